"""Where adapter versions are read from: a local root or an object-store prefix, each holding
`<adapter>/<version>/` with PEFT's two files.

Both say which versions are there and what marks their content (a rewrite changes it), and copy
a version's two files into a folder of the daemon's, hashed as they are read. A local folder is
opened without following a link, one level at a time: a writer who swaps a folder for a link
to another's adapter gets nothing read through it. An object is read in ranges only while its
ETag is the listed one, so a copy never mixes two uploads.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import blake3
from watchdog.events import FileSystemEvent, FileSystemEventHandler

from ..checkpoint.adapter import CONFIG_NAME, WEIGHTS_NAME
from ..checkpoint.files import identity
from ..config.base import is_remote
from ..errors import ObjectChanged
from . import verdicts
from .filestore import open_store
from .local import Watcher, needs_polling
from .objstore import Bucket, Object

FILES = (CONFIG_NAME, WEIGHTS_NAME)
CHUNK = 8 << 20
MAX_NAME = 128
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class Content:
    """A version's two files as listed: their sizes, and marks any rewrite changes."""

    sizes: tuple[int, int]
    marks: tuple[Hashable, ...]


Listing = dict[str, dict[str, Content | None]]
"""Adapter → version → its content (None: not both files there yet)."""


class Tree(Protocol):
    where: str

    def list(self, say: Any) -> Listing:
        """Every valid adapter and version name; `say(event, **fields)` for a part unreadable."""
        ...

    def copy(self, name: str, version: str, content: Content, into: Path, hasher: blake3.blake3) -> bool:
        """The two files into `into`, hashed in order; False when they changed meanwhile."""
        ...

    def watch(self, wake: Callable[[], None]) -> Watcher | None:
        """Something calling `wake` at each change under the root, started (None: none can)."""
        ...


def valid_name(name: str) -> bool:
    """An adapter's or a version's folder name: what a model name and a path may safely be."""
    return (
        0 < len(name) <= MAX_NAME
        and not name.startswith(".")
        and all(c.isascii() and (c.isalnum() or c in "._-") for c in name)
    )


class LocalTree:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.where = str(root)

    def list(self, say: Any) -> Listing:
        with _directory(str(self.root), None) as root_fd:
            return {
                name: self._versions(root_fd, name, say)
                for name in sorted(n for n in _folders(root_fd) if valid_name(n))
            }

    def _versions(self, root_fd: int, name: str, say: Any) -> dict[str, Content | None]:
        found: dict[str, Content | None] = {}
        try:
            with _directory(name, root_fd) as adapter_fd:
                for version in sorted(v for v in _folders(adapter_fd) if valid_name(v)):
                    try:
                        with _directory(version, adapter_fd) as version_fd:
                            found[version] = _content(version_fd)
                    except OSError as exc:
                        say("adapter.unreadable", adapter=name, version=version, reason=str(exc)[:300])
        except OSError as exc:  # this adapter's folder only
            say("adapter.unreadable", adapter=name, reason=str(exc)[:300])
        return found

    def watch(self, wake: Callable[[], None]) -> Watcher | None:
        """inotify: a version renamed in, or a file closed after writing, is looked at at once,
        not at the next look; a write still going on wakes nothing (each look would copy a file
        not whole yet). A network filesystem, where inotify sees no other host's writes, is only
        looked at."""
        if needs_polling(self.root):
            return None
        watcher = Watcher(
            self.root, ignore=(), notify=lambda _: None, poll=False, poll_interval=1.0, handler=_Wake(wake)
        )
        watcher.start()
        return watcher

    def copy(self, name: str, version: str, content: Content, into: Path, hasher: blake3.blake3) -> bool:
        with (
            _directory(str(self.root), None) as root_fd,
            _directory(name, root_fd) as adapter_fd,
            _directory(version, adapter_fd) as version_fd,
        ):
            for file, size in zip(FILES, content.sizes, strict=True):
                _copy_file(version_fd, file, size, into / file, hasher)
            return _content(version_fd) == content


