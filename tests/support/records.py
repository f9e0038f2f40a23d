"""The record store for tests that build the daemon's parts by hand (the daemon opens its own)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import structlog

from vllm_reloader.records import RecordStore
from vllm_reloader.sources.arrivals import Arrivals


def open_records(directory: Path) -> RecordStore:
    """The record store in `directory` (made, as an operator makes `state.dir`)."""
    directory.mkdir(parents=True, exist_ok=True)
    return RecordStore.open(directory, structlog.get_logger())


def source_records(directory: Path) -> dict[str, Any]:
    """A remote source's `records` and `arrivals`, over the record store in `directory`."""
    records = open_records(directory)
    return {"records": records, "arrivals": Arrivals(records)}


def read_records(directory: Path) -> RecordStore:
    """The record store in `directory`, read-only and without its lock (a daemon may run on it)."""
    return RecordStore.reader(directory, structlog.get_logger())


class FullDisk:
    """The store's connection on a full disk: every write fails as SQLite says it then (in WAL
    mode, with `at_commit`, only the COMMIT: the WAL grows as the transaction is committed)."""

    def __init__(self, real: sqlite3.Connection, at_commit: bool = False) -> None:
        self.real, self.at_commit = real, at_commit
        self.refused = 0

    def execute(self, sql: str, args: object = ()) -> object:
        writes = ("COMMIT",) if self.at_commit else ("INSERT", "DELETE", "UPDATE")
        if sql.split(None, 1)[0].upper() in writes:
            self.refused += 1
            raise sqlite3.OperationalError("database or disk is full")
        return self.real.execute(sql, args)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


def fill_disk(records: RecordStore, monkeypatch: pytest.MonkeyPatch, *, at_commit: bool = False) -> FullDisk:
    full = FullDisk(records._db, at_commit)
    monkeypatch.setattr(records, "_db", full)
    return full
