"""The safetensors element types, and the numpy type each maps to.

Every dtype string safetensors 0.8 can write is listed, so a header that holds
(say) an ``I64`` position table or an ``F4`` tensor still parses. Which of
them a routed expert's parts may have is each format's business
(:mod:`colibri.formats`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import ml_dtypes
import numpy as np

__all__ = ["DType", "DTYPES", "lookup"]


@dataclass(frozen=True)
class DType:
    """One safetensors element type.

    ``bits`` rather than bytes is the primary size because safetensors has
    sub-byte types (F4, F6_*) whose tensors are packed; ``itemsize`` is only
    meaningful for whole-byte types and is 0 for the packed ones.
    """

    name: str
    bits: int
    numpy: np.dtype | None  # None: no exact numpy/ml_dtypes storage type

    @property
    def itemsize(self) -> int:
        """Bytes per element, or 0 for the packed sub-byte types."""
        return self.bits // 8 if self.bits % 8 == 0 else 0


def _table(entries: Iterable[DType]) -> dict[str, DType]:
    return {d.name: d for d in entries}


DTYPES: dict[str, DType] = _table(
    [
        DType("F32", 32, np.dtype(np.float32)),
        DType("F16", 16, np.dtype(np.float16)),
        DType("BF16", 16, np.dtype(ml_dtypes.bfloat16)),
        DType("F8_E4M3", 8, np.dtype(ml_dtypes.float8_e4m3fn)),
        DType("F8_E5M2", 8, np.dtype(ml_dtypes.float8_e5m2)),
        DType("F64", 64, np.dtype(np.float64)),
        DType("F8_E8M0", 8, np.dtype(ml_dtypes.float8_e8m0fnu)),
        DType("F8_E4M3FNUZ", 8, np.dtype(ml_dtypes.float8_e4m3fnuz)),
        DType("F8_E5M2FNUZ", 8, np.dtype(ml_dtypes.float8_e5m2fnuz)),
        DType("F6_E2M3", 6, None),
        DType("F6_E3M2", 6, None),
        DType("F4", 4, None),
        DType("C64", 64, np.dtype(np.complex64)),
        DType("BOOL", 8, np.dtype(np.bool_)),
        DType("U8", 8, np.dtype(np.uint8)),
        DType("I8", 8, np.dtype(np.int8)),
        DType("U16", 16, np.dtype(np.uint16)),
        DType("I16", 16, np.dtype(np.int16)),
        DType("U32", 32, np.dtype(np.uint32)),
        DType("I32", 32, np.dtype(np.int32)),
        DType("U64", 64, np.dtype(np.uint64)),
        DType("I64", 64, np.dtype(np.int64)),
    ]
)


def lookup(name: str) -> DType | None:
    """The entry for a safetensors dtype string, or None if it is unknown."""
    return DTYPES.get(name)
