"""The producer side: place a checkpoint into a root so that it appears whole or not at all,
and never destroy what this publish did not create.

Into an object store (`publish_remote`), under a create-only claim: the publish first creates
`NAME/.publishing` with `If-None-Match: *` (decided by the store: of two publishers racing on
one name, exactly one gets it). One that finds a claim there fails with a one-line
`PublishError` naming it (another publish is running or crashed) and touches nothing. With the
claim, it lists `NAME/`: anything else there (a published version, a foreign writer's files, a
crashed publish's leftovers) is never taken over or overwritten: it deletes its own claim and
fails, naming what is there. Then each file is streamed up the normal way, overwriting (a
multipart upload in parts of `PART_SIZE` for a large file: no per-file size limit, at most a
dozen parts in memory), hashed from the same one read that uploads it, so the manifest's digests
are of the bytes uploaded; a file whose size, mtime or inode changed meanwhile fails the
publish. The manifest goes last, create-only (the daemon looks at a version only once its
manifest exists), then the claim is deleted. A failure after the claim deletes exactly the
objects this publish uploaded (the claim kept other publishers off those keys), then the claim;
when whether the manifest landed is unknown, everything stays and the error says what to check.
The guarantee holds among publishers that take the claim: a writer that does not (a trainer
writing into the bucket, an older `publish`) is only detected (listed before, or its manifest
found at the end), not kept out. The costs: two small requests more per publish (the claim's
create and delete) and one LIST of `NAME/`; a crash leaves the claim, and the name stays refused
until someone deletes `NAME/`; a failed multipart upload is aborted, but one cut off by a crash
stays invisible in the bucket, billed, until the store's lifecycle rule for incomplete multipart
uploads removes it.

Into a local root (`publish`): the publish that creates `ROOT/.incoming-NAME/` (a plain mkdir:
it fails if the directory exists) owns it, and only it ever removes it; one that finds it there
fails and touches nothing. Files go there (ignored by the daemon), each fsynced; the manifest is
written last and fsynced; then one rename makes `ROOT/NAME` appear, and ROOT is fsynced so the
rename survives a crash. A failure puts `--move`d files back and removes the incoming directory.
"""

from __future__ import annotations

import errno
import io
import json
import os
import secrets
import shutil
import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import blake3

from ..checkpoint.manifest import MANIFEST_NAME, Manifest, ManifestFile, dumps
from ..checkpoint.manifest import parse as parse_manifest
from ..durable import fsync_dir, write_synced
from ..errors import ManifestInvalid, NotJSONYet, PublishError, SourceError

if TYPE_CHECKING:
    from ..sources.objstore import Store

COPY_CHUNK = 8 << 20


def default_name(src: Path, step: int | None) -> str:
    return f"step-{step}" if step is not None else src.resolve().name


def _source_files(src: Path) -> list[Path]:
    files = sorted(
        p
        for p in src.rglob("*")
        if p.is_file()
        and p.relative_to(src).as_posix() != MANIFEST_NAME
        and not any(part.startswith(".") for part in p.relative_to(src).parts)
    )
    if not files:
        raise PublishError(f"{src}: no files to publish")
    return files


def _hash_and_sync(path: Path) -> tuple[str, int]:
    """blake3 and size of one file, from one read; the file fsynced."""
    hasher, size = blake3.blake3(), 0
    with path.open("rb") as f:
        while chunk := f.read(COPY_CHUNK):
            hasher.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return str(hasher.hexdigest()), size


def _copy_and_hash(src: Path, dst: Path) -> tuple[str, int]:
    """Copy one file, fsync it, and return its blake3 and size from the same pass over the bytes."""
    hasher, size = blake3.blake3(), 0
    with src.open("rb") as fin, dst.open("wb") as fout:
        while chunk := fin.read(COPY_CHUNK):
            hasher.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return str(hasher.hexdigest()), size


def _renamed(src: Path, dst: Path) -> bool:
    """Moved by rename (same filesystem); False: the caller copies instead."""
    try:
        os.rename(src, dst)
    except OSError:
        return False
    return True


