"""When is a checkpoint whole? Our manifest says so, or the trainer's own convention.

`describe` turns a checkpoint into the list of files the gate must check — our manifest,
or one worked out from what the trainer writes last — or says why it cannot yet. It reads
a `Listing`: names, sizes and times of the files, and their bytes on demand. A local
directory (`DirectoryListing`) and an object-store listing (`sources.remote`) both provide
one, so a checkpoint is judged the same wherever it sits.

- `auto` (the default): whichever of these the checkpoint shows, in this order — our
  `manifest.json`; a marker; HF Trainer's `trainer_state.json` (written last; a checkpoint
  with Trainer's other files but not it yet waits for it); HF's index; a lone
  `model.safetensors` whose header accounts for its size, once the directory has been quiet
  for `settle_seconds` (save_pretrained and `cp` write it front to back; the quiet lets a
  manifest written in place after it win). A downloader's partial file beside it
  (`*.aria2`, `*.part`, ...) keeps it waiting; a writer that preallocates must publish
  with a manifest, and one that writes our manifest in place, index and all, should set
  `manifest`: its weights would otherwise load at the index, then again, verified, at the
  manifest. Its content is the names and sizes of its weight files, index and config.json,
  whichever rule applied: a tokenizer or trainer_state.json written after the weights does
  not make it new content (weights rewritten in place at the same sizes are not new content
  either: write a new directory). While no rule applies it has none (fingerprint "").
- `manifest`: `manifest.json`, written last by `vllm-reloader publish` (or anyone).
- `hf-index`: HF `save_pretrained` writes its shards, then `model.safetensors.index.json`
  (not atomically: a half-written index is pending). Every shard in its `weight_map` must
  have a header that covers the file. A single `model.safetensors` without an index has no
  last-written file, so it must also have been quiet for `settle_seconds`.
- `marker`: a named file (Orbax's `commit_success.txt`, `_SUCCESS`, `COMPLETE`) marks the
  checkpoint complete; every top-level `.safetensors` must have a header covering its file.

Synthesised lists carry each shard's size *as its header declares it*, so the size check
turns a short shard into `pending` and an over-long one into `rejected`.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal, Protocol

from ..errors import LayoutUnreadable, ManifestInvalid, NotJSONYet, ReloaderError
from . import order
from .conventions import (
    CONTENT_METADATA,
    MEGATRON_LEGACY_FILE,
    TRACKERS,
    TRAINER_STATE,
    Convention,
    Foreign,
    foreign,
    name_says_step,
    name_step,
    resolved,
    signal_name,
    trainer_step,
    waiting_reason,
    wanted,
)
from .files import (
    INDEX_NAME,
    SINGLE_NAME,
    WEIGHT_SUFFIX,
    Identity,
    is_top_level_shard,
    open_regular,
    read_small,
    size_from_header,
    weights_from_index,
)
from .files import identity as identity_of
from .manifest import MANIFEST_NAME, Manifest, ManifestFile
from .manifest import parse as parse_manifest

MAX_LISTING_BYTES = 16 << 20
"""A completing file (manifest, index, marker) is read up to this size."""


@dataclass(frozen=True)
class Entry:
    size: int
    mtime: float
    regular: bool = True
    identity: Identity | None = None
    """On a filesystem: what the gate verifies and later readers compare."""


class Listing(Protocol):
    """What `describe` needs of a checkpoint, wherever it is."""

    def top(self) -> Mapping[str, Entry]:
        """Files directly in the checkpoint (not directories), by name."""

    def entry(self, path: str) -> Entry | None:
        """Any file by its relative path; None when it is not there."""

    def whole(self, name: str) -> bytes:
        """A small top-level file's bytes (manifest, index, marker), at most MAX_LISTING_BYTES."""

    def shard_size(self, name: str) -> int | None:
        """The size a shard has when whole, from its header; None while the header is not
        all there. Raises `LayoutUnreadable`."""

    def last_change(self) -> float:
        """When anything in the checkpoint last changed (for a writer with no last file)."""


