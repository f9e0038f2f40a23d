"""The one reload sequence, and the only place that pauses the engine, so the rule
"never leave it paused" lives in one `finally`.

While weights are being replaced the engine's weight version reads `reloading:<version>`.
A daemon that dies mid-reload therefore finds out on restart that the weights may be a
mix of two checkpoints, instead of trusting the old version string.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .. import failpoints
from ..checkpoint.files import Identity
from ..checkpoint.files import changed as files_changed
from ..errors import EngineCallFailed, EngineError, EngineUnavailable, ReloadFailed
from . import capabilities, nodes
from .client import RELOADING_PREFIX, EngineClient
from .probe import Finding


@dataclass(frozen=True)
class Target:
    version: str
    path: str
    files: Mapping[str, Identity] | None = None
    """Each file as the gate verified it: compared after the load (and by the extension
    while it reads). None for a checkpoint never gated here (the engine's startup model)."""
    staged: str | None = None
    """A multi-node engine: the content's fingerprint; every rank reads the files its own
    node's daemon verified for it (`engine.nodes`), asked before the pause."""

    def changed(self) -> str | None:
        """Why the files are no longer the verified ones, or None."""
        return None if self.files is None else files_changed(Path(self.path), self.files)


def _short_node(client: EngineClient, target: Target) -> bool:
    """A multi-node engine: whether a node no longer holds the target as verified (its rank
    refused the load: a hand or a disk at its copy, no fault of the checkpoint's)."""
    if target.staged is None:
        return False
    try:
        return nodes.first_short(nodes.node_states(client.staged(target.path, target.staged))) is not None
    except EngineError:
        return False


@contextmanager
def _timed(timings: dict[str, Any], phase: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[f"{phase}_ms"] = round((time.perf_counter() - start) * 1000, 3)


def hot_swap(
    client: EngineClient,
    target: Target,
    *,
    fallback: Target | None,
    on_resume_failed: Callable[[EngineError], None],
    strategy: Literal["inplace", "sleep"] = "inplace",
    extension: bool = False,
    pause_mode: str | None = None,
    probe: Callable[[EngineClient], Finding] | None = None,
) -> dict[str, Any]:
    """pause → mark reloading → reload_weights → compare the files → probe → reset prefix
    cache → set version → resume.

    `sleep` (engines started with `--enable-sleep-mode`) wraps the reload: sleep level 2
    (weights and KV cache dropped, buffers kept) → wake the weights (same virtual addresses,
    so CUDA graphs stay valid) → reload → wake the KV cache. The KV cache's memory is free
    for the loader's transient buffers, so no headroom beyond the weights is needed. Once
    asleep the weights are gone: any failure from then on loads the fallback back.

    After the load, the target's files are compared with what the gate verified: a file
    changed meanwhile may have been read half old, half new (vLLM's own loader reads by
    path), so the fallback is loaded back (`ReloadFailed.changed`).

    `extension`: load through the worker extension; its report is returned under `load`.
    `pause_mode`: how to pause, when not the engine's configured way.
    `probe`: a forward pass on every rank, still paused: weights it finds broken are a failed
    load, the fallback loaded back before the resume (`ReloadFailed.probed`), so no client
    request ever reaches them; a probe with no answer loads it back too, blaming nothing
    (`ReloadFailed.unjudged`).

    Returns per-phase durations. Raises `ReloadFailed` (after restoring `fallback` when the
    engine is still answering) or `EngineUnavailable`. Whatever happens after the pause
    request was sent, the engine is woken (sleep) and resume attempted before returning.
    """
    timings: dict[str, Any] = {}
    mode = pause_mode or client.config.pause_mode
    failpoints.hit("before_pause")
    if mode == "abort":  # it drops what is in flight: say how much
        aborted = client.requests_in_flight()
        if aborted is not None:
            timings["aborted_requests"] = aborted
    asleep = False
    try:
        with _timed(timings, "pause"):
            client.pause(mode)
        failpoints.hit("after_pause")
        client.set_weight_version(RELOADING_PREFIX + target.version)
        try:
            if strategy == "sleep":
                with _timed(timings, "sleep"):
                    asleep = True
                    client.sleep(2, mode)
                    client.wake_up(("weights",))
            with _timed(timings, "reload"):
                load = client.reload_weights(
                    target.path, extension=extension, files=target.files, staged=target.staged
                )
        except EngineError as exc:  # a writer at the files makes it no fault of the checkpoint's
            changed = target.changed() is not None or _short_node(client, target)
            woken = _wake(client, asleep)
            # Refused for want of memory (vLLM 0.34+) rank by rank: another rank may have loaded.
            refused = _refused(exc, target)
            raise _restore(
                client, fallback, str(exc), extension, woken=woken, changed=changed, refused=refused
            ) from exc
        if asleep:
            with _timed(timings, "wake"):
                client.wake_up(("kv_cache",))
                asleep = False
        if load is not None:
            timings["load"] = load
        failpoints.hit("after_reload")
        if problem := target.changed():
            raise _restore(
                client, fallback, f"files changed during the reload: {problem}", extension, changed=True
            )
        if probe is not None:
            _probe(client, probe, fallback, extension, timings)
        try:
            with _timed(timings, "reset"):
                client.reset_prefix_cache()
        except EngineCallFailed as exc:  # new weights behind old cached prefixes: go back
            raise _restore(client, fallback, str(exc), extension) from exc
        client.set_weight_version(target.version)
    finally:
        if asleep:  # a failure on the way: an engine left asleep serves nothing
            _wake_all(client, on_resume_failed)
        with _timed(timings, "resume"):
            _resume(client, on_resume_failed)
    return timings


def _probe(
    client: EngineClient,
    probe: Callable[[EngineClient], Finding],
    fallback: Target | None,
    extension: bool,
    timings: dict[str, Any],
) -> None:
    try:
        with _timed(timings, "probe"):
            found = probe(client)
    except EngineError as exc:  # no answer: the engine's condition, not the weights' (not blamed)
        raise _restore(client, fallback, f"probe: no answer: {exc}", extension, unjudged=True) from exc
    if found.broken is not None:
        raise _restore(client, fallback, f"probe: {found.broken}", extension, probed=True)
    if found.unavailable is not None:
        timings["probe_unavailable"] = found.unavailable
    timings.update({f"probe_{key}": value for key, value in found.summary.items()})


def _wake(client: EngineClient, asleep: bool) -> bool:
    """Wake everything after a sleep; whether the engine is awake now (True if it never slept)."""
    if not asleep:
        return True
    try:
        client.wake_up()
    except EngineError:
        return False
    return True


def _wake_all(client: EngineClient, on_failed: Callable[[EngineError], None]) -> None:
    try:
        client.wake_up()
    except EngineError as exc:
        on_failed(exc)


def _refused(exc: EngineError, target: Target) -> bool:
    text = exc.detail if isinstance(exc, EngineCallFailed) and exc.detail else str(exc)
    return capabilities.refused(text, (target.path, *(target.files or ())))


def _restore(
    client: EngineClient,
    fallback: Target | None,
    cause: str,
    extension: bool,
    *,
    woken: bool = True,
    changed: bool = False,
    refused: bool = False,
    probed: bool = False,
    unjudged: bool = False,
) -> ReloadFailed:
    """The model may now hold a mix of old and new tensors (or, after a sleep, none): load
    the last good one back, if the engine is awake to take it. After a refusal (`refused`) a
    restore refused too means no rank touched a weight: each refused one load or the other,
    and one that took the new weights took the old ones back."""
    why_failed = {"changed": changed, "refused": refused, "probed": probed, "unjudged": unjudged}
    if fallback is None or not woken:
        why = "no checkpoint to restore" if fallback is None else "the engine did not wake up"
        return ReloadFailed(f"{cause}; {why}", restored=False, engine_up=woken, **why_failed)
    try:
        client.reload_weights(
            fallback.path, extension=extension, files=fallback.files, staged=fallback.staged
        )
        if problem := fallback.changed():
            raise ReloadFailed(
                f"{fallback.version} changed while restoring it: {problem}", restored=False, engine_up=True
            )
        client.reset_prefix_cache()
        client.set_weight_version(fallback.version)
    except EngineError as again:
        if refused and _refused(again, fallback):
            try:
                client.set_weight_version(fallback.version)
            except EngineError:
                pass  # still marked reloading: the next check reconciles it
            else:
                kept = f"{cause}; restoring {fallback.version} was refused too: no rank changed its weights"
                return ReloadFailed(kept, restored=True, engine_up=True, refused=True)
        return ReloadFailed(
            f"{cause}; restoring {fallback.version} failed too: {again}",
            restored=False,
            engine_up=not isinstance(again, EngineUnavailable),
            **why_failed,
        )
    return ReloadFailed(f"{cause}; restored {fallback.version}", restored=True, engine_up=True, **why_failed)


def _resume(client: EngineClient, on_failed: Callable[[EngineError], None]) -> None:
    """One try; a failure is reported so the daemon keeps retrying from its main loop."""
    try:
        client.resume()
    except EngineError as exc:
        on_failed(exc)
