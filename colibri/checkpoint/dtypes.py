"""The safetensors element types colibri knows, and what each maps to.

Every dtype string safetensors 0.8 can write is listed, so a header that holds
(say) an ``I64`` position table or an ``F4`` tensor still parses. Only a few of
them can be routed-expert weights: those with a ``coli_format`` (the value of
``ColiTensorFormat`` in ``csrc/tensor.h``). Block scales must be ``F32``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import ml_dtypes
import numpy as np

from colibri._ffi import lib

__all__ = [
    "DType",
    "DTYPES",
    "EXPERT_DTYPES",
    "SCALE_DTYPE",
    "COLI_TENSOR_F32",
    "COLI_TENSOR_FP8_E4M3_BLOCK",
    "COLI_TENSOR_FP4_NATIVE_BLOCK",
    "COLI_TENSOR_INT4_BLOCK",
    "COLI_TENSOR_F16",
    "COLI_TENSOR_BF16",
    "COLI_TENSOR_F8_E4M3",
    "COLI_TENSOR_F8_E5M2",
    "COLI_TENSOR_INT4_GPTQ",
    "COLI_TENSOR_INT4_AWQ",
    "COLI_SCALE_NONE",
    "COLI_SCALE_F32",
    "COLI_SCALE_UE8M0",
    "COLI_SCALE_BF16",
    "COLI_SCALE_F16",
    "coli_scale_format",
    "lookup",
    "coli_format",
]

# ColiTensorFormat and ColiScaleFormat values (csrc/tensor.h), read from the
# compiled library so that they cannot drift from it.
COLI_TENSOR_F32: int = lib.COLI_TENSOR_F32
COLI_TENSOR_FP8_E4M3_BLOCK: int = lib.COLI_TENSOR_FP8_E4M3_BLOCK
COLI_TENSOR_FP4_NATIVE_BLOCK: int = lib.COLI_TENSOR_FP4_NATIVE_BLOCK  # MXFP4
COLI_TENSOR_INT4_BLOCK: int = lib.COLI_TENSOR_INT4_BLOCK  # pack-quantized int4
COLI_TENSOR_F16: int = lib.COLI_TENSOR_F16
COLI_TENSOR_BF16: int = lib.COLI_TENSOR_BF16
COLI_TENSOR_F8_E4M3: int = lib.COLI_TENSOR_F8_E4M3
COLI_TENSOR_F8_E5M2: int = lib.COLI_TENSOR_F8_E5M2
COLI_TENSOR_INT4_GPTQ: int = lib.COLI_TENSOR_INT4_GPTQ  # GPTQ qweight, packed down the columns
COLI_TENSOR_INT4_AWQ: int = lib.COLI_TENSOR_INT4_AWQ  # AWQ GEMM qweight, packed along the rows
COLI_SCALE_NONE: int = lib.COLI_SCALE_NONE
COLI_SCALE_F32: int = lib.COLI_SCALE_F32
COLI_SCALE_UE8M0: int = lib.COLI_SCALE_UE8M0
COLI_SCALE_BF16: int = lib.COLI_SCALE_BF16
COLI_SCALE_F16: int = lib.COLI_SCALE_F16

_SCALE_FORMATS = {"F32": COLI_SCALE_F32, "U8": COLI_SCALE_UE8M0, "F8_E8M0": COLI_SCALE_UE8M0,
                  "BF16": COLI_SCALE_BF16, "F16": COLI_SCALE_F16}


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
    coli_format: int | None  # None: never usable as a routed-expert weight

    @property
    def itemsize(self) -> int:
        """Bytes per element, or 0 for the packed sub-byte types."""
        return self.bits // 8 if self.bits % 8 == 0 else 0

    @property
    def expert_usable(self) -> bool:
        return self.coli_format is not None


def _table(entries: Iterable[DType]) -> dict[str, DType]:
    return {d.name: d for d in entries}


DTYPES: dict[str, DType] = _table(
    [
        DType("F32", 32, np.dtype(np.float32), COLI_TENSOR_F32),
        DType("F16", 16, np.dtype(np.float16), COLI_TENSOR_F16),
        DType("BF16", 16, np.dtype(ml_dtypes.bfloat16), COLI_TENSOR_BF16),
        DType("F8_E4M3", 8, np.dtype(ml_dtypes.float8_e4m3fn), COLI_TENSOR_F8_E4M3),
        DType("F8_E5M2", 8, np.dtype(ml_dtypes.float8_e5m2), COLI_TENSOR_F8_E5M2),
        # Readable in headers, not usable as expert weights.
        DType("F64", 64, np.dtype(np.float64), None),
        DType("F8_E8M0", 8, np.dtype(ml_dtypes.float8_e8m0fnu), None),
        DType("F8_E4M3FNUZ", 8, np.dtype(ml_dtypes.float8_e4m3fnuz), None),
        DType("F8_E5M2FNUZ", 8, np.dtype(ml_dtypes.float8_e5m2fnuz), None),
        DType("F6_E2M3", 6, None, None),
        DType("F6_E3M2", 6, None, None),
        DType("F4", 4, None, None),
        DType("C64", 64, np.dtype(np.complex64), None),
        DType("BOOL", 8, np.dtype(np.bool_), None),
        DType("U8", 8, np.dtype(np.uint8), None),
        DType("I8", 8, np.dtype(np.int8), None),
        DType("U16", 16, np.dtype(np.uint16), None),
        DType("I16", 16, np.dtype(np.int16), None),
        DType("U32", 32, np.dtype(np.uint32), None),
        DType("I32", 32, np.dtype(np.int32), None),
        DType("U64", 64, np.dtype(np.uint64), None),
        DType("I64", 64, np.dtype(np.int64), None),
    ]
)

# Element types a routed-expert weight may have, and the one its scales must have.
EXPERT_DTYPES: frozenset[str] = frozenset(n for n, d in DTYPES.items() if d.expert_usable)
SCALE_DTYPE = "F32"


def lookup(name: str) -> DType | None:
    """The entry for a safetensors dtype string, or None if it is unknown."""
    return DTYPES.get(name)


def coli_format(name: str, scaled: bool) -> int:
    """``ColiTensorFormat`` for an expert weight of dtype ``name``.

    Block-scaled fp8 e4m3 is its own format; no other dtype takes scales.
    Raises KeyError/ValueError for a combination the C core cannot hold; the
    layout scanner validates before it gets here.
    """
    dtype = DTYPES[name]
    if dtype.coli_format is None:
        raise ValueError(f"dtype {name} is not usable as an expert weight")
    if scaled:
        if name != "F8_E4M3":
            raise ValueError(f"dtype {name} cannot carry block scales (only F8_E4M3)")
        return COLI_TENSOR_FP8_E4M3_BLOCK
    return dtype.coli_format


def coli_scale_format(name: str) -> int:
    """``ColiScaleFormat`` for scales of safetensors dtype ``name`` (U8 and
    F8_E8M0 are e8m0 exponents). Raises ValueError for any other dtype."""
    found = _SCALE_FORMATS.get(name)
    if found is None:
        raise ValueError(f"dtype {name} cannot hold scales")
    return found
