"""The daemon as systemd runs it: a real subprocess, a real NOTIFY_SOCKET, real signals."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.checkpoints import write_manifest
from tests.support.fake_engine import FakeEngine, unreachable
from vllm_reloader import failpoints
from vllm_reloader.service import state
from vllm_reloader.tools.demo import free_port


def test_service_ready_status_and_watchdog_over_notify_socket(service):
    start, _engine, notify, _config, _root = service
    daemon = start(WATCHDOG_USEC="400000")
    ready = notify.wait_for("READY=1")
    assert any(f.startswith("STATUS=serving step-1 since") for f in ready)
    notify.wait_for("WATCHDOG=1")
    notify.wait_for("WATCHDOG=1")
    assert daemon.stop() == 0


def test_service_extends_start_timeout_until_engine_answers(service):
    start, engine, notify, _config, _root = service
    engine.fail["/weight_info"] = unreachable()
    start()
    notify.wait_for("EXTEND_TIMEOUT_USEC=")
    assert not any("READY=1" in m for m in notify.messages)
    del engine.fail["/weight_info"]
    notify.wait_for("READY=1")


def test_service_sighup_swaps_valid_config_and_keeps_old_on_invalid(service):
    start, _engine, notify, config, _root = service
    daemon = start()
    notify.wait_for("READY=1")
    good = config.read_text()
    config.write_text(good.replace("retry_max = 2.0", "retry_max = 3.0"))
    daemon.process.send_signal(signal.SIGHUP)
    reloading = notify.wait_for("RELOADING=1")
    assert any(f.startswith("MONOTONIC_USEC=") for f in reloading)
    notify.wait_for("READY=1")
    daemon.wait_for("config.reloaded")

    config.write_text(good + "[engine2]\n")
    daemon.process.send_signal(signal.SIGHUP)
    invalid = daemon.wait_for("config.invalid")
    assert "engine2: unknown key" in str(invalid["reason"])
    notify.wait_for("READY=1")
    assert daemon.process.poll() is None
    assert daemon.stop() == 0


def test_service_sighup_with_a_missing_or_blocked_path_keeps_the_old_config_makes_nothing_and_runs_on(
    service, make_checkpoint
):
    """`systemctl reload` with a typo'd `source.path` or `state.dir` (missing, or under a file):
    the old config stays, nothing is made on the host, the daemon runs on. Before, a missing
    one was made, and one under a file closed the old watcher first and exited 2."""
    start, _engine, notify, config, root = service
    daemon = start()
    notify.wait_for("READY=1")
    blocker = root.parent / "a-file"
    blocker.write_text("not a directory")
    good, typo = config.read_text(), root.parent / "typo"
    source, state_dir = f'path = "{root}"', f'dir = "{root.parent / "s"}"'
    missing = "no such directory; create it"
    typos = [
        (good.replace(source, f'path = "{typo / "root"}"'), "source.path", missing),
        (good.replace(state_dir, f'dir = "{typo / "s"}"'), "state.dir", missing),
        (good.replace(source, f'path = "{blocker / "checkpoints"}"'), "source.path", str(blocker)),
    ]
    for count, (text, key, says) in enumerate(typos, 1):
        config.write_text(text)
        daemon.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while len(daemon.events("config.invalid")) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        invalid = daemon.events("config.invalid")[count - 1]
        assert str(invalid["reason"]).startswith(key) and says in str(invalid["reason"]), invalid
        assert invalid["kept"] == "previous config"
        notify.wait_for("READY=1")
        assert daemon.process.poll() is None, "still running"
    assert not typo.exists()
    make_checkpoint("step-2", step=2, root=root)
    daemon.wait_for("reload.succeeded", version="step-2")  # the old root is still watched
    assert daemon.stop() == 0


def test_service_sigterm_notifies_stopping_and_exits_zero_with_engine_resumed(service):
    start, engine, notify, _config, _root = service
    daemon = start()
    notify.wait_for("READY=1")
    daemon.process.send_signal(signal.SIGTERM)
    notify.wait_for("STOPPING=1")
    assert daemon.process.wait(timeout=30) == 0
    assert not engine.paused
    daemon.stop()


def test_service_sigterm_lets_in_flight_reload_finish(service, make_checkpoint):
    start, engine, notify, _config, root = service
    slow = threading_event_delay(engine, f"reload:{root / 'step-2'}", seconds=1.0)
    daemon = start()
    notify.wait_for("READY=1")
    make_checkpoint("step-2", step=2, root=root)
    daemon.wait_for("reload.started", version="step-2")
    daemon.process.send_signal(signal.SIGTERM)
    assert daemon.process.wait(timeout=30) == 0
    assert slow.done, "the reload was allowed to finish"
    assert engine.version == "step-2" and not engine.paused
    daemon.stop()
    daemon.wait_for("reload.succeeded", version="step-2")


def test_service_log_priority_prefix_for_journald(service):
    start, engine, _notify, config, _root = service
    fast = config.read_text().replace("retry_max = 2.0\n", "retry_max = 2.0\ncheck_interval = 0.1\n")
    config.write_text(fast)
    daemon = start(args=("--log-priority-prefix",))
    daemon.wait_for("engine.reconciled")
    engine.fail["/weight_info"] = unreachable()  # it answered before: a warning now
    daemon.wait_for("engine.unreachable")
    del engine.fail["/weight_info"]
    daemon.wait_for("engine.reconciled", timeout=30)
    assert daemon.stop() == 0
    prefixes = {line[:3] for line in daemon.raw if line.startswith("<")}
    assert {"<4>", "<6>"} <= prefixes
    assert all(line.startswith(("<4>{", "<6>{", "<3>{")) for line in daemon.raw)


class threading_event_delay:
    """Make one fake endpoint slow, and record that it ran to the end."""

    def __init__(self, engine: FakeEngine, key: str, *, seconds: float) -> None:
        self.done = False

        def slow():
            time.sleep(seconds)
            self.done = True
            engine.loaded = key.removeprefix("reload:")
            import httpx

            return httpx.Response(200, json={"results": [None]})

        engine.fail[key] = slow


def test_service_sigkill_then_restart_does_not_reload_needlessly(service, make_checkpoint):
    start, engine, notify, _config, root = service
    first = start()
    make_checkpoint("step-2", step=2, root=root)
    first.wait_for("reload.succeeded", version="step-2")
    first.process.send_signal(signal.SIGKILL)
    first.stop()
    reloads = [c for c in engine.calls if c.startswith("reload:")]
    second = start()
    second.wait_for("engine.reconciled", version="step-2")
    notify.wait_for("READY=1")
    time.sleep(0.5)
    assert [c for c in engine.calls if c.startswith("reload:")] == reloads
    assert second.stop() == 0


def test_service_says_ready_again_until_systemd_takes_it(service):
    """The READY=1 the daemon sends is dropped: it must send it again, or systemd kills it at
    TimeoutStartSec (after a reload, `systemctl reload` would wait for it until its timeout)."""
    start, _engine, notify, _config, _root = service
    assert notify.fill() >= 1
    daemon = start()
    daemon.wait_for("engine.warmed")
    time.sleep(0.5)  # its first READY=1 went nowhere
    notify.wait_for("READY=1")  # reads the stale ones first, then what it sends now
    assert notify.fill() >= 1
    daemon.process.send_signal(signal.SIGHUP)
    daemon.wait_for("config.reloaded")
    time.sleep(0.5)
    assert "READY=1" in notify.wait_for("READY=1")
    assert daemon.stop() == 0


def test_service_whose_ready_systemd_dropped_while_idle_sends_it_again_before_its_next_engine_check(
    service,
):
    """A queue that stays full through the start (systemd busy; the kernel's default is 10
    datagrams): READY=1, and the STATUS naming what is served, come once it is read, although
    nothing else wakes the loop until the next engine check, an hour away here."""
    start, _engine, notify, config, _root = service
    config.write_text(config.read_text().replace("[engine]\n", "[engine]\ncheck_interval = 3600.0\n", 1))
    assert notify.fill() >= 1
    daemon = start()
    daemon.wait_for("engine.warmed")
    time.sleep(1.0)  # its READY=1 went nowhere; the daemon has nothing else to do
    assert all("READY=1" not in fields for fields in notify.drain())
    ready = notify.wait_for("READY=1", timeout=60.0)  # not an hour
    assert any(f.startswith("STATUS=serving step-1") for f in ready)
    assert daemon.stop() == 0


def test_service_tells_systemd_at_most_a_few_datagrams_a_second_however_busy_the_loop(service):
    """A writer's many files turn the loop a hundred times a second: a WATCHDOG=1 and an
    EXTEND_TIMEOUT_USEC per turn filled systemd's queue, and the datagrams that mattered were lost."""
    start, _engine, notify, _config, root = service
    daemon = start(WATCHDOG_USEC="2000000")  # a ping a second is owed
    notify.wait_for("READY=1")
    busy = root / "busy"
    busy.mkdir()
    notify.drain()
    began = time.monotonic()
    for i in range(200):  # each a watcher event, each a turn of the loop
        (busy / f"f{i}").write_bytes(b"x")
        time.sleep(0.01)
    time.sleep(max(0.0, 2.0 - (time.monotonic() - began)))
    told = notify.drain()
    seconds = time.monotonic() - began
    assert ["WATCHDOG=1"] in told, "still told systemd it is alive"
    assert len(told) <= 2 * (seconds + 1), told  # a full queue holds 10
    assert daemon.stop() == 0


