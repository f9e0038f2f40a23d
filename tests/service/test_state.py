"""The checkpoints' facts in the record store, and the previous release's JSON files imported
into it at the first start (kept, renamed): nothing it remembered is lost, and a file that
cannot be read stops the start instead of being taken for empty."""

import errno
import json
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from tests.support.records import fill_disk, open_records
from vllm_reloader import records as records_mod
from vllm_reloader.errors import StateError
from vllm_reloader.lock import LOCK_NAME
from vllm_reloader.service import migrate, state
from vllm_reloader.sources.verdicts import Verdict


def sample() -> state.State:
    loaded = state.Loaded(name="step-2", version="step-2", path="/r/step-2", since=1.0, step=2)
    rejected = {"step-3": state.Rejection(version="step-3", reason="bad", fingerprint="f", at=2.0)}
    return state.State(serving=loaded, good=(loaded,), rejected=rejected, pinned="step-2")


def test_state_round_trips_through_the_record_store(tmp_path):
    state.save(tmp_path, sample())
    assert state.load(tmp_path) == sample()
    made = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(("-wal", "-shm")))
    assert made == sorted([LOCK_NAME, records_mod.NAME])


def test_state_of_a_state_dir_with_no_store_is_empty_and_nothing_is_made(tmp_path):
    assert state.load(tmp_path) == state.State() and list(tmp_path.iterdir()) == []


def test_state_a_write_the_disk_failed_is_said_and_written_whole_at_the_next_change(tmp_path, monkeypatch):
    records = open_records(tmp_path)
    facts = state.StateRecords(records, structlog.get_logger())
    full = fill_disk(records, monkeypatch)
    with capture_logs() as logs:
        facts.save(sample())
    assert [e["event"] for e in logs] == ["state.write_failed"] and full.refused
    assert "disk is full" in logs[0]["reason"]
    monkeypatch.undo()
    assert state.StateRecords(records, structlog.get_logger()).saved == state.State(), "nothing half-written"
    facts.save(sample())  # the same facts again: written now (not taken as saved before)
    assert state.load(tmp_path) == sample()


def test_state_a_fact_another_release_wrote_is_dropped_and_said_the_rest_kept(tmp_path):
    state.save(tmp_path, sample())
    records = open_records(tmp_path)
    records.put("checkpoint", "good", [{"name": 3}])
    with capture_logs() as logs:
        found = state.StateRecords(records, structlog.get_logger()).saved
    assert found.rejected == sample().rejected and found.good == ()
    assert [e["event"] for e in logs] == ["state.corrupt"]


# -- the previous release's files ---------------------------------------------------------------


def previous_release(directory: Path) -> None:
    """What the release before wrote in `state.dir`."""
    directory.mkdir(parents=True, exist_ok=True)
    old = sample().model_dump(mode="json")
    old["last_good"] = old.pop("good")[0]  # the oldest layout: one last good
    (directory / "state.json").write_text(json.dumps(old))
    (directory / "adapters.json").write_text(json.dumps({"rejected": {"ab" * 16: "its canary failed: NaN"}}))
    verdict = {"name": "step-4", "version": "step-4", "fingerprint": "4" * 64, "passed": False,
               "reason": "canary: NaN", "canary": True}  # fmt: skip
    (directory / "unwritten-verdicts.json").write_text(json.dumps([verdict]))
    (directory / "instance-id").write_text("c" * 32)
    (directory / "adapter-fleet").mkdir()
    (directory / "adapter-fleet" / "unwritten-verdicts.json").write_text(
        json.dumps([{**verdict, "name": "support", "version": "v1", "passed": True, "reason": None}])
    )


def test_migrate_imports_everything_the_previous_release_kept_and_renames_its_files(tmp_path):
    previous_release(tmp_path)
    records = open_records(tmp_path)
    with capture_logs() as logs:
        migrate.migrate(records, tmp_path, structlog.get_logger())
    assert state.StateRecords(records, structlog.get_logger()).saved == sample()
    assert records.all("adapter_rejected") == {"ab" * 16: "its canary failed: NaN"}
    assert [Verdict(**v).name for _, v in records.outbox("checkpoints")] == ["step-4"]
    assert [(v["name"], v["passed"]) for _, v in records.outbox("adapters")] == [("support", True)]
    assert records.meta("instance:checkpoints") == "c" * 32
    [said] = [e for e in logs if e["event"] == "state.migrated"]
    assert said["imported"]["state.json"] == {"rejected": 1, "good": 1}
    assert sorted(p.name for p in tmp_path.rglob("*.migrated")) == [
        "adapters.json.migrated", "instance-id.migrated", "state.json.migrated",
        "unwritten-verdicts.json.migrated", "unwritten-verdicts.json.migrated",
    ]  # fmt: skip
    assert not list(tmp_path.rglob("*.json")), "each file kept, renamed"
    migrate.migrate(records, tmp_path, structlog.get_logger())  # the next start: nothing twice
    assert len(records.outbox("checkpoints")) == 1
    assert not [e for e in logs if e["event"] == "config.default_changed"], "the config set completeness"


def test_migrate_says_once_that_the_completeness_default_changed_when_the_config_leaves_it_unset(tmp_path):
    """The oldest release with state.json waited for a manifest by default; this one loads a
    Trainer's checkpoint once whole: an upgrade with the same config must not change that unsaid."""
    previous_release(tmp_path)
    records = open_records(tmp_path)
    with capture_logs() as logs:
        migrate.migrate(records, tmp_path, structlog.get_logger(), completeness_unset=True)
        migrate.migrate(records, tmp_path, structlog.get_logger(), completeness_unset=True)
    [said] = [e for e in logs if e["event"] == "config.default_changed"]
    assert said["log_level"] == "warning" and said["key"] == "[source] completeness"
    assert 'completeness = "manifest"' in said["fix"]


