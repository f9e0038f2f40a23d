"""What the engine holds, as far as the daemon knows: the serving checkpoint and the ones
that passed their canary before it (the rollback history), the engine's startup model and
layout baseline, what it was started with, and whether it answers (with the backoff while
it does not).

One owner, the reloader on the main loop; `status` sees it through a snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checkpoint import layout, order
from .state import Loaded

HISTORY = 4
"""Checkpoints kept as rollback targets: trainers delete old ones (HF `save_total_limit`),
so the newest still intact is used, not just the last."""


@dataclass
class Served:
    serving: Loaded | None
    good: tuple[Loaded, ...]
    """Passed their canary, newest first."""
    retry_initial: float
    startup: str | None = None
    baseline: layout.Layout | None = None
    sleep_capable: bool = False
    extension: bool = False
    reconciled: bool = False
    """False until the daemon learned what the engine serves (and again after it went away)."""
    up: bool = False
    resume_owed: bool = False
    """A resume failed: the loop retries it until the engine answers."""
    retry_at: float = 0.0
    next_check: float = 0.0
    """When an idle daemon next asks the engine for its weight version."""
    last_reload: dict[str, Any] | None = None
    backoff: float = 0.0
    rollback: str | None = None
    """The version a failed reload would go back to now; None: nothing intact is left."""

    def __post_init__(self) -> None:
        self.backoff = self.retry_initial

    def serving_key(self) -> order.OrderKey | None:
        """Where the serving checkpoint sits in the order; None: outside the root (all are newer)."""
        serving = self.serving
        return order.order_key(serving.name, serving.step) if serving and serving.in_root else None

    def went_down(self, now: float, retry_max: float) -> float:
        """It did not answer: reconcile again after a backoff; returns the wait."""
        self.reconciled = self.up = False
        wait = self.backoff
        self.retry_at = now + wait
        self.backoff = min(self.backoff * 2, retry_max)
        return wait

    def answered(self, now: float, check_interval: float) -> None:
        self.up = True
        self.next_check = now + check_interval

    @property
    def last_good(self) -> Loaded | None:
        return self.good[0] if self.good else None

    def loaded(self, serving: Loaded | None, good: Loaded | None = None) -> None:
        """What the engine holds now; `good` passed its canary: the newest rollback target."""
        self.serving = serving
        if good is not None:
            older = tuple(g for g in self.good if (g.name, g.path) != (good.name, good.path))
            self.good = (good, *older)[:HISTORY]
