"""LoRA adapters as a source of versions: `<root>/<adapter>/<version>/` with PEFT's
`adapter_config.json` and `adapter_model.safetensors`, in a local root or an object-store
prefix (`adapter_trees`).

A thread looks at the root every `interval` seconds (adapters are few and small). A version
whose two files are there is copied, hashed as it is read, into
`<copies>/<adapter>/<version>@<digest>/`, a directory only the daemon writes: the engine reads
that copy, so the bytes it loads are the bytes the gate verified, whatever the writer does
afterwards, and each content has a path of its own (vLLM keys its prefix cache by an
adapter's name and path). A copy of the same bytes made before is kept, never replaced: an
engine may read it at any time. The copy is gated; one the gate finds not whole yet is
dropped and taken again at the next look, so no debounce waits on a writer that is done.
What is bigger than an adapter of the served model at `max_rank` could be is refused before a
byte is copied.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from .. import log
from ..checkpoint import adapter
from ..checkpoint.adapter import CONFIG_NAME, MAX_CONFIG_BYTES, WEIGHTS_NAME, AdapterVerdict, AdapterVersion
from ..checkpoint.conventions import name_step
from ..errors import SourceError
from ..records import RecordStore
from ..retry import Backoff, Policy
from ..threads import LoopWorker
from .adapter_fleet import AdapterFleet, AdapterRecalled
from .adapter_trees import CHUNK, Content, Tree
from .content import SOURCE_HOLDER, ContentStore
from .local import name_too_long

STAGING_PREFIX = ".copying-"
RETRY = Policy(10.0, 600.0)
"""A version that could not be copied (the store or the disk failed), or was rejected for what
is not its content (`io`, `internal`), is judged again after a backoff from 10 s to 10 min."""
DIGEST_CHARS = 32
"""Of the copy's blake3, in its directory's name."""
_instances = itertools.count()
_seen = itertools.count()
_first_seen: dict[tuple[str, str, str, str | None], int] = {}
"""(root, adapter, version, fingerprint) → when that content was first seen, in this process:
judged again (a retry, a new source after a SIGHUP, a new base), it keeps its place in order."""


@dataclass(frozen=True)
class AdapterGated:
    """One version of an adapter judged: `copy` is what the engine may load (ready only)."""

    adapter: str
    version: str
    order: tuple[int, int]
    """(the step its name ends in, or -1; when this content was first seen): newer orders later."""
    verdict: AdapterVerdict
    copy: AdapterVersion | None = None


@dataclass(frozen=True)
class AdaptersListed:
    """The adapter folders in the root now (an adapter no longer there may be unloaded)."""

    names: frozenset[str]


Found = AdapterGated | AdaptersListed | AdapterRecalled
"""What the source tells the loop."""


@dataclass(frozen=True)
class _Judged:
    content: Content
    served: adapter.Served
    copy: str | None
    said: tuple[object, ...] | None = None
    """The warning its copy failed with, which holds until it is tried again."""
    waiting: AdapterGated | None = None
    """A follower: what is posted once the canary hosts pass it."""


def max_weights_bytes(served: adapter.Served) -> int:
    """The most an adapter of the served model can hold: A and B for every 2-D weight, at
    `max_rank`, in F32, and a header's worth more."""
    pairs = sum(shape[0] + shape[-1] for shape in served.weights.values() if len(shape) == 2)
    return pairs * served.max_rank * 4 + (16 << 20)


