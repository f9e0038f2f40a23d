"""The reloader: the host's checkpoints, from what is on disk to a verdict and what it means.

It owns the `Catalog` (what is on disk), the gate in flight, the book of what must survive a
restart (`book`) and the engines' base weights (`loads`, the planner their schedulers ask).
The daemon's loop feeds it and calls `tick`; it never waits on an engine or a checkpoint's
bytes: gates run on their own thread (`gating`), and every engine call on the engine's own,
started by its scheduler (`scheduler`).

Several engines: one gate per checkpoint, loaded on the first engine (the canary engine)
first; the others follow once it passed there (`rollout`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

from .. import log
from ..checkpoint import gate, order
from ..config import Config
from ..engine.client import EngineClient
from ..records import RecordStore
from ..sources.arrivals import Arrivals
from ..sources.verdicts import Verdict
from . import fleet, rollout, status
from .book import Book
from .catalog import Catalog
from .engine import Engine
from .engines import Engines
from .gating import GateFinished, Gater, Gating, Ready
from .jobs import Answered, Job, Outcome, WarmedUp
from .loads import Loads
from .messages import ReloadFinished
from .metrics import Metrics
from .reconcile import with_fingerprints
from .reverify import Reverified
from .served import Served
from .state import Loaded, StateRecords
from .status import Snapshot


class Reloader:
    def __init__(
        self,
        config: Config,
        post: Callable[[ReloadFinished | GateFinished | WarmedUp | Answered | Reverified], None],
        records: RecordStore,
        clients: Mapping[str, EngineClient] | None = None,
        on_verdict: Callable[[Verdict], None] | None = None,
    ) -> None:
        """`on_verdict`: told the canary engine's verdicts and the gate's rejections (`service.fleet`),
        in the transaction of the decision they tell."""
        self.config, self.log, self.records = config, log.get(), records
        state = StateRecords(records, self.log)
        convention = gate.GateOptions.from_config(config).convention
        saved = with_fingerprints(state.saved, convention)
        self.arrivals = Arrivals(records)
        self.catalog = Catalog(
            config.checkpoint_root,
            ignore=config.source.ignore,
            convention=convention,
            rejected=saved.rejected,
            pinned=saved.pinned,
            arrivals=self.arrivals,
            serving=lambda: self.served.serving_key(),
            source=str(config.source.path),
            remote=config.source.remote,
        )
        self.metrics = Metrics()
        self.engines = Engines(
            config.engine,
            (saved.serving, saved.good),
            lambda done: post(ReloadFinished(done) if isinstance(done, Outcome) else done),
            self.log,
            self.metrics,
            clients or {},
        )
        self.book = Book(
            records,
            state,
            self.catalog,
            lambda: self.engines.canary.served,
            self.metrics,
            self.log,
            on_verdict,
        )
        self.loads = Loads(config, self.engines, self.catalog, self.book, self.metrics, self.log, post)
        self.gating: Gating | None = None
        self.next_rescan = 0.0
        self.gater = Gater(post, config.gate.digest_threads)

    # -- the first engine: the canary engine, whose history is the host's ----------------------

    @property
    def canary(self) -> Engine:
        return self.engines.canary

    @property
    def served(self) -> Served:
        return self.canary.served

    @property
    def in_flight(self) -> Job | None:
        """A base reload on any engine (the canary engine's first)."""
        return next(iter(self.engines.jobs()), None)

    def jobs(self) -> list[Job]:
        return self.engines.jobs()

    @property
    def root(self) -> Path:
        return self.config.checkpoint_root

    def start(self) -> None:
        self.engines.start()
        self.gater.start()
        self.loads.targets.reverifier.start()

    def is_alive(self) -> bool:
        reverifier = self.loads.targets.reverifier
        return self.engines.is_alive() and self.gater.is_alive() and reverifier.is_alive()

    def close(self) -> None:
        if self.gating is not None:
            self.gating.cancel.set()
        self.gater.close()
        self.loads.targets.reverifier.close()
        self.engines.close()

    def reconfigure(self, config: Config) -> None:
        """SIGHUP: follow the new config (engines reconciled again, added or dropped by `urls`)."""
        old, self.config = self.config, config
        self.loads.config = config
        convention = gate.GateOptions.from_config(config).convention
        source, remote = str(config.source.path), config.source.remote
        self.catalog.configure(config.checkpoint_root, config.source.ignore, convention, source, remote)
        if config.source != old.source or config.state != old.state:
            self.next_rescan = 0.0
        if config.engine != old.engine:
            self.engines.regroup(config.engine, (self.served.serving, self.served.good))

    def next_deadline(self) -> float:
        deadlines = [self.next_rescan, *(at for s in self.engines.schedulers for at in s.deadlines())]
        if self.gating is None and (recheck := self.catalog.next_recheck()) is not None:
            deadlines.append(recheck)
        if (ready := self.loads.ready) is not None and ready.hold_until is not None:
            deadlines.append(ready.hold_until)
        return min(deadlines)

    def tick(self) -> None:
        """What is on disk looked at again, recalls noted, and the newest candidate worth it
        handed to the gate thread (never judged on the loop). What engines do is their
        schedulers' (`loads.plan`)."""
        now = time.monotonic()
        if now >= self.next_rescan:
            self.catalog.rescan()
            self.next_rescan = now + self.config.source.rescan_interval
        self.catalog.refresh_dirty()
        self.loads.recalls.note(self.engines, self.catalog.rejected_fingerprints())
        canary, served = self.canary, self.served
        if served.baseline is None or not served.reconciled or not self.engines.idle(canary):
            return
        best = self.catalog.next_to_gate(served.serving, served.serving_key(), now)
        if self.gating is not None:  # a newer one than the one being judged: judge that first
            if best is not None and best.key > self.gating.candidate.key:
                self.gating.cancel.set()
            return
        ready = self.loads.ready
        if best is not None and (ready is None or best.key > ready.candidate.key):
            options = self.loads.gate_options()
            self.gating = self.gater.submit(best, self.root / best.name, served.baseline, options)

    def snapshot(self, newer: bool = False) -> Snapshot:
        views = self.engines.views(rollout.wanted(self.served), self.catalog, time.monotonic(), newer)
        return status.snapshot_of(self.served, self.catalog, self.in_flight, self.gating, views)

    # -- inputs from the loop -------------------------------------------------------------

    def changed(self, name: str) -> None:
        self.catalog.changed(name)
        if self.gating is not None and self.gating.candidate.name == name:
            self.gating.cancel.set()  # judged on files that are no longer the ones there
        if self.loads.ready is not None and self.loads.ready.candidate.name == name:
            self.loads.ready = None  # judged again, on what is there now

    def rejected_remotely(self, name: str, version: str, reason: str, fingerprint: str, check: str) -> None:
        verdict = fleet.rejected(name, version, reason, fingerprint, {"check": check})
        self.book.reject(name, version, reason, fingerprint, verdict, check=check)

    def recalled(self, name: str, version: str, fingerprint: str, reason: str) -> None:
        """A follower: a canary host failed a version engines here serve; they go back from it."""
        self.loads.recalls.add(name, version, fingerprint, reason, self.engines)
        self.book.reject(name, version, reason, fingerprint, check=fleet.FLEET_CHECK)

    def gated(self, finished: GateFinished, *, act: bool = True) -> None:
        """A verdict came back from the gate thread: wait, reject, or load."""
        self.gating = None
        verdict, name = finished.verdict, finished.gating.candidate.name
        if not act or finished.cancelled or name not in self.catalog.candidates:
            return  # asked again at the next tick, about what is there now
        if verdict.status == "pending":
            until = time.monotonic() + self.config.source.pending_recheck_interval
            self.catalog.waiting(name, verdict.reason, until, **verdict.details)
        elif verdict.status == "rejected":
            version = verdict.manifest.version if verdict.manifest else None
            told = fleet.rejected(name, version, verdict.reason, verdict.fingerprint, verdict.details)
            self.book.reject(name, version, verdict.reason, verdict.fingerprint, told, **verdict.details)
        else:
            manifest = verdict.manifest
            assert manifest is not None
            version, size = manifest.version or order.base_name(name), verdict.bytes
            step = manifest.step if manifest.step is not None else finished.gating.candidate.step
            self.log.info(
                "checkpoint.ready",
                name=name,
                version=version,
                bytes=size,
                gate_ms=round(finished.seconds * 1000, 3),
                cached_bytes=finished.gating.progress.cached,
                host_scan=finished.gating.scans,
            )
            self.catalog.pending.pop(name, None)
            path, files = str(finished.gating.directory), dict(verdict.files)
            arrival = finished.gating.candidate.arrival if step is None else None
            loading = Loaded(
                name=name, version=version, path=path, since=0, step=step, files=files,
                fingerprint=verdict.fingerprint, arrival=arrival,
            )  # fmt: skip
            candidate = loading.candidate(verdict.fingerprint)
            self.loads.ready = Ready(candidate, loading, size, host_scanned=finished.gating.scans)

    def reverified(self, result: Reverified) -> None:
        self.loads.reverified(result)

    # -- the control socket's commands (called on the main loop) -----------------------------

    def pin(self, name: str, *, force: bool = False) -> str | None:
        return self.book.pin(name, force=force)

    def unpin(self) -> None:
        self.book.unpin()

    def check_now(self) -> None:
        """`reload`: rescan the root and ask the engines now, instead of at the next timer."""
        self.next_rescan = 0.0
        self.engines.check_now()
        self.catalog.recheck_at.clear()