@dataclass(frozen=True)
class Listed:
    manifest: Manifest
    """The files the engine reads (all of them, for our own manifest)."""
    fingerprint: str
    extras: tuple[ManifestFile, ...] = ()
    """A foreign writer's small metadata files (config, tokenizer): not checked by the
    gate, but downloaded with the weights."""


@dataclass(frozen=True)
class Incomplete:
    status: Literal["pending", "rejected"]
    reason: str
    fingerprint: str = ""
    check: str = "manifest"
    """For `rejected`: which gate check failed (the metric's label)."""
    convert: str = ""
    """`pending` on a trainer's own format that is whole: the format a converter takes."""

    @property
    def details(self) -> dict[str, object]:
        return {"convert": self.convert} if self.convert else {}


def fingerprint_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _wanted_files(listing: Listing, convention: Convention) -> dict[str, Entry]:
    return {n: e for n, e in listing.top().items() if e.regular and wanted(n, convention)}


def fingerprint(listing: Listing, convention: Convention) -> str:
    """What a rejection is remembered by: it is retried only once this changes. Ours: the
    manifest's bytes. A foreign writer's: every wanted file's name and size, and the bytes
    of its index or marker — alike for a directory and a bucket, so a rejection made after
    a download is recognised before downloading again."""
    concrete = resolved(listing.top(), convention)
    if concrete.mode == "manifest":
        return fingerprint_of(listing.whole(MANIFEST_NAME)) if MANIFEST_NAME in listing.top() else ""
    if concrete.mode == "auto":  # nothing says it is complete yet: no content, but a trainer's own format's
        return found[1] if (found := foreign_content(listing, convention)) else ""
    files = _wanted_files(listing, convention)
    if convention.mode == "auto":  # see the module's docstring
        files = {n: e for n, e in files.items() if is_top_level_shard(n) or n in CONTENT_METADATA}
        signal = None
    else:
        signal = signal_name(files, convention)
    parts = [f"{name}\0{entry.size}" for name, entry in sorted(files.items())]
    if signal is not None and signal != SINGLE_NAME:
        parts.append(listing.whole(signal).hex())
    return fingerprint_of("\n".join(parts).encode())


def candidate(name: str, listing: Listing, convention: Convention) -> order.Candidate:
    """Name, step and fingerprint: enough to order candidates without gating them.
    A manifest's step is ours; a trainer's checkpoint has its own (`trainer_step`), also while
    written (waited for as newer); a trainer's own format, its converted output's (`name_step`)."""
    try:
        fp = fingerprint(listing, convention)
    except OSError:
        return order.Candidate(name, None, "")
    step = None
    mode = resolved(listing.top(), convention).mode
    if fp and mode == "manifest":
        try:
            step = parse_manifest(listing.whole(MANIFEST_NAME)).step
        except (OSError, NotJSONYet, ManifestInvalid):
            step = None
    elif fp and mode == "auto":  # nothing else says it is whole: a trainer's own format
        step = name_step(order.base_name(name))
    elif mode != "manifest":  # whole or still written: a `checkpoint-N` waited for is newer
        step = _trainer_step(name, listing)
    return order.Candidate(name, step, fp)


def _trainer_step(name: str, listing: Listing) -> int | None:
    """A trainer's checkpoint in the root: its own step (`trainer_step`); its trainer_state.json
    (bounded; on a store, a GET at each rescan) read only when the name says none."""
    base = order.base_name(name)
    if (named := name_says_step(base)) is not None:
        return named
    try:
        state = listing.whole(TRAINER_STATE) if TRAINER_STATE in listing.top() else b""
    except (OSError, ReloaderError):  # gone, too big, a store that failed: no step from it
        state = b""
    return trainer_step(base, state)


