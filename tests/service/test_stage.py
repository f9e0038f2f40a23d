"""What a stage node keeps: whatever its engine may still load or go back to."""

from vllm_reloader.checkpoint import order
from vllm_reloader.service.stage import Copy, stage_holds


def copy(step: int) -> Copy:
    fp = f"{step:02d}" * 32
    return Copy(f"step-{step}@{fp[:16]}", order.Candidate(f"step-{step}@{fp[:16]}", step, fp), {})


def fp(step: int) -> str:
    return f"{step:02d}" * 32


COPIES = [copy(1), copy(2), copy(3), copy(4)]


def names(held: set[str]) -> list[str]:
    return sorted(h.partition("@")[0] for h in held)


def test_stage_keeps_everything_while_the_leaders_verdicts_are_unknown():
    assert names(stage_holds(COPIES, None, keep=0)) == ["step-1", "step-2", "step-3", "step-4"]


def test_stage_keeps_the_last_version_its_leader_passed_and_every_newer_one_it_did_not_fail():
    leader = {fp(1): "passed", fp(2): "passed", fp(3): "failed"}
    assert names(stage_holds(COPIES, leader, keep=0)) == ["step-2", "step-4"]


def test_stage_keeps_its_newest_few_besides_unless_the_leader_failed_them():
    leader = {fp(3): "passed", fp(4): "failed"}
    assert names(stage_holds(COPIES, leader, keep=2)) == ["step-2", "step-3"]


def test_stage_with_nothing_passed_yet_keeps_all_but_what_the_leader_failed():
    assert names(stage_holds(COPIES, {fp(2): "failed"}, keep=0)) == ["step-1", "step-3", "step-4"]
