"""The canary's judgement (pure), and the probe against the scripted engine."""

from __future__ import annotations

import math

import httpx

from tests.support.fake_engine import FakeEngine
from vllm_reloader.config import CanaryConfig
from vllm_reloader.engine import canary


def test_canary_passes_finite_logprobs():
    assert canary.judge([[-0.1, -2.0], [-0.5]], None) is None


def test_canary_fails_on_nan_inf_or_missing_logprobs():
    assert "not finite" in (canary.judge([[-0.1, math.nan]], None) or "")
    assert "not finite" in (canary.judge([[-math.inf]], None) or "")
    assert "not finite" in (canary.judge([[None]], None) or "")
    assert "no tokens" in (canary.judge([[]], None) or "")


def test_canary_min_mean_logprob_is_optional():
    assert canary.judge([[-9.0, -11.0]], None) is None
    assert "below min_mean_logprob" in (canary.judge([[-9.0, -11.0]], -8.0) or "")


def test_canary_probe_fails_on_an_engine_error_or_garbage_weights():
    engine = FakeEngine()
    client = engine.client()
    config = CanaryConfig(prompts=("a", "b"))
    assert canary.probe(client, config) is None
    assert engine.calls.count("/v1/completions") == 2
    engine.garbage.add(engine.loaded)
    assert "not finite" in (canary.probe(client, config) or "")
    engine.fail["/v1/completions"] = lambda: httpx.Response(500, json={"error": {"message": "worker died"}})
    reason = canary.probe(client, config) or ""
    assert reason.startswith("prompt 0: /v1/completions: HTTP 500") and "worker died" in reason


def test_canary_says_what_vllms_json_error_for_non_finite_logprobs_means():
    """vLLM cannot encode an inf logprob and answers HTTP 400 with Python's JSON error."""
    engine = FakeEngine()
    message = "Out of range float values are not JSON compliant"
    engine.fail["/v1/completions"] = lambda: httpx.Response(400, json={"error": {"message": message}})
    found = canary.examine(engine.client(), CanaryConfig(prompts=("a",)))
    assert found is not None and found.answered
    assert found.reason.startswith("prompt 0: the weights produce non-finite logits (")
    assert message in found.reason


def test_canary_rejects_a_flat_output_distribution_at_every_step():
    """Weights scaled into overflow: the engine's answer is finite but uniform over the vocabulary."""
    flat = [[[-5.545, -5.545, -5.545]] * 2]
    assert "equally likely" in (canary.judge([[-5.545, -5.545]], None, flat) or "")
    peaked = [[[-0.5, -2.0, -2.1], [-5.545, -5.545, -5.545]]]
    assert canary.judge([[-0.5, -5.545]], None, peaked) is None, "one flat step is not enough"
    assert canary.judge([[-0.5]], None, [[]]) is None, "no top logprobs: not judged"
