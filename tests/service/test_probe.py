"""The daemon and the probe inside the pause: weights it finds broken are loaded back before
any request reaches them, rejected like a failed canary; where no probe can run, it says so."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.service.test_owners import adapters_config, holding, lora_engines, until
from tests.support.adapters import write_adapter
from tests.support.checkpoints import write_manifest
from tests.support.fake_engine import FakeEngine, error, unreachable
from vllm_reloader import config
from vllm_reloader.checkpoint import gate
from vllm_reloader.checkpoint.order import Candidate
from vllm_reloader.engine.swap import Target
from vllm_reloader.service.engine import SCAN_FAILED
from vllm_reloader.service.jobs import Job, Outcome, ReloadWorker
from vllm_reloader.service.outcomes import decide


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


def _with_one_nan(directory: Path) -> None:
    """One NaN in the embedding row of a token no prompt uses (the gate's scan would see it)."""
    tensors = load_file(directory / "model.safetensors")
    tensors["model.embed_tokens.weight"][15, 3] = np.nan
    save_file(tensors, str(directory / "model.safetensors"))
    write_manifest(directory, step=int(directory.name.split("-")[1]))


def test_with_scan_engine_the_gate_only_hashes_and_the_probe_finds_nan_before_the_resume(
    start, root, make_checkpoint
):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.extension = True
    running = start(engine, gate=config.GateConfig(scan="engine"))
    running.wait_for("engine.reconciled")
    _with_one_nan(make_checkpoint("step-2", step=2, root=root, seed=2))
    rolled = running.wait_for("reload.rolled_back", version="step-2")
    assert rolled["cause"] == "probe" and engine.loaded == str(root / "step-1") and not engine.paused
    rejected = running.wait_for("checkpoint.rejected", name="step-2")
    assert rejected["check"] == "probe"
    assert "model.embed_tokens.weight holds NaN or Inf" in str(rejected["reason"])
    assert engine.probes[-1]["scan"] is True and engine.probes[-1]["paused"] is True
    make_checkpoint("step-3", step=3, root=root, seed=3)
    done = running.wait_for("reload.succeeded", version="step-3")
    assert done["probe_scanned_bytes"] == sum(4 * 8 * n for n in (16, 32, 16)), "every parameter read"


def test_with_scan_engine_an_engine_without_the_extension_gets_host_scanned_weights(
    start, root, make_checkpoint
):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))  # no extension: it cannot scan
    running = start(engine, gate=config.GateConfig(scan="engine"))
    running.wait_for("engine.reconciled")
    _with_one_nan(make_checkpoint("step-2", step=2, root=root, seed=2))
    rejected = running.wait_for("checkpoint.rejected", name="step-2")
    assert rejected["check"] == "finite", "the gate scanned"
    assert running.events("reload.started") == [] and engine.loaded == str(root / "step-1")


@pytest.mark.parametrize(("device", "scanned_by"), [("cuda", "probe"), ("cpu", "finite")])
def test_scan_auto_moves_to_the_engine_once_a_probe_showed_an_accelerator(
    start, root, make_checkpoint, device, scanned_by
):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.extension, engine.device = True, device
    running = start(engine)  # scan = "auto"
    running.wait_for("engine.reconciled")
    make_checkpoint("step-2", step=2, root=root, seed=2)
    running.wait_for("reload.succeeded", version="step-2")
    assert engine.probes[-1]["scan"] is False, "no probe had said where the weights are: the host scanned"
    _with_one_nan(make_checkpoint("step-3", step=3, root=root, seed=3))
    rejected = running.wait_for("checkpoint.rejected", name="step-3")
    assert rejected["check"] == scanned_by and engine.loaded == str(root / "step-2")


def _job(engine: FakeEngine, directory: Path, **fields: object) -> Job:
    files = gate.check(directory, serving=None, options=gate.GateOptions(check_finite=False)).files
    return Job(
        client=engine.client(),
        candidate=Candidate(directory.name, 2, "fp-2"),
        target=Target(directory.name, str(directory), files),
        rollback=None,
        size=1,
        **fields,  # type: ignore[arg-type]
    )


