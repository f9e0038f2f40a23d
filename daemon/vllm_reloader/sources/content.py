"""The content store: every copy the daemon makes, and who holds each.

Downloads (`<cache>/checkpoints/NAME@fp`), adapter copies (`<copies>/<adapter>/<version>@fp`)
and converter outputs (`ROOT/NAME@fp`) are entries of one store, registered in the record store
(`content`) by the thread that makes them, once they are in place. Every use of an entry holds
a lease (`leases`): what an engine serves or holds, a load or a swap under way and what it would
go back to, the rollback history, the pin, a gate reading it, what would load next, the newest
few kept as a cache. As containerd's collector: an entry no lease holds may be collected; one
the daemon did not make never is, nor a converter's output (it lies in the trainer's root).

The collector runs on the loop, where every lease but the sources' own is known: the loop's
owners declare what they hold (`hold`, whole each time) just before it runs, so no lease is a
stale snapshot; a source thread declares its own from its thread (the record store's lock).
A lease of `ALL` on a kind keeps every entry of it (an engine whose adapters are not known yet).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from ..checkpoint.files import Identity
from ..checkpoint.staged import staged_marker
from ..durable import replace_atomically
from ..errors import StateError
from ..records import RecordStore

Kind = Literal["download", "adapter", "converted"]
ALL = "*"
"""A path held by a lease of `ALL:<kind>`: every entry of that kind is kept."""
SOURCE_HOLDER = "source:"
NEVER_COLLECTED: frozenset[Kind] = frozenset({"converted"})
"""A converter's outputs are placed in the trainer's root, which other daemons may read (the
converter lets another daemon on the root convert): registered, never deleted by one of them."""
"""How the holders a source thread declares from its own thread begin (the loop's do not)."""


def all_of(kind: Kind) -> str:
    return f"{ALL}:{kind}"


class ContentStore:
    def __init__(self, records: RecordStore, log: Any) -> None:
        self.records, self.log = records, log

    def made(self, path: Path, kind: Kind) -> None:
        """`path` is a copy the daemon made (a download placed, an adapter copied, an output
        placed): collected once no lease holds it. From any thread."""
        self.records.add_content(str(path), kind)

    def hold(self, holder: str, paths: Iterable[str | Path | None]) -> None:
        """What `holder` holds now, whole (`None`s are skipped). From any thread."""
        self.records.hold(holder, (str(p) for p in paths if p is not None))

    def declare(self, holders: Mapping[str, Iterable[str]]) -> None:
        """The loop's leases, whole: every holder but the sources' own (`SOURCE_HOLDER`) is
        replaced by `holders` (one that holds nothing now holds nothing); written only when
        something changed."""
        wanted = {(str(path), holder) for holder, paths in holders.items() for path in paths}
        try:
            now = {
                (path, holder)
                for path, found in self.records.leases().items()
                for holder in found
                if not holder.startswith(SOURCE_HOLDER)
            }
        except StateError:
            now = set()
        if now == wanted:
            return
        with self.records.transaction():
            for holder in {h for _, h in now} - set(holders):
                self.records.hold(holder, ())
            for holder, paths in holders.items():
                self.records.hold(holder, (str(p) for p in paths))

    def forget_holders(self) -> None:
        """At start: every lease is of a process gone (its owners declare theirs anew)."""
        self.records.release("")

    def adopt(self, directory: Path, pattern: str, kind: Kind) -> None:
        """What an earlier release made in `directory` (the daemon's own: no other writer there,
        as `paths.apart` checks) is registered once, so it is collected like new copies."""
        key = f"adopted:{kind}:{directory}"
        if self.records.meta(key) is not None:
            return
        with self.records.transaction():
            for found in sorted(directory.glob(pattern)):
                if found.is_dir() and not found.is_symlink() and not found.name.startswith("."):
                    self.made(found, kind)
            self.records.set_meta(key, "1")

    def collect(self) -> list[tuple[str, str]]:
        """Delete every copy the daemon made that no lease holds; on the loop, right after its
        owners declared what they hold. Returns (kind, path) of those deleted."""
        try:
            entries, leases = self.records.contents(), self.records.leases()
        except StateError as exc:  # the store failing now: nothing is collected this time
            self.log.warning("content.unreadable", reason=str(exc))
            return []
        blocked = {path.removeprefix(f"{ALL}:") for path in leases if path.startswith(f"{ALL}:")}
        deleted = []
        for path, kind, _made in entries:
            if kind in blocked or kind in NEVER_COLLECTED or path in leases:
                continue
            if _remove(Path(path)):
                self.records.drop_content(path)
                deleted.append((kind, path))
        return deleted


def mark_staged(copy: Path, node: str, fingerprint: str, files: Mapping[str, Identity]) -> None:
    """Say, beside `copy`, that this node's daemon verified `fingerprint` there with these files
    (what every rank of a multi-node engine reads before it loads). Raises OSError."""
    marker = {
        "format": 1,
        "node": node,
        "fingerprint": fingerprint,
        "files": {k: list(v) for k, v in files.items()},
    }
    staged_marker(copy).parent.mkdir(exist_ok=True)
    replace_atomically(staged_marker(copy), json.dumps(marker, sort_keys=True).encode())


def _remove(path: Path) -> bool:
    """Renamed to a dot-name first (no watcher or gate ever sees one half-deleted), then
    deleted, its staged marker first (none ever vouches for a copy half gone); whether it is gone."""
    with contextlib.suppress(OSError):  # one left vouches for nothing: a gone copy is "no copy" to a rank
        staged_marker(path).unlink(missing_ok=True)
    if not os.path.lexists(path):
        return True
    doomed = path.with_name(f".deleting-{secrets.token_hex(8)}")  # short: a name may be 255 bytes
    try:
        os.rename(path, doomed)
    except OSError:
        return False
    shutil.rmtree(doomed, ignore_errors=True)
    return True
