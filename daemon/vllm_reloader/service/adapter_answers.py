"""What the adapter loop makes of each engine's answer: what it holds, a swap's outcome (loaded,
failed its canary and gone back, refused, or uncertain), a canary again after a base change,
an unload. Each answer updates the facts in `Holdings`, and the record store where they must
survive a restart: a content whose canary answers were broken is rejected by fingerprint (with
the verdict telling the fleet, in one transaction); one that failed on an engine that may still
hold it keeps that engine out of rotation (`Holdings.failed_here`).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Mapping

from ..checkpoint.adapter import AdapterVersion
from ..engine import adapters as swapping
from .adapter_records import FAILED_KIND, Adapter, Holdings
from .engine import Engine
from .metrics import Metrics

RECHECK = "recheck"
"""The backoff's key for an engine's adapters canaried again (after a base change, a start)."""


class AdapterAnswers:
    def __init__(
        self,
        facts: Holdings,
        metrics: Metrics,
        tell_fleet: Callable[[AdapterVersion, bool, str | None], None],
        forgotten: queue.SimpleQueue[tuple[str, str]],
    ) -> None:
        """`tell_fleet`: a canary engine's verdict for the fleet; `forgotten`: versions whose copy
        proved changed, for the source to judge again."""
        self.facts, self.metrics, self.tell_fleet, self.forgotten = facts, metrics, tell_fleet, forgotten

    def held(self, url: str, found: Mapping[str, str]) -> None:
        self.facts.held[url] = dict(found)  # canaried again if it is not what passed (`owed`)
        self.facts.tidy()

    def swapped(self, engine: Engine, canary: bool, result: swapping.Swapped) -> None:
        facts, target = self.facts, result.target
        held = facts.held.get(engine.url)
        state = facts.known.setdefault(target.adapter, Adapter())
        fields = {"adapter": target.adapter, "version": target.version, "fingerprint": target.fingerprint}
        if result.uncertain or held is None:
            facts.held[engine.url] = held = None  # asked again before anything else is done there
        if result.probe_unavailable is not None:
            engine.no_probe(result.probe_unavailable)
        if result.changed is not None:
            engine.log.error("adapter.changed", **fields, reason=result.changed)
            self.forgotten.put((target.adapter, target.version))
            state.newest = None if state.newest and state.newest.copy == target else state.newest
            state.good = None if state.good == target else state.good
        elif result.canary_failed is not None:
            self._failed(engine, canary, result, fields, held)
        elif result.error is not None:
            self._count(target.adapter, "failed", engine.url)
            wait = facts.backoff.failed((engine.url, target.fingerprint))
            engine.log.warning("adapter.load_failed", **fields, reason=result.error, retry_in_s=wait)
        else:
            if held is not None:
                held[target.adapter] = target.path
                base = engine.served.serving.fingerprint if engine.served.serving else None
                facts.passed(engine.url, base)  # its canary asked the base and every adapter held
            if canary and target.fingerprint not in facts.rejected:  # not recalled while it loaded
                state.passed(target)
                self.tell_fleet(target, True, None)
            state.last_reload = {"version": target.version, "engine": engine.url, "at": time.time()}
            self._count(target.adapter, "success", engine.url)
            took = round(result.seconds * 1000, 1)
            engine.log.info(
                "adapter.loaded", **fields, load_ms=result.load_ms, probe_ms=result.probe_ms, duration_ms=took
            )
        facts.tidy()

    def _failed(
        self,
        engine: Engine,
        canary: bool,
        result: swapping.Swapped,
        fields: dict[str, str],
        held: dict[str, str] | None,
    ) -> None:
        facts, target = self.facts, result.target
        self._count(target.adapter, "canary_failed", engine.url)
        back = facts.versions.get(held.get(target.adapter, "")) if held else None
        if held is not None and not result.probed:  # probed: nothing was loaded, it holds what it did
            if result.rolled_back and back is not None:
                held[target.adapter] = back.path
            else:
                held.pop(target.adapter, None)
        reason = f"its canary failed: {result.canary_failed}"
        with facts.records.transaction("adapter_failure"):  # what is remembered, the fleet's verdict
            facts.failed(engine.url, target.fingerprint, reason)  # out while the engine may hold it
            if canary and result.blamed:
                facts.rejected.remember(target.fingerprint, reason)
                self.tell_fleet(target, False, reason)
        if canary and result.blamed:
            state = facts.known[target.adapter]
            state.rejected = {**state.rejected, target.version: f"canary: {result.canary_failed}"}
        else:  # a follower's failure, or no answer: tried again later, blaming nothing
            facts.backoff.failed((engine.url, target.fingerprint))
        engine.log.error(
            "adapter.rolled_back", **fields, cause="probe" if result.probed else "canary",
            reason=result.canary_failed, blamed=result.blamed,
            to_version=back.version if (result.rolled_back or result.probed) and back else None,
            unloaded=result.unloaded, flush_probes=result.flush_probes, error=result.error,
        )  # fmt: skip

    def rechecked(
        self,
        engine: Engine,
        base: str | None,
        names: tuple[str, ...],
        canary: bool,
        result: swapping.Rechecked,
    ) -> None:
        """Each adapter canaried again: one broken on this base is unfit for it (unloaded, or
        kept out while its unload failed); all judged and every broken one gone, what the
        engine holds passed on this base."""
        facts, found, unloaded = self.facts, result.found, result.unloaded
        held = facts.held.get(engine.url)
        if held is None:
            return
        for name, reason in found.items():
            path = held.get(name, "")
            version = facts.versions.get(path)
            if reason is not None and path:  # broken on this base, unloaded or not: never held as fit
                facts.unfit.add((facts.content_of(path) or path, base))
            if reason is None:
                state = facts.known.get(name)
                fit = version is not None and version.fingerprint not in facts.rejected
                if canary and state is not None and version is not None and fit and state.confirmed(version):
                    self.tell_fleet(version, True, None)  # held before a restart, or an answer lost
                if version is not None:  # it answers well here now
                    facts.failed_here.pop(f"{engine.url} {version.fingerprint}", None)
                continue
            if name in unloaded:
                held.pop(name, None)
                engine.log.error("adapter.unloaded", adapter=name, cause="base_changed", reason=reason)
        failed = {name for name, reason in found.items() if reason is not None}
        if set(found) != set(names) or not failed <= unloaded:  # no answer, or an unload failed: again
            facts.held[engine.url] = None
            wait = facts.backoff.failed((engine.url, RECHECK))  # a slow engine is not asked in a loop
            engine.log.warning("adapter.recheck_failed", adapters=list(names), retry_in_s=wait)
        else:
            facts.passed(engine.url, base)
        facts.records.replace(FAILED_KIND, facts.failed_here)
        facts.tidy()

    def unloaded(self, engine: Engine, name: str, cause: str, error: str | None) -> None:
        held = self.facts.held.get(engine.url)
        if error is not None:
            self.facts.held[engine.url] = None
            engine.log.warning("adapter.unload_failed", adapter=name, reason=error)
            return
        if held is not None:
            held.pop(name, None)
        engine.log.info("adapter.unloaded", adapter=name, cause=cause)
        self.facts.tidy()

    def _count(self, adapter: str, result: str, engine: str) -> None:
        self.metrics.adapter_loads.labels(adapter=adapter, result=result, engine=engine).inc()
