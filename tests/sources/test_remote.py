"""The object-store source against moto's real S3 wire protocol on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import structlog

from tests.support.checkpoints import MakeCheckpoint, hf_index, write_manifest, write_weights
from tests.support.daemon_fixtures import wait_for_event
from tests.support.fake_engine import FakeEngine, FakeEngineServer
from tests.support.records import open_records, source_records
from tests.support.store_fixtures import OBJECT_STORES, SETTLE_FOR, STORES, WRITABLE, Bucket, new_bucket
from vllm_reloader import config
from vllm_reloader.checkpoint import completeness, gate, order, verified
from vllm_reloader.checkpoint.completeness import DirectoryListing, Listed
from vllm_reloader.checkpoint.conventions import Convention
from vllm_reloader.checkpoint.files import INDEX_NAME
from vllm_reloader.checkpoint.manifest import parse
from vllm_reloader.errors import KeyUnreadable, SourceError
from vllm_reloader.service.control import Reply
from vllm_reloader.service.daemon import Daemon
from vllm_reloader.service.messages import ControlRequest
from vllm_reloader.sources.filestore import FileStore
from vllm_reloader.sources.listing import BucketListing, judge
from vllm_reloader.sources.objstore import Object, Store
from vllm_reloader.sources.remote import Downloaded, Rejected, RemoteSource

pytestmark = pytest.mark.stores(*STORES)


class Harness:
    def __init__(self, tmp_path: Path, bucket_url: str, **state: Any) -> None:
        self.cfg = config.Config(
            source=config.SourceConfig(path=bucket_url, part_size=4096, download_concurrency=4),
            engine=config.EngineConfig(url="http://127.0.0.1:1"),
            state=config.StateConfig(dir=tmp_path / "state", **{"min_free_bytes": 0, **state}),
        )
        self.posted: list[Downloaded | Rejected] = []
        self.serving_key = order.NOTHING
        self.source = RemoteSource(
            self.cfg,
            serving=lambda: self.serving_key,
            rejected=dict,
            post=self.posted.append,
            **source_records(self.cfg.state.dir),
        )

    @property
    def root(self) -> Path:
        return self.cfg.checkpoint_root

    def fetched(self) -> list[str]:
        """The names downloaded (each placed as `NAME@<fingerprint>`)."""
        return [order.base_name(m.name) for m in self.posted if isinstance(m, Downloaded)]

    def placed(self, name: str) -> Path:
        """Where the newest download of `name` was placed (`ROOT/NAME` when none was)."""
        found = (
            [p for p in self.root.glob("*") if order.base_name(p.name) == name] if self.root.exists() else []
        )
        return max(found, key=lambda p: p.stat().st_mtime_ns) if found else self.root / name

    def rejected(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(m) for m in self.posted if isinstance(m, Rejected)]


@pytest.fixture
def checkpoint(make_checkpoint: MakeCheckpoint, tmp_path: Path) -> Path:
    """Three shards of a few KiB each: several ranged GETs apiece at part_size 4096."""
    return make_checkpoint("step-5", step=5, root=tmp_path / "src", shards=3)


def test_remote_manifest_uploaded_last_is_the_signal(tmp_path, bucket: Bucket, checkpoint: Path):
    harness = Harness(tmp_path, bucket.url)
    bucket.upload_dir(checkpoint, "step-5", skip=("manifest.json",))
    harness.source.poll()
    assert harness.posted == [] and not harness.root.exists()
    bucket.put("step-5/manifest.json", (checkpoint / "manifest.json").read_bytes())
    with structlog.testing.capture_logs() as logs:
        harness.source.poll()
    assert harness.fetched() == ["step-5"]
    placed = harness.placed("step-5")
    assert gate.check(placed, serving=None).status == "ready"
    for path in checkpoint.iterdir():
        assert (placed / path.name).read_bytes() == path.read_bytes()
    finished = next(e for e in logs if e["event"] == "download.finished")
    assert finished["bytes"] == sum(
        p.stat().st_size for p in checkpoint.iterdir() if p.name != "manifest.json"
    )
    assert not (harness.cfg.cache_dir / "staging" / "step-5").exists()


def test_remote_shard_still_uploading_is_pending_then_loads(tmp_path, bucket: Bucket, checkpoint: Path):
    harness = Harness(tmp_path, bucket.url)
    late = sorted(checkpoint.glob("*.safetensors"))[-1].name
    bucket.upload_dir(checkpoint, "step-5", skip=(late,))  # a writer that sends the manifest early
    with structlog.testing.capture_logs() as logs:
        harness.source.poll()
        harness.source.poll()
    pending = [e for e in logs if e["event"] == "checkpoint.pending"]
    assert len(pending) == 1 and late in pending[0]["reason"], "one line per change, not per poll"
    assert harness.source.pending == {"step-5": pending[0]["reason"]}
    assert harness.fetched() == []
    bucket.put(f"step-5/{late}", (checkpoint / late).read_bytes())
    harness.source.poll()
    assert harness.fetched() == ["step-5"] and harness.source.pending == {}


def test_remote_wrong_digest_is_rejected_and_never_placed(tmp_path, bucket: Bucket, checkpoint: Path):
    harness = Harness(tmp_path, bucket.url)
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: moto stores it without complaint
    bucket.upload_dir(checkpoint, "step-5", skip=(shard.name, "manifest.json"))
    bucket.put(f"step-5/{shard.name}", bytes(data))
    bucket.put("step-5/manifest.json", (checkpoint / "manifest.json").read_bytes())
    harness.source.poll()
    (rejection,) = harness.rejected()
    assert rejection["name"] == "step-5" and rejection["check"] == "digests"
    assert f"{shard.name}: blake3 mismatch" in rejection["reason"]
    assert not (harness.placed("step-5")).exists()
    assert not (harness.cfg.cache_dir / "staging" / "step-5").exists()
    harness.source.poll()
    assert len(harness.rejected()) == 1, "not downloaded again until the manifest changes"


def test_remote_only_newer_than_serving_and_newest_first(tmp_path, bucket: Bucket, make_checkpoint):
    harness = Harness(tmp_path, bucket.url)
    for step in (3, 4, 6):
        bucket.upload_dir(make_checkpoint(f"step-{step}", step=step, root=tmp_path / "src"), f"step-{step}")
    harness.serving_key = order.Serving(order.order_key("step-4", 4))
    harness.source.poll()
    harness.source.poll()
    assert harness.fetched() == ["step-6"], "one download per poll, the newest; never older than serving"


@pytest.mark.stores("s3")
def test_remote_wrong_credentials_one_clear_line_and_keeps_polling(
    tmp_path, bucket: Bucket, checkpoint: Path, s3_auth_enforced
):
    harness = Harness(tmp_path, bucket.url)
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            harness.source.poll()
    failed = [e for e in logs if e["event"] == "source.failed"]
    assert len(failed) == 1, logs
    assert "InvalidAccessKeyId" in failed[0]["reason"] and "\n" not in failed[0]["reason"]
    assert failed[0]["reason"].startswith(f"LIST {bucket.url}")


@pytest.mark.stores("s3")
def test_remote_recovers_when_credentials_start_working(tmp_path, bucket: Bucket, checkpoint: Path):
    from moto import settings

    bucket.upload_dir(checkpoint, "step-5")
    harness = Harness(tmp_path, bucket.url)
    before = settings.INITIAL_NO_AUTH_ACTION_COUNT
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    try:
        with structlog.testing.capture_logs() as logs:
            harness.source.poll()
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = before
    assert [e["event"] for e in logs] == ["source.failed"]
    with structlog.testing.capture_logs() as logs:
        harness.source.poll()
    assert "source.recovered" in [e["event"] for e in logs]
    assert harness.fetched() == ["step-5"]


def test_remote_missing_bucket_is_reported_once_then_picked_up(tmp_path, s3_env, checkpoint: Path):
    bucket = new_bucket(s3_env, create=False)
    harness = Harness(tmp_path, bucket.url)
    with structlog.testing.capture_logs() as logs:
        harness.source.poll()
        harness.source.poll()
    (failed,) = [e for e in logs if e["event"] == "source.failed"]
    assert "NoSuchBucket" in failed["reason"]
    bucket.client.create_bucket(Bucket=bucket.name)
    bucket.upload_dir(checkpoint, "step-5")
    harness.source.poll()
    assert harness.fetched() == ["step-5"]


def test_remote_unreachable_store_is_one_line(tmp_path, monkeypatch, checkpoint: Path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    cfg_url = "s3://nowhere/runs"
    harness = Harness(tmp_path, cfg_url)
    harness.source.store = Store(cfg_url, endpoint_url="http://127.0.0.1:9", timeout=2)
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            harness.source.poll()
    (failed,) = [e for e in logs if e["event"] == "source.failed"]  # once, not at every poll
    assert failed["reason"] == "LIST s3://nowhere/runs: connection refused by http://127.0.0.1:9"
    assert "cause: Connection refused" in harness.source.problems["source"], "status: the store's words"


def test_remote_short_of_disk_space_says_so_and_starts_nothing(tmp_path, bucket: Bucket, checkpoint: Path):
    bucket.upload_dir(checkpoint, "step-5")
    harness = Harness(tmp_path, bucket.url, min_free_bytes=1 << 60)
    with structlog.testing.capture_logs() as logs:
        harness.source.poll()
        harness.source.poll()
    (failed,) = [e for e in logs if e["event"] == "download.failed"]
    assert failed["reason"].startswith("not enough space in ") and "GB is free" in failed["reason"]
    assert harness.fetched() == [] and not (harness.placed("step-5")).exists()


def test_remote_manifest_refetched_only_when_its_etag_changes(tmp_path, bucket: Bucket, checkpoint: Path):
    harness = Harness(tmp_path, bucket.url)
    bucket.upload_dir(checkpoint, "step-5", skip=(sorted(checkpoint.glob("*.safetensors"))[0].name,))
    gets: list[str] = []
    real_get = harness.source.store.get
    harness.source.store.get = lambda key: (gets.append(key), real_get(key))[1]  # type: ignore[method-assign]
    for _ in range(3):
        harness.source.poll()
    assert gets == ["step-5/manifest.json"]
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["step"] = 6
    bucket.put("step-5/manifest.json", json.dumps(manifest).encode())
    harness.source.poll()
    assert gets == ["step-5/manifest.json"] * 2


def test_judge_rejects_unsafe_paths_and_oversized_objects():
    def remote(files: list[dict[str, Any]]) -> Listed:
        data = json.dumps({"format_version": 1, "files": files}).encode()
        return Listed(parse(data), "fp")

    def listing(objects: dict[str, Object]) -> BucketListing:
        return BucketListing(objects, {}, lambda _name, _object: None)

    unsafe = judge(remote([{"path": "../x.safetensors", "size": 1}]), listing({}))
    assert unsafe is not None and unsafe.status == "rejected" and unsafe.check == "paths"
    big = judge(remote([{"path": "a.safetensors", "size": 1}]), listing({"a.safetensors": Object(2, '"e"')}))
    assert big is not None and big.status == "rejected" and big.check == "sizes"
    short = judge(
        remote([{"path": "a.safetensors", "size": 3}]), listing({"a.safetensors": Object(2, '"e"')})
    )
    assert short is not None and short.status == "pending"
    assert (
        judge(remote([{"path": "a.safetensors", "size": 2}]), listing({"a.safetensors": Object(2, '"e"')}))
        is None
    )


def test_remote_ignores_temporary_names_in_the_store(tmp_path, bucket: Bucket, checkpoint: Path):
    harness = Harness(tmp_path, bucket.url)
    bucket.upload_dir(checkpoint, "tmp-checkpoint-5")
    bucket.upload_dir(checkpoint, ".staging-5")
    harness.source.poll()
    assert harness.posted == [] and harness.source.seen == {}


@pytest.mark.stores(*OBJECT_STORES, "gcs")
def test_remote_manifest_that_is_not_json_is_rejected_at_once(tmp_path, bucket: Bucket, checkpoint: Path):
    harness = Harness(tmp_path, bucket.url)
    bucket.upload_dir(checkpoint, "step-5", skip=("manifest.json",))
    bucket.put("step-5/manifest.json", b'{"format_version": 1, "fil')
    harness.source.poll()
    (rejection,) = harness.rejected()
    assert rejection["check"] == "manifest" and "not valid JSON" in rejection["reason"]


@pytest.mark.stores("file")
def test_remote_manifest_on_a_shared_root_may_be_mid_write_for_its_grace(
    tmp_path, bucket: Bucket, checkpoint: Path
):
    """A file on a shared root is listed as it is written: an unparsable manifest is pending for
    `manifest_grace` after its last change, as in a local root, then rejected."""
    harness = Harness(tmp_path, bucket.url)
    bucket.upload_dir(checkpoint, "step-5", skip=("manifest.json",))
    bucket.put("step-5/manifest.json", b'{"format_version": 1, "fil')
    harness.source.poll()
    assert harness.rejected() == [] and "step-5" in harness.source.pending
    manifest = bucket.client / "runs" / "step-5" / "manifest.json"
    os.utime(manifest, (time.time() - 11, time.time() - 11))  # its writer gave up 11 s ago
    time.sleep(SETTLE_FOR + 0.01)  # out of the window its ctime opened
    harness.source.poll()
    (rejection,) = harness.rejected()
    assert rejection["check"] == "manifest" and "not valid JSON" in rejection["reason"]


@pytest.mark.stores(*WRITABLE)
def test_remote_version_written_by_publish_keeps_its_manifest_bytes(tmp_path, bucket: Bucket, checkpoint):
    write_manifest(checkpoint, step=5)
    harness = Harness(tmp_path, bucket.url)
    bucket.upload_dir(checkpoint, "step-5")
    harness.source.poll()
    placed = harness.placed("step-5") / "manifest.json"
    assert placed.read_bytes() == (checkpoint / "manifest.json").read_bytes(), "same fingerprint locally"


# -- the daemon with an object-store source ------------------------------------------------


def remote_daemon(
    tmp_path: Path, bucket: Bucket, engine: FakeEngine, **state: Any
) -> tuple[Daemon, threading.Thread]:
    (tmp_path / "state").mkdir(exist_ok=True)  # the daemon never makes it
    cfg = config.Config(
        source=config.SourceConfig(path=bucket.url, poll_interval=0.1, pending_recheck_interval=0.05),
        engine=config.EngineConfig(url="http://engine.test", retry_initial=0.05, retry_max=0.2),
        state=config.StateConfig(dir=tmp_path / "state", **{"min_free_bytes": 0, **state}),
    )
    daemon = Daemon(cfg, client=engine.client(retry_initial=0.05))
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    return daemon, thread


def wait_for(logs: list[dict], event: str, timeout: float = 15.0, **fields: object) -> dict:
    return wait_for_event(logs, event, timeout, **fields)


@pytest.mark.stores(*WRITABLE)
def test_daemon_loads_from_the_bucket_and_keeps_only_what_it_may_need(
    tmp_path, bucket: Bucket, make_checkpoint: MakeCheckpoint
):
    from vllm_reloader.tools.upload import publish_remote

    startup = make_checkpoint("startup", root=tmp_path / "models")
    engine = FakeEngine(startup=str(startup))
    with structlog.testing.capture_logs() as logs:
        daemon, thread = remote_daemon(tmp_path, bucket, engine, keep=1)
        try:
            wait_for(logs, "engine.reconciled")
            for step in (2, 3, 4):
                src = make_checkpoint(f"out-{step}", root=tmp_path / "trainer", seed=step)
                publish_remote(src, bucket.url, step=step)
                wait_for(logs, "reload.succeeded", version=f"step-{step}")
                assert order.base_name(Path(engine.loaded).name) == f"step-{step}"
            wait_for(logs, "cache.pruned", name="step-2")
            assert placed_names(daemon.config.checkpoint_root) == ["step-3", "step-4"]
            bad = make_checkpoint("out-5", root=tmp_path / "trainer", seed=5)
            write_manifest(bad, step=5, overrides={"version": "step-5"})
            bucket.upload_dir(bad, "step-5", skip=("manifest.json",))
            manifest = json.loads((bad / "manifest.json").read_text())
            manifest["files"][0]["blake3"] = "0" * 64
            bucket.put("step-5/manifest.json", json.dumps(manifest).encode())
            rejected = wait_for(logs, "checkpoint.rejected", name="step-5")
            assert rejected["check"] == "digests"
            reply = Reply()
            daemon.inbox.put(ControlRequest({"command": "status"}, reply))
            status = reply.wait(5)
            assert status is not None
            assert status["serving"]["version"] == "step-4" and "step-5" in status["rejected"]
            assert status["source"] == {"url": bucket.url, "failing": {}}
        finally:
            daemon.request_stop()
            thread.join(timeout=15)
    assert not thread.is_alive() and not engine.paused
    assert not [c for c in engine.calls if "step-5" in c], "a rejected checkpoint never reaches the engine"


def test_daemon_rewrite_of_the_serving_name_is_a_new_version_and_rolls_back_to_the_old_copy(
    tmp_path, bucket: Bucket, make_checkpoint: MakeCheckpoint
):
    """`latest` rewritten with the same step is loaded (a version is its content); the new
    content fails its canary, and the engine goes back to the first copy, which the download of
    the second never replaced nor deleted."""
    startup = make_checkpoint("startup", root=tmp_path / "models")
    engine = FakeEngine(startup=str(startup))
    first = make_checkpoint("latest", step=5, root=tmp_path / "v1", seed=1)
    second = make_checkpoint("latest", step=5, root=tmp_path / "v2", seed=2)
    with structlog.testing.capture_logs() as logs:
        daemon, thread = remote_daemon(tmp_path, bucket, engine)
        root = daemon.config.checkpoint_root
        try:
            wait_for(logs, "engine.reconciled")
            bucket.upload_dir(first, "latest")
            wait_for(logs, "reload.succeeded", version="latest")
            v1 = root / order.placed_name("latest", fingerprint_of(first))
            assert engine.loaded == str(v1)
            v2 = root / order.placed_name("latest", fingerprint_of(second))
            engine.garbage.add(str(v2))
            bucket.upload_dir(second, "latest")
            back = wait_for(logs, "reload.rolled_back", cause="canary")
            assert back["to_version"] == "latest" and engine.loaded == str(v1)
            assert gate.check(v1, serving=None).status == "ready", "the rollback target is intact"
            rejected = wait_for(logs, "checkpoint.rejected", check="canary")
            assert rejected["fingerprint"] == fingerprint_of(second)
        finally:
            daemon.request_stop()
            thread.join(timeout=15)
    assert not [e for e in logs if e["event"] == "reload.canary_failed_no_fallback"]
    assert not engine.paused


def test_daemon_rewrite_that_passes_is_loaded_once_and_the_first_copy_never_again(
    tmp_path, bucket: Bucket, make_checkpoint: MakeCheckpoint
):
    """v2 replaces v1 under `latest` and passes: v1's copy, still in the cache, served before
    v2 and is never taken for newer (the two would load in turn for ever)."""
    startup = make_checkpoint("startup", root=tmp_path / "models")
    engine = FakeEngine(startup=str(startup))
    first = make_checkpoint("latest", step=5, root=tmp_path / "v1", seed=1)
    second = make_checkpoint("latest", step=5, root=tmp_path / "v2", seed=2)
    with structlog.testing.capture_logs() as logs:
        daemon, thread = remote_daemon(tmp_path, bucket, engine)
        try:
            wait_for(logs, "engine.reconciled")
            bucket.upload_dir(first, "latest")
            wait_for(logs, "reload.succeeded", version="latest")
            bucket.upload_dir(second, "latest")
            v2 = str(daemon.config.checkpoint_root / order.placed_name("latest", fingerprint_of(second)))
            deadline = time.monotonic() + 15
            while engine.loaded != v2:
                assert time.monotonic() < deadline, engine.calls
                time.sleep(0.05)
            time.sleep(1.5)  # some polls and ticks: nothing more may load
        finally:
            daemon.request_stop()
            thread.join(timeout=15)
    reloads = [c for c in engine.calls if c.startswith("reload:")]
    assert len(reloads) == 2 and engine.loaded == v2, reloads


@pytest.mark.stores("s3")
def test_daemon_subprocess_with_wrong_credentials_logs_once_and_keeps_running(
    tmp_path, bucket: Bucket, s3_auth_enforced
):
    from tests.support.engine_fixtures import DaemonProcess

    write_weights(tmp_path / "models" / "startup")  # the layout baseline: without one it exits 2
    engine = FakeEngine(startup=str(tmp_path / "models" / "startup"))
    server = FakeEngineServer(engine)
    cfg = tmp_path / "daemon.toml"
    (tmp_path / "state").mkdir()
    cfg.write_text(
        f'[source]\npath = "{bucket.url}"\npoll_interval = 0.1\n'
        f'[engine]\nurl = "{server.url}"\n[state]\ndir = "{tmp_path / "state"}"\n[log]\nformat = "json"\n'
    )
    daemon = DaemonProcess(cfg)
    try:
        failed = daemon.wait_for("source.failed", timeout=30)
        assert "InvalidAccessKeyId" in str(failed["reason"])
        time.sleep(1.0)  # ~10 more polls
        assert daemon.process.poll() is None
        assert len(daemon.events("source.failed")) == 1
    finally:
        assert daemon.stop() == 0
        server.close()


# -- foreign writers in the bucket ------------------------------------------------------------


def foreign_harness(tmp_path: Path, bucket: Bucket, mode: str, **source: Any) -> Harness:
    harness = Harness(tmp_path, bucket.url)
    harness.cfg = harness.cfg.model_copy(
        update={"source": harness.cfg.source.model_copy(update={"completeness": mode, **source})}
    )
    harness.source = RemoteSource(
        harness.cfg,
        serving=lambda: order.NOTHING,
        rejected=dict,
        post=harness.posted.append,
        **source_records(harness.cfg.state.dir),
    )
    return harness


def test_remote_hf_checkpoint_uploaded_shards_then_index(tmp_path, bucket: Bucket):
    shards = write_weights(tmp_path / "hf" / "checkpoint-300", shards=2)
    (tmp_path / "hf" / "checkpoint-300" / "optimizer.pt").write_bytes(b"\0" * 5000)
    harness = foreign_harness(tmp_path, bucket, "hf-index")
    bucket.upload_dir(tmp_path / "hf" / "checkpoint-300", "checkpoint-300")
    harness.source.poll()
    assert harness.posted == [], "no index yet: not a candidate"
    index = hf_index(shards)
    bucket.put("checkpoint-300/model.safetensors.index.json", index)
    harness.source.poll()
    assert harness.fetched() == ["checkpoint-300"]
    placed = harness.placed("checkpoint-300")
    assert sorted(p.name for p in placed.iterdir()) == sorted(
        [*(s.name for s in shards), "config.json", INDEX_NAME]
    )
    options = gate.GateOptions(convention=Convention("hf-index"))
    assert gate.check(placed, serving=None, options=options).status == "ready"
    local = completeness.candidate("checkpoint-300", DirectoryListing(placed), Convention("hf-index"))
    assert local.fingerprint == harness.source.seen["checkpoint-300"].fingerprint


def test_remote_auto_fetches_a_trainer_checkpoint_once_trainer_state_is_there(tmp_path, bucket: Bucket):
    directory = tmp_path / "hf" / "checkpoint-400"
    shards = write_weights(directory, shards=2)
    (directory / INDEX_NAME).write_bytes(hf_index(shards))
    (directory / "optimizer.pt").write_bytes(b"\0" * 5000)
    harness = foreign_harness(tmp_path, bucket, "auto")
    bucket.upload_dir(directory, "checkpoint-400")
    harness.source.poll()
    assert harness.fetched() == [], "Trainer writes trainer_state.json last"
    bucket.put("checkpoint-400/trainer_state.json", b'{"global_step": 400}')
    harness.source.poll()
    assert harness.fetched() == ["checkpoint-400"]
    placed = harness.placed("checkpoint-400")
    assert "optimizer.pt" not in {p.name for p in placed.iterdir()}
    assert gate.check(placed, serving=None).status == "ready"
    local = completeness.candidate("checkpoint-400", DirectoryListing(placed), Convention())
    assert local.fingerprint == harness.source.seen["checkpoint-400"].fingerprint


def test_remote_checkpoint_nothing_says_is_complete_is_pending_with_the_reason(tmp_path, bucket: Bucket):
    directory = tmp_path / "hf" / "checkpoint-500"
    write_weights(directory, shards=2)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "pytorch_model.bin").write_bytes(b"\x80\x04weights")
    harness = foreign_harness(tmp_path, bucket, "auto")
    bucket.upload_dir(directory, "checkpoint-500")
    bucket.upload_dir(tmp_path / "old", "old-style")
    with structlog.testing.capture_logs() as logs:
        harness.source.poll()
        harness.source.poll()
    assert harness.fetched() == []
    assert "no model.safetensors.index.json yet" in harness.source.pending["checkpoint-500"]
    assert "save with safetensors" in harness.source.pending["old-style"]
    said = [e["name"] for e in logs if e["event"] == "checkpoint.pending"]
    assert sorted(said) == ["checkpoint-500", "old-style"], "once each, not at every poll"


def test_remote_header_reads_refused_while_listing_works_is_one_failure_never_a_recovery(
    tmp_path, bucket: Bucket
):
    """A LIST that works is no recovery when the same round's reads fail (a key policy that
    refuses GET only): said once, not failed/recovered at every poll."""
    directory = tmp_path / "hf" / "checkpoint-1"
    shards = write_weights(directory, shards=2)
    (directory / INDEX_NAME).write_bytes(hf_index(shards))
    harness = foreign_harness(tmp_path, bucket, "hf-index")
    bucket.upload_dir(directory, "checkpoint-1")

    def refused(key: str, start: int, end: int, etag: str | None) -> memoryview:
        raise SourceError(f"GET {bucket.url}/{key}: AccessDenied (403 Forbidden)")

    harness.source.store.get_range = refused  # type: ignore[method-assign]
    with structlog.testing.capture_logs() as logs:
        for _ in range(4):
            harness.source.poll()
    assert [e["event"] for e in logs if e["event"].startswith("source.")] == ["source.failed"]


def test_remote_hf_shard_with_a_short_object_is_pending(tmp_path, bucket: Bucket):
    directory = tmp_path / "hf" / "checkpoint-1"
    shards = write_weights(directory, shards=2)
    harness = foreign_harness(tmp_path, bucket, "hf-index")
    bucket.upload_dir(directory, "checkpoint-1", skip=(shards[1].name,))
    bucket.put(f"checkpoint-1/{shards[1].name}", shards[1].read_bytes()[:-10])
    bucket.put(f"checkpoint-1/{INDEX_NAME}", hf_index(shards))
    harness.source.poll()
    assert "checkpoint-1" in harness.source.pending and harness.fetched() == []
    bucket.put(f"checkpoint-1/{shards[1].name}", shards[1].read_bytes())
    harness.source.poll()
    assert harness.fetched() == ["checkpoint-1"]


def test_remote_marker_checkpoint_is_fetched_once_the_marker_is_there(tmp_path, bucket: Bucket):
    directory = tmp_path / "orbax" / "700"
    write_weights(directory)
    harness = foreign_harness(tmp_path, bucket, "marker")
    bucket.upload_dir(directory, "700")
    harness.source.poll()
    assert harness.fetched() == []
    bucket.put("700/commit_success.txt", b"ok")
    harness.source.poll()
    assert harness.fetched() == ["700"]
    assert (harness.placed("700") / "commit_success.txt").read_bytes() == b"ok"


def test_remote_single_safetensors_waits_for_quiet(tmp_path, bucket: Bucket):
    directory = tmp_path / "hf" / "final"
    write_weights(directory)
    bucket.upload_dir(directory, "final")
    harness = foreign_harness(tmp_path, bucket, "hf-index", settle_seconds=3600.0)
    harness.source.poll()
    assert "settle" in harness.source.pending["final"]
    harness = foreign_harness(tmp_path, bucket, "hf-index", settle_seconds=0.0)
    harness.source.poll()
    assert harness.fetched() == ["final"]


@pytest.mark.stores(*WRITABLE)
def test_daemon_with_keep_0_still_loads_what_it_downloaded(tmp_path, bucket: Bucket, make_checkpoint):
    from vllm_reloader.tools.upload import publish_remote

    engine = FakeEngine(startup=str(make_checkpoint("startup", root=tmp_path / "models")))
    with structlog.testing.capture_logs() as logs:
        daemon, thread = remote_daemon(tmp_path, bucket, engine, keep=0)
        try:
            wait_for(logs, "engine.reconciled")
            for step in (2, 3):
                publish_remote(
                    make_checkpoint(f"o{step}", root=tmp_path / "t", seed=step), bucket.url, step=step
                )
                wait_for(logs, "reload.succeeded", version=f"step-{step}")
            wait_for(logs, "cache.pruned", name="step-2")  # the collector's next turn
            assert placed_names(daemon.config.checkpoint_root) == ["step-3"]
        finally:
            daemon.request_stop()
            thread.join(timeout=15)
    assert len([e for e in logs if e["event"] == "download.started"]) == 2, "nothing fetched twice"


def test_retention_never_deletes_a_downloaded_checkpoint_waiting_to_load(tmp_path, make_checkpoint):
    from vllm_reloader.service.leases import Collector
    from vllm_reloader.service.reloader import Reloader
    from vllm_reloader.service.state import Loaded
    from vllm_reloader.sources.content import ContentStore

    cfg = config.Config(
        source=config.SourceConfig(path="s3://bucket/runs"),
        engine=config.EngineConfig(url="http://engine.test"),
        state=config.StateConfig(dir=tmp_path / "state", keep=0),
    )
    cfg.state.dir.mkdir()
    records = open_records(cfg.state.dir)
    reloader = Reloader(cfg, lambda _message: None, records, {"http://engine.test": FakeEngine().client()})
    for step in (1, 2, 3):
        make_checkpoint(f"step-{step}", step=step, root=cfg.checkpoint_root)
    for name in ("step-1", "step-2", "step-3"):
        reloader.changed(name)
    reloader.catalog.refresh_dirty()
    serving = Loaded(
        name="step-2", version="step-2", path=str(cfg.checkpoint_root / "step-2"), since=0, step=2
    )
    reloader.loads.set_serving(reloader.canary, serving, good=serving)
    content = ContentStore(records, structlog.get_logger())
    for step in (1, 2, 3):
        content.made(cfg.checkpoint_root / f"step-{step}", "download")
    Collector(content, structlog.get_logger()).turn(reloader, None, cfg.state.keep)
    assert sorted(p.name for p in cfg.checkpoint_root.iterdir()) == ["step-2", "step-3"]


# -- odd keys, rewritten checkpoints -----------------------------------------------------------


@pytest.mark.stores("s3")
def test_remote_key_obstore_cannot_list_costs_only_that_object(tmp_path, bucket: Bucket, make_checkpoint):
    """One `//` or `/../` key fails obstore's whole listing: the daemon lists per checkpoint,
    and a checkpoint with our manifest is read by HEAD, never touching the odd key."""
    harness = Harness(tmp_path, bucket.url)
    for step in (5, 6):
        bucket.upload_dir(
            make_checkpoint(f"step-{step}", step=step, root=tmp_path / "src", seed=step), f"step-{step}"
        )
    bucket.put("step-6//stray", b"x")
    bucket.put("step-7/../odd", b"y")
    with structlog.testing.capture_logs() as logs:
        harness.source.poll()
        harness.source.poll()
    assert harness.fetched() == ["step-6", "step-5"], "one per poll, newest first; the odd keys cost nothing"
    bad = [e for e in logs if e["event"] == "source.bad_key"]
    assert {e["name"] for e in bad} == {"step-6", "step-7"}, "each logged once, not per poll"
    assert gate.check(harness.placed("step-6"), serving=None).status == "ready"
    assert not [e for e in logs if e["event"] == "source.failed"]


def placed_names(root: Path) -> list[str]:
    return sorted(order.base_name(p.name) for p in root.iterdir())


def fingerprint_of(checkpoint: Path) -> str:
    return completeness.fingerprint_of((checkpoint / "manifest.json").read_bytes())


def test_remote_checkpoint_rewritten_under_the_same_name_is_fetched_again_beside_the_serving_copy(
    tmp_path, bucket: Bucket, make_checkpoint
):
    harness = Harness(tmp_path, bucket.url)
    first = make_checkpoint("a", step=5, root=tmp_path / "src", seed=1)
    bucket.upload_dir(first, "step-5")
    harness.source.poll()
    assert harness.fetched() == ["step-5"]
    second = make_checkpoint("b", step=5, root=tmp_path / "src", seed=2)
    was = harness.placed("step-5")
    harness.serving_key = order.Serving(order.order_key("step-5", 5), was.name, fingerprint_of(first))
    bucket.upload_dir(second, "step-5")  # same name, other bytes, another manifest ETag
    harness.source.poll()
    assert harness.fetched() == ["step-5", "step-5"], "the serving name's new content is a new version"
    placed = harness.placed("step-5")
    assert (
        placed != was and (placed / "manifest.json").read_bytes() == (second / "manifest.json").read_bytes()
    )
    assert gate.check(placed, serving=None).status == "ready"
    assert gate.check(was, serving=None).status == "ready", "the serving copy is never replaced nor deleted"
    assert (was / "manifest.json").read_bytes() == (first / "manifest.json").read_bytes()
    harness.source.poll()
    assert harness.fetched() == ["step-5", "step-5"], "fetched once per rewrite"


@pytest.mark.stores(*WRITABLE)
def test_remote_download_verified_while_streaming_is_not_read_again(
    tmp_path, bucket: Bucket, checkpoint: Path
):
    """The digests checked and the NaN scan done as the bytes came in are kept by the placed
    files' identities: the local gate settles them without reading."""
    harness = Harness(tmp_path, bucket.url)
    harness.source.verified_files = cache = verified.Cache()
    bucket.upload_dir(checkpoint, "step-5")
    harness.source.poll()
    placed = harness.placed("step-5")
    run = gate.Run(cache=cache)
    assert gate.check(placed, serving=None, run=run).status == "ready"
    listed = sum(p.stat().st_size for p in placed.iterdir() if p.name != "manifest.json")
    assert run.progress.cached == listed == run.progress.done, "nothing read again"


