"""What an engine must offer the daemon, and what to tell the operator when it does not.

Asked once per reconcile (`/version`, `/openapi.json`): an engine without dev mode, or a
release outside the supported range, is a setup error that no retry fixes — the daemon
says so in one line, naming the variable or flag, and exits 2 instead of retrying forever.
The routes the daemon drives have kept their URLs from 0.27.1 to 0.32 (only vLLM's modules
moved: `serve/rlhf` → `serve/dev/rlhf` → `rl/online`), and `reload_weights` its
`weights_path` keyword, so nothing needs bridging inside that range.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

REQUIRED_ROUTES = (
    "/server_info",
    "/weight_info",
    "/update_weight_version",
    "/pause",
    "/resume",
    "/is_paused",
    "/collective_rpc",
    "/reset_prefix_cache",
)
"""Every route a reload uses (all dev-mode routes, unauthenticated: keep the engine on loopback)."""
OPTIONAL_ROUTES = ("/sleep", "/wake_up")
"""The `sleep` strategy's; only engines with --enable-sleep-mode need them."""
OLDEST = (0, 27, 1)
NEWEST_TESTED = (0, 32)
SUPPORTED = "0.27.1 to 0.32.x"
DEV_MODE_FIX = "start vLLM with VLLM_SERVER_DEV_MODE=1 in its environment"


@dataclass(frozen=True)
class Capabilities:
    version: str | None
    """`/version`'s answer; None where the engine has no such route."""
    routes: frozenset[str] | None
    """The routes the daemon knows of that the engine has, from `/openapi.json`; None where that
    is off (`--disable-fastapi-docs`)."""
    dev_mode: bool
    """Whether the dev routes answer (from `routes`, or a probe of `GET /is_paused`)."""

    def logged(self) -> dict[str, object]:
        return {
            "vllm_version": self.version,
            "routes": sorted(self.routes) if self.routes is not None else None,
        }


def release(version: str | None) -> tuple[int, ...] | None:
    """`0.32.0`, `0.27.1+cpu`, `0.33.0rc1.dev12` → (0, 32, 0), (0, 27, 1), (0, 33, 0)."""
    if version is None or not (found := re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)):
        return None
    return tuple(int(part) for part in found.groups(default="0"))


def problem(found: Capabilities) -> str | None:
    """One line saying why the daemon cannot drive this engine, and what to change; None if it can."""
    if not found.dev_mode:
        return f"the engine's dev routes are off (it answers 404 on /is_paused): {DEV_MODE_FIX}"
    missing = [route for route in REQUIRED_ROUTES if found.routes is not None and route not in found.routes]
    if missing:
        return (
            f"vLLM {found.version or '(unknown release)'} has no {', '.join(missing)}: "
            f"use a release from {SUPPORTED} with VLLM_SERVER_DEV_MODE=1"
        )
    parsed = release(found.version)
    if parsed is not None and parsed < OLDEST:
        return f"vLLM {found.version} is older than this daemon supports: use a release from {SUPPORTED}"
    return None


def untested(found: Capabilities) -> bool:
    """A release newer than the newest tested: driven all the same (its routes are there), and said."""
    parsed = release(found.version)
    return parsed is not None and parsed[:2] > NEWEST_TESTED
