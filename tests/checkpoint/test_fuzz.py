"""Fuzzing the parsers that see untrusted bytes: no exception escapes, only verdicts.

The manifest parser, the HF index parser, the safetensors header reading and the whole
gate on arbitrary bytes where a manifest or a shard should be.
"""

from __future__ import annotations

import contextlib
import json
import struct
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllm_reloader.checkpoint import files, gate
from vllm_reloader.checkpoint.conventions import Convention
from vllm_reloader.checkpoint.manifest import parse
from vllm_reloader.errors import LayoutUnreadable, ManifestInvalid, NotJSONYet

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NO_GRACE = gate.GateOptions(convention=Convention("manifest", manifest_grace=0))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
manifest_like = st.fixed_dictionaries(
    {"format_version": st.sampled_from([1, 2, "1", None])},
    optional={
        "version": json_values | st.text(max_size=30),
        "step": json_values,
        "files": st.lists(
            st.fixed_dictionaries(
                {},
                optional={"path": st.text(max_size=30), "size": json_values, "blake3": st.text(max_size=70)},
            ),
            max_size=4,
        ),
    },
)


@FUZZ
@given(st.binary(max_size=400) | manifest_like.map(lambda m: json.dumps(m).encode()))
def test_fuzz_manifest_parser_raises_only_its_own_errors(data: bytes):
    try:
        manifest = parse(data)
    except (NotJSONYet, ManifestInvalid):
        return
    assert manifest.format_version == 1 and manifest.files


@FUZZ
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps({"weight_map": v}).encode()))
def test_fuzz_hf_index_parser_answers_or_says_not_json(data: bytes):
    try:
        weights = files.weights_from_index(data)
    except NotJSONYet:
        return
    assert isinstance(weights, str) or all(isinstance(w, str) and w for w in weights)


def safetensors_like(header: bytes, body: bytes, claimed: int | None) -> bytes:
    return struct.pack("<Q", len(header) if claimed is None else claimed) + header + body


header_json = st.dictionaries(
    st.text(max_size=8),
    st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(["F32", "BF16", "F16", "I64", "X"]),
            "shape": json_values,
            "data_offsets": st.lists(st.integers(-5, 5000), max_size=3) | json_values,
        },
    )
    | json_values,
    max_size=3,
).map(lambda h: json.dumps(h).encode())


@FUZZ
@given(
    st.binary(max_size=200) | header_json,
    st.binary(max_size=600),
    st.none() | st.integers(0, 2**64 - 1),
)
# Found in CI: a negative end offset made a negative size, which crashed the marker path.
@example(header=b'{"":{"":"","":null,"data_offsets":[null,-550]}}', body=b"", claimed=None)
def test_fuzz_gate_on_arbitrary_shards_gives_only_verdicts(header: bytes, body: bytes, claimed: int | None):
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch) / "step-1"
        directory.mkdir()
        data = safetensors_like(header, body, claimed)
        (directory / "model.safetensors").write_bytes(data)
        (directory / "manifest.json").write_text(
            json.dumps({"format_version": 1, "files": [{"path": "model.safetensors", "size": len(data)}]})
        )
        verdict = gate.check(directory, serving=None, options=NO_GRACE)
        assert verdict.status in ("ready", "rejected")
        marker = gate.GateOptions(convention=Convention("marker"))
        (directory / "_SUCCESS").touch()
        assert gate.check(directory, serving=None, options=marker).status in ("ready", "pending", "rejected")
        with contextlib.suppress(LayoutUnreadable):
            files.size_from_header("x", lambda start, end: data[start:end], len(data))
