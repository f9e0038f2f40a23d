"""The gate's bounds on headers: a checkpoint whose shards' headers declare more bytes in all
than `[gate] max_header_bytes` is rejected from their 8-byte prefixes, no header read or
parsed; one listing more tensors than `[gate] max_tensors` is rejected while its headers are
parsed, the parse cut short. Legal safetensors both (zero-size tensors, header-only shards),
as a hostile or broken writer makes them."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from tests.support.checkpoints import TENSORS, MakeCheckpoint, write_manifest
from vllm_reloader import config
from vllm_reloader.checkpoint import files, gate
from vllm_reloader.checkpoint.conventions import Convention


def header_only_shard(path: Path, tensors: int, *, first: int = 0) -> int:
    """A legal safetensors file of `tensors` zero-size tensors (its data ends where the file
    does); the length of its header."""
    header = {
        f"model.layers.{i}.mlp.experts.0.down_proj.weight": {
            "dtype": "BF16",
            "shape": [0, 8],
            "data_offsets": [0, 0],
        }
        for i in range(first, first + tensors)
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return len(raw)


def header_only_checkpoint(directory: Path, shards: int, tensors: int, *, manifest: bool = True) -> int:
    """`shards` header-only shards of `tensors` tensors each; the headers' bytes in all."""
    total = 0
    for i in range(shards):
        path = directory / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        total += header_only_shard(path, tensors, first=i * tensors)
    if manifest:
        write_manifest(directory)
    return total


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The headers parsed (by file name), through the one parser every reader uses."""
    calls: list[str] = []
    real = files.parse_header

    def spy(file_name: str, *args: object, **kwargs: object) -> list[files.Tensor]:
        calls.append(file_name)
        return real(file_name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(files, "parse_header", spy)
    return calls


@pytest.fixture
def read_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many bytes each `os.pread` asked for."""
    sizes: list[int] = []
    real = os.pread

    def spy(fd: int, n: int, offset: int) -> bytes:
        sizes.append(n)
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", spy)
    return sizes


def test_gate_rejects_headers_over_max_header_bytes_from_their_prefixes_alone(
    tmp_path: Path, parsed: list[str], read_sizes: list[int]
):
    directory = tmp_path / "step-1"
    total = header_only_checkpoint(directory, shards=3, tensors=400)
    options = gate.GateOptions(max_header_bytes=total - 1)
    verdict = gate.check(directory, serving=None, options=options)
    assert verdict.status == "rejected" and verdict.details["check"] == "headers"
    assert verdict.reason == (
        f"the safetensors headers of 3 shards declare {total} bytes in all, more than "
        f"[gate] max_header_bytes = {total - 1}: none was read"
    )
    assert verdict.fingerprint and "\n" not in verdict.reason
    assert parsed == [], "no header parsed"
    assert read_sizes and max(read_sizes) == 8, "only the 8-byte prefixes read"


def test_gate_rejects_more_tensors_than_max_tensors_counted_before_any_header_is_parsed(
    tmp_path: Path, parsed: list[str]
):
    directory = tmp_path / "step-1"
    header_only_checkpoint(directory, shards=3, tensors=40)
    verdict = gate.check(directory, serving=None, options=gate.GateOptions(max_tensors=100))
    assert verdict.status == "rejected" and verdict.details["check"] == "headers"
    assert verdict.reason == (
        "the shards' headers list more than [gate] max_tensors = 100 tensors in all: none was parsed"
    )
    assert verdict.fingerprint and parsed == []


