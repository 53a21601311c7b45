"""GPTQ 4-bit modules (AutoGPTQ, GPTQModel), the ``gptq`` and ``gptq_v2``
packings (:mod:`colibri.formats.qmodule` has what GPTQ and AWQ share).

``qweight`` I32 ``(in / 8, out)`` packs the values down the columns: input
row ``8k + n`` in bits ``4n..4n+3`` of word ``k``. ``qzeros`` I32
``(groups, out / 8)`` packs eight zero points per word along each row.
``g_idx`` I32 ``(in,)`` gives the group of each input row (act order or
not). The original format (``gptq``) stores every zero point minus one, so
``z`` is the nibble plus one, as AutoGPTQ reads it; ``gptq_v2`` stores
``z`` itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colibri.formats import qmodule
from colibri.formats.nibbles import nibbles_along_rows, torch_nibbles_of_words
from colibri.formats.record import IN_OUT, Encoded, Format, need

__all__ = ["NAME", "NAME_V2", "FORMAT", "FORMAT_V2", "gptq_to_float"]

NAME = qmodule.GPTQ
NAME_V2 = qmodule.GPTQ_V2


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
    qt = nibbles_along_rows(np.ascontiguousarray(words.T))
    rows, sc, z = qmodule.scales_and_zeros(qt, scales, nibbles_along_rows(qzeros), qzeros, what)
    if zeros_minus_one:
        z = z + 1  # uint8: 15 + 1 is 16, not 0
    held = qmodule.rows_in_group_order(g_idx, rows, what)
    g = qmodule.groups_of_rows(rows, sc.shape[0], group_size, None if held is not None else g_idx, what)
    w = qmodule.apply_groups(qt, z, sc, g)
    if held is None:
        return w
    # Input i is at the stored row holding it: a gather along the C-contiguous
    # (out, in) result's rows (a scatter by column is ten times slower).
    return np.take(w.T, np.argsort(held), axis=1).T


def _record(name: str, minus_one: bool, summary: str) -> Format:
    def to_float(enc: Encoded) -> np.ndarray:
        scale = need(enc.scale, f"{name} weight {enc.role} has no scales")
        zero = need(enc.zero, f"{name} weight {enc.what} has no zero points")
        return gptq_to_float(enc.data, scale, zero, enc.g_idx, group_size=enc.group_size,
                             zeros_minus_one=minus_one, what=enc.what)

    def to_torch(torch: Any, enc: Encoded) -> Any:
        need(enc.scale, f"{name} weight {enc.role} has no scales")
        zero = need(enc.zero, f"{name} weight {enc.what} has no zero points")
        q = torch_nibbles_of_words(torch, enc.data.t()).t()
        z = torch_nibbles_of_words(torch, zero)
        return qmodule.module_to_torch(torch, enc, q, z + 1 if minus_one else z)

    return Format(name=name, summary=summary, parts=qmodule.PARTS,
                  coli_formats={"I32": qmodule.CODES[name]}, scale_formats=qmodule.SCALE_FORMATS,
                  block=qmodule.block, validate=qmodule.validator(name), group_size=qmodule.group_size,
                  to_float=to_float, to_torch=to_torch, orientation=IN_OUT)


FORMAT = _record(NAME, True, "GPTQ 4-bit modules, zero points stored minus one (checkpoint_format gptq)")
FORMAT_V2 = _record(NAME_V2, False, "GPTQ 4-bit modules, zero points as they are (gptq_v2)")