def _put_back(moved: list[Path], src: Path, incoming: Path) -> list[Path]:
    """Every moved file back where the trainer left it; returns those that could not be."""
    stranded = []
    for path in reversed(moved):
        try:
            os.rename(incoming / path.relative_to(src), path)
        except OSError:
            stranded.append(path)
    return stranded


CLAIM_NAME = ".publishing"
"""`NAME/.publishing`: created create-only by the one publish of NAME that may write under NAME/.
A dot-file: the daemon never downloads it or counts it as part of a checkpoint."""

PART_SIZE = 16 << 20
"""A file longer than this goes up in parts of this size (larger for a file of over 10,000 parts)."""

MAX_PARTS = 10_000
"""The most parts S3 (and the stores speaking its protocol) takes in one multipart upload."""


def _part_size(size: int) -> int:
    return max(PART_SIZE, -(-size // MAX_PARTS))


class _HashingReader(io.FileIO):
    """A file as the uploader reads it: the blake3 and length of exactly the bytes handed to
    it, front to back, in the one read of the file that the upload makes."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, "rb")
        self.opened = os.fstat(self.fileno())
        self.hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        self.handed = 0
        self.in_order = True
        """False once a read did not start where the last one ended: the digest is not the object's."""

    def read(self, size: int | None = -1, /) -> bytes:
        if self.tell() != self.handed:
            self.in_order = False
        data = super().read(size) or b""
        self.hasher.update(data)
        self.handed += len(data)
        return data


def _open_hashing(path: Path) -> _HashingReader:
    return _HashingReader(path)


def _upload(store: Store, key: str, path: Path) -> tuple[str, int]:
    """One file streamed up (multipart when large); the blake3 and size of the bytes uploaded.
    A file that changed while it was read (its size, mtime or inode) fails the publish."""
    with _open_hashing(path) as reader:
        store.put(key, reader, part_size=_part_size(reader.opened.st_size))
        before, now = reader.opened, os.fstat(reader.fileno())
        try:
            there = os.stat(path)
        except OSError:
            there = None
        unchanged = all(
            stat is not None
            and (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
            == (before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns)
            for stat in (now, there)
        )
        if not (unchanged and reader.in_order and reader.handed == before.st_size == reader.tell()):
            raise PublishError(
                f"{path} changed while it was being uploaded (size, mtime or inode): is something still "
                "writing it? publish once it is done"
            )
        return str(reader.hasher.hexdigest()), reader.handed


def _new_claim(name: str) -> bytes:
    return json.dumps(
        {
            "version": name,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "id": secrets.token_hex(16),
        }
    ).encode()


def _holder(claim: bytes) -> str:
    """Who a claim says holds it, for the error; "" when it says nothing readable."""
    try:
        found = json.loads(claim)
        who = f"claimed by pid {int(found['pid'])} on {found['host']} at {found['started_at']}"
    except (ValueError, TypeError, KeyError):
        return ""
    return f" ({' '.join(who.split())})"  # one line, whatever the claim holds


def _claim(store: Store, name: str, where: str) -> None:
    """Create `NAME/.publishing` create-only, or fail touching nothing."""
    key, claim = f"{name}/{CLAIM_NAME}", _new_claim(name)
    try:
        if store.create(key, claim):
            return
        found = store.get(key)[0]
    except SourceError as exc:  # it may have landed: say what to check
        raise PublishError(
            f"publishing {name}: could not claim it ({exc}); if {where}/{CLAIM_NAME} exists and no publish "
            f"of {name} is running, delete it and publish again"
        ) from exc
    if found == claim:
        return  # our PUT landed, its answer was lost, and the retry found it
    raise PublishError(
        f"{where}/{CLAIM_NAME} exists: another publish of {name} is running or crashed{_holder(found)}; if "
        f"none is running and {where}/{MANIFEST_NAME} does not exist, delete everything under {where}/ "
        "and publish again"
    )


def _release(store: Store, name: str, where: str, failure: str) -> None:
    """Delete this publish's claim (and nothing else)."""
    try:
        store.delete([f"{name}/{CLAIM_NAME}"])
    except SourceError as exc:
        raise PublishError(
            f"publishing {name}: {failure}; its claim {where}/{CLAIM_NAME} could not be removed ({exc}): "
            "delete it"
        ) from exc


def _remove_own(store: Store, uploaded: list[str], name: str, where: str, failure: str) -> None:
    """Delete the objects this publish uploaded, then its claim: under the claim no one else
    wrote those keys. The claim stays while any of them may."""
    try:
        store.delete(uploaded)
    except SourceError as exc:
        raise PublishError(
            f"publishing {name}: {failure}; the {len(uploaded)} objects it uploaded could not be removed "
            f"({exc}): if {where}/{MANIFEST_NAME} does not exist, delete everything under {where}/, "
            f"{CLAIM_NAME} last"
        ) from exc
    _release(store, name, where, failure)


def _refuse_anything_there(store: Store, name: str, where: str) -> None:
    """Under the claim: NAME/ must hold nothing else (a version, a foreign writer's files, a
    crashed publish's leftovers), or the claim is released and the publish refused."""
    from ..sources.objstore import Unlistable

    try:
        found = sorted(k for k in store.list_under(name) if k != f"{name}/{CLAIM_NAME}")
    except Unlistable as exc:
        message = f"{exc}; versions are never overwritten: delete everything under {where}/ and publish again"
        _release(store, name, where, message)
        raise PublishError(message) from exc
    except BaseException as exc:
        _release(store, name, where, str(exc) or type(exc).__name__)
        raise
    if not found:
        return
    if f"{name}/{MANIFEST_NAME}" in found:
        message = f"{where} already exists; versions are never overwritten"
    else:
        message = (
            f"{store.url}/{found[0]} already exists ({len(found)} objects under {where}/, no "
            f"{MANIFEST_NAME}); versions are never overwritten, and what is there was left as it is (if "
            f"nothing is writing there, a crashed or foreign writer left it: delete everything under "
            f"{where}/ and publish again)"
        )
    _release(store, name, where, message)
    raise PublishError(message)


def _own_uploads_not_in(theirs: bytes, uploaded: list[str], name: str) -> list[str]:
    """Of this publish's objects, those another writer's manifest does not list (all of them
    stay when that manifest cannot be read)."""
    try:
        listed = {f"{name}/{item.path}" for item in parse_manifest(theirs).files}
    except (NotJSONYet, ManifestInvalid):
        return []
    return [key for key in uploaded if key not in listed]


def publish_remote(
    src: Path, url: str, *, name: str | None = None, step: int | None = None, endpoint_url: str | None = None
) -> str:
    from ..sources.objstore import Store  # the local publish needs no object-store client

    if not src.is_dir():
        raise PublishError(f"{src}: not a directory")
    name = _checked_name(name or default_name(src, step))
    files = _source_files(src)
    store = Store(url, endpoint_url=endpoint_url)
    where, manifest_key = f"{store.url}/{name}", f"{name}/{MANIFEST_NAME}"
    if store.exists(manifest_key):
        raise PublishError(f"{where} already exists; versions are never overwritten")
    _claim(store, name, where)
    _refuse_anything_there(store, name, where)
    uploaded: list[str] = []  # by this publish, under its claim: the only objects it may delete
    try:
        entries = []
        for path in files:
            relative = path.relative_to(src).as_posix()
            uploaded.append(f"{name}/{relative}")  # before its PUT: one that failed may have landed
            digest, size = _upload(store, f"{name}/{relative}", path)
            entries.append(ManifestFile(path=relative, size=size, blake3=digest))
        manifest = dumps(Manifest(format_version=1, version=name, step=step, files=tuple(entries)))
    except BaseException as exc:
        failure = (exc.strerror if isinstance(exc, OSError) else None) or str(exc) or type(exc).__name__
        _remove_own(store, uploaded, name, where, failure)
        if isinstance(exc, OSError):  # opening or reading a file (the store's own errors are SourceErrors)
            raise PublishError(f"publishing {name}: {failure}") from exc
        raise
    try:
        theirs = None if store.create(manifest_key, manifest) else store.get(manifest_key)[0]
    except SourceError as exc:  # it may have landed: then every file is needed, none is removed
        raise PublishError(
            f"publishing {name}: whether its manifest landed is unknown ({exc}); if {where}/{MANIFEST_NAME} "
            f"exists, {name} is published: delete {where}/{CLAIM_NAME}; if not, delete everything under "
            f"{where}/ and publish again"
        ) from exc
    if theirs is None or theirs == manifest:  # (the second: our PUT landed, its answer was lost)
        try:
            store.delete([f"{name}/{CLAIM_NAME}"])
        except SourceError as exc:
            raise PublishError(
                f"published {where}, but its claim {where}/{CLAIM_NAME} could not be removed ({exc}): the "
                "version is whole; delete the claim"
            ) from exc
        return where
    mine = _own_uploads_not_in(theirs, uploaded, name)
    message = (
        f"{store.url}/{manifest_key} already exists: a writer that takes no claim published {name} "
        f"meanwhile; versions are never overwritten (this publish removed {len(mine)} of the "
        f"{len(uploaded)} files it uploaded, those that manifest does not list; any it lists may hold "
        f"this publish's bytes: check that {where} verifies)"
    )
    _remove_own(store, mine, name, where, message)
    raise PublishError(message)


def _checked_name(name: str) -> str:
    if name.startswith(".") or "/" in name or name in ("", ".."):
        raise PublishError(f"{name!r}: not a valid version name")
    return name


def publish(
    src: Path, root: Path, *, name: str | None = None, step: int | None = None, move: bool = False
) -> Path:
    if not src.is_dir():
        raise PublishError(f"{src}: not a directory")
    name = _checked_name(name or default_name(src, step))
    final = root / name
    if final.exists():
        raise PublishError(f"{final} already exists; versions are never overwritten")
    files = _source_files(src)
    root.mkdir(parents=True, exist_ok=True)
    incoming = root / f".incoming-{name}"
    try:  # whoever creates it owns it: only that publish ever removes it
        incoming.mkdir()
    except FileExistsError:
        raise PublishError(
            f"{incoming} exists: another publish of {name} is running or crashed (if none is running, "
            "its files are there, a --move's only copy: take what you need, remove it, publish again)"
        ) from None
    except OSError as exc:
        raise PublishError(f"publishing {name}: {exc.strerror or exc}") from exc
    entries: list[ManifestFile] = []
    moved: list[Path] = []  # renamed into incoming: put back on any failure (--move)
    copied: list[Path] = []
    try:
        for path in files:
            relative = path.relative_to(src).as_posix()
            dst = incoming / relative
            dst.parent.mkdir(parents=True, exist_ok=True)
            if move and _renamed(path, dst):
                moved.append(path)
                digest, size = _hash_and_sync(dst)
            else:  # a copy (or a move across filesystems: the source goes once published)
                digest, size = _copy_and_hash(path, dst)
                copied.append(path)
            entries.append(ManifestFile(path=relative, size=size, blake3=digest))
        manifest = Manifest(format_version=1, version=name, step=step, files=tuple(entries))
        write_synced(incoming / MANIFEST_NAME, dumps(manifest))
        for directory in {(incoming / e.path).parent for e in entries}:
            fsync_dir(directory)
        try:
            os.rename(incoming, final)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):  # another publish of NAME won
                raise PublishError(f"{final} already exists; versions are never overwritten") from exc
            raise
    except BaseException as exc:
        if stranded := _put_back(moved, src, incoming):  # never delete what could not go back
            raise PublishError(
                f"publishing {name} failed ({exc}); {len(stranded)} moved files could not be put back "
                f"and are still in {incoming}"
            ) from exc
        shutil.rmtree(incoming, ignore_errors=True)
        if isinstance(exc, OSError):
            raise PublishError(f"publishing {name}: {exc.strerror or exc}") from exc
        raise
    try:
        fsync_dir(root)
        for path in copied if move else ():
            path.unlink()
    except OSError as exc:
        raise PublishError(f"published {final}, but then: {exc.strerror or exc}") from exc
    return final
