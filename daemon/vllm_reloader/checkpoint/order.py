"""Which checkpoint is newer, and which to try next: a pure function of what is known, no I/O.

Candidates are ordered by step (a manifest's, a trainer's), then by name in natural order
(`step-9` < `step-10`). One with no step orders by its arrival (`Arrival`, kept by
`sources.arrivals`): after the highest step known when it arrived, and after every step-less
one that arrived before it; one that was there before anything was watching (no arrival)
sorts before every stepped one. Only a candidate
newer than the one serving is ever loaded, newest first, so checkpoints that became ready
during a reload are coalesced into one reload to the newest, and the serving version never
moves backwards by itself.

A version is its content (its fingerprint), not its name: the serving name rewritten with
other content was published after what serves, so it is newer whatever its step. A download
of a name is placed as `NAME@<first 16 hex of its fingerprint>`, so two contents of one name
never share a directory; such a directory orders (and is rejected) by `NAME`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

NaturalKey = tuple[tuple[int, int | str], ...]
OrderKey = tuple[int, int, int, NaturalKey]
Arrival = tuple[int, int]
"""A step-less version's place: (the highest step known when it arrived, its arrival number)."""

_DIGITS = re.compile(r"([0-9]+)")
_PLACED = re.compile(r"(?P<base>.+)@(?P<fingerprint>[0-9a-f]{16})")
PLACED_FINGERPRINT_CHARS = 16


def placed_name(name: str, fingerprint: str) -> str:
    """The directory a download of `name` with this content is placed in."""
    return f"{name}@{fingerprint[:PLACED_FINGERPRINT_CHARS]}"


def split_placed(directory: str) -> tuple[str, str]:
    """(name, fingerprint prefix) of a placed download's directory; (directory, "") for any other."""
    found = _PLACED.fullmatch(directory)
    return (found["base"], found["fingerprint"]) if found else (directory, "")


def base_name(directory: str) -> str:
    """The version's name: a placed download's directory without its fingerprint."""
    return split_placed(directory)[0]


def natural_key(name: str) -> NaturalKey:
    """`step-9` < `step-10`: runs of ASCII digits compare as numbers, the rest (other
    scripts' digits included) as text."""
    return tuple(
        (0, int(part)) if _DIGITS.fullmatch(part) else (1, part) for part in _DIGITS.split(name) if part
    )


def order_key(name: str, step: int | None, arrival: Arrival | None = None) -> OrderKey:
    if step is not None:
        return (1, step, 0, natural_key(name))
    if arrival is not None:  # after every version of its floor's step, in arrival order
        return (1, arrival[0], 1, ((0, arrival[1]),))
    return (0, 0, 0, natural_key(name))


def floor_of(
    candidates: Iterable[Candidate], serving: OrderKey | None, rejected: Mapping[str, Collection[str]]
) -> int:
    """The floor of a step-less version arriving now: the highest step known (a step-less
    arrival's floor included), what serves included, a rejected content's aside."""
    keys = [c.key for c in candidates if c.fingerprint not in rejected.get(c.base, ())]
    return max((key[1] for key in (*keys, serving) if key is not None and key[0] == 1), default=0)


@dataclass(frozen=True)
class Candidate:
    name: str
    """Its directory (or, in an object store, its prefix)."""
    step: int | None
    fingerprint: str
    """What its content is (`completeness.fingerprint`), "" while nothing readable says."""
    published: float = math.inf
    """When this copy of its name was placed (a directory's mtime); inf: the store's current one."""
    arrival: Arrival | None = None
    """With no step: when it arrived (None: before anything watched)."""

    @property
    def base(self) -> str:
        return base_name(self.name)

    @property
    def key(self) -> OrderKey:
        return order_key(self.base, self.step, self.arrival)


@dataclass(frozen=True)
class Serving:
    """What serves, as candidates are compared with it."""

    key: OrderKey | None
    """Its place in the order; None: outside the root (every candidate is newer)."""
    name: str = ""
    fingerprint: str = ""
    """"" when unknown (a startup model): then only the order counts."""
    served_before: frozenset[str] = frozenset()
    """Contents of the same name that served before this one (older: never newer again)."""
    published: float = 0.0
    """When the serving copy was placed (0: unknown)."""

    def replaced_by(self, candidate: Candidate) -> bool:
        """Whether `candidate` is newer: later in the order, or the serving name's content
        published after it — its own directory rewritten, or another copy placed later (never
        one that served before)."""
        if self.key is None or candidate.key > self.key:
            return True
        old = ("", self.fingerprint, *self.served_before)
        if not self.fingerprint or candidate.base != base_name(self.name) or candidate.fingerprint in old:
            return False
        return candidate.name == self.name or candidate.published > self.published


NOTHING = Serving(None)


def to_try(
    candidates: Mapping[str, Candidate],
    *,
    serving: Serving,
    rejected: Mapping[str, Collection[str]],
) -> list[Candidate]:
    """Candidates worth gating now, newest first.

    `rejected` maps a version's name → the fingerprints of its contents that were rejected;
    such a candidate comes back only with other content.
    """
    eligible = [
        c
        for c in candidates.values()
        if serving.replaced_by(c) and c.fingerprint not in rejected.get(c.base, ())
    ]
    return sorted(eligible, key=lambda c: c.key, reverse=True)
