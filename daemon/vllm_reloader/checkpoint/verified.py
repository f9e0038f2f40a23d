"""What was verified already, by file identity: a shard read while its checkpoint was still
being written is not read again when the manifest lands.

A result stands for a file only while its identity (device, inode, size, mtime, ctime) is
the same, and only if the file had last changed a timestamp tick before the read began
(git's "racily clean" rule: a write within the same tick would not change the identity).
A digest that differs from the manifest's is never believed from here: only a fresh full
read may reject a checkpoint.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from .files import RACY_NS, Identity
from .manifest import ManifestFile


@dataclass(frozen=True)
class Verified:
    identity: Identity
    blake3: str
    """Of the whole file ("" when the read stopped early at a NaN)."""
    non_finite: str | None
    """The first tensor holding NaN or Inf, if the file was scanned and one does."""
    scanned: bool
    started_ns: int
    """When the read began (wall clock, as file times are)."""

    def settles(self, entry: ManifestFile, scan: bool) -> Literal["clean", "non_finite", "scan"] | None:
        """What this earlier read says of `entry` now: `clean`, `non_finite`, `scan` (its
        digest is settled, the NaN scan still needs a read), or None when the file must be
        read in full (racy, a digest not computed or that differs)."""
        if self.identity[4] + RACY_NS > self.started_ns:
            return None
        if scan and self.non_finite is not None:
            return "non_finite"
        if entry.sha256 or (entry.blake3 and entry.blake3 != self.blake3):
            return None
        return "scan" if scan and not self.scanned else "clean"


class Cache:
    """Results by identity (the newest `limit`), and the reads under way: a gate that needs
    a file being read already waits for that read instead of starting its own."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._done: OrderedDict[Identity, Verified] = OrderedDict()
        self._running: dict[Identity, threading.Event] = {}
        self._lock = threading.Lock()

    def claim(self, identity: Identity) -> bool:
        """True: the caller reads the file and must `release` it; False: known or under way."""
        with self._lock:
            if identity in self._done or identity in self._running:
                return False
            self._running[identity] = threading.Event()
            return True

    def release(self, identity: Identity, result: Verified | None) -> None:
        with self._lock:
            finished = self._running.pop(identity, None)
            if result is not None:
                self._store(result)
        if finished is not None:
            finished.set()

    def put(self, result: Verified) -> None:
        with self._lock:
            self._store(result)

    def _store(self, result: Verified) -> None:
        self._done[result.identity] = result
        self._done.move_to_end(result.identity)
        while len(self._done) > self.limit:
            self._done.popitem(last=False)

    def get(self, identity: Identity, wait: float = 600.0) -> Verified | None:
        with self._lock:
            running = self._running.get(identity)
        if running is not None:
            running.wait(wait)
        with self._lock:
            return self._done.get(identity)
