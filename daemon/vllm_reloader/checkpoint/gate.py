"""The gate: proves a checkpoint directory is whole and loadable before the engine sees it.

vLLM's `reload_weights` kills the engine on a truncated shard or a shape mismatch, so
nothing passes here on a guess. `check` is a function of the directory, the layout being
served and the clock; its verdict is data:

- `ready`: every check passed; the engine may load it — exactly these bytes: the verdict
  carries each file's identity (device, inode, size, mtime, ctime), and whoever reads the
  files later (the daemon before the pause and after the load, the worker extension while
  it reads) compares them first.
- `pending`: may still be being written (no manifest yet, a file missing or short, a
  manifest that is not JSON yet, a file that changed while it was read), or a file the
  daemon may not read (`details["unreadable"]`: permissions get fixed); check again later.
- `rejected`: can never become loadable as described; not retried unless its content
  (`fingerprint`: the manifest's bytes, or what `completeness` takes for a foreign writer's)
  changes.

"Whole" depends on the writer (`completeness`: our manifest, HF's index, a marker, `auto`);
a NeMo `<name>-unfinished` next to the directory holds it pending in any mode.
Checks run cheapest first: schema, paths, sizes, safetensors headers, layout, then one read
of every byte for the digests and the NaN/Inf scan together (`scan`), warming the page cache
for the engine. Any other error rejects that checkpoint (check `internal`); none escapes.
"""

from __future__ import annotations

import os
import pwd
import stat
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..config import Config
from ..errors import LayoutUnreadable, NotJSONYet
from . import completeness, conventions, layout, scan
from .completeness import DirectoryListing, Incomplete, Listing
from .conventions import UNFINISHED_SUFFIX, Convention
from .files import (
    INDEX_NAME,
    RACY_NS,
    Header,
    Identity,
    TooManyTensors,
    header_in,
    header_totals,
    is_top_level_shard,
    layout_problem,
    open_regular,
    read_header,
    reader,
    weights_from_index,
)
from .manifest import DELTA_REFUSED, Manifest, ManifestFile, path_problem
from .scan import Run as Run

__all__ = ["GateOptions", "Verdict", "check"]

Status = Literal["ready", "pending", "rejected"]

LAYOUT_DIFFERS = "layout differs from serving"
"""How a rejection for another model's layout begins (its fix: train from the served model)."""


@dataclass(frozen=True)
class Verdict:
    status: Status
    reason: str = ""
    manifest: Manifest | None = None
    fingerprint: str = ""
    """sha256 of the manifest bytes the verdict was reached on."""
    details: dict[str, object] = field(default_factory=dict)
    files: Mapping[str, Identity] = field(default_factory=dict)
    """`ready`: every file read (listed files and the one that says it is complete) as verified."""

    @property
    def bytes(self) -> int:
        return self.manifest.total_bytes if self.manifest else 0


@dataclass(frozen=True)
class GateOptions:
    verify_digests: bool = True
    check_finite: bool = True
    digest_threads: int = 4
    convention: Convention = field(default_factory=Convention)
    max_header_bytes: int = 256 << 20
    """The shards' safetensors headers together, as their 8-byte prefixes declare them (see
    `config.GateConfig`): over it, none is read."""
    max_tensors: int = 1_000_000
    """Tensors listed by the shards' headers together, counted while they are parsed."""

    @classmethod
    def from_config(cls, config: Config) -> GateOptions:
        source = config.source
        return cls(
            verify_digests=config.gate.verify_digests,
            check_finite=config.gate.check_finite,
            digest_threads=config.gate.digest_threads,
            max_header_bytes=config.gate.max_header_bytes,
            max_tensors=config.gate.max_tensors,
            convention=Convention(
                mode=source.completeness,
                markers=source.markers,
                settle_seconds=source.settle_seconds,
                manifest_grace=source.manifest_grace,
                converter=bool(source.converter),
            ),
        )


def _pending(reason: str, manifest: Manifest | None = None, fp: str = "", **details: object) -> Verdict:
    return Verdict("pending", reason, manifest, fp, details)


def _unreadable(directory: Path, path: Path) -> Verdict:
    """Pending on a file the daemon may not read, naming what an operator needs to fix it."""
    where = path.relative_to(directory).as_posix() if path.is_relative_to(directory) else path.name
    try:
        found = os.stat(path, follow_symlinks=False)
        owner, mode = _user(found.st_uid), f"{stat.S_IMODE(found.st_mode):04o}"
    except OSError:
        owner, mode = "unknown", "unknown"
    reason = f"cannot read {where or '.'}: permission denied (owner {owner}, mode {mode})"
    return _pending(reason, unreadable=where or ".", owner=owner, mode=mode)


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


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
        return _pending(found.reason, manifest, found.fingerprint or fingerprint, **found.details)
    return _rejected(found.reason, manifest, found.fingerprint or fingerprint, check=found.check)


