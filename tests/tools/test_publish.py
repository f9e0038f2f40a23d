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


def test_publish_into_s3_creates_every_file_and_the_manifest_last(src, bucket, monkeypatch):
    """Every object goes up create-only (`If-None-Match: *`): nothing is ever overwritten."""
    from vllm_reloader.sources.objstore import Store
    from vllm_reloader.tools.publish import publish_remote

    order: list[str] = []
    real_create = Store.create

    def recording_create(self, key, data):
        order.append(key)
        return real_create(self, key, data)

    def no_overwrite(self, key, data, *, create_only=False):
        raise AssertionError(f"{key}: uploaded with put")

    monkeypatch.setattr(Store, "create", recording_create)
    monkeypatch.setattr(Store, "put", no_overwrite)
    url = publish_remote(src, bucket.url, step=3)
    assert url == f"{bucket.url}/step-3"
    assert order[-1] == "step-3/manifest.json"
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


def test_publish_loser_of_the_incoming_directory_touches_nothing(src, tmp_path, monkeypatch):
    """Another trainer creates `.incoming-v1` (its --move'd files inside, their only copy) after
    this publish checked but before it could create it: this one fails and removes nothing."""
    root = tmp_path / "root"
    incoming = root / ".incoming-v1"
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    real_mkdir = os.mkdir

    def other_trainer_first(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if os.fspath(path) == os.fspath(incoming) and not incoming.exists():
            real_mkdir(incoming)
            (incoming / "theirs.safetensors").write_bytes(b"the other trainer's only copy")
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", other_trainer_first)
    with pytest.raises(PublishError) as lost:
        publish(src, root, name="v1", move=True)
    assert (incoming / "theirs.safetensors").read_bytes() == b"the other trainer's only copy"
    assert [p.name for p in incoming.iterdir()] == ["theirs.safetensors"]
    assert str(lost.value).startswith(f"{incoming} exists") and "\n" not in str(lost.value)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert sorted(p.name for p in root.iterdir()) == [".incoming-v1"]


def _bucket_version(bucket, name):  # type: ignore[no-untyped-def]
    """The objects under `name` (key → bytes) and its manifest, read with the test's own client."""
    objects = {
        key.removeprefix(f"{name}/"): bucket.client.get_object(Bucket=bucket.name, Key=f"runs/{key}")[
            "Body"
        ].read()
        for key in bucket.listed()
        if key.startswith(f"{name}/")
    }
    return objects, json.loads(objects["manifest.json"])


def _assert_verifies(bucket, name, src, tmp_path):  # type: ignore[no-untyped-def]
    """Every file the manifest lists is in the bucket with its digest, byte for byte `src`'s,
    and the gate takes the downloaded version as ready."""
    import blake3

    objects, manifest = _bucket_version(bucket, name)
    assert sorted(objects) == sorted([*(f["path"] for f in manifest["files"]), "manifest.json"])
    for entry in manifest["files"]:
        data = objects[entry["path"]]
        assert blake3.blake3(data).hexdigest() == entry["blake3"] and len(data) == entry["size"]
        assert data == (src / entry["path"]).read_bytes()
    copy = tmp_path / "downloaded" / name
    copy.mkdir(parents=True)
    for relative, data in objects.items():
        (copy / relative).write_bytes(data)
    assert gate.check(copy, serving=None).status == "ready"


def _attempt(publish_one):  # type: ignore[no-untyped-def]
    try:
        return publish_one()
    except PublishError as exc:
        return exc


@pytest.mark.parametrize("interleaving", ["loser_starts_before_the_winners_manifest", "loser_checked_first"])
def test_publish_remote_loser_never_overwrites_the_winners_shards(
    src, tmp_path, bucket, monkeypatch, interleaving
):
    """Two trainers publish v1 at once. Either the other one starts once this one's shards are
    up, before its manifest; or it found no manifest, then this one published whole before its
    first upload. The winner's bytes stay and its version verifies; the loser fails on the
    first key it finds taken and removes only the object it had created itself."""
    import obstore

    from vllm_reloader.tools.publish import publish_remote

    other = tmp_path / "other-trainer"
    write_weights(other, shards=2, seed=1)  # same names, other bytes
    (other / "a-theirs-only.bin").write_bytes(b"sorted first: the loser creates it, then removes it")
    real_put = obstore.put
    cut_in: list[object] = []

    def winner() -> object:
        return _attempt(lambda: publish_remote(src, bucket.url, name="v1"))

    def loser() -> object:
        return _attempt(lambda: publish_remote(other, bucket.url, name="v1"))

    def interleaved(store, key, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not cut_in and (interleaving == "loser_checked_first" or key == "v1/manifest.json"):
            cut_in.append(None)  # the one cutting in goes straight through
            cut_in[0] = winner() if interleaving == "loser_checked_first" else loser()
        return real_put(store, key, *args, **kwargs)

    monkeypatch.setattr(obstore, "put", interleaved)
    if interleaving == "loser_checked_first":
        lost, won = loser(), cut_in[0]
    else:
        won, lost = winner(), cut_in[0]
    monkeypatch.setattr(obstore, "put", real_put)

    assert {k: v for k, v in _bucket_version(bucket, "v1")[0].items() if k != "manifest.json"} == {
        p.name: p.read_bytes() for p in src.iterdir()
    }, "the winner's shards, byte for byte, and nothing else"
    _assert_verifies(bucket, "v1", src, tmp_path)
    assert won == f"{bucket.url}/v1"
    message = str(lost)
    assert isinstance(lost, PublishError) and "\n" not in message
    assert (
        message.startswith(f"{bucket.url}/v1/config.json already exists") and "never overwritten" in message
    )


def test_publish_remote_whose_manifest_loses_removes_only_the_shards_it_created(
    src, tmp_path, bucket, monkeypatch
):
    """No shard name in common: both publishers' shards go up, the other's manifest lands
    first. This one removes the shards it created, never the winner's, which verifies."""
    import obstore

    from vllm_reloader.tools.publish import publish_remote

    other = tmp_path / "other-trainer"
    write_weights(other, shards=1, config={"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    (other / "config.json").rename(other / "config-other.json")
    real_put = obstore.put
    racing = {"done": False}

    def interleaved(store, key, *args, **kwargs):  # type: ignore[no-untyped-def]
        if key == "v1/manifest.json" and not racing["done"]:
            racing["done"] = True
            assert publish_remote(other, bucket.url, name="v1") == f"{bucket.url}/v1"
        return real_put(store, key, *args, **kwargs)

    monkeypatch.setattr(obstore, "put", interleaved)
    with pytest.raises(PublishError, match=r"v1/manifest\.json already exists") as lost:
        publish_remote(src, bucket.url, name="v1")
    monkeypatch.setattr(obstore, "put", real_put)
    assert "never overwritten" in str(lost.value)
    _assert_verifies(bucket, "v1", other, tmp_path)


def test_publish_remote_keeps_its_manifest_that_landed_before_a_retry_said_it_exists(
    src, tmp_path, bucket, monkeypatch
):
    """The manifest's PUT landed but its answer was lost; the retry gets 412. The bytes there
    are this publish's own manifest: it succeeded, and nothing is removed."""
    from vllm_reloader.sources.objstore import Store
    from vllm_reloader.tools.publish import publish_remote

    real_create = Store.create

    def create(self, key, data):  # type: ignore[no-untyped-def]
        created = real_create(self, key, data)
        return False if key.endswith("/manifest.json") else created

    monkeypatch.setattr(Store, "create", create)
    assert publish_remote(src, bucket.url, name="v1") == f"{bucket.url}/v1"
    _assert_verifies(bucket, "v1", src, tmp_path)


def test_publish_remote_after_a_crash_says_what_to_delete_and_touches_nothing(src, tmp_path, bucket):
    """A publish killed midway left shards and no manifest. A new publish of the name removes
    none of them (it cannot know whose they are) and says how to publish again."""
    from vllm_reloader.tools.publish import publish_remote

    bucket.put("v1/config.json", b"left by a crashed publish")
    with pytest.raises(PublishError) as caught:
        publish_remote(src, bucket.url, name="v1")
    message = str(caught.value)
    assert message.startswith(f"{bucket.url}/v1/config.json already exists") and "\n" not in message
    assert f"delete everything under {bucket.url}/v1/" in message
    assert bucket.listed() == ["v1/config.json"]
    bucket.client.delete_object(Bucket=bucket.name, Key="runs/v1/config.json")  # as the message says
    assert publish_remote(src, bucket.url, name="v1") == f"{bucket.url}/v1"
    _assert_verifies(bucket, "v1", src, tmp_path)


def test_publish_remote_failing_midway_removes_what_it_uploaded(src, bucket, monkeypatch):
    import obstore

    from vllm_reloader.errors import SourceError
    from vllm_reloader.tools.publish import publish_remote

    real_put = obstore.put
    calls = {"n": 0}

    def reset_on_the_second(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(104, "Connection reset by peer")
        return real_put(*args, **kwargs)

    monkeypatch.setattr(obstore, "put", reset_on_the_second)
    with pytest.raises(SourceError, match="Connection reset"):
        publish_remote(src, bucket.url, name="v1")
    assert bucket.listed() == []


def test_publish_remote_refuses_a_file_larger_than_one_s3_put_before_uploading(src, bucket):
    """Create-only uploads are one PUT each, and S3 takes at most 5 GiB in one."""
    from vllm_reloader.tools.publish import publish_remote

    with (src / "model-huge.safetensors").open("wb") as f:
        f.truncate((5 << 30) + 1)  # sparse: no disk used
    with pytest.raises(PublishError, match=r"model-huge\.safetensors: 5368709121 bytes.*at most 5 GiB"):
        publish_remote(src, bucket.url, name="v1")
    assert bucket.listed() == []


def test_publish_remote_whose_manifest_may_have_landed_removes_nothing(src, bucket, monkeypatch):
    """The manifest's PUT fails with no answer (it may have landed): every shard stays."""
    import obstore

    from vllm_reloader.tools.publish import publish_remote

    real_put = obstore.put

    def no_answer_for_the_manifest(store, key, *args, **kwargs):  # type: ignore[no-untyped-def]
        if key == "v1/manifest.json":
            raise OSError(110, "Connection timed out")
        return real_put(store, key, *args, **kwargs)

    monkeypatch.setattr(obstore, "put", no_answer_for_the_manifest)
    with pytest.raises(PublishError, match=r"whether its manifest landed is unknown") as caught:
        publish_remote(src, bucket.url, name="v1")
    assert f"delete everything under {bucket.url}/v1/ and publish again" in str(caught.value)
    assert sorted(bucket.listed()) == sorted(f"v1/{p.name}" for p in src.iterdir())


def test_publish_remote_unreadable_file_removes_what_it_uploaded(src, bucket, monkeypatch):
    from vllm_reloader.tools.publish import publish_remote

    real = publish_module._read_and_hash
    calls = {"n": 0}

    def denied_on_the_second(path):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(publish_module, "_read_and_hash", denied_on_the_second)
    with pytest.raises(PublishError, match="publishing v1: Permission denied"):
        publish_remote(src, bucket.url, name="v1")
    assert bucket.listed() == []


def test_publish_loser_of_the_final_rename_keeps_the_winners_version(src, tmp_path, monkeypatch):
    """Another publish of v1 runs whole between this one's existence check and its mkdir."""
    root = tmp_path / "root"
    other = tmp_path / "other-trainer"
    write_weights(other, shards=1, seed=1)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    real_mkdir = os.mkdir
    racing = {"done": False}

    def other_wins(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if os.fspath(path) == os.fspath(root / ".incoming-v1") and not racing["done"]:
            racing["done"] = True
            assert publish(other, root, name="v1") == root / "v1"
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", other_wins)
    with pytest.raises(PublishError, match="v1 already exists; versions are never overwritten"):
        publish(src, root, name="v1", move=True)
    assert gate.check(root / "v1", serving=None).status == "ready"
    assert (root / "v1" / "model.safetensors").read_bytes() == (other / "model.safetensors").read_bytes()
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert sorted(p.name for p in root.iterdir()) == ["v1"]
