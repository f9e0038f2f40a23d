"""A shared root read as a bucket, against what hostile or careless writers leave in it: links,
FIFOs, odd names, deep folders, files rewritten while read. (The store-wide behaviour runs on
every store, this one included, through `store_fixtures`.)"""

from __future__ import annotations

import errno
import io
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from vllm_reloader.checkpoint.files import MAX_SMALL_BYTES
from vllm_reloader.errors import ConfigError, KeyUnreadable, ObjectChanged, PublishError, SourceError
from vllm_reloader.sources import filestore
from vllm_reloader.sources.filestore import MAX_DEPTH, SETTLE_NS, TEMPORARY, FileStore, open_store

WINDOW_NS = 50_000_000
"""The settle window here (the daemon's is SETTLE_NS): long enough to see a write in it."""


@pytest.fixture(autouse=True)
def _short_window(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SETTLE_NS >= 1_000_000_000, "wide enough for the clocks of a file server and a host"
    monkeypatch.setattr(filestore, "SETTLE_NS", WINDOW_NS)


def settled() -> None:
    time.sleep(WINDOW_NS / 1e9 + 0.01)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    found = tmp_path / "shared"
    (found / "good").mkdir(parents=True)
    (found / "good" / "manifest.json").write_bytes(b"{}")
    (found / "good" / "sub").mkdir()
    (found / "good" / "sub" / "a.bin").write_bytes(b"abc")
    return found


def store_at(root: Path) -> FileStore:
    found = open_store(f"file://{root}")
    assert isinstance(found, FileStore)
    return found


def test_filestore_lists_regular_files_with_their_sizes(root: Path):
    settled()
    objects, unlisted = store_at(root).list()
    assert {k: o.size for k, o in objects.items()} == {"good/manifest.json": 2, "good/sub/a.bin": 3}
    assert unlisted == {}


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda d: (d / "shard.safetensors").symlink_to("/etc/passwd"), "is a symbolic link"),
        (lambda d: (d / "sub").symlink_to("/"), "is a symbolic link"),
        (lambda d: os.mkfifo(d / "manifest.json"), "not a regular file"),
        (lambda d: (d / os.fsdecode(b"\xff.bin")).write_bytes(b"x"), "is not UTF-8"),
    ],
    ids=["file-link", "folder-link-to-root", "fifo", "not-utf8"],
)
def test_filestore_unlists_only_the_checkpoint_holding_what_is_not_a_regular_file(
    root: Path, make, said, monkeypatch: pytest.MonkeyPatch
):
    bad = root / "bad"
    bad.mkdir()
    make(bad)
    settled()
    listed: list[int] = []
    real = filestore._names
    monkeypatch.setattr(filestore, "_names", lambda fd: listed.append(fd) or real(fd))
    objects, unlisted = store_at(root).list()
    assert len(listed) <= 4, "the root, good, good/sub and bad: a link to / is never walked"
    assert set(objects) == {"good/manifest.json", "good/sub/a.bin"}
    assert list(unlisted) == ["bad"] and said in unlisted["bad"]


def test_filestore_never_reads_or_heads_through_a_link(root: Path):
    (root / "linked").symlink_to(root / "good")
    (root / "good" / "passwd").symlink_to("/etc/passwd")
    store = store_at(root)
    objects, unlisted = store.list()
    assert "linked" in unlisted and not any(k.startswith("linked/") for k in objects)
    assert store.head("linked/manifest.json") is None
    assert store.head("good/passwd") is None
    with pytest.raises(SourceError, match=r"GET file://.*/linked/manifest\.json"):
        store.get("linked/manifest.json")
    with pytest.raises(SourceError, match="good/passwd"):
        store.get("good/passwd")


def test_filestore_reading_a_fifo_never_blocks(root: Path):
    os.mkfifo(root / "good" / "pipe")
    done = threading.Event()

    def read() -> None:
        with pytest.raises(SourceError, match="not a regular file"):
            store_at(root).get("good/pipe")
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(5), "a FIFO blocked the read"


def test_filestore_folders_nested_too_deep_unlist_their_checkpoint(root: Path):
    deep = root / "deep"
    deep.joinpath(*["d"] * (MAX_DEPTH + 1)).mkdir(parents=True)
    (deep.joinpath(*["d"] * (MAX_DEPTH + 1)) / "x.bin").write_bytes(b"x")
    settled()
    objects, unlisted = store_at(root).list()
    assert "deep" in unlisted and "nested more than" in unlisted["deep"]
    assert "good/manifest.json" in objects


def test_filestore_leaves_a_file_changed_this_tick_for_the_next_listing(root: Path):
    store = store_at(root)
    (root / "good" / "new.bin").write_bytes(b"new")
    assert "good/new.bin" not in store.list()[0]
    settled()
    assert "good/new.bin" in store.list()[0]
    assert "good/new.bin" in store.list_under("good"), "records are listed as soon as written"


def test_filestore_range_of_a_file_rewritten_since_it_was_listed_is_refused(root: Path):
    settled()
    store = store_at(root)
    listed = store.list()[0]["good/sub/a.bin"]
    assert bytes(store.get_range("good/sub/a.bin", 1, 3, listed.etag)) == b"bc"
    (root / "good" / "sub" / "a.bin").write_bytes(b"xyz")  # same size, other bytes
    with pytest.raises(ObjectChanged):
        store.get_range("good/sub/a.bin", 1, 3, listed.etag)
    settled()
    now = store.list()[0]["good/sub/a.bin"]
    assert now.etag != listed.etag and bytes(store.get_range("good/sub/a.bin", 0, 3, now.etag)) == b"xyz"


