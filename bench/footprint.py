"""Footprint: the daemon idle for a while, watching a root of 200 checkpoints.

RSS against a baseline measured in the same run: a bare Python that imports the daemon's
modules and sleeps (what any Python daemon would cost). CPU as a fraction of wall time
(the engine is the scripted stand-in: an idle daemon's only engine traffic is the weight
version check every `engine.check_interval`).

    .venv/bin/python bench/footprint.py [--checkpoints 200] [--seconds 60]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import emit, write_checkpoint

TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args(argv)

    from tests.support.engine_fixtures import DaemonProcess
    from tests.support.fake_engine import FakeEngine, FakeEngineServer

    with tempfile.TemporaryDirectory(prefix="vllm-reloader-bench-") as scratch:
        base = Path(scratch)
        root = base / "root"
        for i in range(args.checkpoints):
            write_checkpoint(root / f"step-{i}", shards=1, total_bytes=4096, seed=i)
        server = FakeEngineServer(FakeEngine(startup=str(root / f"step-{args.checkpoints - 1}")))
        config = base / "d.toml"
        (base / "state").mkdir()  # the daemon never makes it
        config.write_text(
            f'[source]\npath = "{root}"\n[engine]\nurl = "{server.url}"\n'
            f'[state]\ndir = "{base / "state"}"\n[log]\nformat = "json"\n'
        )
        baseline = subprocess.Popen(
            [sys.executable, "-c", "import vllm_reloader.service.daemon, time; time.sleep(3600)"]
        )
        daemon = DaemonProcess(config)
        try:
            daemon.wait_for("engine.reconciled", timeout=60)
            time.sleep(1.0)
            pid = daemon.process.pid
            cpu_before, started = _cpu_seconds(pid), time.monotonic()
            time.sleep(args.seconds)
            cpu = _cpu_seconds(pid) - cpu_before
            wall = time.monotonic() - started
            rss, rss_baseline = _rss_mb(pid), _rss_mb(baseline.pid)
        finally:
            daemon.stop()
            baseline.kill()
            baseline.wait()
            server.close()
    return emit({
        "benchmark": "footprint", "checkpoints": args.checkpoints, "seconds": round(wall, 1),
        "rss_mb": round(rss, 1), "baseline_rss_mb": round(rss_baseline, 1),
        "rss_ratio": round(rss / rss_baseline, 2), "cpu_fraction": round(cpu / wall, 4),
    })  # fmt: skip


if __name__ == "__main__":
    main()
