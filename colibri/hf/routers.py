"""The MoE routers of a colibri.hf model computed natively for a decode
step's few rows.

transformers' softmax top-k routers (Qwen2/3-MoE, OLMoE, Mixtral and their
kin) run a matrix-vector product and four to six small tensor ops per
layer and token; at one token each op's dispatch costs more than its
arithmetic, and the product runs at half the memory's speed. PILOT runs the
same router once more per layer to predict. :func:`use_decode_routers`
gives each router whose forward is one of :data:`FORMS` (compared on the
forward's syntax tree, so a family that routes any other way keeps its own)
a forward that, for at most :data:`~colibri.hf.linears.DECODE_ROWS` rows
without autograd, computes the logits with colibri's linear kernel on the
router's own weight and the softmax, top-k and renormalisation in one call
(``coli_router_topk``). Experts whose probabilities are equal are taken in
order of their numbers.
"""

from __future__ import annotations

import sys
import textwrap
import types
import weakref
from dataclasses import dataclass
from typing import Any

from colibri._ffi import ffi, lib
from colibri.errors import error_for
from colibri.hf.linears import DECODE_ROWS, weight_array
from colibri.hf.module_attrs import parameter
from colibri.hf.norms import float_codes
from colibri.hf.source_forms import function_form, source_form
from colibri.kernels import linear
from colibri.linear import PackedWeight, plain_weight

__all__ = ["FORMS", "RouterForm", "router_form", "router_topk", "use_decode_routers"]


@dataclass(frozen=True)
class RouterForm:
    """What a recognised router computes after its logits: whether the k
    probabilities are divided by their sum (``renorm``: "always", or the
    name of the module's flag), and the scores' dtype ("logits": the
    logits', or "float32")."""

    source: str
    renorm: str
    scores: str


_HEAD = """
hidden_states = hidden_states.reshape(-1, self.hidden_dim)
router_logits = F.linear(hidden_states, self.weight)
"""

#: The forwards taken over: Qwen2/3-MoE and OLMoE (renormalised when
#: ``norm_topk_prob``), Qwen3.5-MoE and Qwen3-VL-MoE (always), Mixtral and
#: MiniMax (always, scores left in float32).
FORMS: dict[str, RouterForm] = {
    "softmax_topk": RouterForm(_HEAD + """
router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
if self.norm_topk_prob:
    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
router_top_value = router_top_value.to(router_logits.dtype)
router_scores = router_top_value
return (router_logits, router_scores, router_indices)
""", renorm="norm_topk_prob", scores="logits"),
    "softmax_topk_renorm": RouterForm(_HEAD + """
router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
router_top_value = router_top_value.to(router_logits.dtype)
router_scores = router_top_value
return (router_logits, router_scores, router_indices)
""", renorm="always", scores="logits"),
    "softmax_float_topk_renorm": RouterForm(_HEAD + """
router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
router_scores = router_top_value
return (router_logits, router_scores, router_indices)
""", renorm="always", scores="float32"),
}

_ERR_LEN = 256


_FORM_STATEMENTS = {name: source_form("def forward(self, hidden_states):" + textwrap.indent(form.source, "    "))
                    for name, form in FORMS.items()}


def router_form(cls: type) -> str | None:
    """Which of :data:`FORMS` ``cls.forward`` computes, or None (another
    routing, or a forward whose source cannot be read)."""
    form = function_form(getattr(cls, "forward", None))
    if form is None:
        return None
    return next((name for name, known in _FORM_STATEMENTS.items() if known == form), None)


def router_topk(logits: Any, k: int, renorm: bool, scores_dtype: Any = None) -> tuple[Any, Any]:
    """(scores, indices) of a softmax top-k routing of ``logits`` (a CPU
    torch tensor of rows of expert logits, float32 or bfloat16,
    contiguous): the k largest softmax probabilities of each row, largest
    first, divided by their sum when ``renorm``, as ``scores_dtype``
    (float32 or bfloat16; default the logits'), and their experts (int64)."""
    torch = sys.modules["torch"]
    codes = float_codes()
    scores_dtype = logits.dtype if scores_dtype is None else scores_dtype
    if logits.dtype not in codes or scores_dtype not in codes:
        raise TypeError(f"router_topk takes float32 or bfloat16 logits and scores, not {logits.dtype} "
                        f"and {scores_dtype}")
    if not logits.is_cpu or not logits.is_contiguous() or logits.dim() < 1:
        raise ValueError(f"router_topk computes contiguous CPU rows, not a {logits.device} tensor of "
                         f"shape {tuple(logits.shape)}")
    return _compute(logits, int(k), bool(renorm), scores_dtype, codes, torch)


