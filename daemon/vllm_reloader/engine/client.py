"""Talking to one vLLM engine over its dev-mode HTTP API (`VLLM_SERVER_DEV_MODE=1`).

`EngineClient` is the thin edge: one method per endpoint, httpx errors translated into
`EngineUnavailable` / `EngineCallFailed` where they enter. The reload sequence that uses
it is `swap.hot_swap`.
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx

from ..config import EngineConfig
from ..errors import EngineCallFailed, EngineError, EngineUnavailable
from .capabilities import ADAPTER_ROUTES, OPTIONAL_ROUTES, REQUIRED_ROUTES, Capabilities
from .loads import load_report
from .serverinfo import ServerConfig, lora_of, nnodes_of, reload_mode_of, str_or_none

RELOADING_PREFIX = "reloading:"
EXTENSION = "vllm_reloader.extension.ReloadExtension"
"""The worker extension (`--worker-extension-cls`) whose faster reload the daemon uses when present."""
EXTENSION_METHOD = "reloader_load_checkpoint"
STAGED_METHOD = "reloader_staged"
BUILTIN_LOADER_RISK = (
    "the engine runs without the worker extension: vLLM reads the files by path and maps them, "
    "so a writer truncating a shard while it loads can still kill the engine"
)
BUILTIN_LOADER_FIX = f"start vLLM with --worker-extension-cls {EXTENSION}"
STARTUP_VERSION = "default"
"""What vLLM reports as weight version before anyone set one."""


TOP_LOGPROBS = 5
"""The canary asks for the 5 most likely tokens at each step: a flat distribution there
(every token exactly equally likely) means weights that blew up, even when every logprob is finite."""


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        *,
        url: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """`url`: one of `config.urls` (default the first)."""
        self.config = config
        self.url = url or config.url
        key = config.api_key.get_secret_value() if config.api_key else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(
            base_url=self.url,
            timeout=config.timeout,
            transport=transport,
            headers=headers,
            # A connection of its own for every call, so `Deadline` can end it (calls are few).
            limits=httpx.Limits(max_keepalive_connections=0),
        )
        self._load_tracked: bool | None = None
        """Whether the engine counts its HTTP requests (`--enable-server-load-tracking`): asked once."""

    def close(self) -> None:
        self._http.close()

    def _exchange(self, method: str, path: str, limit: float, **kwargs: Any) -> httpx.Response:
        """One request and its whole answer within `limit` seconds, or `EngineUnavailable`."""
        with Deadline(limit) as deadline:
            try:
                response = self._http.request(
                    method, path, timeout=limit, extensions={"trace": deadline.trace}, **kwargs
                )
            except httpx.TimeoutException as exc:
                raise EngineUnavailable(f"{path}: timed out", endpoint=path) from exc
            except httpx.TransportError as exc:
                if deadline.expired:
                    raise EngineUnavailable(
                        f"{path}: no whole answer within {limit:g} s", endpoint=path
                    ) from exc
                raise EngineUnavailable(f"{path}: {exc or type(exc).__name__}", endpoint=path) from exc
            except httpx.HTTPError as exc:  # an answer httpx cannot decode
                raise EngineCallFailed(f"{path}: {exc or type(exc).__name__}", endpoint=path) from exc
        if deadline.expired:  # an answer that ends when its connection does was cut short
            raise EngineUnavailable(f"{path}: no whole answer within {limit:g} s", endpoint=path)
        return response

    def _answered(
        self, method: str, path: str, *, timeout: float | None = None, **kwargs: Any
    ) -> httpx.Response:
        response = self._exchange(method, path, timeout or self.config.timeout, **kwargs)
        if response.status_code >= 400:
            detail = _error_text(response, 4096)  # parsed once; the message keeps 300 characters
            raise EngineCallFailed(
                f"{path}: HTTP {response.status_code}: {detail[:300]}",
                endpoint=path,
                status=response.status_code,
                detail=detail,
            )
        return response

    def _call(self, method: str, path: str, *, timeout: float | None = None, **kwargs: Any) -> Any:
        response = self._answered(method, path, timeout=timeout, **kwargs)
        if not response.content:
            return None
        try:
            return response.json()
        except (ValueError, RecursionError) as exc:  # not JSON, or nested past what parses
            raise EngineCallFailed(f"{path}: answer is not JSON", endpoint=path) from exc

    def weight_version(self) -> str:
        body = self._call("GET", "/weight_info")
        if not isinstance(body, dict) or not isinstance(body.get("weight_version"), str):
            raise EngineCallFailed("/weight_info: no weight_version in answer", endpoint="/weight_info")
        return str(body["weight_version"])

    def server_config(self) -> ServerConfig:
        """What `/server_info` says of how the engine was started."""
        body = self._call("GET", "/server_info", params={"config_format": "json"})
        try:
            config = body["vllm_config"]
            model = str(config["model_config"]["model"])
        except (KeyError, TypeError) as exc:
            raise EngineCallFailed("/server_info: no model path in answer", endpoint="/server_info") from exc
        return ServerConfig(
            model=model,
            sleep_mode=bool(config["model_config"].get("enable_sleep_mode")),
            extension=(config.get("parallel_config") or {}).get("worker_extension_cls") == EXTENSION,
            revision=str_or_none(config["model_config"].get("revision")),
            reload_mode=reload_mode_of(body.get("vllm_env")),
            lora=lora_of(config.get("lora_config", ())),
            nnodes=nnodes_of(config.get("parallel_config")),
        )

    def capabilities(self) -> Capabilities:
        """The engine's release and which of the routes the daemon drives it has."""
        version = self._optional("/version")
        spec = self._optional("/openapi.json")
        if isinstance(spec, dict) and isinstance(spec.get("paths"), dict):
            known = (*REQUIRED_ROUTES, *OPTIONAL_ROUTES, *ADAPTER_ROUTES)
            routes = frozenset(r for r in known if r in spec["paths"])
            dev_mode = "/is_paused" in routes
        else:  # --disable-fastapi-docs: no spec; a harmless dev-only GET tells whether dev mode is on
            routes, dev_mode = None, self._optional("/is_paused") is not None
        release = version.get("version") if isinstance(version, dict) else None
        return Capabilities(str(release) if release is not None else None, routes, dev_mode)

    def _optional(self, path: str) -> Any:
        """A GET whose 404 means "not there" (None) rather than a failure."""
        try:
            return self._call("GET", path)
        except EngineCallFailed as exc:
            if exc.status == 404:
                return None
            raise

    def sleep(self, level: int, mode: str) -> None:
        """`mode` matters: /sleep aborts in-flight requests unless told to keep them."""
        self._call("POST", "/sleep", params={"level": level, "mode": mode}, timeout=self.config.pause_timeout)

    def wake_up(self, tags: tuple[str, ...] = ()) -> None:
        self._call("POST", "/wake_up", params=[("tags", t) for t in tags], timeout=self.config.reload_timeout)

    def requests_in_flight(self) -> int | None:
        """Requests the engine holds: running + waiting in its scheduler (`/metrics`), or, with
        `--enable-server-load-tracking`, those its HTTP handlers hold (`/load`) when more (one
        still being read or tokenized is not in the scheduler yet); None if unknown."""
        scheduled, handled = self._scheduled(), self._handled()
        known = [n for n in (scheduled, handled) if n is not None]
        return max(known) if known else None

    def _handled(self) -> int | None:
        if self._load_tracked is False:
            return None
        try:
            body = self._call("GET", "/load")
        except EngineCallFailed:  # it answered without a count: not tracked (asked once)
            body = None
        except EngineUnavailable:
            return None
        load = body.get("server_load") if isinstance(body, dict) else None
        self._load_tracked = isinstance(load, int) and not isinstance(load, bool) and load >= 0
        return load if self._load_tracked else None

    def _scheduled(self) -> int | None:
        try:
            response = self._exchange("GET", "/metrics", self.config.timeout)
        except (EngineUnavailable, EngineCallFailed):
            return None
        total, found = 0.0, False
        for line in response.text.splitlines():
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                try:
                    total += float(line.rsplit(" ", 1)[1])
                    found = True
                except (IndexError, ValueError):
                    continue
        usable = found and response.status_code == 200 and math.isfinite(total) and total >= 0
        return int(total) if usable else None

    def is_paused(self) -> bool:
        body = self._call("GET", "/is_paused")
        return bool(body.get("is_paused")) if isinstance(body, dict) else False

    def pause(self, mode: str) -> None:
        self._call("POST", "/pause", params={"mode": mode}, timeout=self.config.pause_timeout)

    def resume(self) -> None:
        self._call("POST", "/resume")

    def reload_weights(
        self,
        path: str,
        *,
        extension: bool = False,
        files: Mapping[str, Sequence[int]] | None = None,
        staged: str | None = None,
    ) -> dict[str, Any] | None:
        """vLLM's own `reload_weights`, or the extension's, which reads only the files the
        gate verified (`files`: their identities; `staged`: each node's own, as its daemon
        verified this content) and answers with what the load took (bytes, seconds, device
        memory), from the first worker."""
        if extension:
            method = EXTENSION_METHOD
            kwargs: dict[str, Any] = {"path": path}
            if files is not None:
                kwargs["files"] = {name: list(found) for name, found in files.items()}
            kwargs.update({"staged": staged} if staged is not None else {})
        else:
            method, kwargs = "reload_weights", {"weights_path": path}
        results = self.collective_rpc(method, kwargs, timeout=self.config.reload_timeout)
        if not extension:
            return None
        return load_report(results)

    def staged(self, path: str, fingerprint: str) -> list[Any]:
        """Every rank's word on its node's copy at `path` (`ReloadExtension.reloader_staged`)."""
        asked = {"path": path, "fingerprint": fingerprint}
        return self.collective_rpc(STAGED_METHOD, asked, timeout=self.config.timeout)

    def collective_rpc(self, method: str, kwargs: dict[str, Any], *, timeout: float) -> list[Any]:
        """`method` on every worker: each one's answer, in rank order."""
        body = self._call(
            "POST",
            "/collective_rpc",
            json={"method": method, "kwargs": kwargs},
            timeout=timeout,
            # vLLM's route drops the connection after a worker error; a pooled one would make
            # the restore that follows fail on a dead socket. One connection per call.
            headers={"Connection": "close"},
        )
        results = body.get("results") if isinstance(body, dict) else None
        if not isinstance(results, list) or not results:
            raise EngineCallFailed(
                "/collective_rpc: no per-worker results in the answer", endpoint="/collective_rpc"
            )
        return results

    def tokens(self, prompt: str) -> list[int] | None:
        """`prompt` as the engine's tokenizer splits it; None where it does not say."""
        try:
            body = self._call("POST", "/tokenize", json={"prompt": prompt})
        except EngineError:
            return None
        found = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(found, list) or any(type(t) is not int for t in found):
            return None
        return found

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix: its KV was computed with the weights just replaced.

        Requests kept through the pause still hold KV blocks, and vLLM refuses to reset while
        any block is held (`{"success": false}`), so they are preempted too
        (`reset_running_requests`): they resume by recomputing on the new weights, none fails.
        A refusal all the same is a failed step, never ignored."""
        body = self._call("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineCallFailed(
                "/reset_prefix_cache: the engine could not reset its prefix cache (success: false)",
                endpoint="/reset_prefix_cache",
            )

    def load_adapter(self, name: str, path: str) -> None:
        """A LoRA adapter loaded under `name`, or replaced in place. Each version from its own
        `path`: vLLM keys its prefix cache by name and path, not by the bytes."""
        self._answered(
            "POST",
            "/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": path, "load_inplace": True},
            timeout=self.config.reload_timeout,
        )

    def unload_adapter(self, name: str) -> None:
        self._answered("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters loaded, by name: the path each was loaded from."""
        body = self._call("GET", "/v1/models")
        found = body.get("data") if isinstance(body, dict) else None
        models = [m for m in found if isinstance(m, dict)] if isinstance(found, list) else []
        return {str(m["id"]): str(m.get("root")) for m in models if "id" in m and m.get("parent") is not None}

    def set_weight_version(self, version: str) -> None:
        self._call("POST", "/update_weight_version", json={"new_version": version})

    def token_logprobs(
        self, prompt: str, *, max_tokens: int, timeout: float, model: str | None = None
    ) -> tuple[list[float | None], list[list[float]]]:
        """A greedy completion of `prompt` (by `model`: an adapter's name; None: the base): the
        logprob of each generated token, and at each step the `TOP_LOGPROBS` most likely tokens'."""
        body = self._call(
            "POST",
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": TOP_LOGPROBS,
                  **({"model": model} if model else {})},
            timeout=timeout,
        )  # fmt: skip
        try:
            logprobs = body["choices"][0]["logprobs"]
            values = [None if v is None else float(v) for v in logprobs["token_logprobs"]]
        except (KeyError, IndexError, TypeError, ValueError, OverflowError) as exc:  # a 400-digit number too
            raise EngineCallFailed(
                "/v1/completions: no token_logprobs in answer", endpoint="/v1/completions"
            ) from exc
        try:
            top = [[float(v) for v in step.values()] for step in logprobs.get("top_logprobs") or ()]
        except (AttributeError, TypeError, ValueError, OverflowError):
            top = []
        return values, top


