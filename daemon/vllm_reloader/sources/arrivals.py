"""When each version with no step arrived, remembered across restarts: its place in the order.

A trainer's `save_model` output (no manifest step, no trainer step, no number in its name)
copied in after a stepped version is newer than it: a step-less version orders after the
highest step known when its content was first seen (its floor), and after every step-less
one that arrived before it (`order.Arrival`). Content, not name: a name written again with
other bytes arrives again; the same bytes keep their place. One that was already there when
its source was first listed with arrivals kept (a new host, an upgrade, a new source path)
has none: nothing says when it came, so it orders by name, before every stepped one.

Placed by the one part that lists the source (the object store's thread when there is one,
else the root's catalog on the main loop); others only read (`of`: a download placed as
`NAME@…` is found as the store listed it, NAME). Thread-safe; in the record store, by source
and directory name. Never forgotten
while the daemon runs or at a start: a root that lists nothing for a while (an unmounted
share) must not make everything in it new again; the same bytes keep their place, and the
table grows only with names that never had a step. What is remembered changes only once
written (a full disk: placed again at the next look). What serves keeps its place in its
own record (`Loaded.arrival`), whatever happens here.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from ..checkpoint import order
from ..records import RecordStore

KIND = "arrival"
META = "arrivals:"
"""+ the source: set once its first listing was placed (what is new after it arrived)."""


@dataclass(frozen=True)
class _Entry:
    arrival: order.Arrival | None
    fingerprint: str


class Arrivals:
    """Each source's arrivals (a source: the root's path or the store's URL, as configured)."""

    def __init__(self, records: RecordStore) -> None:
        self.records = records
        self._lock = threading.Lock()
        self._table: dict[tuple[str, str], _Entry] = {}
        for key, value in records.all(KIND).items():
            if (where := _key(key)) is not None and isinstance(value, dict):
                self._table[where] = _Entry(_parsed(value.get("arrival")), str(value.get("fingerprint", "")))
        self._next = 1 + max((e.arrival[1] for e in self._table.values() if e.arrival), default=0)
        self._fresh: dict[str, bool] = {}

    def fresh(self, source: str) -> bool:
        """`source` was never listed with arrivals kept (as this process started): what it
        lists first was there before."""
        with self._lock:
            if source not in self._fresh:
                self._fresh[source] = self.records.meta(META + source) is None
            return self._fresh[source]

    def of(self, source: str, name: str) -> order.Arrival | None:
        with self._lock:
            found = self._table.get((source, order.base_name(name)))
            return found.arrival if found else None

    def place(
        self, source: str, batch: Iterable[order.Candidate], *, floor: int, first: bool
    ) -> dict[str, order.Candidate]:
        """The step-less candidates of `batch` (seen in one look) with their arrivals. Content
        not seen before under its name (a name new, or written again) arrives now, after
        `floor` (the highest step known, the batch's own included), unless this is the
        source's `first` listing while it is `fresh`: then it was there before, with none. A
        candidate with no content yet ("": incomplete) keeps its name's place."""
        fresh = first and self.fresh(source)
        placed: dict[str, order.Candidate] = {}
        with self._lock:
            for candidate in sorted((c for c in batch if c.step is None), key=lambda c: c.key):
                where = (source, candidate.name)  # a converter's output (NAME@…) is its own
                known = self._table.get(where)
                if known is None or (candidate.fingerprint and candidate.fingerprint != known.fingerprint):
                    arrival = None if fresh else (floor, self._next)
                    self._next += arrival is not None
                    known = self._write(where, _Entry(arrival, candidate.fingerprint))
                placed[candidate.name] = replace(candidate, arrival=known.arrival)
        return placed

    def started(self, source: str) -> None:
        """`source`'s first listing is placed: from now on what is new arrived (at the next
        start too)."""
        if self.fresh(source):
            self.records.set_meta(META + source, "1")

    def _write(self, where: tuple[str, str], entry: _Entry) -> _Entry:
        """`entry`, kept once written (else placed again at the next look)."""
        value = {"arrival": entry.arrival, "fingerprint": entry.fingerprint}
        written: list[bool] = []
        with self.records.transaction():
            self.records.put(KIND, json.dumps(where), value)
            self.records.ended(written.append)
        if written == [True]:
            self._table[where] = entry
        return entry


def _key(key: str) -> tuple[str, str] | None:
    try:
        found = json.loads(key)
    except ValueError:
        return None
    ok = isinstance(found, list) and len(found) == 2 and all(isinstance(part, str) for part in found)
    return (found[0], found[1]) if ok else None


def _parsed(value: Any) -> order.Arrival | None:
    """A stored arrival; anything else (a hand edit, a corrupt row) as none."""
    if isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value):
        return (value[0], value[1])
    return None
