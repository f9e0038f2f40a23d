"""A checkpoint's files as vLLM's loader sees them: which are shards, which shards an HF
index names, and what each safetensors header promises (tensors, offsets, whole size).

Standard library only (and `errors`, which imports nothing): the worker extension runs
inside the vLLM engine, where only torch and safetensors can be counted on, and reads
checkpoints through this module, so the engine and the daemon apply the same rules.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import LayoutUnreadable, NotJSONYet

WEIGHT_SUFFIX = ".safetensors"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000
"""safetensors caps its header at 100 MB; anything larger is not a header."""


def is_top_level_shard(name: str) -> bool:
    """A file vLLM's loader reads: a `*.safetensors` directly in the checkpoint directory
    (its glob skips dot-files)."""
    return "/" not in name and not name.startswith(".") and name.endswith(WEIGHT_SUFFIX)


def weights_from_index(data: bytes) -> list[str] | str:
    """The shard names an HF index maps tensors to, or why it cannot be used.
    Raises `NotJSONYet` when the bytes are not (yet) JSON."""
    try:
        index = json.loads(data)
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


def parse_header(file_name: str, raw: bytes, data_start: int) -> list[Tensor]:
    """The tensors a safetensors header (the JSON after its 8-byte length) lists, in header
    order. Raises `LayoutUnreadable` naming the file."""
    try:
        header = json.loads(raw)
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
    return tensors


def _header_length(file_name: str, prefix: bytes) -> int:
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise LayoutUnreadable(f"{file_name}: safetensors header too large")
    return int(length)


def _read_header(
    file_name: str, read: Callable[[int, int], bytes], available: int
) -> tuple[int, list[Tensor]] | None:
    """(where the data starts, the tensors), or None while the header is not all there."""
    if available < 8:
        return None
    length = _header_length(file_name, read(0, 8))
    if available < 8 + length:
        return None
    return 8 + length, parse_header(file_name, read(8, 8 + length), 8 + length)


def read_tensors(file_name: str, read: Callable[[int, int], bytes], available: int) -> list[Tensor] | None:
    """The tensors of one safetensors file whose first `available` bytes can be read with
    `read(start, end)` (local or remote); None while the header itself is not all there yet
    (a writer still at it). Raises `LayoutUnreadable`."""
    found = _read_header(file_name, read, available)
    return None if found is None else found[1]


def size_from_header(file_name: str, read: Callable[[int, int], bytes], available: int) -> int | None:
    """The size a safetensors file has when whole, from its header; None while the header
    is not all there yet. Raises `LayoutUnreadable`."""
    found = _read_header(file_name, read, available)
    if found is None:
        return None
    data_start, tensors = found
    return max((t.end for t in tensors), default=data_start)


def tensors_of(path: Path) -> list[Tensor]:
    """Every tensor of one safetensors file on disk. Raises `LayoutUnreadable` (a file too
    short for its header included) or `OSError`."""
    with path.open("rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        found = read_tensors(path.name, lambda start, end: os.pread(fd, end - start, start), size)
    if found is None:
        raise LayoutUnreadable(f"{path.name}: too short for its safetensors header")
    return found
