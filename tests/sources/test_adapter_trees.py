"""Adapters from an object-store prefix, on each store's real wire protocol on loopback: a
version is copied only while its objects are the listed ones, its copy is the same content
(the same fingerprint) as a local root's, and what is not an adapter version is passed by."""

from __future__ import annotations

from pathlib import Path

import blake3
import pytest
from structlog.testing import capture_logs

from tests.support.adapters import write_adapter
from tests.support.ports import unused_port
from tests.support.records import open_records
from tests.support.store_fixtures import STORES, Bucket
from vllm_reloader.checkpoint.adapter import CONFIG_NAME, WEIGHTS_NAME, Served
from vllm_reloader.sources.adapter_trees import LocalTree, StoreTree
from vllm_reloader.sources.adapters import AdapterGated, AdaptersListed, AdapterSource
from vllm_reloader.sources.filestore import open_store
from vllm_reloader.sources.objstore import Store

from .test_adapters import SERVED, gated

pytestmark = pytest.mark.stores(*STORES)


def upload(
    bucket: Bucket, version: Path, key: str, files: tuple[str, ...] = (CONFIG_NAME, WEIGHTS_NAME)
) -> None:
    for file in files:
        bucket.put(f"{key}/{file}", (version / file).read_bytes())


def store_source(
    bucket: Bucket, tmp_path: Path, found: list[AdapterGated | AdaptersListed], served: Served = SERVED
) -> AdapterSource:
    return AdapterSource(
        StoreTree(open_store(bucket.url)), tmp_path / "copies", 0.05,
        served=lambda: served, post=found.append, records=open_records(tmp_path / "state"),
    )  # fmt: skip


def test_adapter_source_copies_from_a_store_the_same_content_a_local_root_gives(bucket, tmp_path):
    found: list[AdapterGated | AdaptersListed] = []
    version = write_adapter(tmp_path / "made" / "support" / "step-3", seed=3)
    upload(bucket, version, "support/step-3")
    store_source(bucket, tmp_path, found).scan()
    [message] = gated(found)
    assert message.verdict.status == "ready" and message.copy is not None and message.order[0] == 3
    copy = Path(message.copy.path)
    assert (copy / WEIGHTS_NAME).read_bytes() == (version / WEIGHTS_NAME).read_bytes()
    local: list[AdapterGated | AdaptersListed] = []
    AdapterSource(
        LocalTree(tmp_path / "made"), tmp_path / "local-copies", 0.05,
        served=lambda: SERVED, post=local.append, records=open_records(tmp_path / "state"),
    ).scan()  # fmt: skip
    [same] = gated(local)
    assert same.copy is not None and same.copy.fingerprint == message.copy.fingerprint


def test_adapter_source_waits_for_both_objects_and_judges_an_upload_again_when_replaced(bucket, tmp_path):
    found: list[AdapterGated | AdaptersListed] = []
    source = store_source(bucket, tmp_path, found)
    first = write_adapter(tmp_path / "one", seed=1)
    upload(bucket, first, "support/step-1", files=(CONFIG_NAME,))
    source.scan()
    assert gated(found) == [], "the config alone is no version yet"
    upload(bucket, first, "support/step-1", files=(WEIGHTS_NAME,))
    source.scan()
    source.scan()  # the same objects: judged once
    upload(bucket, write_adapter(tmp_path / "two", seed=2), "support/step-1")  # replaced in place
    source.scan()
    one, two = gated(found)
    assert one.copy and two.copy and one.copy.fingerprint != two.copy.fingerprint
    assert (Path(two.copy.path) / WEIGHTS_NAME).read_bytes() == (tmp_path / "two" / WEIGHTS_NAME).read_bytes()


def test_adapter_source_passes_by_keys_that_are_no_adapter_version(bucket, tmp_path):
    found: list[AdapterGated | AdaptersListed] = []
    version = write_adapter(tmp_path / "v", seed=1)
    for key in (".hidden/step-1", "with space/step-1", "support/step 1", "support/step-1/deeper"):
        upload(bucket, version, key)
    bucket.put("README.md", b"not an adapter")
    bucket.put("support/step-2/notes.txt", b"not a file of PEFT's")
    store_source(bucket, tmp_path, found).scan()
    assert gated(found) == []
    assert [m.names for m in found if isinstance(m, AdaptersListed)] == [{"support"}]


def test_adapter_source_refuses_an_object_too_big_for_any_adapter_before_reading_it(bucket, tmp_path):
    found: list[AdapterGated | AdaptersListed] = []
    version = write_adapter(tmp_path / "v")
    upload(bucket, version, "support/step-1", files=(CONFIG_NAME,))
    bucket.put(f"support/step-1/{WEIGHTS_NAME}", b"\0" * (17 << 20))  # over the bound at r = 1
    store_source(bucket, tmp_path, found, Served(weights=SERVED.weights, dtype="BF16", max_rank=1)).scan()
    [message] = gated(found)
    assert message.verdict.check == "size" and not list((tmp_path / "copies").glob("*/*"))


@pytest.mark.stores("s3")
def test_store_tree_copies_nothing_of_an_object_replaced_since_it_was_listed(bucket, tmp_path):
    tree = StoreTree(open_store(bucket.url))
    upload(bucket, write_adapter(tmp_path / "one", seed=1), "support/step-1")
    content = tree.list(print)["support"]["step-1"]
    assert content is not None
    upload(bucket, write_adapter(tmp_path / "two", seed=2), "support/step-1")
    (tmp_path / "into").mkdir()
    assert tree.copy("support", "step-1", content, tmp_path / "into", blake3.blake3()) is False


@pytest.mark.stores("s3")
def test_adapter_source_thread_says_an_unreachable_store_once_and_lives_on(s3_env, tmp_path):
    found: list[AdapterGated | AdaptersListed] = []
    store = Store("s3://nowhere/runs", endpoint_url=f"http://127.0.0.1:{unused_port()}", timeout=1)
    source = AdapterSource(
        StoreTree(store), tmp_path / "copies", 0.02,
        served=lambda: SERVED, post=found.append, records=open_records(tmp_path / "state"),
    )  # fmt: skip
    with capture_logs() as logs:
        source.start()
        try:
            source.stop.wait(1.5)
            assert source.is_alive()
        finally:
            source.close()
    said = [e for e in logs if e["event"] == "adapters.unreadable"]
    assert len(said) == 1 and "refused" in said[0]["reason"], said
    assert found == []
