"""One engine the daemon drives: its HTTP client, what it holds (`Served`), its own reload
thread and the job on it. A host with several engines has one of each per engine, so a
reload on one never waits behind another's; the reloader owns them all and decides, with
`rollout`, what each loads and when.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..checkpoint import layout, order
from ..config import CanaryConfig, Config, EngineConfig
from ..engine.client import BUILTIN_LOADER_FIX, BUILTIN_LOADER_RISK, STARTUP_VERSION, EngineClient
from ..engine.swap import Target
from ..errors import EngineCallFailed, EngineError, EngineNotSetUp, EngineUnavailable
from . import outcomes, reconcile, rollout, setup, status
from .jobs import Job, Outcome, ReloadWorker, WarmedUp, WarmUp
from .metrics import Metrics
from .served import Served
from .state import Loaded

History = tuple[Loaded | None, tuple[Loaded, ...]]
"""What the host serves and the checkpoints that passed their canary: a new engine starts from it."""


@dataclass(eq=False)
class Engine:
    url: str
    client: EngineClient
    served: Served
    worker: ReloadWorker
    log: Any
    """The daemon's logger with `engine=url` bound: every event about this engine names it."""
    metrics: Metrics
    in_flight: Job | None = None
    retry_at_follow: float = 0.0
    """A follower whose reload failed is not tried again before this (monotonic)."""
    follow_backoff: float = 0.0
    """The next wait after a follower's failed reload (reset to `retry_initial` at the first)."""
    last_error: str | None = None
    """Why the last reload on this engine failed (shown in `status` until one succeeds)."""

    @classmethod
    def make(
        cls,
        config: EngineConfig,
        url: str,
        *,
        known: Loaded | None,
        good: tuple[Loaded, ...],
        post: Callable[[Outcome | WarmedUp], None],
        log: Any,
        metrics: Metrics,
        client: EngineClient | None = None,
    ) -> Engine:
        return cls(
            url=url,
            client=client or EngineClient(config, url=url),
            served=Served(known, good, config.retry_initial),
            worker=ReloadWorker(post, name=f"reload-worker {url}"),
            log=log.bind(engine=url),
            metrics=metrics,
        )

    def tend(self, now: float, config: EngineConfig, reconcile: Callable[[Engine], None]) -> None:
        """Ask an idle engine whether it still holds what we think, reconcile one that does not
        (after its backoff); an engine that fails to answer backs off."""
        served = self.served
        try:
            if served.reconciled and self.in_flight is None and now >= served.next_check:
                self.check()
            if not served.reconciled:
                if now < served.retry_at:
                    return
                reconcile(self)
        except EngineError as exc:
            self.went_down(exc, config.retry_max)
            return
        self.answered(now, config.check_interval)

    def load(
        self,
        candidate: order.Candidate,
        loading: Loaded,
        size: int,
        fallback: Loaded | None,
        config: Config,
        *,
        detect_ms: float | None,
    ) -> None:
        """Hand a reload (and its canary) to this engine's reload thread."""
        served = self.served
        strategy = config.engine.strategy
        if strategy == "auto":
            strategy = "sleep" if served.sleep_capable else "inplace"
        self.log.info(
            "reload.started",
            version=loading.version,
            path=loading.path,
            bytes=size,
            from_version=served.serving.version if served.serving else None,
            detect_ms=detect_ms,
            strategy=strategy,
            loader="extension" if served.extension else "builtin",
        )
        self.in_flight = Job(
            client=self.client,
            candidate=candidate,
            target=Target(loading.version, loading.path, loading.files),
            rollback=fallback,
            loading=loading,
            size=size,
            canary=config.canary,
            strategy=strategy,
            extension=served.extension,
        )
        self.worker.submit(self.in_flight)

    def check(self) -> None:
        """Notice an engine that restarted (or was reloaded by someone else) while we idled."""
        version = self.client.weight_version()
        serving = self.served.serving
        if serving is None or version != serving.version:
            self.log.warning(
                "engine.changed", engine_reported=version, expected=serving.version if serving else None
            )
            self.served.reconciled = False

    def answered(self, now: float, check_interval: float) -> None:
        self.served.answered(now, check_interval)
        self.metrics.engine_up.labels(engine=self.url).set(1)

    def went_down(self, exc: EngineError, retry_max: float) -> None:
        wait = self.served.went_down(time.monotonic(), retry_max)
        self.metrics.engine_up.labels(engine=self.url).set(0)
        self.log.warning(
            "engine.unreachable" if isinstance(exc, EngineUnavailable) else "engine.error",
            url=self.url,
            reason=str(exc),
            retry_in_s=wait,
        )

    def retry_resume(self, retry_max: float) -> None:
        try:
            self.client.resume()
        except (EngineUnavailable, EngineCallFailed) as exc:
            self.went_down(exc, retry_max)
            return
        self.served.resume_owed = False
        self.log.info("engine.resumed")

    def as_follower(self, decision: outcomes.Decision, config: EngineConfig) -> outcomes.Decision:
        """A follower loads a version that passed on the canary engine: a failed reload here is
        this engine's, retried with a backoff, and blames no checkpoint; a failed canary blames
        the version, for the whole host (loading the same weights again would fail again)."""
        if decision.result == "succeeded" or (decision.reject and decision.reject.check == "canary"):
            self.last_error, self.retry_at_follow = None, 0.0
            return decision
        reason = decision.reject.reason if decision.reject else decision.result
        if self.last_error is None:
            self.follow_backoff = config.retry_initial
        wait = self.follow_backoff
        self.retry_at_follow = time.monotonic() + wait
        self.follow_backoff = min(self.follow_backoff * 2, config.retry_max)
        self.last_error = reason
        retry = outcomes.Event("warning", "engine.retry", {"reason": reason, "retry_in_s": wait})
        return replace(decision, reject=None, regate=None, events=(*decision.events, retry))

    def close(self) -> None:
        self.worker.close()
        if self.served.resume_owed:
            self.retry_resume(0.0)
        self.client.close()

    def learn(
        self, config: EngineConfig, root: Path, candidates: Mapping[str, order.Candidate], *, trusted: bool
    ) -> tuple[str, Loaded]:
        """Ask the engine what it is and serves (reconcile): its capabilities, startup model,
        layout baseline; returns the weight version it reports and what that means."""
        served = self.served
        found = setup.check_capabilities(self.client, self.log)
        version = self.client.weight_version()
        server = self.client.server_config()
        served.sleep_capable, served.extension = server.sleep_mode, server.extension
        if not server.extension:
            self.log.warning("engine.builtin_loader", reason=BUILTIN_LOADER_RISK, fix=BUILTIN_LOADER_FIX)
        served.startup = setup.startup_path(server)
        serving = reconcile.serving(
            version, served.startup, known=served.serving, root=root, candidates=candidates, trusted=trusted
        )
        served.baseline = setup.settle_baseline(config, server, served, serving.path, self.log)
        served.reconciled = True
        served.backoff = config.retry_initial
        self.log.info(
            "engine.reconciled",
            version=serving.version,
            path=serving.path,
            engine_reported=version,
            **found.logged(),
        )
        return version, serving

    def settle(self, version: str, serving: Loaded, canary: CanaryConfig) -> None:
        """After `learn`, unless a restore runs: resume an engine found paused, name startup
        weights from the root, and warm the engine up for its first canary."""
        if self.client.is_paused():
            # Only a daemon killed mid-reload leaves it so: nothing else pauses this engine.
            self.client.resume()
            self.log.warning("engine.resumed", reason="found paused at reconcile")
        if version == STARTUP_VERSION and serving.in_root:
            # Name the startup weights, so clients and `weight_info` see which checkpoint it is.
            self.client.set_weight_version(serving.version)
        if canary.enabled:
            self.worker.submit(WarmUp(self.client, canary))

    def deadlines(self) -> Iterator[float]:
        """When the loop must next act for this engine."""
        served = self.served
        if served.reconciled and self.in_flight is None:
            yield served.next_check
            if self.last_error is not None:
                yield self.retry_at_follow
        if not served.reconciled or served.resume_owed:
            yield served.retry_at


