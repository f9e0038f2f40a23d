"""An engine's own thread: every call to the engine runs here, one at a time — reloads
(`hot_swap`, then the canary), warm-ups, and the loop's quick questions (`Ask`: health
checks, reconciles, resumes).

A reload can take minutes on a real model and a hung engine can hold any call until its
deadline. Running them here keeps the main loop free to take events, answer the control
socket, drive the other engines and ping systemd's watchdog; each result comes back to the
loop as a message, like everything else. A canary that fails loads the fallback (the last
good checkpoint) back at once, here, before the loop hears of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from .. import failpoints
from ..checkpoint import gate
from ..checkpoint.order import Candidate
from ..checkpoint.staged import staged_marker
from ..config import CanaryConfig
from ..engine import canary, nodes, probe
from ..engine.client import EngineClient
from ..engine.nodes import NodeState
from ..engine.swap import Target, hot_swap
from ..errors import EngineCallFailed, EngineError, EngineNotSetUp, ReloaderError, ReloadFailed
from ..sources import content
from ..threads import QueueWorker
from .readiness import Drain
from .state import Loaded

FLUSH_PROBES = 5


@dataclass(frozen=True)
class Job:
    client: EngineClient
    candidate: Candidate
    target: Target
    rollback: Loaded | None
    """What a failure goes back to (picked intact when the job was made)."""
    size: int
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    strategy: Literal["inplace", "sleep"] = "inplace"
    extension: bool = False
    """Load through the worker extension (`engine.client.EXTENSION`)."""
    started: float = field(default_factory=time.monotonic)
    loading: Loaded | None = None
    """What the engine serves once this succeeds (its name, step and fingerprint)."""
    drain: Drain | None = None
    """Out of rotation first, back after the canary (or the rollback); None: in place."""
    scan: bool = False
    """The probe checks every loaded parameter for NaN/Inf (`[gate] scan`)."""
    host_scan: gate.GateOptions | None = None
    """The gate skipped the NaN/Inf scan and this engine cannot do it: read the files for
    it here, before the pause (these options say how)."""
    restore: bool = False
    """Weights of unknown mix loaded back (nothing new: no verdict, no drain)."""
    node: str | None = None
    """A multi-node engine's leading daemon: this node's name in the staged markers (it marks
    its own copy, then asks every rank whether its node holds the version, before the pause)."""

    @property
    def fallback(self) -> Target | None:
        return None if self.rollback is None else target_of(self.rollback, self.node)


def target_of(loaded: Loaded, node: str | None) -> Target:
    """What a reload of `loaded` reads; with a leading daemon's `node`, each node's own verified
    copy of its content (one never gated here, as the startup model, is read as it is)."""
    staged = loaded.fingerprint if node and loaded.fingerprint and loaded.files is not None else None
    return Target(loaded.version, loaded.path, loaded.files, staged)


@dataclass(frozen=True)
class Outcome:
    job: Job
    seconds: float
    timings: dict[str, Any] | None = None
    error: EngineError | None = None
    resume_error: EngineError | None = None
    canary_failed: str | None = None
    """Why the canary failed; then `rolled_back` says whether the fallback is loaded again."""
    rolled_back: bool = False
    flush_probes: int = 0
    """Probes after the rollback until one passed (0: none did)."""
    changed: str | None = None
    """The files were no longer the verified ones before the pause: nothing was sent."""
    non_finite: str | None = None
    """The host scan owed before the pause (`Job.host_scan`) found NaN/Inf: nothing was sent."""
    nodes: tuple[NodeState, ...] = ()
    """A multi-node engine: each node's word on the version, asked before the pause."""
    not_staged: NodeState | None = None
    """A node that does not hold the version verified: nothing was sent."""


@dataclass(frozen=True, eq=False)
class WarmUp:
    """One canary probe right after the engine is reconciled: its first logprobs request
    costs seconds (CPU), paid here rather than by the first canary, with clients queued
    behind the paused engine's resume."""

    client: EngineClient
    canary: CanaryConfig


@dataclass(frozen=True)
class WarmedUp:
    seconds: float
    problem: str | None
    warmup: WarmUp | None = None


@dataclass(frozen=True, eq=False)
class Ask:
    """Engine calls the loop needs answered (`call` runs here with the engine's client); the
    answer comes back as `Answered`, and the loop goes on from there."""

    client: EngineClient
    call: Callable[[EngineClient], object]


