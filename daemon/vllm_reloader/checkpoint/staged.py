"""A copy's staged marker: one node's daemon saying it verified a content at a path.

Each node of a multi-node engine holds its own copy of a version at the same absolute path;
each rank opens that path on its own node. The daemon beside the node writes the marker once
its gate passed the copy (`sources.content.mark_staged`); every rank reads it, before a reload
and while loading (`extension.ReloadExtension.reloader_staged`), and trusts only files whose
identities are still the verified ones. Standard library and `files` only: the extension
imports it inside vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .files import Identity, changed, parse_json, read_small

MARKERS = ".staged"
"""Beside the copies, a dot-directory (never a candidate) with one marker each, named as its copy."""


def staged_marker(copy: Path) -> Path:
    """Where a node's daemon says it verified the copy at `copy` (the same path on every node)."""
    return copy.parent / MARKERS / copy.name


@dataclass(frozen=True)
class Staged:
    """One node's word on the copy at a path: which content it verified there (`fingerprint`),
    by which daemon (`node`), and each file as it was verified (`files`: identities)."""

    node: str
    fingerprint: str
    files: dict[str, Identity]


def read_staged(copy: Path) -> Staged:
    """The marker beside `copy`. Raises OSError (missing, unreadable) or ValueError (not one)."""
    found = parse_json(read_small(staged_marker(copy), 1 << 20))
    if not isinstance(found, dict) or found.get("format") != 1:
        raise ValueError("not a staged marker of format 1")
    node, fingerprint, listed = found.get("node"), found.get("fingerprint"), found.get("files")
    if not isinstance(node, str) or not isinstance(fingerprint, str) or not isinstance(listed, dict):
        raise ValueError("a staged marker needs node, fingerprint and files")
    files: dict[str, Identity] = {}
    for name, want in listed.items():
        parts = Path(name).parts
        odd = not name or "\0" in name or len(name.encode(errors="replace")) > 4096 or name.startswith("/")
        if odd or ".." in parts or any(len(p.encode(errors="replace")) > 255 for p in parts):
            raise ValueError(f"a staged marker names {name[:100]!r}, not a file of its copy")
        if not (isinstance(want, list) and len(want) == 5 and all(type(n) is int for n in want)):
            raise ValueError(f"a staged marker's identity of {name!r} is not five integers")
        files[str(name)] = (want[0], want[1], want[2], want[3], want[4])
    return Staged(node[:200], fingerprint[:200], files)


def staged_problem(copy: Path, fingerprint: str) -> tuple[Staged | None, str | None]:
    """This node's marker of `copy`, and why it does not hold `fingerprint` verified there now
    (None: it does). What every rank answers before a reload of a multi-node engine."""
    if not copy.is_dir():
        return None, f"no copy at {copy} (is this node's stage daemon running?)"
    try:
        staged = read_staged(copy)
    except FileNotFoundError:
        return None, f"a copy no daemon marked as verified at {copy} (is this node's stage daemon running?)"
    except (OSError, ValueError) as exc:
        return None, f"{staged_marker(copy)} cannot be read: {exc}"
    if staged.fingerprint != fingerprint:
        return staged, f"{copy} holds content {staged.fingerprint}, not {fingerprint}"
    if not staged.files:
        return staged, f"{staged_marker(copy)} lists no files"
    try:
        problem = changed(copy, staged.files)
    except (OSError, ValueError) as exc:  # a name through a file, one the node may not read
        problem = f"cannot be looked at: {exc}"
    if problem:
        return staged, f"changed since {staged.node} verified it: {problem}"
    return staged, None
