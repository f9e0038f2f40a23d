"""An object-store prefix as a checkpoint source: list, judge, download into the local root.

An object store can only be polled. Each poll LISTs the prefix once and GETs a
checkpoint's completing object (our manifest, an HF index, a marker) only when its ETag
changed. Its objects are then judged by the local gate's `completeness.describe`, through
a `BucketListing` (shard headers by two small ranged GETs, once per ETag): pending (not all
uploaded yet, or short), rejected (an unsafe path, a shard longer than listed, bytes that
fail their digest while downloading), or ready: download the newest one newer than the one
serving, into the checkpoint root, where the local watcher and gate take over.

A listed object is whole (a multipart upload is invisible until it completes), so a
manifest or index that is not JSON gets no grace: it is rejected at once (on a shared root,
`file://`, after `manifest_grace`, as in a local root). This runs on its
own thread (a download takes minutes); rejections and finished downloads go to the main
loop's inbox like any other event.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import log
from ..checkpoint import completeness, conventions, order, verified
from ..checkpoint.completeness import MAX_LISTING_BYTES, Incomplete, Listed
from ..checkpoint.files import SINGLE_NAME
from ..checkpoint.manifest import Manifest
from ..config import Config
from ..errors import Cancelled, DownloadError, KeyUnreadable, SourceError
from ..records import RecordStore
from ..threads import LoopWorker
from . import cache, local, verdicts
from .arrivals import Arrivals
from .content import SOURCE_HOLDER, ContentStore
from .download import Fetched, Plan, fetch, remember
from .filestore import open_store
from .listing import BucketListing, HeaderSizes, by_head, convention_of, judge
from .objstore import Bucket, Object


@dataclass(frozen=True)
class Downloaded:
    """A checkpoint was placed in the checkpoint root: gate it now."""

    name: str
    """Its directory there (`NAME@<fingerprint>`)."""


@dataclass(frozen=True)
class Rejected:
    """Judged bad before or while downloading; the state keeps it like a gate rejection."""

    name: str
    version: str
    reason: str
    fingerprint: str
    check: str


SourceEvent = Downloaded | Rejected | verdicts.Recalled


@dataclass(frozen=True)
class Seen:
    """A checkpoint's completing object as last fetched (never fetched: a single
    `model.safetensors`, whose bytes are the weights), and how it orders now."""

    signal: str
    etag: str | None
    data: bytes
    candidate: order.Candidate
    problem: str = ""
    """Why it can never load, known before anything is read (a completing object too large to
    be one): rejected once, by a fingerprint of the object's size and ETag."""

    @property
    def fingerprint(self) -> str:
        return self.candidate.fingerprint


