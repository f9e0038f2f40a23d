"""Canary verdict records in a real S3 wire protocol (moto on loopback): one per content, host
and verdict, written once and never overwritten; what a follower makes of them, hostile ones
included; two canary hosts under one name told apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog

from tests.support.records import open_records
from tests.support.store_fixtures import WRITABLE, Bucket
from vllm_reloader.config import RolloutConfig
from vllm_reloader.sources import verdicts
from vllm_reloader.sources.filestore import open_store
from vllm_reloader.sources.objstore import Bucket as Store

pytestmark = pytest.mark.stores(*WRITABLE)

FP1, FP2 = "1" * 64, "2" * 64


@pytest.fixture
def store(bucket: Bucket) -> Store:
    return open_store(bucket.url)


def fleet(store: Store, state: Path, host: str = "canary-1", **rollout: object) -> verdicts.Fleet:
    rollout_config = RolloutConfig(host=host, **rollout)  # type: ignore[arg-type]
    return verdicts.Fleet(store, rollout_config, structlog.get_logger(), open_records(state))


def write(
    f: verdicts.Fleet, name: str, fingerprint: str, passed: bool, reason: str | None = None
) -> list[dict]:
    f.add(verdicts.Verdict(name, name, fingerprint, passed, reason))
    with structlog.testing.capture_logs() as logs:
        f.write_queued()
    return logs


def body(bucket: Bucket, key: str) -> dict:
    return json.loads(bucket.read(key))


def test_verdict_record_sits_at_its_content_host_and_verdict_and_is_never_overwritten(
    bucket: Bucket, store: Store, tmp_path: Path
):
    f = fleet(store, tmp_path)
    assert [e["event"] for e in write(f, "step-5", FP1, True)] == ["verdict.recorded"]
    assert [e["event"] for e in write(f, "step-5", FP1, True)] == ["verdict.exists"], "a restart keeps it"
    assert bucket.listed() == [f"step-5/_verdicts/{FP1}/canary-1.passed.json"]
    record = body(bucket, f"step-5/_verdicts/{FP1}/canary-1.passed.json")
    assert {k: record[k] for k in ("name", "version", "fingerprint", "host", "verdict")} == {
        "name": "step-5",
        "version": "step-5",
        "fingerprint": FP1,
        "host": "canary-1",
        "verdict": "passed",
    }
    assert record["daemon_version"] and record["at"] > 0 and len(record["instance"]) == 32


def test_verdict_failure_is_never_blocked_by_a_pass_of_the_same_host(bucket: Bucket, store: Store, tmp_path):
    f = fleet(store, tmp_path)
    write(f, "step-5", FP1, True)
    assert [e["event"] for e in write(f, "step-5", FP1, False, "canary: NaN")] == ["verdict.recorded"]
    assert f.clearance("step-5", FP1) == ("failed", "canary host canary-1 failed it: canary: NaN")


def test_verdict_counts_only_for_the_content_it_judged(bucket: Bucket, store: Store, tmp_path: Path):
    f = fleet(store, tmp_path)
    write(f, "latest", FP1, True)
    assert f.clearance("latest", FP1)[0] == "cleared"
    assert f.clearance("latest", FP2) == ("waiting", "waiting for canary hosts: 0 of 1 passed")
    write(f, "latest", FP2, False, "canary: NaN")
    assert f.clearance("latest", FP2)[0] == "failed" and f.clearance("latest", FP1)[0] == "cleared"


def test_verdict_of_a_second_canary_host_is_its_own_object(bucket: Bucket, store: Store, tmp_path: Path):
    write(fleet(store, tmp_path / "a", "canary-1"), "step-5", FP1, True)
    write(fleet(store, tmp_path / "b", "canary-2"), "step-5", FP1, False, "canary: NaN")
    tally = fleet(store, tmp_path / "f").tally("step-5", FP1)
    assert tally.passed == ("canary-1",) and tally.failed == (("canary-2", "canary: NaN"),)
    assert tally.clearance(1)[0] == "failed", "one failure is enough to keep it from followers"


def test_verdict_clearance_waits_for_min_canaries(bucket: Bucket, store: Store, tmp_path: Path):
    follower = fleet(store, tmp_path / "f", "follower", min_canaries=2)
    write(fleet(store, tmp_path / "a", "a"), "step-7", FP1, True)
    assert follower.clearance("step-7", FP1) == ("waiting", "waiting for canary hosts: 1 of 2 passed")
    write(fleet(store, tmp_path / "b", "b"), "step-7", FP1, True)
    assert follower.clearance("step-7", FP1) == ("cleared", "passed on a, b")


def test_verdict_two_canary_hosts_with_one_name_are_told_apart_and_count_once(
    bucket: Bucket, store: Store, tmp_path: Path
):
    write(fleet(store, tmp_path / "a"), "step-7", FP1, True)
    logs = write(fleet(store, tmp_path / "b"), "step-7", FP1, True)  # another daemon, the same name
    (conflict,) = [e for e in logs if e["event"] == "verdict.host_conflict"]
    assert conflict["log_level"] == "error" and conflict["host"] == "canary-1"
    assert conflict["fix"] == "set [rollout] host to a name no other canary host uses"
    assert "verdict.exists" not in [e["event"] for e in logs]
    follower = fleet(store, tmp_path / "f", "follower", min_canaries=2)
    assert follower.clearance("step-7", FP1) == ("waiting", "waiting for canary hosts: 1 of 2 passed")


def test_verdict_instance_id_is_kept_across_restarts(bucket: Bucket, store: Store, tmp_path: Path):
    first = fleet(store, tmp_path)
    write(first, "step-1", FP1, True)
    again = fleet(store, tmp_path)  # the same state dir: the same daemon, restarted
    assert again.instance == first.instance
    assert [e["event"] for e in write(again, "step-1", FP1, True)] == ["verdict.exists"]


def test_verdict_pass_without_a_canary_is_not_recorded(bucket: Bucket, store: Store, tmp_path: Path):
    f = fleet(store, tmp_path)
    f.add(verdicts.Verdict("step-1", "step-1", FP1, True, canary=False))
    with structlog.testing.capture_logs() as logs:
        f.write_queued()
    assert [(e["event"], e["log_level"]) for e in logs] == [("verdict.not_recorded", "warning")]
    assert bucket.listed() == []


def record(**fields: object) -> bytes:
    found = {
        "name": "step-9",
        "version": "v",
        "fingerprint": FP1,
        "host": "a",
        "verdict": "passed",
        "at": 0,
        "daemon_version": "x",
        "instance": "0" * 32,
    }
    return json.dumps({**found, **fields}).encode()


@pytest.mark.parametrize(
    "rest, data",
    [
        ("evil.passed.json", b"not json"),
        ("deep.passed.json", b"[" * 30_000 + b"]" * 30_000),
        ("huge.passed.json", b" " * (verdicts.MAX_RECORD_BYTES + 1)),
        ("other.passed.json", record()),  # a host writing under another's name
        ("a.failed.json", record()),  # at the key of another verdict
        ("a.passed.json", record(fingerprint=FP2)),  # a record on other content, copied here
        ("a.passed.json", record(name="step-8")),  # a record on another name, copied here
        ("a.passed.json", record(verdict="maybe")),
        ("a.passed.json", record(instance=None)),
    ],
)
def test_verdict_records_that_are_not_ours_pass_nothing(bucket: Bucket, store: Store, rest: str, data: bytes):
    """Malformed, nested, oversized, at another's key, or on other content: counted for nothing."""
    bucket.put(f"step-9/_verdicts/{FP1}/{rest}", data)
    assert verdicts.Reader(store).tally("step-9", FP1, store.list_under(f"step-9/_verdicts/{FP1}")) == (
        verdicts.Tally()
    )


