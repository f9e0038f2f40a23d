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
from collections.abc import Collection, Mapping
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
# Besides the weights, the small files a serving directory needs (config, tokenizer, chat
# template). A trainer's optimizer state and RNG files are neither checked nor downloaded.
METADATA_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")


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


def is_top_level_shard(name: str) -> bool:
    """A shard name an index or a marker may point at: the engine loads only these."""
    return "/" not in name and not name.startswith(".") and name.endswith(WEIGHT_SUFFIX)


def wanted(name: str, convention: Convention) -> bool:
    """Is this top-level file part of a foreign writer's checkpoint, as far as serving goes?"""
    return name.endswith((WEIGHT_SUFFIX, *METADATA_SUFFIXES)) or name in convention.markers


def signal_name(names: Collection[str], convention: Convention) -> str | None:
    """The file whose arrival says a checkpoint is (or may be) complete, if it is there."""
    if convention.mode == "manifest":
        order: tuple[str, ...] = (MANIFEST_NAME,)
    elif convention.mode == "hf-index":
        order = (INDEX_NAME, SINGLE_NAME)
    else:
        order = convention.markers
    return next((name for name in order if name in names), None)


def listing_fingerprint(sizes: Mapping[str, int], signal: tuple[str, bytes] | None) -> str:
    """A foreign checkpoint's fingerprint: every wanted file's name and size, and the bytes of
    its index or marker. Computed alike from a directory and from an object listing, so a
    rejection made after a download is recognised before downloading it again."""
    parts = [f"{name}\0{size}" for name, size in sorted(sizes.items())]
    if signal is not None and signal[0] != SINGLE_NAME:
        parts.append(signal[1][:MAX_LISTING_BYTES].hex())
    return fingerprint_of("\n".join(parts).encode())


def fingerprint(directory: Path, convention: Convention) -> str:
    """What a rejection is remembered by: it is retried only once this changes."""
    if convention.mode == "manifest":
        found = _read_regular(directory / MANIFEST_NAME)
        return fingerprint_of(found[0]) if found else ""
    with os.scandir(directory) as entries:
        sizes = {
            e.name: e.stat(follow_symlinks=False).st_size
            for e in entries
            if e.is_file(follow_symlinks=False) and wanted(e.name, convention)
        }
    signal = signal_name(sizes, convention)
    return listing_fingerprint(sizes, (signal, (directory / signal).read_bytes()) if signal else None)


def weights_from_index(data: bytes) -> list[str] | str:
    """The shard names of an HF index, or why it cannot be used (not JSON: ValueError)."""
    index = json.loads(data)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        return f"{INDEX_NAME} has no weight_map"
    if not all(isinstance(v, str) and v for v in weight_map.values()):
        return f"{INDEX_NAME}: weight_map values must be file names"
    return sorted(set(weight_map.values()))


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
        weights = weights_from_index(data)
    except ValueError:
        if now - mtime < convention.manifest_grace:
            return Incomplete("pending", f"{INDEX_NAME} is not whole JSON yet (may still be written)", fp)
        return Incomplete("rejected", f"{INDEX_NAME} is not valid JSON", fp)
    return Incomplete("rejected", weights, fp) if isinstance(weights, str) else weights


def _marked_weights(directory: Path, convention: Convention, fp: str) -> list[str] | Incomplete:
    if not any((directory / name).is_file() for name in convention.markers):
        return Incomplete("pending", no_marker(convention), fp)
    return marked_weights([p.name for p in directory.glob("*" + WEIGHT_SUFFIX)], fp)


def no_marker(convention: Convention) -> str:
    return f"no completion marker ({', '.join(convention.markers)}) yet"


def marked_weights(names: Collection[str], fp: str) -> list[str] | Incomplete:
    weights = sorted(name for name in names if "/" not in name and name.endswith(WEIGHT_SUFFIX))
    if not weights:
        return Incomplete("rejected", "marked complete but holds no .safetensors file", fp)
    return weights


def _from_headers(directory: Path, weights: list[str], fp: str) -> Listed | Incomplete:
    """Each shard's whole size, as its own header declares it."""
    files = []
    for name in weights:
        path = directory / name
        if not is_top_level_shard(name):
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
