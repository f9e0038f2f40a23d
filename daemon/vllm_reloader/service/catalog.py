"""What is on disk: the candidates in the checkpoint root, what waits and why, what was
rejected (and by which fingerprint), and an operator's pin.

One owner, the reloader on the main loop; everyone else sees it through a snapshot.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

from .. import log
from ..checkpoint import completeness, conventions, order
from ..checkpoint.completeness import DirectoryListing
from ..checkpoint.conventions import Convention
from ..checkpoint.files import SINGLE_NAME
from ..checkpoint.gate import LAYOUT_DIFFERS
from ..checkpoint.manifest import MANIFEST_NAME
from ..checkpoint.manifest import parse as parse_manifest
from ..errors import ManifestInvalid, NotJSONYet
from ..sources import local
from ..sources.arrivals import Arrivals
from .reconcile import version_of
from .state import Loaded, Rejection


def rejection_fix(check: str, name: str, reason: str = "") -> str:
    """What an operator does about a rejection, by the check that made it (a layout that could
    not be read, a config.json that is not JSON, is a broken file, not another model)."""
    again = f"`vllm-reloader pin {name} --force` judges the same bytes again"
    if check == "layout" and reason.startswith(LAYOUT_DIFFERS):
        return (
            "it is not the model the engine serves: train from that model, or restart the engine "
            f"on this one; {again}"
        )
    if check in ("canary", "probe", "finite"):
        return f"the weights are broken (training diverged?): publish a good checkpoint; {again}"
    return f"fix it and publish it again (new bytes or a new name); {again}"


class Catalog:
    def __init__(
        self,
        root: Path,
        *,
        ignore: Iterable[str],
        convention: Convention,
        rejected: dict[str, Rejection],
        pinned: str | None,
        arrivals: Arrivals,
        serving: Callable[[], order.Serving],
        source: str,
        remote: bool = False,
    ) -> None:
        """`arrivals`: when each step-less version arrived, placed here for the root `source`
        (its configured path), or, when `remote`, by the object-store thread (only read here);
        `serving`: what the canary engine serves now (a version arriving is newer than it)."""
        self.root, self.ignore, self.convention = root, tuple(ignore), convention
        self.arrivals, self.serving, self.source, self.remote = arrivals, serving, source, remote
        self.candidates: dict[str, order.Candidate] = {}
        self.pending: dict[str, str] = {}
        """name → why it waits, for candidates worth trying (logged once per reason)."""
        self.rejected = dict(rejected)
        self.rejected_view = _fingerprints(self.rejected)
        """Replaced whole on each rejection: the object-store thread reads it as it is."""
        self.pinned = pinned
        self.dirty: set[str] = set()
        """Names something happened to since the last look (watcher events, downloads)."""
        self.recheck_at: dict[str, float] = {}
        """Pending candidates are gated again only from then on (or once something changes)."""
        self.last_scan = 0.0
        self.watching_since = time.time()
        """Since when a new checkpoint is loaded as soon as it is found (start, or the last
        unpin): one whole before then waited for no detection (`detection_lag_ms`)."""
        self.skipped: set[str] = set()
        """Names that can never be candidates, warned about once."""
        self.arrived: set[str] = set()
        """Names that appeared while running (not at the first scan): each is said to be passed
        over, once, if it orders before what serves (a copy with no step behind a stepped one)."""
        self.passed_over: dict[str, str] = {}
        """Those said to be passed over, while they stay so: name → why (for `status`)."""
        self.log = log.get()

    def configure(
        self, root: Path, ignore: Iterable[str], convention: Convention, source: str, remote: bool
    ) -> None:
        self.root, self.ignore, self.convention = root, tuple(ignore), convention
        self.source, self.remote = source, remote

    def rescan(self) -> None:
        """Every directory in the root, and every candidate known (it may be gone)."""
        self.refresh(local.list_candidates(self.root, self.ignore) | set(self.candidates))
        if not self.last_scan and not self.remote:
            self.arrivals.started(self.source)
        self.last_scan = time.time()

    def refresh_dirty(self) -> None:
        self.refresh(self.dirty)
        self.dirty = set()

    def refresh(self, names: Iterable[str]) -> None:
        seen: dict[str, order.Candidate] = {}
        for name in names:
            directory = self.root / name
            if (unusable := local.unusable_name(name)) is not None:
                if name not in self.skipped:
                    self.skipped.add(name)
                    self.log.warning("checkpoint.skipped", name=repr(name), reason=unusable)
                continue
            if not _real_directory(directory):  # gone, or a symlink: never a candidate
                self.forget(name)
                continue
            if name not in self.candidates:
                if self.last_scan:  # arrived while running
                    self.log.info("checkpoint.seen", name=name, path=str(directory))
                    self.arrived.add(name)
                else:  # the first listing: one line per folder at every start is noise
                    self.log.debug("checkpoint.seen", name=name, path=str(directory))
            seen[name] = _peek(name, directory, self.convention)
        self.candidates.update(seen)
        self.candidates.update(self._arrived(seen))

    def _arrived(self, seen: Mapping[str, order.Candidate]) -> dict[str, order.Candidate]:
        """The step-less ones of one look, with their arrivals (after the highest step known,
        this look's included; a rejected content's step counts for nothing)."""
        if self.remote:  # placed as the store listed them
            return {
                n: replace(c, arrival=self.arrivals.of(self.source, c.base))
                for n, c in seen.items()
                if c.step is None
            }
        floor = order.floor_of(self.candidates.values(), self.serving().key, self.rejected_fingerprints())
        return self.arrivals.place(self.source, seen.values(), floor=floor, first=not self.last_scan)

    def forget(self, name: str) -> None:
        self.arrived.discard(name)
        self.passed_over.pop(name, None)
        self.candidates.pop(name, None)
        self.pending.pop(name, None)
        self.recheck_at.pop(name, None)

    def changed(self, name: str) -> None:
        """Something under ROOT/name changed: look at it, and gate it again, now."""
        self.dirty.add(name)
        self.recheck_at.pop(name, None)

    def next_to_gate(
        self, serving: Loaded | None, serving_key: order.Serving, now: float
    ) -> order.Candidate | None:
        """The newest candidate worth gating that is not waiting for its recheck."""
        worth = self.worth_trying(serving, self._dated(serving_key))
        return next((c for c in worth if self.recheck_at.get(c.name, 0.0) <= now), None)

    def next_recheck(self) -> float | None:
        return min((at for name, at in self.recheck_at.items() if name in self.pending), default=None)

    def waiting(self, name: str, reason: str, until: float, **details: object) -> None:
        """A pending verdict: said once per reason, gated again from `until`."""
        self.note_pending(name, reason, **details)
        self.recheck_at[name] = until

    def rejected_fingerprints(self) -> Mapping[str, frozenset[str]]:
        """A version's name → the fingerprints of its rejected contents: each is retried only with
        other content (a download placed as `NAME@…` is rejected as NAME, as the object store's
        listing sees it). A snapshot: safe to read from another thread."""
        return self.rejected_view

    def worth_trying(self, serving: Loaded | None, serving_key: order.Serving) -> list[order.Candidate]:
        """The candidates to gate now, newest first: only the pinned one while pinned (an
        operator's choice: load exactly that one, older or not, then hold still)."""
        rejected = self.rejected_fingerprints()
        if self.pinned is not None:
            pinned = self.candidates.get(self.pinned)
            done = serving is not None and serving.name == self.pinned
            skip = done or pinned is None or pinned.fingerprint in rejected.get(pinned.base, ())
            worth = [] if skip or pinned is None else [pinned]
        else:
            worth = order.to_try(self.candidates, serving=serving_key, rejected=rejected)
            self._say_passed_over(worth, serving_key)
        names = {c.name for c in worth}
        self.pending = {n: reason for n, reason in self.pending.items() if n in names}
        self.passed_over = {n: why for n, why in self.passed_over.items() if n not in names}
        return worth

    def _say_passed_over(self, worth: Sequence[order.Candidate], serving: order.Serving) -> None:
        """A checkpoint copied in that will never load by itself is said once, with what to do."""
        self.arrived -= {c.name for c in worth}  # newer than what served when it came: not passed over
        for name in sorted(self.arrived):
            found = self.candidates.get(name)
            if found is None or name == serving.name or not _settled(self.root, self.convention, found):
                continue
            self.arrived.discard(name)
            if found.fingerprint in self.rejected_view.get(found.base, ()):
                continue
            step = f"step {found.step}" if found.step is not None else "no step"
            step += f", arrived after step {found.arrival[0]}" if found.arrival is not None else ""
            reason = f"{step}, not newer than {serving.name}: {ORDER_RULE}"
            fix = f"`vllm-reloader pin {name}` loads it; or publish it with a higher --step"
            self.passed_over[name] = f"{reason}; {fix}"
            self.log.info("checkpoint.passed_over", name=name, serving=serving.name, reason=reason, fix=fix)

    def _dated(self, serving: order.Serving) -> order.Serving:
        """`serving` with the time its copy was placed, when it is in the root."""
        found = self.candidates.get(serving.name)
        return replace(serving, published=found.published) if found is not None else serving

    def newer_than(self, serving_key: order.Serving) -> set[str]:
        """Candidates that would load next (retention must not delete them)."""
        return {
            c.name
            for c in order.to_try(
                self.candidates, serving=self._dated(serving_key), rejected=self.rejected_fingerprints()
            )
        }

    def note_pending(self, name: str, reason: str, **details: object) -> None:
        if self.pending.get(name) != reason:
            self.pending[name] = reason
            if "unreadable" in details:  # an operator must act: a warning, naming file, owner, mode
                self.log.warning("checkpoint.unreadable", name=name, reason=reason, **details)
            else:
                self.log.info("checkpoint.pending", name=name, reason=reason)

    def reject(
        self, name: str, version: str | None, reason: str, fingerprint: str, **details: object
    ) -> dict[str, object]:
        """Records a rejection; returns its `checkpoint.rejected` line's fields, which the caller
        logs once the state file holds it (whoever reads the file on that line sees it there)."""
        version = version or order.base_name(name)
        self.pending.pop(name, None)
        base = order.base_name(name)
        before = self.rejected.get(base)
        earlier = () if before is None else (before.fingerprint, *before.earlier)
        source, prefix = self.candidates.get(base), order.split_placed(name)[1]
        if prefix and source is not None and source.fingerprint.startswith(prefix):  # converted from it
            earlier = (source.fingerprint, *earlier)  # the trainer's own directory stops waiting too
        earlier = tuple(fp for fp in dict.fromkeys(earlier) if fp != fingerprint)[: REJECTED_PER_NAME - 1]
        self.rejected[base] = Rejection(
            version=version, reason=reason, fingerprint=fingerprint, at=time.time(), earlier=earlier
        )
        self.rejected_view = _fingerprints(self.rejected)
        fix = details.pop("fix", None) or rejection_fix(str(details.get("check", "")), base, reason)
        return dict(name=name, version=version, fingerprint=fingerprint, reason=reason, fix=fix, **details)

    def pin(self, name_or_version: str | None, *, force: bool = False) -> str | None:
        """An operator's pin (None: unpin), by directory name or version; returns an error. A
        rejected content is refused (it would never load: the pin would hold the engine still
        for nothing) unless `force`: then its rejection is forgotten, so the gate and the canary
        check judge it again (and it is rejected again if it fails again)."""
        if name_or_version is None:
            self.log.info("control.unpinned", name=self.pinned)
            self.pinned, self.watching_since = None, time.time()
            return None
        matches = self.find(name_or_version)
        if not matches:
            return f"no checkpoint named {name_or_version!r} in {self.root}"
        if len(matches) > 1:
            return f"version {name_or_version!r} names {', '.join(matches)}: pin one of them by that name"
        match = matches[0]
        if (converted := self._converted_from(match)) is not None:  # never loadable as it is
            copy = converted or "its converted copy, once converted"
            return f"{match} is a trainer's own format that vLLM cannot read: pin {copy}"
        rejected = self.rejection_of(match)
        if rejected is not None and not force:
            return f"{match} was rejected: {rejected}; `pin --force` tries it again"
        if rejected is not None:
            self._forget_rejection(self.candidates[match])
        self.log.info(
            "control.pinned", name=match, forced=force, **({"rejected": rejected} if rejected else {})
        )
        self.pinned = match
        return None

    def _converted_from(self, name: str) -> str | None:
        """For a trainer's own format: its converted copy's name ("" while there is none)."""
        try:
            found = completeness.foreign_content(DirectoryListing(self.root / name), self.convention)
        except OSError:
            return None
        if found is None:
            return None
        placed = order.placed_name(name, found[1])
        return placed if placed in self.candidates else ""

    def rejection_of(self, name: str) -> str | None:
        """Why the candidate's current content was rejected; None: it was not (`pin`, `status`)."""
        candidate = self.candidates.get(name)
        rejection = None if candidate is None else self.rejected.get(candidate.base)
        if candidate is None or rejection is None or not candidate.fingerprint:
            return None
        if candidate.fingerprint == rejection.fingerprint:
            return rejection.reason
        return REASON_NOT_KEPT if candidate.fingerprint in rejection.earlier else None

    def rejection_of_content(self, base: str, fingerprint: str) -> str:
        """Why a content of the name `base` was rejected (it is: `rejected_fingerprints`)."""
        rejection = self.rejected.get(base)
        if rejection is None:
            return "rejected"
        return rejection.reason if rejection.fingerprint == fingerprint else REASON_NOT_KEPT

    def _forget_rejection(self, candidate: order.Candidate) -> None:
        """The name's other rejected contents stay rejected."""
        rejection = self.rejected.pop(candidate.base)
        rest = tuple(fp for fp in (rejection.fingerprint, *rejection.earlier) if fp != candidate.fingerprint)
        if rest:
            reason = rejection.reason if rest[0] == rejection.fingerprint else REASON_NOT_KEPT
            update = {"fingerprint": rest[0], "earlier": rest[1:], "reason": reason}
            self.rejected[candidate.base] = rejection.model_copy(update=update)
        self.rejected_view = _fingerprints(self.rejected)

    def find(self, name_or_version: str) -> list[str]:
        """Candidates by directory name, else by manifest version (for `pin`), after a rescan:
        several when a version names several contents."""
        self.rescan()
        if name_or_version in self.candidates:
            return [name_or_version]
        return sorted(n for n in self.candidates if version_of(self.root / n) == name_or_version)


REJECTED_PER_NAME = 8
"""Rejected contents remembered per name (a trainer rewriting one name keeps it bounded)."""
REASON_NOT_KEPT = "rejected before (its reason was not kept)"
"""A name keeps the reason of its newest rejected content only."""


def _fingerprints(rejected: Mapping[str, Rejection]) -> Mapping[str, frozenset[str]]:
    return MappingProxyType({name: frozenset((r.fingerprint, *r.earlier)) for name, r in rejected.items()})


ORDER_RULE = (
    "checkpoints order by step (a manifest's; else Trainer's global_step, or the number a "
    "checkpoint-N / step-N name ends in), then name; one with no step orders after the highest "
    "step known when it arrived (one there before the daemon first ran: before every stepped one)"
)


def _settled(root: Path, convention: Convention, found: order.Candidate) -> bool:
    """Whether a writer is done with it as the catalog last saw it: its completing file is
    there (and quiet, for a lone model.safetensors), a manifest parses (one written in place
    has no step until whole), and nothing changed since (else a refresh is on its way)."""
    try:
        listing = DirectoryListing(root / found.name)
        signal = conventions.signal_name(listing.top(), convention)
        quiet = time.time() - listing.last_change() >= convention.settle_seconds
        if signal == MANIFEST_NAME:
            parse_manifest(listing.whole(MANIFEST_NAME))
        now = completeness.candidate(found.name, listing, convention)
    except (OSError, NotJSONYet, ManifestInvalid):
        return False
    unchanged = (now.step, now.fingerprint) == (found.step, found.fingerprint)
    return unchanged and signal is not None and (signal != SINGLE_NAME or quiet)


def _real_directory(directory: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(directory).st_mode)
    except OSError:
        return False


def _peek(name: str, directory: Path, convention: Convention) -> order.Candidate:
    """How it orders; nothing a writer puts in a manifest stops the loop here. A download's copy
    (`NAME@…`) is published when it was placed: its directory's mtime (the completing file is
    written into it last)."""
    try:
        found = completeness.candidate(name, DirectoryListing(directory), convention)
        return replace(found, published=os.lstat(directory).st_mtime)
    except Exception:  # the gate will say what is wrong with it, as a verdict
        return order.Candidate(name, None, "")


def detection_lag_ms(directory: Path, since: float = 0.0) -> float | None:
    """Manifest written → now: how long detection took (None: no manifest, or written before
    `since`, when nothing was watching for it: a start, a pin held)."""
    try:
        mtime = os.stat(directory / MANIFEST_NAME).st_mtime
    except OSError:
        return None
    return round((time.time() - mtime) * 1000, 3) if mtime >= since else None
