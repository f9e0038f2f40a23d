"""Shared by the benchmarks: percentiles, a tiny checkpoint writer, and the scripted engine
from the tests (a stand-in that answers at once, so only the daemon's own time is measured)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests package: its fakes


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99), "mean": statistics.fmean(values)}


def emit(result: dict[str, object]) -> dict[str, object]:
    print(json.dumps(result))
    return result


def write_checkpoint(
    directory: Path, *, shards: int, total_bytes: int, seed: int = 0, version: str | None = None
) -> None:
    """Random float32 shards adding up to about `total_bytes`, with our manifest (blake3)."""
    import numpy as np
    from safetensors.numpy import save_file
    from tests.support.checkpoints import write_manifest

    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    per_shard = max(4, total_bytes // shards // 4)
    for i in range(shards):
        tensors = {f"layer.{i}.weight": rng.standard_normal(per_shard, dtype=np.float32)}
        save_file(tensors, str(directory / f"model-{i:05d}-of-{shards:05d}.safetensors"))
    (directory / "config.json").write_text("{}")
    write_manifest(directory, overrides={"version": version or directory.name})
