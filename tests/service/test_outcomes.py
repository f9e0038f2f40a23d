"""What a reload's outcome means, as data (no daemon, no engine)."""

from __future__ import annotations

from tests.support.fake_engine import FakeEngine
from vllm_reloader.checkpoint.order import Candidate
from vllm_reloader.engine.swap import Target
from vllm_reloader.errors import EngineUnavailable, ReloadFailed
from vllm_reloader.service.jobs import Job, Outcome
from vllm_reloader.service.outcomes import decide
from vllm_reloader.service.state import Loaded

FALLBACK = Target("step-1", "/root/step-1")
GOOD = Loaded(name="step-1", version="step-1", path="/root/step-1", since=0, step=1)


def job(fallback: Target | None = FALLBACK) -> Job:
    return Job(
        client=FakeEngine().client(),
        candidate=Candidate("step-2", 2, "fp-2"),
        target=Target("step-2", "/root/step-2"),
        fallback=fallback,
        size=42,
    )


def names(decision) -> list[str]:
    return [event.name for event in decision.events]


def test_outcome_success_serves_the_new_checkpoint_and_makes_it_last_good():
    decision = decide(Outcome(job(), 0.5, timings={"reload_ms": 400}), believed=GOOD, now=100.0)
    assert decision.result == "succeeded" and decision.set_serving
    assert (
        decision.serving
        == decision.last_good
        == Loaded(name="step-2", version="step-2", path="/root/step-2", since=100.0, step=2)
    )
    assert names(decision) == ["reload.succeeded"] and decision.events[0].fields["reload_ms"] == 400
    assert decision.reject is None and decision.engine_down is None and decision.reloaded["bytes"] == 42


def test_outcome_failed_reload_that_was_restored_rejects_and_keeps_the_engine_up():
    failed = ReloadFailed("bad shard; restored step-1", restored=True, engine_up=True)
    decision = decide(Outcome(job(), 0.5, error=failed), believed=GOOD, now=1.0)
    assert decision.result == "failed" and decision.rollback == "reload"
    assert names(decision) == ["reload.failed", "reload.rolled_back"]
    assert decision.reject is not None and decision.reject.check == "reload"
    assert decision.engine_down is None and not decision.set_serving


def test_outcome_unreachable_engine_is_not_a_rejection():
    down = EngineUnavailable("/pause: refused", endpoint="/pause")
    decision = decide(Outcome(job(), 0.1, error=down, resume_error=down), believed=GOOD, now=1.0)
    assert decision.reject is None and decision.engine_down is down and decision.resume_owed
    assert names(decision) == ["engine.resume_failed", "reload.failed"]


def test_outcome_canary_failure_rolled_back_serves_the_believed_checkpoint_only_if_it_is_the_one():
    rolled = Outcome(job(), 0.5, canary_failed="prompt 0: logprob nan is not finite", rolled_back=True)
    decision = decide(rolled, believed=GOOD, now=1.0)
    assert decision.reject is not None and decision.reject.check == "canary" and decision.rollback == "canary"
    assert decision.set_serving and decision.serving == GOOD
    other = GOOD.model_copy(update={"version": "step-0"})
    assert not decide(rolled, believed=other, now=1.0).set_serving


def test_outcome_canary_failure_without_fallback_stays_loaded_and_says_so():
    decision = decide(Outcome(job(fallback=None), 0.5, canary_failed="nan"), believed=None, now=1.0)
    assert names(decision) == ["reload.canary_failed_no_fallback"]
    assert decision.serving is not None and decision.serving.version == "step-2" and decision.set_serving
