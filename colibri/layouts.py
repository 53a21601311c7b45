"""Map safetensors tensor names to routed experts: (layer, expert, parts).

Per-expert layouts (one tensor per role and expert):

* ``"mixtral"``: ``model.layers.{L}.block_sparse_moe.experts.{E}.w1/w3/w2.weight``
  (w1 = gate, w3 = up, w2 = down);
* ``"mlp_experts"``: ``model.layers.{L}.mlp.experts.{E}.gate_proj/up_proj/down_proj.weight``
  (Qwen2/Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4.5/5 and relatives).

Stacked layouts (experts along the outer dimension of one tensor per role;
expert ``e`` is the contiguous slice ``tensor[e]``):

* ``"gpt_oss"``: ``mlp.experts.gate_up_proj`` (gate and up interleaved) and
  ``down_proj``, with ``_bias``, float or MXFP4 (``_blocks`` + ``_scales``);
* ``"llama4"``: ``feed_forward.experts.gate_up_proj`` (concatenated) and ``down_proj``;
* ``"stacked"``: ``mlp.experts.gate_up_proj``/``down_proj`` as transformers
  holds experts in memory (concatenated).

The leading ``model.`` is optional. Shared experts, routers, dense MLPs and
everything else never match. ``layout="auto"`` picks the one built-in
layout that finds routed experts.

Formats (:data:`SCHEMES`): plain floats; DeepSeek-V3 FP8, a weight ``W``
with block scales ``W_scale_inv`` (F32, one per 128x128 block); MXFP4;
compressed-tensors pack-quantized int4 (``weight_packed``, ``weight_scale``,
optional ``weight_zero_point``, ``weight_shape``); GPTQ and AWQ 4-bit
(``qweight``, ``qzeros``, ``scales``, GPTQ's ``g_idx``, in place of a
module's ``weight``). Any other tensor that
accompanies an expert weight (``W_<something>``) is refused, because
ignoring it would silently compute with the wrong weights. docs/formats.md
has the table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Union

from .checkpoint import dtypes as _dtypes
from .errors import FormatError, UnknownExpertError
import numpy as np

from .checkpoint.config import ModuleQuant, compressed_tensors_weights, model_type, module_quant_config
from .checkpoint.safetensors import ModelSource, TensorInfo, read_model_tensors

__all__ = [
    "ROLES",
    "Layout",
    "MIXTRAL",
    "MLP_EXPERTS",
    "BUILTIN_LAYOUTS",
    "StackedLayout",
    "GPT_OSS",
    "LLAMA4",
    "STACKED",
    "STACKED_LAYOUTS",
    "AnyLayout",
    "SCHEMES",
    "PLAIN",
    "FP8_BLOCK",
    "MXFP4",
    "INT4",
    "GPTQ",
    "GPTQ_V2",
    "AWQ",
    "INTERLEAVED",
    "CONCATENATED",
    "ExpertTensors",
    "ModelExperts",
    "scale_block",
    "detect_layout",
    "experts_from_tensors",
    "scan_model",
]

# The roles in the order of ColiExpertSource's tensors and of coli_view_layout's
# offsets (tests/test_constants.py checks both against the library).
ROLES: tuple[str, str, str] = ("gate", "up", "down")
_NUMBER = re.compile(r"[0-9]+")


def _match_role(pattern: Union[re.Pattern[str], str], roles: Mapping[str, str],
                name: str) -> tuple[re.Match[str], str] | None:
    """The full match of ``name`` against a layout's (compiled) pattern and
    the role its ``role`` group maps to; None if it does not match or names
    no role of ``roles``."""
    assert isinstance(pattern, re.Pattern)
    found = pattern.fullmatch(name)
    if found is None:
        return None
    role = roles.get(found.group("role"))
    return None if role is None else (found, role)


@dataclass(frozen=True)
class Layout:
    """A naming scheme for routed-expert weights.

    ``pattern`` (a string or compiled regex) must match a whole tensor name and
    have the named groups ``layer`` and ``expert`` (decimal numbers) and
    ``role``; ``roles`` maps the captured role text to ``"gate"``, ``"up"`` or
    ``"down"`` (each of the three must be reachable). A name whose role text is
    not in ``roles`` is not an expert weight. ``scale_suffix`` names the block
    scale of a weight (``weight name + suffix``); ``None`` means the layout has
    no scales. Example::

        Layout("my_moe",
               r"blocks\\.(?P<layer>\\d+)\\.moe\\.(?P<expert>\\d+)\\.(?P<role>wi|wg|wo)",
               {"wg": "gate", "wi": "up", "wo": "down"})
    """

    name: str
    pattern: Union[re.Pattern[str], str]
    roles: Mapping[str, str]
    scale_suffix: str | None = "_scale_inv"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise FormatError(f"layout name must be a non-empty string, got {self.name!r}")
        pattern = self.pattern
        if isinstance(pattern, str):
            try:
                pattern = re.compile(pattern)
            except re.error as exc:
                raise FormatError(f"layout {self.name!r}: bad pattern: {exc}") from None
        if not isinstance(pattern, re.Pattern) or not isinstance(pattern.pattern, str):
            raise FormatError(f"layout {self.name!r}: pattern must be a str regex")
        missing = {"layer", "expert", "role"} - set(pattern.groupindex)
        if missing:
            raise FormatError(
                f"layout {self.name!r}: pattern lacks the named group(s) "
                + ", ".join(sorted(missing))
            )
        if not isinstance(self.roles, Mapping):
            raise FormatError(f"layout {self.name!r}: roles must be a mapping")
        roles = dict(self.roles)
        for text, role in roles.items():
            if not isinstance(text, str) or role not in ROLES:
                raise FormatError(
                    f"layout {self.name!r}: roles maps {text!r} to {role!r}; "
                    "keys are role texts, values one of gate, up, down"
                )
        unreachable = set(ROLES) - set(roles.values())
        if unreachable:
            raise FormatError(
                f"layout {self.name!r}: no role text maps to " + ", ".join(sorted(unreachable))
            )
        if self.scale_suffix is not None and (
            not isinstance(self.scale_suffix, str) or not self.scale_suffix
        ):
            raise FormatError(f"layout {self.name!r}: scale_suffix must be a non-empty str or None")
        # Frozen: normalise through object.__setattr__ (compiled regex, read-only roles).
        object.__setattr__(self, "pattern", pattern)
        object.__setattr__(self, "roles", MappingProxyType(roles))

    def __hash__(self) -> int:  # mappingproxy is unhashable; hash what defines us
        pattern = self.pattern
        assert isinstance(pattern, re.Pattern)
        return hash((self.name, pattern.pattern, pattern.flags,
                     tuple(sorted(self.roles.items())), self.scale_suffix))

    def match(self, name: str) -> tuple[int, int, str] | None:
        """``(layer, expert, role)`` if ``name`` is an expert weight, else None."""
        hit = _match_role(self.pattern, self.roles, name)
        if hit is None:
            return None
        found, role = hit
        numbers = []
        for group in ("layer", "expert"):
            text = found.group(group)
            # A custom regex could capture "x" or "-1"; that is a layout bug.
            if text is None or not _NUMBER.fullmatch(text):
                raise FormatError(
                    f"layout {self.name!r}: tensor {name!r} gives {group} {text!r}, "
                    "not a decimal number"
                )
            numbers.append(int(text))
        return numbers[0], numbers[1], role


MIXTRAL = Layout(
    "mixtral",
    r"(?:model\.)?layers\.(?P<layer>[0-9]+)\.block_sparse_moe\.experts\."
    r"(?P<expert>[0-9]+)\.(?P<role>w[123])\.weight",
    {"w1": "gate", "w3": "up", "w2": "down"},
)
MLP_EXPERTS = Layout(
    "mlp_experts",
    r"(?:model\.)?layers\.(?P<layer>[0-9]+)\.mlp\.experts\."
    r"(?P<expert>[0-9]+)\.(?P<role>gate_proj|up_proj|down_proj)\.weight",
    {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
)
BUILTIN_LAYOUTS: Mapping[str, Layout] = MappingProxyType(
    {MIXTRAL.name: MIXTRAL, MLP_EXPERTS.name: MLP_EXPERTS}
)


# The block edge every FP8 checkpoint we know uses (weight_block_size [128, 128]).
_CONVENTIONAL_BLOCK = 128


def _block_edge(size: int, count: int) -> int | None:
    """Edge of the blocks that cut ``size`` elements into ``count`` scales.

    Any block b with ceil(size / b) == count fits. When the dimension is not a
    multiple of the block several b fit (200 rows in 2 scales: 100..199); the
    quantisers pad the last block, so the conventional 128 wins when it fits,
    otherwise the smallest fitting block, ceil(size / count).
    """
    if size <= 0 or count <= 0 or count > size:
        return None
    if -(-size // _CONVENTIONAL_BLOCK) == count:
        return _CONVENTIONAL_BLOCK
    block = -(-size // count)
    return block if -(-size // block) == count else None


def scale_block(weight: TensorInfo, scale: TensorInfo) -> tuple[int, int]:
    """Block shape ``(block_rows, block_columns)`` one scale value covers.

    Derived from the shapes and checked to tile the weight: a (7168, 2048)
    weight with (56, 16) scales has 128x128 blocks, a (64, 96) weight with
    (2, 3) scales 32x32 blocks. Raises FormatError when no block size gives
    ``scale.shape == ceil(weight.shape / block)``.
    """
    if len(weight.shape) != 2 or len(scale.shape) != 2:
        raise FormatError(
            f"scale {scale.name!r} {list(scale.shape)} of weight {weight.name!r} "
            f"{list(weight.shape)}: both must be 2-D"
        )
    rows = _block_edge(weight.shape[0], scale.shape[0])
    cols = _block_edge(weight.shape[1], scale.shape[1])
    if rows is None or cols is None:
        raise FormatError(
            f"scale {scale.name!r} has shape {list(scale.shape)}, which does not "
            f"tile weight {weight.name!r} of shape {list(weight.shape)} into blocks"
        )
    return rows, cols


# How an expert's weights are stored (ExpertTensors.scheme).
PLAIN = "plain"            # F32/F16/BF16/unscaled fp8, no scales
FP8_BLOCK = "fp8_block"    # F8_E4M3 with F32 block scales (DeepSeek-V3)
MXFP4 = "mxfp4"            # e2m1 pairs per byte, one e8m0 scale per 32 values (gpt-oss)
INT4 = "int4"              # compressed-tensors pack-quantized: 8 int4 per int32, group scales
GPTQ = "gptq"              # GPTQ qweight/qzeros/scales/g_idx, zeros stored minus one (v1)
GPTQ_V2 = "gptq_v2"        # the same with zeros stored as they are (checkpoint_format gptq_v2)
AWQ = "awq"                # AWQ GEMM qweight/qzeros/scales, packed along rows in AWQ's order
SCHEMES: tuple[str, ...] = (PLAIN, FP8_BLOCK, MXFP4, INT4, GPTQ, GPTQ_V2, AWQ)
# The GPTQ/AWQ family: (in, out) matrices, per-input-row groups of scales.
QUANT_MODULE_SCHEMES: tuple[str, ...] = (GPTQ, GPTQ_V2, AWQ)

# ExpertTensors.fused: how a fused gate_up tensor holds gate and up.
INTERLEAVED = "interleaved"    # gate, up, gate, up ... (gpt-oss)
CONCATENATED = "concatenated"  # all of gate, then all of up (Llama 4, transformers)


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
    * ``scheme`` is one of :data:`SCHEMES`; ``shapes`` the logical
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

    def block_shape(self, role: str) -> tuple[int, int] | None:
        """Elements ``(rows, columns)`` one scale covers, or None if unscaled."""
        scale, w = self.scale(role), self.weight(role)
        if scale is None or w is None:
            return None
        if self.scheme in (MXFP4, INT4):
            return (1, self.group_size)
        if self.scheme in QUANT_MODULE_SCHEMES:
            shape = self.shape(role)
            assert shape is not None
            return (self.group_size or shape[0], 1)
        return scale_block(w, scale)

    def coli_format(self, role: str) -> int:
        """``ColiTensorFormat`` value of ``role``'s data (csrc/tensor.h)."""
        w = self.weight(role)
        if w is None:
            raise KeyError(f"{role} is fused into gate")
        if self.scheme == MXFP4:
            return _dtypes.COLI_TENSOR_FP4_NATIVE_BLOCK
        if self.scheme == INT4:
            return _dtypes.COLI_TENSOR_INT4_BLOCK
        if self.scheme in (GPTQ, GPTQ_V2):
            return _dtypes.COLI_TENSOR_INT4_GPTQ
        if self.scheme == AWQ:
            return _dtypes.COLI_TENSOR_INT4_AWQ
        return _dtypes.coli_format(w.dtype, self.scale(role) is not None)

    def coli_scale_format(self, role: str) -> int:
        """``ColiScaleFormat`` value of ``role``'s scales."""
        scale = self.scale(role)
        if scale is None:
            return _dtypes.COLI_SCALE_NONE
        return _dtypes.coli_scale_format(scale.dtype)

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
                f"{_ranges(self.layers)})"
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


