import json
import os

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
    (tmp_path / "state").mkdir()
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
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / state.STATE_NAME).write_text(json.dumps({"serving": old, "good": [old]}))
    shutil.rmtree(x)
    make_checkpoint("latest", step=5, root=root, seed=2)  # Y, in its place
    startup = make_checkpoint("startup", root=tmp_path / "models")
    engine = FakeEngine(startup=str(startup))
    engine.version, engine.loaded = "latest", str(x)
    running = start(engine)
    running.wait_for("reload.succeeded", version="latest")
    assert engine.loaded == str(root / "latest")
