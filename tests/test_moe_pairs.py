"""A MoE layer's (token, position) pairs computed from the slots
(colibri.kernels.moe_ffn, coli_store_moe_ffn) and added per token
(colibri.kernels.moe_combine, coli_moe_combine).

* Each pair's row is, bit for bit, its expert applied to its token alone
  (expert_ffn), whether its expert has one pair (computed in place) or more
  (rows gathered and scattered), for numpy and torch operands, float32 and
  bfloat16 activations, on 1 and 2 threads; rows of experts not leased are
  left as they were; a routing split into lease groups gives the same rows.
* A token's sum is the weighted sum of its k rows in routing order, in
  float32, bit for bit (numpy's float32 products and sums in that order),
  rounded to bfloat16 as ml_dtypes rounds; any routing: a token's result is
  the same bits alone or in a batch (hypothesis).
* Wrong calls fail with a clear error: shapes, dtypes, overlaps, released
  leases, leases of two stores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import colibri
from colibri.kernels import expert_ffn, moe_combine, moe_ffn
from colibri.synthetic_formats import write_format_checkpoint

BF16 = np.dtype(ml_dtypes.bfloat16)
HIDDEN = 64
EXPERTS = 6


@pytest.fixture(scope="module")
def paths(tmp_path_factory: Any) -> dict[str, Path]:
    """bf16 and int4 checkpoints: two layers of six experts (hidden 64, intermediate 32)."""
    return {fmt: write_format_checkpoint(tmp_path_factory.mktemp(fmt), fmt, hidden=HIDDEN, intermediate=32,
                                         experts=EXPERTS, layers=2, group=32, seed=i, symmetric=True,
                                         block=(32, 32))
            for i, fmt in enumerate(("bf16", "int4"))}


def _store(path: Path) -> colibri.Store:
    return colibri.open_store(path, slots_per_layer=EXPERTS, prefetch_workers=0)


def _routing(rng: np.random.Generator, tokens: int, k: int, experts: int = EXPERTS) -> np.ndarray:
    """(tokens, k) int64 expert numbers, repeats within a token allowed."""
    return rng.integers(0, experts, size=(tokens, k)).astype(np.int64)


def _alone(store: colibri.Store, layer: int, x: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Each pair's row from expert_ffn on its token alone."""
    tokens, k = index.shape
    want = np.empty((tokens * k, x.shape[1]), dtype=np.float32)
    for t in range(tokens):
        for j in range(k):
            with store.lease(layer, int(index[t, j])) as ex:
                expert_ffn(ex, x[t:t + 1], out=want[t * k + j:t * k + j + 1])
    return want


def _leased_union(store: colibri.Store, layer: int, index: np.ndarray) -> Any:
    return store.lease_many(layer, sorted({int(e) for e in index.reshape(-1)}))


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("threads", [1, 2])
def test_each_pair_is_its_expert_on_its_token_alone(paths: dict[str, Path], fmt: str, dtype: Any,
                                                     threads: int) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, HIDDEN)).astype(np.float32).astype(dtype)
    index = _routing(rng, 9, 3)
    index[0] = [2, 2, 5]                       # a token choosing an expert twice
    with _store(paths[fmt]) as store:
        want = _alone(store, 1, x, index)
        pairs = np.full((index.size, HIDDEN), np.nan, dtype=np.float32)
        with _leased_union(store, 1, index) as group:
            assert moe_ffn(group, x, index, pairs, threads=threads) is pairs
        np.testing.assert_array_equal(pairs, want)
        assert store.active_leases == 0


def test_one_pair_per_expert_and_torch_operands(paths: dict[str, Path]) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, HIDDEN)).astype(np.float32)
    index = np.array([[4, 0, 3]], dtype=np.int64)  # decode: each expert one pair, computed in place
    with _store(paths["int4"]) as store:
        want = _alone(store, 0, x, index)
        pairs = torch.empty(3, HIDDEN)
        with _leased_union(store, 0, index) as group:
            moe_ffn(group, torch.from_numpy(x).bfloat16().float(), torch.from_numpy(index), pairs)
        np.testing.assert_array_equal(pairs.numpy(), _alone(store, 0, x.astype(BF16).astype(np.float32), index))
        with _leased_union(store, 0, index) as group:
            moe_ffn(group, torch.from_numpy(x), torch.from_numpy(index), pairs)
        np.testing.assert_array_equal(pairs.numpy(), want)


def test_groups_compute_their_own_pairs_and_leave_the_rest(paths: dict[str, Path]) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, HIDDEN)).astype(np.float32)
    index = _routing(rng, 5, 4)
    with _store(paths["bf16"]) as store:
        want = _alone(store, 0, x, index)
        union = sorted({int(e) for e in index.reshape(-1)})
        pairs = np.full((index.size, HIDDEN), 7.0, dtype=np.float32)
        with store.lease_many(0, union[:2] + union[:1]) as group:    # a repeated lease gets no pairs
            moe_ffn(group, x, index, pairs)
        mine = np.isin(index.reshape(-1), union[:2])
        np.testing.assert_array_equal(pairs[mine], want[mine])
        assert (pairs[~mine] == 7.0).all()
        with store.lease_many(0, union[2:]) as group:
            moe_ffn(group, x, index, pairs)
        np.testing.assert_array_equal(pairs, want)


