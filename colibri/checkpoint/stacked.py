"""Experts stacked along the first dimension of one tensor per role (gpt-oss,
Llama 4, transformers' in-memory layout): each expert's part is the
contiguous slice ``tensor[e]``, one byte range, so it is still read in place.

A role tensor ``T`` is plain floats, MXFP4 (``T_blocks`` + ``T_scales``) or
compressed-tensors pack-quantized int4 (``T.weight_packed``...), and may
have ``T_bias``. The orientation ((out, in) or (in, out)) is read from the
shapes; each role's format is checked by its record (:mod:`colibri.formats`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from colibri.checkpoint.config import compressed_tensors_weights
from colibri.checkpoint.experts import ExpertTensors, ModelExperts
from colibri.checkpoint.naming import StackedLayout, describe_files
from colibri.checkpoint.safetensors import TensorInfo
from colibri.errors import FormatError
from colibri.formats import (FORMATS, INT4, MXFP4, OUT_IN, PLAIN, Declared, RoleFacts, RoleParts,
                             format_of, int4)

__all__ = ["stacked_experts"]

# A layer's tensors: role -> suffix ("" for the role tensor itself) -> tensor.
Roles = dict[str, dict[str, TensorInfo]]

# The part suffixes of each stacked format, by kind.
_MXFP4 = FORMATS[MXFP4].parts
_INT4 = FORMATS[INT4].parts
_FLOATS = FORMATS[PLAIN].coli_formats  # the dtypes a bias may have


def stacked_experts(files: tuple[str, ...], tensors: Mapping[str, TensorInfo],
                    chosen: StackedLayout) -> ModelExperts:
    """Every expert of a stacked layout, validated."""
    found: dict[int, Roles] = {}
    for name, info in tensors.items():
        hit = chosen.match(name)
        if hit is not None:
            layer, role, suffix = hit
            found.setdefault(layer, {}).setdefault(role, {})[suffix] = info
    if not found:
        raise FormatError(
            f"layout {chosen.name!r} matches no routed-expert tensor in {describe_files(files)}")
    _refuse_strangers(tensors, chosen, found)
    packed = any(_INT4["data"] in parts for roles in found.values() for parts in roles.values())
    declared = int4.declared(compressed_tensors_weights(files)) if packed else Declared()
    result = {layer: _layer(f"layer {layer}", found[layer], chosen, declared) for layer in sorted(found)}
    return ModelExperts(files=files, layout=chosen.name, experts=MappingProxyType(result))


def _refuse_strangers(tensors: Mapping[str, TensorInfo], chosen: StackedLayout,
                      found: Mapping[int, Roles]) -> None:
    """Refuses a tensor that accompanies a role tensor with a suffix the layout does not know."""
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


class _Experts:
    """How many experts a layer's stacked tensors hold, checked to agree."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.count: int | None = None
        self.source = ""

    def check(self, info: TensorInfo | None, ndim: int) -> None:
        """``info`` (if any) is a non-empty ``ndim``-D stack of as many experts as the others."""
        if info is None:
            return
        if len(info.shape) != ndim or 0 in info.shape:
            raise FormatError(f"{self.where}: {info.name!r} has shape {list(info.shape)}; expected a "
                              f"non-empty {ndim}-D tensor with experts along the first dimension")
        if self.count is None:
            self.count, self.source = info.shape[0], info.name
        elif info.shape[0] != self.count:
            raise FormatError(f"{self.where}: {info.name!r} stacks {info.shape[0]} experts but "
                              f"{self.source!r} stacks {self.count}")


def _data_roles(where: str, roles: Roles) -> list[str]:
    """The roles holding data: gate_up and down, or gate, up and down."""
    fused = "gate_up" in roles
    if fused and ("gate" in roles or "up" in roles):
        raise FormatError(f"{where}: has both a fused gate_up and a separate gate or up tensor")
    data_roles = ["gate_up", "down"] if fused else ["gate", "up", "down"]
    for role in data_roles:
        if role not in roles:
            have = ", ".join(repr(t.name) for parts in roles.values() for t in parts.values())
            raise FormatError(f"{where}: no stacked {role} tensor (found {have})")
    return data_roles


def _int4_role(where: str, role: str, parts: Mapping[str, TensorInfo], experts: _Experts) -> RoleParts:
    present = [key for key in parts if key in _INT4.values()]
    for other in ("", _MXFP4["data"], _MXFP4["scale"]):
        if other in parts:
            raise FormatError(f"{where}: {parts[other].name!r} and the pack-quantized "
                              f"{parts[present[0]].name!r} are both the {role} tensor")
    if _INT4["data"] not in parts:
        seen = parts[present[0]]
        raise FormatError(f"{where}: pack-quantized {role} {seen.name!r} has no "
                          f"{seen.name[: len(seen.name) - len(present[0])] + _INT4['data']!r}")
    found = {kind: parts.get(suffix) for kind, suffix in _INT4.items()}
    for kind, ndim in (("data", 3), ("scale", 3), ("zero", 3), ("shape", 2)):
        experts.check(found[kind], ndim)
    return RoleParts(where, role, stacked=True, **{k: v for k, v in found.items() if v is not None})


