"""Verified while written: a shard read once its writer closed it is not read again when the
manifest lands — unless anything says it might not be the same bytes."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from tests.support.checkpoints import MakeCheckpoint, write_manifest
from vllm_reloader.checkpoint import files, gate, scan, verified
from vllm_reloader.checkpoint.manifest import ManifestFile


def gate_with(cache: verified.Cache, directory: Path) -> tuple[gate.Verdict, scan.Progress]:
    run = gate.Run(cache=cache)
    return gate.check(directory, serving=None, run=run), run.progress


def settle_tick() -> None:
    time.sleep(files.RACY_NS / 1e9 * 1.5)


def test_verified_shard_is_not_read_again_by_the_gate(make_checkpoint: MakeCheckpoint, monkeypatch):
    directory = make_checkpoint("step-1", shards=2)
    settle_tick()
    cache = verified.Cache()
    for shard in sorted(directory.glob("*.safetensors")):
        scan.prehash(shard, cache)
    passes: list[int] = []
    real = scan.read_pass
    monkeypatch.setattr(scan, "read_pass", lambda *a, **k: (passes.append(1), real(*a, **k))[1])
    verdict, progress = gate_with(cache, directory)
    assert verdict.status == "ready"
    shard_bytes = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    assert progress.cached == shard_bytes and len(passes) == 1, "only config.json was read"


def test_verified_result_is_not_trusted_for_a_file_changed_within_its_tick(make_checkpoint: MakeCheckpoint):
    """Racily clean: a read begun within a tick of the file's last change proves nothing."""
    directory = make_checkpoint("step-1")
    shard = directory / "model.safetensors"
    found = files.identity(shard.lstat())
    cache = verified.Cache()
    cache.put(verified.Verified(found, "0" * 64, None, True, started_ns=found[4] + 1))
    entry = ManifestFile(path=shard.name, size=found[2], blake3="0" * 64)
    assert cache.get(found).settles(entry, scan=True) is None  # type: ignore[union-attr]
    clean = verified.Verified(found, "0" * 64, None, True, started_ns=found[4] + files.RACY_NS)
    assert clean.settles(entry, scan=True) == "clean"


def test_verified_digest_that_differs_is_confirmed_by_a_fresh_read_before_anything_is_rejected(
    make_checkpoint: MakeCheckpoint,
):
    directory = make_checkpoint("step-1")
    settle_tick()
    shard = directory / "model.safetensors"
    found = files.identity(shard.lstat())
    cache = verified.Cache()
    cache.put(verified.Verified(found, "f" * 64, None, True, time.time_ns()))  # a wrong memory of it
    verdict, progress = gate_with(cache, directory)
    assert verdict.status == "ready" and progress.cached == 0, "the fresh read found the bytes good"


def test_verified_shard_rewritten_after_its_read_is_read_again(make_checkpoint: MakeCheckpoint):
    directory = make_checkpoint("step-1")
    settle_tick()
    cache = verified.Cache()
    shard = directory / "model.safetensors"
    scan.prehash(shard, cache)
    data = bytearray(shard.read_bytes())
    data[-4:] = b"\x00\x00\xc0\x7f"  # a NaN, same size, written after the early read
    shard.write_bytes(data)
    write_manifest(directory)
    settle_tick()
    verdict, progress = gate_with(cache, directory)
    assert verdict.status == "rejected" and verdict.details["check"] == "finite" and progress.cached == 0


def test_verified_nan_found_while_written_rejects_without_a_second_read(make_checkpoint: MakeCheckpoint):
    directory = make_checkpoint("step-1")
    shard = directory / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-4:] = b"\x00\x00\xc0\x7f"
    shard.write_bytes(data)
    write_manifest(directory)
    settle_tick()
    cache = verified.Cache()
    scan.prehash(shard, cache)
    verdict, progress = gate_with(cache, directory)
    assert verdict.status == "rejected" and verdict.details["check"] == "finite"
    assert progress.cached == shard.stat().st_size


def test_verified_gate_waits_for_a_read_already_under_way(make_checkpoint: MakeCheckpoint, monkeypatch):
    directory = make_checkpoint("step-1")
    settle_tick()
    shard = directory / "model.safetensors"
    cache = verified.Cache()
    release = threading.Event()
    real = scan.read_pass

    def slow_first(*args, **kwargs):  # type: ignore[no-untyped-def]
        release.wait(5)
        return real(*args, **kwargs)

    monkeypatch.setattr(scan, "read_pass", slow_first)
    early = threading.Thread(target=scan.prehash, args=(shard, cache))
    early.start()
    time.sleep(0.1)
    monkeypatch.setattr(scan, "read_pass", real)
    threading.Timer(0.2, release.set).start()
    verdict, progress = gate_with(cache, directory)
    early.join(5)
    assert verdict.status == "ready" and progress.cached == shard.stat().st_size


@pytest.mark.parametrize("odd", ["symlink", "fifo", "gone"])
def test_verified_early_read_of_an_odd_file_leaves_nothing(tmp_path: Path, odd: str):
    path = tmp_path / "model.safetensors"
    if odd == "symlink":
        (tmp_path / "real").write_bytes(b"x" * 64)
        path.symlink_to(tmp_path / "real")
    elif odd == "fifo":
        os.mkfifo(path)
    cache = verified.Cache()
    scan.prehash(path, cache)  # neither raises nor blocks
    assert cache._done == {}


def test_verified_prehash_of_a_shard_listing_too_many_tensors_parses_no_header(
    make_checkpoint: MakeCheckpoint, monkeypatch
):
    """A header past `[gate] max_tensors` is not parsed on the reading threads (its digest is
    kept; the gate refuses it when the manifest lands)."""
    directory = make_checkpoint("step-1")
    shard = directory / "model.safetensors"
    settle_tick()
    tensors = len(files.tensors_of(shard))
    limited, unlimited = verified.Cache(), verified.Cache()
    scan.prehash(shard, limited, max_tensors=tensors - 1)
    scan.prehash(shard, unlimited, max_tensors=tensors)
    found = files.identity(os.stat(shard))
    kept, whole = limited.get(found, wait=0), unlimited.get(found, wait=0)
    assert kept is not None and whole is not None
    assert (kept.scanned, whole.scanned) == (False, True)
    assert kept.blake3 == whole.blake3 != ""
