"""The rolling update's decisions, as pure functions of what each engine holds."""

from __future__ import annotations

from vllm_reloader.service import rollout
from vllm_reloader.service.served import Served
from vllm_reloader.service.state import Loaded


def loaded(step: int, *, in_root: bool = True) -> Loaded:
    name = f"step-{step}"
    return Loaded(name=name, version=name, path=f"/root/{name}", since=0, step=step, in_root=in_root)


def follower(
    url: str, serving: Loaded | None, *, busy: bool = False, retry_at: float = 0.0
) -> rollout.Follower:
    return rollout.Follower(url, serving, reconciled=True, busy=busy, retry_at=retry_at)


def test_rollout_wants_only_what_passed_its_canary_on_the_canary_engine():
    canary = Served(loaded(3), (loaded(2),), 0.1, reconciled=True)
    assert rollout.wanted(canary) is None, "serving, but not (yet) among the good ones"
    canary.loaded(loaded(3), good=loaded(3))
    assert rollout.wanted(canary) == loaded(3)
    canary.reconciled = False
    assert rollout.wanted(canary) is None, "unknown while the canary engine is not reconciled"


def test_rollout_moves_a_follower_forward_never_back_unless_pinned():
    assert rollout.behind(loaded(1), loaded(2), pinned=None)
    assert not rollout.behind(loaded(2), loaded(2), pinned=None)
    assert not rollout.behind(loaded(3), loaded(2), pinned=None), "never backwards by itself"
    assert rollout.behind(loaded(3), loaded(2), pinned="step-2"), "an operator's pin is followed"


def test_rollout_brings_an_engine_of_unknown_weights_to_the_wanted_version():
    restarted = Loaded(name="default", version="default", path="/models/x", since=0, in_root=False)
    assert rollout.behind(restarted, loaded(2), pinned=None)
    assert rollout.behind(None, loaded(2), pinned=None)
    startup = loaded(1, in_root=False)
    assert not rollout.behind(loaded(2), startup, pinned=None), "no position: not a reason to move"


def test_rollout_loads_at_most_room_followers_skipping_busy_and_backing_off_ones():
    followers = [
        follower("a", loaded(1), busy=True),
        follower("b", loaded(1), retry_at=100.0),
        follower("c", loaded(2)),
        follower("d", loaded(1)),
        follower("e", loaded(1)),
    ]
    assert rollout.next_to_load(followers, loaded(2), None, room=1, now=50.0) == ["d"]
    assert rollout.next_to_load(followers, loaded(2), None, room=2, now=150.0) == ["b", "d"]
    assert rollout.next_to_load(followers, loaded(2), None, room=0, now=150.0) == []
    assert rollout.next_to_load(followers, None, None, room=5, now=150.0) == []


def test_rollout_states_what_status_shows_of_each_engine():
    assert rollout.state(up=True, busy=True, serving=loaded(1), want=loaded(2), pinned=None) == "reloading"
    assert (
        rollout.state(up=False, busy=False, serving=loaded(1), want=loaded(2), pinned=None) == "unreachable"
    )
    assert rollout.state(up=True, busy=False, serving=loaded(1), want=loaded(2), pinned=None) == "behind"
    assert rollout.state(up=True, busy=False, serving=loaded(2), want=loaded(2), pinned=None) == "serving"