def test_verdict_record_of_the_previous_release_counts_for_nothing(bucket: Bucket, store: Store, tmp_path):
    old = {"verdict": "passed", "host": "a", "version": "v", "at": 0, "daemon_version": "0.1"}
    bucket.put("step-9/_verdicts/a.json", json.dumps(old).encode())
    assert fleet(store, tmp_path).clearance("step-9", FP1)[0] == "waiting"


def test_verdict_folder_with_a_key_that_cannot_be_listed_waits_and_says_why(
    bucket: Bucket, store: Store, tmp_path: Path
):
    if bucket.kind == "file":  # a shared root lists regular files only
        folder = bucket.client / "runs" / "step-9" / "_verdicts" / FP1
        folder.mkdir(parents=True)
        (folder / "odd").symlink_to("/etc/passwd")
    else:
        bucket.put(f"step-9/_verdicts/{FP1}//odd", b"x")
    status, why = fleet(store, tmp_path).clearance("step-9", FP1)
    assert status == "waiting" and "cannot be listed" in why


def test_verdict_recall_tells_each_served_content_a_canary_host_failed_once(
    bucket: Bucket, store: Store, tmp_path: Path
):
    follower = fleet(store, tmp_path / "f", "follower")
    write(fleet(store, tmp_path / "a"), "step-2", FP2, False, "canary: NaN")
    write(fleet(store, tmp_path / "a"), "step-1", FP1, True)
    served = [("step-1", FP1), ("step-2", FP2), ("step-3", "")]
    (recalled,) = follower.recalls(served)
    assert recalled == verdicts.Recalled(
        "step-2", "step-2", FP2, "canary host canary-1 failed it: canary: NaN"
    )
    assert follower.recalls(served) == [], "told once"
