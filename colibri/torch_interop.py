"""Leased expert arrays as ``torch.Tensor``s sharing their memory (no copy).

torch is optional: it is imported on the first call, and a missing torch
raises ImportError then, not when colibri is imported.

    from colibri.torch_interop import as_torch, expert_tensors
    with store.lease(layer, expert) as ex:
        gate = as_torch(ex.gate)            # torch.bfloat16 for a BF16 checkpoint
        y = torch.nn.functional.linear(x, gate)

Rules:

* **Read-only.** The tensor views the cache slot's bytes, which the store
  shares with every other lease of that expert. torch has no read-only
  tensors, so nothing stops an in-place op (``t.add_(1)``, ``t[0] = 0``,
  ``out=t``); doing one is forbidden and corrupts the cache for everyone.
  Use ``t.clone()`` when a writable copy is needed.
* **Lifetime.** The tensor holds a reference to the numpy array, which holds
  the lease: the slot stays leased (never evicted, never reused) as long as
  the tensor, or any view of it, is alive, even after the ``with`` block ends
  (the lease then warns with a ResourceWarning, as for numpy arrays). Drop
  the tensors before the block ends to give the slot back on time; results
  of computations (``linear(x, gate)``) are new tensors and hold nothing.
* **Every part.** :func:`expert_tensors` gives every part of a lease
  (packed MXFP4 blocks, int4/GPTQ/AWQ words, scales, biases, zero points,
  GPTQ's g_idx) by the
  names of ``ex.parts``; :func:`dequantize_torch` is :func:`colibri.dequantize`
  computed in torch from those views.
* **Dtypes.** float32/float16 map directly; ``bfloat16`` (ml_dtypes) becomes
  ``torch.bfloat16`` and ``float8_e4m3fn`` / ``float8_e5m2`` become
  ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, through a same-size
  integer view, so the bytes are shared, not converted. FP8 block scales are
  float32 tensors like any other.

The memory is handed over through DLPack, which accepts the read-only numpy
arrays a lease gives without the "non-writable array" warning that
``torch.from_numpy`` prints; with a numpy too old to export read-only arrays
through DLPack, ``from_numpy`` is used and that warning is suppressed.
"""

from __future__ import annotations

import warnings
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["as_torch", "expert_tensors", "dequantize_torch"]

# numpy dtype -> (same-size integer dtype to export, torch dtype attribute name)
_REINTERPRET: dict[np.dtype, tuple[np.dtype, str]] = {
    np.dtype(ml_dtypes.bfloat16): (np.dtype(np.uint16), "bfloat16"),
    np.dtype(ml_dtypes.float8_e4m3fn): (np.dtype(np.uint8), "float8_e4m3fn"),
    np.dtype(ml_dtypes.float8_e5m2): (np.dtype(np.uint8), "float8_e5m2"),
    np.dtype(ml_dtypes.float8_e8m0fnu): (np.dtype(np.uint8), "float8_e8m0fnu"),
}


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("colibri.torch_interop needs PyTorch: pip install torch") from exc
    return torch


def _share(torch: Any, array: np.ndarray) -> Any:
    try:
        return torch.from_dlpack(array)
    except (BufferError, TypeError, RuntimeError):
        pass
    # Fallback: from_numpy warns about non-writable arrays; the module doc says why
    # that is fine here. (catch_warnings is process-wide while it is active.)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def as_torch(array: np.ndarray) -> Any:
    """A ``torch.Tensor`` sharing ``array``'s memory (same shape and strides).

    Meant for the arrays of a lease (``ex.gate``, ``ex.gate_scale``...), but
    any numpy array works. The tensor must not be written to, and it keeps
    the array (so the lease) alive; see the module documentation.
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"as_torch needs a numpy array, not {type(array).__name__}")
    torch = _torch()
    special = _REINTERPRET.get(array.dtype)
    if special is None:
        return _share(torch, array)
    int_dtype, torch_name = special
    torch_dtype = getattr(torch, torch_name, None)
    if torch_dtype is None:
        raise TypeError(f"this torch ({torch.__version__}) has no torch.{torch_name}")
    # Same itemsize, so the integer view keeps shape and strides and the
    # torch view reinterprets the same bytes.
    return _share(torch, array.view(int_dtype)).view(torch_dtype)


def expert_tensors(ex: Any) -> dict[str, Any]:
    """Every part of a lease as tensors, by the names of ``ex.parts``
    (``gate``, ``up``, ``down`` or ``gate_up``, scales, biases, zero points)."""
    return {name: as_torch(array) for name, array in ex.parts.items()}


def _unpack_nibbles(torch: Any, data: Any) -> Any:
    """uint8 (..., n) -> int64 nibbles (..., 2n), the low nibble first."""
    return torch.stack(((data & 0x0F).long(), (data >> 4).long()), dim=-1).flatten(-2)


def _module_quant(torch: Any, info: Any, role: str, data: Any, scale: Any, zero: Any,
                  g_idx: Any) -> Any:
    """GPTQ/AWQ (in, out) weight, as colibri.dequant's gptq_to_float/awq_to_float."""
    from colibri.dequant import _AWQ_NIBBLE
    from colibri.errors import FormatError
    from colibri.layouts import AWQ, GPTQ

    def along(words: Any) -> Any:  # int32 (R, K) -> nibbles (R, 8K), word by word
        return _unpack_nibbles(torch, words.contiguous().view(torch.uint8))

    def natural(words: Any) -> Any:  # AWQ's order within each word undone
        n = along(words)
        return n.reshape(n.shape[0], -1, 8)[:, :, torch.from_numpy(_AWQ_NIBBLE)].reshape(n.shape)

    if zero is None:
        raise FormatError(f"{info.scheme} weight {role} has no zero points")
    if info.scheme == AWQ:
        q, z = natural(data), natural(zero)
    else:
        q, z = along(data.t()).t(), along(zero)
        if info.scheme == GPTQ:
            z = z + 1  # zero points stored minus one
    rows, groups = q.shape[0], scale.shape[0]
    if g_idx is None:
        g = torch.arange(rows) // (info.group_size or rows)
    else:
        g = g_idx.long()
        if g.numel() and (int(g.min()) < 0 or int(g.max()) >= groups):
            raise FormatError(f"{role}: g_idx holds groups {int(g.min())}..{int(g.max())}, but "
                              f"the scales have {groups}")
    if int(g[-1]) >= groups or z.shape != scale.shape:
        raise FormatError(f"{role}: scales {list(scale.shape)} and zero points {list(z.shape)} "
                          f"do not fit {rows} input rows")
    return (q - z[g]).to(torch.float32) * scale.to(torch.float32)[g]


