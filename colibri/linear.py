"""A linear layer's weight as the checkpoint stores it, for colibri's kernels.

:class:`PackedWeight` holds one ``(outputs, inputs)`` matrix in a format the
native kernels compute in place (compressed-tensors pack-quantized int4,
FP8 with block scales, or plain floats), its scales, zero points and bias,
and describes it once to the C kernels (the ``ColiFfnMatrix`` that
:func:`colibri.kernels.linear` passes to ``coli_linear``).
:func:`read_packed` reads one from a checkpoint's safetensors by the
layer's name; :meth:`PackedWeight.to_float` decodes it with the format's
own decoder (:mod:`colibri.formats`), for reference and tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from colibri._ffi import ffi, lib
from colibri.checkpoint.safetensors import TensorInfo, read_array
from colibri.errors import FormatError
from colibri.formats import FP8_BLOCK, INT4, PLAIN, Encoded, format_of
from colibri.formats.fp8 import scale_block

__all__ = ["PackedWeight", "read_packed", "packed_scheme", "plain_weight"]

_BIAS_FORMATS = {"float32": lib.COLI_TENSOR_F32, "float16": lib.COLI_TENSOR_F16,
                 "bfloat16": lib.COLI_TENSOR_BF16}


@dataclass
class PackedWeight:
    """One linear layer's weight, stored ``(outputs, inputs)`` as ``scheme``
    (:data:`colibri.formats.INT4`, :data:`~colibri.formats.FP8_BLOCK` or
    :data:`~colibri.formats.PLAIN`), with the safetensors dtypes of its data
    and scales. ``block``: the elements one scale covers; ``bias``: one per
    output (float32, float16 or bfloat16) or None."""

    scheme: str
    shape: tuple[int, int]
    data: np.ndarray
    dtype: str
    scale: np.ndarray | None = None
    scale_dtype: str | None = None
    block: tuple[int, int] = (0, 0)
    zero: np.ndarray | None = None
    bias: np.ndarray | None = None
    _matrix: Any = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Bytes of every array held."""
        return sum(a.nbytes for a in (self.data, self.scale, self.zero, self.bias) if a is not None)

    def to_float(self) -> np.ndarray:
        """The weight as float32 ``(outputs, inputs)``, by the format's decoder."""
        enc = Encoded(data=self.data, scale=self.scale, zero=self.zero, shape=self.shape,
                      group_size=self.block[1], block=self.block, role="weight",
                      what=f"{self.scheme} linear")
        return np.asarray(format_of(self.scheme).to_float(enc), dtype=np.float32)

    def matrix(self) -> Any:
        """The ``ColiFfnMatrix *`` describing this weight (built once; it
        points into the arrays, which this object keeps)."""
        if self._matrix is None:
            self._matrix = _describe(self)
        return self._matrix


def _address(a: np.ndarray) -> Any:
    if not a.flags.c_contiguous:
        raise ValueError("a packed weight's arrays must be C-contiguous")
    return ffi.cast("const void *", int(a.__array_interface__["data"][0]))


def _describe(w: PackedWeight) -> Any:
    fmt = format_of(w.scheme)
    m = ffi.new("ColiFfnMatrix *")
    v = m.view
    v.format = fmt.coli_format(w.dtype)
    v.data = _address(w.data)
    v.data_bytes = w.data.nbytes
    v.rows, v.columns = w.shape
    if w.scale is not None:
        v.scale_format = fmt.coli_scale_format(w.scale_dtype or "")
        v.scales = _address(w.scale)
        v.scale_bytes = w.scale.nbytes
        v.block_rows, v.block_columns = w.block
    if w.zero is not None:
        m.zeros = _address(w.zero)
        m.zero_bytes = w.zero.nbytes
    if w.bias is not None:
        code = _BIAS_FORMATS.get(str(w.bias.dtype))
        if code is None:
            raise FormatError(f"a bias of {w.bias.dtype}; the kernels take float32, float16 or bfloat16")
        m.bias = _address(w.bias)
        m.bias_format = code
        m.bias_bytes = w.bias.nbytes
    return m


def packed_scheme(tensors: Mapping[str, TensorInfo], name: str) -> str | None:
    """How the checkpoint stores linear layer ``name`` (its tensors' prefix)
    when the kernels compute it as stored: :data:`~colibri.formats.INT4`
    (``name.weight_packed``), :data:`~colibri.formats.FP8_BLOCK`
    (``name.weight`` in F8_E4M3 with ``name.weight_scale_inv``), else None."""
    if f"{name}.weight_packed" in tensors:
        return INT4
    weight = tensors.get(f"{name}.weight")
    if weight is not None and weight.dtype == "F8_E4M3" and f"{name}.weight_scale_inv" in tensors:
        return FP8_BLOCK
    return None


def read_packed(tensors: Mapping[str, TensorInfo], name: str, bias: np.ndarray | None = None) -> PackedWeight:
    """Linear layer ``name``'s weight as stored (see :func:`packed_scheme`),
    read from the checkpoint's files; ``bias`` is added to it as given."""
    scheme = packed_scheme(tensors, name)
    if scheme == INT4:
        packed, scale = tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"]
        zero = tensors.get(f"{name}.weight_zero_point")
        shape_info = tensors.get(f"{name}.weight_shape")
        if shape_info is None:
            raise FormatError(f"{name}: weight_packed without weight_shape")
        rows, cols = (int(v) for v in read_array(shape_info).reshape(-1))
        if len(scale.shape) != 2 or scale.shape[0] != rows or not scale.shape[1] or cols % scale.shape[1]:
            raise FormatError(f"{name}: weight_scale {list(scale.shape)} does not fit weight_shape {[rows, cols]}")
        return PackedWeight(INT4, (rows, cols), read_array(packed), packed.dtype, read_array(scale),
                            scale.dtype, (1, cols // scale.shape[1]),
                            read_array(zero) if zero is not None else None, bias)
    if scheme == FP8_BLOCK:
        weight, scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"]
        if len(weight.shape) != 2:
            raise FormatError(f"{name}: an fp8 weight of shape {list(weight.shape)}")
        rows, cols = weight.shape
        return PackedWeight(FP8_BLOCK, (rows, cols), read_array(weight), weight.dtype, read_array(scale),
                            scale.dtype, scale_block(weight, scale), None, bias)
    raise FormatError(f"{name}: not stored in a format the kernels compute as stored "
                      f"(no {name}.weight_packed, nor an F8_E4M3 {name}.weight with weight_scale_inv)")


def plain_weight(weight: np.ndarray, bias: np.ndarray | None = None) -> PackedWeight:
    """A float32, float16 or bfloat16 ``(outputs, inputs)`` array as a :class:`PackedWeight`."""
    names = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
    dtype = names.get(str(weight.dtype))
    if dtype is None or weight.ndim != 2:
        raise FormatError(f"a plain weight must be 2-D float32, float16 or bfloat16, not {weight.dtype}{list(weight.shape)}")
    return PackedWeight(PLAIN, (int(weight.shape[0]), int(weight.shape[1])), np.ascontiguousarray(weight), dtype,
                        bias=bias)