def test_remote_download_with_nan_weights_is_rejected_from_its_streaming_scan(
    tmp_path, bucket: Bucket, make_checkpoint
):
    import numpy as np
    from safetensors.numpy import save_file

    diverged = make_checkpoint("src", root=tmp_path / "src")
    save_file(
        {"model.embed_tokens.weight": np.full((16, 8), np.nan, np.float32)},
        str(diverged / "model.safetensors"),
    )
    write_manifest(diverged, step=5)
    harness = Harness(tmp_path, bucket.url)
    harness.source.verified_files = cache = verified.Cache()
    bucket.upload_dir(diverged, "step-5")
    harness.source.poll()
    run = gate.Run(cache=cache)
    verdict = gate.check(harness.placed("step-5"), serving=None, run=run)
    assert verdict.status == "rejected" and verdict.details["check"] == "finite"
    assert run.progress.cached == run.progress.done > 0, "known from the download, not read again"


# -- candidates that fail for reasons of their own: rejected once, the next one loads ----------


@pytest.mark.stores(*WRITABLE)
def test_remote_oversized_manifest_is_never_read_rejected_once_and_older_ones_load(
    tmp_path, bucket: Bucket, make_checkpoint, monkeypatch
):
    harness = Harness(tmp_path, bucket.url)
    bucket.upload_dir(make_checkpoint("a-1", root=tmp_path / "src", seed=1), "a-1")
    padded = b'{"format_version": 1, "files": [{"path": "model.safetensors", "size": 1}]}'
    bucket.put("b-2/model.safetensors", b"x")
    bucket.put("b-2/manifest.json", padded + b" " * (16 << 20))  # the newest by name, no step
    got: list[str] = []
    real_get = harness.source.store.get
    monkeypatch.setattr(harness.source.store, "get", lambda key: (got.append(key), real_get(key))[1])
    for _ in range(3):
        harness.source.poll()
    assert "b-2/manifest.json" not in got, "a completing object over 16 MiB is never fetched"
    assert [(r["name"], r["check"]) for r in harness.rejected()] == [("b-2", "manifest")]
    assert "more than" in harness.rejected()[0]["reason"]
    assert harness.fetched() == ["a-1"], "the older good version is not held back"


