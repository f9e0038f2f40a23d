"""The reloader: what is known about candidates and the engine, and what to do next.

It owns the candidates, the state file and the reload worker. The daemon's loop feeds it
(filesystem changes, reload outcomes) and calls `tick`; it never blocks on the engine
for longer than one quick call, because reloads run on the worker.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import gate, layout, log, outcomes, policy, reconcile, remote, source
from . import state as state_store
from .config import Config
from .engine import RELOADING_PREFIX, STARTUP_VERSION, EngineClient, Target
from .errors import EngineCallFailed, EngineError, EngineUnavailable, StateError
from .manifest import MANIFEST_NAME
from .metrics import Metrics
from .state import Loaded, Rejection, State
from .swapper import Job, Outcome, ReloadWorker


class Reloader:
    def __init__(self, config: Config, client: EngineClient, post: Callable[[tuple[str, Any]], None]) -> None:
        self.config = config
        self.client = client
        self.log = log.get()
        self.state: State = state_store.load(config.state.dir)
        self.candidates: dict[str, policy.Candidate] = {}
        self.last_report: dict[str, tuple[str, str]] = {}
        self.baseline: layout.Layout | None = None
        self.startup: str | None = None
        self.sleep_capable = False
        self.extension = False
        self.reconciled = False
        self.resume_owed = False
        self.backoff = config.engine.retry_initial
        self.engine_retry_at = 0.0
        self.next_rescan = 0.0
        self.next_recheck: float | None = None
        self.next_engine_check = 0.0
        self.engine_up = False
        self.last_reload: dict[str, Any] | None = None
        self.metrics = Metrics()
        self.dirty: set[str] = set()
        self.in_flight: Job | None = None
        self.last_scan = 0.0
        self.worker = ReloadWorker(lambda outcome: post(("reloaded", outcome)))

    @property
    def root(self) -> Path:
        return self.config.checkpoint_root

    def next_deadline(self) -> float:
        deadlines = [self.next_rescan]
        if self.reconciled and self.in_flight is None:
            deadlines.append(self.next_engine_check)
        if self.next_recheck is not None:
            deadlines.append(self.next_recheck)
        if not self.reconciled or self.resume_owed:
            deadlines.append(self.engine_retry_at)
        return min(deadlines)

    def tick(self) -> None:
        now = time.monotonic()
        if self.resume_owed and now >= self.engine_retry_at:
            self._retry_resume()
        if now >= self.next_rescan:
            self._rescan()
            self.last_scan = time.time()
            self.next_rescan = now + self.config.source.rescan_interval
        self._refresh(self.dirty)
        self.dirty = set()
        try:
            if self.reconciled and self.in_flight is None and now >= self.next_engine_check:
                self._check_engine()
            if not self.reconciled:
                if now < self.engine_retry_at:
                    return
                self._reconcile()
        except EngineError as exc:
            self.engine_down(exc)
            return
        self.next_engine_check = now + self.config.engine.check_interval
        self.engine_up = True
        self.metrics.engine_up.set(1)
        self._advance()

    def _check_engine(self) -> None:
        """Notice an engine that restarted (or was reloaded by someone else) while we idled."""
        version = self.client.weight_version()
        serving = self.state.serving
        if serving is None or version != serving.version:
            self.log.warning(
                "engine.changed", engine_reported=version, expected=serving.version if serving else None
            )
            self.reconciled = False

    def _rescan(self) -> None:
        names = source.list_candidates(self.root, self.config.source.ignore)
        self._refresh(names | set(self.candidates))

    def _refresh(self, names: set[str]) -> None:
        for name in names:
            directory = self.root / name
            if not directory.is_dir():
                self.candidates.pop(name, None)
                self.last_report.pop(name, None)
                continue
            if name not in self.candidates:
                self.log.info("checkpoint.seen", name=name, path=str(directory))
            self.candidates[name] = reconcile.peek(directory, self.config.source.completeness)

    # -- engine: what is loaded, and loading ------------------------------------------------

    def _reconcile(self) -> None:
        """Learn what the engine serves, so nothing is reloaded needlessly after a restart."""
        version = self.client.weight_version()
        server = self.client.server_config()
        startup = self.startup = server.model
        self.sleep_capable, self.extension = server.sleep_mode, server.extension
        self._rescan()
        serving = reconcile.serving(
            version, startup, known=self.state.serving, root=self.root, candidates=self.candidates
        )
        self.baseline = reconcile.baseline(startup, serving.path)
        if self.baseline is None:
            self.log.error(
                "gate.no_baseline",
                paths=[startup, serving.path],
                reason="cannot read the serving checkpoint's headers: nothing will be loaded",
            )
        self.reconciled = True
        self.backoff = self.config.engine.retry_initial
        self.log.info(
            "engine.reconciled", version=serving.version, path=serving.path, engine_reported=version
        )
        if version.startswith(RELOADING_PREFIX) and self.state.last_good is not None:
            self._restore_after_interrupted_reload(version)  # resumes when done
            return
        if self.client.is_paused():
            # Only a daemon killed mid-reload leaves it so: nothing else pauses this engine.
            self.client.resume()
            self.log.warning("engine.resumed", reason="found paused at reconcile")
        if version == STARTUP_VERSION and serving.in_root:
            # Name the startup weights, so clients and `weight_info` see which checkpoint it is.
            self.client.set_weight_version(serving.version)
        self.set_serving(serving)

    def _restore_after_interrupted_reload(self, marker: str) -> None:
        """The weights may be a mix of two checkpoints: load the last good one back."""
        good = self.state.last_good
        assert good is not None
        self.log.warning("engine.weights_unknown", engine_reported=marker, restoring=good.version)
        self.set_serving(None)
        self._load(policy.Candidate(good.name, good.step, ""), good.version, good.path, 0)

    def rejected_fingerprints(self) -> dict[str, str]:
        """name → the fingerprint it was rejected with: retried only once that changes."""
        return {name: r.fingerprint for name, r in self.state.rejected.items()}

    def serving_key(self) -> policy.OrderKey | None:
        """Where the serving checkpoint sits in the order; None: outside the root (all are newer)."""
        serving = self.state.serving
        return policy.order_key(serving.name, serving.step) if serving and serving.in_root else None

    def _advance(self) -> None:
        if self.baseline is None or self.in_flight is not None:
            return
        serving = self.state.serving
        key = self.serving_key()
        rejected = self.rejected_fingerprints()
        options = gate.GateOptions.from_config(self.config)
        self.next_recheck = None
        if self.state.pinned is not None:
            # An operator's choice: load exactly that one (older or not), then hold still.
            pinned = self.candidates.get(self.state.pinned)
            done = serving is not None and serving.name == self.state.pinned
            worth_trying = (
                [] if done or pinned is None or rejected.get(pinned.name) == pinned.fingerprint else [pinned]
            )
        else:
            worth_trying = policy.to_try(self.candidates, serving=key, rejected=rejected)
        names = {c.name for c in worth_trying}
        self.last_report = {n: r for n, r in self.last_report.items() if n in names}
        for candidate in worth_trying:
            directory = self.root / candidate.name
            started = time.perf_counter()
            verdict = gate.check(directory, serving=self.baseline, options=options)
            gate_ms = round((time.perf_counter() - started) * 1000, 3)
            if verdict.status == "pending":
                self._report_pending(candidate.name, verdict.reason)
                self.next_recheck = time.monotonic() + self.config.source.pending_recheck_interval
            elif verdict.status == "rejected":
                self.last_report.pop(candidate.name, None)
                self.reject(
                    candidate.name,
                    verdict.manifest.version if verdict.manifest else None,
                    verdict.reason,
                    verdict.fingerprint,
                    **verdict.details,
                )
            else:
                manifest = verdict.manifest
                assert manifest is not None
                version = manifest.version or candidate.name
                self.log.info(
                    "checkpoint.ready",
                    name=candidate.name,
                    version=version,
                    bytes=verdict.bytes,
                    gate_ms=gate_ms,
                )
                self.last_report.pop(candidate.name, None)
                ready = policy.Candidate(candidate.name, manifest.step, verdict.fingerprint)
                self._load(ready, version, str(directory), verdict.bytes)
                return

    def _load(self, candidate: policy.Candidate, version: str, path: str, size: int) -> None:
        serving = self.state.serving
        fallback = self.state.last_good or serving
        lag_ms = _detection_lag_ms(Path(path))
        if lag_ms is not None and candidate.fingerprint:  # not for restores of old checkpoints
            self.metrics.detection_lag.observe(lag_ms / 1000)
        strategy = self.config.engine.strategy
        if strategy == "auto":
            strategy = "sleep" if self.sleep_capable else "inplace"
        self.log.info(
            "reload.started",
            version=version,
            path=path,
            bytes=size,
            from_version=serving.version if serving else None,
            detect_ms=lag_ms,
            strategy=strategy,
            loader="extension" if self.extension else "builtin",
        )
        self.in_flight = Job(
            client=self.client,
            candidate=candidate,
            target=Target(version, path),
            fallback=Target(fallback.version, fallback.path) if fallback else None,
            size=size,
            canary=self.config.canary,
            strategy=strategy,
            extension=self.extension,
        )
        self.worker.submit(self.in_flight)

    def finished(self, outcome: Outcome) -> None:
        """A reload came back from the worker: record it, and what the engine now holds."""
        self.in_flight = None
        outcomes.record(self, outcome)

    # -- the control socket's commands (called on the main loop) -----------------------------

    def pin(self, name: str) -> str | None:
        """Pin a checkpoint by directory name or version; returns an error, or None."""
        self._rescan()
        match = name if name in self.candidates else None
        match = match or next(
            (n for n in self.candidates if reconcile.version_of(self.root / n) == name), None
        )
        if match is None:
            return f"no checkpoint named {name!r} in {self.root}"
        self.log.info("control.pinned", name=match)
        self._save(self.state.model_copy(update={"pinned": match}))
        return None

    def unpin(self) -> None:
        self.log.info("control.unpinned", name=self.state.pinned)
        self._save(self.state.model_copy(update={"pinned": None}))

    def check_now(self) -> None:
        """`reload`: rescan the root and ask the engine now, instead of at the next timer."""
        self.next_rescan = self.next_engine_check = self.engine_retry_at = 0.0

    def close(self) -> None:
        self.worker.close()
        if self.resume_owed:
            self._retry_resume()
        self.client.close()

    def prune_cache(self) -> None:
        """Downloads only (a local root is the trainer's): keep what serves or may be rolled back to."""
        if not self.config.source.remote:
            return
        protected = {
            loaded.name for loaded in (self.state.serving, self.state.last_good) if loaded is not None
        } | {self.state.pinned or "", self.in_flight.candidate.name if self.in_flight else ""}
        if self.startup and Path(self.startup).parent == self.root:
            protected.add(Path(self.startup).name)
        rejected = self.rejected_fingerprints()
        newer = policy.to_try(self.candidates, serving=self.serving_key(), rejected=rejected)
        protected |= {c.name for c in newer}  # downloaded to be loaded next: not yet
        doomed = policy.to_prune(self.candidates, protected=protected, keep=self.config.state.keep)
        for name in remote.prune(self.root, doomed):
            self.candidates.pop(name, None)
            self.log.info("cache.pruned", name=name, kept=sorted(protected - {""}))

    def set_serving(self, serving: Loaded | None, *, last_good: Loaded | None = None) -> None:
        if serving is not None and serving.step is not None:
            self.metrics.serving_step.set(serving.step)
        update: dict[str, Any] = {"serving": serving}
        if last_good is not None:
            update["last_good"] = last_good
        self._save(self.state.model_copy(update=update))

    def reject(self, name: str, version: str | None, reason: str, fingerprint: str, **details: Any) -> None:
        version = version or name
        self.metrics.rejected.labels(check=details.get("check", "")).inc()
        self.log.warning("checkpoint.rejected", name=name, version=version, reason=reason, **details)
        rejected = {
            **self.state.rejected,
            name: Rejection(version=version, reason=reason, fingerprint=fingerprint, at=time.time()),
        }
        self._save(self.state.model_copy(update={"rejected": rejected}))

    def _report_pending(self, name: str, reason: str) -> None:
        if self.last_report.get(name) != ("pending", reason):
            self.last_report[name] = ("pending", reason)
            self.log.info("checkpoint.pending", name=name, reason=reason)

    def _save(self, new: State) -> None:
        """Keep serving when the state disk fails: the engine, not this file, is the truth."""
        self.state = new
        try:
            state_store.save(self.config.state.dir, new)
        except StateError as exc:
            self.log.error("state.write_failed", reason=str(exc))

    def engine_down(self, exc: EngineError) -> None:
        self.reconciled = False
        self.engine_up = False
        self.metrics.engine_up.set(0)
        self.engine_retry_at = time.monotonic() + self.backoff
        self.log.warning(
            "engine.unreachable" if isinstance(exc, EngineUnavailable) else "engine.error",
            url=self.config.engine.url,
            reason=str(exc),
            retry_in_s=self.backoff,
        )
        self.backoff = min(self.backoff * 2, self.config.engine.retry_max)

    def _retry_resume(self) -> None:
        try:
            self.client.resume()
        except (EngineUnavailable, EngineCallFailed) as exc:
            self.engine_down(exc)
            return
        self.resume_owed = False
        self.log.info("engine.resumed")


def _detection_lag_ms(directory: Path) -> float | None:
    try:
        mtime = os.stat(directory / MANIFEST_NAME).st_mtime
    except OSError:
        return None
    return round((time.time() - mtime) * 1000, 3)
