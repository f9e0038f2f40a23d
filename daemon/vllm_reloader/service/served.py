"""What the engine holds, as far as the daemon knows: the serving checkpoint and the ones
that passed their canary before it (the rollback history), the engine's startup model and
layout baseline, what it was started with, and whether it answers (with the backoff while
it does not).

One owner, the reloader on the main loop; `status` sees it through a snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..checkpoint import layout, order
from ..checkpoint.files import Identity
from ..engine.serverinfo import UNSAID, Lora
from .state import Loaded


def serving_of(loaded: Loaded | None, history: tuple[Loaded, ...] = ()) -> order.Serving:
    """`history`: what served before (its contents of the same name are not newer)."""
    if loaded is None or not loaded.in_root:
        return order.NOTHING
    base = order.base_name(loaded.name)
    key = order.order_key(base, loaded.step, loaded.arrival)
    before = frozenset(g.fingerprint for g in history if order.base_name(g.name) == base and g.fingerprint)
    return order.Serving(key, loaded.name, loaded.fingerprint, before)


HISTORY = 4
"""Checkpoints kept as rollback targets: trainers delete old ones (HF `save_total_limit`),
so the newest still intact is used, not just the last."""


@dataclass
class Served:
    serving: Loaded | None
    good: tuple[Loaded, ...]
    """Passed their canary, newest first."""
    startup: str | None = None
    baseline: layout.Layout | None = None
    sleep_capable: bool = False
    extension: bool = False
    reconciled: bool = False
    """False until the daemon learned what the engine serves (and again after it went away)."""
    up: bool = False
    down_reason: str | None = None
    """Why it did not answer the last time, or why it is reconciled again (shown in `status`
    and the readiness answer until it answers)."""
    resume_owed: bool = False
    """A resume failed, or it was found paused: its scheduler resumes it."""
    next_check: float = 0.0
    """When an idle daemon next asks the engine for its weight version."""
    last_reload: dict[str, Any] | None = None
    rollback: str | None = None
    """The version a failed reload would go back to now; None: nothing intact is left."""
    lora: Lora | None = UNSAID
    """How it serves LoRA adapters (None: it does not)."""

    def serving_key(self) -> order.Serving:
        """What a candidate must replace: the serving checkpoint's place in the order and content
        (nothing, when it is outside the root: all are newer)."""
        return serving_of(self.serving, self.good)

    def went_down(self, reason: str) -> None:
        """It did not answer: reconciled again once it does."""
        self.reconciled = self.up = False
        self.down_reason = reason

    def answered(self, now: float, check_interval: float) -> None:
        self.up, self.down_reason = True, None
        self.next_check = now + check_interval

    @property
    def last_good(self) -> Loaded | None:
        return self.good[0] if self.good else None

    def reidentified(self, name: str, fingerprint: str, files: Mapping[str, Identity]) -> None:
        """The files of a checkpoint that passed its canary were shown to hold the same bytes
        under new identities (`reverify`): use those from now on."""

        def renewed(loaded: Loaded) -> Loaded:
            same = (loaded.name, loaded.fingerprint) == (name, fingerprint)
            return loaded.model_copy(update={"files": dict(files)}) if same else loaded

        self.good = tuple(renewed(g) for g in self.good)
        self.serving = renewed(self.serving) if self.serving is not None else None

    def loaded(self, serving: Loaded | None, good: Loaded | None = None) -> None:
        """What the engine holds now; `good` passed its canary: the newest rollback target."""
        self.serving = serving
        if good is not None:
            older = tuple(g for g in self.good if (g.name, g.path) != (good.name, good.path))
            self.good = (good, *older)[:HISTORY]