def test_remote_downloads_a_version_with_no_step_uploaded_after_the_stepped_one_that_serves(
    tmp_path, bucket: Bucket, make_checkpoint
):
    harness = Harness(tmp_path, bucket.url)
    bucket.upload_dir(make_checkpoint("step-1", step=1, root=tmp_path / "src", seed=1), "step-1")
    bucket.upload_dir(make_checkpoint("there", root=tmp_path / "src", seed=2), "there")
    harness.source.poll()
    assert harness.fetched() == ["step-1"]
    harness.serving_key = order.Serving(order.order_key("step-1", 1), "step-1")
    harness.source.poll()
    bucket.upload_dir(make_checkpoint("final", root=tmp_path / "src", seed=3), "final")  # no step
    harness.source.poll()
    assert harness.fetched() == ["step-1", "final"], "listed after step-1: newer; 'there' was there first"
    assert harness.source.arrivals.of(bucket.url, "final") == (1, 1)


@pytest.mark.stores("file")
def test_remote_version_with_a_file_it_cannot_read_waits_and_an_older_one_loads(
    tmp_path, bucket: Bucket, make_checkpoint, monkeypatch: pytest.MonkeyPatch
):
    """A shard of a shared root this daemon may not read (a trainer's umask 077 under root
    squash): that version waits, saying why; the older one loads; once readable, it loads."""
    harness = Harness(tmp_path, bucket.url)
    bucket.upload_dir(make_checkpoint("step-1", step=1, root=tmp_path / "src", seed=1), "step-1")
    bucket.upload_dir(make_checkpoint("step-2", step=2, root=tmp_path / "src", seed=2), "step-2")
    real = FileStore._open

    def denied(store: FileStore, what: str, key: str, name: str, parent: int) -> int:
        if key.startswith("step-2/") and key.endswith(".safetensors"):
            raise KeyUnreadable(f"{what} {store.url}/{key}: Permission denied")
        return real(store, what, key, name, parent)

    monkeypatch.setattr(FileStore, "_open", denied)
    with structlog.testing.capture_logs() as logs:
        harness.source.poll()
    assert harness.fetched() == ["step-1"] and not harness.rejected()
    assert "Permission denied" in harness.source.pending["step-2"]
    assert not [e for e in logs if e["event"] in ("source.failed", "download.failed")]
    monkeypatch.setattr(FileStore, "_open", real)
    harness.source.poll()
    assert harness.fetched() == ["step-1", "step-2"]