@pytest.mark.parametrize("name", ["state.json", "adapters.json", "unwritten-verdicts.json"])
@pytest.mark.parametrize(
    "error", [PermissionError(errno.EACCES, "Permission denied"), OSError(errno.EIO, "Input/output error")]
)
def test_migrate_a_file_that_cannot_be_read_stops_the_start_and_nothing_is_lost_or_imported(
    tmp_path, monkeypatch, name, error
):
    """Before: an `adapters.json` unreadable for a moment was taken for empty: a canary-rejected
    adapter loaded again, and the next save erased every rejection. Now no start without it."""
    previous_release(tmp_path)
    held = (tmp_path / name).read_bytes()
    real = Path.read_bytes

    def read_bytes(path: Path) -> bytes:
        if path == tmp_path / name:
            raise error
        return real(path)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    monkeypatch.setattr(records_mod, "OPEN_BACKOFF_S", 0.001)
    records = open_records(tmp_path)
    with capture_logs() as logs, pytest.raises(StateError, match=rf"cannot read .*{name}: {error.strerror}"):
        migrate.migrate(records, tmp_path, structlog.get_logger())
    assert [e["event"] for e in logs] == ["state.unreadable"] * records_mod.OPEN_TRIES
    assert records.meta(migrate.IMPORTED) is None and records.all("adapter_rejected") == {}
    assert real(tmp_path / name) == held and not list(tmp_path.rglob("*.migrated"))
    monkeypatch.undo()
    migrate.migrate(records, tmp_path, structlog.get_logger())  # the disk is back: all of it imported
    assert records.all("adapter_rejected") == {"ab" * 16: "its canary failed: NaN"}


def test_migrate_a_file_read_and_not_what_it_should_be_is_set_aside_said_and_the_rest_imported(tmp_path):
    previous_release(tmp_path)
    (tmp_path / "adapters.json").write_text('{"rejected": ["not", "a", "map"]}')
    records = open_records(tmp_path)
    with capture_logs() as logs:
        migrate.migrate(records, tmp_path, structlog.get_logger())
    [corrupt] = [e for e in logs if e["event"] == "state.corrupt"]
    assert Path(corrupt["moved_to"]).read_text() == '{"rejected": ["not", "a", "map"]}'
    assert state.StateRecords(records, structlog.get_logger()).saved == sample()


def test_daemon_whose_adapter_rejections_cannot_be_read_exits_1_and_never_loads_a_rejected_adapter(
    tmp_path, monkeypatch, capsys
):
    """Exit 1, not 2: the unit's `RestartPreventExitStatus=2` would keep it down for good, and a
    disk that failed a read may answer at the next start."""
    from vllm_reloader import cli
    from vllm_reloader.service.daemon import Daemon

    (tmp_path / "root").mkdir()
    previous_release(tmp_path / "state")
    path = tmp_path / "x.toml"
    path.write_text(
        f'[source]\npath = "{tmp_path / "root"}"\n[engine]\nurl = "http://engine.test"\n'
        f'[state]\ndir = "{tmp_path / "state"}"\n[log]\nformat = "json"\n'
    )
    real = Path.read_bytes

    def read_bytes(found: Path) -> bytes:
        if found.name == "adapters.json":
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(found)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    monkeypatch.setattr(records_mod, "OPEN_BACKOFF_S", 0.001)
    monkeypatch.setattr(Daemon, "run", lambda _self: 99)  # started after all: say so, do not hang
    assert cli.main(["run", "--config", str(path)]) == 1
    out, err = capsys.readouterr()
    assert err.startswith(
        f"vllm-reloader: cannot read {tmp_path / 'state' / 'adapters.json'}: Permission denied"
    )
    assert err.count("\n") == 1 and "Traceback" not in err
    assert [json.loads(line)["event"] for line in out.splitlines()] == [
        "state.unreadable"
    ] * records_mod.OPEN_TRIES


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
    (tmp_path / "state" / "state.json").write_text(json.dumps(old))
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
    (tmp_path / "state" / "state.json").write_text(json.dumps({"serving": old, "good": [old]}))
    shutil.rmtree(x)
    make_checkpoint("latest", step=5, root=root, seed=2)  # Y, in its place
    startup = make_checkpoint("startup", root=tmp_path / "models")
    engine = FakeEngine(startup=str(startup))
    engine.version, engine.loaded = "latest", str(x)
    running = start(engine)
    running.wait_for("reload.succeeded", version="latest")
    assert engine.loaded == str(root / "latest")


def test_migrate_imports_again_what_a_release_gone_back_to_wrote_since(tmp_path):
    """Upgrade, go back a release (it writes its JSON files again), forward again: what it wrote
    is the newer, and imported; before, it was renamed away unread."""
    previous_release(tmp_path)
    records = open_records(tmp_path)
    migrate.migrate(records, tmp_path, structlog.get_logger())
    newer = sample().model_copy(update={"pinned": None})
    (tmp_path / "state.json").write_text(newer.model_dump_json())  # the release gone back to
    migrate.migrate(records, tmp_path, structlog.get_logger())
    assert state.StateRecords(records, structlog.get_logger()).saved == newer
    assert not (tmp_path / "state.json").exists()
