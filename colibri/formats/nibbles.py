"""4-bit values packed eight per little-endian int32 word, nibble 0 (bits
0-3) first: the unpacking the int4, GPTQ and AWQ formats share, in numpy
and in torch."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["nibbles_along_rows", "torch_nibbles", "torch_nibbles_of_words"]


def nibbles_along_rows(words: np.ndarray) -> np.ndarray:
    """uint8 nibbles of int32 words ``(rows, k)`` as ``(rows, 8k)``, word by
    word, nibble 0 first."""
    w = np.ascontiguousarray(np.asarray(words)).astype("<i4", copy=False)
    b = w.view(np.uint8).reshape(w.shape[0], -1)
    out = np.empty((w.shape[0], b.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = b & 0x0F
    out[:, 1::2] = b >> 4
    return out


def torch_nibbles(torch: Any, data: Any) -> Any:
    """uint8 ``(..., n)`` to int64 nibbles ``(..., 2n)``, the low nibble first."""
    return torch.stack(((data & 0x0F).long(), (data >> 4).long()), dim=-1).flatten(-2)


def torch_nibbles_of_words(torch: Any, words: Any) -> Any:
    """int32 words ``(R, K)`` to int64 nibbles ``(R, 8K)``, word by word."""
    return torch_nibbles(torch, words.contiguous().view(torch.uint8))
