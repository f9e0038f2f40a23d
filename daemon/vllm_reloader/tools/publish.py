"""The producer side: place a checkpoint into a root so that it appears whole or not at all,
and never destroy what this publish did not create. Into an object store: `tools.upload`.

Into a local root (`publish`): the publish that creates `ROOT/.incoming-NAME/` (a plain mkdir:
it fails if the directory exists) owns it, and only it ever removes it; one that finds it there
fails and touches nothing. Files go there (no candidate: a watching daemon only reads each
shard as it is closed or moved in), then each is fsynced; the manifest is written last and
fsynced; then one rename makes `ROOT/NAME` appear, and ROOT is fsynced so the rename survives
a crash. A failure puts `--move`d files back and removes the incoming directory.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import blake3

from ..checkpoint.files import header_in, is_top_level_shard
from ..checkpoint.manifest import MANIFEST_NAME, Manifest, ManifestFile, dumps, listed
from ..durable import fsync_dir, write_synced
from ..errors import LayoutUnreadable, PublishError

COPY_CHUNK = 8 << 20
KEPT_OPEN = 256
"""Copies whose descriptors are held for the sync at once, at most (the open-file limit)."""
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt")
"""Weights in a format the reload cannot take (pickled torch), named when no safetensors is there."""


def default_name(src: Path, step: int | None) -> str:
    return f"step-{step}" if step is not None else src.resolve().name


def source_files(src: Path) -> list[Path]:
    files = sorted(
        p
        for p in src.rglob("*")
        if p.is_file()
        and p.relative_to(src).as_posix() != MANIFEST_NAME
        and not any(part.startswith(".") for part in p.relative_to(src).parts)
    )
    if not files:
        raise PublishError(f"{src}: no files to publish")
    names = [p.relative_to(src).as_posix() for p in files]
    if not any(is_top_level_shard(name) for name in names):  # the gate would reject it: say so now
        others = [name for name in names if name.endswith(OTHER_WEIGHTS)]
        found = f" (found {', '.join(others[:3])}{', …' if len(others) > 3 else ''})" if others else ""
        raise PublishError(
            f"{src}: no .safetensors weights{found}, and the engine is reloaded from safetensors "
            "only: save with safetensors (save_pretrained(..., safe_serialization=True)) or convert them"
        )
    for path in files:
        if is_top_level_shard(path.relative_to(src).as_posix()):
            _check_whole(path)
    return files


def _check_whole(shard: Path) -> None:
    """A shard shorter than its header says (a copy cut short, a save still running) would be
    published and then rejected by every daemon's gate: refused here, before anything is written."""
    try:
        with shard.open("rb") as f:
            size, whole = os.fstat(f.fileno()).st_size, header_in(f.fileno(), shard.name).whole_size
    except (OSError, LayoutUnreadable) as exc:
        reason = exc.strerror or str(exc) if isinstance(exc, OSError) else str(exc)
        raise PublishError(
            f"{shard}: not a whole safetensors file ({reason}); publish it once written"
        ) from None
    if size < whole:
        raise PublishError(
            f"{shard}: {size} bytes where its header says {whole}: cut short (a copy or save not "
            "finished?); publish it once written"
        )


def copy_and_hash(src: Path, dst: Path) -> tuple[str, int, int]:
    """Copy one file; its blake3 and size from the same pass over the bytes, and a read-only
    descriptor of the copy, opened before the writer's is closed (see `_sync`)."""
    hasher, size = blake3.blake3(), 0
    with src.open("rb") as fin, dst.open("wb") as fout:
        while chunk := fin.read(COPY_CHUNK):
            hasher.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        kept = os.open(dst, os.O_RDONLY | os.O_CLOEXEC)
    return str(hasher.hexdigest()), size, kept


def _sync(kept: list[int]) -> None:
    """fsync copies through descriptors opened before their writers closed: the close is what
    tells a watching daemon to read a shard (so it verifies each while the disk takes the lot;
    syncing before the close made a 1 GB shard's whole hash wait for the manifest), and a
    descriptor open since then still hears of a write-back error (Linux syncs a file's dirty
    pages through any descriptor)."""
    try:
        for fd in kept:
            os.fsync(fd)
    finally:
        for fd in kept:
            os.close(fd)
        kept.clear()


