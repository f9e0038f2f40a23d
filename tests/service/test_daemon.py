"""The main loop against a real filesystem and watcher, with a scripted engine for faults."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from tests.support.checkpoints import hf_index, write_manifest, write_weights
from tests.support.fake_engine import FakeEngine, error, unreachable
from tests.support.records import fill_disk
from vllm_reloader import config
from vllm_reloader.checkpoint.files import INDEX_NAME
from vllm_reloader.engine.client import RELOADING_PREFIX
from vllm_reloader.service import state, status
from vllm_reloader.tools import publish as publish_module
from vllm_reloader.tools.publish import publish


def test_daemon_recognises_startup_checkpoint_and_does_not_reload_it(start, root, make_checkpoint):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine)
    running.wait_for("engine.reconciled", version="step-1")
    time.sleep(0.2)
    assert not [c for c in engine.calls if c.startswith("reload:")]
    assert not engine.paused


def test_daemon_reloads_published_checkpoint(start, root, tmp_path, make_checkpoint):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine)
    running.wait_for("engine.reconciled")
    publish(make_checkpoint("src", root=tmp_path / "staging", seed=2), root, step=2)
    done = running.wait_for("reload.succeeded", version="step-2")
    assert done["bytes"] > 0 and "reload_ms" in done
    assert engine.version == "step-2" and engine.loaded == str(root / "step-2")
    saved = state.load(tmp_path / "state")
    assert saved.serving is not None and saved.serving.version == "step-2"
    assert saved.last_good == saved.serving


def test_daemon_restart_with_state_does_not_reload(start, root, tmp_path, make_checkpoint):
    make_checkpoint("step-1", step=1, root=root)
    make_checkpoint("step-2", step=2, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    first = start(engine)
    first.wait_for("reload.succeeded", version="step-2")
    first.daemon.request_stop()
    calls = len(engine.calls)
    second = start(engine)
    second.wait_for("engine.reconciled", version="step-2")
    time.sleep(0.2)
    assert not [c for c in engine.calls[calls:] if c.startswith("reload:")]


def test_daemon_rejects_checkpoint_whose_reload_fails_and_rolls_back(start, root, tmp_path, make_checkpoint):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.fail[f"reload:{root / 'step-2'}"] = error(500, "meta tensors")
    running = start(engine)
    running.wait_for("engine.reconciled")
    make_checkpoint("step-2", step=2, root=root)
    failed = running.wait_for("reload.failed", version="step-2")
    assert failed["restored"] is True
    rejected = running.wait_for("checkpoint.rejected", name="step-2")
    assert rejected["fix"].startswith("fix it and publish") and "pin step-2 --force" in rejected["fix"]
    assert engine.version == "step-1" and not engine.paused
    time.sleep(0.3)
    assert engine.calls.count(f"reload:{root / 'step-2'}") == 1, "a rejected version is not retried"
    assert "step-2" in state.load(tmp_path / "state").rejected


def test_daemon_waits_for_unreachable_engine_then_loads(start, root, make_checkpoint):
    make_checkpoint("step-1", step=1, root=root)
    make_checkpoint("step-2", step=2, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.fail["/weight_info"] = unreachable()
    running = start(engine)
    starting = running.wait_for("engine.starting")  # never answered yet: starting, not down
    assert starting["log_level"] == "info" and starting["poll_s"] == 1.0
    del engine.fail["/weight_info"]
    running.wait_for("reload.succeeded", version="step-2")
    assert not running.events("engine.unreachable")


def test_daemon_stopped_names_what_the_engine_said_it_serves_not_only_the_record(
    start, root, make_checkpoint
):
    make_checkpoint("step-1", step=1, root=root)
    make_checkpoint("step-2", step=2, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    first = start(engine)
    first.wait_for("reload.succeeded", version="step-2")
    first.stop()
    assert first.wait_for("daemon.stopped")["serving"] == "step-2"
    engine.fail["/weight_info"] = unreachable()  # restarted, and the engine has not answered since
    second = start(engine)
    second.wait_for("engine.starting")
    second.stop()
    stopped = second.wait_for("daemon.stopped")
    assert stopped["serving"] is None and stopped["recorded"] == "step-2"


def test_daemon_polls_a_starting_engine_every_second_and_warns_once_past_the_bound(
    start, root, make_checkpoint, monkeypatch
):
    from vllm_reloader.service import engine as engine_mod

    monkeypatch.setattr(engine_mod, "STARTING_WARN_AFTER_S", 2.5)
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.fail["/weight_info"] = unreachable()
    running = start(engine)  # retry_max 2 s: a backoff would ask at 0.2, 0.6, 1.4, 3.4 s
    running.wait_for("engine.starting")
    warned = running.wait_for("engine.unreachable", timeout=10)
    assert warned["log_level"] == "warning" and warned["waited_s"] >= 2 and "systemctl" in warned["fix"]
    canary = running.daemon.reloader.canary
    assert canary.retry_at() - time.monotonic() <= engine_mod.STARTING_POLL_S, "asked every second"
    time.sleep(0.5)
    assert len(running.events("engine.unreachable")) == 1 and len(running.events("engine.starting")) == 1
    del engine.fail["/weight_info"]
    running.wait_for("engine.reconciled")


def test_daemon_goes_straight_to_newest_of_a_burst(start, root, make_checkpoint):
    make_checkpoint("step-0", step=0, root=root)
    engine = FakeEngine(startup=str(root / "step-0"))
    engine.fail["/weight_info"] = unreachable()
    running = start(engine)
    running.wait_for("engine.starting")
    for i in range(1, 11):
        make_checkpoint(f"step-{i}", step=i, root=root)
    del engine.fail["/weight_info"]
    running.wait_for("reload.succeeded", version="step-10")
    time.sleep(0.2)
    assert [c for c in engine.calls if c.startswith("reload:")] == [f"reload:{root / 'step-10'}"]


def test_daemon_restores_last_good_after_interrupted_reload(start, root, tmp_path, make_checkpoint):
    make_checkpoint("step-1", step=1, root=root)
    make_checkpoint("step-2", step=2, root=root)
    good = state.Loaded(name="step-1", version="step-1", path=str(root / "step-1"), since=0, step=1)
    state.save(tmp_path / "state", state.State(serving=good, last_good=good))
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.version = RELOADING_PREFIX + "step-2"
    engine.fail[f"reload:{root / 'step-2'}"] = error(500)
    running = start(engine)
    running.wait_for("engine.weights_unknown", restoring="step-1")
    running.wait_for("reload.succeeded", version="step-1")
    assert engine.loaded == str(root / "step-1")


def test_daemon_keeps_serving_when_state_cannot_be_written(
    start, root, tmp_path, make_checkpoint, monkeypatch
):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))

    running = start(engine)
    running.wait_for("engine.reconciled")
    fill_disk(running.daemon.records, monkeypatch)
    make_checkpoint("step-2", step=2, root=root)
    running.wait_for("reload.succeeded", version="step-2")
    assert running.wait_for("state.write_failed")["reason"] == "database or disk is full"
    assert (
        running.daemon.reloader.served.serving is not None
        and running.daemon.reloader.served.serving.version == "step-2"
    )


def test_daemon_finds_checkpoint_by_rescan_when_events_are_lost(start, root, make_checkpoint, monkeypatch):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine, rescan_interval=0.3)
    running.wait_for("engine.reconciled")
    running.daemon.watcher.notify = lambda _name: None  # as if the inotify queue overflowed
    make_checkpoint("step-2", step=2, root=root)
    running.wait_for("reload.succeeded", version="step-2", timeout=5)


def test_daemon_brings_restarted_engine_back_to_current_version(start, root, make_checkpoint):
    make_checkpoint("step-1", step=1, root=root)
    make_checkpoint("step-2", step=2, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine, engine_check_interval=0.1)
    running.wait_for("reload.succeeded", version="step-2")
    engine.version, engine.loaded = "default", engine.startup  # systemd restarted it
    running.wait_for("engine.changed", engine_reported="default")
    deadline = time.monotonic() + 10
    while len(running.events("reload.succeeded", version="step-2")) < 2:
        assert time.monotonic() < deadline, "step-2 was not reloaded into the restarted engine"
        time.sleep(0.05)
    assert engine.loaded == str(root / "step-2") and engine.version == "step-2"


def test_daemon_resumes_engine_left_paused_by_a_killed_daemon(start, root, make_checkpoint):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.paused = True
    running = start(engine)
    running.wait_for("engine.resumed")
    assert not engine.paused


def test_daemon_reloads_a_checkpoint_hf_wrote_without_a_manifest(start, root, tmp_path):
    write_weights(root / "checkpoint-100")
    engine = FakeEngine(startup=str(root / "checkpoint-100"))
    running = start(engine, completeness="hf-index")
    running.wait_for("engine.reconciled", version="checkpoint-100")
    target = root / "checkpoint-200"
    shards = write_weights(target, seed=2, shards=2)  # save_pretrained: shards first...
    time.sleep(0.2)
    assert not running.events("reload.started")
    (target / INDEX_NAME).write_bytes(hf_index(shards))  # ...the index last
    running.wait_for("reload.succeeded", version="checkpoint-200")
    assert engine.loaded == str(target)


INDEX_YET = "no model.safetensors.index.json yet"


def test_daemon_by_default_serves_an_hf_checkpoint_copied_in_and_says_what_one_waits_for(start, root):
    write_weights(root / "checkpoint-100")
    engine = FakeEngine(startup=str(root / "checkpoint-100"))
    running = start(engine, settle_seconds=0.3)  # completeness: the default, auto
    running.wait_for("engine.reconciled", version="checkpoint-100")
    write_weights(root / "checkpoint-150", seed=1)  # cp -r of a save_pretrained directory
    running.wait_for("reload.succeeded", version="checkpoint-150")
    seen = [(e["name"], e["log_level"]) for e in running.events("checkpoint.seen")]
    assert seen == [("checkpoint-100", "debug"), ("checkpoint-150", "info")], "at start: not one line each"
    target = root / "checkpoint-200"
    shards = write_weights(target, seed=2, shards=2)
    deadline = time.monotonic() + 10  # seen while its shards were written, it may say so first
    while not [
        e for e in running.events("checkpoint.pending", name="checkpoint-200") if INDEX_YET in e["reason"]
    ]:
        assert time.monotonic() < deadline, running.events("checkpoint.pending", name="checkpoint-200")
        time.sleep(0.02)
    pending = status.answer(running.daemon.snapshot())["pending"]
    assert "model.safetensors.index.json" in pending["checkpoint-200"]
    (target / INDEX_NAME).write_bytes(hf_index(shards))
    running.wait_for("reload.succeeded", version="checkpoint-200")
    assert engine.loaded == str(target)


def test_daemon_says_once_that_a_copy_naming_a_lower_step_than_what_serves_will_not_load(
    start, root, make_checkpoint
):
    make_checkpoint("step-100", step=100, root=root)
    engine = FakeEngine(startup=str(root / "step-100"))
    running = start(engine, settle_seconds=1.0)
    running.wait_for("engine.reconciled", version="step-100")
    (root / "step-101").mkdir()  # a writer that writes its manifest in place, last: not yet
    write_weights(root / "checkpoint-50", seed=5)
    said = running.wait_for("checkpoint.passed_over", name="checkpoint-50")
    assert said["serving"] == "step-100" and "pin checkpoint-50" in said["fix"]
    assert "step 50, not newer than step-100" in said["reason"]
    shown = status.answer(running.daemon.snapshot())["passed_over"]
    assert list(shown) == ["checkpoint-50"] and "pin checkpoint-50" in shown["checkpoint-50"]
    make_checkpoint("step-101", step=101, root=root, seed=1)
    running.wait_for("reload.succeeded", version="step-101")
    assert [e["name"] for e in running.events("checkpoint.passed_over")] == ["checkpoint-50"]
    assert f"reload:{root / 'checkpoint-50'}" not in engine.calls
    shutil.rmtree(root / "checkpoint-50")
    deadline = time.monotonic() + 10
    while "checkpoint-50" in status.answer(running.daemon.snapshot())["passed_over"]:
        assert time.monotonic() < deadline, "a deleted copy stays in status"
        time.sleep(0.05)


def test_daemon_serves_a_trainer_checkpoint_copied_in_after_a_stepped_publish(start, root, make_checkpoint):
    """The drop-a-checkpoint workflow: Trainer's `checkpoint-N` has step N (its
    trainer_state.json's global_step first), so it is newer than `step-1`."""
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine, settle_seconds=0.3)
    running.wait_for("engine.reconciled", version="step-1")
    write_weights(root / "checkpoint-200", seed=2)
    running.wait_for("reload.succeeded", version="checkpoint-200")
    staged = root.parent / "staged-run"
    write_weights(staged, seed=3)
    (staged / "trainer_state.json").write_text('{"global_step": 300, "log_history": []}')
    staged.rename(root / "run-final")  # the name says no step; Trainer's state does
    running.wait_for("reload.succeeded", version="run-final")
    assert not running.events("checkpoint.passed_over")


