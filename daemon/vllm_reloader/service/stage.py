"""A stage node's daemon (`[node] role = "stage"`): beside a headless node of a multi-node
engine, it never talks to an engine. It downloads each new version from the object store into
the same path the leading daemon uses (`<cache>/checkpoints/NAME@fp`), gates it with every
check that needs no engine (digests, headers, paths, NaN/Inf), and marks it as verified beside
the copy (`sources.content.mark_staged`): what each rank of the engine on this node reads
before it loads (`extension.ReloadExtension.reloader_staged`).

Kept here: whatever the engine may still load or go back to, read from the leader's verdicts in
the store (`stage_holds`): the newest version the leader passed, every version newer than that
it has not failed, the `[state] keep` newest. While the leader's verdicts cannot be read,
nothing is collected.

The same loop as the daemon's, smaller: the source, the gate and the verdict reader only
enqueue; the loop acts (`match`), marks, declares its leases and runs the content store's
collector, and keeps systemd informed.
"""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .. import log
from ..checkpoint import completeness, gate, order
from ..checkpoint.completeness import DirectoryListing
from ..checkpoint.files import Identity
from ..checkpoint.staged import read_staged, staged_marker, staged_problem
from ..config import Config
from ..errors import SourceError, StateError
from ..records import RecordStore
from ..sources import local, verdicts
from ..sources.arrivals import Arrivals
from ..sources.content import SOURCE_HOLDER, ContentStore, mark_staged
from ..sources.filestore import open_store
from ..sources.remote import Downloaded, Rejected, RemoteSource
from ..threads import LoopWorker, take_all
from . import paths
from .gating import GateFinished, Gater
from .messages import SignalReceived
from .notify import Notifier

HOLDER = "stage"
LOCAL_FAULTS = frozenset({"digests", "io", "internal"})
"""A placed copy's own bytes failing (the download checked the store's): fetched again, not rejected."""
REJECTED = "stage_rejected"
"""The record store's facts kind: each name's contents rejected here (never downloaded again)."""


@dataclass(frozen=True)
class LeaderSaid:
    """The leader's verdicts on the contents staged here (fingerprint → passed or failed);
    None: they could not be read (nothing is collected then)."""

    verdicts: Mapping[str, str] | None


@dataclass(frozen=True)
class Copy:
    """A copy staged here: verified, marked, in the order as the source lists it."""

    directory: str
    candidate: order.Candidate
    files: Mapping[str, Identity]
    """Each file as this daemon verified it: the marker must still say the same."""


def stage_holds(staged: Iterable[Copy], leader: Mapping[str, str] | None, keep: int) -> set[str]:
    """The staged copies (directories) the engine may still load or go back to: the newest the
    leader passed (its last good), every newer one it did not fail (what it loads next), and
    the `keep` newest it did not fail. The leader's verdicts unknown: all of them."""
    copies = sorted(staged, key=lambda c: c.candidate.key)
    if leader is None:
        return {c.directory for c in copies}
    alive = [c for c in copies if leader.get(c.candidate.fingerprint) != "failed"]
    passed = [c for c in alive if leader.get(c.candidate.fingerprint) == "passed"]
    held = {c.directory for c in alive[-keep:]} if keep > 0 else set()
    if not passed:
        return held | {c.directory for c in alive}
    good = passed[-1]
    return held | {good.directory} | {c.directory for c in alive if c.candidate.key > good.candidate.key}


class LeaderVerdicts(LoopWorker):
    """Reads the leader's records on the contents staged here, off the loop (a LIST each)."""

    def __init__(
        self, config: Config, staged: Callable[[], tuple[Copy, ...]], post: Callable[[LeaderSaid], None]
    ) -> None:
        super().__init__("leader-verdicts", config.source.interval)
        self.store = open_store(config.source.path, endpoint_url=config.source.endpoint_url)
        self.reader = verdicts.Reader(self.store)
        self.leader, self.staged, self.post = config.node.leader or "", staged, post

    def turn(self) -> None:
        found: dict[str, str] = {}
        try:
            for copy in self.staged():
                name, fingerprint = order.base_name(copy.directory), copy.candidate.fingerprint
                listed = self.store.list_under(verdicts.folder(name, fingerprint))
                tally = self.reader.tally(name, fingerprint, listed)
                if any(host == self.leader for host, _ in tally.failed):
                    found[fingerprint] = "failed"
                elif self.leader in tally.passed:
                    found[fingerprint] = "passed"
        except SourceError:
            self.post(LeaderSaid(None))
            return
        self.post(LeaderSaid(found))


