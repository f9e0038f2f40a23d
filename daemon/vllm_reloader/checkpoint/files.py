"""A checkpoint's files as vLLM's loader sees them: which are shards, which shards an HF
index names, what each safetensors header promises (tensors, offsets, whole size) — and
the one way to open a file a writer controls.

Every read of a writer's file goes through `open_regular`: no symlink followed, never
blocking (a FIFO named `manifest.json` must not stall the daemon), regular files only,
small files bounded (`read_small`). A file's `Identity` (device, inode, size, mtime,
ctime) is what the gate verified; whoever reads it later compares before trusting it.

Standard library only (and `errors`, which imports nothing): the worker extension runs
inside the vLLM engine, where only torch and safetensors can be counted on, and reads
checkpoints through this module, so the engine and the daemon apply the same rules.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import LayoutUnreadable, NotJSONYet

WEIGHT_SUFFIX = ".safetensors"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000
"""safetensors caps its header at 100 MB; anything larger is not a header."""
MAX_SMALL_BYTES = 16 << 20
"""A manifest, an index, a marker or config.json: anything larger is not one."""
RACY_NS = 20_000_000
"""A file last changed this recently may change again within the same timestamp tick
(coarse kernel clocks tick every 1-10 ms) without its identity showing it (git's "racily
clean" rule): its bytes are trusted only from a read begun after that."""
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Bits per element, for every dtype safetensors knows (sub-byte floats pack several a byte).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6,
    "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}  # fmt: skip

Identity = tuple[int, int, int, int, int]
"""(device, inode, size, mtime_ns, ctime_ns): any write, truncation or replacement changes it."""


def usable_cpus() -> int:
    """The cores this process may run on (systemd's CPUAffinity, a cpuset), not the machine's:
    the daemon's scan threads. Not in vLLM's workers: OpenMP pins their main thread to one."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def identity(info: os.stat_result) -> Identity:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def through_links(path: Path, *, trusted: bool) -> Path:
    """Where to open `path`. A writer's file is opened only as itself (`open_regular` refuses a
    link); the engine's own startup model (trusted: nothing a writer made) may link its files
    elsewhere, as a Hugging Face cache snapshot links every file to its blob."""
    return Path(os.path.realpath(path)) if trusted else path


def open_regular(path: Path) -> int:
    """A file descriptor for `path`, only if it is a regular file reached without following a
    symlink; opening never blocks. Raises OSError naming the file."""
    fd = os.open(path, OPEN_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_exactly(fd: int, into: memoryview, offset: int) -> None:
    """Fill `into` from `offset`; a file that ends first (truncated) is an OSError."""
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if got == 0:
            raise OSError(errno.EIO, f"ended at {offset + done} bytes, {offset + len(into)} expected")
        done += got


def read_small(path: Path, limit: int = MAX_SMALL_BYTES) -> bytes:
    """All of a small file (a manifest, an index, config.json). Raises OSError if it is larger."""
    fd = open_regular(path)
    try:
        return read_small_at(fd, path, limit)
    finally:
        os.close(fd)


def read_small_at(fd: int, path: Path, limit: int = MAX_SMALL_BYTES) -> bytes:
    """`read_small` of a file already open (whose identity the caller takes from the same fd)."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
    data = bytearray(size)
    read_exactly(fd, memoryview(data), 0)
    return bytes(data)


def parse_json(data: bytes) -> Any:
    """json.loads, where nesting too deep for the parser is invalid JSON like any other."""
    try:
        return json.loads(data)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc


def changed(directory: Path, expected: Mapping[str, Sequence[int]]) -> str | None:
    """The first file under `directory` whose identity is no longer the expected one."""
    for name, want in expected.items():
        try:
            found = identity(os.lstat(directory / name))
        except FileNotFoundError:
            return f"{name} is gone"
        if found != tuple(want):
            return f"{name} changed (was {_describe_identity(want)}, now {_describe_identity(found)})"
    return None


def _describe_identity(found: Iterable[int]) -> str:
    _dev, ino, size, mtime_ns, ctime_ns = found
    return f"inode {ino}, {size} bytes, mtime {mtime_ns}, ctime {ctime_ns}"


