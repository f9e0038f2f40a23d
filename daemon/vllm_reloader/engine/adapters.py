"""One LoRA adapter's swap on one engine, run on the engine's own thread (a `jobs.Ask`, so
never beside a base reload of that engine).

The verified copy is loaded under the adapter's public name in place (`load_inplace`: the
name keeps its id, so requests naming it go on). A loaded adapter takes part in every
request on the engine — one of NaN weights made every base-model request fail (vLLM 0.32) —
so the canary asks the adapter, the base model and every other adapter the engine serves;
one that fails loads the adapter's last good version back (from its own copy), or unloads
the adapter when it has none, then probes the base model until it answers clean (the bad
requests left non-finite values in freed KV blocks, as after a bad base reload).

A request in flight on the adapter is never failed by the swap: vLLM replaces the weights
between two scheduler steps, so its tokens after that step come from the new version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.adapter import AdapterVersion
from ..checkpoint.files import changed
from ..config import CanaryConfig
from ..errors import EngineCallFailed, EngineError
from . import canary
from .client import EngineClient

FLUSH_PROBES = 5


@dataclass(frozen=True)
class Swapped:
    target: AdapterVersion
    seconds: float = 0.0
    load_ms: float = 0.0
    error: str | None = None
    """The engine refused the load: it serves what it did."""
    changed: str | None = None
    """The copy was no longer the verified bytes: nothing was sent."""
    canary_failed: str | None = None
    rolled_back: bool = False
    """After a failed canary: the last good version is loaded again."""
    unloaded: bool = False
    """After a failed canary with no last good version: the adapter is unloaded."""
    flush_probes: int = 0
    uncertain: bool = False
    """The engine stopped answering midway: what it holds for this adapter is asked again."""


def swap(
    client: EngineClient,
    target: AdapterVersion,
    fallback: AdapterVersion | None,
    others: tuple[str, ...],
    config: CanaryConfig,
) -> Swapped:
    """Load `target` and canary it. Nothing raises: a refusal, a failed canary, an engine that
    stopped answering are each data (`uncertain`: what it holds now must be asked again)."""
    started = time.perf_counter()
    if problem := changed(Path(target.path), target.files):
        return Swapped(target, changed=problem)
    try:
        client.load_adapter(target.adapter, target.path)
    except EngineCallFailed as exc:
        return Swapped(target, time.perf_counter() - started, error=_refusal(exc))
    except EngineError as exc:
        return Swapped(target, time.perf_counter() - started, error=str(exc), uncertain=True)
    load_ms = round((time.perf_counter() - started) * 1000, 3)
    reason = probe_all(client, config, (target.adapter, *others)) if config.enabled else None
    if reason is None:
        return Swapped(target, time.perf_counter() - started, load_ms)
    try:
        rolled_back = fallback is not None and changed(Path(fallback.path), fallback.files) is None
        if fallback is not None and rolled_back:
            client.load_adapter(fallback.adapter, fallback.path)
        else:  # none, or its copy is no longer what was verified: nothing of it is served
            client.unload_adapter(target.adapter)
    except EngineError as exc:
        seconds = time.perf_counter() - started
        return Swapped(
            target, seconds, load_ms, error=f"going back: {exc}", canary_failed=reason, uncertain=True
        )
    flushes = next((n for n in range(1, FLUSH_PROBES + 1) if canary.probe(client, config) is None), 0)
    seconds = time.perf_counter() - started
    return Swapped(
        target,
        seconds,
        load_ms,
        canary_failed=reason,
        rolled_back=rolled_back,
        unloaded=not rolled_back,
        flush_probes=flushes,
    )


def probe_all(client: EngineClient, config: CanaryConfig, adapters: tuple[str, ...]) -> str | None:
    """The first adapter's canary, then the base model's, then the others': why one fails, or None."""
    first, *others = adapters or (None,)
    for model in (first, None, *others) if first is not None else (None,):
        if (reason := canary.probe(client, config, model=model)) is not None:
            return f"{model or 'base model'}: {reason}"
    return None


def _refusal(exc: EngineCallFailed) -> str:
    """vLLM's refusal in one line, naming what to do when runtime loading is off."""
    if exc.status == 404 and "lora" not in (exc.detail or "").lower():  # no such route
        return (
            f"{exc.endpoint}: not found: start vLLM with --enable-lora and the environment "
            "variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
        )
    return str(exc)


def recheck(client: EngineClient, names: tuple[str, ...], config: CanaryConfig) -> dict[str, str | None]:
    """After the base weights changed: each adapter's canary again, and one that fails is
    unloaded. By name: why it failed (None: it passed); a name missing was not reached (the
    engine stopped answering: what it holds is asked again)."""
    found: dict[str, str | None] = {}
    for name in names:
        reason = canary.probe(client, config, model=name) if config.enabled else None
        if reason is not None and unload(client, name) is not None:
            break
        found[name] = reason
    return found


def unload(client: EngineClient, name: str) -> str | None:
    """Unloaded (None), or why not."""
    try:
        client.unload_adapter(name)
    except EngineError as exc:
        return str(exc)
    return None
