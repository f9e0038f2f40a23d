"""The one frozen config object, parsed and validated once from TOML.

Every section rejects unknown keys, so a typo fails loudly at start instead of silently
falling back to a default. `load` turns any problem into a one-line `ConfigError` naming
the key (`source.path: field required`), which the CLI prints and exits 2 on.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ConfigError

DEFAULT_IGNORE = ("*.tmp", "*.partial", "tmp-*", "*.orbax-checkpoint-tmp-*")


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class SourceConfig(_Section):
    path: Path
    poll: bool = False
    """Poll instead of inotify. Turned on by itself for NFS/CIFS/FUSE mounts."""
    poll_interval: float = Field(2.0, gt=0)
    rescan_interval: float = Field(30.0, gt=0)
    """Full rescan even with inotify: its queue can overflow."""
    pending_recheck_interval: float = Field(1.0, gt=0)
    """How often pending candidates are re-gated when no event arrives."""
    manifest_grace: float = Field(10.0, ge=0)
    """How long an unparsable manifest may be mid-write before it is rejected."""
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    """Glob patterns of directory names that are never candidates (dot-dirs always are)."""

    @field_validator("path", mode="before")
    @classmethod
    def _path_from_str(cls, value: object) -> object:
        return Path(value) if isinstance(value, str) else value

    @field_validator("ignore", mode="before")
    @classmethod
    def _ignore_from_list(cls, value: object) -> object:
        return tuple(value) if isinstance(value, list) else value


class GateConfig(_Section):
    verify_digests: bool = True
    digest_threads: int = Field(4, ge=1, le=64)


class EngineConfig(_Section):
    url: str
    pause_mode: Literal["keep", "wait", "abort"] = "keep"
    timeout: float = Field(10.0, gt=0)
    """Per-call timeout for the quick calls (pause, resume, reset, version, info)."""
    pause_timeout: float = Field(120.0, gt=0)
    """`wait` mode waits for in-flight requests, so pausing may take longer."""
    reload_timeout: float = Field(600.0, gt=0)
    retry_initial: float = Field(0.5, gt=0)
    retry_max: float = Field(30.0, gt=0)
    check_interval: float = Field(5.0, gt=0)
    """How often an idle daemon asks the engine for its weight version, to notice a restart."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")


class StateConfig(_Section):
    dir: Path

    @field_validator("dir", mode="before")
    @classmethod
    def _path_from_str(cls, value: object) -> object:
        return Path(value) if isinstance(value, str) else value


class LogConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"
    priority_prefix: bool = False
    """`<N>` before each line for journald (the unit turns it on with --log-priority-prefix)."""


class ControlConfig(_Section):
    socket: Path | None = None
    """The control socket (mode 0660); default `<state.dir>/control.sock`."""

    @field_validator("socket", mode="before")
    @classmethod
    def _path_from_str(cls, value: object) -> object:
        return Path(value) if isinstance(value, str) else value


class MetricsConfig(_Section):
    listen: str | None = None
    """`HOST:PORT` for the Prometheus endpoint; off when unset."""

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None and not value.rpartition(":")[2].isdigit():
            raise ValueError("must be HOST:PORT, e.g. 127.0.0.1:9400")
        return value


class Config(_Section):
    source: SourceConfig
    engine: EngineConfig
    state: StateConfig
    gate: GateConfig = GateConfig()
    log: LogConfig = LogConfig()
    control: ControlConfig = ControlConfig()
    metrics: MetricsConfig = MetricsConfig()

    @property
    def control_socket(self) -> Path:
        return self.control.socket or self.state.dir / "control.sock"


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key"
        elif item["type"] == "missing":
            message = "required key is missing"
        parts.append(f"{key}: {message}")
    return "; ".join(parts)


def parse(text: str, origin: str = "<config>") -> Config:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{origin}: not valid TOML: {exc}") from exc
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{origin}: {_describe(exc)}") from exc


def load(path: Path) -> Config:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from exc
    return parse(text, str(path))
