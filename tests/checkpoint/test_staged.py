"""What a rank of a multi-node engine reads before it loads: its node's marker of a copy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vllm_reloader.checkpoint.files import identity
from vllm_reloader.checkpoint.staged import read_staged, staged_marker, staged_problem
from vllm_reloader.sources.content import mark_staged

FP = "ab" * 32


def marker_of(**fields: object) -> bytes:
    return json.dumps({"format": 1, "node": "n", "fingerprint": FP, "files": {}, **fields}).encode()


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    directory = tmp_path / "checkpoints" / "step-1@abababababababab"
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"x" * 64)
    (directory / "config.json").write_text("{}")
    return directory


def files_of(directory: Path) -> dict[str, tuple[int, int, int, int, int]]:
    return {p.name: identity(os.lstat(p)) for p in directory.iterdir()}


def test_staged_copy_marked_and_unchanged_holds_its_content(copy: Path):
    mark_staged(copy, "node-1", FP, files_of(copy))
    staged, problem = staged_problem(copy, FP)
    assert problem is None and staged is not None and staged.node == "node-1"
    assert staged_marker(copy).parent.name.startswith(".")  # never a candidate of the root


def test_staged_problem_names_a_missing_copy_and_an_unmarked_one(copy: Path, tmp_path: Path):
    _, missing = staged_problem(tmp_path / "checkpoints" / "step-2@cdcdcdcdcdcdcdcd", FP)
    assert missing is not None and missing.startswith("no copy at")
    _, unmarked = staged_problem(copy, FP)
    assert unmarked is not None and "no daemon marked as verified" in unmarked


def test_staged_problem_names_another_content_at_the_path(copy: Path):
    mark_staged(copy, "node-1", "cd" * 32, files_of(copy))
    _, problem = staged_problem(copy, FP)
    assert problem is not None and "cdcdcdcdcdcdcdcd, not abababababababab" in problem


def test_staged_problem_names_a_file_changed_since_it_was_verified(copy: Path):
    mark_staged(copy, "node-1", FP, files_of(copy))
    with (copy / "model.safetensors").open("r+b") as f:
        f.write(b"y")
    _, problem = staged_problem(copy, FP)
    assert problem is not None and "changed since node-1 verified it: model.safetensors changed" in problem


@pytest.mark.parametrize(
    "marker",
    [
        b"{not json",
        b"[" * 100_000 + b"]" * 100_000,
        json.dumps({"format": 2, "node": "n", "fingerprint": FP, "files": {}}).encode(),
        json.dumps(
            {"format": 1, "node": "n", "fingerprint": FP, "files": {"../x": [1, 2, 3, 4, 5]}}
        ).encode(),
        json.dumps({"format": 1, "node": "n", "fingerprint": FP, "files": {"a": [1, 2, "3", 4, 5]}}).encode(),
        json.dumps({"format": 1, "node": 7, "fingerprint": FP, "files": {}}).encode(),
    ],
)
def test_a_marker_that_is_not_one_is_a_problem_never_an_exception(copy: Path, marker: bytes):
    staged_marker(copy).parent.mkdir()
    staged_marker(copy).write_bytes(marker)
    with pytest.raises(ValueError):
        read_staged(copy)
    staged, problem = staged_problem(copy, FP)
    assert staged is None and problem is not None and "cannot be read" in problem


def test_a_marker_that_lists_no_files_vouches_for_nothing(copy: Path):
    mark_staged(copy, "node-1", FP, {})
    _, problem = staged_problem(copy, FP)
    assert problem is not None and "lists no files" in problem


def test_a_marker_naming_a_file_through_a_file_is_a_problem_never_an_exception(copy: Path):
    mark_staged(copy, "node-1", FP, {"model.safetensors/x": (1, 2, 3, 4, 5)})
    _, problem = staged_problem(copy, FP)
    assert problem is not None and "cannot be looked at" in problem
