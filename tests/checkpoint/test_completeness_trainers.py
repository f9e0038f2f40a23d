"""Trainers' own layouts, written by the trainers' real writers where they run here (torch
DCP), in their real order of writes: every partial state is pending, never loadable; the
formats vLLM cannot read say what they are and what to do instead."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from vllm_reloader.checkpoint import gate
from vllm_reloader.checkpoint.conventions import Convention
from vllm_reloader.checkpoint.files import INDEX_NAME

AUTO = gate.GateOptions(convention=Convention(manifest_grace=10))


def judge(directory: Path, now: float | None = None) -> gate.Verdict:
    return gate.check(directory, serving=None, options=AUTO, now=now)


@pytest.fixture(scope="module")
def hf_writer_output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What TorchTitan's `last_save_in_hf` leaves: two gloo ranks' `sharded/` files, the
    consolidated shards, the index."""
    from vllm_reloader.tools.tinymodel import write_checkpoint

    base = tmp_path_factory.mktemp("dcp")
    source = write_checkpoint(base / "seed", seed=1)
    out = base / "out"
    run = [sys.executable, "-m", "tests.support.dcp_run", str(source), str(out)]
    done = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def _header_only(shard: Path, into: Path) -> None:
    """A consolidated shard as `_write_metadata` leaves it: its header, before any data."""
    data = shard.read_bytes()
    length = 8 + int.from_bytes(data[:8], "little")
    (into / shard.name).write_bytes(data[:length])


def test_hf_storage_writer_consolidation_is_pending_in_every_state_before_its_index(
    hf_writer_output: Path, tmp_path: Path
):
    out = hf_writer_output
    first, second = sorted(out.glob("model-*.safetensors"))
    states = tmp_path / "states"
    shutil.copytree(out / "sharded", states / "sharded")  # 1. every rank's slices
    assert judge(states).status == "pending"
    _header_only(first, states)  # 2. the first consolidated shard: its header, then its data
    assert judge(states).status == "pending"
    shutil.copy2(first, states)
    _header_only(second, states)
    assert judge(states).status == "pending"
    shutil.copy2(second, states)  # 3. both whole, no index
    verdict = judge(states)
    assert verdict.status == "pending" and INDEX_NAME in verdict.reason
    index = (out / INDEX_NAME).read_bytes()
    (states / INDEX_NAME).write_bytes(index[: len(index) // 2])  # 4. the index mid-write
    assert judge(states).status == "pending"
    (states / INDEX_NAME).write_bytes(index)  # 5. whole: ready, the slices in sharded/ ignored
    ready = judge(states)
    assert ready.status == "ready", ready.reason
    assert sorted(f.path for f in ready.manifest.files) == [first.name, second.name]


def test_torch_dcp_checkpoint_says_vllm_cannot_read_it_before_and_after_its_metadata(tmp_path: Path):
    import torch
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "dcp"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.ones(4, 4)}, checkpoint_id=str(out))  # .distcp files, then .metadata
    complete = judge(out)
    assert complete.status == "pending" and "torch DCP checkpoint (complete)" in complete.reason
    assert "HuggingFaceStorageWriter" in complete.reason
    (out / ".metadata").unlink()
    writing = judge(out)
    assert writing.status == "pending" and ".metadata comes last" in writing.reason


@pytest.mark.parametrize(
    ("names", "said"),
    [
        (["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"], "zero_to_fp32.py"),
        (["__0_0.distcp", ".metadata", "metadata.json", "common.pt"], "Megatron torch DCP"),
        (["shard-00001-model-00001-of-00001.safetensors"], "enable_consolidation=True"),
    ],
)
def test_trainer_formats_vllm_cannot_read_wait_saying_how_to_convert(
    tmp_path: Path, names: list[str], said: str
):
    for name in names:
        if name.endswith(".safetensors"):
            save_file({"w": np.zeros((4, 4), np.float32)}, tmp_path / name)
        else:
            (tmp_path / name).write_bytes(b"\0" * 64)
    verdict = judge(tmp_path, now=time.time() + 3600)
    assert verdict.status == "pending" and said in verdict.reason
