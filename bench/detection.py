"""Detection: a complete checkpoint renamed into the root → the daemon starts its reload.

Baseline, same run, same filesystem: how long watchdog itself takes to report the same
rename (staged inside the root, as `publish` does; inotify, or a polling observer at the same
interval) — the floor no daemon built on it can beat. The daemon's figure includes gating
the checkpoint (a tiny one, digests and the NaN scan on).

    .venv/bin/python bench/detection.py [--runs 50] [--poll-interval 0.1]
"""

from __future__ import annotations

import argparse
import os
import queue
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import emit, summary, write_checkpoint


def _baseline(base: Path, runs: int, polling: bool, interval: float) -> list[float]:
    from watchdog.events import FileSystemEventHandler
    from watchdog.observers import Observer
    from watchdog.observers.polling import PollingObserver

    from vllm_reloader.sources.local import disable_move_pairing_delay

    disable_move_pairing_delay()  # the same watchdog settings as the daemon's
    root = base / "baseline"
    root.mkdir()
    seen: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()

    class Handler(FileSystemEventHandler):
        def on_moved(self, event: Any) -> None:
            seen.put((os.fsdecode(event.dest_path), time.perf_counter()))

        def on_created(self, event: Any) -> None:  # a polling observer may report a create
            seen.put((os.fsdecode(event.src_path), time.perf_counter()))

    observer = PollingObserver(timeout=interval) if polling else Observer()
    observer.schedule(Handler(), str(root), recursive=True)
    observer.start()
    latencies = []
    try:
        for i in range(runs):
            staged = root / f".stage-{i}"  # staged inside the root, as `publish` does
            write_checkpoint(staged, shards=1, total_bytes=4096, seed=i, version=f"step-{i}")
            target = root / f"step-{i}"
            started = time.perf_counter()
            os.rename(staged, target)
            while True:
                path, at = seen.get(timeout=30)
                if path == str(target) or path.startswith(str(target) + os.sep):
                    latencies.append(at - started)
                    break
    finally:
        observer.stop()
        observer.join()
    return latencies


def _daemon(base: Path, runs: int, polling: bool, interval: float) -> list[float]:
    import structlog
    from tests.support.fake_engine import FakeEngine

    from vllm_reloader import config
    from vllm_reloader.service.daemon import Daemon
    from vllm_reloader.service.jobs import Ask, Job, WarmUp

    root = base / "root"
    write_checkpoint(root / "step-0", shards=1, total_bytes=4096)
    engine = FakeEngine(startup=str(root / "step-0"))
    (base / "state").mkdir(exist_ok=True)  # the daemon never makes it
    cfg = config.Config(
        source=config.SourceConfig(path=str(root), poll=polling, poll_interval=interval),
        engine=config.EngineConfig(url="http://engine.test"),
        state=config.StateConfig(dir=base / "state"),
        canary=config.CanaryConfig(enabled=False),
    )
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())  # quiet
    daemon = Daemon(cfg, client=engine.client())
    submitted: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
    submit = daemon.reloader.engines.schedulers[0].worker.submit

    def recorded(job: Job | WarmUp | Ask) -> None:
        if isinstance(job, Job):  # a reload (the engine's thread also takes the loop's questions)
            submitted.put((job.candidate.name, time.perf_counter()))
        submit(job)

    daemon.reloader.engines.schedulers[0].worker.submit = recorded  # type: ignore[method-assign]
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    latencies = []
    try:
        while not daemon.reloader.served.reconciled:
            time.sleep(0.01)
        for i in range(1, runs + 1):
            staged = root / f".stage-{i}"
            write_checkpoint(staged, shards=1, total_bytes=4096, seed=i, version=f"step-{i}")
            started = time.perf_counter()
            os.rename(staged, root / f"step-{i}")
            name, at = submitted.get(timeout=30)
            assert name == f"step-{i}", name
            latencies.append(at - started)
            while daemon.reloader.in_flight is not None or engine.version != f"step-{i}":
                time.sleep(0.002)
    finally:
        daemon.request_stop()
        thread.join(timeout=10)
    return latencies


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--poll-interval", type=float, default=0.1)
    args = parser.parse_args(argv)
    results = []
    for mode in ("inotify", "polling"):
        polling = mode == "polling"
        with tempfile.TemporaryDirectory(prefix="vllm-reloader-bench-") as scratch:
            base = Path(scratch)
            baseline = summary(_baseline(base, args.runs, polling, args.poll_interval))
            ours = summary(_daemon(base, args.runs, polling, args.poll_interval))
        results.append(emit({
            "benchmark": "detection", "mode": mode, "runs": args.runs,
            "daemon_p50_ms": round(ours["p50"] * 1000, 2), "daemon_p99_ms": round(ours["p99"] * 1000, 2),
            "watchdog_p50_ms": round(baseline["p50"] * 1000, 2),
            "watchdog_p99_ms": round(baseline["p99"] * 1000, 2),
            "ratio_p50": round(ours["p50"] / baseline["p50"], 2),
        }))  # fmt: skip
    return results


if __name__ == "__main__":
    main()
