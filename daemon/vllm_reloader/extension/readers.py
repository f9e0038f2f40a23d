"""How the extension reads a checkpoint's tensors for `reload_weights(weights_iterator=…)`.

vLLM's own iterator mmaps each shard and yields its tensors in file order (alphabetical:
`layers.10` before `layers.2`), pageable memory, one page fault at a time. With an
accelerator, here several threads `pread` the tensors, in the order the model's modules
consume them, into a few reused pinned host buffers (the copy to the device is then a straight
DMA) while the model loads the ones before. Layer order also matters to vLLM's layerwise
reload, which holds a layer's tensors on the device until the layer is complete. On CPU there
is nothing to DMA: the tensors are zero-copy views of the page cache, in layer order.

A buffer is refilled only when no tensor but the pool's own refers to its storage: the
layerwise loader keeps the tensors it was given until their layer is complete, so reusing
memory by count or by time could hand one layer another layer's bytes.

Imported only inside the engine (it needs torch); the daemon never imports it.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.files import INDEX_NAME, WEIGHT_SUFFIX, tensors_of, weights_from_index

CHUNK_BYTES = 32 << 20
"""Tensors are read in runs of about this many bytes, one run per buffer."""
ALIGN = 64
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


@dataclass(frozen=True)
class TensorRead:
    name: str
    file: Path
    offset: int
    """Where the tensor's bytes start in `file`."""
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def weight_files(directory: Path) -> list[Path]:
    """The files vLLM's loader reads: those the index names, else every top-level shard."""
    index = directory / INDEX_NAME
    if not index.exists():
        return sorted(directory.glob("*" + WEIGHT_SUFFIX))
    names = weights_from_index(index.read_bytes())
    if isinstance(names, str):
        raise ValueError(names)
    return [directory / name for name in names]


def plan(directory: Path) -> list[TensorRead]:
    """Every tensor of the checkpoint, in file order, from the safetensors headers.

    Checked here, before the model is touched, that every file holds the bytes its header
    promises and every tensor's bytes fit its shape: vLLM's reload moves each layer to the
    meta device first, so a reader failing halfway leaves a model nothing can serve from.
    Raises `ValueError` naming the file and tensor (`LayoutUnreadable` for a bad header)."""
    reads = []
    for path in weight_files(directory):
        size = path.stat().st_size
        for tensor in tensors_of(path):
            read = TensorRead(tensor.name, path, tensor.start, tensor.nbytes, tensor.dtype, tensor.shape)
            if tensor.end > size:
                raise ValueError(
                    f"{path.name}: ends inside tensor {tensor.name} ({size} bytes): nothing was loaded"
                )
            if read.dtype in DTYPES and read.nbytes != math.prod(read.shape) * DTYPES[read.dtype].itemsize:
                shape = list(read.shape)
                raise ValueError(
                    f"{path.name}: tensor {tensor.name} has {read.nbytes} bytes for its shape {shape}"
                )
            reads.append(read)
    return reads


def _natural(name: str) -> tuple[Any, ...]:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def layer_order(reads: Iterable[TensorRead], module_names: Sequence[str]) -> list[TensorRead]:
    """`reads` in the order the model's modules come (`named_modules()` order): each tensor
    goes with the deepest module its dotted name starts with; names matching no module
    (renamed by the model's loader) go last, in natural order (`2` before `10`)."""
    position = {name: i for i, name in enumerate(module_names)}

    def key(read: TensorRead) -> tuple[int, tuple[Any, ...]]:
        prefix = read.name
        while "." in prefix:
            prefix = prefix.rpartition(".")[0]
            if prefix in position:
                return position[prefix], _natural(read.name)
        return len(position), _natural(read.name)

    return sorted(reads, key=key)


def runs(reads: Sequence[TensorRead], chunk_bytes: int = CHUNK_BYTES) -> list[list[TensorRead]]:
    """Consecutive `reads` grouped into runs of at most `chunk_bytes` (a bigger tensor alone)."""
    groups: list[list[TensorRead]] = []
    size = 0
    for read in reads:
        need = _aligned(read.nbytes)
        if not groups or size + need > chunk_bytes:
            groups.append([])
            size = 0
        groups[-1].append(read)
        size += need
    return groups


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class BufferPool:
    """Host buffers kept across reloads; one is handed out again only when free."""

    def __init__(self, pin: bool, min_bytes: int = CHUNK_BYTES) -> None:
        self.pin = pin
        self.min_bytes = min_bytes
        self._buffers: list[_Buffer] = []
        self.allocated = 0
        """Buffers allocated since the last `reset_counts`."""

    def reset_counts(self) -> None:
        self.allocated = 0

    @property
    def nbytes(self) -> int:
        return sum(b.tensor.numel() for b in self._buffers)

    def take(self, nbytes: int) -> _Buffer:
        free = [b for b in self._buffers if b.tensor.numel() >= nbytes and b.is_free()]
        if free:
            buffer = min(free, key=lambda b: b.tensor.numel())
        else:
            buffer = _Buffer(torch.empty(max(nbytes, self.min_bytes), dtype=torch.uint8, pin_memory=self.pin))
            self._buffers.append(buffer)
            self.allocated += 1
        buffer.busy = True
        return buffer


