"""The RMS norms of a colibri.hf model computed in one native call for a
decode step's few rows.

A decoder layer of a Llama-family model runs two to four RMS norms per
token (before attention and the MLP, and on each head's queries and keys
in Qwen3). transformers computes each with six tensor ops; on a row of a
few thousand values each op's dispatch costs more than its arithmetic, and
a decode step spends about a tenth of its time there. :func:`use_decode_norms`
gives every norm whose forward is one of the two formulas transformers'
families use (:data:`FORMS`, compared on the forward's syntax tree, so a
family that computes anything else keeps its own) a forward that, for at
most :data:`DECODE_NORM_VALUES` values without autograd, is
``coli_rms_norm``: the same steps, rounded where the framework rounds.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from colibri._ffi import ffi, lib
from colibri.errors import error_for
from colibri.hf.source_forms import function_form

__all__ = ["DECODE_NORM_VALUES", "FORMS", "norm_form", "rms_norm", "use_decode_norms"]

#: The most values (all rows together) a norm's forward computes natively:
#: 4 tokens of a 16384-wide model; larger forwards (prefill) stay torch's.
DECODE_NORM_VALUES = 1 << 16

_BODY = ("input_dtype = hidden_states.dtype",
         "hidden_states = hidden_states.to(torch.float32)",
         "variance = hidden_states.pow(2).mean(-1, keepdim=True)",
         "hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)")

#: The forwards taken over, by where the weight multiplies (rms_norm.h):
#: after the cast to the input's dtype (Llama, Mistral, Mixtral, Qwen, DeepSeek,
#: ...), or before it, in float32 (OLMo-2, gpt-oss).
FORMS: dict[str, tuple[str, ...]] = {
    "after_cast": (*_BODY, "return self.weight * hidden_states.to(input_dtype)"),
    "before_cast": (*_BODY, "return (self.weight * hidden_states).to(input_dtype)"),
}
#: coli_rms_norm's order of each form (where the weight multiplies: after or before the cast).
WEIGHT_ORDERS = {"after_cast": lib.COLI_RMS_WEIGHT_AFTER_CAST, "before_cast": lib.COLI_RMS_WEIGHT_BEFORE_CAST}
_ERR_LEN = 256
_TORCH_CODES: dict[Any, int] = {}  # filled by float_codes() once torch is imported


def norm_form(cls: type) -> str | None:
    """Which of :data:`FORMS` ``cls.forward`` computes, or None (another
    formula, or a forward whose source cannot be read)."""
    form = function_form(getattr(cls, "forward", None))
    if form is None or form[0] != "self, hidden_states":
        return None
    return next((name for name, statements in FORMS.items() if statements == form[1]), None)


def rms_norm(x: Any, weight: Any, eps: float, form: str = "after_cast") -> Any:
    """The RMS norm of each row of ``x`` (a CPU torch tensor, float32 or
    bfloat16, contiguous; rows of ``weight.numel()`` values) by ``weight``
    (float32 or bfloat16, contiguous, on the CPU) as the ``form`` of
    :data:`FORMS` computes it, in one native call. Returns a new tensor of
    the dtype the formula gives."""
    codes = float_codes()
    if form not in FORMS:
        raise ValueError(f"form must be one of {', '.join(FORMS)}, not {form!r}")
    if x.dtype not in codes or weight.dtype not in codes:
        raise TypeError(f"rms_norm takes float32 or bfloat16 rows and weight, not {x.dtype} and {weight.dtype}")
    if not (x.is_cpu and weight.is_cpu):
        raise ValueError(f"rms_norm computes CPU tensors, not {x.device} and {weight.device}")
    if not (x.is_contiguous() and weight.is_contiguous()) or x.dim() < 1 or x.shape[-1] != weight.numel():
        raise ValueError(f"rms_norm: contiguous rows of {weight.numel()} values wanted, got shape "
                         f"{tuple(x.shape)}")
    return _compute(x, weight, eps, form, codes)


def float_codes() -> dict[Any, int]:
    """The core's format codes of torch's float32 and bfloat16 (torch
    imported), made once; the native decode forwards (norms, routers,
    rotary) look their operands' dtypes up here."""
    if not _TORCH_CODES:
        torch = sys.modules["torch"]
        _TORCH_CODES.update({torch.float32: lib.COLI_TENSOR_F32, torch.bfloat16: lib.COLI_TENSOR_BF16})
    return _TORCH_CODES


def _compute(x: Any, weight: Any, eps: float, form: str, codes: dict[Any, int]) -> Any:
    """:func:`rms_norm` on operands already checked."""
    torch = sys.modules["torch"]
    out_dtype = x.dtype if form == "before_cast" or x.dtype == weight.dtype else torch.float32
    out = torch.empty(x.shape, dtype=out_dtype)
    err = ffi.new("char[]", _ERR_LEN)
    n = weight.numel()
    rc = lib.coli_rms_norm(ffi.cast("const void *", x.data_ptr()), ffi.cast("void *", out.data_ptr()),
                           ffi.cast("const void *", weight.data_ptr()), x.numel() // n if n else 0, n,
                           codes[x.dtype], codes[weight.dtype], codes[out_dtype], float(eps), WEIGHT_ORDERS[form],
                           err, _ERR_LEN)
    if rc < 0:
        raise error_for(rc, ffi.string(err).decode(errors="replace"))
    return out


def weight_fits(w: Any) -> bool:
    """Whether a norm's weight ``w`` is one :func:`native_forward` computes
    with: float32 or bfloat16, one contiguous CPU row."""
    return w.dtype in float_codes() and w.is_cpu and w.dim() == 1 and w.is_contiguous()


def native_forward(self: Any, hidden_states: Any) -> Any:
    """A norm's forward as :func:`use_decode_norms` sets it, bound to the
    module (so a deep copy of the model binds it to the copy):
    :func:`rms_norm` for a small forward without autograd, else the
    class's own. It checks the operands once, here."""
    torch = sys.modules["torch"]
    w = self.weight
    codes = float_codes()
    if 0 < hidden_states.numel() <= DECODE_NORM_VALUES and hidden_states.dtype in codes and weight_fits(w) \
            and hidden_states.is_cpu and hidden_states.dim() >= 1 and hidden_states.shape[-1] == w.numel() \
            and hidden_states.is_contiguous() \
            and not (torch.is_grad_enabled() and (hidden_states.requires_grad or w.requires_grad)):
        return _compute(hidden_states, w, self.variance_epsilon, self.colibri_rms_form, codes)
    return type(self).forward(self, hidden_states)


def use_decode_norms(model: Any) -> int:
    """Gives each module of ``model`` whose class's forward is one of
    :data:`FORMS` a forward that computes at most
    :data:`DECODE_NORM_VALUES` values without autograd with
    :func:`rms_norm` and anything else with the class's own; returns how
    many. The module, its class and its parameters stay as they are; a
    module that already has a forward of its own is left alone."""
    forms: dict[type, str | None] = {}
    count = 0
    for module in model.modules():
        cls = type(module)
        if cls not in forms:
            forms[cls] = norm_form(cls) if cls.__name__.endswith("RMSNorm") else None
        form = forms[cls]
        if form is None or not hasattr(module, "variance_epsilon") or "forward" in vars(module):
            continue
        module.colibri_rms_form = form
        module.forward = types.MethodType(native_forward, module)
        count += 1
    return count
