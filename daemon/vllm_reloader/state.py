"""What the daemon knows across restarts, in one JSON file written atomically.

The engine is the source of truth for what is loaded (`reconcile` in the daemon asks it);
this file adds what the engine cannot tell: which directory a version came from, the
last good checkpoint to fall back on, and which candidates were rejected and why, so a
restarted daemon neither reloads needlessly nor retries a known-bad checkpoint.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import StateError

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


class Rejection(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: str
    reason: str
    fingerprint: str
    at: float


class State(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    serving: Loaded | None = None
    last_good: Loaded | None = None
    rejected: dict[str, Rejection] = {}
    pinned: str | None = None
    """A checkpoint name an operator pinned: loaded, and no auto-advance until unpinned."""


def load(directory: Path) -> State:
    path = directory / STATE_NAME
    try:
        return State.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return State()
    except OSError as exc:
        raise StateError(f"cannot read {path}: {exc.strerror}") from exc
    except ValidationError as exc:
        raise StateError(f"{path} is corrupt: {exc.errors()[0]['msg']}") from exc


def save(directory: Path, state: State) -> None:
    """Write via temp file + fsync + rename + fsync(dir): a crash leaves old or new, never half."""
    data = state.model_dump_json(indent=1).encode()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".state-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, directory / STATE_NAME)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(directory)
    except OSError as exc:
        raise StateError(f"cannot write {directory / STATE_NAME}: {exc.strerror}") from exc


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