def _decode(torch: Any, info: Any, role: str, data: Any, scale: Any, zero: Any,
            g_idx: Any = None) -> Any:
    from colibri.layouts import FP8_BLOCK, INT4, MXFP4, QUANT_MODULE_SCHEMES

    f32 = torch.float32
    if scale is None:
        return data.to(f32, copy=True)
    if info.scheme == FP8_BLOCK:
        rows, cols = data.shape
        br, bc = info.block_shape(role)
        full = scale.to(f32).repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
        return data.to(f32) * full
    if info.scheme == MXFP4:
        from colibri.dequant import E2M1_VALUES

        lut = torch.from_numpy(E2M1_VALUES)
        values = lut[_unpack_nibbles(torch, data)]                 # (R, G, 32)
        exponents = scale.view(torch.uint8).to(torch.int32) - 127  # (R, G)
        return torch.ldexp(values, exponents[..., None]).flatten(-2)
    if info.scheme == INT4:
        rows, cols = info.shape(role)
        q = _unpack_nibbles(torch, data.contiguous().view(torch.uint8)).to(f32)[:, :cols] - 8
        groups = scale.shape[1]
        q = q.reshape(rows, groups, cols // groups)
        if zero is not None:
            z = _unpack_nibbles(torch, zero.t().contiguous().view(torch.uint8)).to(f32)[:, :rows] - 8
            q = q - z.t()[:, :, None]
        return (q * scale.to(f32)[:, :, None]).reshape(rows, cols)
    if info.scheme in QUANT_MODULE_SCHEMES:
        return _module_quant(torch, info, role, data, scale, zero, g_idx)
    raise ValueError(f"unknown weight scheme {info.scheme!r}")


def dequantize_torch(ex: Any) -> dict[str, Any]:
    """:func:`colibri.dequantize` in torch: the same float32 weights and
    biases (Mixtral orientation), computed from zero-copy tensor views of the
    leased parts. The results are new tensors that hold nothing of the slot."""
    from colibri.layouts import INTERLEAVED, ROLES

    torch = _torch()
    info = ex.tensors
    parts = expert_tensors(ex)
    first = "gate_up" if info.fused else "gate"
    decoded: dict[str, Any] = {}
    for role in ROLES:
        name = first if role == "gate" else role
        if name in parts:
            decoded[name] = _decode(torch, info, role, parts[name], parts.get(f"{name}_scale"),
                                    parts.get(f"{name}_zero"), parts.get(f"{name}_g_idx"))
    if info.transposed:
        decoded = {name: w.t() for name, w in decoded.items()}

    def split(t: Any) -> tuple[Any, Any]:
        if info.fused == INTERLEAVED:
            return t[0::2], t[1::2]
        return t[: t.shape[0] // 2], t[t.shape[0] // 2:]

    out: dict[str, Any] = {}
    out["gate"], out["up"] = split(decoded["gate_up"]) if info.fused else (decoded["gate"], decoded["up"])
    out["down"] = decoded["down"]
    if "gate_up_bias" in parts:
        out["gate_bias"], out["up_bias"] = split(parts["gate_up_bias"].to(torch.float32, copy=True))
    for role in ROLES:
        if f"{role}_bias" in parts:
            out[f"{role}_bias"] = parts[f"{role}_bias"].to(torch.float32, copy=True)
    del parts
    # contiguous() of a view of our own results copies nothing of the slot.
    return {name: t.contiguous() for name, t in out.items()}
