"""The non-finite scan: a diverged run writes NaN or Inf weights into whole, well-shaped files.

Such a checkpoint passes every structural check, and loading it does more harm than
serving garbage for a moment: vLLM's KV cache keeps the NaN keys and values the first
requests wrote, and the first requests after a rollback that reuse those blocks read NaN
through masked attention (0 * NaN is NaN). So NaN never reaches the engine.

A float is NaN or Inf exactly when its exponent bits are all ones: with the sign bit
cleared, its bits as an unsigned word are then at least the exponent mask. So each chunk is
read as little-endian words (no float conversion, no copy), masked into a reused buffer and
reduced to its maximum, a piece of `PIECE` bytes at a time: both passes then run in the
core's cache instead of memory (0.54 against 0.91 ms per 8 MB here), and numpy lets go of
the GIL for both, so the scanning threads run beside the hashing ones.
"""

from __future__ import annotations

import mmap
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

PIECE = 256 << 10
"""Bytes masked and reduced at a time: small enough to stay in a core's L2 cache."""
_scratch = threading.local()


def _masked(word: np.dtype[np.unsignedinteger]) -> np.ndarray:
    """A reused buffer per scanning thread (a piece's worth), viewed as words."""
    found: np.ndarray | None = getattr(_scratch, "buffer", None)
    if found is None:
        found = _scratch.buffer = np.empty(PIECE, np.uint8)
    return found.view(word)


def element_bytes(dtype: str) -> int:
    """Bytes per element of a float dtype the scan knows; 0 for the others."""
    bits = DTYPES.get(dtype)
    return bits.word.itemsize if bits else 0


def holds_non_finite(data: bytearray | mmap.mmap, start: int, end: int, dtype: str) -> bool:
    """Whether the whole elements in `data[start:end]` of a tensor of `dtype` hold a NaN or
    Inf (False for dtypes that cannot: integers, booleans)."""
    bits = DTYPES.get(dtype)
    if bits is None or (count := (end - start) // bits.word.itemsize) == 0:
        return False
    words = np.frombuffer(data, dtype=bits.word, count=count, offset=start)
    masked, magnitude = _masked(bits.word), bits.word.type(bits.magnitude)
    step = len(masked)
    for at in range(0, count, step):
        piece = words[at : at + step]
        out = masked[: len(piece)]
        np.bitwise_and(piece, magnitude, out=out)
        if out.max() >= bits.limit:
            return True
    return False
