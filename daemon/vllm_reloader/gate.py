"""The gate: proves a checkpoint directory is whole and loadable before the engine sees it.

vLLM's `reload_weights` kills the engine on a truncated shard or a shape mismatch, so
nothing passes here on a guess. `check` is a pure function of the directory, the layout
being served and the clock; its verdict is data:

- `ready`: every check passed; the engine may load it.
- `pending`: may still be being written (no manifest yet, a file missing or short, a
  manifest that is not JSON yet); check again later.
- `rejected`: can never become loadable as described; not retried unless the manifest
  bytes change (`fingerprint`).

Checks run cheapest first: schema, paths, sizes, safetensors headers, layout, digests.
Digests come last because they read every byte — which also warms the page cache right
before the engine reads the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import blake3
from safetensors import SafetensorError, safe_open

from . import layout
from .manifest import MANIFEST_NAME, Manifest, ManifestFile, ManifestInvalid, ManifestNotJSON
from .manifest import parse as parse_manifest

Status = Literal["ready", "pending", "rejected"]

# What vLLM's default loader reads from a checkpoint directory (top level only).
WEIGHT_SUFFIX = ".safetensors"
READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class Verdict:
    status: Status
    reason: str = ""
    manifest: Manifest | None = None
    fingerprint: str = ""
    """sha256 of the manifest bytes the verdict was reached on."""
    details: dict[str, object] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return self.manifest.total_bytes if self.manifest else 0


@dataclass(frozen=True)
class GateOptions:
    verify_digests: bool = True
    digest_threads: int = 4
    manifest_grace: float = 10.0


def _pending(reason: str, manifest: Manifest | None = None, fingerprint: str = "") -> Verdict:
    return Verdict("pending", reason, manifest, fingerprint)


def _rejected(
    reason: str, manifest: Manifest | None = None, fingerprint: str = "", **details: object
) -> Verdict:
    return Verdict("rejected", reason, manifest, fingerprint, details)


def fingerprint_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_manifest_bytes(directory: Path) -> tuple[bytes, float] | None:
    path = directory / MANIFEST_NAME
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode):
            raise IsADirectoryError(f"{MANIFEST_NAME} is not a regular file")
        return path.read_bytes(), info.st_mtime
    except FileNotFoundError:
        return None


def _unsafe_path(relative: str) -> str | None:
    """Why a manifest path may not be used, or None. Symlinks are checked separately."""
    if relative.startswith("/"):
        return "is absolute"
    if "\x00" in relative or posixpath.normpath(relative) != relative:
        return "is not normalised"
    if ".." in relative.split("/"):
        return "leaves the checkpoint directory"
    if relative == MANIFEST_NAME:
        return "is the manifest itself"
    return None


def _check_paths(directory: Path, manifest: Manifest) -> str | None:
    root = os.path.realpath(directory)
    seen: set[str] = set()
    for entry in manifest.files:
        problem = _unsafe_path(entry.path)
        if problem is None and entry.path in seen:
            problem = "is listed twice"
        resolved = os.path.realpath(directory / entry.path)  # a loop resolves to itself; stat fails later
        if problem is None and not resolved.startswith(root + os.sep):
            problem = "resolves outside the checkpoint directory (symlink)"
        if problem:
            return f"path {entry.path!r} {problem}"
        seen.add(entry.path)
    weights = {e.path for e in manifest.files if _is_weight(e.path)}
    if not weights:
        return "manifest lists no .safetensors file"
    for name in sorted(p.name for p in directory.glob("*" + WEIGHT_SUFFIX)):
        if name not in weights:
            return f"{name} is in the directory but not in the manifest (the engine would load it)"
    return None


def _is_weight(relative: str) -> bool:
    return "/" not in relative and relative.endswith(WEIGHT_SUFFIX)


def _check_sizes(directory: Path, manifest: Manifest) -> Verdict | None:
    for entry in manifest.files:
        try:
            info = (directory / entry.path).stat()
        except FileNotFoundError:
            return _pending(f"{entry.path} does not exist yet")
        if not stat.S_ISREG(info.st_mode):
            return _rejected(f"{entry.path} is not a regular file", check="sizes")
        if info.st_size < entry.size:
            return _pending(f"{entry.path} has {info.st_size} of {entry.size} bytes")
        if info.st_size > entry.size:
            return _rejected(
                f"{entry.path} has {info.st_size} bytes, manifest says {entry.size}", check="sizes"
            )
    return None


def _check_headers(directory: Path, weights: list[Path]) -> str | None:
    for path in weights:
        try:
            with safe_open(str(path), framework="numpy"):
                pass
        except SafetensorError as exc:
            return f"{path.name}: {exc}"
    return None


def _hash_file(path: Path, entry: ManifestFile) -> str | None:
    hashers: dict[str, Callable[[], object]] = {}
    if entry.sha256:
        hashers["sha256"] = hashlib.sha256
    if entry.blake3:
        hashers["blake3"] = blake3.blake3
    states = {name: make() for name, make in hashers.items()}
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            for state in states.values():
                state.update(view[:n])  # type: ignore[attr-defined]
    for name, state in states.items():
        if state.hexdigest() != getattr(entry, name):  # type: ignore[attr-defined]
            return f"{entry.path}: {name} mismatch"
    return None


def _check_digests(directory: Path, manifest: Manifest, threads: int) -> str | None:
    todo = [e for e in manifest.files if e.sha256 or e.blake3]
    if not todo:
        return None
    # Largest first, so one big shard does not start last and finish alone.
    todo.sort(key=lambda e: e.size, reverse=True)
    with ThreadPoolExecutor(max_workers=min(threads, len(todo))) as pool:
        results = pool.map(lambda e: _hash_file(directory / e.path, e), todo)
        return next((r for r in results if r), None)


def check(
    directory: Path,
    *,
    serving: layout.Layout | None,
    options: GateOptions = GateOptions(),
    now: float | None = None,
) -> Verdict:
    """Judge one checkpoint directory. `serving=None` skips the layout comparison."""
    now = time.time() if now is None else now
    try:
        return _check(directory, serving, options, now)
    except FileNotFoundError as exc:
        return _pending(f"{Path(exc.filename or directory).name} disappeared while checking")
    except PermissionError as exc:
        return _rejected(f"cannot read {Path(exc.filename or directory).name}: permission denied", check="io")
    except OSError as exc:
        # Symlink loops, I/O errors, non-regular manifests: nothing a retry would fix.
        return _rejected(f"cannot read checkpoint: {exc.strerror or exc}", check="io")


def _check(directory: Path, serving: layout.Layout | None, options: GateOptions, now: float) -> Verdict:
    found = _read_manifest_bytes(directory)
    if found is None:
        return _pending("no manifest.json yet")
    data, mtime = found
    fp = fingerprint_of(data)
    try:
        manifest = parse_manifest(data)
    except ManifestNotJSON as exc:
        if now - mtime < options.manifest_grace:
            return _pending(f"{exc} (may still be written)", fingerprint=fp)
        return _rejected(str(exc), fingerprint=fp, check="manifest")
    except ManifestInvalid as exc:
        return _rejected(f"manifest: {exc}", fingerprint=fp, check="manifest")

    if problem := _check_paths(directory, manifest):
        return _rejected(problem, manifest, fp, check="paths")
    if size_verdict := _check_sizes(directory, manifest):
        return Verdict(size_verdict.status, size_verdict.reason, manifest, fp, size_verdict.details)
    weights = [directory / e.path for e in manifest.files if _is_weight(e.path)]
    if problem := _check_headers(directory, weights):
        return _rejected(problem, manifest, fp, check="headers")
    if serving is not None:
        try:
            candidate = layout.read_layout(directory, weights)
        except layout.LayoutUnreadable as exc:
            return _rejected(str(exc), manifest, fp, check="layout")
        if difference := layout.first_difference(candidate, serving):
            reason, tensor = difference
            return _rejected(
                f"layout differs from serving: {reason}", manifest, fp, check="layout", tensor=tensor
            )
    if options.verify_digests and (problem := _check_digests(directory, manifest, options.digest_threads)):
        return _rejected(problem, manifest, fp, check="digests")
    again = _read_manifest_bytes(directory)
    if again is None or fingerprint_of(again[0]) != fp:
        return _pending("manifest changed while it was being checked")
    return Verdict("ready", "", manifest, fp)
