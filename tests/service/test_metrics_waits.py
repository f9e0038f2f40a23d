"""`Metrics.observe`: how long things have waited, learned from successive snapshots."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import generate_latest

from vllm_reloader.service.metrics import Metrics
from vllm_reloader.service.status import EngineView, Snapshot
from vllm_reloader.sources.verdicts import WAITING_FOR_CANARIES

CANARIES = f"{WAITING_FOR_CANARIES}: 0 of 1 passed"
PENDING = "vllm_reloader_pending_since_timestamp_seconds"
NEWER = "vllm_reloader_newer_since_timestamp_seconds"


def snapshot(pending: Mapping[str, str] = {}, **newer: tuple[str, ...]) -> Snapshot:
    """`newer`: engine URL → the candidates newer than what it serves."""
    return Snapshot(
        serving=None,
        last_good=None,
        rollback=None,
        last_reload=None,
        reloading=None,
        gating=None,
        pinned=None,
        pending=dict(pending),
        rejected={},
        engines=tuple(
            EngineView(url=url, version="step-1", state="behind", reachable=True, newer=names)
            for url, names in newer.items()
        ),
        last_scan=0.0,
    )


def metrics_text(metrics: Metrics) -> str:
    return generate_latest(metrics.registry).decode()


def pending_since(metrics: Metrics, waiting_for: str) -> float | None:
    return metrics.registry.get_sample_value(PENDING, {"waiting_for": waiting_for})


def newer_since(metrics: Metrics, engine: str) -> float | None:
    return metrics.registry.get_sample_value(NEWER, {"engine": engine})


def test_pending_since_is_the_oldest_wait_kept_while_pending_and_forgotten_once_it_leaves():
    metrics = Metrics()
    metrics.observe(snapshot({"step-2": "manifest.json missing"}), now=100.0)
    assert pending_since(metrics, "files") == 100.0
    metrics.observe(snapshot({"step-2": "a shard is short", "step-3": "no manifest.json yet"}), now=200.0)
    assert pending_since(metrics, "files") == 100.0, "kept across snapshots, the oldest of the names"
    metrics.observe(snapshot({"step-3": "no manifest.json yet"}), now=300.0)
    assert pending_since(metrics, "files") == 200.0, "step-2 left: the next oldest"
    metrics.observe(snapshot({"step-2": "manifest.json missing", "step-3": "x"}), now=400.0)
    assert pending_since(metrics, "files") == 200.0
    metrics.observe(snapshot({"step-2": "manifest.json missing"}), now=500.0)
    assert pending_since(metrics, "files") == 400.0, "back after it left: it waits anew"
    metrics.observe(snapshot(), now=600.0)
    assert pending_since(metrics, "files") is None, "the series is removed while nothing waits"
    assert PENDING + "{" not in metrics_text(metrics)


def test_pending_since_tells_a_wait_on_canary_hosts_from_one_on_files():
    metrics = Metrics()
    metrics.observe(snapshot({"step-2": CANARIES}), now=100.0)
    assert pending_since(metrics, "canary_hosts") == 100.0
    assert pending_since(metrics, "files") is None
    metrics.observe(snapshot({"step-2": CANARIES, "step-3": "no manifest.json yet"}), now=200.0)
    assert (pending_since(metrics, "canary_hosts"), pending_since(metrics, "files")) == (100.0, 200.0)
    metrics.observe(snapshot({"step-3": "no manifest.json yet"}), now=300.0)
    assert (pending_since(metrics, "canary_hosts"), pending_since(metrics, "files")) == (None, 200.0)


def test_newer_since_is_per_engine_kept_while_it_does_not_serve_it_and_removed_when_nothing_is_newer():
    metrics, a, b = Metrics(), "http://a:8000", "http://b:8000"
    metrics.observe(snapshot(**{a: ("step-2",), b: ()}), now=100.0)
    assert (newer_since(metrics, a), newer_since(metrics, b)) == (100.0, None)
    metrics.observe(snapshot(**{a: ("step-2", "step-3"), b: ("step-3",)}), now=200.0)
    assert (newer_since(metrics, a), newer_since(metrics, b)) == (100.0, 200.0)
    metrics.observe(snapshot(**{a: ("step-3",), b: ("step-3",)}), now=300.0)
    assert newer_since(metrics, a) == 200.0, "it loaded step-2: behind only since step-3 came"
    metrics.observe(snapshot(**{a: (), b: ("step-3",)}), now=400.0)
    assert (newer_since(metrics, a), newer_since(metrics, b)) == (None, 200.0)
    metrics.observe(snapshot(**{a: ()}), now=500.0)
    assert newer_since(metrics, b) is None, "an engine dropped from the config loses its series"
    assert NEWER + "{" not in metrics_text(metrics)
