"""Failpoints, for the fault tests: named points in a reload where a test can act.

- `VLLM_RELOADER_FAILPOINT=<name>`: the process SIGKILLs itself at <name> (does a restart
  converge?).
- `VLLM_RELOADER_FAILPOINT_DIR=<dir>`: at <name>, while `<dir>/<name>.hold` exists, the
  process writes `<dir>/<name>.held` and waits (at most `HOLD_LIMIT` seconds) until the test
  removes the `.hold` file — so a test can change files at an exact moment. The worker
  extension, inside the engine, honours it too (`mid_load`). In that directory,
  `<name>.rank<N>.fail` makes rank N alone raise at <name>, once (the file is taken): one
  tensor-parallel rank failing a load, the restore after it loading fine.

Off in production: both variables are read once at import; `hit` is two comparisons with
None. Standard library only: the extension imports it inside vLLM.

    after_gate     the gate said ready; nothing compared again, nothing sent to the engine
    before_pause   the files compared again, nothing sent to the engine yet
    after_pause    the engine paused, weights untouched
    load_start     (in the engine, each rank) a load asked for, the model not touched yet
    mid_load       (in the engine) the first run of tensors handed to the model
    after_reload   new weights loaded, version still `reloading:<v>`, files not compared yet
    after_version  version set and the engine resumed, the record store not yet written
    recorded_<d>   decision <d> committed to the record store, nothing acted on or said yet:
                   `rejection` (a content rejected), `serving` (a reload's outcome: what the
                   engine serves, its history, a rejection, an engine kept out), `pin`,
                   `adapter_failure` (an adapter's failed canary: rejected, or kept out)
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

NAMES = (
    "after_gate",
    "before_pause",
    "after_pause",
    "load_start",
    "mid_load",
    "after_reload",
    "after_version",
    "recorded_rejection",
    "recorded_serving",
    "recorded_pin",
    "recorded_adapter_failure",
)
KILL_NAMES = ("before_pause", "after_pause", "after_reload", "after_version")
"""Where the restart tests kill the daemon (mid_load is the engine's, after_gate holds only)."""
HOLD_LIMIT = 120.0
_KILL = os.environ.get("VLLM_RELOADER_FAILPOINT") or None
_HOLD_DIR = os.environ.get("VLLM_RELOADER_FAILPOINT_DIR") or None


class FailpointError(RuntimeError):
    """Raised where a test asked one rank to fail."""


def hit(name: str, *, rank: int | None = None) -> None:
    if _KILL is not None and name == _KILL:
        os.kill(os.getpid(), signal.SIGKILL)
    if _HOLD_DIR is not None:
        if rank is not None and _take(Path(_HOLD_DIR) / f"{name}.rank{rank}.fail"):
            raise FailpointError(f"failpoint {name} on rank {rank}")
        _hold(Path(_HOLD_DIR), name)


def _take(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def _hold(directory: Path, name: str) -> None:
    hold, held = directory / f"{name}.hold", directory / f"{name}.held"
    if not hold.exists():
        return
    held.touch()
    deadline = time.monotonic() + HOLD_LIMIT
    try:
        while hold.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        held.unlink(missing_ok=True)
