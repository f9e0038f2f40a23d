"""What the daemon knows across restarts, in one JSON file written atomically.

The engine is the source of truth for what is loaded (`reconcile` in the daemon asks it);
this file adds what the engine cannot tell: which directory a version came from, the
last good checkpoint to fall back on, and which candidates were rejected and why, so a
restarted daemon neither reloads needlessly nor retries a known-bad checkpoint.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from ..durable import replace_atomically
from ..errors import StateError

STATE_NAME = "state.json"


class Loaded(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """The checkpoint's directory name in the root (or the engine's startup model's)."""
    version: str
    path: str
    since: float
    step: int | None = None
    in_root: bool = True
    """False for a startup model outside the root: every candidate counts as newer."""
    files: dict[str, tuple[int, int, int, int, int]] | None = None
    """Each file's identity as the gate verified it (None: never gated here, e.g. the
    startup model): a rollback target is used only while these still hold."""
    fingerprint: str = ""
    """What the version is: its content's fingerprint (`completeness.fingerprint`; "" for the
    startup model and for state files written before versions were content)."""


class Rejection(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: str
    reason: str
    fingerprint: str
    at: float
    earlier: tuple[str, ...] = ()
    """The fingerprints of the name's contents rejected before this one (newest first): none of
    them is tried again either."""


class State(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    serving: Loaded | None = None
    good: tuple[Loaded, ...] = ()
    """Checkpoints that passed their canary, newest first: the rollback targets."""
    rejected: dict[str, Rejection] = {}
    pinned: str | None = None
    """A checkpoint name an operator pinned: loaded, and no auto-advance until unpinned."""

    @model_validator(mode="before")
    @classmethod
    def _one_last_good(cls, data: Any) -> Any:
        """State files before the history kept one `last_good`."""
        if isinstance(data, dict) and "last_good" in data:
            data = dict(data)
            last = data.pop("last_good")
            data.setdefault("good", [last] if last else [])
        return data

    @property
    def last_good(self) -> Loaded | None:
        return self.good[0] if self.good else None


READ_TRIES = 4
READ_BACKOFF_S = 0.1
"""A state file that cannot be read (EACCES, EIO: a disk or mount having a bad moment) is
tried `READ_TRIES` times, waiting 0.1, 0.2, 0.4 s between; then the daemon does not start."""
_pause = threading.Event()  # never set: its wait() is an interruptible sleep


def load(directory: Path, log: Any = None) -> State:
    """The saved state. A file that cannot be read, after retries, or that was read and cannot
    be parsed, is `StateError` (see `load_or_set_aside`, which tells the two apart)."""
    path = directory / STATE_NAME
    data = _read(path, log)
    return State() if data is None else _parse(path, data)


def _read(path: Path, log: Any) -> bytes | None:
    """The file's bytes; None when there is none. An error reading it is retried and logged
    (`state.unreadable`), and in the end a `StateError`: never taken for a corrupt file."""
    wait = READ_BACKOFF_S
    for attempt in range(1, READ_TRIES + 1):
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
            last = attempt == READ_TRIES
            if log is not None:
                log.warning(
                    "state.unreadable",
                    path=str(path),
                    reason=reason,
                    attempt=attempt,
                    of=READ_TRIES,
                    retry_in_s=None if last else round(wait, 3),
                )
            if last:
                raise StateError(
                    f"cannot read {path}: {reason} ({READ_TRIES} tries); not starting without the "
                    "pin, rollback history and rejections it holds (exit 1: systemd tries again)"
                ) from exc
            _pause.wait(wait)
            wait *= 2
    raise AssertionError("unreachable")  # pragma: no cover


def _parse(path: Path, data: bytes) -> State:
    try:
        return State.model_validate_json(data)
    except ValidationError as exc:
        raise StateError(f"{path} is corrupt: {exc.errors()[0]['msg']}") from exc


def load_or_set_aside(directory: Path, log: Any = None) -> tuple[State, Path | None]:
    """The saved state, or — when the file was read and is corrupt — an empty one, the corrupt
    file moved to `state.json.corrupt-<time>` (returned) so the daemon starts and asks the
    engine: under systemd a daemon that refused to start would restart forever. A file that
    cannot be read is no proof of corruption: `StateError`, nothing moved (the caller stops)."""
    path = directory / STATE_NAME
    data = _read(path, log)
    if data is None:
        return State(), None
    try:
        return _parse(path, data), None
    except StateError:
        aside = path.with_name(f"{STATE_NAME}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        try:
            os.replace(path, aside)
        except OSError as exc:
            raise StateError(f"{path} is corrupt and cannot be moved aside: {exc.strerror}") from exc
        return State(), aside


def save(directory: Path, state: State) -> None:
    """Written atomically: a crash leaves the old file or the new one, never half. `directory`
    is never created: the daemon checked it at start (`paths.check`), and one gone since is
    said (`state.write_failed`), not silently made again."""
    try:
        replace_atomically(directory / STATE_NAME, state.model_dump_json(indent=1).encode())
    except OSError as exc:
        raise StateError(f"cannot write {directory / STATE_NAME}: {exc.strerror}") from exc


class StateFile:
    """The state file, written whenever what it holds changes. A disk that fails a write is
    logged, not fatal: the engine, not this file, is the truth about what is served. One that
    fails the first read is `StateError` (after retries): starting empty would forget the pin,
    the rollback targets and the rejected versions, and load a known-bad one again."""

    def __init__(self, directory: Path, log: Any) -> None:
        self.directory, self.log = directory, log
        self.saved, aside = load_or_set_aside(directory, log)
        if aside is not None:
            log.error(
                "state.corrupt",
                moved_to=str(aside),
                reason="not valid state: starting from what the engine says",
            )

    def save(self, new: State) -> None:
        if new == self.saved:
            return
        try:
            save(self.directory, new)
        except StateError as exc:
            self.log.error("state.write_failed", reason=str(exc))
            return
        self.saved = new
