"""The engine killed in the middle of a reload and restarted: the daemon (killed too, at
the same moment) comes back, waits for it, and converges. Its own engine: this one dies.
It runs without the worker extension: the daemon falls back to vLLM's own reload."""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.support.engine_fixtures import DaemonProcess, daemon_config, start_engine
from vllm_reloader.service import state
from vllm_reloader.tools.publish import publish

pytestmark = pytest.mark.engine


def test_engine_killed_mid_reload_then_restarted_converges(tmp_path: Path):
    from vllm_reloader.tools.tinymodel import write_checkpoint

    root = tmp_path / "root"
    publish(write_checkpoint(tmp_path / "a", seed=1), root, step=1)
    b = write_checkpoint(tmp_path / "b", seed=2)
    engine = start_engine(root / "step-1", tmp_path / "engine-1.log", extension=False)
    port = int(engine.url.rsplit(":", 1)[1])
    config = daemon_config(tmp_path / "d.toml", root=root, engine_url=engine.url, state_dir=tmp_path / "s")
    restarted = None
    first = DaemonProcess(config, env={"VLLM_RELOADER_FAILPOINT": "after_pause"})
    try:
        first.wait_for("engine.reconciled", version="step-1")
        publish(b, root, step=2)
        assert first.process.wait(timeout=60) == -signal.SIGKILL
        assert engine.is_paused(), "the daemon died with the engine paused, mid-reload"
        engine.stop()  # ...and the engine dies too
        # systemd brings the engine back, here on B's bytes, so its fresh answers are the reference.
        shutil.copytree(b, tmp_path / "b-fresh")
        restarted = start_engine(tmp_path / "b-fresh", tmp_path / "engine-2.log", port=port, extension=False)
        fresh_b = restarted.complete()
        second = DaemonProcess(config)
        try:
            assert second.wait_for("reload.started", version="step-2", timeout=120)["loader"] == "builtin"
            assert "load" not in second.wait_for("reload.succeeded", version="step-2", timeout=120)
            assert restarted.weight_version() == "step-2" and not restarted.is_paused()
            assert restarted.complete() == fresh_b
            deadline = time.monotonic() + 10
            while (saved := state.load(tmp_path / "s")).serving is None or saved.serving.version != "step-2":
                assert time.monotonic() < deadline
                time.sleep(0.05)
        finally:
            assert second.stop() == 0
    finally:
        first.stop()
        engine.stop()
        if restarted is not None:
            restarted.stop()
