"""A decoder layer's decode step in one lean forward.

A transformers decoder layer computes one token through a dozen module
calls, transformers' keyword plumbing and, in colibri.hf, one operand check
and one new output tensor per native call. On a decode step of a small MoE
layer that Python costs about as much as the layer's kernels, and it runs on
one thread while the kernels use all of them. :func:`use_decode_layers`
gives each decoder layer of a family it knows (:data:`FAMILIES`) a forward
that, for one token, calls the native functions the modules' own forwards
call (norms, projections, rotary, attention, router), in the same order, on
buffers it keeps, its operands checked once per step: two native calls
(``coli_decode_qkv`` before the key/value cache's update, ``coli_decode_route``
after it) run them, and the cache's update and the experts module run as
they do: the same bits.

A step takes this path when it is one token of batch 1 on the CPU without
autograd, in the layer's dtype (float32 or bfloat16, every weight the path
reads in it), with no attention mask and colibri's decode attention
(``colibri_sdpa``), no keyword that changes the attention's math, no hook
nor forward of their own (a wrapper) on the modules it skips, and no other
thread in the same layer's step; the layer's class's forward computes
everything else.
"""

from __future__ import annotations

import sys
import threading
import types
import weakref
from typing import Any, NamedTuple

from colibri import kernels
from colibri._ffi import ffi, lib
from colibri.compute_threads import compute_pool, default_threads
from colibri.errors import error_for
from colibri.hf import routers
from colibri.hf.accept import IMPLEMENTATION
from colibri.hf.attention import DECODE_SDPA, OTHER_MATH
from colibri.hf.module_attrs import child, parameter
from colibri.hf.norms import DECODE_NORM_VALUES, WEIGHT_ORDERS, float_codes
from colibri.hf.norms import native_forward as norm_forward
from colibri.hf.norms import weight_fits as norm_weight_fits
from colibri.hf.rotary import is_native

__all__ = ["FAMILIES", "use_decode_layers"]

#: The decoder layers this path computes: transformers' modeling module,
#: the layer's class, its attention's class, its MoE block's class, and
#: whether the attention RMS-norms each query and key head (``q_norm``,
#: ``k_norm``). Each computes pre-norm grouped-query attention with the
#: rotary embedding, then a softmax top-k routed MoE block, each added to
#: the residual stream.
FAMILIES = (
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeDecoderLayer", "Qwen3MoeAttention",
     "Qwen3MoeSparseMoeBlock", True),
    ("transformers.models.mixtral.modeling_mixtral", "MixtralDecoderLayer", "MixtralAttention",
     "MixtralSparseMoeBlock", False),
)

_ERR_LEN = 256


def use_decode_layers(model: Any) -> int:
    """Gives each decoder layer of ``model`` whose classes are one of
    :data:`FAMILIES` the lean decode forward (see the module's comment);
    returns how many. A layer that already has a forward of its own is left
    alone. The modules and parameters stay as they are."""
    known = _known_classes()
    count = 0
    for module in model.modules():
        classes = known.get(type(module))
        if classes is None or "forward" in vars(module):
            continue
        attention, block, qk_norm = classes
        if type(getattr(module, "self_attn", None)) is not attention or type(getattr(module, "mlp", None)) is not block:
            continue
        module.colibri_qk_norm = qk_norm
        module.forward = types.MethodType(_decode_forward, module)
        count += 1
    return count


def _known_classes() -> dict[type, tuple[type, type, bool]]:
    known = {}
    for name, layer, attention, block, qk_norm in FAMILIES:
        mod = sys.modules.get(name)
        if mod is not None and all(hasattr(mod, c) for c in (layer, attention, block)):
            known[getattr(mod, layer)] = (getattr(mod, attention), getattr(mod, block), qk_norm)
    return known


class _Modules(NamedTuple):
    """The modules of a layer the lean step computes with (the norms of
    query and key heads None in a family without them)."""

    attn: Any
    q_proj: Any
    k_proj: Any
    v_proj: Any
    o_proj: Any
    input_norm: Any
    post_norm: Any
    mlp: Any
    gate: Any
    q_norm: Any
    k_norm: Any


