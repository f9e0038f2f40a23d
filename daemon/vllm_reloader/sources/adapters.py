"""LoRA adapters as a source of versions: `<root>/<adapter>/<version>/` with PEFT's
`adapter_config.json` and `adapter_model.safetensors`.

A thread looks at the root every `interval` seconds (adapters are few and small). A version
whose two files are there is copied, hashed as it is read, into
`<copies>/<adapter>/<version>@<digest>/`, a directory only the daemon writes: the engine reads
that copy, so the bytes it loads are the bytes the gate verified, whatever the writer does
afterwards, and each content has a path of its own (vLLM keys its prefix cache by an
adapter's name and path). A copy of the same bytes made before is kept, never replaced: an
engine may read it at any time. The copy is gated; one the gate finds not whole yet is
dropped and taken again at the next look, so no debounce waits on a writer that is done.

Every folder is opened without following a link, one level at a time: a writer who swaps a
folder for a link to another's adapter gets nothing read through it. What is bigger than an
adapter of the served model at `max_rank` could be is refused before a byte is copied.
"""

from __future__ import annotations

import itertools
import os
import queue
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import blake3

from .. import log
from ..checkpoint import adapter
from ..checkpoint.adapter import CONFIG_NAME, MAX_CONFIG_BYTES, WEIGHTS_NAME, AdapterVerdict, AdapterVersion
from ..checkpoint.conventions import name_step
from ..checkpoint.files import Identity, identity

STAGING_PREFIX = ".copying-"
CHUNK = 8 << 20
MAX_NAME = 128
RETRY_SECONDS = 60.0
"""A version rejected for what is not its content (`io`, `internal`) is judged again after this."""
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
Content = tuple[Identity, Identity]
_instances = itertools.count()


@dataclass(frozen=True)
class AdapterGated:
    """One version of an adapter judged: `copy` is what the engine may load (ready only)."""

    adapter: str
    version: str
    order: tuple[int, int]
    """(the step its name ends in, or -1; when this content was first seen): newer orders later."""
    verdict: AdapterVerdict
    copy: AdapterVersion | None = None


@dataclass(frozen=True)
class AdaptersListed:
    """The adapter folders in the root now (an adapter no longer there may be unloaded)."""

    names: frozenset[str]


@dataclass(frozen=True)
class _Judged:
    content: Content
    served: adapter.Served
    copy: str | None
    retry_at: float | None = None


def valid_name(name: str) -> bool:
    """An adapter's or a version's folder name: what a model name and a path may safely be."""
    return (
        0 < len(name) <= MAX_NAME
        and not name.startswith(".")
        and all(c.isascii() and (c.isalnum() or c in "._-") for c in name)
    )


def max_weights_bytes(served: adapter.Served) -> int:
    """The most an adapter of the served model can hold: A and B for every 2-D weight, at
    `max_rank`, in F32, and a header's worth more."""
    pairs = sum(shape[0] + shape[-1] for shape in served.weights.values() if len(shape) == 2)
    return pairs * served.max_rank * 4 + (16 << 20)