def test_service_sigkill_mid_reload_then_restart_converges(service, make_checkpoint):
    start, engine, _notify, _config, root = service
    slow = threading_event_delay(engine, f"reload:{root / 'step-2'}", seconds=1.0)
    first = start()
    first.wait_for("engine.reconciled")
    make_checkpoint("step-2", step=2, root=root)
    deadline = time.monotonic() + 10
    while f"reload:{root / 'step-2'}" not in engine.calls:  # paused, weights being written
        assert time.monotonic() < deadline
        time.sleep(0.01)
    first.process.send_signal(signal.SIGKILL)
    first.stop()
    assert engine.paused, "killed after pausing: the engine is left paused"
    while not slow.done:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert engine.version == "reloading:step-2"
    second = start()
    second.wait_for("reload.succeeded", version="step-2")
    assert engine.version == "step-2" and not engine.paused
    assert second.stop() == 0


@pytest.mark.parametrize("failpoint", failpoints.KILL_NAMES)
def test_service_sigkill_at_each_failpoint_then_restart_converges(
    service, make_checkpoint, failpoint, tmp_path
):
    start, engine, _notify, _config, root = service
    first = start(VLLM_RELOADER_FAILPOINT=failpoint)
    first.wait_for("engine.reconciled")
    make_checkpoint("step-2", step=2, root=root)
    assert first.process.wait(timeout=20) == -signal.SIGKILL
    first.stop()
    assert engine.paused == (failpoint in ("after_pause", "after_reload"))
    second = start()
    second.wait_for("engine.reconciled")
    deadline = time.monotonic() + 20
    while engine.version != "step-2" or engine.paused:
        assert time.monotonic() < deadline, (engine.version, engine.paused)
        time.sleep(0.05)
    assert engine.loaded == str(root / "step-2")
    while (saved := state.load(tmp_path / "s")).serving is None or saved.serving.version != "step-2":
        assert time.monotonic() < deadline, saved
        time.sleep(0.05)
    assert second.process.poll() is None
    assert second.stop() == 0


