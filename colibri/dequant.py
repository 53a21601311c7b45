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
  eight per int32 down each column) when the checkpoint has them;
* ``gptq``, ``gptq_v2`` and ``awq``: stored (in, out). Unsigned 4-bit
  values ``q``, zero points ``z`` packed eight per int32 along each row of
  ``qzeros``, and per-group scales ``s``; the weight of input row ``i`` and
  column ``j`` is ``(q - z[g, j]) * s[g, j]`` with ``g = g_idx[i]`` (GPTQ;
  ``i // group_size`` without a g_idx and for AWQ). GPTQ packs ``q`` down
  the columns (input row ``8k + n`` in bits ``4n..4n+3`` of word ``k``) and
  its original format (``gptq``) stores every zero point minus one, so
  ``z`` is the nibble plus one, as AutoGPTQ reads it; ``gptq_v2`` stores
  ``z`` itself. AWQ packs ``q`` and ``z`` along the rows, nibble ``n`` of
  word ``k`` holding column ``8k + (0, 2, 4, 6, 1, 3, 5, 7)[n]``.

The results are new arrays: they do not reference the cache slot, so the
lease may end right after. An engine that wants the raw parts keeps them
through ``lease.parts``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colibri import fp8
from colibri.errors import FormatError
from colibri.layouts import (AWQ, FP8_BLOCK, GPTQ, GPTQ_V2, INT4, INTERLEAVED, MXFP4, PLAIN, ROLES,
                             ExpertTensors)

__all__ = ["dequantize", "mxfp4_to_float", "unpack_int4", "int4_to_float", "gptq_to_float",
           "awq_to_float", "AWQ_ORDER", "E2M1_VALUES"]

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


# AWQ's GEMM packing: nibble n of a word holds column AWQ_ORDER[n] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# ... so column c of the eight is nibble _AWQ_NIBBLE[c].
_AWQ_NIBBLE = np.argsort(AWQ_ORDER)


def _nibbles_along_rows(words: np.ndarray) -> np.ndarray:
    """uint8 nibbles of int32 words ``(rows, k)`` as ``(rows, 8k)``, word by
    word, nibble 0 (bits 0-3) first."""
    w = np.ascontiguousarray(np.asarray(words)).astype("<i4", copy=False)
    b = w.view(np.uint8).reshape(w.shape[0], -1)
    out = np.empty((w.shape[0], b.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = b & 0x0F
    out[:, 1::2] = b >> 4
    return out


def _awq_natural(words: np.ndarray) -> np.ndarray:
    """AWQ-packed words ``(rows, k)`` as nibbles ``(rows, 8k)`` in column order."""
    n = _nibbles_along_rows(words)
    return n.reshape(n.shape[0], -1, 8)[:, :, _AWQ_NIBBLE].reshape(n.shape)


def _awq_transposed(words: np.ndarray) -> np.ndarray:
    """The values of AWQ-packed ``(rows, k)`` words transposed: ``(8k, rows)``
    uint8, column ``8i + AWQ_ORDER[n]`` of the matrix from nibble ``n``."""
    wt = np.ascontiguousarray(np.asarray(words).T).astype("<i4", copy=False).view("<u4")
    out = np.empty((wt.shape[0], 8, wt.shape[1]), dtype=np.uint8)
    for n, column in enumerate(AWQ_ORDER):
        out[:, column, :] = (wt >> np.uint32(4 * n)) & np.uint32(0x0F)
    return out.reshape(-1, wt.shape[1])


def _groups_of_rows(rows: int, groups: int, group_size: int, g_idx: np.ndarray | None,
                    what: str) -> np.ndarray:
    """The scale row of each input row: ``g_idx`` when given, else ``i // group_size``."""
    if g_idx is None:
        g = np.arange(rows) // (group_size or rows)
        if g[-1] >= groups:
            raise FormatError(f"{what}: {groups} scale rows do not cover {rows} input rows "
                              f"in groups of {group_size or rows}")
        return g
    g = np.asarray(g_idx).astype(np.int64)
    if g.shape != (rows,):
        raise FormatError(f"{what}: g_idx {list(g.shape)} does not give a group for each of "
                          f"{rows} input rows")
    if g.size and (g.min() < 0 or g.max() >= groups):
        raise FormatError(f"{what}: g_idx holds groups {int(g.min())}..{int(g.max())}, but the "
                          f"scales have {groups}")
    return g


def _apply_groups(qt: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``(q - zeros[g]) * scales[g]`` in float32 from the transposed values
    ``qt`` (out, in); returns the (in, out) result as a view of a C-contiguous
    (out, in) array, so that the Mixtral orientation costs no copy."""
    w = qt.astype(np.float32)
    zt = np.ascontiguousarray(zeros.T).astype(np.float32)   # (out, groups)
    st = np.ascontiguousarray(scales.T)                      # (out, groups)
    out, rows = w.shape
    groups = st.shape[1]
    if rows % groups == 0 and np.array_equal(g, np.arange(rows) // (rows // groups)):
        tiles = w.reshape(out, groups, rows // groups)  # groups of consecutive input rows
        tiles -= zt[:, :, None]
        tiles *= st[:, :, None]
    else:  # act order, or a last group shorter than the others
        w -= zt[:, g]
        w *= st[:, g]
    return w.T


def _scales_and_zeros(qt: np.ndarray, scales: np.ndarray, zeros: np.ndarray, packed_zeros: np.ndarray,
                      what: str) -> tuple[int, np.ndarray, np.ndarray]:
    """(input rows, float32 scales, unpacked zeros) of a GPTQ/AWQ weight whose
    transposed nibbles are ``qt``, after checking that they fit together."""
    sc = np.asarray(scales).astype(np.float32)
    cols, rows = qt.shape
    if sc.ndim != 2 or sc.shape[1] != cols:
        raise FormatError(f"{what}: scales {list(sc.shape)} do not fit a ({rows}, {cols}) weight")
    if zeros.shape != sc.shape:
        raise FormatError(f"{what}: qzeros {list(np.shape(packed_zeros))} do not fit scales {list(sc.shape)}")
    return rows, sc, zeros


def gptq_to_float(qweight: np.ndarray, scales: np.ndarray, qzeros: np.ndarray,
                  g_idx: np.ndarray | None = None, *, group_size: int = 0,
                  zeros_minus_one: bool = True, what: str = "GPTQ weight") -> np.ndarray:
    """float32 ``(in, out)`` weight of a GPTQ module: ``qweight`` int32
    ``(in / 8, out)``, ``scales`` ``(groups, out)``, ``qzeros`` int32
    ``(groups, out / 8)``, ``g_idx`` ``(in,)`` (None: ``i // group_size``,
    0 meaning one group). ``zeros_minus_one``: the original GPTQ format, whose
    zero points are stored minus one (``checkpoint_format`` gptq); False for
    gptq_v2. The result is the transpose of a C-contiguous (out, in) array."""
    words = np.asarray(qweight)
    # Word row k holds input rows 8k..8k+7 of each column: the transposed
    # words unpack along their rows straight into (out, in).
    qt = _nibbles_along_rows(np.ascontiguousarray(words.T))
    rows, sc, z = _scales_and_zeros(qt, scales, _nibbles_along_rows(qzeros), qzeros, what)
    if zeros_minus_one:
        z = z + 1  # uint8: 15 + 1 is 16, not 0
    g = _groups_of_rows(rows, sc.shape[0], group_size, g_idx, what)
    return _apply_groups(qt, z, sc, g)


def awq_to_float(qweight: np.ndarray, scales: np.ndarray, qzeros: np.ndarray, *,
                 group_size: int = 0, what: str = "AWQ weight") -> np.ndarray:
    """float32 ``(in, out)`` weight of an AWQ GEMM module: ``qweight`` int32
    ``(in, out / 8)``, ``scales`` ``(groups, out)``, ``qzeros`` int32
    ``(groups, out / 8)``, both packed in :data:`AWQ_ORDER`; input row ``i``
    uses group ``i // group_size`` (0: one group). The result is the
    transpose of a C-contiguous (out, in) array."""
    qt = _awq_transposed(qweight)
    rows, sc, z = _scales_and_zeros(qt, scales, _awq_natural(qzeros), qzeros, what)
    g = _groups_of_rows(rows, sc.shape[0], group_size, None, what)
    return _apply_groups(qt, z, sc, g)


def _decode(info: ExpertTensors, role: str, data: np.ndarray, scale: np.ndarray | None,
            zero: np.ndarray | None, g_idx: np.ndarray | None = None) -> np.ndarray:
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
    if info.scheme in (GPTQ, GPTQ_V2, AWQ):
        w = info.weight(role)
        what = f"{role} {w.name!r}" if w is not None else role
        if zero is None:
            raise FormatError(f"{info.scheme} weight {what} has no zero points")
        if info.scheme == AWQ:
            return awq_to_float(data, scale, zero, group_size=info.group_size, what=what)
        return gptq_to_float(data, scale, zero, g_idx, group_size=info.group_size,
                             zeros_minus_one=info.scheme == GPTQ, what=what)
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
                                parts.get(f"{name}_zero"), parts.get(f"{name}_g_idx"))
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