class AdapterSource(LoopWorker):
    def __init__(
        self,
        tree: Tree,
        copies: Path,
        interval: float,
        served: Callable[[], adapter.Served | None],
        post: Callable[[Found], None],
        records: RecordStore,
        forgotten: queue.SimpleQueue[tuple[str, str]] | None = None,
        fleet: AdapterFleet | None = None,
        holds: Callable[[], Iterable[tuple[str, str]]] = tuple,
    ) -> None:
        """`served`: what the gate compares with (None: not known yet, nothing is judged);
        `records`: where each copy is registered (`content`: the loop collects the copies no
        one holds); `forgotten`: versions (adapter, version) to judge again, their copy found
        changed; `fleet`: the records of the hosts reading the same store; `holds`: what
        engines here hold, as (adapter, fingerprint), for a follower's recalls."""
        super().__init__("adapters", interval)
        self.tree, self.copies = tree, copies
        self.fleet, self._holds = fleet, holds
        self._served, self._post = served, post
        self.content = ContentStore(records, log.get())
        self.holder = f"{SOURCE_HOLDER}adapters:{next(_instances)}"
        """Its lease: the copies of the versions it judged in their present content."""
        self._forgotten = forgotten or queue.SimpleQueue()
        self._judged: dict[tuple[str, str], _Judged] = {}
        self.waiting: Mapping[str, Mapping[str, str]] = {}
        """A follower's: adapter → its newest version waiting for the canary hosts → why (for
        `status`; replaced whole at each turn, so another thread reads it as it is)."""
        self._retry: Backoff[tuple[str, str]] = Backoff(RETRY)
        """(adapter, version) judged again once its wait is over (a failure that blamed nothing)."""
        self._said: set[tuple[object, ...]] = set()
        """Warnings said and still holding: not said again until they stop and come back."""
        self._holding: set[tuple[object, ...]] = set()
        self._staging = f"{STAGING_PREFIX}{os.getpid()}-{next(_instances)}-"
        self.log = log.get().bind(root=tree.where)

    def run(self) -> None:
        self._sweep()
        try:  # a change under a watched root pokes it at once
            watcher = self.tree.watch(self.poke)
        except OSError as exc:  # inotify's limits: every `interval` it is looked at all the same
            watcher = None
            self.log.warning("adapters.unwatched", reason=_reason(exc), interval=self.interval)
        try:
            super().run()
        finally:
            if watcher is not None:
                watcher.close()

    def turn(self) -> None:
        try:
            self.scan()
        except (OSError, SourceError) as exc:  # the root itself: said once, looked at again
            self.waiting = {}  # not known now: `status` shows no wait it cannot vouch for
            self._say("adapters.unreadable", reason=_reason(exc))

    def _tell(self, message: Found) -> None:
        """To the loop, unless closed: a source replaced by a SIGHUP while stuck in a call to a
        hung store says nothing of the old root when it comes back."""
        if not self.stop.is_set():
            self._post(message)

    def _say(self, event: str, **fields: Any) -> tuple[object, ...]:
        """A warning said once for as long as it holds (a look every second would repeat it)."""
        return self._said_once(self.log.warning, event, **fields)

    def _said_info(self, event: str, **fields: Any) -> tuple[object, ...]:
        return self._said_once(self.log.info, event, **fields)

    def _said_once(self, say: Callable[..., Any], event: str, **fields: Any) -> tuple[object, ...]:
        key = (event, *sorted(fields.items()))
        self._holding.add(key)
        if key not in self._said:
            self._said.add(key)
            say(event, **fields)
        return key

    def scan(self) -> None:
        """One look at the root: every version not judged in its present content is."""
        served = self._served()
        if served is None:
            return
        while not self._forgotten.empty():
            self._judged.pop(self._forgotten.get_nowait(), None)
        self._holding = set()
        listing = self.tree.list(self._say)  # raises: what was said holds (the root's warning too)
        present = set()
        for name, versions in sorted(listing.items()):
            for version, content in sorted(versions.items()):
                if self.stop.is_set():
                    return
                present.add((name, version))
                self._consider(name, version, content, served)
        for gone in set(self._judged) - present:  # its folder is gone: its copy may go once unused
            del self._judged[gone]
        for key in [k for k in _first_seen if k[0] == self.tree.where and k[1:3] not in present]:
            _first_seen.pop(key, None)
        if self.fleet is not None:
            try:
                self._tend(self.fleet)
            except SourceError as exc:  # the records only: the versions found still count
                self.waiting = {}
                self._say("adapters.unreadable", reason=f"the fleet's records: {_reason(exc)}")
        if listing:  # an empty root (a mount not there) unloads nothing
            self._tell(AdaptersListed(frozenset(listing)))
        self._said = self._holding  # a warning not said again this look has stopped holding
        self._hold()

    def _consider(self, name: str, version: str, content: Content | None, served: adapter.Served) -> None:
        judged = self._judged.get((name, version))
        if judged is not None and judged.said is not None:
            self._holding.add(judged.said)  # until it is tried again
        key = (name, version)
        again = self._retry.until(key) is not None and not self._retry.waiting(key)
        if content is None or (
            judged is not None and judged.content == content and judged.served is served and not again
        ):
            return
        try:
            verdict, copy = self._judge(name, version, content, served)
        except (OSError, SourceError) as exc:  # not the content's fault: tried again in a while
            said = self._say("adapter.unreadable", adapter=name, version=version, reason=_reason(exc))
            self._retry.failed(key)
            self._judged[key] = _Judged(content, served, None, said)
            return
        except Exception as exc:
            verdict, copy = (
                adapter.AdapterVerdict("rejected", f"{type(exc).__name__}: {exc}"[:500], "internal"),
                None,
            )
        if verdict.status == "pending":
            return
        if verdict.check in ("io", "internal"):
            self._retry.failed(key)
        else:
            self._retry.succeeded(key)
        first = (self.tree.where, name, version, copy.fingerprint if copy else None)
        order = (
            step if (step := name_step(version)) is not None else -1,
            _first_seen.setdefault(first, next(_seen)),
        )
        message = AdapterGated(name, version, order, verdict, copy if verdict.status == "ready" else None)
        follow = self.fleet is not None and self.fleet.follower and message.copy is not None
        waiting = message if follow else None  # a follower's: posted once the canary hosts pass it
        kept = copy.path if copy and verdict.status == "ready" else None
        self._judged[key] = _Judged(content, served, kept, None, waiting)
        if not follow:
            self._tell(message)

    def _tend(self, fleet: AdapterFleet) -> None:
        """The fleet's turn: verdicts written; of each adapter's versions waiting for the canary
        hosts the newest asked about (one older is asked once that one failed, never once it
        passed: an older one is never loaded then); recalls."""
        newest: dict[str, tuple[tuple[str, str], AdapterGated]] = {}
        waiting_now: dict[str, dict[str, str]] = {}
        for where, judged in self._judged.items():
            if (waiting := judged.waiting) is not None and (
                where[0] not in newest or waiting.order > newest[where[0]][1].order
            ):
                newest[where[0]] = (where, waiting)
        for where, waiting in newest.values():
            assert waiting.copy is not None
            status, why = fleet.clearance(waiting.adapter, waiting.copy.fingerprint)
            if status == "waiting":
                waiting_now.setdefault(where[0], {})[where[1]] = why
                fingerprint = waiting.copy.fingerprint
                self._said_info(
                    "adapter.waiting", adapter=where[0], version=where[1], fingerprint=fingerprint, reason=why
                )
                continue
            self._judged[where] = dataclasses.replace(self._judged[where], waiting=None)
            if status == "cleared":
                self._tell(waiting)
                for other, judged in self._judged.items():  # older: never loaded now, never asked
                    if other[0] == where[0] and judged.waiting and judged.waiting.order < waiting.order:
                        self._judged[other] = dataclasses.replace(judged, waiting=None)
            else:
                verdict = adapter.AdapterVerdict("rejected", why, "fleet")
                self._tell(dataclasses.replace(waiting, verdict=verdict, copy=None))
        self.waiting = waiting_now
        for recalled in fleet.tend(self._holds()):
            self._tell(recalled)

    def _judge(
        self, name: str, version: str, content: Content, served: adapter.Served
    ) -> tuple[AdapterVerdict, AdapterVersion | None]:
        config_size, weights_size = content.sizes
        if config_size > MAX_CONFIG_BYTES or weights_size > (limit := max_weights_bytes(served)):
            too_big = (
                f"{CONFIG_NAME} of {config_size} and {WEIGHTS_NAME} of {weights_size} bytes: more than "
                f"an adapter of the served model at r = {served.max_rank} can hold ({limit} bytes)"
            )
            return adapter.AdapterVerdict("rejected", too_big, "size"), None
        if too_long := self._too_long(name, version):  # never copied: rejected once, not retried
            return adapter.AdapterVerdict("rejected", too_long, "local"), None
        made = self._copy(name, version, content)
        if made is None:  # written meanwhile: the next look takes it
            return adapter.AdapterVerdict("pending", "written while copied"), None
        copy, _ = made
        verdict = adapter.check(Path(copy.path), served)  # not ready: not held, so collected
        return verdict, AdapterVersion(name, version, copy.path, copy.fingerprint, verdict.files, copy.size)

    def _too_long(self, name: str, version: str) -> str | None:
        """Why the copy's directories cannot be made where copies live (the copy is named
        `<adapter>/<version>@<digest>`), or None."""
        return name_too_long(self.copies, name) or name_too_long(
            self.copies / name, f"{version}@{'0' * DIGEST_CHARS}"
        )

    def _copy(self, name: str, version: str, content: Content) -> tuple[AdapterVersion, bool] | None:
        """The two files copied and hashed in one read, then renamed into place (or the
        copy of the same bytes made before, kept as it is); None when the source changed while
        it was read. The flag: a new copy."""
        self._ensure(self.copies)
        where = blake3.blake3(f"{name}/{version}".encode()).hexdigest()[:16]
        staging = self.copies / f"{self._staging}{where}"  # short, whatever the names' lengths
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        os.chmod(staging, 0o755)  # the engine's user reads it, whatever the daemon's umask
        hasher, size = _hasher(), sum(content.sizes)
        try:
            if not self.tree.copy(name, version, content, staging, hasher):
                return None
            digest = hasher.hexdigest()
            final = self.copies / name / f"{version}@{digest[:DIGEST_CHARS]}"
            self._ensure(final.parent)
            new = not (final.is_dir() and _digest(final) == digest)  # the same bytes: an engine may read it
            if new:
                if final.exists():  # not what its name says (changed by hand): never loaded again
                    shutil.rmtree(final)
                os.rename(staging, final)
            with self.content.records.transaction():  # one of the daemon's copies, held from now
                self.content.made(final, "adapter")
                self._hold(also=final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return AdapterVersion(name, version, str(final), digest, size=size), new

    def _ensure(self, directory: Path) -> None:
        """Made inside one that exists (never its parents: a state dir deleted under a running
        daemon is not made again behind the operator's back; the copy fails, saying so)."""
        if not directory.is_dir():
            directory.mkdir(exist_ok=True)
            os.chmod(directory, 0o755)

    def _sweep(self) -> None:
        """What an earlier process left (this one's other sources clean up after themselves)."""
        if self.copies.is_dir():
            for leftover in self.copies.glob(f"{STAGING_PREFIX}*"):
                if not leftover.name.startswith(f"{STAGING_PREFIX}{os.getpid()}-"):
                    shutil.rmtree(leftover, ignore_errors=True)

    def _hold(self, also: Path | None = None) -> None:
        """Its lease, whole: the copies of what it judged ready in its present content (and one
        just placed), so none is collected while a version still lists it. Not once closed: a
        source replaced by a SIGHUP lets go of its copies to the new one."""
        if self.stop.is_set():
            self.content.hold(self.holder, ())
            return
        self.content.hold(self.holder, [*(j.copy for j in self._judged.values() if j.copy), also])


def _hasher() -> blake3.blake3:
    """blake3 on every core for the 8 MB chunks of a copy (0.17 -> 0.09 s a GB on two cores)."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO)


def _reason(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc))[:300]


def _digest(copy: Path) -> str | None:
    """The digest of a copy's bytes, read again (None: not whole)."""
    hasher = _hasher()
    try:
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            hasher.update(name.encode() + b"\0")
            with open(copy / name, "rb") as f:
                while chunk := f.read(CHUNK):
                    hasher.update(chunk)
    except OSError:
        return None
    return hasher.hexdigest()
