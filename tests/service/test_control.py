"""status / pin / unpin / reload through the CLI, against a running daemon subprocess."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support.fake_engine import unreachable
from vllm_reloader.cli import main
from vllm_reloader.service import control
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
    found = [daemon.events("reload.started", version=v)[0] for v in ("step-2", "step-1", "step-3")]
    assert ["detect_ms" in started for started in found] == [True, False, False], (
        "a pin, and an unpin, load what was found long before: no detection time"
    )


def test_control_pin_unknown_version_is_a_one_line_error(service):
    start, _engine, notify, config, _root = service
    daemon = start()
    notify.wait_for("READY=1")
    result = cli("pin", "step-404", "--config", str(config))
    assert result.returncode == 1
    assert result.stderr.strip().endswith("no checkpoint named 'step-404' in " + str(config.parent / "root"))
    assert daemon.stop() == 0


def test_control_pin_of_a_rejected_version_says_why_unless_forced(service, make_checkpoint):
    start, engine, notify, config, root = service
    daemon = start()
    notify.wait_for("READY=1")
    make_checkpoint("step-2", step=2, root=root, shapes={"lm_head.weight": (3, 3)})
    daemon.wait_for("checkpoint.rejected", name="step-2")
    reason = status(config)["rejected"]["step-2"]["reason"]

    refused = cli("pin", "step-2", "--config", str(config))
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    assert f"step-2 was rejected: {reason}; `pin --force` tries it again" in refused.stderr
    assert status(config)["pinned"] is None

    assert cli("pin", "step-2", "--force", "--config", str(config)).returncode == 0
    assert daemon.wait_for("control.pinned", name="step-2")["forced"] is True
    wait_until(lambda: len(daemon.events("checkpoint.rejected", name="step-2")) == 2)  # judged again
    answer = status(config)
    assert answer["pinned"] == "step-2" and answer["pinned_rejected"] == reason
    assert engine.version == "step-1"
    human = cli("status", "--config", str(config)).stdout
    assert f"pinned    step-2  REJECTED: {reason}; not loaded" in human
    assert daemon.stop() == 0


def test_control_status_says_why_the_engine_does_not_answer(service):
    start, engine, _notify, config, _root = service
    engine.fail["/weight_info"] = unreachable()
    daemon = start()
    daemon.wait_for("engine.starting")
    answer = status(config)
    assert answer["engine"]["reachable"] is False
    assert answer["engine"]["last_error"].startswith("/weight_info: ")
    assert answer["engines"][0]["last_error"] == answer["engine"]["last_error"]
    human = cli("status", "--config", str(config)).stdout
    assert f"UNREACHABLE: {answer['engine']['last_error']} (retry in " in human
    del engine.fail["/weight_info"]
    daemon.wait_for("engine.reconciled")
    wait_until(lambda: status(config)["engine"]["last_error"] is None)
    assert daemon.stop() == 0


def _control_config(tmp_path: Path) -> Path:
    config = tmp_path / "c.toml"
    config.write_text(
        f'[source]\npath = "{tmp_path}"\n[engine]\nurl = "http://127.0.0.1:9"\n[state]\ndir = "{tmp_path}"\n'
    )
    return config


def test_control_without_daemon_says_what_to_check(tmp_path):
    result = cli("status", "--config", str(_control_config(tmp_path)))
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"vllm-reloader: cannot reach the daemon at {tmp_path / 'control.sock'}: No such file or "
        "directory (is vllm-reloader running with this --config?)"
    )


def test_control_with_a_socket_left_by_a_dead_daemon_says_none_runs(tmp_path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as left:
        left.bind(str(tmp_path / "control.sock"))  # bound, never listened on: refused
        result = cli("pin", "step-1", "--config", str(_control_config(tmp_path)))
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert "Connection refused (is vllm-reloader running with this --config?)" in result.stderr


def test_control_socket_the_user_may_not_open_says_to_join_the_group(tmp_path, monkeypatch, capsys):
    """Tests run as root, which no file mode stops: the refusal is the kernel's answer, planted."""

    def refused(_sock: socket.socket, _address: str) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(socket.socket, "connect", refused)
    assert main(["status", "--config", str(_control_config(tmp_path))]) == 1
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "Permission denied" in said
    assert "(is your user in the daemon's group? the socket is mode 0660)" in said


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


