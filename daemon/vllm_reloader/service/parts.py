"""The daemon's source threads, made from a config: at start, and again on a SIGHUP that
changes `[source]` (every new part is built before an old one is closed)."""

from __future__ import annotations

from collections.abc import Callable

from ..config import Config
from ..sources import local
from ..sources.remote import RemoteSource
from . import fleet
from .messages import FileChanged, Message, ShardWritten
from .reloader import Reloader


def watcher(config: Config, post: Callable[[Message], None]) -> local.Watcher:
    return local.Watcher(
        config.checkpoint_root,
        ignore=config.source.ignore,
        notify=lambda name: post(FileChanged(name)),
        written=lambda path: post(ShardWritten(path)),
        poll=config.source.poll and not config.source.remote,  # the cache is a local disk
        poll_interval=min(config.source.interval, 2.0),
    )


def remote(config: Config, reloader: Reloader, post: Callable[[Message], None]) -> RemoteSource | None:
    if not config.source.remote:
        return None
    return RemoteSource(
        config,
        serving=lambda: reloader.served.serving_key(),  # the canary engine of now
        rejected=reloader.catalog.rejected_fingerprints,
        post=post,
        records=reloader.records,
        arrivals=reloader.arrivals,
        verified_files=reloader.gater.cache,
        serves=lambda: fleet.served_content(reloader.engines),  # a follower checks them
    )
