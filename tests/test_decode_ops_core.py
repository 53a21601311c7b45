"""The core's small decode-step ops (coli_rms_norm, coli_router_topk,
coli_rotary) called directly on numpy buffers, against numpy references:
this file needs neither torch nor transformers, so the sanitizer builds
run it (.ci/sanitizers). The tests through torch modules are
test_hf_decode_norms.py, test_hf_decode_routers.py and
test_hf_decode_rotary.py."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from colibri._ffi import ffi, lib

BF16 = ml_dtypes.bfloat16
FORMATS = {np.dtype(np.float32): lib.COLI_TENSOR_F32, np.dtype(BF16): lib.COLI_TENSOR_BF16}


def _ptr(a: np.ndarray) -> Any:
    return ffi.cast("void *", a.ctypes.data)


def _err() -> Any:
    return ffi.new("char[]", 256)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([np.float32, BF16]), out_dtype=st.sampled_from([np.float32, BF16]),
       rows=st.integers(0, 4), n=st.integers(1, 200), k=st.integers(1, 12), renorm=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_router_topk_is_softmax_then_the_k_largest(dtype: Any, out_dtype: Any, rows: int, n: int, k: int,
                                                   renorm: bool, seed: int) -> None:
    k = min(k, n)
    rng = np.random.default_rng(seed)
    # distinct logits, exact in bfloat16: the order is the reference's alone
    logits = np.array([(rng.permutation(n) - n // 2) * 0.125 for _ in range(rows)]).reshape(rows, n).astype(dtype)
    scores = np.full((rows, k), np.nan, dtype=out_dtype)
    index = np.full((rows, k), -1, dtype=np.int64)
    err = _err()
    rc = lib.coli_router_topk(_ptr(logits), FORMATS[logits.dtype], rows, n, k, int(renorm), _ptr(scores),
                              FORMATS[scores.dtype], ffi.cast("int64_t *", index.ctypes.data), err, 256)
    assert rc == 0, ffi.string(err)
    x = logits.astype(np.float32)
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p = p / p.sum(axis=1, keepdims=True)
    want = np.argsort(-p, axis=1, kind="stable")[:, :k]
    assert np.array_equal(index, want)
    values = np.take_along_axis(p, want, axis=1)
    if renorm:
        values = values / values.sum(axis=1, keepdims=True)
    bound = 2.0 ** -7 if out_dtype is BF16 else 1e-5
    np.testing.assert_allclose(scores.astype(np.float32), values, rtol=bound, atol=0)


def test_router_topk_takes_equal_ones_by_position_and_refuses_bad_calls() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 0.0, 3.0]], dtype=np.float32)
    scores, index = np.zeros((1, 3), np.float32), np.zeros((1, 3), np.int64)
    err = _err()

    def call(k: int, n: int = 5, fmt: int = lib.COLI_TENSOR_F32) -> int:
        return int(lib.coli_router_topk(_ptr(logits), fmt, 1, n, k, 1, _ptr(scores), lib.COLI_TENSOR_F32,
                                        ffi.cast("int64_t *", index.ctypes.data), err, 256))

    assert call(3) == 0
    assert index.tolist() == [[1, 2, 4]]
    np.testing.assert_allclose(scores, np.full((1, 3), 1 / 3), rtol=1e-6)
    for rc in (call(0), call(6), call(3, fmt=lib.COLI_TENSOR_F16)):
        assert rc == lib.COLI_EINVAL


def _bf16_round(v: np.ndarray) -> np.ndarray:
    return v.astype(BF16).astype(np.float32)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([np.float32, BF16]), batch=st.integers(1, 3), heads=st.integers(1, 6),
       half=st.integers(1, 40), seed=st.integers(0, 2 ** 16))
def test_rotary_is_the_framework_formula_rounded_op_by_op(dtype: Any, batch: int, heads: int, half: int,
                                                          seed: int) -> None:
    rng = np.random.default_rng(seed)
    d = 2 * half
    x = (rng.standard_normal((batch, heads, d)) * 3).astype(dtype)
    angles = rng.random((batch, d)) * 50
    cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    out = np.zeros_like(x)
    err = _err()
    rc = lib.coli_rotary(_ptr(x), _ptr(out), batch * heads, heads, d, _ptr(cos), _ptr(sin), FORMATS[x.dtype],
                         err, 256)
    assert rc == 0, ffi.string(err)
    xf, cf, sf = (a.astype(np.float32) for a in (x, cos, sin))
    rotated = np.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    rnd = _bf16_round if dtype is BF16 else (lambda v: v)
    want = rnd(rnd(xf * cf[:, None, :]) + rnd(rotated * sf[:, None, :]))
    assert np.array_equal(out.astype(np.float32), want)


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([np.float32, BF16]), rows=st.integers(0, 3), n=st.integers(1, 700),
       seed=st.integers(0, 2 ** 16))
def test_rms_norm_in_blocks_is_the_formula(dtype: Any, rows: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, n)) * 5).astype(dtype)
    w = rng.standard_normal(n).astype(dtype)
    out = np.zeros_like(x)
    err = _err()
    f = FORMATS[x.dtype]
    rc = lib.coli_rms_norm(_ptr(x), _ptr(out), _ptr(w), rows, n, f, f, f, 1e-6,
                           lib.COLI_RMS_WEIGHT_AFTER_CAST, err, 256)
    assert rc == 0, ffi.string(err)
    xf = x.astype(np.float64)
    h = xf / np.sqrt((xf * xf).mean(axis=1, keepdims=True) + 1e-6)
    want = w.astype(np.float64) * h
    bound = 2.0 ** -7 if dtype is BF16 else 1e-5
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=bound, atol=bound * np.abs(want).max(initial=0))


@pytest.mark.parametrize("n", [1, 255, 256, 257, 1024])
def test_rms_norm_rows_do_not_reach_past_their_end(n: int) -> None:
    x = np.ones((2, n + 1), dtype=np.float32)[:, :n].copy()    # a tight buffer each
    w = np.full(n, 2.0, dtype=np.float32)
    out = np.full((2, n), np.nan, dtype=np.float32)
    rc = lib.coli_rms_norm(_ptr(x), _ptr(out), _ptr(w), 2, n, lib.COLI_TENSOR_F32, lib.COLI_TENSOR_F32,
                           lib.COLI_TENSOR_F32, 0.0, lib.COLI_RMS_WEIGHT_AFTER_CAST, _err(), 256)
    assert rc == 0
    np.testing.assert_allclose(out, 2.0, rtol=1e-6)