class StoreTree:
    """An object-store prefix: one LIST a look; only `<adapter>/<version>/<file>` keys count."""

    def __init__(self, store: Bucket) -> None:
        self.store = store
        self.where = store.url
        self._last: Listing = {}

    def list(self, say: Any) -> Listing:
        """A folder holding a key obstore cannot list (`a//b`) keeps the versions it had: an odd
        key is not an adapter removed."""
        objects, unlisted = self.store.list()
        found: Listing = {}
        for prefix, why in unlisted.items():
            name = prefix.rstrip("/")
            say("adapter.unreadable", adapter=name, reason=why)
            if valid_name(name):
                found[name] = dict(self._last.get(name, {}))
        files: dict[tuple[str, str], dict[str, Object]] = {}
        for key, one in objects.items():
            name, folder, rest = key.partition("/")
            if not (folder and valid_name(name)) or verdicts.is_record(rest):  # no adapter's file
                continue
            versions = found.setdefault(name, {})
            version, _, file = rest.partition("/")
            if valid_name(version) and file in FILES:
                versions.setdefault(version, None)
                files.setdefault((name, version), {})[file] = one
        for (name, version), both in files.items():
            if len(both) == len(FILES):
                config, weights = (both[file] for file in FILES)
                found[name][version] = Content((config.size, weights.size), (config, weights))
        self._last = found
        return found

    def watch(self, wake: Callable[[], None]) -> Watcher | None:
        return None  # a store tells nothing: it is listed

    def copy(self, name: str, version: str, content: Content, into: Path, hasher: blake3.blake3) -> bool:
        try:
            for file, listed in zip(FILES, cast(tuple[Object, Object], content.marks), strict=True):
                key, etag, size = f"{name}/{version}/{file}", listed.etag, listed.size
                hasher.update(file.encode() + b"\0")
                with open(into / file, "xb") as out:
                    for start in range(0, size, CHUNK):
                        chunk = self.store.get_range(key, start, min(start + CHUNK, size), etag)
                        hasher.update(chunk)
                        out.write(chunk)
                os.chmod(into / file, 0o644)
                os.utime(into / file, (listed.modified, listed.modified))
                if etag is None and self.store.head(key) != listed:
                    return False  # a store without ETags: the listing is compared again
        except ObjectChanged:
            return False
        return True


class _Wake(FileSystemEventHandler):
    def __init__(self, wake: Callable[[], None]) -> None:
        self.wake = wake

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("closed", "moved", "deleted") or (
            event.event_type == "created" and event.is_directory
        ):
            self.wake()


def tree(root: str, endpoint_url: str | None, timeout: float) -> Tree:
    if is_remote(root):
        store = open_store(root, endpoint_url=endpoint_url, timeout=timeout, key=("adapters", "root"))
        return StoreTree(store)
    return LocalTree(Path(root))


@contextmanager
def _directory(name: str, parent_fd: int | None) -> Iterator[int]:
    """A folder opened in its parent without following a link."""
    fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _folders(fd: int) -> list[str]:
    """Names of the real directories in the folder open as `fd` (no symlinks)."""
    found = []
    for name in os.listdir(fd):
        try:
            if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                found.append(name)
        except FileNotFoundError:
            continue
    return found


def _content(version_fd: int) -> Content | None:
    """The two files' identities, or None while either is missing or not a regular file."""
    found = []
    for file in FILES:
        try:
            info = os.stat(file, dir_fd=version_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(info.st_mode):
            return None
        found.append(identity(info))
    return Content((found[0][2], found[1][2]), tuple(found))


def _copy_file(version_fd: int, name: str, size: int, target: Path, hasher: blake3.blake3) -> None:
    """At most `size` bytes (what was listed): a file that grows meanwhile is caught after."""
    fd = os.open(name, FILE_FLAGS, dir_fd=version_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{name}: not a regular file")
        hasher.update(name.encode() + b"\0")
        copied = 0
        with open(target, "xb") as out:
            while copied < size and (chunk := os.read(fd, min(CHUNK, size - copied))):
                hasher.update(chunk)
                out.write(chunk)
                copied += len(chunk)
            # Not fsynced (it doubled the copy's time): after a crash the copy is read again and
            # compared with the digest its name holds before any engine is given it.
        os.chmod(target, 0o644)
        info = os.fstat(fd)  # its time kept: the gate's grace for a file still written is the source's
        os.utime(target, ns=(info.st_atime_ns, info.st_mtime_ns))
    finally:
        os.close(fd)
