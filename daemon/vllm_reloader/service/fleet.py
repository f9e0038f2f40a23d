"""This host's part in a fleet, on the main loop (the records are `sources.verdicts`).

A canary host tells the fleet what it made of each content: its canary engine's reload and
canary (`judged`), and its gate's rejections, local or made while downloading (`rejected`). A
follower whose engines serve a version that a canary host failed after they loaded it goes
back from it (`Recalls`): rejected like any failed version, dropped from the rollback history,
and every engine serving it loads its rollback target, as room allows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from ..checkpoint import order
from ..sources.verdicts import Verdict
from .engine import Engine
from .jobs import Job
from .outcomes import Decision, Event, rolled_back_fix
from .state import Loaded

FLEET_CHECK = "canary"
"""The check a rejection taken from the canary hosts' records carries (as before downloading)."""


def judged(job: Job, decision: Decision) -> Verdict | None:
    """The canary engine's verdict on the new content it loaded; None: nothing to record (a
    reload that failed for the engine's sake, or a writer that changed the files)."""
    name, version = order.base_name(job.candidate.name), job.target.version
    fingerprint = job.loading.fingerprint if job.loading is not None else job.candidate.fingerprint
    if not fingerprint:
        return None
    if decision.result == "succeeded":
        return Verdict(name, version, fingerprint, True, canary=job.canary.enabled)
    if decision.reject is not None:  # its canary, or its reload, failed here
        return Verdict(name, version, fingerprint, False, decision.reject.reason)
    return None


def rejected(
    name: str, version: str | None, reason: str, fingerprint: str, details: Mapping[str, object]
) -> Verdict | None:
    """A rejection by this host's gate, or by the object store's listing or download digests: a
    failure for the fleet (no canary needed). Not one taken from the fleet's own records."""
    if not fingerprint or details.get("check") in (FLEET_CHECK, "local"):
        return None  # the fleet's own verdict, or this host's filesystem: nothing to tell others
    base = order.base_name(name)
    return Verdict(base, version or base, fingerprint, False, reason)


def served_content(engines: Iterable[Engine]) -> tuple[tuple[str, str], ...]:
    """What the engines serve, as (name, fingerprint), for the object-store thread to check."""
    return tuple(
        (order.base_name(loaded.name), loaded.fingerprint)
        for engine in list(engines)
        if (loaded := engine.served.serving) is not None and loaded.fingerprint and loaded.in_root
    )


@dataclasses.dataclass
class Recalls:
    """Contents a canary host failed while engines here served them."""

    log: Any
    failed: dict[tuple[str, str], tuple[str, str, str]] = dataclasses.field(default_factory=dict)
    """(name, fingerprint) → (version, reason, cause: `fleet`, or `canary` / `probe` when an
    engine of this host failed it)."""
    rolling: dict[str, tuple[Job, str, str, str]] = dataclasses.field(default_factory=dict)
    """An engine's URL → its rollback job, with the version it leaves, why, and the cause."""
    stuck: set[tuple[str, str, str]] = dataclasses.field(default_factory=set)
    """(engine URL, name, fingerprint) with nothing to go back to: said once."""

    def covers(self, loaded: Loaded | None) -> bool:
        if loaded is None or not loaded.fingerprint:
            return False
        return (order.base_name(loaded.name), loaded.fingerprint) in self.failed

    def add(
        self,
        name: str,
        version: str,
        fingerprint: str,
        reason: str,
        engines: Iterable[Engine],
        cause: str = "fleet",
    ) -> None:
        self.failed[(name, fingerprint)] = (version, reason, cause)
        self._forget(engines)

    def _forget(self, engines: Iterable[Engine]) -> None:
        """Never a rollback target, nor what the other engines of this host converge to."""
        for engine in engines:
            served = engine.served
            if any(self.covers(g) for g in served.good):
                served.good = tuple(g for g in served.good if not self.covers(g))

    def note(self, engines: Iterable[Engine], rejected: Mapping[str, Collection[str]]) -> None:
        """A content this host rejected is recalled too where an engine serves it (a restart
        forgets recalls under way); none stays a rollback target or what followers converge to."""
        engines = list(engines)
        for engine in engines:
            loaded = engine.served.serving
            if loaded is not None and loaded.fingerprint and not self.covers(loaded):
                name = order.base_name(loaded.name)
                if loaded.fingerprint in rejected.get(name, ()):
                    self.failed[(name, loaded.fingerprint)] = (
                        loaded.version,
                        "rejected on this host",
                        "rejected",
                    )
        if self.failed:
            self._forget(engines)

    def plan(
        self, engine: Engine, now: float, target: Callable[[Engine, str], Loaded | None]
    ) -> Loaded | None:
        """What an engine serving a recalled content loads back (`target`, skipping what it
        serves); None when it serves none, waits its backoff, or has nothing to go back to
        (then it keeps serving it, said once)."""
        serving, served = engine.served.serving, engine.served
        if serving is None or not self.covers(serving) or not served.reconciled:
            return None
        content = (engine.url, order.base_name(serving.name), serving.fingerprint)
        if now < engine.retry_at_follow() or content in self.stuck:
            return None
        _, reason, cause = self.failed[content[1:]]
        back = target(engine, serving.name)
        fields = {
            "version": serving.version,
            "fingerprint": serving.fingerprint,
            "reason": reason,
            "cause": cause,
        }
        if back is None:
            self.stuck.add(content)
            engine.log.error(
                "fleet.recalled", to_version=None, action="keeps serving it: nothing to go back to", **fields
            )
            return None
        engine.log.warning("fleet.recalled", to_version=back.version, **fields)
        return back

    def started(self, engine: Engine, job: Job) -> None:
        """The load back from a recalled content began: said as a rollback when it ends."""
        serving = engine.served.serving
        assert serving is not None
        _, reason, cause = self.failed[(order.base_name(serving.name), serving.fingerprint)]
        self.rolling[engine.url] = (job, serving.version, reason, cause)

    def finished(self, url: str, job: Job, decision: Decision) -> Decision:
        """A rollback this made came back: said as one (`reload.rolled_back`, cause `fleet`)."""
        rolling = self.rolling.get(url)
        if rolling is None or rolling[0] is not job:
            return decision
        del self.rolling[url]
        if decision.result != "succeeded":
            return decision
        _, version, reason, cause = rolling
        fields = {"version": version, "to_version": job.target.version, "cause": cause, "reason": reason}
        fields["fix"] = rolled_back_fix(version, job.target.version)
        event = Event("warning", "reload.rolled_back", fields)
        return dataclasses.replace(decision, events=(*decision.events, event), rollback=cause)
