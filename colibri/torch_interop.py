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

from colibri.dequant import ArrayKit, decode_expert

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


def dequantize_torch(ex: Any) -> dict[str, Any]:
    """:func:`colibri.dequantize` in torch: the same float32 weights and
    biases (Mixtral orientation), computed from zero-copy tensor views of the
    leased parts by each format's torch decoder. The results are new tensors
    that hold nothing of the slot."""
    torch = _torch()
    kit = ArrayKit(decode=lambda fmt, enc: fmt.to_torch(torch, enc),
                   float_copy=lambda t: t.to(torch.float32, copy=True),
                   contiguous=lambda t: t.contiguous())
    return decode_expert(ex.tensors, expert_tensors(ex), kit)
