"""LoRA adapters on the loop: the one object that knows what each adapter has passed and
what each engine holds.

Per adapter: the newest version the gate passed, and its last good version (one that passed
its canary on the canary engine, the first). A content whose canary answers were broken is
rejected by fingerprint, across restarts (`adapter_records.Rejections`); a failure that
blames nothing — a timeout, the engine's refusal, an engine not clean before the load — is
tried again after a backoff. Per engine: which adapter it holds from which copy, asked of
the engine (`/v1/models`) at start, after it restarted, and whenever a call left it unknown.

Each engine does one adapter call at a time on its own thread, never beside a base reload
(an adapter job is an `Ask`; a reload starts only on an idle engine). The canary engine
loads a new version first; the others then load the version that passed there. No version
that orders before the newest is loaded by itself. Whatever an engine holds is canaried
again whenever its base weights are not the ones its adapters were last canaried with — a
base reload, and the daemon's own start (it cannot know what was canaried before) — and an
adapter whose answers are broken there is unloaded (it was trained on other weights).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from ..checkpoint.adapter import AdapterVersion, Served
from ..config import Config
from ..engine import adapters as swapping
from ..engine.client import EngineClient
from ..retry import Backoff
from ..sources.adapter_fleet import AdapterFleet, AdapterRecalled
from ..sources.adapter_trees import StoreTree
from ..sources.adapters import AdaptersListed, AdapterSource, Found
from . import paths
from .adapter_calls import drained
from .adapter_records import RETRY, Adapter, GateView, Rejections, in_use
from .engine import Engine
from .metrics import Metrics
from .readiness import Drain

RECHECK = "recheck"
"""The backoff's key for an engine's adapters canaried again (after a base change, a start)."""


class Adapters:
    def __init__(self, config: Config, log: Any, metrics: Metrics, post: Callable[[Found], None]) -> None:
        """`post`: the loop's inbox, where the source thread sends what it found."""
        self.config, self.log, self.metrics, self.post = config, log, metrics, post
        self.known: dict[str, Adapter] = {}
        self.listed: frozenset[str] | None = None
        self.held: dict[str, dict[str, str] | None] = {}
        """Engine URL → adapter → the copy it was loaded from (None: ask the engine)."""
        self.checked: dict[str, str | None] = {}
        """Engine URL → the base weights (fingerprint) its adapters were last canaried with."""
        self.versions: dict[str, AdapterVersion] = {}
        """Copy path → the version it holds (what an engine reports is mapped back by it)."""
        self.unfit: set[tuple[str, str | None]] = set()
        """(adapter fingerprint, base fingerprint) whose canary failed on that base."""
        self.rejected = Rejections(config.state.dir, log)
        self.backoff: Backoff[tuple[str, str]] = Backoff(RETRY)
        """(engine URL, content or `RECHECK`) → the wait after a failure that blamed nothing."""
        self.gate = GateView()
        self.keep: frozenset[str] | None = None
        """Copies in use, None until every engine said what it holds (read by the source thread)."""
        self.gate_against: Served | None = None
        """What the canary engine serves, for the source thread's gate (replaced, never changed)."""
        self.forgotten: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        """Versions whose copy proved changed: the source judges them again."""
        self.asks: dict[str, object] = {}
        """Engine URL → the last question of ours put to its thread (`under_way`)."""
        self.swaps: dict[str, object] = {}
        """Engine URL → its last drained swap (out of rotation while it runs)."""
        self.holds: frozenset[tuple[str, str]] = frozenset()
        """(adapter, fingerprint) the engines hold, for a follower's recalls (read by the source)."""
        self.source = self._source(config)

    def _source(self, config: Config) -> AdapterSource | None:
        if config.adapters.root is None:
            return None
        tree = paths.adapter_tree(config)
        fleet = (
            AdapterFleet(tree.store, config.rollout, self.log, config.state.dir)
            if isinstance(tree, StoreTree)
            else None
        )
        return AdapterSource(
            tree, config.adapter_copies, config.adapters.look_interval,
            served=lambda: self.gate_against, keep=lambda: self.keep,
            post=self.post, forgotten=self.forgotten, fleet=fleet, holds=lambda: self.holds,
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
        if old.state.dir != config.state.dir:
            self.rejected = self.rejected.moved_to(config.state.dir)

        def parts(c: Config) -> tuple[object, ...]:
            return (c.adapters, c.adapter_copies, c.adapter_endpoint, c.rollout, c.state.dir)

        if parts(old) != parts(config):
            before = self.source
            if before is not None:  # not waited for: a hung store must not hold the loop up
                before.close(timeout=0)
            self.source = self._source(config)
            if before and before.fleet and self.source and self.source.fleet:  # no verdict is lost
                self.source.fleet.records.adopt(before.fleet.records.detach())
            self.start()

    # -- what the source found --------------------------------------------------------------

    def found(self, message: Found) -> None:
        if isinstance(message, AdaptersListed):
            self.listed = message.names
            return
        if isinstance(message, AdapterRecalled):  # engines holding it go back from it (`_next`)
            self.rejected.remember(message.fingerprint, message.reason)
            if (state := self.known.get(message.adapter)) is not None:
                state.recalled(message.fingerprint)
            self.log.error(
                "adapter.recalled", adapter=message.adapter, version=message.version,
                fingerprint=message.fingerprint, reason=message.reason,
            )  # fmt: skip
            return
        state = self.known.setdefault(message.adapter, Adapter())
        verdict, copy = message.verdict, message.copy
        if copy is None:
            self._reject(message.adapter, message.version, verdict.check, verdict.reason)
            return
        self.versions[copy.path] = copy
        if copy.fingerprint in self.rejected:
            reason = self.rejected.reasons[copy.fingerprint]
            self._reject(message.adapter, message.version, "canary", f"rejected before: {reason}")
            return
        if state.newest is not None and message.order <= state.newest.order:
            return  # never backwards by itself
        state.newest = message
        self.log.info(
            "adapter.verified", adapter=message.adapter, version=message.version,
            fingerprint=copy.fingerprint, rank=verdict.rank, modules=verdict.modules, bytes=copy.size,
        )  # fmt: skip
        self._kept()

    def _reject(self, name: str, version: str, check: str, reason: str) -> None:
        state = self.known.setdefault(name, Adapter())
        state.rejected = dict(list({**state.rejected, version: reason}.items())[-20:])
        self.metrics.adapter_rejected.labels(adapter=name, check=check or "unknown").inc()
        self.log.warning("adapter.rejected", adapter=name, version=version, check=check, reason=reason)

    # -- the loop's turn: start what each idle engine should do next ---------------------------

    def tick(self, engines: list[Engine], drain: Callable[[str], Drain | None] = lambda _: None) -> None:
        """`drain`: how an engine is taken out of rotation for a swap (None: in place)."""
        if not engines or (self.source is None and not self.known):
            return
        first = engines[0].served
        self.gate_against = self.gate.of(
            first.baseline, first.startup, self.config.adapters.max_rank, first.lora
        )
        if dropped := set(self.held) - {e.url for e in engines}:  # a SIGHUP let them go
            self.held = {url: held for url, held in self.held.items() if url not in dropped}
            self._kept()
        for n, engine in enumerate(engines):
            served = engine.served
            if not (served.reconciled and served.up):  # back from a restart, it holds none
                if self.held.get(engine.url) is not None:
                    self.backoff.forget(partial(_on_engine, engine.url))
                self.held[engine.url] = None
                continue
            if not engine.idle:
                continue
            held = self.held.get(engine.url)
            if held is None:  # unknown: no copy may go until it is known
                self.held[engine.url] = None
                self._kept()
                engine.ask(lambda client: client.adapters(), partial(self._held, engine.url))
                continue
            base = served.serving.fingerprint if served.serving else None
            if engine.url not in self.checked or self.checked[engine.url] != base:
                if held and not self.backoff.waiting((engine.url, RECHECK)):
                    names = tuple(sorted(held))
                    check = partial(swapping.recheck, names=names, config=self.config.canary)
                    self._ask(engine, check, partial(self._rechecked, engine, base, names, n == 0))
                if held:
                    continue
                self.checked[engine.url] = base
            out = drain(engine.url)
            if out is not None and self._unavailable(engines) >= self.config.engine.max_unavailable:
                continue  # a drained swap takes the engine out of rotation: as a reload, it waits
            self._next(engine, held, base, out, canary=n == 0)

    def _next(
        self, engine: Engine, held: dict[str, str], base: str | None, drain: Drain | None, *, canary: bool
    ) -> None:
        removed = self.config.adapters.unload_removed and self.listed is not None
        refused = set(self.rejected.reasons) | {fp for fp, on in self.unfit if on == base}
        for name, state in sorted(self.known.items()):
            want = state.want(canary, refused)
            if (
                want is None
                or (removed and name not in (self.listed or ()))
                or held.get(name) == want.path
                or self.backoff.waiting((engine.url, want.fingerprint))
            ):
                continue
            good = state.good if canary else self.versions.get(held.get(name, ""))
            fallback = good if good and good.fingerprint not in refused else None
            self.log.info(
                "adapter.loading", engine=engine.url, adapter=name, version=want.version,
                from_version=self._version_of(held.get(name)),
            )  # fmt: skip
            others = tuple(sorted(n for n in held if n != name))
            call = partial(
                swapping.swap, target=want, fallback=fallback, others=others, config=self.config.canary
            )
            self._ask(
                engine, drained(call, want, engine, drain), partial(self._swapped, engine, canary, base)
            )
            if drain is not None:
                self.swaps[engine.url] = engine.asking
            return
        refused_held = [
            name
            for name, path in sorted(held.items())  # refused since it loaded, nothing to go back to
            if (v := self.versions.get(path)) and v.fingerprint in refused
            and (known := self.known.get(name)) is not None and known.want(canary, refused) is None
        ]  # fmt: skip
        gone = sorted((set(held) & set(self.known)) - (self.listed or frozenset())) if removed else []
        for name, cause in [*((n, "rejected") for n in refused_held), *((n, "removed") for n in gone)]:
            self._ask(
                engine, partial(swapping.unload, name=name), partial(self._unloaded, engine, name, cause)
            )
            return

    def _ask(self, engine: Engine, call: Callable[[EngineClient], Any], then: Callable[[Any], None]) -> None:
        engine.ask(call, then)
        self.asks[engine.url] = engine.asking

    def _unavailable(self, engines: list[Engine]) -> int:
        """Engines out of rotation: on a reload, or on a drained swap of ours."""
        return sum(e.in_flight is not None or _on(e, self.swaps) for e in engines)

    def under_way(self, engines: list[Engine]) -> bool:
        """Whether an engine's thread is on a swap, a canary again or an unload of ours: a
        stop waits for it (cut short, a swap would leave an adapter loaded and not canaried)."""
        return any(_on(e, self.asks) for e in engines)

    # -- what an engine's thread answered ----------------------------------------------------

    def _held(self, url: str, found: Mapping[str, str]) -> None:
        self.held[url] = dict(found)
        self.checked.pop(url, None)  # what it holds is canaried before anything else
        self._kept()

    def _swapped(self, engine: Engine, canary: bool, base: str | None, result: swapping.Swapped) -> None:
        target, held = result.target, self.held.get(engine.url)
        state = self.known.setdefault(target.adapter, Adapter())
        fields = {"adapter": target.adapter, "version": target.version, "fingerprint": target.fingerprint}
        if result.uncertain or held is None:
            self.held[engine.url] = held = None  # asked again before anything else is done there
        if result.changed is not None:
            engine.log.error("adapter.changed", **fields, reason=result.changed)
            self.forgotten.put((target.adapter, target.version))
            state.newest = None if state.newest and state.newest.copy == target else state.newest
            state.good = None if state.good == target else state.good
        elif result.canary_failed is not None:
            self._failed(engine, canary, result, fields, held)
        elif result.error is not None:
            self._count(target.adapter, "failed", engine.url)
            wait = self.backoff.failed((engine.url, target.fingerprint))
            engine.log.warning("adapter.load_failed", **fields, reason=result.error, retry_in_s=wait)
        else:
            if held is not None:
                held[target.adapter] = target.path
            if canary and target.fingerprint not in self.rejected:  # not recalled while it loaded
                state.passed(target)
                self._tell_fleet(target, passed=True)
            state.last_reload = {"version": target.version, "engine": engine.url, "at": time.time()}
            self._count(target.adapter, "success", engine.url)
            took = round(result.seconds * 1000, 1)
            engine.log.info("adapter.loaded", **fields, load_ms=result.load_ms, duration_ms=took)
        self._kept()

    def _failed(
        self,
        engine: Engine,
        canary: bool,
        result: swapping.Swapped,
        fields: dict[str, str],
        held: dict[str, str] | None,
    ) -> None:
        target = result.target
        self._count(target.adapter, "canary_failed", engine.url)
        back = self.versions.get(held.get(target.adapter, "")) if held else None
        if held is not None:
            if result.rolled_back and back is not None:
                held[target.adapter] = back.path
            else:
                held.pop(target.adapter, None)
        if canary and result.blamed:
            self.rejected.remember(target.fingerprint, f"its canary failed: {result.canary_failed}")
            self._tell_fleet(target, passed=False, reason=f"its canary failed: {result.canary_failed}")
            state = self.known[target.adapter]
            state.rejected = {**state.rejected, target.version: f"canary: {result.canary_failed}"}
        else:  # a follower's failure, or no answer: tried again later, blaming nothing
            self.backoff.failed((engine.url, target.fingerprint))
        engine.log.error(
            "adapter.rolled_back", **fields, cause="canary",
            reason=result.canary_failed, blamed=result.blamed,
            to_version=back.version if result.rolled_back and back else None,
            unloaded=result.unloaded, flush_probes=result.flush_probes, error=result.error,
        )  # fmt: skip

    def _rechecked(
        self,
        engine: Engine,
        base: str | None,
        names: tuple[str, ...],
        canary: bool,
        found: dict[str, str | None],
    ) -> None:
        held = self.held.get(engine.url)
        if held is None:
            return
        for name, reason in found.items():
            path = held.get(name, "")
            version = self.versions.get(path)
            if reason is None:
                state = self.known.get(name)
                fit = version is not None and version.fingerprint not in self.rejected
                if canary and state is not None and version is not None and fit and state.confirmed(version):
                    self._tell_fleet(version, passed=True)  # held before a restart, or an answer lost
                continue
            held.pop(name, None)
            if version is not None:
                self.unfit.add((version.fingerprint, base))
            engine.log.error("adapter.unloaded", adapter=name, cause="base_changed", reason=reason)
        if set(found) != set(names):  # not all judged (no answer, or an unload failed): ask again
            self.held[engine.url] = None
            wait = self.backoff.failed((engine.url, RECHECK))  # a slow engine is not asked in a loop
            engine.log.warning("adapter.recheck_failed", adapters=list(names), retry_in_s=wait)
        else:
            self.checked[engine.url] = base
        self._kept()

    def _unloaded(self, engine: Engine, name: str, cause: str, error: str | None) -> None:
        held = self.held.get(engine.url)
        if error is not None:
            self.held[engine.url] = None
            engine.log.warning("adapter.unload_failed", adapter=name, reason=error)
            return
        if held is not None:
            held.pop(name, None)
        engine.log.info("adapter.unloaded", adapter=name, cause=cause)
        self._kept()

    # -- state -----------------------------------------------------------------------------

    def _count(self, adapter: str, result: str, engine: str) -> None:
        self.metrics.adapter_loads.labels(adapter=adapter, result=result, engine=engine).inc()

    def _version_of(self, path: str | None) -> str | None:
        found = self.versions.get(path or "")
        return found.version if found else None

    def _kept(self) -> None:
        self.keep, self.holds = in_use(self.held, self.known, self.versions)

    def snapshot(self, engines: list[Engine]) -> dict[str, Any]:
        """For `status`: per adapter, the newest passed, the last good, what each engine holds."""
        return {
            name: {
                "newest": state.newest.version if state.newest else None,
                "last_good": state.good.version if state.good else None,
                "engines": {e.url: self._version_of((self.held.get(e.url) or {}).get(name)) for e in engines},
                "last_reload": state.last_reload,
                "rejected": dict(state.rejected),
            }
            for name, state in sorted(self.known.items())
        }


def _on(engine: Engine, asked: Mapping[str, object]) -> bool:
    """Whether the engine's thread is on the question `asked` recorded for it."""
    return engine.asking is not None and engine.asking is asked.get(engine.url)


def _on_engine(url: str, key: tuple[str, str]) -> bool:
    return key[0] == url
