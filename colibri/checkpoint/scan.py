"""From a checkpoint's tensor names to its validated routed experts.

:func:`scan_model` reads the headers, :func:`experts_from_tensors` applies
a layout. A per-expert layout (one tensor per role and expert) is read
here; a stacked one by :mod:`colibri.checkpoint.stacked`. Which format the
experts are in follows from the parts beside each weight: ``W`` with
``W_scale_inv`` is block-scaled FP8, ``W_packed`` (with ``W_scale``,
``W_shape``, maybe ``W_zero_point``) pack-quantized int4, a module with
``qweight``, ``qzeros``, ``scales`` (maybe ``g_idx``) GPTQ or AWQ, a bare
``W`` plain floats. Each role is then checked by its format's record
(:mod:`colibri.formats`). Any other tensor that accompanies an expert
weight is refused, because ignoring it would silently compute with the
wrong weights.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Union

from colibri.checkpoint.config import compressed_tensors_weights, module_quant_config
from colibri.checkpoint.experts import ROLES, ExpertTensors, ModelExperts, format_ranges
from colibri.checkpoint.naming import AnyLayout, Layout, choose_layout, describe_files, weight_name
from colibri.checkpoint.safetensors import ModelSource, TensorInfo, read_model_tensors
from colibri.checkpoint.stacked import stacked_experts
from colibri.errors import FormatError
from colibri.formats import (FORMATS, FP8_BLOCK, GPTQ, INT4, IN_OUT, PLAIN, Declared, RoleParts,
                             format_of, int4, qmodule, role_format)

__all__ = ["scan_model", "experts_from_tensors"]

# The parts of a pack-quantized weight W, by their suffix after W ("_packed"...).
_INT4_KINDS = {suffix[len(".weight"):]: kind for kind, suffix in FORMATS[INT4].parts.items()}
# The parts of a GPTQ/AWQ module M, by their name after "M." ("qweight"...).
_MODULE_KINDS = {suffix[1:]: kind for kind, suffix in FORMATS[GPTQ].parts.items()}
# What the message calls each optional part.
_OPTIONAL = {"zero": "zero points", "g_idx": "g_idx"}

# The tensors of one quantized weight or module, by the name of its data part: its parts by kind.
Parts = dict[str, dict[str, TensorInfo]]


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


def experts_from_tensors(files: tuple[str, ...] | list[str],
                         tensors: Mapping[str, TensorInfo],
                         layout: Union[str, AnyLayout] = "auto") -> ModelExperts:
    """Apply a layout to already-read headers and validate the result."""
    files = tuple(files)
    chosen = choose_layout(layout, tensors, files)
    if not isinstance(chosen, Layout):
        return stacked_experts(files, tensors, chosen)
    packed = _int4_parts(chosen, tensors)
    modules = _module_parts(chosen, tensors)
    if packed and modules:
        raise FormatError(f"{describe_files(files)} mixes pack-quantized ({next(iter(packed))!r}) and "
                          f"GPTQ/AWQ ({next(iter(modules))!r}) expert weights")
    found = _expert_weights(chosen, tensors, files, "pack-quantized" if packed else
                            "GPTQ/AWQ" if modules else None)
    if packed or modules:
        parts = packed or modules
    else:
        weights = {info.name for experts in found.values()
                   for roles in experts.values() for info in roles.values()}
        parts = {name: {"data": tensors[name]} for name in weights}
        for name, scale in _companions(tensors, set(weights), chosen).items():
            parts[name]["scale"] = scale
    declared = _declared(files, packed, modules)
    family = INT4 if packed else GPTQ if modules else PLAIN
    result = {layer: _layer(layer, found[layer], family, parts, declared) for layer in sorted(found)}
    return ModelExperts(files=files, layout=chosen.name, experts=MappingProxyType(result))


def _declared(files: tuple[str, ...], packed: Parts, modules: Parts) -> Declared:
    """What the checkpoint's settings say about its quantized experts."""
    if packed:
        return int4.declared(compressed_tensors_weights(files))
    if modules:
        return module_quant_config(files, next(iter(modules)))
    return Declared()


