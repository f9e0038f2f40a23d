"""What the worker extension reports of a load, read from every worker's answer."""

from __future__ import annotations

from typing import Any

from ..errors import EngineCallFailed


def load_report(results: list[Any]) -> dict[str, Any]:
    """Every worker's answer counts: one that did not report a load is a failed reload (with
    tensor parallelism each rank loads its own part). One worker: its report; several: rank
    0's, with bytes summed, the slowest rank's seconds, and every rank's report listed."""
    for rank, result in enumerate(results):
        if not isinstance(result, dict) or "loader" not in result:
            raise EngineCallFailed(
                f"/collective_rpc: rank {rank} of {len(results)} reported no load ({str(result)[:200]})",
                endpoint="/collective_rpc",
            )
    if len(results) == 1:
        return dict(results[0])
    return {
        **results[0],
        "bytes": sum(int(r.get("bytes") or 0) for r in results),
        "seconds": max(float(r.get("seconds") or 0.0) for r in results),
        "workers": len(results),
        "ranks": results,
    }
