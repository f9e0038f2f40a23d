import os
import queue
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.support.converters import (
    COPYING,
    ECHOING,
    EMPTY,
    FAILING,
    HANGING,
    KILLED,
    LINKING,
    OWN_MANIFEST,
    REWRITING,
    converter,
)
from vllm_reloader.checkpoint import gate
from vllm_reloader.checkpoint.conventions import Convention
from vllm_reloader.checkpoint.gate import GateOptions, Verdict
from vllm_reloader.checkpoint.manifest import MANIFEST_NAME
from vllm_reloader.checkpoint.manifest import parse as parse_manifest
from vllm_reloader.config import SourceConfig
from vllm_reloader.retry import Policy
from vllm_reloader.sources.convert import STAGING_PREFIX, Converter
from vllm_reloader.sources.remote import Downloaded, Rejected

CONVERTING = GateOptions(convention=Convention(converter=True))


def dcp(directory: Path) -> Verdict:
    """A whole torch DCP checkpoint (rank files, then `.metadata`), and the gate's verdict on it."""
    directory.mkdir(parents=True)
    for rank in range(2):
        (directory / f"__{rank}_0.distcp").write_bytes(b"\0" * 256)
    (directory / ".metadata").write_bytes(b"metadata")
    verdict = gate.check(directory, serving=None, options=CONVERTING)
    assert verdict.details == {"convert": "torch-dcp"} and verdict.fingerprint
    return verdict


WHOLE: Verdict
FP: str


@pytest.fixture
def convert(tmp_path: Path):
    """Starts a converter on ROOT with `argv`; yields (root, start, posted); stops it after.
    ROOT/step-5 is a whole DCP checkpoint: WHOLE the gate's verdict, FP its fingerprint."""
    global WHOLE, FP
    root = tmp_path / "root"
    WHOLE = dcp(root / "step-5")
    FP = WHOLE.fingerprint
    posted: queue.SimpleQueue[Downloaded | Rejected] = queue.SimpleQueue()
    made: list[Converter] = []

    def start(argv: tuple[str, ...], timeout: float = 60.0) -> Converter:
        source = SourceConfig(path=str(root), converter=argv, converter_timeout=timeout)
        made.append(Converter(source, root, posted.put))
        made[-1].start()
        return made[-1]

    yield root, start, posted
    for each in made:
        each.close()


def test_converter_places_its_output_with_a_manifest_as_name_at_fingerprint(
    convert, make_checkpoint, tmp_path
):
    root, start, posted = convert
    made = make_checkpoint("made", root=tmp_path / "made", shards=2)
    with capture_logs() as logs:
        converter_ = start(converter(tmp_path, "copy", COPYING, made))
        converter_.consider("step-5", root / "step-5", WHOLE)
        converter_.consider("step-5", root / "step-5", WHOLE)  # the gate's next look: once only
        result = posted.get(timeout=30)
    placed = f"step-5@{FP[:16]}"
    assert result == Downloaded(placed)
    manifest = parse_manifest((root / placed / MANIFEST_NAME).read_bytes())
    shards = sorted(p.name for p in made.glob("*.safetensors"))
    assert sorted(f.path for f in manifest.files if f.path.endswith(".safetensors")) == shards
    assert all(f.blake3 for f in manifest.files) and manifest.version == "step-5"
    assert manifest.step == 5, "the number its name ends in"
    assert not [p for p in root.iterdir() if p.name.startswith(STAGING_PREFIX)]
    assert [e["event"] for e in logs if e["event"].startswith("checkpoint.")] == [
        "checkpoint.converting", "checkpoint.converted",
    ]  # fmt: skip
    assert posted.empty()


def test_converter_failure_rejects_that_content_with_its_last_lines(convert, tmp_path):
    root, start, posted = convert
    start(converter(tmp_path, "fail", FAILING)).consider("step-5", root / "step-5", WHOLE)
    result = posted.get(timeout=30)
    assert isinstance(result, Rejected) and result.check == "converter" and result.fingerprint == FP
    assert result.name == "step-5" and "exited with status 3" in result.reason
    assert "RuntimeError: the optimizer state is not a model" in result.reason
    assert "line 19" in result.reason and "line 5" not in result.reason, "the last lines only"
    assert "\n" not in result.reason
    assert sorted(p.name for p in root.iterdir()) == ["step-5"], "nothing placed, no staging left"


def test_converter_that_writes_no_safetensors_is_a_rejection(convert, tmp_path):
    root, start, posted = convert
    start(converter(tmp_path, "empty", EMPTY)).consider("step-5", root / "step-5", WHOLE)
    result = posted.get(timeout=30)
    assert isinstance(result, Rejected) and "wrote no .safetensors" in result.reason


