"""What GPTQ and AWQ share: a quantized Linear module ``M`` stores
``M.qweight`` (unsigned 4-bit values packed in int32 words), ``M.qzeros``
(zero points, eight per word along each row), ``M.scales`` ``(groups, out)``
and, for GPTQ, ``M.g_idx`` in place of ``M.weight``, as an (in, out)
matrix. The weight of input row ``i`` and column ``j`` is
``(q - z[g, j]) * s[g, j]`` with ``g = g_idx[i]``, or ``i // group_size``
without a g_idx. The two differ in how the words are packed
(:mod:`colibri.formats.gptq`, :mod:`colibri.formats.awq`).

A store holds GPTQ with act order in group order: its rows moved once, on
load, so that stored row ``j`` is in group ``j // group_size``, and g_idx
entry ``j`` rewritten to ``-1 -`` the input row it holds (every entry
negative). The kernels read that form without sorting; the functions here
move the rows back.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from colibri._ffi import lib
from colibri.errors import FormatError
from colibri.formats.record import Declared, Encoded, RoleFacts, RoleParts, Validator, need

__all__ = ["GPTQ", "GPTQ_V2", "AWQ", "SCHEMES", "PARTS", "SCALE_FORMATS", "CODES", "guess_scheme",
           "validator", "group_size", "block", "rows_in_group_order", "groups_of_rows",
           "scales_and_zeros", "apply_groups", "module_to_torch"]

GPTQ = "gptq"         # zero points stored minus one (the original format)
GPTQ_V2 = "gptq_v2"   # zero points stored as they are
AWQ = "awq"           # AWQ GEMM
SCHEMES = (GPTQ, GPTQ_V2, AWQ)

#: The module's parts, by their names in the checkpoint.
PARTS: Mapping[str, str] = MappingProxyType(
    {"data": ".qweight", "scale": ".scales", "zero": ".qzeros", "g_idx": ".g_idx"})
SCALE_FORMATS: Mapping[str, int] = MappingProxyType(
    {"F16": lib.COLI_SCALE_F16, "BF16": lib.COLI_SCALE_BF16, "F32": lib.COLI_SCALE_F32})
#: The ColiTensorFormat of each packing's qweight.
CODES: Mapping[str, int] = MappingProxyType(
    {GPTQ: lib.COLI_TENSOR_INT4_GPTQ, GPTQ_V2: lib.COLI_TENSOR_INT4_GPTQ, AWQ: lib.COLI_TENSOR_INT4_AWQ})


def guess_scheme(parts: RoleParts) -> str:
    """Without settings, the shapes tell GPTQ's (in/8, out) words from AWQ's
    (in, out/8): GPTQ has a g_idx, or as many scale columns as words per row."""
    scales = parts.scale
    if parts.g_idx is not None or scales is None or scales.shape[1:2] == parts.data.shape[1:2]:
        return GPTQ
    return AWQ


def _check_words(parts: RoleParts, scheme: str) -> tuple[int, int]:
    """(in, out) of a module's qweight, checked against its scales."""
    where, qweight = parts.where, parts.data
    prefix = qweight.name[: -len("qweight")]
    scales = need(parts.scale, f"{where}: {qweight.name!r} has no {prefix + 'scales'!r}")
    need(parts.zero, f"{where}: {qweight.name!r} has no {prefix + 'qzeros'!r}")
    if qweight.dtype != "I32" or len(qweight.shape) != 2 or 0 in qweight.shape:
        raise FormatError(f"{where}: {qweight.name!r} is {qweight.dtype}{list(qweight.shape)}; "
                          "a 4-bit qweight is a non-empty 2-D I32 tensor")
    if scales.dtype not in SCALE_FORMATS or len(scales.shape) != 2 or 0 in scales.shape:
        raise FormatError(f"{where}: scales {scales.name!r} are {scales.dtype}{list(scales.shape)}; "
                          f"expected a 2-D {'/'.join(SCALE_FORMATS)} (groups, out) tensor")
    if scheme == AWQ:
        rows, cols = qweight.shape[0], 8 * qweight.shape[1]
        layout = "(in, out/8) words of eight values along each row"
    else:
        rows, cols = 8 * qweight.shape[0], qweight.shape[1]
        layout = "(in/8, out) words of eight values down each column"
    if scales.shape[1] != cols:
        raise FormatError(f"{where}: scales {scales.name!r} {list(scales.shape)} do not fit "
                          f"{'AWQ' if scheme == AWQ else 'GPTQ'} qweight {qweight.name!r} "
                          f"{list(qweight.shape)}, which packs {layout}: a ({rows}, {cols}) "
                          f"matrix needs (groups, {cols}) scales")
    if cols % 8:
        raise FormatError(f"{where}: {qweight.name!r}: {cols} output columns do not pack into "
                          "int32 zero points")
    return rows, cols


