"""A multi-node engine's ranks, asked before a reload whether their nodes hold the version.

Each rank opens the path on its own node's filesystem. The daemon beside node 0 asks every
rank (`EngineClient.staged`) and reloads only when each says its node's daemon verified that
content there and nothing changed since; one node short means no pause at all, and one line
naming the node. Pure: a function of the ranks' answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NodeState:
    node: str
    """`node R (host)`, as its ranks name it."""
    ranks: tuple[int, ...]
    problem: str | None
    """None: it holds the version, verified, unchanged."""


def node_states(answers: Sequence[Any]) -> tuple[NodeState, ...]:
    """Each node's state, from its ranks' answers (in rank order); a rank's answer that is not
    one (an engine without the extension's `reloader_staged`, a bug) is a problem of its own."""
    found: dict[str, tuple[list[int], str | None]] = {}
    for position, answer in enumerate(answers):
        problem: str | None
        if not isinstance(answer, dict):
            node, problem = f"rank {position}", f"no staged answer ({str(answer)[:120]})"
        else:
            node = _node_name(answer)
            raw = answer.get("problem")
            problem = None if raw is None else str(raw)[:400]
        ranks, known = found.setdefault(node, ([], None))
        ranks.append(position)
        if known is None and problem is not None:
            found[node] = (ranks, problem)
    return tuple(NodeState(node, tuple(ranks), problem) for node, (ranks, problem) in found.items())


def _node_name(answer: dict[str, Any]) -> str:
    host = str(answer.get("host", "?"))[:100]
    node_rank = answer.get("node_rank")
    return f"node {node_rank} ({host})" if type(node_rank) is int else host


def first_short(states: Sequence[NodeState]) -> NodeState | None:
    """The first node that does not hold the version (None: every one does)."""
    return next((s for s in states if s.problem is not None), None)
