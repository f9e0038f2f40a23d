"""The engines of one host: the canary engine first, then its followers; made, regrouped on a
SIGHUP and closed together, and the loop's way to an engine's answers (`answered`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..checkpoint import layout
from ..config import EngineConfig, ReadinessConfig
from ..engine.client import EngineClient
from ..errors import EngineError, EngineNotSetUp
from . import rollout, status
from .catalog import Catalog
from .engine import Engine
from .jobs import Answered, Ask, Job, Report
from .metrics import Metrics
from .readiness import Drain, Rotation
from .served import Served
from .state import Loaded

History = tuple[Loaded | None, tuple[Loaded, ...]]
"""What the host serves and the checkpoints that passed their canary: a new engine starts from it."""


class Engines:
    """The engines of this host, the canary engine first, and those dropped by a SIGHUP while a
    job ran on them (closed once it is done)."""

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
        """Which engines should take traffic (`GET /ready/<n>`)."""
        self.stopping = threading.Event()
        """Set at `close`: a reload thread waiting for its engine to drain stops waiting."""
        self.all = [self._make(config, url, history) for url in config.urls]
        self.retired: list[Engine] = []

    def _make(self, config: EngineConfig, url: str, history: History) -> Engine:
        known, good = history
        return Engine.make(
            config,
            url,
            known=known,
            good=good,
            post=self.post,
            log=self.log,
            metrics=self.metrics,
            rotation=self.rotation,
            client=self.clients.get(url),
        )

    @property
    def canary(self) -> Engine:
        return self.all[0]

    @property
    def followers(self) -> list[Engine]:
        return self.all[1:]

    def __iter__(self) -> Iterator[Engine]:
        return iter(self.all)

    def jobs(self) -> list[Job]:
        return [e.in_flight for e in (*self.all, *self.retired) if e.in_flight is not None]

    def served(self) -> list[Served]:
        return [e.served for e in self.all]

    def busy(self) -> int:
        return sum(e.in_flight is not None for e in self.all)

    def take(self, job: Job) -> Engine | None:
        """The engine `job` ran on, now free; None if it was dropped (it is closed then)."""
        engine = next((e for e in (*self.all, *self.retired) if e.in_flight is job), None)
        if engine is None:
            return None
        engine.in_flight = None
        if engine in self.retired:
            self.retired.remove(engine)
            engine.let_go()
            return None
        return engine

    def start(self) -> None:
        for engine in self.all:
            engine.worker.start()

    def is_alive(self) -> bool:
        return all(e.worker.is_alive() for e in self.all)

    def close(self, wait: float = 5.0) -> None:
        """Every engine's thread is told to stop first, so a shutdown waits `wait` seconds in
        all for calls under way, not that much per engine."""
        engines = (*self.all, *self.retired)
        self.stopping.set()
        for engine in engines:
            engine.worker.finish()
        until = time.monotonic() + wait
        for engine in engines:
            engine.close(max(0.0, until - time.monotonic()))

    def answered(self, answer: Answered, *, act: bool = True) -> None:
        """An engine's thread answered what the loop asked: go on from there (`act`: the daemon
        is not stopping). An answer to a question asked before a SIGHUP regrouped the engines
        is dropped."""
        engine = next((e for e in self.all if e.asking is answer.ask), None)
        if engine is None:
            return
        then, engine.asking = engine.then, None
        if not act:
            return
        try:
            if answer.error is not None:
                raise answer.error  # EngineNotSetUp goes on up: the daemon exits 2
            then(answer.value)
        except EngineError as exc:
            engine.went_down(exc, self.config.retry_max)
            return
        engine.answered(time.monotonic(), self.config.check_interval)

    def regroup(self, config: EngineConfig, history: History) -> None:
        """SIGHUP with a new `[engine]`: every engine is reconciled again; engines new in `urls`
        start with the host's history, dropped ones are let go (after their job, if one runs)."""
        self.config = config
        current = {e.url: e for e in self.all}
        regrouped = []
        for url in config.urls:
            engine = current.pop(url, None)
            if engine is None:
                engine = self._make(config, url, history)
                engine.worker.start()
            else:
                old, engine.client = engine.client, self.clients.get(url) or EngineClient(config, url=url)
                engine.worker.submit(Ask(old, EngineClient.close))  # after what it runs with it
                engine.asking = None  # its answer, if one comes, was asked of the old client
            engine.served.reconciled = False
            self.rotation.take_out(url, "down", "reconciling after a config reload")
            regrouped.append(engine)
        for dropped in current.values():
            dropped.log.info("engine.dropped")
            if dropped.in_flight is None:
                dropped.let_go()
            else:
                self.retired.append(dropped)
        self.all = regrouped
        self.rotation.track(config.urls)

    def views(
        self, want: Loaded | None, catalog: Catalog, now: float, newer: bool = False
    ) -> tuple[status.EngineView, ...]:
        """`newer`: also what each engine has yet to serve (for the metrics: a pass over every
        candidate per engine, so not for every status line)."""
        return tuple(self._view(e, want, catalog, now, newer) for e in self.all)

    @staticmethod
    def _view(e: Engine, want: Loaded | None, catalog: Catalog, now: float, newer: bool) -> status.EngineView:
        """What fails there now: why the engine did not answer, else why its last reload failed;
        and what it has yet to serve."""
        down = e.served.down_reason if not e.served.up else None
        retry_at = e.served.retry_at if down else e.retry_at_follow if e.last_error else None
        return status.EngineView(
            url=e.url,
            version=e.served.serving.version if e.served.serving else None,
            fingerprint=e.served.serving.fingerprint or None if e.served.serving else None,
            state=rollout.state(
                up=e.served.up,
                busy=e.in_flight is not None,
                serving=e.served.serving,
                want=want,
                pinned=catalog.pinned,
            ),
            reachable=e.served.up,
            last_reload=e.served.last_reload,
            last_error=down or e.last_error,
            retry_in_s=None if retry_at is None else round(max(0.0, retry_at - now), 1),
            # Not while pinned (held on purpose) or unreachable (said by its own alert).
            newer=tuple(sorted(catalog.newer_than(e.served.serving_key())))
            if newer and e.served.up and catalog.pinned is None
            else (),
        )

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

    def drain(self, config: ReadinessConfig, url: str) -> Drain | None:
        """How a reload takes its engine out of rotation first; None to reload it in place
        (drain off, or no other engine is in rotation: taking it out would leave none). One
        the balancer has not seen back yet counts: the drain waits for it (`Drain.out`)."""
        if not (config.drain and self.rotation.others_ready(url)):
            return None
        return Drain(self.rotation, config.grace, config.drain_timeout, self.stopping)

    def check_now(self) -> None:
        """Ask every engine now, and retry a failed follower now, instead of at the next timer."""
        for engine in self.all:
            engine.served.next_check = engine.served.retry_at = engine.retry_at_follow = 0.0
