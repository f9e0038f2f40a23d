"""The producer side, into an object store: place a checkpoint under a prefix so that it
appears whole or not at all, and never destroy what this publish did not create.

`publish_remote` works under a create-only claim: the publish first creates
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
"""

from __future__ import annotations

import io
import json
import os
import secrets
import socket
from datetime import UTC, datetime
from pathlib import Path

import blake3

from ..checkpoint.manifest import MANIFEST_NAME, Manifest, ManifestFile, dumps
from ..checkpoint.manifest import parse as parse_manifest
from ..errors import ManifestInvalid, NotJSONYet, PublishError, SourceError
from ..sources.filestore import open_store
from ..sources.objstore import Bucket
from .publish import checked_name, default_name, source_files

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


def _upload(store: Bucket, key: str, path: Path) -> tuple[str, int]:
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


def _claim(store: Bucket, name: str, where: str) -> None:
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


def _release(store: Bucket, name: str, where: str, failure: str) -> None:
    """Delete this publish's claim (and nothing else)."""
    try:
        store.delete([f"{name}/{CLAIM_NAME}"])
    except SourceError as exc:
        raise PublishError(
            f"publishing {name}: {failure}; its claim {where}/{CLAIM_NAME} could not be removed ({exc}): "
            "delete it"
        ) from exc


def _remove_own(store: Bucket, uploaded: list[str], name: str, where: str, failure: str) -> None:
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


def _refuse_anything_there(store: Bucket, name: str, where: str) -> None:
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
    if not src.is_dir():
        raise PublishError(f"{src}: not a directory")
    name = checked_name(name or default_name(src, step))
    files = source_files(src)
    store = open_store(url, endpoint_url=endpoint_url)
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