def describe(listing: Listing, convention: Convention, now: float) -> Listed | Incomplete:
    concrete = resolved(listing.top(), convention)
    if concrete.mode == "manifest":
        return _from_manifest(listing, concrete, now)
    if concrete.mode == "auto":  # nothing says it is whole; its content is a trainer's own format's
        return _foreign(listing, convention) or Incomplete("pending", waiting_reason(listing.top()))
    fp = fingerprint(listing, convention)
    if concrete.mode == "hf-index":
        weights = _hf_weights(listing, concrete, now, fp)
    elif any(name in listing.top() for name in concrete.markers):
        # The marker says "judge now"; an index still says which shards (a copy may bring the
        # marker before the last shard).
        indexed = INDEX_NAME in listing.top()
        weights = _hf_weights(listing, concrete, now, fp) if indexed else marked_weights(listing.top(), fp)
    else:
        weights = Incomplete("pending", f"no completion marker ({', '.join(concrete.markers)}) yet", fp)
    if isinstance(weights, Incomplete):
        return weights
    return _from_headers(listing, concrete, weights, fp)


def _foreign(listing: Listing, convention: Convention) -> Incomplete | None:
    """A trainer's own format (`conventions.foreign`): pending, with `convert` once it is whole."""
    found = foreign_content(listing, convention)
    if found is None:
        return None
    (what, fp) = found
    return Incomplete("pending", what.reason, fp, convert=what.format if what.complete else "")


def foreign_content(listing: Listing, convention: Convention) -> tuple[Foreign, str] | None:
    """In a directory: a trainer's own format, and its content — every file's name, size and
    time, and the root's trackers (a rejected conversion is not run again on the same)."""
    if not isinstance(listing, DirectoryListing):
        return None
    name, trackers = listing.beside()
    try:
        legacy = listing.entry(MEGATRON_LEGACY_FILE)
    except OSError:  # `mp_rank_00` is a file, or unreadable: not that layout
        legacy = None
    found = foreign(
        name, listing.top(), trackers=trackers, legacy=legacy is not None, converter=convention.converter
    )
    if found is None:
        return None
    files = {**listing.top(), **({MEGATRON_LEGACY_FILE: legacy} if legacy is not None else {})}
    parts = [f"{n}\0{e.size}\0{e.mtime!r}" for n, e in sorted(files.items())]
    parts += [f"{n}\0{text}" for n, text in sorted(trackers.items())]
    return found, fingerprint_of("\n".join(parts).encode())


def _from_manifest(listing: Listing, convention: Convention, now: float) -> Listed | Incomplete:
    found = listing.top().get(MANIFEST_NAME)
    if found is None:
        return Incomplete("pending", "no manifest.json yet")
    data = listing.whole(MANIFEST_NAME)
    fp = fingerprint_of(data)
    try:
        return Listed(parse_manifest(data), fp)
    except NotJSONYet as exc:
        if now - found.mtime < convention.manifest_grace:
            return Incomplete("pending", f"{exc} (may still be written)", fp)
        return Incomplete("rejected", str(exc), fp)
    except ManifestInvalid as exc:
        return Incomplete("rejected", f"manifest: {exc}", fp)


def _hf_weights(listing: Listing, convention: Convention, now: float, fp: str) -> list[str] | Incomplete:
    top = listing.top()
    index = top.get(INDEX_NAME)
    if index is None:
        if SINGLE_NAME not in top:
            return Incomplete("pending", f"no {INDEX_NAME} or {SINGLE_NAME} yet", fp)
        quiet_for = now - listing.last_change()
        if quiet_for < convention.settle_seconds:
            return Incomplete(
                "pending",
                f"changed {quiet_for:.1f} s ago; a single {SINGLE_NAME} needs "
                f"{convention.settle_seconds:g} s of quiet to settle",
                fp,
            )
        return [SINGLE_NAME]
    try:
        weights = weights_from_index(listing.whole(INDEX_NAME))
    except NotJSONYet:
        if now - index.mtime < convention.manifest_grace:
            return Incomplete("pending", f"{INDEX_NAME} is not whole JSON yet (may still be written)", fp)
        return Incomplete("rejected", f"{INDEX_NAME} is not valid JSON", fp)
    return Incomplete("rejected", weights, fp) if isinstance(weights, str) else weights


