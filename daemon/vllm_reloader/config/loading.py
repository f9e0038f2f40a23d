"""Reading the config file: TOML → `Config`, with the engine's API key from its file or the
environment. Any problem is one `ConfigError` line naming the key (`source.path: required key
is missing`), which the CLI prints and exits 2 on."""

from __future__ import annotations

import os
import stat
import tomllib
from collections.abc import Mapping
from pathlib import Path

from pydantic import SecretStr, ValidationError

from .. import log
from ..errors import ConfigError
from .model import API_KEY_ENV, Config


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


def parse(
    text: str, origin: str = "<config>", environ: Mapping[str, str] | None = None, base: Path | None = None
) -> Config:
    """The config in `text`, with the engine's API key read from its file or `environ`
    (default: this process's environment); relative paths joined to `base` (the file's directory)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{origin}: not valid TOML: {exc}") from exc
    try:
        config = Config.model_validate(raw, context={"base": base})
    except ValidationError as exc:
        raise ConfigError(f"{origin}: {_describe(exc)}") from exc
    environ = os.environ if environ is None else environ
    key_file = config.engine.api_key_file
    if key_file:
        key = _read_api_key(key_file, origin)
    else:  # empty or unset: no key, as vLLM itself reads its VLLM_API_KEY
        key = environ.get(API_KEY_ENV, "").strip()
        _check_printable(key, f"{origin}: {API_KEY_ENV} (the environment)")
    if not key:
        return config
    log.add_secret(key)
    engine = config.engine.model_copy(update={"api_key": SecretStr(key)})
    return config.model_copy(update={"engine": engine})


def _read_api_key(path: Path, origin: str) -> str:
    where = f"{origin}: engine.api_key_file: {path}"
    try:
        with path.open(encoding="utf-8") as file:
            mode = os.fstat(file.fileno()).st_mode
            key = file.read().strip()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{where}: readable by others (mode {stat.S_IMODE(mode):04o}); chmod 600 it")
    if not key or any(c.isspace() for c in key):
        raise ConfigError(f"{where}: must hold one key, no spaces" if key else f"{where}: is empty")
    _check_printable(key, where)
    return key


MIN_KEY_CHARS = 8


def _check_printable(key: str, where: str) -> None:
    """An HTTP header takes printable ASCII only; the library refusing anything else quotes
    the whole header, key included, in its error. Named by where it came from, never shown."""
    if 0 < len(key) < MIN_KEY_CHARS:  # redacted from every log line: a short one would mangle them
        raise ConfigError(f"{where}: the key is shorter than {MIN_KEY_CHARS} characters; use a longer one")
    for char in key:
        if not " " <= char <= "~":
            kind = (
                "a control character" if char.isascii() or not char.isprintable() else "a non-ASCII character"
            )
            raise ConfigError(f"{where}: the key holds {kind}; it must be printable ASCII")


def load(path: Path) -> Config:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    return parse(text, str(path), base=Path(os.path.abspath(path)).parent)