def is_top_level_shard(name: str) -> bool:
    """A file vLLM's loader reads: a `*.safetensors` directly in the checkpoint directory
    (its glob skips dot-files)."""
    return "/" not in name and not name.startswith(".") and name.endswith(WEIGHT_SUFFIX)


def weights_from_index(data: bytes) -> list[str] | str:
    """The shard names an HF index maps tensors to, or why it cannot be used.
    Raises `NotJSONYet` when the bytes are not (yet) JSON."""
    try:
        index = parse_json(data)
    except ValueError as exc:
        raise NotJSONYet(f"{INDEX_NAME} is not valid JSON") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        return f"{INDEX_NAME} has no weight_map"
    if not all(isinstance(v, str) and v for v in weight_map.values()):
        return f"{INDEX_NAME}: weight_map values must be file names"
    return sorted(set(weight_map.values()))


@dataclass(frozen=True)
class Tensor:
    """One tensor as its file's header describes it; `start`/`end` are offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor(name: str, entry: Any, data_start: int) -> Tensor | None:
    if not isinstance(entry, dict):
        return None
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or not isinstance(shape, list) or not all(map(_is_count, shape)):
        return None
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets)):
        return None
    if offsets[0] > offsets[1]:
        return None
    return Tensor(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


class TooManyTensors(LayoutUnreadable):
    """A header lists more tensors than its reader allows: its parse was cut short there."""

    def __init__(self, file_name: str, max_tensors: int) -> None:
        super().__init__(f"{file_name}: more than {max_tensors} tensors")
        self.file_name = file_name


def _counted_json(file_name: str, raw: bytes, max_tensors: int) -> Any:
    """`parse_json`, stopped as soon as the JSON holds more objects than a header of
    `max_tensors` tensors has (each tensor is one; the header and its `__metadata__` two
    more): a header of millions of tiny tensors never becomes millions of dicts."""
    made = 0

    def one_more(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal made
        made += 1
        if made > max_tensors + 2:
            raise TooManyTensors(file_name, max_tensors)
        return dict(pairs)

    try:
        return json.loads(raw, object_pairs_hook=one_more)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc


def parse_header(file_name: str, raw: bytes, data_start: int, max_tensors: int | None = None) -> list[Tensor]:
    """The tensors a safetensors header (the JSON after its 8-byte length) lists, in header
    order. Raises `LayoutUnreadable` naming the file; `TooManyTensors` (counted while parsing)
    when it lists more than `max_tensors`."""
    try:
        # Every object opens with `{`: with no more of them than the cap allows, none to count.
        if max_tensors is not None and raw.count(b"{") > max_tensors + 2:
            header = _counted_json(file_name, raw, max_tensors)
        else:
            header = parse_json(raw)
    except ValueError as exc:
        raise LayoutUnreadable(f"{file_name}: unreadable safetensors header") from exc
    if not isinstance(header, dict):
        raise LayoutUnreadable(f"{file_name}: unreadable safetensors header")
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensor = _tensor(name, entry, data_start)
        if tensor is None:
            raise LayoutUnreadable(f"{file_name}: unreadable safetensors header (tensor {name!r})")
        tensors.append(tensor)
    if max_tensors is not None and len(tensors) > max_tensors:
        raise TooManyTensors(file_name, max_tensors)
    return tensors


def _header_length(file_name: str, prefix: bytes) -> int:
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise LayoutUnreadable(f"{file_name}: safetensors header too large")
    return int(length)


def declared_header_length(file_name: str, read: Callable[[int, int], bytes], available: int) -> int | None:
    """The header length a safetensors file's 8-byte prefix declares, nothing more read; None
    while fewer than 8 bytes are there. Raises `LayoutUnreadable` over `MAX_HEADER_BYTES`."""
    return None if available < 8 else _header_length(file_name, read(0, 8))


def reader(fd: int) -> Callable[[int, int], bytes]:
    """`read(start, end)` of the file open at `fd`, as `read_header` takes it."""
    return lambda start, end: os.pread(fd, end - start, start)


TENSOR_KEY = b'"data_offsets"'
"""Every tensor's entry in a header has this key once: counting it counts tensors unparsed."""


