"""Canary verdict records in a real S3 wire protocol (moto on loopback): written once, never
overwritten, each host its own object; and what a follower makes of them, hostile ones included."""

from __future__ import annotations

import json

import pytest

from tests.support.store_fixtures import Bucket
from vllm_reloader.config import RolloutConfig
from vllm_reloader.sources import verdicts
from vllm_reloader.sources.objstore import Store


@pytest.fixture
def store(bucket: Bucket) -> Store:
    return Store(bucket.url)


def records(bucket: Bucket, name: str) -> dict[str, verdicts.Object]:
    listing, _ = Store(bucket.url).list()
    prefix = f"{name}/"
    return {
        k.removeprefix(prefix): o
        for k, o in listing.items()
        if k.startswith(prefix) and verdicts.is_record(k.removeprefix(prefix))
    }


def test_verdict_record_is_written_once_and_never_overwritten(bucket: Bucket, store: Store):
    assert verdicts.write(store, "step-5", host="canary-1", version="v5", passed=True, reason=None)
    assert not verdicts.write(store, "step-5", host="canary-1", version="v5", passed=False, reason="late")
    body = bucket.client.get_object(Bucket=bucket.name, Key="runs/step-5/_verdicts/canary-1.json")[
        "Body"
    ].read()
    record = json.loads(body)
    assert record["verdict"] == "passed" and record["version"] == "v5" and record["daemon_version"]


def test_verdict_of_a_second_canary_host_is_its_own_object(bucket: Bucket, store: Store):
    assert verdicts.write(store, "step-5", host="canary-1", version="v5", passed=True, reason=None)
    assert verdicts.write(store, "step-5", host="canary-2", version="v5", passed=False, reason="canary: NaN")
    assert sorted(records(bucket, "step-5")) == ["_verdicts/canary-1.json", "_verdicts/canary-2.json"]
    tally = verdicts.Reader(store).tally("step-5", records(bucket, "step-5"))
    assert tally.passed == ("canary-1",) and tally.failed == (("canary-2", "canary: NaN"),)
    assert tally.clearance(1)[0] == "failed", "one failure is enough to keep it from followers"


def test_verdict_clearance_waits_for_min_canaries(bucket: Bucket, store: Store):
    reader = verdicts.Reader(store)
    assert reader.tally("step-7", {}).clearance(1) == ("waiting", "waiting for canary hosts: 0 of 1 passed")
    verdicts.write(store, "step-7", host="a", version="v7", passed=True, reason=None)
    assert reader.tally("step-7", records(bucket, "step-7")).clearance(2)[0] == "waiting"
    verdicts.write(store, "step-7", host="b", version="v7", passed=True, reason=None)
    assert reader.tally("step-7", records(bucket, "step-7")).clearance(2) == ("cleared", "passed on a, b")


@pytest.mark.parametrize(
    "key, body",
    [
        ("_verdicts/evil.json", b"not json"),
        ("_verdicts/deep.json", b"[" * 30_000 + b"]" * 30_000),
        ("_verdicts/huge.json", b" " * (verdicts.MAX_RECORD_BYTES + 1)),
        (
            "_verdicts/other.json",
            json.dumps(
                {"verdict": "passed", "host": "a", "version": "v", "at": 0, "daemon_version": "x"}
            ).encode(),
        ),
        (
            "_verdicts/b.json",
            json.dumps(
                {"verdict": "maybe", "host": "b", "version": "v", "at": 0, "daemon_version": "x"}
            ).encode(),
        ),
    ],
)
def test_verdict_records_that_are_not_ours_pass_nothing(bucket: Bucket, store: Store, key: str, body: bytes):
    """Malformed, nested, oversized, or a host writing under another's name: counted for nothing."""
    bucket.put(f"step-9/{key}", body)
    tally = verdicts.Reader(store).tally("step-9", records(bucket, "step-9"))
    assert tally == verdicts.Tally()


def test_verdict_fleet_writes_queued_verdicts_and_logs_each(bucket: Bucket, store: Store):
    import structlog

    fleet = verdicts.Fleet(store, RolloutConfig(host="canary-1"), structlog.get_logger())
    fleet.queued.put(verdicts.Verdict("step-3", "v3", True))
    fleet.queued.put(verdicts.Verdict("step-3", "v3", False, "again"))
    with structlog.testing.capture_logs() as logs:
        fleet.write_queued()
    assert [(e["event"], e.get("verdict")) for e in logs] == [
        ("verdict.recorded", "passed"),
        ("verdict.exists", None),
    ]
    assert fleet.queued.empty()
