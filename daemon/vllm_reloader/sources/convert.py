"""A trainer's own format (torch DCP, Megatron, DeepSpeed) made loadable by the operator's
converter command, then placed into the root like a download.

The gate says when such a checkpoint is whole by its trainer's rule (`conventions.foreign`)
and what its content is. Each content is converted once, on this thread (a conversion takes
minutes), into `ROOT/.converting-NAME@<fp>/output` (dot-named: no watcher or gate looks at
it). On success the output gets a manifest (its files' sizes and blake3), is synced, and
one rename places it as `ROOT/NAME@<fp>`, which orders as NAME and is gated like any
checkpoint. On failure (an exit status, a timeout, no safetensors written) that content is
rejected with the converter's last lines; new content is converted again. Stopping the
daemon kills a running converter and records nothing: it runs again after the restart.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
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

import blake3

from .. import log
from ..checkpoint import order
from ..checkpoint.files import is_top_level_shard, open_regular
from ..checkpoint.gate import Verdict
from ..checkpoint.manifest import MANIFEST_NAME, Manifest, ManifestFile, dumps
from ..config import SourceConfig
from .download import place
from .remote import Downloaded, Rejected

CHECK = "converter"
STAGING_PREFIX = ".converting-"
TAIL_LINES = 8
TAIL_CHARS = 1500
HASH_CHUNK = 16 << 20
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


class Converter:
    """Runs `[source] converter` on whole foreign checkpoints, one at a time, and posts
    `Downloaded` (placed: gate it) or `Rejected` to the loop."""

    def __init__(
        self, source: SourceConfig, root: Path, post: Callable[[Downloaded | Rejected], None]
    ) -> None:
        self.source, self.root, self.post = source, root, post
        self.asked: set[tuple[str, str]] = set()
        """(name, fingerprint) submitted since start: each content is converted once."""
        self.stop = threading.Event()
        self.log = log.get()
        self._jobs: queue.SimpleQueue[Conversion | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="converter", daemon=True)

    def configure(self, source: SourceConfig, root: Path) -> None:
        """SIGHUP: the next conversion runs the new command, into the new root (one running goes on)."""
        self.source, self.root = source, root

    def consider(self, name: str, directory: Path, verdict: Verdict) -> None:
        """From the loop, on each verdict: converts what the gate found whole (`convert`)."""
        kind, fingerprint = verdict.details.get("convert"), verdict.fingerprint
        if verdict.status != "pending" or not isinstance(kind, str) or not fingerprint:
            return
        if not self.source.converter or (name, fingerprint) in self.asked:
            return
        self.asked.add((name, fingerprint))
        job = Conversion(name, fingerprint, directory, kind, self.root)
        self.log.info("checkpoint.converting", name=name, format=kind, into=job.placed)
        self._jobs.put(job)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        self.stop.set()
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None and not self.stop.is_set():
            try:
                result = self._convert(job)
            except Exception as exc:  # a bug: this content only; the thread goes on
                result = self._rejected(job, f"internal error: {type(exc).__name__}: {exc}")
            if result is not None:
                self.post(result)

    def _rejected(self, job: Conversion, reason: str) -> Rejected:
        return Rejected(job.name, "", reason[:TAIL_CHARS], job.fingerprint, CHECK)

    def _convert(self, job: Conversion) -> Downloaded | Rejected | None:
        staging = job.root / f"{STAGING_PREFIX}{job.placed}"
        with _owned(staging.with_name(staging.name + ".lock")) as owned:
            if os.path.lexists(job.root / job.placed):  # converted before (a restart, another daemon)
                return Downloaded(job.placed)
            if not owned:  # another daemon on this root converts it: its output shows up here
                return None
            shutil.rmtree(staging, ignore_errors=True)  # what a crash or a stop left
            try:
                return self._converted(job, staging)
            except OSError as exc:
                return self._rejected(
                    job, f"converting into {exc.filename or staging}: {exc.strerror or exc}"
                )
            finally:
                shutil.rmtree(staging, ignore_errors=True)
                staging.with_name(staging.name + ".lock").unlink(missing_ok=True)

    def _converted(self, job: Conversion, staging: Path) -> Downloaded | Rejected | None:
        output = staging / "output"
        staging.mkdir()
        failed = self._execute(job, staging, output)
        if failed is None:
            return None  # stopping
        if failed:
            return self._rejected(job, failed)
        if output.is_symlink() or not output.is_dir():
            return self._rejected(job, "the converter exited 0 but made no directory at {output}")
        entries = _files(output)
        if not any(is_top_level_shard(entry.path) for entry in entries):
            return self._rejected(job, "the converter exited 0 but wrote no .safetensors into {output}")
        manifest = Manifest(format_version=1, version=job.name, files=tuple(entries))
        place(output, job.root, job.placed, (MANIFEST_NAME, dumps(manifest)))
        self.log.info("checkpoint.converted", name=job.name, placed=job.placed, bytes=manifest.total_bytes)
        return Downloaded(job.placed)

    def _execute(self, job: Conversion, staging: Path, output: Path) -> str | None:
        """Runs the command: "" when it succeeded, why it failed, None when stopping."""
        values = {
            "{input}": str(job.directory),
            "{output}": str(output),
            "{format}": job.format,
            "{name}": job.name,
        }
        argv = [_substituted(arg, values) for arg in self.source.converter]
        started = time.monotonic()
        with (staging / "converter.log").open("w+b") as out:
            process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=staging,
                start_new_session=True,  # its children are killed with it
            )  # fmt: skip
            try:
                while process.poll() is None:
                    if self.stop.wait(0.2):
                        return None
                    if time.monotonic() - started > self.source.converter_timeout:
                        return (
                            f"the converter ran past converter_timeout ({self.source.converter_timeout:g} s)"
                            + _tail(out)
                        )
            finally:
                if process.poll() is None:
                    _kill(process)
            if process.returncode != 0:
                return f"the converter exited with status {process.returncode}" + _tail(out)
        return ""


def _substituted(arg: str, values: dict[str, str]) -> str:
    """In one pass: a name that spells `{output}` stays as it is."""
    return PLACEHOLDER.sub(lambda found: values[found[0]], arg)


def _kill(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _tail(out: BinaryIO) -> str:
    """`: ` and the converter's last lines (its output, read back from the log file)."""
    out.seek(max(0, out.seek(0, os.SEEK_END) - 64 * 1024))
    lines = deque(
        (line.strip() for line in out.read().decode(errors="replace").splitlines() if line.strip()),
        TAIL_LINES,
    )
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


def _files(output: Path) -> list[ManifestFile]:
    """Every regular file the converter wrote (no symlinks followed), with its size and blake3;
    a manifest of its own is not one of them (the daemon writes the output's)."""
    entries = []
    for path in sorted(output.rglob("*")):
        if path.is_symlink() or not path.is_file() or path.relative_to(output).as_posix() == MANIFEST_NAME:
            continue
        hasher, size = blake3.blake3(max_threads=blake3.blake3.AUTO), 0
        fd = open_regular(path)
        try:
            while chunk := os.read(fd, HASH_CHUNK):
                hasher.update(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
        entries.append(
            ManifestFile(path=path.relative_to(output).as_posix(), size=size, blake3=hasher.hexdigest())
        )
    return entries
