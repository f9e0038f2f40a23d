"""One real CPU vLLM engine over two nodes (`--nnodes 2`, node 1 headless), each node in its
own mount namespace so the one cache path is a different disk on each (`two_nodes`), a daemon
per node in its namespace: the leading one beside node 0's server, a stage daemon beside node
1. Versions come from moto's S3, or from a shared root both see. Every reload reads, on each
node, the copy that node's daemon verified; a node short of it holds the reload back without a
pause, in one line naming it."""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import small_disk
from tests.support.engine_fixtures import DaemonProcess
from tests.support.store_fixtures import Bucket
from tests.support.two_nodes import TwoNodes, two_node_engine
from vllm_reloader.checkpoint.staged import staged_marker

pytestmark = [pytest.mark.engine, pytest.mark.stores("s3")]


def node_config(path: Path, source: str, cache: Path, state: Path, node: str, engine_url: str = "") -> Path:
    state.mkdir(parents=True, exist_ok=True)  # the daemon never makes it
    engine = f'[engine]\nurl = "{engine_url}"\nretry_initial = 0.2\nretry_max = 2.0\n' if engine_url else ""
    path.write_text(
        f'[source]\npath = "{source}"\npoll_interval = 0.2\n{engine}'
        f'[state]\ndir = "{state}"\ncache_dir = "{cache}"\nmin_free_bytes = 0\nkeep = 0\n'
        f'[canary]\nprobe = false\n[log]\nformat = "json"\n{node}\n'
    )
    return path


class Run:
    def __init__(self, nodes: TwoNodes, source: str, tmp_path: Path) -> None:
        """`source`: an S3 prefix, or a shared root (`file://`) both nodes see."""
        self.nodes, self.source = nodes, source
        lead = '[rollout]\nhost = "node-0"\n[node]\nrole = "lead"'
        stage = '[rollout]\nhost = "node-1"\n[node]\nrole = "stage"\nleader = "node-0"'
        lead_config = node_config(
            tmp_path / "lead.toml", source, nodes.cache, tmp_path / "lead", lead, nodes.engine.url
        )
        self.stage_config = node_config(
            tmp_path / "stage.toml", source, nodes.cache, tmp_path / "stage", stage
        )
        self.lead = DaemonProcess(lead_config, prefix=nodes.nodes[0].enter)
        self.stage = self.start_stage()
        self.step = 0

    def start_stage(self) -> DaemonProcess:
        return DaemonProcess(self.stage_config, prefix=self.nodes.nodes[1].enter)

    def publish(self, weights: Path) -> str:
        from vllm_reloader.tools.publish import publish
        from vllm_reloader.tools.upload import publish_remote

        self.step += 1
        name = f"step-{self.step}"
        if self.source.startswith("file://"):  # as a trainer on another host would
            publish(weights, Path(self.source.removeprefix("file://")), name=name, step=self.step)
        else:
            publish_remote(weights, self.source, name=name, step=self.step)
        return name

    def copy_on(self, node: int, name: str) -> Path:
        """A node's copy of `name`, as the host sees that node's disk."""
        found = list((self.nodes.nodes[node].disk / "checkpoints").glob(f"{name}@*"))
        assert len(found) == 1, found
        return found[0]

    def only_copy_on_node_1(self, name: str, timeout: float = 60.0) -> None:
        """Node 1 has let go of everything but `name` (the leader passed it: nothing older is kept)."""
        deadline = time.monotonic() + timeout
        while [p.name for p in (self.nodes.nodes[1].disk / "checkpoints").glob("step-*")] != [
            self.copy_on(1, name).name
        ]:
            assert time.monotonic() < deadline, list((self.nodes.nodes[1].disk / "checkpoints").iterdir())
            time.sleep(0.1)

    def serving(self) -> str:
        return self.nodes.engine.weight_version()

    def held_back(self, name: str, serving: str, reason: str) -> None:
        """The leader said node 1 lacks `name` (`reason`), and the engine was never paused."""
        short = self.lead.wait_for("node.not_staged", version=name, timeout=120, reason_has=reason)
        assert str(short["node"]).startswith("node 1 ("), short
        assert not self.lead.events("reload.started", version=name)
        assert not self.nodes.engine.is_paused() and self.serving() == serving

    def fault_after_staging(self, weights: Path, fault: Callable[[Path], None], reason: str) -> str:
        """A version staged on node 1, then `fault` done to that copy while node 1's daemon
        hangs and before the leader looks; the leader holds it back, and loads it once node
        1's daemon has fetched it again."""
        serving = self.serving()
        self.lead.process.send_signal(signal.SIGSTOP)
        try:
            name = self.publish(weights)
            _wait_staged(self.stage, name)
            self.stage.process.send_signal(signal.SIGSTOP)
            fault(self.copy_on(1, name))
        finally:
            self.lead.process.send_signal(signal.SIGCONT)
        try:
            self.held_back(name, serving, reason)
        finally:
            self.stage.process.send_signal(signal.SIGCONT)
        self.stage.wait_for("node.unstaged", timeout=60)
        self.lead.wait_for("reload.succeeded", version=name, timeout=180)
        return name


