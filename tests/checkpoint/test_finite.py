"""The NaN/Inf scan, on real safetensors files of every float dtype it knows."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.support.checkpoints import MakeCheckpoint, write_manifest
from vllm_reloader.checkpoint import finite, gate, scan


def bf16(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (numpy has no bf16): the top half of each float32."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def as_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return bf16(values)
    with np.errstate(over="ignore"):  # F16 of a large normal sample: Inf where it overflows
        return values.astype({"F32": np.float32, "F16": np.float16, "F64": np.float64}[dtype])


def write_raw(path, dtype: str, raw: np.ndarray) -> None:
    """A safetensors file whose single tensor has `dtype` and these bytes."""
    import json
    import struct

    data = raw.tobytes()
    header = json.dumps({"t": {"dtype": dtype, "shape": [raw.size], "data_offsets": [0, len(data)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", ["F32", "F16", "F64", "BF16"])
def test_finite_scan_finds_one_non_finite_value_anywhere(tmp_path, dtype, bad):
    values = np.random.default_rng(0).standard_normal(100_000) * 100
    values[77_777] = bad
    write_raw(tmp_path / "x.safetensors", dtype, as_dtype(values, dtype))
    assert scan.first_non_finite(tmp_path / "x.safetensors") == "t"


@pytest.mark.parametrize("dtype", ["F32", "F16", "F64", "BF16"])
def test_finite_scan_passes_large_but_finite_values(tmp_path, dtype):
    big = {"F32": 3.0e38, "F16": 65000.0, "F64": 1.0e308, "BF16": 3.0e38}[dtype]
    values = np.array([big, -big, 0.0, -0.0, 1e-30, 1.0] * 1000)
    write_raw(tmp_path / "x.safetensors", dtype, as_dtype(values, dtype))
    assert scan.first_non_finite(tmp_path / "x.safetensors") is None


def test_finite_scan_ignores_integer_tensors(tmp_path):
    save_file({"ids": np.full(1000, -1, dtype=np.int32)}, str(tmp_path / "x.safetensors"))
    assert scan.first_non_finite(tmp_path / "x.safetensors") is None


def test_finite_scan_crosses_chunk_boundaries(tmp_path):
    values = np.zeros(10_000, np.float32)
    values[-1] = np.nan
    save_file({"w": values, "a": np.zeros(3, np.float16)}, str(tmp_path / "x.safetensors"))
    # 4094 is no multiple of 4: reads must still be cut at element boundaries
    assert scan.first_non_finite(tmp_path / "x.safetensors", chunk=4094) == "w"


def test_gate_rejects_a_checkpoint_with_nan_weights(make_checkpoint: MakeCheckpoint, tmp_path):
    directory = make_checkpoint("step-2", step=2)
    path = directory / "model.safetensors"
    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    tensors["lm_head.weight"][3, 4] = np.nan
    save_file(tensors, str(path))
    write_manifest(directory, step=2)
    verdict = gate.check(directory, serving=None)
    assert verdict.status == "rejected" and verdict.details["check"] == "finite"
    assert "lm_head.weight" in verdict.reason
    assert gate.check(directory, serving=None, options=gate.GateOptions(check_finite=False)).status == "ready"


def _streamed(path, pieces: int, seed: int) -> scan.StreamScan:
    """The file fed to a StreamScan in `pieces` pieces cut at random offsets (odd ones too)."""
    data = path.read_bytes()
    cuts = sorted(np.random.default_rng(seed).choice(np.arange(1, len(data)), pieces - 1, replace=False))
    streamed = scan.StreamScan(path.name)
    for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
        streamed.update(memoryview(data)[start:end])
    return streamed


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stream_scan_in_pieces_finds_what_the_file_scan_finds(tmp_path, dtype, seed):
    """A download's parts split elements and the header anywhere: same answer as one read."""
    values = np.random.default_rng(seed).standard_normal(12_001)
    write_raw(tmp_path / "clean.safetensors", dtype, as_dtype(values, dtype))
    values[11_999] = np.nan
    write_raw(tmp_path / "bad.safetensors", dtype, as_dtype(values, dtype))
    for name, expected in (("clean", None), ("bad", "t")):
        assert scan.first_non_finite(tmp_path / f"{name}.safetensors") == expected
        streamed = _streamed(tmp_path / f"{name}.safetensors", pieces=40, seed=seed)
        assert streamed.scanned and streamed.found == expected, name


