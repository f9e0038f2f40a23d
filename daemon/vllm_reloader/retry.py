"""The one retry policy: after a failure that blames nothing (an engine that did not answer, a
store that refused, a converter killed for memory, a copy the disk failed), wait, doubling from
`initial` up to `cap`, with a little jitter so a fleet of daemons does not retry in step. A
failure that blames the content is no retry: the content is rejected, by fingerprint, for good.

Engines, sources, the converter and adapters all back off with `Backoff`; none keeps a wait of
its own.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Policy:
    initial: float
    """The first wait, in seconds."""
    cap: float
    """The longest wait."""
    jitter: float = 0.1
    """Each wait is spread by up to this fraction either way (0: exact, for tests)."""

    def wait(self, failures: int) -> float:
        """The wait after the `failures`-th failure in a row (1: the first)."""
        base = min(self.cap, self.initial * 2 ** min(max(0, failures - 1), 62))  # no float overflow
        spread = base * self.jitter * (2 * random.random() - 1) if self.jitter else 0.0
        return float(round(max(0.0, min(self.cap, base + spread)), 3))


@dataclass(frozen=True)
class Failure:
    """What a failure means: `blames` the content (rejected for good) or nothing (retried)."""

    reason: str
    blames: bool = False


class Backoff(Generic[K]):
    """Waits per key (an engine, a content, an engine and a content): `failed` starts or
    doubles one, `succeeded` ends it. Used from one thread (the owner's)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._until: dict[K, tuple[float, int]] = {}

    @staticmethod
    def clock() -> float:
        return time.monotonic()

    def failed(self, key: K, at_most: float | None = None) -> float:
        """One more failure in a row: returns the wait before `key` is tried again (no longer
        than `at_most`, when given)."""
        _, failures = self._until.get(key, (0.0, 0))
        wait = self.policy.wait(failures + 1)
        wait = wait if at_most is None else min(wait, at_most)
        self._until[key] = (self.clock() + wait, failures + 1)
        return wait

    def waiting(self, key: K) -> bool:
        until = self._until.get(key)
        return until is not None and self.clock() < until[0]

    def until(self, key: K) -> float | None:
        """When `key` may be tried again (None: no failure since its last success)."""
        found = self._until.get(key)
        return None if found is None else found[0]

    def failures(self, key: K) -> int:
        return self._until.get(key, (0.0, 0))[1]

    def succeeded(self, key: K) -> None:
        self._until.pop(key, None)

    def forget(self, matches: Callable[[K], bool]) -> None:
        """End the waits of every key `matches` (an engine that restarted: try it all at once)."""
        self._until = {k: v for k, v in self._until.items() if not matches(k)}

    def next_at(self) -> float | None:
        """The earliest time a waiting key may be tried again."""
        now = self.clock()
        return min((at for at, _ in self._until.values() if at > now), default=None)
