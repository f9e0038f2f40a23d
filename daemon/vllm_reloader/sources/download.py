"""Download one checkpoint from the object store into the local root: verified, resumable.

Parts are fetched with parallel ranged GETs (`concurrency` at a time, `part_size` bytes
each, `If-Match` the listed ETag) and written in place with `pwrite`. They are consumed
in file order as the window slides, so each file's digests are computed while streaming
with at most `concurrency` parts in memory. A part counts only once the disk took all of
its bytes (a filling disk cuts a `pwrite` short without an error): only then is it hashed
and appended to a journal in the staging directory; after a crash those parts are read back
from disk, not fetched again. A write the disk refuses is a DownloadError that places
nothing. The manifest is written last, everything is fsynced, and one rename puts the
directory into the root — where the local gate checks it once more, like any checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import verified
from ..checkpoint.files import RACY_NS, identity, is_top_level_shard
from ..checkpoint.manifest import Manifest, ManifestFile, digest_mismatch, hashers
from ..checkpoint.scan import StreamScan
from ..durable import fsync_dir, write_synced
from ..errors import Cancelled, DownloadError, SourceError
from .objstore import Bucket, Object

JOURNAL_NAME = ".parts"
SYNC_BYTES = 256 << 20
"""Written parts are fdatasync'ed, then journaled, in batches of about this many bytes."""

Part = tuple[str, int, int, str]
"""(path, start, end, etag): one ranged GET, and its journal entry."""


@dataclass(frozen=True)
class Plan:
    concurrency: int = 8
    part_size: int = 16 << 20
    min_free_bytes: int = 1 << 30
    scan_finite: bool = True
    """Scan the shards for NaN/Inf as they stream in, so the gate need not read them again."""


@dataclass(frozen=True)
class Fetched:
    path: Path | None
    """The checkpoint in the root; None when `rejected`."""
    rejected: str = ""
    """Why these bytes can never load (a digest mismatch): final for this manifest."""
    fetched_bytes: int = 0
    reused_bytes: int = 0
    seconds: float = 0.0
    blake3: dict[str, str] = field(default_factory=dict)
    """Each file's blake3 as computed while it streamed in, checked against the manifest."""
    scanned: dict[str, str | None] = field(default_factory=dict)
    """Each shard scanned while it streamed in: the first tensor holding NaN/Inf, or None."""


