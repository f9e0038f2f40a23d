"""The bytes the real engine reads are the bytes the gate verified, whatever a writer does.

Each test holds the daemon (after the gate, after the load) or the engine's worker extension
(mid-load) at a failpoint, changes the checkpoint's files at that moment, releases it, and
checks that the real CPU vLLM engine is alive and answers exactly as a fresh engine on a
checkpoint whose bytes match its manifest — the one it served before — never a mix.
The bytes a writer puts over the staged checkpoint are another checkpoint's (C): a mix, or
C itself, would answer differently.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.support.e2e_world import World, _next_step_above_serving, list_files

pytestmark = pytest.mark.engine


def _hold(world: World, point: str) -> Path:
    hold = world.holds / f"{point}.hold"
    hold.touch()
    return hold


def _wait_held(world: World, point: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (world.holds / f"{point}.held").exists():
        assert time.monotonic() < deadline, f"never held at {point}:\n" + "".join(world.daemon.raw[-15:])
        time.sleep(0.02)


def _overwrite_in_place(shard: Path, source: Path) -> None:
    """Same size, other bytes, the same inode: a trainer saving over a fixed path."""
    data = source.read_bytes()
    assert len(data) == shard.stat().st_size
    with shard.open("r+b") as f:
        f.write(data)


def _change(world: World, directory: Path, how: str) -> None:
    shard = directory / "model.safetensors"
    other = world.staging / "seed-3" / "model.safetensors"
    if how == "rewrite in place":
        _overwrite_in_place(shard, other)
    elif how == "truncate":
        os.truncate(shard, shard.stat().st_size // 2)
    elif how == "replace by rename":
        shutil.copy(other, directory / ".replacement")
        os.rename(directory / ".replacement", shard)
    else:
        shutil.rmtree(directory)


def _publish_held(world: World, point: str) -> tuple[str, Path, Path]:
    hold = _hold(world, point)
    name, staged = world.stage("B" if world.expected == world.fresh_a else "A")
    list_files(staged, name, step=_next_step_above_serving(world))
    staged.rename(world.root / name)
    _wait_held(world, point)
    return name, world.root / name, hold


@pytest.mark.parametrize("how", ["rewrite in place", "truncate", "replace by rename", "delete the directory"])
@pytest.mark.parametrize("point", ["after_gate", "mid_load", "after_reload"])
def test_e2e_files_changed_at_any_step_never_reach_the_engine(world: World, point: str, how: str):
    name, directory, hold = _publish_held(world, point)
    try:
        if point == "after_reload":  # (mid-load the engine's core is busy: it cannot say)
            assert world.engine.is_paused(), "held while the weights are being replaced"
        _change(world, directory, how)
    finally:
        hold.unlink()
    changed = world.daemon.wait_for("checkpoint.changed", name=name, timeout=120)
    assert changed["when"] == ("before_pause" if point == "after_gate" else "after_load")
    if point != "after_gate":
        world.daemon.wait_for("reload.rolled_back", version=name, cause="changed", timeout=120)
    deadline = time.monotonic() + 60
    while world.engine.is_paused():
        assert time.monotonic() < deadline, "the engine was left paused"
        time.sleep(0.1)
    world.assert_unchanged()  # alive, the version it served, answering exactly as before
    assert not world.daemon.events("checkpoint.rejected", name=name, check="reload"), "not blamed"


def test_e2e_symlinked_candidate_is_never_loaded_however_it_is_repointed(world: World, tmp_path: Path):
    elsewhere = tmp_path / "elsewhere"
    for weights, target in (("B", "one"), ("C", "two")):
        name, staged = world.stage(weights)
        list_files(staged, name, step=_next_step_above_serving(world))
        staged.rename(elsewhere / target if elsewhere.exists() else _mkdir_then(elsewhere, target))
    link = world.root / "step-9999"
    link.symlink_to(elsewhere / "one")
    time.sleep(1.5)
    link.unlink()
    link.symlink_to(elsewhere / "two")  # repointed, as a deploy script might
    time.sleep(1.5)
    assert not world.daemon.events("reload.started", version="step-9999")
    assert not [e for e in world.daemon.events("checkpoint.seen") if e.get("name") == "step-9999"]
    world.assert_unchanged()
    link.unlink()


def _mkdir_then(directory: Path, name: str) -> Path:
    directory.mkdir()
    return directory / name


def test_e2e_rollback_goes_to_an_intact_checkpoint_when_the_last_good_one_was_deleted(world: World):
    """The trainer rotated the serving checkpoint away; the next one passes the gate and
    explodes when run: the engine goes back to an older good one that is still there, then
    loads the next good one."""
    from safetensors.torch import load_file, save_file

    older_weights = "B" if world.expected == world.fresh_a else "A"
    older = world.publish(older_weights, step=_next_step_above_serving(world))  # good, loaded
    world.daemon.wait_for("reload.succeeded", version=older, timeout=120)
    older_answers = world.engine.complete()
    world.serving = older
    newest = world.publish("A" if older_weights == "B" else "B", step=_next_step_above_serving(world))
    world.daemon.wait_for("reload.succeeded", version=newest, timeout=120)
    world.serving, world.expected = newest, world.engine.complete()
    bad_step, next_step = _next_step_above_serving(world), _next_step_above_serving(world) + 10**6
    shutil.rmtree(world.root / newest)  # save_total_limit took the serving one

    name, staged = world.stage("C")
    for shard in staged.glob("*.safetensors"):
        tensors = load_file(str(shard))
        save_file({k: (v.float() * 1e15).to(v.dtype) for k, v in tensors.items()}, str(shard))
    list_files(staged, name, step=bad_step)
    staged.rename(world.root / name)
    rolled = world.daemon.wait_for("reload.rolled_back", version=name, timeout=120)
    assert rolled["to_version"] == older and rolled["cause"] == "probe"
    world.serving, world.expected = older, older_answers
    world.assert_unchanged()

    following = world.publish(older_weights, step=next_step)
    world.daemon.wait_for("reload.succeeded", version=following, timeout=120)
    world.serving = following
    world.assert_unchanged()  # the same weights as `older`: the same answers