def test_filestore_range_past_the_end_of_a_truncated_file_fails(root: Path):
    store = store_at(root)
    with pytest.raises(SourceError, match="ended at 3 bytes"):
        store.get_range("good/sub/a.bin", 0, 10, None)


def test_filestore_create_never_overwrites_and_leaves_no_temporary(root: Path):
    store = store_at(root)
    assert store.create("good/_verdicts/fp/h.passed.json", b"one")
    assert not store.create("good/_verdicts/fp/h.passed.json", b"two")
    assert (root / "good/_verdicts/fp/h.passed.json").read_bytes() == b"one"
    with pytest.raises(PublishError, match="already exists"):
        store.put("good/_verdicts/fp/h.passed.json", b"three", create_only=True)
    store.put("good/other.json", b"four")
    store.put("good/other.json", b"five")
    assert (root / "good/other.json").read_bytes() == b"five"
    assert not [p for p in root.rglob("*") if p.name.endswith(TEMPORARY)]


def test_filestore_writes_and_deletes_never_go_through_a_link(root: Path, tmp_path: Path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.json").write_bytes(b"keep")
    (root / "good" / "_verdicts").symlink_to(elsewhere)
    store = store_at(root)
    with pytest.raises(SourceError, match="PUT"):
        store.create("good/_verdicts/x.json", b"x")
    store.delete(["good/_verdicts/keep.json", "good/missing.json"])
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.json"]


def test_filestore_root_that_is_gone_fails_the_listing_in_one_line(tmp_path: Path):
    with pytest.raises(SourceError) as failed:
        store_at(tmp_path / "unmounted").list()
    assert str(failed.value) == f"LIST file://{tmp_path}/unmounted: No such file or directory"


@pytest.mark.parametrize("url", ["file://relative/path", "file://host/path"])
def test_filestore_needs_an_absolute_path(url: str):
    with pytest.raises(ConfigError, match="give an absolute path after file://"):
        FileStore(url)


def test_filestore_never_reads_whole_a_file_grown_past_any_manifest(root: Path):
    with (root / "good" / "manifest.json").open("r+b") as grown:
        grown.truncate(MAX_SMALL_BYTES + 1)  # sparse: no disk used
    with pytest.raises(SourceError, match="more than"):
        store_at(root).get("good/manifest.json")


def test_filestore_failed_write_leaves_no_temporary(root: Path):
    class DiskFull(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(SourceError, match="No space left on device"):
        store_at(root).create("good/_verdicts/fp/h.json", DiskFull())  # type: ignore[arg-type]
    assert not [p for p in root.rglob("*") if p.name.endswith(TEMPORARY)]
    assert not (root / "good/_verdicts/fp/h.json").exists()


def test_filestore_folders_and_files_it_makes_follow_the_umask(root: Path):
    before = os.umask(0o002)
    try:
        store_at(root).create("good/_verdicts/fp/h.json", b"{}")
    finally:
        os.umask(before)
    assert (root / "good/_verdicts/fp").stat().st_mode & 0o777 == 0o775
    assert (root / "good/_verdicts/fp/h.json").stat().st_mode & 0o777 == 0o664


def test_filestore_whole_read_of_a_file_just_written_has_no_etag_to_keep_it_by(root: Path):
    store = store_at(root)
    (root / "good" / "manifest.json").write_bytes(b'{"a": 1}')
    assert store.get("good/manifest.json") == (b'{"a": 1}', None)
    settled()
    data, etag = store.get("good/manifest.json")
    assert data == b'{"a": 1}' and etag == store.head("good/manifest.json").etag  # type: ignore[union-attr]


def test_filestore_file_replaced_while_read_is_changed_not_mixed(root: Path, monkeypatch: pytest.MonkeyPatch):
    shard = root / "good" / "sub" / "a.bin"
    real = filestore.read_exactly

    def replaced_meanwhile(fd: int, into: memoryview, offset: int) -> None:
        real(fd, into, offset)
        (root / "new.bin").write_bytes(b"xyz")
        os.replace(root / "new.bin", shard)  # another host's writer: a new file on the name

    monkeypatch.setattr(filestore, "read_exactly", replaced_meanwhile)
    with pytest.raises(ObjectChanged):
        store_at(root).get_range("good/sub/a.bin", 0, 3, None)


def test_filestore_file_turned_into_a_fifo_after_listing_is_that_versions_problem(root: Path):
    settled()
    store = store_at(root)
    listed = store.list()[0]["good/sub/a.bin"]
    (root / "good" / "sub" / "a.bin").unlink()
    os.mkfifo(root / "good" / "sub" / "a.bin")
    with pytest.raises(KeyUnreadable, match="not a regular file"):
        store.get_range("good/sub/a.bin", 0, 3, listed.etag)


def test_filestore_never_walks_the_names_it_is_told_to_skip(root: Path):
    trash = root / ".Trash-1000"
    trash.mkdir()
    (trash / "loop").symlink_to("/")
    settled()
    objects, unlisted = store_at(root).list(lambda name: name.startswith("."))
    assert unlisted == {} and not any(k.startswith(".Trash") for k in objects)
    assert ".Trash-1000" in store_at(root).list()[1]