class Deadline:
    """Ends an exchange still running after `seconds`, however slowly its bytes trickle in:
    httpx's timeouts bound each read, not the call, so an engine answering a byte a second
    would hold the caller for as long as it likes. At the deadline the call's socket is shut
    down, which ends the read blocked on it (every call has a connection of its own)."""

    CONNECTED = (
        "connection.connect_tcp.complete",
        "connection.connect_unix_socket.complete",
        "connection.start_tls.complete",  # TLS wraps the socket anew: the one to shut is that one
        "proxy.start_tls.complete",
    )

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> Deadline:
        self._timer.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._timer.cancel()

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's trace hook: learns the socket once connected."""
        if event not in self.CONNECTED or info.get("return_value") is None:
            return
        with self._lock:
            self._socket = info["return_value"].get_extra_info("socket")
            if self.expired:
                self._shut()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            self._shut()

    def _shut(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(OSError):  # closed already: the exchange ended as it came
                # The plain socket's shutdown, also under TLS (`SSLSocket.shutdown` would drop
                # the TLS state under a reader between two reads, as an unmapped ValueError).
                socket.socket.shutdown(self._socket, socket.SHUT_RDWR)


def _error_text(response: httpx.Response, limit: int) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[: min(limit, 200)]
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        if isinstance(error, dict):
            error = error.get("message", error)
        return str(error)[:limit]
    return str(body)[:limit]
