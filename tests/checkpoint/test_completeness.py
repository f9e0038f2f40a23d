"""Trainers that write no manifest, written the way they write: their files, in their order.

HF `save_pretrained` writes config.json, the shards, then the index (not atomically);
Orbax writes into `<step>.orbax-checkpoint-tmp-<n>`, renames it, then writes
`commit_success.txt`; Hadoop/Spark-style jobs finish with `_SUCCESS`; NeMo keeps a
`<name>-unfinished` file next to the checkpoint until it is done.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.support.checkpoints import TENSORS, hf_index, write_weights
from vllm_reloader.checkpoint import gate, layout
from vllm_reloader.checkpoint.conventions import Convention
from vllm_reloader.checkpoint.files import INDEX_NAME
from vllm_reloader.sources import local

HF = gate.GateOptions(convention=Convention("hf-index", settle_seconds=30, manifest_grace=10))
MARKER = gate.GateOptions(convention=Convention("marker"))


def judge(directory: Path, options: gate.GateOptions, **kwargs: object) -> gate.Verdict:
    return gate.check(directory, serving=None, options=options, **kwargs)  # type: ignore[arg-type]


def hf_sharded(
    tmp_path: Path, name: str = "checkpoint-500", shards: int = 2
) -> tuple[Path, list[Path], bytes]:
    """A whole HF checkpoint's files in a scratch dir, and the index save_pretrained writes."""
    scratch = tmp_path / "scratch" / name
    paths = write_weights(scratch, shards=shards)
    return scratch, paths, hf_index(paths)


