"""Rollback that cannot dangle: the newest intact checkpoint that passed its canary, else the
startup model, never a missing path, never another layout; none left is said loudly."""

from __future__ import annotations

import os
import shutil
import threading
import time

from tests.support.fake_engine import FakeEngine
from vllm_reloader.engine.client import RELOADING_PREFIX
from vllm_reloader.service import rollback, state
from vllm_reloader.service.control import Reply
from vllm_reloader.service.messages import ControlRequest


def reloads(engine: FakeEngine) -> list[str]:
    return [c.removeprefix("reload:") for c in engine.calls if c.startswith("reload:")]


def status_of(running) -> dict:  # type: ignore[no-untyped-def]
    reply = Reply()
    running.daemon.inbox.put(ControlRequest({"command": "status"}, reply))
    answer = reply.wait(5)
    assert answer is not None
    return answer


def test_rollback_goes_to_the_newest_intact_good_checkpoint_when_the_last_one_was_deleted(
    start, root, tmp_path, make_checkpoint
):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine)
    running.wait_for("engine.reconciled")
    for step in (2, 3):
        make_checkpoint(f"step-{step}", step=step, root=root, seed=step)
        running.wait_for("reload.succeeded", version=f"step-{step}")
    shutil.rmtree(root / "step-3")  # the trainer's save_total_limit took the serving one
    engine.garbage.add(str(root / "step-4"))  # whole, right shapes, answers NaN
    make_checkpoint("step-4", step=4, root=root, seed=4)
    rolled = running.wait_for("reload.rolled_back", version="step-4")
    assert rolled["to_version"] == "step-2" and rolled["cause"] == "canary"
    assert engine.loaded == str(root / "step-2") and engine.version == "step-2" and not engine.paused
    assert state.load(tmp_path / "state").serving.version == "step-2"  # type: ignore[union-attr]
    make_checkpoint("step-5", step=5, root=root, seed=5)
    running.wait_for("reload.succeeded", version="step-5")
    assert reloads(engine).count(str(root / "step-3")) == 1, "a missing path is never tried again"


def test_rollback_with_nothing_intact_says_so_and_keeps_following_new_checkpoints(
    start, root, tmp_path, make_checkpoint
):
    startup = make_checkpoint("startup", root=tmp_path / "models")
    engine = FakeEngine(startup=str(startup))
    running = start(engine)
    running.wait_for("engine.reconciled")
    make_checkpoint("step-2", step=2, root=root, seed=2)
    running.wait_for("reload.succeeded", version="step-2")
    shutil.rmtree(root / "step-2")
    shutil.rmtree(startup)  # and the engine's own model is gone too
    engine.garbage.add(str(root / "step-3"))
    make_checkpoint("step-3", step=3, root=root, seed=3)
    none_left = running.wait_for("rollback.none_left")
    assert set(none_left["passed_over"]) == {"step-2", "default"}
    running.wait_for("reload.canary_failed_no_fallback", version="step-3")
    assert status_of(running)["rollback"] is None
    assert (
        running.daemon.reloader.metrics.rollback_ready.labels(engine="http://engine.test")._value.get() == 0
    )
    make_checkpoint("step-4", step=4, root=root, seed=4)
    running.wait_for("reload.succeeded", version="step-4")
    assert status_of(running)["rollback"] == "step-4"
    assert reloads(engine) == [str(root / f"step-{n}") for n in (2, 3, 4)], "no restore of a missing path"


def test_rollback_never_restores_a_checkpoint_of_another_layout(start, root, tmp_path, make_checkpoint):
    """The engine was restarted on a model of another shape: yesterday's good checkpoints
    would kill it, its own startup model is the only safe way back."""
    other = {"model.embed_tokens.weight": (32, 8), "lm_head.weight": (32, 8)}
    make_checkpoint("step-2", step=2, root=root, shapes=other)
    good = state.Loaded(name="step-2", version="step-2", path=str(root / "step-2"), since=0, step=2)
    state.save(tmp_path / "state", state.State(serving=good, good=(good,)))
    startup = make_checkpoint("startup", root=tmp_path / "models")
    engine = FakeEngine(startup=str(startup))
    running = start(engine)
    target = running.wait_for("rollback.target")
    assert target["version"] == "default" and "layout differs" in target["passed_over"]["step-2"]


