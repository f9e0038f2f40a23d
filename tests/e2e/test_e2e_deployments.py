"""The real engine as users deploy it: guarded by `--api-key`, and so on (docs/deployments.md)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.dtypes import converted
from tests.support.e2e_world import World, _next_step_above_serving, list_files
from tests.support.engine_fixtures import API_KEY, DaemonProcess, daemon_config, start_engine
from tests.support.hub_cache import cache_model
from tests.support.service_fixtures import NotifySocket
from vllm_reloader.tools.publish import publish

pytestmark = pytest.mark.engine


def test_e2e_engine_with_api_key_refuses_calls_without_it(world: World):
    """What makes the key matter: the canary's /v1/completions is guarded (dev routes are not)."""
    body = {"model": "tiny", "prompt": "w1", "max_tokens": 1}
    assert httpx.post(f"{world.engine.url}/v1/completions", json=body, timeout=60).status_code == 401
    assert world.engine.http.post("/v1/completions", json=body).status_code == 200


def test_e2e_daemon_under_systemd_sends_ready_every_start_even_when_systemd_reads_late(
    world: World, tmp_path: Path
):
    """The shipped unit's environment (NOTIFY_SOCKET, WATCHDOG_USEC=60 s), the real engine
    already up, five starts: READY=1 naming the served version each time, also when the
    notify queue was full through the start and read only after the engine was warmed."""
    assert world.daemon.stop() == 0
    try:
        for start in range(5):
            notify = NotifySocket(tmp_path / f"notify-{start}.sock")
            late = start % 2 == 1
            if late:  # as systemd busy: the kernel's default queue of 10 datagrams, all taken
                notify.fill()
            env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "60000000"}
            daemon = DaemonProcess(world.config, env=env)
            try:
                daemon.wait_for("engine.reconciled", version=world.serving)
                if late:
                    daemon.wait_for("engine.warmed")
                    time.sleep(1.0)
                ready = notify.wait_for("READY=1", timeout=30.0)
                assert f"STATUS=serving {world.serving}" in " ".join(ready), (start, ready)
            finally:
                assert daemon.stop() == 0
                notify.close()
    finally:
        world.start_daemon()


def test_e2e_daemon_with_api_key_file_reloads_and_never_logs_the_key(world: World, tmp_path: Path):
    """It stops the world's daemon first (one engine, one daemon), and starts it again after."""
    assert world.daemon.stop() == 0
    key_file = tmp_path / "engine.key"
    key_file.write_text(API_KEY + "\n")
    key_file.chmod(0o600)
    config = tmp_path / "daemon.toml"
    config.write_text(
        world.config.read_text().replace("[engine]\n", f'[engine]\napi_key_file = "{key_file}"\n')
    )
    daemon = DaemonProcess(config, env={"VLLM_API_KEY": ""})  # the file alone
    try:
        daemon.wait_for("engine.reconciled", version=world.serving)
        name, staged = world.stage("B")
        list_files(staged, name, step=_next_step_above_serving(world))
        staged.rename(world.root / name)
        done = daemon.wait_for("reload.succeeded", version=name, timeout=120)
        assert done.get("canary_ms") is not None, "the canary ran (and passed) through the guarded route"
        assert not daemon.events("reload.rolled_back")
        world.serving, world.expected = name, world.engine.complete()
        world.outputs_b = world.outputs_b or world.expected
    finally:
        assert daemon.stop() == 0
        world.serving = world.engine.weight_version()  # from outside the world's root
        world.start_daemon()
    assert not [line for line in daemon.raw if API_KEY in line]


