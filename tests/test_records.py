"""The record store: one SQLite file, one transaction per decision, one policy for a file that
cannot be read (retried, then no start) and one that is corrupt (set aside, said)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from tests.support.records import open_records
from vllm_reloader import records as records_mod
from vllm_reloader.errors import StateError
from vllm_reloader.records import RecordStore


def test_records_keep_facts_verdicts_and_meta_across_a_reopen(tmp_path):
    records = open_records(tmp_path)
    records.put("rejected", "step-3", {"reason": "canary: NaN"})
    records.outbox_add("checkpoints", {"name": "step-3"})
    records.set_meta("instance:checkpoints", "c" * 32)
    records.close()
    again = open_records(tmp_path)
    assert again.all("rejected") == {"step-3": {"reason": "canary: NaN"}}
    assert [v for _, v in again.outbox("checkpoints")] == [{"name": "step-3"}]
    assert again.meta("instance:checkpoints") == "c" * 32


def test_records_a_decision_lands_whole_or_not_at_all(tmp_path):
    records = open_records(tmp_path)
    with pytest.raises(RuntimeError), records.transaction():
        records.put("rejected", "step-3", {"reason": "canary: NaN"})
        records.outbox_add("checkpoints", {"name": "step-3"})
        raise RuntimeError("a bug between the two writes")
    assert records.all("rejected") == {} and records.outbox("checkpoints") == []


def test_records_say_a_decisions_line_only_once_it_is_in_the_store(tmp_path):
    records, reader = open_records(tmp_path), open_records(tmp_path)
    seen: list[dict] = []
    with records.transaction():
        records.put("rejected", "step-3", {"reason": "x"})
        records.then(lambda: seen.append(reader.all("rejected")))
        assert seen == [], "not said inside the transaction"
    assert seen == [{"step-3": {"reason": "x"}}], "a reader on the line finds it"
    records.then(lambda: seen.append({}))  # outside a transaction: at once
    assert len(seen) == 2


def test_records_are_read_by_another_connection_while_the_loop_writes(tmp_path):
    writer, reader = open_records(tmp_path), open_records(tmp_path)
    done = threading.Event()

    def write() -> None:
        for n in range(200):
            writer.put("rejected", f"step-{n}", {"n": n})
        done.set()

    thread = threading.Thread(target=write)
    thread.start()
    while not done.is_set():
        found = reader.all("rejected")
        assert all(value == {"n": int(key.split("-")[1])} for key, value in found.items())
    thread.join()
    assert len(reader.all("rejected")) == 200


def failing_open(monkeypatch: pytest.MonkeyPatch, reason: str, times: int | None = None) -> list[int]:
    """The file cannot be opened (`times` times, or for ever): the suite runs as root, so a
    chmod would not do."""
    calls: list[int] = []
    real = records_mod._connect

    def connect(path: Path) -> sqlite3.Connection:
        if times is None or len(calls) < times:
            calls.append(1)
            raise sqlite3.OperationalError(reason)
        return real(path)

    monkeypatch.setattr(records_mod, "_connect", connect)
    monkeypatch.setattr(records_mod, "OPEN_BACKOFF_S", 0.001)
    return calls


@pytest.mark.parametrize("reason", ["disk I/O error", "unable to open database file"])
def test_records_that_cannot_be_read_stop_the_start_and_are_never_replaced(tmp_path, monkeypatch, reason):
    records = open_records(tmp_path)
    records.put("rejected", "step-3", {"reason": "canary: NaN"})
    records.close()
    before = (tmp_path / records_mod.NAME).read_bytes()
    calls = failing_open(monkeypatch, reason)
    with capture_logs() as logs, pytest.raises(StateError, match=rf"cannot read .*: {reason} \(4 tries\)"):
        RecordStore.open(tmp_path, structlog.get_logger())
    assert len(calls) == records_mod.OPEN_TRIES
    assert [e["event"] for e in logs] == ["state.unreadable"] * records_mod.OPEN_TRIES
    assert logs[-1]["retry_in_s"] is None
    monkeypatch.undo()
    assert (tmp_path / records_mod.NAME).read_bytes() == before
    assert open_records(tmp_path).all("rejected") == {"step-3": {"reason": "canary: NaN"}}


def test_records_unreadable_for_a_moment_are_read_on_a_retry(tmp_path, monkeypatch):
    open_records(tmp_path).put("rejected", "step-3", {"reason": "x"})
    failing_open(monkeypatch, "disk I/O error", times=2)
    with capture_logs() as logs:
        found = RecordStore.open(tmp_path, structlog.get_logger())
    assert [(e["event"], e["attempt"]) for e in logs] == [("state.unreadable", 1), ("state.unreadable", 2)]
    assert found.all("rejected") == {"step-3": {"reason": "x"}}


@pytest.mark.parametrize("junk", [b"{not a database", b"SQLite format 3\0" + b"\xff" * 200])
def test_records_corrupt_are_set_aside_said_and_started_afresh(tmp_path, junk):
    (tmp_path / records_mod.NAME).write_bytes(junk)
    with capture_logs() as logs:
        found = RecordStore.open(tmp_path, structlog.get_logger())
    [said] = logs
    assert said["event"] == "state.corrupt" and Path(said["moved_to"]).read_bytes() == junk
    assert found.all("rejected") == {}
    found.put("rejected", "step-1", {"reason": "x"})
    assert found.all("rejected") == {"step-1": {"reason": "x"}}


def test_records_moved_to_a_new_state_dir_take_everything_along(tmp_path):
    records = open_records(tmp_path / "a")
    records.put("rejected", "step-3", {"reason": "x"})
    records.outbox_add("adapters", {"name": "support"})
    records.add_content("/copies/support/v1@ab", "adapter")
    records.hold("engine:a", ["/copies/support/v1@ab"])
    (tmp_path / "b").mkdir()
    records.move_to(tmp_path / "b")
    records.put("rejected", "step-4", {"reason": "y"})
    moved = open_records(tmp_path / "b")
    assert set(moved.all("rejected")) == {"step-3", "step-4"}
    assert [v for _, v in moved.outbox("adapters")] == [{"name": "support"}]
    assert moved.leases() == {"/copies/support/v1@ab": {"engine:a"}}
    assert set(open_records(tmp_path / "a").all("rejected")) == {"step-3"}, "the old one left as it was"


def test_records_a_commit_the_disk_refuses_loses_no_verdict_and_writes_the_facts_again(tmp_path, monkeypatch):
    """In WAL mode a full disk fails the COMMIT, not the writes before it: a decision inside a
    transaction cannot know its writes were lost until it ends."""
    from tests.support.records import fill_disk
    from vllm_reloader.config import RolloutConfig
    from vllm_reloader.service.state import Rejection, State, StateRecords
    from vllm_reloader.sources.verdicts import Fleet, Verdict

    records = open_records(tmp_path)
    facts = StateRecords(records, structlog.get_logger())
    fleet = Fleet(None, RolloutConfig(host="h"), structlog.get_logger(), records)  # type: ignore[arg-type]
    rejected = State(
        rejected={"step-9": Rejection(version="step-9", reason="canary", fingerprint="f" * 16, at=1.0)}
    )
    verdict = Verdict("step-9", "step-9", "f" * 16, False, "canary")
    full = fill_disk(records, monkeypatch, at_commit=True)
    with capture_logs() as logs, records.transaction("rejection"):
        facts.save(rejected)
        fleet.add(verdict)
    assert full.refused == 1 and [e["event"] for e in logs] == ["state.write_failed"]
    assert fleet.pending() == [verdict], "kept in memory, added again first"
    monkeypatch.undo()
    facts.save(rejected)  # the same facts again: not taken as saved
    assert StateRecords(records, structlog.get_logger()).saved == rejected


def test_records_moved_to_the_same_dir_by_a_symlink_keep_everything_and_the_lock(tmp_path):
    """A SIGHUP naming the state dir by another path: nothing copied onto itself, and the lock
    (the process's) still held, so a second daemon is still refused."""
    import subprocess
    import sys

    records = open_records(tmp_path / "a")
    records.put("rejected", "step-3", {"reason": "x"})
    (tmp_path / "alias").symlink_to(tmp_path / "a")
    records.move_to(tmp_path / "alias")
    assert set(records.all("rejected")) == {"step-3"}
    probe = (
        "import sys; from pathlib import Path; from vllm_reloader.lock import take_lock; "
        "take_lock(Path(sys.argv[1]))"
    )
    other = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "a")], capture_output=True, text=True)
    assert other.returncode != 0 and "AlreadyRunning" in other.stderr, other.stderr
    records.close()
