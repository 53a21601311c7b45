"""Plain float32 weights from a leased expert, whatever its layout and format.

:func:`dequantize` turns a lease into ``gate``, ``up`` and ``down`` in the
Mixtral orientation (gate and up ``(intermediate, hidden)``, down
``(hidden, intermediate)``), plus ``gate_bias``, ``up_bias`` and
``down_bias`` where the checkpoint has biases. Each role is decoded by its
format's record (:mod:`colibri.formats`, which documents every format),
then un-transposed and un-fused. :func:`decode_expert` is the same for any
array library (:func:`colibri.torch_interop.dequantize_torch` is its torch
case).

The results are new arrays: they do not reference the cache slot, so the
lease may end right after. An engine that wants the raw parts keeps them
through ``lease.parts``.

The per-format decoders that lived here (``mxfp4_to_float``,
``unpack_int4``, ``int4_to_float``, ``gptq_to_float``, ``awq_to_float``,
``AWQ_ORDER``, ``E2M1_VALUES``) are in their format's module now and are
re-exported here for one release.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from colibri.checkpoint.experts import INTERLEAVED, ROLES, ExpertTensors
from colibri.formats import Encoded, Format
from colibri.formats.awq import AWQ_ORDER, awq_to_float
from colibri.formats.gptq import gptq_to_float
from colibri.formats.int4 import int4_to_float, unpack_int4
from colibri.formats.mxfp4 import E2M1_VALUES, mxfp4_to_float

__all__ = ["dequantize", "decode_expert", "ArrayKit", "NUMPY",
           # deprecated re-exports, for one release
           "mxfp4_to_float", "unpack_int4", "int4_to_float", "gptq_to_float", "awq_to_float",
           "AWQ_ORDER", "E2M1_VALUES"]


@dataclass(frozen=True)
class ArrayKit:
    """How one array library takes part in :func:`decode_expert`: a role's
    decoder (the format's ``to_float`` or ``to_torch``), a float32 copy (for
    biases) and a C-contiguous copy or view (for the results)."""

    decode: Callable[[Format, Encoded], Any]
    float_copy: Callable[[Any], Any]
    contiguous: Callable[[Any], Any]


#: numpy: the formats' ``to_float`` decoders.
NUMPY = ArrayKit(decode=lambda fmt, enc: fmt.to_float(enc),
                 float_copy=lambda a: np.array(a, dtype=np.float32, copy=True),
                 contiguous=np.ascontiguousarray)


def _encoded(info: ExpertTensors, role: str, parts: Mapping[str, Any]) -> Encoded | None:
    """``role``'s leased parts and facts, or None for the up of a fused gate_up."""
    name = "gate_up" if role == "gate" and info.fused else role
    if name not in parts:
        return None
    w = info.weight(role)
    shape = info.shape(role)
    return Encoded(data=parts[name], scale=parts.get(f"{name}_scale"), zero=parts.get(f"{name}_zero"),
                   g_idx=parts.get(f"{name}_g_idx"), role=role, shape=shape or (0, 0),
                   group_size=info.group_size, block=info.block_shape(role),
                   what=f"{role} {w.name!r}" if w is not None else role)


def _split(fused: Any, how: str | None) -> tuple[Any, Any]:
    """(gate, up) from a fused gate_up along its first axis."""
    if how == INTERLEAVED:
        return fused[0::2], fused[1::2]
    half = fused.shape[0] // 2
    return fused[:half], fused[half:]


def decode_expert(info: ExpertTensors, parts: Mapping[str, Any], kit: ArrayKit) -> dict[str, Any]:
    """``gate``, ``up``, ``down`` (Mixtral orientation) and the biases of an
    expert stored as ``info`` says, from its ``parts`` (arrays of ``kit``'s
    library, by the names of ``lease.parts``), as new float32 arrays."""
    decoded: dict[str, Any] = {}
    for role in ROLES:
        enc = _encoded(info, role, parts)
        if enc is not None:
            decoded[role] = kit.decode(info.role_format(role), enc)
    if info.transposed:
        decoded = {role: w.T for role, w in decoded.items()}
    out: dict[str, Any] = {}
    if info.fused:
        out["gate"], out["up"] = _split(decoded["gate"], info.fused)
    else:
        out["gate"], out["up"] = decoded["gate"], decoded["up"]
    out["down"] = decoded["down"]
    # Biases are copied: nothing returned may view the slot.
    if "gate_up_bias" in parts:
        out["gate_bias"], out["up_bias"] = _split(kit.float_copy(parts["gate_up_bias"]), info.fused)
    for role in ROLES:
        if f"{role}_bias" in parts:
            out[f"{role}_bias"] = kit.float_copy(parts[f"{role}_bias"])
    # A contiguous copy of a view of our own results copies nothing of the slot.
    return {name: kit.contiguous(a) for name, a in out.items()}


def dequantize(lease: Any) -> dict[str, np.ndarray]:
    """A leased expert's weights as float32: ``gate``, ``up``, ``down`` in
    the Mixtral orientation, plus ``gate_bias``, ``up_bias``, ``down_bias``
    where the checkpoint has biases. New C-contiguous arrays, independent of
    the lease. ``lease`` is an :class:`colibri.ExpertLease` of any layout
    and format."""
    return decode_expert(lease.tensors, lease.parts, NUMPY)
