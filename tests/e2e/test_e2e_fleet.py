"""A fleet following one object-store prefix (moto's S3 server on loopback): a canary host
(the session's real engine, its daemon with `role = "canary"`) and a follower host (a scripted
engine behind a real socket, its daemon with `role = "follow"`), each daemon a real
subprocess. The follower waits for the canary's record, then loads; a version the canary
failed never reaches it."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from tests.support.e2e_world import World, _steps
from tests.support.engine_fixtures import DaemonProcess, exploding
from tests.support.fake_engine import FakeEngine, FakeEngineServer
from tests.support.store_fixtures import OBJECT_STORES, Bucket

pytestmark = [pytest.mark.engine, pytest.mark.stores(*OBJECT_STORES)]


def fleet_config(path: Path, bucket: Bucket, engine_url: str, state: Path, rollout: str) -> Path:
    state.mkdir(parents=True, exist_ok=True)  # the daemon never makes it
    path.write_text(
        f'[source]\npath = "{bucket.url}"\npoll_interval = 0.2\npart_size = 65536\n'
        f'[engine]\nurl = "{engine_url}"\nretry_initial = 0.2\n'
        f'[state]\ndir = "{state}"\nmin_free_bytes = 0\n[log]\nformat = "json"\n[rollout]\n{rollout}\n'
    )
    return path


def at(event: dict[str, object]) -> datetime:
    return datetime.fromisoformat(str(event["timestamp"]))


def test_e2e_fleet_follower_loads_only_what_a_canary_host_passed(
    world: World, tmp_path: Path, bucket: Bucket
):
    """It stops the world's daemon first (one engine, one daemon), and starts it again after."""
    from vllm_reloader.tools.upload import publish_remote

    assert world.daemon.stop() == 0
    follower_engine = FakeEngine(startup=str(world.root / world.serving))
    server = FakeEngineServer(follower_engine)
    canary = follower = None
    try:
        canary_config = fleet_config(
            tmp_path / "canary.toml",
            bucket,
            world.engine.url,
            tmp_path / "canary",
            'role = "canary"\nhost = "canary-1"',
        )
        follower_config = fleet_config(
            tmp_path / "follower.toml",
            bucket,
            server.url,
            tmp_path / "follower",
            'role = "follow"\nmin_canaries = 1\nhost = "follower-1"',
        )
        follower = DaemonProcess(follower_config)
        follower.wait_for("engine.reconciled")
        good = f"step-{next(_steps)}"
        publish_remote(world.staging / "seed-2", bucket.url, name=good, step=10**7)
        # Listed while still uploading it first waits for its manifest; then for the canary hosts.
        waiting = "waiting for canary hosts: 0 of 1 passed"
        follower.wait_for("checkpoint.pending", name=good, reason_has=waiting)
        assert not follower.events("download.started", name=good)

        canary = DaemonProcess(canary_config)
        recorded = canary.wait_for("verdict.recorded", name=good, verdict="passed", timeout=120)
        loaded = follower.wait_for("reload.succeeded", version=good, timeout=60)
        assert follower_engine.version == good and world.engine.weight_version() == good
        (key,) = [k for k in bucket.listed() if k.startswith(f"{good}/_verdicts/")]  # <fingerprint>/
        assert key.endswith("/canary-1.passed.json")
        record = json.loads(bucket.read(key))
        assert record["verdict"] == "passed" and record["host"] == "canary-1" and record["version"] == good
        # Not before the record existed: made at `at`, then written; the canary host logs
        # `verdict.recorded` after the write, so the follower may act before that line.
        started = at(follower.wait_for("download.started", name=good))
        assert started.timestamp() > record["at"] and str(recorded["key"]).endswith(key)
        assert loaded["bytes"] > 0

        bad = f"step-{next(_steps)}"
        exploding(world.staging / "seed-2", tmp_path / "bad")
        publish_remote(tmp_path / "bad", bucket.url, name=bad, step=10**7 + 1)
        canary.wait_for("reload.rolled_back", version=bad, timeout=120)
        canary.wait_for("verdict.recorded", name=bad, verdict="failed")
        rejected = follower.wait_for("checkpoint.rejected", name=bad, timeout=30)
        assert rejected["check"] == "canary" and "canary host canary-1 failed it" in str(rejected["reason"])
        assert not follower.events("download.started", name=bad)
        assert not [call for call in follower_engine.calls if bad in call], "never loaded on the follower"
        assert world.engine.weight_version() == good
        world.serving, world.expected = good, world.engine.complete()
    finally:
        for daemon in (canary, follower):
            if daemon is not None:
                assert daemon.stop() == 0
        server.close()
        world.start_daemon()  # the engine back to the world's daemon, for the modules after


