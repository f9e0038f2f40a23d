"""What the adapter loop keeps between its turns: each adapter's versions, the contents a
canary proved broken (kept across restarts), the waits after failures that blame nothing,
and what the gate compares an adapter with."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint import adapter as adapter_gate
from ..checkpoint.adapter import AdapterVersion
from ..checkpoint.layout import Layout
from ..durable import replace_atomically
from ..engine.serverinfo import Lora
from ..retry import Policy
from ..sources.adapters import AdapterGated

STATE_NAME = "adapters.json"
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
    """Contents a canary's answers proved broken, by fingerprint, in `<state.dir>/adapters.json`:
    a restart never loads one again. A failure that blames nothing is never written here."""

    def __init__(self, directory: Path, log: Any) -> None:
        self.path, self.log = directory / STATE_NAME, log
        self.reasons = self._load()

    def __contains__(self, fingerprint: object) -> bool:
        return fingerprint in self.reasons

    def remember(self, fingerprint: str, reason: str) -> None:
        self.reasons = dict(list({**self.reasons, fingerprint: reason}.items())[-MAX_REJECTED:])
        self._save()

    def moved_to(self, directory: Path) -> Rejections:
        """A SIGHUP's new state dir: what is rejected goes there too (a restart forgets none)."""
        moved = Rejections(directory, self.log)
        moved.reasons = dict(list({**self.reasons, **moved.reasons}.items())[-MAX_REJECTED:])
        moved._save()
        return moved

    def _save(self) -> None:
        try:
            replace_atomically(self.path, json.dumps({"rejected": self.reasons}, indent=1).encode())
        except OSError as exc:  # said; the rejection holds until a restart
            self.log.error("state.write_failed", path=str(self.path), reason=str(exc))

    def _load(self) -> dict[str, str]:
        try:
            found = json.loads(self.path.read_bytes()).get("rejected", {})
            return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, AttributeError, RecursionError) as exc:
            self.log.error("state.unreadable", path=str(self.path), reason=str(exc)[:300])
            return {}


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


def in_use(
    held: Mapping[str, Mapping[str, str] | None],
    known: Mapping[str, Adapter],
    versions: Mapping[str, AdapterVersion],
) -> tuple[frozenset[str] | None, frozenset[tuple[str, str]]]:
    """The copies no one may remove (None while an engine's holdings are unknown: none is),
    and what the engines hold as (adapter, fingerprint), for the fleet's recalls. `held`:
    engine URL → adapter → copy path."""
    holdings = [(name, path) for paths in held.values() for name, path in (paths or {}).items()]
    holds = frozenset((n, v.fingerprint) for n, p in holdings if (v := versions.get(p)))
    if not held or any(paths is None for paths in held.values()):
        return None, holds
    kept = {path for _, path in holdings}
    for state in known.values():
        newest = state.newest.copy if state.newest else None
        kept |= {v.path for v in (state.good, state.before, newest) if v}
    return frozenset(kept), holds
