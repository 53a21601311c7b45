"""MXFP4 (gpt-oss): e2m1 values, two per byte with the low nibble first, in
blocks of 32 (16 bytes) that share one e8m0 scale byte: the value is
``e2m1 * 2 ** (scale - 127)``.

A role ``T`` is stored as ``T_blocks`` U8 ``(rows, columns / 32, 16)`` and
``T_scales`` U8 (or F8_E8M0) ``(rows, columns / 32)``, always (out, in);
gpt-oss stacks the experts along a first dimension of both.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import numpy as np

from colibri._ffi import lib
from colibri.errors import FormatError
from colibri.formats.nibbles import torch_nibbles
from colibri.formats.record import Declared, Encoded, Format, RoleFacts, RoleParts, fixed_group, need

__all__ = ["NAME", "FORMAT", "GROUP", "E2M1_VALUES", "mxfp4_to_float"]

NAME = "mxfp4"
#: Values per scale.
GROUP = 32

# The 16 values of an e2m1 nibble (sign bit 3, exponent bits 2-1, mantissa bit 0).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
# For each byte, its two values (low nibble first) as one 8-byte word.
_E2M1_PAIRS = np.ascontiguousarray(np.stack(
    [E2M1_VALUES[np.arange(256) & 0x0F], E2M1_VALUES[np.arange(256) >> 4]], axis=1)).view(np.uint64)[:, 0]


def mxfp4_to_float(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 values of MXFP4 ``blocks`` ``(..., G, 16)`` uint8 with e8m0
    ``scales`` ``(..., G)`` uint8: shape ``(..., G * 32)``."""
    b = np.asarray(blocks)
    sc = np.asarray(scales)
    if b.dtype != np.uint8 or b.ndim < 2 or b.shape[-1] != 16:
        raise FormatError(f"MXFP4 blocks must be uint8 (..., groups, 16), not {b.dtype}{list(b.shape)}")
    if sc.shape != b.shape[:-1]:
        raise FormatError(f"MXFP4 scales {list(sc.shape)} do not match blocks {list(b.shape)}")
    # One gather of 8 bytes per byte of blocks: both of its values at once.
    out = np.take(_E2M1_PAIRS, b.astype(np.intp)).view(np.float32)  # (..., G, 32)
    exponents = sc.view(np.uint8).astype(np.int32) - 127
    if (exponents < 128).all():
        # 2**e is exact in float32 for e in -127..127 (subnormal below -126),
        # so the product rounds as ldexp does.
        with np.errstate(over="ignore"):  # 6 * 2**127 is inf, as with ldexp
            out *= np.ldexp(np.float32(1), exponents).astype(np.float32)[..., None]
    else:  # e8m0 255 (NaN): ldexp's answers (0 stays 0), as the reference gives
        out = np.ldexp(out, exponents[..., None]).astype(np.float32, copy=False)
    return out.reshape(b.shape[:-2] + (b.shape[-2] * 32,))


def _validate(parts: RoleParts, declared: Declared) -> RoleFacts:
    where, blocks = parts.where, parts.data
    scales = need(parts.scale, f"{where}: MXFP4 tensor {blocks.name!r} has no scales")
    lead = blocks.shape[:1] if parts.stacked else ()
    if blocks.dtype != "U8" or len(blocks.shape) != len(lead) + 3 or blocks.shape[-1] != 16:
        raise FormatError(f"{where}: MXFP4 blocks {blocks.name!r} are "
                          f"{blocks.dtype}{list(blocks.shape)}; expected U8 "
                          f"[{'experts, ' if lead else ''}rows, blocks, 16] (32 e2m1 values in 16 bytes)")
    if scales.dtype not in FORMAT.scale_formats or scales.shape != blocks.shape[:-1]:
        raise FormatError(f"{where}: MXFP4 scales {scales.name!r} are "
                          f"{scales.dtype}{list(scales.shape)}; blocks {blocks.name!r} "
                          f"need U8{list(blocks.shape[:-1])}")
    rows, groups = blocks.shape[-3], blocks.shape[-2]
    return RoleFacts((rows, groups * GROUP), GROUP, groups)


def _block(shape: tuple[int, int], scale_shape: tuple[int, ...], group_size: int) -> tuple[int, int]:
    return (1, GROUP)


def _to_float(enc: Encoded) -> np.ndarray:
    return mxfp4_to_float(enc.data, need(enc.scale, f"{NAME} weight {enc.role} has no scales"))


def _to_torch(torch: Any, enc: Encoded) -> Any:
    scale = need(enc.scale, f"{NAME} weight {enc.role} has no scales")
    values = torch.from_numpy(E2M1_VALUES)[torch_nibbles(torch, enc.data)]   # (R, G, 32)
    exponents = scale.view(torch.uint8).to(torch.int32) - 127                 # (R, G)
    return torch.ldexp(values, exponents[..., None]).flatten(-2)


FORMAT = Format(
    name=NAME,
    summary="gpt-oss's MXFP4: e2m1 pairs per byte, one e8m0 scale per 32 values",
    parts=MappingProxyType({"data": "_blocks", "scale": "_scales"}),
    coli_formats=MappingProxyType({"U8": lib.COLI_TENSOR_FP4_NATIVE_BLOCK}),
    scale_formats=MappingProxyType({"U8": lib.COLI_SCALE_UE8M0, "F8_E8M0": lib.COLI_SCALE_UE8M0}),
    block=_block,
    validate=_validate,
    group_size=fixed_group(GROUP),
    to_float=_to_float,
    to_torch=_to_torch,
)
