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
