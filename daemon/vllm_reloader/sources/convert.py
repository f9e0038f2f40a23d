"""A trainer's own format (torch DCP, Megatron, DeepSpeed) made loadable by the operator's
converter command, then placed into the root like a download.

The gate says when such a checkpoint is whole by its trainer's rule (`conventions.foreign`)
and what its content is (every file's name, size and time). Each content is converted once,
on this thread (a conversion takes minutes), into `ROOT/.converting-NAME@<fp>/output`
(dot-named: no watcher or gate looks at it). Its content is checked again before the
command runs and after it exits: a checkpoint written again meanwhile is dropped, not
converted half-old, and its new content is converted next. On success every output file is
synced and listed in a manifest (sizes, blake3), and one rename places it as
`ROOT/NAME@<fp>`, which orders as NAME (with the step its name ends in) and is gated like any
checkpoint. The command failing on it (an exit status, a timeout, no safetensors) rejects
that content with its last lines; what is not about the checkpoint (killed by a signal: out
of memory; a disk error) is tried again after a backoff. Stopping kills a running command,
records nothing, and the next start sweeps what it left.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .. import log
from ..checkpoint import completeness, order
from ..checkpoint.completeness import DirectoryListing
from ..checkpoint.conventions import Convention, name_step
from ..checkpoint.files import is_top_level_shard, open_regular
from ..checkpoint.gate import Verdict
from ..checkpoint.manifest import MANIFEST_NAME, Manifest, ManifestFile, dumps, listed
from ..config import API_KEY_ENV, SourceConfig
from ..retry import Backoff, Policy
from ..threads import QueueWorker
from .content import ContentStore
from .download import place
from .local import name_too_long
from .remote import Downloaded, Rejected

CHECK = "converter"
STAGING_PREFIX = ".converting-"
LOCK_SUFFIX = ".lock"
TAIL_LINES = 8
TAIL_CHARS = 1500
RETRY = Policy(60.0, 3600.0)
"""Backoff after a failure that is not the checkpoint's (first, most), in seconds."""
PLACEHOLDER = re.compile(r"\{(input|output|format|name)\}")


@dataclass(frozen=True)
class Conversion:
    name: str
    fingerprint: str
    directory: Path
    format: str
    root: Path
    """Where its output is placed: the root of when it was asked for."""

    @property
    def placed(self) -> str:
        return order.placed_name(self.name, self.fingerprint)


class _Again(Exception):
    """Not the checkpoint's fault: try it again after a backoff."""