def test_gate_counts_tensors_while_parsing_too_and_stops_the_parse_at_the_cap(
    tmp_path: Path, parsed: list[str], monkeypatch: pytest.MonkeyPatch
):
    """Keys written with JSON escapes are not counted before parsing: the parse counts them."""
    directory = tmp_path / "step-1"
    header_only_checkpoint(directory, shards=3, tensors=40, manifest=False)
    for path in directory.glob("*.safetensors"):
        raw = path.read_bytes()[8:].replace(b'"data_offsets"', b'"data\\u005foffsets"')
        path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    write_manifest(directory)
    made: list[str] = []
    real = files._tensor
    monkeypatch.setattr(files, "_tensor", lambda name, *a: made.append(name) or real(name, *a))
    verdict = gate.check(directory, serving=None, options=gate.GateOptions(max_tensors=100))
    assert verdict.status == "rejected" and verdict.details["check"] == "headers"
    assert verdict.reason == (
        "model-00003-of-00003.safetensors: the shards' headers list more than "
        "[gate] max_tensors = 100 tensors in all"
    )
    assert len(parsed) == 3, "the third header is parsed only up to the cap"
    assert len(made) == 80, "no tensor of the third header is made: its parse stopped at the cap"
    assert gate.check(directory, serving=None, options=gate.GateOptions(max_tensors=120)).status == "ready"


def test_gate_bounds_are_inclusive_and_a_checkpoint_within_them_is_ready(make_checkpoint: MakeCheckpoint):
    directory = make_checkpoint("step-1", shards=3)
    header_bytes = sum(struct.unpack("<Q", p.read_bytes()[:8])[0] for p in directory.glob("*.safetensors"))
    exact = gate.GateOptions(max_tensors=len(TENSORS), max_header_bytes=header_bytes)
    assert gate.check(directory, serving=None, options=exact).status == "ready"
    fewer = gate.GateOptions(max_tensors=len(TENSORS) - 1)
    assert "[gate] max_tensors = 2" in gate.check(directory, serving=None, options=fewer).reason
    smaller = gate.GateOptions(max_header_bytes=header_bytes - 1)
    assert "[gate] max_header_bytes" in gate.check(directory, serving=None, options=smaller).reason


@pytest.mark.parametrize("mode", ["marker", "hf-index"])
def test_gate_bounds_hold_for_a_foreign_writer_before_its_sizes_are_read_from_headers(
    tmp_path: Path, parsed: list[str], mode: str
):
    """Without our manifest, the shards' sizes come from their headers: the bounds come first."""
    directory = tmp_path / "run"
    total = header_only_checkpoint(directory, shards=2, tensors=50, manifest=False)
    if mode == "marker":
        (directory / "COMPLETE").write_text("")
    else:
        names = sorted(p.name for p in directory.glob("*.safetensors"))
        weight_map = {f"t{i}": name for i, name in enumerate(names)}
        (directory / files.INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    convention = Convention(mode=mode)  # type: ignore[arg-type]
    verdict = gate.check(
        directory, serving=None, options=gate.GateOptions(convention=convention, max_header_bytes=total // 2)
    )
    assert verdict.status == "rejected" and verdict.details["check"] == "headers", verdict.reason
    assert "[gate] max_header_bytes" in verdict.reason and verdict.fingerprint
    assert parsed == []
    verdict = gate.check(
        directory, serving=None, options=gate.GateOptions(convention=convention, max_tensors=60)
    )
    assert verdict.status == "rejected" and verdict.details["check"] == "headers"
    assert verdict.reason.endswith("[gate] max_tensors = 60 tensors in all: none was parsed")
    assert parsed == []
    assert (
        gate.check(directory, serving=None, options=gate.GateOptions(convention=convention)).status == "ready"
    )


def test_gate_bounds_come_from_the_config_with_defaults_sized_for_the_largest_real_checkpoints():
    cfg = config.Config(
        source=config.SourceConfig(path="/srv/checkpoints"),
        engine=config.EngineConfig(url="http://127.0.0.1:8000"),
        state=config.StateConfig(dir=Path("/var/lib/vllm-reloader")),
    )
    options = gate.GateOptions.from_config(cfg)
    assert (options.max_header_bytes, options.max_tensors) == (256 << 20, 1_000_000)
    assert (options.max_header_bytes, options.max_tensors) == (
        gate.GateOptions().max_header_bytes,
        gate.GateOptions().max_tensors,
    )
    small = cfg.model_copy(update={"gate": config.GateConfig(max_header_bytes=4096, max_tensors=10)})
    assert (
        gate.GateOptions.from_config(small).max_header_bytes,
        gate.GateOptions.from_config(small).max_tensors,
    ) == (4096, 10)