def test_control_status_view_names_the_rollback_target_as_a_target():
    """Serving step-2 with step-2 as the target: "rollback step-2" read as a rollback done."""
    answer = {
        "serving": {"version": "step-2", "path": "/r/step-2", "since": time.time()},
        "engine": {"url": "http://e", "reachable": True},
        "rollback": "step-2",
    }
    assert "rollback  to step-2 if a reload fails" in render_status(answer).splitlines()
    lines = render_status({**answer, "rollback": None}).splitlines()
    assert "rollback  NONE: a failed reload has no intact good checkpoint to go back to" in lines


# -- the server on its own: timeouts, a bound on clients, answered or not applied ------------


def _server(tmp_path: Path, enqueue) -> control.ControlServer:  # type: ignore[no-untyped-def]
    server = control.ControlServer(tmp_path / "c.sock", enqueue)
    server.start()
    return server


def test_control_request_not_answered_in_time_is_never_applied(tmp_path, monkeypatch):
    monkeypatch.setattr(control, "ANSWER_TIMEOUT", 0.2)
    queued: list[tuple[dict, control.Reply]] = []
    server = _server(tmp_path, lambda request, reply: queued.append((request, reply)))
    try:
        answer = control.call(tmp_path / "c.sock", "pin", version="step-1")
        assert answer == {"ok": False, "error": "the daemon did not answer in time; nothing was applied"}
        ((_request, reply),) = queued
        assert not reply.claim(), "the loop, busy until now, must not apply it"
    finally:
        server.close()


def test_control_request_claimed_by_the_loop_is_answered_with_its_outcome(tmp_path, monkeypatch):
    monkeypatch.setattr(control, "ANSWER_TIMEOUT", 0.3)

    def slow_loop(request: dict, reply: control.Reply) -> None:
        def act() -> None:
            assert reply.claim()
            time.sleep(0.5)  # past the client's wait: it is applied, so it must be answered
            reply.put({"ok": True, "applied": request["command"]})

        threading.Thread(target=act, daemon=True).start()

    server = _server(tmp_path, slow_loop)
    try:
        assert control.call(tmp_path / "c.sock", "unpin") == {"ok": True, "applied": "unpin"}
    finally:
        server.close()


def test_control_client_that_says_nothing_is_let_go(tmp_path, monkeypatch):
    monkeypatch.setattr(control, "READ_TIMEOUT", 0.2)
    server = _server(tmp_path, lambda request, reply: reply.put({"ok": True}))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            silent.connect(str(tmp_path / "c.sock"))
            silent.settimeout(5)
            assert silent.recv(100) == b"", "closed by the server after its read timeout"
        assert control.call(tmp_path / "c.sock", "status") == {"ok": True}
    finally:
        server.close()


def test_control_clients_past_the_bound_are_told_the_daemon_is_busy(tmp_path, monkeypatch):
    monkeypatch.setattr(control, "MAX_CLIENTS", 2)
    server = _server(tmp_path, lambda request, reply: reply.put({"ok": True}))
    silent = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
    try:
        for sock in silent:
            sock.connect(str(tmp_path / "c.sock"))
        time.sleep(0.2)
        answer = control.call(tmp_path / "c.sock", "status")
        assert answer["ok"] is False and "busy" in answer["error"]
    finally:
        for sock in silent:
            sock.close()
    time.sleep(0.2)
    try:
        assert control.call(tmp_path / "c.sock", "status") == {"ok": True}, "slots come back"
    finally:
        server.close()
