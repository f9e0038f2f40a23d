"""The content store: the daemon collects only copies it made, and only those no lease holds."""

from __future__ import annotations

from pathlib import Path

import structlog

from tests.support.records import open_records
from vllm_reloader.sources.content import ContentStore, all_of


def made(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"x")
    return directory


def store(tmp_path: Path) -> ContentStore:
    return ContentStore(open_records(tmp_path / "state"), structlog.get_logger())


def test_content_collects_what_the_daemon_made_and_no_lease_holds(tmp_path):
    content = store(tmp_path)
    kept, gone = made(tmp_path / "cache" / "step-2@a"), made(tmp_path / "cache" / "step-1@b")
    content.made(kept, "download")
    content.made(gone, "download")
    content.declare({"engine:a": {str(kept)}})
    assert content.collect() == [("download", str(gone))]
    assert kept.is_dir() and not gone.exists()
    assert content.collect() == [], "each copy collected once"


def test_content_never_deletes_a_directory_it_did_not_make_whatever_its_name(tmp_path):
    """Before: adapter copies set to the download cache, and the adapter prune deleted the
    served checkpoint (it removed anything shaped */*@*)."""
    content = store(tmp_path)
    theirs = made(tmp_path / "copies" / "support" / "step-1@0123456789abcdef")
    content.declare({})
    assert content.collect() == [] and theirs.is_dir()


def test_content_a_lease_on_all_of_a_kind_keeps_every_copy_of_it(tmp_path):
    content = store(tmp_path)
    copy = made(tmp_path / "copies" / "support" / "v1@ab")
    content.made(copy, "adapter")
    content.declare({"engine:b:adapters": {all_of("adapter")}})  # what b holds is not known yet
    assert content.collect() == [] and copy.is_dir()
    content.declare({"engine:b:adapters": set()})
    assert content.collect() == [("adapter", str(copy))]


def test_content_the_loops_declaration_replaces_its_own_leases_not_a_sources(tmp_path):
    content = store(tmp_path)
    one, two = made(tmp_path / "copies" / "a" / "v1@1"), made(tmp_path / "copies" / "a" / "v2@2")
    for copy in (one, two):
        content.made(copy, "adapter")
    content.hold("source:adapters:0", [str(two)])  # from the adapter source's own thread
    content.declare({"engine:a:work": {str(one)}})
    content.declare({})  # the swap is over: what it held is let go
    assert content.collect() == [("adapter", str(one))] and two.is_dir()


def test_content_collects_a_copy_whose_name_is_as_long_as_a_name_can_be(tmp_path):
    content = store(tmp_path)
    longest = made(tmp_path / "cache" / ("z" * 255))
    content.made(longest, "download")
    content.declare({})
    assert content.collect() == [("download", str(longest))] and list(longest.parent.iterdir()) == []


def test_content_adopts_what_an_earlier_release_made_in_its_own_directory_once(tmp_path):
    content = store(tmp_path)
    old = made(tmp_path / "cache" / "step-1@ab")
    content.adopt(tmp_path / "cache", "*", "download")
    content.declare({"engine:a": {str(old)}})
    assert content.collect() == []
    new = made(tmp_path / "cache" / "step-2@cd")  # not made by the daemon: never adopted again
    content.adopt(tmp_path / "cache", "*", "download")
    content.declare({})
    assert content.collect() == [("download", str(old))] and new.is_dir()


def test_content_never_collects_a_converters_output_it_placed_in_the_trainers_root(tmp_path):
    """The root is the trainer's, and other daemons on it may serve what one converted."""
    content = store(tmp_path)
    output = made(tmp_path / "root" / "step-5@0123456789abcdef")
    content.made(output, "converted")
    content.declare({})
    assert content.collect() == [] and output.is_dir()


def test_content_a_lease_held_again_unchanged_writes_nothing(tmp_path, monkeypatch):
    """A source re-declares what it holds at every look (every second): no write, no fsync."""
    content = store(tmp_path)
    content.hold("source:adapters:0", ["/copies/a/v1@1"])
    written: list[str] = []
    real = content.records.transaction
    monkeypatch.setattr(content.records, "transaction", lambda *a: (written.append("w"), real(*a))[1])
    for _ in range(5):
        content.hold("source:adapters:0", ["/copies/a/v1@1"])
    assert written == []
    content.hold("source:adapters:0", ["/copies/a/v2@2"])
    assert written and content.records.leases() == {"/copies/a/v2@2": {"source:adapters:0"}}
