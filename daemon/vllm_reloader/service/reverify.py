"""Rollback targets judged by their bytes, not their metadata.

A rollback target counts while its files keep the identities the gate verified. Many changes
of no byte move an identity: `chmod g+r` (which trainers are told to run), a backup's hard
link, a remount (the device number moves). When a target's files are all there at their
sizes but their identities moved, its bytes are read again — by the gate, on this thread,
off the loop — and checked against the digests its fingerprint names. Only a byte change (or
a checkpoint with no digests to check against) disqualifies it; a target that passes takes
its files' new identities.

One target at a time: this is rare, and a rollback target is at most a few checkpoints.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from ..checkpoint import gate, layout
from ..checkpoint.files import Identity, identity
from ..threads import QueueWorker
from .state import Loaded

RETRY_CHANGED = 30.0
"""A target whose files changed while they were read is read again no sooner than this."""


@dataclass(frozen=True)
class Reverified:
    """The gate read a rollback target again: `files` are its new identities, or None."""

    name: str
    fingerprint: str
    files: Mapping[str, Identity] | None
    reason: str
    """Why it no longer counts (when `files` is None)."""
    seconds: float
    final: bool = True
    """False: the files changed while they were read; read again later, not disqualified."""


def moved(target: Loaded) -> tuple[Identity, ...] | None:
    """The files' identities now, when every one is there at its verified size but some moved
    (a change of metadata that may be no change of bytes); None otherwise."""
    if not target.fingerprint or target.files is None:
        return None
    now = []
    for name, want in target.files.items():
        try:
            found = identity(os.lstat(Path(target.path) / name))
        except OSError:
            return None
        if found[2] != want[2]:
            return None
        now.append(found)
    return None if tuple(now) == tuple(tuple(w) for w in target.files.values()) else tuple(now)


def _judge(target: Loaded, verdict: gate.Verdict) -> str:
    """Why the gate's verdict does not show these are the target's bytes ("" when it does)."""
    if verdict.status != "ready":
        return verdict.reason or verdict.status
    if verdict.fingerprint != target.fingerprint:
        return "its manifest changed"
    manifest = verdict.manifest
    if manifest is None or not all(f.blake3 or f.sha256 for f in manifest.files):
        return "no digests to check its bytes against"
    return ""


@dataclass(frozen=True)
class _Work:
    target: Loaded
    serving: layout.Layout | None
    options: gate.GateOptions
    key: tuple[str, str, tuple[Identity, ...]]


class Reverifier(QueueWorker[_Work]):
    """Used from the loop (`submit`, `done`); the gate runs on its own thread (`close` stops a
    read under way at its next chunk)."""

    def __init__(self, post: Callable[[Reverified], None]) -> None:
        super().__init__("reverify")
        self._post = post
        self.under_way: dict[tuple[str, str], tuple[str, str, tuple[Identity, ...]]] = {}
        """(name, fingerprint) → what is being read (the loop's; loads wait for these)."""
        self._failed: set[tuple[str, str, tuple[Identity, ...]]] = set()
        """Read and found changed, with these identities: not read again until they move."""
        self._retry_at: dict[tuple[str, str], float] = {}
        """Changed while being read: not read again before then (a file touched over and over)."""

    def submit(  # type: ignore[override]
        self,
        target: Loaded,
        now: tuple[Identity, ...],
        serving: layout.Layout | None,
        options: gate.GateOptions,
    ) -> bool:
        """Read `target` again (its files now have identities `now`); False when that is under
        way or was done for these identities."""
        key = (target.path, target.fingerprint, now)
        waiting = self._retry_at.get((target.path, target.fingerprint), 0.0) > time.monotonic()
        if key in self._failed or waiting or (target.name, target.fingerprint) in self.under_way:
            return False
        self.under_way[(target.name, target.fingerprint)] = key
        checked = replace(options, verify_digests=True)  # only digests can show the bytes are the same
        super().submit(_Work(target, serving, checked, key))
        return True

    def done(self, result: Reverified) -> None:
        key = self.under_way.pop((result.name, result.fingerprint), None)
        if result.files is None and key is not None:
            if result.final:
                self._failed.add(key)
            else:
                self._retry_at[key[:2]] = time.monotonic() + RETRY_CHANGED

    def handle(self, work: _Work) -> None:
        started = time.perf_counter()
        target = work.target
        run = gate.Run(threads=work.options.digest_threads, cancel=self.stop)
        verdict = gate.check(Path(target.path), serving=work.serving, options=work.options, run=run)
        why = _judge(target, verdict)
        files = None if why else verdict.files
        seconds = time.perf_counter() - started
        final = verdict.status != "pending"
        self._post(Reverified(target.name, target.fingerprint, files, why, seconds, final))
