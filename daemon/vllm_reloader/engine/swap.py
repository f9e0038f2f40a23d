"""The one reload sequence, and the only place that pauses the engine, so the rule
"never leave it paused" lives in one `finally`.

While weights are being replaced the engine's weight version reads `reloading:<version>`.
A daemon that dies mid-reload therefore finds out on restart that the weights may be a
mix of two checkpoints, instead of trusting the old version string.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from .. import failpoints
from ..errors import EngineError, EngineUnavailable, ReloadFailed
from .client import RELOADING_PREFIX, EngineClient


@dataclass(frozen=True)
class Target:
    version: str
    path: str


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
) -> dict[str, Any]:
    """pause → mark reloading → reload_weights → reset prefix cache → set version → resume.

    `sleep` (engines started with `--enable-sleep-mode`) wraps the reload: sleep level 2
    (weights and KV cache dropped, buffers kept) → wake the weights (same virtual addresses,
    so CUDA graphs stay valid) → reload → wake the KV cache. The KV cache's memory is free
    for the loader's transient buffers, so no headroom beyond the weights is needed.

    `extension`: load through the worker extension; its report is returned under `load`.

    Returns per-phase durations. Raises `ReloadFailed` (after restoring `fallback` when the
    engine is still answering) or `EngineUnavailable`. Whatever happens after the pause
    request was sent, the engine is woken (sleep) and resume attempted before returning.
    """
    timings: dict[str, Any] = {}
    failpoints.hit("before_pause")
    if client.config.pause_mode == "abort":  # it drops what is in flight: say how much
        aborted = client.requests_in_flight()
        if aborted is not None:
            timings["aborted_requests"] = aborted
    asleep = False
    try:
        with _timed(timings, "pause"):
            client.pause(client.config.pause_mode)
        failpoints.hit("after_pause")
        client.set_weight_version(RELOADING_PREFIX + target.version)
        if strategy == "sleep":
            with _timed(timings, "sleep"):
                asleep = True
                client.sleep(2, client.config.pause_mode)
                client.wake_up(("weights",))
        with _timed(timings, "reload"):
            try:
                load = client.reload_weights(target.path, extension=extension)
            except EngineError as exc:
                raise _restore(client, fallback, exc, extension) from exc
        if load is not None:
            timings["load"] = load
        failpoints.hit("after_reload")
        if asleep:
            with _timed(timings, "wake"):
                client.wake_up(("kv_cache",))
                asleep = False
        with _timed(timings, "reset"):
            client.reset_prefix_cache()
        client.set_weight_version(target.version)
    finally:
        if asleep:  # a failure on the way: an engine left asleep serves nothing
            _wake_all(client, on_resume_failed)
        with _timed(timings, "resume"):
            _resume(client, on_resume_failed)
    return timings


def _wake_all(client: EngineClient, on_failed: Callable[[EngineError], None]) -> None:
    try:
        client.wake_up()
    except EngineError as exc:
        on_failed(exc)


def _restore(
    client: EngineClient, fallback: Target | None, cause: EngineError, extension: bool
) -> ReloadFailed:
    """The model may now hold a mix of old and new tensors: load the last good one back."""
    engine_up = not isinstance(cause, EngineUnavailable)
    if fallback is None:
        return ReloadFailed(f"{cause}; no checkpoint to restore", restored=False, engine_up=engine_up)
    try:
        client.reload_weights(fallback.path, extension=extension)
        client.reset_prefix_cache()
        client.set_weight_version(fallback.version)
    except EngineError as again:
        return ReloadFailed(
            f"{cause}; restoring {fallback.version} failed too: {again}",
            restored=False,
            engine_up=not isinstance(again, EngineUnavailable),
        )
    return ReloadFailed(f"{cause}; restored {fallback.version}", restored=True, engine_up=True)


def _resume(client: EngineClient, on_failed: Callable[[EngineError], None]) -> None:
    """One try; a failure is reported so the daemon keeps retrying from its main loop."""
    try:
        client.resume()
    except EngineError as exc:
        on_failed(exc)
