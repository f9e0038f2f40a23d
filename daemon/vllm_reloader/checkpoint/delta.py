"""Delta versions: only what changed since a base version, each produced tensor bound by its digest.

A delta version's directory holds `manifest.json` — the manifest of the full version it
produces (every file with its size and blake3) plus `delta` — and `delta/tensors.safetensors`
(the encodings; in a folder, as vLLM's loader reads every top-level `*.safetensors`), and the
full version's files that are no shard (config.json, a tokenizer), whole. Its shards are the
base's byte for byte (header, metadata, size) but for the changed tensors' bytes: anything
else that differs makes a full version. `delta.tensors` names each changed tensor, its shard,
its encoding and the blake3 of the bytes it produces.

The encodings, in the container, under the tensor's index in `delta.tensors`:

- `whole`: `I` — the new bytes (U8).
- `sparse`: which units changed, as the gaps between them (the first from -1): `I.gaps` (U8,
  one per changed unit; 0 for a gap of 256 or more, which is the next of `I.far`: U32, or U64
  past 2**32 units), and `I.values` (their new bits). A unit is one element, as an unsigned
  integer of its width; for the sub-byte dtypes (F4, F6) one byte. Most gaps fit a byte: a
  changed element costs its bits and about one byte.

The producer takes, per tensor, whichever is smaller. A one-step update of bf16 weights from
fp32 master weights moves only the elements whose update crossed a bf16 rounding step: sparse.
Materializing is `checkpoint.materialize`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import blake3
import numpy as np

from ..errors import LayoutUnreadable
from .files import (
    DTYPE_BITS,
    Header,
    Tensor,
    header_in,
    layout_problem,
    open_regular,
    read_exactly,
)
from .manifest import (
    DELTA_NAME,
    ManifestFile,
)

_WORDS: dict[int, np.dtype[np.unsignedinteger]] = {
    1: np.dtype("u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}
_WORD_DTYPES = {1: "U8", 2: "U16", 4: "U32", 8: "U64"}


class DeltaUnusable(Exception):
    """A delta that cannot produce its version: the message names the tensor or the file."""


@dataclass(frozen=True)
class Encoded:
    """One changed tensor's encoding: the entries it adds to the container."""

    encoding: Literal["whole", "sparse"]
    entries: dict[str, tuple[str, bytes]]
    """key suffix ("", or ".gaps", ".far", ".values") → (dtype, bytes)."""

    @property
    def nbytes(self) -> int:
        return sum(len(data) for _, data in self.entries.values())