def _ranges(numbers: tuple[int, ...]) -> str:
    """"1-3, 7" style, so errors about 75-layer models stay one line."""
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


def _describe(files: tuple[str, ...] | list[str]) -> str:
    if len(files) <= 2:
        return ", ".join(files) or "no files"
    return f"{files[0]} and {len(files) - 1} more files"


@dataclass(frozen=True)
class StackedLayout:
    """Experts stacked along the outer dimension of one tensor per role, the
    way transformers holds them in memory: ``tensor[e]`` is expert ``e``.

    ``pattern`` matches a whole role tensor name and has the named groups
    ``layer`` and ``role``; ``roles`` maps the role text to ``"gate_up"``,
    ``"gate"``, ``"up"`` or ``"down"``. A role tensor ``T`` may come with
    ``T_bias`` (one bias row per expert), or be MXFP4 as ``T_blocks`` and
    ``T_scales`` instead of ``T``, or compressed-tensors pack-quantized int4
    as ``T.weight_packed``, ``T.weight_scale``, ``T.weight_shape`` and
    optionally ``T.weight_zero_point``, each with the experts stacked along
    the first dimension (llm-compressor's compressed 3-D MoE repack writes
    these names). ``fused`` says how a gate_up holds gate
    and up (:data:`INTERLEAVED` or :data:`CONCATENATED`). The orientation
    ((out, in) as Mixtral, or (in, out)) is read from the shapes.
    """

    name: str
    pattern: Union[re.Pattern[str], str]
    roles: Mapping[str, str]
    fused: str = CONCATENATED

    SUFFIXES = ("_bias", "_blocks", "_scales", ".weight_packed", ".weight_scale", ".weight_shape",
                ".weight_zero_point")

    def __post_init__(self) -> None:
        pattern = re.compile(self.pattern) if isinstance(self.pattern, str) else self.pattern
        missing = {"layer", "role"} - set(pattern.groupindex)
        if missing:
            raise FormatError(f"layout {self.name!r}: pattern lacks the named group(s) "
                              + ", ".join(sorted(missing)))
        if self.fused not in (INTERLEAVED, CONCATENATED):
            raise FormatError(f"layout {self.name!r}: fused must be {INTERLEAVED!r} or {CONCATENATED!r}")
        for text, role in self.roles.items():
            if role not in ("gate_up", "gate", "up", "down"):
                raise FormatError(f"layout {self.name!r}: roles maps {text!r} to {role!r}")
        object.__setattr__(self, "pattern", pattern)
        object.__setattr__(self, "roles", MappingProxyType(dict(self.roles)))

    def __hash__(self) -> int:
        pattern = self.pattern
        assert isinstance(pattern, re.Pattern)
        return hash((self.name, pattern.pattern, tuple(sorted(self.roles.items())), self.fused))

    def match_base(self, name: str) -> tuple[int, str] | None:
        """``(layer, role)`` if ``name`` is a role tensor (no suffix), else None."""
        hit = _match_role(self.pattern, self.roles, name)
        if hit is None:
            return None
        found, role = hit
        text = found.group("layer")
        if text is None or not _NUMBER.fullmatch(text):
            return None
        return int(text), role

    def match(self, name: str) -> tuple[int, str, str] | None:
        """``(layer, role, suffix)`` for a role tensor or one of its known
        companions (suffix ``""`` or one of :attr:`SUFFIXES`)."""
        hit = self.match_base(name)
        if hit is not None:
            return hit[0], hit[1], ""
        for suffix in self.SUFFIXES:
            if name.endswith(suffix):
                hit = self.match_base(name[: -len(suffix)])
                if hit is not None:
                    return hit[0], hit[1], suffix
        return None


