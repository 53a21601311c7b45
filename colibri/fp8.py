"""Deprecated, kept for one release: block-scaled FP8 is
:mod:`colibri.formats.fp8`, and :func:`colibri.dequantize` is the one
function that dequantizes a lease.

* ``colibri.fp8.dequantize(weight, scale_inv, block)`` is
  :func:`colibri.formats.fp8.fp8_to_float`;
* ``colibri.fp8.dequantize_lease(ex)`` is ``colibri.dequantize(ex)``'s
  gate, up and down.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from colibri.dequant import dequantize as dequantize_any
from colibri.formats.fp8 import DEFAULT_BLOCK, fp8_to_float

__all__ = ["dequantize", "dequantize_lease", "DEFAULT_BLOCK"]


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"colibri.fp8.{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)


def dequantize(weight_fp8: np.ndarray, scale_inv: np.ndarray,
               block: tuple[int, int] | None = DEFAULT_BLOCK) -> np.ndarray:
    """Deprecated name of :func:`colibri.formats.fp8.fp8_to_float`."""
    _deprecated("dequantize", "colibri.formats.fp8.fp8_to_float")
    return fp8_to_float(weight_fp8, scale_inv, block)


def dequantize_lease(ex: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Deprecated: ``colibri.dequantize(ex)``'s gate, up and down."""
    _deprecated("dequantize_lease", "colibri.dequantize")
    weights = dequantize_any(ex)
    return weights["gate"], weights["up"], weights["down"]
