"""The probe inside the pause: what the ranks' reports mean (pure), and `hot_swap` loading the
last good weights back, still paused, when it finds the new ones broken."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.fake_engine import FakeEngine, error, unreachable
from vllm_reloader.engine import probe
from vllm_reloader.engine.swap import Target, hot_swap
from vllm_reloader.errors import ReloadFailed

NEW = Target("step-2", "/root/step-2")
OLD = Target("step-1", "/root/step-1")
GOOD = {"available": True, "logits": True, "finite": True, "flat": False, "max_abs": 12.0, "entropy": 3.1}


def test_probe_passes_finite_logits_and_sums_up_the_ranks():
    scanned = {**GOOD, "scanned_bytes": 4, "device": "cuda"}
    found = probe.judge([scanned, {**scanned, "max_abs": 20.0, "scanned_bytes": 8}, scanned])
    assert found.broken is None and found.unavailable is None
    assert found.summary == {
        "max_abs_logit": 20.0,
        "entropy": 3.1,
        "ranks_with_logits": 3,
        "scanned_bytes": 16,
        "device": "cuda",
    }


def test_probe_reports_no_scan_unless_every_rank_scanned():
    found = probe.judge([{**GOOD, "scanned_bytes": 8}, GOOD])
    assert "scanned_bytes" not in found.summary


def test_probe_reports_the_scan_even_where_no_forward_pass_ran():
    pipeline = {"available": False, "why": "pipeline parallel", "scanned_bytes": 8, "device": "cpu"}
    found = probe.judge([pipeline, pipeline])
    assert found.unavailable == "rank 0: pipeline parallel"
    assert found.summary == {"scanned_bytes": 16, "device": "cpu"}


@pytest.mark.parametrize(
    ("mode", "able", "device", "scans"),
    [
        ("host", True, "cuda", False),
        ("engine", True, "cpu", True),
        ("both", True, None, True),
        ("engine", False, "cuda", False),  # no extension's probe: the host must
        ("auto", True, "cuda", True),
        ("auto", True, "cpu", False),  # clients would wait through it
        ("auto", True, None, False),  # no probe answered yet: the host, to be safe
    ],
)
def test_engine_scans_only_where_asked_and_able(mode, able, device, scans):
    assert probe.engine_scans(mode, able=able, device=device) is scans


@pytest.mark.parametrize(
    ("mode", "engines", "scans"),
    [
        ("host", [True], True),
        ("both", [True, True], True),
        ("engine", [True, True], False),
        ("engine", [True, False], True),  # one engine would load the bytes unscanned
        ("auto", [True], False),
        ("auto", [False], True),
    ],
)
def test_gate_scans_unless_every_engine_does(mode, engines, scans):
    assert probe.host_scans(mode, engines) is scans


@pytest.mark.parametrize(
    ("second", "why"),
    [
        (None, "rank 1 of 2 gave no probe report"),
        ("boom", "rank 1 of 2 gave no probe report (boom)"),
        ({**GOOD, "finite": False}, "rank 1: the logits of a forward pass are not finite"),
        ({**GOOD, "flat": True}, "rank 1: every token equally likely at every position"),
        ({**GOOD, "non_finite": "lm_head.weight"}, "rank 1: parameter lm_head.weight holds NaN or Inf"),
    ],
)
def test_probe_finds_the_weights_broken_when_one_rank_of_two_fails(second: Any, why: str):
    assert why in str(probe.judge([GOOD, second]).broken)


def test_probe_finds_a_non_finite_parameter_even_where_no_forward_pass_can_run():
    found = probe.judge([{"available": False, "why": "no _dummy_run", "non_finite": "embed.weight"}])
    assert found.broken == "rank 0: parameter embed.weight holds NaN or Inf"


def test_probe_says_why_it_could_not_judge_and_breaks_nothing():
    found = probe.judge([{"available": False, "why": "this vLLM's model runner has no _dummy_run"}])
    assert found.broken is None and found.unavailable == "rank 0: this vLLM's model runner has no _dummy_run"
    stages = probe.judge([{"available": True, "logits": False}, {"available": True, "logits": False}])
    assert stages.broken is None and stages.unavailable == "no rank computed logits"


def test_probe_lets_no_rank_it_cannot_run_on_hide_another_ranks_broken_logits():
    found = probe.judge([{"available": False, "why": "no attention layer"}, {**GOOD, "finite": False}])
    assert found.broken == "rank 1: the logits of a forward pass are not finite"


def test_probe_reads_only_the_last_pipeline_stage_logits():
    found = probe.judge([{"available": True, "logits": False}, GOOD])
    assert found.broken is None and found.summary["ranks_with_logits"] == 1


def swap(engine: FakeEngine, fallback: Target | None = OLD) -> dict[str, Any]:
    client = engine.client()
    asked = probe.Probe(tokens=probe.tokens_of(client, ["The capital of France is"]))
    return hot_swap(
        client,
        NEW,
        fallback=fallback,
        on_resume_failed=lambda _: None,
        extension=True,
        probe=lambda c: probe.run(c, asked, timeout=5.0),
    )


def extension_engine(ranks: int = 1) -> FakeEngine:
    engine = FakeEngine()
    engine.extension, engine.ranks = True, ranks
    return engine


def test_swap_probes_the_new_weights_still_paused_with_the_prompts_tokens():
    engine = extension_engine()
    timings = swap(engine)
    assert engine.probes == [{"tokens": [3, 7, 2, 6, 2], "scan": False, "paused": True, "loaded": NEW.path}]
    assert (
        timings["probe_ms"] >= 0 and timings["probe_max_abs_logit"] == 9.5 and timings["probe_entropy"] == 2.5
    )
    assert (
        engine.calls.index("probe")
        < engine.calls.index("/reset_prefix_cache")
        < engine.calls.index("/resume")
    )
    assert engine.version == "step-2" and not engine.paused


def test_swap_loads_the_last_good_weights_back_before_the_resume_when_one_rank_of_two_is_broken():
    engine = extension_engine(ranks=2)
    engine.probe_answers = [GOOD, {**GOOD, "finite": False}]
    with pytest.raises(ReloadFailed) as failed:
        swap(engine)
    assert failed.value.probed and failed.value.restored and "rank 1" in str(failed.value)
    restored = engine.calls.index(f"reload:{OLD.path}")
    assert engine.calls.index("probe") < restored < engine.calls.index("/resume"), "still paused"
    assert engine.loaded == OLD.path and engine.version == "step-1" and not engine.paused


@pytest.mark.parametrize("failing", [unreachable(), error(500, "worker died in the forward pass")])
def test_swap_loads_the_last_good_weights_back_unjudged_when_the_probe_gives_no_answer(failing):
    """Unverified weights never serve; nor is a checkpoint blamed for the engine's condition."""
    engine = extension_engine()
    engine.fail["probe"] = failing
    with pytest.raises(ReloadFailed) as failed:
        swap(engine)
    assert failed.value.unjudged and not failed.value.probed and failed.value.restored
    assert str(failed.value).startswith("probe: no answer: ")
    assert engine.loaded == OLD.path and not engine.paused


