"""A scripted stand-in for the vLLM dev API, for injecting faults the real engine won't
produce on demand. The real engine is what proves the whole works (test_e2e.py)."""

from __future__ import annotations

import json
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
from safetensors.numpy import load_file

from vllm_reloader.checkpoint.files import changed
from vllm_reloader.checkpoint.staged import staged_problem
from vllm_reloader.config import EngineConfig
from vllm_reloader.engine.client import EXTENSION, EXTENSION_METHOD, STAGED_METHOD, EngineClient

REFUSED = (
    "RuntimeError: Updating weights layer by layer needs about 3.10 GiB of free device memory, at "
    "least 1.55 GiB for the largest layer alone, but only 0.80 GiB is free beside the extensible KV cache."
)
"""vLLM 0.34's KV-cache loan refusing a reload (vllm/v1/worker/extensible_kv_cache.py)."""


class FakeEngine:
    def __init__(self, startup: str = "/models/startup") -> None:
        self.calls: list[str] = []
        self.version = "default"
        self.startup = startup
        self.loaded = startup
        self.paused = False
        self.sleep_mode = False
        self.pause_modes: list[str] = []
        self.server_load: int | None = None
        """Requests its HTTP handlers hold (`/load`); None: not tracked."""
        self.extension = False
        """Started with the worker extension: `/server_info` names it, its method answers."""
        self.methods: list[str] = []
        """The collective_rpc methods called, in order."""
        self.asleep: set[str] = set()
        """What is asleep: "weights", "kv_cache"."""
        self.garbage: set[str] = set()
        """Checkpoint paths whose weights answer with NaN logprobs (a diverged run)."""
        self.probe_broken: set[str] = set()
        """Checkpoint paths whose forward pass in the extension's probe gives non-finite logits
        (`garbage` alone passes it: answers wrong only when sampled, as the canary sees)."""
        self.probe_answers: list[object] | None = None
        """What each rank answers the probe (None: a finite, unflat forward pass on every rank,
        unless what is loaded is `probe_broken`)."""
        self.probes: list[dict[str, object]] = []
        """The probe's kwargs, each time, and whether the engine was paused then."""
        self.device = "cpu"
        """Where its weights are, as its probe reports (`cuda`: an accelerator)."""
        self.fail: dict[str, Callable[[], httpx.Response]] = {}
        """endpoint (or 'reload:<path>') -> response factory, or raise inside it."""
        self.during_load: Callable[[str], None] | None = None
        """Runs while a checkpoint is being loaded (a writer acting mid-load)."""
        self.read_bytes = False
        """Read the shards of what is loaded, as a loader would: `held` says what was read."""
        self.held: dict[str, bytes] = {}
        """With `read_bytes`: each top-level shard's bytes as the load read them."""
        self.release: str | None = None
        """What `/version` answers; None: no such route (404)."""
        self.routes: set[str] | None = None
        """The paths `/openapi.json` lists; None: docs off (404)."""
        self.dev_mode = True
        """False: every dev route answers 404, as vLLM without VLLM_SERVER_DEV_MODE=1."""
        self.revision: str | None = None
        """`--revision`, as `/server_info` reports it."""
        self.reload_mode: str | None = None
        """`VLLM_RELOAD_MODE` in `/server_info`'s `vllm_env` (0.34+); None: not there."""
        self.lora_config: object = ()
        """`/server_info`'s `lora_config` (None: LoRA off; `()`: no such key)."""
        self.running = 0
        """Requests holding KV blocks: vLLM refuses to reset the prefix cache while any does,
        unless told to preempt them (`reset_running_requests`)."""
        self.preempted = 0
        self.ranks = 1
        """Workers answering each collective_rpc (tensor parallelism)."""
        self.rank_fails: int | None = None
        """With the extension: this rank answers without a load report (for the next load only)."""
        self.cache_reset_refused = False
        """Answer `{"success": false}` to every reset (blocks held by a KV transfer)."""
        self.requests_running, self.requests_waiting = 3, 2
        """What `/metrics` reports as in flight."""
        self.loras: dict[str, str] = {}
        """LoRA adapters loaded at run time: name → the path each was loaded from."""
        self.lora_refused: set[str] = set()
        """Adapter paths whose load the engine refuses (an error answer, nothing loaded)."""
        self.during_lora: Callable[[str], None] | None = None
        """Runs while an adapter is being loaded (what the test sees mid-swap)."""
        self.during_completion: Callable[[str | None], None] | None = None
        """Runs as a completion is asked of a model (None: the base), before it answers."""
        self.other_nodes: dict[str, tuple[Path, Path]] = {}
        """A multi-node engine: each other node's host → (the leader's cache, that node's): a path
        under the first is read under the second there, as a rank on that node would."""
        self.nnodes = 1
        """`--nnodes`, as `/server_info`'s parallel_config says."""
        self.staged_asks: list[str] = []
        """The paths every rank was asked about (`reloader_staged`), in order."""
        self.on_staged_ask: Callable[[list[dict[str, object]]], None] | None = None
        """Runs after each `reloader_staged`, with the ranks' answers (a hand at a node's copy)."""
        self.staged_loads: list[tuple[str, str]] = []
        """(path, fingerprint) of each load that read each node's own verified copy."""

    def _staged(self, path: str, fingerprint: str) -> list[dict[str, object]]:
        """What each node's rank answers (one rank a node): the leader's node reads `path`."""
        places = [("leader", Path(path))]
        for host, (mine, theirs) in self.other_nodes.items():
            places.append((host, theirs / Path(path).relative_to(mine)))
        answers: list[dict[str, object]] = []
        for rank, (host, where) in enumerate(places):
            staged, problem = staged_problem(where, fingerprint)
            answers.append(
                {
                    "rank": rank,
                    "node_rank": rank,
                    "host": host,
                    "staged_by": staged and staged.node,
                    "problem": problem,
                }
            )
        return answers

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        key = path
        if path == "/collective_rpc":
            self.methods.append(body["method"])
            first = next(iter(body["kwargs"].values()))
            key = "probe" if body["method"] == "reloader_probe" else f"reload:{first}"
        self.calls.append(key if path == "/collective_rpc" else path)
        if key in self.fail:
            return self.fail[key]()
        if path == "/version" and self.release is not None:
            return httpx.Response(200, json={"version": self.release})
        if path == "/openapi.json" and self.routes is not None:
            return httpx.Response(200, json={"paths": {route: {} for route in self.routes}})
        if not self.dev_mode and path not in ("/v1/completions", "/metrics"):
            return httpx.Response(404, json={"detail": "Not Found"})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.version})
        if path == "/server_info":
            model_config = {"model": self.startup, "revision": self.revision}
            model_config["enable_sleep_mode"] = self.sleep_mode
            parallel_config = {
                "worker_extension_cls": EXTENSION if self.extension else "",
                "nnodes": self.nnodes,
            }
            config = {"model_config": model_config, "parallel_config": parallel_config}
            if self.lora_config != ():
                config["lora_config"] = self.lora_config
            env = {} if self.reload_mode is None else {"VLLM_RELOAD_MODE": self.reload_mode}
            return httpx.Response(200, json={"vllm_config": config, "vllm_env": env})
        if path == "/sleep":
            self.asleep = {"weights", "kv_cache"}
            self.calls[-1] = f"/sleep?level={request.url.params['level']}&mode={request.url.params['mode']}"
            return httpx.Response(200, json={"status": "sleeping"})
        if path == "/wake_up":
            tags = request.url.params.get_list("tags") or ["weights", "kv_cache"]
            self.asleep -= set(tags)
            self.calls[-1] = f"/wake_up?tags={','.join(tags)}"
            return httpx.Response(200, json={"status": "awake"})
        if path == "/pause":
            self.paused = True
            self.pause_modes.append(request.url.params.get("mode", ""))
            return httpx.Response(200, json={"status": "paused"})
        if path == "/resume":
            self.paused = False
            return httpx.Response(200, json={"status": "resumed"})
        if path == "/is_paused":
            return httpx.Response(200, json={"is_paused": self.paused})
        if path == "/collective_rpc":
            if "weights" in self.asleep:
                return httpx.Response(500, json={"error": {"message": "weights are asleep"}})
            if body["method"] == "reloader_probe" and self.extension:
                self.probes.append({**body["kwargs"], "paused": self.paused, "loaded": self.loaded})
                scan = bool(body["kwargs"].get("scan"))
                return httpx.Response(200, json={"results": self._probe_answers(scan)})
            if body["method"] == "reloader_probe_adapter" and self.extension:
                adapter = body["kwargs"]["path"]
                self.probes.append({**body["kwargs"], "paused": self.paused, "adapter": adapter})
                finite = adapter not in self.garbage and adapter not in self.probe_broken
                answer = {"available": True, "logits": True, "finite": finite, "flat": False, "max_abs": 9.5}
                return httpx.Response(200, json={"results": [answer] * self.ranks})
            if body["method"] == STAGED_METHOD and self.extension:
                self.staged_asks.append(body["kwargs"]["path"])
                answers = self._staged(**body["kwargs"])
                if self.on_staged_ask is not None:
                    self.on_staged_ask(answers)
                return httpx.Response(200, json={"results": answers})
            if body["method"] == EXTENSION_METHOD:
                if not self.extension:  # what vLLM answers for a method no worker has
                    return httpx.Response(500, json={"error": {"message": "no attribute"}})
                if (fp := body["kwargs"].get("staged")) is not None:
                    short = [a for a in self._staged(body["kwargs"]["path"], fp) if a["problem"]]
                    if short:  # a rank refuses before reading anything
                        return httpx.Response(500, json={"error": {"message": short[0]["problem"]}})
                    self.staged_loads.append((body["kwargs"]["path"], fp))
                if problem := self._load(body["kwargs"]["path"], body["kwargs"].get("files")):
                    return httpx.Response(500, json={"error": {"message": problem}})
                results: list[object] = [{"loader": "extension", "bytes": 42}] * self.ranks
                if self.rank_fails is not None:
                    results[self.rank_fails], self.rank_fails = None, None
                return httpx.Response(200, json={"results": results})
            if problem := self._load(body["kwargs"]["weights_path"], None):
                return httpx.Response(500, json={"error": {"message": problem}})
            return httpx.Response(200, json={"results": [None] * self.ranks})
        if path == "/reset_prefix_cache":
            if request.url.params.get("reset_running_requests") == "true":
                self.preempted, self.running = self.preempted + self.running, 0
            success = self.running == 0 and not self.cache_reset_refused
            return httpx.Response(200, json={"success": success})
        if path == "/load":  # vLLM without --enable-server-load-tracking fails it (no count kept)
            if self.server_load is None:
                return httpx.Response(500, text="Internal Server Error")
            return httpx.Response(200, json={"server_load": self.server_load})
        if path == "/metrics":
            return httpx.Response(
                200,
                text=f'# HELP x\nvllm:num_requests_running{{model_name="tiny"}} {self.requests_running}.0\n'
                f'vllm:num_requests_waiting{{model_name="tiny"}} {self.requests_waiting}.0\n',
            )
        if path == "/v1/load_lora_adapter":
            if body["lora_path"] in self.lora_refused:
                return httpx.Response(400, json={"error": {"message": "refused"}})
            if self.during_lora is not None:
                self.during_lora(body["lora_path"])
            self.loras[body["lora_name"]] = body["lora_path"]
            return httpx.Response(200, text="Success")
        if path == "/v1/unload_lora_adapter":
            self.loras.pop(body["lora_name"], None)
            return httpx.Response(200, text="Success")
        if path == "/v1/models":
            adapters = [{"id": n, "root": p, "parent": self.startup} for n, p in self.loras.items()]
            return httpx.Response(200, json={"data": [{"id": self.startup, "root": self.startup}, *adapters]})
        if path == "/v1/completions":
            if self.during_completion is not None:
                self.during_completion(body.get("model"))
            weights = self.loras.get(body.get("model") or "", self.loaded)
            value = float("nan") if self.loaded in self.garbage or weights in self.garbage else -0.5
            body = {"choices": [{"logprobs": {"token_logprobs": [value] * 2}}]}  # NaN as Python writes it
            return httpx.Response(
                200, content=json.dumps(body).encode(), headers={"content-type": "application/json"}
            )
        if path == "/tokenize":
            return httpx.Response(200, json={"tokens": [len(word) for word in body["prompt"].split()]})
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return httpx.Response(200, json={"success": True})
        return httpx.Response(404)

    def _probe_answers(self, scan: bool) -> list[object]:
        if self.probe_answers is not None:
            return self.probe_answers
        finite = self.loaded not in self.probe_broken
        answer = {"available": True, "logits": True, "finite": finite, "flat": False, "max_abs": 9.5}
        answer |= {"device": self.device, **(self._scan() if scan else {})}
        return [{**answer, "rank": rank, "entropy": 2.5} for rank in range(self.ranks)]

    def _scan(self) -> dict[str, object]:
        """As the extension's scan: the first loaded tensor holding NaN or Inf, and the bytes read."""
        scanned = 0
        for shard in sorted(Path(self.loaded).glob("*.safetensors")):
            for name, tensor in load_file(shard).items():
                if not np.isfinite(tensor).all():
                    return {"non_finite": name, "scanned_bytes": scanned}
                scanned += tensor.nbytes
        return {"non_finite": None, "scanned_bytes": scanned}

    def _load(self, path: str, files: dict[str, list[int]] | None) -> str | None:
        """Like the extension: refuse files that are not the verified ones, read each shard
        (by path, as vLLM's own loader does), fail if one changed while it was read."""
        directory = Path(path)
        if files is not None and (problem := changed(directory, {k: tuple(v) for k, v in files.items()})):
            return f"not the verified checkpoint: {problem}"
        self.loaded = path
        if self.during_load is not None:
            self.during_load(path)
        if self.read_bytes:
            try:
                shards = sorted(p for p in directory.iterdir() if p.name.endswith(".safetensors"))
                self.held = {p.name: p.read_bytes() for p in shards}
            except OSError as exc:
                return f"cannot read: {exc}"
        if files is not None and (problem := changed(directory, {k: tuple(v) for k, v in files.items()})):
            return f"changed while it was read: {problem}"
        return None

    def client(self, url: str = "http://engine.test", **config: object) -> EngineClient:
        cfg = EngineConfig(url=url, **config)  # type: ignore[arg-type]
        return EngineClient(cfg, transport=httpx.MockTransport(self.handle))


