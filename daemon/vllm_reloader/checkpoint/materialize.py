"""Materializing a delta version (`checkpoint.delta`): the full version it produces, written
from the base's verified directory and the delta's, every byte checked against the manifest
before the directory is whole; nothing partial is left behind."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import blake3

from ..durable import fsync_dir, write_synced
from ..errors import LayoutUnreadable, ManifestInvalid, NotJSONYet
from .delta import Container, DeltaUnusable, apply, digest, open_container, word
from .files import header_in, is_top_level_shard, open_regular, read_exactly, read_small
from .manifest import (
    DELTA_NAME,
    MANIFEST_NAME,
    DeltaTensor,
    Manifest,
    ManifestFile,
    base_fingerprint,
    dumps,
    parse,
    path_problem,
)

Changed = dict[str, list[tuple[int, DeltaTensor]]]
"""Each shard's changed tensors, with their index in `delta.tensors`."""


def materialize(base: Path, delta_dir: Path, manifest: Manifest, out: Path) -> None:
    """Write the full version a delta's `manifest` produces into the new directory `out`, from
    the base's full directory (a version whose manifest it names) and the delta's.

    A shard with no changed tensor is a hard link to the base's, once the base's manifest lists
    it with the same digest (nothing writes to it); the others are copies with each changed
    tensor's bytes produced, checked against its digest, then the whole shard against the
    manifest's; the other files are copied from the delta, checked as they are copied. No link
    is followed below either directory. Raises DeltaUnusable naming the base, the file or the
    tensor (and leaves no `out`); OSError for this host's disk."""
    delta = manifest.delta
    if delta is None:
        raise DeltaUnusable("not a delta version")
    if problem := path_problem(manifest):  # nothing is written outside `out`, read outside the two
        raise DeltaUnusable(problem)
    if not delta.file.blake3 or not all(e.blake3 for e in manifest.files):
        raise DeltaUnusable("a delta's manifest lists a blake3 for every file")
    try:
        raw = read_small(base / MANIFEST_NAME)
        named, listed = base_fingerprint(raw), {e.path: e for e in parse(raw).produced().files}
    except (OSError, NotJSONYet, ManifestInvalid) as exc:
        raise DeltaUnusable(f"its base {base.name} cannot be read: {exc}") from exc
    if named != delta.base:
        raise DeltaUnusable(f"its base is {delta.base[:16]}, not {base.name} ({named[:16]})")
    changed: Changed = {}
    for index, tensor in enumerate(delta.tensors):
        changed.setdefault(tensor.shard, []).append((index, tensor))
    out.mkdir()
    try:
        _produce(base, listed, delta_dir, manifest, out, changed)
        fsync_dir(out)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # nothing partial is left to be taken for a version
        raise


def _produce(
    base: Path,
    listed: dict[str, ManifestFile],
    delta_dir: Path,
    manifest: Manifest,
    out: Path,
    changed: Changed,
) -> None:
    delta = manifest.delta
    assert delta is not None
    container_path = _unlinked(delta_dir, DELTA_NAME)
    with open_container(container_path, delta.file, len(delta.tensors)) as container:
        for entry in manifest.files:
            target = out / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            if not is_top_level_shard(entry.path):
                _copy(_unlinked(delta_dir, entry.path), target, entry)
            elif entry.path not in changed:
                if (theirs := listed.get(entry.path)) is None or _digest_of(theirs) != _digest_of(entry):
                    raise DeltaUnusable(f"{entry.path} is unchanged, yet not the base's (size or blake3)")
                _link_or_copy(base / entry.path, target, entry)
            else:
                if (theirs := listed.get(entry.path)) is None or theirs.size != entry.size:
                    raise DeltaUnusable(f"{entry.path}: the base has none of {entry.size} bytes")
                _copy(base / entry.path, target, theirs, produced=False)  # checked once produced
                _replace(target, entry, changed[entry.path], container)
    _check_file(container_path, delta.file)  # after the tensors: a bad one is named
    write_synced(out / MANIFEST_NAME, dumps(manifest.produced()))


def _digest_of(entry: ManifestFile) -> tuple[int, str | None]:
    return entry.size, entry.blake3


