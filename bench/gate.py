"""Gate cost vs checkpoint size: header-only, and the full one-pass gate (digests + NaN scan).

Baselines, same run, same page-cached files: `cat FILES > /dev/null` (reading the bytes at
all), blake3 alone on all cores (hashing them, the least a gate that verifies a digest can
do), sha256 in threads; and the two-pass gate (digests, then the NaN scan: two reads) the
one-pass gate replaced. Ratios are each baseline's time over the gate's: 1.0 would mean
checking costs no more than that baseline. The gate runs as the daemon runs it, on reading
threads made once (`gate.Run` with a long-lived pool).

    .venv/bin/python bench/gate.py [--sizes-mb 1000,8000,16000] [--shards 1,8,64] [--plot gate.png]
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

import blake3
from _common import emit, hash_all, write_checkpoint

from vllm_reloader.checkpoint import gate


def _timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def _case(
    size_mb: int, shards: int, threads: int, pool: ThreadPoolExecutor, dtype: str = "F32"
) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="vllm-reloader-bench-") as scratch:
        directory = Path(scratch) / "step-1"
        write_checkpoint(directory, shards=shards, total_bytes=size_mb * 1_000_000, dtype=dtype)
        files = sorted(directory.glob("*.safetensors"))
        total = sum(p.stat().st_size for p in files)
        cat = ["cat", *map(str, files)]
        subprocess.run(cat, stdout=subprocess.DEVNULL, check=True)  # the page cache warm
        run = gate.Run(threads, pool)

        def check(options: gate.GateOptions) -> float:
            return _timed(lambda: gate.check(directory, serving=None, options=options, run=run))

        header_s = min(check(gate.GateOptions(verify_digests=False, check_finite=False)) for _ in range(3))
        full_s = min(check(gate.GateOptions(digest_threads=threads)) for _ in range(2))
        digests_s = check(gate.GateOptions(digest_threads=threads, check_finite=False))
        finite_s = check(gate.GateOptions(digest_threads=threads, verify_digests=False))
        baselines = {
            "cat": min(
                _timed(lambda: subprocess.run(cat, stdout=subprocess.DEVNULL, check=True)) for _ in range(2)
            ),
            "blake3": min(
                _timed(
                    lambda: hash_all(files, lambda: blake3.blake3(max_threads=blake3.blake3.AUTO), threads)
                )
                for _ in range(2)
            ),
            "sha256": _timed(lambda: hash_all(files, hashlib.sha256, threads)),
        }
    fastest = min(baselines, key=lambda k: baselines[k])
    return {
        "benchmark": "gate", "mb": round(total / 1e6), "shards": shards, "dtype": dtype,
        "headers_ms": round(header_s * 1000, 2),
        "full_s": round(full_s, 3), "full_gb_per_s": round(total / full_s / 1e9, 2),
        "two_pass_s": round(digests_s + finite_s, 3),
        **{f"{name}_s": round(seconds, 3) for name, seconds in baselines.items()},
        "baseline": fastest, "baseline_gb_per_s": round(total / baselines[fastest] / 1e9, 2),
        "ratio": round(baselines[fastest] / full_s, 3),
        "ratio_vs_blake3": round(baselines["blake3"] / full_s, 3),
        "one_pass_speedup": round((digests_s + finite_s) / full_s, 3),
    }  # fmt: skip


def plot(results: list[dict[str, object]], path: Path) -> None:
    """Seconds vs GB for the gate, `cat` and blake3, one line per shard count (the first dtype)."""
    results = [r for r in results if r["dtype"] == results[0]["dtype"]]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for shards in sorted({int(r["shards"]) for r in results}):  # type: ignore[call-overload]
        rows = sorted((r for r in results if r["shards"] == shards), key=lambda r: r["mb"])  # type: ignore[arg-type,return-value]
        gb = [int(r["mb"]) / 1000 for r in rows]  # type: ignore[call-overload]
        for key, style in (("full_s", "-o"), ("blake3_s", "--"), ("cat_s", ":")):
            label = {"full_s": "gate", "blake3_s": "blake3 alone", "cat_s": "cat"}[key]
            axes.plot(gb, [r[key] for r in rows], style, label=f"{label}, {shards} shards")
    axes.set_xlabel("checkpoint size (GB)")
    axes.set_ylabel("seconds (page cache warm)")
    axes.set_title("vllm-reloader gate vs reading and hashing the same bytes")
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_dtypes(results: list[dict[str, object]], path: Path) -> None:
    """GB/s of the gate, blake3 alone and `cat` for each dtype, at the largest size measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    largest = max(int(str(r["mb"])) for r in results)
    rows = [r for r in results if r["mb"] == largest]
    dtypes = [str(r["dtype"]) for r in rows]
    gb = largest / 1000
    bars = {
        "gate (blake3 + NaN/Inf scan + headers)": [gb / float(str(r["full_s"])) for r in rows],
        "blake3 alone, all cores": [gb / float(str(r["blake3_s"])) for r in rows],
        "cat > /dev/null": [gb / float(str(r["cat_s"])) for r in rows],
    }
    figure, axes = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / len(bars)
    for i, (label, values) in enumerate(bars.items()):
        axes.bar([x + i * width for x in range(len(dtypes))], values, width, label=label)
    axes.set_xticks([x + width for x in range(len(dtypes))], dtypes)
    axes.set_ylabel("GB/s (page cache warm)")
    axes.set_title(f"The gate vs hashing and reading the same {gb:g} GB, by dtype")
    axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
    axes.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="10,100,1000")
    parser.add_argument("--shards", default="1,8,64")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument(
        "--dtypes", default="F32", help="comma-separated: F64, F32, BF16, F16, F8_E5M2, F8_E4M3"
    )
    parser.add_argument("--plot", type=Path, help="write a PNG of seconds vs GB")
    parser.add_argument("--plot-dtypes", type=Path, help="write a PNG of GB/s by dtype, largest size")
    args = parser.parse_args(argv)
    with ThreadPoolExecutor(args.threads, thread_name_prefix="gate-read") as pool:
        results = [
            emit(_case(size_mb, shards, args.threads, pool, dtype))
            for dtype in args.dtypes.split(",")
            for size_mb in (int(s) for s in args.sizes_mb.split(","))
            for shards in (int(s) for s in args.shards.split(","))
        ]
    if args.plot:
        plot(results, args.plot)
    if args.plot_dtypes:
        plot_dtypes(results, args.plot_dtypes)
    return results


if __name__ == "__main__":
    main()
