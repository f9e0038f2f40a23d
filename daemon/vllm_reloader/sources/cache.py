"""The download cache's own upkeep: partial downloads no longer wanted, and a single-file
checkpoint's times. What is deleted from the cache once placed is the content store's
collector's alone (`content`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


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
