"""The process: one loop that acts, and everything else only enqueues.

Watchdog callbacks, signal handlers, the object-store thread, the control server and the
reload thread put a typed message (`messages`) on `inbox` (gunicorn's arbiter does the
same with its signal queue); the loop drains it, dispatches each message with `match`,
lets the reloader act, and keeps systemd informed:
READY once the engine answered, STATUS as things change, WATCHDOG only while the watcher
and the reload worker are alive, RELOADING on SIGHUP, STOPPING on SIGTERM.
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from .. import config as config_mod
from .. import log
from ..config import Config
from ..engine.client import EngineClient
from ..errors import ConfigError
from ..sources.convert import Converter
from ..sources.verdicts import WAITING_FOR_CANARIES, Verdict
from . import parts, paths, status
from .adapters import Adapters
from .control import ControlServer, Request
from .messages import (
    AdapterGated,
    AdapterRecalled,
    AdaptersListed,
    Answered,
    ControlRequest,
    Downloaded,
    FileChanged,
    GateFinished,
    Message,
    Recalled,
    Rejected,
    ReloadFinished,
    Reverified,
    ShardWritten,
    SignalReceived,
    WarmedUp,
)
from .notify import Notifier
from .readiness import ReadinessServer
from .reloader import Reloader

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Helper(Protocol):
    """The lifecycle every thread the loop relies on shares."""

    def start(self) -> None: ...
    def close(self) -> None: ...
    def is_alive(self) -> bool: ...


class Daemon:
    def __init__(
        self,
        config: Config,
        *,
        config_path: Path | None = None,
        client: EngineClient | None = None,
        clients: Mapping[str, EngineClient] | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        """`client`: the (first) engine's client; `clients`: by URL, for several (tests)."""
        self.config = config
        self.config_path = config_path
        self.inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.log = log.get()
        self.notifier = notifier or Notifier()
        paths.check(config)  # before the state file is read or the socket made
        made = {config.engine.url: client} if client else {}
        self.reloader = Reloader(config, self.inbox.put, {**made, **(clients or {})}, self._verdict)
        self.watcher = parts.watcher(config, self.inbox.put)
        self.remote = parts.remote(config, self.reloader, self.inbox.put)
        self.converter = Converter(config.source, config.checkpoint_root, self.inbox.put)
        self.adapters = Adapters(config, self.log, self.reloader.metrics, self.inbox.put)
        self.control = ControlServer(
            config.control_socket, lambda request, reply: self.inbox.put(ControlRequest(request, reply))
        )
        self.ready_sent = False
        self.stopping_since: float | None = None
        self.last_status = ""
        self.next_observe = 0.0
        self.exit_code = 0

    def _verdict(self, verdict: Verdict) -> None:
        """A canary host tells the fleet (the object-store thread writes the record)."""
        if self.remote is not None and self.config.rollout.role == "canary":
            self.remote.record(verdict)

    # -- edges: called from other threads or signal handlers; they only enqueue ------------

    def request_stop(self) -> None:
        self.inbox.put(SignalReceived(signal.SIGTERM))

    def install_signal_handlers(self) -> None:
        for signum in SIGNALS:
            signal.signal(signum, lambda signo, _frame: self.inbox.put(SignalReceived(signo)))

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        """Until SIGTERM (exit 0), or until a helper thread dies (exit 1: systemd restarts us)."""
        if self.config.metrics.listen:
            self.reloader.metrics.serve(self.config.metrics.listen)
        readiness = self._serve_readiness()
        self.watcher.start()
        if self.remote:
            self.remote.start()
        self.converter.start()
        self.adapters.start()
        self.reloader.start()
        self.control.start()
        self.log.info(
            "daemon.started",
            root=str(self.config.checkpoint_root),
            source=self.config.source.path,
            engines=list(self.config.engine.urls),
            detection="polling" if self.watcher.polling else "inotify",
        )
        try:
            while not self.stop.is_set():
                self._step()
                self._wait()
        except ConfigError as exc:  # the engine is not set up for us: no restart fixes that
            self.log.error("daemon.not_runnable", reason=str(exc))
            self.exit_code = 2
        except Exception:  # a bug: say so with the traceback, exit 1, and systemd restarts us
            self.log.exception("daemon.crashed")
            self.exit_code = 1
        finally:
            if readiness is not None:
                readiness.close()
            self.control.close()
            if self.remote:
                self.remote.close()
            self.converter.close()
            self.adapters.close()
            self.watcher.close()
            self.reloader.close()
            serving = self.reloader.served.serving
            self.log.info(
                "daemon.stopped", serving=serving.version if serving else None, exit_code=self.exit_code
            )
        return self.exit_code

    def _serve_readiness(self) -> ReadinessServer | None:
        """`GET /ready/<n>` for the balancer (its address is read at start only)."""
        config = self.config.readiness
        if config.listen is None:
            return None
        server = ReadinessServer(config.listen, self.reloader.engines.rotation)
        server.start()
        in_place = config.drain and len(self.config.engine.urls) < 2
        self.log.info(
            "readiness.listening",
            listen=config.listen,
            engines={str(n): url for n, url in enumerate(self.config.engine.urls)},
            drain="in place: one engine alone" if in_place else "rotation" if config.drain else "off",
        )
        return server

    def _dead_helper(self) -> str | None:
        helpers: dict[str, Helper | None] = {
            "watcher": self.watcher, "reload thread": self.reloader, "control socket": self.control,
            "converter": self.converter, "object store": self.remote, "adapters": self.adapters,
        }  # fmt: skip
        return next((name for name, h in helpers.items() if h is not None and not h.is_alive()), None)

    def _step(self) -> None:
        if (dead := self._dead_helper()) is not None:  # never run on with a silent dead thread
            self.log.error("daemon.thread_died", thread=dead, action="exiting 1; systemd restarts the daemon")
            self.exit_code = 1
            self.stop.set()
            return
        if self.stopping_since is None:
            self.reloader.tick()
            engines = self.reloader.engines
            self.adapters.tick(engines.all, lambda url: engines.drain(self.config.readiness, url))
        elif not self._under_way() or time.monotonic() > self._stop_deadline():
            self.stop.set()
            return
        self._tell_systemd()

    def snapshot(self, newer: bool = False) -> status.Snapshot:
        """What operators see: the reloader's view, and the object store's (what waits there is
        newer than what any engine serves: the store lists only such; one waiting on canary
        hosts is said by its own alert). `newer`: what each engine has yet to serve."""
        found = self.reloader.snapshot(newer)
        found = dataclasses.replace(found, adapters=self.adapters.snapshot(self.reloader.engines.all))
        if self.remote is None:
            return found
        remote = self.remote.pending
        waiting = {n for n, why in remote.items() if not why.startswith(WAITING_FOR_CANARIES)}
        held = not newer or found.pinned is not None
        return dataclasses.replace(
            found,
            pending={**found.pending, **remote},
            engines=tuple(
                e
                if held or not e.reachable
                else dataclasses.replace(e, newer=tuple(sorted({*e.newer, *waiting})))
                for e in found.engines
            ),
            source_url=self.remote.config.source.path,
            source_failing=dict(self.remote.problems),
        )

    def _tell_systemd(self) -> None:
        """Every tick: systemd's status and watchdog; once a second, with `[metrics] listen`,
        the metrics of what waits (one snapshot for both)."""
        observe = self.config.metrics.listen is not None and time.monotonic() >= self.next_observe
        snapshot = self.snapshot(newer=observe)
        if observe:
            self.next_observe = time.monotonic() + 1.0
            self.reloader.metrics.observe(snapshot, time.time())
        now = status.line(snapshot)
        if not self.ready_sent and self.reloader.served.reconciled and self.reloader.canary.idle:
            self.ready_sent = True
            self.notifier.ready(now)
        elif not self.ready_sent:
            self.notifier.extend_timeout(self.config.engine.retry_max + 30)
        if now != self.last_status:
            self.last_status = now
            self.notifier.status(now)
        if self._healthy():
            self.notifier.watchdog()

    def _healthy(self) -> bool:
        """Alive means the helper threads run, and no reload outlives what its timeouts allow."""
        if not (self.watcher.is_alive() and self.reloader.is_alive() and self.control.is_alive()):
            return False
        if self.remote and not self.remote.is_alive():
            return False
        now = time.monotonic()
        return all(now - job.started < self._reload_budget() for job in self.reloader.jobs())

    def _reload_budget(self) -> float:
        engine, readiness = self.config.engine, self.config.readiness
        drain = readiness.grace + readiness.drain_timeout if readiness.drain else 0.0
        return drain + engine.pause_timeout + 2 * engine.reload_timeout + 6 * engine.timeout

    def _under_way(self) -> bool:
        """A reload, or an engine's thread on a question (an adapter's swap, canary, rollback)."""
        return bool(self.reloader.jobs()) or self.adapters.under_way(self.reloader.engines.all)

    def _stop_deadline(self) -> float:
        assert self.stopping_since is not None
        return self.stopping_since + self._reload_budget()

    def _wait(self) -> None:
        timeout = max(0.0, self.reloader.next_deadline() - time.monotonic())
        if self.notifier.watchdog_interval is not None:
            timeout = min(timeout, self.notifier.watchdog_interval)
        if self.stopping_since is not None:
            timeout = min(timeout, 0.5)
        try:
            messages = [self.inbox.get(timeout=timeout)]
        except queue.Empty:
            return
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for message in messages:
            self._dispatch(message)

    # -- the one place messages are acted on ----------------------------------------------------

    def _dispatch(self, message: Message) -> None:
        match message:
            case FileChanged(name):
                self.reloader.changed(name)
            case ShardWritten(path):  # read it now, beside the writer, not once the manifest lands
                self.reloader.gater.prehash(Path(path), self.config.gate.max_tensors)
            case Downloaded(name):  # gate it now, not at the watcher's pace
                self.reloader.changed(name)
                self.reloader.prune_cache()
            case Rejected(name, version, reason, fingerprint, check):
                self.reloader.rejected_remotely(name, version, reason, fingerprint, check)
            case Recalled(name, version, fingerprint, reason):  # a follower goes back from it
                self.reloader.recalled(name, version, fingerprint, reason)
            case GateFinished(gating, verdict):  # stopping: nothing new is loaded, or converted
                self.reloader.gated(message, act=self.stopping_since is None)
                if self.stopping_since is None and not message.cancelled:
                    self.converter.consider(gating.candidate.name, gating.directory, verdict)
            case Answered() as answer:  # stopping: nothing new is started on what it says
                self.reloader.engines.answered(answer, act=self.stopping_since is None)
            case ReloadFinished(outcome):
                self.reloader.finished(outcome)
            case Reverified():
                self.reloader.reverified(message)
            case AdapterGated() | AdaptersListed() | AdapterRecalled():
                self.adapters.found(message)
            case WarmedUp(seconds, problem, engine):
                self.log.info("engine.warmed", ms=round(seconds * 1000, 1), problem=problem, engine=engine)
            case ControlRequest(request, reply):
                if reply.claim():  # else its client was told it timed out: do nothing
                    reply.put(self._control(request))
            case SignalReceived(signum):
                self._signal(signum)
            case _:
                self.log.error("inbox.unknown", message=repr(message)[:200])

    def _control(self, request: Request) -> dict[str, object]:
        command = request["command"]
        if command == "status":
            return {"ok": True, **status.answer(self.snapshot())}
        error = None
        if command == "pin":
            error = self.reloader.pin(str(request.get("version", "")), force=request.get("force") is True)
        elif command == "unpin":
            self.reloader.unpin()
        self.reloader.check_now()
        return {"ok": error is None, **({"error": error} if error else {})}

    def _signal(self, signum: int) -> None:
        if signum == signal.SIGHUP:
            self.reload_config()
        elif self.stopping_since is None:
            self.stopping_since = time.monotonic()
            self.notifier.stopping()
            self.reloader.engines.stopping.set()  # a reload still draining pauses nothing
            if self.reloader.gating is not None:
                self.reloader.gating.cancel.set()
            jobs = self.reloader.jobs()
            self.log.info(
                "daemon.stopping",
                signal=signal.Signals(signum).name,
                waiting_for=jobs[0].target.version if jobs else None,
            )

    def reload_config(self) -> None:
        """SIGHUP: build a new config, validate it, swap it in with one assignment; keep the
        old one (and say so) when the new one is invalid."""
        self.notifier.reloading()
        try:
            if self.config_path is None:
                raise ConfigError("no config file to re-read")
            new = config_mod.load(self.config_path)
            paths.check(new)  # the directories it names, as at start, whatever changed
        except ConfigError as exc:
            self.log.error("config.invalid", reason=str(exc), kept="previous config")
            self.notifier.ready(status.line(self.snapshot()))
            return
        old = self.config
        if old.log.priority_prefix:  # set on the command line, which a SIGHUP does not re-read
            new = new.model_copy(update={"log": new.log.model_copy(update={"priority_prefix": True})})
        if new.log != old.log:
            log.configure(new.log.level, new.log.format, priority_prefix=new.log.priority_prefix)
        if new.source != old.source or new.state != old.state or new.rollout != old.rollout:
            remote = watcher = None
            try:  # every new part built (the watcher started) before any old one is closed
                remote = parts.remote(new, self.reloader, self.inbox.put)
                watcher = parts.watcher(new, self.inbox.put)
                watcher.start()  # inotify watches are made here: a limit or a permission fails now
            except (ConfigError, OSError) as exc:
                if watcher is not None:
                    watcher.close()
                reason = str(exc) if isinstance(exc, ConfigError) else f"source: {exc.strerror or exc}"
                self.log.error("config.invalid", reason=reason, kept="previous config")
                self.notifier.ready(status.line(self.snapshot()))
                return
            if self.remote:
                self.remote.close()
                if remote is not None:  # none is lost, whatever the new state dir
                    remote.fleet.adopt(self.remote.fleet.detach())
            self.remote = remote
            self.watcher.close()
            self.watcher = watcher
            if self.remote:
                self.remote.start()
        self.config = new
        self.converter.configure(new.source, new.checkpoint_root)
        self.adapters.reconfigure(new)
        self.reloader.reconfigure(new)
        self.log.info("config.reloaded", path=str(self.config_path))
        self.notifier.ready(status.line(self.snapshot()))
