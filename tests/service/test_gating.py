"""The gate runs off the loop: while a checkpoint is being read the daemon answers, shows how
far the gate got, and calls the gate off when its candidate changes, a newer one arrives,
or the daemon stops."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tests.support.fake_engine import FakeEngine
from vllm_reloader.checkpoint import gate, scan
from vllm_reloader.service.control import Reply
from vllm_reloader.service.messages import ControlRequest


class SlowReads:
    """scan.read held until released (a checkpoint far bigger than the test's), cancellable."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.progressed = threading.Event()

    def __call__(self, directory, work, *args, cancel=None, progress=None, **kwargs):  # type: ignore[no-untyped-def]
        self.started.append(directory.name)
        while not self.release.is_set():
            if cancel is not None and cancel.is_set():
                self.cancelled.append(directory.name)
                return scan.Found("cancelled", "called off")
            if progress is not None:
                progress.add(1)
                self.progressed.set()
            time.sleep(0.005)
        return REAL_READ(directory, work, *args, cancel=cancel, progress=progress, **kwargs)


REAL_READ = scan.read


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlowReads]:
    reads = SlowReads()
    monkeypatch.setattr(gate.scan, "read", reads)
    yield reads
    reads.release.set()


def ask_status(running) -> tuple[dict, float]:  # type: ignore[no-untyped-def]
    reply = Reply()
    started = time.perf_counter()
    running.daemon.inbox.put(ControlRequest({"command": "status"}, reply))
    answer = reply.wait(5)
    assert answer is not None
    return answer, time.perf_counter() - started


def serving_step_1(start, root, make_checkpoint):  # type: ignore[no-untyped-def]
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine)
    running.wait_for("engine.reconciled")
    running.engine = engine
    return running


def wait_until(check, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_gating_leaves_the_loop_free_and_shows_how_far_it_got(start, root, make_checkpoint, slow):
    running = serving_step_1(start, root, make_checkpoint)
    make_checkpoint("step-2", step=2, root=root, seed=2)
    wait_until(slow.progressed.is_set)
    answers = [ask_status(running) for _ in range(5)]  # each answered (within 5 s) while gating
    gating = answers[-1][0]["gating"]
    assert gating["name"] == "step-2" and gating["total"] > 0 and gating["done"] > 0
    slow.release.set()
    running.wait_for("reload.succeeded", version="step-2")
    assert ask_status(running)[0]["gating"] is None


def test_gating_is_called_off_when_its_candidate_changes_and_starts_again(start, root, make_checkpoint, slow):
    running = serving_step_1(start, root, make_checkpoint)
    new = make_checkpoint("step-2", step=2, root=root, seed=2)
    wait_until(lambda: "step-2" in slow.started)
    (new / "notes.txt").write_text("the trainer writes one more file")
    wait_until(lambda: "step-2" in slow.cancelled)
    wait_until(lambda: slow.started.count("step-2") >= 2)
    slow.release.set()
    running.wait_for("reload.succeeded", version="step-2")


def test_gating_gives_way_to_a_newer_candidate(start, root, make_checkpoint, slow):
    running = serving_step_1(start, root, make_checkpoint)
    engine = running.engine
    make_checkpoint("step-2", step=2, root=root, seed=2)
    wait_until(lambda: "step-2" in slow.started)
    make_checkpoint("step-3", step=3, root=root, seed=3)
    wait_until(lambda: "step-2" in slow.cancelled and "step-3" in slow.started)
    slow.release.set()
    running.wait_for("reload.succeeded", version="step-3")
    time.sleep(0.3)
    assert not [c for c in engine.calls if "step-2" in c], "superseded before it loaded"


def test_gating_is_called_off_when_the_daemon_stops(start, root, make_checkpoint, slow):
    running = serving_step_1(start, root, make_checkpoint)
    make_checkpoint("step-2", step=2, root=root, seed=2)
    wait_until(lambda: "step-2" in slow.started)
    started = time.monotonic()
    running.daemon.request_stop()
    running.wait_for("daemon.stopped")
    assert time.monotonic() - started < 5 and "step-2" in slow.cancelled
