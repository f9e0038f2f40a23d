"""What operators and systemd see, assembled on the loop from the facts' owners: the `status`
snapshot (the reloader's, the adapters', the object store's), and each turn's report to
systemd — READY once the canary engine was reconciled, STATUS as it changes, WATCHDOG only
while the daemon is healthy — with, once a second, the metrics of what waits.
"""

from __future__ import annotations

import dataclasses
import time

from ..config import Config
from ..sources.remote import RemoteSource
from ..sources.verdicts import WAITING_FOR_CANARIES
from . import status
from .adapters import Adapters
from .notify import Notifier
from .reloader import Reloader


def snapshot(
    reloader: Reloader, adapters: Adapters, remote: RemoteSource | None, newer: bool
) -> status.Snapshot:
    """The reloader's view, the adapters', and the object store's (what waits there is newer
    than what any engine serves: the store lists only such; one waiting on canary hosts is said
    by its own alert). `newer`: what each engine has yet to serve."""
    found = reloader.snapshot(newer)
    found = dataclasses.replace(found, adapters=adapters.snapshot(reloader.engines.all))
    if remote is None:
        return found
    pending = remote.pending
    waiting = {n for n, why in pending.items() if not why.startswith(WAITING_FOR_CANARIES)}
    held = not newer or found.pinned is not None
    return dataclasses.replace(
        found,
        pending={**found.pending, **pending},
        engines=tuple(
            e
            if held or not e.reachable
            else dataclasses.replace(e, newer=tuple(sorted({*e.newer, *waiting})))
            for e in found.engines
        ),
        source_url=remote.config.source.path,
        source_failing=dict(remote.problems),
    )


RESEND_S = 0.5
"""A datagram systemd did not take (its queue full) is sent again this soon, the loop woken
for it: a READY=1 or STATUS= lost is otherwise only sent again at the next turn, which on an
idle daemon may be a check interval away, and a start job waits for READY=1."""
PING_S = 1.0
"""WATCHDOG=1 and EXTEND_TIMEOUT_USEC at most this often. One of each per turn of the loop
filled a notify queue of 10 datagrams (the kernel's default `net.unix.max_dgram_qlen`) in a
busy second, and what came next (the STATUS that named the served version, READY=1) was
dropped."""


class Reporting:
    """systemd's view of the daemon, told at every turn of the loop."""

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier
        self.ready_sent = False
        self.last_status = ""
        """The STATUS= systemd last took."""
        self.next_observe = 0.0
        self.next_ping = 0.0
        self.resend_at: float | None = None
        """When to turn again for a datagram systemd did not take; None: all were taken."""

    def turn(
        self,
        config: Config,
        reloader: Reloader,
        adapters: Adapters,
        remote: RemoteSource | None,
        healthy: bool,
    ) -> None:
        """systemd's status and watchdog; once a second, with `[metrics] listen`, the metrics of
        what waits (one snapshot for both)."""
        observe = config.metrics.listen is not None and time.monotonic() >= self.next_observe
        if not observe and not self.notifier.enabled:
            return
        found = snapshot(reloader, adapters, remote, newer=observe)
        if observe:
            self.next_observe = time.monotonic() + 1.0
            reloader.metrics.observe(found, time.time())
        if self.notifier.enabled:
            self._tell(config, reloader, status.line(found), healthy)

    def _tell(self, config: Config, reloader: Reloader, now: str, healthy: bool) -> None:
        clock, taken, engines = time.monotonic(), True, reloader.engines
        if not self.ready_sent and reloader.served.reconciled and engines.idle(engines.canary):
            # Until it is taken: a READY=1 dropped (systemd's queue full) would leave the start
            # job waiting, and systemd would kill the daemon at TimeoutStartSec.
            self.ready_sent = taken = self.notifier.ready(now)
            self.last_status = now if taken else self.last_status
        if taken and now != self.last_status:  # (a READY=1 not taken carried it: again with it)
            taken = self.notifier.status(now)
            self.last_status = now if taken else self.last_status
        if clock >= self.next_ping:
            extended = self.ready_sent or self.notifier.extend_timeout(config.engine.retry_max + 30)
            pinged = extended and (not healthy or self.notifier.watchdog())
            interval = min(PING_S, (self.notifier.watchdog_interval or PING_S) / 2)  # a short WatchdogSec
            self.next_ping = clock + (interval if pinged else RESEND_S)
            taken = taken and pinged
        self.resend_at = None if taken else clock + RESEND_S


def reload_budget(config: Config) -> float:
    """The longest a reload may take, all its timeouts added: longer, the daemon is not healthy."""
    engine, readiness = config.engine, config.readiness
    drain = readiness.grace + readiness.drain_timeout if readiness.drain else 0.0
    canary = config.canary  # the probe's tokens asked before the pause, then its answer
    probe = len(canary.prompts) * engine.timeout + canary.probe_timeout if canary.probe else 0.0
    return drain + probe + engine.pause_timeout + 2 * engine.reload_timeout + 6 * engine.timeout