class Engines:
    """The engines of this host, the canary engine first, and those dropped by a SIGHUP while a
    job ran on them (closed once it is done)."""

    def __init__(
        self,
        config: EngineConfig,
        history: History,
        post: Callable[[Outcome | WarmedUp], None],
        log: Any,
        metrics: Metrics,
        clients: Mapping[str, EngineClient],
    ) -> None:
        self.post, self.log, self.metrics, self.clients = post, log, metrics, dict(clients)
        """`clients`: made by the caller (tests: scripted engines); the others are made here."""
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
            engine.close()
            return None
        return engine

    def start(self) -> None:
        for engine in self.all:
            engine.worker.start()

    def is_alive(self) -> bool:
        return all(e.worker.is_alive() for e in self.all)

    def close(self) -> None:
        for engine in (*self.all, *self.retired):
            engine.close()

    def regroup(self, config: EngineConfig, history: History) -> None:
        """SIGHUP with a new `[engine]`: every engine is reconciled again; engines new in `urls`
        start with the host's history, dropped ones are let go (after their job, if one runs)."""
        current = {e.url: e for e in self.all}
        regrouped = []
        for url in config.urls:
            engine = current.pop(url, None)
            if engine is None:
                engine = self._make(config, url, history)
                engine.worker.start()
            else:
                engine.client = self.clients.get(url) or EngineClient(config, url=url)
            engine.served.reconciled = False
            regrouped.append(engine)
        for dropped in current.values():
            dropped.log.info("engine.dropped")
            if dropped.in_flight is None:
                dropped.close()
            else:
                self.retired.append(dropped)
        self.all = regrouped

    def views(self, want: Loaded | None, pinned: str | None, now: float) -> tuple[status.EngineView, ...]:
        return tuple(
            status.EngineView(
                url=e.url,
                version=e.served.serving.version if e.served.serving else None,
                fingerprint=e.served.serving.fingerprint or None if e.served.serving else None,
                state=rollout.state(
                    up=e.served.up,
                    busy=e.in_flight is not None,
                    serving=e.served.serving,
                    want=want,
                    pinned=pinned,
                ),
                reachable=e.served.up,
                last_reload=e.served.last_reload,
                last_error=e.last_error,
                retry_in_s=round(max(0.0, e.retry_at_follow - now), 1) if e.last_error else None,
            )
            for e in self.all
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

    def check_now(self) -> None:
        """Ask every engine now, and retry a failed follower now, instead of at the next timer."""
        for engine in self.all:
            engine.served.next_check = engine.served.retry_at = engine.retry_at_follow = 0.0
