"""What is on disk: the candidates in the checkpoint root, what waits and why, what was
rejected (and by which fingerprint), and an operator's pin.

One owner, the reloader on the main loop; everyone else sees it through a snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from .. import log
from ..checkpoint import completeness, order
from ..checkpoint.completeness import Convention, DirectoryListing
from ..sources import local
from .reconcile import version_of
from .state import Loaded, Rejection


class Catalog:
    def __init__(
        self,
        root: Path,
        *,
        ignore: Iterable[str],
        convention: Convention,
        rejected: dict[str, Rejection],
        pinned: str | None,
    ) -> None:
        self.root, self.ignore, self.convention = root, tuple(ignore), convention
        self.candidates: dict[str, order.Candidate] = {}
        self.pending: dict[str, str] = {}
        """name → why it waits, for candidates worth trying (logged once per reason)."""
        self.rejected = dict(rejected)
        self.pinned = pinned
        self.dirty: set[str] = set()
        """Names something happened to since the last look (watcher events, downloads)."""
        self.last_scan = 0.0
        self.log = log.get()

    def configure(self, root: Path, ignore: Iterable[str], convention: Convention) -> None:
        self.root, self.ignore, self.convention = root, tuple(ignore), convention

    def rescan(self) -> None:
        """Every directory in the root, and every candidate known (it may be gone)."""
        self.refresh(local.list_candidates(self.root, self.ignore) | set(self.candidates))
        self.last_scan = time.time()

    def refresh_dirty(self) -> None:
        self.refresh(self.dirty)
        self.dirty = set()

    def refresh(self, names: Iterable[str]) -> None:
        for name in names:
            directory = self.root / name
            if not directory.is_dir():
                self.forget(name)
                continue
            if name not in self.candidates:
                self.log.info("checkpoint.seen", name=name, path=str(directory))
            self.candidates[name] = completeness.candidate(name, DirectoryListing(directory), self.convention)

    def forget(self, name: str) -> None:
        self.candidates.pop(name, None)
        self.pending.pop(name, None)

    def rejected_fingerprints(self) -> dict[str, str]:
        """name → the fingerprint it was rejected with: retried only once that changes."""
        return {name: r.fingerprint for name, r in self.rejected.items()}

    def worth_trying(
        self, serving: Loaded | None, serving_key: order.OrderKey | None
    ) -> list[order.Candidate]:
        """The candidates to gate now, newest first: only the pinned one while pinned (an
        operator's choice: load exactly that one, older or not, then hold still)."""
        rejected = self.rejected_fingerprints()
        if self.pinned is not None:
            pinned = self.candidates.get(self.pinned)
            done = serving is not None and serving.name == self.pinned
            skip = done or pinned is None or rejected.get(pinned.name) == pinned.fingerprint
            worth = [] if skip or pinned is None else [pinned]
        else:
            worth = order.to_try(self.candidates, serving=serving_key, rejected=rejected)
        names = {c.name for c in worth}
        self.pending = {n: reason for n, reason in self.pending.items() if n in names}
        return worth

    def newer_than(self, serving_key: order.OrderKey | None) -> set[str]:
        """Candidates that would load next (retention must not delete them)."""
        return {
            c.name
            for c in order.to_try(self.candidates, serving=serving_key, rejected=self.rejected_fingerprints())
        }

    def note_pending(self, name: str, reason: str) -> None:
        if self.pending.get(name) != reason:
            self.pending[name] = reason
            self.log.info("checkpoint.pending", name=name, reason=reason)

    def reject(
        self, name: str, version: str | None, reason: str, fingerprint: str, **details: object
    ) -> None:
        version = version or name
        self.pending.pop(name, None)
        self.log.warning("checkpoint.rejected", name=name, version=version, reason=reason, **details)
        self.rejected[name] = Rejection(
            version=version, reason=reason, fingerprint=fingerprint, at=time.time()
        )

    def find(self, name_or_version: str) -> str | None:
        """A candidate by directory name or manifest version (for `pin`), after a rescan."""
        self.rescan()
        if name_or_version in self.candidates:
            return name_or_version
        return next((n for n in self.candidates if version_of(self.root / n) == name_or_version), None)
