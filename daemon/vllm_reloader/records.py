"""The one record store: everything the daemon must remember across a restart, in one SQLite
file in `state.dir` (`records.sqlite`, write-ahead logged, so `status` reads while the loop
writes).

    facts     (kind, key) → JSON value: the pin, the rollback history, rejected checkpoints
              and adapters (by fingerprint), why an engine is kept out of rotation, when
              each step-less version arrived
    outbox    verdicts for a fleet's object store, not written there yet (both fleets)
    content   every copy the daemon made (downloads, adapter copies, converter outputs)
    leases    who holds each copy (a copy no lease holds may be collected)
    meta      the schema's version, the fleets' instance ids, when JSON files were imported

A decision is one transaction (`with records.transaction():` around all it writes): a rejection
and the verdict that tells the fleet land together, or neither does.

One policy for the whole file. One that cannot be opened or read (EIO, EACCES, a disk having
a bad moment) is tried again a few times, then the daemon does not start (exit 1: systemd
tries again): never taken for empty, never written over. One that opens and is not a database,
or fails its integrity check, is set aside (`records.sqlite.corrupt-<time>`), said, and the
daemon starts from what the engines answer. A write that fails (a full disk) is said, and the
owner writes its whole fact again at its next change.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from . import failpoints
from .errors import AlreadyRunning, StateError
from .lock import take_lock

NAME = "records.sqlite"
SCHEMA = 1
OPEN_TRIES = 4
OPEN_BACKOFF_S = 0.1
"""A file that cannot be read is tried `OPEN_TRIES` times, waiting 0.1, 0.2, 0.4 s between."""
_CORRUPT = {"SQLITE_CORRUPT", "SQLITE_NOTADB"}
_pause = threading.Event()  # never set: its wait() is an interruptible sleep
T = TypeVar("T")

_TABLES = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS facts (
    kind TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL, PRIMARY KEY (kind, key));
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT, fleet TEXT NOT NULL, verdict TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS content (
    path TEXT PRIMARY KEY, kind TEXT NOT NULL, made REAL NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    path TEXT NOT NULL, holder TEXT NOT NULL, PRIMARY KEY (path, holder));
"""


