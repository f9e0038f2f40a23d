"""The loop's inbox: what the other threads tell the one thread that acts.

Watchdog callbacks, signal handlers, the object-store thread, the reload thread and the
control server each put one of these small frozen messages on the inbox and return
(gunicorn's arbiter: `SIG_QUEUE.put_nowait(sig)`, no logging in a handler); the loop
dispatches on the type with `match`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..sources.adapter_fleet import AdapterRecalled
from ..sources.adapters import AdapterGated, AdaptersListed
from ..sources.remote import Downloaded, Rejected
from ..sources.verdicts import Recalled
from .control import Reply
from .gating import GateFinished
from .jobs import Answered, Outcome, WarmedUp
from .reverify import Reverified


@dataclass(frozen=True)
class FileChanged:
    """Something under ROOT/name changed (watchdog's thread)."""

    name: str


@dataclass(frozen=True)
class ShardWritten:
    """A writer closed a shard of a checkpoint not yet complete (watchdog's thread)."""

    path: str


@dataclass(frozen=True)
class ReloadFinished:
    """The reload thread is done with a job, canary included."""

    outcome: Outcome


@dataclass(frozen=True)
class ControlRequest:
    """A parsed control-socket request; the loop claims `reply` before acting, then answers."""

    request: dict[str, Any]
    reply: Reply


@dataclass(frozen=True)
class SignalReceived:
    signum: int


Message = (
    FileChanged
    | ShardWritten
    | Downloaded
    | Rejected
    | Recalled
    | GateFinished
    | ReloadFinished
    | WarmedUp
    | Answered
    | Reverified
    | ControlRequest
    | SignalReceived
    | AdapterGated
    | AdaptersListed
    | AdapterRecalled
)
__all__ = [
    "AdapterGated",
    "AdapterRecalled",
    "AdaptersListed",
    "Answered",
    "ControlRequest",
    "Downloaded",
    "FileChanged",
    "GateFinished",
    "Message",
    "Recalled",
    "Rejected",
    "ReloadFinished",
    "Reverified",
    "ShardWritten",
    "SignalReceived",
    "WarmedUp",
]
