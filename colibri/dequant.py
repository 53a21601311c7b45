"""Plain float32 weights from a leased expert, whatever its layout and format.

:func:`dequantize` turns a lease into ``gate``, ``up`` and ``down`` in the
Mixtral orientation (gate and up ``(intermediate, hidden)``, down
``(hidden, intermediate)``), plus ``gate_bias``, ``up_bias`` and
``down_bias`` where the checkpoint has biases. It decodes the format, then
un-transposes and un-fuses:

* ``plain``: F32, F16, BF16, unscaled fp8, converted;
* ``fp8_block``: e4m3 times one F32 factor per block (DeepSeek-V3), through
  :func:`colibri.fp8.dequantize`;
* ``mxfp4`` (gpt-oss): e2m1 values, two per byte with the low nibble first,
  each group of 32 times ``2 ** (scale - 127)``;
* ``int4`` (compressed-tensors pack-quantized): eight 4-bit values per
  little-endian int32, low nibble first, stored as ``q + 8``; the weight is
  ``(q - zero) * scale`` per group of columns, with zero points (packed
  eight per int32 down each column) when the checkpoint has them.

The results are new arrays: they do not reference the cache slot, so the
lease may end right after. An engine that wants the raw parts keeps them
through ``lease.parts``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colibri import fp8
from colibri.errors import FormatError
from colibri.layouts import FP8_BLOCK, INT4, INTERLEAVED, MXFP4, PLAIN, ROLES, ExpertTensors

__all__ = ["dequantize", "mxfp4_to_float", "unpack_int4", "int4_to_float", "E2M1_VALUES"]

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


def unpack_int4(packed: np.ndarray, columns: int) -> np.ndarray:
    """int8 values ``q`` in -8..7 of words packed eight per int32 along rows:
    ``(rows, ceil(columns / 8))`` int32 to ``(rows, columns)``."""
    words = np.ascontiguousarray(np.asarray(packed)).astype("<i4", copy=False)
    rows = words.shape[0]
    nibbles = words.view(np.uint8).reshape(rows, -1)
    out = np.empty((rows, nibbles.shape[1] * 2), dtype=np.int8)
    out[:, 0::2] = nibbles & 0x0F
    out[:, 1::2] = nibbles >> 4
    out -= 8
    return out[:, :columns]


def _unpack_int4_down_columns(packed: np.ndarray, rows: int) -> np.ndarray:
    """Zero points packed eight per int32 down each column: (ceil(rows/8), G) -> (rows, G)."""
    return unpack_int4(np.ascontiguousarray(np.asarray(packed).T), rows).T


def int4_to_float(packed: np.ndarray, scale: np.ndarray, shape: tuple[int, int],
                  zero: np.ndarray | None = None) -> np.ndarray:
    """float32 weight of shape ``(rows, columns)`` from pack-quantized
    ``packed`` int32, group ``scale`` ``(rows, groups)`` and optional packed
    ``zero`` points ``(ceil(rows / 8), groups)``."""
    rows, columns = shape
    sc = np.asarray(scale).astype(np.float32)
    if sc.ndim != 2 or sc.shape[0] != rows or columns % sc.shape[1]:
        raise FormatError(f"int4 scales {list(sc.shape)} do not fit a weight of shape {[rows, columns]}")
    group = columns // sc.shape[1]
    q = unpack_int4(packed, columns).astype(np.float32)
    if q.shape != (rows, columns):
        raise FormatError(f"packed int4 words {list(np.shape(packed))} do not hold a {rows}x{columns} weight")
    tiles = q.reshape(rows, sc.shape[1], group)
    if zero is not None:
        zp = _unpack_int4_down_columns(zero, rows).astype(np.float32)
        tiles -= zp[:, :, None]
    tiles *= sc[:, :, None]
    return q


def _decode(info: ExpertTensors, role: str, data: np.ndarray, scale: np.ndarray | None,
            zero: np.ndarray | None) -> np.ndarray:
    """One role's data as float32, in its stored orientation."""
    if info.scheme == PLAIN or (info.scheme == FP8_BLOCK and scale is None):
        return np.array(data, dtype=np.float32, copy=True)
    if scale is None:
        raise FormatError(f"{info.scheme} weight {role} has no scales")
    if info.scheme == FP8_BLOCK:
        return fp8.dequantize(data, scale, block=None)
    if info.scheme == MXFP4:
        return mxfp4_to_float(data, scale)
    if info.scheme == INT4:
        shape = info.shape(role)
        assert shape is not None
        return int4_to_float(data, scale, shape, zero)
    raise FormatError(f"unknown weight scheme {info.scheme!r}")


def _split(fused: np.ndarray, how: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(gate, up) from a fused gate_up along its first axis."""
    if how == INTERLEAVED:
        return fused[0::2], fused[1::2]
    half = fused.shape[0] // 2
    return fused[:half], fused[half:]


def dequantize(lease: Any) -> dict[str, np.ndarray]:
    """A leased expert's weights as float32: ``gate``, ``up``, ``down`` in
    the Mixtral orientation, plus ``gate_bias``, ``up_bias``, ``down_bias``
    where the checkpoint has biases. New C-contiguous arrays, independent of
    the lease. ``lease`` is an :class:`colibri.ExpertLease` of any layout
    and format."""
    info: ExpertTensors = lease.tensors
    parts = lease.parts
    first = "gate_up" if info.fused else "gate"
    out: dict[str, np.ndarray] = {}
    decoded: dict[str, np.ndarray] = {}
    for role in ROLES:
        name = first if role == "gate" else role
        if name not in parts:
            continue  # up of a fused gate_up
        decoded[name] = _decode(info, role, parts[name], parts.get(f"{name}_scale"),
                                parts.get(f"{name}_zero"))
    if info.transposed:
        decoded = {name: w.T for name, w in decoded.items()}
    if info.fused:
        out["gate"], out["up"] = _split(decoded["gate_up"], info.fused)
    else:
        out["gate"], out["up"] = decoded["gate"], decoded["up"]
    out["down"] = decoded["down"]
    # Biases are copied: nothing returned may view the slot.
    if "gate_up_bias" in parts:
        bias = np.array(parts["gate_up_bias"], dtype=np.float32, copy=True)
        out["gate_bias"], out["up_bias"] = _split(bias, info.fused)
    for role in ROLES:
        if f"{role}_bias" in parts:
            out[f"{role}_bias"] = np.array(parts[f"{role}_bias"], dtype=np.float32, copy=True)
    del parts
    return {name: np.ascontiguousarray(a) for name, a in out.items()}