class Stage:
    def __init__(self, config: Config, *, notifier: Notifier | None = None) -> None:
        self.config, self.log = config, log.get()
        self.inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.notifier = notifier or Notifier()
        paths.check(config)
        self.records = RecordStore.open(config.state.dir, self.log)
        self.content = ContentStore(self.records, self.log)
        self.content.forget_holders()
        self.content.adopt(config.checkpoint_root, "*", "download")
        self.options = gate.GateOptions.from_config(config)
        self.staged: dict[str, Copy] = {}
        self.snapshot: tuple[Copy, ...] = ()
        """`staged`, as the other threads read it (replaced whole, never changed)."""
        self.rejected: dict[str, frozenset[str]] = {
            name: frozenset(fps) for name, fps in self.records.all(REJECTED).items() if isinstance(fps, list)
        }
        self.leader: Mapping[str, str] | None = None
        self.gating: set[str] = set()
        self.dropped: set[str] = set()
        """Copies whose bytes failed here (not their content's fault): let go, fetched again."""
        self.gater = Gater(self.inbox.put, config.gate.digest_threads)
        self.remote = RemoteSource(
            config,
            serving=self._serving,
            rejected=self._rejected,
            post=self.inbox.put,
            records=self.records,
            arrivals=Arrivals(self.records),
            verified_files=self.gater.cache,
        )
        self.verdicts = LeaderVerdicts(config, lambda: self.snapshot, self.inbox.put)
        self.exit_code = 0

    def install_signal_handlers(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda signo, _frame: self.inbox.put(SignalReceived(signo)))

    def _serving(self) -> order.Serving:
        """What a download must be newer than: the newest copy staged here."""
        newest = max(self.snapshot, key=lambda c: c.candidate.key, default=None)
        if newest is None:
            return order.NOTHING
        return order.Serving(newest.candidate.key, newest.directory, newest.candidate.fingerprint)

    def _rejected(self) -> Mapping[str, frozenset[str]]:
        """Rejected here, and failed by the leader (`LeaderSaid`): never downloaded (again).
        Read by the object-store thread: the mapping is replaced whole, never changed."""
        return self.rejected

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        self.gater.start()
        self.remote.start()
        self.verdicts.start()
        self.log.info(
            "daemon.started", role="stage", source=self.config.source.path,
            root=str(self.config.checkpoint_root), leader=self.config.node.leader,
            node=self.config.rollout.host,
        )  # fmt: skip
        try:
            self._rescan()
            self.notifier.ready(self._status())
            while not self.stop.is_set():
                if (dead := self._dead()) is not None:
                    self.log.error(
                        "daemon.thread_died", thread=dead, action="exiting 1; systemd restarts the daemon"
                    )
                    self.exit_code = 1
                    break
                self._recheck()
                self._collect()
                self.notifier.status(self._status())
                self.notifier.watchdog()
                self._wait()
        except Exception:
            self.log.exception("daemon.crashed")
            self.exit_code = 1
        finally:
            for helper in (self.remote, self.verdicts, self.gater):
                helper.close()
            self.records.close()
            self.log.info("daemon.stopped", exit_code=self.exit_code, role="stage")
        return self.exit_code

    def _dead(self) -> str | None:
        helpers = {"object store": self.remote, "leader verdicts": self.verdicts, "gate": self.gater}
        return next((name for name, helper in helpers.items() if not helper.is_alive()), None)

    def _wait(self) -> None:
        timeout = min(self.config.source.interval, self.notifier.watchdog_interval or 60.0)
        for message in take_all(self.inbox, timeout):
            self._dispatch(message)

    def _dispatch(self, message: object) -> None:
        match message:
            case Downloaded(name):  # from now on held as unjudged, then by what it is (`_collect`)
                self._gate(name)
                self.content.hold(f"{SOURCE_HOLDER}remote", ())
            case Rejected(name, version, reason, fingerprint, check):
                self._reject(name, version, reason, fingerprint, check)
            case GateFinished(gating, verdict):
                self._gated(gating.candidate, gating.directory, verdict)
            case LeaderSaid(found):
                self.leader = found
                for copy in self.snapshot:  # never downloaded again, once collected
                    if (found or {}).get(copy.candidate.fingerprint) == "failed":
                        self._remember_rejected(copy.directory, copy.candidate.fingerprint)
            case SignalReceived(signum) if signum != signal.SIGHUP:
                self.notifier.stopping()
                self.stop.set()
            case SignalReceived():
                self.log.info(
                    "config.reload_ignored", reason="a stage node reads its config at start: restart it"
                )
            case _:
                self.log.error("inbox.unknown", message=repr(message)[:200])

    # -- what is staged ---------------------------------------------------------------------

    def _rescan(self) -> None:
        """At start: a copy still marked and unchanged is staged; any other copy is gated."""
        for directory in sorted(local.list_candidates(self.config.checkpoint_root, ())):
            copy = self.config.checkpoint_root / directory
            try:
                marked = read_staged(copy)
            except (OSError, ValueError):
                self._gate(directory)
                continue
            _, problem = staged_problem(copy, marked.fingerprint)
            candidate = self._candidate(directory)
            if problem is None and candidate.fingerprint == marked.fingerprint:
                self._add(directory, candidate, marked.files)
            else:
                self._gate(directory)

    def _candidate(self, directory: str) -> order.Candidate:
        listing = DirectoryListing(self.config.checkpoint_root / directory)
        found = completeness.candidate(directory, listing, self.options.convention)
        return order.Candidate(
            found.name,
            found.step,
            found.fingerprint,
            arrival=self.remote.arrivals.of(self.remote.source_id, directory),
        )

    def _gate(self, directory: str) -> None:
        if directory in self.gating:
            return
        self.gating.add(directory)
        self.gater.submit(
            self._candidate(directory), self.config.checkpoint_root / directory, None, self.options
        )

    def _gated(self, candidate: order.Candidate, directory: Path, verdict: gate.Verdict) -> None:
        self.gating.discard(directory.name)
        if verdict.status == "pending":  # a placed download is whole: a writer at our cache
            self.log.warning("checkpoint.pending", name=directory.name, reason=verdict.reason)
            return
        check = str(verdict.details.get("check", ""))
        if verdict.status == "rejected" and check in LOCAL_FAULTS:
            self._unstage(directory.name, verdict.reason, "dropped: it is downloaded again")
            return
        if verdict.status == "rejected":
            version = verdict.manifest.version if verdict.manifest else None
            self._reject(
                directory.name, version or directory.name, verdict.reason, verdict.fingerprint, check
            )
            return
        try:
            mark_staged(directory, self.config.rollout.host, verdict.fingerprint, verdict.files)
        except OSError as exc:
            where = staged_marker(directory).parent
            why = f"cannot mark it as verified in {where}: {exc.strerror or exc}"
            self.log.error("node.stage_failed", name=directory.name, reason=why)
            return
        self._add(directory.name, candidate, verdict.files)
        self.log.info(
            "node.staged", name=directory.name, fingerprint=verdict.fingerprint, bytes=verdict.bytes,
            node=self.config.rollout.host,
        )  # fmt: skip

    def _recheck(self) -> None:
        """A staged copy that changed since it was verified (a disk, a careless hand) is no longer
        staged: its marker goes at once, and it is gated again (bytes that fail their digests
        are dropped and downloaded again)."""
        for directory, copy in list(self.staged.items()):
            marked, problem = staged_problem(
                self.config.checkpoint_root / directory, copy.candidate.fingerprint
            )
            if problem is None and marked is not None and marked.files != dict(copy.files):
                problem = f"{staged_marker(self.config.checkpoint_root / directory)} was rewritten"
            if problem is not None:
                self._unstage(directory, problem, "gated again")
                self._gate(directory)

    def _unstage(self, directory: str, reason: str, action: str) -> None:
        copy = self.config.checkpoint_root / directory
        try:
            staged_marker(copy).unlink(missing_ok=True)
        except OSError as exc:
            reason = f"{reason}; its marker could not be removed: {exc}"
        if self.staged.pop(directory, None) is not None:
            self.snapshot = tuple(self.staged.values())
        if action.startswith("dropped"):
            self.dropped.add(directory)
        self.log.warning("node.unstaged", name=directory, reason=reason, action=action)

    def _add(self, directory: str, candidate: order.Candidate, files: Mapping[str, Identity]) -> None:
        self.staged[directory] = Copy(directory, candidate, dict(files))
        self.snapshot = tuple(self.staged.values())
        self.verdicts.poke()

    def _reject(self, name: str, version: str, reason: str, fingerprint: str, check: str) -> None:
        self._remember_rejected(name, fingerprint)
        self.log.warning("checkpoint.rejected", name=name, version=version, reason=reason, check=check)

    def _remember_rejected(self, name: str, fingerprint: str) -> None:
        base = order.base_name(name)
        if fingerprint in self.rejected.get(base, ()):
            return
        fps = self.rejected.get(base, frozenset()) | {fingerprint}
        self.rejected = {**self.rejected, base: fps}
        try:
            self.records.put(REJECTED, base, sorted(fps))
        except StateError as exc:  # kept in memory; written again with the next rejection of the name
            self.log.warning("state.write_failed", reason=str(exc))

    def _collect(self) -> None:
        """Hold what the engine may still need (and every copy not judged yet); collect the rest."""
        keep = stage_holds(self.staged.values(), self.leader, self.config.state.keep)
        root = self.config.checkpoint_root
        listed = local.list_candidates(root, ())
        self.dropped &= listed
        judged = {*self.staged, *self.dropped}
        unjudged = {d for d in listed if d not in judged and not self._is_rejected(d)}
        self.content.declare({HOLDER: [str(root / d) for d in keep | unjudged | self.gating]})
        for _kind, path in self.content.collect():
            gone = Path(path).name
            if self.staged.pop(gone, None) is not None:
                self.snapshot = tuple(self.staged.values())
            self.log.info("cache.pruned", kind="download", name=order.base_name(gone), directory=gone)

    def _is_rejected(self, directory: str) -> bool:
        name, fingerprint = order.split_placed(directory)
        return any(fp.startswith(fingerprint) for fp in self.rejected.get(name, ())) if fingerprint else False

    def _status(self) -> str:
        newest = max(self.staged.values(), key=lambda c: c.candidate.key, default=None)
        leader = "leader's verdicts unknown" if self.leader is None else f"leader {self.config.node.leader}"
        return f"staged {newest.directory if newest else 'nothing yet'}; {len(self.staged)} kept; {leader}"
