"""One pass over a checkpoint's bytes: the digests and the non-finite scan in the same read.

Files are read with `pread` into a reused buffer, never mapped: a writer can truncate a
file while it is read, and a mapped page past the new end is a SIGBUS that kills the
process, where a read just comes back short. Each file is opened once (no symlink, regular
only) and its identity compared with the one the listing recorded, before and after the
read: a file written meanwhile was not the file verified, so the verdict is `changed`.

Reads are cut at tensor boundaries (a tensor larger than a chunk at a multiple of its
element size), so the non-finite scan never sees half an element. Each chunk is scanned
beside its hashing (blake3 runs without the GIL): a single big shard is checked about as
fast as blake3 alone hashes it.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import blake3

from ..errors import LayoutUnreadable
from . import finite, verified
from .files import (
    RACY_NS,
    Header,
    Identity,
    Tensor,
    header_in,
    identity,
    open_regular,
    read_exactly,
    read_header,
    usable_cpus,
)
from .manifest import ManifestFile, digest_mismatch, hashers

Buffer = bytearray | mmap.mmap
CHUNK = 2 << 20
"""Bytes read at a time: small enough that what the kernel copies in is still in the CPU's
cache when blake3 and the scan read it (8 MiB took ~20% more CPU here for the same bytes)."""
_SCANNER = ThreadPoolExecutor(usable_cpus(), thread_name_prefix="nan-scan")
"""The NaN scan of a chunk runs beside its hashing: both read the same buffer."""


@dataclass(frozen=True)
class Found:
    check: Literal["digests", "finite", "changed", "cancelled"]
    reason: str
    tensor: str | None = None


@dataclass
class Progress:
    """Bytes read of the bytes to read, for `status` while a big checkpoint is checked
    (updated by the reading threads, read by anyone)."""

    total: int = 0
    done: int = 0
    cached: int = 0
    """Of `done`, bytes settled by an earlier read (made while the checkpoint was written)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, n: int, *, cached: bool = False) -> None:
        with self._lock:
            self.done += n
            self.cached += n if cached else 0


_buffers = threading.local()


