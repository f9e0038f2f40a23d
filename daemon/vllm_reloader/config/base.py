"""What every config section shares: frozen sections that refuse unknown keys, and the two
kinds of location a key can name (a path, resolved against the config file's directory; or
a path, an object-store prefix or a shared root read as one)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, ValidationInfo

SHARED_ROOT = "file://"
"""The scheme of a shared filesystem root, read like a store (`sources.filestore`)."""
REMOTE_SCHEMES = ("s3://", "gs://", "az://", SHARED_ROOT)
"""Copied into the cache before anything reads it: object stores, and a shared filesystem root
(`file:///mnt/checkpoints`, NFS or the like), where writers on other hosts can change a file
under a reader."""


def anchored(value: object, info: ValidationInfo) -> object:
    """A relative path in a config file is relative to the file's directory (`load` passes it
    as `base`), not to wherever the daemon happened to be started."""
    if not isinstance(value, str | Path) or "://" in str(value):
        return value  # an object-store URL, or not a path: the field's own checks say so
    if str(value) == "":
        raise ValueError("must not be empty")
    if "\0" in str(value):
        raise ValueError("must not hold a NUL character")
    base = (info.context or {}).get("base")
    return Path(value) if base is None or Path(value).is_absolute() else Path(os.path.normpath(base / value))


def _as_str(value: object, info: ValidationInfo) -> object:
    value = anchored(value, info)
    return str(value) if isinstance(value, Path) else value


def _known_scheme(value: str) -> str:
    if "://" in value and not value.startswith(REMOTE_SCHEMES):
        raise ValueError(f"unsupported scheme; use a local path or one of {', '.join(REMOTE_SCHEMES)}")
    if problem := shared_root_problem(value):
        raise ValueError(problem)
    return value


def shared_root_problem(value: str) -> str | None:
    """Why a `file://` location names no shared root (a relative path, a host, `/` itself)."""
    if not value.startswith(SHARED_ROOT):
        return None
    if not value.startswith(SHARED_ROOT + "/") or value.rstrip("/") == "file:":
        return "file:// needs an absolute path below / (file:///mnt/checkpoints)"
    return "must not hold a NUL character" if "\0" in value else None


ConfigPath = Annotated[Path, BeforeValidator(anchored)]
"""A path-valued key: `Path`, resolved against the config file's directory when relative."""
Location = Annotated[str, BeforeValidator(_as_str), AfterValidator(_known_scheme)]
"""A local directory (resolved as `ConfigPath`), an object-store prefix (`s3://`, `gs://`, `az://`)
or a shared root copied from like one (`file:///...`)."""


def is_remote(location: str | None) -> bool:
    return location is not None and location.startswith(REMOTE_SCHEMES)


class Section(BaseModel):
    # No NaN or inf: an infinite interval would never tick (or sleep forever).
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)
