"""The object-store edge: obstore (one Rust client for S3, GCS and Azure), errors translated.

Credentials and client options come the standard way for each store (`AWS_*`, `GOOGLE_*`,
`AZURE_*` env vars, instance metadata), including `AWS_ENDPOINT_URL` and `<STORE>_ALLOW_HTTP`;
an explicit `endpoint_url` (S3's or Azure's endpoint, GCS's base URL) overrides. obstore's own
exceptions carry multi-line debug dumps with timings; `SourceError` keeps one stable line (the
operation, the key, the condition: the store's code, refused, DNS, TLS, credentials) and the
store's own words and cause as its `detail`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    BaseError,
    InvalidPathError,
    NotFoundError,
    PreconditionError,
)
from obstore.store import from_url

from ..errors import ConfigError, ObjectChanged, PublishError, SourceError
from . import reasons

_BAD_PATH = re.compile(r'Path "([^"]*)"')
_ENV_PREFIX = {"s3": "AWS_", "gs": "GOOGLE_", "az": "AZURE_"}
CLIENT_KEYS = (
    "allow_http",
    "allow_invalid_certificates",
    "connect_timeout",
    "default_content_type",
    "http1_only",
    "http2_only",
    "http2_max_frame_size",
    "http2_keep_alive_interval",
    "http2_keep_alive_timeout",
    "http2_keep_alive_while_idle",
    "pool_idle_timeout",
    "pool_max_idle_per_host",
    "proxy_url",
    "proxy_ca_certificate",
    "proxy_excludes",
    "randomize_addresses",
    "read_timeout",
    "root_certificate",
    "timeout",
    "user_agent",
)
"""The HTTP client's keys, each read from `<STORE>_<KEY>` (`root_certificate`: PEM text)."""


@dataclass(frozen=True)
class Object:
    size: int
    etag: str | None
    modified: float = 0.0
    """Last-Modified, as a Unix time."""


class Unlistable(SourceError):
    """A folder holding a key obstore cannot represent (`a//b`, `a/../b`), or, on a shared root,
    something that is not a regular file: it cannot be listed."""


Skip = Callable[[str], bool]
"""Top-level names a listing need not look into (a store may list them anyway)."""


def skip_nothing(_name: str) -> bool:
    return False


Data = bytes | Path | BinaryIO
"""What an upload reads: bytes, a file by path, or a file open for reading (read once, front to back)."""


class Bucket(Protocol):
    """What the sources read and write: an object-store prefix (`Store`) or a shared root
    (`filestore.FileStore`); keys are relative to `url`. Opened by `filestore.open_store`."""

    url: str

    def list(self, skip: Skip = skip_nothing) -> tuple[dict[str, Object], dict[str, str]]: ...
    def list_under(self, prefix: str) -> dict[str, Object]: ...
    def head(self, key: str) -> Object | None: ...
    def get(self, key: str) -> tuple[bytes, str | None]: ...
    def get_range(self, key: str, start: int, end: int, etag: str | None) -> memoryview: ...
    def exists(self, key: str) -> bool: ...
    def put(
        self, key: str, data: Data, *, create_only: bool = False, part_size: int | None = None
    ) -> None: ...
    def create(self, key: str, data: Data) -> bool: ...
    def delete(self, keys: Sequence[str]) -> None: ...


def client_options(
    url: str, endpoint_url: str | None, timeout: float, environ: Mapping[str, str]
) -> dict[str, Any]:
    """The HTTP client's options. obstore reads them from the store's variables (`AWS_ALLOW_HTTP`,
    `AZURE_PROXY_URL`, `GOOGLE_ALLOW_INVALID_CERTIFICATES`, ...) only when none are passed, and
    passing any replaces them all: so they are read here, and what the user set stays in force
    (an empty one counts as unset, as in a templated EnvironmentFile). The config adds its
    timeouts where the environment sets none, and allows http for an `http://` endpoint_url."""
    prefix = _env_prefix(url)
    from_env = {
        key: environ[prefix + key.upper()] for key in CLIENT_KEYS if environ.get(prefix + key.upper())
    }
    options: dict[str, Any] = {"timeout": f"{timeout:g}s", "connect_timeout": "5s", **from_env}
    if (endpoint_url or "").startswith("http://"):
        options["allow_http"] = True
    return options


