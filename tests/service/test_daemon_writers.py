"""Writers that change a checkpoint after the gate said ready: held at an exact step by a
failpoint, the files changed, released. What the engine holds is always bytes the gate
verified, and the candidate is checked again rather than blamed."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fake_engine import FakeEngine
from vllm_reloader import failpoints


@pytest.fixture
def holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    directory = tmp_path / "failpoints"
    directory.mkdir()
    monkeypatch.setattr(failpoints, "_HOLD_DIR", str(directory))
    yield directory
    for hold in directory.glob("*.hold"):
        hold.unlink()


def held(holds: Path, name: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not (holds / f"{name}.held").exists():
        assert time.monotonic() < deadline, f"never held at {name}"
        time.sleep(0.01)


def rewrite_in_place(shard: Path) -> None:
    """Same size, other bytes, the same inode: a trainer saving over a fixed path."""
    data = bytearray(shard.read_bytes())
    data[-4:] = b"\x00\x00\x80\x3f"  # 1.0f: finite, so only the digest can tell
    with shard.open("r+b") as f:
        f.write(data)


def _reloads(engine: FakeEngine) -> list[str]:
    return [c.removeprefix("reload:") for c in engine.calls if c.startswith("reload:")]


@pytest.mark.parametrize(
    "change",
    ["rewrite in place", "truncate", "replace by rename", "delete the directory"],
)
def test_daemon_files_changed_after_the_gate_never_reach_the_engine(
    start, root, make_checkpoint, holds, change
):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.read_bytes = True
    running = start(engine)
    running.wait_for("engine.reconciled")
    (holds / "after_gate.hold").touch()
    new = make_checkpoint("step-2", step=2, root=root, seed=2)
    held(holds, "after_gate")
    shard = new / "model.safetensors"
    if change == "rewrite in place":
        rewrite_in_place(shard)
    elif change == "truncate":
        os.truncate(shard, shard.stat().st_size - 16)
    elif change == "replace by rename":
        (new / "other").write_bytes(shard.read_bytes())
        os.rename(new / "other", shard)
    else:
        shutil.rmtree(new)
    (holds / "after_gate.hold").unlink()
    found = running.wait_for("checkpoint.changed", name="step-2")
    assert found["when"] == "before_pause"
    assert str(new) not in _reloads(engine) and engine.version == "step-1" and not engine.paused
    if change == "replace by rename":  # the same bytes under a new inode: verified again, loaded
        running.wait_for("reload.succeeded", version="step-2")
    elif change != "delete the directory":
        time.sleep(0.5)
        assert str(new) not in _reloads(engine), "the changed bytes do not match the manifest"
    assert not running.events("checkpoint.rejected", check="reload")


@pytest.mark.parametrize("extension", [False, True])
def test_daemon_files_changed_during_the_load_are_restored_before_resume(
    start, root, make_checkpoint, holds, extension
):
    """vLLM's own loader reads by path; the extension checks as it reads: either way, the
    fallback is loaded back before the engine serves again, and the candidate is re-gated."""
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.extension, engine.read_bytes = extension, True
    new_path = root / "step-2"
    engine.during_load = lambda path: (
        rewrite_in_place(new_path / "model.safetensors") if path == str(new_path) else None
    )
    running = start(engine)
    running.wait_for("engine.reconciled")
    make_checkpoint("step-2", step=2, root=root, seed=2)
    rolled = running.wait_for("reload.rolled_back", version="step-2")
    assert rolled["cause"] == "changed" and rolled["to_version"] == "step-1"
    assert running.wait_for("checkpoint.changed", name="step-2")["when"] == "after_load"
    assert engine.loaded == str(root / "step-1") and engine.version == "step-1" and not engine.paused
    rejected = running.wait_for("checkpoint.rejected", name="step-2")
    assert rejected["check"] == "digests", "gated again: its bytes no longer match its manifest"


def test_daemon_files_changed_after_the_load_are_restored_before_resume(start, root, make_checkpoint, holds):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine)
    running.wait_for("engine.reconciled")
    (holds / "after_reload.hold").touch()
    new = make_checkpoint("step-2", step=2, root=root, seed=2)
    held(holds, "after_reload")
    assert engine.paused, "held mid-swap: still paused"
    rewrite_in_place(new / "model.safetensors")
    (holds / "after_reload.hold").unlink()
    running.wait_for("reload.rolled_back", version="step-2", cause="changed")
    assert engine.loaded == str(root / "step-1") and engine.version == "step-1" and not engine.paused
