"""What a reload's outcome means: success, a failed reload (restored or not), a canary that
failed (rolled back or not). `decide` works it out as data, a pure function of the outcome
and what the daemon believed before; the reloader, which owns that state, applies it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..engine import capabilities
from ..errors import EngineError, ReloadFailed
from .jobs import Job, Outcome
from .state import Loaded


@dataclass(frozen=True)
class Event:
    level: Literal["info", "warning", "error"]
    name: str
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class Rejecting:
    name: str
    version: str
    reason: str
    fingerprint: str
    check: str


@dataclass(frozen=True)
class Decision:
    result: Literal["succeeded", "failed", "changed", "waiting"]
    """The reloads metric's label (`changed`: a writer changed the files; nothing to blame;
    `waiting`: a node of a multi-node engine does not hold the version yet, nothing was sent)."""
    events: tuple[Event, ...] = ()
    """Logged in this order."""
    resume_owed: bool = False
    """The engine could not be resumed: keep trying from the loop."""
    rollback: str | None = None
    """The cause, when the last good checkpoint was loaded back."""
    reject: Rejecting | None = None
    serving: Loaded | None = None
    set_serving: bool = False
    """`serving` is what the engine now holds (None: unknown)."""
    last_good: Loaded | None = None
    """Set on success: the new rollback target."""
    engine_down: EngineError | None = None
    reloaded: Mapping[str, Any] = field(default_factory=dict)
    """On success: seconds and bytes, for the metrics and `status`."""
    regate: str | None = None
    """A candidate whose files changed under the reload: gate it again once it settles."""
    refused: bool = False
    """The engine's condition, not the checkpoint's (vLLM refused the load for want of device
    memory, or the probe gave no answer): the engine tries it again later, nothing blamed."""


NOT_STAGED_FIX = (
    "nothing if that node's stage daemon is downloading it (the reload follows); else start it there "
    '(vllm-reloader run with [node] role = "stage"), or free its disk'
)


def decide(outcome: Outcome, *, now: float) -> Decision:
    job = outcome.job
    version, path = job.target.version, job.target.path
    events: list[Event] = []
    if outcome.resume_error is not None:
        events.append(Event("error", "engine.resume_failed", {"reason": str(outcome.resume_error)}))
    owed = outcome.resume_error is not None
    if outcome.changed is not None:
        events.append(_changed(outcome, outcome.changed, "before_pause"))
        return Decision("changed", tuple(events), owed, regate=job.candidate.name)
    if (short := outcome.not_staged) is not None:  # nothing sent: tried again as the node catches up
        fields = {"version": version, "node": short.node, "reason": short.problem, "fix": NOT_STAGED_FIX}
        events.append(Event("warning", "node.not_staged", fields))
        return Decision("waiting", tuple(events), owed, refused=True)
    if outcome.non_finite is not None:  # nothing sent: the checkpoint's own bytes
        candidate = job.candidate
        blame = Rejecting(candidate.name, version, outcome.non_finite, candidate.fingerprint, "finite")
        return Decision("failed", tuple(events), owed, reject=blame)
    if outcome.canary_failed is not None:
        return _canary_failed(outcome, events, owed, now)
    error = outcome.error
    if isinstance(error, ReloadFailed):
        rolled_back = error.restored and job.fallback is not None
        # Refused for the engine's memory and put back as it was: no weight blamed, nothing
        # rolled back (not counted as one), tried again later; one line says all of it.
        quietly = error.refused and error.restored
        if quietly:
            refused = {"version": version, "reason": str(error), "restored": True}
            if job.fallback is not None:
                refused["to_version"] = job.fallback.version
            refused["fix"] = capabilities.LOAN_REFUSED_FIX
            events.append(Event("warning", "engine.reload_refused", refused))
        else:
            failed = {"version": version, "path": path, "reason": str(error), "restored": error.restored}
            events.append(Event("error", "reload.failed", failed))
        cause = "changed" if error.changed else "probe" if error.probed or error.unjudged else "reload"
        blamed = error.engine_up and not _not_blamed(error)
        if rolled_back and job.fallback is not None and not quietly:
            fields = {"version": version, "to_version": job.fallback.version, "cause": cause}
            fields["fix"] = rolled_back_fix(version, job.fallback.version, blames=blamed)
            events.append(Event("warning", "reload.rolled_back", fields))
        if error.changed:
            events.append(_changed(outcome, str(error), "after_load"))
        blame = Rejecting(  # a probe blames the weights loaded, a follower's too (as a canary does)
            job.candidate.name,
            version,
            str(error) if error.probed else f"reload_weights failed: {error}",
            _fingerprint(job) if error.probed else job.candidate.fingerprint,
            "probe" if error.probed else "reload",
        )
        back = job.rollback.model_copy(update={"since": now}) if rolled_back and job.rollback else None
        return Decision(
            "changed" if error.changed else "failed",
            tuple(events),
            owed,
            rollback=cause if rolled_back and not quietly else None,
            reject=blame if blamed else None,
            serving=back,
            set_serving=back is not None,
            engine_down=None if error.restored else error,
            regate=job.candidate.name if error.changed else None,
            refused=error.refused or error.unjudged,
        )
    if error is not None:
        events.append(
            Event(
                "error",
                "reload.failed",
                {"version": version, "path": path, "reason": str(error), "restored": False},
            )
        )
        return Decision("failed", tuple(events), owed, engine_down=error)
    files = dict(job.target.files) if job.target.files is not None else None
    loaded = Loaded(
        name=job.candidate.name,
        version=version,
        path=path,
        since=now,
        step=job.candidate.step,
        files=files,
        fingerprint=_fingerprint(job),
        arrival=job.candidate.arrival,
    )
    seconds = outcome.seconds
    events.append(
        Event(
            "info",
            "reload.succeeded",
            {
                "version": version,
                "path": path,
                "bytes": job.size,
                "duration_ms": round(seconds * 1000, 3),
                "gb_per_s": round(job.size / seconds / 1e9, 3) if seconds > 0 else None,
                **(outcome.timings or {}),
            },
        )
    )
    return Decision(
        "succeeded",
        tuple(events),
        owed,
        serving=loaded,
        set_serving=True,
        last_good=loaded,
        reloaded={
            "version": version,
            "duration_ms": round(seconds * 1000, 3),
            "at": now,
            "seconds": seconds,
            "bytes": job.size,
        },
    )


def rolled_back_fix(version: str, to_version: str, *, blames: bool = True) -> str:
    """What an operator does after a rollback: nothing for the engine (it serves good weights
    again); the version itself, when it is to blame, is rejected."""
    if not blames:
        return f"nothing: it serves {to_version} again, and {version} is tried again later"
    return f"nothing for the engine (it serves {to_version} again); {version} is rejected: publish a good one"


def _canary_failed(outcome: Outcome, events: list[Event], owed: bool, now: float) -> Decision:
    """Loaded, but the engine answered like broken weights: reject it; the reload thread has
    already loaded the fallback back when there was one."""
    job, reason = outcome.job, f"canary: {outcome.canary_failed}"
    version = job.target.version
    reject = Rejecting(job.candidate.name, version, reason, _fingerprint(job), "canary")
    if outcome.rolled_back and job.fallback is not None:
        events.append(
            Event(
                "warning",
                "reload.rolled_back",
                {
                    "version": version,
                    "to_version": job.fallback.version,
                    "cause": "canary",
                    "reason": reason,
                    "clean_after_probes": outcome.flush_probes or None,
                    "fix": rolled_back_fix(version, job.fallback.version),
                },
            )
        )
        back = job.rollback.model_copy(update={"since": now}) if job.rollback else None
        return Decision(
            "failed", tuple(events), owed, rollback="canary", reject=reject, serving=back, set_serving=True
        )
    if outcome.error is not None:  # the rollback itself failed: the engine is down or wedged
        events.append(
            Event("error", "reload.rollback_failed", {"version": version, "reason": str(outcome.error)})
        )
        return Decision(
            "failed", tuple(events), owed, reject=reject, set_serving=True, engine_down=outcome.error
        )
    # Nothing to go back to: it stays loaded, rejected, and the next good one replaces it.
    events.append(Event("error", "reload.canary_failed_no_fallback", {"version": version, "reason": reason}))
    stays = Loaded(
        name=job.candidate.name,
        version=version,
        path=job.target.path,
        since=now,
        step=job.candidate.step,
        fingerprint=_fingerprint(job),
        arrival=job.candidate.arrival,
    )
    return Decision("failed", tuple(events), owed, reject=reject, serving=stays, set_serving=True)


def _not_blamed(error: ReloadFailed) -> bool:
    """A writer at the files, the engine's memory, a probe with no answer: not the checkpoint."""
    return error.changed or error.refused or error.unjudged


def _fingerprint(job: Job) -> str:
    """The loaded version's content fingerprint (a follower's or a restore's job carries it in
    `loading`; its candidate's is "" so that it is not taken for a new version)."""
    return job.loading.fingerprint if job.loading is not None else job.candidate.fingerprint


def _changed(outcome: Outcome, reason: str, when: str) -> Event:
    job = outcome.job
    fields = {"name": job.candidate.name, "version": job.target.version, "reason": reason, "when": when}
    return Event("warning", "checkpoint.changed", fields)
