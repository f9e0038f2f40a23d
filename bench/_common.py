"""Shared by the benchmarks: percentiles, a tiny checkpoint writer, and the scripted engine
from the tests (a stand-in that answers at once, so only the daemon's own time is measured)."""

from __future__ import annotations

import json
import mmap
import statistics
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests package: its fakes


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99), "mean": statistics.fmean(values)}


def emit(result: dict[str, object]) -> dict[str, object]:
    print(json.dumps(result))
    return result


ELEMENT_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E5M2": 1, "F8_E4M3": 1}


def finite_bytes(rng: Any, count: int, dtype: str) -> bytes:
    """`count` random finite elements of `dtype`, as safetensors stores them."""
    import numpy as np

    if dtype.startswith("F8"):  # bit 6 clear: the exponent is never all ones
        return (rng.integers(0, 256, count, dtype=np.uint8) & np.uint8(0xBF)).tobytes()
    values = rng.random(count, dtype=np.float64 if dtype == "F64" else np.float32) - 0.5
    if dtype == "BF16":
        return (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    return values.astype({"F64": "<f8", "F32": "<f4", "F16": "<f2"}[dtype]).tobytes()


def write_checkpoint(
    directory: Path,
    *,
    shards: int,
    total_bytes: int,
    seed: int = 0,
    version: str | None = None,
    dtype: str = "F32",
) -> None:
    """Random finite shards of `dtype` adding up to about `total_bytes` (tensors of up to
    ~256 MB, as real layers), with our manifest. Written tensor by tensor and hashed as
    written: a 16 GB shard is never held in memory."""
    import struct

    import blake3
    import numpy as np

    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    size = ELEMENT_BYTES[dtype]
    per_shard = max(8, total_bytes // shards // 8 * 8)
    count = max(1, -(-per_shard // (256 << 20)))
    files = []
    for i in range(shards):
        sizes = [per_shard // count // size] * count
        header: dict[str, object] = {}
        offset = 0
        for j, n in enumerate(sizes):
            header[f"model.layers.{i}.w{j}"] = {
                "dtype": dtype,
                "shape": [n],
                "data_offsets": [offset, offset + size * n],
            }
            offset += size * n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        path = directory / f"model-{i:05d}-of-{shards:05d}.safetensors"
        digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
        with path.open("wb") as f:
            for chunk in (struct.pack("<Q", len(raw)), raw):
                f.write(chunk)
                digest.update(chunk)
            for n in sizes:
                data = finite_bytes(rng, n, dtype)
                f.write(data)
                digest.update(data)
        files.append({"path": path.name, "size": path.stat().st_size, "blake3": digest.hexdigest()})
    (directory / "config.json").write_text("{}")
    files.append({"path": "config.json", "size": 2, "blake3": blake3.blake3(b"{}").hexdigest()})
    manifest = {"format_version": 1, "version": version or directory.name, "files": files}
    (directory / "manifest.json").write_text(json.dumps(manifest))


def hash_all(files: list[Path], make: Callable[[], Any], threads: int, buffer_bytes: int = 16 << 20) -> None:
    """Each file read as the gate must read it: into a reused buffer (one per thread), never
    mapped (a mapping dies on a file truncated under it), `threads` files at a time."""
    buffers = threading.local()

    def one(path: Path) -> None:
        state = make()
        buffer = getattr(buffers, "buffer", None) or mmap.mmap(-1, buffer_bytes)  # page-aligned
        buffers.buffer, view = buffer, memoryview(buffer)
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(view):
                state.update(view[:n])
        state.hexdigest()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, files))