class Converter(QueueWorker[Conversion]):
    """Runs `[source] converter` on whole foreign checkpoints, one at a time, and posts
    `Downloaded` (placed: gate it) or `Rejected` to the loop."""

    def __init__(
        self,
        source: SourceConfig,
        root: Path,
        post: Callable[[Downloaded | Rejected], None],
        content: ContentStore | None = None,
    ) -> None:
        """`content`: where each output is registered (collected once nothing holds it)."""
        super().__init__("converter")
        self.source, self.root, self.post, self.content = source, root, post, content
        self.asked: set[tuple[str, str]] = set()
        """(name, fingerprint) submitted since start: each content is converted once..."""
        self.backoff: Backoff[tuple[str, str]] = Backoff(RETRY)
        """...unless it failed for a reason not its own: tried again once its wait is over."""
        self.queued: set[tuple[str, str]] = set()
        """Submitted and not done yet (a verdict every second must not queue it again)."""
        self._lock = threading.Lock()
        self.log = log.get()

    def configure(self, source: SourceConfig, root: Path) -> None:
        """SIGHUP: the next conversion runs the new command, into the new root (one running goes on)."""
        self.source, self.root = source, root

    def consider(self, name: str, directory: Path, verdict: Verdict) -> None:
        """From the loop, on each verdict: converts what the gate found whole (`convert`)."""
        kind, fingerprint = verdict.details.get("convert"), verdict.fingerprint
        key = (name, fingerprint)
        if verdict.status != "pending" or not isinstance(kind, str) or not fingerprint:
            return
        if not self.source.converter or directory.parent != self.root:  # a SIGHUP moved the root
            return
        with self._lock:
            failed_before = self.backoff.until(key) is not None
            if key in self.queued or (key in self.asked and (not failed_before or self.backoff.waiting(key))):
                return
            self.asked.add(key)
            self.queued.add(key)
            waiting = len(self.queued) > 1
        job = Conversion(name, fingerprint, directory, kind, self.root)
        self.log.info("checkpoint.converting", name=name, format=kind, into=job.placed, queued=waiting)
        self.submit(job)

    def run(self) -> None:
        _sweep(self.root)  # here, not at start: a crashed conversion's leftovers may be large
        super().run()

    def handle(self, job: Conversion) -> None:
        key = (job.name, job.fingerprint)
        try:
            with self._lock:
                waiting = self.backoff.waiting(key)  # as it runs, not as it was queued
            if self.stop.is_set() or waiting:
                return
            try:
                result = self._convert(job)
            except _Again as exc:
                self._later(job, str(exc))
                return
            except Exception as exc:  # a bug: this content only; the thread goes on
                result = self._rejected(job, f"internal error: {type(exc).__name__}: {exc}")
            with self._lock:
                self.backoff.succeeded(key)
            if result is not None:
                self.post(result)
        finally:
            with self._lock:
                self.queued.discard(key)

    def _later(self, job: Conversion, reason: str) -> None:
        with self._lock:
            wait = self.backoff.failed((job.name, job.fingerprint))
        self.log.warning(
            "checkpoint.convert_failed", name=job.name, reason=reason[:TAIL_CHARS], retry_in_s=wait
        )

    def _rejected(self, job: Conversion, reason: str) -> Rejected:
        return Rejected(job.name, "", reason[:TAIL_CHARS], job.fingerprint, CHECK)

    def _still(self, job: Conversion) -> bool:
        """Whether the input is still whole with the content it was asked for."""
        convention = Convention(self.source.completeness, self.source.markers, converter=True)
        try:
            found = completeness.foreign_content(DirectoryListing(job.directory), convention)
        except OSError:
            return False
        return found is not None and found[0].complete and found[1] == job.fingerprint

    def _dropped(self, job: Conversion, why: str) -> None:
        with self._lock:
            self.asked.discard((job.name, job.fingerprint))
        self.log.info("checkpoint.convert_dropped", name=job.name, reason=why)

    def _convert(self, job: Conversion) -> Downloaded | Rejected | None:
        staging = job.root / f"{STAGING_PREFIX}{job.placed}"
        if too_long := name_too_long(job.root, staging.name + LOCK_SUFFIX):  # once, not retried
            why = f"its output cannot be placed: {too_long}"
            return Rejected(job.name, "", why, job.fingerprint, "local")
        try:
            with _owned(staging.with_name(staging.name + LOCK_SUFFIX)) as owned:
                if os.path.lexists(job.root / job.placed):  # converted before (a restart, another daemon)
                    return Downloaded(job.placed)
                if not owned:  # another daemon on this root converts it: its output shows up here
                    return None
                try:
                    return self._converted(job, staging)
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
                    staging.with_name(staging.name + LOCK_SUFFIX).unlink(missing_ok=True)
        except OSError as exc:  # the disk, not the checkpoint
            raise _Again(f"converting into {exc.filename or staging}: {exc.strerror or exc}") from exc

    def _converted(self, job: Conversion, staging: Path) -> Downloaded | Rejected | None:
        if not self._still(job):
            self._dropped(job, "written again, or gone, since the gate saw it whole")
            return None
        shutil.rmtree(staging, ignore_errors=True)  # what a crash left
        output = staging / "output"
        staging.mkdir()
        failed = self._execute(job, staging, output)
        if failed is None:
            return None  # stopping
        if not self._still(job):  # the command may have read some files old and some new
            self._dropped(job, "written again while the converter ran")
            return None
        if failed:
            return self._rejected(job, failed)
        if output.is_symlink() or not output.is_dir():
            return self._rejected(job, "the converter exited 0 but made no directory at {output}")
        entries = _files(output)
        if not any(is_top_level_shard(entry.path) for entry in entries):
            return self._rejected(job, "the converter exited 0 but wrote no .safetensors into {output}")
        manifest = Manifest(
            format_version=1, version=job.name, step=name_step(job.name), files=tuple(entries)
        )
        placed, _ = place(output, job.root, job.placed, (MANIFEST_NAME, dumps(manifest)))
        if self.content is not None:
            self.content.made(placed, "converted")
        self.log.info("checkpoint.converted", name=job.name, placed=job.placed, bytes=manifest.total_bytes)
        return Downloaded(job.placed)

    def _execute(self, job: Conversion, staging: Path, output: Path) -> str | None:
        """Runs the command: "" when it succeeded, why it failed, None when stopping. Raises
        `_Again` when it was killed by a signal (out of memory, most likely) or cannot start."""
        values = {
            "{input}": str(job.directory),
            "{output}": str(output),
            "{format}": job.format,
            "{name}": job.name,
        }
        argv = [PLACEHOLDER.sub(lambda found: values[found[0]], arg) for arg in self.source.converter]
        environment = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}  # it reads pickles
        timeout, started = self.source.converter_timeout, time.monotonic()
        with (staging / "converter.log").open("w+b") as out:
            try:
                process = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=staging,
                    env=environment, start_new_session=True,  # its children are killed with it
                )  # fmt: skip
            except (OSError, ValueError, IndexError) as exc:  # gone since the config was read; none set
                raise _Again(f"the converter could not start: {exc}") from exc
            try:
                while process.poll() is None:
                    if self.stop.wait(0.2):
                        return None
                    if time.monotonic() - started > timeout:
                        return f"the converter ran past converter_timeout ({timeout:g} s)" + _tail(out)
            finally:
                _kill(process)  # whatever it started is gone before its output is read
            if process.returncode < 0:
                said = (
                    signal.Signals(-process.returncode).name
                    if -process.returncode in signal.valid_signals()
                    else ""
                )
                raise _Again(
                    f"the converter was killed by signal {-process.returncode} {said} (out of memory?)"
                    + _tail(out)
                )
            if process.returncode != 0:
                return f"the converter exited with status {process.returncode}" + _tail(out)
        return ""