def _env_prefix(url: str) -> str:
    """The prefix of the store's own variables: `AWS_`, `GOOGLE_`, `AZURE_`."""
    return _ENV_PREFIX[url.partition("://")[0]]


def _bad_variable(url: str, options: Mapping[str, Any], config: Mapping[str, Any], prefix: str) -> str | None:
    """The one environment variable without which obstore builds the store (builds only: no I/O)."""
    for key in CLIENT_KEYS:
        if key in options and os.environ.get(name := prefix + key.upper()):
            try:
                without = {k: v for k, v in options.items() if k != key}
                from_url(url, client_options=without, **config)  # type: ignore[call-overload]
            except (BaseError, ValueError):
                continue
            return f"{name}={options[key]!r} is refused"
    return None


class Store:
    """One prefix of one bucket; keys are relative to `url`."""

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        timeout: float = 30.0,
        key: tuple[str, str] = ("source", "path"),
    ) -> None:
        """`key`: the config key `url` came from, named when it cannot be used."""
        self.url = url.rstrip("/")
        config: dict[str, Any] = {}
        if endpoint_url:
            config["base_url" if url.startswith("gs://") else "endpoint"] = endpoint_url
        options = client_options(url, endpoint_url, timeout, os.environ)
        self._prefix = _env_prefix(url)
        self._proxy = reasons.without_password(options["proxy_url"]) if "proxy_url" in options else None
        try:
            self._store = from_url(  # type: ignore[call-overload]
                self.url, client_options=options, retry_config={"max_retries": 2}, **config
            )
        except (BaseError, ValueError) as exc:
            bad = _bad_variable(self.url, options, config, self._prefix)
            why = f"{bad}: {reasons.first_line(str(exc))[:200]}" if bad else reasons.one_line(exc)
            raise ConfigError(f"{'.'.join(key)} {url!r}: {why}") from exc

    def _fail(self, what: str, key: str, exc: BaseException) -> SourceError:
        where = f"{self.url}/{key}" if key else self.url
        if isinstance(exc, PreconditionError):
            return ObjectChanged(f"{what} {where}: changed while being read")
        reason = reasons.one_line(exc, proxy=self._proxy, env_prefix=self._prefix)
        return SourceError(f"{what} {where}: {reason}", f"{what} {where}: {reasons.detail(exc)}")

    def list(self, skip: Skip = skip_nothing) -> tuple[dict[str, Object], dict[str, str]]:
        """Every object under the prefix (key → size, ETag, time), and the top-level names
        whose objects could not be listed, with why.

        obstore refuses a whole listing at the first key it cannot represent (`a//b`,
        `a/../b`). Then each top-level name is listed on its own (but those to `skip`), so
        such a key costs only the listing of the checkpoint holding it."""
        try:
            return self._list(None), {}
        except InvalidPathError:
            pass
        try:
            names = obstore.list_with_delimiter(self._store)["common_prefixes"]
        except (BaseError, OSError) as exc:
            raise self._fail("LIST", "", exc) from exc
        found: dict[str, Object] = {}
        unlisted: dict[str, str] = {}
        for name in names:
            if skip(name.rstrip("/")):
                continue
            try:
                found.update(self._list(name))
            except InvalidPathError as exc:
                bad = _BAD_PATH.search(str(exc))
                unlisted[name] = (
                    f"key {bad.group(1) if bad else '?'!r} cannot be listed (empty, . or .. segment)"
                )
        return found, unlisted

    def list_under(self, prefix: str) -> dict[str, Object]:
        """Every object under the folder `prefix` (key → size, ETag, time), by its own LIST: a
        key obstore cannot represent elsewhere under the prefix costs nothing here; one inside
        this folder is `Unlistable`."""
        try:
            return self._list(prefix.rstrip("/"))
        except InvalidPathError as exc:
            bad = _BAD_PATH.search(str(exc))
            raise Unlistable(
                f"LIST {self.url}/{prefix}: key {bad.group(1) if bad else '?'!r} cannot be listed"
            ) from exc

    def _list(self, prefix: str | None) -> dict[str, Object]:
        try:
            return {
                meta["path"]: _object(meta)
                for batch in obstore.list(self._store, prefix=prefix)
                for meta in batch
            }
        except InvalidPathError:
            raise
        except (BaseError, OSError) as exc:
            raise self._fail("LIST", prefix or "", exc) from exc

    def head(self, key: str) -> Object | None:
        """One object's size and ETag; None when it does not exist."""
        try:
            return _object(obstore.head(self._store, key))
        except (NotFoundError, FileNotFoundError):
            return None
        except (BaseError, OSError) as exc:
            raise self._fail("HEAD", key, exc) from exc

    def get(self, key: str) -> tuple[bytes, str | None]:
        """A whole (small) object and its ETag."""
        try:
            result = obstore.get(self._store, key)
            return bytes(result.bytes()), _etag(result.meta["e_tag"])
        except (BaseError, OSError) as exc:
            raise self._fail("GET", key, exc) from exc

    def get_range(self, key: str, start: int, end: int, etag: str | None) -> memoryview:
        """Bytes [start, end) of the object, only if it still has `etag`."""
        options: dict[str, Any] = {"range": (start, end)}
        if etag:
            options["if_match"] = etag
        try:
            return memoryview(obstore.get(self._store, key, options=options).bytes())  # type: ignore[arg-type]
        except (BaseError, OSError) as exc:
            raise self._fail("GET", key, exc) from exc

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def put(self, key: str, data: Data, *, create_only: bool = False, part_size: int | None = None) -> None:
        """Upload one object; `create_only` sends `If-None-Match: *` (never overwrite).

        Otherwise a file (a `Path`, or a file open for reading, which obstore reads once, front to
        back) longer than `part_size` (default: obstore's, 5 MiB) goes up as a multipart upload in
        parts of that size, a few in flight at a time, never whole in memory; a multipart upload
        that fails is aborted. On S3 an upload has at most 10,000 parts."""
        if create_only:
            if not self.create(key, data):
                raise PublishError(f"{self.url}/{key} already exists; versions are never overwritten")
            return
        parts: dict[str, Any] = {} if part_size is None else {"chunk_size": part_size}
        try:
            obstore.put(self._store, key, data, mode="overwrite", **parts)
        except (BaseError, OSError) as exc:
            raise self._fail("PUT", key, exc) from exc

    def create(self, key: str, data: Data) -> bool:
        """Upload one object only if none is there (`If-None-Match: *`, decided by the store
        itself, so two writers racing cannot both win); False when one was."""
        try:
            obstore.put(self._store, key, data, mode="create")
        except AlreadyExistsError:
            return False
        except (BaseError, OSError) as exc:
            raise self._fail("PUT", key, exc) from exc
        return True

    def delete(self, keys: Sequence[str]) -> None:
        """Remove these objects (in bulk where the store can); one that is already gone is no
        error, on any store."""
        if not keys:
            return
        try:
            obstore.delete(self._store, list(keys))
            return
        except (NotFoundError, FileNotFoundError):
            pass  # GCS and Azure refuse a batch naming a missing object: one at a time, then
        except (BaseError, OSError) as exc:
            raise self._fail("DELETE", keys[0], exc) from exc
        for key in keys:
            try:
                obstore.delete(self._store, key)
            except (NotFoundError, FileNotFoundError):
                pass
            except (BaseError, OSError) as exc:
                raise self._fail("DELETE", key, exc) from exc


def _object(meta: Any) -> Object:
    return Object(meta["size"], _etag(meta["e_tag"]), meta["last_modified"].timestamp())


def _etag(value: str | None) -> str | None:
    """An ETag in HTTP's quoted form: Azure's and GCS's listings give it bare, their HEAD and
    GET quoted, and one object must compare equal to itself."""
    if value and not value.startswith(('"', "W/")):
        return f'"{value}"'
    return value
