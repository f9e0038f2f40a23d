"""The daemon and the probe inside the pause: weights it finds broken are loaded back before
any request reaches them, rejected like a failed canary; where no probe can run, it says so."""

from __future__ import annotations

from tests.support.fake_engine import FakeEngine, unreachable


def test_daemon_loads_the_last_good_weights_back_before_any_request_reaches_weights_its_probe_finds_broken(
    start, root, make_checkpoint
):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.extension = True
    asked_of: list[str] = []  # what was loaded whenever a request (the canary's) came
    engine.during_completion = lambda _model: asked_of.append(engine.loaded)
    running = start(engine)
    running.wait_for("engine.reconciled")
    engine.probe_broken.add(str(root / "step-2"))  # overflows in the forward pass, finite on disk
    make_checkpoint("step-2", step=2, root=root, seed=2)
    rolled = running.wait_for("reload.rolled_back", version="step-2")
    assert rolled["cause"] == "probe" and rolled["to_version"] == "step-1"
    rejected = running.wait_for("checkpoint.rejected", name="step-2")
    assert rejected["check"] == "probe" and "not finite" in str(rejected["reason"])
    assert engine.loaded == str(root / "step-1") and engine.version == "step-1" and not engine.paused
    assert str(root / "step-2") not in asked_of, "no request reached the broken weights"
    make_checkpoint("step-3", step=3, root=root, seed=3)
    done = running.wait_for("reload.succeeded", version="step-3")
    assert done["probe_ms"] >= 0 and done["probe_ranks_with_logits"] == 1
    assert [p["loaded"] for p in engine.probes] == [str(root / "step-2"), str(root / "step-3")]


def test_daemon_says_once_that_no_probe_judges_an_engines_reloads(start, root, make_checkpoint):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.extension = True
    engine.probe_answers = [{"available": False, "why": "LoRA is enabled"}]
    running = start(engine)
    running.wait_for("engine.reconciled")
    for step in (2, 3):
        make_checkpoint(f"step-{step}", step=step, root=root, seed=step)
        running.wait_for("reload.succeeded", version=f"step-{step}")
    said = running.events("engine.probe_unavailable")
    assert [e["reason"] for e in said] == ["rank 0: LoRA is enabled"], "once, not at every reload"


def test_daemon_says_an_engine_without_the_extension_is_judged_by_its_canary_alone(
    start, root, make_checkpoint
):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    running = start(engine)
    running.wait_for("engine.reconciled")
    said = running.wait_for("engine.probe_unavailable")
    assert "worker extension" in str(said["reason"]) and "--worker-extension-cls" in str(said["reason"])
    assert "reloader_probe" not in engine.methods


def test_daemon_blames_no_checkpoint_for_a_probe_that_gives_no_answer_and_tries_it_again(
    start, root, make_checkpoint
):
    """The engine's condition (a probe timing out), not the weights': they are loaded back
    unjudged, nothing is rejected, and the same version is tried again after a backoff."""
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.extension = True
    engine.fail["probe"] = unreachable()
    running = start(engine)
    running.wait_for("engine.reconciled")
    make_checkpoint("step-2", step=2, root=root, seed=2)
    rolled = running.wait_for("reload.rolled_back", version="step-2")
    assert rolled["cause"] == "probe" and engine.loaded == str(root / "step-1")
    running.wait_for("engine.retry")
    del engine.fail["probe"]
    running.wait_for("reload.succeeded", version="step-2", timeout=20)
    assert running.events("checkpoint.rejected") == [], "nothing blamed"
