"""What the engine holds, as far as the daemon knows: the serving checkpoint and the last
good one, the engine's startup model and layout baseline, what it was started with, and
whether it answers (with the backoff while it does not).

One owner, the reloader on the main loop; `status` sees it through a snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checkpoint import layout, order
from .state import Loaded


@dataclass
class Served:
    serving: Loaded | None
    last_good: Loaded | None
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

    def loaded(self, serving: Loaded | None, last_good: Loaded | None = None) -> None:
        self.serving = serving
        if last_good is not None:
            self.last_good = last_good