def test_rollback_after_an_interrupted_reload_restores_an_intact_one_or_moves_on(
    start, root, tmp_path, make_checkpoint
):
    for step in (1, 2):
        make_checkpoint(f"step-{step}", step=step, root=root, seed=step)
    gone = state.Loaded(name="step-9", version="step-9", path=str(root / "step-9"), since=0, step=9)
    good = state.Loaded(name="step-1", version="step-1", path=str(root / "step-1"), since=0, step=1)
    state.save(tmp_path / "state", state.State(serving=gone, good=(gone, good)))
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.version = RELOADING_PREFIX + "step-9"  # a daemon died mid-reload of a since-deleted one
    running = start(engine)
    running.wait_for("engine.weights_unknown", restoring="step-1")
    running.wait_for("reload.succeeded", version="step-2")
    time.sleep(0.3)
    assert str(root / "step-9") not in reloads(engine)


def test_rollback_pick_skips_what_changed_or_vanished(make_checkpoint, tmp_path):
    from vllm_reloader.checkpoint.files import identity

    kept = make_checkpoint("step-1", root=tmp_path / "root")
    rewritten = make_checkpoint("step-2", root=tmp_path / "root", seed=2)

    def loaded(directory, step):  # type: ignore[no-untyped-def]
        files = {p.name: identity(p.lstat()) for p in directory.iterdir()}
        return state.Loaded(
            name=directory.name, version=directory.name, path=str(directory), since=0, step=step, files=files
        )

    targets = [loaded(rewritten, 2), loaded(kept, 1)]
    (rewritten / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    found, passed = rollback.pick(targets, baseline=None)
    assert found == targets[1] and "config.json changed" in passed["step-2"]
    shutil.rmtree(kept)
    found, passed = rollback.pick(targets, baseline=None)
    assert found is None and passed["step-1"].endswith("is gone")


def test_rollback_target_whose_metadata_moved_is_read_again_and_still_used(
    start, root, tmp_path, make_checkpoint
):
    """`chmod g+r` (as docs/deployments.md tells trainers) and a backup's hard link change no byte, but
    move every file's ctime: the target's bytes are read again, and it is still the way back."""
    startup = make_checkpoint("startup", root=tmp_path / "models")
    engine = FakeEngine(startup=str(startup))
    running = start(engine)
    running.wait_for("engine.reconciled")
    make_checkpoint("step-1", step=1, root=root, seed=1)
    running.wait_for("reload.succeeded", version="step-1")
    for path in (root / "step-1").iterdir():
        path.chmod(0o640)
    os.link(root / "step-1" / "manifest.json", tmp_path / "backup-manifest.json")
    engine.garbage.add(str(root / "step-2"))
    make_checkpoint("step-2", step=2, root=root, seed=2)
    again = running.wait_for("rollback.reverified", name="step-1")
    assert again["same_bytes"] is True
    rolled = running.wait_for("reload.rolled_back", version="step-2")
    assert rolled["to_version"] == "step-1" and engine.loaded == str(root / "step-1")
    assert not running.events("reload.canary_failed_no_fallback")


def test_rollback_target_whose_bytes_changed_at_the_same_size_is_not_used(
    start, root, tmp_path, make_checkpoint
):
    startup = make_checkpoint("startup", root=tmp_path / "models")
    engine = FakeEngine(startup=str(startup))
    running = start(engine)
    running.wait_for("engine.reconciled")
    make_checkpoint("step-1", step=1, root=root, seed=1)
    running.wait_for("reload.succeeded", version="step-1")
    shard = next(p for p in (root / "step-1").iterdir() if p.suffix == ".safetensors")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one bit of one weight, same size
    shard.write_bytes(bytes(data))
    engine.garbage.add(str(root / "step-2"))
    make_checkpoint("step-2", step=2, root=root, seed=2)
    again = running.wait_for("rollback.reverified", name="step-1")
    assert again["same_bytes"] is False and "mismatch" in again["reason"]
    rolled = running.wait_for("reload.rolled_back", version="step-2")
    assert rolled["to_version"] == "default" and engine.loaded == str(startup), "the startup model instead"


def test_two_contents_of_one_name_that_failed_their_canary_are_each_loaded_once(
    start, root, tmp_path, make_checkpoint
):
    """Every rejected content of a name is remembered, not just the last: the first bad copy
    does not come back once the second is rejected."""
    make_checkpoint("step-4", step=4, root=root, seed=4)
    engine = FakeEngine(startup=str(root / "step-4"))
    running = start(engine)
    running.wait_for("engine.reconciled")
    first, second = root / ("step-5@" + "a" * 16), root / ("step-5@" + "b" * 16)
    engine.garbage |= {str(first), str(second)}
    make_checkpoint(first.name, step=5, root=tmp_path / "w", seed=1).rename(first)
    running.wait_for("reload.rolled_back")
    make_checkpoint(second.name, step=5, root=tmp_path / "w", seed=2).rename(second)
    deadline = time.monotonic() + 10
    while len(running.events("reload.rolled_back")) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.0)
    assert reloads(engine).count(str(first)) == 1 and reloads(engine).count(str(second)) == 1


