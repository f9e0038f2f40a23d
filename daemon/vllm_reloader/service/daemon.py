"""The process: one loop that acts, and everything else only enqueues.

Watchdog callbacks, signal handlers, the object-store thread, the control server and each
engine's thread put a typed message (`messages`) on `inbox` (gunicorn's arbiter does the same
with its signal queue); the loop drains it, dispatches each message with `match`, then takes
its turn: the reloader and the adapters look at what they own, each engine's scheduler settles
its rotation and starts what is owed, the content store's collector runs. It keeps systemd
informed: READY once the engine answered, STATUS as things change, WATCHDOG only while every
thread is alive, RELOADING on SIGHUP, STOPPING on SIGTERM.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from .. import log
from ..config import Config
from ..engine.client import EngineClient
from ..errors import ConfigError, StateError
from ..records import RecordStore
from ..sources.content import ContentStore
from ..sources.convert import Converter
from ..sources.verdicts import Verdict
from ..threads import take_all
from . import parts, paths, reconfigure, status, views
from .adapters import Adapters
from .control import ControlServer, Request
from .leases import Collector
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
from .migrate import migrate
from .notify import Notifier
from .readiness import serve
from .reloader import Reloader

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Helper(Protocol):
    """The lifecycle every thread the loop relies on shares (`threads.Worker`)."""

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
        self.config, self.config_path = config, config_path
        self.inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.log = log.get()
        self.notifier = notifier or Notifier()
        paths.check(config)  # before the record store is read or the socket made
        self.records = RecordStore.open(config.state.dir, self.log)
        unset = "completeness" not in config.source.model_fields_set
        migrate(self.records, config.state.dir, self.log, completeness_unset=unset)
        self.content = ContentStore(self.records, self.log)
        self.content.forget_holders()  # of a process gone: each owner declares its own anew
        if config.source.remote:
            self.content.adopt(config.checkpoint_root, "*", "download")
        if config.adapters.root is not None:
            self.content.adopt(config.adapter_copies, "*/*@*", "adapter")
        made = {config.engine.url: client} if client else {}
        clients = {**made, **(clients or {})}
        self.reloader = Reloader(config, self.inbox.put, self.records, clients, self._verdict)
        self.watcher = parts.watcher(config, self.inbox.put)
        self.remote = parts.remote(config, self.reloader, self.inbox.put)
        self.converter = Converter(config.source, config.checkpoint_root, self.inbox.put, self.content)
        self.adapters = Adapters(config, self.log, self.reloader.metrics, self.inbox.put, self.records)
        self.collector = Collector(self.content, self.log)
        self.control = ControlServer(
            config.control_socket, lambda request, reply: self.inbox.put(ControlRequest(request, reply))
        )
        self.reporting = views.Reporting(self.notifier)
        self.stopping_since: float | None = None
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

    def helpers(self) -> dict[str, Helper | None]:
        return {
            "watcher": self.watcher, "reload thread": self.reloader, "control socket": self.control,
            "converter": self.converter, "object store": self.remote, "adapters": self.adapters,
        }  # fmt: skip

    def run(self) -> int:
        """Until SIGTERM (exit 0), or until a helper thread dies (exit 1: systemd restarts us)."""
        if self.config.metrics.listen:
            self.reloader.metrics.serve(self.config.metrics.listen)
        readiness = serve(self.config, self.reloader.engines.rotation, self.log)
        for helper in self.helpers().values():
            if helper is not None:
                helper.start()
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
            for name, helper in self.helpers().items():
                if helper is not None and name != "reload thread":
                    helper.close()
            self.reloader.close()  # last: the engines are resumed if a resume is owed
            self.records.close()
            self.log.info("daemon.stopped", exit_code=self.exit_code, **self._stopped_serving())
        return self.exit_code

    def _stopped_serving(self) -> dict[str, str | None]:
        """What the engine serves, as it last said: the record alone (`recorded`) is what it
        served when this daemon or the last one last heard from it."""
        served = self.reloader.served
        version = served.serving.version if served.serving is not None else None
        return {"serving": version} if served.reconciled else {"serving": None, "recorded": version}

    def _step(self) -> None:
        dead = next((name for name, h in self.helpers().items() if h is not None and not h.is_alive()), None)
        if dead is not None:  # never run on with a silent dead thread
            self.log.error("daemon.thread_died", thread=dead, action="exiting 1; systemd restarts the daemon")
            self.exit_code = 1
            self.stop.set()
            return
        engines, loads = self.reloader.engines, self.reloader.loads
        if self.stopping_since is None:
            self.reloader.tick()
            self.adapters.prepare(engines.all)
        engines.settle((loads.standing, self.adapters.standing))  # before new work: what ended is out
        if self.stopping_since is None:
            engines.tick(
                (loads.plan, self.adapters.plan), self.config, loads.reconciled, (self.adapters.owes,)
            )
            self.collector.turn(self.reloader, self.adapters, self.config.state.keep)
        elif not engines.under_way() or time.monotonic() > self._stop_deadline():
            self.stop.set()
            return
        self.reporting.turn(self.config, self.reloader, self.adapters, self.remote, self._healthy())

    def snapshot(self, newer: bool = False) -> status.Snapshot:
        """What operators see (`views.snapshot`)."""
        return views.snapshot(self.reloader, self.adapters, self.remote, newer)

    def _healthy(self) -> bool:
        """Alive means the helper threads run, and no reload outlives what its timeouts allow."""
        if not all(h.is_alive() for h in self.helpers().values() if h is not None):
            return False
        now, budget = time.monotonic(), views.reload_budget(self.config)
        return all(now - job.started < budget for job in self.reloader.jobs())

    def _stop_deadline(self) -> float:
        assert self.stopping_since is not None
        return self.stopping_since + views.reload_budget(self.config)

    def _wait(self) -> None:
        timeout = max(0.0, self.reloader.next_deadline() - time.monotonic())
        if self.notifier.watchdog_interval is not None:
            timeout = min(timeout, self.notifier.watchdog_interval)
        if self.reporting.resend_at is not None:  # systemd did not take a datagram: again soon
            timeout = min(timeout, max(0.0, self.reporting.resend_at - time.monotonic()))
        if self.stopping_since is not None:
            timeout = min(timeout, 0.5)
        for message in take_all(self.inbox, timeout):
            self._dispatch(message)

    # -- the one place messages are acted on ----------------------------------------------------

    def _dispatch(self, message: Message) -> None:
        match message:
            case FileChanged(name):
                self.reloader.changed(name)
            case Downloaded(name):  # gate it now, not at the watcher's pace
                self.reloader.changed(name)
                self.collector.soon()
            case ShardWritten(path):  # read it now, beside the writer, not once the manifest lands
                self.reloader.gater.prehash(Path(path), self.config.gate.max_tensors)
            case Rejected(name, version, reason, fingerprint, check):
                self.reloader.rejected_remotely(name, version, reason, fingerprint, check)
            case Recalled(name, version, fingerprint, reason):  # a follower goes back from it
                self.reloader.recalled(name, version, fingerprint, reason)
            case GateFinished(gating, verdict):  # stopping: nothing new is loaded, or converted
                self.reloader.gated(message, act=self.stopping_since is None)
                if self.stopping_since is None and not message.cancelled:
                    self.converter.consider(gating.candidate.name, gating.directory, verdict)
            case ReloadFinished(outcome):
                self.reloader.engines.finished(outcome)
                self.collector.soon()
            case Answered() | WarmedUp():  # applied while stopping too: nothing new starts from one
                self.reloader.engines.finished(message)
            case Reverified():
                self.reloader.reverified(message)
            case AdapterGated() | AdaptersListed() | AdapterRecalled():
                self.adapters.found(message)
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
        old = self.config
        try:
            rebuilt = reconfigure.prepare(self.config_path, old, self.reloader, self.inbox.put, self.records)
        except (ConfigError, StateError) as exc:
            self.log.error("config.invalid", reason=str(exc), kept="previous config")
            self._reloaded()
            return
        new = rebuilt.config
        if new.log != old.log:
            log.configure(new.log.level, new.log.format, priority_prefix=new.log.priority_prefix)
        if rebuilt.sources:
            if self.remote:
                self.remote.fleet.detach()  # the new one writes what is left in the outbox
                self.remote.close()
            self.watcher.close()
            self.remote, self.watcher = rebuilt.remote, rebuilt.watcher or self.watcher
            if self.remote:
                self.remote.start()
        self.config = new
        self.converter.configure(new.source, new.checkpoint_root)
        self.adapters.reconfigure(new)
        self.reloader.reconfigure(new)
        self.log.info("config.reloaded", path=str(self.config_path))
        self._reloaded()

    def _reloaded(self) -> None:
        """READY=1 after RELOADING=1; one dropped (a full queue) is sent again by the loop,
        else `systemctl reload` would wait for it until its timeout."""
        if not self.notifier.ready(status.line(self.snapshot())):
            self.reporting.ready_sent = not self.notifier.enabled
