"""The adapter source: each version copied (hashed as read) into the daemon's own directory,
the copy gated, the verdict posted; what is not whole yet waits, odd entries are passed by."""

from __future__ import annotations

import os
import shutil
import stat
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.support.adapters import BASE, write_adapter
from tests.support.records import open_records
from vllm_reloader.checkpoint.adapter import WEIGHTS_NAME, Served
from vllm_reloader.sources.adapter_trees import LocalTree
from vllm_reloader.sources.adapters import AdapterGated, AdaptersListed, AdapterSource

SERVED = Served(weights=BASE, dtype="BF16", max_rank=16)


@pytest.fixture
def found() -> list[AdapterGated | AdaptersListed]:
    return []


def make_source(tmp_path: Path, found: list[AdapterGated | AdaptersListed], **kw: object) -> AdapterSource:
    (tmp_path / "root").mkdir(exist_ok=True)
    served = kw.pop("served", SERVED)
    return AdapterSource(
        LocalTree(tmp_path / "root"), tmp_path / "copies", 0.05,
        served=lambda: served, post=found.append, records=open_records(tmp_path / "state"),  # type: ignore[arg-type]
    )  # fmt: skip


def collect(source: AdapterSource, *held: str) -> list[tuple[str, str]]:
    """The loop's collector, with `held` the copies the engines and adapters hold."""
    source.content.declare({"engines": set(held)})
    return source.content.collect()


def gated(found: list[AdapterGated | AdaptersListed]) -> list[AdapterGated]:
    return [m for m in found if isinstance(m, AdapterGated)]


def test_adapter_source_gates_a_copy_the_engine_can_read_and_never_the_writers_files(tmp_path, found):
    source = make_source(tmp_path, found)
    original = write_adapter(tmp_path / "root" / "support" / "step-1", seed=1)
    source.scan()
    [message] = gated(found)
    assert message.verdict.status == "ready" and message.copy is not None
    copy = Path(message.copy.path)
    assert copy.parent == tmp_path / "copies" / "support"
    assert copy.name == f"step-1@{message.copy.fingerprint[:32]}"
    assert (copy / WEIGHTS_NAME).read_bytes() == (original / WEIGHTS_NAME).read_bytes()
    assert stat.S_IMODE(os.stat(copy / WEIGHTS_NAME).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(copy).st_mode) == 0o755
    assert set(message.copy.files) == {"adapter_config.json", WEIGHTS_NAME}
    (original / WEIGHTS_NAME).write_bytes(b"rewritten by the writer")  # after the copy: the copy is untouched
    assert (copy / WEIGHTS_NAME).read_bytes() != b"rewritten by the writer"
    assert message.order[0] == 1
    assert [m.names for m in found if isinstance(m, AdaptersListed)] == [{"support"}]


def test_adapter_source_judges_a_content_once_and_again_when_it_is_rewritten(tmp_path, found):
    source = make_source(tmp_path, found)
    version = write_adapter(tmp_path / "root" / "support" / "step-1", seed=1)
    source.scan()
    source.scan()
    assert len(gated(found)) == 1
    write_adapter(version, seed=2)
    os.utime(version / WEIGHTS_NAME, ns=(1, 1))  # another identity whatever the clock's grain
    source.scan()
    first, second = gated(found)
    assert first.copy and second.copy and first.copy.fingerprint != second.copy.fingerprint