def test_daemon_serves_a_copy_with_no_step_that_arrives_after_a_stepped_version_and_remembers_when(
    start, root, make_checkpoint, tmp_path
):
    """`save_model`'s output has no step anywhere: one copied in after `step-1` serves is newer
    (arrival order, kept in the record store); one there before the daemon first ran is not."""
    make_checkpoint("step-1", step=1, root=root)
    write_weights(root / "old-export", seed=4)
    engine = FakeEngine(startup=str(root / "step-1"))
    first = start(engine, settle_seconds=0.3)
    first.wait_for("engine.reconciled", version="step-1")
    write_weights(root / "final-model", seed=2)
    first.wait_for("reload.succeeded", version="final-model")
    first.stop()
    first.wait_for("daemon.stopped")
    saved = state.load(tmp_path / "state").serving
    assert saved is not None and saved.arrival is not None and saved.arrival[0] == 1, "after step 1"
    make_checkpoint("step-2", step=2, root=root)  # both new since the last run: which came
    write_weights(root / "while-down", seed=3)  # first is unknown, so the step-less one is newer
    for written in [*(root / "while-down").iterdir(), root / "while-down"]:  # quiet: whole at once
        os.utime(written, (time.time() - 60, time.time() - 60))
    calls = len(engine.calls)
    second = start(engine, settle_seconds=0.3)
    second.wait_for("reload.succeeded", version="while-down")
    make_checkpoint("step-3", step=3, root=root)  # a higher step is newer than all
    second.wait_for("reload.succeeded", version="step-3")
    loads = [c for c in engine.calls[calls:] if c.startswith("reload:")]
    assert loads == [f"reload:{root / 'while-down'}", f"reload:{root / 'step-3'}"]
    assert f"reload:{root / 'old-export'}" not in engine.calls, "there before: nothing says it is newer"
    assert not first.events("checkpoint.passed_over") and not second.events("checkpoint.passed_over")


