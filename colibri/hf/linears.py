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

:func:`use_decode_linears` gives the layers that stay float (bfloat16 or
float32 attention projections, the LM head, dense and shared MLPs) the same
kernel for forwards of a few rows, a decode step's: there it reads the
weight once at close to the memory's speed, where torch's matmul reaches
about half of it; from :data:`DECODE_ROWS` rows on, torch's (oneDNN's)
blocked matmul is the faster one and computes them.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable

from colibri.checkpoint.safetensors import TensorInfo, read_model_tensors
from colibri.errors import FormatError
from colibri.hf.module_attrs import parameter
from colibri.kernels import linear
from colibri.linear import PackedWeight, packed_scheme, plain_weight, read_packed

__all__ = ["DECODE_ROWS", "decode_linear_class", "pack_linears", "packed_linear_class", "use_decode_linears"]

#: The most rows (tokens) of a float layer's forward that colibri's kernel
#: computes; more go to torch. Measured on bfloat16 layers of 128 to 32000
#: outputs over 1024 inputs (one thread, an AVX-512 BF16 CPU): the kernel took
#: 0.5-0.9x torch's time at 1 to 4 rows, 1.1-1.6x at 8 (docs/hf.md).
DECODE_ROWS = 4

_classes: dict[str, Any] = {}
_class_lock = threading.Lock()


def _made_once(maker: Callable[[], Any]) -> Any:
    """``maker()``'s class, made on first use (so that importing colibri.hf
    needs no torch) and kept."""
    with _class_lock:
        made = _classes.get(maker.__name__)
        if made is None:
            made = _classes[maker.__name__] = maker()
        return made


def packed_linear_class() -> Any:
    """The ``torch.nn.Module`` class that replaces a packed ``nn.Linear``."""
    return _made_once(_make_class)


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


def decode_linear_class() -> Any:
    """The ``torch.nn.Linear`` subclass that :func:`use_decode_linears` puts
    in place of a float ``nn.Linear``."""
    return _made_once(_make_decode_class)


def _make_decode_class() -> Any:
    import torch

    kernel_dtypes = (torch.float32, torch.bfloat16)
    functional_linear = torch.nn.functional.linear

    class DecodeLinear(torch.nn.Linear):  # type: ignore[misc, name-defined]
        """An ``nn.Linear`` (the same parameter objects as the layer it
        replaces, so tied weights stay tied and ``state_dict`` is unchanged)
        whose forward of at most :data:`DECODE_ROWS` rows, without autograd,
        is :func:`colibri.kernels.linear` on the weight's own memory. Other
        forwards, and any whose input dtype is not the weight's float32 or
        bfloat16, are ``nn.Linear``'s."""

        def __init__(self, layer: Any) -> None:
            torch.nn.Module.__init__(self)
            self.in_features = int(layer.in_features)
            self.out_features = int(layer.out_features)
            self.weight = layer.weight
            self.register_parameter("bias", layer.bias)
            self._packed: PackedWeight | None = None
            self._packed_key: tuple[Any, ...] = ()

        def kernel_weight(self) -> PackedWeight:
            """The weight as the kernel reads it: a view of the weight's memory
            (in-place changes show through), made again when a parameter was
            replaced; the bias is a float32 copy, made again also when it
            changed in place (its version)."""
            w, b = parameter(self, "weight"), parameter(self, "bias")
            key = (w.data_ptr(), w.dtype, w.shape, None if b is None else (b.data_ptr(), b._version))
            if self._packed is None or key != self._packed_key:
                bias = None if b is None else b.detach().float().numpy().copy()
                self._packed = plain_weight(weight_array(w), bias)
                self._packed_key = key
            return self._packed

        def forward(self, x: Any) -> Any:
            w = self.weight
            rows = x.numel() // self.in_features if x.dim() else 0
            if 0 < rows <= DECODE_ROWS and x.dtype == w.dtype and x.dtype in kernel_dtypes and x.is_cpu \
                    and w.is_cpu and w.is_contiguous() and x.shape[-1] == self.in_features \
                    and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad
                                                          or (self.bias is not None and self.bias.requires_grad))):
                out = linear(self.kernel_weight(), x.reshape(rows, self.in_features).contiguous())
                return out.view(*x.shape[:-1], self.out_features)
            return functional_linear(x, w, self.bias)

    return DecodeLinear


def weight_array(weight: Any) -> Any:
    """A float32 or bfloat16 CPU weight's own memory as a numpy array (no copy)."""
    import ml_dtypes
    import numpy as np
    import torch

    w = weight.detach()
    if w.dtype == torch.bfloat16:
        return np.asarray(w.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    return np.asarray(w.numpy())


def use_decode_linears(model: Any) -> int:
    """Replaces each ``nn.Linear`` of ``model`` (exactly that type) whose
    weight is a float32 or bfloat16 CPU tensor with a
    :func:`decode_linear_class` layer over the same parameters; returns how
    many. The parameters are not copied."""
    import torch

    cls = decode_linear_class()
    chosen = [name for name, module in model.named_modules()
              if type(module) is torch.nn.Linear and module.weight.is_cpu
              and module.weight.dtype in (torch.float32, torch.bfloat16) and module.weight.dim() == 2]
    for name in chosen:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, cls(model.get_submodule(name)))
    return len(chosen)


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
