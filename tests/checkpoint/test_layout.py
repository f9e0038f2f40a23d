import numpy as np
import pytest

from tests.support.checkpoints import MakeCheckpoint, write_weights
from vllm_reloader.checkpoint import gate, layout
from vllm_reloader.checkpoint.layout import Layout, first_difference, loadable_into


@pytest.mark.parametrize("ours", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("theirs", ["F32", "F16", "BF16"])
def test_float_checkpoints_load_into_a_model_served_in_any_float_dtype(ours, theirs):
    assert loadable_into((ours, (4, 2)), (theirs, (4, 2)))


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ("F8_E4M3", "BF16"),  # an FP8 checkpoint into a bf16 model: different kernels, scales
        ("BF16", "F8_E4M3"),
        ("F8_E5M2", "F8_E4M3"),
        ("I8", "F32"),  # int8 weights, packed formats, their integer scales
        ("F32", "I32"),
        ("U8", "I8"),
        ("F64", "F32"),  # not a dtype vLLM's float loaders are written for
    ],
)
def test_quantized_integer_and_other_dtypes_must_match_exactly(ours, theirs):
    assert not loadable_into((ours, (4, 2)), (theirs, (4, 2)))
    assert loadable_into((ours, (4, 2)), (ours, (4, 2)))


def test_a_convertible_dtype_never_excuses_a_shape_difference():
    assert not loadable_into(("F32", (4, 2)), ("BF16", (2, 4)))
    found = first_difference(Layout({"w": ("F32", (4, 2))}, {}), Layout({"w": ("BF16", (2, 4))}, {}))
    assert found == ("tensor w is F32[4, 2], serving has BF16[2, 4]", "w")


def test_first_difference_names_a_quantized_dtype_mismatch():
    found = first_difference(
        Layout({"a": ("F32", (2,)), "w": ("I8", (4,))}, {}),
        Layout({"a": ("BF16", (2,)), "w": ("F8_E4M3", (4,))}, {}),
    )
    assert found == ("tensor w is I8[4], serving has F8_E4M3[4]", "w")


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_gate_judges_a_checkpoint_of_another_dtype_by_what_the_engine_converts(
    make_checkpoint: MakeCheckpoint, tmp_path, dtype
):
    served = layout.read_served_layout(write_weights(tmp_path / "served")[0].parent)  # float32
    verdict = gate.check(make_checkpoint("step-1", dtype=dtype), serving=served)
    if dtype is np.float16:
        assert verdict.status == "ready", verdict.reason
    else:
        assert verdict.status == "rejected" and verdict.details["check"] == "layout"
        assert "is F64[" in verdict.reason and "serving has F32[" in verdict.reason