def _weighted_sums(pairs: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """float32 w0 * y0 + w1 * y1 + ... in position order, as numpy rounds each step."""
    tokens, k = weights.shape
    y = pairs.reshape(tokens, k, -1)
    w = weights.astype(np.float32)
    acc = w[:, 0, None] * y[:, 0]
    for j in range(1, k):
        acc = acc + w[:, j, None] * y[:, j]
    return acc


@pytest.mark.parametrize("w_dtype", [np.float32, BF16])
@pytest.mark.parametrize("out_dtype", [np.float32, BF16])
def test_combine_adds_in_routing_order(w_dtype: Any, out_dtype: Any) -> None:
    rng = np.random.default_rng(4)
    tokens, k = 6, 5
    pairs = (rng.standard_normal((tokens * k, 40)) * 1e3).astype(np.float32)
    pairs[0, 0] = -0.0
    weights = rng.random((tokens, k)).astype(np.float32).astype(w_dtype)
    weights[0] = 1.0
    out = np.empty((tokens, 40), dtype=out_dtype)
    assert moe_combine(pairs, weights, out) is out
    want = _weighted_sums(pairs, weights)
    np.testing.assert_array_equal(out.view(np.uint8), want.astype(out_dtype).view(np.uint8))


def test_combine_rounds_as_torch_does() -> None:
    torch = pytest.importorskip("torch")
    pairs = torch.tensor([[1.0, float("nan"), float("inf"), 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8]])
    out = moe_combine(pairs, torch.ones(1, 1, dtype=torch.bfloat16), torch.empty(1, 5, dtype=torch.bfloat16))
    assert torch.isnan(out[0, 1])                   # a NaN stays one (its bits are torch's business)
    keep = [0, 2, 3, 4]
    assert torch.equal(out[:, keep].view(torch.int16), pairs[:, keep].to(torch.bfloat16).view(torch.int16))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), tokens=st.integers(1, 6), k=st.integers(1, 4),
       bf16=st.booleans())
def test_a_token_gets_the_same_bits_alone_or_in_a_batch(paths: dict[str, Path], seed: int, tokens: int,
                                                          k: int, bf16: bool) -> None:
    rng = np.random.default_rng(seed)
    dtype = BF16 if bf16 else np.float32
    x = rng.standard_normal((tokens, HIDDEN)).astype(dtype)
    index = _routing(rng, tokens, k)
    weights = rng.random((tokens, k)).astype(np.float32)

    def layer(x: np.ndarray, index: np.ndarray, weights: np.ndarray) -> np.ndarray:
        pairs = np.empty((index.size, HIDDEN), dtype=np.float32)
        with _leased_union(store, 1, index) as group:
            moe_ffn(group, x, index, pairs)
        return moe_combine(pairs, weights, np.empty((len(x), HIDDEN), dtype=dtype))

    with _store(paths["int4"]) as store:
        batch = layer(x, index, weights)
        for t in range(tokens):
            alone = layer(x[t:t + 1], index[t:t + 1], weights[t:t + 1])
            np.testing.assert_array_equal(alone[0].view(np.uint8), batch[t].view(np.uint8))


def test_bad_calls(paths: dict[str, Path], tmp_path: Path) -> None:
    x = np.zeros((2, HIDDEN), dtype=np.float32)
    index = np.array([[0, 1], [1, 2]], dtype=np.int64)
    pairs = np.zeros((4, HIDDEN), dtype=np.float32)
    with _store(paths["bf16"]) as store, _store(paths["int4"]) as other:
        with store.lease_many(0, [0, 1, 2]) as group:
            with pytest.raises(ValueError, match="at least one lease"):
                moe_ffn((), x, index, pairs)
            with other.lease(0, 0) as foreign:
                with pytest.raises(ValueError, match=r"leases\[1\] is not a lease"):
                    moe_ffn((group[0], foreign), x, index, pairs)
            with pytest.raises(ValueError, match="must be"):
                moe_ffn(group, x[:1], index, pairs)
            with pytest.raises(ValueError, match="must be"):
                moe_ffn(group, x, index, pairs[:3])
            with pytest.raises(TypeError, match="int32"):
                moe_ffn(group, x, index.astype(np.int32), pairs)
            with pytest.raises(TypeError, match="float16"):
                moe_ffn(group, x.astype(np.float16), index, pairs)
            with pytest.raises(ValueError, match="writable"):
                ro = pairs.copy()
                ro.flags.writeable = False
                moe_ffn(group, x, index, ro)
            with pytest.raises(ValueError, match="contiguous rows"):
                moe_ffn(group, np.zeros((HIDDEN, 2), dtype=np.float32).T, index, pairs)
            view = pairs.reshape(-1)[:x.size].reshape(x.shape)
            with pytest.raises(colibri.ColibriError, match="pairs overlap x"):
                moe_ffn(group, view, index, pairs)
            with pytest.raises(TypeError, match="numpy array or a torch tensor"):
                moe_ffn(group, x.tolist(), index, pairs)
            released = group[0]
        with pytest.raises(colibri.LeaseError):
            moe_ffn((released,), x, index, pairs)
    weights = np.ones((2, 2), dtype=np.float32)
    out = np.zeros((2, HIDDEN), dtype=np.float32)
    with pytest.raises(ValueError, match="must be"):
        moe_combine(pairs[:3], weights, out)
    with pytest.raises(colibri.ColibriError, match="out overlaps pairs"):
        moe_combine(pairs, weights, pairs[:2])
    with pytest.raises(TypeError, match="float32"):
        moe_combine(pairs, weights, out.astype(np.float16))
