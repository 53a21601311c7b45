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
(in, out) orientation, block-scaled FP8, MXFP4, int4, GPTQ, AWQ): each lease
group is computed by colibri's native kernels straight from the slots
(:func:`colibri.experts_ffn`), in float32.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from colibri.dequant import dequantize as dequantize_lease
from colibri.kernels import experts_ffn
from colibri.store import LeaseGroup, Store

__all__ = ["route", "swiglu", "expert_weights", "experts_forward", "moe_layer", "LayerStream"]


def _f32(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == np.float32 else a.astype(np.float32)


class LayerStream:
    """The experts a layer needs, leased in groups its cache holds at once:
    iterate to get each group leased (a :class:`~colibri.LeaseGroup`, all
    or nothing), released when the loop moves on. ``len()`` is the number
    of groups; ``groups`` lists them, in the order given.

    A union that fits the layer's slots is one group. A larger one streams
    through the cache once: with I/O workers (``prefetch_workers > 0``) and
    two slots or more, in groups of half the slots, and while a group is
    leased the next one is prefetched into the other half (a prefetch never
    evicts a leased slot), so its reads overlap this group's compute;
    without workers, in groups of all the slots, each read by its lease.

    A union that fits is one group; with workers, when only part of it is
    resident, the resident experts come first (``Store.lease_hits``) while
    the workers read the others (``Store.start_reads``), which follow as a
    second group (``lease_many``): their reads overlap the first group's
    compute. ``groups`` and ``len()`` count the planned groups.
    """

    def __init__(self, store: Store, layer: int, experts: Sequence[int]) -> None:
        self.store, self.layer = store, layer
        slots = store.slots(layer)
        self.streaming = len(experts) > slots > 1 and store.prefetch_workers > 0
        size = slots // 2 if self.streaming else slots
        self.groups = [list(experts)] if len(experts) <= size else \
            [list(experts[i:i + size]) for i in range(0, len(experts), size)]

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[LeaseGroup]:
        store, groups = self.store, self.groups
        if len(groups) == 1 and len(groups[0]) > 1 and store.prefetch_workers > 0:
            yield from self._hits_first(groups[0])
            return
        for g, group in enumerate(groups):
            with store.lease_many(self.layer, group) as leased:
                if self.streaming and g + 1 < len(groups):
                    store.prefetch([(self.layer, e) for e in groups[g + 1]])
                yield leased

    def _hits_first(self, group: list[int]) -> Iterator[LeaseGroup]:
        # The resident experts compute while the workers read the others.
        store, layer = self.store, self.layer
        with store.lease_hits(layer, group) as hits:
            if len(hits) == len(group):
                yield hits
                return
            held = {lease.expert for lease in hits}
            rest = [e for e in group if e not in held]
            if hits:
                store.start_reads(layer, rest)
                yield hits
        with store.lease_many(layer, rest) as leased:
            yield leased


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
    computed by the native kernels from their slots. Every expert chosen by some token is
    leased once, all or nothing, in groups that fit the layer's slots (one
    group when the union fits; :class:`LayerStream`), and released before returning. Returns
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
    # A big batch may choose more experts than the layer has slots: the union
    # streams through the cache in groups (LayerStream), each all or nothing.
    for leases in LayerStream(store, layer, [int(e) for e in np.unique(idx)]):
        # Every (token, slot) pair of the group's experts, gathered by
        # expert: one kernel call computes them all from the slots.
        picks = [np.nonzero(idx == lease.expert) for lease in leases]
        rows = np.concatenate([r for r, _ in picks])
        scale = w[rows, np.concatenate([k for _, k in picks]), None]
        xs = x[rows] * scale if weights_on_input else x[rows]
        y = experts_ffn(leases, np.ascontiguousarray(xs), [len(r) for r, _ in picks],
                        activation=activation, alpha=swiglu_alpha, limit=swiglu_limit)
        # np.add.at: a token may pick the same expert in two of its k slots.
        np.add.at(out, rows, y if weights_on_input else scale * y)
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
