"""The manifest: `ROOT/<version>/manifest.json`, written last by the producer.

Its arrival is the signal that a checkpoint is complete, so it must describe every file
the engine will read. The format is public (docs/design.md); `format_version` guards changes.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from typing import Any, Literal

import blake3
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ManifestInvalid, NotJSONYet
from .files import is_top_level_shard

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
MAX_STEP = 2**53
"""Steps are exported as a float metric: beyond this they would not be exact."""


class ManifestFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    path: str = Field(min_length=1)
    size: int = Field(ge=0)
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    blake3: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    format_version: Literal[1]
    version: str | None = Field(
        None, min_length=1, max_length=200, pattern=r"^[^./\x00-\x1f\x7f-\x9f][^/\x00-\x1f\x7f-\x9f]*$"
    )
    """Reported as the engine's weight version and in systemd's STATUS: no control characters."""
    step: int | None = Field(None, ge=-MAX_STEP, le=MAX_STEP)
    files: tuple[ManifestFile, ...] = Field(min_length=1)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def parse(data: bytes) -> Manifest:
    """Parse manifest bytes, raising `NotJSONYet` or `ManifestInvalid`."""
    try:
        return Manifest.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid" and "recursion limit" in first["msg"]:
            raise ManifestInvalid("manifest is nested too deeply") from exc
        if first["type"] in ("json_invalid", "json_type"):
            raise NotJSONYet(f"manifest is not valid JSON: {first['msg']}") from exc
        where = ".".join(str(p) for p in first["loc"]) or "manifest"
        if first["loc"] == ("format_version",) and first["type"] == "literal_error":
            raise ManifestInvalid(f"unknown format_version {first['input']!r}") from exc
        raise ManifestInvalid(f"{where}: {first['msg']}") from exc


def dumps(manifest: Manifest) -> bytes:
    return (manifest.model_dump_json(exclude_none=True, indent=1) + "\n").encode()


HASH_CHUNK = 16 << 20


def listed(fd: int, path: str) -> ManifestFile:
    """The entry for a file a producer just placed (`publish --move`, a converter's output):
    its size and blake3 from one read of `fd`, and the file fsynced before it is listed."""
    hasher, size = blake3.blake3(max_threads=blake3.blake3.AUTO), 0
    while chunk := os.read(fd, HASH_CHUNK):
        hasher.update(chunk)
        size += len(chunk)
    os.fsync(fd)
    return ManifestFile(path=path, size=size, blake3=hasher.hexdigest())


def hashers(entry: ManifestFile, threads: int = blake3.blake3.AUTO) -> dict[str, Any]:
    """A fresh hasher per digest the entry lists, to feed the file's bytes in order. blake3
    on `threads` threads (AUTO: all cores on big updates)."""
    found: dict[str, Any] = {}
    if entry.sha256:
        found["sha256"] = hashlib.sha256()
    if entry.blake3:
        found["blake3"] = blake3.blake3(max_threads=threads)
    return found


def digest_mismatch(entry: ManifestFile, fed: dict[str, Any]) -> str | None:
    for name, state in fed.items():
        if state.hexdigest() != getattr(entry, name):
            return f"{entry.path}: {name} mismatch"
    return None


def _unsafe_path(relative: str) -> str | None:
    """Why a manifest path may not be used, or None. Symlinks are checked where files are."""
    if relative.startswith("/"):
        return "is absolute"
    if "\x00" in relative or posixpath.normpath(relative) != relative:
        return "is not normalised"
    if ".." in relative.split("/"):
        return "leaves the checkpoint directory"
    if relative == MANIFEST_NAME:
        return "is the manifest itself"
    return None


def path_problem(manifest: Manifest) -> str | None:
    """What is wrong with a manifest's paths on their own, before any file is looked at
    (a directory's gate and a bucket's listing check the same)."""
    seen: set[str] = set()
    for entry in manifest.files:
        problem = _unsafe_path(entry.path) or ("is listed twice" if entry.path in seen else None)
        if problem:
            return f"path {entry.path!r} {problem}"
        seen.add(entry.path)
    if not any(is_top_level_shard(e.path) for e in manifest.files):
        return "manifest lists no .safetensors file"
    return None


def shards(manifest: Manifest) -> list[ManifestFile]:
    """The entries vLLM's loader reads."""
    return [e for e in manifest.files if is_top_level_shard(e.path)]