def _renamed(src: Path, dst: Path) -> bool:
    """Moved by rename (same filesystem); False: the caller copies instead."""
    try:
        os.rename(src, dst)
    except OSError:
        return False
    return True


def _put_back(moved: list[Path], src: Path, incoming: Path) -> list[Path]:
    """Every moved file back where the trainer left it; returns those that could not be."""
    stranded = []
    for path in reversed(moved):
        try:
            os.rename(incoming / path.relative_to(src), path)
        except OSError:
            stranded.append(path)
    return stranded


def checked_name(name: str) -> str:
    if name.startswith(".") or "/" in name or name in ("", ".."):
        raise PublishError(f"{name!r}: not a valid version name")
    return name


def claim(root: Path, name: str) -> Path:
    """`ROOT/.incoming-NAME`, made by this publish: whoever creates it owns it, and only that
    publish ever removes it."""
    root.mkdir(parents=True, exist_ok=True)
    incoming = root / f".incoming-{name}"
    try:
        incoming.mkdir()
    except FileExistsError:
        raise PublishError(
            f"{incoming} exists: another publish of {name} is running or crashed (if none is running, "
            "its files are there, a --move's only copy: take what you need, remove it, publish again)"
        ) from None
    except OSError as exc:
        raise PublishError(f"publishing {name}: {exc.strerror or exc}") from exc
    return incoming


def commit(incoming: Path, final: Path, manifest: Manifest) -> None:
    """The manifest last, synced with its folders, then one rename makes the version appear."""
    write_synced(incoming / MANIFEST_NAME, dumps(manifest))
    for directory in (incoming, *(p for p in incoming.rglob("*") if p.is_dir() and not p.is_symlink())):
        fsync_dir(directory)
    try:
        os.rename(incoming, final)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):  # another publish of NAME won
            raise PublishError(f"{final} already exists; versions are never overwritten") from exc
        raise


def publish(
    src: Path, root: Path, *, name: str | None = None, step: int | None = None, move: bool = False
) -> Path:
    if not src.is_dir():
        raise PublishError(f"{src}: not a directory")
    name = checked_name(name or default_name(src, step))
    final = root / name
    if final.exists():
        raise PublishError(f"{final} already exists; versions are never overwritten")
    files = source_files(src)
    incoming = claim(root, name)
    entries: list[ManifestFile] = []
    moved: list[Path] = []  # renamed into incoming: put back on any failure (--move)
    copied: list[Path] = []
    kept: list[int] = []  # the copies' descriptors, synced together (at most KEPT_OPEN at a time)
    try:
        for path in files:
            relative = path.relative_to(src).as_posix()
            dst = incoming / relative
            dst.parent.mkdir(parents=True, exist_ok=True)
            if move and _renamed(path, dst):
                moved.append(path)
                with dst.open("rb") as f:
                    entry = listed(f.fileno(), relative)
            else:  # a copy (or a move across filesystems: the source goes once published)
                digest, size, fd = copy_and_hash(path, dst)
                entry = ManifestFile(path=relative, size=size, blake3=digest)
                kept.append(fd)
                copied.append(path)
                if len(kept) >= KEPT_OPEN:
                    _sync(kept)
            entries.append(entry)
        _sync(kept)
        commit(incoming, final, Manifest(format_version=1, version=name, step=step, files=tuple(entries)))
    except BaseException as exc:
        for fd in kept:
            os.close(fd)
        if stranded := _put_back(moved, src, incoming):  # never delete what could not go back
            raise PublishError(
                f"publishing {name} failed ({exc}); {len(stranded)} moved files could not be put back "
                f"and are still in {incoming}"
            ) from exc
        shutil.rmtree(incoming, ignore_errors=True)
        if isinstance(exc, OSError):
            raise PublishError(f"publishing {name}: {exc.strerror or exc}") from exc
        raise
    try:
        fsync_dir(root)
        for path in copied if move else ():
            path.unlink()
    except OSError as exc:
        raise PublishError(f"published {final}, but then: {exc.strerror or exc}") from exc
    return final
