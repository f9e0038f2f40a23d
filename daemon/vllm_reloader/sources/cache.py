"""Retention in the download cache: a local root is the trainer's, the cache is ours.

Kept: whatever the caller protects (serving, last good, pinned, in flight, the engine's
startup model, anything newer than serving not yet loaded) and the `keep` newest others;
the rest is deleted, each renamed to a dot-name first so no watcher or gate ever sees one
half-deleted.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path

from ..checkpoint.order import Candidate


def to_prune(candidates: Mapping[str, Candidate], *, protected: set[str], keep: int) -> list[str]:
    """Downloaded checkpoints to delete: all but the protected ones and the `keep` newest others."""
    others = sorted(
        (c for c in candidates.values() if c.name not in protected), key=lambda c: c.key, reverse=True
    )
    return [c.name for c in others[keep:]]


def prune(root: Path, names: list[str]) -> list[str]:
    """Delete downloaded checkpoints from `root`; returns the names deleted."""
    done = []
    for name in names:
        doomed = root / f".deleting-{secrets.token_hex(8)}"  # short: a name may be 255 bytes
        try:
            os.rename(root / name, doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        done.append(name)
    return done


def clean_staging(staging: Path, keep: set[str]) -> None:
    """Partial downloads of contents no longer in the store, or already placed."""
    try:
        leftovers = [p for p in staging.iterdir() if p.name not in keep]
    except FileNotFoundError:
        return
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)


def backdate(directory: Path, when: float) -> None:
    """A downloaded single-file checkpoint keeps the store's quiet time, or the local gate
    would wait `settle_seconds` a second time."""
    for path in (*directory.iterdir(), directory):
        os.utime(path, (when, when))
