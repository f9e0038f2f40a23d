"""Delta versions: only what changed since a base version, each produced tensor bound by its digest.

A delta version's directory holds `manifest.json` — the manifest of the full version it
produces (every file with its size and blake3) plus `delta` — and `delta.safetensors` (the
encodings), and the full version's files that are no shard (config.json, a tokenizer), whole.
Its shards have the base's names and headers: each is the base's shard with the changed
tensors' bytes replaced (a tensor that changed name, shape or dtype makes a full version).
`delta.tensors` names each changed tensor, its shard, its encoding and the blake3 of the bytes
it produces; what it does not name is the base's, byte for byte.

The encodings, in `delta.safetensors`, under the tensor's index in `delta.tensors`:

- `whole`: `I` — the new bytes (U8).
- `sparse`: `I.positions` (U32, or U64 past 2**32 elements: which elements changed,
  ascending) and `I.values` (their new bits, as unsigned integers of the element's width).

The producer takes, per tensor, whichever is smaller. A one-step update of bf16 weights from
fp32 master weights moves only the elements whose update crossed a bf16 rounding step: sparse.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import stat
import struct
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import blake3
import numpy as np

from ..durable import write_synced
from ..errors import LayoutUnreadable, ManifestInvalid, NotJSONYet
from .files import (
    DTYPE_BITS,
    Header,
    Tensor,
    header_in,
    is_top_level_shard,
    open_regular,
    read_exactly,
    read_small,
)
from .manifest import (
    DELTA_NAME,
    MANIFEST_NAME,
    DeltaTensor,
    Manifest,
    ManifestFile,
    base_fingerprint,
    dumps,
    path_problem,
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
    """One changed tensor's encoding: the entries it adds to `delta.safetensors`."""

    encoding: Literal["whole", "sparse"]
    entries: dict[str, tuple[str, bytes]]
    """key suffix ("" or ".positions", ".values") → (dtype, bytes)."""

    @property
    def nbytes(self) -> int:
        return sum(len(data) for _, data in self.entries.values())