def test_swap_goes_on_where_the_probe_is_unavailable_and_says_why():
    engine = extension_engine()
    engine.probe_answers = [{"available": False, "why": "this vLLM's model runner has no _dummy_run"}]
    timings = swap(engine)
    assert timings["probe_unavailable"] == "rank 0: this vLLM's model runner has no _dummy_run"
    assert engine.loaded == NEW.path and engine.version == "step-2"


def test_swap_resumes_even_when_the_restore_inside_the_pause_fails_and_says_nothing_was_restored():
    engine = extension_engine()
    engine.probe_broken.add(NEW.path)
    engine.fail[f"reload:{OLD.path}"] = error(500, "out of memory")
    with pytest.raises(ReloadFailed) as failed:
        swap(engine)
    assert failed.value.probed and not failed.value.restored and failed.value.engine_up
    assert "restoring step-1 failed too" in str(failed.value)
    assert engine.calls[-1] == "/resume" and not engine.paused, "never left paused"


def test_swap_with_nothing_to_go_back_to_keeps_the_broken_weights_marked_reloading():
    engine = extension_engine()
    engine.probe_broken.add(NEW.path)
    with pytest.raises(ReloadFailed) as failed:
        swap(engine, fallback=None)
    assert (
        failed.value.probed and not failed.value.restored and "no checkpoint to restore" in str(failed.value)
    )
    assert engine.version.startswith("reloading:"), "its weights are not taken for step-2"
    assert not engine.paused


@pytest.mark.parametrize(
    "message",
    [
        "AttributeError: 'CPUWorker' object has no attribute 'reloader_probe'",  # mp executor
        "NotImplementedError: Method 'reloader_probe' is not implemented.",  # uni, ray
    ],
)
def test_swap_takes_an_engine_whose_extension_predates_the_probe_as_one_without_it(message: str):
    """The daemon upgraded, the engine not restarted: its workers have no `reloader_probe`."""
    engine = extension_engine()
    engine.fail["probe"] = error(500, message)
    timings = swap(engine)
    assert timings["probe_unavailable"] == probe.OLD_EXTENSION
    assert engine.loaded == NEW.path and engine.version == "step-2", "not a failed load"
