"""The verdicts a canary host has not written to the store yet, kept in its state dir
(`unwritten-verdicts.json`) so a restart loses none.

A file that cannot be read right now (EACCES, EIO) is never replaced — that would drop what
it holds — but read again before each round of writes, its verdicts going first. One that
was read and is not a list of verdicts is set aside (`.corrupt`) and started afresh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from ..durable import replace_atomically

NAME = "unwritten-verdicts.json"


@dataclass(frozen=True)
class Verdict:
    """What this canary host made of one content of a version."""

    name: str
    """The version's name in the store (never a placed directory's `NAME@…`)."""
    version: str
    fingerprint: str
    passed: bool
    reason: str | None = None
    canary: bool = True
    """Whether its canary ran: a pass without one is not recorded (it proves only a load)."""


_VERDICTS = TypeAdapter(list[Verdict])


class UnwrittenFile:
    def __init__(self, state_dir: Path, log: Any) -> None:
        self.path, self.log = state_dir / NAME, log
        self.unread = False
        """The file is there but could not be read: not replaced until it is."""

    def load(self) -> list[Verdict]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            self.unread = False
            return []
        except OSError as exc:
            if not self.unread:
                self.log.warning(
                    "verdict.queue_failed", reason=f"cannot read {self.path}: {exc.strerror or exc}"
                )
            self.unread = True
            return []
        self.unread = False
        try:
            return list(_VERDICTS.validate_json(data))
        except ValidationError as exc:
            aside = self.path.with_name(f"{NAME}.corrupt")
            reason = f"{self.path} is not a list of verdicts, set aside as {aside.name}: {exc}"[:300]
            self.log.warning("verdict.queue_failed", reason=reason)
            with contextlib.suppress(OSError):  # then the next save replaces it
                self.path.replace(aside)
            return []

    def merge(self, queued: Sequence[Verdict]) -> list[Verdict]:
        """The file's verdicts (once it reads) first, then those queued since it would not."""
        earlier = self.load()
        return [*earlier, *(v for v in queued if v not in earlier)]

    def save(self, verdicts: Sequence[Verdict]) -> None:
        if self.unread:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_atomically(self.path, _VERDICTS.dump_json(list(verdicts)))
        except OSError as exc:  # they are still written from memory, unless the daemon stops first
            self.log.warning("verdict.queue_failed", reason=f"cannot keep the unwritten verdicts: {exc}")