def word(dtype: str) -> np.dtype[np.unsignedinteger]:
    """The unsigned integer one element's bits are compared as (a byte, for sub-byte dtypes)."""
    bits = DTYPE_BITS.get(dtype, 8)
    return _WORDS[bits // 8] if bits in (8, 16, 32, 64) else _WORDS[1]


def _wide(units: int) -> int:
    """Bytes of a gap too long for one byte: 4, or 8 past 2**32 units."""
    return 8 if units > 2**32 else 4


def encode(old: bytes | memoryview, new: bytes | memoryview, dtype: str) -> Encoded | None:
    """The smaller encoding of `new` over `old` (same dtype and size); None if equal."""
    unit = word(dtype)
    before = np.frombuffer(old, dtype=unit)
    after = np.frombuffer(new, dtype=unit)
    positions = np.flatnonzero(before != after)
    if positions.size == 0:
        return None
    gaps = np.diff(positions, prepend=-1)  # each at least 1
    far = gaps[gaps > 255]
    wide = _wide(after.size)
    sparse_bytes = positions.size * (1 + unit.itemsize) + far.size * wide
    if sparse_bytes >= len(new):
        return Encoded("whole", {"": ("U8", bytes(new))})
    near = np.where(gaps > 255, 0, gaps).astype(np.uint8)
    return Encoded(
        "sparse",
        {
            ".gaps": ("U8", near.tobytes()),
            ".far": (_WORD_DTYPES[wide], far.astype(_WORDS[wide]).tobytes()),
            ".values": (_WORD_DTYPES[unit.itemsize], after[positions].tobytes()),
        },
    )


def apply(into: bytearray | memoryview, dtype: str, encoding: str, read: Callable[[str], bytes]) -> None:
    """Turn the base tensor's bytes `into` the new ones, from the entries `read(suffix)` gives.
    Raises DeltaUnusable when the entries do not fit the tensor."""
    if encoding == "whole":
        data = read("")
        if len(data) != len(into):
            raise DeltaUnusable(f"{len(data)} bytes for a tensor of {len(into)}")
        into[:] = data
        return
    unit = word(dtype)
    target = np.frombuffer(into, dtype=unit)
    near = np.frombuffer(read(".gaps"), dtype=np.uint8)
    far = np.frombuffer(read(".far"), dtype=_WORDS[_wide(target.size)])
    values = np.frombuffer(read(".values"), dtype=unit)
    if near.size != values.size:
        raise DeltaUnusable(f"{near.size} positions for {values.size} values")
    escaped = near == 0
    if int(escaped.sum()) != far.size or (far.size and int(far.min()) < 256):
        raise DeltaUnusable("its long gaps do not match its escapes")
    gaps = near.astype(np.int64)
    gaps[escaped] = far.astype(np.int64)
    positions = np.cumsum(gaps) - 1
    if positions.size and int(positions[-1]) >= target.size:
        raise DeltaUnusable("positions outside the tensor")
    target[positions] = values


def same_layout(base: Header, new: Header) -> str | None:
    """Why `new` cannot be a delta of `base` (a shard's tensors, shapes, dtypes or offsets
    differ), or None."""
    ours = {t.name: (t.dtype, t.shape, t.start, t.end) for t in base.tensors}
    theirs = {t.name: (t.dtype, t.shape, t.start, t.end) for t in new.tensors}
    if base.data_start != new.data_start or ours != theirs:
        changed = sorted(set(ours) ^ set(theirs)) or sorted(n for n in ours if ours[n] != theirs.get(n))
        return (
            f"tensor {changed[0]!r} differs in name, dtype, shape or place" if changed else "header differs"
        )
    return None


def digest(data: bytes | bytearray | memoryview) -> str:
    return blake3.blake3(data).hexdigest()


# --- delta.safetensors: written and read without torch ---------------------------------


def write_container(path: Path, entries: Mapping[str, tuple[str, bytes]]) -> None:
    """A safetensors file of raw entries (key → dtype, bytes), one dimension each, fsynced."""
    header: dict[str, object] = {}
    offset = 0
    for key, (dtype, data) in entries.items():
        width = max(1, DTYPE_BITS[dtype] // 8)
        header[key] = {
            "dtype": dtype,
            "shape": [len(data) // width],
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    with path.open("xb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for _, data in entries.values():
            out.write(data)
        out.flush()
        os.fsync(out.fileno())


@dataclass(frozen=True)
class Container:
    """An open container: its entries by key, each within the file."""

    fd: int
    entries: dict[str, Tensor]

    def read(self, key: str, limit: int) -> bytearray:
        """An entry's bytes; refused, before anything is allocated, past `limit` bytes."""
        found = self.entries.get(key)
        if found is None:
            raise DeltaUnusable(f"{DELTA_NAME} has no entry {key!r}")
        if found.nbytes > limit:
            raise DeltaUnusable(f"{DELTA_NAME} entry {key!r} has {found.nbytes} bytes, more than {limit}")
        data = bytearray(found.nbytes)
        read_exactly(self.fd, memoryview(data), found.start)
        return data


@contextmanager
def open_container(path: Path, entry: ManifestFile, tensors: int) -> Iterator[Container]:
    """The container, opened as the gate opens a writer's file (no link, regular only), only if
    it has the size its manifest lists, a header of at most three entries per changed tensor, and
    every entry inside it."""
    fd = open_regular(path)
    try:
        if (size := os.fstat(fd).st_size) != entry.size:
            raise DeltaUnusable(f"{DELTA_NAME} has {size} bytes, its manifest lists {entry.size}")
        try:
            header = header_in(fd, DELTA_NAME, max_tensors=3 * tensors)
        except LayoutUnreadable as exc:
            raise DeltaUnusable(str(exc)) from exc
        if (problem := layout_problem(DELTA_NAME, header, size)) is not None:
            raise DeltaUnusable(problem)
        yield Container(fd, {t.name: t for t in header.tensors})
    finally:
        os.close(fd)
