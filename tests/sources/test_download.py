"""Downloads from moto's S3 on loopback: parallel ranged parts, resume, digests, ETag changes."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support import small_disk
from tests.support.checkpoints import MakeCheckpoint
from tests.support.store_fixtures import STORES, WRITABLE, Bucket
from vllm_reloader.checkpoint import gate
from vllm_reloader.checkpoint.manifest import parse
from vllm_reloader.errors import DownloadError, ObjectChanged
from vllm_reloader.sources import download
from vllm_reloader.sources.download import JOURNAL_NAME, Part, Plan, fetch
from vllm_reloader.sources.filestore import open_store
from vllm_reloader.sources.objstore import Store

pytestmark = pytest.mark.stores(*STORES)

PLAN = Plan(concurrency=4, part_size=4096, min_free_bytes=0)


class Killed(Exception):
    """Stands for the process dying at a part boundary: only what reached the disk survives."""


@pytest.fixture
def uploaded(make_checkpoint: MakeCheckpoint, tmp_path: Path, bucket: Bucket) -> tuple[Path, Store]:
    shapes = {"model.embed_tokens.weight": (64, 64), "lm_head.weight": (64, 64)}  # 16 KiB tensors
    checkpoint = make_checkpoint("step-9", step=9, root=tmp_path / "src", shapes=shapes, shards=2)
    bucket.upload_dir(checkpoint, "step-9")
    return checkpoint, open_store(bucket.url)


def run_fetch(store: Store, tmp_path: Path, get_part=None, plan: Plan = PLAN):
    listing, _ = store.list()
    data, _ = store.get("step-9/manifest.json")
    manifest = parse(data)
    objects = {e.path: listing[f"step-9/{e.path}"] for e in manifest.files}
    (tmp_path / "cache" / "staging").mkdir(parents=True, exist_ok=True)  # as the remote source does at start
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


@pytest.mark.stores(*WRITABLE)
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


def journaled(staging: Path) -> list[tuple[str, int, int]]:
    journal = staging / JOURNAL_NAME
    lines = journal.read_text().splitlines() if journal.exists() else []
    return [(entry["path"], entry["start"], entry["end"]) for entry in map(json.loads, lines)]


def assert_journal_names_only_whole_parts(staging: Path, checkpoint: Path) -> None:
    """A journaled part is read back on resume instead of fetched: it must hold the source's bytes."""
    for path, start, end in journaled(staging):
        with (staging / path).open("rb") as f:
            f.seek(start)
            on_disk = f.read(end - start)
        assert on_disk == (checkpoint / path).read_bytes()[start:end], f"{path} [{start}, {end}) is a hole"


def into_shard(fd: int) -> bool:
    """Picks out the `os.pwrite` calls into a shard (where a hole would go unseen longest)."""
    return os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors")


