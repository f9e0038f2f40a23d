"""Each engine's one scheduler: every call to an engine, one at a time, and whether the engine
is in rotation — decided here, nowhere else.

Work of every kind — a reconcile, a resume, a weight-version check, a warm-up, a base reload or
rollback, an adapter swap, recheck or unload — is a `Work`: what runs on the engine's own thread
(`jobs`), what the loop does with its answer, whether it pauses the engine (a base reload) and
whether it is drained out of rotation first. The schedulers of a host share one budget: at most
`max_unavailable` engines paused or drained at once, whatever the kind of work.

What an idle engine does next (`tick`) is its own upkeep first (resume, reconcile, name, warm
up, check), then what the planners propose, in priority: the reloader's restores and reloads,
then the adapters'. Each planner answers from the facts it owns, recomputed at every turn, and
starts nothing itself.

Rotation (`settle`) follows one rule for every kind of work, recomputed at every turn from
facts, never remembered: an engine takes traffic only while it answers, is reconciled and
resumed, is not drained for work of ours, and what it holds is known and passed — its base
weights (the reloader's standing) and every adapter it holds (the adapters'). A daemon restart
or an engine restart gives the right answer at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import Config, ReadinessConfig
from ..engine.client import EngineClient
from ..errors import EngineError
from . import setup
from .engine import Engine
from .jobs import Answered, Ask, Job, Outcome, ReloadWorker, Report, WarmedUp, WarmUp
from .readiness import NOT_YET, Drain, Rotation

RELOAD_KINDS = ("reload", "restore", "adapter swap", "adapter recheck", "adapter unload")
"""Work a stop waits for (cut short, it would leave weights or an adapter not canaried)."""


def _nothing(_: object) -> None:
    """An answer nothing more is done with."""


@dataclass(frozen=True, eq=False)
class Work:
    kind: str
    run: Job | Ask | WarmUp
    then: Callable[[Any], None] = _nothing
    """On the loop, with what the engine's thread reports (an `Outcome`, an `Answered` value)."""
    pauses: bool = False
    """It pauses the engine (a base reload): it counts against `max_unavailable`."""
    drains: bool = False
    """Taken out of rotation first (where a balancer reads readiness): it counts too."""
    holds: tuple[str | None, ...] = ()
    """The copies it reads: leased while it runs (`content`)."""
    stopped: Callable[[], Any] | None = None
    """An `Ask`'s answer when the daemon began stopping during its drain (nothing was done)."""
    started: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Slot:
    """What an idle engine may start now."""

    room: int
    """How many more engines the host's budget allows paused or drained."""
    drains: bool
    """Work that drains would take this engine out of rotation (else it runs in place)."""


Planner = Callable[[Engine, Slot], Work | None]
Standing = Callable[[Engine], Mapping[str, str]]
"""Why an engine must not take traffic, by cause, from an owner's facts (empty: nothing)."""
Owing = Callable[[Engine], bool]
"""Whether an owner keeps the engine out for work of ours it owes (it counts in the budget)."""


