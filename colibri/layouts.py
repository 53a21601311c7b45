"""Map safetensors tensor names to routed experts: (layer, expert, role).

Two layouts are built in:

* ``"mixtral"``: ``model.layers.{L}.block_sparse_moe.experts.{E}.w1/w3/w2.weight``
  (w1 = gate, w3 = up, w2 = down);
* ``"mlp_experts"``: ``model.layers.{L}.mlp.experts.{E}.gate_proj/up_proj/down_proj.weight``
  (Qwen2/Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4.5/5 and relatives).

The leading ``model.`` is optional in both. Shared experts, routers, dense MLPs
and everything else never match. ``layout="auto"`` picks the one built-in
layout that finds routed experts.

A weight ``W`` may carry a block-scale tensor named ``W + scale_suffix``
(DeepSeek-V3 FP8: ``...gate_proj.weight_scale_inv``, F32, one value per
128x128 block); any other tensor named ``W_<something>`` is refused, because
ignoring it would silently compute with unscaled weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterator, Mapping, Union

from . import _dtypes
from .errors import FormatError, UnknownExpertError
from .safetensors_reader import ModelSource, TensorInfo, read_model_tensors

__all__ = [
    "ROLES",
    "Layout",
    "MIXTRAL",
    "MLP_EXPERTS",
    "BUILTIN_LAYOUTS",
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
        pattern = self.pattern
        assert isinstance(pattern, re.Pattern)
        found = pattern.fullmatch(name)
        if found is None:
            return None
        role = self.roles.get(found.group("role"))
        if role is None:
            return None
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


@dataclass(frozen=True)
class ExpertTensors:
    """The three weight tensors of one routed expert, plus optional block scales."""

    gate: TensorInfo
    up: TensorInfo
    down: TensorInfo
    gate_scale: TensorInfo | None = None
    up_scale: TensorInfo | None = None
    down_scale: TensorInfo | None = None

    def weight(self, role: str) -> TensorInfo:
        if role not in ROLES:
            raise KeyError(role)
        info: TensorInfo = getattr(self, role)
        return info

    def scale(self, role: str) -> TensorInfo | None:
        if role not in ROLES:
            raise KeyError(role)
        info: TensorInfo | None = getattr(self, f"{role}_scale")
        return info

    def block_shape(self, role: str) -> tuple[int, int] | None:
        """Scale block of ``role``'s weight, or None if it is unscaled."""
        scale = self.scale(role)
        return None if scale is None else scale_block(self.weight(role), scale)

    def coli_format(self, role: str) -> int:
        """``ColiTensorFormat`` value of ``role``'s weight (csrc/tensor.h)."""
        return _dtypes.coli_format(self.weight(role).dtype, self.scale(role) is not None)

    def tensors(self) -> tuple[TensorInfo, ...]:
        """Every tensor of the expert: each role's weight then its scale."""
        out: list[TensorInfo] = []
        for role in ROLES:
            out.append(self.weight(role))
            scale = self.scale(role)
            if scale is not None:
                out.append(scale)
        return tuple(out)

    @property
    def nbytes(self) -> int:
        """Bytes of weights and scales together: what one cache slot holds."""
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


def detect_layout(names: Mapping[str, object] | list[str], files: tuple[str, ...] = ()) -> Layout:
    """The single built-in layout that matches some tensor name."""
    hits = [
        layout for layout in BUILTIN_LAYOUTS.values()
        if any(layout.match(name) is not None for name in names)
    ]
    if not hits:
        raise FormatError(
            f"no routed experts found in {_describe(files)}: tried layouts "
            + ", ".join(BUILTIN_LAYOUTS)
            + " (pass a custom colibri.layouts.Layout for other naming schemes)"
        )
    if len(hits) > 1:
        raise FormatError(
            f"ambiguous layout in {_describe(files)}: tensors match "
            + " and ".join(h.name for h in hits)
            + "; pass layout= explicitly"
        )
    return hits[0]


def _choose_layout(layout: Union[str, Layout], names: Mapping[str, TensorInfo],
                   files: tuple[str, ...]) -> Layout:
    if isinstance(layout, Layout):
        return layout
    if layout == "auto":
        return detect_layout(names, files)
    if isinstance(layout, str) and layout in BUILTIN_LAYOUTS:
        return BUILTIN_LAYOUTS[layout]
    raise FormatError(
        f"unknown layout {layout!r}: use 'auto', "
        + ", ".join(repr(n) for n in BUILTIN_LAYOUTS)
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
    gate, up, down = ex.gate.shape, ex.up.shape, ex.down.shape
    if up != gate or down != (gate[1], gate[0]):
        raise FormatError(
            f"{where}: shapes gate {list(gate)}, up {list(up)}, down {list(down)}; "
            "expected gate (I, H), up (I, H), down (H, I)"
        )


def _signature(ex: ExpertTensors) -> tuple[object, ...]:
    """What must be equal across the experts of one layer."""
    out: list[object] = []
    for t in (ex.gate, ex.up, ex.down, ex.gate_scale, ex.up_scale, ex.down_scale):
        out.append(None if t is None else (t.dtype, t.shape))
    return tuple(out)


def _describe_signature(ex: ExpertTensors) -> str:
    parts = []
    for role in ROLES:
        w, s = ex.weight(role), ex.scale(role)
        text = f"{role} {w.dtype}{list(w.shape)}"
        if s is not None:
            text += f" scale {s.dtype}{list(s.shape)}"
        parts.append(text)
    return ", ".join(parts)


def experts_from_tensors(files: tuple[str, ...] | list[str],
                         tensors: Mapping[str, TensorInfo],
                         layout: Union[str, Layout] = "auto") -> ModelExperts:
    """Apply a layout to already-read headers and validate the result."""
    files = tuple(files)
    chosen = _choose_layout(layout, tensors, files)

    found: dict[int, dict[int, dict[str, TensorInfo]]] = {}
    for name, info in tensors.items():
        hit = chosen.match(name)
        if hit is None:
            continue
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
    weights = {info.name for experts in found.values()
               for roles in experts.values() for info in roles.values()}
    scales = _companions(tensors, weights, chosen)

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
            ex = ExpertTensors(
                gate=roles["gate"], up=roles["up"], down=roles["down"],
                gate_scale=scales.get(roles["gate"].name),
                up_scale=scales.get(roles["up"].name),
                down_scale=scales.get(roles["down"].name),
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


def scan_model(source: ModelSource, layout: Union[str, Layout] = "auto") -> ModelExperts:
    """Read a model's headers and return its validated routed experts.

    ``source`` is anything :func:`colibri.safetensors_reader.resolve_files`
    accepts; ``layout`` is ``"auto"``, a built-in name (``"mixtral"``,
    ``"mlp_experts"``) or a :class:`Layout`. Raises FormatError naming the
    file, layer, expert or tensor at fault.
    """
    files, tensors = read_model_tensors(source)
    return experts_from_tensors(files, tensors, layout)
