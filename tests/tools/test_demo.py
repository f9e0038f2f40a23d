"""`vllm-reloader demo` as a newcomer runs it: its own tiny checkpoints and CPU engine, or an
engine the user already runs (--engine-url)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.engine_fixtures import start_engine

pytestmark = pytest.mark.engine


def run_demo(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "vllm_reloader", "demo", *args], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_demo_reloads_and_reports_against_engine_start():
    out = run_demo()
    assert "reload.succeeded" in out
    assert "answer changed: True" in out
    assert "x the reload)" in out
    assert "vllm-reloader-demo-" in out and "kept" not in out


def test_demo_with_engine_url_reloads_the_users_engine_and_leaves_it_running(tmp_path: Path):
    from vllm_reloader.tools.tinymodel import write_checkpoint

    engine = start_engine(write_checkpoint(tmp_path / "model", seed=3), tmp_path / "engine.log", api_key=None)
    try:
        before = engine.complete()
        out = run_demo("--engine-url", engine.url)
        assert "using the engine at " + engine.url in out
        assert "reload.succeeded" in out
        assert "answer changed: False" in out  # its own weights, republished
        assert engine.healthy() and not engine.is_paused()
        assert engine.weight_version() == "default", "named as it started: the same bytes"
        assert "weight version is 'default' again" in out
        assert engine.complete() == before
        run_demo("--engine-url", engine.url)  # again: nothing the first run left is an obstacle
        assert engine.weight_version() == "default" and engine.complete() == before
        engine.http.post("/update_weight_version", json={"new_version": "step-7"}).raise_for_status()
        refused = subprocess.run(
            [sys.executable, "-m", "vllm_reloader", "demo", "--engine-url", engine.url],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        assert "serves 'step-7', not the weights it started with" in refused.stderr
        assert "run the demo without --engine-url" in refused.stderr
        assert engine.weight_version() == "step-7" and not engine.is_paused(), "nothing touched"
    finally:
        engine.stop()