def test_e2e_bf16_engine_started_offline_from_a_hub_model_id_takes_float32_and_float16(tmp_path: Path):
    """`vllm serve org/tiny --dtype bfloat16` from a Hugging Face cache (no download): the daemon
    finds the snapshot for its baseline. A' (A with the values float16 cannot hold zeroed) is
    the same numbers in bfloat16, float16 and float32, so the engine's fresh answers on the
    cached float16 copy are the reference for each copy hot-reloaded after other weights (B).
    Its own engine."""
    from vllm_reloader.tools.tinymodel import write_checkpoint

    a, b = (write_checkpoint(tmp_path / n, seed=s) for n, s in (("a", 1), ("b", 2)))
    a16 = converted(a, tmp_path / "a16", "float16", exact=True)
    a32 = converted(a, tmp_path / "a32", "float32", exact=True)
    a_bf16 = converted(a, tmp_path / "abf16", "bfloat16", exact=True)
    cache = tmp_path / "hf" / "hub"
    snapshot = cache_model(cache, "org/tiny", a16)
    hub = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    engine = start_engine("org/tiny", tmp_path / "hub-engine.log", env=hub)
    try:
        fresh = engine.complete()
        root = tmp_path / "root"
        config = daemon_config(
            tmp_path / "d.toml", root=root, engine_url=engine.url, state_dir=tmp_path / "s"
        )  # it makes the root and the state dir
        daemon = DaemonProcess(config, env=hub)
        try:
            reconciled = daemon.wait_for("engine.reconciled", version="default")
            assert Path(str(reconciled["path"])) == snapshot
            assert str(reconciled["vllm_version"]).startswith("0.")
            step = iter(range(2, 100))
            for copy in (a32, a16, a_bf16):
                other = publish(b, root, step=next(step))
                daemon.wait_for("reload.succeeded", version=other.name, timeout=120)
                assert engine.complete() != fresh, "B answers otherwise, or this proves nothing"
                loaded = publish(copy, root, step=next(step))
                daemon.wait_for("reload.succeeded", version=loaded.name, timeout=120)
                assert engine.complete() == fresh, f"{copy.name} hot-reloaded answers as a fresh engine"
            assert not daemon.events("checkpoint.rejected") and not daemon.events("reload.rolled_back")
        finally:
            assert daemon.stop() == 0
    finally:
        engine.stop()


def test_e2e_no_prefix_cached_with_old_weights_is_reused_after_a_reload(world: World):
    """A prompt longer than one KV block, cached before the reload, computes afterwards exactly
    as a prompt that can share no cached block (another `cache_salt`) does."""
    info = world.engine.http.get("/server_info", params={"config_format": "json"}).json()
    cache_config = info["vllm_config"]["cache_config"]
    assert cache_config["enable_prefix_caching"], "the engine caches prefixes (vLLM's default)"
    words = min(cache_config["block_size"] * 3 // 2, 230)
    assert words > cache_config["block_size"], "the prompt fills at least one whole block"
    prompt = " ".join(f"w{3 + i % 240}" for i in range(words))

    def answer(**extra: object) -> tuple[str, list[float]]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1, **extra}
        response = world.engine.http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["text"], choice["logprobs"]["token_logprobs"]

    def hits() -> float:
        text = world.engine.http.get("/metrics").text
        return sum(float(v) for v in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M))

    before = answer()
    cached_hits = hits()
    assert answer() == before and hits() > cached_hits, "the second ask reused the cached prefix"
    name = world.publish("C")
    world.daemon.wait_for("reload.succeeded", version=name, timeout=120)
    after = answer()
    assert after == answer(cache_salt=f"cold-{name}"), "a prefix cached with the old weights was reused"
    assert after != before, "the new weights compute this prompt differently"
    world.serving, world.expected = name, world.engine.complete()


