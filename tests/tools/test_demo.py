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
        assert engine.weight_version().startswith("demo-")
        assert engine.complete() == before
        first = engine.weight_version()
        run_demo("--engine-url", engine.url)  # again: the version left by the first run is no obstacle
        assert engine.weight_version() not in ("default", first)
    finally:
        engine.stop()
