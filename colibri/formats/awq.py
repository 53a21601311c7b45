"""AWQ 4-bit modules in the GEMM packing (AutoAWQ)
(:mod:`colibri.formats.qmodule` has what GPTQ and AWQ share).

``qweight`` I32 ``(in, out / 8)`` and ``qzeros`` I32 ``(groups, out / 8)``
pack eight values per word along each row, nibble ``n`` of word ``k``
holding column ``8k + AWQ_ORDER[n]``; ``scales`` ``(groups, out)``; no
g_idx: input row ``i`` uses group ``i // group_size``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import numpy as np

from colibri.formats import qmodule
from colibri.formats.nibbles import nibbles_along_rows, torch_nibbles_of_words
from colibri.formats.record import IN_OUT, Encoded, Format, need

__all__ = ["NAME", "FORMAT", "AWQ_ORDER", "awq_to_float"]

NAME = qmodule.AWQ
# AWQ's GEMM packing: nibble n of a word holds column AWQ_ORDER[n] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# ... so column c of the eight is nibble _NIBBLE_OF_COLUMN[c].
_NIBBLE_OF_COLUMN = np.argsort(AWQ_ORDER)


def _natural(words: np.ndarray) -> np.ndarray:
    """AWQ-packed words ``(rows, k)`` as nibbles ``(rows, 8k)`` in column order."""
    n = nibbles_along_rows(words)
    return n.reshape(n.shape[0], -1, 8)[:, :, _NIBBLE_OF_COLUMN].reshape(n.shape)


def _transposed(words: np.ndarray) -> np.ndarray:
    """The values of AWQ-packed ``(rows, k)`` words transposed: ``(8k, rows)``
    uint8, column ``8i + AWQ_ORDER[n]`` of the matrix from nibble ``n``."""
    wt = np.ascontiguousarray(np.asarray(words).T).astype("<i4", copy=False).view("<u4")
    out = np.empty((wt.shape[0], 8, wt.shape[1]), dtype=np.uint8)
    for n, column in enumerate(AWQ_ORDER):
        out[:, column, :] = (wt >> np.uint32(4 * n)) & np.uint32(0x0F)
    return out.reshape(-1, wt.shape[1])


def awq_to_float(qweight: np.ndarray, scales: np.ndarray, qzeros: np.ndarray, *,
                 group_size: int = 0, what: str = "AWQ weight") -> np.ndarray:
    """float32 ``(in, out)`` weight of an AWQ GEMM module: ``qweight`` int32
    ``(in, out / 8)``, ``scales`` ``(groups, out)``, ``qzeros`` int32
    ``(groups, out / 8)``, both packed in :data:`AWQ_ORDER`; input row ``i``
    uses group ``i // group_size`` (0: one group). The result is the
    transpose of a C-contiguous (out, in) array."""
    qt = _transposed(qweight)
    rows, sc, z = qmodule.scales_and_zeros(qt, scales, _natural(qzeros), qzeros, what)
    g = qmodule.groups_of_rows(rows, sc.shape[0], group_size, None, what)
    return qmodule.apply_groups(qt, z, sc, g)


def _to_float(enc: Encoded) -> np.ndarray:
    scale = need(enc.scale, f"{NAME} weight {enc.role} has no scales")
    zero = need(enc.zero, f"{NAME} weight {enc.what} has no zero points")
    return awq_to_float(enc.data, scale, zero, group_size=enc.group_size, what=enc.what)


def _to_torch(torch: Any, enc: Encoded) -> Any:
    need(enc.scale, f"{NAME} weight {enc.role} has no scales")
    zero = need(enc.zero, f"{NAME} weight {enc.what} has no zero points")
    order = torch.from_numpy(_NIBBLE_OF_COLUMN)

    def natural(words: Any) -> Any:  # AWQ's order within each word undone
        n = torch_nibbles_of_words(torch, words)
        return n.reshape(n.shape[0], -1, 8)[:, :, order].reshape(n.shape)

    return qmodule.module_to_torch(torch, enc, natural(enc.data), natural(zero))


FORMAT = Format(name=NAME, summary="AWQ 4-bit modules, GEMM packing",
                parts=MappingProxyType({k: v for k, v in qmodule.PARTS.items() if k != "g_idx"}),
                coli_formats={"I32": qmodule.CODES[NAME]}, scale_formats=qmodule.SCALE_FORMATS,
                block=qmodule.block, validate=qmodule.validator(NAME), group_size=qmodule.group_size,
                to_float=_to_float, to_torch=_to_torch, orientation=IN_OUT)
