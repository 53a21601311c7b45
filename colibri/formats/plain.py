"""Plain floats: F32, F16, BF16, and fp8 (e4m3, e5m2) without scales.

The data is the weight itself, one element per value, so an engine can
compute on the leased bytes in place (``zero_copy``); decoding is a
conversion to float32. Every stacked layout may hold them either way round
((out, in) or (in, out)); the scanner reads which from the shapes.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from colibri._ffi import lib
from colibri.errors import FormatError
from colibri.formats.record import EITHER, Declared, Encoded, Format, RoleFacts, RoleParts, fixed_group

__all__ = ["NAME", "DTYPES", "FORMAT", "check_matrix"]

NAME = "plain"

#: The data dtypes a routed-expert weight may have, and the ColiTensorFormat of each.
DTYPES: Mapping[str, int] = MappingProxyType({
    "F32": lib.COLI_TENSOR_F32,
    "F16": lib.COLI_TENSOR_F16,
    "BF16": lib.COLI_TENSOR_BF16,
    "F8_E4M3": lib.COLI_TENSOR_F8_E4M3,
    "F8_E5M2": lib.COLI_TENSOR_F8_E5M2,
})


def check_matrix(parts: RoleParts) -> tuple[int, int]:
    """The (rows, columns) of one expert's float matrix, after checking its
    dtype and that it is a non-empty matrix (a stacked tensor's experts
    were counted by the scanner)."""
    w = parts.data
    if w.dtype not in DTYPES:
        raise FormatError(f"{parts.where}: tensor {w.name!r} has dtype {w.dtype}; "
                          "expert weights must be one of " + ", ".join(sorted(DTYPES)))
    shape = w.shape[1:] if parts.stacked else w.shape
    if len(shape) != 2 or 0 in shape:
        raise FormatError(f"{parts.where}: tensor {w.name!r} has shape {list(w.shape)}; "
                          "expert weights must be non-empty 2-D matrices")
    return shape[0], shape[1]


def _validate(parts: RoleParts, declared: Declared) -> RoleFacts:
    return RoleFacts(check_matrix(parts))


def _no_block(shape: tuple[int, int], scale_shape: tuple[int, ...], group_size: int) -> tuple[int, int]:
    raise FormatError("plain weights have no scales")


def _to_float(enc: Encoded) -> np.ndarray:
    return np.array(enc.data, dtype=np.float32, copy=True)


def _to_torch(torch: Any, enc: Encoded) -> Any:
    return enc.data.to(torch.float32, copy=True)


FORMAT = Format(
    name=NAME,
    summary="F32, F16, BF16, or fp8 without scales",
    parts=MappingProxyType({"data": ".weight"}),
    coli_formats=DTYPES,
    scale_formats=MappingProxyType({}),
    block=_no_block,
    validate=_validate,
    group_size=fixed_group(0),
    to_float=_to_float,
    to_torch=_to_torch,
    orientation=EITHER,
    zero_copy=True,
)