def test_stream_scan_names_the_first_bad_tensor_among_several(tmp_path):
    tensors = {f"t{i}": np.ones(1_001, np.float32) for i in range(4)} | {"ids": np.arange(7, dtype=np.int16)}
    tensors["t2"][1_000] = np.inf
    save_file(tensors, str(tmp_path / "x.safetensors"))
    assert _streamed(tmp_path / "x.safetensors", pieces=25, seed=3).found == "t2"


def test_stream_scan_of_what_is_no_safetensors_file_scans_nothing(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\xff" * 8 + b"not json")
    streamed = _streamed(path, pieces=3, seed=0)
    assert not streamed.scanned and streamed.found is None


def non_finite_by_bits(words: list[int], dtype: str) -> bool:
    """The definition, word by word: exponent bits all ones (E4M3fn: only S.1111.111, its NaN)."""
    exponent = {"BF16": 0x7F80, "F16": 0x7C00, "F32": 0x7F80_0000, "F64": 0x7FF0_0000_0000_0000}
    if dtype == "F8_E4M3":
        return any(w & 0x7F == 0x7F for w in words)
    mask = exponent.get(dtype, 0x7C)  # F8_E5M2: S.11111.xx
    return any(w & mask == mask for w in words)


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32", "F64", "F8_E5M2", "F8_E4M3"])
def test_finite_scan_agrees_with_the_bit_definition_on_every_kind_of_word(dtype):
    from vllm_reloader.checkpoint import finite

    size = finite.element_bytes(dtype)
    rng = np.random.default_rng(size)
    word = np.dtype(f"<u{size}")
    for trial in range(400):
        count = int(rng.integers(1, 24))
        raw = rng.integers(0, np.iinfo(word).max, size=count, dtype=word, endpoint=True)
        if trial % 2:  # mostly finite words, a few of them random: NaN and Inf are rare
            raw &= word.type(~(1 << (8 * size - 2)) & np.iinfo(word).max)
            raw[rng.random(count) < 0.05] = rng.integers(0, np.iinfo(word).max, dtype=word, endpoint=True)
        offset = int(rng.integers(0, 3)) * size  # a tensor that starts past the buffer's start
        data = bytearray(offset) + bytearray(raw.tobytes()) + bytearray(size - 1)  # a partial element after
        expected = non_finite_by_bits([int(w) for w in raw], dtype)
        assert finite.holds_non_finite(data, offset, len(data), dtype) == expected, (raw, dtype)


@pytest.mark.parametrize("dtype", sorted(finite.DTYPES))
def test_finite_scan_finds_a_non_finite_word_on_either_side_of_every_piece_boundary(dtype):
    bits = finite.DTYPES[dtype]
    size = bits.word.itemsize
    count = 3 * finite.PIECE // size + 5  # three whole pieces and part of a fourth
    data = bytearray(count * size)
    assert not finite.holds_non_finite(data, 0, len(data), dtype)
    nan = int(bits.limit).to_bytes(size, "little")
    for index in (0, finite.PIECE // size - 1, finite.PIECE // size, 2 * finite.PIECE // size, count - 1):
        marked = bytearray(data)
        marked[index * size : (index + 1) * size] = nan
        assert finite.holds_non_finite(marked, 0, len(marked), dtype), (dtype, index)
        assert not finite.holds_non_finite(marked, (index + 1) * size, len(marked), dtype)  # after it
        assert not finite.holds_non_finite(marked, 0, index * size, dtype)  # before it
