"""colibri.moe without transformers: routing variants and the experts path."""

from __future__ import annotations

import numpy as np
import pytest

import colibri
from colibri import moe

from conftest import expected_experts


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def reference_output(model, layer: int, x: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
    experts = expected_experts(model)
    out = np.zeros((len(x), x.shape[1]), np.float64)
    for t in range(len(x)):
        for k in range(idx.shape[1]):
            parts = experts[(layer, int(idx[t, k]))]
            g, u, d = (parts[r].astype(np.float64) for r in ("gate", "up", "down"))
            out[t] += w[t, k] * (d @ (silu(g @ x[t]) * (u @ x[t])))
    return out


def test_route_softmax_default_is_mixtral_style() -> None:
    rng = np.random.default_rng(0)
    router, x = rng.standard_normal((8, 16)), rng.standard_normal((10, 16))
    idx, w = moe.route(router, x, 3)
    logits = x.astype(np.float32) @ router.astype(np.float32).T
    for t in range(10):
        best = sorted(range(8), key=lambda e: -logits[t, e])[:3]
        assert list(idx[t]) == best
        chosen = np.exp(logits[t, best] - logits[t, best].max())
        np.testing.assert_allclose(w[t], chosen / chosen.sum(), rtol=1e-5)
    assert w.dtype == np.float32


def test_route_softmax_without_renormalising() -> None:
    rng = np.random.default_rng(1)
    router, x = rng.standard_normal((6, 8)), rng.standard_normal((4, 8))
    idx, w = moe.route(router, x, 2, norm_topk_prob=False)
    logits = x @ router.T
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(w, np.take_along_axis(probs, idx, 1), rtol=1e-5)
    assert (w.sum(axis=1) < 1).all()


def test_route_sigmoid_with_bias_groups_and_scaling() -> None:
    rng = np.random.default_rng(2)
    router, x = rng.standard_normal((8, 12)), rng.standard_normal((20, 12))
    bias = rng.random(8) * 0.5
    idx, w = moe.route(router, x, 2, scoring="sigmoid", bias=bias, n_group=4, topk_group=2,
                       routed_scaling_factor=2.5)
    scores = 1 / (1 + np.exp(-(x @ router.T)))
    for t in range(20):
        biased = scores[t] + bias
        groups = biased.reshape(4, 2).sum(axis=1)            # two per group: both are the best two
        kept = set(np.argsort(-groups)[:2])
        allowed = [e for e in range(8) if e // 2 in kept]
        best = sorted(allowed, key=lambda e: -biased[e])[:2]
        assert sorted(idx[t]) == sorted(best)
        want = scores[t, idx[t]] / scores[t, idx[t]].sum() * 2.5
        np.testing.assert_allclose(w[t], want, rtol=1e-5)


def test_route_rejects_bad_settings() -> None:
    router, x = np.ones((4, 3)), np.ones((2, 3))
    for kwargs, msg in [({"top_k": 5}, "top_k"), ({"top_k": 0}, "top_k"),
                        ({"top_k": 1, "scoring": "relu"}, "scoring"),
                        ({"top_k": 1, "bias": np.zeros(4)}, "sigmoid"),
                        ({"top_k": 1, "scoring": "sigmoid", "n_group": 3}, "groups"),
                        ({"top_k": 1, "scoring": "sigmoid", "n_group": 2, "topk_group": 3}, "groups")]:
        with pytest.raises(ValueError, match=msg):
            moe.route(router, x, **kwargs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_experts_forward_matches_a_reference(model_factory, dtype: str) -> None:
    model = model_factory(layout="mlp_experts", n_layers=3, n_experts=6, dense_layers=1, dtype=dtype)
    rng = np.random.default_rng(4)
    layer = model.layers[-1]
    x = rng.standard_normal((9, model.hidden)).astype(np.float32)
    idx = np.argsort(rng.random((9, 6)), axis=1)[:, :2]
    idx[0] = [3, 3]                                         # the same expert twice: counted twice
    w = rng.random((9, 2)).astype(np.float32)
    with colibri.open_store(model.path, slots_per_layer=4, prefetch_workers=0) as store:
        got = moe.experts_forward(store, layer, x, idx, w)
        assert store.active_leases == 0
        one = moe.experts_forward(store, layer, x, idx[:, 0], w[:, 0])   # top-1 as vectors
    want = reference_output(model, layer, x, idx, w)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(one, reference_output(model, layer, x, idx[:, :1], w[:, :1]),
                               rtol=1e-4, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="tokens, k"):
        moe.experts_forward(store, layer, x, idx, w[:, :1])


def test_moe_layer_routes_then_computes(model_factory) -> None:
    model = model_factory(layout="mixtral", n_layers=2, n_experts=8, dtype="float16")
    rng = np.random.default_rng(5)
    layer = model.layers[0]
    router = model.routers()[layer]
    x = rng.standard_normal((7, model.hidden)).astype(np.float32)
    with colibri.open_store(model.path, slots_per_layer=8, prefetch_workers=0) as store:
        got = moe.moe_layer(store, layer, router, x, 2, norm_topk_prob=False)
    idx, w = moe.route(router, x, 2, norm_topk_prob=False)
    want = reference_output(model, layer, x, idx, w)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5 * np.abs(want).max())
