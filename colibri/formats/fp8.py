"""Block-scaled FP8 (DeepSeek-V3): an ``F8_E4M3`` weight ``W`` of shape
``(rows, columns)`` and an ``F32`` tensor ``W_scale_inv`` of shape
``(ceil(rows / br), ceil(columns / bc))``, one factor per ``br x bc`` block
(128x128 in every checkpoint known), the last blocks partial when the shape
is not a multiple of the block. The weight is::

    w[i, j] = float32(fp8[i, j]) * scale_inv[i // br, j // bc]

(the factor is the inverse of the quantiser's scale, hence the name, so
dequantizing is a multiplication). The block is read from the shapes.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from colibri._ffi import lib
from colibri.checkpoint.safetensors import TensorInfo
from colibri.errors import FormatError
from colibri.formats import plain
from colibri.formats.record import Declared, Encoded, Format, RoleFacts, RoleParts, fixed_group

__all__ = ["NAME", "FORMAT", "DEFAULT_BLOCK", "CONVENTIONAL_BLOCK", "block_edge", "scale_block",
           "infer_block", "fp8_to_float"]

NAME = "fp8_block"
#: The block edge every FP8 checkpoint we know uses (weight_block_size [128, 128]).
CONVENTIONAL_BLOCK = 128
DEFAULT_BLOCK: tuple[int, int] = (CONVENTIONAL_BLOCK, CONVENTIONAL_BLOCK)
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_FLOAT8 = frozenset(np.dtype(t) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2))


def block_edge(size: int, count: int) -> int | None:
    """Edge of the blocks that cut ``size`` elements into ``count`` scales.

    Any block b with ceil(size / b) == count fits. When the dimension is not a
    multiple of the block several b fit (200 rows in 2 scales: 100..199); the
    quantisers pad the last block, so the conventional 128 wins when it fits,
    otherwise the smallest fitting block, ceil(size / count).
    """
    if size <= 0 or count <= 0 or count > size:
        return None
    if -(-size // CONVENTIONAL_BLOCK) == count:
        return CONVENTIONAL_BLOCK
    block = -(-size // count)
    return block if -(-size // block) == count else None


def _block_of(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, int] | None:
    if len(weight_shape) != 2 or len(scale_shape) != 2:
        return None
    rows = block_edge(weight_shape[0], scale_shape[0])
    cols = block_edge(weight_shape[1], scale_shape[1])
    return None if rows is None or cols is None else (rows, cols)


def scale_block(weight: TensorInfo, scale: TensorInfo) -> tuple[int, int]:
    """Block shape ``(block_rows, block_columns)`` one scale value covers.

    Derived from the shapes and checked to tile the weight: a (7168, 2048)
    weight with (56, 16) scales has 128x128 blocks, a (64, 96) weight with
    (2, 3) scales 32x32 blocks. Raises FormatError when no block size gives
    ``scale.shape == ceil(weight.shape / block)``.
    """
    if len(weight.shape) != 2 or len(scale.shape) != 2:
        raise FormatError(f"scale {scale.name!r} {list(scale.shape)} of weight {weight.name!r} "
                          f"{list(weight.shape)}: both must be 2-D")
    found = _block_of(weight.shape, scale.shape)
    if found is None:
        raise FormatError(f"scale {scale.name!r} has shape {list(scale.shape)}, which does not "
                          f"tile weight {weight.name!r} of shape {list(weight.shape)} into blocks")
    return found


def infer_block(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, int]:
    """:func:`scale_block` from bare shapes: the block ``(rows, columns)``
    one scale covers. Raises FormatError when no block does."""
    if len(weight_shape) != 2 or len(scale_shape) != 2:
        raise FormatError(
            f"fp8 weight {list(weight_shape)} and scales {list(scale_shape)} must both be 2-D")
    found = _block_of(weight_shape, scale_shape)
    if found is None:
        raise FormatError(f"scales of shape {list(scale_shape)} do not tile a weight of shape "
                          f"{list(weight_shape)} into blocks")
    return found


def _as_fp8(weight: np.ndarray) -> np.ndarray:
    if weight.dtype in _FLOAT8:
        return weight
    if weight.dtype == np.uint8:  # raw bytes of e4m3fn (a torch/uint8 round trip)
        return weight.view(_E4M3)
    raise FormatError(
        f"dequantize needs an fp8 array (float8_e4m3fn, float8_e5m2, or uint8 bytes "
        f"of e4m3fn), not {weight.dtype}")


def fp8_to_float(weight_fp8: np.ndarray, scale_inv: np.ndarray,
                 block: tuple[int, int] | None = DEFAULT_BLOCK) -> np.ndarray:
    """float32 ``weight_fp8 * scale_inv`` broadcast over ``block``-sized tiles.

    ``weight_fp8`` is ``(rows, columns)`` fp8 (``uint8`` is read as e4m3fn
    bytes); ``scale_inv`` is ``(ceil(rows / block[0]), ceil(columns /
    block[1]))``, the last blocks partial. ``block=None`` infers it from the
    shapes (128x128 when that tiles the weight, else the smallest block that
    does). Returns a new C-contiguous float32 array.
    """
    weight = _as_fp8(np.asarray(weight_fp8))
    scales = np.asarray(scale_inv)
    if weight.ndim != 2 or scales.ndim != 2:
        raise FormatError(
            f"dequantize needs a 2-D weight and 2-D scales, got {list(weight.shape)} "
            f"and {list(scales.shape)}")
    rows, cols = weight.shape
    if block is None:
        br, bc = infer_block(weight.shape, scales.shape)
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


def _validate(parts: RoleParts, declared: Declared) -> RoleFacts:
    shape = plain.check_matrix(parts)
    w, s = parts.data, parts.scale
    if s is None:
        raise FormatError(f"{parts.where}: weight {w.name!r} has no block scale")
    if w.dtype not in FORMAT.coli_formats:
        raise FormatError(f"{parts.where}: weight {w.name!r} is {w.dtype} but has scale "
                          f"{s.name!r}; only F8_E4M3 weights take block scales")
    if s.dtype not in FORMAT.scale_formats:
        raise FormatError(f"{parts.where}: scale {s.name!r} has dtype {s.dtype}; scales must be "
                          + "/".join(FORMAT.scale_formats))
    try:
        scale_block(w, s)
    except FormatError as exc:
        raise FormatError(f"{parts.where}: {exc}") from None
    return RoleFacts(shape)


def _block(shape: tuple[int, int], scale_shape: tuple[int, ...], group_size: int) -> tuple[int, int]:
    return infer_block(shape, scale_shape)


def _to_float(enc: Encoded) -> np.ndarray:
    return fp8_to_float(enc.data, enc.scale, block=enc.block)


def _to_torch(torch: Any, enc: Encoded) -> Any:
    f32 = torch.float32
    rows, cols = enc.data.shape
    br, bc = enc.block if enc.block is not None else infer_block(tuple(enc.data.shape),
                                                                  tuple(enc.scale.shape))
    full = enc.scale.to(f32).repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    return enc.data.to(f32) * full


FORMAT = Format(
    name=NAME,
    summary="block-scaled FP8 (weight_scale_inv, as DeepSeek-V3 ships)",
    parts=MappingProxyType({"data": ".weight", "scale": ".weight_scale_inv"}),
    coli_formats=MappingProxyType({"F8_E4M3": lib.COLI_TENSOR_FP8_E4M3_BLOCK}),
    scale_formats=MappingProxyType({"F32": lib.COLI_SCALE_F32}),
    block=_block,
    validate=_validate,
    group_size=fixed_group(0),
    to_float=_to_float,
    to_torch=_to_torch,
)
