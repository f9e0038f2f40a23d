"""Canary verdicts shared through the object store: a fleet's only shared state.

A canary host whose engine served a version and ran its canary writes
`<prefix>/<name>/_verdicts/<host>.json` (passed or failed, when, by which daemon release) with
a conditional create (`If-None-Match: *`): a record is never overwritten, and a second canary
host's record is its own object. A follower loads a version only once `min_canaries` hosts
recorded it as passed and none as failed. No coordinator of our own: this rests on the store's
strong read-after-write consistency (S3 since 2020, GCS, Azure Blob) and on conditional writes
being decided by the store, as lakehouse table formats commit through it.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .. import __version__
from ..config import RolloutConfig
from ..errors import SourceError
from .objstore import Object, Store

VERDICTS_DIR = "_verdicts"
MAX_RECORD_BYTES = 64 << 10
"""A record is a few hundred bytes; a larger object there is not one of ours (not read)."""


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    verdict: Literal["passed", "failed"]
    host: str = Field(max_length=255)
    version: str = Field(max_length=1024)
    at: float
    daemon_version: str = Field(max_length=64)
    reason: str | None = Field(None, max_length=4096)


def key(name: str, host: str) -> str:
    return f"{name}/{VERDICTS_DIR}/{host}.json"


def is_record(rest: str) -> bool:
    """Whether a key under a checkpoint's prefix (`rest`: the part after `<name>/`) is a verdict
    record, not one of the checkpoint's files."""
    return rest.startswith(f"{VERDICTS_DIR}/")


def write(store: Store, name: str, *, host: str, version: str, passed: bool, reason: str | None) -> bool:
    """This host's record for `name`; False when it already has one (kept as it is)."""
    record = Record(
        verdict="passed" if passed else "failed",
        host=host,
        version=version,
        at=time.time(),
        daemon_version=__version__,
        reason=reason,
    )
    return store.create(key(name, host), record.model_dump_json().encode())


@dataclass(frozen=True)
class Tally:
    passed: tuple[str, ...] = ()
    """Hosts that recorded the version as passed."""
    failed: tuple[tuple[str, str], ...] = ()
    """(host, reason) for each that recorded it as failed."""

    def clearance(self, min_canaries: int) -> tuple[Literal["cleared", "waiting", "failed"], str]:
        """Whether a follower may load the version, and why not."""
        if self.failed:
            host, reason = self.failed[0]
            return "failed", f"canary host {host} failed it: {reason}"
        if len(self.passed) < min_canaries:
            return "waiting", f"waiting for canary hosts: {len(self.passed)} of {min_canaries} passed"
        return "cleared", f"passed on {', '.join(self.passed)}"


class Reader:
    """Reads the records under each checkpoint, once per ETag (a record never changes; one that
    does is read again)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._read: dict[tuple[str, str | None], Record | None] = {}

    def tally(self, name: str, records: Mapping[str, Object]) -> Tally:
        """`records`: the objects under `<name>/_verdicts/`, by key relative to `<name>/`. A
        record that cannot be read as one counts for nothing (a hostile or careless writer
        cannot pass a version; failing one needs a well-formed `failed` record)."""
        passed: list[str] = []
        failed: list[tuple[str, str]] = []
        for rest, found in sorted(records.items()):
            record = self._record(f"{name}/{rest}", found)
            if record is None or f"{VERDICTS_DIR}/{record.host}.json" != rest:
                continue  # not ours, or a host writing under another's name
            if record.verdict == "passed":
                passed.append(record.host)
            else:
                failed.append((record.host, record.reason or "failed"))
        return Tally(tuple(passed), tuple(failed))

    def _record(self, object_key: str, found: Object) -> Record | None:
        cached = (object_key, found.etag)
        if cached not in self._read:
            record = None
            if found.size <= MAX_RECORD_BYTES:
                try:
                    record = Record.model_validate_json(self.store.get(object_key)[0])
                except ValidationError:
                    record = None
            self._read[cached] = record
        return self._read[cached]


@dataclass(frozen=True)
class Verdict:
    """What this canary host's engine made of a version."""

    name: str
    version: str
    passed: bool
    reason: str | None = None


class Fleet:
    """This host's side of the fleet: its verdicts to write (a canary host), the others'
    records to read (a follower). Used on the object-store thread only."""

    def __init__(self, store: Store, rollout: RolloutConfig, log: Any) -> None:
        self.store, self.rollout, self.log = store, rollout, log
        self.reader = Reader(store)
        self.queued: queue.SimpleQueue[Verdict] = queue.SimpleQueue()

    def write_queued(self) -> None:
        """Write every queued verdict; one the store refuses stays queued (SourceError)."""
        host = self.rollout.host
        while not self.queued.empty():
            v = self.queued.get()
            try:
                created = write(
                    self.store, v.name, host=host, version=v.version, passed=v.passed, reason=v.reason
                )
            except SourceError:
                self.queued.put(v)
                raise
            fields = {"name": v.name, "version": v.version, "host": host, "key": key(v.name, host)}
            if created:
                self.log.info("verdict.recorded", verdict="passed" if v.passed else "failed", **fields)
            else:
                self.log.info("verdict.exists", **fields)  # recorded before (a restart): kept as it was

    def clearance(
        self, name: str, records: Mapping[str, Object]
    ) -> tuple[Literal["cleared", "waiting", "failed"], str]:
        return self.reader.tally(name, records).clearance(self.rollout.min_canaries)
