"""Which checkpoint is newer, and which to try next: a pure function of what is known, no I/O.

Candidates are ordered by manifest `step`, then by directory name in natural order
(`step-9` < `step-10`); a candidate without a step sorts before every stepped one.
Only a candidate strictly newer than the one serving is ever loaded, newest first, so
checkpoints that became ready during a reload are coalesced into one reload to the newest,
and the serving version never moves backwards by itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

OrderKey = tuple[int, int, tuple[tuple[int, int | str], ...]]

_DIGITS = re.compile(r"([0-9]+)")


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """`step-9` < `step-10`: runs of ASCII digits compare as numbers, the rest (other
    scripts' digits included) as text."""
    return tuple(
        (0, int(part)) if _DIGITS.fullmatch(part) else (1, part) for part in _DIGITS.split(name) if part
    )


def order_key(name: str, step: int | None) -> OrderKey:
    return (0 if step is None else 1, step or 0, natural_key(name))


@dataclass(frozen=True)
class Candidate:
    name: str
    step: int | None
    fingerprint: str
    """sha256 of the manifest bytes, "" when there is no readable manifest yet."""

    @property
    def key(self) -> OrderKey:
        return order_key(self.name, self.step)


def to_try(
    candidates: Mapping[str, Candidate],
    *,
    serving: OrderKey | None,
    rejected: Mapping[str, str],
) -> list[Candidate]:
    """Candidates worth gating now, newest first.

    `serving` is the serving checkpoint's key (None: the engine serves something outside
    the root, so every candidate is newer). `rejected` maps name → the manifest fingerprint
    it was rejected with; such a candidate comes back only once its manifest changed.
    """
    eligible = [
        c
        for c in candidates.values()
        if (serving is None or c.key > serving) and rejected.get(c.name) != c.fingerprint
    ]
    return sorted(eligible, key=lambda c: c.key, reverse=True)
