"""Block-scaled FP8 weights (DeepSeek-V3 style) to float32, in numpy.

DeepSeek-V3 and its relatives ship each expert projection as an ``F8_E4M3``
weight ``W`` of shape ``(rows, columns)`` plus an ``F32`` tensor
``W_scale_inv`` of shape ``(ceil(rows / 128), ceil(columns / 128))``: one
factor per 128x128 block, the last row and column of blocks partial when the
shape is not a multiple of 128. The real weight is::

    w[i, j] = float32(fp8[i, j]) * scale_inv[i // 128, j // 128]

(the factor is the inverse of the quantiser's scale, hence the name, so
dequantizing is a multiplication).

A leased fp8 expert exposes the raw fp8 arrays (``ex.gate``...) and their
scales (``ex.gate_scale``...); :func:`dequantize_lease` gives the three
float32 matrices. The result is a fresh array, independent of the lease.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from colibri.errors import FormatError
from colibri.layouts import ROLES, _block_edge

__all__ = ["dequantize", "dequantize_lease", "DEFAULT_BLOCK"]

DEFAULT_BLOCK: tuple[int, int] = (128, 128)
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_FLOAT8 = frozenset(
    np.dtype(t) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
)


def _infer_block(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, int]:
    """The block ``(rows, columns)`` one scale covers, by the rule the layout
    scanner applies to checkpoints: 128x128 whenever that tiles the weight
    into ``scale_shape`` blocks, otherwise the smallest block that does.
    Raises FormatError when no block does."""
    if len(weight_shape) != 2 or len(scale_shape) != 2:
        raise FormatError(
            f"fp8 weight {list(weight_shape)} and scales {list(scale_shape)} must both be 2-D")
    rows = _block_edge(weight_shape[0], scale_shape[0])
    cols = _block_edge(weight_shape[1], scale_shape[1])
    if rows is None or cols is None:
        raise FormatError(
            f"scales of shape {list(scale_shape)} do not tile a weight of shape "
            f"{list(weight_shape)} into blocks")
    return rows, cols


def _as_fp8(weight: np.ndarray) -> np.ndarray:
    if weight.dtype in _FLOAT8:
        return weight
    if weight.dtype == np.uint8:  # raw bytes of e4m3fn (a torch/uint8 round trip)
        return weight.view(_E4M3)
    raise FormatError(
        f"dequantize needs an fp8 array (float8_e4m3fn, float8_e5m2, or uint8 bytes "
        f"of e4m3fn), not {weight.dtype}")


def dequantize(weight_fp8: np.ndarray, scale_inv: np.ndarray,
               block: tuple[int, int] | None = DEFAULT_BLOCK) -> np.ndarray:
    """float32 ``weight_fp8 * scale_inv`` broadcast over ``block``-sized tiles.

    ``weight_fp8`` is ``(rows, columns)`` fp8 (``uint8`` is read as e4m3fn
    bytes); ``scale_inv`` is ``(ceil(rows / block[0]), ceil(columns /
    block[1]))``, the last blocks partial. ``block=None`` infers it from the
    shapes (128x128 when that tiles the weight, else the smallest block that does). Returns a new C-contiguous float32 array.
    """
    weight = _as_fp8(np.asarray(weight_fp8))
    scales = np.asarray(scale_inv)
    if weight.ndim != 2 or scales.ndim != 2:
        raise FormatError(
            f"dequantize needs a 2-D weight and 2-D scales, got {list(weight.shape)} "
            f"and {list(scales.shape)}")
    rows, cols = weight.shape
    if block is None:
        br, bc = _infer_block(weight.shape, scales.shape)
    else:
        br, bc = (int(b) for b in block)
        if br <= 0 or bc <= 0:
            raise FormatError(f"block must be positive, got {tuple(block)}")
    want = (-(-rows // br), -(-cols // bc))
    if scales.shape != want:
        raise FormatError(
            f"a {rows}x{cols} weight in {br}x{bc} blocks needs scales of shape "
            f"{list(want)}, got {list(scales.shape)}")
    out = weight.astype(np.float32)
    s = scales.astype(np.float32, copy=False)
    if rows % br == 0 and cols % bc == 0:
        # Whole blocks: one broadcast multiply over a (nr, br, nc, bc) view.
        tiles = out.reshape(want[0], br, want[1], bc)
        tiles *= s[:, None, :, None]
        return out
    full = np.repeat(np.repeat(s, br, axis=0), bc, axis=1)
    out *= full[:rows, :cols]
    return out


def dequantize_lease(ex: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(gate, up, down)`` of a leased expert as new float32 arrays: the
    fp8 case of :func:`colibri.dequantize` (which also takes any other
    layout and format, and returns biases too). The results do not reference
    the cache slot, so the lease may end right after."""
    from colibri.dequant import dequantize as dequantize_any

    weights = dequantize_any(ex)
    return weights["gate"], weights["up"], weights["down"]
