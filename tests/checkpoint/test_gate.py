"""Every gate outcome, on real safetensors files."""

from __future__ import annotations

import ctypes
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import pytest

from tests.support.checkpoints import TENSORS, MakeCheckpoint, write_manifest, write_weights
from tests.support.permissions import OWNER, as_another_user
from vllm_reloader.checkpoint import files, gate, layout, scan
from vllm_reloader.checkpoint.conventions import Convention
from vllm_reloader.checkpoint.files import INDEX_NAME, identity

NO_GRACE = gate.GateOptions(convention=Convention("manifest", manifest_grace=0))


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
    options = gate.GateOptions(convention=Convention("manifest"))
    verdict = gate.check(directory, serving=None, options=options)
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
    assert verdict.status == "rejected" and verdict.details["check"] == "headers"
    assert "tensor data ends at byte" in verdict.reason


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


def test_gate_keeps_unreadable_file_pending_naming_file_owner_and_mode(
    make_checkpoint: MakeCheckpoint, monkeypatch
):
    """Permissions get fixed (transformers 5 writes 0600): never a final verdict."""
    directory = make_checkpoint("step-1")
    shard = directory / "model.safetensors"
    shard.chmod(0o600)
    as_another_user(monkeypatch, directory)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "pending"
    assert verdict.reason == f"cannot read model.safetensors: permission denied (owner {OWNER}, mode 0600)"
    assert verdict.details == {"unreadable": "model.safetensors", "owner": OWNER, "mode": "0600"}
    shard.chmod(0o644)
    assert gate.check(directory, serving=None).status == "ready"


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
    real = scan.read_all

    def rewrite_then_hash(*args, **kwargs):
        write_manifest(directory, step=2)  # the producer replaced it mid-check
        return real(*args, **kwargs)

    monkeypatch.setattr(scan, "read_all", rewrite_then_hash)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "pending" and "changed while it was being checked" in verdict.reason


# -- verified bytes, odd input -------------------------------------------------------------


def test_gate_ready_verdict_carries_the_identity_of_every_file_it_verified(make_checkpoint: MakeCheckpoint):
    directory = make_checkpoint("step-1", shards=2)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "ready"
    listed = {e["path"] for e in manifest_of(directory)["files"]}
    assert set(verdict.files) == listed | {"manifest.json"}
    for name, found in verdict.files.items():
        assert found == identity((directory / name).lstat())


def test_gate_pending_when_a_shard_is_rewritten_while_it_is_hashed(
    make_checkpoint: MakeCheckpoint, monkeypatch
):
    """Same size, other bytes, written while the gate reads: not the file it verified."""
    directory = make_checkpoint("step-1")
    real = gate.scan.read

    def rewrite_then_read(where, work, *args, **kwargs):
        shard = directory / "model.safetensors"
        shard.write_bytes(shard.read_bytes())  # a trainer saving again over the same path
        return real(where, work, *args, **kwargs)

    monkeypatch.setattr(gate.scan, "read", rewrite_then_read)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "pending" and "changed while it was being checked" in verdict.reason


def test_gate_rejects_a_listed_file_that_is_a_symlink_inside_the_checkpoint(make_checkpoint: MakeCheckpoint):
    directory = make_checkpoint("step-1")
    (directory / "tokenizer.json").write_text("{}")
    (directory / "alias.json").symlink_to(directory / "tokenizer.json")
    write_manifest(directory)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "rejected" and "alias.json is not a regular file" in verdict.reason


def test_gate_rejects_a_symlink_as_the_checkpoint_directory(make_checkpoint: MakeCheckpoint, tmp_path):
    directory = make_checkpoint("real")
    (tmp_path / "root" / "step-2").symlink_to(directory)
    verdict = gate.check(tmp_path / "root" / "step-2", serving=None)
    assert verdict.status == "rejected" and "not a directory" in verdict.reason


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_gate_never_blocks_or_fills_memory_on_an_odd_manifest(tmp_path, kind):
    directory = tmp_path / "step-1"
    write_weights(directory)
    manifest = directory / "manifest.json"
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "dev-zero":
        manifest.symlink_to("/dev/zero")
    else:
        manifest.write_bytes(b" " * (17 << 20))  # over the 16 MiB a manifest may have
    started = time.monotonic()
    verdict = gate.check(directory, serving=None)
    assert time.monotonic() - started < 5
    assert verdict.status == "rejected" and verdict.details["check"] == "io"
    assert "manifest.json" in verdict.reason