def _bounds_problem(directory: Path, shards: list[str], options: GateOptions) -> str | None:
    """Whether the shards' headers are over the bounds, found before any is parsed (see
    `files.header_totals`). Raises `LayoutUnreadable` for a header no safetensors file has."""
    size, tensors = header_totals(directory, shards, options.max_header_bytes, options.max_tensors)
    if size > options.max_header_bytes:
        return (
            f"the safetensors headers of {len(shards)} shards declare {size} bytes in all, more than "
            f"[gate] max_header_bytes = {options.max_header_bytes}: none was read"
        )
    return _too_many(options) + ": none was parsed" if tensors > options.max_tensors else None


def _too_many(options: GateOptions) -> str:
    return f"the shards' headers list more than [gate] max_tensors = {options.max_tensors} tensors in all"


def _headers(directory: Path, manifest: Manifest, options: GateOptions) -> dict[str, Header] | str:
    """Each shard's header, refused where safetensors would refuse it (read, never mapped),
    within the bounds: checked before any is parsed, the tensors counted again while parsing."""
    shards = [item for item in manifest.files if is_top_level_shard(item.path)]
    found, left = {}, options.max_tensors
    try:
        if problem := _bounds_problem(directory, [item.path for item in shards], options):
            return problem
        for item in shards:
            fd = open_regular(directory / item.path)
            try:
                header = header_in(fd, item.path, left)
            finally:
                os.close(fd)
            if problem := layout_problem(item.path, header, item.size):
                return problem
            found[item.path], left = header, left - len(header.tensors)
    except TooManyTensors as exc:  # past the count before parsing: keys written with escapes
        return f"{exc.file_name}: {_too_many(options)}"
    except LayoutUnreadable as exc:
        return str(exc)
    return found


class _Bounded(DirectoryListing):
    """A directory whose shards' sizes, where `describe` takes them from their headers (a
    foreign writer's), are read within the bounds, as `_headers` reads them."""

    def __init__(self, directory: Path, options: GateOptions) -> None:
        super().__init__(directory)
        self.options = options
        self._left: int | None = None

    def shard_size(self, name: str) -> int | None:
        if self._left is None:
            shards = sorted(n for n, e in self.top().items() if e.regular and is_top_level_shard(n))
            if problem := _bounds_problem(self.directory, shards, self.options):
                raise LayoutUnreadable(problem)
            self._left = self.options.max_tensors
        fd = open_regular(self.directory / name)
        try:
            header = read_header(name, reader(fd), os.fstat(fd).st_size, self._left)
        except TooManyTensors as exc:
            raise LayoutUnreadable(f"{exc.file_name}: {_too_many(self.options)}") from None
        finally:
            os.close(fd)
        if header is None:
            return None
        self._left -= len(header.tensors)
        return header.whole_size


def _index_problem(listing: Listing, manifest: Manifest) -> str | None:
    """vLLM's loader reads only the shards an HF index names, and trusts its names: an index
    in the directory must be listed and name exactly the listed shards."""
    if INDEX_NAME not in listing.top():
        return None
    listed = {e.path for e in manifest.files}
    if INDEX_NAME not in listed:
        return f"{INDEX_NAME} is in the directory but not listed (the engine would follow it)"
    try:
        names = weights_from_index(listing.whole(INDEX_NAME))
    except NotJSONYet as exc:
        return str(exc)
    if isinstance(names, str):
        return names
    shards = {p for p in listed if is_top_level_shard(p)}
    if set(names) != shards:
        return f"{INDEX_NAME} names {sorted(names)}, the listed shards are {sorted(shards)}"
    return None


def _settled(directory: Path, options: GateOptions) -> DirectoryListing:
    """The listing, taken once no file's last change is within a timestamp tick of now."""
    listing = _Bounded(directory, options)
    newest = max((e.identity[4] for e in listing.top().values() if e.identity), default=0)
    if (wait_ns := newest + RACY_NS - time.time_ns()) <= 0:
        return listing
    time.sleep(min(wait_ns, RACY_NS) / 1e9)
    return _Bounded(directory, options)


