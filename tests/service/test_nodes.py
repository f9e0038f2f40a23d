"""One engine over two nodes, scripted: the leading daemon beside node 0 and a stage daemon
beside node 1, both in this process, on one object-store prefix (moto's S3). The scripted
engine answers for node 1's rank by reading the stage daemon's cache where the leader's path
points (`FakeEngine.other_nodes`), as a rank on that node would; the real two-node engine is
in tests/e2e/test_e2e_nodes.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from tests.support import small_disk
from tests.support.checkpoints import MakeCheckpoint
from tests.support.daemon_fixtures import events_in, wait_for_event
from tests.support.fake_engine import BadSteps, FakeEngine
from tests.support.store_fixtures import Bucket
from vllm_reloader import config
from vllm_reloader.checkpoint.staged import staged_marker
from vllm_reloader.service import status
from vllm_reloader.service.daemon import Daemon
from vllm_reloader.service.messages import SignalReceived
from vllm_reloader.service.stage import Stage

pytestmark = pytest.mark.stores("s3")
NODE = "stage-1"


class Nodes:
    def __init__(self, tmp_path: Path, bucket: Bucket, make: MakeCheckpoint, logs: list[dict]) -> None:
        self.tmp_path, self.bucket, self.make, self.logs = tmp_path, bucket, make, logs
        self.startup = make("startup", root=tmp_path / "models")
        self.engine = FakeEngine(startup=str(self.startup))
        self.engine.extension = True
        self.lead_dir, self.stage_dir = tmp_path / "lead", tmp_path / "stage"
        self.stage_cache = self.stage_dir / "cache"
        self.engine.other_nodes = {NODE: (self.lead_dir / "cache", self.stage_cache)}
        self.threads: list[tuple[Daemon | Stage, threading.Thread]] = []

    def _config(self, directory: Path, state: dict[str, object], **sections: object) -> config.Config:
        directory.mkdir(exist_ok=True)
        source = config.SourceConfig(path=self.bucket.url, poll_interval=0.1, pending_recheck_interval=0.05)
        return config.Config(
            source=source,
            engine=config.EngineConfig(url="http://lead.test", retry_initial=0.05, retry_max=0.3),
            state=config.StateConfig(dir=directory, min_free_bytes=0, **state),  # type: ignore[arg-type]
            **sections,  # type: ignore[arg-type]
        )

    def lead(self) -> Daemon:
        cfg = self._config(
            self.lead_dir,
            {},
            rollout=config.RolloutConfig(host="lead"),
            node=config.NodeConfig(role="lead"),
        )
        daemon = Daemon(cfg, clients={cfg.engine.url: self.engine.client(cfg.engine.url, retry_initial=0.05)})
        self._start(daemon)
        self.wait_for("engine.reconciled")
        return daemon

    def stage(self, **state: object) -> Stage:
        if "cache_dir" in state:  # its rank reads there
            self.stage_cache = Path(str(state["cache_dir"]))
            self.engine.other_nodes = {NODE: (self.lead_dir / "cache", self.stage_cache)}
        cfg = self._config(
            self.stage_dir,
            state,
            rollout=config.RolloutConfig(host=NODE),
            node=config.NodeConfig(role="stage", leader="lead"),
        )
        stage = Stage(cfg)
        self._start(stage)
        return stage

    def _start(self, process: Daemon | Stage) -> None:
        thread = threading.Thread(target=process.run, daemon=True)
        thread.start()
        self.threads.append((process, thread))

    def stop(self, process: Daemon | Stage) -> None:
        for found, thread in self.threads:
            if found is process:
                process.inbox.put(SignalReceived(signal.SIGTERM))
                thread.join(timeout=15)
                assert not thread.is_alive()

    def publish(self, name: str, step: int) -> Path:
        directory = self.make(name, step=step, root=self.tmp_path / f"src-{name}", seed=step)
        self.bucket.upload_dir(directory, name, skip=("manifest.json",))
        self.bucket.put(f"{name}/manifest.json", (directory / "manifest.json").read_bytes())
        return directory

    def stage_copy(self, name: str) -> Path:
        found = [p for p in (self.stage_cache / "checkpoints").iterdir() if p.name.startswith(f"{name}@")]
        assert len(found) == 1, found
        return found[0]

    def wait_for(self, event: str, /, timeout: float = 15.0, reason_has: str = "", **fields: object) -> dict:
        """The newest such event (with `reason_has` in its reason: one said earlier does not count)."""
        deadline = time.monotonic() + timeout
        while True:
            found = wait_for_event(self.logs, event, max(0.0, deadline - time.monotonic()), **fields)
            if reason_has in str(found.get("reason", "")):
                return found
            assert time.monotonic() < deadline, f"no {event} with {reason_has!r}: {found}"
            time.sleep(0.02)

    def events(self, event: str, /, **fields: object) -> list[dict]:
        return events_in(self.logs, event, **fields)

    def paused(self) -> bool:
        return "/pause" in self.engine.calls


@pytest.fixture
def nodes(tmp_path: Path, bucket: Bucket, make_checkpoint: MakeCheckpoint) -> Iterator[Nodes]:
    with structlog.testing.capture_logs() as logs:
        found = Nodes(tmp_path, bucket, make_checkpoint, logs)
        yield found
        for process, thread in found.threads:
            process.inbox.put(SignalReceived(signal.SIGTERM))
            thread.join(timeout=15)
            assert not thread.is_alive()
        assert not found.engine.paused, "no engine is ever left paused"


def test_lead_reloads_once_every_node_holds_the_version_verified(nodes: Nodes):
    nodes.stage()
    nodes.lead()
    nodes.publish("step-1", step=1)
    staged = nodes.wait_for("node.staged", node=NODE)
    succeeded = nodes.wait_for("reload.succeeded", version="step-1")
    path = Path(str(succeeded["path"]))
    assert staged["name"] == path.name
    asks = nodes.engine.staged_asks  # when planned (again after a backoff), and at the pause
    assert len(asks) >= 2 and set(asks) == {str(path)}
    assert nodes.engine.staged_loads == [(str(path), staged["fingerprint"])]
    assert nodes.engine.loaded == str(path)
    lead_marker = json.loads(staged_marker(path).read_text())
    stage_marker = json.loads(staged_marker(nodes.stage_copy("step-1")).read_text())
    assert lead_marker["node"] == "lead" and stage_marker["node"] == NODE
    assert lead_marker["fingerprint"] == stage_marker["fingerprint"] == staged["fingerprint"]
    assert lead_marker["files"] != stage_marker["files"]  # each node's own files, as verified there
    assert not nodes.events("reload.failed") and not nodes.events("checkpoint.rejected")


def test_lead_never_pauses_while_a_node_lacks_the_version_and_loads_once_its_stage_daemon_runs(nodes: Nodes):
    lead = nodes.lead()
    nodes.publish("step-1", step=1)
    short = nodes.wait_for("node.not_staged", version="step-1")
    shown = status.render(status.answer(lead.snapshot())).splitlines()
    assert "node      node 0 (leader)  step-1: staged and verified" in shown
    assert any(
        line.startswith(f"node      node 1 ({NODE})  step-1: NOT STAGED: no copy at") for line in shown
    )
    assert short["node"] == f"node 1 ({NODE})" and "no copy at" in short["reason"]
    assert short["retry_in_s"] > 0 and "stage" in short["fix"]
    assert not nodes.paused() and nodes.engine.loaded == str(nodes.startup)
    assert not nodes.events("reload.failed") and not nodes.events("checkpoint.rejected")
    nodes.stage()
    nodes.wait_for("reload.succeeded", version="step-1", timeout=20)
    assert len(nodes.events("node.not_staged")) <= len(nodes.engine.staged_asks) - 1


def test_a_byte_changed_on_a_node_after_staging_holds_the_reload_until_that_node_fetches_it_again(
    nodes: Nodes,
):
    stage = nodes.stage()
    nodes.publish("step-1", step=1)
    nodes.wait_for("node.staged", node=NODE)
    nodes.stop(stage)
    shard = next(nodes.stage_copy("step-1").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    nodes.lead()
    short = nodes.wait_for("node.not_staged", version="step-1")
    assert short["node"] == f"node 1 ({NODE})" and "changed since stage-1 verified it" in short["reason"]
    assert not nodes.paused()
    nodes.stage()  # at its start it finds the copy changed: gated again, its bytes fail, fetched again
    nodes.wait_for("node.unstaged", name=shard.parent.name)
    nodes.wait_for("reload.succeeded", version="step-1", timeout=20)
    assert not nodes.events("checkpoint.rejected")


def test_a_node_whose_disk_is_full_holds_the_reload_until_space_is_freed(nodes: Nodes):
    disk = nodes.tmp_path / "stage-disk"
    with small_disk.tmpfs(disk, 8 << 20) as refused:
        assert not refused, refused  # the suite runs as root (CI too): a real full disk
        nodes.stage(cache_dir=disk)
        filler = small_disk.fill(disk, leave=small_disk.PAGE)
        nodes.lead()
        nodes.publish("step-1", step=1)
        nodes.wait_for("download.failed", name="step-1")
        short = nodes.wait_for("node.not_staged", version="step-1")
        assert short["node"] == f"node 1 ({NODE})"
        assert not nodes.paused()
        filler.unlink()
        nodes.wait_for("reload.succeeded", version="step-1", timeout=20)
        for process, _ in nodes.threads:
            nodes.stop(process)


def test_a_rollback_goes_back_to_a_version_every_node_still_holds(nodes: Nodes):
    nodes.stage(keep=0)  # only what the engine may still load or go back to
    nodes.engine.garbage = BadSteps({2})
    nodes.lead()
    nodes.publish("step-1", step=1)
    nodes.wait_for("reload.succeeded", version="step-1")
    good = nodes.stage_copy("step-1")
    nodes.publish("step-2", step=2)
    back = nodes.wait_for("reload.rolled_back", version="step-2", timeout=20)
    assert back["to_version"] == "step-1" and nodes.engine.loaded.endswith(good.name)
    fingerprint = json.loads(staged_marker(good).read_text())["fingerprint"]
    assert nodes.engine.staged_loads[-1] == (nodes.engine.loaded, fingerprint)  # each node its own copy
    pruned = nodes.wait_for("cache.pruned", name="step-2", timeout=20)  # the leader failed it: let go
    assert pruned["directory"].startswith("step-2@")
    time.sleep(1.0)  # a few more polls and collector turns: never downloaded there again
    assert len(nodes.events("download.started", name="step-2")) == 2  # once by each node
    assert good.exists() and staged_marker(good).exists()
    assert not nodes.events("cache.pruned", name="step-1")


def test_a_node_refusing_mid_load_blames_no_checkpoint_and_the_version_loads_once_fetched_again(
    nodes: Nodes,
):
    """Asked before the pause, both nodes held it; a hand at node 1's copy before the load:
    that rank refuses, node 0's weights are put back, nothing is rejected."""
    nodes.stage()
    nodes.lead()

    held = []

    def touch_node_1(answers: list[dict[str, object]]) -> None:
        if all(a["problem"] is None for a in answers):
            held.append(answers)
            if len(held) == 2:  # the job's own question, just before the pause
                shard = next(nodes.stage_copy("step-1").glob("*.safetensors"))
                os.utime(shard, ns=(1, 1))

    nodes.engine.on_staged_ask = touch_node_1
    nodes.publish("step-1", step=1)
    changed = nodes.wait_for("checkpoint.changed", version="step-1", timeout=20)
    # its rank saw the copy changed, or its daemon had already taken the marker back
    assert any(why in changed["reason"] for why in ("changed since stage-1 verified it", "no daemon marked"))
    assert changed["when"] == "after_load" and "restored" in changed["reason"]
    nodes.wait_for("reload.succeeded", version="step-1", timeout=30)
    assert not nodes.events("checkpoint.rejected") and not nodes.events("verdict.recorded", verdict="failed")