def _kill(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(30)  # one stuck in uninterruptible I/O is left behind, not waited on forever


def _tail(out: BinaryIO) -> str:
    """`: ` and the converter's last lines (its output, read back from the log file)."""
    out.seek(max(0, out.seek(0, os.SEEK_END) - 64 * 1024))
    text = out.read().decode(errors="replace")
    lines = deque((line.strip() for line in text.splitlines() if line.strip()), TAIL_LINES)
    return ": " + " | ".join(lines) if lines else " (it printed nothing)"


@contextlib.contextmanager
def _owned(lock: Path) -> Iterator[bool]:
    """Whether this process converts it (an flock, let go if it dies): two daemons on one root
    never share a staging directory, and a crashed one's leftovers go with the next try."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _sweep(root: Path) -> None:
    """Staging directories no live converter holds (a crash, a kill, a power cut left them)."""
    try:
        leftovers = [
            p
            for p in root.iterdir()
            if p.name.startswith(STAGING_PREFIX) and not p.name.endswith(LOCK_SUFFIX)
        ]
    except OSError:
        return
    for staging in leftovers:
        with contextlib.suppress(OSError), _owned(staging.with_name(staging.name + LOCK_SUFFIX)) as owned:
            if owned:
                shutil.rmtree(staging, ignore_errors=True)
                staging.with_name(staging.name + LOCK_SUFFIX).unlink(missing_ok=True)


def _files(output: Path) -> list[ManifestFile]:
    """Every regular file the converter wrote (no symlinks followed), with its size and blake3,
    each synced to the disk (the placing rename must not outrun its data); a manifest of its
    own is not one of them (the daemon writes the output's)."""
    entries = []
    for path in sorted(output.rglob("*")):
        relative = path.relative_to(output).as_posix()
        if path.is_symlink() or not path.is_file() or relative == MANIFEST_NAME:
            continue
        fd = open_regular(path)
        try:
            entries.append(listed(fd, relative))
        finally:
            os.close(fd)
    return entries
