"""What a format tells the rest of colibri: the :class:`Format` record, and
the plain values that pass between a format and its callers.

A format module (``plain``, ``fp8``, ``mxfp4``, ``int4``, ``gptq``,
``awq``) builds one :class:`Format`; :mod:`colibri.formats` keeps them in
one table. The checkpoint scanner hands a format the tensors of one role
(:class:`RoleParts`) and what the checkpoint's settings declare
(:class:`Declared`), and gets plain facts back (:class:`RoleFacts`); the
dequantizers hand it one role's leased arrays (:class:`Encoded`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from colibri.checkpoint.safetensors import TensorInfo
from colibri.errors import FormatError

__all__ = ["Format", "RoleParts", "RoleFacts", "Declared", "Encoded", "need", "fixed_group",
           "OUT_IN", "IN_OUT", "EITHER"]

# Format.orientation: how a format stores a projection of ``in`` inputs and ``out`` outputs.
OUT_IN = "out_in"   # (out, in), as Mixtral and nn.Linear
IN_OUT = "in_out"   # (in, out): GPTQ and AWQ modules
EITHER = "either"   # plain floats: stacked layouts hold them either way


@dataclass(frozen=True)
class RoleParts:
    """The checkpoint tensors of one role: of one expert, or of every expert
    of a layer when ``stacked`` (experts along each tensor's first dimension).

    ``where`` and ``role`` (``gate``, ``up``, ``down``, ``gate_up``) name it
    in messages; the parts a format does not have are None."""

    where: str
    role: str
    data: TensorInfo
    scale: TensorInfo | None = None
    zero: TensorInfo | None = None
    g_idx: TensorInfo | None = None
    shape: TensorInfo | None = None   # compressed-tensors' weight_shape
    stacked: bool = False

    def optional(self) -> dict[str, TensorInfo]:
        """The zero points and g_idx present, by their part name suffix."""
        found = {"zero": self.zero, "g_idx": self.g_idx}
        return {kind: info for kind, info in found.items() if info is not None}


@dataclass(frozen=True)
class Declared:
    """What the checkpoint's quantization settings say about the experts
    (None: not said). ``source`` names the file, for messages."""

    scheme: str | None = None       # GPTQ/AWQ: the format its settings name
    bits: Any = 4
    group_size: int | None = None   # GPTQ/AWQ: 0 is one group over the input
    source: str = "config.json"


@dataclass(frozen=True)
class RoleFacts:
    """What validating one role found: its logical ``(rows, columns)`` as
    stored (one expert's, in elements), its group size (0: none or not known
    from this role alone) and its number of scale groups."""

    shape: tuple[int, int]
    group_size: int = 0
    groups: int = 0


@dataclass(frozen=True)
class Encoded:
    """One role's leased arrays (numpy or torch) and what decoding needs:
    the logical ``shape`` as stored, ``group_size``, the ``block`` one scale
    covers, and ``what`` to call it in messages."""

    data: Any
    scale: Any = None
    zero: Any = None
    g_idx: Any = None
    role: str = ""
    shape: tuple[int, int] = (0, 0)
    group_size: int = 0
    block: tuple[int, int] | None = None
    what: str = ""


def need(value: Any, message: str) -> Any:
    """``value``, or a FormatError saying ``message`` when it is None."""
    if value is None:
        raise FormatError(message)
    return value


GroupRule = Callable[[str, Mapping[str, "RoleParts"], Mapping[str, RoleFacts], Declared], int]


def fixed_group(size: int) -> GroupRule:
    """The group rule of a format whose group size never varies (0: none)."""
    def rule(where: str, parts: Mapping[str, RoleParts], facts: Mapping[str, RoleFacts],
             declared: Declared) -> int:
        return size

    return rule


Validator = Callable[[RoleParts, Declared], RoleFacts]
BlockRule = Callable[[tuple[int, int], tuple[int, ...], int], tuple[int, int]]


@dataclass(frozen=True)
class Format:
    """One way of storing an expert projection: the only place colibri asks
    what a format is.

    * ``name``: the scheme name (``ExpertTensors.scheme``); ``summary`` for docs and errors.
    * ``parts``: how a checkpoint names each part (``data``, ``scale``,
      ``zero``, ``g_idx``, ``shape``), as a suffix of the projection's name.
    * ``coli_formats``: the ``ColiTensorFormat`` of each data dtype it
      accepts; ``scale_formats``: the ``ColiScaleFormat`` of each scale dtype
      (empty: unscaled). Both read from the compiled library.
    * ``block(shape, scale_shape, group_size)``: the elements
      ``(rows, columns)`` one scale covers.
    * ``validate(parts, declared)``: checks one role, returns its facts or
      raises FormatError naming the tensor; ``group_size(where, parts,
      facts, declared)``: the expert's group size, checked across its roles.
    * ``to_float(encoded)``: float32 numpy of one role in its stored
      orientation; ``to_torch(torch, encoded)`` the same in torch. Both
      return new arrays that view nothing of the lease.
    * ``orientation``: :data:`OUT_IN`, :data:`IN_OUT` or :data:`EITHER`;
      ``zero_copy``: the leased data are the weights themselves (an engine
      can compute on them in place).
    """

    name: str
    summary: str
    parts: Mapping[str, str]
    coli_formats: Mapping[str, int]
    scale_formats: Mapping[str, int]
    block: BlockRule
    validate: Validator
    group_size: GroupRule
    to_float: Callable[[Encoded], np.ndarray]
    to_torch: Callable[[Any, Encoded], Any]
    orientation: str = OUT_IN
    zero_copy: bool = False

    def coli_format(self, dtype: str) -> int:
        """``ColiTensorFormat`` of data of safetensors dtype ``dtype``."""
        found = self.coli_formats.get(dtype)
        if found is None:
            raise FormatError(f"dtype {dtype} is not usable as {self.name} data (only "
                              + ", ".join(self.coli_formats) + ")")
        return found

    def coli_scale_format(self, dtype: str) -> int:
        """``ColiScaleFormat`` of scales of safetensors dtype ``dtype``."""
        found = self.scale_formats.get(dtype)
        if found is None:
            raise FormatError(f"dtype {dtype} cannot hold {self.name} scales")
        return found
