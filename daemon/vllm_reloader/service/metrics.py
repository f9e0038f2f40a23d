"""Prometheus metrics, served from `[metrics] listen` (off by default).

A registry of its own, so nothing else in the process leaks into the scrape and tests can
make as many as they like. Updated only from the main loop. What is one engine's carries an
`engine` label (its URL): a host may run several.

How long something has waited is exported as the unix time it started (`*_since_timestamp_seconds`),
so an alert reads `time() - x` and a scrape missed or late changes nothing; the daemon learns
those times from successive snapshots (`observe`), so a restart starts them again.
"""

from __future__ import annotations

from collections.abc import Collection

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ..errors import ConfigError
from ..sources.verdicts import WAITING_FOR_CANARIES
from .status import Snapshot

DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.reloads = Counter("vllm_reloader_reloads", "Reloads by result", ["result", "engine"], registry=r)
        self.reload_seconds = Histogram(
            "vllm_reloader_reload_duration_seconds",
            "Pause to resume",
            ["engine"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.bytes_reloaded = Counter(
            "vllm_reloader_reloaded_bytes", "Bytes of weights reloaded", ["engine"], registry=r
        )
        self.serving_step = Gauge(
            "vllm_reloader_serving_step", "Step of the serving checkpoint", ["engine"], registry=r
        )
        self.rejected = Counter(
            "vllm_reloader_rejected", "Checkpoints rejected, by the check that failed", ["check"], registry=r
        )
        self.detection_lag = Histogram(
            "vllm_reloader_detection_lag_seconds",
            "Manifest mtime to reload start",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.rollbacks = Counter(
            "vllm_reloader_rollbacks",
            "Last good checkpoint loaded back, by cause",
            ["cause", "engine"],
            registry=r,
        )
        self.serving_info = Gauge(
            "vllm_reloader_serving_info",
            "1 for the version each engine serves, by name and content fingerprint",
            ["engine", "version", "fingerprint"],
            registry=r,
        )
        self._serving_labels: dict[str, tuple[str, str]] = {}
        self.engine_up = Gauge("vllm_reloader_engine_up", "1 when the engine answers", ["engine"], registry=r)
        self.adapter_loads = Counter(
            "vllm_reloader_adapter_loads",
            "Adapter loads by result",
            ["adapter", "result", "engine"],
            registry=r,
        )
        self.adapter_rejected = Counter(
            "vllm_reloader_adapter_rejected",
            "Adapter versions rejected, by check",
            ["adapter", "check"],
            registry=r,
        )
        self.rollback_ready = Gauge(
            "vllm_reloader_rollback_ready",
            "1 while an intact checkpoint to roll back to exists, 0 when none is left",
            ["engine"],
            registry=r,
        )
        self.pending_since = Stamps(
            Gauge(
                "vllm_reloader_pending_since_timestamp_seconds",
                "Unix time since which the longest-waiting pending candidate has waited, by what for",
                ["waiting_for"],
                registry=r,
            )
        )
        self.newer_since = Stamps(
            Gauge(
                "vllm_reloader_newer_since_timestamp_seconds",
                "Unix time since which a checkpoint newer than what the engine serves has been known",
                ["engine"],
                registry=r,
            )
        )
        self._pending = Since()
        self._newer: dict[str, Since] = {}

    def observe(self, snapshot: Snapshot, now: float) -> None:
        """What waits, from the loop's snapshot of this tick (`now`: unix time); a series is
        removed while nothing waits, so an alert on it clears."""
        self._pending.update(snapshot.pending, now)
        canaries = {n for n, why in snapshot.pending.items() if why.startswith(WAITING_FOR_CANARIES)}
        for waiting_for, names in (("canary_hosts", canaries), ("files", snapshot.pending.keys() - canaries)):
            self.pending_since.put(waiting_for, self._pending.oldest(names))
        engines = {view.url: view.newer for view in snapshot.engines}
        for url in self._newer.keys() - engines.keys():  # dropped by a SIGHUP
            del self._newer[url]
            self.newer_since.put(url, None)
        for url, newer in engines.items():
            since = self._newer.setdefault(url, Since())
            since.update(newer, now)
            self.newer_since.put(url, since.oldest(newer))

    def serving(self, engine: str, version: str, fingerprint: str) -> None:
        """One series per engine: the version it serves now (the last one's is removed)."""
        old = self._serving_labels.get(engine)
        if old == (version, fingerprint):
            return
        if old is not None:
            self.serving_info.remove(engine, *old)
        self._serving_labels[engine] = (version, fingerprint)
        self.serving_info.labels(engine=engine, version=version, fingerprint=fingerprint).set(1)

    def serve(self, listen: str) -> None:
        host, _, port = listen.rpartition(":")
        try:
            start_http_server(int(port), addr=host.strip("[]") or "127.0.0.1", registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"metrics.listen {listen}: cannot listen: {exc.strerror or exc}") from exc


class Since:
    """When each name was first seen in successive observations; one that leaves is forgotten
    (back later, it waits anew)."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}

    def update(self, names: Collection[str], now: float) -> None:
        self.first = {name: self.first.get(name, now) for name in names}

    def oldest(self, names: Collection[str]) -> float | None:
        return min((self.first[name] for name in names), default=None)


class Stamps:
    """A gauge of unix times by one label: a series exists only while it has a time (removed
    only if there, as older prometheus_client raises on an absent one)."""

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge
        self.labels: set[str] = set()

    def put(self, label: str, value: float | None) -> None:
        if value is not None:
            self.gauge.labels(label).set(value)
            self.labels.add(label)
        elif label in self.labels:
            self.gauge.remove(label)
            self.labels.discard(label)