def test_weights_the_gate_left_unscanned_are_scanned_by_the_host_before_the_pause_for_an_engine_that_cannot(
    root, make_checkpoint
):
    """The gate skipped the scan (every engine scanned then); the engine that loads it cannot now
    (it restarted without the extension): the host reads the files first, and nothing is sent."""
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    directory = make_checkpoint("step-2", step=2, root=root, seed=2)
    _with_one_nan(directory)
    reports: list[object] = []
    worker = ReloadWorker(reports.append)
    worker.handle(_job(engine, directory, host_scan=gate.GateOptions(verify_digests=False)))
    [outcome] = reports
    assert isinstance(outcome, Outcome) and "model.embed_tokens.weight" in str(outcome.non_finite)
    assert engine.methods == [] and engine.pause_modes == [] and engine.loaded == str(root / "step-1")
    decision = decide(outcome, now=1.0)
    assert decision.reject is not None and decision.reject.check == "finite"
    assert decision.reject.fingerprint == "fp-2" and not decision.set_serving


def test_a_host_scan_of_clean_files_lets_the_reload_go_on(root, make_checkpoint):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    directory = make_checkpoint("step-2", step=2, root=root, seed=2)
    reports: list[object] = []
    ReloadWorker(reports.append).handle(_job(engine, directory, host_scan=gate.GateOptions()))
    [outcome] = reports
    assert isinstance(outcome, Outcome) and outcome.error is None and outcome.non_finite is None
    assert engine.loaded == str(directory)


class Named(set):  # type: ignore[type-arg]
    """Paths whose last part starts with `prefix` (an adapter copy's name is its version, `@`,
    its digest): what the fake engine's `garbage` holds, whatever the copy is called."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def __contains__(self, path: object) -> bool:
        return isinstance(path, str) and Path(path).name.startswith(self.prefix)


def test_an_adapter_version_the_probe_finds_broken_is_never_loaded_for_clients(
    start, root, tmp_path, make_checkpoint
):
    make_checkpoint("step-1", step=1, root=root)
    [engine] = lora_engines(root, 1)
    engine.extension = True
    loaded: list[str] = []
    engine.during_lora = loaded.append
    write_adapter(tmp_path / "adapters" / "support" / "step-1", seed=1)
    running = start(engine, adapters=adapters_config(tmp_path))
    until(lambda: holding(engine, "step-1"))
    engine.garbage = Named("step-2@")  # NaN in use, and in the probe's pass
    write_adapter(tmp_path / "adapters" / "support" / "step-2", seed=2)
    rolled = running.wait_for("adapter.rolled_back", version="step-2", timeout=30)
    assert rolled["cause"] == "probe" and rolled["blamed"] and rolled["to_version"] == "step-1", rolled
    assert "not finite" in str(rolled["reason"])
    assert holding(engine, "step-1") and [Path(p).name.split("@")[0] for p in loaded] == ["step-1"]
    probed = [Path(str(p["adapter"])).name.split("@")[0] for p in engine.probes if "adapter" in p]
    assert probed == ["step-1", "step-2"], "each version probed before it was loaded"
    write_adapter(tmp_path / "adapters" / "support" / "step-3", seed=3)
    until(lambda: holding(engine, "step-3"), what="the next good version loads")


def test_a_scan_that_does_not_run_is_no_pass_and_the_host_scans_for_that_engine_after(
    start, root, make_checkpoint
):
    """The engine's extension predates the probe (`scan = "engine"`): its weights were loaded
    back unjudged, and from then on the host reads the files for that engine."""
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.extension = True
    engine.fail["probe"] = error(500, "'Worker' object has no attribute 'reloader_probe'")
    asked_of: list[str] = []
    engine.during_completion = lambda _model: asked_of.append(engine.loaded)
    running = start(engine, gate=config.GateConfig(scan="engine"))
    running.wait_for("engine.reconciled")
    _with_one_nan(make_checkpoint("step-2", step=2, root=root, seed=2))
    rolled = running.wait_for("reload.rolled_back", version="step-2")
    assert rolled["cause"] == "probe" and engine.loaded == str(root / "step-1") and not engine.paused
    running.wait_for("engine.probe_unavailable", reason=SCAN_FAILED)
    rejected = running.wait_for("checkpoint.rejected", name="step-2", timeout=20)
    assert rejected["check"] == "finite", "the host scanned it (the gate, or before the pause)"
    assert len(running.events("reload.started", version="step-2")) == 1, "the second try sent nothing"
    assert str(root / "step-2") not in asked_of, "no request reached the unscanned weights"
