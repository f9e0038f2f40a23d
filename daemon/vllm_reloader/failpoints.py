"""Failpoints: `VLLM_RELOADER_FAILPOINT=<name>` makes the daemon SIGKILL itself at <name>.

For the fault tests, which kill the daemon at each step of a reload and check that a
restart converges. Off in production: the variable is read once at import, and `hit` is a
comparison with None.

    before_pause   the reload decided, nothing sent to the engine yet
    after_pause    the engine paused, weights untouched
    after_reload   new weights loaded, weight version still `reloading:<v>`
    after_version  version set and the engine resumed, the state file not yet written
"""

from __future__ import annotations

import os
import signal

NAMES = ("before_pause", "after_pause", "after_reload", "after_version")
_ACTIVE = os.environ.get("VLLM_RELOADER_FAILPOINT") or None


def hit(name: str) -> None:
    if _ACTIVE is not None and name == _ACTIVE:
        os.kill(os.getpid(), signal.SIGKILL)