def test_hf_index_checkpoint_is_pending_until_the_index_is_whole_then_ready(tmp_path):
    scratch, shards, index = hf_sharded(tmp_path)
    target = tmp_path / "root" / "checkpoint-500"
    target.mkdir(parents=True)
    (target / "config.json").write_bytes((scratch / "config.json").read_bytes())
    assert judge(target, HF).status == "pending"
    for shard in shards:  # each shard written in two halves, as a stream would be
        data = shard.read_bytes()
        with (target / shard.name).open("wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            assert judge(target, HF).status == "pending"
            f.write(data[len(data) // 2 :])
        assert judge(target, HF).status == "pending", "no index yet"
    (target / INDEX_NAME).write_bytes(index[: len(index) // 2])
    half = judge(target, HF)
    assert half.status == "pending" and "not whole JSON" in half.reason
    (target / INDEX_NAME).write_bytes(index)
    ready = judge(target, HF)
    assert ready.status == "ready", ready.reason
    assert ready.bytes == sum(p.stat().st_size for p in shards)


def test_hf_index_rejects_an_index_still_broken_after_the_grace(tmp_path):
    scratch, _, index = hf_sharded(tmp_path)
    (scratch / INDEX_NAME).write_bytes(index[:10])
    mtime = (scratch / INDEX_NAME).stat().st_mtime
    late = judge(scratch, HF, now=mtime + 11)
    assert late.status == "rejected" and late.details["check"] == "manifest"


def test_hf_index_shard_shorter_than_its_header_is_pending_longer_is_rejected(tmp_path):
    scratch, shards, index = hf_sharded(tmp_path)
    (scratch / INDEX_NAME).write_bytes(index)
    data = shards[0].read_bytes()
    shards[0].write_bytes(data[:-5])
    short = judge(scratch, HF)
    assert short.status == "pending" and f"of {len(data)} bytes" in short.reason
    shards[0].write_bytes(data + b"extra")
    long = judge(scratch, HF)
    assert long.status == "rejected" and long.details["check"] == "sizes"


def test_hf_index_shard_missing_from_the_directory_is_pending(tmp_path):
    scratch, shards, index = hf_sharded(tmp_path)
    (scratch / INDEX_NAME).write_bytes(index)
    shards[1].unlink()
    verdict = judge(scratch, HF)
    assert verdict.status == "pending" and shards[1].name in verdict.reason


def test_hf_index_rejects_a_weight_map_pointing_outside_the_directory(tmp_path):
    scratch, _, _ = hf_sharded(tmp_path)
    (scratch / INDEX_NAME).write_text(json.dumps({"weight_map": {"lm_head.weight": "../x.safetensors"}}))
    verdict = judge(scratch, HF)
    assert verdict.status == "rejected" and verdict.details["check"] == "paths"


def test_hf_index_layout_is_still_compared_with_the_serving_model(tmp_path):
    serving_dir = tmp_path / "serving"
    write_weights(serving_dir)
    scratch, _, _ = hf_sharded(tmp_path)
    bigger = {**TENSORS, "lm_head.weight": (17, 8)}
    for p in scratch.glob("*.safetensors"):
        p.unlink()
    paths = write_weights(scratch, bigger, shards=1)
    weight_map = {t: paths[0].name for t in bigger}
    (scratch / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    verdict = gate.check(scratch, serving=layout.read_served_layout(serving_dir), options=HF)
    assert verdict.status == "rejected" and verdict.details["tensor"] == "lm_head.weight"


def test_hf_single_file_waits_for_the_directory_to_settle(tmp_path):
    directory = tmp_path / "root" / "final"
    write_weights(directory)  # model.safetensors + config.json, no index
    newest = max(p.stat().st_mtime for p in directory.iterdir())
    early = judge(directory, HF, now=newest + 5)
    assert early.status == "pending" and "quiet" in early.reason
    assert judge(directory, HF, now=newest + 31).status == "ready"


def test_hf_single_file_truncated_stays_pending_after_settling(tmp_path):
    directory = tmp_path / "root" / "final"
    (path,) = write_weights(directory)
    path.write_bytes(path.read_bytes()[:-100])
    newest = max(p.stat().st_mtime for p in directory.iterdir())
    assert judge(directory, HF, now=newest + 60).status == "pending"


def test_orbax_style_checkpoint_is_ready_once_commit_success_is_written(tmp_path):
    root = tmp_path / "root"
    tmp = root / "500.orbax-checkpoint-tmp-1733212345"
    write_weights(tmp, shards=2)
    assert local.list_candidates(root, ()) == set(), "Orbax's temporary directory is never a candidate"
    os.rename(tmp, root / "500")
    assert judge(root / "500", MARKER).status == "pending"
    (root / "500" / "commit_success.txt").write_text("Checkpoint commit was successful to ...")
    ready = judge(root / "500", MARKER)
    assert ready.status == "ready", ready.reason
    assert {f.path for f in ready.manifest.files} == {p.name for p in (root / "500").glob("*.safetensors")}


@pytest.mark.parametrize("marker", ["_SUCCESS", "COMPLETE"])
def test_marker_checkpoint_with_a_truncated_shard_stays_pending(tmp_path, marker):
    directory = tmp_path / "root" / "job-7"
    (path,) = write_weights(directory)
    path.write_bytes(path.read_bytes()[:-3])
    (directory / marker).touch()
    verdict = judge(directory, MARKER)
    assert verdict.status == "pending" and "bytes" in verdict.reason
    (path,) = write_weights(directory)
    assert judge(directory, MARKER).status == "ready"


def test_marker_checkpoint_without_safetensors_is_rejected(tmp_path):
    directory = tmp_path / "root" / "orbax-native"
    directory.mkdir(parents=True)
    (directory / "_CHECKPOINT_METADATA").write_text("{}")
    (directory / "commit_success.txt").touch()
    verdict = judge(directory, MARKER)
    assert verdict.status == "rejected" and ".safetensors" in verdict.reason


def test_nemo_unfinished_marker_holds_the_checkpoint_pending_in_every_mode(tmp_path):
    root = tmp_path / "root"
    name = "megatron_gpt--val_loss=1.23-step=100-consumed_samples=800"
    (root / f"{name}-unfinished").parent.mkdir(parents=True)
    (root / f"{name}-unfinished").touch()  # NeMo writes the marker first
    scratch, _, index = hf_sharded(tmp_path, name)
    os.rename(scratch, root / name)
    (root / name / INDEX_NAME).write_bytes(index)
    held = judge(root / name, HF)
    assert held.status == "pending" and "-unfinished" in held.reason
    assert local.list_candidates(root, ()) == {name}
    assert local.candidate_name(root, str(root / f"{name}-unfinished"), ()) == name
    (root / f"{name}-unfinished").unlink()  # ...and removes it last
    assert judge(root / name, HF).status == "ready"


def test_always_ignored_names_cannot_be_configured_away(tmp_path):
    for name in ("tmp-checkpoint-100", "3.orbax-checkpoint-tmp-9", "x.tmp", "y.partial", ".hidden", "step-1"):
        (tmp_path / name).mkdir()
    assert local.list_candidates(tmp_path, ()) == {"step-1"}
    assert local.list_candidates(tmp_path, ("step-*",)) == set()


def test_foreign_checkpoint_changing_while_checked_is_pending(tmp_path, monkeypatch):
    scratch, _, index = hf_sharded(tmp_path)
    (scratch / INDEX_NAME).write_bytes(index)
    serving = layout.read_served_layout(scratch)
    real = layout.read_arch

    def touch_then_read(directory):
        (scratch / "trainer_state.json").write_text("{}")  # the trainer writes one more file
        return real(directory)

    monkeypatch.setattr(layout, "read_arch", touch_then_read)
    verdict = gate.check(scratch, serving=serving, options=HF)
    assert verdict.status == "pending" and "changed" in verdict.reason
    monkeypatch.setattr(layout, "read_arch", real)
    assert gate.check(scratch, serving=serving, options=HF, now=time.time()).status == "ready"