def _modules_of(layer: Any) -> _Modules:
    """The layer's modules (AttributeError when one is missing)."""
    attn, mlp = child(layer, "self_attn"), child(layer, "mlp")
    qk = bool(getattr(layer, "colibri_qk_norm", False))
    return _Modules(attn, child(attn, "q_proj"), child(attn, "k_proj"), child(attn, "v_proj"),
                    child(attn, "o_proj"), child(layer, "input_layernorm"), child(layer, "post_attention_layernorm"),
                    mlp, child(mlp, "gate"), child(attn, "q_norm") if qk else None,
                    child(attn, "k_norm") if qk else None)


# Each layer's plans by dtype, with weak references to the modules they were
# made for (kept outside the module, and holding no module: a deep copy of
# the model makes its own, and a dropped model is freed).
_plans: "weakref.WeakKeyDictionary[Any, dict[Any, tuple[tuple[Any, ...], _Plan | None]]]" = \
    weakref.WeakKeyDictionary()


def _decode_forward(self: Any, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
    """The layer's forward as :func:`use_decode_layers` sets it."""
    by_dtype = _plans.get(self)
    if by_dtype is None:
        by_dtype = _plans[self] = {}
    dtype = getattr(hidden_states, "dtype", None)
    try:
        modules = _modules_of(self)
    except AttributeError:      # a module replaced by one without the family's parts
        return type(self).forward(self, hidden_states, *args, **kwargs)
    held = by_dtype.get(dtype)
    if held is None or any(r() is not m for r, m in zip(held[0], modules)):
        held = by_dtype[dtype] = (tuple(weakref.ref(m) if m is not None else _none for m in modules),
                                  _Plan.make(modules, dtype))
    plan = held[1]
    if plan is not None and not args and plan.lock.acquire(blocking=False):
        try:
            out = plan.step(self, modules, hidden_states, kwargs)
        finally:
            plan.lock.release()
        if out is not None:
            return out
    return type(self).forward(self, hidden_states, *args, **kwargs)


def _none() -> None:
    """A dead reference's stand-in, for a module a family does not have."""
    return None


class _Plan:
    """One layer's lean step for one dtype: its sizes, buffers and native
    calls (its modules are looked up at every step)."""

    @staticmethod
    def make(m: _Modules, dtype: Any) -> "_Plan | None":
        """The plan of a layer of modules ``m`` for ``dtype`` activations, or
        None when its sizes are not ones this path computes (whether its
        weights are is asked at every step: they may change)."""
        codes = float_codes()
        if dtype not in codes:
            return None
        attn = m.attn
        try:
            hidden = int(m.input_norm.weight.numel())
            heads, kv_heads = int(attn.config.num_attention_heads), int(attn.config.num_key_value_heads)
            d, experts = int(attn.head_dim), int(m.gate.weight.shape[0])
        except (AttributeError, TypeError, IndexError):
            return None
        if min(hidden, kv_heads, d, experts) < 1 or heads <= kv_heads or heads % kv_heads \
                or max(hidden, heads * d) > DECODE_NORM_VALUES:
            return None     # not grouped-query attention, or norms their forward computes with torch
        return _Plan(dtype, hidden, heads, kv_heads, d, m.q_norm is not None, experts)

    def __init__(self, dtype: Any, hidden: int, heads: int, kv_heads: int, d: int, qk_norm: bool,
                 experts: int) -> None:
        torch = sys.modules["torch"]
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.attention_functions: Any = ALL_ATTENTION_FUNCTIONS
        self.dtype, self.code = dtype, float_codes()[dtype]
        self.hidden, self.heads, self.kv_heads, self.d, self.qk_norm = hidden, heads, kv_heads, d, qk_norm
        self.experts = experts
        self.lock = threading.Lock()
        self.err = ffi.new("char[]", _ERR_LEN)
        empty = torch.empty
        self.normed = empty((1, 1, hidden), dtype=dtype)      # the input norm's output
        self.q = empty((1, 1, heads, d), dtype=dtype)
        self.k = empty((1, 1, kv_heads, d), dtype=dtype)
        self.q_normed = empty((1, 1, heads, d), dtype=dtype)
        self.k_normed = empty((1, 1, kv_heads, d), dtype=dtype)
        self.q_rotated = empty((1, heads, 1, d), dtype=dtype)
        self.attended = empty((1, 1, heads, d), dtype=dtype)
        self.o = empty((1, 1, hidden), dtype=dtype)
        self.post = empty((1, hidden), dtype=dtype)           # the post-attention norm's output
        self.logits = empty((1, experts), dtype=dtype)
        self.residual = empty((1, 1, hidden), dtype=dtype)     # h + o
        code = self.code
        self.qkv = ffi.new("ColiDecodeQkv *", {
            "format": code, "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "d": d, "qk_norm": int(qk_norm),
            **{name: _ptr(getattr(self, name)) for name in ("normed", "q", "k", "q_normed", "k_normed",
                                                           "q_rotated")}})
        self.route = ffi.new("ColiDecodeRoute *", {
            "format": code, "hidden": hidden, "experts": experts,
            "attention": {"q": _ptr(self.q_rotated), "out": _ptr(self.attended), "batch": 1, "heads": heads,
                          "kv_heads": kv_heads, "d": d, "dv": d, "format": code},
            **{name: _ptr(getattr(self, name)) for name in ("attended", "o", "residual", "post", "logits")}})
        self.shapes = ((heads * d, hidden), (kv_heads * d, hidden), (kv_heads * d, hidden), (hidden, heads * d),
                       (experts, hidden))

    def _fitting_weights(self, m: _Modules) -> tuple[list[Any], list[Any]] | None:
        """The norms' weights (input, post-attention, then query and key
        heads') and the projections' and the router's PackedWeight, when
        every weight the step reads is what this plan was made for, as the
        modules' native forwards take it; else None."""
        dtype = self.dtype
        norms = [self._norm_weight(m.input_norm, self.hidden), self._norm_weight(m.post_norm, self.hidden)]
        if self.qk_norm:
            norms += (self._norm_weight(m.q_norm, self.d), self._norm_weight(m.k_norm, self.d))
        for w in norms:
            if w is None:
                return None
        for x in (m.attn, m.mlp, m.q_proj, m.k_proj, m.v_proj, m.o_proj):
            if "forward" in x.__dict__:
                return None     # a forward of the module's own: the path would skip it
        weights = []
        for p, shape in zip((m.q_proj, m.k_proj, m.v_proj, m.o_proj), self.shapes):
            w = _projection_weight(p, dtype)
            if w is None or tuple(w.shape) != shape:
                return None
            weights.append(w)
        gate = m.gate
        if not _routes_natively(gate, dtype, self.hidden):
            return None
        router = routers.kernel_weight(gate, parameter(gate, "weight"))
        if tuple(router.shape) != self.shapes[4]:
            return None
        weights.append(router)
        return norms, weights

    def _norm_weight(self, norm: Any, n: int) -> Any:
        """RMS norm ``norm``'s weight of ``n`` values, when its native
        forward computes with it in this plan's dtype; else None."""
        d = norm.__dict__
        w = parameter(norm, "weight")
        if w is None or not d.get("colibri_rms_form") \
                or getattr(d.get("forward"), "__func__", None) is not norm_forward \
                or w.dtype != self.dtype or not norm_weight_fits(w) or w.shape[0] != n:
            return None
        return w

    def _fits(self, layer: Any, m: _Modules, h: Any, kwargs: dict[str, Any], torch: Any) -> bool:
        """Whether this step is one the modules would compute natively."""
        if torch.is_grad_enabled() or h.dtype != self.dtype or tuple(h.shape) != (1, 1, self.hidden) \
                or not h.is_cpu or not h.is_contiguous() or layer.training or m.attn.training or m.mlp.training:
            return False
        if kwargs.get("attention_mask") is not None or m.attn.config._attn_implementation != DECODE_SDPA \
                or self.attention_functions.get_interface(DECODE_SDPA, None) is None:
            return False
        if any(kwargs.get(k) is not None and kwargs[k] is not False for k in OTHER_MATH):
            return False
        hooks = torch.nn.modules.module
        if hooks._global_forward_hooks or hooks._global_forward_pre_hooks \
                or any(x is not None and (x._forward_hooks or x._forward_pre_hooks) for x in m):
            return False
        return is_native(sys.modules[type(m.attn).__module__].apply_rotary_pos_emb)

    def step(self, layer: Any, m: _Modules, h: Any, kwargs: dict[str, Any]) -> Any:
        """The output of ``layer`` (modules ``m``) for ``h`` (1, 1, hidden),
        or None when this step does not fit the path (nothing computed
        then)."""
        torch = sys.modules["torch"]
        if not self._fits(layer, m, h, kwargs, torch):
            return None
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        pe = kwargs.get("position_embeddings")
        if cache is None or pe is None or len(pe) != 2:
            return None
        cos, sin = pe
        d = self.d
        if not all(isinstance(t, torch.Tensor) and t.dtype == self.dtype and tuple(t.shape) == (1, 1, d)
                   and t.is_cpu and t.is_contiguous() for t in (cos, sin)):
            return None
        fitted = self._fitting_weights(m)
        if fitted is None:
            return None
        norms, weights = fitted
        pool = compute_pool(default_threads(True))
        isa = kernels.call_isa()
        # attention, as the attention module's forward computes it: norm, projections, rotary
        qkv = self.qkv
        v = torch.empty((1, 1, self.kv_heads, d), dtype=self.dtype)
        k_rotated = torch.empty((1, self.kv_heads, 1, d), dtype=self.dtype)
        qkv.isa, qkv.h, qkv.cos, qkv.sin, qkv.v, qkv.k_rotated = isa, _ptr(h), _ptr(cos), _ptr(sin), _ptr(v), \
            _ptr(k_rotated)
        qkv.q_proj, qkv.k_proj, qkv.v_proj = weights[0].matrix(), weights[1].matrix(), weights[2].matrix()
        _set_norm(qkv.input_norm, m.input_norm, norms[0])
        if self.qk_norm:
            _set_norm(qkv.q_norm, m.q_norm, norms[2])
            _set_norm(qkv.k_norm, m.k_norm, norms[3])
        self._check(lib.coli_decode_qkv(qkv, pool, self.err, _ERR_LEN))
        # the keywords the layer's forward gives its attention, which gives them to the cache
        passed = {key: value for key, value in kwargs.items() if key not in _LAYER_ONLY}
        keys, values = cache.update(k_rotated, v.transpose(1, 2), m.attn.layer_idx, kwargs=passed)
        # then attention, o projection, residual, post-attention norm, router and its top-k
        route = self.route
        route.isa = isa
        route.attend = self._attention_fits(keys, values, float(m.attn.scaling), isa)
        if not route.attend:
            self._attend_by_module(m.attn, keys, values, passed)
        route.h, route.o_proj, route.router = _ptr(h), weights[3].matrix(), weights[4].matrix()
        _set_norm(route.post_norm, m.post_norm, norms[1])
        scores, index = self._route_into(m.gate, route, torch)
        self._check(lib.coli_decode_route(route, pool, self.err, _ERR_LEN))
        # the MoE block, as its forward computes it
        routed = self._experts(m.mlp.experts, index, scores)
        return self.residual + routed.view(1, 1, self.hidden)

    def _experts(self, experts: Any, index: Any, scores: Any) -> Any:
        """The experts module's output for the post-attention norm's
        output: by the runtime's one-token path when the module's forward
        would call the runtime and nothing else would run (a hook, a
        forward of its own), else by the module."""
        binding = getattr(experts, "colibri_binding", None)
        if binding is not None and not (experts._forward_hooks or experts._forward_pre_hooks) \
                and "forward" not in vars(experts) \
                and getattr(getattr(experts, "config", None), "_experts_implementation", None) == IMPLEMENTATION:
            runtime, layer = binding
            out = runtime.one_token_experts(experts, layer, self.post, index, scores)
            if out is not None:
                return out
        return experts(self.post, index, scores)

    def _attention_fits(self, keys: Any, values: Any, scaling: float, isa: int) -> int:
        """1 with the route's attention set to read the cache's keys and
        values, as the decode attention computes it; 0 when the native
        call would not read them."""
        n = int(keys.shape[2]) if keys.dim() == 4 else 0
        shape = (1, self.kv_heads, n, self.d)
        if not n or tuple(keys.shape) != shape or tuple(values.shape) != shape or keys.dtype != self.dtype \
                or values.dtype != self.dtype or keys.stride(3) != 1 or values.stride(3) != 1 \
                or not (keys.is_cpu and values.is_cpu):
            return 0
        a = self.route.attention
        a.k, a.v, a.n, a.scale, a.isa = _ptr(keys), _ptr(values), n, scaling, isa
        a.k_batch, a.k_head, a.k_token = keys.stride(0), keys.stride(1), keys.stride(2)
        a.v_batch, a.v_head, a.v_token = values.stride(0), values.stride(1), values.stride(2)
        return 1

    def _attend_by_module(self, attn: Any, keys: Any, values: Any, passed: dict[str, Any]) -> None:
        """Attention over keys and values the native call does not read, by
        the attention function the module's forward would call (colibri's
        decode attention, whose own fallback then computes it)."""
        window = attn.sliding_window if hasattr(attn, "sliding_window") \
            else getattr(attn.config, "sliding_window", None)
        function = self.attention_functions.get_interface(DECODE_SDPA, None)
        out, _ = function(attn, self.q_rotated, keys, values, None, dropout=0.0, scaling=attn.scaling,
                          sliding_window=window, **passed)
        self.attended.copy_(out.reshape(self.attended.shape))

    def _route_into(self, gate: Any, route: Any, torch: Any) -> tuple[Any, Any]:
        """New scores and index tensors for the router's top-k, set in the
        route as its native forward routes."""
        form = routers.FORMS[gate.colibri_router_form]
        k = int(gate.top_k)
        renorm = True if form.renorm == "always" else bool(getattr(gate, form.renorm))
        scores_dtype = self.dtype if form.scores == "logits" else torch.float32
        scores = torch.empty((1, k), dtype=scores_dtype)
        index = torch.empty((1, k), dtype=torch.int64)
        route.top_k, route.renorm, route.scores_format = k, int(renorm), float_codes()[scores_dtype]
        route.scores, route.index = _ptr(scores), ffi.cast("int64_t *", index.data_ptr())
        return scores, index

    def _check(self, rc: int) -> None:
        if rc < 0:
            raise error_for(rc, ffi.string(self.err).decode(errors="replace"))


# Keywords of the layer's forward that its attention does not pass on to the cache.
_LAYER_ONLY = ("attention_mask", "cache", "past_key_values", "position_embeddings")


def _routes_natively(gate: Any, dtype: Any, hidden: int) -> bool:
    """Whether the router's own forward would route one row natively."""
    d = gate.__dict__
    return getattr(d.get("forward"), "__func__", None) is routers.native_forward \
        and d.get("colibri_router_form") in routers.FORMS and int(gate.hidden_dim) == hidden \
        and routers.weight_fits(gate, dtype)


def _set_norm(norm: Any, module: Any, weight: Any) -> None:
    """The ``ColiDecodeNorm`` fields of RMS norm ``module`` of weight
    ``weight`` (checked to fit by the step)."""
    norm.weight = _ptr(weight)
    norm.eps = float(module.variance_epsilon)
    norm.order = WEIGHT_ORDERS[module.colibri_rms_form]


def _ptr(t: Any) -> Any:
    return ffi.cast("void *", t.data_ptr())


def _projection_weight(module: Any, dtype: Any) -> Any:
    """The :class:`~colibri.linear.PackedWeight` colibri's kernel computes
    projection ``module`` with for ``dtype`` inputs, or None when its
    forward would not call the kernel."""
    packed = module.__dict__.get("packed")      # a packed linear's, set at its making
    if packed is not None and hasattr(packed, "matrix"):
        return packed
    own = getattr(module, "kernel_weight", None)
    w = parameter(module, "weight")
    if own is None or w is None or w.dtype != dtype or not w.is_cpu or not w.is_contiguous():
        return None
    return own()
