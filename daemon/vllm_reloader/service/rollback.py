"""Where a failed reload goes back to: the newest checkpoint that passed its canary and is
still intact, else the engine's startup model — never a path that is gone or changed, and
never one whose layout differs from what the engine serves (vLLM dies on that).

Trainers rotate old checkpoints away (HF `save_total_limit`), operators restart engines on
other models: the last good checkpoint of yesterday may be neither there nor loadable
today, so each candidate target is checked when it is about to be needed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..checkpoint import gate, layout, order
from ..checkpoint.files import Identity, changed
from ..engine.client import STARTUP_VERSION
from ..errors import LayoutUnreadable
from . import reconcile
from .engine import Engine
from .metrics import Metrics
from .reverify import Reverified, Reverifier, moved
from .served import Served
from .state import Loaded


def problem(target: Loaded, baseline: layout.Layout | None) -> str | None:
    """Why `target` cannot be loaded back now, or None."""
    directory = Path(target.path)
    try:
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            return f"{target.path} is not a directory"
        if target.files is not None and (why := changed(directory, target.files)):
            return why
        if baseline is not None and (
            difference := layout.first_difference(layout.read_served_layout(directory), baseline)
        ):
            return f"layout differs from serving: {difference[0]}"
    except FileNotFoundError:
        return f"{target.path} is gone"
    except (OSError, LayoutUnreadable) as exc:
        return f"{target.path}: {exc}"
    return None


Reverify = Callable[[Loaded, tuple[Identity, ...]], object]
"""Read a target whose files' metadata moved (to these identities) again, off the loop."""


def pick(
    targets: Iterable[Loaded],
    baseline: layout.Layout | None,
    *,
    skip: str | None = None,
    reverify: Reverify | None = None,
) -> tuple[Loaded | None, dict[str, str]]:
    """The first usable target (newest first), and why each one before it was passed over.
    `skip`: a checkpoint name never to go back to (the one that just failed). A target whose
    files moved but kept their sizes is passed over while `reverify` reads its bytes."""
    passed: dict[str, str] = {}
    for target in targets:
        if target.name == skip:
            continue
        if (why := problem(target, baseline)) is None:
            return target, passed
        if reverify is not None and (now := moved(target)) is not None:
            reverify(target, now)
            why = f"{why}; reading its bytes again (only a change of bytes disqualifies it)"
        passed[target.version] = why
    return None, passed


def choose(
    served: Served,
    root: Path,
    candidates: Mapping[str, order.Candidate],
    *,
    skip: str | None,
    log: Any,
    reverify: Reverify | None = None,
) -> Loaded | None:
    """The newest intact checkpoint that passed its canary, else the engine's startup model;
    logged when the answer changes (as an error when nothing is left), kept in `served`."""
    startup = []
    if served.startup:
        startup = [
            reconcile.serving(STARTUP_VERSION, served.startup, known=None, root=root, candidates=candidates)
        ]
    target, passed = pick([*served.good, *startup], served.baseline, skip=skip, reverify=reverify)
    found = target.version if target else None
    if target is None and (found != served.rollback or passed):
        reason = "no intact checkpoint that passed its canary, and no usable startup model"
        log.error("rollback.none_left", passed_over=passed, reason=reason)
    elif found != served.rollback:
        log.info("rollback.target", version=found, passed_over=passed or None)
    served.rollback = found
    return target


REVERIFY_HOLD = 120.0
"""How long a new version waits to load while a better rollback target's bytes are read again:
after that it loads with the target there is (a hung disk or a file touched faster than it can
be read must not stop loading)."""


class Targets:
    """Each engine's rollback target, worked out when it is needed (and shown in the metrics);
    a target whose files moved at the same sizes is read again off the loop (`reverify`)."""

    def __init__(self, post: Callable[[Reverified], None], metrics: Metrics, log: Any) -> None:
        self.reverifier = Reverifier(post)
        self.metrics, self.log = metrics, log

    def of(
        self,
        engine: Engine,
        root: Path,
        candidates: Mapping[str, order.Candidate],
        options: gate.GateOptions,
        skip: str | None = None,
    ) -> Loaded | None:
        def reverify(target: Loaded, now: tuple[Identity, ...]) -> None:
            self.reverifier.submit(target, now, engine.served.baseline, options)

        target = choose(engine.served, root, candidates, skip=skip, log=engine.log, reverify=reverify)
        self.metrics.rollback_ready.labels(engine=engine.url).set(1 if target else 0)
        return target

    def holding(self, engine: Engine) -> bool:
        """Whether a target of `engine` better than the one it would use is being read again."""
        under_way = self.reverifier.under_way
        return any((g.name, g.fingerprint) in under_way for g in engine.served.good[: self._rank(engine)])

    def _rank(self, engine: Engine) -> int:
        """How many of `engine`'s good checkpoints come before its rollback target."""
        good = engine.served.good
        names = [g.version for g in good]
        return names.index(engine.served.rollback) if engine.served.rollback in names else len(good)

    def reverified(self, result: Reverified, engines: Iterable[Engine]) -> bool:
        """A target's bytes were read again: the same ones take their new identities. Returns
        whether what the engines hold changed (the state file is to be written)."""
        self.reverifier.done(result)
        fields = {"name": result.name, "fingerprint": result.fingerprint, "seconds": round(result.seconds, 3)}
        if result.files is None:
            self.log.warning("rollback.reverified", same_bytes=False, reason=result.reason, **fields)
            return False
        self.log.info("rollback.reverified", same_bytes=True, **fields)
        for engine in engines:
            engine.served.reidentified(result.name, result.fingerprint, result.files)
        return True