class Scheduler:
    """One engine's: the one `Work` on its thread, and what it owes the engine itself."""

    def __init__(self, engine: Engine, post: Callable[[Report], None]) -> None:
        self.engine = engine
        self.worker = ReloadWorker(post, name=f"reload-worker {engine.url}")
        self.work: Work | None = None
        self.drained = False
        """The work under way was started with a drain: out of rotation until it ends."""

    @property
    def url(self) -> str:
        return self.engine.url

    @property
    def idle(self) -> bool:
        return self.work is None

    @property
    def job(self) -> Job | None:
        """The base reload (or restore) under way."""
        return self.work.run if self.work is not None and isinstance(self.work.run, Job) else None

    @property
    def unavailable(self) -> bool:
        """Whether it counts against the host's budget: work of ours has it paused or drained,
        or it is paused waiting for its resume (an owner may count it too: `Owing`)."""
        working = self.work is not None and (self.work.pauses or self.drained)
        return working or self.engine.served.resume_owed

    def start(self, work: Work, drain: Drain | None) -> None:
        run = work.run
        if drain is not None and isinstance(run, Job):
            run = replace(run, drain=drain)
        elif drain is not None and isinstance(run, Ask):
            run = Ask(run.client, _drained(run.call, self.url, drain, work.stopped))
        self.work, self.drained = replace(work, run=run), drain is not None
        self.worker.submit(run)

    def finished(self, report: Report, check_interval: float) -> bool:
        """Whether `report` answers the work under way; then it is done, and its `then` run
        (an answer that is an error puts the engine down instead; `EngineNotSetUp` goes on up:
        the daemon exits 2)."""
        work = self.work
        if work is None or not _answers(report, work.run):
            return False
        self.work, self.drained = None, False
        if isinstance(report, Answered):
            if report.error is not None:
                if not isinstance(report.error, EngineError):
                    raise report.error
                self.engine.went_down(report.error)
                return True
            work.then(report.value)
            self.engine.answered(time.monotonic(), check_interval)
        else:
            work.then(report)
        return True

    def upkeep(
        self, now: float, config: Config, reconciled: Callable[[Engine, setup.Learned], None]
    ) -> Work | None:
        """What the engine itself is owed next: a resume, a reconcile (`reconciled`: what the
        reloader makes of it), a name for its startup weights, a warm-up, a check of its
        weight version; each after its backoff."""
        engine, served = self.engine, self.engine.served
        if now < engine.retry_at():
            return None
        client = engine.client
        if served.resume_owed:
            return Work("resume", Ask(client, EngineClient.resume), engine.resumed)
        if not served.reconciled:
            return Work(
                "reconcile", Ask(client, setup.ask_engine), lambda learned: reconciled(engine, learned)
            )
        if (name := engine.name_owed) is not None:
            return Work("name", Ask(client, lambda c: c.set_weight_version(name)), self._named)
        if engine.warm_owed and config.canary.enabled:
            engine.warm_owed = False
            return Work("warm-up", WarmUp(client, config.canary), self._warmed)
        if now >= served.next_check:
            return Work("check", Ask(client, EngineClient.weight_version), engine.checked)
        return None

    def _named(self, _: object) -> None:
        self.engine.name_owed = None

    def _warmed(self, warmed: WarmedUp) -> None:
        self.engine.log.info("engine.warmed", ms=round(warmed.seconds * 1000, 1), problem=warmed.problem)

    def deadlines(self) -> Iterator[float]:
        """When the loop must next act for this engine (a busy one's report wakes it)."""
        engine, served = self.engine, self.engine.served
        if not self.idle:
            return
        if served.reconciled and not served.resume_owed:
            yield served.next_check
            if engine.last_error is not None and (at := engine.retry_at_follow()) > time.monotonic():
                yield at  # (once past, a freed place wakes the loop)
        else:
            yield engine.retry_at()

    def causes(self, standings: Sequence[Standing]) -> dict[str, str]:
        """Why the engine must not take traffic now, by cause: the one rule (see the module)."""
        engine, served = self.engine, self.engine.served
        found: dict[str, str] = {}
        if served.resume_owed:
            found["paused"] = engine.paused_why
        if not (served.reconciled and served.up):  # what it holds is known once it is reconciled
            return {**found, "down": served.down_reason or NOT_YET}
        if engine.unclean is not None:
            found["weights"] = engine.unclean
        for standing in standings:
            for cause, why in standing(engine).items():
                found[cause] = f"{found[cause]}; {why}" if cause in found else why
        return found

    def let_go(self) -> None:
        """Dropped by a SIGHUP, its work done: its thread resumes the engine if a resume is owed
        and closes its client, after what it runs now; the loop waits for none of it."""
        owed = self.engine.served.resume_owed

        def last(client: EngineClient) -> None:
            try:
                if owed:
                    client.resume()
            finally:
                client.close()

        self.worker.submit(Ask(self.engine.client, last))
        self.worker.finish()

    def close(self, wait: float = 5.0) -> None:
        """Let the engine's thread end (waiting `wait` seconds at most for a call under way),
        and resume the engine if a resume is owed (one call, within its deadline)."""
        self.worker.close(wait)
        engine = self.engine
        if engine.served.resume_owed:
            try:
                engine.client.resume()
                engine.resumed()
            except EngineError as exc:
                engine.went_down(exc)
        engine.client.close()


def tick(
    schedulers: Sequence[Scheduler],
    planners: Sequence[Planner],
    *,
    config: Config,
    rotation: Rotation,
    stopping: threading.Event,
    reconciled: Callable[[Engine, setup.Learned], None],
    now: float,
    owing: Sequence[Owing] = (),
) -> None:
    """Start, on each idle engine (the canary engine first), the first work owed: its own
    upkeep, else the planners' in their order. Budget: pausing or draining work only while
    fewer than `max_unavailable` engines are paused or drained."""
    for scheduler in schedulers:
        if not scheduler.idle:
            continue
        work = scheduler.upkeep(now, config, reconciled)
        drains = _drains(config.readiness, rotation, scheduler.url)
        slot = Slot(room=room(schedulers, config.engine.max_unavailable, owing), drains=drains)
        for planner in planners:
            if work is not None:
                break
            work = planner(scheduler.engine, slot)
        if work is None:
            continue
        drain = Drain(rotation, config.readiness.grace, config.readiness.drain_timeout, stopping)
        scheduler.start(work, drain if work.drains and drains else None)


def room(schedulers: Iterable[Scheduler], max_unavailable: int, owing: Sequence[Owing] = ()) -> int:
    """How many more engines may be paused or drained now: one budget, every kind of work."""
    return max_unavailable - sum(s.unavailable or any(o(s.engine) for o in owing) for s in schedulers)


def settle(schedulers: Iterable[Scheduler], rotation: Rotation, standings: Sequence[Standing]) -> None:
    """Each engine in or out of rotation by the one rule; a drain ends with its work."""
    for scheduler in schedulers:
        rotation.settle(scheduler.url, scheduler.causes(standings), drained=scheduler.drained)


def _drains(config: ReadinessConfig, rotation: Rotation, url: str) -> bool:
    """Whether work that drains takes the engine out of rotation now: drain on, and another
    engine takes traffic (else it runs in place rather than leave none). One the balancer has
    not seen back yet counts: the drain waits for it (`Drain.out`)."""
    return config.drain and rotation.others_ready(url)


def _drained(
    call: Callable[[EngineClient], Any], url: str, drain: Drain, stopped: Callable[[], Any] | None
) -> Callable[[EngineClient], Any]:
    """The call, on the engine's thread, once the engine is out of rotation and drained; it
    comes back in when the loop settles rotation after its answer, not here."""

    def run(client: EngineClient) -> Any:
        if drain.out(url, client.requests_in_flight) is None:  # the daemon began stopping
            return stopped() if stopped is not None else None
        return call(client)

    return run


def _answers(report: Report, run: Job | Ask | WarmUp) -> bool:
    if isinstance(report, Outcome):
        return report.job is run
    if isinstance(report, Answered):
        return report.ask is run
    return report.warmup is run
