import json
import os

import pytest

from tests.support.checkpoints import write_weights
from vllm_reloader.checkpoint import gate
from vllm_reloader.errors import PublishError
from vllm_reloader.tools import publish as publish_module
from vllm_reloader.tools.publish import publish


@pytest.fixture
def src(tmp_path):
    directory = tmp_path / "trainer-out"
    write_weights(directory, shards=2)
    return directory


def test_publish_writes_whole_checkpoint_the_gate_accepts(src, tmp_path):
    final = publish(src, tmp_path / "root", step=12)
    assert final == tmp_path / "root" / "step-12"
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["version"] == "step-12" and manifest["step"] == 12
    assert all(len(f["blake3"]) == 64 for f in manifest["files"])
    assert gate.check(final, serving=None).status == "ready"
    assert not [p for p in (tmp_path / "root").iterdir() if p.name.startswith(".incoming")]
    assert src.exists() and any(src.iterdir()), "copy leaves the source alone"


def test_publish_defaults_name_to_source_directory(src, tmp_path):
    assert publish(src, tmp_path / "root").name == "trainer-out"


def test_publish_move_empties_source(src, tmp_path):
    names = sorted(p.name for p in src.iterdir())
    final = publish(src, tmp_path / "root", name="v1", move=True)
    assert not any(src.iterdir())
    assert sorted(p.name for p in final.iterdir()) == sorted([*names, "manifest.json"])
    assert gate.check(final, serving=None).status == "ready"


def test_publish_never_overwrites_a_version(src, tmp_path):
    publish(src, tmp_path / "root", name="v1")
    with pytest.raises(PublishError, match="already exists"):
        publish(src, tmp_path / "root", name="v1")


def test_publish_failure_leaves_nothing_behind_and_keeps_moved_files(src, tmp_path, monkeypatch):
    names = sorted(p.name for p in src.iterdir())
    real_rename = os.rename

    def rename(a, b):
        if str(b).endswith("/v1"):
            raise OSError(28, "No space left on device")
        return real_rename(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(PublishError, match="No space left"):
        publish(src, tmp_path / "root", name="v1", move=True)
    assert list((tmp_path / "root").iterdir()) == []
    assert sorted(p.name for p in src.iterdir()) == names


def test_publish_rejects_bad_names(src, tmp_path):
    with pytest.raises(PublishError, match="not a valid version name"):
        publish(src, tmp_path / "root", name=".hidden")


def test_publish_into_s3_uploads_files_first_and_manifest_last(src, bucket, monkeypatch):
    from vllm_reloader.sources.objstore import Store
    from vllm_reloader.tools.publish import publish_remote

    order: list[str] = []
    real_put = Store.put

    def recording_put(self, key, data, *, create_only=False):
        order.append(f"{key}{' (create only)' if create_only else ''}")
        return real_put(self, key, data, create_only=create_only)

    monkeypatch.setattr(Store, "put", recording_put)
    url = publish_remote(src, bucket.url, step=3)
    assert url == f"{bucket.url}/step-3"
    assert order[-1] == "step-3/manifest.json (create only)"
    assert sorted(order[:-1]) == sorted(f"step-3/{p.name}" for p in src.iterdir())
    manifest = json.loads(
        bucket.client.get_object(Bucket=bucket.name, Key="runs/step-3/manifest.json")["Body"].read()
    )
    assert manifest["step"] == 3 and all(len(f["blake3"]) == 64 for f in manifest["files"])


def test_publish_into_s3_never_overwrites_a_version(src, bucket):
    from vllm_reloader.sources.objstore import Store
    from vllm_reloader.tools.publish import publish_remote

    publish_remote(src, bucket.url, name="v1")
    with pytest.raises(PublishError, match="already exists"):
        publish_remote(src, bucket.url, name="v1")
    # Two publishers racing past the existence check: the conditional create still refuses.
    with pytest.raises(PublishError, match="never overwritten"):
        Store(bucket.url).put("v1/manifest.json", b"{}", create_only=True)


@pytest.mark.parametrize("failure", [OSError(5, "Input/output error"), KeyboardInterrupt()])
def test_publish_move_puts_every_file_back_when_hashing_fails_after_the_move(
    src, tmp_path, monkeypatch, failure
):
    """The trainer's own files: moved into the incoming directory, then the hash of one of
    them fails; each goes back where it was, byte for byte, and nothing else is left."""
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    calls = {"n": 0}
    real = publish_module._hash_and_sync

    def fails_on_the_second(path):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise failure
        return real(path)

    monkeypatch.setattr(publish_module, "_hash_and_sync", fails_on_the_second)
    with pytest.raises((PublishError, KeyboardInterrupt)):
        publish(src, tmp_path / "root", step=3, move=True)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert list((tmp_path / "root").iterdir()) == []