@pytest.mark.stores("file")
def test_remote_shared_root_name_that_is_not_utf8_is_never_a_version(
    tmp_path, bucket: Bucket, checkpoint: Path
):
    harness = Harness(tmp_path, bucket.url)
    odd = os.fsdecode(b"step-9\xff")
    bucket.upload_dir(checkpoint, odd)
    with structlog.testing.capture_logs() as logs:
        harness.source.poll()
        harness.source.poll()
    assert harness.posted == [] and harness.source.seen == {}
    (said,) = [e for e in logs if e["event"] == "source.bad_key"]
    assert "not UTF-8" in said["reason"]


@pytest.mark.stores(*OBJECT_STORES, "gcs")  # a shared root cannot hold the name either
def test_remote_name_too_long_for_the_filesystem_is_rejected_once_and_older_ones_load(
    tmp_path, bucket: Bucket, make_checkpoint
):
    harness = Harness(tmp_path, bucket.url)
    bucket.upload_dir(make_checkpoint("a-1", root=tmp_path / "src", seed=1), "a-1")
    long_name = "z" * 300  # S3 allows 1024 bytes; a directory name, 255
    bucket.upload_dir(make_checkpoint("long", root=tmp_path / "src", seed=2), long_name)
    for _ in range(3):
        harness.source.poll()
    assert [r["name"] for r in harness.rejected()] == [long_name]
    assert "too long" in harness.rejected()[0]["reason"]
    assert harness.fetched() == ["a-1"]