def test_adapter_source_waits_for_a_version_still_being_written(tmp_path, found):
    source = make_source(tmp_path, found)
    version = tmp_path / "root" / "support" / "step-1"
    whole = write_adapter(tmp_path / "staged", seed=1)
    version.mkdir(parents=True)
    (version / "adapter_config.json").write_bytes((whole / "adapter_config.json").read_bytes())
    source.scan()  # no weights yet
    data = (whole / WEIGHTS_NAME).read_bytes()
    (version / WEIGHTS_NAME).write_bytes(data[: len(data) // 2])
    source.scan()  # short: pending, its copy not held
    assert gated(found) == [] and len(collect(source)) == 1 and list((tmp_path / "copies").glob("*/*")) == []
    (version / WEIGHTS_NAME).write_bytes(data)
    source.scan()
    assert [m.verdict.status for m in gated(found)] == ["ready"]


def test_adapter_source_posts_a_rejection_and_keeps_no_copy_of_it(tmp_path, found):
    source = make_source(tmp_path, found)
    b_name = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    nan = np.full((BASE["model.layers.0.mlp.up_proj.weight"][0], 4), np.nan, dtype=np.float32)
    write_adapter(tmp_path / "root" / "support" / "step-1", overrides={b_name: nan})
    source.scan()
    [message] = gated(found)
    assert message.verdict.status == "rejected" and message.verdict.check == "non_finite"
    assert message.copy is None and len(collect(source)) == 1, "its copy is not held: collected"
    assert list((tmp_path / "copies").glob("*/*")) == []


def test_adapter_source_passes_by_odd_names_links_and_files(tmp_path, found):
    source = make_source(tmp_path, found)
    root = tmp_path / "root"
    write_adapter(root / ".hidden" / "step-1")
    write_adapter(root / "with space" / "step-1")
    write_adapter(root / "support" / "step 1")
    write_adapter(tmp_path / "elsewhere" / "step-1")
    (root / "linked").symlink_to(tmp_path / "elsewhere")
    (root / "afile").write_text("x")
    (root / "support" / "afile").write_text("x")
    source.scan()
    assert gated(found) == [] and [m.names for m in found if isinstance(m, AdaptersListed)] == [{"support"}]


def test_adapter_source_judges_nothing_before_the_served_model_is_known(tmp_path, found):
    source = make_source(tmp_path, found, served=None)
    write_adapter(tmp_path / "root" / "support" / "step-1")
    source.scan()
    assert found == []


def test_adapter_source_lets_go_of_copies_of_removed_versions_and_only_unheld_ones_are_collected(
    tmp_path, found
):
    source = make_source(tmp_path, found)
    for step in (1, 2):
        write_adapter(tmp_path / "root" / "support" / f"step-{step}", seed=step)
    source.scan()
    first, second = (Path(m.copy.path) for m in gated(found) if m.copy)
    assert collect(source) == [], "held by the source while their versions are there"
    for step in (1, 2):
        shutil.rmtree(tmp_path / "root" / "support" / f"step-{step}")
    source.scan()
    assert collect(source, str(first)) == [("adapter", str(second))], "an engine holds the first"
    assert first.is_dir() and not second.exists()


def test_adapter_source_thread_lives_through_an_unreadable_root_and_stops(tmp_path, found):
    source = make_source(tmp_path, found)
    (tmp_path / "root").rmdir()
    source.start()
    try:
        write_adapter(tmp_path / "root" / "support" / "step-1")
        deadline = 100
        while not gated(found) and deadline:
            deadline -= 1
            source.stop.wait(0.05)
        assert gated(found) and source.is_alive()
    finally:
        source.close()
    assert not source.is_alive()


def test_adapter_source_keeps_the_copy_of_the_same_bytes_an_engine_may_be_reading(tmp_path, found):
    source = make_source(tmp_path, found)
    version = write_adapter(tmp_path / "root" / "support" / "step-1", seed=1)
    source.scan()
    copy = Path(gated(found)[0].copy.path)  # type: ignore[union-attr]
    inode = os.stat(copy / WEIGHTS_NAME).st_ino
    os.chmod(version / WEIGHTS_NAME, 0o600)  # a chmod, a touch: a new identity, the same bytes
    source.scan()
    again = gated(found)[1].copy
    assert again is not None and again.path == str(copy) and os.stat(copy / WEIGHTS_NAME).st_ino == inode


def test_adapter_source_refuses_what_no_adapter_of_the_served_model_could_be_before_copying(tmp_path, found):
    source = make_source(tmp_path, found)
    version = write_adapter(tmp_path / "root" / "support" / "step-1")
    with open(version / WEIGHTS_NAME, "r+b") as f:
        f.truncate(1 << 40)  # sparse: a terabyte to read
    source.scan()
    [message] = gated(found)
    assert message.verdict.check == "size" and "r = 16" in message.verdict.reason
    assert list((tmp_path / "copies").glob("*/*")) == []


def test_adapter_source_rejects_a_config_number_no_float_holds_and_goes_on(tmp_path, found):
    source = make_source(tmp_path, found)
    write_adapter(tmp_path / "root" / "a" / "step-1", config={"lora_alpha": 10**400})
    write_adapter(tmp_path / "root" / "b" / "step-1")
    source.scan()
    assert {m.adapter: m.verdict.status for m in gated(found)} == {"a": "rejected", "b": "ready"}


def test_adapter_source_never_reads_through_a_linked_version_or_a_fifo(tmp_path, found):
    source = make_source(tmp_path, found)
    elsewhere = write_adapter(tmp_path / "elsewhere" / "secret")
    (tmp_path / "root" / "support").mkdir(parents=True)
    (tmp_path / "root" / "support" / "step-1").symlink_to(elsewhere)
    fifo = tmp_path / "root" / "support" / "step-2"
    write_adapter(fifo)
    (fifo / WEIGHTS_NAME).unlink()
    os.mkfifo(fifo / WEIGHTS_NAME)
    source.scan()  # returns: a FIFO is never opened
    assert gated(found) == []


def test_adapter_source_says_nothing_of_an_empty_root_and_deletes_nothing_itself(tmp_path, found):
    source = make_source(tmp_path, found)
    source.scan()
    assert found == [], "an empty root (a mount not there) is not 'every adapter removed'"
    write_adapter(tmp_path / "root" / "support" / "step-1")
    source.scan()
    copy = Path(gated(found)[0].copy.path)  # type: ignore[union-attr]
    shutil.rmtree(tmp_path / "root" / "support" / "step-1")
    source.scan()
    assert copy.is_dir(), "only the loop's collector deletes a copy, where it knows who holds it"


class FullDisk(LocalTree):
    """A local root whose copies fail as on a full disk while `full` is set."""

    full = True

    def copy(self, *args, **kw):  # type: ignore[no-untyped-def]
        if self.full:
            raise OSError(28, "No space left on device")
        return super().copy(*args, **kw)


def test_adapter_source_says_a_copy_failing_once_retries_it_and_never_rejects_the_version(
    tmp_path, found, monkeypatch
):
    from structlog.testing import capture_logs

    from vllm_reloader.retry import Policy
    from vllm_reloader.sources import adapters

    monkeypatch.setattr(adapters, "RETRY", Policy(0.0, 0.0))  # tried again at every look
    (tmp_path / "root").mkdir()
    tree = FullDisk(tmp_path / "root")
    source = AdapterSource(
        tree,
        tmp_path / "copies",
        0.05,
        served=lambda: SERVED,
        post=found.append,
        records=open_records(tmp_path / "state"),
    )
    write_adapter(tmp_path / "root" / "support" / "step-1")
    with capture_logs() as logs:
        for _ in range(3):
            source.scan()
        assert gated(found) == [], "a full disk is not the version's fault"
        tree.full = False
        source.scan()
        assert [m.verdict.status for m in gated(found)] == ["ready"]
        write_adapter(tmp_path / "root" / "support" / "step-2")
        tree.full = True
        source.scan()
        source.scan()
    said = [(e["version"], e["reason"]) for e in logs if e["event"] == "adapter.unreadable"]
    assert said == [("step-1", "No space left on device"), ("step-2", "No space left on device")]
    assert list((tmp_path / "copies").glob(".copying-*")) == [], "no staging left behind"


def test_adapter_source_thread_takes_a_version_renamed_into_a_watched_root_without_waiting_a_look(
    tmp_path, found
):
    (tmp_path / "root").mkdir()
    source = AdapterSource(
        LocalTree(tmp_path / "root"), tmp_path / "copies", 3600.0,  # looks: once an hour
        served=lambda: SERVED, post=found.append, records=open_records(tmp_path / "state"),
    )  # fmt: skip
    source.start()
    try:
        source.stop.wait(0.3)  # the first look done, the watch in place
        staged = write_adapter(tmp_path / "staged" / "step-1")
        (tmp_path / "root" / "support").mkdir()
        staged.rename(tmp_path / "root" / "support" / "step-1")
        for _ in range(100):
            if gated(found):
                break
            source.stop.wait(0.05)
        assert [m.version for m in gated(found)] == ["step-1"], "woken by inotify, not the hourly look"
    finally:
        source.close()
    assert not source.is_alive()


class Blocking(LocalTree):
    """A root whose listing hangs until `go` is set, as a hung store's LIST does."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.go, self.listing = threading.Event(), threading.Event()

    def list(self, say):  # type: ignore[no-untyped-def]
        self.listing.set()
        self.go.wait(10)
        return super().list(say)


def test_adapter_source_closed_while_stuck_in_a_listing_says_nothing_and_removes_nothing(tmp_path, found):
    write_adapter(tmp_path / "root" / "old" / "step-1")
    tree = Blocking(tmp_path / "root")
    (tmp_path / "copies" / "new").mkdir(parents=True)
    (tmp_path / "copies" / "new" / "step-1@abc").mkdir()  # a copy the source replacing it made
    source = AdapterSource(
        tree,
        tmp_path / "copies",
        0.05,
        served=lambda: SERVED,
        post=found.append,
        records=open_records(tmp_path / "state"),
    )
    source.start()
    assert tree.listing.wait(5)
    source.close(timeout=0)  # as a SIGHUP does: not waited for
    tree.go.set()
    source._thread.join(5)
    assert found == [], "nothing of the old root reaches the loop"
    assert (tmp_path / "copies" / "new" / "step-1@abc").is_dir(), "nor is another source's copy pruned"


def test_adapter_source_thread_is_not_woken_by_a_write_still_going_on(tmp_path, found):
    (tmp_path / "root" / "support" / "step-1").mkdir(parents=True)
    tree = LocalTree(tmp_path / "root")
    looks = []
    real = tree.list
    tree.list = lambda say: (looks.append(1), real(say))[1]  # type: ignore[method-assign]
    source = AdapterSource(
        tree,
        tmp_path / "copies",
        3600.0,
        served=lambda: SERVED,
        post=found.append,
        records=open_records(tmp_path / "state"),
    )
    source.start()
    try:
        source.stop.wait(0.3)
        assert len(looks) == 1
        with open(tmp_path / "root" / "support" / "step-1" / "adapter_model.safetensors", "wb") as f:
            for _ in range(20):
                f.write(b"x" * 4096)
                f.flush()
                source.stop.wait(0.01)
            source.stop.wait(0.3)
            assert len(looks) == 1, "each look would copy a file not whole yet"
        for _ in range(40):
            if len(looks) > 1:
                break
            source.stop.wait(0.05)
        assert len(looks) == 2, "closed after writing: looked at once"
    finally:
        source.close()


def test_adapter_source_keeps_a_versions_place_in_order_when_it_is_judged_again(tmp_path, found):
    source = make_source(tmp_path, found)
    write_adapter(tmp_path / "root" / "support" / "beta", seed=1)
    source.scan()
    write_adapter(tmp_path / "root" / "support" / "alpha", seed=2)  # no step: newer by when seen
    source.scan()
    first = {m.version: m.order for m in gated(found)}
    assert first["alpha"] > first["beta"]
    found.clear()
    source._judged.clear()  # judged again: a retry, a new base, a new source after a SIGHUP
    source.scan()
    assert {m.version: m.order for m in gated(found)} == first


def test_adapter_source_copies_an_adapter_and_version_with_the_longest_names_allowed(tmp_path, found):
    from vllm_reloader.sources.adapter_trees import MAX_NAME

    source = make_source(tmp_path, found)
    name, version = "a" * MAX_NAME, "v" * (MAX_NAME - 2) + "-7"
    write_adapter(tmp_path / "root" / name / version)
    source.scan()
    [message] = gated(found)
    assert message.verdict.status == "ready" and message.copy is not None, message.verdict
    assert Path(message.copy.path).parent == tmp_path / "copies" / name


def test_adapter_source_rejects_once_a_version_whose_copy_the_filesystem_cannot_name(
    tmp_path, found, monkeypatch
):
    real = os.pathconf
    monkeypatch.setattr(
        os, "pathconf", lambda path, name: 100 if name == "PC_NAME_MAX" else real(path, name)
    )  # a filesystem with short names (eCryptfs allows 143 bytes)
    source = make_source(tmp_path, found)
    write_adapter(tmp_path / "root" / "support" / ("v" * 80))
    for _ in range(3):
        source.scan()
    [message] = gated(found)
    assert (message.verdict.status, message.verdict.check) == ("rejected", "local")
    assert "name is too long" in message.verdict.reason and message.copy is None
    assert not list((tmp_path / "copies").glob("*/*")), "nothing copied"
