"""The gate: proves a checkpoint directory is whole and loadable before the engine sees it.

vLLM's `reload_weights` kills the engine on a truncated shard or a shape mismatch, so
nothing passes here on a guess. `check` is a pure function of the directory, the layout
being served and the clock; its verdict is data:

- `ready`: every check passed; the engine may load it.
- `pending`: may still be being written (no manifest yet, a file missing or short, a
  manifest that is not JSON yet); check again later.
- `rejected`: can never become loadable as described; not retried unless the manifest
  bytes change (`fingerprint`).

What "whole" means depends on the writer (`completeness`: our manifest, HF's index, a
marker file); a NeMo `<name>-unfinished` next to the directory holds it pending in any mode.
Checks run cheapest first: schema, paths, sizes, safetensors headers, layout, digests,
then no NaN/Inf in any float tensor (`finite`).
Digests come last because they read every byte — which also warms the page cache right
before the engine reads the same bytes.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import blake3
from safetensors import SafetensorError, safe_open

from ..config import Config
from ..errors import LayoutUnreadable
from . import completeness, finite, layout
from .completeness import UNFINISHED_SUFFIX, Convention, DirectoryListing, Incomplete
from .files import is_top_level_shard
from .manifest import Manifest, ManifestFile, digest_mismatch, hashers, path_problem

__all__ = ["GateOptions", "Verdict", "check"]

Status = Literal["ready", "pending", "rejected"]
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
    check_finite: bool = True
    digest_threads: int = 4
    convention: Convention = field(default_factory=Convention)

    @classmethod
    def from_config(cls, config: Config) -> GateOptions:
        source = config.source
        return cls(
            verify_digests=config.gate.verify_digests,
            check_finite=config.gate.check_finite,
            digest_threads=config.gate.digest_threads,
            convention=Convention(
                mode=source.completeness,
                markers=source.markers,
                settle_seconds=source.settle_seconds,
                manifest_grace=source.manifest_grace,
            ),
        )


def _pending(reason: str, manifest: Manifest | None = None, fingerprint: str = "") -> Verdict:
    return Verdict("pending", reason, manifest, fingerprint)


def _rejected(
    reason: str, manifest: Manifest | None = None, fingerprint: str = "", **details: object
) -> Verdict:
    return Verdict("rejected", reason, manifest, fingerprint, details)


def _escapes(directory: Path, listing: DirectoryListing, manifest: Manifest) -> str | None:
    """A listed path that a symlink takes outside the directory, or an unlisted shard the
    engine would load anyway (vLLM's loader reads every top-level `*.safetensors`)."""
    root = os.path.realpath(directory)
    for entry in manifest.files:
        resolved = os.path.realpath(directory / entry.path)  # a loop resolves to itself; stat fails later
        if not resolved.startswith(root + os.sep):
            return f"path {entry.path!r} resolves outside the checkpoint directory (symlink)"
    weights = {e.path for e in manifest.files if is_top_level_shard(e.path)}
    for name in sorted(n for n in listing.top() if is_top_level_shard(n)):
        if name not in weights:
            return f"{name} is in the directory but not listed (the engine would load it)"
    return None


def _from_incomplete(found: Incomplete, manifest: Manifest | None = None, fingerprint: str = "") -> Verdict:
    if found.status == "pending":
        return _pending(found.reason, manifest, found.fingerprint or fingerprint)
    return _rejected(found.reason, manifest, found.fingerprint or fingerprint, check=found.check)


def _check_headers(directory: Path, weights: list[Path]) -> str | None:
    for path in weights:
        try:
            with safe_open(str(path), framework="numpy"):
                pass
        except SafetensorError as exc:
            return f"{path.name}: {exc}"
    return None


def _hash_file(path: Path, entry: ManifestFile) -> str | None:
    if entry.blake3 and not entry.sha256:
        # blake3 alone: its Rust side reads the mmap with all cores (~3x one thread, stream).
        state = blake3.blake3(max_threads=blake3.blake3.AUTO)
        state.update_mmap(path)
        return digest_mismatch(entry, {"blake3": state})
    states = hashers(entry)
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            for state in states.values():
                state.update(view[:n])
    return digest_mismatch(entry, states)


def _check_digests(directory: Path, manifest: Manifest, threads: int) -> str | None:
    todo = [e for e in manifest.files if e.sha256 or e.blake3]
    if not todo:
        return None
    # Largest first, so one big shard does not start last and finish alone.
    todo.sort(key=lambda e: e.size, reverse=True)
    with ThreadPoolExecutor(max_workers=min(threads, len(todo))) as pool:
        results = pool.map(lambda e: _hash_file(directory / e.path, e), todo)
        return next((r for r in results if r), None)


def _check_finite(weights: list[Path], threads: int) -> str | None:
    """After the digests, so it reads from a warm page cache."""
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(weights)))) as pool:
        for path, tensor in zip(weights, pool.map(finite.first_non_finite, weights), strict=True):
            if tensor is not None:
                return f"{path.name}: tensor {tensor} holds NaN or Inf values (a diverged run?)"
    return None


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
    unfinished = directory.with_name(directory.name + UNFINISHED_SUFFIX)
    if unfinished.exists():
        return _pending(f"{unfinished.name} is there: the trainer (NeMo) has not finished it")
    listing = DirectoryListing(directory)
    listed = completeness.describe(listing, options.convention, now)
    if isinstance(listed, Incomplete):
        return _from_incomplete(listed)
    manifest, fp = listed.manifest, listed.fingerprint
    if problem := path_problem(manifest) or _escapes(directory, listing, manifest):
        return _rejected(problem, manifest, fp, check="paths")
    if incomplete := completeness.check_files(listing, manifest):
        return _from_incomplete(incomplete, manifest, fp)
    weights = [directory / e.path for e in manifest.files if is_top_level_shard(e.path)]
    if problem := _check_headers(directory, weights):
        return _rejected(problem, manifest, fp, check="headers")
    if serving is not None:
        try:
            candidate = layout.read_layout(directory, weights)
        except LayoutUnreadable as exc:
            return _rejected(str(exc), manifest, fp, check="layout")
        if difference := layout.first_difference(candidate, serving):
            reason, tensor = difference
            return _rejected(
                f"layout differs from serving: {reason}", manifest, fp, check="layout", tensor=tensor
            )
    if options.verify_digests and (problem := _check_digests(directory, manifest, options.digest_threads)):
        return _rejected(problem, manifest, fp, check="digests")
    if options.check_finite and (problem := _check_finite(weights, options.digest_threads)):
        return _rejected(problem, manifest, fp, check="finite")
    if completeness.fingerprint(DirectoryListing(directory), options.convention) != fp:
        return _pending("checkpoint changed while it was being checked")
    return Verdict("ready", "", manifest, fp)
