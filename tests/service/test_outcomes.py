"""What a reload's outcome means, as data (no daemon, no engine)."""

from __future__ import annotations

from tests.support.fake_engine import FakeEngine
from vllm_reloader.checkpoint.order import Candidate
from vllm_reloader.engine.swap import Target
from vllm_reloader.errors import EngineUnavailable, ReloadFailed
from vllm_reloader.service.jobs import Job, Outcome
from vllm_reloader.service.outcomes import decide
from vllm_reloader.service.state import Loaded

GOOD = Loaded(
    name="step-1", version="step-1", path="/root/step-1", since=0, step=1, files={"a": (1, 2, 3, 4, 5)}
)
FILES = {"model.safetensors": (1, 9, 42, 7, 7)}


def job(rollback: Loaded | None = GOOD) -> Job:
    return Job(
        client=FakeEngine().client(),
        candidate=Candidate("step-2", 2, "fp-2"),
        target=Target("step-2", "/root/step-2", FILES),
        rollback=rollback,
        size=42,
    )


def names(decision) -> list[str]:
    return [event.name for event in decision.events]


def test_outcome_success_serves_the_new_checkpoint_and_makes_it_last_good():
    decision = decide(Outcome(job(), 0.5, timings={"reload_ms": 400}), now=100.0)
    assert decision.result == "succeeded" and decision.set_serving
    assert (
        decision.serving
        == decision.last_good
        == Loaded(
            name="step-2",
            version="step-2",
            path="/root/step-2",
            since=100.0,
            step=2,
            files=FILES,
            fingerprint="fp-2",
        )
    ), "its content fingerprint and the identities it was verified with are kept"
    assert names(decision) == ["reload.succeeded"] and decision.events[0].fields["reload_ms"] == 400
    assert decision.reject is None and decision.engine_down is None and decision.reloaded["bytes"] == 42


def test_outcome_failed_reload_that_was_restored_rejects_and_serves_the_rollback_target():
    failed = ReloadFailed("bad shard; restored step-1", restored=True, engine_up=True)
    decision = decide(Outcome(job(), 0.5, error=failed), now=1.0)
    assert decision.result == "failed" and decision.rollback == "reload"
    assert names(decision) == ["reload.failed", "reload.rolled_back"]
    assert decision.reject is not None and decision.reject.check == "reload"
    assert decision.engine_down is None
    assert decision.set_serving and decision.serving == GOOD.model_copy(update={"since": 1.0})


def test_outcome_unreachable_engine_is_not_a_rejection():
    down = EngineUnavailable("/pause: refused", endpoint="/pause")
    decision = decide(Outcome(job(), 0.1, error=down, resume_error=down), now=1.0)
    assert decision.reject is None and decision.engine_down is down and decision.resume_owed
    assert names(decision) == ["engine.resume_failed", "reload.failed"]


def test_outcome_files_changed_before_the_pause_regates_without_blame():
    decision = decide(Outcome(job(), 0.0, changed="model.safetensors changed"), now=1.0)
    assert decision.result == "changed" and decision.regate == "step-2"
    assert decision.reject is None and not decision.set_serving and names(decision) == ["checkpoint.changed"]
    assert decision.events[0].fields["when"] == "before_pause"


def test_outcome_files_changed_during_the_load_rolls_back_and_regates_without_blame():
    failed = ReloadFailed(
        "files changed during the reload: x; restored step-1", restored=True, engine_up=True, changed=True
    )
    decision = decide(Outcome(job(), 0.5, error=failed), now=1.0)
    assert decision.result == "changed" and decision.rollback == "changed" and decision.regate == "step-2"
    assert decision.reject is None and decision.serving == GOOD.model_copy(update={"since": 1.0})
    assert names(decision) == ["reload.failed", "reload.rolled_back", "checkpoint.changed"]


def test_outcome_canary_failure_rolled_back_serves_the_rollback_target():
    rolled = Outcome(job(), 0.5, canary_failed="prompt 0: logprob nan is not finite", rolled_back=True)
    decision = decide(rolled, now=1.0)
    assert decision.reject is not None and decision.reject.check == "canary" and decision.rollback == "canary"
    assert decision.set_serving and decision.serving == GOOD.model_copy(update={"since": 1.0})


def test_outcome_canary_failure_without_fallback_stays_loaded_and_says_so():
    decision = decide(Outcome(job(rollback=None), 0.5, canary_failed="nan"), now=1.0)
    assert names(decision) == ["reload.canary_failed_no_fallback"]
    assert decision.serving is not None and decision.serving.version == "step-2" and decision.set_serving


def test_outcome_load_refused_whose_restore_failed_is_a_failed_reload_at_error():
    failed = ReloadFailed("Updating weights …; restore failed", restored=False, engine_up=True, refused=True)
    decision = decide(Outcome(job(), 0.5, error=failed), now=1.0)
    assert names(decision) == ["reload.failed"] and decision.events[0].level == "error"
    assert decision.engine_down is failed


def test_outcome_load_refused_for_memory_blames_no_checkpoint_and_says_how_to_make_room():
    failed = ReloadFailed("Updating weights …; restored step-1", restored=True, engine_up=True, refused=True)
    decision = decide(Outcome(job(), 0.5, error=failed), now=1.0)
    assert decision.refused and decision.reject is None and decision.engine_down is None
    assert names(decision) == ["engine.reload_refused"], "one refusal, one line"
    said = decision.events[0].fields
    assert "gpu_memory_utilization" in said["fix"] and said["restored"] and said["to_version"] == "step-1"
    assert decision.rollback is None, "put back as it was, nothing blamed: not counted as a rollback"
    assert decision.serving == GOOD.model_copy(update={"since": 1.0})
