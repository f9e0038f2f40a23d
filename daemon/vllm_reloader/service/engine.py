"""One engine the daemon drives: its HTTP client, what it holds (`Served`), and what the daemon
owes it (a restore of unknown weights, a name for its startup weights, a warm-up) — the facts
its scheduler (`scheduler`) plans from. Nothing here calls the engine: every call runs on the
engine's own thread, started by its scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..checkpoint import order
from ..config import Config, EngineConfig
from ..engine import probe
from ..engine.client import (
    BUILTIN_LOADER_FIX,
    BUILTIN_LOADER_RISK,
    STARTUP_VERSION,
    EngineClient,
)
from ..engine.nodes import NodeState
from ..errors import EngineError, EngineUnavailable
from ..retry import Backoff, Policy
from . import outcomes, reconcile, setup
from .metrics import Metrics
from .served import Served
from .state import Loaded

STARTING_POLL_S = 1.0
"""An engine that never answered since the daemon started is asked this often: its start is
noticed within a second, whatever `retry_max` says."""
STARTING_WARN_AFTER_S = 600.0
"""...and said as a warning once it has not answered for this long (a big model on a slow
disk takes minutes; ten without an answer is worth a look)."""
FOUND_PAUSED = "found paused: resuming it"
RESUME_FAILED = "its resume failed: retrying"
CHANGED_UNDER_US = "its weights changed under us: reconciling"


SCAN_FAILED = (
    "its scan inside the pause failed or gave no answer: the host scans its weights until it restarts"
)


@dataclass(eq=False)
class Engine:
    url: str
    client: EngineClient
    served: Served
    log: Any
    """The daemon's logger with `engine=url` bound: every event about this engine names it."""
    metrics: Metrics
    down: Backoff[str]
    """The wait before this engine is asked again after it did not answer."""
    follow: Backoff[str]
    """The wait before a failed reload here is tried again (a follower's, or a refused load)."""
    last_error: str | None = None
    """Why the last reload on this engine failed (shown in `status` until one succeeds)."""
    restore: Loaded | None = None
    """Its weights are of unknown mix (a reload cut short): load this back, before anything."""
    name_owed: str | None = None
    """Startup weights of the root to name (`weight_info`), once reconciled."""
    warm_owed: bool = False
    """A canary probe owed after a reconcile (its first logprobs request costs seconds)."""
    paused_why: str = RESUME_FAILED
    unclean: str | None = None
    """Why it is out of rotation though it serves good weights (not clean after a rollback):
    until a reload passes on it, or it restarts. Kept in the record store."""
    probe_unavailable: str | None = None
    """Why no forward pass inside the pause can judge its reloads (said once: the canary alone
    judges them)."""
    device: str | None = None
    """Where its weights are (`cuda`, `cpu`, ...), as its last probe said (None: none did)."""
    quantized: bool = False
    """Its last probe said the weights are quantized (a scan of them is not the checkpoint's)."""
    scan_failed: bool = False
    """A scan inside the pause failed or gave no answer: the host scans for it until it restarts."""
    answered_once: bool = False
    """It answered since the daemon started: a refusal now is an outage, not a start."""
    starting_since: float | None = None
    """When it first did not answer, before it ever did (it is starting: said as info)."""
    start_warned: bool = False
    nodes: tuple[str, tuple[NodeState, ...]] | None = None
    """A multi-node engine: the version its ranks were last asked about, and each node's word."""

    @classmethod
    def make(
        cls,
        config: EngineConfig,
        url: str,
        *,
        known: Loaded | None,
        good: tuple[Loaded, ...],
        log: Any,
        metrics: Metrics,
        client: EngineClient | None = None,
    ) -> Engine:
        policy = Policy(config.retry_initial, config.retry_max)
        return cls(
            url=url,
            client=client or EngineClient(config, url=url),
            served=Served(known, good),
            log=log.bind(engine=url),
            metrics=metrics,
            down=Backoff(policy),
            follow=Backoff(policy),
        )

    # -- what it answered ----------------------------------------------------------------------

    def answered(self, now: float, check_interval: float) -> None:
        self.answered_once = True
        self.served.answered(now, check_interval)
        self.down.succeeded(self.url)
        self.metrics.engine_up.labels(engine=self.url).set(1)

    def went_down(self, exc: EngineError) -> None:
        self.served.went_down(str(exc))
        self.metrics.engine_up.labels(engine=self.url).set(0)
        now = time.monotonic()
        if isinstance(exc, EngineUnavailable) and not self.answered_once:  # most likely starting
            self.starting_since = self.starting_since or now
            waited = now - self.starting_since
            if waited < STARTING_WARN_AFTER_S:
                self.down.failed(self.url, at_most=STARTING_POLL_S)  # noticed once it is up
                if self.down.failures(self.url) == 1:
                    self.log.info("engine.starting", url=self.url, reason=str(exc), poll_s=STARTING_POLL_S)
                return
            wait = self.down.failed(self.url, at_most=STARTING_POLL_S)  # still polled: a big
            if not self.start_warned:  # model may take many minutes to load; said once, not each try
                self.start_warned = True
                self.log.warning(
                    "engine.unreachable", url=self.url, reason=str(exc), waited_s=round(waited),
                    retry_in_s=wait,
                    fix="is the engine running? `systemctl status vllm`, `journalctl -u vllm`; "
                    "does [engine] url name it?",
                )  # fmt: skip
            return
        wait = self.down.failed(self.url)
        self.log.warning(
            "engine.unreachable" if isinstance(exc, EngineUnavailable) else "engine.error",
            url=self.url,
            reason=str(exc),
            retry_in_s=wait,
        )

    def retry_at(self) -> float:
        """When it may be asked again after it did not answer (0: now)."""
        return self.down.until(self.url) or 0.0

    def retry_at_follow(self) -> float:
        """When a failed reload here may be tried again (0: now)."""
        return self.follow.until(self.url) or 0.0

    def probes(self, config: Config) -> bool:
        """New weights (and adapters) are probed here before any client request reaches them."""
        extension = self.served.extension and self.probe_unavailable != probe.OLD_EXTENSION
        return config.canary.probe and extension

    def can_scan(self, config: Config) -> bool:
        """Its probe can check every loaded parameter for NaN/Inf (inside the pause)."""
        return self.probes(config) and not self.scan_failed

    def scans(self, config: Config) -> bool:
        """Its probe checks every loaded parameter for NaN/Inf, as `[gate] scan` asks."""
        able = config.gate.check_finite and self.can_scan(config)
        return probe.engine_scans(config.gate.scan, able=able, device=self.device, quantized=self.quantized)

    def probed(self, timings: Mapping[str, Any], *, scan_failed: bool) -> None:
        """What a reload's probe said of the engine (or that its scan failed)."""
        if why := timings.get("probe_unavailable"):
            self.no_probe(str(why))
        if isinstance(device := timings.get("probe_device"), str):
            self.device, self.quantized = device, bool(timings.get("probe_quantized"))
        if scan_failed:
            self.scan_failed = True
            self.no_probe(SCAN_FAILED)

    def no_probe(self, why: str) -> None:
        """New weights are judged by the canary alone, on live traffic: said once per cause."""
        if why != self.probe_unavailable:
            self.probe_unavailable = why
            self.log.warning("engine.probe_unavailable", reason=why)

    def resumed(self, _: object = None) -> None:
        self.served.resume_owed = False
        self.log.info(
            "engine.resumed", **({"reason": "found paused at reconcile"} if self.paused_found else {})
        )
        self.paused_why = RESUME_FAILED

    @property
    def paused_found(self) -> bool:
        return self.paused_why == FOUND_PAUSED

    def checked(self, version: str) -> None:
        """Notice an engine that restarted (or was reloaded by someone else) while we idled."""
        serving = self.served.serving
        if serving is None or version != serving.version:
            self.log.warning(
                "engine.changed", engine_reported=version, expected=serving.version if serving else None
            )
            self.served.reconciled = False
            self.served.down_reason = CHANGED_UNDER_US

    def as_follower(self, decision: outcomes.Decision) -> outcomes.Decision:
        """A follower loads a version that passed on the canary engine: a failed reload here is
        this engine's, retried with a backoff, and blames no checkpoint; a failed canary blames
        the version, for the whole host (loading the same weights again would fail again), and
        so does a probe that found them broken, or a host scan that found NaN/Inf."""
        blames_weights = decision.reject is not None and decision.reject.check in (
            "canary",
            "probe",
            "finite",
        )
        if decision.result == "succeeded" or blames_weights:
            self.last_error = None
            self.follow.succeeded(self.url)
            return decision
        refusals = ("engine.reload_refused", "node.not_staged")
        said = ("reload.failed", *refusals)
        failed = [e.fields.get("reason") for e in decision.events if e.name in said]
        reason = decision.reject.reason if decision.reject else str(failed[0] if failed else decision.result)
        wait = self.follow.failed(self.url)
        self.last_error = reason
        if any(e.name in refusals for e in decision.events):  # its one line says when it is tried again
            events = tuple(
                replace(e, fields={**e.fields, "retry_in_s": wait}) if e.name in refusals else e
                for e in decision.events
            )
            return replace(decision, reject=None, regate=None, events=events)
        retry = outcomes.Event("warning", "engine.retry", {"reason": reason, "retry_in_s": wait})
        return replace(decision, reject=None, regate=None, events=(*decision.events, retry))

    # -- a reconcile: what it said of itself ----------------------------------------------------

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
        setup.nodes(whole.node.role, server, served.extension)
        if not server.extension:
            self.log.warning("engine.builtin_loader", reason=BUILTIN_LOADER_RISK, fix=BUILTIN_LOADER_FIX)
            self.no_probe(f"the engine runs without the worker extension: {BUILTIN_LOADER_FIX}")
        served.startup = setup.startup_path(server)
        serving = reconcile.serving(
            version, served.startup, known=served.serving, root=root, candidates=candidates, trusted=trusted
        )
        served.baseline = setup.settle_baseline(config, server, served, serving.path, self.log)
        served.reconciled = True
        if version == STARTUP_VERSION:  # restarted: nothing of before is loaded, nor unclean
            self.unclean = None  # and what its probes said may not hold (another extension, device)
            self.device, self.quantized, self.scan_failed, self.probe_unavailable = None, False, False, None
        return version, serving

    def settle(self, version: str, serving: Loaded, *, paused: bool) -> None:
        """After `learn`, unless a restore is owed: resume an engine found paused (only a daemon
        killed mid-reload leaves it so), name startup weights from the root (so clients and
        `weight_info` see which checkpoint it is), and warm it up for its first canary. Each is
        owed here and done by its scheduler."""
        if paused:
            self.served.resume_owed, self.paused_why = True, FOUND_PAUSED
        self.name_owed = serving.version if version == STARTUP_VERSION and serving.in_root else None
        self.warm_owed = True

    def say_reconciled(self, version: str, serving: Loaded, learned: setup.Learned) -> None:
        """Said once the record store holds what it means (whoever reads it on the line finds it)."""
        fields = {"version": serving.version, "path": serving.path, "engine_reported": version}
        self.log.info("engine.reconciled", **fields, **learned.found.logged())
