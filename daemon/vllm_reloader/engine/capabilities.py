"""What an engine must offer the daemon, and what to tell the operator when it does not.

Asked once per reconcile (`/version`, `/openapi.json`): an engine without dev mode, or a
release outside the supported range, is a setup error that no retry fixes — the daemon
says so in one line, naming the variable or flag, and exits 2 instead of retrying forever.
The routes the daemon drives have kept their URLs and parameters from 0.27.1 to 0.34 (only
vLLM's modules moved: `serve/rlhf` → `serve/dev/rlhf` → `rl/online`), and `reload_weights`
its keywords; `tests/contract` checks that against every release's wheel. What changed is
behaviour, handled per release: from 0.33 a pause in `wait` or `abort` mode answers new
requests with 503 until `/resume`; 0.34 reloads inside a KV-cache loan that may refuse
before touching any weight, and has `VLLM_RELOAD_MODE=direct` (no rollback inside vLLM).
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
ADAPTER_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
"""LoRA adapters at run time (`[adapters]`): there only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True."""
ADAPTER_FIX = "start vLLM with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment"
OLDEST = (0, 27, 1)
NEWEST_TESTED = (0, 34)
"""The newest release the contract (`tests/contract`) passes on; the real-engine tests run the
newest CPU build, 0.32."""
SUPPORTED = "0.27.1 to 0.34.x"
PAUSE_REJECTS_FROM = (0, 33)
"""From this release a pause in `wait` or `abort` mode answers new requests with HTTP 503
(`engine_paused`) until `/resume`; `keep` still queues them."""
LOAN_REFUSED = "of free device memory, at least"
"""In vLLM's error when its KV-cache loan refuses a reload (0.34+), raised before any weight is
touched: the engine's condition, not the checkpoint's (`refused` matches the whole sentence)."""
LOAN_FROM = (0, 34)
_REFUSAL = re.compile(
    r"Updating weights layer by layer needs about [\d.]+ GiB " + re.escape(LOAN_REFUSED) + r" [\d.]+ GiB"
)
LOAN_REFUSED_FIX = (
    "let vLLM borrow the KV cache's memory: drain behind a balancer ([readiness] drain = true pauses "
    'a drained engine in wait mode, which clears the cache) or set [engine] pause_mode = "wait"; '
    'or leave room: a lower gpu_memory_utilization, or [engine] strategy = "sleep"'
)
PAUSE_REJECTS_FIX = (
    "drain behind a balancer ([readiness] drain = true: out of rotation before its pause), or set "
    '[engine] pause_mode = "keep" (nothing turned away, but vLLM keeps its KV cache through such a '
    "pause, so 0.34+ may refuse a reload for want of memory)"
)
DIRECT_RELOAD = (
    "VLLM_RELOAD_MODE=direct writes the new weights into the live tensors: a reload that fails "
    "midway leaves them mixed (vLLM keeps no copy); the daemon loads the last good checkpoint back"
)
DIRECT_RELOAD_FIX = "unset VLLM_RELOAD_MODE in the engine's environment (layerwise is the default)"
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


def refused(error_text: str, hostile: tuple[str, ...] = ()) -> bool:
    """Whether vLLM refused a reload for want of device memory. The names a writer chose (the
    checkpoint's path, its files) are taken out first: they could spell the sentence."""
    for name in sorted(filter(None, hostile), key=len, reverse=True):
        error_text = error_text.replace(name, "\0")
    return _REFUSAL.search(error_text) is not None


def pause_rejects(found: Capabilities) -> bool:
    """Whether a pause in `wait` or `abort` mode turns new requests away with 503 here."""
    parsed = release(found.version)
    return parsed is not None and parsed[:2] >= PAUSE_REJECTS_FROM


def adapters_missing(found: Capabilities) -> bool:
    """Whether the engine cannot load adapters at run time (unknown without `/openapi.json`)."""
    return found.routes is not None and not set(ADAPTER_ROUTES) <= found.routes


def untested(found: Capabilities) -> bool:
    """A release newer than the newest tested: driven all the same (its routes are there), and said."""
    parsed = release(found.version)
    return parsed is not None and parsed[:2] > NEWEST_TESTED