class SmallDisk:
    """The cache's disk, which another writer fills up once the download has started: a real
    tmpfs where it can be mounted; else `os.pwrite` plays a disk with `leave` bytes free."""

    def __init__(self, path: Path, refused: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.path, self.refused, self.monkeypatch = path, refused, monkeypatch
        self.free: int | None = None  # simulated: bytes left, None while not full

    def fill(self, *, leave: int) -> None:
        if not self.refused:
            small_disk.fill(self.path, leave=leave)
            return
        self.free, real = leave, os.pwrite

        def pwrite(fd: int, data, offset: int) -> int:
            if self.free is None:
                return real(fd, data, offset)
            if self.free == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written = real(fd, memoryview(data)[: self.free], offset)
            self.free -= written
            return written

        self.monkeypatch.setattr(download.os, "pwrite", pwrite)

    def make_room(self) -> None:
        (self.path / "filler").unlink(missing_ok=True)
        self.free = None


@pytest.fixture
def disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[SmallDisk]:
    with small_disk.tmpfs(tmp_path / "disk", 256 << 10) as refused:
        if refused:  # said, never skipped: the test runs on the simulated disk instead
            request.node.user_properties.append(("disk", f"simulated, no tmpfs: {refused}"))
            reporter = request.config.pluginmanager.get_plugin("terminalreporter")
            capture = request.config.pluginmanager.get_plugin("capturemanager")
            if reporter is not None and capture is not None:
                with capture.global_and_fixture_disabled():
                    reporter.write_line(f"\n{request.node.nodeid}: ran on a simulated full disk ({refused})")
        yield SmallDisk(tmp_path / "disk", refused, monkeypatch)


def test_download_onto_a_disk_that_fills_up_fails_in_one_line_places_nothing_and_leaks_no_fd(
    uploaded, disk: SmallDisk
):
    """The free-space precheck passes, then another writer takes the space: the next write is
    cut short (one page left for a two-page part), the one after gets ENOSPC, and the journal
    cannot be written either. Every file is still closed, and a resume after space is freed
    places the source's bytes."""
    checkpoint, store = uploaded
    plan = Plan(concurrency=1, part_size=2 * small_disk.PAGE, min_free_bytes=0)
    inner = counting(store, [])
    filled: list[Part] = []

    def filling(part: Part):
        if not filled and part[0].endswith(".safetensors") and part[1] > 0:
            filled.append(part)
            disk.fill(leave=small_disk.PAGE)
        return inner(part)

    with pytest.raises(DownloadError) as caught:
        run_fetch(store, disk.path, filling, plan)
    message = str(caught.value)
    assert filled and "\n" not in message and "No space left on device" in message, message
    assert filled[0][0] in message, f"the message names the file: {message}"
    assert not (disk.path / "cache" / "root" / "step-9").exists()
    assert small_disk.open_under(disk.path) == [], "every file of the failed download closed"
    staging = disk.path / "cache" / "staging" / "step-9"
    assert_journal_names_only_whole_parts(staging, checkpoint)

    disk.make_room()
    result = run_fetch(store, disk.path, plan=plan)
    assert result.rejected == "" and result.path is not None
    for path in checkpoint.iterdir():
        assert (result.path / path.name).read_bytes() == path.read_bytes()


def test_download_writes_the_rest_of_a_part_the_disk_took_only_half_of(uploaded, tmp_path, monkeypatch):
    """`pwrite` may write less than asked and say so only by its count: the rest is written
    again, so the placed shard is the uploaded one, not a hole of zeros under a good digest."""
    checkpoint, store = uploaded
    real, cut = os.pwrite, []

    def pwrite(fd: int, data, offset: int) -> int:
        if not cut and into_shard(fd):
            cut.append(offset)
            return real(fd, memoryview(data)[: len(data) // 2], offset)
        return real(fd, data, offset)

    monkeypatch.setattr(download.os, "pwrite", pwrite)
    result = run_fetch(store, tmp_path)
    assert cut and result.rejected == "" and result.path is not None
    for path in checkpoint.iterdir():
        assert (result.path / path.name).read_bytes() == path.read_bytes(), path.name
    assert gate.check(result.path, serving=None).status == "ready"


def test_download_write_that_makes_no_progress_is_a_download_error(uploaded, tmp_path, monkeypatch):
    _checkpoint, store = uploaded
    real = os.pwrite
    monkeypatch.setattr(
        download.os, "pwrite", lambda fd, data, at: 0 if into_shard(fd) else real(fd, data, at)
    )
    with pytest.raises(DownloadError, match="No space left on device"):
        run_fetch(store, tmp_path)
    assert not (tmp_path / "cache" / "root" / "step-9").exists()
    assert small_disk.open_under(tmp_path / "cache") == []


def test_download_journals_no_part_whose_bytes_the_disk_refused(uploaded, tmp_path, monkeypatch):
    """Half a part written, then EIO on the rest: the download fails, and the journal it leaves
    names only parts whose bytes are on disk, so a resume never reads a hole back as data."""
    checkpoint, store = uploaded
    real, cut, broken = os.pwrite, [], [True]

    def pwrite(fd: int, data, offset: int) -> int:
        if broken and into_shard(fd) and (not cut or cut == [offset]):
            if cut:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            cut.append(offset + len(data) // 2)
            return real(fd, memoryview(data)[: len(data) // 2], offset)
        return real(fd, data, offset)

    monkeypatch.setattr(download.os, "pwrite", pwrite)
    with pytest.raises(DownloadError, match="Input/output error"):
        run_fetch(store, tmp_path, plan=Plan(concurrency=1, part_size=4096, min_free_bytes=0))
    staging = tmp_path / "cache" / "staging" / "step-9"
    assert_journal_names_only_whole_parts(staging, checkpoint)
    assert not (tmp_path / "cache" / "root" / "step-9").exists()
    broken.clear()
    result = run_fetch(store, tmp_path)
    assert result.rejected == "" and result.path is not None
    for path in checkpoint.iterdir():
        assert (result.path / path.name).read_bytes() == path.read_bytes(), path.name


def test_download_into_a_state_dir_deleted_meanwhile_fails_and_makes_it_not_again(uploaded, tmp_path):
    _, store = uploaded
    state = tmp_path / "state"
    (state / "cache" / "staging").mkdir(parents=True)  # as at start
    shutil.rmtree(state)  # an operator's `rm -rf` under the running daemon
    listing, _ = store.list()
    data, _ = store.get("step-9/manifest.json")
    manifest = parse(data)
    objects = {e.path: listing[f"step-9/{e.path}"] for e in manifest.files}
    with pytest.raises(DownloadError, match="No such file or directory"):
        fetch(
            store, "step-9", ("manifest.json", data), manifest, objects,
            staging_root=state / "cache" / "staging", root=state / "cache" / "root", plan=PLAN,
        )  # fmt: skip
    assert not state.exists(), "the records are gone with it: nothing is made again behind the operator"
