"""One engine the daemon drives: its HTTP client, what it holds (`Served`), its own thread
and the job or question on it. A host with several engines has one of each per engine, so a
reload or a hung call on one never waits behind another's, and the loop never calls an
engine itself: it asks the engine's thread (`ask`) and goes on when the answer comes back
(`Engines.answered`). The reloader owns them all and decides, with `rollout`, what each
loads and when.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..checkpoint import order
from ..config import CanaryConfig, Config, EngineConfig
from ..engine.client import (
    BUILTIN_LOADER_FIX,
    BUILTIN_LOADER_RISK,
    RELOADING_PREFIX,
    STARTUP_VERSION,
    EngineClient,
)
from ..engine.swap import Target
from ..errors import EngineError, EngineUnavailable
from . import outcomes, reconcile, setup
from .jobs import Ask, Job, Outcome, ReloadWorker, Report, WarmUp
from .metrics import Metrics
from .readiness import Drain, Rotation
from .served import Served
from .state import Loaded


@dataclass(eq=False)
class Engine:
    url: str
    client: EngineClient
    served: Served
    worker: ReloadWorker
    log: Any
    """The daemon's logger with `engine=url` bound: every event about this engine names it."""
    metrics: Metrics
    rotation: Rotation
    in_flight: Job | None = None
    retry_at_follow: float = 0.0
    """A follower whose reload failed is not tried again before this (monotonic)."""
    follow_backoff: float = 0.0
    """The next wait after a follower's failed reload (reset to `retry_initial` at the first)."""
    last_error: str | None = None
    """Why the last reload on this engine failed (shown in `status` until one succeeds)."""
    asking: Ask | None = None
    """Calls on the engine's thread whose answer the loop waits for (one at a time)."""
    then: Callable[[Any], None] = field(default=lambda _: None)
    """What the loop does with that answer."""

    @classmethod
    def make(
        cls,
        config: EngineConfig,
        url: str,
        *,
        known: Loaded | None,
        good: tuple[Loaded, ...],
        post: Callable[[Report], None],
        log: Any,
        metrics: Metrics,
        rotation: Rotation,
        client: EngineClient | None = None,
    ) -> Engine:
        return cls(
            url=url,
            client=client or EngineClient(config, url=url),
            served=Served(known, good, config.retry_initial),
            worker=ReloadWorker(post, name=f"reload-worker {url}"),
            log=log.bind(engine=url),
            metrics=metrics,
            rotation=rotation,
        )

    @property
    def idle(self) -> bool:
        """Nothing of the loop's runs on the engine's thread: a reload may start."""
        return self.in_flight is None and self.asking is None

    def ask(self, call: Callable[[EngineClient], Any], then: Callable[[Any], None]) -> None:
        self.asking, self.then = Ask(self.client, call), then
        self.worker.submit(self.asking)

    def tend(self, now: float, reconcile: Callable[[Engine, setup.Learned], None]) -> None:
        """Resume an engine a failed resume left paused, ask an idle one whether it still holds
        what we think, reconcile one that does not (each after its backoff)."""
        served = self.served
        if not self.idle or now < served.retry_at:
            return
        if served.resume_owed:
            self.ask(EngineClient.resume, self._resumed)
        elif not served.reconciled:
            self.ask(setup.ask_engine, lambda learned: reconcile(self, learned))
        elif now >= served.next_check:
            self.ask(EngineClient.weight_version, self._checked)

    def load(
        self,
        candidate: order.Candidate,
        loading: Loaded,
        size: int,
        fallback: Loaded | None,
        config: Config,
        *,
        detect_ms: float | None,
        drain: Drain | None = None,
    ) -> None:
        """Hand a reload (and its canary) to this engine's reload thread. `detect_ms`: how long
        a new checkpoint took to be found (None, and not logged, for what was not just found)."""
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
            **({} if detect_ms is None else {"detect_ms": detect_ms}),
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
            drain=drain,
        )
        self.worker.submit(self.in_flight)

    def _checked(self, version: str) -> None:
        """Notice an engine that restarted (or was reloaded by someone else) while we idled."""
        serving = self.served.serving
        if serving is None or version != serving.version:
            self.log.warning(
                "engine.changed", engine_reported=version, expected=serving.version if serving else None
            )
            self.served.reconciled = False
            self.rotation.take_out(self.url, "down", "its weights changed under us: reconciling")

    def answered(self, now: float, check_interval: float) -> None:
        self.served.answered(now, check_interval)
        self.metrics.engine_up.labels(engine=self.url).set(1)
        if self.served.reconciled:
            self.rotation.put_back(self.url, "down")

    def went_down(self, exc: EngineError, retry_max: float) -> None:
        wait = self.served.went_down(time.monotonic(), retry_max, str(exc))
        self.metrics.engine_up.labels(engine=self.url).set(0)
        self.rotation.take_out(self.url, "down", str(exc))
        self.log.warning(
            "engine.unreachable" if isinstance(exc, EngineUnavailable) else "engine.error",
            url=self.url,
            reason=str(exc),
            retry_in_s=wait,
        )

    def _resumed(self, _: object = None) -> None:
        self.served.resume_owed = False
        self.rotation.put_back(self.url, "paused")
        self.log.info("engine.resumed")

    def rotate(self, outcome: Outcome, decision: outcomes.Decision) -> None:
        """After a reload: back in rotation only on weights that passed (or the good ones
        loaded back cleanly) and resumed; a reload that never paused changes nothing."""
        if decision.result != "changed":
            if decision.resume_owed:
                self.rotation.take_out(self.url, "paused", "its resume failed: retrying")
            canary_ok = outcome.canary_failed is None or (outcome.rolled_back and outcome.flush_probes > 0)
            if decision.engine_down is None and decision.set_serving and decision.serving and canary_ok:
                self.rotation.put_back(self.url, "weights")
            else:
                self.rotation.take_out(self.url, "weights", "its last reload did not end on verified weights")
        self.rotation.put_back(self.url, "drain")  # last: no check reads it ready in between

    def as_follower(self, decision: outcomes.Decision, config: EngineConfig) -> outcomes.Decision:
        """A follower loads a version that passed on the canary engine: a failed reload here is
        this engine's, retried with a backoff, and blames no checkpoint; a failed canary blames
        the version, for the whole host (loading the same weights again would fail again)."""
        if decision.result == "succeeded" or (decision.reject and decision.reject.check == "canary"):
            self.last_error, self.retry_at_follow = None, 0.0
            return decision
        failed = [e.fields.get("reason") for e in decision.events if e.name == "reload.failed"]
        reason = decision.reject.reason if decision.reject else str(failed[0] if failed else decision.result)
        if self.last_error is None:
            self.follow_backoff = config.retry_initial
        wait = self.follow_backoff
        self.retry_at_follow = time.monotonic() + wait
        self.follow_backoff = min(self.follow_backoff * 2, config.retry_max)
        self.last_error = reason
        retry = outcomes.Event("warning", "engine.retry", {"reason": reason, "retry_in_s": wait})
        return replace(decision, reject=None, regate=None, events=(*decision.events, retry))

    def let_go(self) -> None:
        """Dropped by a SIGHUP, its job done: its thread resumes the engine if a resume is owed
        and closes its client, after what it runs now; the loop waits for none of it."""
        owed = self.served.resume_owed

        def last(client: EngineClient) -> None:
            try:
                if owed:
                    client.resume()
            finally:
                client.close()

        self.worker.submit(Ask(self.client, last))
        self.worker.finish()

    def close(self, wait: float = 5.0) -> None:
        """Let the engine's thread end (waiting `wait` seconds at most for a call under way),
        and resume the engine if a resume is owed (one call, within its deadline)."""
        self.worker.close(wait)
        if self.served.resume_owed:
            try:
                self.client.resume()
                self._resumed()
            except EngineError as exc:
                self.went_down(exc, 0.0)
        self.client.close()

    def learn(
        self,
        whole: Config,
        root: Path,
        candidates: Mapping[str, order.Candidate],
        learned: setup.Learned,
        *,
        trusted: bool,
    ) -> tuple[str, Loaded]:
        """What the engine said of itself (reconcile: `setup.ask_engine`) means: its startup
        model and layout baseline; returns the weight version it reports and what that is."""
        served, found, version, server = self.served, learned.found, learned.version, learned.server
        setup.untested(found, self.log)
        config = whole.engine
        setup.per_release(
            config, whole.readiness.drain, found, server, self.log, whole.adapters.root is not None
        )
        served.sleep_capable, served.extension, served.lora = server.sleep_mode, server.extension, server.lora
        if not server.extension:
            self.log.warning("engine.builtin_loader", reason=BUILTIN_LOADER_RISK, fix=BUILTIN_LOADER_FIX)
        served.startup = setup.startup_path(server)
        serving = reconcile.serving(
            version, served.startup, known=served.serving, root=root, candidates=candidates, trusted=trusted
        )
        served.baseline = setup.settle_baseline(config, server, served, serving.path, self.log)
        served.reconciled = True
        served.backoff = config.retry_initial
        return version, serving

    def say_reconciled(self, version: str, serving: Loaded, learned: setup.Learned) -> None:
        """Said once the state file holds what it means (whoever reads it on the line finds it)."""
        fields = {"version": serving.version, "path": serving.path, "engine_reported": version}
        self.log.info("engine.reconciled", **fields, **learned.found.logged())
        self.rotation.put_back(self.url, "down")
        if version.startswith(RELOADING_PREFIX):  # a mix of two checkpoints: out until a good one loads
            self.rotation.take_out(self.url, "weights", "a reload was interrupted: its weights are unknown")

    def settle(self, version: str, serving: Loaded, canary: CanaryConfig, *, paused: bool) -> None:
        """After `learn`, unless a restore runs: resume an engine found paused (only a daemon
        killed mid-reload leaves it so), name startup weights from the root (so clients and
        `weight_info` see which checkpoint it is), and warm the engine up for its first canary."""
        name = serving.version if version == STARTUP_VERSION and serving.in_root else None

        def calls(client: EngineClient) -> None:
            if paused:
                client.resume()
            if name is not None:
                client.set_weight_version(name)

        def done(_: object) -> None:
            if paused:
                self.rotation.put_back(self.url, "paused")
                self.log.warning("engine.resumed", reason="found paused at reconcile")

        if paused:
            self.rotation.take_out(self.url, "paused", "found paused: resuming it")
        if paused or name is not None:
            self.ask(calls, done)
        if canary.enabled:
            self.worker.submit(WarmUp(self.client, canary))

    def deadlines(self) -> Iterator[float]:
        """When the loop must next act for this engine (a busy one's report wakes it)."""
        served = self.served
        if not self.idle:
            return
        if served.reconciled and not served.resume_owed:
            yield served.next_check
            if self.last_error is not None and self.retry_at_follow > time.monotonic():
                yield self.retry_at_follow  # (once past, a freed place wakes the loop)
        else:
            yield served.retry_at
