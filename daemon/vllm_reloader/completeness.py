"""When is a checkpoint directory whole? Our manifest says so, or the trainer's own convention.

`describe` turns a directory into the list of files the gate must check — our manifest,
or one worked out from what the trainer writes last — or says why it cannot yet:

- `manifest`: `manifest.json`, written last by `vllm-reloader publish` (or anyone).
- `hf-index`: HF `save_pretrained` writes its shards, then `model.safetensors.index.json`
  (not atomically: a half-written index is pending). Every shard in its `weight_map` must
  have a header that covers the file. A single `model.safetensors` without an index has no
  last-written file, so it must also have been quiet for `settle_seconds`.
- `marker`: a named file (Orbax's `commit_success.txt`, `_SUCCESS`, `COMPLETE`) marks the
  directory complete; every top-level `.safetensors` must have a header covering its file.

Synthesised lists carry each shard's size *as its header declares it*, so the gate's size
check turns a short shard into `pending` and an over-long one into `rejected`.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from . import layout
from .manifest import MANIFEST_NAME, Manifest, ManifestFile, ManifestInvalid, ManifestNotJSON
from .manifest import parse as parse_manifest

Mode = Literal["manifest", "hf-index", "marker"]
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
WEIGHT_SUFFIX = ".safetensors"
MAX_LISTING_BYTES = 16 << 20


@dataclass(frozen=True)
class Convention:
    mode: Mode = "manifest"
    markers: tuple[str, ...] = ("commit_success.txt", "_SUCCESS", "COMPLETE")
    settle_seconds: float = 30.0
    manifest_grace: float = 10.0
    """How long an unparsable manifest or index may be mid-write before it is rejected."""


@dataclass(frozen=True)
class Listed:
    manifest: Manifest
    fingerprint: str


@dataclass(frozen=True)
class Incomplete:
    status: Literal["pending", "rejected"]
    reason: str
    fingerprint: str = ""
    check: str = "manifest"
    """For `rejected`: which gate check failed (the metric's label)."""


def fingerprint_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_regular(path: Path) -> tuple[bytes, float] | None:
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode):
        raise IsADirectoryError(f"{path.name} is not a regular file")
    return path.read_bytes()[:MAX_LISTING_BYTES], info.st_mtime


def fingerprint(directory: Path, convention: Convention) -> str:
    """What a rejection is remembered by: it is retried only once this changes.

    The manifest's bytes; for a foreign writer, its index or marker plus the name and size
    of every top-level file (there is no one file that describes the checkpoint)."""
    if convention.mode == "manifest":
        found = _read_regular(directory / MANIFEST_NAME)
        return fingerprint_of(found[0]) if found else ""
    parts = []
    with os.scandir(directory) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.is_file(follow_symlinks=False):
                parts.append(f"{entry.name}\0{entry.stat(follow_symlinks=False).st_size}")
    names = {p.split("\0")[0] for p in parts}
    for special in (INDEX_NAME, *convention.markers):
        if special in names:
            parts.append((directory / special).read_bytes()[:MAX_LISTING_BYTES].hex())
    return fingerprint_of("\n".join(parts).encode())


def describe(directory: Path, convention: Convention, now: float) -> Listed | Incomplete:
    if convention.mode == "manifest":
        return _from_manifest(directory, convention, now)
    fp = fingerprint(directory, convention)
    if convention.mode == "hf-index":
        weights = _hf_weights(directory, convention, now, fp)
    else:
        weights = _marked_weights(directory, convention, fp)
    if isinstance(weights, Incomplete):
        return weights
    return _from_headers(directory, weights, fp)


def _from_manifest(directory: Path, convention: Convention, now: float) -> Listed | Incomplete:
    found = _read_regular(directory / MANIFEST_NAME)
    if found is None:
        return Incomplete("pending", "no manifest.json yet")
    data, mtime = found
    fp = fingerprint_of(data)
    try:
        return Listed(parse_manifest(data), fp)
    except ManifestNotJSON as exc:
        if now - mtime < convention.manifest_grace:
            return Incomplete("pending", f"{exc} (may still be written)", fp)
        return Incomplete("rejected", str(exc), fp)
    except ManifestInvalid as exc:
        return Incomplete("rejected", f"manifest: {exc}", fp)


def _hf_weights(directory: Path, convention: Convention, now: float, fp: str) -> list[str] | Incomplete:
    found = _read_regular(directory / INDEX_NAME)
    if found is None:
        if not (directory / SINGLE_NAME).exists():
            return Incomplete("pending", f"no {INDEX_NAME} or {SINGLE_NAME} yet", fp)
        quiet_for = now - max(
            [directory.stat().st_mtime] + [e.stat().st_mtime for e in os.scandir(directory)]
        )
        if quiet_for < convention.settle_seconds:
            return Incomplete(
                "pending",
                f"changed {quiet_for:.1f} s ago; a single {SINGLE_NAME} needs "
                f"{convention.settle_seconds:g} s of quiet",
                fp,
            )
        return [SINGLE_NAME]
    data, mtime = found
    try:
        index = json.loads(data)
    except ValueError:
        if now - mtime < convention.manifest_grace:
            return Incomplete("pending", f"{INDEX_NAME} is not whole JSON yet (may still be written)", fp)
        return Incomplete("rejected", f"{INDEX_NAME} is not valid JSON", fp)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        return Incomplete("rejected", f"{INDEX_NAME} has no weight_map", fp)
    if not all(isinstance(v, str) and v for v in weight_map.values()):
        return Incomplete("rejected", f"{INDEX_NAME}: weight_map values must be file names", fp)
    return sorted(set(weight_map.values()))


def _marked_weights(directory: Path, convention: Convention, fp: str) -> list[str] | Incomplete:
    if not any((directory / name).is_file() for name in convention.markers):
        return Incomplete("pending", f"no completion marker ({', '.join(convention.markers)}) yet", fp)
    weights = sorted(p.name for p in directory.glob("*" + WEIGHT_SUFFIX))
    if not weights:
        return Incomplete("rejected", "marked complete but holds no .safetensors file", fp)
    return weights


def _from_headers(directory: Path, weights: list[str], fp: str) -> Listed | Incomplete:
    """Each shard's whole size, as its own header declares it."""
    files = []
    for name in weights:
        path = directory / name
        if "/" in name or name.startswith(".") or not name.endswith(WEIGHT_SUFFIX):
            return Incomplete("rejected", f"shard {name!r} is not a top-level .safetensors file", fp, "paths")
        try:
            size = layout.file_size_from_header(path)
        except FileNotFoundError:
            return Incomplete("pending", f"{name} does not exist yet", fp)
        except layout.LayoutUnreadable as exc:
            return Incomplete("rejected", str(exc), fp, "headers")
        if size is None:
            return Incomplete("pending", f"{name}: header not fully written yet", fp)
        files.append(ManifestFile(path=name, size=size))
    return Listed(Manifest(format_version=1, files=tuple(files)), fp)