def test_daemon_does_not_say_a_manifest_written_in_part_is_passed_over(start, root, make_checkpoint):
    make_checkpoint("step-100", step=100, root=root)
    engine = FakeEngine(startup=str(root / "step-100"))
    running = start(engine, settle_seconds=0.5)
    running.wait_for("engine.reconciled", version="step-100")
    target = root / "step-101"
    write_weights(target, seed=1)
    write_manifest(target, step=101)
    whole = (target / "manifest.json").read_bytes()
    (target / "manifest.json").write_bytes(whole[: len(whole) // 2])  # a writer caught mid-write
    running.wait_for("checkpoint.seen", name="step-101")
    write_weights(root / "checkpoint-50", seed=5)  # said after step-101 was looked at
    running.wait_for("checkpoint.passed_over", name="checkpoint-50")
    assert [e["name"] for e in running.events("checkpoint.passed_over")] == ["checkpoint-50"]
    (target / "manifest.json").write_bytes(whole)
    running.wait_for("reload.succeeded", version="step-101")


def test_daemon_rolls_back_a_checkpoint_whose_canary_fails(start, root, tmp_path, make_checkpoint):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.garbage.add(str(root / "step-2"))  # whole, right shapes, NaN answers
    running = start(engine)
    running.wait_for("engine.reconciled")
    make_checkpoint("step-2", step=2, root=root, seed=2)
    rolled = running.wait_for("reload.rolled_back", version="step-2")
    assert (
        rolled["to_version"] == "step-1" and rolled["cause"] == "canary" and "not finite" in rolled["reason"]
    )
    assert "serves step-1 again" in rolled["fix"] and "publish a good one" in rolled["fix"]
    rejected = running.wait_for("checkpoint.rejected", name="step-2")
    assert rejected["check"] == "canary"
    assert "pin step-2 --force" in rejected["fix"] and "diverged" in rejected["fix"]
    assert engine.version == "step-1" and engine.loaded == str(root / "step-1") and not engine.paused
    saved = state.load(tmp_path / "state")
    assert saved.serving is not None and saved.serving.version == "step-1"
    assert saved.rejected["step-2"].reason.startswith("canary: ")
    shown = status.answer(running.daemon.snapshot())
    assert shown["last_reload"]["version"] == "step-2" and shown["last_reload"]["rolled_back_to"] == "step-1"
    assert "last      step-2 ROLLED BACK to step-1 (canary)" in status.render(shown)
    make_checkpoint("step-3", step=3, root=root, seed=3)
    running.wait_for("reload.succeeded", version="step-3")
    assert engine.calls.count(f"reload:{root / 'step-2'}") == 1, "a rejected version is not retried"
    metrics = running.daemon.reloader.metrics
    assert metrics.rollbacks.labels(cause="canary", engine="http://engine.test")._value.get() == 1


def test_daemon_with_canary_off_does_not_probe(start, root, make_checkpoint):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine, canary=config.CanaryConfig(enabled=False))
    running.wait_for("engine.reconciled")
    make_checkpoint("step-2", step=2, root=root)
    running.wait_for("reload.succeeded", version="step-2")
    assert "/v1/completions" not in engine.calls


@pytest.mark.parametrize("sleep_mode", [True, False])
@pytest.mark.parametrize("extension", [True, False])
def test_daemon_picks_strategy_and_loader_from_what_the_engine_was_started_with(
    start, root, make_checkpoint, sleep_mode, extension
):
    """auto strategy sleeps only engines with sleep mode; the worker extension loads only
    where the engine has it (`/server_info`), else plain `reload_weights`."""
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.sleep_mode, engine.extension = sleep_mode, extension
    running = start(engine)
    running.wait_for("engine.reconciled")
    make_checkpoint("step-2", step=2, root=root)
    started = running.wait_for("reload.started", version="step-2")
    assert started["strategy"] == ("sleep" if sleep_mode else "inplace")
    assert started["loader"] == ("extension" if extension else "builtin")
    succeeded = running.wait_for("reload.succeeded", version="step-2")
    sleeps = [c for c in engine.calls if c.startswith(("/sleep", "/wake_up"))]
    if sleep_mode:
        assert "/sleep?level=2&mode=keep" in sleeps and engine.asleep == set()
    else:
        assert not sleeps
    loads = ["reloader_load_checkpoint", "reloader_probe"] if extension else ["reload_weights"]
    assert engine.methods == loads, "the extension's probe runs after its load"
    assert succeeded.get("load") == ({"loader": "extension", "bytes": 42} if extension else None)


def test_daemon_logs_an_unknown_message_and_keeps_running(start, root, make_checkpoint):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine)
    running.wait_for("engine.reconciled")
    running.daemon.inbox.put(("fs", "step-2"))  # type: ignore[arg-type]  # the old untyped form
    assert "('fs', 'step-2')" in running.wait_for("inbox.unknown")["message"]
    make_checkpoint("step-2", step=2, root=root)
    running.wait_for("reload.succeeded", version="step-2")