def test_gate_rejects_json_nested_past_the_parser_as_a_verdict(make_checkpoint: MakeCheckpoint, tmp_path):
    directory = make_checkpoint("step-1")
    (directory / "manifest.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    assert gate.check(directory, serving=None, options=NO_GRACE).status == "rejected"
    directory = make_checkpoint("step-2")
    (directory / "config.json").write_bytes(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    write_manifest(directory)
    verdict = gate.check(directory, serving=serving_layout(tmp_path))
    assert verdict.status == "rejected" and "config.json is not valid JSON" in verdict.reason


def test_gate_rejects_an_index_not_listed_in_the_manifest(make_checkpoint: MakeCheckpoint):
    """vLLM's loader follows an HF index: one nobody listed must not steer it."""
    directory = make_checkpoint("step-1")
    (directory / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "/etc/passwd"}}))
    verdict = gate.check(directory, serving=None)
    assert (
        verdict.status == "rejected" and f"{INDEX_NAME} is in the directory but not listed" in verdict.reason
    )


def test_gate_rejects_an_index_naming_other_shards_than_the_listed_ones(make_checkpoint: MakeCheckpoint):
    directory = make_checkpoint("step-1", shards=2)
    shards = sorted(p.name for p in directory.glob("*.safetensors"))
    (directory / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": shards[0]}}))
    write_manifest(directory)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "rejected" and "the listed shards are" in verdict.reason
    (directory / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}}))
    write_manifest(directory)
    assert gate.check(directory, serving=None).status == "ready"


def test_gate_turns_an_unexpected_error_into_a_rejection_of_that_checkpoint(
    make_checkpoint: MakeCheckpoint, monkeypatch
):
    directory = make_checkpoint("step-1")

    def bug(*_args, **_kwargs):
        raise KeyError("something nobody thought of")

    monkeypatch.setattr(gate, "path_problem", bug)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "rejected" and verdict.details["check"] == "internal"
    assert "KeyError" in verdict.reason and "Traceback" in str(verdict.details["traceback"])
    assert verdict.fingerprint, "remembered by its manifest, so it is not judged again every tick"


def test_gate_waits_out_the_timestamp_tick_of_a_file_written_just_now(make_checkpoint: MakeCheckpoint):
    """A write within the same tick as the last one would not change the identity: the gate
    reads only once the clock is past it (git's racily-clean rule)."""
    directory = make_checkpoint("step-1")
    write_manifest(directory)  # just now
    started = time.time_ns()
    verdict = gate.check(directory, serving=None)
    newest = max(found[4] for found in verdict.files.values())
    assert verdict.status == "ready"
    assert started - newest < files.RACY_NS, "this test needs a file changed within the tick"
    assert time.time_ns() >= newest + files.RACY_NS


def test_gate_hashes_each_file_on_one_thread_while_other_files_fill_the_cores(
    make_checkpoint: MakeCheckpoint, monkeypatch
):
    """blake3's own threads only contend with the other files' readers; the last file,
    read alone, gets every core again."""
    directory = make_checkpoint("step-1", step=1, digests=("blake3",), shards=3)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    read, seen = gate.scan.read, []

    def recorded(directory: Path, work: gate.scan.Work, *args: object, **kwargs: object):
        seen.append((work.entry.path, work.hash_threads))
        return read(directory, work, *args, **kwargs)

    monkeypatch.setattr(gate.scan, "read", recorded)
    with ThreadPoolExecutor(1) as pool:  # one file at a time, so the order is known
        verdict = gate.check(directory, serving=None, options=NO_GRACE, run=gate.Run(threads=2, pool=pool))
    assert verdict.status == "ready", verdict.reason
    threads = [t for _, t in seen]
    assert len(threads) == 4  # three shards and config.json
    assert threads[:3] == [1, 1, 1] and threads[3] == blake3.blake3.AUTO


def test_gate_reads_into_page_aligned_buffers():
    """A read buffer 8 or 16 bytes off a 32-byte boundary (where a bytearray may start) cost
    the kernel's copy and blake3 twice the CPU for the same bytes."""
    for size in (gate.scan.CHUNK, 4096 + 3):
        buffer = gate.scan.aligned(size)
        assert len(buffer) == size
        assert ctypes.addressof(ctypes.c_char.from_buffer(buffer)) % 4096 == 0
