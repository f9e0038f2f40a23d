"""The gate thread: judges one candidate at a time off the main loop.

Gating a 16 GB checkpoint reads 16 GB; a 1.5 TB one, minutes of reading. On the loop that
would stop the systemd watchdog pings and the control socket for as long (systemd kills a
daemon that stops pinging, and it would gate the same checkpoint again after the restart,
forever). So the loop only asks; the verdict comes back as a message. A gate can be called
off — its candidate changed, a newer one arrived, the daemon stops — and says how far it got.

The reading threads are made once, with the thread, not per gate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import gate, layout, order, scan, verified
from ..threads import QueueWorker
from .state import Loaded


@dataclass(frozen=True)
class Gating:
    """One candidate being judged."""

    candidate: order.Candidate
    directory: Path
    scans: bool = True
    """The gate scans for NaN/Inf (else the engines do: `[gate] scan`)."""
    cancel: threading.Event = field(default_factory=threading.Event)
    progress: scan.Progress = field(default_factory=scan.Progress)
    started: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class GateFinished:
    """The gate thread's verdict on `gating.candidate` (pending and `cancelled` if called off)."""

    gating: Gating
    verdict: gate.Verdict
    seconds: float

    @property
    def cancelled(self) -> bool:
        return bool(self.verdict.details.get("cancelled"))


@dataclass(frozen=True)
class Ready:
    """A verdict of `ready` waiting for room (`max_unavailable` engines were busy when it came),
    or for a rollback target's bytes to be read again (until `hold_until`)."""

    candidate: order.Candidate
    loading: Loaded
    size: int
    hold_until: float | None = None
    host_scanned: bool = True
    """The gate scanned it for NaN/Inf (else the engine that loads it must)."""


@dataclass(frozen=True)
class _Job:
    gating: Gating
    serving: layout.Layout | None
    options: gate.GateOptions


class Gater(QueueWorker[_Job]):
    def __init__(self, post: Callable[[GateFinished], None], threads: int) -> None:
        super().__init__("gate")
        self._post = post
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gate-read")
        self.cache = verified.Cache()
        """Shards read while their checkpoint was written, by identity (see `verified`)."""
        self._threads = threads

    def close(self, timeout: float = 5.0) -> None:
        super().close(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def submit(  # type: ignore[override]
        self,
        candidate: order.Candidate,
        directory: Path,
        serving: layout.Layout | None,
        options: gate.GateOptions,
    ) -> Gating:
        gating = Gating(candidate, directory, scans=options.check_finite)
        super().submit(_Job(gating, serving, options))
        return gating

    def prehash(self, shard: Path, max_tensors: int | None = None) -> None:
        """A writer closed `shard`: read it now, on the reading threads, beside the writing."""
        self._pool.submit(scan.prehash, shard, self.cache, max_tensors)

    def handle(self, job: _Job) -> None:
        gating = job.gating
        run = gate.Run(self._threads, self._pool, gating.cancel, gating.progress, self.cache)
        verdict = gate.check(gating.directory, serving=job.serving, options=job.options, run=run)
        self._post(GateFinished(gating, verdict, time.perf_counter() - gating.started))
