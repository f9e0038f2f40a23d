"""LoRA adapters as a source of versions: `<root>/<adapter>/<version>/` with PEFT's
`adapter_config.json` and `adapter_model.safetensors`.

A thread looks at the root every `interval` seconds (adapters are few and small). A version
whose two files are there is copied, hashed as it is read, into
`<copies>/<adapter>/<version>@<fp16>/`, a directory only the daemon writes: the engine reads
that copy, so the bytes it loads are the bytes the gate verified, whatever the writer does
afterwards, and each version has a path of its own (vLLM keys its prefix cache by an
adapter's name and path). The copy is gated; a copy the gate finds not whole yet is
dropped and taken again at the next look, so no debounce waits on a writer that is done.
The verdict goes to the loop; a content already judged is not read again.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import blake3

from .. import log
from ..checkpoint import adapter
from ..checkpoint.adapter import CONFIG_NAME, WEIGHTS_NAME, AdapterVerdict, AdapterVersion
from ..checkpoint.conventions import name_step
from ..checkpoint.files import Identity, identity, open_regular

STAGING_PREFIX = ".copying-"
CHUNK = 8 << 20
MAX_NAME = 128
Content = tuple[Identity, Identity]


@dataclass(frozen=True)
class AdapterGated:
    """One version of an adapter judged: `copy` is what the engine may load (ready only)."""

    adapter: str
    version: str
    order: tuple[int, int]
    """(the step its name ends in, or -1; its folder's mtime): newer versions order later."""
    verdict: AdapterVerdict
    copy: AdapterVersion | None = None


@dataclass(frozen=True)
class AdaptersListed:
    """The adapter folders in the root now (an adapter no longer there may be unloaded)."""

    names: frozenset[str]


def valid_name(name: str) -> bool:
    """An adapter's or a version's folder name: what a model name and a path may safely be."""
    return (
        0 < len(name) <= MAX_NAME
        and not name.startswith(".")
        and all(c.isascii() and (c.isalnum() or c in "._-") for c in name)
    )


class AdapterSource:
    def __init__(
        self,
        root: Path,
        copies: Path,
        interval: float,
        served: Callable[[], adapter.Served | None],
        keep: Callable[[], frozenset[str]],
        post: Callable[[AdapterGated | AdaptersListed], None],
    ) -> None:
        """`served`: what the gate compares with (None: not known yet, nothing is judged);
        `keep`: copies in use (serving or a rollback target), never removed."""
        self.root, self.copies, self.interval = root, copies, interval
        self._served, self._keep, self._post = served, keep, post
        self._judged: dict[tuple[str, str], Content] = {}
        self._stop = threading.Event()
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
        names = frozenset(n for n in _folders(self.root) if valid_name(n))
        for name in sorted(names):
            for version in sorted(v for v in _folders(self.root / name) if valid_name(v)):
                if self._stop.is_set():
                    return
                try:
                    self._consider(name, version, served)
                except OSError as exc:  # this version only
                    self.log.warning(
                        "adapter.unreadable", adapter=name, version=version, reason=str(exc)[:300]
                    )
        self._post(AdaptersListed(names))
        self._prune()

    def _consider(self, name: str, version: str, served: adapter.Served) -> None:
        source = self.root / name / version
        content = _content(source)
        if content is None or self._judged.get((name, version)) == content:
            return
        copy = self._copy(name, version, source, content)
        if copy is None:  # written meanwhile: the next look takes it
            return
        verdict = adapter.check(Path(copy.path), served)
        if verdict.status != "ready":  # pending: taken again at the next look; rejected: kept out
            shutil.rmtree(copy.path, ignore_errors=True)
        if verdict.status == "pending":
            return
        self._judged[(name, version)] = content
        order = (step if (step := name_step(version)) is not None else -1, os.stat(source).st_mtime_ns)
        ready = AdapterVersion(name, version, copy.path, copy.fingerprint, verdict.files, copy.size)
        self._post(AdapterGated(name, version, order, verdict, ready if verdict.status == "ready" else None))

    def _copy(self, name: str, version: str, source: Path, content: Content) -> AdapterVersion | None:
        """The two files copied and hashed in one read, synced, then renamed into place; None
        when the source changed while it was read."""
        staging = self.copies / f"{STAGING_PREFIX}{name}-{version}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        os.chmod(staging, 0o755)  # the engine's user reads it, whatever the daemon's umask
        hasher, size = blake3.blake3(), 0
        try:
            for file in (CONFIG_NAME, WEIGHTS_NAME):
                size += _copy_file(source / file, staging / file, hasher)
            if _content(source) != content:
                return None
            fingerprint = hasher.hexdigest()[:16]
            final = self.copies / name / f"{version}@{fingerprint}"
            final.parent.mkdir(exist_ok=True)
            os.chmod(final.parent, 0o755)
            if final.exists():  # the same bytes, copied before (a restart): the new copy goes
                shutil.rmtree(final)
            os.rename(staging, final)
            _sync_directory(final.parent)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return AdapterVersion(name, version, str(final), fingerprint, size=size)

    def _sweep(self) -> None:
        if not self.copies.is_dir():
            return
        for leftover in self.copies.glob(f"{STAGING_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def _prune(self) -> None:
        """Copies of versions no longer judged (their folder gone or rewritten) and not in use."""
        keep = self._keep()
        judged = {f"{n}/{v}" for n, v in self._judged}
        for copy in self.copies.glob("*/*@*"):
            if str(copy) in keep or f"{copy.parent.name}/{copy.name.rpartition('@')[0]}" in judged:
                continue
            shutil.rmtree(copy, ignore_errors=True)


def _folders(path: Path) -> list[str]:
    """Names of the real directories in `path` (no symlinks: a writer's link leads anywhere)."""
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [e.name for e in entries if e.is_dir(follow_symlinks=False)]


def _content(directory: Path) -> Content | None:
    """The two files' identities, or None while either is missing or not a regular file."""
    found = []
    for file in (CONFIG_NAME, WEIGHTS_NAME):
        try:
            info = os.lstat(directory / file)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(info.st_mode):
            return None
        found.append(identity(info))
    return found[0], found[1]


def _copy_file(source: Path, target: Path, hasher: blake3.blake3) -> int:
    fd = open_regular(source)
    try:
        hasher.update(source.name.encode() + b"\0")
        size = 0
        with open(target, "xb") as out:
            while chunk := os.read(fd, CHUNK):
                hasher.update(chunk)
                out.write(chunk)
                size += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(target, 0o644)
        info = os.fstat(fd)  # its time kept: the gate's grace for a file still written is the source's
        os.utime(target, ns=(info.st_atime_ns, info.st_mtime_ns))
        return size
    finally:
        os.close(fd)


def _sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