def _expert_weights(chosen: Layout, tensors: Mapping[str, TensorInfo], files: tuple[str, ...],
                    quantized: str | None) -> dict[int, dict[int, dict[str, TensorInfo]]]:
    """The data part of each role of each expert, by layer and expert.
    ``quantized`` names the format of a checkpoint whose experts are stored
    under other names than ``weight``, in which a plain weight is refused."""
    found: dict[int, dict[int, dict[str, TensorInfo]]] = {}
    for name, info in tensors.items():
        hit = chosen.match(name)
        if hit is not None and quantized is not None:
            raise FormatError(f"tensor {name!r} ({info.path}) is a plain expert weight in a "
                              f"checkpoint of {quantized} experts")
        if hit is None and quantized is not None and weight_name(name) != name:
            hit = chosen.match(weight_name(name))
        if hit is None:
            continue
        layer, expert, role = hit
        roles = found.setdefault(layer, {}).setdefault(expert, {})
        if role in roles:
            raise FormatError(f"tensors {roles[role].name!r} and {name!r} are both the {role} "
                              f"weight of layer {layer} expert {expert}")
        roles[role] = info
    if not found:
        raise FormatError(f"layout {chosen.name!r} matches no routed-expert tensor in "
                          f"{describe_files(files)}")
    return found


def _layer(layer: int, by_expert: dict[int, dict[str, TensorInfo]], family: str, parts: Parts,
           declared: Declared) -> Mapping[int, ExpertTensors]:
    """The validated experts of one layer, numbered 0..N-1, all alike."""
    numbers = sorted(by_expert)
    for want, have in enumerate(numbers):
        if want != have:
            raise FormatError(f"layer {layer}: experts must be numbered 0..N-1, but expert {want} "
                              f"is missing (found {format_ranges(tuple(numbers))})")
    layer_experts: dict[int, ExpertTensors] = {}
    reference: tuple[int, ExpertTensors] | None = None
    for expert in numbers:
        roles = by_expert[expert]
        absent = [r for r in ROLES if r not in roles]
        if absent:
            have_names = ", ".join(repr(roles[r].name) for r in ROLES if r in roles)
            raise FormatError(f"layer {layer} expert {expert} has no {' or '.join(absent)} "
                              f"tensor (found {have_names})")
        where = f"layer {layer} expert {expert}"
        ex = _expert(where, family, {r: _role_parts(f"{where} {r}", r, parts[roles[r].name])
                                     for r in ROLES}, declared)
        if reference is None:
            reference = (expert, ex)
        elif _signature(ex) != _signature(reference[1]):
            raise FormatError(f"layer {layer}: expert {expert} ({_describe_signature(ex)}) "
                              f"disagrees with expert {reference[0]} "
                              f"({_describe_signature(reference[1])})")
        layer_experts[expert] = ex
    return MappingProxyType(layer_experts)


def _role_parts(where: str, role: str, parts: Mapping[str, TensorInfo]) -> RoleParts:
    return RoleParts(where, role, parts["data"], scale=parts.get("scale"), zero=parts.get("zero"),
                     g_idx=parts.get("g_idx"), shape=parts.get("shape"))


def _scheme(where: str, family: str, parts: Mapping[str, RoleParts], declared: Declared) -> str:
    """The format of an expert of ``family`` (plain, int4 or gptq: which
    parts its roles have), for GPTQ/AWQ from its settings or its shapes."""
    if family == INT4:
        return INT4
    if family == PLAIN:
        return FP8_BLOCK if parts["gate"].scale is not None else PLAIN
    schemes = {r: declared.scheme or qmodule.guess_scheme(p) for r, p in parts.items()}
    if len(set(schemes.values())) != 1:
        raise FormatError(f"{where}: gate, up and down are packed differently ("
                          + ", ".join(f"{r} {s}" for r, s in schemes.items()) + ")")
    return schemes["gate"]


