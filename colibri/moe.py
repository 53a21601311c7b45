"""A small reference MoE engine path over a Store (numpy, float32 compute).

It shows how an engine should hold leases: route the batch, lease the union of
the chosen experts once (all or nothing), compute, and release before the
next layer, so a layer never pins more slots than its top-k union.
"""

from __future__ import annotations

import numpy as np

from colibri.store import Store

__all__ = ["route", "swiglu", "moe_layer"]


def route(router_weight: np.ndarray, hidden: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Mixtral-style routing: top-k router logits, softmax over the chosen.

    hidden is (tokens, hidden); returns expert indices (tokens, top_k), in
    descending logit order, and their weights (tokens, top_k), rows summing to 1.
    """
    logits = hidden.astype(np.float32) @ router_weight.astype(np.float32).T
    top = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    chosen = np.take_along_axis(logits, top, axis=1)
    chosen = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    return top, chosen / chosen.sum(axis=1, keepdims=True)


def _f32(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == np.float32 else a.astype(np.float32)


def swiglu(gate: np.ndarray, up: np.ndarray, down: np.ndarray, x: np.ndarray) -> np.ndarray:
    """down @ (silu(gate @ x) * (up @ x)) for a batch x of shape (tokens, hidden)."""
    g = x @ _f32(gate).T
    u = x @ _f32(up).T
    return (g / (1.0 + np.exp(-g)) * u) @ _f32(down).T


def moe_layer(store: Store, layer: int, router_weight: np.ndarray, hidden: np.ndarray,
              top_k: int) -> np.ndarray:
    """The routed-expert output of one MoE layer for hidden (tokens, hidden)."""
    x = _f32(np.atleast_2d(hidden))
    experts, weights = route(router_weight, x, top_k)
    out = np.zeros_like(x)
    union = [int(e) for e in np.unique(experts)]
    with store.lease_many(layer, union) as leases:
        for lease in leases:
            rows, slot = np.nonzero(experts == lease.expert)
            y = swiglu(lease.gate, lease.up, lease.down, x[rows])
            out[rows] += weights[rows, slot, None] * y
    return out
