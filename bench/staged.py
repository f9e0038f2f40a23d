"""Complete → reload call for a checkpoint written shard after shard into the root, manifest
last — as a trainer writes one. The daemon reads each shard once its writer closed it
(verified while written), so when the manifest lands little is left to read.

Measured by the daemon itself (`detect_ms` of `reload.started`: manifest written → reload
call), against a warm `cat` of the whole checkpoint in the same run, and against the same
checkpoint appearing all at once (renamed in whole, page cache warm: nothing read before;
from the rename to `reload.started`'s timestamp), and published by `vllm-reloader publish`.
The scripted engine answers at once, so only the daemon's share is measured.

`--scans host,engine` runs each case with `[gate] scan` so: with `engine` the scripted engine
runs the worker extension (its probe answers that it scanned), so the gate only hashes and
reads the headers; the whole checkpoint's complete → reload call is then also compared with
blake3 alone over the same files, in the same run.

    .venv/bin/python bench/staged.py [--gb 1,8,16 --shards 8 --pace-mb-s 0 --dtypes BF16 --scans host]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import blake3
from _common import emit, hash_all, write_checkpoint

if TYPE_CHECKING:
    from tests.support.fake_engine import FakeEngine


def _manifest(source: Path, target: Path, version: str, step: int) -> None:
    manifest = json.loads((source / "manifest.json").read_text())
    manifest.update(version=version, step=step)
    (target / "manifest.json").write_text(json.dumps(manifest))


def _copy(source: Path, target: Path, pace_mb_s: float) -> None:
    """One file at a time, closed before the next, at `pace_mb_s` (0: as fast as it goes)."""
    started = time.monotonic()
    written = 0
    with source.open("rb") as fin, target.open("wb") as fout:
        while chunk := fin.read(64 << 20):
            fout.write(chunk)
            written += len(chunk)
            if pace_mb_s and (ahead := written / (pace_mb_s * 1e6) - (time.monotonic() - started)) > 0:
                time.sleep(ahead)


def _engine(startup: Path, scan: str) -> FakeEngine:
    from tests.support.fake_engine import FakeEngine

    engine = FakeEngine(startup=str(startup))
    if scan == "engine":  # the extension's probe, which says it read every parameter
        engine.extension = True
        engine.probe_answers = [
            {"available": True, "logits": True, "finite": True, "flat": False, "max_abs": 9.5,
             "device": "cpu", "non_finite": None, "scanned_bytes": 1}
        ]  # fmt: skip
    return engine


def _case(
    gb: float, shards: int, pace_mb_s: float, dtype: str = "BF16", scan: str = "host"
) -> dict[str, object]:
    from tests.support.engine_fixtures import DaemonProcess, daemon_config
    from tests.support.fake_engine import FakeEngineServer

    from vllm_reloader.tools.publish import publish

    with tempfile.TemporaryDirectory(prefix="vllm-reloader-bench-") as scratch:
        base = Path(scratch)
        staging, root = base / "staging", base / "root"
        write_checkpoint(staging, shards=shards, total_bytes=int(gb * 1e9), dtype=dtype)
        (root / "step-1").mkdir(parents=True)
        for path in staging.iterdir():
            if path.name != "manifest.json":
                os.link(path, root / "step-1" / path.name)
        _manifest(staging, root / "step-1", "step-1", 1)
        shard_files = sorted(staging.glob("*.safetensors"))
        cat = ["cat", *map(str, shard_files)]
        subprocess.run(cat, stdout=subprocess.DEVNULL, check=True)
        cat_s = min(_timed_cat(cat) for _ in range(3))
        blake3_s = min(_timed_blake3(shard_files) for _ in range(2))
        server = FakeEngineServer(_engine(root / "step-1", scan))
        config = daemon_config(
            base / "daemon.toml", root=root, engine_url=server.url, state_dir=base / "s",
            engine_extra=f'[gate]\nscan = "{scan}"\n',
        )  # fmt: skip
        daemon = DaemonProcess(config)
        try:
            daemon.wait_for("engine.reconciled", version="step-1")
            # Staged: shard after shard into the candidate directory, the manifest last.
            (root / "step-2").mkdir()
            for path in sorted(staging.iterdir()):
                if path.name != "manifest.json":
                    _copy(path, root / "step-2" / path.name, pace_mb_s)
            _manifest(staging, root / "step-2", "step-2", 2)
            staged = daemon.wait_for("reload.started", version="step-2", timeout=600)
            ready = daemon.events("checkpoint.ready", name="step-2")[-1]
            # All at once: the same bytes copied in whole elsewhere, then renamed in.
            shutil.copytree(staging, base / "whole")
            _manifest(staging, base / "whole", "step-3", 3)
            os.sync()  # written back first: neither the gate nor blake3 competes with the writeback
            subprocess.run(
                ["cat", *map(str, (base / "whole").glob("*.safetensors"))], stdout=subprocess.DEVNULL
            )
            renamed = time.time()  # complete from here: its manifest was written before the warm-up
            os.rename(base / "whole", root / "step-3")
            whole = daemon.wait_for("reload.started", version="step-3", timeout=600)
            whole_gate = daemon.events("checkpoint.ready", name="step-3")[-1]
            # blake3 again, over the files the gate just read (still in the page cache).
            blake3_s = min(blake3_s, _timed_blake3(sorted((root / "step-3").glob("*.safetensors"))))
            # Published: `vllm-reloader publish` copies the shards in (each read as it closes,
            # while the rest are copied and synced), then its manifest and the rename.
            publish(staging, root, step=4)
            published = daemon.wait_for("reload.started", version="step-4", timeout=600)
        finally:
            daemon.stop()
            server.close()
    staged_s = float(staged["detect_ms"]) / 1000  # type: ignore[arg-type]
    whole_s = datetime.fromisoformat(str(whole["timestamp"])).timestamp() - renamed
    whole_gate_s = float(whole_gate["gate_ms"]) / 1000  # type: ignore[arg-type]
    published_s = float(published["detect_ms"]) / 1000  # type: ignore[arg-type]
    return {
        "benchmark": "staged", "gb": gb, "shards": shards, "dtype": dtype, "pace_mb_s": pace_mb_s or None,
        "scan": scan, "blake3_s": round(blake3_s, 3), "ratio_whole_vs_blake3": round(whole_s / blake3_s, 3),
        "staged_complete_to_reload_s": round(staged_s, 3), "cached_bytes": ready.get("cached_bytes"),
        "whole_complete_to_reload_s": round(whole_s, 3), "cat_s": round(cat_s, 3),
        "whole_gate_s": round(whole_gate_s, 3), "ratio_gate_vs_blake3": round(whole_gate_s / blake3_s, 3),
        "published_complete_to_reload_s": round(published_s, 3),
        "ratio": round(staged_s / cat_s, 3), "ratio_whole": round(whole_s / cat_s, 3),
        "ratio_published": round(published_s / cat_s, 3),
    }  # fmt: skip


def _timed_blake3(files: list[Path]) -> float:
    """blake3 alone over the files, 4 files at a time: each file on all cores or on one
    thread, read 16 or 2 MiB at a time, whichever is fastest here (the baseline is the best
    blake3 does, not the gate's own way)."""
    found = []
    for threads in (blake3.blake3.AUTO, 1):
        for buffer_bytes in (16 << 20, 2 << 20):
            started = time.perf_counter()
            hash_all(files, lambda: blake3.blake3(max_threads=threads), 4, buffer_bytes)  # noqa: B023
            found.append(time.perf_counter() - started)
    return min(found)


def _timed_cat(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", default="1,8,16")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument(
        "--pace-mb-s", type=float, default=0.0, help="the writer's pace; 0: as fast as it goes"
    )
    parser.add_argument("--dtypes", default="BF16", help="comma-separated safetensors dtypes")
    parser.add_argument("--scans", default="host", help="comma-separated `[gate] scan` values")
    args = parser.parse_args(argv)
    return [
        emit(_case(float(gb), args.shards, args.pace_mb_s, dtype, scan))
        for scan in args.scans.split(",")
        for dtype in args.dtypes.split(",")
        for gb in args.gb.split(",")
    ]


if __name__ == "__main__":
    main()