def check(
    directory: Path,
    *,
    serving: layout.Layout | None,
    options: GateOptions = GateOptions(),
    now: float | None = None,
    run: Run | None = None,
) -> Verdict:
    """Judge one checkpoint directory. `serving=None` skips the layout comparison. Called off
    through `run.cancel`, the verdict is pending with `details["cancelled"]`."""
    now = time.time() if now is None else now
    run = run or Run(threads=options.digest_threads)
    try:
        return _check(directory, serving, options, now, run)
    except FileNotFoundError as exc:
        return _pending(f"{Path(exc.filename or directory).name} disappeared while checking")
    except PermissionError as exc:  # fixable by whoever owns it: checked again, never rejected
        return _unreadable(directory, Path(exc.filename or directory))
    except OSError as exc:
        # Symlink loops, I/O errors, special files: nothing a retry would fix.
        where = Path(exc.filename).name if exc.filename else "checkpoint"
        return _rejected(f"cannot read {where}: {exc.strerror or exc}", check="io")
    except Exception as exc:  # a bug, or an input nobody thought of: this checkpoint only
        return _rejected(
            f"internal error while checking: {type(exc).__name__}: {exc}"[:500],
            fingerprint=_fingerprint_or_empty(directory, options.convention),
            check="internal",
            traceback=traceback.format_exc(),
        )


def _fingerprint_or_empty(directory: Path, convention: Convention) -> str:
    try:
        return completeness.fingerprint(DirectoryListing(directory), convention)
    except Exception:
        return ""


def _check(
    directory: Path, serving: layout.Layout | None, options: GateOptions, now: float, run: Run
) -> Verdict:
    if not stat.S_ISDIR(os.lstat(directory).st_mode):
        return _rejected(
            f"{directory.name} is not a directory (a symlink is never a checkpoint)", check="paths"
        )
    unfinished = directory.with_name(directory.name + UNFINISHED_SUFFIX)
    if unfinished.exists():
        return _pending(f"{unfinished.name} is there: the trainer (NeMo) has not finished it")
    listing = _settled(directory, options)
    listed = completeness.describe(listing, options.convention, now)
    if isinstance(listed, Incomplete):
        return _from_incomplete(listed)
    manifest, fp = listed.manifest, listed.fingerprint
    if manifest.delta is not None:
        return _rejected(DELTA_REFUSED, manifest, fp, check="manifest")
    if problem := path_problem(manifest) or _escapes(directory, listing, manifest):
        return _rejected(problem, manifest, fp, check="paths")
    if incomplete := completeness.check_files(listing, manifest):
        return _from_incomplete(incomplete, manifest, fp)
    ours = conventions.resolved(listing.top(), options.convention).mode == "manifest"
    if ours and (problem := _index_problem(listing, manifest)):
        return _rejected(problem, manifest, fp, check="paths")
    headers = _headers(directory, manifest, options)
    if isinstance(headers, str):
        return _rejected(headers, manifest, fp, check="headers")
    if serving is not None:
        try:
            candidate = layout.from_headers(headers.values(), layout.read_arch(directory))
        except LayoutUnreadable as exc:
            return _rejected(str(exc), manifest, fp, check="layout")
        if difference := layout.first_difference(candidate, serving):
            reason, tensor = difference
            return _rejected(f"{LAYOUT_DIFFERS}: {reason}", manifest, fp, check="layout", tensor=tensor)
    files = _identities(listing, manifest, options.convention)
    scanned = headers if options.check_finite else {}
    checked = [
        i if options.verify_digests else ManifestFile(path=i.path, size=i.size) for i in manifest.files
    ]
    work = [
        scan.Work(item, files[item.path], scanned.get(item.path))
        for item in checked
        if item.sha256 or item.blake3 or item.path in scanned
    ]
    if (found := scan.read_all(directory, work, run)) is not None:
        if found.check == "cancelled":
            return Verdict("pending", found.reason, manifest, fp, {"cancelled": True})
        if found.check == "changed":
            return _pending(found.reason, manifest, fp)
        return _rejected(found.reason, manifest, fp, check=found.check)
    again = DirectoryListing(directory)
    if (
        completeness.fingerprint(again, options.convention) != fp
        or _identities(again, manifest, options.convention) != files
    ):
        return _pending("checkpoint changed while it was being checked")
    return Verdict("ready", "", manifest, fp, files=files)


def _identities(listing: Listing, manifest: Manifest, convention: Convention) -> dict[str, Identity]:
    """Every listed file's identity, and that of the file that says it is complete."""
    found: dict[str, Identity] = {}
    signal = conventions.signal_name(listing.top(), convention)
    for path in [item.path for item in manifest.files] + ([signal] if signal else []):
        entry = listing.entry(path)
        if entry is None or entry.identity is None:
            raise FileNotFoundError(2, "No such file or directory", path)
        found[path] = entry.identity
    return found
