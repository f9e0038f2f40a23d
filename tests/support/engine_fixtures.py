"""Real peers for the end-to-end tests: a CPU vLLM engine and the daemon, as subprocesses.

One engine per test session (it takes ~40 s to start on 2 cores). If it cannot start, the
tests that need it fail with the engine's log tail; they never skip.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import pytest

from vllm_reloader.tools.demo import ENGINE_ENV, engine_command, free_port, stop_process

# bfloat16, as users serve: the tiny model's head_dim (48) keeps vLLM off its AMX bfloat16
# attention kernel, which crashes the worker on this CPU (tools/tinymodel.py).
ENGINE_DTYPE = os.environ.get("VLLM_RELOADER_TEST_DTYPE", "bfloat16")
ENGINE_START_TIMEOUT = float(os.environ.get("VLLM_RELOADER_ENGINE_TIMEOUT", "400"))
PROMPTS = ["w1 w2 w3 w4", "w10 w20 w30", "w100 w7 w42 w9 w3"]
API_KEY = "e2e-key-4f1c"
"""The test engines run with `--api-key` (guarding /v1/*, as many deployments do); the
daemons get it as `VLLM_API_KEY`, so every canary proves the key is sent."""


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class Engine:
    url: str
    startup: Path | str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: BinaryIO
    holds: Path
    """Its VLLM_RELOADER_FAILPOINT_DIR: `<name>.hold` there holds the extension at <name>."""
    api_key: str | None = API_KEY
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.url, timeout=60, headers=self.headers)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self) -> None:
        stop_process(self.process)
        self.http.close()
        self.log_file.close()

    def healthy(self) -> bool:
        try:
            return self.process.poll() is None and self.http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def weight_version(self) -> str:
        return str(self.http.get("/weight_info").json()["weight_version"])

    def is_paused(self) -> bool:
        return bool(self.http.get("/is_paused").json()["is_paused"])

    def complete(self, model: str = "tiny") -> list[str]:
        """Greedy completions of the fixed prompts, one request at a time (batch-invariant);
        `model`: the base model, or a LoRA adapter's name."""
        texts = []
        for prompt in PROMPTS:
            response = self.http.post(
                "/v1/completions",
                json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0},
            )
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
        return texts


def start_engine(
    model: Path | str,
    log_path: Path,
    port: int | None = None,
    *,
    extension: bool = True,
    api_key: str | None = API_KEY,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
    dtype: str = ENGINE_DTYPE,
) -> Engine:
    """A real CPU vLLM engine (`model`: a directory, or a hub id in the cache `env` names), by
    default with the reloader's worker extension and `--api-key`; its failpoint directory (for
    holds) is `<log dir>/failpoints`."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"vLLM is not installed in this environment ({exc}); run the README's test command")
    port = port or free_port()
    holds = log_path.parent / "failpoints"
    holds.mkdir(exist_ok=True)
    env = {**os.environ, **ENGINE_ENV, "VLLM_RELOADER_FAILPOINT_DIR": str(holds), **(env or {})}
    command = [*engine_command(model, port, dtype, extension=extension, api_key=api_key), *args]
    log = log_path.open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    engine = Engine(f"http://127.0.0.1:{port}", model, process, log_path, log, holds, api_key)
    deadline = time.monotonic() + ENGINE_START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            engine.stop()
            pytest.fail(f"vLLM exited with {process.returncode} while starting:\n{_tail(log_path)}")
        if engine.healthy():
            return engine
        time.sleep(0.5)
    engine.stop()
    pytest.fail(f"vLLM did not become healthy in {ENGINE_START_TIMEOUT:.0f} s:\n{_tail(log_path)}")


class DaemonProcess:
    """`vllm-reloader run` as a subprocess, its JSON log lines collected as they come."""

    def __init__(
        self,
        config_path: Path,
        *args: str,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        """`prefix`: what runs it (`nsenter` into a node's mount namespace)."""
        self.lines: list[dict[str, object]] = []
        self.raw: list[str] = []
        self._new: queue.SimpleQueue[None] = queue.SimpleQueue()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_API_KEY": API_KEY, **(env or {})}
        self.process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "vllm_reloader", "run", "--config", str(config_path), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, cwd=cwd,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.raw.append(line)
            if line.startswith("<") and ">" in line[:4]:  # journald priority prefix
                line = line[line.index(">") + 1 :]
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                continue

    def events(self, event: str, /, **fields: object) -> list[dict[str, object]]:
        return [e for e in list(self.lines) if e.get("event") == event and fields.items() <= e.items()]

    def wait_for(
        self, event: str, /, timeout: float = 60.0, reason_has: str = "", **fields: object
    ) -> dict[str, object]:
        """The newest `event` with `fields` (and, given `reason_has`, a reason holding it: the
        lines said before it, while a writer was still at work, do not count)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := [e for e in self.events(event, **fields) if reason_has in str(e.get("reason", ""))]:
                return found[-1]
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        tail = "".join(self.raw[-30:])
        raise AssertionError(f"no {event} {fields} (daemon rc={self.process.poll()}):\n{tail}")

    def stop(self) -> int:
        """SIGTERM (if still running), wait, and close the pipe; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError("daemon ignored SIGTERM for 60 s:\n" + "".join(self.raw[-15:])) from None
        self._reader.join(timeout=10)
        assert self.process.stdout is not None
        self.process.stdout.close()
        return code


def daemon_config(
    path: Path,
    *,
    root: Path,
    engine_url: str | list[str],
    state_dir: Path,
    engine_extra: str = "",
    source_extra: str = "",
) -> Path:
    """`engine_url`: one engine, or a list of several (`urls`); `engine_extra`, `source_extra`:
    more `[engine]`, `[source]` lines.
    The root and the state dir are made here, as an operator would: the daemon never makes them."""
    root.mkdir(parents=True, exist_ok=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    engines = (
        f'url = "{engine_url}"'
        if isinstance(engine_url, str)
        else "urls = [" + ", ".join(f'"{url}"' for url in engine_url) + "]"
    )
    path.write_text(
        f'[source]\npath = "{root}"\npending_recheck_interval = 0.2\n{source_extra}'
        f"[engine]\n{engines}\nretry_initial = 0.2\nretry_max = 2.0\n{engine_extra}"
        f'[state]\ndir = "{state_dir}"\n[log]\nformat = "json"\n'
    )
    return path


def session_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Path, Path]]:
    """Yields (engine, root, staging): engine started on ROOT/step-1 (seed 1), and
    staging/seed-2 and seed-3 holding checkpoints with the same layout, other weights."""
    from vllm_reloader.tools.publish import publish
    from vllm_reloader.tools.tinymodel import write_checkpoint

    base = tmp_path_factory.mktemp("e2e")
    root, staging = base / "root", base / "staging"
    publish(write_checkpoint(staging / "seed-1", seed=1), root, step=1)
    write_checkpoint(staging / "seed-2", seed=2)
    write_checkpoint(staging / "seed-3", seed=3)
    engine = start_engine(root / "step-1", base / "engine.log")
    try:
        yield engine, root, staging
    finally:
        engine.stop()


def exploding(source: Path, staged: Path) -> Path:
    """Finite weights, right shapes, times 1e30: every gate check passes, the forward pass overflows."""
    return rewritten(source, staged, lambda _name, v: v.float() * 1e30)


def rewritten(source: Path, staged: Path, change: Callable[[str, Any], Any]) -> Path:
    """`source`'s checkpoint staged with each tensor replaced by `change(name, tensor)`
    (returned as a float tensor, stored in the tensor's own dtype), its manifest left out."""
    from safetensors.torch import load_file, save_file

    staged.mkdir(parents=True)
    for path in source.iterdir():
        if path.suffix == ".safetensors":
            tensors = load_file(str(path))
            save_file({k: change(k, v).to(v.dtype) for k, v in tensors.items()}, str(staged / path.name))
        elif path.name != "manifest.json":
            (staged / path.name).write_bytes(path.read_bytes())
    return staged
