"""A real CPU engine with tensor parallelism: two workers, each loading its part of every
reload. Its own engine (two ranks, each bound to one of the two cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.engine_fixtures import DaemonProcess, daemon_config, start_engine
from vllm_reloader.tools.publish import publish

pytestmark = pytest.mark.engine

TWO_RANKS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
"""Without it vLLM refuses: "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"."""


def test_e2e_tensor_parallel_engine_reloads_every_rank_and_restores_when_one_fails(tmp_path: Path):
    from vllm_reloader.tools.tinymodel import write_checkpoint

    root = tmp_path / "root"
    a, b = write_checkpoint(tmp_path / "a", seed=1), write_checkpoint(tmp_path / "b", seed=2)
    publish(a, root, step=1)
    engine = start_engine(
        root / "step-1", tmp_path / "engine.log", env=TWO_RANKS, args=("--tensor-parallel-size", "2")
    )
    try:
        fresh_a = engine.complete()
        config = daemon_config(
            tmp_path / "d.toml", root=root, engine_url=engine.url, state_dir=tmp_path / "s"
        )
        daemon = DaemonProcess(config)
        try:
            daemon.wait_for("engine.reconciled", version="step-1")
            fail = engine.holds / "load_start.rank1.fail"
            fail.touch()  # rank 1 alone fails, once; rank 0 loads

            publish(b, root, step=2)
            failed = daemon.wait_for("reload.failed", version="step-2", timeout=180)
            assert failed["restored"] is True and "failpoint load_start on rank 1" in failed["reason"]
            assert not fail.exists()
            assert engine.weight_version() == "step-1" and not engine.is_paused()
            assert engine.complete() == fresh_a, "rank 0's new weights were replaced too"

            publish(b, root, step=3)
            done = daemon.wait_for("reload.succeeded", version="step-3", timeout=180)
            load = done["load"]
            assert isinstance(load, dict) and load["workers"] == 2 and len(load["rank_seconds"]) == 2
            assert load["bytes"] == sum(load["rank_bytes"]) > 0
            assert engine.complete() != fresh_a
            publish(a, root, step=4)
            daemon.wait_for("reload.succeeded", version="step-4", timeout=180)
            assert engine.complete() == fresh_a, "both ranks hold A again, exactly"
        finally:
            assert daemon.stop() == 0
    finally:
        engine.stop()
