"""SIGHUP: a new config read, checked and everything it needs built before anything of the
running daemon changes; then swapped in with one assignment. A config that fails any of it is
`ConfigError` (or `StateError`: the record store cannot move to its new `state.dir`), and the
running daemon goes on with the old one, untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import config as config_mod
from ..config import Config
from ..errors import ConfigError, StateError
from ..records import RecordStore
from ..sources import local
from ..sources.remote import RemoteSource
from . import parts, paths
from .messages import Message
from .reloader import Reloader


@dataclass(frozen=True)
class Rebuilt:
    config: Config
    sources: bool
    """Whether the source threads are replaced (`watcher` and `remote` are the new ones)."""
    watcher: local.Watcher | None = None
    remote: RemoteSource | None = None


def prepare(
    path: Path | None, old: Config, reloader: Reloader, post: Callable[[Message], None], records: RecordStore
) -> Rebuilt:
    """The new config and its new parts (the watcher started: inotify's limits and permissions
    fail here), the record store moved last; nothing of the running daemon is changed."""
    if path is None:
        raise ConfigError("no config file to re-read")
    new = config_mod.load(path)
    paths.check(new)  # the directories it names, as at start, whatever changed
    if old.log.priority_prefix:  # set on the command line, which a SIGHUP does not re-read
        new = new.model_copy(update={"log": new.log.model_copy(update={"priority_prefix": True})})
    if new.source == old.source and new.state == old.state and new.rollout == old.rollout:
        return Rebuilt(new, sources=False)
    watcher = None
    try:
        remote = parts.remote(new, reloader, post)
        watcher = parts.watcher(new, post)
        watcher.start()
        if new.state.dir != old.state.dir:
            records.move_to(new.state.dir)  # what is remembered goes along
    except (ConfigError, StateError, OSError) as exc:
        if watcher is not None:
            watcher.close()
        if isinstance(exc, OSError):
            raise ConfigError(f"source: {exc.strerror or exc}") from exc
        raise
    return Rebuilt(new, True, watcher, remote)