def test_service_status_line_escapes_what_the_engine_or_a_writer_put_in_a_version(service):
    """A newline in STATUS= starts a new field: `WATCHDOG=trigger` would make systemd restart
    the daemon, at every start. The engine reports whatever someone set as its version."""
    start, engine, notify, _config, root = service
    engine.version = "x\nWATCHDOG=trigger"
    # the version a writer put in the served checkpoint's manifest (else the daemon may
    # reload step-1 over the engine's unknown version before READY=1 is sent)
    write_manifest(root / "step-1", step=1, overrides={"version": engine.version})
    daemon = start()
    ready = notify.wait_for("READY=1")
    assert "WATCHDOG=trigger" not in ready
    assert any(f.startswith("STATUS=serving x\\nWATCHDOG=trigger since") for f in ready), ready
    assert daemon.stop() == 0


def test_service_starts_from_the_engine_when_the_state_file_is_corrupt(service, tmp_path):
    start, _engine, notify, _config, _root = service
    (tmp_path / "s" / "state.json").write_text("{not json")  # the fixture made the state dir
    daemon = start()
    notify.wait_for("READY=1")
    corrupt = daemon.wait_for("state.corrupt")
    assert Path(str(corrupt["moved_to"])).read_text() == "{not json"
    daemon.wait_for("engine.reconciled", version="step-1")
    assert state.load(tmp_path / "s").serving is not None
    assert daemon.stop() == 0


def test_service_exits_2_with_one_line_when_the_engine_has_no_dev_mode(service):
    """What systemd's RestartPreventExitStatus=2 keys on: a setup error, not a crash."""
    start, engine, notify, _config, _root = service
    engine.dev_mode = False
    daemon = start()
    daemon.process.wait(timeout=30)
    assert daemon.stop() == 2
    [line] = daemon.events("daemon.not_runnable")
    assert "VLLM_SERVER_DEV_MODE=1" in str(line["reason"]) and line["level"] == "error"
    assert not any("READY=1" in m for m in notify.messages)
    assert "Traceback" not in "".join(daemon.raw)


@pytest.mark.parametrize("metrics", [False, True])
def test_service_second_run_on_the_same_state_dir_exits_2_naming_the_first_and_touches_nothing(
    service, metrics: bool
):
    """One daemon per state dir: a second `run` by mistake must not replace the first's
    control socket (nor delete it on exit), with or without a metrics port both want."""
    start, _engine, notify, config, _root = service
    if metrics:
        with config.open("a") as extra:
            extra.write(f'[metrics]\nlisten = "127.0.0.1:{free_port()}"\n')
    first = start()
    notify.wait_for("READY=1")
    control = config.parent / "s" / "control.sock"
    before = control.stat().st_ino
    second = subprocess.run(
        [sys.executable, "-m", "vllm_reloader", "run", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert second.returncode == 2, second.stderr
    said = second.stderr.strip().splitlines()
    assert len(said) == 1 and f"pid {first.process.pid}" in said[0] and "Traceback" not in second.stderr
    assert control.stat().st_ino == before
    asked = subprocess.run(
        [sys.executable, "-m", "vllm_reloader", "status", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert asked.returncode == 0 and "serving" in asked.stdout, asked.stderr
    assert first.stop() == 0
    again = start()  # the lock goes with the process: the next daemon starts
    notify.wait_for("READY=1")
    assert again.stop() == 0