def _expert(where: str, family: str, parts: Mapping[str, RoleParts], declared: Declared
            ) -> ExpertTensors:
    """One expert from the parts of its roles, each checked by its format."""
    scheme = _scheme(where, family, parts, declared)
    facts = {r: role_format(scheme, p.scale is not None).validate(p, declared) for r, p in parts.items()}
    group = format_of(scheme).group_size(where, parts, facts, declared)
    extras: list[tuple[str, TensorInfo]] = []
    for kind, text in _OPTIONAL.items():
        have = {r: p.optional()[kind] for r, p in parts.items() if kind in p.optional()}
        if 0 < len(have) < len(ROLES):
            raise FormatError(f"{where}: only some roles have {text} ("
                              + ", ".join(repr(info.name) for info in have.values()) + ")")
        extras += [(f"{r}_{kind}", info) for r, info in have.items()]
    ex = ExpertTensors(
        gate=parts["gate"].data, up=parts["up"].data, down=parts["down"].data,
        gate_scale=parts["gate"].scale, up_scale=parts["up"].scale, down_scale=parts["down"].scale,
        extras=tuple(extras), scheme=scheme, transposed=format_of(scheme).orientation == IN_OUT,
        shapes=tuple(facts[r].shape for r in ROLES), group_size=group)
    gate, up, down = ex.shape("gate"), ex.shape("up"), ex.shape("down")
    assert gate is not None and down is not None
    if up != gate or down != (gate[1], gate[0]):
        raise FormatError(f"{where}: shapes gate {list(gate)}, up {list(up or ())}, down {list(down)}; "
                          "expected gate (I, H), up (I, H), down (H, I)")
    return ex


def _signature(ex: ExpertTensors) -> tuple[object, ...]:
    """What must be equal across the experts of one layer."""
    out: list[object] = [ex.scheme, ex.fused, ex.transposed, ex.shapes, ex.group_size]
    for name, t in zip(ex.part_names(), ex.part_infos()):
        out.append(None if t is None else (name, t.dtype, t.shape))
    return tuple(out)


def _describe_signature(ex: ExpertTensors) -> str:
    return ", ".join(f"{name} {t.dtype}{list(t.shape)}"
                     for name, t in zip(ex.part_names(), ex.part_infos()) if t is not None)


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
                        + "; this quantisation scheme is not supported")
                scales[base] = info
                break
            cut = name.find("_", cut + 1)
        else:
            # A scale whose weight is missing: report it instead of ignoring it.
            scale_suffix = layout.scale_suffix
            if scale_suffix and name.endswith(scale_suffix):
                base = name[: -len(scale_suffix)]
                if base not in weights and layout.match(base) is not None:
                    raise FormatError(f"scale tensor {name!r} ({info.path}) has no weight {base!r}")
    return scales


def _int4_parts(chosen: Layout, tensors: Mapping[str, TensorInfo]) -> Parts:
    """Pack-quantized weights by the name of their packed words: their parts by kind."""
    bases: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        if name.endswith(".weight_packed") and chosen.match(name[: -len("_packed")]):
            bases[name[: -len("_packed")]] = {"data": info}
    if not bases:
        return {}
    for name, info in tensors.items():
        tail = name.rfind(".") + 1
        cut = name.find("_", tail)
        if cut == -1 or name[:cut] not in bases:
            continue
        suffix = name[cut:]
        if suffix == "_g_idx":
            raise FormatError(f"tensor {name!r} ({info.path}): activation ordering (g_idx) "
                              "is not supported")
        if suffix not in _INT4_KINDS:
            raise FormatError(f"tensor {name!r} ({info.path}) accompanies packed weight "
                              f"{name[:cut] + '_packed'!r}, but {suffix!r} is not a "
                              "pack-quantized part")
        bases[name[:cut]][_INT4_KINDS[suffix]] = info
    return {parts["data"].name: parts for parts in bases.values()}


def _module_parts(chosen: Layout, tensors: Mapping[str, TensorInfo]) -> Parts:
    """GPTQ/AWQ expert modules by the name of their qweight: their parts by
    kind. A tensor of such a module that is not a GPTQ/AWQ part is refused."""
    modules: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        if name.endswith(".qweight"):
            prefix = name[: -len("qweight")]
            if chosen.match(prefix + "weight") is not None:
                modules[prefix] = {"data": info}
    if not modules:
        return {}
    for name, info in tensors.items():
        cut = name.rfind(".") + 1
        prefix, suffix = name[:cut], name[cut:]
        if prefix not in modules or suffix == "qweight":
            continue
        if suffix not in _MODULE_KINDS:
            raise FormatError(f"tensor {name!r} ({info.path}) belongs to the quantized expert "
                              f"module {prefix[:-1]!r}, but {suffix!r} is not a GPTQ/AWQ part ("
                              + ", ".join(_MODULE_KINDS) + ")")
        modules[prefix][_MODULE_KINDS[suffix]] = info
    return {parts["data"].name: parts for parts in modules.values()}
