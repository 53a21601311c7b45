"""The non-expert linear layers of a colibri.hf model computed by colibri's
kernels from the checkpoint's bytes as stored.

transformers' compressed-tensors and FP8 loaders, in the dequantize mode
colibri.hf loads with, turn every quantized linear layer (attention
projections, dense MLPs, shared experts) into a float ``nn.Linear``: 4 to 8
times the bytes the checkpoint holds, all read at every token. With
``kernels="native"``, :func:`pack_linears` swaps each ``nn.Linear`` whose
weight the checkpoint stores as pack-quantized int4 (``weight_packed``) or
FP8 with block scales (``weight_scale_inv``) for a :class:`PackedLinear`
holding those bytes, which :func:`colibri.kernels.linear` computes on the
same compute pool and threads as the routed experts. The float copies are
dropped with the modules they belonged to, and their pages given back.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from colibri.checkpoint.safetensors import TensorInfo, read_model_tensors
from colibri.errors import FormatError
from colibri.kernels import linear
from colibri.linear import PackedWeight, packed_scheme, read_packed

__all__ = ["pack_linears", "packed_linear_class"]

_class: Any = None
_class_lock = threading.Lock()


def packed_linear_class() -> Any:
    """The ``torch.nn.Module`` class that replaces a packed ``nn.Linear``
    (made on first use, so that importing colibri.hf needs no torch)."""
    global _class
    with _class_lock:
        if _class is None:
            _class = _make_class()
        return _class


def _make_class() -> Any:
    import torch

    kernel_dtypes = (torch.float32, torch.bfloat16)

    class PackedLinear(torch.nn.Module):  # type: ignore[misc, name-defined]
        """``nn.Linear``'s forward from a :class:`~colibri.linear.PackedWeight`
        (its bias included): float32 and bfloat16 inputs as they are, other
        float types through float32."""

        def __init__(self, packed: PackedWeight, name: str) -> None:
            super().__init__()
            self.packed = packed
            self.name = name
            self.out_features, self.in_features = packed.shape

        def extra_repr(self) -> str:
            return (f"in_features={self.in_features}, out_features={self.out_features}, "
                    f"scheme={self.packed.scheme}, bias={self.packed.bias is not None}")

        def forward(self, x: Any) -> Any:
            rows = x.reshape(-1, self.in_features)
            if rows.shape[0] == 0:
                return x.new_empty((*x.shape[:-1], self.out_features))
            if rows.dtype not in kernel_dtypes:
                out = linear(self.packed, rows.float().contiguous()).to(x.dtype)
            else:
                out = linear(self.packed, rows.contiguous())
            return out.view(*x.shape[:-1], self.out_features)

    return PackedLinear


def _bias(module: Any) -> Any:
    """The layer's bias as a float32 numpy array, or None."""
    bias = getattr(module, "bias", None)
    return None if bias is None else bias.detach().float().cpu().numpy().copy()


def _swap(model: Any, name: str, module: Any, tensors: dict[str, TensorInfo], cls: Any) -> None:
    packed = read_packed(tensors, name, _bias(module))
    expected = (int(module.out_features), int(module.in_features))
    if packed.shape != expected:
        raise FormatError(f"{name}: the checkpoint stores a {list(packed.shape)} weight, the model's "
                          f"layer is {list(expected)} (outputs x inputs)")
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, cls(packed, name))


def pack_linears(model: Any, path: str) -> int:
    """Replaces each ``nn.Linear`` of ``model`` that the checkpoint at
    ``path`` stores packed (named as the model names it) with a
    :class:`PackedLinear`; returns how many. Layers stored as floats, or
    under another name than the model's, stay as they are."""
    import torch

    _, tensors = read_model_tensors(path)
    cls = packed_linear_class()
    chosen = [name for name, module in model.named_modules()
              if type(module) is torch.nn.Linear and packed_scheme(tensors, name) is not None]
    for name in chosen:
        _swap(model, name, model.get_submodule(name), tensors, cls)
    if chosen:
        _give_back()
    return len(chosen)


def _give_back() -> None:
    """Returns the freed float copies' pages to the system: glibc keeps
    freed heap memory in the process otherwise (measured: 81 of 86 MiB on a
    24-layer model). A no-op without glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
