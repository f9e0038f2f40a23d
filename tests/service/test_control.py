"""status / pin / unpin / reload through the CLI, against a running daemon subprocess."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from vllm_reloader.service.status import render as render_status


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vllm_reloader", *args], capture_output=True, text=True, timeout=60
    )


def wait_until(check, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def status(config: Path) -> dict:
    result = cli("status", "--config", str(config), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_control_status_pin_unpin_reload(service, make_checkpoint):
    start, engine, notify, config, root = service
    daemon = start()
    notify.wait_for("READY=1")
    make_checkpoint("step-2", step=2, root=root)
    daemon.wait_for("reload.succeeded", version="step-2")

    socket_path = Path(str(config).replace("daemon.toml", "s")) / "control.sock"
    assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o660

    answer = status(config)
    assert answer["serving"]["version"] == "step-2"
    assert answer["engine"]["reachable"] is True
    assert answer["last_reload"]["version"] == "step-2"
    human = cli("status", "--config", str(config))
    assert human.returncode == 0 and "serving   step-2" in human.stdout and "reachable" in human.stdout

    assert cli("pin", "step-1", "--config", str(config)).returncode == 0
    wait_until(lambda: engine.version == "step-1")
    make_checkpoint("step-3", step=3, root=root)
    assert cli("reload", "--config", str(config)).returncode == 0
    time.sleep(0.5)
    assert engine.version == "step-1", "pinned: no auto-advance"
    assert status(config)["pinned"] == "step-1"

    assert cli("unpin", "--config", str(config)).returncode == 0
    wait_until(lambda: engine.version == "step-3")
    assert status(config)["pinned"] is None
    assert daemon.stop() == 0


def test_control_pin_unknown_version_is_a_one_line_error(service):
    start, _engine, notify, config, _root = service
    daemon = start()
    notify.wait_for("READY=1")
    result = cli("pin", "step-404", "--config", str(config))
    assert result.returncode == 1
    assert result.stderr.strip().endswith("no checkpoint named 'step-404' in " + str(config.parent / "root"))
    assert daemon.stop() == 0


def test_control_without_daemon_says_so(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(
        f'[source]\npath = "{tmp_path}"\n[engine]\nurl = "http://127.0.0.1:9"\n[state]\ndir = "{tmp_path}"\n'
    )
    result = cli("status", "--config", str(config))
    assert result.returncode == 1
    assert "cannot reach the daemon" in result.stderr and "Traceback" not in result.stderr


def test_control_status_view_lists_reasons():
    text = render_status(
        {
            "serving": {"version": "step-2", "path": "/r/step-2", "since": time.time() - 75},
            "engine": {"url": "http://127.0.0.1:8000", "reachable": False},
            "pending": {"step-3": "model.safetensors has 10 of 20 bytes"},
            "rejected": {"step-9": {"reason": "tensor x is F32[2], serving has F32[3]"}},
            "last_reload": {"version": "step-2", "duration_ms": 812.0, "at": time.time() - 75},
        }
    )
    assert "UNREACHABLE" in text
    assert "  step-3: model.safetensors has 10 of 20 bytes" in text
    assert "  step-9: tensor x is F32[2], serving has F32[3]" in text
    assert "step-2 in 812 ms, 1m15s ago" in text
