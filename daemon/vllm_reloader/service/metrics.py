"""Prometheus metrics, served from `[metrics] listen` (off by default).

A registry of its own, so nothing else in the process leaks into the scrape and tests can
make as many as they like. Updated only from the main loop. What is one engine's carries an
`engine` label (its URL): a host may run several.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ..errors import ConfigError

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
        self.rollback_ready = Gauge(
            "vllm_reloader_rollback_ready",
            "1 while an intact checkpoint to roll back to exists, 0 when none is left",
            ["engine"],
            registry=r,
        )

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
