"""LoRA adapters on the loop: the one object that knows what each adapter has passed and
what each engine holds.

Per adapter: the newest version the gate passed, and its last good version (one that passed
its canary on the canary engine, the first). Rejected contents (by fingerprint): a canary's
or the engine's refusal is kept in `<state.dir>/adapters.json`, so a restart never loads a
bad version again; the gate's is found again by the gate. Per engine: which adapter it holds
from which copy, asked of the engine (`/v1/models`) at start and whenever a call left it
unknown.

Each engine loads one adapter at a time on its own thread, never beside a base reload (an
adapter job is an `Ask`; a reload starts only on an idle engine). The canary engine loads a
new version first; the others then load the version that passed there. No version older
than the one served is loaded by itself. When an engine's base weights change, every
adapter it holds is canaried again there, and one that fails is unloaded and rejected (it
was trained on other weights).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..checkpoint import adapter as adapter_gate
from ..checkpoint.adapter import AdapterVersion
from ..config import Config
from ..durable import replace_atomically
from ..engine import adapters as swapping
from ..sources.adapters import AdapterGated, AdaptersListed, AdapterSource
from .engine import Engine
from .metrics import Metrics

STATE_NAME = "adapters.json"
MAX_REJECTED = 1000
DTYPES = ("F16", "BF16", "F32")
Found = AdapterGated | AdaptersListed


@dataclass
class Adapter:
    newest: AdapterGated | None = None
    """The newest version the gate passed (its `copy` is what loads)."""
    good: AdapterVersion | None = None
    last_reload: dict[str, Any] | None = None
    rejected: dict[str, str] = field(default_factory=dict)
    """Version → why (the last few, for `status`)."""


class Adapters:
    def __init__(self, config: Config, log: Any, metrics: Metrics, post: Callable[[Found], None]) -> None:
        """`post`: the loop's inbox, where the source thread sends what it found."""
        self.config, self.log, self.metrics, self.post = config, log, metrics, post
        self.known: dict[str, Adapter] = {}
        self.listed: frozenset[str] | None = None
        self.held: dict[str, dict[str, str] | None] = {}
        """Engine URL → adapter → the copy it was loaded from (None: ask the engine)."""
        self.base: dict[str, str | None] = {}
        """Engine URL → the base weights its adapters were last canaried with."""
        self.versions: dict[str, AdapterVersion] = {}
        """Copy path → the version it holds (what an engine reports is mapped back by it)."""
        self.refused: set[tuple[str, str]] = set()
        """(engine URL, fingerprint) a follower failed: not tried there again."""
        self.rejected = self._load()
        self.keep: frozenset[str] = frozenset()
        """Copies in use (read by the source thread: replaced, never changed)."""
        self.gate_against: adapter_gate.Served | None = None
        """What the canary engine serves, for the source thread's gate (replaced, never changed)."""
        self.source = self._source(config)

    def _source(self, config: Config) -> AdapterSource | None:
        if config.adapters.root is None:
            return None
        return AdapterSource(
            config.adapters.root, config.adapter_copies, config.adapters.interval,
            served=lambda: self.gate_against, keep=lambda: self.keep, post=self.post,
        )  # fmt: skip

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
        if (old.adapters, old.adapter_copies) != (config.adapters, config.adapter_copies):
            self.close()
            self.source = self._source(config)
            self.start()

    # -- what the source found --------------------------------------------------------------

    def found(self, message: Found) -> None:
        if isinstance(message, AdaptersListed):
            self.listed = message.names
            return
        state = self.known.setdefault(message.adapter, Adapter())
        verdict, copy = message.verdict, message.copy
        if copy is None:
            self._reject(message.adapter, message.version, verdict.check, verdict.reason)
            return
        self.versions[copy.path] = copy
        if copy.fingerprint in self.rejected:
            reason = self.rejected[copy.fingerprint]
            self._reject(message.adapter, message.version, "canary", f"rejected before: {reason}")
            return
        if any(copy.path in (held or {}).values() for held in self.held.values()) and state.good is None:
            state.good = copy  # what the canary engine held before a restart
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

    def tick(self, engines: list[Engine]) -> None:
        if self.source is None or not engines:
            return
        self.gate_against = self.served(engines[0])
        for n, engine in enumerate(engines):
            served = engine.served
            if not (served.reconciled and served.up):  # back from a restart, it holds none
                self.held[engine.url] = None
                continue
            if not engine.idle:
                continue
            held = self.held.get(engine.url)
            if held is None:
                engine.ask(lambda client: client.adapters(), partial(self._held, engine.url))
                continue
            base = served.serving.fingerprint if served.serving else None
            if held and self.base.setdefault(engine.url, base) != base:
                names = tuple(sorted(held))
                check = partial(swapping.recheck, names=names, config=self.config.canary)
                engine.ask(check, partial(self._rechecked, engine, base, n == 0))
                continue
            self.base[engine.url] = base
            self._next(engine, held, canary=n == 0)

    def _next(self, engine: Engine, held: dict[str, str], *, canary: bool) -> None:
        removed = self.config.adapters.unload_removed and self.listed is not None
        for name, state in sorted(self.known.items()):
            want = (state.newest.copy if state.newest else None) if canary else state.good
            if (
                want is None
                or (removed and name not in (self.listed or ()))
                or held.get(name) == want.path
                or want.fingerprint in self.rejected
                or (engine.url, want.fingerprint) in self.refused
            ):
                continue
            fallback = state.good if canary else self.versions.get(held.get(name, ""))
            others = tuple(sorted(n for n in held if n != name))
            self.log.info(
                "adapter.loading", engine=engine.url, adapter=name, version=want.version,
                from_version=self._version_of(held.get(name)),
            )  # fmt: skip
            call = partial(
                swapping.swap, target=want, fallback=fallback, others=others, config=self.config.canary
            )
            engine.ask(call, partial(self._swapped, engine, canary))
            return
        if removed:
            for name in sorted((set(held) & set(self.known)) - (self.listed or frozenset())):  # ours only
                engine.ask(
                    partial(swapping.unload, name=name), partial(self._unloaded, engine, name, "removed")
                )
                return

    # -- what an engine's thread answered ----------------------------------------------------

    def _held(self, url: str, found: Mapping[str, str]) -> None:
        self.held[url] = dict(found)
        self._kept()

    def _swapped(self, engine: Engine, canary: bool, result: swapping.Swapped) -> None:
        target = result.target
        held = self.held.get(engine.url)
        state = self.known.setdefault(target.adapter, Adapter())
        fields = {"adapter": target.adapter, "version": target.version, "fingerprint": target.fingerprint}
        if result.uncertain or held is None:
            self.held[engine.url] = None  # asked again before anything else is done there
        if result.changed is not None:
            self.log.error("adapter.changed", **fields, reason=result.changed)
            state.newest = None
        elif result.canary_failed is not None:
            self._failed(engine, canary, result, fields)
        elif result.error is not None:
            self.metrics.adapter_loads.labels(
                adapter=target.adapter, result="failed", engine=engine.url
            ).inc()
            engine.log.warning("adapter.load_failed", **fields, reason=result.error)
            if canary and not result.uncertain:  # the engine refuses these bytes: no retry helps
                self._remember(target.fingerprint, f"the engine refused it: {result.error}")
            elif not result.uncertain:
                self.refused.add((engine.url, target.fingerprint))
        else:
            if held is not None and not result.uncertain:
                held[target.adapter] = target.path
            if canary:
                state.good = target
            state.last_reload = {"version": target.version, "engine": engine.url, "at": time.time()}
            self.metrics.adapter_loads.labels(
                adapter=target.adapter, result="success", engine=engine.url
            ).inc()
            engine.log.info(
                "adapter.loaded",
                **fields,
                load_ms=result.load_ms,
                duration_ms=round(result.seconds * 1000, 1),
            )
        self._kept()

    def _failed(self, engine: Engine, canary: bool, result: swapping.Swapped, fields: dict[str, str]) -> None:
        target, held = result.target, self.held.get(engine.url)
        self.metrics.adapter_loads.labels(
            adapter=target.adapter, result="canary_failed", engine=engine.url
        ).inc()
        back = self.versions.get(held.get(target.adapter, "")) if held else None
        if held is not None and not result.uncertain:
            if result.rolled_back and back is not None:
                held[target.adapter] = back.path
            else:
                held.pop(target.adapter, None)
        if canary:
            self._remember(target.fingerprint, f"its canary failed: {result.canary_failed}")
        else:
            self.refused.add((engine.url, target.fingerprint))
        engine.log.error(
            "adapter.rolled_back", **fields, cause="canary", reason=result.canary_failed,
            to_version=back.version if result.rolled_back and back else None,
            unloaded=result.unloaded, flush_probes=result.flush_probes, error=result.error,
        )  # fmt: skip

    def _rechecked(
        self, engine: Engine, base: str | None, canary: bool, found: dict[str, str | None]
    ) -> None:
        held = self.held.get(engine.url)
        if held is None:
            return
        for name, reason in found.items():
            if reason is None:
                continue
            path = held.pop(name, "")
            if canary and (version := self.versions.get(path)) is not None:
                self._remember(version.fingerprint, f"its canary failed on new base weights: {reason}")
            engine.log.error("adapter.unloaded", adapter=name, cause="base_changed", reason=reason)
        if len(found) < len(held):  # the engine stopped answering midway
            self.held[engine.url] = None
        self.base[engine.url] = base
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
        paths = {p for held in self.held.values() for p in (held or {}).values()}
        for state in self.known.values():
            paths |= {v.path for v in (state.good, state.newest.copy if state.newest else None) if v}
        self.keep = frozenset(paths)

    def _remember(self, fingerprint: str, reason: str) -> None:
        self.rejected = dict(list({**self.rejected, fingerprint: reason}.items())[-MAX_REJECTED:])
        try:
            data = json.dumps({"rejected": self.rejected}, indent=1).encode()
            replace_atomically(self.config.state.dir / STATE_NAME, data)
        except OSError as exc:  # said; the rejection holds until a restart
            self.log.error(
                "state.write_failed", path=str(self.config.state.dir / STATE_NAME), reason=str(exc)
            )

    def _load(self) -> dict[str, str]:
        path = self.config.state.dir / STATE_NAME
        try:
            found = json.loads(path.read_bytes()).get("rejected", {})
            return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, AttributeError, RecursionError) as exc:
            self.log.error("state.unreadable", path=str(path), reason=str(exc)[:300])
            return {}

    def served(self, engine: Engine) -> adapter_gate.Served | None:
        """What an adapter is judged against: the canary engine's base layout (None: not known)."""
        baseline = engine.served.baseline
        if baseline is None:
            return None
        dtypes = [dtype for dtype, _ in baseline.tensors.values() if dtype in DTYPES]
        dtype = min(set(dtypes), key=DTYPES.index) if dtypes else "F16"  # the narrowest range seen
        weights = {name: shape for name, (_, shape) in baseline.tensors.items()}
        return adapter_gate.Served(weights, dtype, self.config.adapters.max_rank, engine.served.startup)

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
