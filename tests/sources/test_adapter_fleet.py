"""The adapter source's side of the fleet, on S3 (moto) and Azurite: a follower posts a gated
version only once the canary hosts passed it (a failure rejects it), and recalls what engines
here hold when a canary host fails it later; a canary host's verdicts are written to the
records the checkpoints' fleet reads, never taken for versions."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from tests.support.adapters import write_adapter
from tests.support.records import open_records
from tests.support.store_fixtures import WRITABLE, Bucket
from vllm_reloader.config import RolloutConfig
from vllm_reloader.errors import SourceError
from vllm_reloader.sources.adapter_fleet import AdapterFleet, AdapterRecalled
from vllm_reloader.sources.adapter_trees import StoreTree
from vllm_reloader.sources.adapters import AdaptersListed, AdapterSource, Found
from vllm_reloader.sources.filestore import open_store
from vllm_reloader.sources.objstore import Store
from vllm_reloader.sources.verdicts import Verdict

from .test_adapter_trees import upload
from .test_adapters import SERVED, gated

pytestmark = pytest.mark.stores(*WRITABLE)


class Host:
    """One daemon's adapter source on the bucket, with its own state dir."""

    def __init__(self, bucket: Bucket, tmp_path: Path, name: str, role: str) -> None:
        (tmp_path / name).mkdir()
        store = open_store(bucket.url)
        self.fleet = AdapterFleet(
            store,
            RolloutConfig(role=role, host=name),
            structlog.get_logger(),
            open_records(tmp_path / name),
        )
        self.found: list[Found] = []
        self.holds: set[tuple[str, str]] = set()
        self.source = AdapterSource(
            StoreTree(store), tmp_path / name / "copies", 0.05,
            served=lambda: SERVED, post=self.found.append, records=open_records(tmp_path / name / "state"),
            fleet=self.fleet, holds=lambda: frozenset(self.holds),
        )  # fmt: skip

    def ready(self) -> list[str]:
        return [m.version for m in gated(self.found) if m.verdict.status == "ready"]


def hosts(bucket: Bucket, tmp_path: Path) -> tuple[Host, Host]:
    return Host(bucket, tmp_path, "canary-1", "canary"), Host(bucket, tmp_path, "follower-1", "follow")


def test_a_follower_posts_a_version_only_once_a_canary_host_passed_it(bucket, tmp_path):
    upload(bucket, write_adapter(tmp_path / "v0", seed=0), "support/step-0")  # never canaried
    upload(bucket, write_adapter(tmp_path / "v1", seed=1), "support/step-1")
    canary, follower = hosts(bucket, tmp_path)
    with capture_logs() as logs:
        follower.source.scan()
        follower.source.scan()
    assert follower.ready() == []
    assert follower.source.waiting == {"support": {"step-1": "waiting for canary hosts: 0 of 1 passed"}}
    assert [e["reason"] for e in logs if e["event"] == "adapter.waiting"] == [
        "waiting for canary hosts: 0 of 1 passed"
    ], "said once"
    canary.source.scan()
    passed = gated(canary.found)[-1]
    assert passed.copy is not None and passed.version == "step-1"
    canary.fleet.record(Verdict("support", "step-1", passed.copy.fingerprint, True))
    canary.source.scan()  # writes it
    records = [k for k in bucket.listed() if "_verdicts" in k]
    assert records == [f"support/_verdicts/{passed.copy.fingerprint}/canary-1.passed.json"]
    follower.source.scan()
    assert follower.ready() == ["step-1"], "the same bytes: the same fingerprint on both hosts"
    assert follower.source.waiting == {}, "status no longer shows it waiting"
    assert [m.version for m in gated(canary.found)] == ["step-0", "step-1"], "records are no versions"
    assert follower.source._judged[("support", "step-0")].waiting is None, "older: never asked now"


