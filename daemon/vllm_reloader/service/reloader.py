"""The reloader: decides what to do next from what is on disk and what the engine holds.

It owns the three pieces of state the daemon acts on — the `Catalog` (what is on disk),
`Served` (what the engine holds) and the job in flight — and the state file they are saved
to. The daemon's loop feeds it and calls `tick`; it never blocks on the engine for longer
than one quick call, because reloads run on the reload thread (`jobs`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from .. import failpoints, log
from ..checkpoint import gate, order
from ..config import Config
from ..engine.client import (
    BUILTIN_LOADER_FIX,
    BUILTIN_LOADER_RISK,
    RELOADING_PREFIX,
    STARTUP_VERSION,
    EngineClient,
)
from ..engine.swap import Target
from ..errors import EngineCallFailed, EngineError, EngineUnavailable
from . import outcomes, reconcile, rollback, setup, status
from .catalog import Catalog, detection_lag_ms
from .gating import GateFinished, Gater, Gating
from .jobs import Job, Outcome, ReloadWorker, WarmedUp, WarmUp
from .messages import ReloadFinished
from .metrics import Metrics
from .served import Served
from .state import Loaded, State, StateFile
from .status import Snapshot


class Reloader:
    def __init__(
        self,
        config: Config,
        client: EngineClient,
        post: Callable[[ReloadFinished | GateFinished | WarmedUp], None],
    ) -> None:
        self.config = config
        self.client = client
        self.log = log.get()
        self.state_file = StateFile(config.state.dir, self.log)
        saved = self.state_file.saved
        self.catalog = Catalog(
            config.checkpoint_root,
            ignore=config.source.ignore,
            convention=gate.GateOptions.from_config(config).convention,
            rejected=saved.rejected,
            pinned=saved.pinned,
        )
        self.served = Served(saved.serving, saved.good, config.engine.retry_initial)
        self.in_flight: Job | None = None
        self.gating: Gating | None = None
        self.metrics = Metrics()
        self.next_rescan = 0.0
        self.worker = ReloadWorker(
            lambda done: post(ReloadFinished(done) if isinstance(done, Outcome) else done)
        )
        self.gater = Gater(post, config.gate.digest_threads)

    @property
    def root(self) -> Path:
        return self.config.checkpoint_root

    def start(self) -> None:
        self.worker.start()
        self.gater.start()

    def is_alive(self) -> bool:
        return self.worker.is_alive() and self.gater.is_alive()

    def close(self) -> None:
        if self.gating is not None:
            self.gating.cancel.set()
        self.gater.close()
        self.worker.close()
        if self.served.resume_owed:
            self._retry_resume()
        self.client.close()

    def reconfigure(self, config: Config) -> None:
        """SIGHUP: the daemon swapped in a new config; follow it (a new engine is reconciled)."""
        old, self.config = self.config, config
        self.catalog.configure(
            config.checkpoint_root, config.source.ignore, gate.GateOptions.from_config(config).convention
        )
        if config.source != old.source or config.state != old.state:
            self.next_rescan = 0.0
        if config.engine != old.engine:
            self.client = EngineClient(config.engine)
            self.served.reconciled = False

    def next_deadline(self) -> float:
        served = self.served
        deadlines = [self.next_rescan]
        if served.reconciled and self.in_flight is None:
            deadlines.append(served.next_check)
        if self.gating is None and (recheck := self.catalog.next_recheck()) is not None:
            deadlines.append(recheck)
        if not served.reconciled or served.resume_owed:
            deadlines.append(served.retry_at)
        return min(deadlines)

    def tick(self) -> None:
        now = time.monotonic()
        served = self.served
        if served.resume_owed and now >= served.retry_at:
            self._retry_resume()
        if now >= self.next_rescan:
            self.catalog.rescan()
            self.next_rescan = now + self.config.source.rescan_interval
        self.catalog.refresh_dirty()
        try:
            if served.reconciled and self.in_flight is None and now >= served.next_check:
                self._check_engine()
            if not served.reconciled:
                if now < served.retry_at:
                    return
                self._reconcile()
        except EngineError as exc:
            self.engine_down(exc)
            return
        served.answered(now, self.config.engine.check_interval)
        self.metrics.engine_up.set(1)
        self._advance()

    def snapshot(self) -> Snapshot:
        return status.snapshot_of(
            self.served, self.catalog, self.in_flight, self.gating, self.config.engine.url
        )

    # -- inputs from the loop -------------------------------------------------------------

    def changed(self, name: str) -> None:
        self.catalog.changed(name)
        if self.gating is not None and self.gating.candidate.name == name:
            self.gating.cancel.set()  # judged on files that are no longer the ones there

    def rejected_remotely(self, name: str, version: str, reason: str, fingerprint: str, check: str) -> None:
        self._reject(name, version, reason, fingerprint, check=check)

    def finished(self, outcome: Outcome) -> None:
        """A reload came back from the reload thread: apply what it means, then say it (the
        log line comes once the state file and the cache agree with it)."""
        self.in_flight = None
        served = self.served
        decision = outcomes.decide(outcome, now=time.time())
        if decision.result == "succeeded":
            failpoints.hit("after_version")  # the engine serves it; nothing recorded yet
        self.metrics.reloads.labels(result=decision.result).inc()
        if decision.resume_owed:
            served.resume_owed = True
        if decision.rollback:
            self.metrics.rollbacks.labels(cause=decision.rollback).inc()
        if decision.set_serving:
            self.set_serving(decision.serving, good=decision.last_good)
        if decision.regate is not None:  # a writer was at it: look again once it settles
            self.catalog.dirty.add(decision.regate)
        if decision.reloaded:
            self.metrics.reload_seconds.observe(decision.reloaded["seconds"])
            self.metrics.bytes_reloaded.inc(decision.reloaded["bytes"])
            served.last_reload = {k: decision.reloaded[k] for k in ("version", "duration_ms", "at")}
            self.prune_cache()
        for event in decision.events:
            getattr(self.log, event.level)(event.name, **event.fields)
        if (r := decision.reject) is not None:
            self._reject(r.name, r.version, r.reason, r.fingerprint, check=r.check)
        if decision.engine_down is not None:
            self.engine_down(decision.engine_down)
        else:
            self._rollback_target()

    # -- the control socket's commands (called on the main loop) -----------------------------

    def pin(self, name: str) -> str | None:
        """Pin a checkpoint by directory name or version; returns an error, or None."""
        match = self.catalog.find(name)
        if match is None:
            return f"no checkpoint named {name!r} in {self.root}"
        self.log.info("control.pinned", name=match)
        self.catalog.pinned = match
        self._persist()
        return None

    def unpin(self) -> None:
        self.log.info("control.unpinned", name=self.catalog.pinned)
        self.catalog.pinned = None
        self._persist()

    def check_now(self) -> None:
        """`reload`: rescan the root and ask the engine now, instead of at the next timer."""
        self.next_rescan = self.served.next_check = self.served.retry_at = 0.0
        self.catalog.recheck_at.clear()

    # -- the engine: what it holds, and loading ------------------------------------------

    def _check_engine(self) -> None:
        """Notice an engine that restarted (or was reloaded by someone else) while we idled."""
        version = self.client.weight_version()
        serving = self.served.serving
        if serving is None or version != serving.version:
            self.log.warning(
                "engine.changed", engine_reported=version, expected=serving.version if serving else None
            )
            self.served.reconciled = False

    def _reconcile(self) -> None:
        """Learn what the engine serves, so nothing is reloaded needlessly after a restart."""
        served = self.served
        found = setup.check_capabilities(self.client, self.log)
        version = self.client.weight_version()
        server = self.client.server_config()
        served.sleep_capable, served.extension = server.sleep_mode, server.extension
        if not server.extension:
            self.log.warning("engine.builtin_loader", reason=BUILTIN_LOADER_RISK, fix=BUILTIN_LOADER_FIX)
        self.catalog.rescan()
        served.startup = setup.startup_path(server)
        serving = reconcile.serving(
            version, served.startup, known=served.serving, root=self.root, candidates=self.catalog.candidates
        )
        served.baseline = setup.settle_baseline(self.config.engine, server, served, serving.path, self.log)
        served.reconciled = True
        served.backoff = self.config.engine.retry_initial
        self.log.info(
            "engine.reconciled",
            version=serving.version,
            path=serving.path,
            engine_reported=version,
            **found.logged(),
        )
        if version.startswith(RELOADING_PREFIX) and self._restore_after_interrupted_reload(version, serving):
            return  # the restore resumes the engine
        if self.client.is_paused():
            # Only a daemon killed mid-reload leaves it so: nothing else pauses this engine.
            self.client.resume()
            self.log.warning("engine.resumed", reason="found paused at reconcile")
        if version == STARTUP_VERSION and serving.in_root:
            # Name the startup weights, so clients and `weight_info` see which checkpoint it is.
            self.client.set_weight_version(serving.version)
        self.set_serving(serving)
        self._rollback_target()  # known before anything fails, and shown in `status`
        if self.config.canary.enabled:
            self.worker.submit(WarmUp(self.client, self.config.canary))

    def _restore_after_interrupted_reload(self, marker: str, unknown: Loaded) -> bool:
        """The weights may be a mix of two checkpoints: load a good one back, if one is left.
        With none, say so and follow new checkpoints (every one is newer than a mix)."""
        target = self._rollback_target()
        if target is None:
            self.set_serving(unknown)
            return False
        self.log.warning("engine.weights_unknown", engine_reported=marker, restoring=target.version)
        self.set_serving(None)
        self._load(order.Candidate(target.name, target.step, ""), target, 0)
        return True

    def _rollback_target(self, skip: str | None = None) -> Loaded | None:
        target = rollback.choose(self.served, self.root, self.catalog.candidates, skip=skip, log=self.log)
        self.metrics.rollback_ready.set(1 if target else 0)
        return target

    def _advance(self) -> None:
        """Ask the gate thread about the newest candidate worth it; never judge on the loop."""
        if self.served.baseline is None or self.in_flight is not None:
            return
        served = self.served
        if self.gating is not None:  # a newer one than the one being judged: judge that first
            best = self.catalog.next_to_gate(served.serving, served.serving_key(), time.monotonic())
            if best is not None and best.key > self.gating.candidate.key:
                self.gating.cancel.set()
            return
        candidate = self.catalog.next_to_gate(served.serving, served.serving_key(), time.monotonic())
        if candidate is not None:
            options = gate.GateOptions.from_config(self.config)
            self.gating = self.gater.submit(candidate, self.root / candidate.name, served.baseline, options)

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
        else:
            manifest = verdict.manifest
            assert manifest is not None
            version, size, gate_ms = (
                manifest.version or name,
                verdict.bytes,
                round(finished.seconds * 1000, 3),
            )
            cached = finished.gating.progress.cached
            self.log.info(
                "checkpoint.ready",
                name=name,
                version=version,
                bytes=size,
                gate_ms=gate_ms,
                cached_bytes=cached,
            )
            self.catalog.pending.pop(name, None)
            path, files = str(finished.gating.directory), dict(verdict.files)
            loading = Loaded(name=name, version=version, path=path, since=0, step=manifest.step, files=files)
            self._load(order.Candidate(name, manifest.step, verdict.fingerprint), loading, size)

    def _load(self, candidate: order.Candidate, loading: Loaded, size: int) -> None:
        served = self.served
        version, path = loading.version, loading.path
        fallback = self._rollback_target(skip=candidate.name)
        lag_ms = detection_lag_ms(Path(path))
        if lag_ms is not None and candidate.fingerprint:  # not for restores of old checkpoints
            self.metrics.detection_lag.observe(lag_ms / 1000)
        strategy = self.config.engine.strategy
        if strategy == "auto":
            strategy = "sleep" if served.sleep_capable else "inplace"
        self.log.info(
            "reload.started",
            version=version,
            path=path,
            bytes=size,
            from_version=served.serving.version if served.serving else None,
            detect_ms=lag_ms,
            strategy=strategy,
            loader="extension" if served.extension else "builtin",
        )
        self.in_flight = Job(
            client=self.client,
            candidate=candidate,
            target=Target(version, path, loading.files),
            rollback=fallback,
            size=size,
            canary=self.config.canary,
            strategy=strategy,
            extension=served.extension,
        )
        self.worker.submit(self.in_flight)

    def prune_cache(self) -> None:
        """Downloads only (a local root is the trainer's): keep what serves or may be rolled back to."""
        if self.config.source.remote:
            in_flight = self.in_flight.candidate.name if self.in_flight else None
            self.catalog.prune_downloads(self.served, in_flight, self.config.state.keep)

    def set_serving(self, serving: Loaded | None, *, good: Loaded | None = None) -> None:
        if serving is not None and serving.step is not None:
            self.metrics.serving_step.set(serving.step)
        self.served.loaded(serving, good)
        self._persist()

    def _reject(
        self, name: str, version: str | None, reason: str, fingerprint: str, **details: object
    ) -> None:
        self.metrics.rejected.labels(check=details.get("check", "")).inc()
        self.catalog.reject(name, version, reason, fingerprint, **details)
        self._persist()

    def _persist(self) -> None:
        served, catalog = self.served, self.catalog
        self.state_file.save(
            State(
                serving=served.serving,
                good=served.good,
                rejected=dict(catalog.rejected),
                pinned=catalog.pinned,
            )
        )

    def engine_down(self, exc: EngineError) -> None:
        wait = self.served.went_down(time.monotonic(), self.config.engine.retry_max)
        self.metrics.engine_up.set(0)
        self.log.warning(
            "engine.unreachable" if isinstance(exc, EngineUnavailable) else "engine.error",
            url=self.config.engine.url,
            reason=str(exc),
            retry_in_s=wait,
        )

    def _retry_resume(self) -> None:
        try:
            self.client.resume()
        except (EngineUnavailable, EngineCallFailed) as exc:
            self.engine_down(exc)
            return
        self.served.resume_owed = False
        self.log.info("engine.resumed")
