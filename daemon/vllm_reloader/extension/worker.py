"""The engine side: a vLLM worker extension with a faster, measured reload path.

`vllm serve … --worker-extension-cls vllm_reloader.extension.ReloadExtension` mixes
`ReloadExtension` into every worker. The daemon sees it in `/server_info` and calls
`reloader_load_checkpoint` through `/collective_rpc` instead of `reload_weights`.

Imported only inside the engine (it needs torch); the daemon never imports it.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import torch

from .. import failpoints
from ..checkpoint.files import changed
from ..checkpoint.staged import staged_marker, staged_problem
from .probe import probe, probe_adapter
from .readers import DTYPES, BufferPool, Checkpoint, LoadStats, layer_order, plan, read_weights, runs


class DeviceMemory:
    """Device memory in use before / after / at peak of a reload; on CPU — and on an XLA
    device without allocator stats, such as torch_xla's CPU device — the process RSS (no
    peak: it is the same memory the model lives in)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def used(self) -> int:
        if self.device.type == "xla" and (info := self._xla()) is not None:
            return int(info["bytes_used"])
        if self.device.type in ("cpu", "xla"):
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return int(torch.accelerator.memory_allocated(self.device.index))

    def reset_peak(self) -> None:
        if self.device.type not in ("cpu", "xla"):
            torch.accelerator.reset_peak_memory_stats(self.device.index)

    def peak(self) -> int | None:
        if self.device.type == "xla":
            info = self._xla() or {}
            return int(info.get("peak_bytes_used", 0)) or None
        if self.device.type == "cpu":
            return None
        return int(torch.accelerator.max_memory_allocated(self.device.index))

    def _xla(self) -> dict[str, Any] | None:
        """A TPU's allocator stats; None where the device has none (PJRT's CPU client)."""
        import torch_xla.core.xla_model as xm  # TPU only

        try:
            return dict(xm.get_memory_info(self.device))
        except RuntimeError:  # "UNIMPLEMENTED: GetAllocatorStats is not supported"
            return None


class ReloadExtension:
    """Mixed into vLLM's worker class: `self` is the worker (`model_runner`, `vllm_config`,
    `device`, and `reload_weights`, which sets the current vLLM config around the load)."""

    model_runner: Any
    vllm_config: Any
    device: torch.device
    reload_weights: Any

    def reloader_staged(self, path: str, fingerprint: str) -> dict[str, Any]:
        """Whether this rank's node holds `fingerprint` verified at `path` (its daemon's marker,
        and every file as it was verified): asked of every rank before a multi-node reload."""
        staged, problem = staged_problem(Path(path), fingerprint)
        return {
            "rank": getattr(self, "rank", None),
            "node_rank": getattr(self.vllm_config.parallel_config, "node_rank", None),
            "host": socket.gethostname(),
            "staged_by": staged.node if staged else None,
            "problem": problem,
        }

    def reloader_load_checkpoint(
        self,
        path: str,
        files: dict[str, list[int]] | None = None,
        reader: str = "buffered",
        staged: str | None = None,
    ) -> dict[str, Any]:
        """Reload the weights from the checkpoint at `path`, in place; what it took.

        `files`: each file's identity as the daemon's gate verified it (device, inode, size,
        mtime_ns, ctime_ns): the shards read must be exactly those, unchanged, or nothing is
        loaded; changed while read, the load fails. `staged` (a multi-node engine): the
        content's fingerprint; each rank reads the files its own node's daemon verified (its
        marker's identities), or refuses before reading anything. Tensors are read into reused
        host buffers (pinned with an accelerator), never mapped (`reader` is accepted for older
        daemons; `buffered` is the only one)."""
        if reader != "buffered":
            raise ValueError(f"reader {reader!r}: only buffered (a mapped read dies on a truncated file)")
        if staged is not None:
            files = _this_nodes(Path(path), staged, files, getattr(self, "rank", None))
        failpoints.hit("load_start", rank=getattr(self, "rank", None))
        model = self.model_runner.get_model()
        memory = DeviceMemory(self.device)
        pool = _pool(self)
        pool.reset_counts()
        stats = LoadStats()
        before = memory.used()
        memory.reset_peak()
        started = time.perf_counter()
        checkpoint = Checkpoint(Path(path))
        try:
            reads = layer_order(plan(checkpoint, files), [name for name, _ in model.named_modules()])
            if any(read.dtype not in DTYPES for read in reads) or getattr(model, "secondary_weights", None):
                self.reload_weights(weights_path=path)  # not ours to read: vLLM's own path
                return {"loader": "builtin", "seconds": time.perf_counter() - started}
            # The machine's cores, not this thread's affinity: vLLM's CPU backend pins its worker's
            # main thread to one core once OpenMP starts, and these threads mostly wait on reads.
            threads = int(os.environ.get("VLLM_RELOADER_LOAD_THREADS", min(8, os.cpu_count() or 1)))
            self.reload_weights(weights_iterator=read_weights(runs(reads), pool, threads, stats, checkpoint))
        finally:
            checkpoint.close()
        model_config = self.vllm_config.model_config  # as vLLM's own reload from a path does
        model_config.model, model_config.model_weights, model_config.revision = path, "", None
        return {
            "loader": "extension",
            "reader": "buffered",
            "seconds": round(time.perf_counter() - started, 4),
            "bytes": stats.bytes,
            "tensors": stats.tensors,
            "read_s": round(stats.read_s, 4),
            "wait_s": round(stats.wait_s, 4),
            "model_s": round(stats.model_s, 4),
            "threads": threads,
            "buffers_allocated": pool.allocated,
            "buffer_bytes": pool.nbytes,
            "device": str(self.device),
            "memory_before": before,
            "memory_after": memory.used(),
            "memory_peak": memory.peak(),
            "verified": files is not None,
        }

    def reloader_probe(self, tokens: list[int] | None = None, scan: bool = False) -> dict[str, Any]:
        """A forward pass on this rank's weights, still paused (see `probe`)."""
        failpoints.hit("probe", rank=getattr(self, "rank", None))
        return probe(self, tokens, scan)

    def reloader_probe_adapter(self, path: str, tokens: list[int] | None = None) -> dict[str, Any]:
        """The forward pass with the adapter at `path` active, before clients can name it."""
        failpoints.hit("probe", rank=getattr(self, "rank", None))
        return probe_adapter(self, path, tokens)


def _this_nodes(
    copy: Path, fingerprint: str, leaders: dict[str, list[int]] | None, rank: int | None
) -> dict[str, list[int]]:
    """The files this rank may read: on the leading daemon's node, the ones it verified (its
    marker must say the same); on another node, the ones that node's daemon marked. Refused
    (before anything is read) where the node does not hold `fingerprint` verified."""
    where = f"{socket.gethostname()} (rank {rank})"
    marker, problem = staged_problem(copy, fingerprint)
    if problem is not None or marker is None:
        raise ValueError(f"{where}: {problem}")
    marked = {name: list(found) for name, found in marker.files.items()}
    if leaders is not None and changed(copy, leaders) is None:
        if marked != leaders:  # the leader's node: its marker must be the leader's word
            raise ValueError(f"{where}: {staged_marker(copy)} is not what the leading daemon verified")
        return leaders
    return marked


def _pool(worker: Any) -> BufferPool:
    pool = getattr(worker, "_reloader_pool", None)
    if pool is None:
        pool = worker._reloader_pool = BufferPool(pin=torch.accelerator.is_available())
    return pool
