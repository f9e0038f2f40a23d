"""Responsiveness while a big checkpoint is gated: the longest gap between systemd watchdog
pings and the slowest `status` answer, the daemon as systemd runs it (a subprocess, a real
NOTIFY_SOCKET, a real control socket, the scripted engine so only the daemon is measured).

Baselines, same run: the ping interval the daemon was given (half of WATCHDOG_USEC) and
`status` answered while the daemon is idle. The gate reads the bytes the engine's startup
checkpoint holds, linked (not copied) under a new name, page cache warm.

    .venv/bin/python bench/responsive.py [--gb 16 --shards 8]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from _common import emit, write_checkpoint


def _link_copy(source: Path, target: Path) -> None:
    target.mkdir(parents=True)
    for path in source.iterdir():
        os.link(path, target / path.name)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=16.0)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--watchdog-ms", type=int, default=2000, help="WatchdogSec: pings every half of it")
    args = parser.parse_args(argv)

    from tests.support.engine_fixtures import DaemonProcess, daemon_config
    from tests.support.fake_engine import FakeEngine, FakeEngineServer

    from vllm_reloader.service import control

    with tempfile.TemporaryDirectory(prefix="vllm-reloader-bench-") as scratch:
        base = Path(scratch)
        write_checkpoint(
            base / "staging", shards=args.shards, total_bytes=int(args.gb * 1e9), version="step-1"
        )
        _link_copy(base / "staging", base / "root" / "step-1")
        subprocess.run(
            ["cat", *map(str, (base / "staging").glob("*.safetensors"))],
            stdout=subprocess.DEVNULL,
            check=True,
        )
        server = FakeEngineServer(FakeEngine(startup=str(base / "root" / "step-1")))
        notify_path = base / "notify.sock"
        pings: list[float] = []
        ready = threading.Event()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        listener.bind(str(notify_path))
        listener.settimeout(0.2)
        done = threading.Event()

        def listen() -> None:
            while not done.is_set():
                try:
                    fields = listener.recv(65536).decode().split("\n")
                except TimeoutError:
                    continue
                if "WATCHDOG=1" in fields:
                    pings.append(time.monotonic())
                if "READY=1" in fields:
                    ready.set()

        threading.Thread(target=listen, daemon=True).start()
        config = daemon_config(
            base / "daemon.toml", root=base / "root", engine_url=server.url, state_dir=base / "s"
        )
        env = {"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": str(args.watchdog_ms * 1000)}
        daemon = DaemonProcess(config, env=env)
        sock = base / "s" / "control.sock"
        try:
            assert ready.wait(60), "no READY=1"

            def ask() -> tuple[float, dict[str, object]]:
                started = time.perf_counter()
                answer = control.call(sock, "status")
                return time.perf_counter() - started, answer

            idle = [ask()[0] for _ in range(20)]
            _link_copy(base / "staging", base / "root" / ".stage")
            started = time.monotonic()
            os.rename(base / "root" / ".stage", base / "root" / "step-2")
            busy: list[float] = []
            progress: list[object] = []
            while not busy or not daemon.events("checkpoint.ready", name="step-2"):
                seconds, answer = ask()
                busy.append(seconds)
                if answer.get("gating"):
                    progress.append(answer["gating"])
                time.sleep(0.05)
                assert time.monotonic() - started < 600, "the gate did not finish"
            ended = time.monotonic()
            gate_ms = daemon.events("checkpoint.ready", name="step-2")[-1]["gate_ms"]
            window = [t for t in pings if started - 2 <= t <= ended + 2]
            gaps = [b - a for a, b in itertools.pairwise(window)]
        finally:
            done.set()
            daemon.stop()
            server.close()
            listener.close()
        shutil.rmtree(base / "root", ignore_errors=True)
    interval = args.watchdog_ms / 2000
    gap = max(gaps, default=0.0)
    return emit(
        {
            "benchmark": "responsive", "gb": args.gb, "shards": args.shards,
            "gate_s": round(float(gate_ms) / 1000, 2),  # type: ignore[arg-type]
            "watchdog_interval_s": interval, "max_watchdog_gap_s": round(gap, 3),
            "watchdog_pings_during_gate": len(window),
            "status_max_ms": round(max(busy) * 1000, 1),
            "status_p50_ms": round(statistics.median(busy) * 1000, 1),
            "idle_status_max_ms": round(max(idle) * 1000, 1), "status_answers_during_gate": len(busy),
            "progress_seen": bool(progress), "ratio_gap_vs_interval": round(gap / interval, 3),
        }
    )  # fmt: skip


if __name__ == "__main__":
    main()
