"""The adapter swap as the engine's thread runs it: out of rotation first where a balancer
reads readiness, back in after its canary or its rollback."""

from __future__ import annotations

from collections.abc import Callable

from ..checkpoint.adapter import AdapterVersion
from ..engine import adapters as swapping
from ..engine.client import EngineClient
from .engine import Engine
from .readiness import Drain


def drained(
    swap: Callable[[EngineClient], swapping.Swapped],
    target: AdapterVersion,
    engine: Engine,
    drain: Drain | None,
) -> Callable[[EngineClient], swapping.Swapped]:
    """The swap, on the engine's thread, with the engine out of rotation where a balancer
    reads readiness (a loaded adapter takes part in every request, the base model's too),
    and back in rotation after its canary or its rollback, whatever happened."""
    if drain is None:
        return swap

    def run(client: EngineClient) -> swapping.Swapped:
        try:
            if drain.out(engine.url, client.requests_in_flight) is None:
                return swapping.Swapped(target, error="the daemon is stopping: not loaded")
            return swap(client)
        finally:
            engine.rotation.put_back(engine.url, "drain")

    return run