@dataclass(frozen=True)
class Answered:
    ask: Ask
    value: object = None
    error: ReloaderError | None = None
    """An `EngineError`, or `EngineNotSetUp` (no retry fixes it: the daemon exits 2)."""


Report = Outcome | WarmedUp | Answered


class ReloadWorker(QueueWorker[Job | WarmUp | Ask]):
    """The engine's thread. `close` waits for the call under way at most its timeout (each
    engine call has its own deadline; a thread left behind dies with the process); what was
    submitted before it still runs (a dropped engine's last resume)."""

    def __init__(self, post: Callable[[Report], None], name: str = "reload-worker") -> None:
        super().__init__(name)
        self._post = post

    def handle(self, job: Job | WarmUp | Ask) -> None:
        started = time.perf_counter()
        if isinstance(job, WarmUp):
            try:
                problem = canary.probe(job.client, job.canary)
            except Exception as exc:  # a bug, or an answer nothing foresaw: said, and the thread lives
                problem = f"internal error: {type(exc).__name__}: {exc}"[:300]
            self._post(WarmedUp(time.perf_counter() - started, problem, job))
            return
        if isinstance(job, Ask):
            self._post(_answer(job))
            return
        try:
            outcome = self._one(job, started)
        except Exception as exc:  # a bug: the loop must hear of it; hot_swap has resumed
            failed = ReloadFailed(
                f"internal error: {type(exc).__name__}: {exc}", restored=False, engine_up=True
            )
            outcome = Outcome(job, time.perf_counter() - started, error=failed)
        self._post(outcome)

    def _one(self, job: Job, started: float) -> Outcome:
        failpoints.hit("after_gate")
        if problem := job.target.changed():
            return Outcome(job, 0.0, changed=problem)
        if job.host_scan is not None and (scanned := _host_scan(job, job.host_scan)) is not None:
            return scanned
        if job.target.staged is not None and job.node is not None:
            states = states_of(job.client, job.node, job.target, job.fallback)
            if (short := nodes.first_short(states)) is not None:
                return Outcome(job, 0.0, nodes=states, not_staged=short)
            return replace(self._drained_swap(job, started), nodes=states)
        return self._drained_swap(job, started)

    def _drained_swap(self, job: Job, started: float) -> Outcome:
        if job.drain is None:
            return self._swap(job, started)
        drained = job.drain.out(job.client.url, job.client.requests_in_flight)
        if drained is None:  # nothing paused: the engine serves what it did, and goes back
            return Outcome(job, 0.0, changed="the daemon is stopping: not reloaded")
        if problem := job.target.changed():  # again: the drain took time
            return Outcome(job, 0.0, changed=problem)
        # Drained, it pauses once what is still in flight is done (vLLM's count can lag a request
        # that came just before the balancer saw it out): none is held into the new weights.
        # (From 0.33 a request reaching it after every balancer read it out is answered 503, and
        # from 0.34 this pause clears the KV cache, which the reload may then borrow.)
        keep = job.client.config.pause_mode == "keep" and drained["in_flight_at_pause"] == 0
        outcome = self._swap(job, started, pause_mode="wait" if keep else None)
        return replace(outcome, timings={**drained, **(outcome.timings or {})})

    def _swap(self, job: Job, started: float, pause_mode: str | None = None) -> Outcome:
        resume_errors: list[EngineError] = []
        try:
            probed = _prober(job)  # its tokens asked before the pause
            timings = hot_swap(
                job.client,
                job.target,
                fallback=job.fallback,
                on_resume_failed=resume_errors.append,
                strategy=job.strategy,
                extension=job.extension,
                pause_mode=pause_mode,
                probe=probed,
            )
            outcome = Outcome(job, time.perf_counter() - started, timings=timings)
        except EngineError as exc:
            outcome = Outcome(job, time.perf_counter() - started, error=exc)
        if outcome.error is None and job.canary.enabled:
            outcome = self._canary(job, outcome, resume_errors)
        if resume_errors:
            outcome = replace(outcome, resume_error=resume_errors[0])
        return outcome

    def _canary(self, job: Job, outcome: Outcome, resume_errors: list[EngineError]) -> Outcome:
        started = time.perf_counter()
        reason = canary.probe(job.client, job.canary)
        timings = {**(outcome.timings or {}), "canary_ms": round((time.perf_counter() - started) * 1000, 3)}
        if reason is None:
            return replace(outcome, timings=timings)
        if job.fallback is None:
            return replace(outcome, timings=timings, canary_failed=reason)
        try:
            hot_swap(
                job.client,
                job.fallback,
                fallback=None,
                on_resume_failed=resume_errors.append,
                strategy=job.strategy,
                extension=job.extension,
            )
        except EngineError as exc:
            return replace(outcome, timings=timings, canary_failed=reason, error=exc)
        # The bad weights' requests left non-finite keys/values in freed KV blocks; requests
        # that reuse a block may read them. Probe again until clean: that also takes them.
        flushes = next(
            (n for n in range(1, FLUSH_PROBES + 1) if canary.probe(job.client, job.canary) is None), 0
        )
        return replace(outcome, timings=timings, canary_failed=reason, rolled_back=True, flush_probes=flushes)


