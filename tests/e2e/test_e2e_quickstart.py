"""The README's operator quick start, as written: its CPU engine command, its minimal config,
`run`, an HF checkpoint copied into the root without a manifest, `status`.

The commands are read from README.md, so the README cannot drift from what works."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.engine_fixtures import ENGINE_START_TIMEOUT, DaemonProcess, _tail
from vllm_reloader.tools.demo import free_port, stop_process

pytestmark = pytest.mark.engine

README = Path(__file__).parents[2] / "README.md"


def fenced_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def cpu_engine_command() -> str:
    """The quick start's CPU engine command, its continuation lines joined."""
    (block,) = [b for b in fenced_blocks("sh") if "vllm.entrypoints.openai.api_server" in b]
    return block.replace("\\\n", " ").strip()


def minimal_config() -> str:
    (block,) = [b for b in fenced_blocks("toml") if "[source]" in b and "[state]" in b]
    return block


def test_readme_quick_start_serves_an_hf_checkpoint_copied_into_the_root(tmp_path: Path):
    from vllm_reloader.tools.tinymodel import write_checkpoint

    base = write_checkpoint(tmp_path / "models" / "base", seed=1)
    trained = write_checkpoint(tmp_path / "trainer" / "checkpoint-2", seed=2)  # save_pretrained
    root, state_dir, port = tmp_path / "srv" / "checkpoints", tmp_path / "state", free_port()
    command = cpu_engine_command().replace("/models/base", str(base)).replace("--port 8000", f"--port {port}")
    assert command.startswith("VLLM_SERVER_DEV_MODE=1 ") and " python -m " in command, command
    command = command.replace(" python -m ", f" {shlex.quote(sys.executable)} -m ", 1)
    log_path = tmp_path / "engine.log"
    with log_path.open("wb") as log:
        engine = subprocess.Popen(
            ["bash", "-c", command], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    daemon = None
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        deadline = time.monotonic() + ENGINE_START_TIMEOUT
        while not _healthy(http):
            assert engine.poll() is None, f"the README's engine command exited:\n{_tail(log_path)}"
            assert time.monotonic() < deadline, f"not healthy in time:\n{_tail(log_path)}"
            time.sleep(0.5)
        config_text = (
            minimal_config()
            .replace("/srv/checkpoints", str(root))
            .replace("/var/lib/vllm-reloader", str(state_dir))
            .replace("http://127.0.0.1:8000", f"http://127.0.0.1:{port}")
        )
        root.mkdir(parents=True)  # "Create both directories"
        state_dir.mkdir()
        config_path = tmp_path / "reloader.toml"
        config_path.write_text(config_text)
        daemon = DaemonProcess(config_path, env={"VLLM_API_KEY": ""})
        daemon.wait_for("engine.reconciled", timeout=120)
        subprocess.run(["cp", "-r", str(trained), str(root)], check=True)  # no manifest
        done = daemon.wait_for("reload.succeeded", timeout=180, version="checkpoint-2")
        assert done["duration_ms"]
        assert http.get("/weight_info").json()["weight_version"] == "checkpoint-2"
        status = subprocess.run(
            [str(Path(sys.executable).parent / "vllm-reloader"), "status", "--config", str(config_path)],
            capture_output=True, text=True, timeout=60, env={**os.environ, "VLLM_API_KEY": ""},
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        assert re.search(r"^serving\s+checkpoint-2\b", status.stdout, flags=re.M), status.stdout
    finally:
        if daemon is not None:
            assert daemon.stop() == 0
        http.close()
        stop_process(engine)


def _healthy(http: httpx.Client) -> bool:
    try:
        return http.get("/health").status_code == 200
    except httpx.TransportError:
        return False
