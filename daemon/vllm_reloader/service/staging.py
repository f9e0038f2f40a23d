"""The leading daemon of a multi-node engine (`[node] role = "lead"`): before the canary engine
reloads a version, every rank says whether its node holds it, verified (`engine.nodes`).

Asked on the engine's thread, as work of its own before the reload is planned: a node that is
short means no pause and no `reload.started`, one `node.not_staged` line per node and reason,
and the question asked again after the engine's backoff, until every node holds it. The job
asks once more just before its pause (`jobs.Job.node`), so nothing loads on a node that lost
its copy in between.
"""

from __future__ import annotations

from ..engine import nodes
from ..engine.client import EngineClient
from ..engine.swap import Target
from .engine import Engine
from .gating import Ready
from .jobs import Ask, states_of, target_of
from .outcomes import NOT_STAGED_FIX
from .scheduler import Work


class Staging:
    def __init__(self, node: str | None) -> None:
        self.node = node
        """This node's name in the markers (`[rollout] host`); None: an engine on one node."""
        self.cleared: str | None = None
        """The content every node last said it holds (asked again before each pause)."""
        self.said: dict[str, str] = {}
        """Each short node's reason, as last logged (for the content asked about)."""
        self.asked: str | None = None

    def owed(self, ready: Ready) -> bool:
        """The canary engine's next load waits for its nodes' word."""
        loading = ready.loading
        return (
            self.node is not None
            and bool(loading.fingerprint)
            and loading.files is not None
            and (self.cleared != loading.fingerprint)
        )

    def ask(self, engine: Engine, ready: Ready, fallback: Target | None) -> Work:
        node = self.node
        assert node is not None
        target = target_of(ready.loading, node)

        def ask(client: EngineClient) -> tuple[nodes.NodeState, ...]:
            return states_of(client, node, target, fallback)

        return Work("nodes", Ask(engine.client, ask), lambda found: self.answered(engine, ready, found))

    def answered(self, engine: Engine, ready: Ready, states: tuple[nodes.NodeState, ...]) -> None:
        loading = ready.loading
        engine.nodes = (loading.version, states)
        if self.asked != loading.fingerprint:
            self.asked, self.said = loading.fingerprint, {}
        short = nodes.first_short(states)
        if short is None:
            self.cleared, self.said = loading.fingerprint, {}
            return
        wait = engine.follow.failed(engine.url)
        if self.said.get(short.node) != short.problem:
            self.said[short.node] = short.problem or ""
            engine.log.warning(
                "node.not_staged", version=loading.version, node=short.node, reason=short.problem,
                fix=NOT_STAGED_FIX, retry_in_s=wait,
            )  # fmt: skip

    def lost(self) -> None:
        """A node lost the version between the question and the pause: ask again."""
        self.cleared = None
