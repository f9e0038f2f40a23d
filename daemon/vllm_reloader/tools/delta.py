"""The producer side of delta versions (`checkpoint.delta`): `publish_delta`, which a training
loop calls after saving its weights (no command-line flag until the daemon loads deltas).

The base is a version already in the root. Each shard of SRC is compared with the base's shard
of the same name, tensor by tensor: the changed ones go into `delta.safetensors`, each in its
smaller encoding with the digest of its new bytes; the manifest lists the full version's files
with their digests. A full version is published instead (and said why) when the shards' names
or headers differ, when the chain would pass `MAX_CHAIN`, or when the delta is not smaller.
The version appears whole or not at all, as `publish` places it (`claim`, `commit`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import blake3

from ..checkpoint.delta import (
    DeltaUnusable,
    Encoded,
    digest,
    encode,
    same_layout,
    write_container,
)
from ..checkpoint.files import header_in, is_top_level_shard, read_exactly, read_small
from ..checkpoint.manifest import (
    DELTA_NAME,
    MANIFEST_NAME,
    MAX_CHAIN,
    Delta,
    DeltaTensor,
    Manifest,
    ManifestFile,
    base_fingerprint,
    parse,
)
from ..checkpoint.materialize import materialize
from ..durable import fsync_dir
from ..errors import ManifestInvalid, NotJSONYet, PublishError
from .publish import checked_name, claim, commit, copy_and_hash, default_name, publish, source_files


@dataclass(frozen=True)
class Published:
    path: Path
    delta: bool
    why_full: str = ""
    """Why a full version was published instead of a delta."""


@dataclass(frozen=True)
class _Changed:
    shard: str
    name: str
    encoded: Encoded
    blake3: str


def publish_delta(
    src: Path,
    root: Path,
    *,
    delta_from: str,
    name: str | None = None,
    step: int | None = None,
    base_weights: Path | None = None,
) -> Published:
    """Publish SRC into ROOT as a delta of ROOT/`delta_from`, or whole when a delta cannot be,
    or would not be smaller. `base_weights`: the base's full shards as the trainer saved them
    (its previous step), so a delta of a delta is not produced again from its chain; were
    they not the base's, materializing refuses the delta (a shard it produces, or one it says
    is unchanged, is not the manifest's)."""
    name = checked_name(name or default_name(src, step))
    base = root / checked_name(delta_from)
    try:
        raw = read_small(base / MANIFEST_NAME)
        base_manifest, base_fp = parse(raw), base_fingerprint(raw)
    except (OSError, NotJSONYet, ManifestInvalid) as exc:
        raise PublishError(f"--delta-from {delta_from}: not a published version in {root} ({exc})") from exc
    depth = (base_manifest.delta.depth if base_manifest.delta else 0) + 1
    if depth > MAX_CHAIN:
        return _whole(src, root, name, step, f"{delta_from} ends a chain of {MAX_CHAIN} deltas")
    files = source_files(src)
    if (root / name).exists():
        raise PublishError(f"{root / name} already exists; versions are never overwritten")
    folder = DELTA_NAME.split("/")[0]
    if any(p.relative_to(src).parts[0] == folder for p in files):
        raise PublishError(f"{src}: a {folder}/ folder holds a delta's encodings: rename it")
    if base_weights is not None:
        changed, shard_entries, why = _changes(src, base_weights, files)
    else:
        with _full_weights(root, base, base_manifest) as full_base:
            changed, shard_entries, why = _changes(src, full_base, files)
    if why:
        return _whole(src, root, name, step, why)
    if changed and all(c.encoded.encoding == "whole" for c in changed):
        return _whole(src, root, name, step, "every changed tensor changed whole: a delta is no smaller")
    entries = {f"{i}{key}": item for i, c in enumerate(changed) for key, item in c.encoded.entries.items()}
    incoming = claim(root, name)
    try:
        (incoming / DELTA_NAME).parent.mkdir()
        write_container(incoming / DELTA_NAME, entries)
        listed = [
            shard_entries.get(p.relative_to(src).as_posix()) or _copied(src, p, incoming) for p in files
        ]
        delta = Delta(
            base=base_fp,
            base_version=delta_from,
            depth=depth,
            file=_entry(incoming / DELTA_NAME, DELTA_NAME),
            tensors=tuple(_described(c) for c in changed),
        )
        manifest = Manifest(format_version=1, version=name, step=step, files=tuple(listed), delta=delta)
        commit(incoming, root / name, manifest)
    except BaseException as exc:
        shutil.rmtree(incoming, ignore_errors=True)
        if isinstance(exc, OSError):
            raise PublishError(f"publishing {name}: {exc.strerror or exc}") from exc
        raise
    try:
        fsync_dir(root)  # the rename survives a crash
    except OSError as exc:
        raise PublishError(f"published {root / name}, but then: {exc.strerror or exc}") from exc
    return Published(root / name, delta=True)


def _described(changed: _Changed) -> DeltaTensor:
    encoding = changed.encoded.encoding
    return DeltaTensor(name=changed.name, shard=changed.shard, encoding=encoding, blake3=changed.blake3)


def _whole(src: Path, root: Path, name: str, step: int | None, why: str) -> Published:
    return Published(publish(src, root, name=name, step=step), delta=False, why_full=why)


