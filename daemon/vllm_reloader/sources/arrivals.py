"""When each version with no step arrived, remembered across restarts: its place in the order.

A trainer's `save_model` output (no manifest step, no trainer step, no number in its name)
copied in after a stepped version is newer than it: a step-less version orders after the
highest step known when it arrived (its floor), and after every step-less one that arrived
before it (`order.Arrival`). One that was already there the first time a state directory
kept arrivals (a new host, or an upgrade) has none: nothing says when it came, so it orders
by name, before every stepped one, as before.

One table for both sources (the root's catalog on the main loop, the object store's thread),
keyed by the version's name (a download placed as `NAME@…` is NAME's), in the record store;
thread-safe. A name is forgotten by the source it is listed in (the object store when there
is one, else the root) when the name is gone: as many entries as the source has versions.
What serves keeps its place in its own record (`Loaded.arrival`).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Any

from ..checkpoint import order
from ..records import RecordStore

KIND = "arrival"
META = "arrivals"


class Arrivals:
    def __init__(self, records: RecordStore) -> None:
        self.records = records
        self._lock = threading.Lock()
        self.fresh = records.meta(META) is None
        """No arrivals were kept before this start: what each source lists first was there."""
        self._table = {name: _parsed(value) for name, value in records.all(KIND).items()}
        self._next = 1 + max((a[1] for a in self._table.values() if a is not None), default=0)

    def of(self, name: str) -> order.Arrival | None:
        with self._lock:
            return self._table.get(order.base_name(name))

    def placed(self, candidate: order.Candidate, *, floor: int, first: bool) -> order.Candidate:
        """`candidate` with its arrival. A step-less name seen for the first time arrives now,
        after `floor` (the highest step known), unless this is its source's `first` listing
        since arrivals were kept (then it was there before: none)."""
        if candidate.step is not None:
            return candidate
        name = candidate.base
        with self._lock:
            if name not in self._table:
                arrival = None if first and self.fresh else (floor, self._next)
                self._next += arrival is not None
                self._table[name] = arrival
                self.records.put(KIND, name, None if arrival is None else list(arrival))
            return replace(candidate, arrival=self._table[name])

    def started(self) -> None:
        """The root's first listing is in the table: from now on what is new arrived."""
        if self.records.meta(META) is None:
            self.records.set_meta(META, "1")

    def snapshot(self) -> Mapping[str, order.Arrival | None]:
        with self._lock:
            return dict(self._table)

    def forget(self, name: str) -> None:
        """Its source no longer has it: if it comes back, it arrives again (newer)."""
        with self._lock:
            if self._table.pop(name, 0) != 0:
                self.records.delete(KIND, name)

    def keep_only(self, names: Collection[str]) -> None:
        """Its source's first listing: names gone while the daemon was down are forgotten."""
        with self._lock, self.records.transaction():
            for name in [n for n in self._table if n not in names]:
                del self._table[name]
                self.records.delete(KIND, name)


def _parsed(value: Any) -> order.Arrival | None:
    """A stored arrival; anything else (a hand edit, a corrupt row) as none."""
    if isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value):
        return (value[0], value[1])
    return None
