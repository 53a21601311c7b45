"""The rotary position embedding of a decode step's queries and keys in one
native call.

transformers' decoder families apply rotary embeddings with a function of
their modeling module, ``apply_rotary_pos_emb``, which runs about ten
tensor ops (two ``rotate_half`` slices and concatenations, four products,
two sums); at one token each op's dispatch costs more than its arithmetic.
:func:`use_decode_rotary` replaces that function, in the modeling module of
each attention class of the model, with one that computes a one-token call
on CPU tensors with ``coli_rotary`` and passes every other call to the
function it replaced. It does so only when the module's function and its
``rotate_half`` are transformers' usual ones (:data:`FORM`, compared on
their syntax trees). Where Hugging Face's ``kernels`` package is installed
(transformers 5.25 requires it), the module's function is a small
``nn.Module`` that calls the plain function unless ``kernelize`` picked a
hub kernel: its plain function is what is compared, and the wrapper is
what every call the native path does not take still goes through. The
native call computes each value op by op as torch
does, rounding where torch rounds, so the results are the same bits; other
models of the same family in the process therefore compute what they
computed before.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

from colibri._ffi import ffi, lib
from colibri.errors import error_for
from colibri.hf.norms import float_codes
from colibri.hf.source_forms import function_form, source_form

__all__ = ["FORM", "ROTATE_HALF", "rotary", "rotary_form", "use_decode_rotary"]

#: transformers' usual rotary function (Llama, Mistral, Mixtral, Qwen2/3(-MoE), OLMoE, ...).
FORM = """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
"""

#: ... and the ``rotate_half`` it calls.
ROTATE_HALF = """
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
"""

_ERR_LEN = 256
_MARK = "__colibri_replaces__"


_FORMS = (source_form(FORM), source_form(ROTATE_HALF))


def rotary_form(module: Any) -> bool:
    """Whether ``module``'s (a modeling module's) ``apply_rotary_pos_emb``
    and ``rotate_half`` are :data:`FORM` and :data:`ROTATE_HALF`."""
    apply, half = getattr(module, "apply_rotary_pos_emb", None), getattr(module, "rotate_half", None)
    apply = _plain_function(getattr(apply, _MARK, apply))
    if not callable(apply) or not callable(half):
        return False
    return (function_form(apply), function_form(half)) == _FORMS


def _plain_function(apply: Any) -> Any:
    """The function under the ``kernels`` package's function wrapper (a
    module whose class's forward calls it, held in that forward's closure as
    ``func``), when ``apply`` is one and has no forward of its own; else
    ``apply``."""
    forward = getattr(type(apply), "forward", None)
    code, cells = getattr(forward, "__code__", None), getattr(forward, "__closure__", None)
    if not hasattr(type(apply), "kernel_layer_name") or "forward" in getattr(apply, "__dict__", {}) \
            or code is None or not cells or "func" not in code.co_freevars:
        return apply
    try:
        inner = cells[code.co_freevars.index("func")].cell_contents
    except ValueError:      # an empty cell
        return apply
    return inner if isinstance(inner, types.FunctionType) else apply


def rotary(x: Any, cos: Any, sin: Any) -> Any:
    """:data:`FORM`'s embedding of one token's queries or keys: ``x``
    ``(batch, heads, 1, d)``, ``cos`` and ``sin`` ``(batch, 1, d)``, CPU
    torch tensors of one dtype (float32 or bfloat16), contiguous, ``d``
    even. Returns a new tensor shaped as ``x``."""
    codes = float_codes()
    if not _fits(x, cos, sin, codes):
        raise ValueError(f"rotary: x (batch, heads, 1, d) and cos, sin (batch, 1, d), contiguous CPU tensors "
                         f"of one dtype, float32 or bfloat16, d even; got {tuple(x.shape)} {x.dtype}, "
                         f"{tuple(cos.shape)} {cos.dtype}, {tuple(sin.shape)} {sin.dtype}")
    return _compute(x, cos, sin, codes)


def _fits(x: Any, cos: Any, sin: Any, codes: dict[Any, int]) -> bool:
    torch = sys.modules["torch"]
    if not all(isinstance(t, torch.Tensor) for t in (x, cos, sin)):
        return False
    if x.dim() != 4 or x.shape[2] != 1 or cos.dim() != 3:
        return False
    batch, d = x.shape[0], x.shape[3]
    return cos.shape == sin.shape == (batch, 1, d) and d % 2 == 0 and d > 0 \
        and x.dtype == cos.dtype == sin.dtype and x.dtype in codes \
        and x.is_cpu and cos.is_cpu and sin.is_cpu \
        and x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()


def _compute(x: Any, cos: Any, sin: Any, codes: dict[Any, int]) -> Any:
    torch = sys.modules["torch"]
    out = torch.empty(x.shape, dtype=x.dtype)
    err = ffi.new("char[]", _ERR_LEN)
    rc = lib.coli_rotary(ffi.cast("const void *", x.data_ptr()), ffi.cast("void *", out.data_ptr()),
                         x.shape[0] * x.shape[1], x.shape[1], x.shape[3], ffi.cast("const void *", cos.data_ptr()),
                         ffi.cast("const void *", sin.data_ptr()), codes[x.dtype], err, _ERR_LEN)
    if rc < 0:
        raise error_for(rc, ffi.string(err).decode(errors="replace"))
    return out


def is_native(function: Any) -> bool:
    """Whether ``function`` is a modeling module's rotary embedding as
    :func:`use_decode_rotary` replaced it."""
    return hasattr(function, _MARK)


def _native(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (:data:`FORM`) with its one-token CPU calls computed natively."""

    def apply_rotary_pos_emb(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> Any:
        torch = sys.modules["torch"]
        codes = float_codes()
        if unsqueeze_dim == 1 and _fits(q, cos, sin, codes) and _fits(k, cos, sin, codes) \
                and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin))):
            return _compute(q, cos, sin, codes), _compute(k, cos, sin, codes)
        return original(q, k, cos, sin, unsqueeze_dim)

    setattr(apply_rotary_pos_emb, _MARK, original)
    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def use_decode_rotary(model: Any) -> int:
    """Replaces ``apply_rotary_pos_emb`` in the modeling module of each
    attention class of ``model`` whose function is :data:`FORM` (and whose
    ``rotate_half`` is :data:`ROTATE_HALF`) by one that computes one-token
    CPU calls natively, the same bits; returns how many modules use it (one
    already replaced counts, and is not replaced again)."""
    names = {type(m).__module__ for m in model.modules() if type(m).__name__.endswith("Attention")}
    count = 0
    for name in sorted(names):
        module = sys.modules.get(name)
        if module is None or not rotary_form(module):
            continue
        current = module.apply_rotary_pos_emb
        if not is_native(current):
            setattr(module, "apply_rotary_pos_emb", _native(current))
        count += 1
    return count
