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
DELTA_NAME = "delta/tensors.safetensors"
"""Not at the top: vLLM's loader reads every top-level `*.safetensors` as weights."""
MAX_CHAIN = 32
"""Deltas on deltas, at most; a longer chain is refused (publish a full version: an anchor)."""
DELTA_REFUSED = (
    "a delta version (docs/deltas.md): this release does not materialize deltas yet; publish "
    "the version whole"
)
MAX_STEP = 2**53
"""Steps are exported as a float metric: beyond this they would not be exact."""


class ManifestFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    path: str = Field(min_length=1)
    size: int = Field(ge=0)
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    blake3: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")


class DeltaTensor(BaseModel):
    """One tensor a delta version changes (`checkpoint.delta`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=1024)
    shard: str = Field(min_length=1)
    encoding: Literal["whole", "sparse"]
    blake3: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Of the bytes it produces: the tensor whole, as the full version holds it."""


class Delta(BaseModel):
    """What makes a manifest a delta version's: its base, and what changed since."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    base: str = Field(pattern=r"^[0-9a-f]{64}$")
    """The base's fingerprint (`base_fingerprint`): a full version, or one a delta produced."""
    base_version: str | None = Field(None, max_length=200)
    """Its name, for people: the fingerprint alone says which it is."""
    depth: int = Field(ge=1, le=MAX_CHAIN)
    """1 on a full version; one more than its base's on a delta's."""
    file: ManifestFile
    """`delta.safetensors`: the encodings."""
    tensors: tuple[DeltaTensor, ...]


class Manifest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    format_version: Literal[1]
    version: str | None = Field(
        None, min_length=1, max_length=200, pattern=r"^[^./\x00-\x1f\x7f-\x9f][^/\x00-\x1f\x7f-\x9f]*$"
    )
    """Reported as the engine's weight version and in systemd's STATUS: no control characters."""
    step: int | None = Field(None, ge=-MAX_STEP, le=MAX_STEP)
    files: tuple[ManifestFile, ...] = Field(min_length=1)
    """Every file of the version; a delta's: of the full version it produces."""
    delta: Delta | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def produced(self) -> Manifest:
        """The manifest of the full version a delta produces (itself, for a full version)."""
        return self if self.delta is None else self.model_copy(update={"delta": None})


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


def base_fingerprint(data: bytes) -> str:
    """What a delta names its base by: the fingerprint of the full version's manifest (a
    delta's: of the manifest it produces, as `dumps` writes it), alike wherever it is placed.
    Raises `NotJSONYet` or `ManifestInvalid`."""
    manifest = parse(data)
    return hashlib.sha256(data if manifest.delta is None else dumps(manifest.produced())).hexdigest()


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
    return None if manifest.delta is None else _delta_problem(manifest.delta, seen)


def _delta_problem(delta: Delta, paths: set[str]) -> str | None:
    if delta.file.path != DELTA_NAME:
        return f"delta.file {delta.file.path!r} is not {DELTA_NAME}"
    if DELTA_NAME in paths:
        return f"{DELTA_NAME} is listed as a file of the version it produces"
    named: set[str] = set()
    for tensor in delta.tensors:
        if tensor.shard not in paths or not is_top_level_shard(tensor.shard):
            return f"delta tensor {tensor.name!r}: shard {tensor.shard!r} is not one of the version's"
        if tensor.name in named:
            return f"delta tensor {tensor.name!r} is listed twice"
        named.add(tensor.name)
    return None


def shards(manifest: Manifest) -> list[ManifestFile]:
    """The entries vLLM's loader reads."""
    return [e for e in manifest.files if is_top_level_shard(e.path)]
