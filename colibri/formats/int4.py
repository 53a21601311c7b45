"""compressed-tensors ``pack-quantized`` int4.

A Linear's weight ``W`` of shape ``(rows, columns)`` is stored as
``W_packed`` I32 ``(rows, columns / 8)``: eight 4-bit values per
little-endian word, low nibble first, each stored as ``q + 8`` (so ``q`` is
in -8..7); ``W_scale`` F32/BF16/F16 ``(rows, columns / group)``; optionally
``W_zero_point`` I32 ``(ceil(rows / 8), columns / group)``, packed the same
way down each column; and ``W_shape``, the two sizes, read at open. The
weight is ``(q - zero) * scale`` per group of columns, stored (out, in).

llm-compressor's compressed 3-D MoE repack stacks the experts along a first
dimension of each part (``weight_shape`` then holds one row per expert,
``[I, H, I, H]`` for a fused gate_up: gate's shape and up's side by side).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from colibri._ffi import lib
from colibri.checkpoint.safetensors import read_ints
from colibri.errors import FormatError
from colibri.formats.nibbles import nibbles_along_rows, torch_nibbles_of_words
from colibri.formats.record import Declared, Encoded, Format, RoleFacts, RoleParts, need

__all__ = ["NAME", "FORMAT", "declared", "unpack_int4", "int4_to_float"]

NAME = "int4"
_PACKED = ".weight_packed"


def declared(weights: Mapping[str, Any], source: str = "config.json") -> Declared:
    """What the ``weights`` entry of a compressed-tensors config group says."""
    group = weights.get("group_size")
    return Declared(bits=weights.get("num_bits", 4),
                    group_size=group if isinstance(group, int) and group > 0 else None, source=source)


def unpack_int4(packed: np.ndarray, columns: int) -> np.ndarray:
    """int8 values ``q`` in -8..7 of words packed eight per int32 along rows:
    ``(rows, ceil(columns / 8))`` int32 to ``(rows, columns)``."""
    out = nibbles_along_rows(packed).view(np.int8)
    out -= 8
    return out[:, :columns]


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
    if zero is not None:  # packed down each column: unpack the transpose
        zp = unpack_int4(np.ascontiguousarray(np.asarray(zero).T), rows).T.astype(np.float32)
        tiles -= zp[:, :, None]
    tiles *= sc[:, :, None]
    return q


def _sibling(packed: str, kind: str) -> str:
    """The name of part ``kind`` of the weight whose packed words are ``packed``."""
    return packed[: -len(_PACKED)] + FORMAT.parts[kind]


def _expert_shape(parts: RoleParts) -> tuple[int, int]:
    """(rows, columns) of one expert's weight, from its ``weight_shape``."""
    info = need(parts.shape, f"{parts.where}: packed weight {parts.data.name!r} has no "
                f"{_sibling(parts.data.name, 'shape')!r}")
    if not parts.stacked:
        values = read_ints(info, 64, "a small I32 or I64 tensor").reshape(-1)
        if values.shape != (2,) or (values <= 0).any():
            raise FormatError(f"{parts.where}: {info.name!r} holds {values.tolist()}, "
                              "not two positive sizes")
        return int(values[0]), int(values[1])
    values = read_ints(info, 1 << 20, "an I32 or I64 [experts, 2 or 4] tensor")
    differ = np.flatnonzero((values != values[0]).any(axis=1))
    if differ.size:
        e = int(differ[0])
        raise FormatError(f"{parts.where}: {info.name!r} gives the experts different shapes "
                          f"(expert 0 {values[0].tolist()}, expert {e} {values[e].tolist()})")
    row = [int(v) for v in values[0]]
    if len(row) == 4 and parts.role == "gate_up" and row[1] == row[3] and row[0] == row[2] and row[0] > 0:
        return 2 * row[0], row[1]
    if len(row) == 2 and min(row) > 0:
        return row[0], row[1]
    raise FormatError(f"{parts.where}: {info.name!r} holds {row} per expert; expected [rows, columns]"
                      + (" or gate's and up's [I, H, I, H]" if parts.role == "gate_up" else ""))