def _wait_staged(stage: DaemonProcess, name: str, timeout: float = 120.0) -> None:
    """Node 1's daemon marked its copy of `name` (`NAME@fingerprint`) as verified."""
    deadline = time.monotonic() + timeout
    while not [e for e in stage.events("node.staged") if str(e["name"]).startswith(f"{name}@")]:
        assert time.monotonic() < deadline, f"node 1 never staged {name}:\n{''.join(stage.raw[-20:])}"
        time.sleep(0.05)


def _flip_a_byte(copy: Path) -> None:
    shard = next(copy.glob("*.safetensors"))
    with shard.open("r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))


def _exploding(source: Path, into: Path) -> Path:
    """Finite weights every gate check passes, whose forward pass overflows (the canary fails)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, into)
    for shard in into.glob("*.safetensors"):
        save_file({k: (v.float() * 1e15).to(v.dtype) for k, v in load_file(str(shard)).items()}, str(shard))
    return into


def test_e2e_two_node_engine_reloads_on_every_rank_only_what_every_node_verified(
    tmp_path: Path, bucket: Bucket
):
    from vllm_reloader.tools.tinymodel import write_checkpoint

    a, b = write_checkpoint(tmp_path / "a", seed=1), write_checkpoint(tmp_path / "b", seed=2)
    bad = _exploding(b, tmp_path / "bad")
    with two_node_engine(a, tmp_path / "nodes", node_1_disk=64 << 20) as nodes:
        engine = nodes.engine
        fresh_a = engine.complete()  # a freshly started two-node engine on A
        run = Run(nodes, bucket.url, tmp_path)
        try:
            run.lead.wait_for("engine.reconciled", timeout=120)
            first = run.publish(b)
            done = run.lead.wait_for("reload.succeeded", version=first, timeout=180)
            answers_b = engine.complete()
            assert answers_b != fresh_a
            lead_copy = Path(str(done["path"]))
            assert lead_copy.parent.parent == nodes.cache and not (nodes.cache / "checkpoints").exists()
            marker_0 = json.loads(staged_marker(run.copy_on(0, first)).read_text())
            marker_1 = json.loads(staged_marker(run.copy_on(1, first)).read_text())
            assert (marker_0["node"], marker_1["node"]) == ("node-0", "node-1")
            assert marker_0["fingerprint"] == marker_1["fingerprint"]
            assert marker_0["files"] != marker_1["files"]  # each node's own files

            back = run.publish(a)
            run.lead.wait_for("reload.succeeded", version=back, timeout=180)
            assert engine.complete() == fresh_a, "every rank on both nodes holds A again, exactly"

            # Node 1's daemon down: no copy there; nothing pauses until it is back.
            assert run.stage.stop() == 0
            missing = run.publish(b)
            run.held_back(missing, back, "no copy at")
            run.stage = run.start_stage()
            run.lead.wait_for("reload.succeeded", version=missing, timeout=180)
            assert engine.complete() == answers_b

            # Node 1's copy gone after staging; then one byte of it changed after staging.
            run.fault_after_staging(a, shutil.rmtree, "no copy at")
            assert engine.complete() == fresh_a
            run.fault_after_staging(b, _flip_a_byte, "changed since node-1 verified it")
            assert engine.complete() == answers_b

            # Node 1's disk full: its download fails; once space is freed, the version loads.
            serving = run.serving()
            run.only_copy_on_node_1(serving)  # what it lets go frees no space after the fill
            filler = small_disk.fill(nodes.nodes[1].disk, leave=small_disk.PAGE)
            full = run.publish(a)
            run.stage.wait_for("download.failed", name=full, timeout=120)
            run.held_back(full, serving, "no copy at")
            filler.unlink()
            run.lead.wait_for("reload.succeeded", version=full, timeout=180)
            assert engine.complete() == fresh_a

            # A failed canary goes back to what every node still holds (node 1 keeps nothing else).
            broken = run.publish(bad)
            rolled = run.lead.wait_for("reload.rolled_back", version=broken, timeout=240)
            assert rolled["to_version"] == full and rolled["cause"] == "canary"
            assert engine.complete() == fresh_a and run.serving() == full
            run.stage.wait_for("cache.pruned", name=broken, timeout=120)  # its leader failed it
            assert staged_marker(run.copy_on(1, full)).exists()
            assert not run.lead.events("reload.failed")
        finally:
            for daemon in (run.lead, run.stage):
                daemon.process.send_signal(signal.SIGCONT)
                daemon.stop()


def test_e2e_two_node_engine_copies_from_a_shared_root_what_a_writer_cannot_change_under_it(tmp_path: Path):
    """Versions published into a shared root (one directory both nodes see, as NFS): each node
    copies its own; a writer rewriting a served version's shard in the share changes nothing
    any rank reads."""
    from vllm_reloader.tools.tinymodel import write_checkpoint

    a, b = write_checkpoint(tmp_path / "a", seed=1), write_checkpoint(tmp_path / "b", seed=2)
    shared = tmp_path / "shared"
    shared.mkdir()
    with two_node_engine(a, tmp_path / "nodes", node_1_disk=64 << 20) as nodes:
        engine = nodes.engine
        fresh_a = engine.complete()
        run = Run(nodes, f"file://{shared}", tmp_path)
        try:
            run.lead.wait_for("engine.reconciled", timeout=120)
            first = run.publish(b)
            run.lead.wait_for("reload.succeeded", version=first, timeout=180)
            assert engine.complete() != fresh_a
            back = run.publish(a)
            run.lead.wait_for("reload.succeeded", version=back, timeout=180)
            assert engine.complete() == fresh_a, "every rank on both nodes holds A again, exactly"
            for node in (0, 1):
                assert staged_marker(run.copy_on(node, back)).exists()

            # A careless writer rewrites the served version's shard in the share.
            copies = {n: {p.name: p.read_bytes() for p in run.copy_on(n, back).iterdir()} for n in (0, 1)}
            _flip_a_byte(shared / back)
            time.sleep(3)  # some 15 polls of each daemon
            assert engine.complete() == fresh_a and run.serving() == back
            for node in (0, 1):
                assert {p.name: p.read_bytes() for p in run.copy_on(node, back).iterdir()} == copies[node]
            assert len(run.lead.events("reload.started", version=back)) == 1
            assert not run.lead.events("reload.failed")
        finally:
            for daemon in (run.lead, run.stage):
                daemon.stop()
