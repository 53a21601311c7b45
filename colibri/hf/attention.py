"""One-query attention for grouped-query models on the CPU.

transformers' SDPA attention hands a decode step without a mask (one
sequence, one new token) to torch with ``enable_gqa=True``. On the CPU,
torch's flash kernel then runs each query head on its own: measured at
94 us a layer with 80 cached tokens, 340 us with 300 and 2.5 ms with 2000
(16 query heads over 4 key/value heads, head size 64, bfloat16, one
thread), more than the layer's 4-bit projections. Laid out the way
transformers already lays out masked one-query steps (each key/value head's
group of query heads as that head's rows of queries), the same SDPA call
takes 16, 38 and 205 us. :func:`decode_sdpa` is transformers' SDPA
attention with that layout for every one-query step on the CPU;
:func:`use_decode_sdpa` switches a model to it.

A one-query step without a mask whose tensors are all float32 or all
bfloat16 (the usual decode step of one sequence) goes instead to
:func:`attend_one_query`, ``coli_decode_attention``: the query heads split
over colibri's compute threads (the ones its kernels use in that step),
products and softmax in float32. Its results differ from torch's in
rounding only, so a ``kernels="torch"`` model, which rounds as stock
transformers does, takes :func:`grouped_sdpa` instead: the same function
without the native call.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import colibri.kernels as kernels
from colibri._ffi import ffi, lib
from colibri.compute_threads import check_threads, compute_pool, default_threads
from colibri.errors import error_for

__all__ = ["DECODE_SDPA", "GROUPED_SDPA", "attend_one_query", "decode_sdpa", "grouped_sdpa", "register_sdpa_like",
           "use_decode_sdpa"]

#: The attention implementations' names in transformers' registry.
DECODE_SDPA = "colibri_sdpa"
GROUPED_SDPA = "colibri_sdpa_grouped"

# Keywords that change what SDPA computes: a call with any of them set goes
# to transformers' own function unchanged.
OTHER_MATH = ("softcap", "s_aux", "sinks", "position_bias", "output_attentions")


def _packable(module: Any, query: Any, attention_mask: Any, kwargs: dict[str, Any]) -> bool:
    if query.shape[2] != 1 or not query.is_cpu or (getattr(module, "num_key_value_groups", 1) or 1) <= 1:
        return False
    if attention_mask is not None and attention_mask.shape[1] != 1:
        return False        # a per-head mask: transformers reshapes it itself
    for k in OTHER_MATH:
        if kwargs.get(k) is not None and kwargs[k] is not False:
            return False
    return True


_functions: dict[str, Any] = {}


def _torch_and_sdpa() -> tuple[Any, Any]:
    """torch and transformers' ``sdpa`` attention function, imported once."""
    if not _functions:
        import torch
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _functions.update(torch=torch, forward=sdpa_attention_forward)
    return _functions["torch"], _functions["forward"]


def _formats() -> dict[Any, int]:
    if "formats" not in _functions:
        torch, _ = _torch_and_sdpa()
        _functions["formats"] = {torch.float32: lib.COLI_TENSOR_F32, torch.bfloat16: lib.COLI_TENSOR_BF16}
    formats: dict[Any, int] = _functions["formats"]
    return formats