def _unlinked(directory: Path, relative: str) -> Path:
    """`directory / relative`, refused if a folder on the way is a link (the file itself is
    opened without following one)."""
    path = directory
    for part in relative.split("/")[:-1]:
        path = path / part
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise DeltaUnusable(f"{relative}: {part} is not a folder (a link is never followed)")
        except FileNotFoundError:
            raise DeltaUnusable(f"{relative} is missing") from None
    return directory / relative


def _replace(
    shard: Path, entry: ManifestFile, tensors: list[tuple[int, DeltaTensor]], container: Container
) -> None:
    fd = os.open(shard, os.O_RDWR | os.O_CLOEXEC)
    try:
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
                apply(data, where.dtype, tensor.encoding, _reader(container, index, data, where.dtype))
            except (ValueError, OverflowError, MemoryError) as exc:
                raise DeltaUnusable(f"{what}: its entries are not one: {exc}") from None
            except DeltaUnusable as exc:
                raise DeltaUnusable(f"{what}: {exc}") from None
            if digest(data) != tensor.blake3:
                raise DeltaUnusable(f"{what}: what the delta produces does not match its digest")
            _write_at(fd, data, where.start)
        os.fsync(fd)
        _check_fd(fd, entry, f"{entry.path} as produced")
    finally:
        os.close(fd)


def _reader(container: Container, index: int, tensor: bytearray, dtype: str) -> Callable[[str], bytes]:
    """A tensor's entries, none larger than it can use: its bytes, a gap byte per element, or a
    long gap (U64 at most) per element."""
    elements = len(tensor) // word(dtype).itemsize
    limits = {"": len(tensor), ".values": len(tensor), ".gaps": elements, ".far": elements * 8}

    def read(suffix: str) -> bytes:
        return bytes(container.read(f"{index}{suffix}", limits.get(suffix, 0)))

    return read


def _check_file(path: Path, entry: ManifestFile) -> None:
    fd = open_regular(path)
    try:
        _check_fd(fd, entry, entry.path)
    finally:
        os.close(fd)


def _check_fd(fd: int, entry: ManifestFile, what: str) -> None:
    """The file open at `fd` is the manifest's `entry` (size and blake3), read from its start."""
    hasher, size, offset = blake3.blake3(), 0, 0
    while chunk := os.pread(fd, 8 << 20, offset):
        hasher.update(chunk)
        size += len(chunk)
        offset += len(chunk)
    if size != entry.size or hasher.hexdigest() != entry.blake3:
        raise DeltaUnusable(f"{what} is not the file its manifest lists (size or blake3)")


def _write_at(fd: int, data: bytearray, offset: int) -> None:
    view, done = memoryview(data), 0
    while done < len(data):
        done += os.pwrite(fd, view[done:], offset + done)


def _link_or_copy(source: Path, target: Path, entry: ManifestFile) -> None:
    """Shared with the base's copy (which nothing writes to), or copied where the filesystem
    cannot link. The base's files are its verified copy: a link is never taken for one."""
    if not stat.S_ISREG(os.lstat(source).st_mode):
        raise DeltaUnusable(f"{source.name} of the base is not a regular file")
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError:
        _copy(source, target, entry)


def _copy(source: Path, target: Path, entry: ManifestFile, *, produced: bool = True) -> None:
    """A copy of a regular file (no link followed), only if it is `entry`'s size; then synced
    and checked against `entry`, unless it is not `produced` yet (a shard whose tensors are
    replaced next, then synced and checked whole against the version's entry)."""
    try:
        fd = open_regular(source)
    except FileNotFoundError:
        raise DeltaUnusable(f"{entry.path} is missing") from None
    except OSError as exc:
        raise DeltaUnusable(f"{entry.path} cannot be read: {exc.strerror or exc}") from None
    try:
        if (size := os.fstat(fd).st_size) != entry.size:
            raise DeltaUnusable(f"{entry.path} has {size} bytes, its manifest lists {entry.size}")
        with target.open("xb") as out:
            done = 0
            while done < size and (n := os.copy_file_range(fd, out.fileno(), size - done, done, done)):
                done += n
            if done != size:
                raise DeltaUnusable(f"{entry.path} ended at {done} of {size} bytes while copied")
            if not produced:
                return
            os.fsync(out.fileno())
        with target.open("rb") as copied:
            _check_fd(copied.fileno(), entry, entry.path)
    finally:
        os.close(fd)