def test_converter_running_past_its_timeout_is_killed_with_its_children_and_rejected(convert, tmp_path):
    root, start, posted = convert
    pids = tmp_path / "pids"
    start(converter(tmp_path, "hang", HANGING, pids), timeout=2).consider("step-5", root / "step-5", WHOLE)
    result = posted.get(timeout=30)
    assert (
        isinstance(result, Rejected)
        and "converter_timeout (2 s)" in result.reason
        and "working" in result.reason
    )
    for pid in map(int, pids.read_text().split()):
        _gone(pid)


def test_stopping_kills_a_running_converter_and_records_nothing(convert, tmp_path):
    root, start, posted = convert
    pids = tmp_path / "pids"
    running = start(converter(tmp_path, "hang", HANGING, pids))
    running.consider("step-5", root / "step-5", WHOLE)
    deadline = time.monotonic() + 30
    while not pids.exists() or not pids.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    running.close()
    assert not running.is_alive() and posted.empty()
    for pid in map(int, pids.read_text().split()):
        _gone(pid)
    assert not [p for p in root.iterdir() if p.name.startswith(STAGING_PREFIX)]


def test_converter_gets_a_name_that_spells_a_placeholder_as_it_is(convert, tmp_path):
    root, start, posted = convert
    odd = root / "step-{output}"
    verdict = dcp(odd)
    seen = tmp_path / "seen"
    start(converter(tmp_path, "echo", ECHOING, seen)).consider(odd.name, odd, verdict)
    assert isinstance(posted.get(timeout=30), Rejected)
    given, output = (seen / "argv").read_text().split("\n")
    placed = f"step-{{output}}@{verdict.fingerprint[:16]}"
    assert given == str(odd) and output.endswith(f"{STAGING_PREFIX}{placed}/output")


def test_converter_is_not_run_again_on_content_it_placed_before_a_restart(convert, tmp_path):
    root, start, posted = convert
    (root / f"step-5@{FP[:16]}").mkdir()
    start(converter(tmp_path, "fail", FAILING)).consider("step-5", root / "step-5", WHOLE)
    assert posted.get(timeout=30) == Downloaded(f"step-5@{FP[:16]}")


@pytest.mark.parametrize("odd", ["not whole", "no fingerprint", "rejected", "written again"])
def test_converter_runs_only_on_what_the_gate_found_whole_as_it_still_is(convert, tmp_path, odd):
    root, start, posted = convert
    verdict = {
        "not whole": Verdict("pending", "a torch DCP checkpoint (being written)", fingerprint=FP),
        "no fingerprint": Verdict("pending", "no fingerprint", details={"convert": "torch-dcp"}),
        "rejected": Verdict("rejected", "bad", fingerprint=FP, details={"convert": "torch-dcp"}),
        "written again": WHOLE,
    }[odd]
    if odd == "written again":  # after the gate's look: other content, converted once the gate sees it
        (root / "step-5" / "__1_0.distcp").write_bytes(b"\1" * 300)
    with capture_logs() as logs:
        start(converter(tmp_path, "fail", FAILING)).consider("step-5", root / "step-5", verdict)
        with pytest.raises(queue.Empty):
            posted.get(timeout=1)
    dropped = [e for e in logs if e["event"] == "checkpoint.convert_dropped"]
    assert bool(dropped) == (odd == "written again")


def _gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if _zombie(pid):
            return
        assert time.monotonic() < deadline, f"{pid} still runs"
        time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except OSError:
        return True


def test_converter_output_that_is_a_symlink_is_rejected_and_nothing_is_placed(
    convert, make_checkpoint, tmp_path
):
    root, start, posted = convert
    made = make_checkpoint("made", root=tmp_path / "made")
    start(converter(tmp_path, "link", LINKING, made)).consider("step-5", root / "step-5", WHOLE)
    result = posted.get(timeout=30)
    assert isinstance(result, Rejected) and "made no directory" in result.reason
    assert sorted(p.name for p in root.iterdir()) == ["step-5"] and made.is_dir()


def test_converter_manifest_of_its_own_is_replaced_by_the_daemons(convert, make_checkpoint, tmp_path):
    root, start, posted = convert
    made = make_checkpoint("made", root=tmp_path / "made")
    start(converter(tmp_path, "own", OWN_MANIFEST, made)).consider("step-5", root / "step-5", WHOLE)
    placed = posted.get(timeout=30)
    assert isinstance(placed, Downloaded)
    manifest = parse_manifest((root / placed.name / MANIFEST_NAME).read_bytes())
    assert MANIFEST_NAME not in [f.path for f in manifest.files] and manifest.files


def test_converter_leaves_content_another_daemon_on_the_root_is_converting_to_it(convert, tmp_path):
    import fcntl

    root, start, posted = convert
    lock = root / f"{STAGING_PREFIX}step-5@{FP[:16]}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        start(converter(tmp_path, "fail", FAILING)).consider("step-5", root / "step-5", WHOLE)
        with pytest.raises(queue.Empty):
            posted.get(timeout=1.5)
    finally:
        os.close(fd)


