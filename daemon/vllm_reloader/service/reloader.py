"""The reloader: decides what to do next from what is on disk and what the engines hold.

It owns the pieces of state the daemon acts on — the `Catalog` (what is on disk), one
`Engine` per engine of this host (what it holds, the job on it), the gate in flight and a
verdict waiting for room — and the state file they are saved to. The daemon's loop feeds it
and calls `tick`; it never waits on an engine or a checkpoint's bytes: gates run on their own
thread (`gating`), and every engine call on the engine's own (`jobs`, `engines`).

Several engines: one gate per checkpoint, loaded on the first engine (the canary engine)
first; the others follow once it passed there (`rollout`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from .. import failpoints, log
from ..checkpoint import gate, order
from ..config import Config
from ..engine.client import RELOADING_PREFIX, EngineClient
from ..sources.verdicts import Verdict
from . import fleet, outcomes, rollback, rollout, setup, status
from .catalog import Catalog, detection_lag_ms
from .engine import Engine
from .engines import Engines
from .gating import GateFinished, Gater, Gating, Ready
from .jobs import Answered, Job, Outcome, WarmedUp
from .messages import ReloadFinished
from .metrics import Metrics
from .reconcile import with_fingerprints
from .reverify import Reverified
from .served import Served
from .state import Loaded, State, StateFile
from .status import Snapshot


class Reloader:
    def __init__(
        self,
        config: Config,
        post: Callable[[ReloadFinished | GateFinished | WarmedUp | Answered | Reverified], None],
        clients: Mapping[str, EngineClient] | None = None,
        on_verdict: Callable[[Verdict], None] | None = None,
    ) -> None:
        """`on_verdict`: told the canary engine's verdicts and the gate's rejections (`service.fleet`)."""
        self.config = config
        self.on_verdict = on_verdict
        self.log = log.get()
        self.state_file = StateFile(config.state.dir, self.log)
        convention = gate.GateOptions.from_config(config).convention
        saved = with_fingerprints(self.state_file.saved, convention)
        self.catalog = Catalog(
            config.checkpoint_root,
            ignore=config.source.ignore,
            convention=convention,
            rejected=saved.rejected,
            pinned=saved.pinned,
        )
        self.metrics = Metrics()
        self.engines = Engines(
            config.engine,
            (saved.serving, saved.good),
            lambda done: post(ReloadFinished(done) if isinstance(done, Outcome) else done),
            self.log,
            self.metrics,
            clients or {},
        )
        self.gating: Gating | None = None
        self.ready: Ready | None = None
        self.next_rescan = 0.0
        self.gater = Gater(post, config.gate.digest_threads)
        self.recalls = fleet.Recalls(self.log)
        self.targets = rollback.Targets(post, self.metrics, self.log)

    # -- the first engine: the canary engine, whose history is the host's ----------------------

    @property
    def canary(self) -> Engine:
        return self.engines.canary

    @property
    def served(self) -> Served:
        return self.canary.served

    @property
    def in_flight(self) -> Job | None:
        """A job on any engine (the canary engine's first)."""
        return next((e.in_flight for e in self.engines if e.in_flight is not None), None)

    def jobs(self) -> list[Job]:
        return self.engines.jobs()

    @property
    def root(self) -> Path:
        return self.config.checkpoint_root

    def start(self) -> None:
        self.engines.start()
        self.gater.start()
        self.targets.reverifier.start()

    def is_alive(self) -> bool:
        return self.engines.is_alive() and self.gater.is_alive() and self.targets.reverifier.is_alive()

    def close(self) -> None:
        if self.gating is not None:
            self.gating.cancel.set()
        self.gater.close()
        self.targets.reverifier.close()
        self.engines.close()

    def reconfigure(self, config: Config) -> None:
        """SIGHUP: follow the new config (engines reconciled again, added or dropped by `urls`)."""
        old, self.config = self.config, config
        self.catalog.configure(
            config.checkpoint_root, config.source.ignore, gate.GateOptions.from_config(config).convention
        )
        if config.source != old.source or config.state != old.state:
            self.next_rescan = 0.0
        if config.engine == old.engine:
            return
        self.engines.regroup(config.engine, (self.served.serving, self.served.good))

    def next_deadline(self) -> float:
        deadlines = [self.next_rescan, *(at for engine in self.engines for at in engine.deadlines())]
        if self.gating is None and (recheck := self.catalog.next_recheck()) is not None:
            deadlines.append(recheck)
        if self.ready is not None and self.ready.hold_until is not None:
            deadlines.append(self.ready.hold_until)
        return min(deadlines)

    def tick(self) -> None:
        now = time.monotonic()
        if now >= self.next_rescan:
            self.catalog.rescan()
            self.next_rescan = now + self.config.source.rescan_interval
        self.catalog.refresh_dirty()
        for engine in self.engines:
            engine.tend(now, self._reconcile)
        rejected = self.catalog.rejected_fingerprints()
        self.recalls.tend(self.engines, self._room(), now, self._rollback_target, self._restore, rejected)
        self._advance()
        self._converge(now)

    def snapshot(self, newer: bool = False) -> Snapshot:
        views = self.engines.views(rollout.wanted(self.served), self.catalog, time.monotonic(), newer)
        return status.snapshot_of(self.served, self.catalog, self.in_flight, self.gating, views)

    # -- inputs from the loop -------------------------------------------------------------

    def changed(self, name: str) -> None:
        self.catalog.changed(name)
        if self.gating is not None and self.gating.candidate.name == name:
            self.gating.cancel.set()  # judged on files that are no longer the ones there
        if self.ready is not None and self.ready.candidate.name == name:
            self.ready = None  # judged again, on what is there now

    def rejected_remotely(self, name: str, version: str, reason: str, fingerprint: str, check: str) -> None:
        self._reject(name, version, reason, fingerprint, check=check)
        self._tell(fleet.rejected(name, version, reason, fingerprint, {"check": check}))

    def recalled(self, name: str, version: str, fingerprint: str, reason: str) -> None:
        """A follower: a canary host failed a version engines here serve; they go back from it."""
        self.recalls.add(name, version, fingerprint, reason, self.engines)
        self._reject(name, version, reason, fingerprint, check=fleet.FLEET_CHECK)

    def finished(self, outcome: Outcome) -> None:
        """A reload came back from an engine's thread: apply it, then say it (once the state file agrees)."""
        if (engine := self.engines.take(outcome.job)) is None:
            return
        decision = self.recalls.finished(engine.url, outcome.job, outcomes.decide(outcome, now=time.time()))
        follower = engine is not self.canary
        if follower or decision.refused:  # refused for memory: no verdict, the same one again later
            decision = engine.as_follower(decision, self.config.engine)
        else:  # the canary engine's verdict came: no retry owed
            engine.last_error = None
        if follower and (r := decision.reject) is not None:  # its canary failed: all on it go back
            base = order.base_name(r.name)
            self.recalls.add(base, r.version, r.fingerprint, r.reason, self.engines, "canary")
            self._tell(Verdict(base, r.version, r.fingerprint, False, r.reason))  # and the fleet
        elif not follower and not decision.refused and outcome.job.candidate.fingerprint:  # not a restore
            self._tell(fleet.judged(outcome.job, decision))
        self._apply(engine, decision)
        engine.rotate(outcome, decision)

    def _tell(self, verdict: Verdict | None) -> None:
        if verdict is not None and self.on_verdict is not None:
            self.on_verdict(verdict)

    def _apply(self, engine: Engine, decision: outcomes.Decision) -> None:
        served, labels = engine.served, {"engine": engine.url}
        if decision.result == "succeeded":
            failpoints.hit("after_version")  # the engine serves it; nothing recorded yet
        self.metrics.reloads.labels(result=decision.result, **labels).inc()
        if decision.resume_owed:
            served.resume_owed = True
        if decision.rollback:
            self.metrics.rollbacks.labels(cause=decision.rollback, **labels).inc()
        if decision.set_serving:
            self.set_serving(engine, decision.serving, good=decision.last_good)
        if decision.regate is not None:  # a writer was at it: look again once it settles
            self.catalog.dirty.add(decision.regate)
        if decision.reloaded:
            self.metrics.reload_seconds.labels(**labels).observe(decision.reloaded["seconds"])
            self.metrics.bytes_reloaded.labels(**labels).inc(decision.reloaded["bytes"])
            served.last_reload = {k: decision.reloaded[k] for k in ("version", "duration_ms", "at")}
            self.prune_cache()
        if (r := decision.reject) is not None:  # in the state file before any line of the decision
            self._reject(r.name, r.version, r.reason, r.fingerprint, check=r.check)
        for event in decision.events:
            getattr(engine.log, event.level)(event.name, **event.fields)
        if decision.engine_down is not None:
            engine.went_down(decision.engine_down, self.config.engine.retry_max)
        else:
            self._rollback_target(engine)

    # -- the control socket's commands (called on the main loop) -----------------------------

    def pin(self, name: str, *, force: bool = False) -> str | None:
        """Pin a checkpoint by directory name or version; returns an error, or None."""
        error = self.catalog.pin(name, force=force)
        self._persist()
        return error

    def unpin(self) -> None:
        self.catalog.pin(None)
        self._persist()

    def check_now(self) -> None:
        """`reload`: rescan the root and ask the engines now, instead of at the next timer."""
        self.next_rescan = 0.0
        self.engines.check_now()
        self.catalog.recheck_at.clear()

    # -- the engines: what they hold, and loading ------------------------------------------

    def _reconcile(self, engine: Engine, learned: setup.Learned) -> None:
        """What the engine serves, so nothing is reloaded needlessly after a restart."""
        self.catalog.rescan()
        own = engine is self.canary  # the state file is the canary engine's own record
        candidates = self.catalog.candidates
        version, serving = engine.learn(self.config, self.root, candidates, learned, trusted=own)
        self.engines.same_layout(engine)
        restoring = version.startswith(RELOADING_PREFIX)
        if not (restoring and self._restore_after_interrupted_reload(engine, version, serving)):
            engine.settle(version, serving, self.config.canary, paused=learned.paused)
            self.set_serving(engine, serving)
            self._rollback_target(engine)  # known before anything fails, and shown in `status`
        engine.say_reconciled(version, serving, learned)

    def _restore_after_interrupted_reload(self, engine: Engine, marker: str, unknown: Loaded) -> bool:
        """The weights may be a mix of two checkpoints: load a good one back, if one is left.
        With none, say so and follow new checkpoints (every one is newer than a mix)."""
        target = self._rollback_target(engine)
        if target is None:
            self.set_serving(engine, unknown)
            return False
        engine.log.warning("engine.weights_unknown", engine_reported=marker, restoring=target.version)
        self.set_serving(engine, None)
        self._restore(engine, target, drain=False)  # it may be paused: nothing would drain
        return True

    def _restore(self, engine: Engine, target: Loaded, *, drain: bool = True) -> None:
        """Load a checkpoint back (not a new version: no canary verdict for the fleet)."""
        self._load(engine, order.Candidate(target.name, target.step, ""), target, 0, drain=drain)

    def _rollback_target(self, engine: Engine, skip: str | None = None) -> Loaded | None:
        options = gate.GateOptions.from_config(self.config)
        return self.targets.of(engine, self.root, self.catalog.candidates, options, skip)

    def _room(self) -> int:
        """How many more engines may be paused now."""
        return self.config.engine.max_unavailable - self.engines.busy()

    def _advance(self) -> None:
        """Ask the gate thread about the newest candidate worth it (never judge on the loop), and
        load a verdict of `ready` on the canary engine once there is room."""
        canary = self.canary
        served = canary.served
        refused = time.monotonic() < canary.retry_at_follow  # its last load was: after a backoff
        if served.baseline is None or not served.reconciled or not canary.idle or refused:
            return
        if self.ready is not None and self._room() > 0:
            if self.ready.hold_until is None:  # a better target whose files moved: wait for its read
                self._rollback_target(canary, skip=self.ready.candidate.name)
                held = rollback.REVERIFY_HOLD if self.targets.holding(canary) else 0.0
                self.ready = replace(self.ready, hold_until=time.monotonic() + held)
            if self.targets.holding(canary) and time.monotonic() < (self.ready.hold_until or 0.0):
                return
            ready, self.ready = self.ready, None
            self._load(canary, ready.candidate, ready.loading, ready.size)
            return
        best = self.catalog.next_to_gate(served.serving, served.serving_key(), time.monotonic())
        if self.gating is not None:  # a newer one than the one being judged: judge that first
            if best is not None and best.key > self.gating.candidate.key:
                self.gating.cancel.set()
            return
        if best is not None and (self.ready is None or best.key > self.ready.candidate.key):
            options = gate.GateOptions.from_config(self.config)
            self.gating = self.gater.submit(best, self.root / best.name, served.baseline, options)

    def _converge(self, now: float) -> None:
        """Followers to the version that passed on the canary engine, as room allows (one place kept)."""
        want = rollout.wanted(self.served)
        if want is None:
            return
        followers = [
            rollout.Follower(e.url, e.served.serving, e.served.reconciled, not e.idle, e.retry_at_follow)
            for e in self.engines.followers
        ]
        room = self._room() - (self.ready is not None)
        by_url = {e.url: e for e in self.engines}
        for url in rollout.next_to_load(followers, want, self.catalog.pinned, room, now):
            engine = by_url[url]
            serving = engine.served.serving
            engine.log.info("engine.behind", version=want.version, serving=serving and serving.version)
            self._load(engine, order.Candidate(want.name, want.step, ""), want, 0)

    def gated(self, finished: GateFinished, *, act: bool = True) -> None:
        """A verdict came back from the gate thread: wait, reject, or load."""
        self.gating = None
        verdict, name = finished.verdict, finished.gating.candidate.name
        if not act or finished.cancelled or name not in self.catalog.candidates:
            return  # asked again at the next tick, about what is there now
        if verdict.status == "pending":
            until = time.monotonic() + self.config.source.pending_recheck_interval
            self.catalog.waiting(name, verdict.reason, until, **verdict.details)
        elif verdict.status == "rejected":
            version = verdict.manifest.version if verdict.manifest else None
            self._reject(name, version, verdict.reason, verdict.fingerprint, **verdict.details)
            self._tell(fleet.rejected(name, version, verdict.reason, verdict.fingerprint, verdict.details))
        else:
            manifest = verdict.manifest
            assert manifest is not None
            version, size = manifest.version or order.base_name(name), verdict.bytes
            self.log.info(
                "checkpoint.ready",
                name=name,
                version=version,
                bytes=size,
                gate_ms=round(finished.seconds * 1000, 3),
                cached_bytes=finished.gating.progress.cached,
            )
            self.catalog.pending.pop(name, None)
            path, files = str(finished.gating.directory), dict(verdict.files)
            loading = Loaded(
                name=name, version=version, path=path, since=0, step=manifest.step, files=files,
                fingerprint=verdict.fingerprint,
            )  # fmt: skip
            self.ready = Ready(order.Candidate(name, manifest.step, verdict.fingerprint), loading, size)
            self._advance()

    def _load(
        self, engine: Engine, candidate: order.Candidate, loading: Loaded, size: int, *, drain: bool = True
    ) -> None:
        """`drain`: False for a paused engine or unknown weights; lag only for new checkpoints."""
        fallback = self._rollback_target(engine, skip=candidate.name)
        found = bool(candidate.fingerprint) and candidate.name != self.catalog.pinned
        lag_ms = detection_lag_ms(Path(loading.path)) if found else None
        if lag_ms is not None:
            self.metrics.detection_lag.observe(lag_ms / 1000)
        out = self.engines.drain(self.config.readiness, engine.url) if drain else None
        engine.load(candidate, loading, size, fallback, self.config, detect_ms=lag_ms, drain=out)

    def reverified(self, result: Reverified) -> None:
        if self.targets.reverified(result, self.engines):
            self._persist()
        for engine in self.engines:
            self._rollback_target(engine)

    def prune_cache(self) -> None:
        if self.config.source.remote:  # downloads only: a local root is the trainer's
            self.catalog.prune_downloads(
                [e.served for e in self.engines], self.jobs(), self.config.state.keep
            )

    def set_serving(self, engine: Engine, serving: Loaded | None, *, good: Loaded | None = None) -> None:
        if serving is not None and serving.step is not None:
            self.metrics.serving_step.labels(engine=engine.url).set(serving.step)
        if serving is not None:
            self.metrics.serving(engine.url, serving.version, serving.fingerprint)
        engine.served.loaded(serving, good)
        if engine is self.canary:
            self._persist()

    def _reject(
        self, name: str, version: str | None, reason: str, fingerprint: str, **details: object
    ) -> None:
        self.metrics.rejected.labels(check=details.get("check", "")).inc()
        said = self.catalog.reject(name, version, reason, fingerprint, **details)
        self._persist()  # then the line: whoever reads the state file on it finds the rejection
        self.log.warning("checkpoint.rejected", **said)

    def _persist(self) -> None:
        served, catalog = self.served, self.catalog
        state = State(serving=served.serving, good=served.good, rejected=dict(catalog.rejected))
        self.state_file.save(state.model_copy(update={"pinned": catalog.pinned}))
