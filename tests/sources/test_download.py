"""Downloads from moto's S3 on loopback: parallel ranged parts, resume, digests, ETag changes."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.support.checkpoints import MakeCheckpoint
from tests.support.store_fixtures import Bucket
from vllm_reloader.checkpoint import gate
from vllm_reloader.checkpoint.manifest import parse
from vllm_reloader.errors import ObjectChanged
from vllm_reloader.sources import download
from vllm_reloader.sources.download import JOURNAL_NAME, Part, Plan, fetch
from vllm_reloader.sources.objstore import Store

PLAN = Plan(concurrency=4, part_size=4096, min_free_bytes=0)


class Killed(Exception):
    """Stands for the process dying at a part boundary: only what reached the disk survives."""


@pytest.fixture
def uploaded(make_checkpoint: MakeCheckpoint, tmp_path: Path, bucket: Bucket) -> tuple[Path, Store]:
    shapes = {"model.embed_tokens.weight": (64, 64), "lm_head.weight": (64, 64)}  # 16 KiB tensors
    checkpoint = make_checkpoint("step-9", step=9, root=tmp_path / "src", shapes=shapes, shards=2)
    bucket.upload_dir(checkpoint, "step-9")
    return checkpoint, Store(bucket.url)


def run_fetch(store: Store, tmp_path: Path, get_part=None, plan: Plan = PLAN):
    listing, _ = store.list()
    data, _ = store.get("step-9/manifest.json")
    manifest = parse(data)
    objects = {e.path: listing[f"step-9/{e.path}"] for e in manifest.files}
    return fetch(
        store, "step-9", ("manifest.json", data), manifest, objects,
        staging_root=tmp_path / "cache" / "staging", root=tmp_path / "cache" / "root",
        plan=plan, get_part=get_part,
    )  # fmt: skip


def counting(store: Store, log: list[Part], *, fail_after: int | None = None):
    lock = threading.Lock()

    def get(part: Part):
        with lock:
            if fail_after is not None and len(log) >= fail_after:
                raise Killed()
            log.append(part)
        path, start, end, etag = part
        return store.get_range(f"step-9/{path}", start, end, etag)

    return get


def test_download_uses_ranged_parts_and_places_a_verified_checkpoint(uploaded, tmp_path):
    checkpoint, store = uploaded
    parts: list[Part] = []
    result = run_fetch(store, tmp_path, counting(store, parts))
    assert result.rejected == "" and result.path == tmp_path / "cache" / "root" / "step-9"
    sizes = {p.name: p.stat().st_size for p in checkpoint.iterdir() if p.name != "manifest.json"}
    assert len(parts) == sum(-(-size // PLAN.part_size) for size in sizes.values())
    assert all(end - start <= PLAN.part_size for _, start, end, _ in parts)
    assert result.fetched_bytes == sum(sizes.values()) and result.reused_bytes == 0
    assert gate.check(result.path, serving=None).status == "ready"
    assert not (result.path / JOURNAL_NAME).exists()
    shards = {name for name in sizes if name.endswith(".safetensors")}
    assert result.scanned == dict.fromkeys(shards), "each shard scanned for NaN as it streamed in"
    assert set(result.blake3) == set(sizes)


def test_download_killed_midway_resumes_without_fetching_finished_parts_again(uploaded, tmp_path):
    checkpoint, store = uploaded
    first: list[Part] = []
    with pytest.raises(Killed):
        run_fetch(store, tmp_path, counting(store, first, fail_after=5))
    journal = tmp_path / "cache" / "staging" / "step-9" / JOURNAL_NAME
    survived = {tuple(json.loads(line).values()) for line in journal.read_text().splitlines()}
    assert 0 < len(survived) <= 5
    second: list[Part] = []
    result = run_fetch(store, tmp_path, counting(store, second))
    assert result.path is not None and result.rejected == ""
    assert not survived & set(second), "a part already on disk was fetched again"
    sizes = [p.stat().st_size for p in checkpoint.iterdir() if p.name != "manifest.json"]
    assert len(survived) + len(second) == sum(-(-size // PLAN.part_size) for size in sizes)
    assert result.reused_bytes == sum(end - start for _, start, end, _ in survived)
    for path in checkpoint.iterdir():
        assert (result.path / path.name).read_bytes() == path.read_bytes()


def test_download_resumed_from_a_corrupted_part_starts_over_and_succeeds(uploaded, tmp_path):
    checkpoint, store = uploaded
    with pytest.raises(Killed):
        run_fetch(store, tmp_path, counting(store, [], fail_after=3))
    staging = tmp_path / "cache" / "staging" / "step-9"
    journal = [json.loads(line) for line in (staging / JOURNAL_NAME).read_text().splitlines()]
    victim = staging / journal[0]["path"]
    with victim.open("r+b") as f:  # the journal said done, the disk lost it (power cut)
        f.seek(journal[0]["start"])
        f.write(b"\0" * 16)
    again: list[Part] = []
    result = run_fetch(store, tmp_path, counting(store, again))
    assert result.rejected == "" and result.path is not None
    assert result.reused_bytes == 0, "after a digest mismatch on resumed parts, everything is fetched anew"
    assert (result.path / victim.name).read_bytes() == (checkpoint / victim.name).read_bytes()


def test_download_rejects_bytes_that_fail_their_digest(uploaded, tmp_path, bucket: Bucket):
    checkpoint, store = uploaded
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    bucket.put(f"step-9/{shard.name}", bytes(data))
    result = run_fetch(store, tmp_path)
    assert result.path is None and result.rejected == f"{shard.name}: blake3 mismatch"
    assert not (tmp_path / "cache" / "root" / "step-9").exists()
    assert not (tmp_path / "cache" / "staging" / "step-9").exists()


def test_download_stops_when_an_object_changes_underneath(uploaded, tmp_path, bucket: Bucket):
    checkpoint, store = uploaded
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    seen: list[Part] = []
    inner = counting(store, seen)

    def replace_after_first(part: Part):
        if len(seen) == 1:
            bucket.put(f"step-9/{shard.name}", np.zeros(shard.stat().st_size, np.uint8).tobytes())
        return inner(part)

    with pytest.raises(ObjectChanged, match="changed while being read"):
        run_fetch(store, tmp_path, replace_after_first, Plan(concurrency=1, part_size=4096, min_free_bytes=0))
    assert not (tmp_path / "cache" / "root" / "step-9").exists()


def test_download_journals_a_part_only_after_its_bytes_are_synced(tmp_path, uploaded, monkeypatch):
    """After a crash the journal's parts are read back, not fetched: one it names must not be
    a hole in a file whose data never reached the disk."""
    _checkpoint, store = uploaded
    events: list[str] = []
    real_sync = os.fdatasync

    def sync(fd: int) -> None:
        real_sync(fd)
        events.append("sync")

    class Journal(download._Journal):
        def __init__(self, path: Path, resume: bool) -> None:
            super().__init__(path, resume)
            write = self._file.write
            self._file.write = lambda line: (events.append("line"), write(line))[1]  # type: ignore[method-assign]

    monkeypatch.setattr(download.os, "fdatasync", sync)
    monkeypatch.setattr(download, "_Journal", Journal)
    monkeypatch.setattr(download, "SYNC_BYTES", 1)  # each part synced and journaled at once
    assert run_fetch(store, tmp_path).rejected == ""
    order = "".join(event[0] for event in events)  # s: a sync, l: a journal line
    assert re.fullmatch(r"(s+l)+", order), f"every part synced before its line is written: {order}"