@pytest.mark.parametrize("helper", ["watcher", "control"])
def test_daemon_exits_1_when_a_helper_thread_dies(start, root, make_checkpoint, helper):
    """Never a silent dead thread: the daemon says which and exits non-zero (systemd restarts it)."""
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine)
    running.wait_for("engine.reconciled")
    if helper == "watcher":
        running.daemon.watcher.close()
    else:
        running.daemon.control._server.shutdown()
    died = running.wait_for("daemon.thread_died")
    assert died["thread"] == {"watcher": "watcher", "control": "control socket"}[helper]
    running.wait_for("daemon.stopped", exit_code=1)
    assert running.daemon.exit_code == 1 and not engine.paused


def test_daemon_warms_the_engine_up_after_reconciling_so_the_first_canary_is_not_the_slow_one(
    start, root, make_checkpoint
):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine)
    warmed = running.wait_for("engine.warmed")
    assert warmed["problem"] is None and warmed["ms"] >= 0
    assert "/v1/completions" in engine.calls and not [c for c in engine.calls if c.startswith("reload:")]


@pytest.mark.parametrize("where", [".incoming-step-2", "step-2"])
def test_daemon_reads_shards_while_the_checkpoint_is_written_not_again_after(
    start, root, tmp_path, make_checkpoint, where
):
    """A writer's shards, closed one after another (in publish's incoming directory, or in
    the candidate directory itself), are read as they land; the manifest, last, costs no
    second read of them."""
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine)
    running.wait_for("engine.reconciled")
    src = make_checkpoint("src", step=2, root=tmp_path / "trainer", seed=2, shards=3)
    target = root / where
    target.mkdir()
    for path in sorted(src.iterdir()):
        if path.name != "manifest.json":
            (target / path.name).write_bytes(path.read_bytes())
            time.sleep(0.1)  # the writer's pace: each shard read while the next is written
    time.sleep(1.0)  # a real writer's last sync: what is read by then is never read again
    (target / "manifest.json").write_bytes((src / "manifest.json").read_bytes())
    if where.startswith("."):
        target.rename(root / "step-2")
    ready = running.wait_for("checkpoint.ready", name="step-2")
    shards = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    assert ready["cached_bytes"] == shards
    running.wait_for("reload.succeeded", path=str(root / "step-2"))


@pytest.mark.parametrize("move", [False, True])
def test_daemon_reads_the_shards_publish_places_before_its_manifest_not_again_after(
    start, root, tmp_path, make_checkpoint, move, monkeypatch
):
    """`publish` closes each copy before syncing them all (a `--move` renames them in): the
    daemon has read every shard by the time the rename makes the checkpoint appear. Shards
    this small sync at once, so the manifest waits as long as a real shard's sync would (on a
    loaded machine a `--move` of tiny files can finish before the watcher's events arrive)."""
    real_write = publish_module.write_synced

    def write_after_the_sync(path, data):
        time.sleep(1.0)
        return real_write(path, data)

    monkeypatch.setattr(publish_module, "write_synced", write_after_the_sync)
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine)
    running.wait_for("engine.reconciled")
    src = make_checkpoint("src", step=2, root=tmp_path / "trainer", seed=2, shards=3)
    (src / "manifest.json").unlink()
    shards = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    publish(src, root, step=2, move=move)
    ready = running.wait_for("checkpoint.ready", name="step-2")
    assert ready["cached_bytes"] == shards
    running.wait_for("reload.succeeded", path=str(root / "step-2"))
