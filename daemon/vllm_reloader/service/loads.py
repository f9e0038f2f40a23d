"""What each engine's base weights should be: the reloader's planner for its engines, and what
a reload's outcome means once it comes back.

For an idle engine its scheduler asks `plan`, and gets the work owed first: weights of unknown
mix loaded back, then a recalled content left, then — on the canary engine — the newest version
the gate passed, and — on a follower — the version that passed on the canary engine. Every
base reload pauses its engine, so each waits for room in the host's budget. `standing` says
whether what an engine's weights are lets it take traffic; `finished` applies an outcome.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import failpoints
from ..checkpoint import gate, order
from ..config import Config
from ..engine import probe
from ..engine.client import RELOADING_PREFIX
from ..errors import ReloadFailed
from ..sources.verdicts import Verdict
from . import fleet, outcomes, rollback, rollout, setup
from .book import Book
from .catalog import Catalog, detection_lag_ms
from .engine import Engine
from .engines import Engines
from .gating import Ready
from .jobs import Job, Outcome, target_of
from .metrics import Metrics
from .reverify import Reverified
from .scheduler import Slot, Work
from .staging import Staging
from .state import Loaded

NOT_CLEAN = "not clean after its rollback: out until a reload passes on it, or it restarts"
UNCLEAN = "engine_unclean"
"""The record store's kind for engines kept out though they serve good weights."""