def _mxfp4_role(where: str, role: str, parts: Mapping[str, TensorInfo], experts: _Experts) -> RoleParts:
    blocks, scales = parts.get(_MXFP4["data"]), parts.get(_MXFP4["scale"])
    if blocks is None or scales is None:
        present = blocks or scales
        assert present is not None
        missing = present.name.rsplit("_", 1)[0] + (_MXFP4["scale"] if scales is None else _MXFP4["data"])
        raise FormatError(f"{where}: MXFP4 tensor {present.name!r} has no {missing!r}")
    if "" in parts:
        raise FormatError(f"{where}: {parts[''].name!r} is stored both plain and as MXFP4 "
                          f"blocks {blocks.name!r}")
    experts.check(blocks, 4)
    return RoleParts(where, role, blocks, scales, stacked=True)


def _role(where: str, role: str, parts: Mapping[str, TensorInfo], experts: _Experts) -> tuple[str, RoleParts]:
    """The format of one stacked role, and its parts."""
    if any(key in _INT4.values() for key in parts):
        return INT4, _int4_role(where, role, parts, experts)
    if _MXFP4["data"] in parts or _MXFP4["scale"] in parts:
        return MXFP4, _mxfp4_role(where, role, parts, experts)
    experts.check(parts[""], 3)
    return PLAIN, RoleParts(where, role, parts[""], stacked=True)


def _orientation(where: str, data_roles: list[str], parts: Mapping[str, RoleParts],
                 facts: Mapping[str, RoleFacts]) -> tuple[bool, int, int]:
    """(transposed, I, H): (out, in) as Mixtral, or (in, out)."""
    fused = data_roles[0] == "gate_up"
    k = 2 if fused else 1
    first, down = facts[data_roles[0]].shape, facts["down"].shape
    if not fused and facts["up"].shape != first:
        raise FormatError(f"{where}: gate {list(first)} and up {list(facts['up'].shape)} differ")
    if first[0] == k * down[1] and first[1] == down[0]:
        return False, down[1], down[0]
    if first[1] == k * down[0] and first[0] == down[1]:
        return True, down[0], down[1]
    names = {r: parts[r].data.name for r in (data_roles[0], "down")}
    raise FormatError(
        f"{where}: {data_roles[0]} {names[data_roles[0]]!r} {list(first)} and down "
        f"{names['down']!r} {list(down)} per expert fit neither "
        + ("gate_up (2I, H) and down (H, I) nor gate_up (H, 2I) and down (I, H)" if fused
           else "gate (I, H) and down (H, I) nor gate (H, I) and down (I, H)"))


def _check_biases(where: str, roles: Roles, inter: int, hidden: int, experts: _Experts) -> None:
    bias_len = {"gate_up": 2 * inter, "gate": inter, "up": inter, "down": hidden}
    for role, parts in roles.items():
        bias = parts.get("_bias")
        if bias is None:
            continue
        experts.check(bias, 2)
        if bias.shape[1] != bias_len[role] or bias.dtype not in _FLOATS:
            raise FormatError(f"{where}: bias {bias.name!r} is {bias.dtype}{list(bias.shape)}; "
                              f"expected a float [experts, {bias_len[role]}]")


def _slice(info: TensorInfo | None, expert: int, count: int) -> TensorInfo | None:
    if info is None:
        return None
    per = info.nbytes // count
    return TensorInfo(name=f"{info.name}[{expert}]", file=info.file, path=info.path,
                      dtype=info.dtype, shape=tuple(info.shape[1:]),
                      offset=info.offset + expert * per, nbytes=per)


def _layer(where: str, roles: Roles, chosen: StackedLayout, declared: Declared) -> Mapping[int, ExpertTensors]:
    """The experts of one layer, each cut from the layer's stacked tensors."""
    data_roles = _data_roles(where, roles)
    experts = _Experts(where)
    schemes: dict[str, str] = {}
    parts: dict[str, RoleParts] = {}
    for role in data_roles:
        schemes[role], parts[role] = _role(where, role, roles[role], experts)
    facts = {r: format_of(schemes[r]).validate(parts[r], declared) for r in data_roles}
    if len(set(schemes.values())) != 1:
        raise FormatError(f"{where}: roles mix formats: "
                          + ", ".join(f"{r} {s}" for r, s in schemes.items()))
    fmt = format_of(schemes["down"])
    transposed, inter, hidden = _orientation(where, data_roles, parts, facts)
    if transposed and fmt.orientation == OUT_IN:
        raise FormatError(f"{where}: {fmt.name} experts must be stored (out, in)")
    group = fmt.group_size(where, parts, facts, declared)
    _check_biases(where, roles, inter, hidden, experts)
    assert experts.count is not None
    count, fused = experts.count, data_roles[0] == "gate_up"
    shapes = tuple(None if r not in facts else facts[r].shape for r in (data_roles[0], "up", "down"))
    out: dict[int, ExpertTensors] = {}
    for e in range(count):
        def cut(role: str, kind: str) -> TensorInfo | None:
            return None if role not in parts else _slice(getattr(parts[role], kind), e, count)

        extras = [(f"{r}_bias", _slice(roles[r]["_bias"], e, count)) for r in data_roles if "_bias" in roles[r]]
        extras += [(f"{r}_zero", cut(r, "zero")) for r in data_roles if parts[r].zero is not None]
        gate, down = cut(data_roles[0], "data"), cut("down", "data")
        assert gate is not None and down is not None
        out[e] = ExpertTensors(
            gate=gate, up=cut("up", "data"), down=down,
            gate_scale=cut(data_roles[0], "scale"), up_scale=cut("up", "scale"),
            down_scale=cut("down", "scale"), extras=tuple((n, i) for n, i in extras if i is not None),
            scheme=fmt.name, fused=chosen.fused if fused else None, transposed=transposed,
            shapes=shapes, group_size=group)
    return MappingProxyType(out)