GPT_OSS = StackedLayout(
    "gpt_oss",
    r"(?:model\.)?layers\.(?P<layer>[0-9]+)\.mlp\.experts\.(?P<role>gate_up_proj|down_proj)",
    {"gate_up_proj": "gate_up", "down_proj": "down"},
    INTERLEAVED,
)
LLAMA4 = StackedLayout(
    "llama4",
    r"(?:language_model\.)?(?:model\.)?layers\.(?P<layer>[0-9]+)\.feed_forward\.experts\."
    r"(?P<role>gate_up_proj|down_proj)",
    {"gate_up_proj": "gate_up", "down_proj": "down"},
    CONCATENATED,
)
STACKED = StackedLayout(
    "stacked",
    r"(?:model\.)?layers\.(?P<layer>[0-9]+)\.(?:mlp|block_sparse_moe)\.experts\."
    r"(?P<role>gate_up_proj|gate_proj|up_proj|down_proj)",
    {"gate_up_proj": "gate_up", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
    CONCATENATED,
)
STACKED_LAYOUTS: Mapping[str, StackedLayout] = MappingProxyType(
    {GPT_OSS.name: GPT_OSS, LLAMA4.name: LLAMA4, STACKED.name: STACKED}
)
AnyLayout = Union[Layout, StackedLayout]


def detect_layout(names: Mapping[str, object] | list[str],
                  files: tuple[str, ...] = ()) -> AnyLayout:
    """The single built-in layout that matches some tensor name.

    Stacked ``mlp.experts.gate_up_proj`` tensors are gpt-oss (interleaved)
    when they come with biases or MXFP4 blocks, or when the config.json
    beside the files says ``model_type`` gpt_oss; otherwise they are
    transformers' own stacking (concatenated).
    """
    # A pack-quantized weight W is stored as W_packed; a GPTQ/AWQ module M's
    # weight M.weight as M.qweight.
    weights = [name[: -len("_packed")] if name.endswith(".weight_packed")
               else name[: -len("qweight")] + "weight" if name.endswith(".qweight") else name
               for name in names]
    hits: list[AnyLayout] = [
        layout for layout in BUILTIN_LAYOUTS.values()
        if any(layout.match(name) is not None for name in weights)
    ]
    stacked = [layout for layout in STACKED_LAYOUTS.values()
               if any(layout.match(name) is not None for name in names)]
    if GPT_OSS in stacked:
        marked = any((hit := GPT_OSS.match(name)) is not None and hit[2] in ("_bias", "_blocks")
                     for name in names)
        if marked or model_type(files) == "gpt_oss":
            stacked = [layout for layout in stacked if layout is not STACKED]
        else:
            stacked = [layout for layout in stacked if layout is not GPT_OSS]
    hits += stacked
    if not hits:
        raise FormatError(
            f"no routed experts found in {_describe(files)}: tried layouts "
            + ", ".join([*BUILTIN_LAYOUTS, *STACKED_LAYOUTS])
            + " (pass a custom colibri.layouts.Layout for other naming schemes)"
        )
    if len(hits) > 1:
        raise FormatError(
            f"ambiguous layout in {_describe(files)}: tensors match "
            + " and ".join(h.name for h in hits)
            + "; pass layout= explicitly"
        )
    return hits[0]


def _choose_layout(layout: Union[str, AnyLayout], names: Mapping[str, TensorInfo],
                   files: tuple[str, ...]) -> AnyLayout:
    if isinstance(layout, (Layout, StackedLayout)):
        return layout
    if layout == "auto":
        return detect_layout(names, files)
    if isinstance(layout, str) and layout in BUILTIN_LAYOUTS:
        return BUILTIN_LAYOUTS[layout]
    if isinstance(layout, str) and layout in STACKED_LAYOUTS:
        return STACKED_LAYOUTS[layout]
    raise FormatError(
        f"unknown layout {layout!r}: use 'auto', "
        + ", ".join(repr(n) for n in [*BUILTIN_LAYOUTS, *STACKED_LAYOUTS])
        + " or a colibri.layouts.Layout"
    )


def _companions(tensors: Mapping[str, TensorInfo], weights: set[str],
                layout: Layout) -> dict[str, TensorInfo]:
    """Scale tensors of matched weights; refuse any other ``W_<suffix>`` tensor."""
    scales: dict[str, TensorInfo] = {}
    for name, info in tensors.items():
        if name in weights:
            continue
        tail_start = name.rfind(".") + 1
        cut = name.find("_", tail_start)
        while cut != -1:
            base = name[:cut]
            if base in weights:
                suffix = name[cut:]
                if suffix != layout.scale_suffix:
                    raise FormatError(
                        f"tensor {name!r} ({info.path}) accompanies expert weight "
                        f"{base!r}, but layout {layout.name!r} only knows "
                        + (f"scale suffix {layout.scale_suffix!r}" if layout.scale_suffix
                           else "unscaled weights")
                        + "; this quantisation scheme is not supported"
                    )
                scales[base] = info
                break
            cut = name.find("_", cut + 1)
        else:
            # A scale whose weight is missing: report it instead of ignoring it.
            scale_suffix = layout.scale_suffix
            if scale_suffix and name.endswith(scale_suffix):
                base = name[: -len(scale_suffix)]
                if base not in weights and layout.match(base) is not None:
                    raise FormatError(
                        f"scale tensor {name!r} ({info.path}) has no weight {base!r}"
                    )
    return scales


def _check_expert(layer: int, expert: int, ex: ExpertTensors) -> None:
    where = f"layer {layer} expert {expert}"
    for role in ROLES:
        w = ex.weight(role)
        assert w is not None  # per-expert layouts never fuse
        if ex.scheme == INT4 or ex.scheme in QUANT_MODULE_SCHEMES:
            continue  # checked by _int4_role / _quant_module_role
        if w.dtype not in _dtypes.EXPERT_DTYPES:
            raise FormatError(
                f"{where}: {role} tensor {w.name!r} has dtype {w.dtype}; expert weights "
                "must be one of " + ", ".join(sorted(_dtypes.EXPERT_DTYPES))
            )
        if len(w.shape) != 2 or 0 in w.shape:
            raise FormatError(
                f"{where}: {role} tensor {w.name!r} has shape {list(w.shape)}; "
                "expert weights must be non-empty 2-D matrices"
            )
        s = ex.scale(role)
        if s is None:
            continue
        if w.dtype != "F8_E4M3":
            raise FormatError(
                f"{where}: {role} weight {w.name!r} is {w.dtype} but has scale "
                f"{s.name!r}; only F8_E4M3 weights take block scales"
            )
        if s.dtype != _dtypes.SCALE_DTYPE:
            raise FormatError(
                f"{where}: scale {s.name!r} has dtype {s.dtype}; scales must be "
                f"{_dtypes.SCALE_DTYPE}"
            )
        try:
            scale_block(w, s)
        except FormatError as exc:
            raise FormatError(f"{where}: {exc}") from None
    gate, up, down = ex.shape("gate"), ex.shape("up"), ex.shape("down")
    assert gate is not None and down is not None
    if up != gate or down != (gate[1], gate[0]):
        raise FormatError(
            f"{where}: shapes gate {list(gate)}, up {list(up or ())}, down {list(down)}; "
            "expected gate (I, H), up (I, H), down (H, I)"
        )


def _signature(ex: ExpertTensors) -> tuple[object, ...]:
    """What must be equal across the experts of one layer."""
    out: list[object] = [ex.scheme, ex.fused, ex.transposed, ex.shapes, ex.group_size]
    for name, t in zip(ex.part_names(), ex.part_infos()):
        out.append(None if t is None else (name, t.dtype, t.shape))
    return tuple(out)


def _describe_signature(ex: ExpertTensors) -> str:
    parts = []
    for name, t in zip(ex.part_names(), ex.part_infos()):
        if t is not None:
            parts.append(f"{name} {t.dtype}{list(t.shape)}")
    return ", ".join(parts)


# compressed-tensors pack-quantized: the weight W of a Linear is stored as
# W_packed (I32, 8 values per word) with these companions.
_INT4_SUFFIXES = ("_packed", "_scale", "_zero_point", "_shape")
_INT4_SCALE_DTYPES = ("F32", "BF16", "F16")


def _read_int_tensor(info: Any) -> np.ndarray:
    """The little-endian I32 or I64 values of a tensor the caller checked is small."""
    dt = _dtypes.lookup(info.dtype)
    assert dt is not None and dt.numpy is not None
    try:
        with open(info.path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.nbytes)
    except OSError as exc:
        raise FormatError(f"cannot read {info.name!r} from {info.path}: {exc}") from None
    if len(raw) != info.nbytes:
        raise FormatError(f"{info.path} ends inside tensor {info.name!r}")
    return np.frombuffer(raw, dtype=dt.numpy.newbyteorder("<"))

def _read_small(info: TensorInfo) -> np.ndarray:
    """The values of a small integer tensor (a weight_shape), read from its file."""
    if info.dtype not in ("I32", "I64") or info.nbytes > 64:
        raise FormatError(f"tensor {info.name!r} ({info.path}) must be a small I32 or I64 "
                          f"tensor, not {info.dtype}{list(info.shape)}")
    return _read_int_tensor(info).reshape(-1)


def _check_int4_columns_and_bits(where: str, name: str, cols: int, config: Mapping[str, Any]) -> None:
    """A pack-quantized int4 weight of ``cols`` columns, as config.json describes it."""
    if cols % 8:
        raise FormatError(f"{where}: {name!r}: {cols} columns are not a multiple of 8; "
                          "padded int4 rows are not supported")
    bits = config.get("num_bits", 4)
    if bits != 4:
        raise FormatError(f"{where}: {name!r}: num_bits {bits} in config.json; "
                          "only 4-bit pack-quantized weights are supported")


def _check_int4_group(where: str, scale_name: str, group: int, config: Mapping[str, Any]) -> None:
    """The groups the scales imply agree with config.json's group_size."""
    want_group = config.get("group_size")
    if isinstance(want_group, int) and want_group > 0 and want_group != group:
        raise FormatError(f"{where}: scale {scale_name!r} has groups of {group} columns but "
                          f"config.json says group_size {want_group}")

def _int4_role(where: str, parts: dict[str, TensorInfo], config: Mapping[str, object]
               ) -> tuple[tuple[int, int], int]:
    """Validates one pack-quantized weight; returns its (rows, columns) and group size."""
    packed = parts["_packed"]
    base = packed.name[: -len("_packed")]
    for suffix in ("_scale", "_shape"):
        if suffix not in parts:
            raise FormatError(f"{where}: packed weight {packed.name!r} has no {base + suffix!r}")
    if packed.dtype != "I32" or len(packed.shape) != 2:
        raise FormatError(f"{where}: {packed.name!r} is {packed.dtype}{list(packed.shape)}; "
                          "a packed int4 weight is a 2-D I32 tensor")
    shape_values = _read_small(parts["_shape"])
    if shape_values.shape != (2,) or (shape_values <= 0).any():
        raise FormatError(f"{where}: {parts['_shape'].name!r} holds {shape_values.tolist()}, "
                          "not two positive sizes")
    rows, cols = int(shape_values[0]), int(shape_values[1])
    if packed.shape != (rows, -(-cols // 8)):
        raise FormatError(
            f"{where}: packed tensor {packed.name!r} has shape {list(packed.shape)}, but "
            f"weight_shape [{rows}, {cols}] packs into [{rows}, {-(-cols // 8)}] I32 words")
    _check_int4_columns_and_bits(where, packed.name, cols, config)
    scale = parts["_scale"]
    if scale.dtype not in _INT4_SCALE_DTYPES or len(scale.shape) != 2 \
            or scale.shape[0] != rows or scale.shape[1] <= 0 or cols % scale.shape[1]:
        raise FormatError(
            f"{where}: scale {scale.name!r} is {scale.dtype}{list(scale.shape)}; a weight of "
            f"shape [{rows}, {cols}] needs [{rows}, groups] scales ({'/'.join(_INT4_SCALE_DTYPES)}) "
            "with groups dividing the columns")
    group = cols // scale.shape[1]
    _check_int4_group(where, scale.name, group, config)
    zero = parts.get("_zero_point")
    if zero is not None and (zero.dtype != "I32" or zero.shape != (-(-rows // 8), scale.shape[1])):
        raise FormatError(
            f"{where}: zero point {zero.name!r} is {zero.dtype}{list(zero.shape)}; expected "
            f"I32{[-(-rows // 8), scale.shape[1]]} (8 packed int4 per word down each column)")
    return (rows, cols), group


def _int4_experts(chosen: Layout, tensors: Mapping[str, TensorInfo]
                  ) -> dict[str, dict[str, TensorInfo]]:
    """Pack-quantized weights by base name (``...gate_proj.weight``): their parts."""
    bases: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        if name.endswith(".weight_packed") and chosen.match(name[: -len("_packed")]):
            bases[name[: -len("_packed")]] = {"_packed": info}
    if not bases:
        return bases
    for name, info in tensors.items():
        tail = name.rfind(".") + 1
        cut = name.find("_", tail)
        if cut == -1 or name[:cut] not in bases:
            continue
        suffix = name[cut:]
        if suffix == "_g_idx":
            raise FormatError(f"tensor {name!r} ({info.path}): activation ordering (g_idx) "
                              "is not supported")
        if suffix not in _INT4_SUFFIXES:
            raise FormatError(f"tensor {name!r} ({info.path}) accompanies packed weight "
                              f"{name[:cut] + '_packed'!r}, but {suffix!r} is not a "
                              "pack-quantized part")
        bases[name[:cut]][suffix] = info
    return bases


def _slice(info: TensorInfo, expert: int, count: int) -> TensorInfo:
    per = info.nbytes // count
    return TensorInfo(name=f"{info.name}[{expert}]", file=info.file, path=info.path,
                      dtype=info.dtype, shape=tuple(info.shape[1:]),
                      offset=info.offset + expert * per, nbytes=per)


def _stacked_experts(files: tuple[str, ...], tensors: Mapping[str, TensorInfo],
                     chosen: StackedLayout) -> ModelExperts:
    found: dict[int, dict[str, dict[str, TensorInfo]]] = {}
    for name, info in tensors.items():
        hit = chosen.match(name)
        if hit is not None:
            layer, role, suffix = hit
            found.setdefault(layer, {}).setdefault(role, {})[suffix] = info
    if not found:
        raise FormatError(
            f"layout {chosen.name!r} matches no routed-expert tensor in {_describe(files)}")
    bases = {parts[key].name[: len(parts[key].name) - len(key)]
             for roles in found.values() for parts in roles.values() for key in parts}
    for name, info in tensors.items():
        if chosen.match(name) is not None:
            continue
        tail = name.rfind(".")
        cuts = [tail] if tail > 0 else []
        cut = name.find("_", tail + 1)
        while cut != -1:
            cuts.append(cut)
            cut = name.find("_", cut + 1)
        for cut in cuts:
            if name[:cut] in bases:
                if name.endswith(".weight_g_idx"):
                    raise FormatError(f"tensor {name!r} ({info.path}): activation ordering (g_idx) "
                                      "is not supported")
                raise FormatError(
                    f"tensor {name!r} ({info.path}) accompanies expert tensor {name[:cut]!r}, "
                    f"but layout {chosen.name!r} only knows the suffixes "
                    + ", ".join(StackedLayout.SUFFIXES))
    config = compressed_tensors_weights(files) if any(".weight_packed" in parts for roles in found.values()
                                         for parts in roles.values()) else {}
    result: dict[int, Mapping[int, ExpertTensors]] = {}
    for layer in sorted(found):
        result[layer] = _stacked_layer(layer, found[layer], chosen, config)
    return ModelExperts(files=files, layout=chosen.name, experts=MappingProxyType(result))


def _stacked_layer(layer: int, roles: dict[str, dict[str, TensorInfo]],
                   chosen: StackedLayout, config: Mapping[str, object]) -> Mapping[int, ExpertTensors]:
    where = f"layer {layer}"
    fused = "gate_up" in roles
    data_roles = ["gate_up", "down"] if fused else ["gate", "up", "down"]
    if fused and ("gate" in roles or "up" in roles):
        raise FormatError(f"{where}: has both a fused gate_up and a separate gate or up tensor")
    for role in data_roles:
        if role not in roles:
            have = ", ".join(repr(t.name) for parts in roles.values() for t in parts.values())
            raise FormatError(f"{where}: no stacked {role} tensor (found {have})")
    schemes: dict[str, str] = {}
    count: int | None = None
    count_from = ""
    logical: dict[str, tuple[int, int]] = {}

    def experts_of(info: TensorInfo, ndim: int) -> None:
        nonlocal count, count_from
        if len(info.shape) != ndim or 0 in info.shape:
            raise FormatError(f"{where}: {info.name!r} has shape {list(info.shape)}; expected a "
                              f"non-empty {ndim}-D tensor with experts along the first dimension")
        if count is None:
            count, count_from = info.shape[0], info.name
        elif info.shape[0] != count:
            raise FormatError(f"{where}: {info.name!r} stacks {info.shape[0]} experts but "
                              f"{count_from!r} stacks {count}")

    groups: dict[str, int] = {}
    for role in data_roles:
        parts = roles[role]
        int4_parts = [key for key in parts if key.startswith(".weight_")]
        if int4_parts:
            for other in ("", "_blocks", "_scales"):
                if other in parts:
                    raise FormatError(f"{where}: {parts[other].name!r} and the pack-quantized "
                                      f"{parts[int4_parts[0]].name!r} are both the {role} tensor")
            for key in (".weight_packed", ".weight_scale", ".weight_shape"):
                if key not in parts:
                    have = ".weight_packed" if ".weight_packed" in parts else int4_parts[0]
                    seen = parts[have]
                    base = seen.name[: len(seen.name) - len(have)]
                    raise FormatError(f"{where}: pack-quantized {role} {seen.name!r} has no "
                                      f"{base + key!r}")
            experts_of(parts[".weight_packed"], 3)
            for key in (".weight_scale", ".weight_zero_point"):
                if key in parts:
                    experts_of(parts[key], 3)
            experts_of(parts[".weight_shape"], 2)
            logical[role], groups[role] = _stacked_int4_role(where, role, parts, config)
            schemes[role] = INT4
        elif "_blocks" in parts or "_scales" in parts:
            blocks, scales = parts.get("_blocks"), parts.get("_scales")
            if blocks is None or scales is None:
                present = blocks or scales
                assert present is not None
                missing = present.name.rsplit("_", 1)[0] + ("_scales" if scales is None else "_blocks")
                raise FormatError(f"{where}: MXFP4 tensor {present.name!r} has no {missing!r}")
            if "" in parts:
                raise FormatError(f"{where}: {parts[''].name!r} is stored both plain and as MXFP4 "
                                  f"blocks {blocks.name!r}")
            experts_of(blocks, 4)
            if blocks.dtype != "U8" or blocks.shape[3] != 16:
                raise FormatError(f"{where}: MXFP4 blocks {blocks.name!r} are "
                                  f"{blocks.dtype}{list(blocks.shape)}; expected U8 [experts, "
                                  "rows, blocks, 16] (32 e2m1 values in 16 bytes)")
            if scales.dtype not in ("U8", "F8_E8M0") or scales.shape != blocks.shape[:3]:
                raise FormatError(f"{where}: MXFP4 scales {scales.name!r} are "
                                  f"{scales.dtype}{list(scales.shape)}; blocks {blocks.name!r} "
                                  f"need U8{list(blocks.shape[:3])}")
            schemes[role] = MXFP4
            logical[role] = (blocks.shape[1], blocks.shape[2] * 32)
        else:
            data = parts[""]
            experts_of(data, 3)
            if data.dtype not in _dtypes.EXPERT_DTYPES:
                raise FormatError(f"{where}: {data.name!r} has dtype {data.dtype}; expert weights "
                                  "must be one of " + ", ".join(sorted(_dtypes.EXPERT_DTYPES)))
            schemes[role] = PLAIN
            logical[role] = (data.shape[1], data.shape[2])
    if len(set(schemes.values())) != 1:
        raise FormatError(f"{where}: roles mix formats: "
                          + ", ".join(f"{r} {s}" for r, s in schemes.items()))
    scheme = schemes["down"]
    # Orientation: (out, in) as Mixtral, or (in, out).
    k = 2 if fused else 1
    first, down = logical[data_roles[0]], logical["down"]
    if not fused and logical["up"] != first:
        raise FormatError(f"{where}: gate {list(first)} and up {list(logical['up'])} differ")
    if first[0] == k * down[1] and first[1] == down[0]:
        transposed, inter, hidden = False, down[1], down[0]
    elif first[1] == k * down[0] and first[0] == down[1]:
        transposed, inter, hidden = True, down[0], down[1]
    else:
        names = {r: next(iter(roles[r].values())).name.rsplit("_", 1)[0]
                 if "" not in roles[r] else roles[r][""].name for r in (data_roles[0], "down")}
        raise FormatError(
            f"{where}: {data_roles[0]} {names[data_roles[0]]!r} {list(first)} and down "
            f"{names['down']!r} {list(down)} per expert fit neither "
            + ("gate_up (2I, H) and down (H, I) nor gate_up (H, 2I) and down (I, H)" if fused
               else "gate (I, H) and down (H, I) nor gate (H, I) and down (I, H)"))
    if scheme in (MXFP4, INT4) and transposed:
        raise FormatError(f"{where}: {scheme} experts must be stored (out, in)")
    if len(set(groups.values())) > 1:
        raise FormatError(f"{where}: the roles use different group sizes "
                          + ", ".join(f"{r} {g}" for r, g in groups.items()))
    bias_len = {"gate_up": 2 * inter, "gate": inter, "up": inter, "down": hidden}
    for role, parts in roles.items():
        bias = parts.get("_bias")
        if bias is None:
            continue
        experts_of(bias, 2)
        if bias.shape[1] != bias_len[role] or bias.dtype not in _dtypes.EXPERT_DTYPES:
            raise FormatError(f"{where}: bias {bias.name!r} is {bias.dtype}{list(bias.shape)}; "
                              f"expected a float [experts, {bias_len[role]}]")
    assert count is not None
    layer_experts: dict[int, ExpertTensors] = {}
    key = {MXFP4: "_blocks", INT4: ".weight_packed"}.get(scheme, "")
    scale_key = {MXFP4: "_scales", INT4: ".weight_scale"}.get(scheme)
    for e in range(count):
        def data_of(role: str) -> TensorInfo:
            return _slice(roles[role][key], e, count)

        def scale_of(role: str) -> TensorInfo | None:
            return _slice(roles[role][scale_key], e, count) if scale_key else None

        first_role = data_roles[0]
        extras = tuple((f"{role}_bias", _slice(roles[role]["_bias"], e, count))
                       for role in (*data_roles[:-1], "down") if "_bias" in roles[role])
        extras += tuple((f"{role}_zero", _slice(roles[role][".weight_zero_point"], e, count))
                        for role in data_roles if ".weight_zero_point" in roles[role])
        layer_experts[e] = ExpertTensors(
            gate=data_of(first_role), up=None if fused else data_of("up"), down=data_of("down"),
            gate_scale=scale_of(first_role), up_scale=None if fused else scale_of("up"),
            down_scale=scale_of("down"), extras=extras, scheme=scheme,
            fused=chosen.fused if fused else None, transposed=transposed,
            shapes=(logical[first_role], None if fused else logical["up"], logical["down"]),
            group_size=32 if scheme == MXFP4 else groups.get("down", 0))
    return MappingProxyType(layer_experts)


def _stacked_shapes(info: TensorInfo) -> np.ndarray:
    """The (experts, k) values of a stacked ``weight_shape`` tensor, read from its file."""
    if info.dtype not in ("I32", "I64") or len(info.shape) != 2 or info.nbytes > (1 << 20):
        raise FormatError(f"tensor {info.name!r} ({info.path}) must be an I32 or I64 "
                          f"[experts, 2 or 4] tensor, not {info.dtype}{list(info.shape)}")
    return _read_int_tensor(info).reshape(info.shape)


def _stacked_int4_role(where: str, role: str, parts: dict[str, TensorInfo],
                       config: Mapping[str, object]) -> tuple[tuple[int, int], int]:
    """Validates one stacked pack-quantized role; returns the (rows, columns)
    of one expert's weight and its group size.

    ``weight_shape`` holds one row per expert: ``[rows, columns]``, or for a
    fused gate_up ``[I, H, I, H]`` (gate's shape, then up's, as stacking and
    concatenating the per-expert shapes gives) or ``[2I, H]``."""
    packed, scale, shape = parts[".weight_packed"], parts[".weight_scale"], parts[".weight_shape"]
    if packed.dtype != "I32":
        raise FormatError(f"{where}: {packed.name!r} is {packed.dtype}{list(packed.shape)}; a "
                          "stacked packed int4 weight is an I32 [experts, rows, columns / 8] tensor")
    values = _stacked_shapes(shape)
    differ = np.flatnonzero((values != values[0]).any(axis=1))
    if differ.size:
        e = int(differ[0])
        raise FormatError(f"{where}: {shape.name!r} gives the experts different shapes "
                          f"(expert 0 {values[0].tolist()}, expert {e} {values[e].tolist()})")
    row = [int(v) for v in values[0]]
    if len(row) == 4 and role == "gate_up" and row[1] == row[3] and row[0] == row[2] and row[0] > 0:
        rows, cols = 2 * row[0], row[1]
    elif len(row) == 2 and min(row) > 0:
        rows, cols = row
    else:
        raise FormatError(f"{where}: {shape.name!r} holds {row} per expert; expected [rows, columns]"
                          + (" or gate's and up's [I, H, I, H]" if role == "gate_up" else ""))
    if packed.shape[1:] != (rows, -(-cols // 8)):
        raise FormatError(
            f"{where}: packed tensor {packed.name!r} has shape {list(packed.shape)}, but "
            f"weight_shape {row} packs into [experts, {rows}, {-(-cols // 8)}] I32 words")
    _check_int4_columns_and_bits(where, packed.name, cols, config)
    if scale.dtype not in _INT4_SCALE_DTYPES or scale.shape[1] != rows or scale.shape[2] <= 0 \
            or cols % scale.shape[2]:
        raise FormatError(
            f"{where}: scale {scale.name!r} is {scale.dtype}{list(scale.shape)}; the weight "
            f"[{rows}, {cols}] needs [experts, {rows}, groups] scales ({'/'.join(_INT4_SCALE_DTYPES)}) "
            "with groups dividing the columns")
    group = cols // scale.shape[2]
    _check_int4_group(where, scale.name, group, config)
    zero = parts.get(".weight_zero_point")
    if zero is not None:
        if role == "gate_up" and (rows // 2) % 8:
            raise FormatError(f"{where}: zero point {zero.name!r}: a fused gate_up with zero points "
                              f"needs I = {rows // 2} to be a multiple of 8 (gate's and up's packed "
                              "words are concatenated)")
        if zero.dtype != "I32" or zero.shape[1:] != (-(-rows // 8), scale.shape[2]):
            raise FormatError(
                f"{where}: zero point {zero.name!r} is {zero.dtype}{list(zero.shape)}; expected "
                f"I32[experts, {-(-rows // 8)}, {scale.shape[2]}] (8 packed int4 per word down each column)")
    return (rows, cols), group


def experts_from_tensors(files: tuple[str, ...] | list[str],
                         tensors: Mapping[str, TensorInfo],
                         layout: Union[str, AnyLayout] = "auto") -> ModelExperts:
    """Apply a layout to already-read headers and validate the result."""
    files = tuple(files)
    chosen = _choose_layout(layout, tensors, files)
    if isinstance(chosen, StackedLayout):
        return _stacked_experts(files, tensors, chosen)

    int4 = _int4_experts(chosen, tensors)
    modules = _quant_modules(chosen, tensors)
    if int4 and modules:
        raise FormatError(f"{_describe(files)} mixes pack-quantized ({next(iter(int4))!r}) and "
                          f"GPTQ/AWQ ({next(iter(modules)) + 'qweight'!r}) expert weights")
    found: dict[int, dict[int, dict[str, TensorInfo]]] = {}
    for name, info in tensors.items():
        hit = chosen.match(name)
        if hit is None:
            if name.endswith(".weight_packed") and name[: -len("_packed")] in int4:
                hit = chosen.match(name[: -len("_packed")])
            elif name.endswith(".qweight") and name[: -len("qweight")] in modules:
                hit = chosen.match(name[: -len("qweight")] + "weight")
            if hit is None:
                continue
        elif int4 or modules:
            raise FormatError(f"tensor {name!r} ({info.path}) is a plain expert weight in a "
                              "checkpoint of " + ("pack-quantized" if int4 else "GPTQ/AWQ")
                              + " experts")
        layer, expert, role = hit
        roles = found.setdefault(layer, {}).setdefault(expert, {})
        if role in roles:
            raise FormatError(
                f"tensors {roles[role].name!r} and {name!r} are both the {role} "
                f"weight of layer {layer} expert {expert}"
            )
        roles[role] = info
    if not found:
        raise FormatError(
            f"layout {chosen.name!r} matches no routed-expert tensor in {_describe(files)}"
        )
    scales: dict[str, TensorInfo] = {}
    if not int4 and not modules:
        weights = {info.name for experts in found.values()
                   for roles in experts.values() for info in roles.values()}
        scales = _companions(tensors, weights, chosen)
    config = compressed_tensors_weights(files) if int4 else {}
    module_config = module_quant_config(files, next(iter(modules.values()))["qweight"].name) if modules else None

    result: dict[int, Mapping[int, ExpertTensors]] = {}
    for layer in sorted(found):
        by_expert = found[layer]
        numbers = sorted(by_expert)
        for want, have in enumerate(numbers):
            if want != have:
                raise FormatError(
                    f"layer {layer}: experts must be numbered 0..N-1, but expert {want} "
                    f"is missing (found {_ranges(tuple(numbers))})"
                )
        layer_experts: dict[int, ExpertTensors] = {}
        reference: tuple[int, ExpertTensors] | None = None
        for expert in numbers:
            roles = by_expert[expert]
            absent = [r for r in ROLES if r not in roles]
            if absent:
                have_names = ", ".join(repr(roles[r].name) for r in ROLES if r in roles)
                raise FormatError(
                    f"layer {layer} expert {expert} has no {' or '.join(absent)} "
                    f"tensor (found {have_names})"
                )
            if int4:
                ex = _int4_expert(f"layer {layer} expert {expert}", roles, int4, config)
            elif module_config is not None:
                ex = _quant_module_expert(f"layer {layer} expert {expert}", roles, modules,
                                          module_config)
            else:
                ex = ExpertTensors(
                    gate=roles["gate"], up=roles["up"], down=roles["down"],
                    gate_scale=scales.get(roles["gate"].name),
                    up_scale=scales.get(roles["up"].name),
                    down_scale=scales.get(roles["down"].name),
                    scheme=FP8_BLOCK if scales.get(roles["gate"].name) is not None else PLAIN,
                )
            _check_expert(layer, expert, ex)
            if reference is None:
                reference = (expert, ex)
            elif _signature(ex) != _signature(reference[1]):
                raise FormatError(
                    f"layer {layer}: expert {expert} ({_describe_signature(ex)}) "
                    f"disagrees with expert {reference[0]} "
                    f"({_describe_signature(reference[1])})"
                )
            layer_experts[expert] = ex
        result[layer] = MappingProxyType(layer_experts)
    return ModelExperts(files=files, layout=chosen.name, experts=MappingProxyType(result))


def _int4_expert(where: str, roles: dict[str, TensorInfo],
                 int4: dict[str, dict[str, TensorInfo]], config: Mapping[str, object]
                 ) -> ExpertTensors:
    shapes: list[tuple[int, int] | None] = []
    groups: set[int] = set()
    extras: list[tuple[str, TensorInfo]] = []
    for role in ROLES:
        parts = int4[roles[role].name[: -len("_packed")]]
        shape, group = _int4_role(f"{where} {role}", parts, config)
        shapes.append(shape)
        groups.add(group)
        if "_zero_point" in parts:
            extras.append((f"{role}_zero", parts["_zero_point"]))
    if len(groups) != 1:
        raise FormatError(f"{where}: gate, up and down use different group sizes {sorted(groups)}")
    if 0 < len(extras) < 3:
        raise FormatError(f"{where}: only some roles have zero points")
    scale_of = {r: int4[roles[r].name[: -len("_packed")]]["_scale"] for r in ROLES}
    return ExpertTensors(
        gate=roles["gate"], up=roles["up"], down=roles["down"],
        gate_scale=scale_of["gate"], up_scale=scale_of["up"], down_scale=scale_of["down"],
        extras=tuple(extras), scheme=INT4, shapes=tuple(shapes), group_size=groups.pop())


# GPTQ and AWQ: a quantized Linear module M stores M.qweight, M.qzeros,
# M.scales and (GPTQ) M.g_idx in place of M.weight.
_MODULE_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_MODULE_SCALE_DTYPES = ("F16", "BF16", "F32")


def _quant_modules(chosen: Layout, tensors: Mapping[str, TensorInfo]
                   ) -> dict[str, dict[str, TensorInfo]]:
    """GPTQ/AWQ expert modules by name prefix (``...gate_proj.``): their parts.
    A tensor of such a module that is not a GPTQ/AWQ part is refused."""
    modules: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        if name.endswith(".qweight"):
            prefix = name[: -len("qweight")]
            if chosen.match(prefix + "weight") is not None:
                modules[prefix] = {"qweight": info}
    if not modules:
        return modules
    for name, info in tensors.items():
        cut = name.rfind(".") + 1
        prefix, suffix = name[:cut], name[cut:]
        if prefix not in modules or suffix == "qweight":
            continue
        if suffix not in _MODULE_PARTS:
            raise FormatError(f"tensor {name!r} ({info.path}) belongs to the quantized expert "
                              f"module {prefix[:-1]!r}, but {suffix!r} is not a GPTQ/AWQ part ("
                              + ", ".join(_MODULE_PARTS) + ")")
        modules[prefix][suffix] = info
    return modules


def _quant_module_role(where: str, parts: Mapping[str, TensorInfo], quant: ModuleQuant
                       ) -> tuple[str, tuple[int, int], int]:
    """Validates one GPTQ/AWQ module; returns its scheme, (in, out) and scale rows."""
    qweight = parts["qweight"]
    prefix = qweight.name[: -len("qweight")]
    for need in ("scales", "qzeros"):
        if need not in parts:
            raise FormatError(f"{where}: {qweight.name!r} has no {prefix + need!r}")
    scales, qzeros = parts["scales"], parts["qzeros"]
    if qweight.dtype != "I32" or len(qweight.shape) != 2 or 0 in qweight.shape:
        raise FormatError(f"{where}: {qweight.name!r} is {qweight.dtype}{list(qweight.shape)}; "
                          "a 4-bit qweight is a non-empty 2-D I32 tensor")
    if scales.dtype not in _MODULE_SCALE_DTYPES or len(scales.shape) != 2 or 0 in scales.shape:
        raise FormatError(f"{where}: scales {scales.name!r} are {scales.dtype}{list(scales.shape)}; "
                          f"expected a 2-D {'/'.join(_MODULE_SCALE_DTYPES)} (groups, out) tensor")
    scheme = quant.scheme
    if scheme is None:  # no config: the shapes tell GPTQ (in/8, out) from AWQ (in, out/8)
        if "g_idx" in parts or scales.shape[1] == qweight.shape[1]:
            scheme = GPTQ
        else:
            scheme = AWQ
    if scheme == AWQ:
        rows, cols = qweight.shape[0], 8 * qweight.shape[1]
        layout = "(in, out/8) words of eight values along each row"
    else:
        rows, cols = 8 * qweight.shape[0], qweight.shape[1]
        layout = "(in/8, out) words of eight values down each column"
    if scales.shape[1] != cols:
        raise FormatError(f"{where}: scales {scales.name!r} {list(scales.shape)} do not fit "
                          f"{'AWQ' if scheme == AWQ else 'GPTQ'} qweight {qweight.name!r} "
                          f"{list(qweight.shape)}, which packs {layout}: a ({rows}, {cols}) "
                          f"matrix needs (groups, {cols}) scales")
    if cols % 8:
        raise FormatError(f"{where}: {qweight.name!r}: {cols} output columns do not pack into "
                          "int32 zero points")
    groups = scales.shape[0]
    if qzeros.dtype != "I32" or qzeros.shape != (groups, cols // 8):
        raise FormatError(f"{where}: qzeros {qzeros.name!r} are {qzeros.dtype}{list(qzeros.shape)}; "
                          f"scales {scales.name!r} {list(scales.shape)} need I32{[groups, cols // 8]} "
                          "(eight zero points per word)")
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        if scheme == AWQ:
            raise FormatError(f"{where}: {g_idx.name!r}: AWQ modules have no g_idx")
        if g_idx.dtype != "I32" or g_idx.shape != (rows,):
            raise FormatError(f"{where}: g_idx {g_idx.name!r} is {g_idx.dtype}{list(g_idx.shape)}; "
                              f"expected I32[{rows}] (the group of each input row)")
    if groups > rows:
        raise FormatError(f"{where}: scales {scales.name!r} have {groups} groups for {rows} "
                          "input rows")
    return scheme, (rows, cols), groups


def _quant_module_expert(where: str, roles: dict[str, TensorInfo],
                         modules: Mapping[str, Mapping[str, TensorInfo]], quant: ModuleQuant
                         ) -> ExpertTensors:
    parts = {r: modules[roles[r].name[: -len("qweight")]] for r in ROLES}
    checked = {r: _quant_module_role(f"{where} {r}", parts[r], quant) for r in ROLES}
    schemes = {scheme for scheme, _, _ in checked.values()}
    if len(schemes) != 1:
        raise FormatError(f"{where}: gate, up and down are packed differently ("
                          + ", ".join(f"{r} {checked[r][0]}" for r in ROLES) + ")")
    scheme = schemes.pop()
    # Rows per scale: the config's, else the one every grouped role implies.
    group = quant.group_size
    if group is None:
        implied = {rows // groups for _, (rows, _), groups in checked.values() if groups > 1}
        group = implied.pop() if len(implied) == 1 else 0
        if implied:
            raise FormatError(f"{where}: the scales of gate, up and down imply different group "
                              "sizes; add the checkpoint's quantization config")
    for role, (_, (rows, _), groups) in checked.items():
        want = -(-rows // group) if group else 1
        if groups != want:
            scales = parts[role]["scales"]
            raise FormatError(f"{where}: scales {scales.name!r} have {groups} groups, but "
                              + (f"group_size {group} over {rows} input rows makes {want}"
                                 if group else f"one group per column ({quant.source}) makes 1"))
    with_g_idx = [r for r in ROLES if "g_idx" in parts[r]]
    if 0 < len(with_g_idx) < 3:
        raise FormatError(f"{where}: only some roles have g_idx ("
                          + ", ".join(repr(parts[r]["g_idx"].name) for r in with_g_idx) + ")")
    extras = [(f"{r}_zero", parts[r]["qzeros"]) for r in ROLES]
    extras += [(f"{r}_g_idx", parts[r]["g_idx"]) for r in with_g_idx]
    return ExpertTensors(
        gate=roles["gate"], up=roles["up"], down=roles["down"],
        gate_scale=parts["gate"]["scales"], up_scale=parts["up"]["scales"],
        down_scale=parts["down"]["scales"], extras=tuple(extras), scheme=scheme,
        transposed=True, shapes=tuple(checked[r][1] for r in ROLES), group_size=group)


def scan_model(source: ModelSource, layout: Union[str, AnyLayout] = "auto") -> ModelExperts:
    """Read a model's headers and return its validated routed experts.

    ``source`` is anything :func:`colibri.checkpoint.safetensors.resolve_files`
    accepts; ``layout`` is ``"auto"``, a built-in name (``"mixtral"``,
    ``"mlp_experts"``, ``"gpt_oss"``, ``"llama4"``, ``"stacked"``), a
    :class:`Layout` or a :class:`StackedLayout`. Raises FormatError naming the
    file, layer, expert or tensor at fault.
    """
    files, tensors = read_model_tensors(source)
    return experts_from_tensors(files, tensors, layout)
