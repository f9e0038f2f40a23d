"""What the daemon knows of checkpoints across restarts, kept in the record store.

The engine is the source of truth for what is loaded (`reconcile` in the daemon asks it);
the record store adds what the engine cannot tell: which directory a version came from, the
last good checkpoints to fall back on, which contents were rejected and why, and an
operator's pin, so a restarted daemon neither reloads needlessly nor retries a known-bad
checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from .. import log as log_mod
from ..checkpoint import order
from ..records import NAME, RecordStore


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
    arrival: tuple[int, int] | None = None
    """With no step: its place by arrival (`order.Arrival`), kept with it so what serves keeps
    its place whatever happens to the arrivals' table."""

    def candidate(self, fingerprint: str = "") -> order.Candidate:
        """As a candidate is ordered (content: `fingerprint`, "" when only the order counts)."""
        return order.Candidate(self.name, self.step, fingerprint, arrival=self.arrival)


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


class StateRecords:
    """The checkpoints' facts in the record store (kinds `checkpoint` and `rejected`), written
    whole in one transaction whenever they change: a write the disk failed is written again
    at the next change."""

    def __init__(self, records: RecordStore, log: Any) -> None:
        self.records, self.log = records, log
        self.saved = self._load()

    def _load(self) -> State:
        checkpoint = self.records.all("checkpoint")
        rejected: dict[str, Any] = {}
        for name, value in self.records.all("rejected").items():
            try:
                rejected[name] = Rejection.model_validate(value)
            except ValidationError as exc:
                self._corrupt(f"rejected {name!r}", exc)
        try:
            return State.model_validate({**checkpoint, "rejected": rejected})
        except ValidationError as exc:  # the history and pin: started afresh from the engines
            self._corrupt("checkpoint", exc)
            return State(rejected=rejected)

    def _corrupt(self, what: str, exc: ValidationError) -> None:
        self.log.error(
            "state.corrupt",
            path=str(self.records.path),
            moved_to=None,
            reason=f"{what}: {exc.errors()[0]['msg']}: dropped; starting from what the engine says",
        )

    def save(self, new: State) -> None:
        if new == self.saved:
            return
        facts = new.model_dump(mode="json")
        with self.records.transaction():
            self.records.replace("checkpoint", {key: facts[key] for key in ("serving", "good", "pinned")})
            self.records.replace("rejected", facts["rejected"])
            self.records.ended(lambda committed: self._saved(new, committed))

    def _saved(self, new: State, committed: bool) -> None:
        """Saved only once committed (the transaction it is in may be a caller's)."""
        if committed:
            self.saved = new


def load(directory: Path) -> State:
    """The checkpoints' facts in `directory`'s record store (`State()` when it has none), read
    as they are (while a daemon may be writing)."""
    if not (directory / NAME).exists():
        return State()
    records = RecordStore.reader(directory, log_mod.get())
    try:
        return StateRecords(records, log_mod.get()).saved
    finally:
        records.close()


def save(directory: Path, state: State) -> None:
    """Written into `directory`'s record store (tests, and tools that prepare a host)."""
    records = RecordStore.open(directory, log_mod.get())
    try:
        StateRecords(records, log_mod.get()).save(state)
    finally:
        records.close()
