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
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["DECODE_SDPA", "decode_sdpa", "register_sdpa_like", "use_decode_sdpa"]

#: The attention implementation's name in transformers' registry.
DECODE_SDPA = "colibri_sdpa"

# Keywords that change what SDPA computes: a call with any of them set goes
# to transformers' own function unchanged.
_OTHER_MATH = ("softcap", "s_aux", "sinks", "position_bias", "output_attentions")


def _packable(module: Any, query: Any, attention_mask: Any, kwargs: dict[str, Any]) -> bool:
    if query.shape[2] != 1 or not query.is_cpu or (getattr(module, "num_key_value_groups", 1) or 1) <= 1:
        return False
    if attention_mask is not None and attention_mask.shape[1] != 1:
        return False        # a per-head mask: transformers reshapes it itself
    for k in _OTHER_MATH:
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


def decode_sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                **kwargs: Any) -> tuple[Any, None]:
    """transformers' ``sdpa`` attention function, with one-query steps of a
    grouped-query layer on the CPU computed over the key/value heads (query
    (batch, heads, 1, dim) as (batch, kv_heads, heads / kv_heads, dim)).
    Returns (batch, 1, heads, dim) and None, as transformers' does."""
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


def use_decode_sdpa(model: Any) -> bool:
    """Switches a model whose attention is transformers' ``sdpa`` to
    :func:`decode_sdpa`; True if it did (another implementation is left
    alone)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    register_sdpa_like(DECODE_SDPA, decode_sdpa)
    model.set_attn_implementation(DECODE_SDPA)
    return True
