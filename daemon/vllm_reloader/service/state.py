"""What the daemon knows across restarts, in one JSON file written atomically.

The engine is the source of truth for what is loaded (`reconcile` in the daemon asks it);
this file adds what the engine cannot tell: which directory a version came from, the
last good checkpoint to fall back on, and which candidates were rejected and why, so a
restarted daemon neither reloads needlessly nor retries a known-bad checkpoint.
"""

from __future__ import annotations

import os
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


def load(directory: Path) -> State:
    """The saved state; a file that cannot be parsed is `StateError` (see `load_or_set_aside`)."""
    path = directory / STATE_NAME
    try:
        return State.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return State()
    except OSError as exc:
        raise StateError(f"cannot read {path}: {exc.strerror}") from exc
    except ValidationError as exc:
        raise StateError(f"{path} is corrupt: {exc.errors()[0]['msg']}") from exc


def load_or_set_aside(directory: Path) -> tuple[State, Path | None]:
    """The saved state, or — when the file is corrupt — an empty one, the corrupt file moved
    to `state.json.corrupt-<time>` (returned) so the daemon starts and asks the engine:
    under systemd a daemon that refused to start would restart forever."""
    try:
        return load(directory), None
    except StateError:
        path = directory / STATE_NAME
        if not path.is_file():
            raise
        aside = path.with_name(f"{STATE_NAME}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        try:
            os.replace(path, aside)
        except OSError as exc:
            raise StateError(f"{path} is corrupt and cannot be moved aside: {exc.strerror}") from exc
        return State(), aside


def save(directory: Path, state: State) -> None:
    """Written atomically: a crash leaves the old file or the new one, never half."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        replace_atomically(directory / STATE_NAME, state.model_dump_json(indent=1).encode())
    except OSError as exc:
        raise StateError(f"cannot write {directory / STATE_NAME}: {exc.strerror}") from exc


class StateFile:
    """The state file, written whenever what it holds changes. A disk that fails is logged,
    not fatal: the engine, not this file, is the truth about what is served."""

    def __init__(self, directory: Path, log: Any) -> None:
        self.directory, self.log = directory, log
        self.saved, aside = load_or_set_aside(directory)
        if aside is not None:
            log.error(
                "state.corrupt", moved_to=str(aside), reason="unreadable: starting from what the engine says"
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