def error(status: int = 500, message: str = "boom") -> Callable[[], httpx.Response]:
    return lambda: httpx.Response(status, json={"error": {"message": message}})


def unreachable() -> Callable[[], httpx.Response]:
    def fail() -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    return fail


class FakeEngineServer:
    """The scripted engine behind a real HTTP socket on 127.0.0.1, for daemon subprocesses."""

    def __init__(self, engine: FakeEngine, tls: ssl.SSLContext | None = None) -> None:
        """`tls`: a server context: the engine answers on https://."""
        import http.server

        fake, server = engine, self
        self.slow: dict[str, float] = {}
        """path -> seconds between the bytes of its answer's body (a hung engine trickling)."""
        self.trickling, self.trickled, self.cut = threading.Event(), threading.Event(), threading.Event()
        """A slow answer began; one was sent whole; one was cut off by the client."""

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                request = httpx.Request(
                    self.command, f"http://engine.test{self.path}", content=self.rfile.read(length)
                )
                response = fake.handle(request)
                self.send_response(response.status_code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(response.content)))
                self.end_headers()
                interval = server.slow.get(self.path.split("?")[0])
                if interval is None:
                    self.wfile.write(response.content)
                    return
                server.trickling.set()
                try:  # a byte at a time: every read is quick, the whole answer is not
                    for byte in response.content:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(interval)
                except OSError:
                    server.cut.set()  # the client gave up before the answer ended
                else:
                    server.trickled.set()

            do_GET = do_POST = _answer

            def log_message(self, *_args: object) -> None:
                pass

        self.engine = engine
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class BadSteps(set[str]):
    """The engine's `garbage`: weights whose manifest has one of these steps answer NaN (the
    scripted engine asks by path; a path's content is what its manifest says)."""

    def __init__(self, steps: set[int]) -> None:
        super().__init__()
        self.steps = steps

    def __contains__(self, path: object) -> bool:
        try:
            manifest = json.loads((Path(str(path)) / "manifest.json").read_text())
        except (OSError, ValueError):
            return False
        return manifest.get("step") in self.steps
