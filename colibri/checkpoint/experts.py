"""The expert data model: where each part of a routed expert lies in the
checkpoint's files (:class:`ExpertTensors`), every expert of a model
(:class:`ModelExperts`), and the C record of each role
(:class:`TensorSource`) that the store copies into ``ColiExpertSource``.

Formats are asked, never decided here: an expert's ``scheme`` names its
record in :data:`colibri.formats.FORMATS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, NamedTuple

import numpy as np

from colibri._ffi import lib
from colibri.checkpoint import dtypes
from colibri.checkpoint.safetensors import TensorInfo
from colibri.errors import UnknownExpertError
from colibri.formats import GPTQ, PLAIN, Format, format_of, role_format

__all__ = ["ROLES", "INTERLEAVED", "CONCATENATED", "ExpertTensors", "ModelExperts", "TensorSource",
           "SOURCE_FIELDS", "format_ranges"]

# The roles in the order of ColiExpertSource's tensors and of coli_view_layout's
# offsets (tests/test_constants.py checks both against the library).
ROLES: tuple[str, str, str] = ("gate", "up", "down")

# ExpertTensors.fused: how a fused gate_up tensor holds gate and up.
INTERLEAVED = "interleaved"    # gate, up, gate, up ... (gpt-oss)
CONCATENATED = "concatenated"  # all of gate, then all of up (Llama 4, transformers)

COLI_SCALE_NONE: int = lib.COLI_SCALE_NONE
# Extra parts by the end of their names: ColiPartSource.kind, and each role's number.
_PART_KINDS = (("_bias", lib.COLI_PART_BIAS), ("_zero", lib.COLI_PART_ZERO),
               ("_g_idx", lib.COLI_PART_G_IDX))
_PART_ROLES = {"gate": 0, "gate_up": 0, "up": 1, "down": 2}


class TensorSource(NamedTuple):
    """One role's ``ColiTensorSource`` (csrc/coli_sources.h), field for field:
    where its data and scales are, the C format values and the block."""

    file: int
    offset: int
    nbytes: int
    format: int
    rows: int
    columns: int
    scale_format: int = COLI_SCALE_NONE
    scale_file: int = 0
    scale_offset: int = 0
    scale_nbytes: int = 0
    block_rows: int = 0
    block_columns: int = 0


#: The field names of :class:`TensorSource`, which are ColiTensorSource's.
SOURCE_FIELDS: tuple[str, ...] = TensorSource._fields


@dataclass(frozen=True)
class ExpertTensors:
    """Where the parts of one routed expert are: each role's data, its scales
    and any extra part (biases, zero points), each a byte range of a file.

    A part cut from a stacked tensor (experts along the outer dimension) is a
    :class:`TensorInfo` named ``"tensor[e]"`` whose offset, size and shape
    are those of expert ``e``'s slice.

    * ``up`` is None when ``fused``: ``gate`` then holds the fused gate_up
      (``"interleaved"``: gate and up alternate, ``"concatenated"``: gate
      first), and its scale is ``gate_scale``.
    * ``transposed``: stored as (in, out), i.e. gate ``(hidden, inter)`` and
      down ``(inter, hidden)``, instead of Mixtral's (out, in).
    * ``scheme`` names its format in :data:`colibri.formats.FORMATS`; ``shapes`` the logical
      ``(rows, columns)`` of gate (or gate_up), up and down as stored, in
      elements (a packed 4-bit tensor holds fewer bytes than elements);
      ``group_size`` the values per scale along a row (4-bit schemes; for
      GPTQ and AWQ, which store (in, out), the input rows per scale, 0 for
      one group over the whole input).
    * ``extras``: ``(name, TensorInfo)`` of the parts beyond data and scales,
      named ``gate_bias``, ``up_bias``, ``gate_up_bias``, ``down_bias``,
      ``gate_zero``, ``up_zero``, ``gate_up_zero``, ``down_zero``,
      ``gate_g_idx``, ``up_g_idx``, ``down_g_idx``.
    """

    gate: TensorInfo
    up: TensorInfo | None
    down: TensorInfo
    gate_scale: TensorInfo | None = None
    up_scale: TensorInfo | None = None
    down_scale: TensorInfo | None = None
    extras: tuple[tuple[str, TensorInfo], ...] = ()
    scheme: str = PLAIN
    fused: str | None = None
    transposed: bool = False
    shapes: tuple[tuple[int, int] | None, ...] = ()
    group_size: int = 0

    def weight(self, role: str) -> TensorInfo | None:
        """The data part of ``role`` (``up`` is None when gate_up is fused)."""
        if role not in ROLES:
            raise KeyError(role)
        info: TensorInfo | None = getattr(self, role)
        return info

    def scale(self, role: str) -> TensorInfo | None:
        if role not in ROLES:
            raise KeyError(role)
        info: TensorInfo | None = getattr(self, f"{role}_scale")
        return info

    def shape(self, role: str) -> tuple[int, int] | None:
        """Logical ``(rows, columns)`` of ``role``'s data as stored, or None if absent."""
        w = self.weight(role)
        if w is None:
            return None
        if self.shapes:
            found = self.shapes[ROLES.index(role)]
            if found is not None:
                return found
        return (w.shape[0], w.shape[1])

    @property
    def format(self) -> Format:
        """The record of :attr:`scheme` (colibri.formats)."""
        return format_of(self.scheme)

    def role_format(self, role: str) -> Format:
        """The format of ``role``'s data (a plain or fp8 expert's unscaled
        role is plain, its scaled one fp8)."""
        return role_format(self.scheme, self.scale(role) is not None)

    def block_shape(self, role: str) -> tuple[int, int] | None:
        """Elements ``(rows, columns)`` one scale covers, or None if unscaled."""
        scale, shape = self.scale(role), self.shape(role)
        if scale is None or shape is None:
            return None
        return self.role_format(role).block(shape, scale.shape, self.group_size)

    def coli_format(self, role: str) -> int:
        """``ColiTensorFormat`` value of ``role``'s data (csrc/tensor.h)."""
        w = self.weight(role)
        if w is None:
            raise KeyError(f"{role} is fused into gate")
        return self.role_format(role).coli_format(w.dtype)

    def coli_scale_format(self, role: str) -> int:
        """``ColiScaleFormat`` value of ``role``'s scales."""
        scale = self.scale(role)
        if scale is None:
            return COLI_SCALE_NONE
        return self.role_format(role).coli_scale_format(scale.dtype)

    def source(self, role: str) -> TensorSource | None:
        """``role``'s ``ColiTensorSource``, field for field; None for the up
        of a fused gate_up (the C record stays zeroed)."""
        w, shape = self.weight(role), self.shape(role)
        if w is None or shape is None:
            return None
        scale = self.scale(role)
        if scale is None:
            return TensorSource(w.file, w.offset, w.nbytes, self.coli_format(role), *shape)
        block = self.block_shape(role)
        assert block is not None
        return TensorSource(w.file, w.offset, w.nbytes, self.coli_format(role), *shape,
                            self.coli_scale_format(role), scale.file, scale.offset, scale.nbytes, *block)

    @property
    def source_flags(self) -> int:
        """``ColiExpertSource.flags``: a fused gate_up and how it is split,
        matrices stored (in, out), GPTQ's original zero points."""
        flags = 0
        if self.fused:
            flags |= lib.COLI_SOURCE_FUSED_GATE_UP
            if self.fused == INTERLEAVED:
                flags |= lib.COLI_SOURCE_INTERLEAVED
        if self.transposed:
            flags |= lib.COLI_SOURCE_IN_OUT
        if self.scheme == GPTQ:
            flags |= lib.COLI_SOURCE_ZERO_PLUS_ONE
        return int(flags)

    @staticmethod
    def part_use(name: str, dtype: str) -> tuple[int, int, int]:
        """What extra part ``name`` (of safetensors dtype ``dtype``) is to the
        kernels: ``ColiPartSource``'s ``(kind, role, format)``."""
        for suffix, kind in _PART_KINDS:
            if name.endswith(suffix):
                role = name[:-len(suffix)]
                fmt = format_of(PLAIN).coli_formats.get(dtype, 0) if kind == lib.COLI_PART_BIAS else 0
                return int(kind), _PART_ROLES[role], int(fmt)
        return int(lib.COLI_PART_OTHER), 0, 0

    @property
    def biased(self) -> bool:
        """Whether some role has a bias."""
        return any(name.endswith("_bias") for name, _ in self.extras)

    def part_names(self) -> tuple[str | None, ...]:
        """Names of the parts in the C core's order: gate (``gate_up`` when
        fused), up, down, their scales, then the extras; None where absent."""
        first = "gate_up" if self.fused else "gate"
        names: list[str | None] = [first, None if self.up is None else "up", "down"]
        for role, prefix in ((r, first if r == "gate" else r) for r in ROLES):
            names.append(None if self.scale(role) is None else f"{prefix}_scale")
        names += [name for name, _ in self.extras]
        return tuple(names)

    def part_infos(self) -> tuple[TensorInfo | None, ...]:
        """The parts in the order of :meth:`part_names`."""
        infos: list[TensorInfo | None] = [self.gate, self.up, self.down]
        infos += [self.scale(r) for r in ROLES]
        infos += [info for _, info in self.extras]
        return tuple(infos)

    def tensors(self) -> tuple[TensorInfo, ...]:
        """Every part of the expert: each role's data then its scale, then the extras."""
        out: list[TensorInfo] = []
        for role in ROLES:
            for info in (self.weight(role), self.scale(role)):
                if info is not None:
                    out.append(info)
        out += [info for _, info in self.extras]
        return tuple(out)

    @property
    def nbytes(self) -> int:
        """Bytes of every part together: what one cache slot holds."""
        return sum(t.nbytes for t in self.tensors())

    def part_views(self) -> tuple[tuple[np.dtype, tuple[int, ...]] | None, ...]:
        """How to view the slot's bytes: numpy dtype and shape of each part
        as stored, in the order of :meth:`part_names` (None where absent)."""
        out: list[tuple[np.dtype, tuple[int, ...]] | None] = []
        for info in self.part_infos():
            if info is None:
                out.append(None)
                continue
            dt = dtypes.lookup(info.dtype)
            assert dt is not None and dt.numpy is not None  # the scanner refused the others
            out.append((np.dtype(dt.numpy), tuple(info.shape)))
        return tuple(out)


