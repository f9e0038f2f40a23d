"""The one way to open a writer's file, and what a safetensors header must promise."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from vllm_reloader.checkpoint import files
from vllm_reloader.errors import LayoutUnreadable, NotJSONYet


def test_open_refuses_a_symlink_even_to_a_regular_file(tmp_path: Path):
    (tmp_path / "real").write_bytes(b"{}")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError):
        files.read_small(tmp_path / "link")


def test_open_of_a_fifo_neither_blocks_nor_reads(tmp_path: Path):
    fifo = tmp_path / "manifest.json"
    os.mkfifo(fifo)
    failed: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(failed, lambda: files.read_small(fifo)), daemon=True)
    thread.start()
    thread.join(timeout=5)
    assert not thread.is_alive(), "opening a FIFO with no writer blocked"
    assert failed and "not a regular file" in str(failed[0])


def _capture(into: list[BaseException], work) -> None:  # type: ignore[no-untyped-def]
    try:
        work()
    except BaseException as exc:
        into.append(exc)


def test_read_small_refuses_a_device_and_a_file_over_its_bound(tmp_path: Path):
    with pytest.raises(OSError, match="not a regular file"):
        files.read_small(Path("/dev/zero"))
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 101)
    with pytest.raises(OSError, match="larger than 100 bytes"):
        files.read_small(big, limit=100)
    assert files.read_small(big, limit=101) == b" " * 101


def test_json_nested_past_the_parser_is_just_invalid_json():
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(ValueError, match="nested too deeply"):
        files.parse_json(deep)
    with pytest.raises(NotJSONYet):
        files.weights_from_index(b'{"weight_map": ' + deep + b"}")
    header = b'{"a": ' + deep + b"}"
    with pytest.raises(LayoutUnreadable):
        files.parse_header("x.safetensors", header, 8 + len(header))


def _header(path: Path) -> files.Header:
    fd = files.open_regular(path)
    try:
        return files.header_in(fd, path.name)
    finally:
        os.close(fd)


def test_layout_problem_accepts_what_safetensors_writes(tmp_path: Path):
    save_file(
        {"a": np.ones((2, 3), np.float32), "b": np.arange(3, dtype=np.int8)}, str(tmp_path / "x.safetensors")
    )
    path = tmp_path / "x.safetensors"
    assert files.layout_problem(path.name, _header(path), path.stat().st_size) is None


@pytest.mark.parametrize(
    ("header", "body", "problem"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "ends at byte"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, "ends at byte"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "has 8 bytes for F32[3]"),
        ({"a": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype"),
        (
            {
                "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
            },
            b"\0" * 6,
            "does not start where the one before ends",
        ),
        ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}, b"\0" * 8, "does not start where"),
    ],
)
def test_layout_problem_names_what_safetensors_would_refuse(tmp_path: Path, header, body, problem):
    path = tmp_path / "x.safetensors"
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    found = files.layout_problem(path.name, _header(path), path.stat().st_size)
    assert found is not None and problem in found and found.startswith("x.safetensors: ")


def test_changed_notices_a_rewrite_of_the_same_size_a_truncation_and_a_replacement(tmp_path: Path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"x" * 100)
    verified = {"a.bin": files.identity(path.lstat())}
    assert files.changed(tmp_path, verified) is None
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))  # mtime kept, ctime moves
    assert files.changed(tmp_path, verified) is not None
    verified = {"a.bin": files.identity(path.lstat())}
    os.truncate(path, 50)
    assert "changed" in (files.changed(tmp_path, verified) or "")
    path.unlink()
    assert files.changed(tmp_path, verified) == "a.bin is gone"


def test_usable_cpus_are_the_cores_this_process_may_run_on_not_the_machines(monkeypatch):
    """Under systemd's CPUAffinity or vLLM's OMP binding, threads past those cores only wait."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5})
    assert files.usable_cpus() == 2
