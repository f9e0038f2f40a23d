"""The non-finite scan: a diverged run writes NaN or Inf weights into whole, well-shaped files.

Such a checkpoint passes every structural check, and loading it does more harm than
serving garbage for a moment: vLLM's KV cache keeps the NaN keys and values the first
requests wrote, and the first requests after a rollback that reuse those blocks read NaN
through masked attention (0 * NaN is NaN). So NaN never reaches the engine.

A float is NaN or Inf exactly when its exponent bits are all ones: with the sign bit
cleared, its bits as an unsigned word are then at least the exponent mask. So each chunk is
read as little-endian words (no float conversion, no copy), masked into a reused buffer and
reduced to its maximum: two passes at memory speed, and numpy lets go of the GIL for both,
so the scanning threads run beside the hashing ones.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class _Bits:
    word: np.dtype[np.unsignedinteger]
    magnitude: int
    """Every bit but the sign."""
    limit: int
    """The smallest magnitude that is NaN or Inf (the exponent's bits all set)."""


DTYPES = {
    "BF16": _Bits(np.dtype("<u2"), 0x7FFF, 0x7F80),
    "F16": _Bits(np.dtype("<u2"), 0x7FFF, 0x7C00),
    "F32": _Bits(np.dtype("<u4"), 0x7FFF_FFFF, 0x7F80_0000),
    "F64": _Bits(np.dtype("<u8"), 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
    "F8_E5M2": _Bits(np.dtype("u1"), 0x7F, 0x7C),
    "F8_E4M3": _Bits(np.dtype("u1"), 0x7F, 0x7F),  # the "fn" variant: no Inf, NaN is S.1111.111
}

_scratch = threading.local()


def _masked(count: int, word: np.dtype[np.unsignedinteger]) -> np.ndarray:
    """A reused buffer per scanning thread (a chunk's worth), viewed as `count` words."""
    nbytes = count * word.itemsize
    found: np.ndarray | None = getattr(_scratch, "buffer", None)
    if found is None or found.nbytes < nbytes:
        found = _scratch.buffer = np.empty(nbytes, np.uint8)
    return found[:nbytes].view(word)


def element_bytes(dtype: str) -> int:
    """Bytes per element of a float dtype the scan knows; 0 for the others."""
    bits = DTYPES.get(dtype)
    return bits.word.itemsize if bits else 0


def holds_non_finite(data: bytearray, start: int, end: int, dtype: str) -> bool:
    """Whether the whole elements in `data[start:end]` of a tensor of `dtype` hold a NaN or
    Inf (False for dtypes that cannot: integers, booleans)."""
    bits = DTYPES.get(dtype)
    if bits is None or (count := (end - start) // bits.word.itemsize) == 0:
        return False
    words = np.frombuffer(data, dtype=bits.word, count=count, offset=start)
    masked = _masked(count, bits.word)
    np.bitwise_and(words, bits.word.type(bits.magnitude), out=masked)
    return bool(masked.max() >= bits.limit)