def marked_weights(names: Collection[str], fp: str) -> list[str] | Incomplete:
    weights = sorted(name for name in names if "/" not in name and name.endswith(WEIGHT_SUFFIX))
    if not weights:
        return Incomplete("rejected", "marked complete but holds no .safetensors file", fp)
    return weights


def _from_headers(
    listing: Listing, convention: Convention, weights: list[str], fp: str
) -> Listed | Incomplete:
    """Each shard's whole size, as its own header declares it."""
    files = []
    top = listing.top()
    for name in weights:
        if not is_top_level_shard(name):
            return Incomplete("rejected", f"shard {name!r} is not a top-level .safetensors file", fp, "paths")
        if name not in top:
            return Incomplete("pending", f"{name} does not exist yet", fp)
        try:
            size = listing.shard_size(name)
        except LayoutUnreadable as exc:
            return Incomplete("rejected", str(exc), fp, "headers")
        if size is None:
            return Incomplete("pending", f"{name}: header not fully written yet", fp)
        files.append(ManifestFile(path=name, size=size))
    signal = signal_name(top, convention)
    extras = tuple(
        ManifestFile(path=name, size=entry.size)
        for name, entry in sorted(_wanted_files(listing, convention).items())
        if name not in weights and name != signal
    )
    return Listed(Manifest(format_version=1, files=tuple(files)), fp, extras)


def check_files(listing: Listing, manifest: Manifest) -> Incomplete | None:
    """Every listed file is there at exactly its size: missing or short → pending (a writer
    may still be at it), longer or not a regular file → rejected."""
    for item in manifest.files:
        found = listing.entry(item.path)
        if found is None:
            return Incomplete("pending", f"{item.path} does not exist yet")
        if not found.regular:
            return Incomplete("rejected", f"{item.path} is not a regular file", check="sizes")
        if found.size < item.size:
            return Incomplete("pending", f"{item.path} has {found.size} of {item.size} bytes")
        if found.size > item.size:
            return Incomplete(
                "rejected", f"{item.path} has {found.size} bytes, manifest says {item.size}", check="sizes"
            )
    return None


def _entry(info: os.stat_result) -> Entry:
    return Entry(info.st_size, info.st_mtime, stat.S_ISREG(info.st_mode), identity_of(info))


class DirectoryListing:
    """A checkpoint directory on a local (or mounted) filesystem, listed once. Nothing is
    followed through a symlink: a symlinked file is not a regular file here."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @cached_property
    def _top(self) -> dict[str, Entry]:
        found = {}
        with os.scandir(self.directory) as entries:
            for item in entries:
                info = item.stat(follow_symlinks=False)
                if not stat.S_ISDIR(info.st_mode):
                    found[item.name] = _entry(info)
        return found

    def top(self) -> Mapping[str, Entry]:
        return self._top

    def entry(self, path: str) -> Entry | None:
        try:
            return _entry(os.lstat(self.directory / path))
        except FileNotFoundError:
            return None

    def whole(self, name: str) -> bytes:
        return read_small(self.directory / name, MAX_LISTING_BYTES)

    def shard_size(self, name: str) -> int | None:
        fd = open_regular(self.directory / name)
        try:
            size = os.fstat(fd).st_size
            return size_from_header(name, lambda start, end: os.pread(fd, end - start, start), size)
        finally:
            os.close(fd)

    def beside(self) -> tuple[str, dict[str, str]]:
        """Its name, and the trainers' tracker files in the root beside it (regular, small)."""
        trackers = {}
        for tracker in TRACKERS:
            try:
                trackers[tracker] = read_small(self.directory.parent / tracker, 4096).decode(errors="replace")
            except (OSError, ValueError):
                continue  # not there, not a regular file, too long: no tracker
        return self.directory.name, trackers

    def last_change(self) -> float:
        times = [self.directory.stat().st_mtime]
        with os.scandir(self.directory) as entries:
            times += [item.stat(follow_symlinks=False).st_mtime for item in entries]
        return max(times)
