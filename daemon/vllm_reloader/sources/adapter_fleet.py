"""The fleet rules for adapters read from an object store, as for checkpoints (`verdicts`).

Every host that reads one adapter prefix shares its records, under
`<prefix>/<adapter>/_verdicts/<fingerprint>/<host>.<passed|failed>.json`: a canary host
records what its canary engine's canary made of each content (a fingerprint is the digest of
the copy's bytes, the same on every host); any host records a content its canary blamed. A
follower loads only a version `min_canaries` canary hosts passed and none failed, and goes
back from one it serves that a canary host fails later. The records are written and read on
the adapter source's thread, never on the loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from ..checkpoint.adapter import AdapterVersion
from ..config import RolloutConfig
from ..records import RecordStore
from . import verdicts
from .objstore import Bucket
from .verdicts import Verdict

Clearance = Literal["cleared", "waiting", "failed"]
FLEET = "adapters"
"""This fleet's name in the record store (its outbox and instance id; the checkpoints' are apart)."""


@dataclass(frozen=True)
class AdapterRecalled:
    """A follower: a canary host failed a content an engine here holds; go back from it."""

    adapter: str
    version: str
    fingerprint: str
    reason: str


class AdapterFleet:
    def __init__(self, store: Bucket, rollout: RolloutConfig, log: Any, records: RecordStore) -> None:
        self.follower = rollout.role == "follow"
        self.records = verdicts.Fleet(store, rollout, log, records, FLEET)

    def record(self, verdict: Verdict) -> None:
        """From the loop: kept on disk at once, written by the source's thread at its next look."""
        self.records.add(verdict)

    def judged(self, version: AdapterVersion, passed: bool, reason: str | None, *, canary: bool) -> None:
        """From the loop, the canary engine's verdict: a pass told by a canary host only, a
        blamed failure by any host."""
        if not passed or not self.follower:
            self.record(
                Verdict(version.adapter, version.version, version.fingerprint, passed, reason, canary)
            )

    def clearance(self, adapter: str, fingerprint: str) -> tuple[Clearance, str]:
        """Whether this host may load the content: always on a canary host."""
        if not self.follower:
            return "cleared", "a canary host"
        return self.records.clearance(adapter, fingerprint)

    def tend(self, served: Iterable[tuple[str, str]]) -> list[AdapterRecalled]:
        """One look's turn: the verdicts queued written; a follower's recalls of what it serves
        (`served`: (adapter, fingerprint)), each told once."""
        self.records.write_queued()
        if not self.follower:
            return []
        return [
            AdapterRecalled(r.name, r.version, r.fingerprint, r.reason) for r in self.records.recalls(served)
        ]
