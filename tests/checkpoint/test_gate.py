"""Every gate outcome, on real safetensors files."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.support.checkpoints import TENSORS, MakeCheckpoint, write_manifest, write_weights
from vllm_reloader.checkpoint import gate, layout
from vllm_reloader.checkpoint.completeness import Convention

NO_GRACE = gate.GateOptions(convention=Convention(manifest_grace=0))


def serving_layout(tmp_path: Path) -> layout.Layout:
    directory = tmp_path / "serving"
    write_weights(directory, seed=99)
    return layout.read_served_layout(directory)


def manifest_of(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def rewrite_manifest(directory: Path, manifest: dict) -> None:
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_gate_accepts_whole_checkpoint_with_matching_layout(make_checkpoint: MakeCheckpoint, tmp_path):
    directory = make_checkpoint("step-1", step=1, digests=("sha256", "blake3"), shards=2)
    verdict = gate.check(directory, serving=serving_layout(tmp_path))
    assert verdict.status == "ready", verdict.reason
    assert verdict.manifest is not None and verdict.manifest.step == 1
    assert verdict.bytes == sum(p.stat().st_size for p in directory.iterdir() if p.name != "manifest.json")


def test_gate_waits_for_missing_manifest(tmp_path):
    directory = tmp_path / "step-1"
    write_weights(directory)
    verdict = gate.check(directory, serving=None)
    assert (verdict.status, verdict.reason) == ("pending", "no manifest.json yet")


def test_gate_waits_for_half_written_manifest_then_rejects_after_grace(make_checkpoint: MakeCheckpoint):
    directory = make_checkpoint("step-1")
    text = (directory / "manifest.json").read_text()
    (directory / "manifest.json").write_text(text[: len(text) // 2])
    mtime = (directory / "manifest.json").stat().st_mtime
    options = gate.GateOptions(convention=Convention(manifest_grace=10))
    assert gate.check(directory, serving=None, options=options, now=mtime + 1).status == "pending"
    late = gate.check(directory, serving=None, options=options, now=mtime + 11)
    assert late.status == "rejected"
    assert "not valid JSON" in late.reason


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"format_version": 2}, "unknown format_version 2"),
        ({"files": []}, "files"),
        ({"step": "twelve"}, "step"),
        ({"extra": 1}, "extra"),
    ],
)
def test_gate_rejects_manifest_breaking_schema(make_checkpoint: MakeCheckpoint, change, expected):
    directory = make_checkpoint("step-1")
    rewrite_manifest(directory, {**manifest_of(directory), **change})
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "rejected"
    assert expected in verdict.reason


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("../outside.safetensors", "leaves the checkpoint directory"),
        ("/etc/passwd", "is absolute"),
        ("./model.safetensors", "is not normalised"),
        ("sub/../model.safetensors", "is not normalised"),
        ("manifest.json", "is the manifest itself"),
    ],
)
def test_gate_rejects_path_outside_root(make_checkpoint: MakeCheckpoint, path, problem):
    directory = make_checkpoint("step-1")
    manifest = manifest_of(directory)
    manifest["files"].append({"path": path, "size": 1})
    rewrite_manifest(directory, manifest)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "rejected"
    assert problem in verdict.reason


def test_gate_rejects_symlink_leaving_checkpoint(make_checkpoint: MakeCheckpoint, tmp_path):
    directory = make_checkpoint("step-1")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x" * 10)
    (directory / "extra.bin").symlink_to(secret)
    manifest = manifest_of(directory)
    manifest["files"].append({"path": "extra.bin", "size": 10})
    rewrite_manifest(directory, manifest)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "rejected"
    assert "symlink" in verdict.reason


def test_gate_rejects_symlink_loop(make_checkpoint: MakeCheckpoint):
    directory = make_checkpoint("step-1")
    (directory / "loop").symlink_to(directory / "loop")
    manifest = manifest_of(directory)
    manifest["files"].append({"path": "loop", "size": 1})
    rewrite_manifest(directory, manifest)
    assert gate.check(directory, serving=None).status == "rejected"


def test_gate_rejects_unlisted_weight_file_the_engine_would_load(make_checkpoint: MakeCheckpoint):
    directory = make_checkpoint("step-1")
    (directory / "stray.safetensors").write_bytes(b"garbage")
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "rejected"
    assert "stray.safetensors" in verdict.reason


def test_gate_waits_for_missing_file(make_checkpoint: MakeCheckpoint):
    directory = make_checkpoint("step-1")
    (directory / "model.safetensors").unlink()
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "pending"
    assert "model.safetensors does not exist yet" in verdict.reason


def test_gate_waits_for_short_file(make_checkpoint: MakeCheckpoint):
    directory = make_checkpoint("step-1")
    shard = directory / "model.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "pending"
    assert "model.safetensors has" in verdict.reason


def test_gate_rejects_file_longer_than_listed(make_checkpoint: MakeCheckpoint):
    directory = make_checkpoint("step-1")
    with (directory / "model.safetensors").open("ab") as f:
        f.write(b"\0" * 8)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "rejected"
    assert "manifest says" in verdict.reason


def test_gate_rejects_truncated_shard_listed_at_its_truncated_size(make_checkpoint: MakeCheckpoint):
    """The case that kills vLLM: sizes agree with the manifest but the header says more."""
    directory = make_checkpoint("step-1")
    shard = directory / "model.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    write_manifest(directory)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "rejected"
    assert "incomplete metadata" in verdict.reason


def test_gate_rejects_file_that_is_not_safetensors(make_checkpoint: MakeCheckpoint):
    directory = make_checkpoint("step-1")
    (directory / "model.safetensors").write_bytes(b"\xff" * 64)
    write_manifest(directory)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "rejected"
    assert verdict.reason.startswith("model.safetensors:")


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_gate_rejects_digest_mismatch(make_checkpoint: MakeCheckpoint, algorithm):
    directory = make_checkpoint("step-1", digests=(algorithm,))
    manifest = manifest_of(directory)
    for entry in manifest["files"]:
        entry[algorithm] = "0" * 64
    rewrite_manifest(directory, manifest)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "rejected"
    assert f"{algorithm} mismatch" in verdict.reason


def test_gate_skips_digests_when_told(make_checkpoint: MakeCheckpoint):
    directory = make_checkpoint("step-1")
    manifest = manifest_of(directory)
    for entry in manifest["files"]:
        entry["blake3"] = "0" * 64
    rewrite_manifest(directory, manifest)
    options = gate.GateOptions(verify_digests=False)
    assert gate.check(directory, serving=None, options=options).status == "ready"


def test_gate_rejects_shape_mismatch_naming_the_tensor(make_checkpoint: MakeCheckpoint, tmp_path):
    shapes = {**TENSORS, "model.layers.0.mlp.up_proj.weight": (64, 8)}
    directory = make_checkpoint("step-1", shapes=shapes)
    verdict = gate.check(directory, serving=serving_layout(tmp_path))
    assert verdict.status == "rejected"
    assert verdict.details["tensor"] == "model.layers.0.mlp.up_proj.weight"
    assert "F32[64, 8], serving has F32[32, 8]" in verdict.reason


def test_gate_rejects_missing_tensor(make_checkpoint: MakeCheckpoint, tmp_path):
    shapes = {k: v for k, v in TENSORS.items() if k != "lm_head.weight"}
    directory = make_checkpoint("step-1", shapes=shapes)
    verdict = gate.check(directory, serving=serving_layout(tmp_path))
    assert verdict.status == "rejected"
    assert verdict.details["tensor"] == "lm_head.weight"


def test_gate_rejects_architecture_change(make_checkpoint: MakeCheckpoint, tmp_path):
    directory = make_checkpoint("step-1", config={"architectures": ["MistralForCausalLM"]})
    verdict = gate.check(directory, serving=serving_layout(tmp_path))
    assert verdict.status == "rejected"
    assert "config.json architectures" in verdict.reason


def test_gate_rejects_unreadable_file(make_checkpoint: MakeCheckpoint, monkeypatch):
    directory = make_checkpoint("step-1")
    shard = directory / "model.safetensors"
    shard.chmod(0)  # enough for a non-root user; root (CI) needs the injected error below

    def denied(path: str, framework: str) -> None:
        raise PermissionError(13, "Permission denied", path)

    if os.geteuid() == 0:
        monkeypatch.setattr(gate, "safe_open", denied)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "rejected"
    assert "permission denied" in verdict.reason


def test_gate_waits_when_directory_disappears(make_checkpoint: MakeCheckpoint, tmp_path):
    directory = make_checkpoint("step-1")
    gone = tmp_path / "gone"
    directory.rename(gone)
    assert gate.check(directory, serving=None).status == "pending"


def test_gate_fingerprint_follows_manifest_bytes(make_checkpoint: MakeCheckpoint):
    directory = make_checkpoint("step-1")
    before = gate.check(directory, serving=None).fingerprint
    time.sleep(0.01)
    write_manifest(directory, step=7)
    assert gate.check(directory, serving=None).fingerprint != before


def test_gate_pending_when_manifest_changes_while_being_verified(
    make_checkpoint: MakeCheckpoint, monkeypatch
):
    directory = make_checkpoint("step-1", step=1)
    real = gate._check_digests

    def rewrite_then_hash(*args, **kwargs):
        write_manifest(directory, step=2)  # the producer replaced it mid-check
        return real(*args, **kwargs)

    monkeypatch.setattr(gate, "_check_digests", rewrite_then_hash)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "pending" and "changed while it was being checked" in verdict.reason
