"""Every durable fact survives a kill -9 at the moment it is decided: the daemon runs as systemd
runs it (a subprocess, the scripted engine behind a real socket), SIGKILLs itself the moment a
decision is committed to the record store (failpoint `recorded_<decision>`: nothing acted on,
nothing said), and the daemon started after it agrees with what was decided — the engine, its
readiness, `status` and the record store — deciding nothing twice and taking nothing undecided
for decided."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.adapters import write_adapter
from tests.support.checkpoints import TENSORS, MakeCheckpoint
from tests.support.engine_fixtures import DaemonProcess
from tests.support.fake_engine import FakeEngine, FakeEngineServer
from tests.support.ports import unused_port
from tests.support.records import read_records
from vllm_reloader.errors import ControlError
from vllm_reloader.service import control, state


class Host:
    """One engine, its daemon's config (readiness on, adapters from ADAPTERS), and the daemons
    started on it in turn."""

    def __init__(self, tmp_path: Path, make_checkpoint: MakeCheckpoint) -> None:
        self.root, self.state = tmp_path / "root", tmp_path / "state"
        self.adapters, self.copies = tmp_path / "adapters", tmp_path / "copies"
        for made in (self.state, self.adapters, self.copies):
            made.mkdir()
        make_checkpoint("step-1", step=1, root=self.root)
        baseline = make_checkpoint("base", root=tmp_path / "models")
        self.engine = FakeEngine(startup=str(self.root / "step-1"))
        self.engine.lora_config = {"max_lora_rank": 16}
        self.server = FakeEngineServer(self.engine)
        self.listen = f"127.0.0.1:{unused_port()}"
        self.config = tmp_path / "daemon.toml"
        self.config.write_text(
            f'[source]\npath = "{self.root}"\npending_recheck_interval = 0.2\n'
            f'[engine]\nurl = "{self.server.url}"\nretry_initial = 0.2\nretry_max = 1.0\n'
            f'check_interval = 0.5\nbaseline = "{baseline}"\n'
            f'[state]\ndir = "{self.state}"\n[log]\nformat = "json"\n'
            f'[readiness]\nlisten = "{self.listen}"\n'
            f'[adapters]\nroot = "{self.adapters}"\ncopies = "{self.copies}"\ninterval = 0.2\n'
        )
        self.daemons: list[DaemonProcess] = []

    def start(self, failpoint: str | None = None) -> DaemonProcess:
        env = {"VLLM_RELOADER_FAILPOINT": failpoint} if failpoint else {}
        self.daemons.append(DaemonProcess(self.config, env=env))
        return self.daemons[-1]

    def killed(self, daemon: DaemonProcess) -> None:
        """It killed itself at its failpoint."""
        assert daemon.process.wait(timeout=30) == -signal.SIGKILL, "".join(daemon.raw[-20:])
        daemon.stop()

    def ready(self) -> tuple[int, str]:
        """The balancer's read of the engine ((0, why) while the daemon does not listen yet)."""
        try:
            answer = httpx.get(f"http://{self.listen}/ready/0", timeout=5)
        except httpx.HTTPError as exc:
            return 0, str(exc)
        return answer.status_code, answer.text.strip()

    def status(self) -> dict[str, object]:
        return control.call(self.state / "control.sock", "status")

    def close(self) -> None:
        for daemon in self.daemons:
            if daemon.process.poll() is None:
                daemon.stop()
        self.server.close()


@pytest.fixture
def host(tmp_path: Path, make_checkpoint: MakeCheckpoint) -> Iterator[Host]:
    made = Host(tmp_path, make_checkpoint)
    yield made
    made.close()


