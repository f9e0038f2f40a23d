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

import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import blake3

from ..checkpoint.delta import (
    DeltaUnusable,
    Encoded,
    digest,
    encode,
    same_layout,
    write_container,
)
from ..checkpoint.files import Header, header_in, is_top_level_shard, read_small
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
    if any(p.relative_to(src).parts[0] == DELTA_NAME.split("/")[0] for p in files):
        raise PublishError(
            f"{src}: a {DELTA_NAME.split('/')[0]}/ folder holds a delta's encodings: rename it"
        )
    if base_weights is not None:
        changed, why = _changes(src, base_weights, files)
    else:
        with _full_weights(root, base, base_manifest) as full_base:
            changed, why = _changes(src, full_base, files)
    if why:
        return _whole(src, root, name, step, why)
    entries = {
        f"{i}{suffix}": item for i, c in enumerate(changed) for suffix, item in c.encoded.entries.items()
    }
    if changed and all(c.encoded.encoding == "whole" for c in changed):
        return _whole(src, root, name, step, "every changed tensor changed whole: a delta is no smaller")
    incoming = claim(root, name)
    try:
        (incoming / DELTA_NAME).parent.mkdir()
        write_container(incoming / DELTA_NAME, entries)
        listed = [_listed(src, path, incoming) for path in files]
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


def _changes(src: Path, base: Path, files: list[Path]) -> tuple[list[_Changed], str]:
    """Each changed tensor of SRC's shards over the base's, or why there can be no delta."""
    shards = [p.relative_to(src).as_posix() for p in files if _is_shard(src, p)]
    theirs = sorted(p.name for p in base.iterdir() if is_top_level_shard(p.name))
    if sorted(shards) != theirs:
        return [], "its shards are not the base's (names)"
    changed: list[_Changed] = []
    for shard in shards:
        with _mapped(src / shard) as new, _mapped(base / shard) as old:
            new_header, old_header = header_in(new.fd, shard), header_in(old.fd, shard)
            if problem := same_layout(old_header, new_header) or _outside_tensors(old, new, new_header):
                return [], f"{shard}: {problem}"
            for tensor in new_header.tensors:
                span = slice(tensor.start, tensor.end)
                with new.view[span] as after, old.view[span] as before:
                    encoded = encode(before, after, tensor.dtype)
                    if encoded is not None:
                        changed.append(_Changed(shard, tensor.name, encoded, digest(after)))
    return changed, ""


def _outside_tensors(old: _Map, new: _Map, header: Header) -> str | None:
    """What differs outside the tensors (the header's bytes, its metadata; gaps; the end):
    a delta carries tensors only."""
    if len(old.view) != len(new.view):
        return "its size differs from the base's"
    covered = 0
    for tensor in sorted(header.tensors, key=lambda t: t.start):
        if old.view[covered : tensor.start] != new.view[covered : tensor.start]:
            return "its header (metadata) or a gap differs from the base's"
        covered = max(covered, tensor.end)
    if old.view[covered:] != new.view[covered:]:
        return "bytes after its tensors differ from the base's"
    return None


@dataclass
class _Map:
    fd: int
    view: memoryview


@contextmanager
def _mapped(path: Path) -> Iterator[_Map]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        view = memoryview(mapped) if mapped is not None else memoryview(b"")
        try:
            yield _Map(fd, view)
        finally:
            view.release()
            if mapped is not None:
                mapped.close()
    finally:
        os.close(fd)


@contextmanager
def _full_weights(root: Path, base: Path, manifest: Manifest) -> Iterator[Path]:
    """The base's full directory: itself, or, for a delta, what its chain produces (made in a
    scratch folder of the root, which daemons ignore, and removed after). Each link of the
    chain must be one shallower than the next: a chain that loops ends at depth 0."""
    if manifest.delta is None:
        yield base
        return
    parent = _find(root, manifest.delta.base)
    if parent is not None:
        found = parse(read_small(parent / MANIFEST_NAME)).delta
        if (found.depth if found else 0) != manifest.delta.depth - 1:
            raise PublishError(f"{base.name}: its chain's depths do not follow each other: publish whole")
    if parent is None:
        raise PublishError(
            f"{base.name} is a delta whose base is no longer in {root}: publish a full version"
        )
    parent_manifest = parse(read_small(parent / MANIFEST_NAME))
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


def _listed(src: Path, path: Path, incoming: Path) -> ManifestFile:
    """A file of the full version: a shard by its digest only, any other copied in whole."""
    relative = path.relative_to(src).as_posix()
    if not is_top_level_shard(relative):
        target = incoming / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        digest_, size, fd = copy_and_hash(path, target)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return ManifestFile(path=relative, size=size, blake3=digest_)
    return _entry(path, relative)


def _is_shard(src: Path, path: Path) -> bool:
    return is_top_level_shard(path.relative_to(src).as_posix())


def _entry(path: Path, relative: str) -> ManifestFile:
    hasher, size = blake3.blake3(max_threads=blake3.blake3.AUTO), 0
    with path.open("rb") as f:
        while chunk := f.read(16 << 20):
            hasher.update(chunk)
            size += len(chunk)
    return ManifestFile(path=relative, size=size, blake3=hasher.hexdigest())
