"""Delta encodings: each changed tensor's smaller encoding, applied back exactly; entries
that do not fit their tensor are refused, never written past it."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_reloader.checkpoint.delta import DeltaUnusable, apply, encode


def words(values: list[int]) -> bytes:
    return np.array(values, dtype="<u2").tobytes()


def test_delta_of_equal_tensors_is_nothing():
    assert encode(words([1, 2, 3]), words([1, 2, 3]), "BF16") is None


def test_delta_few_changed_elements_are_sparse_and_apply_back_exactly():
    old = np.arange(4096, dtype="<u2")
    new = old.copy()
    new[[3, 700, 4095]] = [9, 9, 9]
    encoded = encode(old.tobytes(), new.tobytes(), "BF16")
    assert encoded is not None and encoded.encoding == "sparse"
    assert encoded.nbytes == 3 * (1 + 2) + 2 * 4, "a gap byte per change, 4 more for a gap over 255"
    into = bytearray(old.tobytes())
    apply(into, "BF16", "sparse", lambda suffix: encoded.entries[suffix][1])
    assert bytes(into) == new.tobytes()


def test_delta_mostly_changed_tensor_is_whole():
    old, new = np.zeros(64, dtype="<f4"), np.arange(64, dtype="<f4")
    encoded = encode(old.tobytes(), new.tobytes(), "F32")
    assert encoded is not None and encoded.encoding == "whole" and encoded.nbytes == 256
    into = bytearray(old.tobytes())
    apply(into, "F32", "whole", lambda suffix: encoded.entries[suffix][1])
    assert bytes(into) == new.tobytes()


@pytest.mark.parametrize(
    ("gaps", "far", "values", "said"),
    [
        ([1, 9], [], [5, 5], "outside the tensor"),
        ([1, 0], [], [5, 5], "long gaps do not match"),
        ([1, 0], [3], [5, 5], "long gaps do not match"),  # a long gap that is short
        ([1, 2], [300], [5, 5], "long gaps do not match"),
        ([1], [], [5, 5], "1 positions for 2 values"),
    ],
)
def test_delta_entries_that_do_not_fit_the_tensor_are_refused(gaps, far, values, said):
    into = bytearray(words([0] * 8))
    entries = {
        ".gaps": bytes(gaps),
        ".far": np.array(far, "<u4").tobytes(),
        ".values": words(values),
    }
    with pytest.raises(DeltaUnusable, match=said):
        apply(into, "BF16", "sparse", entries.__getitem__)
    assert bytes(into) == words([0] * 8), "nothing written"


def test_delta_gaps_past_a_byte_come_back_exactly():
    old = np.zeros(100_000, dtype="<u2")
    new = old.copy()
    new[[0, 1, 255, 256, 70_000, 99_999]] = 7
    encoded = encode(old.tobytes(), new.tobytes(), "F16")
    assert encoded is not None and encoded.encoding == "sparse"
    into = bytearray(old.tobytes())
    apply(into, "F16", "sparse", lambda suffix: encoded.entries[suffix][1])
    assert bytes(into) == new.tobytes()


def test_delta_whole_entry_of_another_size_is_refused():
    with pytest.raises(DeltaUnusable, match="3 bytes for a tensor of 4"):
        apply(bytearray(4), "U8", "whole", lambda _: b"abc")