def test_remote_name_the_catalog_would_skip_is_never_downloaded(tmp_path, bucket: Bucket, make_checkpoint):
    harness = Harness(tmp_path, bucket.url)
    bucket.upload_dir(make_checkpoint("a-1", root=tmp_path / "src", seed=1), "a-1")
    hidden = "b-2\u200b"  # a format character: invisible in every log line
    bucket.upload_dir(make_checkpoint("fmt", root=tmp_path / "src", seed=2), hidden)
    for _ in range(3):
        harness.source.poll()
    assert [r["name"] for r in harness.rejected()] == [hidden]
    assert harness.fetched() == ["a-1"]
    assert [order.base_name(p.name) for p in harness.root.iterdir()] == ["a-1"]


def test_remote_name_that_looks_like_a_placed_download_is_rejected_once(
    tmp_path, bucket: Bucket, make_checkpoint
):
    harness = Harness(tmp_path, bucket.url)
    bucket.upload_dir(make_checkpoint("a-1", root=tmp_path / "src", seed=1), "a-1")
    lookalike = "b-2@" + "a" * 16
    bucket.upload_dir(make_checkpoint("look", root=tmp_path / "src", seed=2), lookalike)
    for _ in range(4):
        harness.source.poll()
    assert [r["name"] for r in harness.rejected()] == [lookalike], "once, not at every poll"
    assert harness.fetched() == ["a-1"]