def test_a_follower_rejects_what_a_canary_host_failed_and_recalls_what_it_holds(bucket, tmp_path):
    upload(bucket, write_adapter(tmp_path / "v1", seed=1), "support/step-1")
    upload(bucket, write_adapter(tmp_path / "v2", seed=2), "support/step-2")
    canary, follower = hosts(bucket, tmp_path)
    canary.source.scan()
    one, two = (m.copy.fingerprint for m in gated(canary.found) if m.copy)
    canary.fleet.record(Verdict("support", "step-1", one, True))
    canary.fleet.record(Verdict("support", "step-2", two, False, "its canary failed: NaN"))
    canary.source.scan()
    follower.source.scan()
    follower.source.scan()
    decided = [(m.version, m.verdict.status, m.verdict.check) for m in gated(follower.found)]
    assert decided == [("step-2", "rejected", "fleet"), ("step-1", "ready", "")], "newest first"
    follower.holds.add(("support", one))
    canary.fleet.record(Verdict("support", "step-1", one, False, "its canary failed: flat"))
    canary.source.scan()
    follower.source.scan()
    follower.source.scan()
    recalled = [m for m in follower.found if isinstance(m, AdapterRecalled)]
    assert [(r.adapter, r.fingerprint) for r in recalled] == [("support", one)], "told once"
    assert "canary host canary-1 failed it" in recalled[0].reason


@pytest.mark.stores("s3")
def test_one_record_that_lists_but_cannot_be_read_holds_up_only_its_own_content(
    bucket, tmp_path, monkeypatch
):
    upload(bucket, write_adapter(tmp_path / "a1", seed=1), "aaa/step-1")
    upload(bucket, write_adapter(tmp_path / "b1", seed=2), "bbb/step-1")
    canary, follower = hosts(bucket, tmp_path)
    canary.source.scan()
    held_up, fine = (m.copy.fingerprint for m in gated(canary.found) if m.copy)
    canary.fleet.record(Verdict("aaa", "step-1", held_up, True))
    canary.fleet.record(Verdict("bbb", "step-1", fine, True))
    canary.source.scan()
    real = Store.get

    def get(self: Store, key: str) -> tuple[bytes, str | None]:  # archived, or under another's key
        if key.startswith("aaa/_verdicts/"):
            raise SourceError(f"GET {key}: InvalidObjectState")
        return real(self, key)

    monkeypatch.setattr(Store, "get", get)
    with capture_logs() as logs:
        follower.source.scan()
    assert follower.ready() == ["step-1"] and [m.adapter for m in gated(follower.found)] == ["bbb"]
    waiting = [e for e in logs if e["event"] == "adapter.waiting"]
    assert [e["adapter"] for e in waiting] == ["aaa"] and "cannot be read" in waiting[0]["reason"]
    follower.holds.add(("bbb", fine))
    canary.fleet.record(Verdict("bbb", "step-1", fine, False, "its canary failed: NaN"))
    canary.source.scan()
    follower.source.scan()
    assert [m.adapter for m in follower.found if isinstance(m, AdapterRecalled)] == ["bbb"]


@pytest.mark.stores("s3")
def test_an_adapter_with_only_records_left_is_gone_and_one_with_an_odd_key_is_not(bucket, tmp_path):
    upload(bucket, write_adapter(tmp_path / "v1", seed=1), "support/step-1")
    upload(bucket, write_adapter(tmp_path / "o1", seed=2), "other/step-1")
    canary = Host(bucket, tmp_path, "canary-1", "canary")
    canary.source.scan()
    fingerprint = next(m.copy.fingerprint for m in gated(canary.found) if m.copy and m.adapter == "support")
    canary.fleet.record(Verdict("support", "step-1", fingerprint, True))
    bucket.put("other/notes//x", b"a key obstore cannot list")
    canary.found.clear()
    canary.source.scan()
    assert [m.names for m in canary.found if isinstance(m, AdaptersListed)] == [{"support", "other"}]
    assert gated(canary.found) == [], "the odd key's adapter keeps its versions as they were"
    for key in bucket.listed():
        if key.startswith("support/step-1/"):
            bucket.delete(key)
    canary.found.clear()
    canary.source.scan()
    assert [m.names for m in canary.found if isinstance(m, AdaptersListed)] == [{"other"}], (
        "its records are not an adapter"
    )


def test_a_followers_waiting_versions_are_not_shown_once_its_root_cannot_be_read(
    bucket, tmp_path, monkeypatch
):
    upload(bucket, write_adapter(tmp_path / "v1", seed=1), "support/step-1")
    _canary, follower = hosts(bucket, tmp_path)
    follower.source.turn()
    assert follower.source.waiting == {"support": {"step-1": "waiting for canary hosts: 0 of 1 passed"}}

    def unreadable(say: object) -> None:
        raise SourceError("the store does not answer")

    monkeypatch.setattr(follower.source.tree, "list", unreadable)
    follower.source.turn()
    assert follower.source.waiting == {}, "status vouches for no wait it can no longer see"
