"""Canary verdicts shared through the object store: a fleet's only shared state.

A canary host whose engine judged a version writes one record per (content, host, verdict):
`<prefix>/<name>/_verdicts/<fingerprint>/<host>.<passed|failed>.json`, with a conditional
create (`If-None-Match: *`). A record is never overwritten, a `failed` never waits behind a
`passed` (its own key), and a record judges exactly one content: the name rewritten with other
bytes has another fingerprint, so another folder. A follower reads a version's folder by its
own LIST and loads it only once `min_canaries` hosts passed it and none failed it; one that
serves a version a canary host fails later goes back from it (`service.fleet`).

Each daemon writes a random instance id (kept in its state dir) into its records: a record
under this host's name written by another instance means two canary hosts share a name
(`verdict.host_conflict`); the name counts once.

No coordinator of our own: this rests on the store's strong read-after-write and
list-after-write consistency (S3 since 2020, GCS, Azure Blob) and on conditional writes being
decided by the store, as lakehouse table formats commit through it.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .. import __version__
from ..config import RolloutConfig
from ..errors import SourceError, StateError
from ..records import RecordStore
from .objstore import Bucket, Object, Unlistable

VERDICTS_DIR = "_verdicts"
FLEET = "checkpoints"
"""This fleet's name in the record store (the adapters' is apart)."""
MAX_RECORD_BYTES = 64 << 10
"""A record is a few hundred bytes; a larger object there is not one of ours (not read)."""
WAITING_FOR_CANARIES = "waiting for canary hosts"
"""How a follower's pending reason starts while canary hosts have not cleared the version
(the metrics tell this wait from one on the checkpoint's files by it)."""
_INSTANCE = re.compile(r"[0-9a-f]{32}")
_FINGERPRINT = re.compile(r"[0-9a-f]{16,128}")


@dataclass(frozen=True)
class Verdict:
    """What this canary host made of one content of a version."""

    name: str
    """The version's name in the store (never a placed directory's `NAME@…`)."""
    version: str
    fingerprint: str
    passed: bool
    reason: str | None = None
    canary: bool = True
    """Whether its canary ran: a pass without one is not recorded (it proves only a load)."""


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str = Field(max_length=1024)
    version: str = Field(max_length=1024)
    fingerprint: str = Field(max_length=128)
    host: str = Field(max_length=255)
    verdict: Literal["passed", "failed"]
    reason: str | None = Field(None, max_length=4096)
    at: float
    daemon_version: str = Field(max_length=64)
    instance: str = Field(max_length=64)
    """The writing daemon's instance id: two canary hosts under one name are told apart by it."""


def folder(name: str, fingerprint: str) -> str:
    """Where the records on one content of `name` live."""
    return f"{name}/{VERDICTS_DIR}/{fingerprint}"


def key(name: str, fingerprint: str, host: str, verdict: str) -> str:
    return f"{folder(name, fingerprint)}/{host}.{verdict}.json"


def is_record(rest: str) -> bool:
    """Whether a key under a checkpoint's prefix (`rest`: the part after `<name>/`) is a verdict
    record (or anything else under `_verdicts/`), not one of the checkpoint's files."""
    return rest.startswith(f"{VERDICTS_DIR}/")


def instance_id(records: RecordStore, fleet: str) -> str:
    """This daemon's instance id for `fleet`, kept in the record store (made once)."""
    key = f"instance:{fleet}"
    found = records.meta(key)
    if found is not None and _INSTANCE.fullmatch(found):
        return found
    new = secrets.token_hex(16)
    records.set_meta(key, new)
    return new


@dataclass(frozen=True)
class Recalled:
    """A follower: a canary host failed a version an engine here serves; go back from it."""

    name: str
    version: str
    fingerprint: str
    reason: str


@dataclass(frozen=True)
class Tally:
    passed: tuple[str, ...] = ()
    """Hosts that recorded the content as passed (each name once)."""
    failed: tuple[tuple[str, str], ...] = ()
    """(host, reason) for each that recorded it as failed."""
    version: str = ""
    """The version the records name."""

    def clearance(self, min_canaries: int) -> tuple[Literal["cleared", "waiting", "failed"], str]:
        """Whether a follower may load the version, and why not."""
        if self.failed:
            host, reason = self.failed[0]
            return "failed", f"canary host {host} failed it: {reason}"
        if len(self.passed) < min_canaries:
            return "waiting", f"{WAITING_FOR_CANARIES}: {len(self.passed)} of {min_canaries} passed"
        return "cleared", f"passed on {', '.join(self.passed)}"


class Reader:
    """Reads records, once per ETag (a record never changes; one that does is read again)."""

    def __init__(self, store: Bucket) -> None:
        self.store = store
        self._read: dict[tuple[str, str | None], Record | None] = {}

    def tally(self, name: str, fingerprint: str, records: Mapping[str, Object]) -> Tally:
        """`records`: the objects under `folder(name, fingerprint)`, by key. A record counts only
        at its own key and for the content it names; one that cannot be read as one counts for
        nothing (a careless writer cannot pass a version; failing one needs a well-formed
        `failed` record)."""
        passed: dict[str, None] = {}
        failed: dict[str, str] = {}
        version = ""
        for object_key, found in sorted(records.items()):
            record = self.record(object_key, found)
            if record is None or (record.name, record.fingerprint) != (name, fingerprint):
                continue
            if object_key != key(name, fingerprint, record.host, record.verdict):
                continue  # not at its own key: a host writing under another's name, or a copy
            version = version or record.version
            if record.verdict == "passed":
                passed[record.host] = None
            else:
                failed.setdefault(record.host, record.reason or "failed")
        return Tally(tuple(passed), tuple(failed.items()), version)

    def record(self, object_key: str, found: Object) -> Record | None:
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


class Fleet:
    """This host's side of the fleet: its verdicts to write (a canary host), the others'
    records to read (a follower). The verdicts wait in the record store's outbox (`fleet`: this
    fleet's name there) until the object store takes them, so a restart or a SIGHUP loses none;
    written and read on the object-store thread only."""

    def __init__(
        self, store: Bucket, rollout: RolloutConfig, log: Any, records: RecordStore, fleet: str = FLEET
    ) -> None:
        self.store, self.rollout, self.log, self.records, self.fleet = store, rollout, log, records, fleet
        self.reader = Reader(store)
        self._lock = threading.Lock()
        self._detached = False
        self.unkept: list[Verdict] = []
        """Verdicts the record store could not take (a full disk): kept here, added again first."""
        self.write_problem: str | None = None
        """Why the store refused the last write (logged once per reason); None while writes work."""
        self._written_since = 0
        self._instance: str | None = None
        self.recalled: set[tuple[str, str]] = set()
        """(name, fingerprint) already told to the loop as failed while served here."""

    @property
    def instance(self) -> str:
        if self._instance is None:
            self._instance = instance_id(self.records, self.fleet)
        return self._instance

    def add(self, verdict: Verdict) -> None:
        """From the loop: a verdict to write, kept in the record store before it is tried (in the
        transaction of the decision it tells, where the caller has one)."""
        with self.records.transaction():
            self.records.outbox_add(self.fleet, asdict(verdict))
            self.records.ended(lambda committed: self._kept(verdict, committed))

    def _kept(self, verdict: Verdict, committed: bool) -> None:
        """One the record store could not take is kept in memory, and added again first."""
        if not committed:
            with self._lock:
                self.unkept.append(verdict)

    def pending(self) -> list[Verdict]:
        """The verdicts not written yet, oldest first."""
        return [verdict for _, verdict in self._queue()]

    def _queue(self) -> list[tuple[int | None, Verdict]]:
        """The verdicts not written yet, oldest first, with their ids in the outbox (None: kept
        in memory only). A record store that cannot be read now gives those in memory."""
        with self._lock:
            unkept = [(None, v) for v in self.unkept]
        try:
            queued = [(row, Verdict(**found)) for row, found in self.records.outbox(self.fleet)]
        except (StateError, TypeError):
            queued = []
        return [*queued, *unkept]

    def detach(self) -> None:
        """A SIGHUP replaced this source: from now on it writes no record (its thread may still
        be stuck in a call); the new one writes what is left in the outbox."""
        self._detached = True

    def write_queued(self, **fields: Any) -> bool:
        """Write every queued verdict, in order; whether none is left. One the store refuses
        stays queued, with those behind it, for the next call. A refusal is the writes' own
        condition, not the source's (a read-only policy on `_verdicts/` leaves listing
        working): `verdict.write_failed` once per reason (with `fields`, e.g. `retry_in_s`),
        then one `verdict.written` once the store took every one of them."""
        with self._lock:
            unkept, self.unkept = self.unkept, []
        for verdict in unkept:  # the record store failed them before: kept there first now
            self.add(verdict)
        while not self._detached and (first := next(iter(self._queue()), None)) is not None:
            row, v = first
            try:
                self._write(v)
            except SourceError as exc:
                self._refused(v, str(exc), **fields)
                return False
            except Exception as exc:  # a verdict no retry can write: dropped, never a crash loop
                why = f"cannot be written: {type(exc).__name__}: {exc}"[:500]
                self.log.error("verdict.write_failed", reason=why, name=v.name, dropped=True)
            if row is None:
                with self._lock:
                    self.unkept.remove(v)
            else:
                done: list[bool] = []
                with self.records.transaction():
                    self.records.outbox_done(row)
                    self.records.ended(done.append)
                if not done[0]:  # written, and still in the outbox: written again later
                    return False
            self._written_since += 1
        if self.write_problem is not None:
            self.log.info("verdict.written", verdicts=self._written_since, previous_reason=self.write_problem)
            self.write_problem = None
        self._written_since = 0
        return True

    def _refused(self, v: Verdict, reason: str, **fields: Any) -> None:
        if reason == self.write_problem:
            return
        self.write_problem = reason
        where = key(v.name, v.fingerprint, self.rollout.host, "passed" if v.passed else "failed")
        self.log.error(
            "verdict.write_failed",
            reason=reason,
            key=where,
            name=v.name,
            version=v.version,
            fingerprint=v.fingerprint,
            queued=len(self.pending()),
            **fields,
        )

    def _write(self, v: Verdict) -> None:
        host = self.rollout.host
        verdict = "passed" if v.passed else "failed"
        fields = {"name": v.name, "version": v.version, "fingerprint": v.fingerprint, "host": host}
        if v.passed and not v.canary:
            reason = "canary disabled: a pass without a canary is not recorded; followers count none"
            self.log.warning("verdict.not_recorded", reason=reason, **fields)
            return
        record = Record(  # cut to the record's bounds: a reason may quote a hostile writer's bytes
            name=v.name[:1024],
            version=v.version[:1024],
            fingerprint=v.fingerprint[:128],
            host=host,
            verdict=verdict,
            reason=v.reason[:4096] if v.reason else None,
            at=time.time(),
            daemon_version=__version__,
            instance=self.instance,
        )
        where = key(v.name, v.fingerprint, host, verdict)
        created = self.store.create(where, record.model_dump_json().encode())  # refused: SourceError
        try:
            other = self._other_instance(v.name, v.fingerprint, host)
        except SourceError:
            other = None  # the folder cannot be listed now: the record is written all the same
        if other is not None:
            self.log.error(
                "verdict.host_conflict",
                reason=f"another canary host writes records as {host!r} (instance {other}, this one "
                f"{self.instance}); records under one name count once",
                fix="set [rollout] host to a name no other canary host uses",
                key=where,
                **fields,
            )
        if created:
            self.log.info("verdict.recorded", verdict=verdict, key=where, **fields)
        elif other is None:
            self.log.info("verdict.exists", key=where, **fields)  # this daemon's, from before a restart

    def _other_instance(self, name: str, fingerprint: str, host: str) -> str | None:
        """The instance id of another daemon that wrote on this content under `host`, if one did."""
        for object_key, found in sorted(self.store.list_under(folder(name, fingerprint)).items()):
            record = self.reader.record(object_key, found)
            if record is None or object_key != key(name, fingerprint, record.host, record.verdict):
                continue
            if record.host == host and record.instance != self.instance:
                return record.instance
        return None

    def tally(self, name: str, fingerprint: str) -> Tally:
        """The records on this content of `name`, read by their own LIST."""
        return self.reader.tally(name, fingerprint, self.store.list_under(folder(name, fingerprint)))

    def clearance(self, name: str, fingerprint: str) -> tuple[Literal["cleared", "waiting", "failed"], str]:
        if not _FINGERPRINT.fullmatch(fingerprint):
            return "waiting", "waiting for a fingerprint of its content"
        try:
            tally = self.tally(name, fingerprint)
        except Unlistable as exc:
            return "waiting", f"the canary hosts' records cannot be listed: {exc}"
        except SourceError as exc:  # one record that lists but cannot be read: nothing decided
            return "waiting", f"the canary hosts' records cannot be read: {exc}"
        return tally.clearance(self.rollout.min_canaries)

    def recalls(self, served: Iterable[tuple[str, str]]) -> list[Recalled]:
        """Of the contents engines here serve ((name, fingerprint)), those a canary host failed
        since: each told once."""
        found = []
        for name, fingerprint in sorted(set(served)):
            if (name, fingerprint) in self.recalled or not _FINGERPRINT.fullmatch(fingerprint):
                continue
            try:
                tally = self.tally(name, fingerprint)
            except SourceError:  # its records cannot be listed or read now: as before, asked again
                continue
            status, why = tally.clearance(self.rollout.min_canaries)
            if status == "failed":
                found.append(Recalled(name, tally.version or name, fingerprint, why))
        self.recalled.update((r.name, r.fingerprint) for r in found)
        return found