def _check_zeros_and_g_idx(parts: RoleParts, scheme: str, rows: int, cols: int) -> None:
    where, qzeros, scales = parts.where, parts.zero, parts.scale
    assert qzeros is not None and scales is not None
    groups = scales.shape[0]
    if qzeros.dtype != "I32" or qzeros.shape != (groups, cols // 8):
        raise FormatError(f"{where}: qzeros {qzeros.name!r} are {qzeros.dtype}{list(qzeros.shape)}; "
                          f"scales {scales.name!r} {list(scales.shape)} need I32{[groups, cols // 8]} "
                          "(eight zero points per word)")
    g_idx = parts.g_idx
    if g_idx is not None:
        if scheme == AWQ:
            raise FormatError(f"{where}: {g_idx.name!r}: AWQ modules have no g_idx")
        if g_idx.dtype != "I32" or g_idx.shape != (rows,):
            raise FormatError(f"{where}: g_idx {g_idx.name!r} is {g_idx.dtype}{list(g_idx.shape)}; "
                              f"expected I32[{rows}] (the group of each input row)")
    if groups > rows:
        raise FormatError(f"{where}: scales {scales.name!r} have {groups} groups for {rows} "
                          "input rows")


def validator(scheme: str) -> Validator:
    """The validation of one module packed as ``scheme``: its (in, out) and scale groups."""
    def validate(parts: RoleParts, declared: Declared) -> RoleFacts:
        rows, cols = _check_words(parts, scheme)
        _check_zeros_and_g_idx(parts, scheme, rows, cols)
        assert parts.scale is not None
        return RoleFacts((rows, cols), 0, parts.scale.shape[0])

    return validate


def group_size(where: str, parts: Mapping[str, RoleParts], facts: Mapping[str, RoleFacts],
               declared: Declared) -> int:
    """Rows per scale: the settings', else the one every grouped role
    implies (0: one group over the input); checked against every role."""
    group = declared.group_size
    if group is None:
        implied = {f.shape[0] // f.groups for f in facts.values() if f.groups > 1}
        group = implied.pop() if len(implied) == 1 else 0
        if implied:
            raise FormatError(f"{where}: the scales of gate, up and down imply different group "
                              "sizes; add the checkpoint's quantization config")
    for role, found in facts.items():
        rows = found.shape[0]
        want = -(-rows // group) if group else 1
        if found.groups != want:
            scales = parts[role].scale
            assert scales is not None
            raise FormatError(f"{where}: scales {scales.name!r} have {found.groups} groups, but "
                              + (f"group_size {group} over {rows} input rows makes {want}"
                                 if group else f"one group per column ({declared.source}) makes 1"))
    return group


def block(shape: tuple[int, int], scale_shape: tuple[int, ...], group: int) -> tuple[int, int]:
    """Input rows per scale by one output column (0: the whole input)."""
    return (group or shape[0], 1)


def rows_in_group_order(g_idx: Any, rows: int, what: str) -> np.ndarray | None:
    """The input row each stored row holds when ``g_idx`` is in group order
    (every entry negative: ``-1 -`` the input), else None."""
    if g_idx is None:
        return None
    g = np.asarray(g_idx).astype(np.int64).reshape(-1)
    if g.size == 0 or g[0] >= 0:
        return None
    inputs = -1 - g
    if (inputs.size != rows or inputs.min() < 0 or inputs.max() >= rows
            or np.bincount(inputs, minlength=rows).max() != 1):
        raise FormatError(f"{what}: a g_idx in group order (negative) must hold -1 - each of the "
                          f"{rows} input rows once; it holds {g.size} entries "
                          f"{int(g.min())}..{int(g.max())}")
    return inputs


def groups_of_rows(rows: int, groups: int, group: int, g_idx: np.ndarray | None,
                   what: str) -> np.ndarray:
    """The scale row of each input row: ``g_idx`` when given, else ``i // group``."""
    if g_idx is None:
        g = np.arange(rows) // (group or rows)
        if g[-1] >= groups:
            raise FormatError(f"{what}: {groups} scale rows do not cover {rows} input rows "
                              f"in groups of {group or rows}")
        return g
    g = np.asarray(g_idx).astype(np.int64)
    if g.shape != (rows,):
        raise FormatError(f"{what}: g_idx {list(g.shape)} does not give a group for each of "
                          f"{rows} input rows")
    if g.size and (g.min() < 0 or g.max() >= groups):
        raise FormatError(f"{what}: g_idx holds groups {int(g.min())}..{int(g.max())}, but the "
                          f"scales have {groups}")
    return g


def scales_and_zeros(qt: np.ndarray, scales: np.ndarray, zeros: np.ndarray, packed_zeros: np.ndarray,
                     what: str) -> tuple[int, np.ndarray, np.ndarray]:
    """(input rows, float32 scales, unpacked zeros) of a weight whose
    transposed nibbles are ``qt``, after checking that they fit together."""
    sc = np.asarray(scales).astype(np.float32)
    cols, rows = qt.shape
    if sc.ndim != 2 or sc.shape[1] != cols:
        raise FormatError(f"{what}: scales {list(sc.shape)} do not fit a ({rows}, {cols}) weight")
    if zeros.shape != sc.shape:
        raise FormatError(f"{what}: qzeros {list(np.shape(packed_zeros))} do not fit scales {list(sc.shape)}")
    return rows, sc, zeros


def apply_groups(qt: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g: np.ndarray) -> np.ndarray:
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


def module_to_torch(torch: Any, enc: Encoded, q: Any, z: Any) -> Any:
    """float32 (in, out) weight in torch from the unpacked values ``q``
    (in, out) and zero points ``z`` (groups, out) of a module."""
    scale = enc.scale
    rows, groups = q.shape[0], scale.shape[0]
    held = None if enc.g_idx is None else rows_in_group_order(enc.g_idx.cpu().numpy(), rows, enc.role)
    if enc.g_idx is None or held is not None:
        g = torch.arange(rows) // (enc.group_size or rows)
    else:
        g = enc.g_idx.long()
        if g.numel() and (int(g.min()) < 0 or int(g.max()) >= groups):
            raise FormatError(f"{enc.role}: g_idx holds groups {int(g.min())}..{int(g.max())}, but "
                              f"the scales have {groups}")
    if int(g[-1]) >= groups or z.shape != scale.shape:
        raise FormatError(f"{enc.role}: scales {list(scale.shape)} and zero points {list(z.shape)} "
                          f"do not fit {rows} input rows")
    w = (q - z[g]).to(torch.float32) * scale.to(torch.float32)[g]
    if held is None:
        return w
    return w.index_select(0, torch.from_numpy(np.argsort(held)))