def aligned(size: int) -> mmap.mmap:
    """A page-aligned read buffer. A bytearray's bytes may start 8 or 16 bytes off a 32-byte
    boundary, and reading into such a buffer took the kernel's copy and blake3 about twice
    the CPU here for the same bytes (which a daemon hit and a benchmark, by luck, did not)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # not shmem


def _buffer(size: int) -> Buffer:
    """One reused read buffer per reading thread (pools live as long as the daemon)."""
    found: Buffer | None = getattr(_buffers, "buffer", None)
    if found is None or len(found) != size:
        found = _buffers.buffer = aligned(size)
    return found


@dataclass(frozen=True)
class Work:
    entry: ManifestFile
    """The file and the digests it must have."""
    expected: Identity
    header: Header | None = None
    """Its tensors, when the non-finite scan is asked for (None: digests only)."""
    hash_threads: int = blake3.blake3.AUTO
    """blake3's threads for this file: 1 where other files are read beside it on every core
    (blake3's own threads would only contend with them: ~25% more CPU for the same bytes)."""


def _segments(size: int, header: Header | None, chunk: int) -> Iterator[tuple[int, int]]:
    """[start, end) reads covering the file in order; none splits an element of a tensor."""
    if header is None or not header.tensors:
        yield from ((start, min(start + chunk, size)) for start in range(0, size, chunk))
        return
    yield 0, header.data_start
    start = end = header.data_start
    for tensor in sorted(header.tensors, key=lambda t: t.start):
        if tensor.nbytes > chunk:
            if end > start:
                yield start, end
            stride = max(1, finite.element_bytes(tensor.dtype))
            step = chunk - chunk % stride
            yield from ((o, min(o + step, tensor.end)) for o in range(tensor.start, tensor.end, step))
            start = end = tensor.end
        elif end - start + tensor.nbytes > chunk:
            if end > start:
                yield start, end
            start, end = tensor.start, tensor.end
        else:
            end = tensor.end
    if end > start:
        yield start, end
    if end < size:  # past the last tensor: only a header that lies, which the gate refused
        yield from ((o, min(o + chunk, size)) for o in range(end, size, chunk))


def _non_finite(buffer: Buffer, start: int, end: int, tensors: list[Tensor]) -> str | None:
    """The first tensor with a NaN or Inf among the bytes [start, end) of the file, which
    sit at the start of `buffer`."""
    for tensor in tensors:
        low, high = max(tensor.start, start), min(tensor.end, end)
        if low < high and finite.holds_non_finite(buffer, low - start, high - start, tensor.dtype):
            return tensor.name
    return None


class StreamScan:
    """The non-finite scan of one safetensors file fed in file order, in pieces of any size
    (a download's parts as they are hashed), so a downloaded file is not read again for it.
    Pieces are cut where no element of a tensor straddles the cut; the bytes of a split
    element wait for the next piece. Not a safetensors header: nothing is scanned
    (`scanned` False) and the gate reads the file itself."""

    def __init__(self, file_name: str) -> None:
        self.file_name = file_name
        self.header: Header | None = None
        self.found: str | None = None
        """The first tensor holding NaN or Inf (scanning stops there)."""
        self.unreadable = False
        self._pending = bytearray()
        """Fed bytes not scanned yet, from `_at`: the header while incomplete, or a split element."""
        self._at = 0
        self._tensors: list[Tensor] = []

    @property
    def scanned(self) -> bool:
        return self.header is not None and not self.unreadable

    def update(self, data: memoryview | bytes) -> None:
        if self.found is not None or self.unreadable:
            return
        self._pending += data
        if self.header is None and not self._read_header():
            return
        end = self._at + len(self._pending)
        cut = self._cut(end)
        if cut > self._at:
            self.found = _non_finite(self._pending, self._at, cut, self._tensors)
            del self._pending[: cut - self._at]
            self._at = cut

    def _read_header(self) -> bool:
        head = self._pending
        try:
            self.header = read_header(self.file_name, lambda a, b: bytes(head[a:b]), len(head))
        except LayoutUnreadable:
            self.unreadable = True
            self._pending = bytearray()
            return False
        if self.header is None:
            return False
        self._tensors = sorted(self.header.tensors, key=lambda t: t.start)
        del self._pending[: self.header.data_start]
        self._at = self.header.data_start
        return True

    def _cut(self, end: int) -> int:
        """The last offset up to `end` that splits no element."""
        for tensor in self._tensors:
            if tensor.start < end < tensor.end:
                stride = max(1, finite.element_bytes(tensor.dtype))
                return max(self._at, tensor.start + (end - tensor.start) // stride * stride)
        return end


class _Cancelled(Exception):
    pass


def read_pass(
    fd: int,
    size: int,
    header: Header | None,
    states: Mapping[str, Any],
    *,
    buffer: Buffer | None = None,
    cancel: threading.Event | None = None,
    progress: Progress | None = None,
) -> str | None:
    """Every byte of the open file once, in order: fed to `states` (hashers), float tensors
    scanned beside the hashing. Returns the first tensor holding NaN/Inf (the read stops
    there), or None. Raises OSError when the file ends early, `_Cancelled` when called off."""
    buffer = buffer if buffer is not None else _buffer(CHUNK)
    tensors = sorted(header.tensors, key=lambda t: t.start) if header else []
    view = memoryview(buffer)
    for start, end in _segments(size, header, len(buffer)):
        if cancel is not None and cancel.is_set():
            raise _Cancelled
        part = view[: end - start]
        read_exactly(fd, part, start)
        if progress is not None:
            progress.add(end - start)
        scanning = _SCANNER.submit(_non_finite, buffer, start, end, tensors) if tensors else None
        for state in states.values():  # blake3 hashes without the GIL, beside the scan
            state.update(part)
        if scanning is not None and (name := scanning.result()):
            return name
    return None


def read(
    directory: Path,
    work: Work,
    buffer: Buffer | None = None,
    *,
    cancel: threading.Event | None = None,
    progress: Progress | None = None,
    cache: verified.Cache | None = None,
) -> Found | None:
    """Read one file once: digests checked, float tensors scanned; None when all is well.
    `cancel` stops it between chunks (Found "cancelled"). With a `cache`, a file verified
    while it was written is not read again (see `verified`)."""
    entry = work.entry
    known = cache.get(work.expected) if cache is not None else None
    settled = known.settles(entry, work.header is not None) if known is not None else None
    if known is not None and settled in ("clean", "non_finite"):  # read while written: not again
        if progress is not None:
            progress.add(entry.size, cached=True)
        if settled == "non_finite":
            reason = f"{entry.path}: tensor {known.non_finite} holds NaN or Inf values (a diverged run?)"
            return Found("finite", reason, known.non_finite)
        return None
    fd = open_regular(directory / entry.path)
    try:
        if identity(os.fstat(fd)) != work.expected:
            return Found("changed", f"{entry.path} changed while it was being checked")
        known_digest = settled == "scan"
        states: Mapping[str, Any] = {} if known_digest else hashers(entry, work.hash_threads)
        started_ns = time.time_ns()
        try:
            name = read_pass(
                fd, entry.size, work.header, states, buffer=buffer, cancel=cancel, progress=progress
            )
        except _Cancelled:
            return Found("cancelled", f"{entry.path}: checking it was called off")
        except OSError:
            return Found("changed", f"{entry.path} was cut short while it was being checked")
        if name is not None:
            return Found(
                "finite", f"{entry.path}: tensor {name} holds NaN or Inf values (a diverged run?)", name
            )
        if identity(os.fstat(fd)) != work.expected:
            return Found("changed", f"{entry.path} changed while it was being checked")
    finally:
        os.close(fd)
    if problem := digest_mismatch(entry, dict(states)):
        return Found("digests", problem)
    if cache is not None and "blake3" in states:
        digest = states["blake3"].hexdigest()
        cache.put(verified.Verified(work.expected, digest, None, work.header is not None, started_ns))
    elif cache is not None and known is not None and settled == "scan":
        cache.put(verified.Verified(work.expected, known.blake3, None, True, started_ns))
    return None


def first_non_finite(path: Path, chunk: int = CHUNK) -> str | None:
    """The first tensor (in file order) of one safetensors file holding a NaN or Inf."""
    fd = open_regular(path)
    try:
        found = identity(os.fstat(fd))
        header = header_in(fd, path.name)
    finally:
        os.close(fd)
    work = Work(ManifestFile(path=path.name, size=found[2]), found, header)
    result = read(path.parent, work, aligned(chunk))
    return result.tensor if result is not None else None


def prehash(path: Path, cache: verified.Cache, max_tensors: int | None = None) -> None:
    """Read a shard a writer has just closed — digests and NaN scan — and keep the result by
    its identity, so the gate need not read it again once the manifest lands. Anything odd
    (gone, not a regular file, changed while read, a header past `max_tensors`: never all
    parsed) just leaves nothing in the cache, or the bytes' digest alone."""
    try:
        fd = open_regular(path)
    except OSError:
        return
    try:
        found = identity(os.fstat(fd))
        if not cache.claim(found):
            return
        result = None
        try:
            if (wait_ns := found[4] + RACY_NS - time.time_ns()) > 0:  # racily clean, see `verified`
                time.sleep(min(wait_ns, RACY_NS) / 1e9)
            started_ns = time.time_ns()
            try:
                header: Header | None = header_in(fd, path.name, max_tensors)
            except LayoutUnreadable:
                header = None
            digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
            name = read_pass(fd, found[2], header, {"blake3": digest})
            if identity(os.fstat(fd)) == found:
                whole = digest.hexdigest() if name is None else ""
                result = verified.Verified(found, whole, name, header is not None, started_ns)
        except OSError:
            result = None
        finally:
            cache.release(found, result)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Run:
    """How one check runs: on whose threads, how far it got, and how to call it off."""

    threads: int = 4
    pool: Executor | None = None
    """Reading threads made once by a long-lived caller (None: made for this check)."""
    cancel: threading.Event | None = None
    progress: Progress = field(default_factory=Progress)
    cache: verified.Cache | None = None
    """Files verified before (while they were written), by identity: not read again."""


def read_all(directory: Path, work: list[Work], run: Run) -> Found | None:
    """Every byte once: digests and the NaN/Inf scan, largest files first (so one big shard
    does not start last and finish alone), on the caller's long-lived pool if it has one."""
    if not work:
        return None
    work = sorted(work, key=lambda w: w.entry.size, reverse=True)
    run.progress.total = sum(w.entry.size for w in work)
    left, cores, lock = [len(work)], usable_cpus(), threading.Lock()

    def one(item: Work) -> Found | None:
        with lock:  # files under way or to come: as many as cores, each hashes on one thread
            alone = min(run.threads, left[0]) >= cores
        item = replace(item, hash_threads=1) if alone else item
        try:
            return read(directory, item, cancel=run.cancel, progress=run.progress, cache=run.cache)
        finally:
            with lock:
                left[0] -= 1

    if run.pool is not None:
        return next((r for r in run.pool.map(one, work) if r), None)
    with ThreadPoolExecutor(max_workers=min(run.threads, len(work))) as pool:
        return next((r for r in pool.map(one, work) if r), None)