def test_e2e_trainer_run_is_followed_to_its_last_checkpoint(world: World, tmp_path: Path):
    """A real `transformers.Trainer` run saves float32 `checkpoint-N/` (model.safetensors mode
    0600) into the root and rotates old ones away (`save_total_limit=2`); the daemon, in
    `hf-index` mode, follows it into the engine started on bfloat16, to its last checkpoint."""
    assert world.daemon.stop() == 0
    root = tmp_path / "trainer"
    config = daemon_config(
        tmp_path / "d.toml", root=root, engine_url=world.engine.url, state_dir=tmp_path / "s"
    )
    config.write_text(
        config.read_text().replace(
            "[source]\n", '[source]\ncompleteness = "hf-index"\nsettle_seconds = 1.0\n'
        )
    )  # daemon_config made the root and the state dir
    daemon = DaemonProcess(config)
    try:
        daemon.wait_for("engine.reconciled")
        trainer = [
            sys.executable,
            "-m",
            "tests.support.trainer_run",
            str(world.staging / "seed-1"),
            str(root),
            "3",
        ]
        run = subprocess.run(trainer, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        assert sorted(p.name for p in root.iterdir()) == ["checkpoint-4", "checkpoint-6"], "rotated"
        assert (root / "checkpoint-6" / "model.safetensors").stat().st_mode & 0o777 == 0o600
        done = daemon.wait_for("reload.succeeded", version="checkpoint-6", timeout=120)
        assert done.get("canary_ms") is not None
        assert world.engine.weight_version() == "checkpoint-6"
        assert len(daemon.events("reload.succeeded")) >= 2, "it followed the run, not only its end"
        assert not daemon.events("checkpoint.rejected") and not daemon.events("reload.failed")
    finally:
        assert daemon.stop() == 0
        world.serving = world.engine.weight_version()  # from outside the world's root
        world.start_daemon()


def test_e2e_two_rank_dcp_save_in_hf_format_is_served_like_a_fresh_engine(world: World, tmp_path: Path):
    """Two gloo ranks save with `HuggingFaceStorageWriter` (consolidated), as TorchTitan's
    `last_save_in_hf` does, straight into `step-N/` of the watched root (`auto` completeness):
    every rank's slices into `sharded/`, then the consolidated shards, the index last. The
    engine ends serving each, B then A, and on A answers as the freshly started engine did."""
    assert world.daemon.stop() == 0
    root = tmp_path / "titan"
    url, state = world.engine.url, tmp_path / "s"
    daemon = DaemonProcess(daemon_config(tmp_path / "d.toml", root=root, engine_url=url, state_dir=state))
    try:
        daemon.wait_for("engine.reconciled")
        for name, seed in (("step-10", "seed-2"), ("step-20", "seed-1")):
            source, into = str(world.staging / seed), str(root / name)
            ranks = [sys.executable, "-m", "tests.support.dcp_run", source, into]
            run = subprocess.run(ranks, capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, run.stderr[-3000:]
            assert (root / name / "sharded").is_dir(), "the ranks' slices stay beside the consolidated shards"
            daemon.wait_for("reload.succeeded", version=name, timeout=120)
            assert (world.engine.complete() == world.fresh_a) == (seed == "seed-1")
        assert [e["version"] for e in daemon.events("reload.started")] == ["step-10", "step-20"]
        assert not daemon.events("checkpoint.rejected") and not daemon.events("reload.failed")
    finally:
        assert daemon.stop() == 0
        world.serving = world.engine.weight_version()  # from outside the world's root
        world.start_daemon()


def test_e2e_two_rank_dcp_save_is_converted_by_the_configured_converter_and_served(
    world: World, tmp_path: Path
):
    """Two gloo ranks save with DCP's own FileSystemWriter (`.distcp`, `.metadata` last),
    which vLLM cannot read, into the watched root; `[source] converter` runs the shipped
    deploy/converters/dcp_to_safetensors.py on it once whole. The engine serves the output
    and answers as the freshly started engine did; a DCP checkpoint the converter fails on
    is rejected with its last line, and the engine serves on."""
    assert world.daemon.stop() == 0
    root = tmp_path / "dcp"
    script = Path(__file__).parents[2] / "deploy" / "converters" / "dcp_to_safetensors.py"
    argv = json.dumps([sys.executable, str(script), "{input}", "{output}"])
    config = daemon_config(
        tmp_path / "d.toml", root=root, engine_url=world.engine.url, state_dir=tmp_path / "s",
        source_extra=f"converter = {argv}\n",
    )  # fmt: skip
    daemon = DaemonProcess(config)
    try:
        daemon.wait_for("engine.reconciled")
        for name, seed in (("step-30", "seed-2"), ("step-40", "seed-1")):
            ranks = [
                sys.executable,
                "-m",
                "tests.support.dcp_run",
                str(world.staging / seed),
                str(root / name),
                "plain",
            ]
            run = subprocess.run(ranks, capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, run.stderr[-3000:]
            placed = daemon.wait_for("checkpoint.converted", name=name, timeout=120)["placed"]
            daemon.wait_for("reload.succeeded", path=str(root / placed), timeout=120)
            assert (world.engine.complete() == world.fresh_a) == (seed == "seed-1")
        broken = root / "step-50"
        shutil.copytree(root / "step-40", broken)
        (broken / "__0_0.distcp").write_bytes(b"not what .metadata describes")
        rejected = daemon.wait_for("checkpoint.rejected", name="step-50", timeout=120)
        assert rejected["check"] == "converter" and "exited with status 1" in rejected["reason"]
        assert world.engine.complete() == world.fresh_a
        assert [e["version"] for e in daemon.events("reload.started")] == ["step-30", "step-40"]
        assert not daemon.events("reload.failed")
    finally:
        assert daemon.stop() == 0
        world.serving = world.engine.weight_version()
        world.start_daemon()
