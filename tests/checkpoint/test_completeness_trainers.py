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

from vllm_reloader.checkpoint import conventions, gate
from vllm_reloader.checkpoint.conventions import Convention
from vllm_reloader.checkpoint.files import INDEX_NAME

AUTO = gate.GateOptions(convention=Convention(manifest_grace=10))
CONVERTING = gate.GateOptions(convention=Convention(manifest_grace=10, converter=True))


def judge(directory: Path, now: float | None = None, options: gate.GateOptions = AUTO) -> gate.Verdict:
    return gate.check(directory, serving=None, options=options, now=now)


def converts(directory: Path) -> str | None:
    """What a converter would be run on as (`details["convert"]`), None while not whole."""
    verdict = judge(directory, options=CONVERTING)
    assert verdict.status == "pending", verdict
    convert = verdict.details.get("convert")
    assert (convert is None) == ("being converted" not in verdict.reason), verdict.reason
    return None if convert is None else str(convert)


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
    assert writing.status == "pending" and "whole once .metadata is renamed in" in writing.reason
    assert "set [source] converter" in complete.reason and "set [source] converter" in writing.reason


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


def test_torch_dcp_checkpoint_goes_to_the_converter_once_its_metadata_is_renamed_in(tmp_path: Path):
    import torch
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "step-3"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.ones(4, 4)}, checkpoint_id=str(out))
    assert converts(out) == "torch-dcp"
    whole = judge(out, options=CONVERTING).fingerprint
    metadata = (out / ".metadata").read_bytes()
    (out / ".metadata").unlink()  # the state before FileSystemWriter's last rename
    assert converts(out) is None
    (out / ".metadata").write_bytes(metadata)
    assert converts(out) == "torch-dcp"
    assert judge(out, options=CONVERTING).fingerprint not in ("", whole), "rewritten: other content"


def _files(directory: Path, *names: str) -> Path:
    for name in names:
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(b"\0" * 64)
    return directory


def test_deepspeed_checkpoint_is_whole_once_latest_names_it(tmp_path: Path):
    """DeepSpeed's order, as inotify saw DeepSpeed 0.19.8's `save_checkpoint` (CPU, ZeRO 2):
    `global_stepN/`, its model states, each rank's ZeRO partition; `zero_to_fp32.py` and
    `zero_to_torch.py` into the save dir; the tag into `<save_dir>/latest` last."""
    step = _files(tmp_path / "global_step20", "mp_rank_00_model_states.pt")
    assert converts(step) is None
    _files(step, "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert converts(step) is None
    _files(tmp_path, "zero_to_fp32.py", "zero_to_torch.py")
    assert converts(step) is None
    (tmp_path / "latest").write_text("global_step10")  # the save before: not this one
    assert converts(step) is None
    assert "whole once latest names it" in judge(step).reason
    (tmp_path / "latest").write_text("global_step20")
    assert converts(step) == "deepspeed"


def test_megatron_torch_dist_is_whole_with_its_metadata_json_and_the_tracker_naming_it(tmp_path: Path):
    """Megatron's order: `iter_N/` DCP files and `.metadata`, `common.pt`, `metadata.json`
    last in the folder, then the iteration into `latest_checkpointed_iteration.txt`."""
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("50")
    step = _files(tmp_path / "iter_0000100", "__0_0.distcp", "__1_0.distcp", ".metadata", "common.pt")
    assert converts(step) is None
    assert "Megatron torch DCP" in judge(step).reason
    _files(step, "metadata.json")
    assert converts(step) is None, "the tracker still names the iteration before"
    tracker.write_text("100\n")
    assert converts(step) == "megatron"
    tracker.unlink()  # a root without a tracker: metadata.json is the last file
    assert converts(step) == "megatron"


def test_megatron_legacy_layout_waits_for_its_tracker_not_as_an_empty_checkpoint(tmp_path: Path):
    step = _files(tmp_path / "iter_0000200", "mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt")
    assert "Megatron legacy" in judge(step).reason
    assert converts(step) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("200")
    assert converts(step) == "megatron"


@pytest.mark.parametrize("odd", ["fifo", "symlink", "directory", "huge", "binary"])
def test_a_tracker_that_is_not_a_small_regular_file_names_nothing_and_stops_nothing(tmp_path: Path, odd: str):
    import os

    step = _files(tmp_path / "global_step5", "mp_rank_00_model_states.pt")
    tracker = tmp_path / "latest"
    if odd == "fifo":
        os.mkfifo(tracker)  # opening it for reading would block: it is never opened
    elif odd == "symlink":
        (tmp_path / "elsewhere").write_text("global_step5")
        tracker.symlink_to(tmp_path / "elsewhere")
    elif odd == "directory":
        tracker.mkdir()
    elif odd == "huge":
        tracker.write_bytes(b"global_step5" + b" " * (1 << 20))
    else:
        tracker.write_bytes(b"\xff\xfe global_step5 \0")
    assert converts(step) is None


@pytest.mark.parametrize(
    ("name", "state", "step"),
    [
        ("checkpoint-200", b"", 200),
        ("step-7", b"", 7),
        ("global_step300", b"", 300),
        ("checkpoint-200", b'{"global_step": 250}', 200),  # the name (Trainer's): no file read
        ("checkpoint-" + "9" * 30, b"", None),  # beyond any manifest step: no step
        ("final", b"[" * 100_000, None),  # nested past the parser
        ("final", b'{"global_step": 1e3}', None),
        ("final", b'{"global_step": 9}', 9),
        ("final", b"", None),  # save_model's output: no step anywhere
        ("model-v2", b"", None),  # a number that is not a step
        ("checkpoint-200", b'{"global_step": true}', 200),
        ("checkpoint-200", b'{"global_step": -1}', 200),
        ("checkpoint-200", b'{"global_step": "300"}', 200),
        ("checkpoint-200", b"[" * 100_000, 200),  # nested past the parser
        ("checkpoint-200", b'{"global_step": 3', 200),  # half written
    ],
)
def test_trainer_step_reads_global_step_then_the_name(name: str, state: bytes, step: int | None):
    assert conventions.trainer_step(name, state) == step


@pytest.mark.parametrize("names", [[], ["config.json"], ["config.json", "generation_config.json"]])
def test_waiting_reason_of_a_save_just_begun_asks_whether_it_is_still_written_before_advising_publish(names):
    """A Trainer's save starts as an empty directory, then config.json: not told to publish it."""
    reason = conventions.waiting_reason(names)
    assert "still being written?" in reason
    assert reason.index("still being written?") < reason.index("vllm-reloader publish")
