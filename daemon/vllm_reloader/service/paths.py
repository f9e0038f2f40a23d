"""The directories a config names are checked, never created, before the daemon starts or a
SIGHUP swaps a config in: a typo in `source.path` or `state.dir` is then one line and exit 2,
not a new tree on the host that nobody asked for.

The daemon makes only its own layout inside a directory it was given: `state.json` and
`control.sock` in `state.dir`; for an object-store source the default cache
`<state.dir>/cache` (an explicit `state.cache_dir` must exist), and `checkpoints/` and
`staging/` in the cache.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..config import Config
from ..config.base import is_remote
from ..errors import ConfigError
from ..sources.adapter_trees import Tree, tree
from ..sources.filestore import SCHEME, root_of

_EFFECTIVE = os.access in os.supports_effective_ids
"""Ask as the user the daemon runs as (its effective ids), as its writes will."""


def check(config: Config) -> None:
    """Each directory `config` names exists, is a directory and is usable by this user; then
    an object-store source's cache gets its `checkpoints/`, which the watcher watches."""
    directory(("state", "dir"), config.state.dir, write=True)
    if config.adapters.remote:
        adapter_tree(config)  # the store's URL and client options, checked here (no I/O)
    if config.adapters.root is not None and (root := _local(config.adapters.root)) is not None:
        directory(("adapters", "root"), root, write=False)
    apart(config)
    if config.adapters.root is not None and config.adapters.copies is not None:
        directory(("adapters", "copies"), config.adapters.copies, write=True)
    if config.control.socket is not None:
        directory(("control", "socket"), config.control.socket.parent, write=True, of=config.control.socket)
    if (source := _local(config.source.path)) is not None:  # a converter places its output there
        directory(("source", "path"), source, write=bool(config.source.converter))
    if not config.source.remote:
        return
    if config.state.cache_dir is not None:
        directory(("state", "cache_dir"), config.state.cache_dir, write=True)
    root = config.checkpoint_root
    try:
        root.mkdir(parents=True, exist_ok=True)  # at most <state.dir>/cache: state.dir exists
    except OSError as exc:
        why = exc.strerror or exc
        raise ConfigError(f"state.cache_dir {config.cache_dir}: cannot make {root}: {why}") from exc


def apart(config: Config) -> None:
    """`ConfigError` unless the trainers' roots and the daemon's own stores are each a directory
    of their own: the daemon deletes what it made in its stores, and takes whatever is in a
    root for a version (copies inside a root would be loaded as adapters; the cache set to the
    copies would be pruned as adapters). `state.dir` may hold the stores (their defaults do), but
    may be neither one of them nor inside one."""
    places: list[tuple[tuple[str, str], Path]] = []
    if (source := _local(config.source.path)) is not None:
        places.append((("source", "path"), source))
    if config.source.remote:
        places.append((("state", "cache_dir"), config.cache_dir))
    if config.adapters.root is not None:
        if (root := _local(config.adapters.root)) is not None:
            places.append((("adapters", "root"), root))
        places.append((("adapters", "copies"), config.adapter_copies))
    resolved = [(".".join(key), path, path.resolve()) for key, path in places]  # (see `directory`)
    state = config.state.dir.resolve()
    for n, (key, path, real) in enumerate(resolved):
        for other, other_path, other_real in resolved[n + 1 :]:
            if real == other_real or real in other_real.parents or other_real in real.parents:
                raise ConfigError(f"{other} {other_path}: overlaps {key} {path}; give each its own directory")
        if state == real or real in state.parents:
            raise ConfigError(
                f"state.dir {config.state.dir}: {'is' if state == real else 'inside'} {key} {path}; "
                "give the state its own directory"
            )


def _local(location: str) -> Path | None:
    """The directory a location is on this host: a local root, or a shared one (`file://`)."""
    if location.startswith(SCHEME):
        return root_of(location)
    return None if is_remote(location) else Path(location)


def adapter_tree(config: Config) -> Tree:
    """Where `[adapters]` reads versions from; `ConfigError` for a store it cannot address."""
    assert config.adapters.root is not None
    return tree(config.adapters.root, config.adapter_endpoint, timeout=30.0)


def directory(section_key: tuple[str, str], path: Path, *, write: bool, of: Path | None = None) -> None:
    """`ConfigError`, one line naming the key (`section.key`), `path` and what to do, unless
    `path` is a directory this user can read (and, with `write`, write). `of`: the key's
    value when `path` is the directory it goes in."""
    key = ".".join(section_key)  # not a literal: the event catalogue's test takes those for events
    where = f"{key} {of}: its directory {path}" if of is not None else f"{key} {path}"
    try:
        found = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(
            f"{where}: no such directory; create it (the daemon never does), or correct {key}"
        ) from None
    except NotADirectoryError:
        raise ConfigError(f"{where}: a part of the path is a file, not a directory") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot be reached: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(found.st_mode):
        raise ConfigError(f"{where}: exists and is not a directory")
    need, what = (os.R_OK | os.W_OK | os.X_OK, "writable") if write else (os.R_OK | os.X_OK, "readable")
    if not os.access(path, need, effective_ids=_EFFECTIVE):
        why = (
            " ([source] converter places its output there; systemd: ReadWritePaths=)"
            if write and section_key == ("source", "path")
            else ""
        )
        raise ConfigError(f"{where}: not {what} by this user (uid {os.geteuid()}){why}; chown or chmod it")
