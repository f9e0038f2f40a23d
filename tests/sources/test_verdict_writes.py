"""A store that refuses verdict writes (a read-only IAM policy on `_verdicts/`) while its
listing works: one `verdict.write_failed`, never `source.failed`, and the record written once
the store takes it (moto on loopback, the object-store thread's own loop)."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog

from tests.support.records import open_records
from tests.support.store_fixtures import WRITABLE, Bucket
from vllm_reloader import config
from vllm_reloader.checkpoint import order
from vllm_reloader.errors import SourceError
from vllm_reloader.records import RecordStore
from vllm_reloader.sources import verdicts
from vllm_reloader.sources.arrivals import Arrivals
from vllm_reloader.sources.filestore import FileStore, open_store
from vllm_reloader.sources.objstore import Store
from vllm_reloader.sources.remote import RemoteSource

pytestmark = pytest.mark.stores(*WRITABLE)

FP = "1" * 64
KINDS: tuple[type[Store] | type[FileStore], ...] = (Store, FileStore)


class Refusing:
    """`create` answering as a read-only policy does, while `refuse` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.refuse = threading.Event()
        self.refused = 0
        for kind in KINDS:
            monkeypatch.setattr(kind, "create", self.refusing(kind.create))

    def refusing(self, real: Callable[..., bool]) -> Callable[..., bool]:
        def create(store: Store | FileStore, key: str, data: object) -> bool:
            if self.refuse.is_set():
                self.refused += 1
                raise SourceError(f"PUT {store.url}/{key}: AccessDenied")
            return real(store, key, data)

        return create


def source(
    tmp_path: Path, bucket: Bucket, records: RecordStore | None = None
) -> tuple[RemoteSource, list[int]]:
    cfg = config.Config(
        source=config.SourceConfig(path=bucket.url, poll_interval=0.02),
        engine=config.EngineConfig(url="http://127.0.0.1:1"),
        state=config.StateConfig(dir=tmp_path / "state", min_free_bytes=0),
        rollout=config.RolloutConfig(host="canary-1"),
    )
    found = RemoteSource(
        cfg,
        serving=lambda: order.NOTHING,
        rejected=dict,
        post=lambda _: None,
        records=(store := records or open_records(cfg.state.dir)),
        arrivals=Arrivals(store),
    )
    polls = [0]
    poll = found.poll

    def counted() -> None:
        poll()
        polls[0] += 1

    found.poll = counted  # type: ignore[method-assign]
    return found, polls


