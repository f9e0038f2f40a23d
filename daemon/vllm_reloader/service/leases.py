"""What the loop's owners hold in the content store, declared whole just before the collector
runs (level-triggered: worked out from the facts of now, never remembered), and the collector's
turn itself.

Held: what each engine serves and its startup model, the work under way on it (what it loads
and what it would go back to), what adapters it holds; the rollback history; the pin; what the
gate reads and a verdict waiting to load; what would load next on any engine; each adapter's
newest, last good and the one before; and, of the other downloads and converter outputs, the
`state.keep` newest. Everything else the daemon made is collected.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..checkpoint import order
from ..sources.content import ContentStore
from .adapters import Adapters
from .reloader import Reloader

INTERVAL = 5.0
"""Seconds between the collector's turns."""


def declared(reloader: Reloader, adapters: Adapters | None, keep: int) -> dict[str, set[str]]:
    root, catalog, engines = reloader.root, reloader.catalog, reloader.engines
    held: dict[str, set[str]] = {}
    for engine in engines:  # what it serves, what a failure goes back to, its startup model
        served = engine.served
        back = [g for g in served.good if g.version == served.rollback]
        mine = {loaded.path for loaded in (served.serving, served.last_good, *back) if loaded is not None}
        held[f"engine:{engine.url}"] = mine | ({served.startup} if served.startup else set())
    for url, paths in engines.holds().items():
        held[f"engine:{url}:work"] = {p for p in paths if p is not None}
    if (restore := [e.restore.path for e in engines if e.restore is not None]) != []:
        held["restore"] = set(restore)
    held["pinned"] = {str(root / catalog.pinned)} if catalog.pinned else set()
    reading = [reloader.gating.directory if reloader.gating else None]
    if (ready := reloader.loads.ready) is not None:
        reading.append(Path(ready.loading.path))
    held["gate"] = {str(p) for p in reading if p is not None}
    newer = {name for engine in engines for name in catalog.newer_than(engine.served.serving_key())}
    held["next"] = {str(root / name) for name in newer}
    taken = set().union(*held.values())
    downloads = catalog.candidates.values() if reloader.config.source.remote else ()  # the cache
    others = sorted(
        (c for c in downloads if str(root / c.name) not in taken),
        key=lambda c: c.key,
        reverse=True,
    )
    held["kept"] = {str(root / c.name) for c in others[:keep]}
    if adapters is not None:
        held.update(adapters.facts.leases())
    return held


class Collector:
    """The content store's collector, on the loop, every `INTERVAL` seconds."""

    def __init__(self, content: ContentStore, log: Any) -> None:
        self.content, self.log = content, log
        self.next = 0.0

    def soon(self) -> None:
        """At the next turn (a download placed, a reload done: something may be let go)."""
        self.next = 0.0

    def turn(self, reloader: Reloader, adapters: Adapters | None, keep: int, *, now: bool = False) -> None:
        if not now and time.monotonic() < self.next:
            return
        self.next = time.monotonic() + INTERVAL
        self.content.declare(declared(reloader, adapters, keep))
        for kind, path in self.content.collect():
            found = Path(path)
            if kind == "adapter":
                self.log.info("content.collected", kind=kind, path=path)
                continue
            if found.parent == reloader.root:
                reloader.catalog.forget(found.name)
            self.log.info("cache.pruned", kind=kind, name=order.base_name(found.name), directory=found.name)
