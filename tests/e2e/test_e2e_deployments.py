"""The real engine as users deploy it: guarded by `--api-key`, and so on (README, "Deployments")."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.e2e_world import World, _next_step_above_serving, list_files
from tests.support.engine_fixtures import API_KEY, DaemonProcess

pytestmark = pytest.mark.engine


def test_e2e_engine_with_api_key_refuses_calls_without_it(world: World):
    """What makes the key matter: the canary's /v1/completions is guarded (dev routes are not)."""
    body = {"model": "tiny", "prompt": "w1", "max_tokens": 1}
    assert httpx.post(f"{world.engine.url}/v1/completions", json=body, timeout=60).status_code == 401
    assert world.engine.http.post("/v1/completions", json=body).status_code == 200


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
        world.start_daemon()
    assert not [line for line in daemon.raw if API_KEY in line]