def _compute(logits: Any, k: int, renorm: bool, scores_dtype: Any, codes: dict[Any, int], torch: Any) -> tuple[Any, Any]:
    n = logits.shape[-1]
    rows = logits.numel() // n if n else 0
    scores = torch.empty((*logits.shape[:-1], k), dtype=scores_dtype)
    index = torch.empty((*logits.shape[:-1], k), dtype=torch.int64)
    err = ffi.new("char[]", _ERR_LEN)
    rc = lib.coli_router_topk(ffi.cast("const void *", logits.data_ptr()), codes[logits.dtype], rows, n, k,
                              int(renorm), ffi.cast("void *", scores.data_ptr()), codes[scores_dtype],
                              ffi.cast("int64_t *", index.data_ptr()), err, _ERR_LEN)
    if rc < 0:
        raise error_for(rc, ffi.string(err).decode(errors="replace"))
    return scores, index


# The kernel's view of each router's weight, made again when the parameter
# was replaced (kept outside the module: a deep copy makes its own).
_weights: "weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], PackedWeight]]" = weakref.WeakKeyDictionary()


def kernel_weight(module: Any, w: Any) -> PackedWeight:
    """Router ``module``'s weight ``w`` as colibri's linear kernel reads it
    (a view of its memory), made again when the parameter was replaced."""
    key = (w.data_ptr(), w.dtype, tuple(w.shape))
    held = _weights.get(module)
    if held is None or held[0] != key:
        held = _weights[module] = (key, plain_weight(weight_array(w)))
    return held[1]


def weight_fits(module: Any, dtype: Any) -> bool:
    """Whether router ``module``'s weight is one :func:`native_forward`
    routes rows of ``dtype`` with: of that dtype, float32 or bfloat16, a CPU
    matrix of ``hidden_dim`` contiguous columns, ``top_k`` of its rows at
    most."""
    w = parameter(module, "weight")
    return w is not None and w.dtype == dtype and dtype in float_codes() and w.is_cpu and w.dim() == 2 \
        and w.shape[1] == int(module.hidden_dim) and w.is_contiguous() and 1 <= int(module.top_k) <= w.shape[0]


def native_forward(self: Any, hidden_states: Any) -> Any:
    """A router's forward as :func:`use_decode_routers` sets it, bound to
    the module: the logits by colibri's kernel and the routing by
    ``coli_router_topk`` for a few rows without autograd, else the class's
    own forward."""
    torch = sys.modules["torch"]
    w = self.weight
    codes = float_codes()
    n_in = int(self.hidden_dim)
    rows = hidden_states.numel() // n_in if n_in else 0
    if 0 < rows <= DECODE_ROWS and weight_fits(self, hidden_states.dtype) and hidden_states.is_cpu \
            and hidden_states.shape[-1] == n_in \
            and not (torch.is_grad_enabled() and (hidden_states.requires_grad or w.requires_grad)):
        form = FORMS[self.colibri_router_form]
        logits = linear(kernel_weight(self, w), hidden_states.reshape(rows, n_in).contiguous())
        renorm = True if form.renorm == "always" else bool(getattr(self, form.renorm))
        scores_dtype = logits.dtype if form.scores == "logits" else torch.float32
        scores, index = _compute(logits, int(self.top_k), renorm, scores_dtype, codes, torch)
        return logits, scores, index
    return type(self).forward(self, hidden_states)


def use_decode_routers(model: Any) -> int:
    """Gives each module of ``model`` whose class's forward is one of
    :data:`FORMS` a forward that routes at most
    :data:`~colibri.hf.linears.DECODE_ROWS` rows without autograd natively
    and anything else with the class's own; returns how many. The module,
    its class and its parameters stay as they are; a module that already
    has a forward of its own is left alone."""
    forms: dict[type, str | None] = {}
    count = 0
    for module in model.modules():
        cls = type(module)
        if cls not in forms:
            forms[cls] = router_form(cls) if "Router" in cls.__name__ else None
        form = forms[cls]
        if form is None or "forward" in vars(module) \
                or not all(hasattr(module, a) for a in ("weight", "top_k", "hidden_dim")) \
                or (FORMS[form].renorm != "always" and not hasattr(module, FORMS[form].renorm)):
            continue
        module.colibri_router_form = form
        module.forward = types.MethodType(native_forward, module)
        count += 1
    return count
