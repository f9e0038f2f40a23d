"""The manifest: `ROOT/<version>/manifest.json`, written last by the producer.

Its arrival is the signal that a checkpoint is complete, so it must describe every file
the engine will read. The format is public (see README); `format_version` guards changes.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import blake3
from pydantic import BaseModel, ConfigDict, Field, ValidationError

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


class ManifestFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    path: str = Field(min_length=1)
    size: int = Field(ge=0)
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    blake3: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    format_version: Literal[1]
    version: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[^./\x00][^/\x00]*$")
    step: int | None = None
    files: tuple[ManifestFile, ...] = Field(min_length=1)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class ManifestNotJSON(ValueError):
    """The bytes are not JSON (yet): the producer may still be writing them."""


class ManifestInvalid(ValueError):
    """The JSON is whole but breaks the schema: final until the manifest changes."""


def parse(data: bytes) -> Manifest:
    """Parse manifest bytes, raising `ManifestNotJSON` or `ManifestInvalid`."""
    try:
        return Manifest.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] in ("json_invalid", "json_type"):
            raise ManifestNotJSON(f"manifest is not valid JSON: {first['msg']}") from exc
        where = ".".join(str(p) for p in first["loc"]) or "manifest"
        if first["loc"] == ("format_version",) and first["type"] == "literal_error":
            raise ManifestInvalid(f"unknown format_version {first['input']!r}") from exc
        raise ManifestInvalid(f"{where}: {first['msg']}") from exc


def dumps(manifest: Manifest) -> bytes:
    return (manifest.model_dump_json(exclude_none=True, indent=1) + "\n").encode()


def hashers(entry: ManifestFile) -> dict[str, Any]:
    """A fresh hasher per digest the entry lists, to feed the file's bytes in order."""
    found: dict[str, Any] = {}
    if entry.sha256:
        found["sha256"] = hashlib.sha256()
    if entry.blake3:
        found["blake3"] = blake3.blake3()
    return found


def digest_mismatch(entry: ManifestFile, fed: dict[str, Any]) -> str | None:
    for name, state in fed.items():
        if state.hexdigest() != getattr(entry, name):
            return f"{entry.path}: {name} mismatch"
    return None
