"""Nothing one checkpoint contains stops the loop: each odd input is refused or skipped, the
daemon keeps serving, and the next good checkpoint loads after it."""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.checkpoints import write_manifest, write_weights
from tests.support.fake_engine import FakeEngine
from tests.support.permissions import OWNER, as_another_user

DEEP = b"[" * 100_000 + b"]" * 100_000


def _non_ascii_digits(root: Path) -> str:
    write_weights(root / "step-²")
    write_manifest(root / "step-²")  # no step: ordered by name, a valid checkpoint
    return "reload.succeeded"


def _deep_manifest(root: Path) -> str:
    write_weights(root / "step-5")
    (root / "step-5" / "manifest.json").write_bytes(b'{"format_version": 1, "files": ' + DEEP + b"}")
    return "checkpoint.rejected"


def _deep_config(root: Path) -> str:
    write_weights(root / "step-5")
    (root / "step-5" / "config.json").write_bytes(b'{"a": ' + DEEP + b"}")
    write_manifest(root / "step-5", step=5)
    return "checkpoint.rejected"


def _deep_header(root: Path) -> str:
    (root / "step-5").mkdir()
    header = b'{"a": ' + DEEP + b"}"
    (root / "step-5" / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    write_manifest(root / "step-5", step=5)
    return "checkpoint.rejected"


def _huge_step(root: Path) -> str:
    write_weights(root / "step-5")
    write_manifest(root / "step-5", overrides={"step": 10**30})
    return "checkpoint.rejected"


def _newline_in_version(root: Path) -> str:
    write_weights(root / "step-5")
    write_manifest(root / "step-5", step=5, overrides={"version": "x\nWATCHDOG=trigger"})
    return "checkpoint.rejected"


def _newline_in_name(root: Path) -> str:
    write_weights(root / "step-5\nWATCHDOG=trigger")
    write_manifest(root / "step-5\nWATCHDOG=trigger", step=5, overrides={"version": None})
    return "checkpoint.skipped"


def _name_not_utf8(root: Path) -> str:
    os.mkdir(os.fsencode(root) + b"/step-\xff")
    directory = Path(os.fsdecode(os.fsencode(root) + b"/step-\xff"))
    write_weights(directory)
    manifest = {"format_version": 1, "step": 5, "files": []}
    manifest["files"] = [
        {"path": p.name, "size": p.stat().st_size} for p in directory.iterdir() if p.name != "manifest.json"
    ]
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return "checkpoint.skipped"


def _fifo_manifest(root: Path) -> str:
    write_weights(root / "step-5")
    os.mkfifo(root / "step-5" / "manifest.json")
    return "checkpoint.rejected"


def _manifest_links_to_dev_zero(root: Path) -> str:
    write_weights(root / "step-5")
    (root / "step-5" / "manifest.json").symlink_to("/dev/zero")
    return "checkpoint.rejected"


def _symlinked_candidate(root: Path) -> str:
    elsewhere = root.parent / "elsewhere" / "step-5"
    write_weights(elsewhere)
    write_manifest(elsewhere, step=5)
    (root / "step-5").symlink_to(elsewhere)
    return ""  # never a candidate: nothing to say about it


ODD: dict[str, Callable[[Path], str]] = {
    "digits outside ASCII in a name": _non_ascii_digits,
    "manifest nested past the parser": _deep_manifest,
    "config.json nested past the parser": _deep_config,
    "safetensors header nested past the parser": _deep_header,
    "step too large for a float metric": _huge_step,
    "newline in the version": _newline_in_version,
    "newline in the directory name": _newline_in_name,
    "directory name not UTF-8": _name_not_utf8,
    "manifest.json is a FIFO": _fifo_manifest,
    "manifest.json links to /dev/zero": _manifest_links_to_dev_zero,
    "candidate directory is a symlink": _symlinked_candidate,
}


def test_daemon_rejects_a_manifest_too_large_to_read_copied_in_after_a_stepped_version(
    start, root, make_checkpoint
):
    """Never read, so it says no step: it arrived after what serves, so it is tried, and the
    gate says why it can never load (before, it was passed over with no word but `seen`)."""
    make_checkpoint("step-1", step=1, root=root)
    running = start(FakeEngine(startup=str(root / "step-1")))
    running.wait_for("engine.reconciled", version="step-1")
    staged = make_checkpoint("big", step=2, root=root.parent)
    with (staged / "manifest.json").open("ab") as manifest:
        manifest.write(b" " * (17 << 20))
    staged.rename(root / "big")
    rejected = running.wait_for("checkpoint.rejected", name="big")
    assert "larger than 16777216 bytes" in rejected["reason"], rejected


def test_daemon_a_rejected_checkpoints_step_holds_back_nothing_that_arrives_after_it(
    start, root, make_checkpoint
):
    """A step-less copy arrives after the highest step known: a rejected one's is not known."""
    make_checkpoint("step-1", step=1, root=root)
    running = start(FakeEngine(startup=str(root / "step-1")), settle_seconds=0.3)
    running.wait_for("engine.reconciled", version="step-1")
    _huge_step(root)  # step-5 naming step 10**30: rejected
    running.wait_for("checkpoint.rejected", name="step-5")
    write_weights(root / "final", seed=3)
    running.wait_for("reload.succeeded", version="final")
    make_checkpoint("step-2", step=2, root=root, seed=2)
    running.wait_for("reload.succeeded", version="step-2")


@pytest.mark.parametrize("kind", sorted(ODD))
def test_daemon_refuses_odd_input_and_loads_the_next_good_checkpoint(
    start, root, tmp_path, make_checkpoint, kind
):
    """The engine serves a model from outside the root, so every checkpoint in it is newer
    and gets looked at, odd ones included."""
    engine = FakeEngine(startup=str(make_checkpoint("startup", root=tmp_path / "models")))
    running = start(engine, rescan_interval=0.2)
    running.wait_for("engine.reconciled")
    said = ODD[kind](root)
    if said:
        running.wait_for(said)
    make_checkpoint("step-9", step=9, root=root, seed=9)
    running.wait_for("reload.succeeded", version="step-9")
    assert engine.loaded == str(root / "step-9") and not engine.paused
    assert not running.events("daemon.crashed") and not running.events("daemon.thread_died")
    loaded = [c for c in engine.calls if c.startswith("reload:")]
    expected = [f"reload:{root / 'step-²'}"] if kind == "digits outside ASCII in a name" else []
    assert loaded == [*expected, f"reload:{root / 'step-9'}"], "nothing odd reached the engine"


def test_daemon_keeps_an_unreadable_checkpoint_pending_until_permissions_are_fixed(
    start, root, make_checkpoint, monkeypatch
):
    """transformers 5 writes model.safetensors 0600: a daemon of another user cannot read it."""
    make_checkpoint("step-1", step=1, root=root)
    running = start(FakeEngine(startup=str(root / "step-1")))
    running.wait_for("engine.reconciled")
    as_another_user(monkeypatch, root)
    staged = make_checkpoint("step-2", step=2, root=root.parent / "staging", seed=2)
    (staged / "model.safetensors").chmod(0o600)
    staged.rename(root / "step-2")
    warned = running.wait_for("checkpoint.unreadable", name="step-2")
    assert (warned["unreadable"], warned["owner"], warned["mode"]) == ("model.safetensors", OWNER, "0600")
    assert warned["log_level"] == "warning"
    time.sleep(0.4)  # rechecked every 0.05 s meanwhile
    assert len(running.events("checkpoint.unreadable")) == 1, "said once, not at every recheck"
    assert not running.events("checkpoint.rejected") and not running.events("reload.started")
    (root / "step-2" / "model.safetensors").chmod(0o644)
    running.wait_for("reload.succeeded", version="step-2")
