"""A trainer's own format, converted by `[source] converter` and served; a failing converter
rejects that content once."""

import time

from tests.support.converters import COPYING, FAILING, converter
from tests.support.fake_engine import FakeEngine


def _dcp(directory, *, whole: bool = True):
    """What torch DCP's FileSystemWriter leaves: every rank's `.distcp`, then `.metadata`."""
    directory.mkdir()
    for rank in range(2):
        (directory / f"__{rank}_0.distcp").write_bytes(b"\0" * 256)
    if whole:
        (directory / ".metadata").write_bytes(b"metadata")
    return directory


def test_daemon_converts_a_whole_dcp_checkpoint_and_serves_the_output(start, root, tmp_path, make_checkpoint):
    """...and the next one after it: a trainer's checkpoint orders by the step its name ends
    in, as its output will (published step-1 serving first)."""
    make_checkpoint("step-1", step=1, root=root)
    made = make_checkpoint("src", root=tmp_path / "made", seed=2, shards=2)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine, converter=converter(tmp_path, "copy", COPYING, made))
    running.wait_for("engine.reconciled")
    writing = _dcp(root / "step-2", whole=False)
    time.sleep(0.5)
    assert not running.events("checkpoint.converting"), "not whole yet: .metadata comes last"
    (writing / ".metadata").write_bytes(b"metadata")
    converted = running.wait_for("checkpoint.converted", name="step-2")
    done = running.wait_for("reload.succeeded", path=str(root / converted["placed"]))
    assert done["version"] == "step-2"
    assert engine.loaded == str(root / converted["placed"])
    _dcp(root / "step-3")
    converted = running.wait_for("checkpoint.converted", name="step-3")
    running.wait_for("reload.succeeded", path=str(root / converted["placed"]))
    time.sleep(0.5)
    assert len(running.events("checkpoint.converting")) == 2
    assert not running.events("checkpoint.rejected")


def test_daemon_rejects_what_its_converter_fails_on_once_and_serves_on(
    start, root, tmp_path, make_checkpoint
):
    make_checkpoint("step-1", root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine, converter=converter(tmp_path, "fail", FAILING))
    running.wait_for("engine.reconciled")
    _dcp(root / "step-2")
    rejected = running.wait_for("checkpoint.rejected", name="step-2")
    assert rejected["check"] == "converter" and "exited with status 3" in rejected["reason"]
    assert "the optimizer state is not a model" in rejected["reason"]
    time.sleep(0.5)  # the gate's rechecks: the rejected content is not converted again
    assert len(running.events("checkpoint.converting")) == 1
    assert not [c for c in engine.calls if c.startswith("reload:")]
    assert running.daemon.reloader.catalog.rejected["step-2"]


def test_daemon_restarted_does_not_convert_again_what_its_converter_failed_on(
    start, root, tmp_path, make_checkpoint
):
    make_checkpoint("step-1", root=root)
    argv = converter(tmp_path, "fail", FAILING)
    engine = FakeEngine(startup=str(root / "step-1"))
    first = start(engine, converter=argv)
    _dcp(root / "step-2")
    first.wait_for("checkpoint.rejected", name="step-2")
    first.daemon.request_stop()
    first.wait_for("daemon.stopped")
    second = start(engine, converter=argv)
    deadline = time.monotonic() + 10
    while len(second.events("checkpoint.seen", name="step-2")) < 2:  # the logs of both daemons
        assert time.monotonic() < deadline, "the restarted daemon never looked at step-2"
        time.sleep(0.05)
    time.sleep(1.0)  # twenty pending rechecks
    assert len(second.events("checkpoint.converting")) == 1, "the one before the restart only"
    catalog = second.daemon.reloader.catalog
    assert "step-2" in catalog.rejected and "step-2" not in catalog.pending


def test_daemon_rejecting_a_converted_output_stops_its_trainer_directory_waiting(
    start, root, tmp_path, make_checkpoint
):
    """The output of another model (the gate's `layout` check): rejected, and the trainer's
    directory it came from is no longer pending ("being converted") nor gated again."""
    make_checkpoint("step-1", root=root)
    other = make_checkpoint("src", root=tmp_path / "made", shapes={"model.other.weight": (4, 4)})
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine, converter=converter(tmp_path, "copy", COPYING, other))
    running.wait_for("engine.reconciled")
    _dcp(root / "step-2")
    placed = running.wait_for("checkpoint.converted", name="step-2")["placed"]
    rejected = running.wait_for("checkpoint.rejected", name=placed)
    assert rejected["check"] == "layout"
    time.sleep(0.5)
    catalog = running.daemon.reloader.catalog
    assert "step-2" not in catalog.pending and placed not in catalog.pending
    assert "step-2" not in catalog.newer_than(running.daemon.reloader.served.serving_key())
    assert not [c for c in engine.calls if c.startswith("reload:")]


def test_pinning_a_trainers_own_directory_is_refused_naming_its_converted_copy(
    start, root, tmp_path, make_checkpoint
):
    make_checkpoint("step-1", root=root)
    made = make_checkpoint("src", root=tmp_path / "made", seed=2)
    running = start(
        FakeEngine(startup=str(root / "step-1")), converter=converter(tmp_path, "copy", COPYING, made)
    )
    running.wait_for("engine.reconciled")
    _dcp(root / "step-2")
    placed = running.wait_for("checkpoint.converted", name="step-2")["placed"]
    catalog = running.daemon.reloader.catalog
    said = catalog.pin("step-2")
    assert said is not None and f"pin {placed}" in said and catalog.pinned is None
    assert catalog.pin(placed) is None and catalog.pinned == placed