def _changes(src: Path, base: Path, files: list[Path]) -> tuple[list[_Changed], dict[str, ManifestFile], str]:
    """Each changed tensor of SRC's shards over the base's, and SRC's shards' entries (from the
    same one read of their bytes), or why there can be no delta."""
    shards = [_relative(src, p) for p in files if _is_shard(src, p)]
    theirs = sorted(p.name for p in base.iterdir() if is_top_level_shard(p.name))
    if sorted(shards) != theirs:
        return [], {}, "its shards are not the base's (names)"
    changed: list[_Changed] = []
    entries: dict[str, ManifestFile] = {}
    for shard in shards:
        found = _diff(shard, src / shard, base / shard)
        if isinstance(found, str):
            return [], {}, f"{shard}: {found}"
        changed += found[0]
        entries[shard] = found[1]
    return changed, entries, ""


def _diff(shard: str, new_path: Path, old_path: Path) -> tuple[list[_Changed], ManifestFile] | str:
    """One shard's changed tensors and its entry, reading both files once, front to back (read,
    never mapped: a file truncated meanwhile is an error, not a SIGBUS); or what differs
    outside the tensors (the header, its metadata, a gap, the size), which a delta cannot carry."""
    with open(new_path, "rb") as new, open(old_path, "rb") as old:
        new_header, old_header = header_in(new.fileno(), shard), header_in(old.fileno(), shard)
        if problem := same_layout(old_header, new_header):
            return problem
        size = os.fstat(new.fileno()).st_size
        if os.fstat(old.fileno()).st_size != size:
            return "its size differs from the base's"
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        changed: list[_Changed] = []
        covered = 0
        for tensor in [*sorted(new_header.tensors, key=lambda t: t.start), None]:
            start = size if tensor is None else tensor.start
            if (between := _read(new, covered, start)) != _read(old, covered, start):
                return "its header (metadata), a gap or its end differs from the base's"
            hasher.update(between)
            if tensor is None:
                break
            after, before = _read(new, tensor.start, tensor.end), _read(old, tensor.start, tensor.end)
            hasher.update(after)
            if (encoded := encode(before, after, tensor.dtype)) is not None:
                changed.append(_Changed(shard, tensor.name, encoded, digest(after)))
            covered = max(covered, tensor.end)
    return changed, ManifestFile(path=shard, size=size, blake3=hasher.hexdigest())


def _read(file: BinaryIO, start: int, end: int) -> bytes:
    data = bytearray(max(0, end - start))
    read_exactly(file.fileno(), memoryview(data), start)
    return bytes(data)


@contextmanager
def _full_weights(root: Path, base: Path, manifest: Manifest) -> Iterator[Path]:
    """The base's full directory: itself, or, for a delta, what its chain produces (made in a
    scratch folder of the root, which daemons ignore, and removed after). Each link of the
    chain must be one shallower than the next: a chain that loops ends at depth 0."""
    if manifest.delta is None:
        yield base
        return
    parent = _find(root, manifest.delta.base)
    if parent is None:
        raise PublishError(
            f"{base.name} is a delta whose base is no longer in {root}: publish a full version"
        )
    parent_manifest = parse(read_small(parent / MANIFEST_NAME))
    if (parent_manifest.delta.depth if parent_manifest.delta else 0) != manifest.delta.depth - 1:
        raise PublishError(f"{base.name}: its chain's depths do not follow each other: publish whole")
    with (
        _full_weights(root, parent, parent_manifest) as full_parent,
        tempfile.TemporaryDirectory(dir=root, prefix=".delta-base-") as scratch,
    ):
        produced = Path(scratch) / base.name
        try:
            materialize(full_parent, base, manifest, produced)
        except DeltaUnusable as exc:
            raise PublishError(f"{base.name}: {exc}") from exc
        yield produced


def _find(root: Path, fingerprint: str) -> Path | None:
    """The version in the root whose full version has `fingerprint`."""
    for candidate in sorted(root.iterdir()):
        if candidate.name.startswith(".") or not candidate.is_dir():
            continue
        try:
            if base_fingerprint(read_small(candidate / MANIFEST_NAME)) == fingerprint:
                return candidate
        except (OSError, NotJSONYet, ManifestInvalid):
            continue
    return None


def _copied(src: Path, path: Path, incoming: Path) -> ManifestFile:
    """A file of the full version that is no shard: copied in whole, synced, listed."""
    relative = _relative(src, path)
    target = incoming / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    digest_, size, fd = copy_and_hash(path, target)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return ManifestFile(path=relative, size=size, blake3=digest_)


def _relative(src: Path, path: Path) -> str:
    return path.relative_to(src).as_posix()


def _is_shard(src: Path, path: Path) -> bool:
    return is_top_level_shard(_relative(src, path))


def _entry(path: Path, relative: str) -> ManifestFile:
    hasher, size = blake3.blake3(max_threads=blake3.blake3.AUTO), 0
    with path.open("rb") as f:
        while chunk := f.read(16 << 20):
            hasher.update(chunk)
            size += len(chunk)
    return ManifestFile(path=relative, size=size, blake3=hasher.hexdigest())
