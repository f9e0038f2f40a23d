"""A shared filesystem root (`file:///mnt/checkpoints`: NFS, CephFS, Lustre) read as a bucket, so
each host copies what it serves into its own cache exactly as from an object store: the bytes an
engine reads are the ones verified here, whatever a writer on another host does to the share.

Not obstore's LocalStore: it follows symlinks while listing and reading (a writer's `ln -s / x`
would have every poll walk the whole host). Here every path is walked from the root one folder
at a time, never through a link; only regular files are objects. A link, a FIFO, a device, a
name that is not UTF-8 or a folder that cannot be read makes its top-level name unlisted, with
why, as a key obstore cannot represent does in a bucket.

An object's ETag is its identity on the file server (inode, size, mtime, ctime): the same on
every host mounting the share, changed by any rewrite. A read compares it before and after (a
change meanwhile is `ObjectChanged`; the second look opens the file again, as NFS revalidates
its attributes only on open). A file changed within `SETTLE_NS` of being looked at is left out
of that listing of checkpoints, and read without an ETag to keep its bytes by: within one clock
tick a rewrite need not show in its identity. The window is wider than a tick so that the file
server's clock and this host's may differ by up to it (NTP keeps them far closer).

Writes (the fleet's records, `publish --into file://`) go to a temporary file in the same folder,
fsynced, then renamed over the name, or hard-linked to it when only a new name may be made
(`link` fails if the name exists, decided by the file server, as `If-None-Match: *` by a store).
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

from ..checkpoint.files import MAX_SMALL_BYTES, OPEN_FLAGS, read_exactly
from ..config.base import SHARED_ROOT
from ..errors import ConfigError, KeyUnreadable, ObjectChanged, PublishError, SourceError
from .objstore import Bucket, Data, Object, Skip, Store, Unlistable, skip_nothing

SCHEME = SHARED_ROOT
TEMPORARY = ".vllm-reloader-tmp"
"""The end of a write's temporary name: never listed."""
SETTLE_NS = 1_000_000_000
"""A file changed this recently (by either clock) may change again without its ETag showing it."""
MAX_DEPTH = 32
"""Folders nested deeper than this in one checkpoint make it unlisted (no checkpoint has them)."""
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
_UNREADABLE = (errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENXIO, errno.ENODEV)
"""A file's own mode or kind (a link, a socket), not the share's failure."""


def open_store(
    url: str,
    *,
    endpoint_url: str | None = None,
    timeout: float = 30.0,
    key: tuple[str, str] = ("source", "path"),
) -> Bucket:
    """The store at `url`: a shared root (`file://`) or an object-store prefix."""
    if url.startswith(SCHEME):
        return FileStore(url, key=key)
    return Store(url, endpoint_url=endpoint_url, timeout=timeout, key=key)


def root_of(url: str) -> Path:
    """The directory a `file://` URL names (absolute, no host)."""
    return Path(os.path.normpath(url.removeprefix(SCHEME) or "/"))


