"""LoRA adapters on the loop: what each adapter has passed and what each engine holds, and the
planner each engine's scheduler asks for adapter work.

Per adapter: the newest version the gate passed, and its last good version (one that passed
its canary on the canary engine, the first). A content whose canary answers were broken is
rejected by fingerprint, across restarts (`adapter_records.Rejections`); a failure that
blames nothing — a timeout, the engine's refusal, an engine not clean before the load — is
tried again after a backoff. Per engine: which adapter it holds from which copy, asked of
the engine (`/v1/models`) at start, after it restarted, and whenever a call left it unknown.

The canary engine loads a new version first; the others then load the version that passed
there. No version that orders before the newest is loaded by itself. Whatever an engine holds
is canaried again whenever its base weights are not the ones its adapters were last canaried
with — a base reload, and the daemon's own start (it cannot know what was canaried before) —
and an adapter whose answers are broken there is unloaded (it was trained on other weights).
Every call runs as `Work` its engine's scheduler started (one at a time, never beside a base
reload); a swap drained out of rotation counts against the host's budget like a reload.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from ..checkpoint.adapter import AdapterVersion, Served
from ..config import Config
from ..engine import adapters as swapping
from ..engine import probe
from ..engine.client import EngineClient
from ..records import RecordStore
from ..sources.adapter_fleet import AdapterFleet, AdapterRecalled
from ..sources.adapter_trees import StoreTree
from ..sources.adapters import AdaptersListed, AdapterSource, Found
from . import paths
from .adapter_answers import RECHECK, AdapterAnswers
from .adapter_records import Adapter, GateView, Holdings, Rejections
from .engine import Engine
from .jobs import Ask
from .metrics import Metrics
from .scheduler import Slot, Work


class Adapters:
    def __init__(
        self, config: Config, log: Any, metrics: Metrics, post: Callable[[Found], None], records: RecordStore
    ) -> None:
        """`post`: the loop's inbox, where the source thread sends what it found."""
        self.config, self.log, self.metrics, self.post, self.records = config, log, metrics, post, records
        self.facts = Holdings(Rejections(records), records, copies=config.adapter_copies)
        self.gate = GateView()
        self.gate_against: Served | None = None
        """What the canary engine serves, for the source thread's gate (replaced, never changed)."""
        self.forgotten: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        """Versions whose copy proved changed: the source judges them again."""
        self.holds: frozenset[tuple[str, str]] = frozenset()
        """(adapter, fingerprint) the engines hold, for a follower's recalls (read by the source)."""
        self.answers = AdapterAnswers(self.facts, metrics, self._tell_fleet, self.forgotten)
        self.canary_url = ""
        self.source = self._source(config)

    @property
    def rejected(self) -> Rejections:
        return self.facts.rejected

    @property
    def known(self) -> dict[str, Adapter]:
        return self.facts.known

    def _source(self, config: Config) -> AdapterSource | None:
        if config.adapters.root is None:
            return None
        tree = paths.adapter_tree(config)
        fleet = (
            AdapterFleet(tree.store, config.rollout, self.log, self.records)
            if isinstance(tree, StoreTree)
            else None
        )
        return AdapterSource(
            tree, config.adapter_copies, config.adapters.look_interval,
            served=lambda: self.gate_against, post=self.post, forgotten=self.forgotten, fleet=fleet,
            holds=lambda: self.holds, records=self.records,
        )  # fmt: skip

    def _tell_fleet(self, target: AdapterVersion, passed: bool, reason: str | None = None) -> None:
        if self.source is not None and self.source.fleet is not None:
            self.source.fleet.judged(target, passed, reason, canary=self.config.canary.enabled)

    def start(self) -> None:
        if self.source is not None:
            self.source.start()

    def close(self) -> None:
        if self.source is not None:
            self.source.close()

    def is_alive(self) -> bool:
        return self.source is None or self.source.is_alive()

    def reconfigure(self, config: Config) -> None:
        """SIGHUP: a new `[adapters]` (or state dir) gets a new source thread; what is known stays."""
        old, self.config = self.config, config
        self.facts.copies = config.adapter_copies

        def parts(c: Config) -> tuple[object, ...]:
            return (c.adapters, c.adapter_copies, c.adapter_endpoint, c.rollout, c.state.dir)

        if parts(old) != parts(config):
            before = self.source
            if before is not None:  # not waited for: a hung store must not hold the loop up
                before.close(timeout=0)
            if before is not None:  # its copies are the new one's to hold, or to let go
                before.content.hold(before.holder, ())
            if before is not None and before.fleet is not None:  # the new one writes what is left
                before.fleet.records.detach()
            self.source = self._source(config)
            self.start()

    # -- what the source found --------------------------------------------------------------

    def found(self, message: Found) -> None:
        facts = self.facts
        if isinstance(message, AdaptersListed):
            facts.listed = message.names
            return
        if isinstance(message, AdapterRecalled):  # engines holding it go back from it (`plan`)
            facts.rejected.remember(message.fingerprint, message.reason)
            if (state := facts.known.get(message.adapter)) is not None:
                state.recalled(message.fingerprint)
            self.log.error(
                "adapter.recalled", adapter=message.adapter, version=message.version,
                fingerprint=message.fingerprint, reason=message.reason,
            )  # fmt: skip
            return
        state = facts.known.setdefault(message.adapter, Adapter())
        verdict, copy = message.verdict, message.copy
        if copy is None:
            self._reject(message.adapter, message.version, verdict.check, verdict.reason)
            return
        facts.versions[copy.path] = copy
        if copy.fingerprint in facts.rejected:  # said when it was: at each restart, not again
            reason = facts.rejected.reasons[copy.fingerprint]
            self._reject(message.adapter, message.version, "canary", f"rejected before: {reason}", again=True)
            return
        if state.newest is not None and message.order <= state.newest.order:
            return  # never backwards by itself
        state.newest = message
        self.log.info(
            "adapter.verified", adapter=message.adapter, version=message.version,
            fingerprint=copy.fingerprint, rank=verdict.rank, modules=verdict.modules, bytes=copy.size,
        )  # fmt: skip

    def _reject(self, name: str, version: str, check: str, reason: str, *, again: bool = False) -> None:
        state = self.facts.known.setdefault(name, Adapter())
        said = version in state.rejected
        state.rejected = dict(list({**state.rejected, version: reason}.items())[-20:])
        if again:  # a content rejected before (the record store says so): warned then, not at restarts
            self.log.info("adapter.rejected", adapter=name, version=version, check=check, reason=reason)
            return
        if not said:
            self.metrics.adapter_rejected.labels(adapter=name, check=check or "unknown").inc()
        self.log.warning("adapter.rejected", adapter=name, version=version, check=check, reason=reason)

    # -- the loop's turn ---------------------------------------------------------------------

    @property
    def managed(self) -> bool:
        return self.source is not None or bool(self.facts.known)

    def prepare(self, engines: list[Engine]) -> None:
        """Before the schedulers ask: what the gate compares with, engines dropped or back from
        a restart (they hold none of what we loaded: asked again), what the engines hold."""
        facts = self.facts
        if not engines or not self.managed:
            return
        self.canary_url, first = engines[0].url, engines[0].served
        self.gate_against = self.gate.of(
            first.baseline, first.startup, self.config.adapters.max_rank, first.lora
        )
        urls = {e.url for e in engines}
        facts.held = {url: held for url, held in facts.held.items() if url in urls}  # a SIGHUP let go
        for engine in engines:
            if not (engine.served.reconciled and engine.served.up):
                if facts.held.get(engine.url) is not None:
                    facts.backoff.forget(partial(_on_engine, engine.url))
                facts.held[engine.url] = None
        self.holds = facts.holds()

    def plan(self, engine: Engine, slot: Slot) -> Work | None:
        """The adapter work an idle engine does next: learn what it holds, canary it again on
        new base weights, load what it should hold, unload what it must not."""
        facts, client, canary = self.facts, engine.client, engine.url == self.canary_url
        if not self.managed or not engine.served.reconciled:
            return None
        held = facts.held.get(engine.url)
        if held is None:  # unknown: no copy may go until it is known
            return Work("adapter list", Ask(client, _adapters), partial(self.answers.held, engine.url))
        base = engine.served.serving.fingerprint if engine.served.serving else None
        if (owed := facts.owed(engine.url, base)) is not None:  # canaried again before anything
            if facts.backoff.waiting((engine.url, RECHECK)):
                return None
            drains = owed == "unknown" and slot.drains  # `changed`: out of rotation already
            if drains and slot.room <= 0:
                return None
            names = tuple(sorted(held))
            check = partial(swapping.recheck, names=names, config=self.config.canary)
            then = partial(self.answers.rechecked, engine, base, names, canary)
            return Work(
                "adapter recheck", Ask(client, check), then, drains=drains, holds=tuple(held.values())
            )
        if not held:
            facts.passed(engine.url, base)  # nothing held: nothing owed when adapters load
        if slot.drains and slot.room <= 0:
            return None  # a drained swap takes the engine out of rotation: as a reload, it waits
        return self._swap(engine, held, base, slot, canary=canary) or self._unload(engine, held, base, canary)

    def _swap(
        self, engine: Engine, held: dict[str, str], base: str | None, slot: Slot, *, canary: bool
    ) -> Work | None:
        facts = self.facts
        removed = self.config.adapters.unload_removed and facts.listed is not None
        refused = facts.refused(base)
        for name, state in sorted(facts.known.items()):
            want = state.want(canary, refused)
            if (
                want is None
                or (removed and name not in (facts.listed or ()))
                or held.get(name) == want.path
                or facts.backoff.waiting((engine.url, want.fingerprint))
            ):
                continue
            good = state.good if canary else facts.versions.get(held.get(name, ""))
            fallback = good if good and good.fingerprint not in refused else None
            self.log.info(
                "adapter.loading", engine=engine.url, adapter=name, version=want.version,
                from_version=self._version_of(held.get(name)),
            )  # fmt: skip
            others = tuple(sorted(n for n in held if n != name))
            call = partial(
                swapping.swap, target=want, fallback=fallback, others=others, config=self.config.canary,
                probe=self._prober() if engine.probes(self.config) else None,
            )  # fmt: skip
            stopped = partial(swapping.Swapped, want, error="the daemon is stopping: not loaded")
            return Work(
                "adapter swap", Ask(engine.client, call), partial(self.answers.swapped, engine, canary),
                drains=slot.drains, holds=(want.path, fallback.path if fallback else None), stopped=stopped,
            )  # fmt: skip
        return None

    def _prober(self) -> Callable[[EngineClient, str], probe.Finding]:
        """The forward pass with the new version active, before it is loaded for clients."""
        config = self.config.canary
        timeout = self.config.engine.reload_timeout + config.probe_timeout  # it loads the copy too

        def run(client: EngineClient, path: str) -> probe.Finding:
            tokens = probe.tokens_of(client, config.prompts)
            return probe.run_adapter(client, path, tokens, timeout)

        return run

    def _unload(self, engine: Engine, held: dict[str, str], base: str | None, canary: bool) -> Work | None:
        facts = self.facts
        refused = facts.refused(base)
        removed = self.config.adapters.unload_removed and facts.listed is not None
        refused_held = [
            name
            for name, path in sorted(held.items())  # refused since it loaded, nothing to go back to
            if (v := facts.versions.get(path)) and v.fingerprint in refused
            and (known := facts.known.get(name)) is not None and known.want(canary, refused) is None
        ]  # fmt: skip
        gone = sorted((set(held) & set(facts.known)) - (facts.listed or frozenset())) if removed else []
        for name, cause in [*((n, "rejected") for n in refused_held), *((n, "removed") for n in gone)]:
            then = partial(self.answers.unloaded, engine, name, cause)
            return Work("adapter unload", Ask(engine.client, partial(swapping.unload, name=name)), then)
        return None

    def standing(self, engine: Engine) -> dict[str, str]:
        """Why what the engine holds keeps it out of rotation: not known yet, or an adapter
        rejected, unfit for its base weights, or failed its canary there."""
        if not self.managed:
            return {}
        held = self.facts.held.get(engine.url)
        if held is None:
            return {"adapters": "what adapters it holds is not known yet"}
        base = engine.served.serving.fingerprint if engine.served.serving else None
        if held and self.facts.owed(engine.url, base) == "changed":
            return {"adapters": "what it holds is not canaried on its new base weights yet"}
        for name, path in sorted(held.items()):
            if why := self.facts.why_refused(engine.url, path, base):
                return {"adapters": f"holds {name} {self._version_of(path) or Path(path).name}: {why}"}
        return {}

    def owes(self, engine: Engine) -> bool:
        """Out of rotation for a canary of ours it owes (its base changed): it counts against
        the host's budget, as the reload that changed its base did."""
        if not self.managed:
            return False
        base = engine.served.serving.fingerprint if engine.served.serving else None
        return self.facts.owed(engine.url, base) == "changed"

    # -- state -----------------------------------------------------------------------------

    def _version_of(self, path: str | None) -> str | None:
        found = self.facts.versions.get(path or "")
        return found.version if found else None

    def snapshot(self, engines: list[Engine]) -> dict[str, Any]:
        """For `status`: per adapter, the newest passed, the last good, what each engine holds,
        and (a follower's) the version waiting for the canary hosts."""
        held, known = self.facts.held, self.facts.known
        waiting = self.source.waiting if self.source is not None else {}
        return {
            name: {
                "newest": state.newest.version if (state := known.get(name)) and state.newest else None,
                "last_good": state.good.version if state and state.good else None,
                "engines": {e.url: self._version_of((held.get(e.url) or {}).get(name)) for e in engines},
                "last_reload": state.last_reload if state else None,
                "rejected": dict(state.rejected) if state else {},
                "waiting": dict(waiting.get(name, {})),
            }
            for name in sorted({*known, *waiting})
        }


def _adapters(client: EngineClient) -> dict[str, str]:
    return client.adapters()


def _on_engine(url: str, key: tuple[str, str]) -> bool:
    return key[0] == url
