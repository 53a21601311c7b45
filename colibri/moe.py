"""A small reference MoE engine path over a Store (numpy, float32 compute).

It shows how an engine should hold leases: route the batch, lease the union of
the chosen experts once (all or nothing; in slot-sized groups when the union
is larger than the layer's cache), compute, and release before the next
layer, so a layer never pins more slots than its top-k union.

Three steps, usable separately:

* :func:`route` turns router weights and hidden states into top-k expert
  indices and weights. ``scoring="softmax"`` covers Mixtral, Qwen2-MoE,
  Qwen3-MoE and OLMoE (``norm_topk_prob`` as in their configs);
  ``scoring="sigmoid"`` with ``bias`` (``e_score_correction_bias``),
  ``n_group``/``topk_group`` and ``routed_scaling_factor`` covers DeepSeek-V3
  and GLM-4.5-MoE. Each variant is checked against ``transformers`` in
  ``tests/test_transformers_integration.py``.
* :func:`experts_forward` computes the routed-expert output for given
  indices and weights (any router's, e.g. transformers' own), leasing each
  chosen expert once.
* :func:`moe_layer` does both. Shared experts, dense MLPs and the rest of the
  block are the engine's business, not the store's.

Experts may be of any layout and format the store reads (fused gate_up,
(in, out) orientation, block-scaled FP8, MXFP4, int4, GPTQ, AWQ), dequantized
per leased expert with :func:`colibri.dequantize`; compute is float32.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colibri.dequant import dequantize as dequantize_lease
from colibri.store import Store

__all__ = ["route", "swiglu", "expert_weights", "experts_forward", "moe_layer"]


def _f32(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == np.float32 else a.astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    # Descending, ties broken by the lower expert index.
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def route(router_weight: np.ndarray, hidden: np.ndarray, top_k: int, *,
          scoring: str = "softmax", norm_topk_prob: bool = True,
          bias: np.ndarray | None = None, n_group: int = 1, topk_group: int = 1,
          routed_scaling_factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Top-k routing of ``hidden`` (tokens, hidden) by ``router_weight`` (experts, hidden).

    Returns expert indices (tokens, top_k), best first, and their weights
    (tokens, top_k) float32.

    * ``scoring="softmax"`` (default): probabilities = softmax of the router
      logits over all experts; the top_k are kept, renormalised to sum to 1 if
      ``norm_topk_prob`` (Mixtral always; Qwen2/3-MoE and OLMoE per config).
    * ``scoring="sigmoid"`` (DeepSeek-V3, GLM-4.5-MoE): scores = sigmoid of the
      logits; experts are *chosen* by ``scores + bias`` restricted to the best
      ``topk_group`` of ``n_group`` expert groups (a group's score is the sum of
      its two best biased scores) but *weighted* by the unbiased scores,
      renormalised if ``norm_topk_prob``, then times ``routed_scaling_factor``.
    """
    logits = _f32(np.atleast_2d(hidden)) @ _f32(router_weight).T
    n_experts = logits.shape[1]
    if not 0 < top_k <= n_experts:
        raise ValueError(f"top_k must be in 1..{n_experts}, got {top_k}")
    if scoring == "softmax":
        if bias is not None or n_group != 1:
            raise ValueError("bias and expert groups belong to scoring='sigmoid'")
        probs = _softmax(logits)
        top = _top(probs, top_k)
        weights = np.take_along_axis(probs, top, axis=1)
        if norm_topk_prob:
            weights = weights / weights.sum(axis=1, keepdims=True)
    elif scoring == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-logits))
        choice = scores if bias is None else scores + _f32(np.asarray(bias))[None, :]
        if n_group < 1 or n_experts % n_group or not 0 < topk_group <= n_group:
            raise ValueError(f"{n_experts} experts cannot form {n_group} groups with "
                             f"topk_group={topk_group}")
        if n_group > 1:
            grouped = choice.reshape(len(choice), n_group, n_experts // n_group)
            best_two = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)
            keep = _top(best_two, topk_group)
            mask = np.zeros((len(choice), n_group), dtype=bool)
            np.put_along_axis(mask, keep, True, axis=1)
            choice = np.where(np.repeat(mask, n_experts // n_group, axis=1), choice, -np.inf)
        top = _top(choice, top_k)
        weights = np.take_along_axis(scores, top, axis=1)
        if norm_topk_prob:
            weights = weights / (weights.sum(axis=1, keepdims=True) + 1e-20)
        weights = weights * np.float32(routed_scaling_factor)
    else:
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', not {scoring!r}")
    return top, weights.astype(np.float32)


def swiglu(gate: np.ndarray, up: np.ndarray, down: np.ndarray, x: np.ndarray) -> np.ndarray:
    """down @ (silu(gate @ x) * (up @ x)) for a batch x of shape (tokens, hidden).

    gate and up are (intermediate, hidden), down (hidden, intermediate), any
    float dtype; compute is float32.
    """
    g = x @ _f32(gate).T
    u = x @ _f32(up).T
    return (g / (1.0 + np.exp(-g)) * u) @ _f32(down).T


def expert_weights(ex: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gate, up, down) of a leased expert, ready for :func:`swiglu`.

    Unscaled weights stored as Mixtral stores them (gate (I, H), not fused)
    are returned as the leased arrays themselves (swiglu converts them), so
    no copy outlives the computation; every other layout and format goes
    through :func:`colibri.dequantize` (float32 copies).
    """
    info = ex.tensors
    if info.format.zero_copy and not info.fused and not info.transposed:
        return ex.gate, ex.up, ex.down
    weights = dequantize_lease(ex)
    return weights["gate"], weights["up"], weights["down"]


def _biased(y: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    return y if bias is None else y + bias


def _expert(ex: Any, x: np.ndarray, activation: str, limit: float, alpha: float) -> np.ndarray:
    """One expert applied to x (tokens, hidden)."""
    if activation == "silu" and not ex.tensors.extras:
        gate, up, down = expert_weights(ex)
        y = swiglu(gate, up, down, x)
        del gate, up, down  # no leased array outlives the lease
        return y
    w = dequantize_lease(ex)
    g = _biased(x @ w["gate"].T, w.get("gate_bias"))
    u = _biased(x @ w["up"].T, w.get("up_bias"))
    if activation == "silu":
        h = g / (1.0 + np.exp(-g)) * u
    else:  # gpt-oss: clamped, with a sigmoid gate and up + 1
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
        h = (u + 1.0) * g * (0.5 + 0.5 * np.tanh(0.5 * alpha * g))  # sigmoid, without overflow
    return np.asarray(_biased(h @ w["down"].T, w.get("down_bias")), dtype=np.float32)


def experts_forward(store: Store, layer: int, hidden: np.ndarray, top_k_index: np.ndarray,
                    top_k_weights: np.ndarray, *, activation: str = "silu",
                    weights_on_input: bool = False, swiglu_limit: float = 7.0,
                    swiglu_alpha: float = 1.702) -> np.ndarray:
    """The routed-expert output of ``layer`` for the given routing.

    ``hidden`` is (tokens, hidden); ``top_k_index`` (tokens, k) expert numbers
    and ``top_k_weights`` (tokens, k) their weights, from :func:`route` or any
    other router. Token t gets ``sum_j w[t, j] * expert_{idx[t, j]}(x_t)``
    (``weights_on_input``: ``expert(w[t, j] * x_t)``, as Llama 4 does).
    ``activation`` is ``"silu"`` (``down(silu(gate x) * up x)``, biases added
    where the checkpoint has them) or ``"gpt_oss"`` (gate clamped at
    ``swiglu_limit``, up to +-``swiglu_limit``, ``down((up + 1) * gate *
    sigmoid(swiglu_alpha * gate))``). Experts of any layout and format are
    dequantized per leased expert. Every expert chosen by some token is
    leased once, all or nothing, in groups of at most the layer's slot count
    (one group when the union fits), and released before returning. Returns
    float32 (tokens, hidden).
    """
    if activation not in ("silu", "gpt_oss"):
        raise ValueError(f"activation must be 'silu' or 'gpt_oss', not {activation!r}")
    x = _f32(np.atleast_2d(np.asarray(hidden)))
    idx = np.asarray(top_k_index)
    w = _f32(np.asarray(top_k_weights))
    if idx.ndim == 1:  # top-1 given as vectors
        idx = idx[:, None]
    if w.ndim == 1:
        w = w[:, None]
    if idx.shape != w.shape or idx.shape[0] != x.shape[0]:
        raise ValueError(f"top_k_index {idx.shape} and top_k_weights {w.shape} must both be "
                         f"(tokens, k) for {x.shape[0]} tokens")
    out = np.zeros_like(x)
    union = [int(e) for e in np.unique(idx)]
    # A big batch may choose more experts than the layer has slots: lease the
    # union in groups the cache can hold at once, each all or nothing.
    group = max(1, store.slots(layer))
    for start in range(0, len(union), group):
        with store.lease_many(layer, union[start:start + group]) as leases:
            for lease in leases:
                rows, slot = np.nonzero(idx == lease.expert)
                scale = w[rows, slot, None]
                if weights_on_input:
                    y = _expert(lease, x[rows] * scale, activation, swiglu_limit, swiglu_alpha)
                else:
                    y = scale * _expert(lease, x[rows], activation, swiglu_limit, swiglu_alpha)
                # np.add.at: a token may pick the same expert in two of its k slots.
                np.add.at(out, rows, y)
    return out


def moe_layer(store: Store, layer: int, router_weight: np.ndarray, hidden: np.ndarray,
              top_k: int, **routing: Any) -> np.ndarray:
    """Route ``hidden`` (tokens, hidden) and return the routed-expert output.

    ``routing`` keywords go to :func:`route` (default: Mixtral-style softmax
    with renormalised top-k).
    """
    x = _f32(np.atleast_2d(hidden))
    experts, weights = route(router_weight, x, top_k, **routing)
    return experts_forward(store, layer, x, experts, weights)
