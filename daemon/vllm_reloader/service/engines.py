"""The engines of one host: the canary engine first, then its followers, each with its one
scheduler; made, regrouped on a SIGHUP and closed together, and the loop's way to each engine's
work (`tick`, `finished`) and rotation (`settle`), both decided in `scheduler`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ..checkpoint import layout
from ..config import Config, EngineConfig
from ..engine.client import EngineClient
from ..errors import EngineNotSetUp
from . import rollout, scheduler, setup, status
from .catalog import Catalog
from .engine import Engine
from .jobs import Ask, Job, Report
from .metrics import Metrics
from .readiness import Rotation
from .scheduler import Owing, Planner, Scheduler, Standing
from .served import Served
from .state import Loaded

History = tuple[Loaded | None, tuple[Loaded, ...]]
"""What the host serves and the checkpoints that passed their canary: a new engine starts from it."""
RECONFIGURED = "reconciling after a config reload"


class Engines:
    """The engines of this host, the canary engine first, and those dropped by a SIGHUP while
    work ran on them (closed once it is done)."""

    def __init__(
        self,
        config: EngineConfig,
        history: History,
        post: Callable[[Report], None],
        log: Any,
        metrics: Metrics,
        clients: Mapping[str, EngineClient],
    ) -> None:
        self.config, self.post, self.log, self.metrics = config, post, log, metrics
        self.clients = dict(clients)
        """Made by the caller (tests: scripted engines); the others are made here."""
        self.rotation = Rotation(config.urls)
        """Which engines should take traffic (`GET /ready/<n>`): written by the schedulers alone."""
        self.stopping = threading.Event()
        """Set at a stop: a drain under way stops waiting and pauses nothing."""
        self.schedulers = [self._make(config, url, history) for url in config.urls]
        self.retired: list[Scheduler] = []

    def _make(self, config: EngineConfig, url: str, history: History) -> Scheduler:
        known, good = history
        engine = Engine.make(
            config,
            url,
            known=known,
            good=good,
            log=self.log,
            metrics=self.metrics,
            client=self.clients.get(url),
        )
        return Scheduler(engine, self.post)

    @property
    def all(self) -> list[Engine]:
        return [s.engine for s in self.schedulers]

    @property
    def canary(self) -> Engine:
        return self.schedulers[0].engine

    @property
    def followers(self) -> list[Engine]:
        return self.all[1:]

    def __iter__(self) -> Iterator[Engine]:
        return iter(self.all)

    def of(self, engine: Engine) -> Scheduler:
        return next(s for s in self.schedulers if s.engine is engine)

    def idle(self, engine: Engine) -> bool:
        return self.of(engine).idle

    def jobs(self) -> list[Job]:
        """The base reloads under way (those of dropped engines too)."""
        return [job for s in (*self.schedulers, *self.retired) if (job := s.job) is not None]

    def under_way(self) -> bool:
        """Whether work a stop waits for runs on any engine (`scheduler.RELOAD_KINDS`)."""
        return any(
            s.work is not None and s.work.kind in scheduler.RELOAD_KINDS
            for s in (*self.schedulers, *self.retired)
        )

    def served(self) -> list[Served]:
        return [e.served for e in self.all]

    def holds(self) -> dict[str, tuple[str | None, ...]]:
        """Each engine's work under way: the copies it reads (leased while it runs)."""
        return {s.url: s.work.holds for s in (*self.schedulers, *self.retired) if s.work is not None}

    # -- the loop's turn ------------------------------------------------------------------------

    def tick(
        self,
        planners: Sequence[Planner],
        config: Config,
        reconciled: Callable[[Engine, setup.Learned], None],
        owing: Sequence[Owing] = (),
    ) -> None:
        scheduler.tick(
            self.schedulers, planners, config=config, rotation=self.rotation, stopping=self.stopping,
            reconciled=reconciled, now=time.monotonic(), owing=owing,
        )  # fmt: skip

    def settle(self, standings: Sequence[Standing]) -> None:
        scheduler.settle(self.schedulers, self.rotation, standings)

    def finished(self, report: Report) -> None:
        """An engine's thread reported on its work: done, and its answer applied. A report of a
        dropped engine's last work lets it go."""
        for each in self.schedulers:
            if each.finished(report, self.config.check_interval):
                return
        for each in list(self.retired):
            if each.finished(report, self.config.check_interval):
                self.retired.remove(each)
                each.let_go()
                return

    def start(self) -> None:
        for each in self.schedulers:
            each.worker.start()

    def is_alive(self) -> bool:
        return all(s.worker.is_alive() for s in self.schedulers)

    def close(self, wait: float = 5.0) -> None:
        """Every engine's thread is told to stop first, so a shutdown waits `wait` seconds in
        all for calls under way, not that much per engine."""
        each = (*self.schedulers, *self.retired)
        self.stopping.set()
        for one in each:
            one.worker.finish()
        until = time.monotonic() + wait
        for one in each:
            one.close(max(0.0, until - time.monotonic()))

    def regroup(self, config: EngineConfig, history: History) -> None:
        """SIGHUP with a new `[engine]`: every engine is reconciled again; engines new in `urls`
        start with the host's history, dropped ones are let go (after their work, if one runs)."""
        self.config = config
        current = {s.url: s for s in self.schedulers}
        for back in [s for s in self.retired if s.url in config.urls]:  # back before its work ended:
            self.retired.remove(back)  # its one thread, never a second beside it
            current[back.url] = back
        regrouped = []
        for url in config.urls:
            found = current.pop(url, None)
            if found is None:
                found = self._make(config, url, history)
                found.worker.start()
            else:
                engine = found.engine
                old, engine.client = engine.client, self.clients.get(url) or EngineClient(config, url=url)
                found.worker.submit(Ask(old, EngineClient.close))  # after what it runs with it
                if found.work is not None and found.work.kind not in scheduler.RELOAD_KINDS:
                    found.work = None  # its answer, if one comes, was asked of the old client
            found.engine.served.reconciled = False
            found.engine.served.down_reason = RECONFIGURED
            regrouped.append(found)
        for dropped in current.values():
            dropped.engine.log.info("engine.dropped")
            if dropped.work is None:
                dropped.let_go()
            else:
                self.retired.append(dropped)
        self.schedulers = regrouped
        self.rotation.track(config.urls)

    def check_now(self) -> None:
        """Ask every engine now, and retry a failed follower now, instead of at the next timer."""
        for engine in self.all:
            engine.served.next_check = 0.0
            engine.down.forget(lambda _: True)
            engine.follow.forget(lambda _: True)

    # -- what they hold -------------------------------------------------------------------------

    def views(
        self, want: Loaded | None, catalog: Catalog, now: float, newer: bool = False
    ) -> tuple[status.EngineView, ...]:
        """`newer`: also what each engine has yet to serve (for the metrics: a pass over every
        candidate per engine, so not for every status line)."""
        return tuple(_view(s, want, catalog, now, newer) for s in self.schedulers)

    def same_layout(self, engine: Engine) -> None:
        """One gate serves every engine, so all must serve the same layout."""
        mine = engine.served.baseline
        for other in self.all:
            theirs = other.served.baseline
            if other is engine or mine is None or theirs is None:
                continue
            if difference := layout.first_difference(mine, theirs):
                raise EngineNotSetUp(
                    f"engine {engine.url} serves a model whose layout differs from engine {other.url}'s "
                    f"({difference[0]}): the engines of one daemon must serve the same model"
                )


def _view(s: Scheduler, want: Loaded | None, catalog: Catalog, now: float, newer: bool) -> status.EngineView:
    """What fails there now: why the engine did not answer, else why its last reload failed;
    and what it has yet to serve."""
    e = s.engine
    down = e.served.down_reason if not e.served.up else None
    retry_at = e.retry_at() if down else e.retry_at_follow() if e.last_error else None
    return status.EngineView(
        url=e.url,
        version=e.served.serving.version if e.served.serving else None,
        fingerprint=e.served.serving.fingerprint or None if e.served.serving else None,
        state=rollout.state(
            up=e.served.up, busy=s.job is not None, serving=e.served.serving, want=want, pinned=catalog.pinned
        ),
        reachable=e.served.up,
        last_reload=e.served.last_reload,
        last_error=down or e.last_error,
        retry_in_s=None if not retry_at else round(max(0.0, retry_at - now), 1),
        nodes=status.node_views(*e.nodes) if e.nodes else (),
        # Not while pinned (held on purpose) or unreachable (said by its own alert).
        newer=tuple(sorted(catalog.newer_than(e.served.serving_key())))
        if newer and e.served.up and catalog.pinned is None
        else (),
    )
