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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..checkpoint.adapter import AdapterVersion
from ..checkpoint.files import changed
from ..config import CanaryConfig
from ..errors import EngineCallFailed, EngineError
from . import canary
from . import probe as probing
from .client import EngineClient

FLUSH_PROBES = 5


@dataclass(frozen=True)
class Swapped:
    target: AdapterVersion
    seconds: float = 0.0
    load_ms: float = 0.0
    error: str | None = None
    """Nothing to blame the version for (the engine refused or did not answer, or did not
    answer clean before the load): it serves what it did, unless `uncertain`."""
    changed: str | None = None
    """The copy was no longer the verified bytes: nothing was sent."""
    canary_failed: str | None = None
    blamed: bool = False
    """The canary's answers say the version is broken (not a timeout or an overloaded engine)."""
    rolled_back: bool = False
    """After a failed canary: the last good version is loaded again."""
    unloaded: bool = False
    """After a failed canary with no last good version: the adapter is unloaded."""
    flush_probes: int = 0
    uncertain: bool = False
    """The engine stopped answering midway: what it holds for this adapter is asked again."""
    probed: bool = False
    """The probe found it broken before the load: nothing was loaded, the engine holds what it did."""
    probe_unavailable: str | None = None
    """Why no probe judged it (the canary alone did)."""
    probe_ms: float | None = None
    """How long its probe took (None: none ran)."""


def swap(
    client: EngineClient,
    target: AdapterVersion,
    fallback: AdapterVersion | None,
    others: tuple[str, ...],
    config: CanaryConfig,
    probe: Callable[[EngineClient, str], probing.Finding] | None = None,
) -> Swapped:
    """Probe `target` (where the engine runs the worker extension), load it and canary it.
    Nothing raises: a refusal, a failed probe or canary, an engine that stopped answering are
    each data. A failed canary is blamed on the version only if, once it is gone, the engine
    answers clean again (base model, other adapters, the version gone back to): what fails
    without it too is not its fault. A failed probe is: nothing else was touched."""
    started = time.perf_counter()
    if problem := _changed(target):
        return Swapped(target, changed=problem)
    unavailable = probe_ms = None
    if probe is not None:
        probing_started = time.perf_counter()
        try:
            judged = probe(client, target.path)
        except EngineError as exc:  # no answer: nothing loaded, nothing blamed, tried again later
            return Swapped(target, time.perf_counter() - started, error=f"probe: no answer: {exc}")
        if judged.broken is not None:
            seconds = time.perf_counter() - started
            return Swapped(target, seconds, canary_failed=f"probe: {judged.broken}", blamed=True, probed=True)
        unavailable, probe_ms = judged.unavailable, round((time.perf_counter() - probing_started) * 1000, 3)
    if problem := _changed(target):  # again: vLLM's loader reads it by path, as the probe's did
        return Swapped(target, changed=problem)
    loading = time.perf_counter()
    try:
        client.load_adapter(target.adapter, target.path)
    except EngineError as exc:
        uncertain = not isinstance(exc, EngineCallFailed)  # no answer: did it load or not?
        return Swapped(target, time.perf_counter() - started, error=_refusal(exc), uncertain=uncertain)
    load_ms = round((time.perf_counter() - loading) * 1000, 3)
    found = examine_all(client, config, (target.adapter, None, *others)) if config.enabled else None
    if found is None:
        seconds = time.perf_counter() - started
        return Swapped(target, seconds, load_ms, probe_unavailable=unavailable, probe_ms=probe_ms)
    failed = Swapped(
        target,
        load_ms=load_ms,
        canary_failed=found.reason,
        blamed=found.answered,
        probe_unavailable=unavailable,
    )
    try:
        rolled_back = fallback is not None and _changed(fallback) is None
        if fallback is not None and rolled_back:
            client.load_adapter(fallback.adapter, fallback.path)
        else:  # none, or its copy is no longer what was verified: nothing of it is served
            client.unload_adapter(target.adapter)
    except EngineError as exc:
        return replace(
            failed, seconds=time.perf_counter() - started, error=f"going back: {exc}", uncertain=True
        )
    flushes = next((n for n in range(1, FLUSH_PROBES + 1) if canary.probe(client, config) is None), 0)
    still = (target.adapter, *others) if rolled_back else others
    without = (
        examine_all(client, config, still) if flushes else canary.Finding("the base model still fails", True)
    )
    reason = found.reason if without is None else f"{found.reason} (not blamed: without it, {without.reason})"
    return replace(
        failed, seconds=time.perf_counter() - started, rolled_back=rolled_back, unloaded=not rolled_back,
        flush_probes=flushes, blamed=found.answered and without is None, canary_failed=reason,
    )  # fmt: skip


def examine_all(
    client: EngineClient, config: CanaryConfig, models: tuple[str | None, ...]
) -> canary.Finding | None:
    """Each model's canary in turn (None: the base model): the first that fails, named."""
    for model in models:
        if (found := canary.examine(client, config, model=model)) is not None:
            return canary.Finding(f"{model or 'base model'}: {found.reason}", found.answered)
    return None


def _changed(version: AdapterVersion) -> str | None:
    try:
        return changed(Path(version.path), version.files)
    except OSError as exc:  # the copy's directory itself is gone or unreadable
        return f"{version.path}: {exc.strerror or exc}"


def _refusal(exc: EngineError) -> str:
    """vLLM's refusal in one line, naming what to do when runtime loading is off."""
    if isinstance(exc, EngineCallFailed) and exc.status == 404 and "lora" not in (exc.detail or "").lower():
        return (
            f"{exc.endpoint}: not found: start vLLM with --enable-lora and the environment "
            "variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
        )
    return str(exc)


@dataclass(frozen=True)
class Rechecked:
    found: dict[str, str | None]
    """By name: why its canary failed (None: it passed); a name missing was not judged (no
    answer: judged again later)."""
    unloaded: frozenset[str] = frozenset()
    """Of those that failed, the ones unloaded (one whose unload failed is still loaded)."""


def recheck(client: EngineClient, names: tuple[str, ...], config: CanaryConfig) -> Rechecked:
    """After the base weights changed (or what an engine holds is not known to have passed):
    each adapter's canary again, and one whose answers are broken is unloaded. Stops at the
    first that gets no answer, or whose unload fails."""
    found: dict[str, str | None] = {}
    unloaded: set[str] = set()
    for name in names:
        finding = canary.examine(client, config, model=name) if config.enabled else None
        if finding is not None and not finding.answered:
            break
        found[name] = finding.reason if finding else None
        if finding is not None:
            if unload(client, name) is not None:
                break
            unloaded.add(name)
    return Rechecked(found, frozenset(unloaded))


def unload(client: EngineClient, name: str) -> str | None:
    """Unloaded (None), or why not."""
    try:
        client.unload_adapter(name)
    except EngineError as exc:
        return str(exc)
    return None