class Loads:
    def __init__(
        self,
        config: Config,
        engines: Engines,
        catalog: Catalog,
        book: Book,
        metrics: Metrics,
        log: Any,
        post: Callable[[Reverified], None],
    ) -> None:
        self.config, self.engines, self.catalog, self.book = config, engines, catalog, book
        self.metrics, self.log = metrics, log
        self.ready: Ready | None = None
        """A verdict of `ready` on the newest version, waiting for the canary engine."""
        self.staging = Staging(config.rollout.host if config.node.role == "lead" else None)
        self.recalls = fleet.Recalls(log)
        self.targets = rollback.Targets(post, metrics, log)
        unclean = book.records.all(UNCLEAN)
        for engine in engines:
            engine.unclean = unclean.get(engine.url)

    @property
    def canary(self) -> Engine:
        return self.engines.canary

    # -- the planner ----------------------------------------------------------------------------

    def plan(self, engine: Engine, slot: Slot) -> Work | None:
        now = time.monotonic()
        if not engine.served.reconciled or slot.room <= 0:  # every base reload pauses its engine
            return None
        if (restore := engine.restore) is not None and now >= engine.retry_at_follow():  # it may be paused
            engine.restore = None
            return self._work(engine, restore.candidate(), restore, 0, restore=True)
        if (back := self.recalls.plan(engine, now, self.rollback_target)) is not None:
            work = self._work(engine, back.candidate(), back, 0, restore=True)
            assert isinstance(work.run, Job)
            self.recalls.started(engine, work.run)
            return work
        if engine is self.canary:
            return self._advance(engine, now)
        want = rollout.wanted(self.canary.served)
        follower = rollout.Follower(engine.url, engine.served.serving, True, False, engine.retry_at_follow())
        room = slot.room - (self.ready is not None)  # the canary engine's next load keeps its place
        if want is None or not rollout.next_to_load([follower], want, self.catalog.pinned, room, now):
            return None
        serving = engine.served.serving
        engine.log.info("engine.behind", version=want.version, serving=serving and serving.version)
        return self._work(engine, want.candidate(), want, 0)

    def _advance(self, canary: Engine, now: float) -> Work | None:
        """The canary engine loads a verdict of `ready`, once a better rollback target being
        read again is done (at most `REVERIFY_HOLD`), and not while its last load backs off."""
        if self.ready is None or canary.served.baseline is None or now < canary.retry_at_follow():
            return None
        if self.ready.hold_until is None:  # a better target whose files moved: wait for its read
            self.rollback_target(canary, skip=self.ready.candidate.name)
            held = rollback.REVERIFY_HOLD if self.targets.holding(canary) else 0.0
            self.ready = replace(self.ready, hold_until=now + held)
        if self.targets.holding(canary) and now < (self.ready.hold_until or 0.0):
            return None
        if self.staging.owed(self.ready):  # a multi-node engine: every node holds it (and its way back)
            back = self.rollback_target(canary, skip=self.ready.candidate.name)
            fallback = None if back is None else target_of(back, self.staging.node)
            return self.staging.ask(canary, self.ready, fallback)
        ready, self.ready = self.ready, None
        return self._work(canary, ready.candidate, ready.loading, ready.size, scanned=ready.host_scanned)

    def _work(
        self,
        engine: Engine,
        candidate: order.Candidate,
        loading: Loaded,
        size: int,
        *,
        restore: bool = False,
        scanned: bool = True,
    ) -> Work:
        """A reload (and its canary) on the engine's thread; a restore is neither drained nor
        timed (it is no new checkpoint found). `scanned`: the gate scanned the bytes for
        NaN/Inf (else this engine's probe must, or the host before the pause); what engines
        served before, or the canary engine serves, was scanned."""
        fallback = self.rollback_target(engine, skip=candidate.name)
        found = bool(candidate.fingerprint) and candidate.name != self.catalog.pinned
        lag_ms = detection_lag_ms(Path(loading.path), self.catalog.watching_since) if found else None
        if lag_ms is not None:
            self.metrics.detection_lag.observe(lag_ms / 1000)
        served, config = engine.served, self.config
        strategy = config.engine.strategy
        if strategy == "auto":
            strategy = "sleep" if served.sleep_capable else "inplace"
        engine.log.info(
            "reload.started", version=loading.version, path=loading.path, bytes=size,
            from_version=served.serving.version if served.serving else None,
            **({} if lag_ms is None else {"detect_ms": lag_ms}),
            strategy=strategy, loader="extension" if served.extension else "builtin",
        )  # fmt: skip
        node = self.staging.node
        target = target_of(loading, node)
        owed, both = not scanned and config.gate.check_finite, config.gate.scan == "both"
        host_scan = None
        if owed and not engine.can_scan(config):
            host_scan = replace(gate.GateOptions.from_config(config), verify_digests=False)
        job = Job(
            client=engine.client, candidate=candidate, target=target, rollback=fallback, loading=loading,
            size=size, canary=config.canary, strategy=strategy, extension=served.extension,
            scan=(owed and host_scan is None) or (engine.scans(config) and (not scanned or both)),
            host_scan=host_scan, node=node, restore=restore,
        )  # fmt: skip
        return Work(
            "restore" if restore else "reload", job, lambda outcome: self.finished(engine, outcome),
            pauses=True, drains=not restore, holds=(loading.path, fallback.path if fallback else None),
        )  # fmt: skip

    def standing(self, engine: Engine) -> dict[str, str]:
        """Why its base weights keep it out of rotation: unknown, or rejected since it loaded."""
        serving = engine.served.serving
        if serving is None or serving.name.startswith(RELOADING_PREFIX):
            return {"weights": "a reload was interrupted: its weights are unknown"}
        base = order.base_name(serving.name)
        if serving.fingerprint and serving.fingerprint in self.catalog.rejected_fingerprints().get(base, ()):
            why = self.catalog.rejection_of_content(base, serving.fingerprint)
            return {"weights": f"its last reload did not end on verified weights: {serving.version} ({why})"}
        return {}

    # -- what engines answered --------------------------------------------------------------------

    def reconciled(self, engine: Engine, learned: setup.Learned) -> None:
        """What the engine serves, so nothing is reloaded needlessly after a restart."""
        self.catalog.rescan()
        own = engine is self.canary  # the record is the canary engine's own
        version, serving = engine.learn(
            self.config, self.config.checkpoint_root, self.catalog.candidates, learned, trusted=own
        )
        self.engines.same_layout(engine)
        self._keep_unclean()
        target = self.rollback_target(engine) if version.startswith(RELOADING_PREFIX) else None
        if target is not None:  # a mix of two checkpoints: a good one loaded back, first
            engine.log.warning("engine.weights_unknown", engine_reported=version, restoring=target.version)
            self.set_serving(engine, None)
            engine.restore = target
        else:  # with none left: it follows new checkpoints (every one is newer than a mix)
            engine.settle(version, serving, paused=learned.paused)
            self.set_serving(engine, serving)
            self.rollback_target(engine)  # known before anything fails, and shown in `status`
        engine.say_reconciled(version, serving, learned)

    def finished(self, engine: Engine, outcome: Outcome) -> None:
        """A reload came back from the engine's thread: apply it, then say it (once recorded)."""
        decision = self.recalls.finished(engine.url, outcome.job, outcomes.decide(outcome, now=time.time()))
        error = outcome.error
        scan_failed = outcome.job.scan and isinstance(error, ReloadFailed) and error.unjudged
        engine.probed(outcome.timings or {}, scan_failed=scan_failed)
        if outcome.nodes:  # a multi-node engine's nodes, as its ranks last said (`status`)
            engine.nodes = (outcome.job.target.version, outcome.nodes)
        if outcome.not_staged is not None:  # nothing was sent: asked again after the backoff
            self.staging.lost()
            if outcome.job.restore:  # weights of unknown mix: never left paused meanwhile
                engine.restore, engine.served.resume_owed = outcome.job.loading, True
        follower = engine is not self.canary
        if follower or decision.refused:  # refused for memory: no verdict, the same one again later
            decision = engine.as_follower(decision)
        else:  # the canary engine's verdict came: no retry owed
            engine.last_error = None
            engine.follow.succeeded(engine.url)
        verdict = None
        if follower and (r := decision.reject) is not None:  # its canary (or probe) failed: all go back
            base = order.base_name(r.name)
            self.recalls.add(base, r.version, r.fingerprint, r.reason, self.engines, r.check)
            verdict = Verdict(base, r.version, r.fingerprint, False, r.reason)  # and the fleet
        elif not follower and not decision.refused and outcome.job.candidate.fingerprint:  # not a restore
            verdict = fleet.judged(outcome.job, decision)
        if decision.result == "succeeded":
            engine.unclean = None
        elif outcome.canary_failed is not None and outcome.rolled_back and not outcome.flush_probes:
            engine.unclean = NOT_CLEAN  # good weights back, and the bad ones' KV blocks never clean
        self._apply(engine, decision, verdict)

    def _apply(self, engine: Engine, decision: outcomes.Decision, verdict: Verdict | None) -> None:
        served, labels = engine.served, {"engine": engine.url}
        if decision.result == "succeeded":
            failpoints.hit("after_version")  # the engine serves it; nothing recorded yet
        if decision.result != "waiting":  # nothing was sent to the engine
            self.metrics.reloads.labels(result=decision.result, **labels).inc()
        if decision.resume_owed:
            served.resume_owed = True
        if decision.rollback:
            self.metrics.rollbacks.labels(cause=decision.rollback, **labels).inc()
        if decision.regate is not None:  # a writer was at it: look again once it settles
            self.catalog.dirty.add(decision.regate)
        if decision.reloaded:
            self.metrics.reload_seconds.labels(**labels).observe(decision.reloaded["seconds"])
            self.metrics.bytes_reloaded.labels(**labels).inc(decision.reloaded["bytes"])
            served.last_reload = {k: decision.reloaded[k] for k in ("version", "duration_ms", "at")}
        if rolled := next((e.fields for e in decision.events if e.name == "reload.rolled_back"), None):
            served.last_reload = {  # the last reload is this one, not the success before it
                "version": rolled["version"], "at": time.time(),
                "rolled_back_to": rolled["to_version"], "cause": rolled["cause"],
            }  # fmt: skip
        with self.book.records.transaction("serving"):  # the decision and the fleet's verdict, together
            if decision.set_serving:
                self.set_serving(engine, decision.serving, good=decision.last_good)
            self._keep_unclean()
            if (r := decision.reject) is not None:  # in the store before any line of the decision
                self.book.reject(r.name, r.version, r.reason, r.fingerprint, verdict, check=r.check)
            else:
                self.book.tell(verdict)
        for event in decision.events:
            getattr(engine.log, event.level)(event.name, **event.fields)
        if decision.engine_down is not None:
            engine.went_down(decision.engine_down)
        else:
            self.rollback_target(engine)

    def _keep_unclean(self) -> None:
        self.book.records.replace(UNCLEAN, {e.url: e.unclean for e in self.engines if e.unclean})

    def set_serving(self, engine: Engine, serving: Loaded | None, *, good: Loaded | None = None) -> None:
        if serving is not None and serving.step is not None:
            self.metrics.serving_step.labels(engine=engine.url).set(serving.step)
        if serving is not None:
            self.metrics.serving(engine.url, serving.version, serving.fingerprint)
        engine.served.loaded(serving, good)
        if engine is self.canary:
            self.book.persist()

    # -- rollback targets ---------------------------------------------------------------------

    def gate_options(self) -> gate.GateOptions:
        """How the gate (and a rollback target's re-read) checks bytes: the NaN/Inf scan left
        out where the canary engine scans what it loads (the other engines load only what it
        served)."""
        options, config = gate.GateOptions.from_config(self.config), self.config
        scans = probe.host_scans(config.gate.scan, [self.canary.scans(config)])
        return replace(options, check_finite=options.check_finite and scans)

    def rollback_target(self, engine: Engine, skip: str | None = None) -> Loaded | None:
        options = self.gate_options()
        return self.targets.of(engine, self.config.checkpoint_root, self.catalog.candidates, options, skip)

    def reverified(self, result: Reverified) -> None:
        if self.targets.reverified(result, self.engines):
            self.book.persist()
        for engine in self.engines:
            self.rollback_target(engine)