def test_weights_of_unknown_mix_a_node_cannot_restore_yet_are_not_left_paused_and_restored_once_it_can(
    nodes: Nodes,
):
    """The lead died mid-reload (the engine paused on `reloading:`); node 1 has lost the good
    version meanwhile: the engine is resumed (out of rotation, its weights unknown), and the
    good version is loaded back once node 1 holds it again."""
    stage = nodes.stage()
    lead = nodes.lead()
    nodes.publish("step-1", step=1)
    good = nodes.wait_for("reload.succeeded", version="step-1")
    nodes.stop(lead)
    nodes.stop(stage)
    nodes.engine.version, nodes.engine.paused = "reloading:step-2", True
    shutil.rmtree(nodes.stage_copy("step-1"))
    nodes.lead()
    assert nodes.wait_for("engine.weights_unknown", timeout=20)["restoring"] == "step-1"
    nodes.wait_for("node.not_staged", version="step-1", timeout=20, reason_has="no copy at")
    deadline = time.monotonic() + 20
    while nodes.engine.paused:
        assert time.monotonic() < deadline, "left paused"
        time.sleep(0.05)
    assert nodes.engine.version == "reloading:step-2"  # not named as anything it is not
    nodes.stage()
    deadline = time.monotonic() + 30
    while nodes.engine.version != "step-1" or nodes.engine.paused:  # named before its resume
        assert time.monotonic() < deadline, nodes.engine.version
        time.sleep(0.05)
    assert nodes.engine.loaded == good["path"]