def word(dtype: str) -> np.dtype[np.unsignedinteger]:
    """The unsigned integer one element's bits are compared as (a byte, for sub-byte dtypes)."""
    bits = DTYPE_BITS.get(dtype, 8)
    return _WORDS[bits // 8] if bits in (8, 16, 32, 64) else _WORDS[1]


def encode(old: bytes | memoryview, new: bytes | memoryview, dtype: str) -> Encoded | None:
    """The smaller encoding of `new` over `old` (same dtype and size); None if equal."""
    unit = word(dtype)
    before = np.frombuffer(old, dtype=unit)
    after = np.frombuffer(new, dtype=unit)
    positions = np.flatnonzero(before != after)
    if positions.size == 0:
        return None
    wide = 8 if after.size > 2**32 else 4
    sparse_bytes = positions.size * (wide + unit.itemsize)
    if sparse_bytes >= len(new):
        return Encoded("whole", {"": ("U8", bytes(new))})
    index = positions.astype(_WORDS[wide])
    return Encoded(
        "sparse",
        {
            ".positions": (_WORD_DTYPES[wide], index.tobytes()),
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
    positions = np.frombuffer(read(".positions"), dtype=_WORDS[8 if target.size > 2**32 else 4])
    values = np.frombuffer(read(".values"), dtype=unit)
    if positions.size != values.size:
        raise DeltaUnusable(f"{positions.size} positions for {values.size} values")
    if positions.size and (
        int(positions.max()) >= target.size or np.any(np.diff(positions.astype(np.int64)) <= 0)
    ):
        raise DeltaUnusable("positions outside the tensor or not ascending")
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
    """An open `delta.safetensors`: its entries by key."""

    fd: int
    entries: dict[str, Tensor]

    def read(self, key: str) -> bytes:
        found = self.entries.get(key)
        if found is None:
            raise DeltaUnusable(f"{DELTA_NAME} has no entry {key!r}")
        data = bytearray(found.nbytes)
        read_exactly(self.fd, memoryview(data), found.start)
        return bytes(data)


@contextmanager
def open_container(path: Path) -> Iterator[Container]:
    """`delta.safetensors`, opened as the gate opens a writer's file (no link, regular only)."""
    fd = open_regular(path)
    try:
        try:
            header = header_in(fd, DELTA_NAME)
        except LayoutUnreadable as exc:
            raise DeltaUnusable(str(exc)) from exc
        yield Container(fd, {t.name: t for t in header.tensors})
    finally:
        os.close(fd)


# --- materializing: the full version a delta produces ------------------------------------


Changed = dict[str, list[tuple[int, DeltaTensor]]]
"""Each shard's changed tensors, with their index in `delta.tensors`."""


def materialize(base: Path, delta_dir: Path, manifest: Manifest, out: Path) -> None:
    """Write the full version a delta's `manifest` produces into the new directory `out`, from
    the base's full directory and the delta's. A shard with no changed tensor is a hard link to
    the base's (which is never written to); the others are copies with each changed tensor's
    bytes replaced, once they match the tensor's digest. Raises DeltaUnusable naming the base,
    the file or the tensor; OSError for this host's disk."""
    delta = manifest.delta
    if delta is None:
        raise DeltaUnusable("not a delta version")
    if problem := path_problem(manifest):  # nothing is written outside `out`, read outside the two
        raise DeltaUnusable(problem)
    try:
        named = base_fingerprint(read_small(base / MANIFEST_NAME))
    except (OSError, NotJSONYet, ManifestInvalid) as exc:
        raise DeltaUnusable(f"its base {base.name} cannot be read: {exc}") from exc
    if named != delta.base:
        raise DeltaUnusable(f"its base is {delta.base[:16]}, not {base.name} ({named[:16]})")
    changed: Changed = {}
    for index, tensor in enumerate(delta.tensors):
        changed.setdefault(tensor.shard, []).append((index, tensor))
    out.mkdir()
    try:
        _produce(base, delta_dir, manifest, out, changed)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # nothing partial is left to be taken for a version
        raise


def _produce(
    base: Path,
    delta_dir: Path,
    manifest: Manifest,
    out: Path,
    changed: dict[str, list[tuple[int, DeltaTensor]]],
) -> None:
    delta = manifest.delta
    assert delta is not None
    with open_container(delta_dir / DELTA_NAME) as container:
        for entry in manifest.files:
            target = out / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            if not is_top_level_shard(entry.path):
                _copy(delta_dir / entry.path, target)
            elif entry.path not in changed:
                _link_or_copy(base / entry.path, target)
            else:
                _copy(base / entry.path, target)
                _replace(target, entry, changed[entry.path], container)
    _check_file(delta_dir, delta.file)  # after the tensors: a bad one is named
    write_synced(out / MANIFEST_NAME, dumps(manifest.produced()))


def _replace(
    shard: Path, entry: ManifestFile, tensors: list[tuple[int, DeltaTensor]], container: Container
) -> None:
    fd = os.open(shard, os.O_RDWR | os.O_CLOEXEC)
    try:
        if (size := os.fstat(fd).st_size) != entry.size:
            raise DeltaUnusable(f"{entry.path}: the base's is {size} bytes, the version's {entry.size}")
        try:
            found = {t.name: t for t in header_in(fd, entry.path).tensors}
        except LayoutUnreadable as exc:
            raise DeltaUnusable(str(exc)) from exc
        for index, tensor in tensors:
            where = found.get(tensor.name)
            if where is None:
                raise DeltaUnusable(f"tensor {tensor.name!r} is not in the base's {entry.path}")
            data = bytearray(where.nbytes)
            read_exactly(fd, memoryview(data), where.start)
            what = f"tensor {tensor.name!r} in {entry.path}"
            try:
                apply(data, where.dtype, tensor.encoding, functools.partial(_entry, container, index))
            except DeltaUnusable as exc:
                raise DeltaUnusable(f"{what}: {exc}") from None
            if digest(data) != tensor.blake3:
                raise DeltaUnusable(f"{what}: what the delta produces does not match its digest")
            _write_at(fd, data, where.start)
        os.fsync(fd)
    finally:
        os.close(fd)


def _entry(container: Container, index: int, suffix: str) -> bytes:
    return container.read(f"{index}{suffix}")


def _check_file(directory: Path, entry: ManifestFile) -> None:
    """`delta.safetensors` is what the manifest says (its tensors' digests bind what it
    produces; this catches the rest)."""
    fd = open_regular(directory / entry.path)
    try:
        hasher, size = blake3.blake3(), 0
        while chunk := os.read(fd, 8 << 20):
            hasher.update(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size != entry.size or (entry.blake3 and hasher.hexdigest() != entry.blake3):
        raise DeltaUnusable(f"{entry.path} is not the one its manifest lists (size or blake3)")


def _write_at(fd: int, data: bytearray, offset: int) -> None:
    view, done = memoryview(data), 0
    while done < len(data):
        done += os.pwrite(fd, view[done:], offset + done)


def _link_or_copy(source: Path, target: Path) -> None:
    """Shared with the base's copy (never written to by anyone), or copied where the
    filesystem cannot link."""
    try:
        if not stat.S_ISREG(os.lstat(source).st_mode):
            raise DeltaUnusable(f"{source.name} of the base is not a regular file")
        os.link(source, target, follow_symlinks=False)
    except OSError:
        _copy(source, target)


def _copy(source: Path, target: Path) -> None:
    """A copy of a regular file (no link followed), extents shared where the filesystem can."""
    fd = open_regular(source)
    try:
        with target.open("xb") as out:
            size, done = os.fstat(fd).st_size, 0
            try:
                while done < size and (n := os.copy_file_range(fd, out.fileno(), size - done)):
                    done += n
            except OSError:
                os.lseek(fd, done, os.SEEK_SET)
                out.seek(done)
                shutil.copyfileobj(os.fdopen(os.dup(fd), "rb"), out, 8 << 20)
            out.flush()
            os.fsync(out.fileno())
    finally:
        os.close(fd)