def test_new_version_waits_at_most_the_hold_for_a_target_touched_faster_than_it_is_read(
    start, root, tmp_path, make_checkpoint, monkeypatch
):
    """A cron `chmod -R` or a backup's hard links every 0.2 s, on a target that takes 0.5 s to
    read: no re-read ever finishes unchanged, and the new version loads once the hold is over."""
    from vllm_reloader.checkpoint import scan
    from vllm_reloader.service import rollback as rollback_module

    monkeypatch.setattr(rollback_module, "REVERIFY_HOLD", 1.0)
    real = scan.read_all

    def slow(*args, **kwargs):  # a large target takes minutes to read; here half a second
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(scan, "read_all", slow)
    make_checkpoint("step-1", step=1, root=root, seed=1)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine)
    running.wait_for("engine.reconciled")
    make_checkpoint("step-2", step=2, root=tmp_path / "w", seed=2).rename(root / "step-2")
    running.wait_for("reload.succeeded", version="step-2")
    stop = threading.Event()

    def toucher() -> None:
        while not stop.is_set():
            for path in (root / "step-2").iterdir():
                os.chmod(path, 0o644 if path.stat().st_mode & 0o040 == 0 else 0o600)
            time.sleep(0.2)

    touching = threading.Thread(target=toucher, daemon=True)
    touching.start()
    try:
        time.sleep(0.3)
        make_checkpoint("step-3", step=3, root=tmp_path / "w", seed=3).rename(root / "step-3")
        running.wait_for("reload.succeeded", version="step-3", timeout=15)
    finally:
        stop.set()
        touching.join()


def test_pin_of_a_version_that_names_two_contents_is_refused(start, root, tmp_path, make_checkpoint):
    from tests.support.checkpoints import write_manifest

    make_checkpoint("step-1", step=1, root=root, seed=1)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine)
    running.wait_for("engine.reconciled")
    for fp, seed in (("a" * 16, 1), ("b" * 16, 2)):
        staged = make_checkpoint(f"latest@{fp}", root=tmp_path / "w", seed=seed)
        write_manifest(staged, overrides={"version": "latest"})
        staged.rename(root / staged.name)
    reply = Reply()
    running.daemon.inbox.put(ControlRequest({"command": "pin", "version": "latest"}, reply))
    answer = reply.wait(5)
    assert answer is not None and answer["ok"] is False
    assert "latest@aaaaaaaaaaaaaaaa" in answer["error"] and "latest@bbbbbbbbbbbbbbbb" in answer["error"]
    assert running.daemon.reloader.catalog.pinned is None
