"""The rolling update across the engines of one host, as pure functions of what each holds.

The first engine is the canary engine: a new version is loaded there first and its canary
run. Only a version that passed there (it is in that engine's history of good checkpoints)
is what the other engines — the followers — converge on, at most `max_unavailable` engines
paused or reloading at a time, and never backwards unless an operator pinned it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .served import Served, serving_of
from .state import Loaded

EngineState = Literal["serving", "reloading", "unreachable", "behind"]


@dataclass(frozen=True)
class Follower:
    url: str
    serving: Loaded | None
    reconciled: bool
    busy: bool
    """A job (reload, canary, rollback) runs on it now."""
    retry_at: float
    """After a failed reload: not before this (monotonic)."""


def wanted(canary: Served) -> Loaded | None:
    """The version every engine converges on: what the canary engine serves, once it passed its
    canary there. None while it is unknown (the canary engine down, a fresh start on the startup
    model, a failed canary left loaded for want of a fallback)."""
    serving = canary.serving
    if serving is None or not canary.reconciled:
        return None
    passed = any(_same(g, serving) for g in canary.good)
    return serving if passed else None


def _same(a: Loaded, b: Loaded) -> bool:
    """The same checkpoint: one place, and one content where both are known."""
    return (a.version, a.path) == (b.version, b.path) and _same_content(a, b)


def behind(serving: Loaded | None, want: Loaded | None, pinned: str | None) -> bool:
    """Whether an engine serving `serving` should load `want`: a newer version (the same name's
    new content included), weights of unknown mix, or the operator's pin — never an older
    version by itself."""
    if want is None:
        return False
    if serving is not None and serving.version == want.version and _same_content(serving, want):
        return False
    if pinned is not None and pinned == want.name:
        return True
    if not want.in_root:
        return False
    want_as = want.candidate(want.fingerprint)
    return serving_of(serving).replaced_by(want_as)


def _same_content(a: Loaded, b: Loaded) -> bool:
    return not (a.fingerprint and b.fingerprint and a.fingerprint != b.fingerprint)


def next_to_load(
    followers: Sequence[Follower], want: Loaded | None, pinned: str | None, room: int, now: float
) -> list[str]:
    """The followers to load `want` on now, in their configured order, at most `room` of them."""
    picks: list[str] = []
    for follower in followers:
        if len(picks) >= room:
            break
        ready = follower.reconciled and not follower.busy and now >= follower.retry_at
        if ready and behind(follower.serving, want, pinned):
            picks.append(follower.url)
    return picks


def state(
    *, up: bool, busy: bool, serving: Loaded | None, want: Loaded | None, pinned: str | None
) -> EngineState:
    """What `status` says of one engine."""
    if busy:
        return "reloading"
    if not up:
        return "unreachable"
    return "behind" if behind(serving, want, pinned) else "serving"
