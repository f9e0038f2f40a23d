"""End to end on a real CPU vLLM engine: publish → serving, split into its phases.

A random Llama of about `--gb` GB (bf16 on disk), served by the CPU engine; a second one with
the same layout is published and hot-reloaded. Baselines, same run: (a) the engine's own
restart on the same checkpoint (stop, start, healthy), (b) the page-cache memcpy bound
(bytes ÷ measured memcpy bandwidth of this machine), (c) on the same engine, vLLM's own
`reload_weights` against the worker extension's reader (pread into reused buffers, never a
mapping of the file), alternating, `--rounds` each; (d) the probe inside the pause, with and
without its scan of every parameter, against the extension's reload (`probe_vs_reload`).

    .venv/bin/python bench/e2e.py [--hidden 2016 --layers 12]   # ~1 GB
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import emit


def _memcpy_gb_per_s(nbytes: int) -> float:
    import numpy as np

    source = np.ones(nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    best = min(_timed_copy(source, target) for _ in range(3))
    return nbytes / best / 1e9


def _timed_copy(source, target) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    target[:] = source
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2016)  # 42 heads of 48
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--no-cold",
        action="store_true",
        help="no cold start first: a check that it runs (the restart is then cold)",
    )
    args = parser.parse_args(argv)

    from tests.support.engine_fixtures import DaemonProcess, daemon_config, start_engine

    from vllm_reloader.tools.publish import publish
    from vllm_reloader.tools.tinymodel import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="vllm-reloader-bench-") as scratch:
        base = Path(scratch)
        root = base / "root"
        publish(
            write_checkpoint(base / "a", seed=1, hidden_size=args.hidden, layers=args.layers), root, step=1
        )
        write_checkpoint(base / "b", seed=2, hidden_size=args.hidden, layers=args.layers)
        nbytes = sum(p.stat().st_size for p in (root / "step-1").glob("*.safetensors"))
        if not args.no_cold:
            start_engine(root / "step-1", base / "engine.log").stop()  # cold: not the baseline
        started = time.perf_counter()
        engine = start_engine(root / "step-1", base / "engine-2.log")
        restart_s = time.perf_counter() - started
        engine.complete()  # warm, including the logprobs path the canary takes (seconds, once)
        engine.http.post("/v1/completions", json={"prompt": "w1", "max_tokens": 1, "logprobs": 1})
        config = daemon_config(base / "d.toml", root=root, engine_url=engine.url, state_dir=base / "s")
        daemon = DaemonProcess(config)
        try:
            daemon.wait_for("engine.reconciled", version="step-1", timeout=120)
            begun = time.perf_counter()
            publish(base / "b", root, step=2)
            done = daemon.wait_for("reload.succeeded", version="step-2", timeout=600)
            total_s = time.perf_counter() - begun
            started_event = daemon.wait_for("reload.started", version="step-2")
            ready = daemon.wait_for("checkpoint.ready", version="step-2")
            daemon.stop()
            paths = [str(root / "step-1"), str(root / "step-2")]
            loaders = _compare_loaders(engine.http, paths, args.rounds)
            probes = _time_probes(engine.http, args.rounds)
        finally:
            daemon.stop()
            engine.stop()
    bandwidth = _memcpy_gb_per_s(min(nbytes, 1 << 30))
    phases = {
        k: done.get(k) for k in ("pause_ms", "reload_ms", "probe_ms", "reset_ms", "resume_ms", "canary_ms")
    }
    reload_s = float(phases["reload_ms"] or 0) / 1000
    return emit({
        "benchmark": "e2e", "bytes": nbytes, "publish_to_serving_s": round(total_s, 3),
        "detect_ms": _detect_ms(started_event, ready), "gate_ms": ready.get("gate_ms"), **phases,
        "engine_restart_s": round(restart_s, 2), "ratio_vs_restart": round(total_s / restart_s, 3),
        "memcpy_gb_per_s": round(bandwidth, 2), "memcpy_bound_ms": round(nbytes / bandwidth / 1e6, 1),
        "reload_vs_memcpy_bound": round(reload_s / (nbytes / bandwidth / 1e9), 2),
        "loader": started_event.get("loader"), **loaders, **probes,
        "probe_vs_reload": round(probes["probe_s"] / float(str(loaders["extension_reload_s"])), 3),
        "probe_scan_vs_reload": round(probes["probe_scan_s"] / float(str(loaders["extension_reload_s"])), 3),
    })  # fmt: skip


def _detect_ms(started: dict[str, Any], ready: dict[str, Any]) -> float | None:
    """Manifest written → reload started, less the gate's share of it: detection and queueing."""
    if started.get("detect_ms") is None or ready.get("gate_ms") is None:
        return None
    return round(float(started["detect_ms"]) - float(ready["gate_ms"]), 1)


def _compare_loaders(http, paths: list[str], rounds: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Median seconds of vLLM's `reload_weights` and of the extension's reader, alternating
    which goes first and which checkpoint each loads, so both see the same page cache."""
    from vllm_reloader.engine.client import EXTENSION_METHOD

    loaders = ["builtin", "extension"]
    times: dict[str, list[float]] = {name: [] for name in loaders}
    reports: list[dict[str, Any]] = []
    for i in range(rounds * len(loaders)):
        for j, loader in enumerate(loaders[i % 2 :] + loaders[: i % 2]):
            path = paths[(i + j) % 2]
            body = (
                {"method": "reload_weights", "kwargs": {"weights_path": path}}
                if loader == "builtin"
                else {"method": EXTENSION_METHOD, "kwargs": {"path": path}}
            )
            started = time.perf_counter()
            response = http.post("/collective_rpc", json=body, timeout=600)
            times[loader].append(time.perf_counter() - started)
            response.raise_for_status()
            if loader != "builtin":
                reports.append(response.json()["results"][0])
    median = {name: statistics.median(values) for name, values in times.items()}
    return {
        **{f"{name}_reload_s": round(value, 3) for name, value in median.items()},
        "extension_speedup": round(median["builtin"] / median["extension"], 3),
        "extension_wait_s": reports[-1]["wait_s"],
        "extension_allocations_after_first": sum(int(r["buffers_allocated"]) for r in reports[1:]),
        "extension_memory_growth_bytes": int(reports[-1]["memory_after"]) - int(reports[0]["memory_after"]),
    }


def _time_probes(http, rounds: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Median seconds of the probe inside a pause (as the daemon runs it, on 16 tokens), with
    and without the scan of every parameter, alternating; the pause itself not counted."""
    from vllm_reloader.engine.probe import PROBE_METHOD

    times: dict[bool, list[float]] = {False: [], True: []}
    http.post("/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
    try:
        for i in range(max(3, rounds) * 2):
            scan = bool(i % 2)
            body = {"method": PROBE_METHOD, "kwargs": {"tokens": None, "scan": scan}}
            started = time.perf_counter()
            http.post("/collective_rpc", json=body, timeout=600).raise_for_status()
            times[scan].append(time.perf_counter() - started)
    finally:
        http.post("/resume", timeout=60).raise_for_status()
    return {
        "probe_s": round(statistics.median(times[False]), 4),
        "probe_scan_s": round(statistics.median(times[True]), 4),
    }


if __name__ == "__main__":
    main()