def states_of(
    client: EngineClient, node: str, target: Target, fallback: Target | None
) -> tuple[NodeState, ...]:
    """A multi-node engine: this node's copies of `target` and of what a failure would go back
    to marked as verified (with the files this daemon verified, as they are now), then every
    rank asked whether its node holds both; an engine that cannot answer is one short node."""
    found: tuple[NodeState, ...] = ()
    for one, what in ((target, ""), (fallback, "its rollback target ")):
        if one is None or one.staged is None or one.files is None:
            continue
        try:
            content.mark_staged(Path(one.path), node, one.staged, one.files)
        except OSError as exc:  # the same words at every try (no temporary file's name): said once
            where = staged_marker(Path(one.path)).parent
            why = f"cannot mark {what}{one.version} as verified in {where}: {exc.strerror}"
            return (NodeState(node, (), why),)
        try:
            states = nodes.node_states(client.staged(one.path, one.staged))
        except EngineError as exc:
            return (NodeState("the engine", (), f"could not ask its ranks: {exc}"),)
        short = nodes.first_short(states)
        if short is not None and what:  # said as what it is: the way back
            named = replace(short, problem=f"{what}{one.version}: {short.problem}")
            return tuple(named if s is short else s for s in states)
        if short is not None:
            return states
        found = found or states
    return found


def _host_scan(job: Job, options: gate.GateOptions) -> Outcome | None:
    """The NaN/Inf scan the gate left to engines that scan, for one that does not: None when
    the files are the verified ones and finite."""
    started = time.perf_counter()
    verdict = gate.check(Path(job.target.path), serving=None, options=options)
    seconds = time.perf_counter() - started
    if problem := job.target.changed():  # a NaN in bytes that are not the verified ones blames nothing
        return Outcome(job, seconds, changed=problem)
    if verdict.status == "rejected" and verdict.details.get("check") == "finite":
        return Outcome(job, seconds, non_finite=f"host scan (the engine cannot scan): {verdict.reason}")
    verified = job.target.files
    if verdict.status != "ready" or (verified is not None and dict(verdict.files) != dict(verified)):
        return Outcome(job, seconds, changed=f"not the verified files at the host scan: {verdict.reason}")
    return None


def _prober(job: Job) -> Callable[[EngineClient], probe.Finding] | None:
    """The probe inside the pause, where the engine runs the worker extension and it is on."""
    config = job.canary
    if not (job.extension and config.probe):
        return None
    asked = probe.Probe(tokens=probe.tokens_of(job.client, config.prompts), scan=job.scan)

    def run(client: EngineClient) -> probe.Finding:
        found = probe.run(client, asked, config.probe_timeout)
        if asked.scan and found.broken is None and "scanned_bytes" not in found.summary:
            # Nobody else scanned these bytes: no answer, not a pass (loaded back, unjudged).
            why = f"the scan inside the pause did not run: {found.unavailable or 'not every rank scanned'}"
            raise EngineCallFailed(why, endpoint="/collective_rpc")
        return found

    return run


def _answer(ask: Ask) -> Answered:
    try:
        return Answered(ask, value=ask.call(ask.client))
    except (EngineError, EngineNotSetUp) as exc:
        return Answered(ask, error=exc)
    except Exception as exc:  # a bug: the loop hears of it as a failed call, and the thread lives
        failed = EngineCallFailed(f"internal error: {type(exc).__name__}: {exc}", endpoint="")
        return Answered(ask, error=failed)