class FileStore:
    """A folder tree on a shared filesystem; keys are paths relative to its root."""

    def __init__(self, url: str, *, key: tuple[str, str] = ("source", "path")) -> None:
        if not url.startswith(SCHEME + "/"):
            raise ConfigError(
                f"{'.'.join(key)} {url!r}: give an absolute path after file:// (file:///mnt/checkpoints)"
            )
        self.root = root_of(url)
        self.url = SCHEME + str(self.root)

    def _fail(self, what: str, key: str, exc: OSError) -> SourceError:
        where = f"{self.url}/{key}" if key else self.url
        reason = exc.strerror or str(exc) or type(exc).__name__
        return SourceError(f"{what} {where}: {reason}", f"{what} {where}: {exc!r}")

    # Reading.

    def list(self, skip: Skip = skip_nothing) -> tuple[dict[str, Object], dict[str, str]]:
        """Every regular file under the root (key → size, ETag, time), and the top-level names
        holding something that is not one (a link, a FIFO, a name that is not UTF-8, a folder
        that cannot be read), with why: such a name costs only its own checkpoint. Top-level
        names to `skip` (a `.Trash` folder, a publish's `.incoming`) are never walked."""
        found: dict[str, Object] = {}
        unlisted: dict[str, str] = {}
        try:
            with self._folder(()) as root:
                names = [name for name in _names(root) if not skip(name)]
                for name in names:
                    try:
                        found.update(self._under(root, name, settled=True))
                    except Unlistable as exc:
                        unlisted[name] = str(exc)
        except OSError as exc:
            raise self._fail("LIST", "", exc) from exc
        return found, unlisted

    def list_under(self, prefix: str) -> dict[str, Object]:
        """Every regular file under the folder `prefix`; `Unlistable` if it holds anything else."""
        parts = self._parts("LIST", prefix.rstrip("/"))
        try:
            with self._folder(parts[:-1]) as parent:
                return self._under(parent, parts[-1], prefix=prefix.rstrip("/"))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return {}  # a link where a folder should be: nothing is listed through it
            raise self._fail("LIST", prefix, exc) from exc

    def _under(
        self, parent: int, name: str, *, prefix: str | None = None, settled: bool = False
    ) -> dict[str, Object]:
        """The regular files under `name` in the folder open as `parent` (itself, if a file);
        `settled`: not those changed within RACY_NS (the checkpoints' listing, whose completing
        files and headers are read once per ETag; records are written whole, never again)."""
        found: dict[str, Object] = {}
        self._walk(parent, name, name if prefix is None else prefix, found, 0, settled)
        return found

    def _walk(
        self, folder: int, entry: str, key: str, found: dict[str, Object], depth: int, settled: bool
    ) -> None:
        """Depth first, at most MAX_DEPTH folders open at once."""
        _check_name(entry, key)
        try:
            info = os.stat(entry, dir_fd=folder, follow_symlinks=False)
        except FileNotFoundError:
            return  # gone since it was listed
        except OSError as exc:
            raise Unlistable(f"key {key!r} cannot be read: {exc.strerror or exc}") from exc
        if stat.S_ISREG(info.st_mode):
            if not (settled and _racy(info)):
                found[key] = _object(info)
            return
        if not stat.S_ISDIR(info.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file"
            raise Unlistable(f"key {key!r} is {kind}; a shared root lists regular files only")
        if depth >= MAX_DEPTH:
            raise Unlistable(f"folder {key!r} is nested more than {MAX_DEPTH} deep")
        try:
            inner = os.open(entry, _DIRECTORY, dir_fd=folder)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise Unlistable(f"folder {key!r} cannot be read: {exc.strerror or exc}") from exc
        try:
            try:
                names = _names(inner)
            except OSError as exc:
                raise Unlistable(f"folder {key!r} cannot be read: {exc.strerror or exc}") from exc
            for child in names:
                self._walk(inner, child, f"{key}/{child}", found, depth + 1, settled)
        finally:
            os.close(inner)

    def head(self, key: str) -> Object | None:
        """One file's size and ETag; None when no regular file is there (a link is none)."""
        parts = self._parts("HEAD", key)
        try:
            with self._folder(parts[:-1]) as parent:
                info = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return None
            raise self._fail("HEAD", key, exc) from exc
        return _object(info) if stat.S_ISREG(info.st_mode) else None

    def get(self, key: str) -> tuple[bytes, str | None]:
        """A whole small file (a manifest, a record) and its ETag; a larger one, grown since it
        was listed, is refused, never read into memory."""
        with self._reading("GET", key, None) as (fd, size):
            if size > MAX_SMALL_BYTES:
                raise SourceError(
                    f"GET {self.url}/{key}: {size} bytes, more than {MAX_SMALL_BYTES} to read whole"
                )
            data = bytearray(size)
            read_exactly(fd, memoryview(data), 0)
            info = os.fstat(fd)
        return bytes(data), None if _racy(info) else _etag(info)

    def get_range(self, key: str, start: int, end: int, etag: str | None) -> memoryview:
        """Bytes [start, end) of the file, only if it still has `etag`."""
        with self._reading("GET", key, etag) as (fd, _size):
            data = bytearray(max(0, end - start))
            read_exactly(fd, memoryview(data), start)
        return memoryview(data)

    @contextmanager
    def _reading(self, what: str, key: str, etag: str | None) -> Iterator[tuple[int, int]]:
        """The file open (no link followed, never blocking), its size; `ObjectChanged` if it is
        not `etag`, or if it changed while read."""
        parts = self._parts(what, key)
        try:
            with self._folder(parts[:-1]) as parent:
                fd = self._open(what, key, parts[-1], parent)
                try:
                    before = os.fstat(fd)
                    if etag is not None and _etag(before) != etag:
                        raise ObjectChanged(f"{what} {self.url}/{key}: changed while being read")
                    yield fd, before.st_size
                finally:
                    os.close(fd)
                again = self._open(what, key, parts[-1], parent)  # NFS: fresh attributes
                try:
                    if _etag(os.fstat(again)) != _etag(before):
                        raise ObjectChanged(f"{what} {self.url}/{key}: changed while being read")
                finally:
                    os.close(again)
        except OSError as exc:
            raise self._fail(what, key, exc) from exc

    def _open(self, what: str, key: str, name: str, parent: int) -> int:
        """The file, open for reading; `KeyUnreadable` if it is not one this daemon may read."""
        try:
            fd = os.open(name, OPEN_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in _UNREADABLE:
                raise KeyUnreadable(f"{what} {self.url}/{key}: {exc.strerror}") from exc
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise KeyUnreadable(f"{what} {self.url}/{key}: not a regular file")
        return fd

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    # Writing.

    def put(self, key: str, data: Data, *, create_only: bool = False, part_size: int | None = None) -> None:
        """Write one file whole (renamed into place: a reader sees the old or the new);
        `create_only`: never over one that exists. `part_size` is for object stores."""
        del part_size
        if not self._write(key, data, create=create_only):
            raise PublishError(f"{self.url}/{key} already exists; versions are never overwritten")

    def create(self, key: str, data: Data) -> bool:
        """Write one file only if none is there (the file server decides: two writers racing
        cannot both win); False when one was."""
        return self._write(key, data, create=True)

    def _write(self, key: str, data: Data, *, create: bool) -> bool:
        parts = self._parts("PUT", key)
        temporary = f".{secrets.token_hex(8)}{TEMPORARY}"
        try:
            with self._folder(parts[:-1], make=True) as parent:
                fd = os.open(temporary, _NEW_FILE, 0o666, dir_fd=parent)  # the umask decides
                try:
                    try:
                        with os.fdopen(fd, "wb", closefd=False) as out:
                            _copy(data, out)
                        os.fsync(fd)
                        if create:
                            made = _link(temporary, parts[-1], parent, fd)
                        else:
                            made = True
                            os.rename(temporary, parts[-1], src_dir_fd=parent, dst_dir_fd=parent)
                    finally:
                        os.close(fd)
                finally:
                    with suppress(FileNotFoundError):  # a full disk, a crash: none left behind
                        os.unlink(temporary, dir_fd=parent)
                os.fsync(parent)
        except OSError as exc:
            raise self._fail("PUT", key, exc) from exc
        return made

    def delete(self, keys: Sequence[str]) -> None:
        """Remove these files; one already gone is no error."""
        for key in keys:
            parts = self._parts("DELETE", key)
            try:
                with self._folder(parts[:-1]) as parent:
                    os.unlink(parts[-1], dir_fd=parent)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise self._fail("DELETE", key, exc) from exc

    # Walking.

    def _parts(self, what: str, key: str) -> tuple[str, ...]:
        parts = tuple(key.split("/"))
        if any(part in ("", ".", "..") or "\0" in part for part in parts):
            raise SourceError(f"{what} {self.url}/{key}: not a path under the root")
        return parts

    @contextmanager
    def _folder(self, parts: Sequence[str], *, make: bool = False) -> Iterator[int]:
        """The folder `parts` below the root, open, reached without following a link (the
        root itself is the operator's, and may be one); `make`: folders missing are made."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in parts:
                if make:
                    with suppress(FileExistsError):
                        os.mkdir(part, 0o777, dir_fd=fd)  # the umask decides
                inner = os.open(part, _DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = inner
            yield fd
        finally:
            os.close(fd)


def _link(temporary: str, name: str, parent: int, fd: int) -> bool:
    """Hard-link the written file to `name` unless one is there. Over NFS a retransmitted
    LINK can answer EEXIST for the link it made itself: then the file has two names."""
    try:
        os.link(temporary, name, src_dir_fd=parent, dst_dir_fd=parent)
    except FileExistsError:
        return os.fstat(fd).st_nlink == 2
    return True


def _names(fd: int) -> list[str]:
    return [name for name in os.listdir(fd) if not name.endswith(TEMPORARY)]


def _check_name(name: str, key: str) -> None:
    try:
        name.encode()
    except UnicodeEncodeError:
        raise Unlistable(f"key {key.encode(errors='surrogateescape')!r} is not UTF-8") from None


def _racy(info: os.stat_result) -> bool:
    """Changed so recently that a rewrite within the same clock tick would not show."""
    now = time.time_ns()
    return abs(now - info.st_mtime_ns) < SETTLE_NS or abs(now - info.st_ctime_ns) < SETTLE_NS


def _object(info: os.stat_result) -> Object:
    return Object(info.st_size, _etag(info), info.st_mtime)


def _etag(info: os.stat_result) -> str:
    """The file's identity on the server, alike on every host that mounts it (no device number)."""
    return f'"{info.st_ino:x}-{info.st_size:x}-{info.st_mtime_ns:x}-{info.st_ctime_ns:x}"'


def _copy(data: Data, out: BinaryIO) -> None:
    if isinstance(data, bytes):
        out.write(data)
    elif isinstance(data, Path):
        with data.open("rb") as source:
            shutil.copyfileobj(source, out, 1 << 20)
    else:
        shutil.copyfileobj(data, out, 1 << 20)