def header_totals(directory: Path, names: Iterable[str], max_bytes: int, max_tensors: int) -> tuple[int, int]:
    """What the headers of the safetensors files `names` in `directory` add up to, no JSON
    parsed: their lengths as each file's 8-byte prefix declares them, summed (over
    `max_bytes`, nothing more is read and no tensor counted); then their tensors, counted by
    `TENSOR_KEY` at C speed, until past `max_tensors`. A header not all there yet counts as
    declared, its tensors as far as written. An estimate for a hostile header (a key written
    with escapes is not counted): parse with `max_tensors` all the same. Raises
    `LayoutUnreadable` for a length no safetensors file has; OSError as `open_regular`."""
    lengths: dict[str, int] = {}
    for name in names:
        fd = open_regular(directory / name)
        try:
            lengths[name] = declared_header_length(name, reader(fd), os.fstat(fd).st_size) or 0
        finally:
            os.close(fd)
    total, tensors = sum(lengths.values()), 0
    for name, length in lengths.items():
        if total > max_bytes or tensors > max_tensors:
            break
        fd = open_regular(directory / name)
        try:
            tensors += os.pread(fd, length, 8).count(TENSOR_KEY)
        finally:
            os.close(fd)
    return total, tensors


@dataclass(frozen=True)
class Header:
    data_start: int
    """Where tensor data begins: after the 8-byte length and the JSON."""
    tensors: list[Tensor]

    @property
    def whole_size(self) -> int:
        return max((t.end for t in self.tensors), default=self.data_start)


def read_header(
    file_name: str, read: Callable[[int, int], bytes], available: int, max_tensors: int | None = None
) -> Header | None:
    """The header of one safetensors file whose first `available` bytes can be read with
    `read(start, end)` (local or remote); None while the header itself is not all there yet
    (a writer still at it). Raises `LayoutUnreadable` (`TooManyTensors` past `max_tensors`)."""
    length = declared_header_length(file_name, read, available)
    if length is None or available < 8 + length:
        return None
    return Header(8 + length, parse_header(file_name, read(8, 8 + length), 8 + length, max_tensors))


def size_from_header(
    file_name: str, read: Callable[[int, int], bytes], available: int, max_tensors: int | None = None
) -> int | None:
    """The size a safetensors file has when whole, from its header; None while the header
    is not all there yet. Raises `LayoutUnreadable` (`TooManyTensors` past `max_tensors`)."""
    found = read_header(file_name, read, available, max_tensors)
    return None if found is None else found.whole_size


def header_in(fd: int, file_name: str, max_tensors: int | None = None) -> Header:
    """The header of the safetensors file open at `fd` (LayoutUnreadable if it is cut short;
    `TooManyTensors` past `max_tensors`)."""
    size = os.fstat(fd).st_size
    found = read_header(file_name, reader(fd), size, max_tensors)
    if found is None:
        raise LayoutUnreadable(f"{file_name}: too short for its safetensors header")
    return found


def tensors_of(path: Path) -> list[Tensor]:
    """Every tensor of one safetensors file on disk. Raises `LayoutUnreadable` or `OSError`."""
    fd = open_regular(path)
    try:
        return header_in(fd, path.name).tensors
    finally:
        os.close(fd)


def layout_problem(file_name: str, header: Header, file_size: int) -> str | None:
    """What safetensors itself would refuse in a header: an unknown dtype, a tensor whose
    bytes do not fit its shape, a gap or overlap between tensors, data that does not end
    exactly where the file does. Checked from the header alone, before any data is read."""
    position = header.data_start
    for tensor in sorted(header.tensors, key=lambda t: (t.start, t.end)):
        bits = DTYPE_BITS.get(tensor.dtype)
        if bits is None:
            return f"{file_name}: tensor {tensor.name} has unknown dtype {tensor.dtype!r}"
        elements = math.prod(tensor.shape)
        if elements * bits % 8 or elements * bits // 8 != tensor.nbytes:
            shape = f"{tensor.dtype}{list(tensor.shape)}"
            return f"{file_name}: tensor {tensor.name} has {tensor.nbytes} bytes for {shape}"
        if tensor.start != position:
            return f"{file_name}: tensor {tensor.name} does not start where the one before ends"
        position = tensor.end
    if position != file_size:
        return f"{file_name}: tensor data ends at byte {position}, the file at byte {file_size}"
    return None
