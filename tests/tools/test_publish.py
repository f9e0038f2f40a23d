import json
import os

import pytest

from tests.support.checkpoints import write_weights
from tests.support.store_fixtures import OBJECT_STORES
from vllm_reloader.checkpoint import gate
from vllm_reloader.errors import PublishError
from vllm_reloader.tools import publish as publish_module
from vllm_reloader.tools import upload as upload_module
from vllm_reloader.tools.publish import publish

pytestmark = pytest.mark.stores(*OBJECT_STORES)


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


def test_publish_into_s3_claims_the_name_streams_the_files_then_creates_the_manifest(
    src, bucket, monkeypatch
):
    """The claim first (create-only), each file streamed up overwriting (never read whole: the
    upload reads an open file), the manifest last (create-only), then the claim deleted."""
    import obstore

    from vllm_reloader.tools.upload import publish_remote

    calls: list[tuple[str, object, str]] = []
    claims: list[dict[str, object]] = []
    real_put, real_delete = obstore.put, obstore.delete

    def recording_put(store, key, data, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(("put", kwargs.get("mode"), key))
        if key.endswith("/.publishing"):
            claims.append(json.loads(data))
        assert key.endswith(("/.publishing", "/manifest.json")) or hasattr(data, "read"), "streamed"
        return real_put(store, key, data, *args, **kwargs)

    def recording_delete(store, keys):  # type: ignore[no-untyped-def]
        calls.extend(("delete", None, key) for key in ([keys] if isinstance(keys, str) else keys))
        return real_delete(store, keys)

    monkeypatch.setattr(obstore, "put", recording_put)
    monkeypatch.setattr(obstore, "delete", recording_delete)
    url = publish_remote(src, bucket.url, step=3)
    assert url == f"{bucket.url}/step-3"
    files = sorted(f"step-3/{p.name}" for p in src.iterdir())
    assert calls == [
        ("put", "create", "step-3/.publishing"),
        *(("put", "overwrite", key) for key in files),
        ("put", "create", "step-3/manifest.json"),
        ("delete", None, "step-3/.publishing"),
    ]
    assert [sorted(c) for c in claims] == [["host", "id", "pid", "started_at", "version"]]
    assert claims[0]["pid"] == os.getpid() and claims[0]["version"] == "step-3"
    manifest = json.loads(bucket.read("step-3/manifest.json"))
    assert manifest["step"] == 3 and all(len(f["blake3"]) == 64 for f in manifest["files"])
    assert sorted(bucket.listed()) == sorted([*files, "step-3/manifest.json"])


def test_publish_into_s3_never_overwrites_a_version(src, bucket):
    from vllm_reloader.sources.objstore import Store
    from vllm_reloader.tools.upload import publish_remote

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
    real = publish_module.listed

    def fails_on_the_second(fd, path):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise failure
        return real(fd, path)

    monkeypatch.setattr(publish_module, "listed", fails_on_the_second)
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


def _bucket_objects(bucket, name):  # type: ignore[no-untyped-def]
    """The objects under `name` (key → bytes), read with the test's own client."""
    return {
        key.removeprefix(f"{name}/"): bucket.read(key)
        for key in bucket.listed()
        if key.startswith(f"{name}/")
    }


def _bucket_version(bucket, name):  # type: ignore[no-untyped-def]
    """The objects under `name` (key → bytes) and its manifest."""
    objects = _bucket_objects(bucket, name)
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


def _claim_error(bucket, name="v1"):  # type: ignore[no-untyped-def]
    return f"{bucket.url}/{name}/.publishing exists: another publish of {name} is running or crashed"


@pytest.mark.parametrize(
    "interleaving",
    [
        "winner_whole_before_the_losers_claim",
        "loser_while_the_winner_uploads",
        "loser_before_the_winners_manifest",
    ],
)
def test_publish_remote_loser_never_overwrites_the_winners_files(
    src, tmp_path, bucket, monkeypatch, interleaving
):
    """Two trainers publish v1 at once, same file names, other bytes. The other one runs whole
    either once this one found no manifest but before it claimed the name, or once this one
    holds the claim: while it uploads, or just before its manifest. The winner's bytes stay and
    its version verifies; the loser fails in one line, uploads nothing, and leaves no claim."""
    import obstore

    from vllm_reloader.tools.upload import publish_remote

    other = tmp_path / "other-trainer"
    write_weights(other, shards=2, seed=1)  # same names, other bytes
    (other / "a-theirs-only.bin").write_bytes(b"sorted first: the loser would upload it first")
    real_put = obstore.put
    cut_in: list[object] = []
    at = {
        "winner_whole_before_the_losers_claim": None,  # at the loser's first PUT: its claim
        "loser_while_the_winner_uploads": "v1/model-00001-of-00002.safetensors",
        "loser_before_the_winners_manifest": "v1/manifest.json",
    }[interleaving]

    def winner() -> object:
        return _attempt(lambda: publish_remote(src, bucket.url, name="v1"))

    def loser() -> object:
        return _attempt(lambda: publish_remote(other, bucket.url, name="v1"))

    def interleaved(store, key, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not cut_in and key == (at or key):
            cut_in.append(None)  # the one cutting in goes straight through
            cut_in[0] = winner() if interleaving == "winner_whole_before_the_losers_claim" else loser()
        return real_put(store, key, *args, **kwargs)

    monkeypatch.setattr(obstore, "put", interleaved)
    if interleaving == "winner_whole_before_the_losers_claim":
        lost, won = loser(), cut_in[0]
    else:
        won, lost = winner(), cut_in[0]
    monkeypatch.setattr(obstore, "put", real_put)

    assert {k: v for k, v in _bucket_version(bucket, "v1")[0].items() if k != "manifest.json"} == {
        p.name: p.read_bytes() for p in src.iterdir()
    }, "the winner's files, byte for byte, and nothing else (no claim left)"
    _assert_verifies(bucket, "v1", src, tmp_path)
    assert won == f"{bucket.url}/v1"
    message = str(lost)
    assert isinstance(lost, PublishError) and "\n" not in message
    if interleaving == "winner_whole_before_the_losers_claim":
        assert message == f"{bucket.url}/v1 already exists; versions are never overwritten"
    else:
        assert message.startswith(_claim_error(bucket)), message


def test_publish_remote_refuses_a_claim_a_crash_left_and_touches_nothing(src, tmp_path, bucket):
    """A publish killed midway left its claim and some files, no manifest. A new publish of the
    name fails in one line naming the claim, touches nothing, and says what to delete."""
    from vllm_reloader.tools.upload import publish_remote

    claim = json.dumps({"host": "trainer-7", "pid": 4242, "started_at": "2026-12-01T10:00:00+00:00"})
    bucket.put("v1/.publishing", claim.encode())
    bucket.put("v1/config.json", b"left by a crashed publish")
    with pytest.raises(PublishError) as caught:
        publish_remote(src, bucket.url, name="v1")
    message = str(caught.value)
    assert message.startswith(_claim_error(bucket)) and "\n" not in message
    assert "or crashed (claimed by pid 4242 on trainer-7 at 2026-12-01T10:00:00+00:00); if none" in message
    assert f"delete everything under {bucket.url}/v1/ and publish again" in message
    assert sorted(bucket.listed()) == ["v1/.publishing", "v1/config.json"]
    assert _bucket_objects(bucket, "v1")[".publishing"] == claim.encode()
    for key in bucket.listed():  # as the message says
        bucket.delete(key)
    assert publish_remote(src, bucket.url, name="v1") == f"{bucket.url}/v1"
    _assert_verifies(bucket, "v1", src, tmp_path)


def test_publish_remote_refuses_a_name_holding_a_foreign_file_and_removes_its_claim(src, bucket):
    """Another writer's file under v1/ (no claim, no manifest): refused, the file left as it
    is, and the claim this publish made is gone."""
    from vllm_reloader.tools.upload import publish_remote

    bucket.put("v1/notes.txt", b"a foreign writer's")
    bucket.put("v10/config.json", b"another name: not in v1/")
    with pytest.raises(PublishError) as caught:
        publish_remote(src, bucket.url, name="v1")
    message = str(caught.value)
    assert message.startswith(f"{bucket.url}/v1/notes.txt already exists") and "\n" not in message
    assert "never overwritten" in message and f"delete everything under {bucket.url}/v1/" in message
    assert sorted(bucket.listed()) == ["v1/notes.txt", "v10/config.json"]
    assert _bucket_objects(bucket, "v1") == {"notes.txt": b"a foreign writer's"}


@pytest.mark.stores("s3")
def test_publish_remote_uploads_a_file_larger_than_a_part_in_parts_and_it_verifies(
    src, tmp_path, bucket, monkeypatch
):
    """A file over the part size goes up as a multipart upload (moto takes parts of 5 MiB and
    more), and the manifest's digest is of the bytes uploaded."""
    import obstore

    from vllm_reloader.tools.upload import publish_remote

    monkeypatch.setattr(upload_module, "PART_SIZE", 5 << 20)
    (src / "optimizer.bin").write_bytes(os.urandom((11 << 20) + 12345))  # 3 parts: 5, 5, 1 MiB
    real_put = obstore.put
    part_sizes: dict[str, int] = {}

    def recording(store, key, data, *args, **kwargs):  # type: ignore[no-untyped-def]
        if "chunk_size" in kwargs:
            part_sizes[key] = kwargs["chunk_size"]
        return real_put(store, key, data, *args, **kwargs)

    monkeypatch.setattr(obstore, "put", recording)
    assert publish_remote(src, bucket.url, name="v1") == f"{bucket.url}/v1"
    assert part_sizes["v1/optimizer.bin"] == 5 << 20
    head = bucket.client.head_object(Bucket=bucket.name, Key="runs/v1/optimizer.bin")
    assert head["ETag"].strip('"').endswith("-3"), "a multipart upload of 3 parts"
    assert head["ContentLength"] == (11 << 20) + 12345
    _assert_verifies(bucket, "v1", src, tmp_path)


def test_publish_remote_part_size_grows_past_10000_parts():
    """S3 takes at most 10,000 parts in one upload: a file of more grows its parts instead."""
    part = upload_module.PART_SIZE
    assert upload_module._part_size(0) == part
    assert upload_module._part_size(10_000 * part) == part
    assert upload_module._part_size(10_000 * part + 1) == part + 1
    assert upload_module._part_size(5 << 40) * 10_000 >= 5 << 40


def test_publish_remote_failing_midway_removes_only_what_it_uploaded_and_its_claim(src, bucket, monkeypatch):
    """The second file's upload fails. This publish's first file and its claim are removed;
    what others put in the bucket meanwhile, in v1/ or elsewhere, stays."""
    import obstore

    from vllm_reloader.errors import SourceError
    from vllm_reloader.tools.upload import publish_remote

    bucket.put("v0/config.json", b"another version")
    real_put = obstore.put
    first, second = sorted(p.name for p in src.iterdir())[:2]

    def reset_on_the_second(store, key, *args, **kwargs):  # type: ignore[no-untyped-def]
        if key == f"v1/{second}":
            assert sorted(bucket.listed()) == ["v0/config.json", "v1/.publishing", f"v1/{first}"]
            bucket.put("v1/foreign.txt", b"a writer that takes no claim")
            raise OSError(104, "Connection reset by peer")
        return real_put(store, key, *args, **kwargs)

    monkeypatch.setattr(obstore, "put", reset_on_the_second)
    with pytest.raises(SourceError, match="Connection reset"):
        publish_remote(src, bucket.url, name="v1")
    assert sorted(bucket.listed()) == ["v0/config.json", "v1/foreign.txt"]


def test_publish_remote_unreadable_file_removes_what_it_uploaded(src, bucket, monkeypatch):
    from vllm_reloader.tools.upload import publish_remote

    real = upload_module._open_hashing
    calls = {"n": 0}

    def denied_on_the_second(path):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(upload_module, "_open_hashing", denied_on_the_second)
    with pytest.raises(PublishError, match="publishing v1: Permission denied"):
        publish_remote(src, bucket.url, name="v1")
    assert bucket.listed() == []


@pytest.mark.parametrize("change", ["appended", "rewritten_same_size", "replaced"])
def test_publish_remote_fails_when_a_file_changes_while_it_uploads(src, bucket, monkeypatch, change):
    """A trainer still writing a file: what was uploaded is not the file any more. The publish
    fails naming it and removes what it uploaded, claim included."""
    import obstore

    from vllm_reloader.tools.upload import publish_remote

    real_put = obstore.put
    path = src / "config.json"

    def trainer_writes_meanwhile(store, key, *args, **kwargs):  # type: ignore[no-untyped-def]
        result = real_put(store, key, *args, **kwargs)
        if key == "v1/config.json":
            data = path.read_bytes()
            if change == "appended":
                path.write_bytes(data + b" ")
            elif change == "rewritten_same_size":
                path.write_bytes(data[::-1])
                stat = path.stat()
                os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
            else:
                (src / "config.new").write_bytes(data)
                os.replace(src / "config.new", path)
        return result

    monkeypatch.setattr(obstore, "put", trainer_writes_meanwhile)
    with pytest.raises(PublishError, match=r"config\.json changed while it was being uploaded"):
        publish_remote(src, bucket.url, name="v1")
    assert bucket.listed() == []


@pytest.mark.parametrize("lost_answer", ["manifest.json", ".publishing"])
def test_publish_remote_whose_create_landed_before_a_retry_said_it_exists_goes_on(
    src, tmp_path, bucket, monkeypatch, lost_answer
):
    """A create-only PUT (the manifest's, the claim's) landed but its answer was lost; the retry
    gets 412. The bytes there are this publish's own: it goes on, and succeeds."""
    from vllm_reloader.sources.objstore import Store
    from vllm_reloader.tools.upload import publish_remote

    real_create = Store.create

    def create(self, key, data):  # type: ignore[no-untyped-def]
        created = real_create(self, key, data)
        return False if key.endswith(f"/{lost_answer}") else created

    monkeypatch.setattr(Store, "create", create)
    assert publish_remote(src, bucket.url, name="v1") == f"{bucket.url}/v1"
    _assert_verifies(bucket, "v1", src, tmp_path)


def test_publish_remote_whose_manifest_loses_to_a_writer_without_claim_keeps_the_winners_version(
    src, tmp_path, bucket, monkeypatch
):
    """A writer that takes no claim (a trainer writing into the bucket) publishes v1, no file
    name in common, just before this publish's manifest. This one fails, removes its own files
    and its claim, never the other's, whose version verifies."""
    import obstore

    from tests.support.checkpoints import write_manifest
    from vllm_reloader.tools.upload import publish_remote

    other = tmp_path / "other-trainer"
    write_weights(other, shards=1, config={"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    (other / "config.json").rename(other / "config-other.json")
    write_manifest(other, overrides={"version": "v1"})
    real_put = obstore.put

    racing = {"done": False}

    def interleaved(store, key, *args, **kwargs):  # type: ignore[no-untyped-def]
        if key == "v1/manifest.json" and not racing["done"]:
            racing["done"] = True
            bucket.upload_dir(other, "v1")
        return real_put(store, key, *args, **kwargs)

    monkeypatch.setattr(obstore, "put", interleaved)
    with pytest.raises(PublishError) as lost:
        publish_remote(src, bucket.url, name="v1")
    message = str(lost.value)
    assert message.startswith(f"{bucket.url}/v1/manifest.json already exists") and "\n" not in message
    assert "never overwritten" in message and "removed 3 of the 3 files it uploaded" in message
    _assert_verifies(bucket, "v1", other, tmp_path)


def test_publish_remote_whose_manifest_may_have_landed_removes_nothing(src, bucket, monkeypatch):
    """The manifest's PUT fails with no answer (it may have landed): every file stays, and the
    claim too; the error says what to check."""
    import obstore

    from vllm_reloader.tools.upload import publish_remote

    real_put = obstore.put

    def no_answer_for_the_manifest(store, key, *args, **kwargs):  # type: ignore[no-untyped-def]
        if key == "v1/manifest.json":
            raise OSError(110, "Connection timed out")
        return real_put(store, key, *args, **kwargs)

    monkeypatch.setattr(obstore, "put", no_answer_for_the_manifest)
    with pytest.raises(PublishError, match=r"whether its manifest landed is unknown") as caught:
        publish_remote(src, bucket.url, name="v1")
    message = str(caught.value)
    assert "\n" not in message
    assert (
        f"if {bucket.url}/v1/manifest.json exists, v1 is published: delete {bucket.url}/v1/.publishing"
        in message
    )
    assert f"delete everything under {bucket.url}/v1/ and publish again" in message
    assert sorted(bucket.listed()) == sorted(["v1/.publishing", *(f"v1/{p.name}" for p in src.iterdir())])


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


def test_publish_syncs_every_copy_before_its_manifest_a_few_at_a_time(src, tmp_path, monkeypatch):
    """Each copy is closed first (a watching daemon reads it then), synced later through a
    descriptor opened before that close, all before the manifest is written."""
    monkeypatch.setattr(publish_module, "KEPT_OPEN", 2)  # and a few at a time
    events: list[str] = []
    real_fsync, real_write = os.fsync, publish_module.write_synced

    def fsync(fd: int) -> None:
        events.append("sync " + os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(
        publish_module, "write_synced", lambda p, d: (events.append("manifest"), real_write(p, d))
    )
    for extra in ("a.json", "b.json", "c.json"):
        (src / extra).write_text("{}")
    publish(src, tmp_path / "root", name="v1")
    copied = sorted(p.name for p in src.iterdir())
    synced = [e.removeprefix("sync ") for e in events[: events.index("manifest")] if e.startswith("sync ")]
    assert sorted(synced) == copied
