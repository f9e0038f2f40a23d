"""Gate cost vs checkpoint size: header-only, and with digests + the NaN scan.

Baseline, same run, same (page-cached) files: the fastest of hashlib sha256 in threads,
blake3 in threads, and `cat FILES > /dev/null` — reading the bytes at all. The ratio is the
gate's throughput over that: 1.0 would mean checking costs no more than reading once.

    .venv/bin/python bench/gate.py [--sizes-mb 10,100,1000] [--shards 1,8,64] [--threads 4]
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3
from _common import emit, write_checkpoint

from vllm_reloader.checkpoint import gate


def _timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def _hash_all(files: list[Path], make: Callable[[], Any], threads: int) -> None:
    def one(path: Path) -> None:
        state = make()
        with path.open("rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                state.update(chunk)
        state.hexdigest()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, files))


def _case(size_mb: int, shards: int, threads: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="vllm-reloader-bench-") as scratch:
        directory = Path(scratch) / "step-1"
        write_checkpoint(directory, shards=shards, total_bytes=size_mb * 1_000_000)
        files = sorted(directory.glob("*.safetensors"))
        total = sum(p.stat().st_size for p in files)
        _hash_all(files, blake3.blake3, threads)  # warm the page cache
        headers = gate.GateOptions(verify_digests=False, check_finite=False)
        full = gate.GateOptions(digest_threads=threads)
        header_s = min(_timed(lambda: gate.check(directory, serving=None, options=headers)) for _ in range(3))
        full_s = min(_timed(lambda: gate.check(directory, serving=None, options=full)) for _ in range(2))
        cat = ["cat", *map(str, files)]
        baselines = {
            "sha256": _timed(lambda: _hash_all(files, hashlib.sha256, threads)),
            "blake3": _timed(lambda: _hash_all(files, blake3.blake3, threads)),
            "cat": _timed(lambda: subprocess.run(cat, stdout=subprocess.DEVNULL, check=True)),
        }
    fastest = min(baselines, key=lambda k: baselines[k])
    return {
        "benchmark": "gate", "mb": round(total / 1e6), "shards": shards,
        "headers_ms": round(header_s * 1000, 2),
        "full_gb_per_s": round(total / full_s / 1e9, 2),
        "baseline": fastest, "baseline_gb_per_s": round(total / baselines[fastest] / 1e9, 2),
        "ratio": round(baselines[fastest] / full_s, 3),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="10,100,1000")
    parser.add_argument("--shards", default="1,8,64")
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args(argv)
    return [
        emit(_case(size_mb, shards, args.threads))
        for size_mb in (int(s) for s in args.sizes_mb.split(","))
        for shards in (int(s) for s in args.shards.split(","))
    ]


if __name__ == "__main__":
    main()