@dataclass(frozen=True)
class ModelExperts:
    """Every routed expert of a model: ``experts[layer][expert]``.

    Layers are the model's own indices (only layers with experts), sorted;
    experts of a layer are numbered 0..N-1. ``TensorInfo.file`` indexes ``files``.
    """

    files: tuple[str, ...]
    layout: str
    experts: Mapping[int, Mapping[int, ExpertTensors]]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.experts)

    def _layer(self, layer: int) -> Mapping[int, ExpertTensors]:
        found = self.experts.get(layer)
        if found is None:
            raise UnknownExpertError(
                f"layer {layer} has no routed experts (layers with experts: "
                f"{format_ranges(self.layers)})"
            )
        return found

    def num_experts(self, layer: int) -> int:
        return len(self._layer(layer))

    def expert(self, layer: int, expert: int) -> ExpertTensors:
        found = self._layer(layer).get(expert)
        if found is None:
            raise UnknownExpertError(
                f"layer {layer} has experts 0..{self.num_experts(layer) - 1}, not {expert}"
            )
        return found

    def keys(self) -> Iterator[tuple[int, int]]:
        """Every ``(layer, expert)`` in order."""
        for layer, experts in self.experts.items():
            for expert in experts:
                yield layer, expert

    def expert_nbytes(self, layer: int) -> int:
        """Bytes of one expert of ``layer`` (all experts of a layer agree)."""
        return next(iter(self._layer(layer).values())).nbytes

    def routed_nbytes(self) -> int:
        """Bytes of every routed expert of every layer."""
        return sum(self.expert_nbytes(l) * self.num_experts(l) for l in self.layers)


def format_ranges(numbers: tuple[int, ...]) -> str:
    """Numbers as "1-3, 7", so errors about 75-layer models stay one line."""
    parts: list[str] = []
    start = prev = None
    for n in numbers:
        if start is not None and prev is not None and n == prev + 1:
            prev = n
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = n
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(parts) or "none"
