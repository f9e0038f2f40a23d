"""Whether the engine is set up for the daemon, asked at every reconcile.

Two things no retry fixes, so each is an `EngineNotSetUp` (exit 2, one line naming the
fix): an engine without the routes the daemon drives (dev mode off, a release out of range),
and no readable layout baseline — the served model's headers, which every candidate must
match. The baseline comes from `[engine] baseline` when set, else the engine's startup model:
a directory, or a hub model id found in the Hugging Face cache.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint import layout
from ..config import EngineConfig
from ..engine import capabilities
from ..engine.client import EngineClient
from ..engine.serverinfo import ServerConfig
from ..errors import EngineNotSetUp, LayoutUnreadable
from ..sources import hub
from .served import Served


@dataclass(frozen=True)
class Learned:
    """What an engine says of itself at a reconcile (asked on its own thread)."""

    found: capabilities.Capabilities
    version: str
    """The weight version it reports."""
    server: ServerConfig
    paused: bool


def ask_engine(client: EngineClient) -> Learned:
    """The calls of a reconcile, run on the engine's thread: an engine without the routes the
    daemon drives is `EngineNotSetUp` before any of them is called."""
    found = client.capabilities()
    if (why := capabilities.problem(found)) is not None:
        raise EngineNotSetUp(why)
    return Learned(found, client.weight_version(), client.server_config(), client.is_paused())


def untested(found: capabilities.Capabilities, logger: Any) -> None:
    if capabilities.untested(found):
        logger.warning("engine.untested", vllm_version=found.version, tested=capabilities.SUPPORTED)


def per_release(
    config: EngineConfig,
    drained: bool,
    found: capabilities.Capabilities,
    server: ServerConfig,
    logger: Any,
    adapters: bool = False,
) -> None:
    """Say what this release does that an operator would not expect, and what it lacks for
    `[adapters]` (at every reconcile)."""
    if capabilities.pause_rejects(found) and config.pause_mode != "keep" and not drained:
        logger.warning(
            "engine.pause_rejects",
            vllm_version=found.version,
            pause_mode=config.pause_mode,
            fix=capabilities.PAUSE_REJECTS_FIX,
        )
    if adapters and (capabilities.adapters_missing(found) or server.lora is None):
        logger.error(
            "adapter.not_runnable",
            reason="the engine cannot load LoRA adapters",
            fix=capabilities.ADAPTER_FIX,
        )
    if server.reload_mode == "direct":
        logger.warning(
            "engine.reload_mode_direct", reason=capabilities.DIRECT_RELOAD, fix=capabilities.DIRECT_RELOAD_FIX
        )


def startup_path(server: ServerConfig, environ: Mapping[str, str] | None = None) -> str:
    """The startup model's directory: a hub id resolved to its cached snapshot where found."""
    if hub.is_model_id(server.model):
        cached = hub.snapshot(server.model, server.revision, os.environ if environ is None else environ)
        return str(cached) if cached is not None else server.model
    return server.model


@dataclass(frozen=True)
class Baseline:
    layout: layout.Layout | None
    tried: tuple[str, ...]
    """Where it was looked for, for the error."""


def baseline(config: EngineConfig, startup: str, serving: str) -> Baseline:
    """`[engine] baseline` when set, else the startup model's layout (reloads never change it, and
    it outlives rotated checkpoints), else the serving checkpoint's."""
    paths = tuple(dict.fromkeys([str(config.baseline)] if config.baseline else [startup, serving]))
    for path in paths:
        try:
            return Baseline(layout.read_served_layout(Path(path)), paths)
        except (OSError, LayoutUnreadable):
            continue
    return Baseline(None, paths)


def settle_baseline(
    config: EngineConfig, server: ServerConfig, served: Served, serving: str, logger: Any
) -> layout.Layout:
    """The baseline found now; at start, none is an error (nothing could ever be loaded); after
    an engine restart onto files the daemon cannot read, the one it had still holds."""
    found = baseline(config, served.startup or server.model, serving)
    if found.layout is not None:
        return found.layout
    why = no_baseline(found, server, configured=config.baseline is not None)
    if served.baseline is None:
        raise EngineNotSetUp(why)
    logger.error("gate.no_baseline", paths=list(found.tried), reason=why)
    return served.baseline


def no_baseline(
    found: Baseline,
    server: ServerConfig,
    *,
    configured: bool = False,
    environ: Mapping[str, str] | None = None,
) -> str:
    """One line for an operator: where the daemon looked, and what to set."""
    looked = ", ".join(found.tried)
    if configured:
        return f"[engine] baseline = {looked}: no readable safetensors headers there (the served model's)"
    if hub.is_model_id(server.model):
        cache = hub.cache_dir(os.environ if environ is None else environ)
        return (
            f"the engine serves hub model {server.model!r} and its snapshot is not readable in the "
            f"Hugging Face cache {cache}: set HF_HUB_CACHE to the engine's cache (readable to the "
            f"daemon), or [engine] baseline = a directory with the model's safetensors"
        )
    return (
        f"cannot read the served model's safetensors headers (looked in {looked}): "
        "set [engine] baseline = a directory with the model's safetensors, readable to the daemon"
    )


def nodes(role: str, server: ServerConfig, extension: bool) -> None:
    """An engine over several nodes reads every path on each node's own disk: only a leading
    daemon (every node's copy verified first) may reload it, through the worker extension."""
    if server.nnodes > 1 and role != "lead":
        raise EngineNotSetUp(
            f"the engine runs on {server.nnodes} nodes (--nnodes), each reading its own copy: set "
            '[node] role = "lead" here and run a daemon with [node] role = "stage" beside each other node'
        )
    if server.nnodes > 1 and not extension:
        raise EngineNotSetUp(
            f"the engine runs on {server.nnodes} nodes: each node's copy is checked by the worker extension; "
            "start vLLM with --worker-extension-cls vllm_reloader.extension.ReloadExtension"
        )
