"""The host's book of checkpoints: what it must remember across a restart — the pin, the
rejected contents, the canary engine's serving checkpoint and rollback history — written to
the record store as each decision is taken, with the verdict that tells the fleet in the same
transaction, and the decision's line said only once it is there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..records import RecordStore
from ..sources.verdicts import Verdict
from .catalog import Catalog
from .metrics import Metrics
from .served import Served
from .state import State, StateRecords


class Book:
    def __init__(
        self,
        records: RecordStore,
        state: StateRecords,
        catalog: Catalog,
        canary: Callable[[], Served],
        metrics: Metrics,
        log: Any,
        tell: Callable[[Verdict], None] | None,
    ) -> None:
        """`canary`: the canary engine's holdings now (its history is the host's); `tell`: a
        verdict for the fleet (the object-store thread writes it), kept in the record store's
        outbox in the transaction of the decision it tells."""
        self.records, self.state, self.catalog, self.metrics, self.log = records, state, catalog, metrics, log
        self.canary, self._tell = canary, tell

    def reject(
        self, name: str, version: str | None, reason: str, fingerprint: str, verdict: Verdict | None = None,
        **details: object,
    ) -> None:  # fmt: skip
        """A content rejected for good (and, with `verdict`, the fleet told), in one transaction;
        then its `checkpoint.rejected` line."""
        self.metrics.rejected.labels(check=details.get("check", "")).inc()
        said = self.catalog.reject(name, version, reason, fingerprint, **details)
        with self.records.transaction("rejection"):
            self.persist()
            self.tell(verdict)
            self.records.then(lambda: self.log.warning("checkpoint.rejected", **said))

    def tell(self, verdict: Verdict | None) -> None:
        if verdict is not None and self._tell is not None:
            self._tell(verdict)

    def persist(self) -> None:
        """The facts as they are now, whole (a write the disk failed is made again here)."""
        served = self.canary()
        state = State(
            serving=served.serving,
            good=served.good,
            rejected=dict(self.catalog.rejected),
            pinned=self.catalog.pinned,
        )
        self.state.save(state)

    def pin(self, name: str, *, force: bool = False) -> str | None:
        """Pin a checkpoint by directory name or version; returns an error, or None."""
        error = self.catalog.pin(name, force=force)
        with self.records.transaction("pin"):
            self.persist()
        return error

    def unpin(self) -> None:
        self.catalog.pin(None)
        self.persist()
