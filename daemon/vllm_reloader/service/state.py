"""What the daemon knows across restarts, in one JSON file written atomically.

The engine is the source of truth for what is loaded (`reconcile` in the daemon asks it);
this file adds what the engine cannot tell: which directory a version came from, the
last good checkpoint to fall back on, and which candidates were rejected and why, so a
restarted daemon neither reloads needlessly nor retries a known-bad checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

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
    """Written atomically: a crash leaves the old file or the new one, never half."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        replace_atomically(directory / STATE_NAME, state.model_dump_json(indent=1).encode())
    except OSError as exc:
        raise StateError(f"cannot write {directory / STATE_NAME}: {exc.strerror}") from exc