def attend_one_query(query: Any, key: Any, value: Any, scaling: float | None = None, *,
                     threads: int | None = None) -> Any:
    """Softmax attention of one query per head over all of a key/value
    cache: ``query`` (batch, heads, 1, d), ``key`` (batch, kv_heads, n, d)
    and ``value`` (batch, kv_heads, n, dv), CPU tensors of one dtype
    (float32 or bfloat16) with contiguous last dimensions, ``heads`` a
    multiple of ``kv_heads`` (query head h reads key/value head
    ``h // (heads // kv_heads)``), ``scaling`` by default ``d ** -0.5``.
    Returns (batch, 1, heads, dv), the layout transformers' attention
    functions return. Computed by ``coli_decode_attention`` on ``threads``
    compute threads (default: :func:`colibri.compute_threads.default_threads` for
    torch tensors)."""
    torch, _ = _torch_and_sdpa()
    formats = _formats()
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.shape[2] != 1:
        raise ValueError(f"attention of one query: query {list(query.shape)}, key {list(key.shape)} and value "
                         f"{list(value.shape)} must be (batch, heads, 1, d), (batch, kv_heads, n, d), "
                         "(batch, kv_heads, n, dv)")
    batch, heads, _, d = (int(n) for n in query.shape)
    kv_heads, n = int(key.shape[1]), int(key.shape[2])
    dv = int(value.shape[3])
    if tuple(key.shape) != (batch, kv_heads, n, d) or tuple(value.shape[:3]) != (batch, kv_heads, n) \
            or not kv_heads or heads % kv_heads or not n:
        raise ValueError(f"attention of one query: query {list(query.shape)}, key {list(key.shape)} and value "
                         f"{list(value.shape)} do not match (heads a multiple of kv_heads, n at least 1)")
    if query.dtype not in formats or key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"attention of one query: query, key and value must all be float32 or all bfloat16, "
                         f"not {query.dtype}, {key.dtype} and {value.dtype}")
    if not (query.is_cpu and key.is_cpu and value.is_cpu):
        raise ValueError("attention of one query: CPU tensors only")
    if key.stride(3) != 1 or value.stride(3) != 1:
        raise ValueError("attention of one query: key and value rows must be contiguous")
    if query.stride(3) != 1 or query.stride(1) != d or (batch > 1 and query.stride(0) != heads * d):
        query = query.contiguous()
    out = torch.empty((batch, 1, heads, dv), dtype=query.dtype)
    call = ffi.new("ColiDecodeAttention *", {
        "q": ffi.cast("const void *", query.data_ptr()), "k": ffi.cast("const void *", key.data_ptr()),
        "v": ffi.cast("const void *", value.data_ptr()), "out": ffi.cast("void *", out.data_ptr()),
        "batch": batch, "heads": heads, "kv_heads": kv_heads, "n": n, "d": d, "dv": dv,
        "k_batch": key.stride(0), "k_head": key.stride(1), "k_token": key.stride(2),
        "v_batch": value.stride(0), "v_head": value.stride(1), "v_token": value.stride(2),
        "scale": 1.0 / math.sqrt(d) if scaling is None else float(scaling), "format": formats[query.dtype],
        "isa": kernels.call_isa()})
    pool = compute_pool(default_threads(True) if threads is None else check_threads(threads))
    err = ffi.new("char[]", 256)
    rc = lib.coli_decode_attention(call, pool, err, 256)
    if rc < 0:
        raise error_for(rc, ffi.string(err).decode(errors="replace"))
    return out


def _native_fits(query: Any, key: Any, value: Any, attention_mask: Any, dropout: float) -> bool:
    formats = _formats()
    return attention_mask is None and not dropout and query.dtype in formats and key.dtype == query.dtype \
        and value.dtype == query.dtype and key.stride(3) == 1 and value.stride(3) == 1 and key.shape[2] > 0 \
        and not (query.requires_grad or key.requires_grad or value.requires_grad)


def decode_sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                **kwargs: Any) -> tuple[Any, None]:
    """transformers' ``sdpa`` attention function, with one-query steps of a
    grouped-query layer on the CPU computed over the key/value heads:
    natively (:func:`attend_one_query`) when they have no mask and float32
    or bfloat16 tensors, else torch's SDPA with the query (batch, heads, 1,
    dim) as (batch, kv_heads, heads / kv_heads, dim). Returns (batch, 1,
    heads, dim) and None, as transformers' does."""
    if _packable(module, query, attention_mask, kwargs) and _native_fits(query, key, value, attention_mask, dropout):
        return attend_one_query(query, key, value, scaling), None
    return grouped_sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


def grouped_sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                 dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                 **kwargs: Any) -> tuple[Any, None]:
    """:func:`decode_sdpa` with torch's SDPA for every step (the grouped
    layout for one-query steps): what ``kernels="torch"`` models use, which
    round as stock transformers does."""
    torch, sdpa_attention_forward = _torch_and_sdpa()
    if not _packable(module, query, attention_mask, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    batch, heads, _, dim = query.shape
    grouped = query.reshape(batch, key.shape[1], heads // key.shape[1], dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


_registered: set[str] = set()
_register_lock = threading.Lock()


def register_sdpa_like(name: str, function: Any) -> None:
    """Registers ``function`` under ``name`` in transformers' attention
    interface, with SDPA's masks (it must take what SDPA takes); once per
    name."""
    with _register_lock:
        if name in _registered:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)
        _registered.add(name)


def use_decode_sdpa(model: Any, native: bool = True) -> bool:
    """Switches a model whose attention is transformers' ``sdpa`` to
    :func:`decode_sdpa` (``native=False``: :func:`grouped_sdpa`); True if
    it did (another implementation is left alone)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    name, function = (DECODE_SDPA, decode_sdpa) if native else (GROUPED_SDPA, grouped_sdpa)
    register_sdpa_like(name, function)
    model.set_attn_implementation(name)
    return True