def wait_until(predicate, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_verdict_write_refused_is_its_own_condition_logged_once_never_a_source_failure(
    tmp_path: Path, bucket: Bucket, monkeypatch: pytest.MonkeyPatch
):
    store = Refusing(monkeypatch)
    store.refuse.set()
    remote, polls = source(tmp_path, bucket)
    where = verdicts.key("step-5", FP, "canary-1", "passed")
    with structlog.testing.capture_logs() as logs:
        remote.start()
        try:
            remote.record(verdicts.Verdict("step-5", "step-5", FP, True))
            wait_until(lambda: store.refused >= 5 and polls[0] >= 5)  # several polls, each refused
            assert where not in bucket.listed()
            store.refuse.clear()
            remote.poke()
            wait_until(lambda: where in bucket.listed())
            wait_until(lambda: any(e["event"] == "verdict.written" for e in logs))
            seen = polls[0]
            wait_until(lambda: polls[0] >= seen + 3)  # and quiet after it
        finally:
            remote.close()
    events = [e["event"] for e in logs]
    assert "source.failed" not in events and "source.recovered" not in events, events
    (failed,) = [e for e in logs if e["event"] == "verdict.write_failed"]
    assert failed["log_level"] == "error"
    assert failed["key"] == where and failed["reason"] == f"PUT {bucket.url}/{where}: AccessDenied"
    assert failed["name"] == "step-5" and failed["fingerprint"] == FP and failed["queued"] == 1
    (written,) = [e for e in logs if e["event"] == "verdict.written"]
    assert written["verdicts"] == 1 and written["log_level"] == "info"
    assert events.count("verdict.recorded") == 1
    assert (
        events.index("verdict.write_failed")
        < events.index("verdict.recorded")
        < events.index("verdict.written")
    )


def test_verdict_write_refusals_keep_the_order_and_log_again_only_for_a_new_reason(
    tmp_path: Path, bucket: Bucket, monkeypatch: pytest.MonkeyPatch
):
    store = Refusing(monkeypatch)
    store.refuse.set()
    fleet = verdicts.Fleet(
        open_store(bucket.url), config.RolloutConfig(host="h"), structlog.get_logger(), open_records(tmp_path)
    )
    for name in ("step-1", "step-2"):
        fleet.add(verdicts.Verdict(name, name, FP, False, "canary: NaN"))
    refusing = {kind: kind.create for kind in KINDS}
    with structlog.testing.capture_logs() as logs:
        for _ in range(4):
            fleet.write_queued()
        assert [e["event"] for e in logs] == ["verdict.write_failed"]
        assert logs[0]["name"] == "step-1" and logs[0]["queued"] == 2
        for kind in KINDS:
            monkeypatch.setattr(
                kind, "create", lambda *_: (_ for _ in ()).throw(SourceError("PUT: timed out"))
            )
        fleet.write_queued()
        fleet.write_queued()
    first = f"PUT {bucket.url}/{verdicts.key('step-1', FP, 'h', 'failed')}: AccessDenied"
    assert [e["reason"] for e in logs] == [first, "PUT: timed out"]
    for kind in KINDS:
        monkeypatch.setattr(kind, "create", refusing[kind])
    store.refuse.clear()
    with structlog.testing.capture_logs() as logs:
        fleet.write_queued()
        fleet.write_queued()
    assert [(e["event"], e.get("name")) for e in logs] == [
        ("verdict.recorded", "step-1"),
        ("verdict.recorded", "step-2"),
        ("verdict.written", None),
    ]
    assert logs[-1]["verdicts"] == 2


def queued_then_stopped(tmp_path: Path, bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> Refusing:
    """A daemon whose store refused its verdict for step-3 stopped; the store still refuses."""
    refusing = Refusing(monkeypatch)
    refusing.refuse.set()
    first, _ = source(tmp_path, bucket)
    first.record(verdicts.Verdict("step-3", "step-3", FP, False, "canary: NaN"))
    assert first.fleet.write_queued() is False
    first.close()
    return refusing


def test_verdict_refused_before_a_restart_is_written_by_the_next_daemon(
    tmp_path, bucket: Bucket, monkeypatch
):
    """Kept in the state dir, not in memory: the store refused it, the daemon stopped, and the
    one that starts next writes it (before: followers waited for ever)."""
    refusing = queued_then_stopped(tmp_path, bucket, monkeypatch)
    refusing.refuse.clear()
    second, _ = source(tmp_path, bucket)
    assert second.fleet.pending() == [verdicts.Verdict("step-3", "step-3", FP, False, "canary: NaN")]
    assert second.fleet.write_queued() is True
    assert bucket.listed() == [f"step-3/_verdicts/{FP}/canary-1.failed.json"]
    third, _ = source(tmp_path, bucket)
    assert third.fleet.pending() == [], "written once: not again after the next restart"


def test_verdict_refused_before_a_sighup_is_taken_by_the_new_source(tmp_path, bucket: Bucket, monkeypatch):
    refusing = Refusing(monkeypatch)
    refusing.refuse.set()
    old, _ = source(tmp_path / "old", bucket)
    old.record(verdicts.Verdict("step-4", "step-4", FP, True, None))
    assert old.fleet.write_queued() is False
    (tmp_path / "new" / "state").mkdir(parents=True)
    old.fleet.records.move_to(tmp_path / "new" / "state")  # a SIGHUP that moved the state dir
    old.fleet.detach()
    new, _ = source(tmp_path / "new", bucket, records=old.fleet.records)
    assert new.fleet.pending() == old.fleet.pending() != []
    refusing.refuse.clear()
    assert new.fleet.write_queued() is True
    assert bucket.listed() == [f"step-4/_verdicts/{FP}/canary-1.passed.json"]


def test_verdict_whose_reason_quotes_a_huge_hostile_name_is_written_cut_not_a_crash(tmp_path, bucket: Bucket):
    """A gate reason may quote a writer's tensor name of any length: the record keeps the first
    4096 characters (before: a validation error killed the object-store thread at every start)."""
    fleet_source, _ = source(tmp_path, bucket)
    fleet_source.record(verdicts.Verdict("step-6", "step-6", FP, False, "unreadable tensor " + "t" * 5000))
    assert fleet_source.fleet.write_queued() is True
    assert fleet_source.fleet.pending() == []
    key = f"step-6/_verdicts/{FP}/canary-1.failed.json"
    body = bucket.read(key)
    assert len(json.loads(body)["reason"]) == 4096


def test_verdict_source_replaced_by_a_sighup_writes_nothing_more(tmp_path, bucket: Bucket, monkeypatch):
    refusing = Refusing(monkeypatch)
    refusing.refuse.set()
    old, _ = source(tmp_path, bucket)
    old.record(verdicts.Verdict("step-7", "step-7", FP, True, None))
    assert old.fleet.write_queued() is False
    old.fleet.detach()
    refusing.refuse.clear()
    assert old.fleet.write_queued() is True and bucket.listed() == [], "a stuck old thread writes nothing"
    new, _ = source(tmp_path, bucket, records=old.fleet.records)
    assert new.fleet.write_queued() is True
    assert bucket.listed() == [f"step-7/_verdicts/{FP}/canary-1.passed.json"]


def test_verdict_the_record_store_failed_to_keep_is_held_in_memory_and_written_all_the_same(
    tmp_path, bucket: Bucket, monkeypatch
):
    """A full disk under the record store: the verdict is not lost while the daemon runs."""
    found, _ = source(tmp_path, bucket)
    records = found.fleet.records
    real = records._write

    def full(sql: str, args: object = ()) -> None:
        if sql.startswith("INSERT INTO outbox"):
            with records.transaction():
                records._write_failed(sqlite3.OperationalError("database or disk is full"))
            return
        real(sql, args)  # type: ignore[arg-type]

    monkeypatch.setattr(records, "_write", full)
    with structlog.testing.capture_logs() as logs:
        found.record(verdicts.Verdict("step-8", "step-8", FP, True, None))
    assert [e["event"] for e in logs] == ["state.write_failed"]
    assert found.fleet.pending() == [verdicts.Verdict("step-8", "step-8", FP, True, None)]
    monkeypatch.undo()
    assert found.fleet.write_queued() is True
    assert bucket.listed() == [f"step-8/_verdicts/{FP}/canary-1.passed.json"]
    assert found.fleet.pending() == []
