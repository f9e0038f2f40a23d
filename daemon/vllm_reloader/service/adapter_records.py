"""What the adapter loop keeps between its turns: each adapter's versions, the contents a
canary proved broken (kept across restarts), the waits after failures that blame nothing,
and what the gate compares an adapter with."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..checkpoint import adapter as adapter_gate
from ..checkpoint.adapter import AdapterVersion
from ..checkpoint.layout import Layout
from ..engine.serverinfo import Lora
from ..records import RecordStore
from ..retry import Backoff, Policy
from ..sources.adapters import AdapterGated
from ..sources.content import all_of

KIND = "adapter_rejected"
MAX_REJECTED = 1000
DTYPES = ("F16", "BF16", "F32")
DEFAULT_RANK = 16
"""vLLM's `--max-lora-rank` when not given."""
RETRY = Policy(5.0, 600.0)
"""The first and the longest wait after a failure that blames nothing, in seconds."""


@dataclass
class Adapter:
    newest: AdapterGated | None = None
    """The newest version the gate passed (its `copy` is what loads)."""
    good: AdapterVersion | None = None
    """The last version that passed its canary on the canary engine: what a failure goes back to."""
    before: AdapterVersion | None = None
    """The good one before it: what a fleet's recall of the last good one goes back to."""
    last_reload: dict[str, Any] | None = None
    rejected: dict[str, str] = field(default_factory=dict)
    """Version → why (the last few, for `status`)."""

    def want(self, canary: bool, refused: set[str]) -> AdapterVersion | None:
        """What an engine should hold: the canary engine the newest version (or the last good
        one, when the newest is refused); the others only the last good one."""
        newest = self.newest.copy if self.newest else None
        if canary and newest is not None and newest.fingerprint not in refused:
            return newest
        return self.good if self.good and self.good.fingerprint not in refused else None

    def passed(self, version: AdapterVersion) -> None:
        """Its canary passed on the canary engine: the last good one, the one before kept."""
        if self.good is not None and self.good.fingerprint != version.fingerprint:
            self.before = self.good
        self.good = version

    def confirmed(self, version: AdapterVersion) -> bool:
        """The canary engine holds `version` and it passed a canary again (after a restart, a
        base reload): the last good one when none is known, or when it is the newest (its
        swap's answer was lost). Whether it became so."""
        newest = self.newest.copy if self.newest else None
        if self.good is None or (version == newest and version != self.good):
            self.passed(version)
            return True
        return False

    def recalled(self, fingerprint: str) -> None:
        """A canary host failed this content: the good one before it is the last good one again
        (the one move backwards the daemon makes by itself, as for checkpoints)."""
        if self.good is not None and self.good.fingerprint == fingerprint:
            self.good, self.before = self.before, None
        elif self.before is not None and self.before.fingerprint == fingerprint:
            self.before = None


class Rejections:
    """Contents a canary's answers proved broken, by fingerprint, in the record store (kind
    `adapter_rejected`): a restart never loads one again. A failure that blames nothing is
    never written here."""

    def __init__(self, records: RecordStore) -> None:
        self.records = records
        found = records.all(KIND)
        self.reasons = {str(k): str(v) for k, v in found.items()}

    def __contains__(self, fingerprint: object) -> bool:
        return fingerprint in self.reasons

    def remember(self, fingerprint: str, reason: str) -> None:
        self.reasons = dict(list({**self.reasons, fingerprint: reason}.items())[-MAX_REJECTED:])
        self.records.replace(KIND, self.reasons)  # whole: one the disk failed is written again


class GateView:
    """What an adapter is judged against, made again only when it changes (the source thread
    compares it by identity: a new one judges every version again). A baseline read again
    with the same tensors is no change."""

    def __init__(self) -> None:
        self._for: tuple[object, ...] | None = None
        self.served: adapter_gate.Served | None = None

    def of(
        self, baseline: Layout | None, model: str | None, configured: int | None, lora: Lora | None
    ) -> adapter_gate.Served | None:
        """`configured`: `[adapters] max_rank`; `lora`: what the engine says of its LoRA."""
        if baseline is None:
            return None
        said = lora is not None and lora.max_rank > 0
        engine_rank = lora.max_rank if lora is not None and said else None
        max_rank = min(
            r for r in (configured, engine_rank, None if configured or said else DEFAULT_RANK) if r
        )
        key = (baseline, model, max_rank, lora.dtype if lora else None)
        old = self._for  # the same values read again (a reconcile) are no change: nothing judged again
        if old is None or old[1:] != key[1:] or (old[0] is not baseline and old[0] != baseline):
            dtypes = {dtype for dtype, _ in baseline.tensors.values() if dtype in DTYPES}
            narrowest = min(dtypes, key=DTYPES.index) if dtypes else "F16"  # the narrowest range seen
            dtype = lora.dtype if lora is not None and lora.dtype else narrowest
            weights = {name: shape for name, (_, shape) in baseline.tensors.items()}
            self.served = adapter_gate.Served(weights, dtype, max_rank, model)
        self._for = key
        return self.served


FAILED_KIND = "adapter_failed_here"
CHECKED_KIND = "adapters_checked"