class _Journal:
    def __init__(self, path: Path, resume: bool) -> None:
        self.path = path
        self.done: set[Part] = set()
        if resume and path.exists():
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                    self.done.add((entry["path"], entry["start"], entry["end"], entry["etag"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by the crash
        self._file = path.open("a")
        self._lock = threading.Lock()
        self._waiting: list[Part] = []
        self._fds: set[int] = set()
        self._bytes = 0

    def record(self, part: Part, fd: int) -> None:
        """Journal a written part once its bytes are on disk: a part the journal names is read
        back after a crash, so it must not be a hole. Parts are synced in batches."""
        with self._lock:
            self._waiting.append(part)
            self._fds.add(fd)
            self._bytes += part[2] - part[1]
            if self._bytes >= SYNC_BYTES:
                self._sync()

    def _sync(self) -> None:
        for fd in self._fds:
            os.fdatasync(fd)
        for path, start, end, etag in self._waiting:
            self._file.write(json.dumps({"path": path, "start": start, "end": end, "etag": etag}) + "\n")
        self._file.flush()
        self._waiting, self._fds, self._bytes = [], set(), 0

    def close(self) -> None:
        """Keeps what was written (a stop mid-download resumes from it), if it can be synced.
        Never raises: a part it fails to journal is only fetched again, and on a full disk
        its error would hide the download's own."""
        with self._lock:
            try:
                self._sync()
            except OSError:
                pass
            finally:
                with contextlib.suppress(OSError):  # the buffered lines' flush; the file closes anyway
                    self._file.close()


def _parts(manifest: Manifest, listing: dict[str, Object], part_size: int) -> Iterator[Part]:
    for entry in manifest.files:
        etag = listing[entry.path].etag or ""
        for start in range(0, entry.size, part_size):
            yield entry.path, start, min(start + part_size, entry.size), etag


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    """`pwrite` says only by its count that a filling disk took part of the bytes: the rest is
    written again, and a write that takes none is ENOSPC (left alone, it is a hole of zeros)."""
    data = memoryview(data)
    while data:
        written = os.pwrite(fd, data, offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        data, offset = data[written:], offset + written


def _check_space(staging: Path, needed: int, margin: int) -> None:
    info = os.statvfs(staging)
    free = info.f_bavail * info.f_frsize
    if free - needed < margin:
        raise DownloadError(
            f"not enough space in {staging.parent}: the download needs {needed / 1e9:.2f} GB more "
            f"and {margin / 1e9:.2f} GB must stay free, {free / 1e9:.2f} GB is free"
        )


class _Download:
    def __init__(
        self,
        store: Bucket,
        manifest: Manifest,
        listing: dict[str, Object],
        staging: Path,
        plan: Plan,
        stop: threading.Event,
        get_part: Callable[[Part], memoryview] | None,
        journal: _Journal,
        prefix: str,
    ) -> None:
        """`prefix`: the checkpoint's name in the store (its keys are NAME/PATH)."""
        self.store, self.manifest, self.listing, self.staging = store, manifest, listing, staging
        self.journal = journal
        self.plan, self.stop = plan, stop
        self.get_part = get_part or (lambda p: store.get_range(f"{prefix}/{p[0]}", p[1], p[2], p[3] or None))
        self.fds: dict[str, int] = {}
        self.fetched = self.reused = 0
        self.reused_in: set[str] = set()

    def open_files(self) -> None:
        for entry in self.manifest.files:
            path = self.staging / entry.path
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            self.fds[entry.path] = fd
            if os.fstat(fd).st_size != entry.size:
                os.ftruncate(fd, entry.size)

    def part(self, part: Part) -> memoryview:
        """Runs on the pool: one part, from the journal's copy on disk or from the store."""
        path, start, end, _ = part
        fd = self.fds[path]
        if part in self.journal.done:
            return memoryview(os.pread(fd, end - start, start))
        if self.stop.is_set():
            raise Cancelled("the daemon is stopping")
        data = self.get_part(part)
        if len(data) != end - start:
            raise SourceError(f"GET {path} [{start}, {end}): {len(data)} bytes came back")
        try:
            _write_all(fd, data, start)
        except OSError as exc:  # named here: the fd's error knows no file
            raise OSError(exc.errno, exc.strerror, str(self.staging / path)) from exc
        self.journal.record(part, fd)  # a digest and a journal line only for bytes the disk took
        return data

    def run(self) -> str:
        """Fetch and hash everything; returns why the bytes are bad, or "" when they are good."""
        self.entries = {e.path: e for e in self.manifest.files}
        self.states = {path: hashers(e) for path, e in self.entries.items()}
        self.scans = {
            path: StreamScan(path)
            for path in self.entries
            if self.plan.scan_finite and is_top_level_shard(path)
        }
        self.remaining = {path: e.size for path, e in self.entries.items()}
        for entry in self.entries.values():
            if entry.size == 0 and (bad := self._finish(entry)):
                return bad
        todo = _parts(self.manifest, self.listing, self.plan.part_size)
        window: deque[tuple[Part, Future[memoryview]]] = deque()
        with ThreadPoolExecutor(self.plan.concurrency, thread_name_prefix="download") as pool:
            try:
                while True:
                    while len(window) < self.plan.concurrency and (part := next(todo, None)):
                        window.append((part, pool.submit(self.part, part)))
                    if not window:
                        return ""
                    part, future = window.popleft()
                    if bad := self._consume(part, future.result()):
                        return bad
            finally:
                pool.shutdown(cancel_futures=True)

    def _consume(self, part: Part, data: memoryview) -> str:
        """On the calling thread, in file order: hash the part; check the file once it is whole."""
        path, start, end, _ = part
        if part in self.journal.done:
            self.reused += end - start
            self.reused_in.add(path)
        else:
            self.fetched += end - start
        for state in self.states[path].values():
            state.update(data)
        if (scan := self.scans.get(path)) is not None:
            scan.update(data)
        self.remaining[path] -= end - start
        return self._finish(self.entries[path]) if self.remaining[path] == 0 else ""

    def _finish(self, entry: ManifestFile) -> str:
        os.fsync(self.fds[entry.path])
        return digest_mismatch(entry, self.states[entry.path]) or ""

    def close(self) -> None:
        """Every fd, whatever happened: one leaked per file per poll would also keep deleted
        files' space allocated on the disk that just filled up."""
        fds, self.fds = list(self.fds.values()), {}
        for fd in fds:
            with contextlib.suppress(OSError):  # released even when close reports an error
                os.close(fd)


def fetch(
    store: Bucket,
    name: str,
    last: tuple[str, bytes] | None,
    manifest: Manifest,
    listing: dict[str, Object],
    *,
    staging_root: Path,
    root: Path,
    plan: Plan = Plan(),
    stop: threading.Event | None = None,
    get_part: Callable[[Part], memoryview] | None = None,
    place_as: str | None = None,
) -> Fetched:
    """Download `name` (whose manifest and listing the caller judged complete) into `root`,
    as `ROOT/<place_as>` (default: the name).

    `manifest` lists what to fetch (ours, or one worked out for a foreign writer); `listing`
    maps each of its paths to the listed object; `last` is the file that marks the
    checkpoint complete (our manifest, an HF index, a marker), written after all others.
    The caller names each content apart (`order.placed_name`): a directory already there is
    that content, placed before, and nothing in the root is ever replaced.

    Raises SourceError (the store failed: retry later, the journal keeps the progress),
    DownloadError (the cache disk); returns `rejected` when the bytes fail their digests."""
    stop = stop or threading.Event()
    started = time.perf_counter()
    place_as = place_as or name
    staging = staging_root / place_as
    try:
        for resume in (True, False):
            staging_root.mkdir(exist_ok=True)  # never its parents: a state dir deleted meanwhile stays gone
            staging.mkdir(exist_ok=True)
            journal = _Journal(staging / JOURNAL_NAME, resume)
            download = _Download(store, manifest, listing, staging, plan, stop, get_part, journal, name)
            try:
                reused = sum(end - start for _, start, end, _ in journal.done)
                _check_space(staging, manifest.total_bytes - reused, plan.min_free_bytes)
                download.open_files()
                bad = download.run()
            finally:
                try:
                    journal.close()  # first: it syncs the download's fds before journaling their parts
                finally:
                    download.close()
            if bad and download.reused_in and resume:
                shutil.rmtree(staging)  # parts kept from before a crash may not have reached the disk
                continue
            seconds = time.perf_counter() - started
            if bad:
                shutil.rmtree(staging, ignore_errors=True)
                return Fetched(None, bad, download.fetched, download.reused, seconds)
            digests = {p: s["blake3"].hexdigest() for p, s in download.states.items() if "blake3" in s}
            scanned = {p: scan.found for p, scan in download.scans.items() if scan.scanned}
            placed, new = place(staging, root, place_as, last)
            if not new:  # what was checked here is not what is there: the gate reads that itself
                digests, scanned = {}, {}
            return Fetched(placed, "", download.fetched, download.reused, seconds, digests, scanned)
    except OSError as exc:
        where = exc.filename or staging
        raise DownloadError(f"downloading {name} into {where}: {exc.strerror or exc}") from exc
    raise AssertionError("unreachable")


def place(staging: Path, root: Path, name: str, last: tuple[str, bytes] | None) -> tuple[Path, bool]:
    """The completing file last, everything fsynced, then one rename into the root. Never over
    a directory that is there: an engine may serve it, roll back to it or be loading it.
    Returns where it is, and whether these bytes were placed (False: it was there)."""
    (staging / JOURNAL_NAME).unlink(missing_ok=True)
    if last is not None:
        write_synced(staging / last[0], last[1])
    for directory in sorted({p.parent for p in staging.rglob("*")}, reverse=True):
        fsync_dir(directory)
    root.mkdir(exist_ok=True)  # never its parents: a state dir deleted meanwhile stays gone
    final = root / name
    if os.path.lexists(final):  # this content, placed before (its name says so): keep that one
        shutil.rmtree(staging, ignore_errors=True)
        return final, False
    os.rename(staging, final)
    fsync_dir(root)
    return final, True


def remember(verified_files: verified.Cache | None, fetched: Fetched) -> None:
    """The digests just checked (and NaN scans done) while streaming, under the placed files'
    identities, so the local gate does not read them again: taken a timestamp tick after the
    last write, so a later write would show (racily clean)."""
    if verified_files is None or fetched.path is None:
        return
    time.sleep(RACY_NS / 1e9)
    started_ns = time.time_ns()
    for path in fetched.blake3.keys() | fetched.scanned.keys():  # a foreign writer's have no digests
        try:
            found = identity(os.lstat(fetched.path / path))
        except OSError:
            continue
        scanned = fetched.scanned
        result = verified.Verified(
            found, fetched.blake3.get(path, ""), scanned.get(path), path in scanned, started_ns
        )
        verified_files.put(result)