def rewrite(bucket: Bucket, checkpoint: Path, name: str) -> None:
    """Objects written over `name` as a trainer's own uploader does, the manifest last."""
    bucket.upload_dir(checkpoint, name, skip=("manifest.json",))
    bucket.put(f"{name}/manifest.json", (checkpoint / "manifest.json").read_bytes())


def test_e2e_fleet_rewritten_name_failed_on_the_canary_host_never_reaches_the_follower(
    world: World, tmp_path: Path, bucket: Bucket
):
    """`latest` v1 passes on the canary host and the follower loads it; `latest` is rewritten
    with v2 (same name, same step, other bytes). The canary host loads v2 (a new version: new
    content), its canary fails, it goes back to v1 (whose cached copy the download of v2 left
    alone) and records v2 failed; the follower never counts v1's pass for v2."""
    from vllm_reloader.checkpoint.completeness import fingerprint_of
    from vllm_reloader.tools.publish import publish

    assert world.daemon.stop() == 0
    step = 10**7 + 10
    v1 = publish(world.staging / "seed-3", tmp_path / "v1", name="latest", step=step)
    v2 = publish(
        exploding(world.staging / "seed-3", tmp_path / "bad"), tmp_path / "v2", name="latest", step=step
    )
    v2_fingerprint = fingerprint_of((v2 / "manifest.json").read_bytes())
    follower_engine = FakeEngine(startup=str(world.staging / "seed-1"))  # its layout baseline
    server = FakeEngineServer(follower_engine)
    canary = follower = None
    try:
        canary = DaemonProcess(
            fleet_config(
                tmp_path / "canary.toml", bucket, world.engine.url, tmp_path / "canary",
                'role = "canary"\nhost = "canary-1"',
            )
        )  # fmt: skip
        follower = DaemonProcess(
            fleet_config(
                tmp_path / "follower.toml", bucket, server.url, tmp_path / "follower",
                'role = "follow"\nmin_canaries = 1\nhost = "follower-1"',
            )
        )  # fmt: skip
        rewrite(bucket, v1, "latest")
        canary.wait_for("verdict.recorded", name="latest", verdict="passed", timeout=120)
        follower.wait_for("reload.succeeded", version="latest", timeout=60)
        served_v1 = follower_engine.loaded
        expected = world.engine.complete()

        rewrite(bucket, v2, "latest")
        rolled = canary.wait_for("reload.rolled_back", version="latest", timeout=120)
        assert rolled["cause"] == "probe" and rolled["to_version"] == "latest"
        failed = canary.wait_for("verdict.recorded", name="latest", verdict="failed", timeout=30)
        assert v2_fingerprint in str(failed["key"]), "the record is keyed by the content it judged"
        rejected = follower.wait_for("checkpoint.rejected", name="latest", check="canary", timeout=30)
        assert rejected["fingerprint"] == v2_fingerprint
        assert world.engine.complete() == expected, "the canary host serves v1 again"
        assert follower_engine.loaded == served_v1, "the follower still serves v1"
        assert not [c for c in follower_engine.calls if v2_fingerprint[:16] in c], "v2 never reached it"
        assert not canary.events("reload.canary_failed_no_fallback")
        world.serving, world.expected = "latest", expected
    finally:
        for daemon in (canary, follower):
            if daemon is not None:
                assert daemon.stop() == 0
        server.close()
        world.start_daemon()