class Corrupt(Exception):
    """The file opened and is not a sound database of ours."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or str(exc) or type(exc).__name__
    return str(exc) or type(exc).__name__


def _is_corrupt(exc: sqlite3.Error) -> bool:
    name = getattr(exc, "sqlite_errorname", "") or ""
    return name in _CORRUPT or any(said in str(exc) for said in ("file is not a database", "malformed"))


class RecordStore:
    """One connection, used from every thread under one lock (the loop writes; source threads
    take verdicts from the outbox and register copies)."""

    def __init__(self, connection: sqlite3.Connection, path: Path, log: Any, held: int = -1) -> None:
        self._db, self.path, self.log = connection, path, log
        self._held = held
        """The state directory's lock (`take_lock`), released when the store closes; -1: none
        (a reader)."""
        self._lock = threading.RLock()
        self._depth = 0
        self._failed = False
        self._after: list[Callable[[bool], object]] = []

    # -- opening -----------------------------------------------------------------------------

    @classmethod
    def open(cls, directory: Path, log: Any) -> RecordStore:
        """The store in `directory` (made when there is none). `StateError` when it cannot be
        read after retries; a corrupt one is set aside and a new one made."""
        path = directory / NAME
        held = take_lock(directory)  # before anything in it is read or written
        try:
            try:
                return cls(read_to_start(lambda: _connect(path), path, log), path, log, held)
            except Corrupt as exc:
                aside = _set_aside(path)
                log.error(
                    "state.corrupt", path=str(path), moved_to=str(aside),
                    reason=f"{exc}: starting from what the engines say",
                )  # fmt: skip
                return cls(_connect(path), path, log, held)
        except BaseException:
            os.close(held)
            raise

    @classmethod
    def reader(cls, directory: Path, log: Any) -> RecordStore:
        """The store in `directory`, read-only and as it is (an operator's tool, a test reading
        while the daemon writes: never waits on the daemon's transaction). `StateError` when
        there is none or it cannot be read."""
        path = directory / NAME
        try:
            db = sqlite3.connect(
                f"{path.as_uri()}?mode=ro",
                uri=True,
                timeout=5.0,
                isolation_level=None,
                check_same_thread=False,
            )
        except sqlite3.Error as exc:
            raise StateError(f"cannot read {path}: {_reason(exc)}") from exc
        return cls(db, path, log)

    def close(self) -> None:
        with self._lock:
            self._db.close()
            if self._held >= 0:
                os.close(self._held)
                self._held = -1

    def move_to(self, directory: Path) -> None:
        """A SIGHUP's new `state.dir`: everything held here is written there (what was there is
        replaced), and the store lives there from now on. `StateError`: it stays here. The same
        directory by another path (a symlink) is no move: its lock is this process's already,
        and closing the old descriptor would drop it."""
        with contextlib.suppress(OSError):
            if os.path.samefile(directory, self.path.parent):
                return
        try:
            new = RecordStore.open(directory, self.log)
        except AlreadyRunning as exc:
            raise StateError(str(exc)) from exc
        with self._lock, new._lock:
            try:
                new._db.execute("BEGIN IMMEDIATE")
                for table in ("meta", "facts", "outbox", "content", "leases"):
                    rows = self._db.execute(f"SELECT * FROM {table}").fetchall()
                    new._db.execute(f"DELETE FROM {table}")
                    if rows:
                        marks = ", ".join("?" * len(rows[0]))
                        new._db.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
                new._db.execute("COMMIT")
            except sqlite3.Error as exc:
                with contextlib.suppress(sqlite3.Error):
                    new._db.execute("ROLLBACK")
                new.close()
                raise StateError(f"cannot write {new.path}: {_reason(exc)}") from exc
            self._db.close()
            if self._held >= 0:
                os.close(self._held)
            self._db, self.path, self._held = new._db, new.path, new._held

    # -- one decision, one transaction -------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self, decision: str | None = None) -> Iterator[None]:
        """Everything written inside lands together or not at all. A failing write is said
        (`state.write_failed`) and the whole transaction rolled back; the caller goes on (the
        engines, not this file, are the truth about what is served) and writes its facts
        again at its next change. An exception inside rolls it back and goes on up.
        `decision`: its name, for the failpoint `recorded_<decision>` once it is committed (the
        restart tests kill the daemon there: recorded, nothing acted on or said)."""
        with self._lock:
            outer = self._depth == 0
            if outer:
                self._failed = False
                try:
                    self._db.execute("BEGIN IMMEDIATE")
                except sqlite3.Error as exc:
                    self._write_failed(exc)
            self._depth += 1
            aborted = True
            try:
                yield
                aborted = False
            finally:
                self._depth -= 1
                if outer:
                    self._end(aborted)
                    committed = not (aborted or self._failed)
                    if decision is not None and committed:
                        failpoints.hit(f"recorded_{decision}")
                    actions, self._after = self._after, []
                    for action in actions:
                        action(committed)

    def then(self, action: Callable[[], object]) -> None:
        """Run `action` (a decision's log line) once the transaction under way has ended, so
        whoever reads the store on that line finds the decision there; now, outside one."""
        self.ended(lambda _: action())

    def ended(self, action: Callable[[bool], object]) -> None:
        """Run `action(committed)` once the transaction under way has ended: whether what it
        wrote is in the store (a full disk fails at the commit, not at the write). Used inside
        a transaction; outside one, `action(True)` at once."""
        with self._lock:
            if self._depth == 0:
                action(True)
            else:
                self._after.append(action)

    def _end(self, aborted: bool) -> None:
        if not self._db.in_transaction:
            return
        try:
            self._db.execute("ROLLBACK" if aborted or self._failed else "COMMIT")
        except sqlite3.Error as exc:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
            self._write_failed(exc)

    def _write(self, sql: str, args: Iterable[object] = ()) -> None:
        with self.transaction():
            if self._failed:
                return
            try:
                self._db.execute(sql, tuple(args))
            except sqlite3.Error as exc:
                self._write_failed(exc)

    def _write_failed(self, exc: sqlite3.Error) -> None:
        self._failed = True
        self.log.error("state.write_failed", path=str(self.path), reason=_reason(exc))

    def _read(self, sql: str, args: Iterable[object] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._db.execute(sql, tuple(args)).fetchall()
            except sqlite3.Error as exc:  # opened and read at start: a disk failing since
                raise StateError(f"cannot read {self.path}: {_reason(exc)}") from exc

    # -- facts ---------------------------------------------------------------------------------

    def get(self, kind: str, key: str) -> Any:
        rows = self._read("SELECT value FROM facts WHERE kind = ? AND key = ?", (kind, key))
        return json.loads(rows[0][0]) if rows else None

    def all(self, kind: str) -> dict[str, Any]:
        rows = self._read("SELECT key, value FROM facts WHERE kind = ? ORDER BY rowid", (kind,))
        return {key: json.loads(value) for key, value in rows}

    def put(self, kind: str, key: str, value: Any) -> None:
        self._write(
            "INSERT OR REPLACE INTO facts (kind, key, value) VALUES (?, ?, ?)",
            (kind, key, json.dumps(value)),
        )

    def delete(self, kind: str, key: str) -> None:
        self._write("DELETE FROM facts WHERE kind = ? AND key = ?", (kind, key))

    def replace(self, kind: str, values: Mapping[str, Any]) -> None:
        """Every fact of `kind`, as `values` (in this order)."""
        with self.transaction():
            self._write("DELETE FROM facts WHERE kind = ?", (kind,))
            for key, value in values.items():
                self.put(kind, key, value)

    # -- the fleets' outbox ---------------------------------------------------------------------

    def outbox_add(self, fleet: str, verdict: Mapping[str, Any]) -> None:
        self._write("INSERT INTO outbox (fleet, verdict) VALUES (?, ?)", (fleet, json.dumps(verdict)))

    def outbox(self, fleet: str) -> list[tuple[int, dict[str, Any]]]:
        """The verdicts not written yet, oldest first, with their ids."""
        rows = self._read("SELECT id, verdict FROM outbox WHERE fleet = ? ORDER BY id", (fleet,))
        return [(row_id, json.loads(verdict)) for row_id, verdict in rows]

    def outbox_done(self, row_id: int) -> None:
        self._write("DELETE FROM outbox WHERE id = ?", (row_id,))

    # -- meta --------------------------------------------------------------------------------

    def meta(self, key: str) -> str | None:
        rows = self._read("SELECT value FROM meta WHERE key = ?", (key,))
        return str(rows[0][0]) if rows else None

    def set_meta(self, key: str, value: str) -> None:
        self._write("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    # -- content and leases (`sources.content`) ------------------------------------------------

    def add_content(self, path: str, kind: str) -> None:
        self._write(
            "INSERT OR IGNORE INTO content (path, kind, made) VALUES (?, ?, ?)", (path, kind, time.time())
        )

    def contents(self) -> list[tuple[str, str, float]]:
        """(path, kind, made) of every copy the daemon made."""
        return [(str(p), str(k), float(m)) for p, k, m in self._read("SELECT path, kind, made FROM content")]

    def drop_content(self, path: str) -> None:
        with self.transaction():
            self._write("DELETE FROM content WHERE path = ?", (path,))
            self._write("DELETE FROM leases WHERE path = ?", (path,))

    def hold(self, holder: str, paths: Iterable[str]) -> None:
        """What `holder` holds now, whole (what it held before and not now is let go); written
        only when it changed."""
        paths = set(paths)
        held = {str(p) for (p,) in self._read("SELECT path FROM leases WHERE holder = ?", (holder,))}
        if held == paths:
            return
        with self.transaction():
            self._write("DELETE FROM leases WHERE holder = ?", (holder,))
            for path in sorted(set(paths)):
                self._write("INSERT OR IGNORE INTO leases (path, holder) VALUES (?, ?)", (path, holder))

    def release(self, prefix: str) -> None:
        """Every lease whose holder starts with `prefix` (a thread's, a process's)."""
        self._write("DELETE FROM leases WHERE substr(holder, 1, ?) = ?", (len(prefix), prefix))

    def leases(self) -> dict[str, set[str]]:
        """Path → its holders."""
        held: dict[str, set[str]] = {}
        for path, holder in self._read("SELECT path, holder FROM leases"):
            held.setdefault(str(path), set()).add(str(holder))
        return held


def read_to_start(read: Callable[[], T], path: Path, log: Any) -> T:
    """The one policy for what the daemon must read to start (the record store, the previous
    release's files): an error reading it (EACCES, EIO, a disk's bad moment) is tried again
    `OPEN_TRIES` times, each said (`state.unreadable`), then `StateError` (exit 1: systemd
    starts the daemon again) — never taken for empty, never written over."""
    wait = OPEN_BACKOFF_S
    for attempt in range(1, OPEN_TRIES + 1):
        try:
            return read()
        except (sqlite3.Error, OSError) as exc:
            reason, last = _reason(exc), attempt == OPEN_TRIES
            log.warning(
                "state.unreadable", path=str(path), reason=reason, attempt=attempt, of=OPEN_TRIES,
                retry_in_s=None if last else round(wait, 3),
            )  # fmt: skip
            if last:
                raise StateError(
                    f"cannot read {path}: {reason} ({OPEN_TRIES} tries); not starting without what it "
                    "holds (the pin, rollback history, rejections): exit 1, systemd tries again"
                ) from exc
            _pause.wait(wait)
            wait *= 2
    raise AssertionError("unreachable")  # pragma: no cover


def _connect(path: Path) -> sqlite3.Connection:
    """Open, check and lay out the file. `Corrupt` when it is not a sound database."""
    db = sqlite3.connect(str(path), timeout=5.0, isolation_level=None, check_same_thread=False)
    try:
        found = db.execute("PRAGMA quick_check").fetchone()
        if found is None or found[0] != "ok":
            raise Corrupt(f"integrity check: {found[0] if found else 'no answer'}")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # a decision is on the disk before it is acted on
        db.executescript(_TABLES)
        version = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        if version is None:
            db.execute("INSERT INTO meta (key, value) VALUES ('schema', ?)", (str(SCHEMA),))
        elif version[0] != str(SCHEMA):
            raise Corrupt(f"schema {version[0]}, not {SCHEMA} (written by another release)")
        if db.execute("PRAGMA table_info(facts)").fetchall() == []:
            raise Corrupt("no facts table")
    except sqlite3.Error as exc:
        db.close()
        if _is_corrupt(exc):
            raise Corrupt(str(exc)) from exc
        raise
    except Corrupt:
        db.close()
        raise
    return db


def _set_aside(path: Path) -> Path:
    aside = path.with_name(f"{NAME}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
    try:
        os.replace(path, aside)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.replace(f"{path}{suffix}", f"{aside}{suffix}")
    except OSError as exc:
        raise StateError(f"{path} is corrupt and cannot be moved aside: {_reason(exc)}") from exc
    return aside