def test_converter_killed_by_a_signal_is_tried_again_after_a_backoff_not_rejected(
    convert, tmp_path, monkeypatch
):
    from vllm_reloader.sources import convert as module

    monkeypatch.setattr(module, "RETRY", Policy(0.6, 1.0))
    root, start, posted = convert
    with capture_logs() as logs:
        running = start(converter(tmp_path, "killed", KILLED))
        running.consider("step-5", root / "step-5", WHOLE)
        deadline = time.monotonic() + 30
        while not [e for e in logs if e["event"] == "checkpoint.convert_failed"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        running.consider("step-5", root / "step-5", WHOLE)  # within the backoff: not again
        time.sleep(0.8)
        running.consider("step-5", root / "step-5", WHOLE)  # after it: again
        while len([e for e in logs if e["event"] == "checkpoint.convert_failed"]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    failed = [e for e in logs if e["event"] == "checkpoint.convert_failed"]
    assert "killed by signal 9 SIGKILL (out of memory?): loading 80 GB" in failed[0]["reason"]
    assert [e["retry_in_s"] for e in failed] == [pytest.approx(0.6, rel=0.11), pytest.approx(1.0, rel=0.11)]
    assert len([e for e in logs if e["event"] == "checkpoint.converting"]) == 2
    assert posted.empty(), "no rejection: the checkpoint is not at fault"


def test_converter_output_is_dropped_when_the_input_was_written_again_while_it_ran(
    convert, make_checkpoint, tmp_path
):
    root, start, posted = convert
    made = make_checkpoint("made", root=tmp_path / "made")
    with capture_logs() as logs:
        running = start(converter(tmp_path, "rewrite", REWRITING, made))
        running.consider("step-5", root / "step-5", WHOLE)
        deadline = time.monotonic() + 30
        while not [e for e in logs if e["event"] == "checkpoint.convert_dropped"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    running.close()  # its staging is cleaned up after the line
    assert posted.empty() and sorted(p.name for p in root.iterdir()) == ["step-5"]


def test_converter_start_sweeps_staging_no_live_converter_holds(tmp_path):
    import fcntl

    root = tmp_path / "root"
    (root / f"{STAGING_PREFIX}step-1@{'0' * 16}" / "output").mkdir(parents=True)
    held = root / f"{STAGING_PREFIX}step-2@{'1' * 16}"
    (held / "output").mkdir(parents=True)
    fd = os.open(held.with_name(held.name + ".lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        swept = Converter(SourceConfig(path=str(root)), root, lambda _: None)
        swept.start()
        swept.close()
        assert sorted(p.name for p in root.iterdir()) == [held.name, held.name + ".lock"]
    finally:
        os.close(fd)


SLOW_KILLED = """
import os, signal, time
time.sleep(0.5)
print("loading 80 GB", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
"""Runs a while, then dies as the OOM killer kills it."""


def test_converter_offered_a_content_at_every_verdict_runs_it_once_then_only_after_each_backoff(
    convert, tmp_path, monkeypatch
):
    from vllm_reloader.sources import convert as module

    monkeypatch.setattr(module, "RETRY", Policy(1.0, 1.0, jitter=0))
    root, start, posted = convert
    with capture_logs() as logs:
        running = start(converter(tmp_path, "slow-killed", SLOW_KILLED))
        began = time.monotonic()
        while time.monotonic() - began < 2.8:  # the loop gates a waiting checkpoint every 50 ms
            running.consider("step-5", root / "step-5", WHOLE)
            time.sleep(0.05)
        running.close()
    runs = [e for e in logs if e["event"] == "checkpoint.converting"]
    failed = [e for e in logs if e["event"] == "checkpoint.convert_failed"]
    assert 1 < len(runs) <= 2 and len(failed) == len(runs), "no duplicate queued behind a run"
    assert posted.empty(), "no rejection: the checkpoint is not at fault"


def test_converter_rejects_once_a_content_whose_output_the_filesystem_cannot_name(
    convert, tmp_path, make_checkpoint, monkeypatch
):
    """A name as long as the filesystem allows has no room for `@<fingerprint>`: rejected once
    (`local`: this host's filesystem), not tried again after a backoff for ever."""
    root, start, posted = convert
    long_name = "s" * 240
    (root / "step-5").rename(root / long_name)
    running = start(converter(tmp_path, "copy", COPYING, make_checkpoint("made", root=tmp_path / "made")))
    running.consider(long_name, root / long_name, WHOLE)
    rejected = posted.get(timeout=30)
    assert isinstance(rejected, Rejected) and rejected.check == "local" and "too long" in rejected.reason
    running.consider(long_name, root / long_name, WHOLE)  # asked again: converted once
    with pytest.raises(queue.Empty):
        posted.get(timeout=1.0)
