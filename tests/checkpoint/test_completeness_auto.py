"""The default completeness, `auto`: a checkpoint is whole by whichever convention its files
show — our manifest, a marker, HF Trainer's trainer_state.json, HF's index, or a lone
model.safetensors — written here in each writer's own order."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tests.support.checkpoints import hf_index, write_manifest, write_weights
from vllm_reloader.checkpoint import completeness, gate
from vllm_reloader.checkpoint.completeness import DirectoryListing
from vllm_reloader.checkpoint.conventions import Convention
from vllm_reloader.checkpoint.files import INDEX_NAME

AUTO = gate.GateOptions(convention=Convention(manifest_grace=10))


def judge(directory: Path, now: float | None = None) -> gate.Verdict:
    return gate.check(directory, serving=None, options=AUTO, now=now)


def later() -> float:
    """Past the quiet a lone model.safetensors needs (settle_seconds)."""
    return time.time() + 31


def fingerprint(directory: Path) -> str:
    return completeness.fingerprint(DirectoryListing(directory), AUTO.convention)


def test_auto_is_the_default_completeness():
    from vllm_reloader.config import SourceConfig

    assert SourceConfig(path="/srv/checkpoints").completeness == "auto"
    assert Convention().mode == "auto"


def test_auto_loads_a_sharded_hf_checkpoint_once_its_index_is_written_last(tmp_path):
    target = tmp_path / "checkpoint-500"
    shards = write_weights(target, shards=2)
    waiting = judge(target)
    assert waiting.status == "pending"
    assert "no model.safetensors.index.json yet" in waiting.reason
    assert "vllm-reloader publish" in waiting.reason
    (target / INDEX_NAME).write_bytes(hf_index(shards)[:20])
    assert judge(target).status == "pending", "a half-written index waits"
    (target / INDEX_NAME).write_bytes(hf_index(shards))
    ready = judge(target)
    assert ready.status == "ready", ready.reason


def test_auto_loads_a_lone_model_safetensors_once_whole_and_quiet(tmp_path):
    target = tmp_path / "copied"
    (path,) = write_weights(target)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    short = judge(target, now=later())
    assert short.status == "pending" and f"{len(data) - 100} of {len(data)} bytes" in short.reason
    path.write_bytes(data)
    fresh = judge(target)
    assert fresh.status == "pending" and "quiet" in fresh.reason, "a manifest written right after may come"
    ready = judge(target, now=later())
    assert ready.status == "ready", ready.reason


def test_auto_prefers_a_manifest_written_after_the_weights_and_checks_its_digests(tmp_path):
    target = tmp_path / "step-1"
    (path,) = write_weights(target)
    write_manifest(target, step=1)
    path.write_bytes(path.read_bytes()[:-4] + b"\0\0\0\0")  # same size, other bytes
    verdict = judge(target, now=later())
    assert verdict.status == "rejected" and verdict.details["check"] == "digests", verdict.reason
    assert verdict.manifest is not None and verdict.manifest.step == 1


def test_auto_loads_what_trainer_save_model_writes_which_has_no_trainer_state(tmp_path):
    target = tmp_path / "final"
    shards = write_weights(target, shards=2)
    (target / INDEX_NAME).write_bytes(hf_index(shards))
    (target / "training_args.bin").write_bytes(b"\x80\x04args")
    ready = judge(target)
    assert ready.status == "ready", ready.reason


def test_auto_takes_the_shards_from_the_index_when_trainer_state_comes_before_the_last_shard(tmp_path):
    target = tmp_path / "checkpoint-7"
    shards = write_weights(target, shards=2)
    (target / INDEX_NAME).write_bytes(hf_index(shards))
    last = shards[1].read_bytes()
    shards[1].unlink()  # a copy that brought trainer_state.json before the last shard
    (target / "trainer_state.json").write_text("{}")
    waiting = judge(target)
    assert waiting.status == "pending" and shards[1].name in waiting.reason, waiting.reason
    shards[1].write_bytes(last)
    assert judge(target).status == "ready"


def test_auto_waits_while_a_downloader_partial_file_is_there(tmp_path):
    target = tmp_path / "fetched"
    write_weights(target)
    (target / "model.safetensors.aria2").write_bytes(b"state")
    waiting = judge(target, now=later())
    assert waiting.status == "pending" and "model.safetensors.aria2" in waiting.reason
    (target / "model.safetensors.aria2").unlink()
    assert judge(target, now=later()).status == "ready"


def test_auto_has_no_content_to_remember_until_a_rule_applies_and_a_fixed_config_is_new_content(tmp_path):
    target = tmp_path / "checkpoint-9"
    target.mkdir()
    assert fingerprint(target) == ""
    shards = write_weights(target, shards=2)
    assert fingerprint(target) == "", "shards without their index: nothing complete yet"
    (target / INDEX_NAME).write_bytes(hf_index(shards))
    complete = fingerprint(target)
    (target / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "fixed": true}')
    assert fingerprint(target) not in ("", complete), "a bad config.json, once fixed, is judged again"


def test_auto_waits_for_trainer_state_in_a_trainer_checkpoint(tmp_path):
    target = tmp_path / "checkpoint-40"
    write_weights(target)
    (target / "training_args.bin").write_bytes(b"\x80\x04args")
    loaded_at = fingerprint(target)  # whole: it may load now, before Trainer's other files
    (target / "rng_state_3.pth").write_bytes(b"\x80\x04rng")
    waiting = judge(target, now=later())
    assert waiting.status == "pending" and "trainer_state.json" in waiting.reason
    (target / "tokenizer.json").write_text("{}")
    (target / "trainer_state.json").write_text(json.dumps({"global_step": 40}))
    ready = judge(target)
    assert ready.status == "ready", ready.reason
    assert fingerprint(target) == loaded_at != "", "files written after the weights are not new content"


def test_auto_takes_a_marker_as_marker_mode_does(tmp_path):
    target = tmp_path / "orbax-9"
    write_weights(target, shards=2)
    assert judge(target).status == "pending"
    (target / "_SUCCESS").write_bytes(b"")
    ready = judge(target)
    assert ready.status == "ready", ready.reason


def test_auto_says_to_save_with_safetensors_when_only_bin_weights_are_there(tmp_path):
    target = tmp_path / "old-style"
    target.mkdir()
    (target / "pytorch_model.bin").write_bytes(b"\x80\x04weights")
    (target / "config.json").write_text("{}")
    verdict = judge(target, now=later())
    assert verdict.status == "pending"
    assert "no .safetensors weights" in verdict.reason and "safe_serialization=True" in verdict.reason


def test_auto_names_what_an_empty_checkpoint_waits_for(tmp_path):
    target = tmp_path / "empty"
    target.mkdir()
    (target / "config.json").write_text("{}")
    verdict = judge(target, now=later())
    assert verdict.status == "pending"
    assert verdict.reason.startswith("no manifest.json, model.safetensors.index.json, model.safetensors")


def test_auto_fingerprint_is_the_same_for_a_directory_and_its_copy(tmp_path):
    first = tmp_path / "a" / "checkpoint-1"
    shards = write_weights(first, shards=2)
    (first / INDEX_NAME).write_bytes(hf_index(shards))
    second = tmp_path / "b" / "checkpoint-1"
    second.mkdir(parents=True)
    for item in first.iterdir():
        (second / item.name).write_bytes(item.read_bytes())
        os.utime(second / item.name, (1, 1))
    assert fingerprint(first) == fingerprint(second) != ""
