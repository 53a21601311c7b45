"""Naming schemes: which tensor names are routed-expert weights, as
(layer, expert, role), and which scheme a checkpoint uses.

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
layout that finds routed experts (:func:`detect_layout`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Union

from colibri.checkpoint.config import model_type
from colibri.checkpoint.experts import CONCATENATED, INTERLEAVED, ROLES
from colibri.checkpoint.safetensors import TensorInfo
from colibri.errors import FormatError
from colibri.formats import FORMATS, INT4, MXFP4, QUANT_MODULE_SCHEMES

__all__ = [
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
    "detect_layout",
    "choose_layout",
    "describe_files",
    "weight_name",
]

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


def describe_files(files: tuple[str, ...] | list[str]) -> str:
    """The model's files for a message: all of them, or the first and how many more."""
    if len(files) <= 2:
        return ", ".join(files) or "no files"
    return f"{files[0]} and {len(files) - 1} more files"


# A per-expert weight M.weight that a quantized format stores under another
# name: M.weight_packed (pack-quantized), M.qweight (GPTQ, AWQ).
_STORED_AS = tuple(dict.fromkeys(FORMATS[s].parts["data"] for s in (INT4, *QUANT_MODULE_SCHEMES)))


def weight_name(name: str) -> str:
    """The weight name a per-expert layout matches for tensor ``name``: the
    ``M.weight`` whose data part it is, or ``name`` itself."""
    for suffix in _STORED_AS:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    return name


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

    #: The companions a role tensor may have: its bias, and the parts of the
    #: formats stored stacked (MXFP4, pack-quantized int4) other than plain.
    SUFFIXES = ("_bias", *FORMATS[MXFP4].parts.values(), *FORMATS[INT4].parts.values())

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
    weights = [weight_name(name) for name in names]
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
            f"no routed experts found in {describe_files(files)}: tried layouts "
            + ", ".join([*BUILTIN_LAYOUTS, *STACKED_LAYOUTS])
            + " (pass a custom colibri.Layout for other naming schemes)"
        )
    if len(hits) > 1:
        raise FormatError(
            f"ambiguous layout in {describe_files(files)}: tensors match "
            + " and ".join(h.name for h in hits)
            + "; pass layout= explicitly"
        )
    return hits[0]


def choose_layout(layout: Union[str, AnyLayout], names: Mapping[str, TensorInfo],
                  files: tuple[str, ...]) -> AnyLayout:
    """The layout ``layout`` names: itself, the built-in of that name, or
    the one :func:`detect_layout` finds (``"auto"``)."""
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
        + " or a colibri.Layout or colibri.StackedLayout"
    )