def _check_packed(parts: RoleParts, declared: Declared, rows: int, cols: int) -> None:
    packed, lead = parts.data, ["experts"] if parts.stacked else []
    words = -(-cols // 8)
    if packed.shape[len(lead):] != (rows, words):
        raise FormatError(
            f"{parts.where}: packed tensor {packed.name!r} has shape {list(packed.shape)}, but "
            f"weight_shape [{rows}, {cols}] packs into {lead + [rows, words]} I32 words")
    if cols % 8:
        raise FormatError(f"{parts.where}: {packed.name!r}: {cols} columns are not a multiple of 8; "
                          "padded int4 rows are not supported")
    if declared.bits != 4:
        raise FormatError(f"{parts.where}: {packed.name!r}: num_bits {declared.bits} in "
                          f"{declared.source}; only 4-bit pack-quantized weights are supported")


def _check_scale(parts: RoleParts, declared: Declared, rows: int, cols: int) -> int:
    """Checks the scales; returns how many groups each row has."""
    scale = need(parts.scale, f"{parts.where}: packed weight {parts.data.name!r} has no "
                 f"{_sibling(parts.data.name, 'scale')!r}")
    dims = scale.shape[1:] if parts.stacked else scale.shape
    if scale.dtype not in FORMAT.scale_formats or len(dims) != 2 or dims[0] != rows \
            or dims[1] <= 0 or cols % dims[1]:
        raise FormatError(
            f"{parts.where}: scale {scale.name!r} is {scale.dtype}{list(scale.shape)}; a weight of "
            f"shape [{rows}, {cols}] needs [{'experts, ' if parts.stacked else ''}{rows}, groups] "
            f"scales ({'/'.join(FORMAT.scale_formats)}) with groups dividing the columns")
    group = cols // dims[1]
    if declared.group_size is not None and declared.group_size != group:
        raise FormatError(f"{parts.where}: scale {scale.name!r} has groups of {group} columns but "
                          f"{declared.source} says group_size {declared.group_size}")
    return dims[1]


def _check_zero(parts: RoleParts, rows: int, groups: int) -> None:
    zero = parts.zero
    if zero is None:
        return
    if parts.role == "gate_up" and (rows // 2) % 8:
        raise FormatError(f"{parts.where}: zero point {zero.name!r}: a fused gate_up with zero points "
                          f"needs I = {rows // 2} to be a multiple of 8 (gate's and up's packed "
                          "words are concatenated)")
    want = (-(-rows // 8), groups)
    if zero.dtype != "I32" or (zero.shape[1:] if parts.stacked else zero.shape) != want:
        raise FormatError(
            f"{parts.where}: zero point {zero.name!r} is {zero.dtype}{list(zero.shape)}; expected "
            f"I32[{'experts, ' if parts.stacked else ''}{want[0]}, {want[1]}] (8 packed int4 per "
            "word down each column)")


def _validate(parts: RoleParts, declared: Declared) -> RoleFacts:
    """One pack-quantized weight (or a stack of them), checked."""
    packed = parts.data
    if packed.dtype != "I32" or len(packed.shape) != (3 if parts.stacked else 2):
        raise FormatError(f"{parts.where}: {packed.name!r} is {packed.dtype}{list(packed.shape)}; a "
                          + ("stacked packed int4 weight is an I32 [experts, rows, columns / 8] tensor"
                             if parts.stacked else "packed int4 weight is a 2-D I32 tensor"))
    need(parts.scale, f"{parts.where}: packed weight {packed.name!r} has no "
         f"{_sibling(packed.name, 'scale')!r}")
    rows, cols = _expert_shape(parts)
    _check_packed(parts, declared, rows, cols)
    groups = _check_scale(parts, declared, rows, cols)
    _check_zero(parts, rows, groups)
    return RoleFacts((rows, cols), cols // groups, groups)


def _group_size(where: str, parts: Mapping[str, RoleParts], facts: Mapping[str, RoleFacts],
                declared: Declared) -> int:
    sizes = {f.group_size for f in facts.values()}
    if len(sizes) != 1:
        raise FormatError(f"{where}: the roles use different group sizes "
                          + ", ".join(f"{r} {f.group_size}" for r, f in facts.items()))
    return sizes.pop()


def _block(shape: tuple[int, int], scale_shape: tuple[int, ...], group_size: int) -> tuple[int, int]:
    return (1, group_size)


def _to_float(enc: Encoded) -> np.ndarray:
    scale = need(enc.scale, f"{NAME} weight {enc.role} has no scales")
    return int4_to_float(enc.data, scale, enc.shape, enc.zero)


def _to_torch(torch: Any, enc: Encoded) -> Any:
    f32 = torch.float32
    scale = need(enc.scale, f"{NAME} weight {enc.role} has no scales")
    rows, cols = enc.shape
    q = torch_nibbles_of_words(torch, enc.data).to(f32)[:, :cols] - 8
    groups = scale.shape[1]
    q = q.reshape(rows, groups, cols // groups)
    if enc.zero is not None:
        z = torch_nibbles_of_words(torch, enc.zero.t()).to(f32)[:, :rows] - 8
        q = q - z.t()[:, :, None]
    return (q * scale.to(f32)[:, :, None]).reshape(rows, cols)


FORMAT = Format(
    name=NAME,
    summary="compressed-tensors pack-quantized int4: 8 values per int32, group scales, "
            "optional zero points",
    parts=MappingProxyType({"data": _PACKED, "scale": ".weight_scale", "zero": ".weight_zero_point",
                            "shape": ".weight_shape"}),
    coli_formats=MappingProxyType({"I32": lib.COLI_TENSOR_INT4_BLOCK}),
    scale_formats=MappingProxyType({"F32": lib.COLI_SCALE_F32, "BF16": lib.COLI_SCALE_BF16,
                                    "F16": lib.COLI_SCALE_F16}),
    block=_block,
    validate=_validate,
    group_size=_group_size,
    to_float=_to_float,
    to_torch=_to_torch,
)