class _Buffer:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.view = tensor.numpy().data
        self.busy = False
        """Taken and not yet turned into tensors: being read into."""
        self._own_refs = _storage_refs(tensor)

    def is_free(self) -> bool:
        """Not being read into, and no tensor viewing it is alive (vLLM may hold some)."""
        refs = _storage_refs(self.tensor)
        if self.busy or refs is None or self._own_refs is None:
            return False
        return refs <= self._own_refs


def _storage_refs(tensor: torch.Tensor) -> int | None:
    """How many references its storage has; torch's count is internal, and where it is
    missing (None) no buffer is ever reused."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return None if use_count is None else int(use_count(tensor.untyped_storage()._cdata))


def _read_run(run: list[TensorRead], into: memoryview) -> float:
    started = time.perf_counter()
    place = 0
    for read in run:
        with read.file.open("rb", buffering=0) as f:
            done = 0
            while done < read.nbytes:
                got = os.preadv(f.fileno(), [into[place + done : place + read.nbytes]], read.offset + done)
                if got == 0:
                    raise OSError(f"{read.file.name}: ends inside tensor {read.name}")
                done += got
        place += _aligned(read.nbytes)
    return time.perf_counter() - started


def _tensors(run: list[TensorRead], buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    out, place = [], 0
    for read in run:
        raw = buffer[place : place + read.nbytes]
        out.append((read.name, raw.view(DTYPES[read.dtype]).view(read.shape)))
        place += _aligned(read.nbytes)
    return out


@dataclass
class LoadStats:
    bytes: int = 0
    tensors: int = 0
    read_s: float = 0.0
    """Seconds the reading threads spent, summed."""
    wait_s: float = 0.0
    """Seconds the model waited for bytes: near 0 when reading keeps ahead of loading."""


def read_weights(
    runs_: Sequence[list[TensorRead]], pool: BufferPool, threads: int, stats: LoadStats
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in run order; `threads` runs are read ahead while earlier ones load."""
    with ThreadPoolExecutor(threads, thread_name_prefix="reloader-read") as pool_threads:
        pending: list[tuple[list[TensorRead], _Buffer, Future[float]]] = []

        def submit(run: list[TensorRead]) -> None:
            buffer = pool.take(sum(_aligned(r.nbytes) for r in run))
            pending.append((run, buffer, pool_threads.submit(_read_run, run, buffer.view)))

        ahead = iter(runs_)
        for run in ahead:
            submit(run)
            if len(pending) >= threads:
                break
        while pending:
            run, buffer, future = pending.pop(0)
            started = time.perf_counter()
            stats.read_s += future.result()
            stats.wait_s += time.perf_counter() - started
            tensors = _tensors(run, buffer.tensor)
            buffer.busy = False  # free again once the model lets go of these
            for item in ahead:  # refill the window before handing these out
                submit(item)
                break
            while tensors:
                name, tensor = tensors.pop(0)
                stats.bytes += tensor.nbytes
                stats.tensors += 1
                yield name, tensor
                del tensor  # the buffer is free once the model is done with it


def mapped_weights(reads: Iterable[TensorRead], stats: LoadStats) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in `reads` order, each a zero-copy view of the page cache (safetensors'
    mmap): vLLM's own way of reading, in layer order."""
    from safetensors import safe_open

    with ExitStack() as files:
        opened: dict[Path, Any] = {}
        for read in reads:
            if read.file not in opened:
                opened[read.file] = files.enter_context(safe_open(str(read.file), framework="pt"))
            started = time.perf_counter()
            tensor = opened[read.file].get_tensor(read.name)
            stats.read_s += time.perf_counter() - started
            stats.bytes += tensor.nbytes
            stats.tensors += 1
            yield read.name, tensor