def until(predicate: Callable[[], object], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def reloads_of(engine: FakeEngine, directory: Path) -> int:
    return engine.calls.count(f"reload:{directory}")


def test_a_rejection_decided_before_a_kill_is_kept_and_the_content_never_loaded(host, make_checkpoint):
    first = host.start("recorded_rejection")
    first.wait_for("engine.reconciled")
    other = {**TENSORS, "lm_head.weight": (16, 9)}
    bad = make_checkpoint("step-2", step=2, root=host.root, shapes=other)  # another model: `layout`
    host.killed(first)
    assert not first.events("checkpoint.rejected"), "recorded, not said yet"
    assert "step-2" in state.load(host.state).rejected
    second = host.start()
    second.wait_for("engine.reconciled")
    until(lambda: host.ready() == (200, "ready"), what="in rotation")
    answer = host.status()
    assert answer["serving"]["version"] == "step-1" and "step-2" in answer["rejected"]  # type: ignore[index]
    time.sleep(1.0)  # a few rescans: the rejection holds
    assert reloads_of(host.engine, bad) == 0 and not second.events("checkpoint.ready", name="step-2")


def test_a_reload_decided_before_a_kill_is_served_after_it_and_not_loaded_again(host, make_checkpoint):
    first = host.start("recorded_serving")
    first.wait_for("engine.reconciled")
    new = make_checkpoint("step-2", step=2, root=host.root, seed=2)
    host.killed(first)
    saved = state.load(host.state)
    assert (
        saved.serving is not None and saved.serving.version == "step-2" and saved.good[0].version == "step-2"
    )
    second = host.start()
    second.wait_for("engine.reconciled", version="step-2")
    until(lambda: host.ready() == (200, "ready"), what="in rotation")
    assert host.status()["serving"]["version"] == "step-2"  # type: ignore[index]
    time.sleep(1.0)
    assert reloads_of(host.engine, new) == 1, "decided once, loaded once"


def test_weights_whose_canary_failed_with_nothing_to_go_back_to_keep_the_engine_out_after_a_kill(
    host, make_checkpoint
):
    host.engine.garbage.add(str(host.root / "step-2"))
    first = host.start("recorded_serving")
    first.wait_for("engine.reconciled")
    (host.root / "step-1").rename(host.root / ".gone-step-1")  # nothing intact to go back to
    make_checkpoint("step-2", step=2, root=host.root, seed=2)
    host.killed(first)
    saved = state.load(host.state)
    assert saved.serving is not None and saved.serving.version == "step-2" and "step-2" in saved.rejected
    second = host.start()
    second.wait_for("engine.reconciled", version="step-2")
    until(lambda: host.ready()[0] == 503, what="out of rotation")
    assert "did not end on verified weights" in host.ready()[1]
    assert "step-2" in host.status()["rejected"]  # type: ignore[operator]


def test_an_engine_not_clean_after_its_rollback_stays_out_after_a_kill_until_it_restarts(
    host, make_checkpoint
):
    for bad in ("step-1", "step-2"):  # every answer broken, the good weights loaded back too
        host.engine.garbage.add(str(host.root / bad))
    first = host.start("recorded_serving")
    first.wait_for("engine.reconciled")
    make_checkpoint("step-2", step=2, root=host.root, seed=2)
    host.killed(first)
    assert "not clean" in read_records(host.state).all("engine_unclean")[host.server.url]
    second = host.start()
    second.wait_for("engine.reconciled", version="step-1")
    until(lambda: host.ready()[0] == 503, what="out of rotation")
    assert "not clean after its rollback" in host.ready()[1]
    host.engine.garbage.clear()
    host.engine.version, host.engine.loaded = "default", host.engine.startup  # it restarted, on step-1
    until(lambda: host.ready() == (200, "ready"), what="back in rotation once restarted")
    assert read_records(host.state).all("engine_unclean") == {}


def test_a_pin_decided_before_a_kill_holds_after_it(host, make_checkpoint):
    first = host.start("recorded_pin")
    first.wait_for("engine.reconciled")
    make_checkpoint("step-2", step=2, root=host.root, seed=2)
    first.wait_for("reload.succeeded", version="step-2")
    with pytest.raises(ControlError):
        control.call(host.state / "control.sock", "pin", version="step-1")  # killed before answering
    host.killed(first)
    assert state.load(host.state).pinned == "step-1"
    host.start()
    until(lambda: host.engine.version == "step-1", what="the pinned version loaded")
    assert host.status()["pinned"] == "step-1"
    until(lambda: host.ready() == (200, "ready"), what="in rotation")


def test_an_adapter_that_failed_its_canary_and_stayed_loaded_keeps_the_engine_out_after_a_kill(host):
    engine = host.engine
    write_adapter(host.adapters / "support" / "step-1", seed=1)
    first = host.start("recorded_adapter_failure")
    until(lambda: "step-1@" in engine.loras.get("support", ""), what="step-1 loaded")
    good = engine.loras["support"]

    def broken_with_no_way_back(path: str) -> None:
        if "step-2" in path:
            engine.garbage.add(path)
            engine.lora_refused.add(good)

    engine.during_lora = broken_with_no_way_back
    write_adapter(host.adapters / "support" / "step-2", seed=2)
    host.killed(first)
    assert "step-2@" in engine.loras["support"], "the engine still holds the failed adapter"
    records = read_records(host.state)
    [failed] = records.all("adapter_failed_here")
    assert failed.startswith(host.server.url) and failed.split()[1] in records.all("adapter_rejected")
    seen: list[tuple[int, str]] = []
    engine.during_completion = lambda model: seen.append(host.ready()) if model == "support" else None
    second = host.start()  # it canaries what the engine holds again: the balancer reads it out meanwhile
    second.wait_for("adapter.unloaded", adapter="support")
    assert seen and all(status == 503 and "adapters: holds support step-2" in why for status, why in seen), (
        seen
    )
    engine.lora_refused.clear()
    until(lambda: "step-1@" in engine.loras.get("support", ""), what="step-1 loaded back")
    until(lambda: host.ready() == (200, "ready"), what="back in rotation")
    rejected = host.status()["adapters"]["support"]["rejected"]  # type: ignore[index]
    assert "its canary failed" in rejected["step-2"], "status says why, after the restart too"
