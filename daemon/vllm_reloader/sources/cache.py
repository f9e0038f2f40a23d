"""The download cache's own upkeep: what is placed in it, partial downloads no longer wanted,
and a single-file checkpoint's times. What is deleted from the cache once placed is the content store's
collector's alone (`content`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..checkpoint import completeness, order
from ..checkpoint.completeness import DirectoryListing
from ..checkpoint.conventions import Convention
from . import local


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


def placed(root: Path, convention: Convention) -> dict[str, set[str]]:
    """The contents of each name already in the cache's root (their fingerprints, as the placed
    directories' names give them): a name rewritten in the store since is a candidate again.
    A directory of an earlier release (placed as NAME) is fingerprinted from its files."""
    found: dict[str, set[str]] = {}
    for directory in local.list_candidates(root, ()):
        name, fingerprint = order.split_placed(directory)
        if not fingerprint:
            try:
                fingerprint = completeness.fingerprint(DirectoryListing(root / name), convention)
            except OSError:
                continue
        found.setdefault(name, set()).add(fingerprint)
    return found
