"""The main loop: the one place that acts.

Watchdog callbacks and signal handlers only put a message on `inbox`; the loop drains it,
refreshes the candidates that changed, asks the policy which to try, gates them and hands
a ready one to `engine.hot_swap`. One thread decides, so there is nothing to lock.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Any

from . import gate, layout, log, policy, reconcile, source
from . import state as state_store
from .config import Config
from .engine import RELOADING_PREFIX, STARTUP_VERSION, EngineClient, ReloadFailed, Target, hot_swap
from .errors import EngineCallFailed, EngineError, EngineUnavailable, StateError
from .manifest import MANIFEST_NAME
from .state import Loaded, Rejection, State


class Daemon:
    def __init__(self, config: Config, *, client: EngineClient | None = None) -> None:
        self.config = config
        self.root = config.source.path
        self.client = client or EngineClient(config.engine)
        self.inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.log = log.get()
        self.state: State = state_store.load(config.state.dir)
        self.candidates: dict[str, policy.Candidate] = {}
        self.last_report: dict[str, tuple[str, str]] = {}
        self.dirty: set[str] = set()
        self.baseline: layout.Layout | None = None
        self.reconciled = False
        self.resume_owed = False
        self.backoff = config.engine.retry_initial
        self.engine_retry_at = 0.0
        self.next_rescan = 0.0
        self.next_recheck: float | None = None
        self.watcher = source.Watcher(
            self.root,
            ignore=config.source.ignore,
            notify=lambda name: self.inbox.put(("fs", name)),
            poll=config.source.poll,
            poll_interval=config.source.poll_interval,
        )

    # -- edges: called from other threads, they only enqueue -------------------------------

    def request_stop(self) -> None:
        self.inbox.put(("stop", None))

    def install_signal_handlers(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda signo, _frame: self.inbox.put(("signal", signo)))

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        self.watcher.start()
        self.log.info(
            "daemon.started",
            root=str(self.root),
            engine=self.config.engine.url,
            detection="polling" if self.watcher.polling else "inotify",
        )
        try:
            while not self.stop.is_set():
                self._tick()
                self._wait()
        finally:
            self.watcher.stop()
            if self.resume_owed:
                self._retry_resume()
            self.client.close()
            self.log.info("daemon.stopped", serving=self.state.serving and self.state.serving.version)
        return 0

    def _wait(self) -> None:
        now = time.monotonic()
        deadlines = [self.next_rescan]
        if self.next_recheck is not None:
            deadlines.append(self.next_recheck)
        if not self.reconciled or self.resume_owed:
            deadlines.append(self.engine_retry_at)
        timeout = max(0.0, min(deadlines) - now)
        try:
            messages = [self.inbox.get(timeout=timeout)]
        except queue.Empty:
            return
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for kind, value in messages:
            if kind == "fs":
                self.dirty.add(value)
            elif kind in ("stop", "signal"):
                self.log.info("daemon.stopping", signal=signal.Signals(value).name if value else None)
                self.stop.set()

    def _tick(self) -> None:
        now = time.monotonic()
        if self.resume_owed and now >= self.engine_retry_at:
            self._retry_resume()
        if now >= self.next_rescan:
            self._rescan()
            self.next_rescan = now + self.config.source.rescan_interval
        self._refresh(self.dirty)
        self.dirty = set()
        if not self.reconciled:
            if now < self.engine_retry_at:
                return
            try:
                self._reconcile()
            except EngineError as exc:
                self._engine_down(exc)
                return
        self._advance()

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
            self.candidates[name] = reconcile.peek(directory)

    # -- engine: what is loaded, and loading ------------------------------------------------

    def _reconcile(self) -> None:
        """Learn what the engine serves, so nothing is reloaded needlessly after a restart."""
        version = self.client.weight_version()
        startup = self.client.startup_model()
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
        if version.startswith(RELOADING_PREFIX):
            self._restore_after_interrupted_reload(version)
            return
        if version == STARTUP_VERSION and serving.in_root:
            # Name the startup weights, so clients and `weight_info` see which checkpoint it is.
            self.client.set_weight_version(serving.version)
        self._set_serving(serving)

    def _restore_after_interrupted_reload(self, marker: str) -> None:
        """The weights may be a mix of two checkpoints: load the last good one back."""
        good = self.state.last_good
        self.log.warning(
            "engine.weights_unknown", engine_reported=marker, restoring=good.version if good else None
        )
        self._set_serving(None)
        if good is not None:
            self._load(policy.Candidate(good.name, good.step, ""), good.version, good.path, 0)

    def _advance(self) -> None:
        if self.baseline is None:
            return
        serving = self.state.serving
        key = policy.order_key(serving.name, serving.step) if serving and serving.in_root else None
        rejected = {name: r.fingerprint for name, r in self.state.rejected.items()}
        options = gate.GateOptions(
            verify_digests=self.config.gate.verify_digests,
            digest_threads=self.config.gate.digest_threads,
            manifest_grace=self.config.source.manifest_grace,
        )
        self.next_recheck = None
        for candidate in policy.to_try(self.candidates, serving=key, rejected=rejected):
            directory = self.root / candidate.name
            started = time.perf_counter()
            verdict = gate.check(directory, serving=self.baseline, options=options)
            gate_ms = round((time.perf_counter() - started) * 1000, 3)
            if verdict.status == "pending":
                self._report_pending(candidate.name, verdict.reason)
                self.next_recheck = time.monotonic() + self.config.source.pending_recheck_interval
            elif verdict.status == "rejected":
                self._reject(
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
                ready = policy.Candidate(candidate.name, manifest.step, verdict.fingerprint)
                self._load(ready, version, str(directory), verdict.bytes)
                return

    def _load(self, candidate: policy.Candidate, version: str, path: str, size: int) -> None:
        serving = self.state.serving
        fallback = self.state.last_good or serving
        self.log.info(
            "reload.started",
            version=version,
            path=path,
            bytes=size,
            from_version=serving.version if serving else None,
            detect_ms=_detection_lag_ms(Path(path)),
        )
        started = time.perf_counter()
        try:
            timings = hot_swap(
                self.client,
                Target(version, path),
                fallback=Target(fallback.version, fallback.path) if fallback else None,
                on_resume_failed=self._resume_failed,
            )
        except ReloadFailed as exc:
            self.log.error(
                "reload.failed", version=version, path=path, reason=str(exc), restored=exc.restored
            )
            if exc.engine_up:
                self._reject(candidate.name, version, f"reload_weights failed: {exc}", candidate.fingerprint)
            if not exc.restored:
                self.reconciled = False
                self._engine_down(exc)
            return
        except EngineError as exc:
            self.log.error("reload.failed", version=version, path=path, reason=str(exc), restored=False)
            self.reconciled = False
            self._engine_down(exc)
            return
        seconds = time.perf_counter() - started
        loaded = Loaded(
            name=candidate.name, version=version, path=path, since=time.time(), step=candidate.step
        )
        self._set_serving(loaded, last_good=loaded)
        self.log.info(
            "reload.succeeded",
            version=version,
            path=path,
            bytes=size,
            duration_ms=round(seconds * 1000, 3),
            gb_per_s=round(size / seconds / 1e9, 3) if seconds > 0 else None,
            **timings,
        )

    def _set_serving(self, serving: Loaded | None, *, last_good: Loaded | None = None) -> None:
        update: dict[str, Any] = {"serving": serving}
        if last_good is not None:
            update["last_good"] = last_good
        self._save(self.state.model_copy(update=update))

    def _reject(self, name: str, version: str | None, reason: str, fingerprint: str, **details: Any) -> None:
        version = version or name
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

    def _engine_down(self, exc: EngineError) -> None:
        self.reconciled = False
        self.engine_retry_at = time.monotonic() + self.backoff
        self.log.warning(
            "engine.unreachable" if isinstance(exc, EngineUnavailable) else "engine.error",
            url=self.config.engine.url,
            reason=str(exc),
            retry_in_s=self.backoff,
        )
        self.backoff = min(self.backoff * 2, self.config.engine.retry_max)

    def _resume_failed(self, exc: EngineError) -> None:
        self.resume_owed = True
        self.log.error("engine.resume_failed", reason=str(exc))

    def _retry_resume(self) -> None:
        try:
            self.client.resume()
        except (EngineUnavailable, EngineCallFailed) as exc:
            self._engine_down(exc)
            return
        self.resume_owed = False
        self.log.info("engine.resumed")


def _detection_lag_ms(directory: Path) -> float | None:
    try:
        mtime = os.stat(directory / MANIFEST_NAME).st_mtime
    except OSError:
        return None
    return round((time.time() - mtime) * 1000, 3)