class RemoteSource(LoopWorker):
    """Polls `[source] path` and downloads into `config.checkpoint_root`."""

    def __init__(
        self,
        config: Config,
        *,
        serving: Callable[[], order.Serving],
        rejected: Callable[[], Mapping[str, Collection[str]]],
        post: Callable[[SourceEvent], None],
        records: RecordStore,
        arrivals: Arrivals,
        store: Bucket | None = None,
        verified_files: verified.Cache | None = None,
        serves: Callable[[], Iterable[tuple[str, str]]] = tuple,
    ) -> None:
        """`verified_files`: where the digests checked while downloading are kept, by the
        placed files' identities, so the local gate does not hash them again. `serves`: what
        the engines here serve, as (name, fingerprint): a follower goes back from one a canary
        host fails later. `arrivals`: when each step-less version arrived (the daemon's one
        table: its placed copy in the root orders as it does here)."""
        super().__init__("remote-source", config.source.interval)
        self.config, self.serving, self.rejected, self.post = config, serving, rejected, post
        self.serves = serves
        self.arrivals = arrivals
        self.listed, self.source_id = False, str(config.source.path)
        """A listing was read: step-less versions new after it arrived (`sources.arrivals`)."""
        self.verified_files = verified_files
        self.store = store or open_store(config.source.path, endpoint_url=config.source.endpoint_url)
        # Made once, at start (the state dir exists: its lock is held); a download makes its own
        # directory inside, never this or its parents: a state dir deleted meanwhile stays gone.
        self.staging_root.mkdir(parents=True, exist_ok=True)
        self.log = log.get()
        self.seen: dict[str, Seen] = {}
        self.pending: dict[str, str] = {}
        self.unsignalled: dict[str, str] = {}  # nothing says they are complete yet: why
        self.rejected_here: dict[str, set[str]] = {}
        self.convention = convention_of(config.source)
        self.headers = HeaderSizes(self.store, config.gate.max_tensors)
        self.bad_keys: dict[str, str] = {}
        """Checkpoints whose listing hit a key obstore cannot represent (logged once each)."""
        self.problems: dict[str, str] = {}
        """What is failing now, by kind ("source", "download"), in the store's words (`status`)."""
        self.said: dict[str, str] = {}  # ...and its one-line reason, logged once, not per poll
        self.fleet = verdicts.Fleet(self.store, config.rollout, self.log, records)
        self.content = ContentStore(records, self.log)

    @property
    def staging_root(self) -> Path:
        return self.config.cache_dir / "staging"

    def turn(self) -> None:
        try:
            # A refused write is logged by the fleet as its own condition: the listing may
            # work all the while (a read-only policy on `_verdicts/`), so no `source.failed`.
            self.fleet.write_queued(retry_in_s=self.config.source.interval)
            self.poll()
        except Exception:
            # A bug, not a store failure: say so; the watchdog pings stop and systemd restarts us.
            self.log.exception("source.crashed", source=self.config.source.path)
            raise

    def record(self, verdict: verdicts.Verdict) -> None:
        """A canary host's verdict on a version, written by this thread (called from the loop)."""
        self.fleet.add(verdict)
        self.poke()

    def _cleared(self, name: str, seen: Seen, waiting: dict[str, str]) -> bool:
        """A follower: whether the canary hosts' records let this version load (else it waits,
        or is rejected when one failed it)."""
        if self.config.rollout.role != "follow":
            return True
        status, why = self.fleet.clearance(name, seen.fingerprint)
        if status == "failed":
            self._reject(name, None, Incomplete("rejected", why, seen.fingerprint, "canary"))
        elif status == "waiting":
            self._waiting(name, why, waiting)
        return status == "cleared"

    def _waiting(self, name: str, reason: str, waiting: dict[str, str]) -> None:
        """Pending for `reason`: logged when the reason is new, not at every poll."""
        waiting[name] = reason
        if self.pending.get(name) != reason:
            self.log.info("checkpoint.pending", name=name, reason=reason, remote=True)

    def _report(self, kind: str, exc: Exception, **fields: Any) -> None:
        """Said once per reason (stable across retries); `status` shows the store's own words."""
        if self.said.get(kind) != (reason := str(exc)):
            self.log.error(f"{kind}.failed", source=self.config.source.path, reason=reason, **fields)
        self.said[kind], self.problems[kind] = reason, getattr(exc, "detail", reason)

    def _clear(self, kind: str) -> None:
        if self.said.pop(kind, None) is not None:
            self.problems.pop(kind, None)
            self.log.info(f"{kind}.recovered", source=self.config.source.path)

    def poll(self) -> None:
        """One round: LIST, refresh changed completing objects, judge, download the newest ready one."""
        try:
            listing, unlisted = self.store.list(self._ignored)
            by_name: dict[str, dict[str, Object]] = {}
            for key, found in listing.items():
                name, _, rest = key.partition("/")
                ours = rest and not verdicts.is_record(rest)  # records are not a checkpoint's files
                if ours and not self._ignored(name):
                    by_name.setdefault(name, {})[rest] = found
            self.bad_keys = {n: p for n, p in self.bad_keys.items() if n in unlisted}  # said again if back
            for name, problem in unlisted.items():
                if not self._ignored(name):
                    by_name[name] = self._objects_by_head(name, problem)
            self._refresh({name: objects for name, objects in by_name.items() if objects})
            if not self.listed:
                self.listed = True
                self.arrivals.started(self.source_id)
            if self.config.rollout.role == "follow":  # what serves here, failed by a canary host since
                for recalled in self.fleet.recalls(self.serves()):
                    self.post(recalled)
        except SourceError as exc:
            self._report("source", exc, retry_in_s=self.config.source.interval)
            return
        placed = cache.placed(self.config.checkpoint_root, self.convention)
        candidates = {
            name: seen.candidate
            for name, seen in self.seen.items()
            if not any(seen.fingerprint.startswith(fp) for fp in placed.get(name, ()) if fp)
        }
        cache.clean_staging(
            self.staging_root, {order.placed_name(n, self.seen[n].fingerprint) for n in candidates}
        )
        waiting: dict[str, str] = {}
        for candidate in order.to_try(candidates, serving=self.serving(), rejected=self._rejected()):
            name = candidate.name
            seen = self.seen[name]
            if own := self._own_problem(name, seen):
                problem, check = own
                self._reject(name, None, Incomplete("rejected", problem, seen.fingerprint, check))
                continue  # rejected once; the next one may load
            bucket = self._listing(name, by_name[name], seen.signal, seen.data)
            try:
                if not self._cleared(name, seen, waiting):
                    continue
                listed = completeness.describe(bucket, self.convention, time.time())
            except KeyUnreadable as exc:  # one file of a shared root: this version waits, not all
                self._waiting(name, str(exc), waiting)
                continue
            except SourceError as exc:
                self._report("source", exc, retry_in_s=self.config.source.interval)
                return
            verdict = listed if isinstance(listed, Incomplete) else judge(listed, bucket)
            if verdict is None:
                assert isinstance(listed, Listed)
                if (unreadable := self._download(name, listed, by_name[name])) is None:
                    break
                self._waiting(name, unreadable, waiting)
                continue
            if verdict.status == "pending":
                self._waiting(name, verdict.reason, waiting)
            else:
                manifest = None if isinstance(listed, Incomplete) else listed.manifest
                self._reject(name, manifest, verdict)
        unsignalled = self._arrived({n: order.Candidate(n, None, "") for n in self.unsignalled})  # one look
        for name, reason in self.unsignalled.items():  # what would load next, once complete
            if self.serving().replaced_by(unsignalled[name]):
                self._waiting(name, reason, waiting)
        self.pending = waiting
        self._clear("source")  # the whole round read what it needed (a failed header read is no recovery)

    def _ignored(self, name: str) -> bool:
        return local.is_ignored(name, self.config.source.ignore)

    def _rejected(self) -> dict[str, set[str]]:
        theirs, here = self.rejected(), self.rejected_here  # the loop's, and this thread's
        return {name: {*theirs.get(name, ()), *here.get(name, ())} for name in {*theirs, *here}}

    def _own_problem(self, name: str, seen: Seen) -> tuple[str, str] | None:
        """Why this candidate can never be placed, whatever a retry does, and the check that
        says so (`local`: this host's filesystem only, no verdict for the fleet): not one that
        holds older good versions back at every poll."""
        if seen.problem:
            return seen.problem, "manifest"
        if order.split_placed(name)[1]:
            return "name ends in @ and 16 hex digits, as the cache names its downloads: rename it", "paths"
        if problem := local.unusable_name(name):
            return problem, "paths"
        directory = order.placed_name(name, seen.fingerprint)
        if problem := local.name_too_long(self.config.checkpoint_root, directory):
            return problem, "local"
        return None

    def _objects_by_head(self, name: str, problem: str) -> dict[str, Object]:
        """A checkpoint whose listing failed on an odd key: with our manifest, what it lists
        is found by HEAD, and the odd key is never looked at; a foreign writer's checkpoint,
        whose files only a listing names, waits (logged once per problem). A name that is not
        UTF-8 (a shared root's) is never a version's: nothing more is read."""
        if self.bad_keys.get(name) != problem:
            self.bad_keys[name] = problem
            self.log.warning("source.bad_key", name=name, reason=problem)
        wanted = self.convention.mode in ("manifest", "auto") and local.unusable_name(name) is None
        return by_head(self.store, name) if wanted else {}

    def _listing(self, name: str, objects: Mapping[str, Object], signal: str, data: bytes) -> BucketListing:
        return self.headers.listing(name, objects, {} if signal == SINGLE_NAME else {signal: data})

    def _refresh(self, by_name: Mapping[str, Mapping[str, Object]]) -> None:
        """GET each completing object whose ETag changed (a single model.safetensors: never),
        then work out how each checkpoint orders."""
        for name in set(self.seen) - set(by_name):
            del self.seen[name]
        self.unsignalled = {}
        for name, objects in by_name.items():
            top = [k for k in objects if "/" not in k]
            signal = conventions.signal_name(top, self.convention)
            if signal is None:
                self.seen.pop(name, None)
                self.unsignalled[name] = conventions.unsignalled_reason(top, self.convention)
                continue
            listed, known = objects[signal], self.seen.get(name)
            if known is None:
                self.log.info("checkpoint.seen", name=name, path=f"{self.config.source.path}/{name}")
            if signal != SINGLE_NAME and listed.size > MAX_LISTING_BYTES:  # never read whole
                problem = f"{signal} has {listed.size} bytes; more than {MAX_LISTING_BYTES} is not one"
                fp = completeness.fingerprint_of(f"{signal}\0{listed.size}\0{listed.etag}".encode())
                self.seen[name] = Seen(signal, listed.etag, b"", order.Candidate(name, None, fp), problem)
                continue
            if known is not None and known.signal == signal and known.etag == listed.etag is not None:
                data, etag = known.data, known.etag
            elif signal == SINGLE_NAME:
                data, etag = b"", listed.etag
            else:
                try:
                    data, etag = self.store.get(f"{name}/{signal}")
                except KeyUnreadable as exc:
                    self.seen.pop(name, None)
                    self.unsignalled[name] = str(exc)
                    continue
            listing = self._listing(name, objects, signal, data)
            self.seen[name] = Seen(signal, etag, data, completeness.candidate(name, listing, self.convention))
        for name, candidate in self._arrived({n: s.candidate for n, s in self.seen.items()}).items():
            self.seen[name] = dataclasses.replace(self.seen[name], candidate=candidate)

    def _arrived(self, batch: Mapping[str, order.Candidate]) -> dict[str, order.Candidate]:
        """The step-less ones of one listing, with their arrivals (`order.floor_of` the rest)."""
        known = [*(s.candidate for s in self.seen.values()), *batch.values()]
        floor = order.floor_of(known, self.serving().key, self._rejected())
        return self.arrivals.place(self.source_id, batch.values(), floor=floor, first=not self.listed)

    def _reject(self, name: str, manifest: Manifest | None, verdict: Incomplete) -> None:
        fp = verdict.fingerprint or self.seen[name].fingerprint
        self.rejected_here.setdefault(order.base_name(name), set()).add(fp)  # as `to_try` looks it up
        version = (manifest.version if manifest else None) or name
        self.post(Rejected(name, version, verdict.reason, fp, verdict.check))

    def _download(self, name: str, listed: Listed, objects: Mapping[str, Object]) -> str | None:
        """Placed, failing or stopped: None. A file of it that cannot be read here (a shared
        root's): why, and the next version may load meanwhile."""
        seen = self.seen[name]
        files = Manifest(format_version=1, files=listed.manifest.files + listed.extras)
        plan = Plan(
            self.config.source.download_concurrency,
            self.config.source.part_size,
            self.config.state.min_free_bytes,
            self.config.gate.check_finite,
        )
        self.log.info("download.started", name=name, bytes=files.total_bytes, files=len(files.files))
        try:
            fetched: Fetched = fetch(
                self.store,
                name,
                None if seen.signal == SINGLE_NAME else (seen.signal, seen.data),
                files,
                {e.path: objects[e.path] for e in files.files},
                staging_root=self.staging_root,
                root=self.config.checkpoint_root,
                plan=plan,
                stop=self.stop,
                place_as=order.placed_name(name, seen.fingerprint),
            )
        except Cancelled:
            return None
        except KeyUnreadable as exc:
            return str(exc)
        except DownloadError as exc:
            if isinstance(exc.__cause__, OSError) and exc.__cause__.errno in local.OWN_ERRNOS:
                own = Incomplete(
                    "rejected", str(exc), listed.fingerprint, local.OWN_ERRNOS[exc.__cause__.errno]
                )
                self._reject(name, listed.manifest, own)
                return None  # its own names or paths: no retry fixes it
            self._report("download", exc, name=name, retry_in_s=self.config.source.interval)
            return None
        except SourceError as exc:
            self._report("download", exc, name=name, retry_in_s=self.config.source.interval)
            return None
        self._clear("download")
        if fetched.rejected:
            self._reject(
                name, listed.manifest, Incomplete("rejected", fetched.rejected, listed.fingerprint, "digests")
            )
            return None
        if seen.signal == SINGLE_NAME and fetched.path is not None:
            cache.backdate(fetched.path, max(o.modified for o in objects.values()))
        if fetched.path is not None:
            with self.content.records.transaction():  # held until the loop has seen it
                self.content.made(fetched.path, "download")
                self.content.hold(f"{SOURCE_HOLDER}remote", [fetched.path])
            remember(self.verified_files, fetched)
        self.log.info(
            "download.finished",
            name=name,
            bytes=fetched.fetched_bytes,
            reused_bytes=fetched.reused_bytes,
            seconds=round(fetched.seconds, 3),
            mb_per_s=round(fetched.fetched_bytes / fetched.seconds / 1e6, 1) if fetched.seconds else None,
        )
        self.post(Downloaded(fetched.path.name if fetched.path else name))
        return None