@dataclass
class Holdings:
    """What the adapter loop knows between its turns, shared by its planner (`adapters`) and
    what it makes of the engines' answers (`adapter_answers`); the loop's alone."""

    rejected: Rejections
    records: RecordStore
    backoff: Backoff[tuple[str, str]] = field(default_factory=lambda: Backoff(RETRY))
    """(engine URL, content or `RECHECK`) → the wait after a failure that blamed nothing."""
    known: dict[str, Adapter] = field(default_factory=dict)
    listed: frozenset[str] | None = None
    held: dict[str, dict[str, str] | None] = field(default_factory=dict)
    """Engine URL → adapter → the copy it was loaded from (None: ask the engine)."""
    checked: dict[str, tuple[str | None, frozenset[str]]] = field(default_factory=dict)
    """Engine URL → the base weights (fingerprint) its adapters were last canaried with, and
    the copies it held then. In the record store: a restarted daemon knows what passed."""
    versions: dict[str, AdapterVersion] = field(default_factory=dict)
    """Copy path → the version it holds (what an engine reports is mapped back by it)."""
    unfit: set[tuple[str, str | None]] = field(default_factory=set)
    """(adapter fingerprint, base fingerprint) whose canary failed on that base."""
    copies: Path | None = None
    """Where the copies are (`content_of` reads a copy's content from its name)."""
    failed_here: dict[str, str] = field(default_factory=dict)
    """`url fingerprint` → why: a content whose canary failed on that engine, which may still
    hold it (its way back failed): out of rotation while it does. In the record store."""

    def __post_init__(self) -> None:
        self.failed_here = {str(k): str(v) for k, v in self.records.all(FAILED_KIND).items()}
        for url, found in self.records.all(CHECKED_KIND).items():
            if isinstance(found, dict) and isinstance(held := found.get("held"), list):
                self.checked[str(url)] = (found.get("base"), frozenset(map(str, held)))

    def passed(self, url: str, base: str | None) -> None:
        """What the engine holds passed its canary on these base weights (the canary of a swap
        asks every adapter the engine holds, and the base model)."""
        held = self.held.get(url)
        if held is not None and self.checked.get(url) != (entry := (base, frozenset(held.values()))):
            self.checked[url] = entry
            checked = {u: {"base": b, "held": sorted(p)} for u, (b, p) in self.checked.items()}
            self.records.replace(CHECKED_KIND, checked)

    def owed(self, url: str, base: str | None) -> Literal["changed", "unknown"] | None:
        """Whether what the engine holds must be canaried again: `changed`, its base weights
        changed since (it must not take traffic before); `unknown`, whether it passed is not
        known (a daemon restarted after an upgrade, adapters loaded by another hand)."""
        held = self.held.get(url)
        if not held:
            return None
        checked = self.checked.get(url)
        if checked is not None and checked[0] == base and set(held.values()) <= checked[1]:
            return None
        return "changed" if checked is not None and checked[0] != base else "unknown"

    def failed(self, url: str, fingerprint: str, reason: str) -> None:
        self.failed_here[f"{url} {fingerprint}"] = reason
        self.records.replace(FAILED_KIND, self.failed_here)

    def refused(self, base: str | None) -> set[str]:
        """Contents no engine loads on base weights `base`."""
        return set(self.rejected.reasons) | {fp for fp, on in self.unfit if on == base}

    def content_of(self, path: str) -> str | None:
        """Which content a copy an engine holds is: its fingerprint, or, for a copy of ours not
        judged again yet (after a restart), the digest its name ends in (a prefix of it)."""
        if (version := self.versions.get(path)) is not None:
            return version.fingerprint
        copy = Path(path)
        if self.copies is not None and copy.parent.parent == self.copies and "@" in copy.name:
            return copy.name.rpartition("@")[2] or None
        return None

    def why_refused(self, url: str, path: str, base: str | None) -> str | None:
        """Why an engine holding the copy at `path` must not take traffic (None: nothing)."""
        content = self.content_of(path)
        if content is None:
            return None
        if content in self.rejected:  # known: one look (a prefix read off a name: each compared)
            return f"rejected: {self.rejected.reasons[content]}"
        if path not in self.versions:
            for fingerprint, reason in self.rejected.reasons.items():
                if fingerprint.startswith(content):
                    return f"rejected: {reason}"
        if any(fingerprint.startswith(content) for fingerprint, on in self.unfit if on == base):
            return "its canary failed on these base weights"
        mine = f"{url} {content}"
        return next((why for key, why in self.failed_here.items() if key.startswith(mine)), None)

    def tidy(self) -> None:
        """Forget failures here of what the engine no longer holds (known to hold)."""

        def holds(key: str) -> bool:
            url, fingerprint = key.split(" ", 1)
            paths = self.held.get(url, {})
            contents = [self.content_of(p) for p in (paths or {}).values()]
            return paths is None or any(c and fingerprint.startswith(c) for c in contents)

        kept = {key: why for key, why in self.failed_here.items() if holds(key)}
        if kept != self.failed_here:
            self.failed_here = kept
            self.records.replace(FAILED_KIND, kept)

    def holds(self) -> frozenset[tuple[str, str]]:
        """What the engines hold as (adapter, fingerprint), for the fleet's recalls."""
        holdings = [(name, path) for paths in self.held.values() for name, path in (paths or {}).items()]
        return frozenset((n, v.fingerprint) for n, p in holdings if (v := self.versions.get(p)))

    def leases(self) -> dict[str, set[str]]:
        """The copies held, by holder: each engine's, and each adapter's versions (newest, last
        good, the one before); an engine whose holdings are not known holds every copy."""
        found: dict[str, set[str]] = {"adapters": set()}
        if not self.held:  # no engine asked yet
            found["engines:adapters"] = {all_of("adapter")}
        for url, paths in self.held.items():
            found[f"engine:{url}:adapters"] = {all_of("adapter")} if paths is None else set(paths.values())
        for state in self.known.values():
            newest = state.newest.copy if state.newest else None
            found["adapters"] |= {v.path for v in (state.good, state.before, newest) if v}
        return found
