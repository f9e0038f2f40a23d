"""What the worker extension reports of a load, read from every worker's answer."""

from __future__ import annotations

from typing import Any

from ..errors import EngineCallFailed

SHOWN = ("loader", "bytes", "tensors", "seconds", "read_s", "wait_s", "model_s", "memory_peak")
"""What `reload.succeeded` says of a load: enough to see where the time went in one line (the
whole report, buffers and memory before and after included, is the extension's answer to a
direct call)."""


def load_report(results: list[Any]) -> dict[str, Any]:
    """Every worker's answer counts: one that did not report a load is a failed reload (with
    tensor parallelism each rank loads its own part). One worker: its report's SHOWN keys;
    several: rank 0's, with bytes summed, the slowest rank's seconds, the highest peak, and each
    rank's seconds and bytes."""
    for rank, result in enumerate(results):
        if not isinstance(result, dict) or "loader" not in result:
            raise EngineCallFailed(
                f"/collective_rpc: rank {rank} of {len(results)} reported no load ({str(result)[:200]})",
                endpoint="/collective_rpc",
            )
    first = {key: results[0][key] for key in SHOWN if key in results[0]}
    if len(results) == 1:
        return first
    return {
        **first,
        "bytes": sum(int(r.get("bytes") or 0) for r in results),
        "seconds": max(float(r.get("seconds") or 0.0) for r in results),
        "memory_peak": max((r.get("memory_peak") or 0 for r in results), default=0) or None,
        "workers": len(results),
        "rank_seconds": [r.get("seconds") for r in results],
        "rank_bytes": [r.get("bytes") for r in results],
    }
