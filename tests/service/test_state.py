import errno
import json
import os
from pathlib import Path

import pytest

from vllm_reloader import durable
from vllm_reloader.errors import StateError
from vllm_reloader.service import state


def sample() -> state.State:
    loaded = state.Loaded(name="step-2", version="step-2", path="/r/step-2", since=1.0, step=2)
    rejected = {"step-3": state.Rejection(version="step-3", reason="bad", fingerprint="f", at=2.0)}
    return state.State(serving=loaded, good=(loaded,), rejected=rejected)


def test_state_round_trips(tmp_path):
    state.save(tmp_path, sample())
    assert state.load(tmp_path) == sample()


def test_state_missing_file_is_empty(tmp_path):
    assert state.load(tmp_path / "nowhere") == state.State()


def test_state_write_is_atomic_when_interrupted(tmp_path, monkeypatch):
    state.save(tmp_path, sample())

    def crash(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(StateError, match="No space left"):
        state.save(tmp_path, state.State())
    assert state.load(tmp_path) == sample()
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_state_corrupt_file_is_a_state_error(tmp_path):
    (tmp_path / "state.json").write_text("{not json")
    with pytest.raises(StateError, match="corrupt"):
        state.load(tmp_path)


def test_state_read_only_dir_is_a_state_error(tmp_path, monkeypatch):
    def read_only(*_args, **_kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(durable.tempfile, "mkstemp", read_only)
    with pytest.raises(StateError, match="Read-only"):
        state.save(tmp_path, sample())


def test_state_file_with_one_last_good_loads_as_a_history_of_one(tmp_path):
    loaded = state.Loaded(name="step-2", version="step-2", path="/r/step-2", since=1.0, step=2)
    (tmp_path / state.STATE_NAME).write_text(
        json.dumps({"serving": loaded.model_dump(), "last_good": loaded.model_dump(), "rejected": {}})
    )
    assert state.load(tmp_path).good == (loaded,)


def test_state_corrupt_file_is_moved_aside_not_fatal(tmp_path):
    (tmp_path / state.STATE_NAME).write_text('{"serving": {"name": 3')
    found, aside = state.load_or_set_aside(tmp_path)
    assert found == state.State() and aside is not None
    assert aside.name.startswith("state.json.corrupt-") and aside.read_text() == '{"serving": {"name": 3'
    assert not (tmp_path / state.STATE_NAME).exists()


def test_state_file_of_the_previous_release_keeps_pin_rejections_and_history(
    start, root, tmp_path, make_checkpoint
):
    """Written before versions were content: no fingerprints anywhere. Read as it is, each
    intact checkpoint takes its fingerprint, and the rollback history still works."""
    from tests.support.fake_engine import FakeEngine
    from vllm_reloader.checkpoint import completeness, gate
    from vllm_reloader.service.control import Reply
    from vllm_reloader.service.messages import ControlRequest

    def verified(name: str) -> dict:
        directory = root / name
        files = gate.check(directory, serving=None).files
        return {
            "name": name, "version": name, "path": str(directory), "since": 1.0,
            "step": int(name.split("-")[1]), "in_root": True, "files": {k: list(v) for k, v in files.items()},
        }  # fmt: skip

    for step in (1, 2, 3):
        make_checkpoint(f"step-{step}", step=step, root=root, seed=step)
    bad = completeness.fingerprint_of((root / "step-3" / "manifest.json").read_bytes())
    old = {
        "serving": verified("step-2"),
        "good": [verified("step-2"), verified("step-1")],
        "rejected": {"step-3": {"version": "step-3", "reason": "canary: NaN", "fingerprint": bad, "at": 2.0}},
        "pinned": "step-2",
    }
    (tmp_path / "state" / state.STATE_NAME).write_text(json.dumps(old))
    engine = FakeEngine(startup=str(root / "step-1"))
    engine.version, engine.loaded = "step-2", str(root / "step-2")
    running = start(engine)
    running.wait_for("engine.reconciled")
    served = running.daemon.reloader.served
    assert served.serving is not None and served.serving.fingerprint == completeness.fingerprint_of(
        (root / "step-2" / "manifest.json").read_bytes()
    )
    assert [g.name for g in served.good] == ["step-2", "step-1"] and all(g.fingerprint for g in served.good)
    assert running.daemon.reloader.catalog.pinned == "step-2"
    assert running.daemon.reloader.catalog.rejected["step-3"].fingerprint == bad
    running.daemon.inbox.put(ControlRequest({"command": "unpin"}, Reply()))  # on the loop, as `unpin` does
    engine.garbage.add(str(root / "step-4"))
    make_checkpoint("step-4", step=4, root=root, seed=4)
    rolled = running.wait_for("reload.rolled_back", version="step-4")
    assert rolled["to_version"] == "step-2"
    assert str(root / "step-3") not in engine.calls and not any("step-3" in c for c in engine.calls)


def test_state_of_the_previous_release_whose_serving_copy_was_replaced_loads_what_is_there(
    start, root, tmp_path, make_checkpoint
):
    """The previous release renamed a rewrite of `latest` over the copy the engine served: the
    engine holds X, the directory holds Y. Y is new content, and loads."""
    import shutil

    from tests.support.fake_engine import FakeEngine
    from vllm_reloader.checkpoint import gate

    x = make_checkpoint("latest", step=5, root=root, seed=1)
    files = gate.check(x, serving=None).files
    old = {"name": "latest", "version": "latest", "path": str(x), "since": 1.0, "step": 5,
           "files": {k: list(v) for k, v in files.items()}}  # fmt: skip
    (tmp_path / "state" / state.STATE_NAME).write_text(json.dumps({"serving": old, "good": [old]}))
    shutil.rmtree(x)
    make_checkpoint("latest", step=5, root=root, seed=2)  # Y, in its place
    startup = make_checkpoint("startup", root=tmp_path / "models")
    engine = FakeEngine(startup=str(startup))
    engine.version, engine.loaded = "latest", str(x)
    running = start(engine)
    running.wait_for("reload.succeeded", version="latest")
    assert engine.loaded == str(root / "latest")


class Recorded:
    """A logger that keeps what it was told."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields: object) -> None:
        self.events.append((event, fields))

    error = warning


def failing_reads(monkeypatch, error: OSError, times: int | None = None) -> list[int]:
    """`state.json` cannot be read (`times` times, or for ever). The suite runs as root, so a
    chmod would not do."""
    calls: list[int] = []
    read = Path.read_bytes

    def read_bytes(path: Path) -> bytes:
        if path.name == state.STATE_NAME and (times is None or len(calls) < times):
            calls.append(1)
            raise error
        return read(path)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    monkeypatch.setattr(state, "READ_BACKOFF_S", 0.001)
    return calls


@pytest.mark.parametrize(
    "error", [PermissionError(errno.EACCES, "Permission denied"), OSError(errno.EIO, "Input/output error")]
)
def test_state_file_that_cannot_be_read_is_not_set_aside_and_nothing_is_lost(tmp_path, monkeypatch, error):
    state.save(tmp_path, sample())
    saved = (tmp_path / state.STATE_NAME).read_bytes()
    calls = failing_reads(monkeypatch, error)
    log = Recorded()
    with pytest.raises(StateError, match=rf"cannot read .*state.json: {error.strerror} \(4 tries\)"):
        state.StateFile(tmp_path, log)
    assert len(calls) == state.READ_TRIES
    assert [p.name for p in tmp_path.iterdir()] == [state.STATE_NAME]
    assert [e for e, _ in log.events] == ["state.unreadable"] * state.READ_TRIES
    assert log.events[0][1]["reason"] == error.strerror and log.events[-1][1]["retry_in_s"] is None
    monkeypatch.undo()
    assert (tmp_path / state.STATE_NAME).read_bytes() == saved
    assert state.load(tmp_path) == sample()


def test_state_file_unreadable_for_a_moment_is_read_on_a_retry(tmp_path, monkeypatch):
    state.save(tmp_path, sample())
    failing_reads(monkeypatch, OSError(errno.EIO, "Input/output error"), times=2)
    log = Recorded()
    assert state.StateFile(tmp_path, log).saved == sample()
    assert [(e, f["attempt"]) for e, f in log.events] == [("state.unreadable", 1), ("state.unreadable", 2)]
    assert [p.name for p in tmp_path.iterdir()] == [state.STATE_NAME]


def test_state_file_read_and_not_parsed_is_still_set_aside_and_logged(tmp_path):
    (tmp_path / state.STATE_NAME).write_text('{"serving": {"name": 3')
    log = Recorded()
    assert state.StateFile(tmp_path, log).saved == state.State()
    [(event, fields)] = log.events
    assert event == "state.corrupt" and Path(str(fields["moved_to"])).read_text() == '{"serving": {"name": 3'


def test_daemon_whose_state_file_cannot_be_read_exits_1_with_one_line(tmp_path, monkeypatch, capsys):
    """Exit 1, not 2: the unit's `RestartPreventExitStatus=2` would keep it down for good, and a
    disk that failed a read may answer at the next start."""
    from vllm_reloader import cli
    from vllm_reloader.service.daemon import Daemon

    (tmp_path / "root").mkdir()
    (tmp_path / "state").mkdir()
    state.save(tmp_path / "state", sample())
    path = tmp_path / "x.toml"
    path.write_text(
        f'[source]\npath = "{tmp_path / "root"}"\n[engine]\nurl = "http://engine.test"\n'
        f'[state]\ndir = "{tmp_path / "state"}"\n[log]\nformat = "json"\n'
    )
    failing_reads(monkeypatch, PermissionError(errno.EACCES, "Permission denied"))
    monkeypatch.setattr(Daemon, "run", lambda _self: 99)  # started after all: say so, do not hang
    assert cli.main(["run", "--config", str(path)]) == 1
    out, err = capsys.readouterr()
    assert err.startswith(
        f"vllm-reloader: cannot read {tmp_path / 'state' / 'state.json'}: Permission denied"
    )
    assert err.count("\n") == 1 and "Traceback" not in err
    assert [json.loads(line)["event"] for line in out.splitlines()] == ["state.unreadable"] * state.READ_TRIES
    monkeypatch.undo()
    assert state.load(tmp_path / "state") == sample()