class AdapterSource:
    def __init__(
        self,
        root: Path,
        copies: Path,
        interval: float,
        served: Callable[[], adapter.Served | None],
        keep: Callable[[], frozenset[str] | None],
        post: Callable[[AdapterGated | AdaptersListed], None],
        forgotten: queue.SimpleQueue[tuple[str, str]] | None = None,
    ) -> None:
        """`served`: what the gate compares with (None: not known yet, nothing is judged);
        `keep`: copies in use (None: not known yet, none is removed); `forgotten`: versions
        (adapter, version) to judge again, their copy found changed."""
        self.root, self.copies, self.interval = root, copies, interval
        self._served, self._keep, self._post = served, keep, post
        self._forgotten = forgotten or queue.SimpleQueue()
        self._judged: dict[tuple[str, str], _Judged] = {}
        self._seen = itertools.count()
        self._stop = threading.Event()
        self._staging = f"{STAGING_PREFIX}{os.getpid()}-{next(_instances)}-"
        self._thread = threading.Thread(target=self._run, name="adapters", daemon=True)
        self.log = log.get().bind(root=str(root))

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        self._sweep()
        while not self._stop.is_set():
            try:
                self.scan()
            except OSError as exc:  # the root itself: said, and looked at again
                self.log.warning("adapters.unreadable", reason=f"{exc.strerror or exc}")
            self._stop.wait(self.interval)

    def scan(self) -> None:
        """One look at the root: every version not judged in its present content is."""
        served = self._served()
        if served is None:
            return
        while not self._forgotten.empty():
            self._judged.pop(self._forgotten.get_nowait(), None)
        root_fd = os.open(self.root, DIR_FLAGS)
        try:
            names = frozenset(n for n in _folders(root_fd) if valid_name(n))
            present = set()
            for name in sorted(names):
                for version, content in self._versions(root_fd, name):
                    if self._stop.is_set():
                        return
                    present.add((name, version))
                    self._consider(root_fd, name, version, content, served)
        finally:
            os.close(root_fd)
        for gone in set(self._judged) - present:  # its folder is gone: its copy may go once unused
            del self._judged[gone]
        if names:  # an empty root (a mount not there) unloads nothing
            self._post(AdaptersListed(names))
        self._prune()

    def _versions(self, root_fd: int, name: str) -> Iterator[tuple[str, Content | None]]:
        try:
            with _directory(name, root_fd) as adapter_fd:
                for version in sorted(v for v in _folders(adapter_fd) if valid_name(v)):
                    try:
                        with _directory(version, adapter_fd) as version_fd:
                            yield version, _content(version_fd)
                    except OSError as exc:
                        self.log.warning(
                            "adapter.unreadable", adapter=name, version=version, reason=str(exc)[:300]
                        )
        except OSError as exc:  # this adapter's folder only
            self.log.warning("adapter.unreadable", adapter=name, reason=str(exc)[:300])

    def _consider(
        self, root_fd: int, name: str, version: str, content: Content | None, served: adapter.Served
    ) -> None:
        judged = self._judged.get((name, version))
        if content is None or (
            judged is not None
            and judged.content == content
            and judged.served is served
            and (judged.retry_at is None or time.monotonic() < judged.retry_at)
        ):
            return
        try:
            verdict, copy = self._judge(root_fd, name, version, content, served)
        except Exception as exc:
            verdict, copy = (
                adapter.AdapterVerdict("rejected", f"{type(exc).__name__}: {exc}"[:500], "internal"),
                None,
            )
        if verdict.status == "pending":
            return
        retry = time.monotonic() + RETRY_SECONDS if verdict.check in ("io", "internal") else None
        self._judged[(name, version)] = _Judged(content, served, copy.path if copy else None, retry)
        order = (step if (step := name_step(version)) is not None else -1, next(self._seen))
        self._post(AdapterGated(name, version, order, verdict, copy if verdict.status == "ready" else None))

    def _judge(
        self, root_fd: int, name: str, version: str, content: Content, served: adapter.Served
    ) -> tuple[AdapterVerdict, AdapterVersion | None]:
        config_size, weights_size = content[0][2], content[1][2]
        if config_size > MAX_CONFIG_BYTES or weights_size > (limit := max_weights_bytes(served)):
            too_big = (
                f"{CONFIG_NAME} of {config_size} and {WEIGHTS_NAME} of {weights_size} bytes: more than "
                f"an adapter of the served model at r = {served.max_rank} can hold ({limit} bytes)"
            )
            return adapter.AdapterVerdict("rejected", too_big, "size"), None
        made = self._copy(root_fd, name, version, content)
        if made is None:  # written meanwhile: the next look takes it
            return adapter.AdapterVerdict("pending", "written while copied"), None
        copy, new = made
        verdict = adapter.check(Path(copy.path), served)
        if verdict.status != "ready" and new and copy.path not in (self._keep() or ()):
            shutil.rmtree(copy.path, ignore_errors=True)  # pending: taken again; rejected: kept out
        return verdict, AdapterVersion(name, version, copy.path, copy.fingerprint, verdict.files, copy.size)

    def _copy(
        self, root_fd: int, name: str, version: str, content: Content
    ) -> tuple[AdapterVersion, bool] | None:
        """The two files copied and hashed in one read, then renamed into place (or the
        copy of the same bytes made before, kept as it is); None when the source changed while
        it was read. The flag: a new copy."""
        self._ensure(self.copies)
        staging = self.copies / f"{self._staging}{name}-{version}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        os.chmod(staging, 0o755)  # the engine's user reads it, whatever the daemon's umask
        hasher, size = blake3.blake3(), 0
        try:
            with _directory(name, root_fd) as adapter_fd, _directory(version, adapter_fd) as version_fd:
                for file, expected in zip((CONFIG_NAME, WEIGHTS_NAME), content, strict=True):
                    size += _copy_file(version_fd, file, expected[2], staging / file, hasher)
                if _content(version_fd) != content:
                    return None
            digest = hasher.hexdigest()
            final = self.copies / name / f"{version}@{digest[:32]}"
            self._ensure(final.parent)
            if final.is_dir() and _digest(final) == digest:  # the same bytes: an engine may read it
                return AdapterVersion(name, version, str(final), digest, size=size), False
            if final.exists():  # not what its name says (changed by hand): never loaded again
                shutil.rmtree(final)
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return AdapterVersion(name, version, str(final), digest, size=size), True

    def _ensure(self, directory: Path) -> None:
        if not directory.is_dir():
            directory.mkdir(parents=True, exist_ok=True)
            os.chmod(directory, 0o755)

    def _sweep(self) -> None:
        """What an earlier process left (this one's other sources clean up after themselves)."""
        if self.copies.is_dir():
            for leftover in self.copies.glob(f"{STAGING_PREFIX}*"):
                if not leftover.name.startswith(f"{STAGING_PREFIX}{os.getpid()}-"):
                    shutil.rmtree(leftover, ignore_errors=True)

    def _prune(self) -> None:
        """Copies neither in use nor of a version's present content (kept: unknown use)."""
        keep = self._keep()
        if keep is None:
            return
        current = {j.copy for j in self._judged.values() if j.copy}
        for copy in self.copies.glob("*/*@*"):
            if str(copy) not in keep and str(copy) not in current:
                shutil.rmtree(copy, ignore_errors=True)


@contextmanager
def _directory(name: str, parent_fd: int) -> Iterator[int]:
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
    for file in (CONFIG_NAME, WEIGHTS_NAME):
        try:
            info = os.stat(file, dir_fd=version_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(info.st_mode):
            return None
        found.append(identity(info))
    return found[0], found[1]


def _copy_file(version_fd: int, name: str, size: int, target: Path, hasher: blake3.blake3) -> int:
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
            # compared with the digest its name holds before any engine is given it (`_digest`).
        os.chmod(target, 0o644)
        info = os.fstat(fd)  # its time kept: the gate's grace for a file still written is the source's
        os.utime(target, ns=(info.st_atime_ns, info.st_mtime_ns))
        return copied
    finally:
        os.close(fd)


def _digest(copy: Path) -> str | None:
    """The digest of a copy's bytes, read again (None: not whole)."""
    hasher = blake3.blake3()
    try:
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            hasher.update(name.encode() + b"\0")
            with open(copy / name, "rb") as f:
                while chunk := f.read(CHUNK):
                    hasher.update(chunk)
    except OSError:
        return None
    return hasher.hexdigest()
