"""How the extension reads a checkpoint's tensors for `reload_weights(weights_iterator=…)`.

vLLM's own iterator maps each shard into memory and yields its tensors in file order (alphabetical:
`layers.10` before `layers.2`), pageable memory, one page fault at a time. Here several
threads `pread` the tensors, in the order the model's modules consume them, into a few
reused host buffers (pinned with an accelerator: the copy to the device is then a straight
DMA) while the model loads the ones before. Layer order also matters to vLLM's layerwise
reload, which holds a layer's tensors on the device until the layer is complete.

Never a mapping of a checkpoint file: a writer that truncates one would make a mapped read
a SIGBUS, which kills the engine; a `pread` just comes back short and the load fails.
Each file is opened once (no symlink, regular files only), its identity compared with the
one the daemon's gate verified, and compared again once everything is read: any change —
a rewrite in place, a truncation, a replacement (the old file's last link going moves its
ctime) — fails the load before it returns, and the daemon puts the last good checkpoint back.

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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import failpoints
from ..checkpoint.files import (
    INDEX_NAME,
    Identity,
    header_in,
    identity,
    is_top_level_shard,
    open_regular,
    read_exactly,
    read_small,
    through_links,
    weights_from_index,
)

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
    fd: int = -1
    """The file, open once for the whole load."""


def weight_names(directory: Path, listed: Iterable[str] | None) -> list[str]:
    """The shards to read: those an HF index names, else every top-level shard. With the
    gate's list (`listed`), they must be exactly its shards; an index's names must be
    top-level shards whatever it says (vLLM would follow an absolute path)."""
    present = sorted(p.name for p in directory.iterdir() if is_top_level_shard(p.name))
    try:
        names = weights_from_index(read_small(through_links(directory / INDEX_NAME, trusted=listed is None)))
    except FileNotFoundError:
        names = present
    if isinstance(names, str):
        raise ValueError(names)
    if bad := [n for n in names if not is_top_level_shard(n)]:
        raise ValueError(
            f"{INDEX_NAME} names {bad[0]!r}, not a top-level .safetensors file: nothing was loaded"
        )
    if listed is not None:
        verified = sorted(n for n in listed if is_top_level_shard(n))
        if sorted(names) != verified or present != verified:
            raise ValueError(f"shards {sorted(names)} are not the verified {verified}: nothing was loaded")
    return sorted(names)


@dataclass
class Checkpoint:
    """The shards of one checkpoint, each open once, with the identity it had when opened."""

    directory: Path
    opened: dict[str, tuple[int, Identity]] = field(default_factory=dict)

    def open(self, name: str, expected: Sequence[int] | None) -> int:
        fd = open_regular(through_links(self.directory / name, trusted=expected is None))
        found = identity(os.fstat(fd))
        self.opened[name] = (fd, found)
        if expected is not None and found != tuple(expected):
            raise ValueError(f"{name} is not the file the gate verified (it changed): nothing was loaded")
        return fd

    def unchanged(self) -> None:
        """Raises if any file changed since it was opened: what was read may be a mix."""
        for name, (fd, found) in self.opened.items():
            if identity(os.fstat(fd)) != found:
                raise ValueError(f"{name} changed while it was read: the load is not the verified checkpoint")

    def close(self) -> None:
        for fd, _ in self.opened.values():
            os.close(fd)
        self.opened.clear()


def plan(checkpoint: Checkpoint, files: Mapping[str, Sequence[int]] | None = None) -> list[TensorRead]:
    """Every tensor of the checkpoint, in file order, from the safetensors headers.

    Checked here, before the model is touched, that every file holds the bytes its header
    promises and every tensor's bytes fit its shape: vLLM's reload moves each layer to the
    meta device first, so a reader failing halfway leaves a model nothing can serve from.
    Raises `ValueError` naming the file and tensor (`LayoutUnreadable` for a bad header)."""
    reads = []
    for name in weight_names(checkpoint.directory, files):
        fd = checkpoint.open(name, None if files is None else files[name])
        path, size = checkpoint.directory / name, os.fstat(fd).st_size
        for tensor in header_in(fd, name).tensors:
            read = TensorRead(tensor.name, path, tensor.start, tensor.nbytes, tensor.dtype, tensor.shape, fd)
            if tensor.end > size:
                raise ValueError(
                    f"{name}: ends inside tensor {tensor.name} ({size} bytes): nothing was loaded"
                )
            if read.dtype in DTYPES and read.nbytes != math.prod(read.shape) * DTYPES[read.dtype].itemsize:
                shape = list(read.shape)
                raise ValueError(
                    f"{name}: tensor {tensor.name} has {read.nbytes} bytes for its shape {shape}"
                )
            reads.append(read)
    return reads


def _natural(name: str) -> tuple[Any, ...]:
    """ASCII digit runs as numbers (other scripts' digits stay text: int() refuses some)."""
    return tuple((0, int(p)) if p.isascii() and p.isdigit() else (1, p) for p in re.split(r"([0-9]+)", name))


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
        try:
            read_exactly(read.fd, into[place : place + read.nbytes], read.offset)
        except OSError as exc:
            raise OSError(f"{read.file.name}: ends inside tensor {read.name} ({exc.strerror})") from exc
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
    model_s: float = 0.0
    """Seconds vLLM spent with the tensors it was handed (its weight loaders: the copy into
    the parameters, on the device with an accelerator, and any repacking)."""


def read_weights(
    runs_: Sequence[list[TensorRead]],
    pool: BufferPool,
    threads: int,
    stats: LoadStats,
    checkpoint: Checkpoint | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in run order; `threads` runs are read ahead while earlier ones load.
    Once all are read, `checkpoint.unchanged()`: the load fails if a file changed meanwhile."""
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
        first = True
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
                handed = time.perf_counter()
                yield name, tensor
                stats.model_s += time.perf_counter() - handed
                del tensor  # the buffer is free once the model is done with it
            if first:
                failpoints.hit("mid_load")  # the first run is in the model, the rest may not be read
                first = False
    if checkpoint is not None:
        checkpoint.unchanged()
