"""`[node]`: one engine over several nodes (`vllm serve --nnodes N`): which part this daemon plays."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from .base import Section


class NodeConfig(Section):
    """`lead`: beside the engine's node 0 (its HTTP server): reloads only once every rank's
    node holds the version staged and verified. `stage`: beside a headless node: downloads,
    verifies and marks each version at the same path, never talks to an engine. `single`:
    an engine on one node (the default)."""

    role: Literal["single", "lead", "stage"] = "single"
    leader: str | None = None
    """`stage`: the leading daemon's `[rollout] host`, whose passed verdicts say which staged
    versions the engine may still go back to (kept) and which it is past (collected)."""

    @field_validator("leader")
    @classmethod
    def _a_host_name(cls, value: str | None) -> str | None:
        if value is not None and (
            not value
            or value.startswith(".")
            or not all(c.isascii() and (c.isalnum() or c in "._-") for c in value)
        ):
            raise ValueError(f"{value!r}: the leader's [rollout] host: letters, digits, '.', '_' and '-'")
        return value
