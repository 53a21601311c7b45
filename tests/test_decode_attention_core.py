"""coli_decode_attention called directly on numpy buffers against a float64
reference, on every kernel path this CPU runs and on 1 and 2 threads. It
needs neither torch nor transformers, so the sanitizer builds run it
(.ci/sanitizers); the calls through torch are in test_hf_attention.py."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from colibri import kernels
from colibri._ffi import ffi, lib

BF16 = ml_dtypes.bfloat16
FORMATS = {np.dtype(np.float32): lib.COLI_TENSOR_F32, np.dtype(BF16): lib.COLI_TENSOR_BF16}
ISAS = [getattr(lib, f"COLI_FFN_ISA_{name.upper()}") for name in kernels.available_isas()]


@pytest.fixture(scope="module")
def pool() -> Any:
    out = ffi.new("ColiComputePool **")
    err = ffi.new("char[]", 256)
    assert lib.coli_compute_pool_create(2, out, err, 256) == 0
    yield out[0]
    lib.coli_compute_pool_destroy(out[0])


def _call(arrays: tuple[np.ndarray, ...], scale: float, path: int, **changes: Any) -> Any:
    """arrays: q (batch, heads, d), k (batch, kv_heads, rows >= n, d) of which the first n rows, v
    likewise, out (batch, heads, dv); changes: fields to set otherwise (n is required)."""
    q, k, v, o = arrays
    item = q.itemsize
    fields = dict(q=ffi.cast("const void *", q.ctypes.data), k=ffi.cast("const void *", k.ctypes.data),
                  v=ffi.cast("const void *", v.ctypes.data), out=ffi.cast("void *", o.ctypes.data),
                  batch=q.shape[0], heads=q.shape[1], kv_heads=k.shape[1], n=changes.pop("n"), d=q.shape[2],
                  dv=v.shape[3], k_batch=k.strides[0] // item, k_head=k.strides[1] // item,
                  k_token=k.strides[2] // item, v_batch=v.strides[0] // item, v_head=v.strides[1] // item,
                  v_token=v.strides[2] // item, scale=scale, format=FORMATS[q.dtype], isa=path)
    fields.update(changes)
    return ffi.new("ColiDecodeAttention *", fields)


def _run(call: Any, pool: Any) -> tuple[int, str]:
    err = ffi.new("char[]", 256)
    rc = lib.coli_decode_attention(call, pool, err, 256)
    return rc, ffi.string(err).decode()


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, n: int, scale: float) -> np.ndarray:
    group = q.shape[1] // k.shape[1]
    kk = np.repeat(k[:, :, :n].astype(np.float64), group, axis=1)
    vv = np.repeat(v[:, :, :n].astype(np.float64), group, axis=1)
    s = np.einsum("bhd,bhnd->bhn", q.astype(np.float64), kk) * scale
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("bhn,bhnd->bhd", p / p.sum(axis=-1, keepdims=True), vv)


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from([np.float32, BF16]), batch=st.integers(1, 2), kv_heads=st.integers(1, 3),
       group=st.sampled_from([1, 2, 3, 4, 8]), n=st.integers(1, 300), room=st.integers(0, 9),
       d=st.integers(1, 80), dv=st.integers(1, 80), seed=st.integers(0, 2 ** 16))
def test_every_path_matches_the_reference(pool: Any, dtype: Any, batch: int, kv_heads: int, group: int, n: int,
                                          room: int, d: int, dv: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    q = rng.standard_normal((batch, heads, d)).astype(dtype)
    k = rng.standard_normal((batch, kv_heads, n + room, d)).astype(dtype)    # a cache with room to spare
    v = rng.standard_normal((batch, kv_heads, n + room, dv)).astype(dtype)
    scale = 1.0 / np.sqrt(d)
    ref = _reference(q, k, v, n, scale)
    top = np.abs(ref).max()
    bound = 2.0 ** -8 if dtype is BF16 else 1e-5
    results = []
    for isa in ISAS:
        for threads in (ffi.NULL, pool):
            out = np.full((batch, heads, dv), np.nan, dtype=dtype)
            rc, err = _run(_call((q, k, v, out), scale, isa, n=n), threads)
            assert rc == 0, err
            assert np.abs(out.astype(np.float64) - ref).max() <= bound * top
            results.append(out)
    for isa in range(len(ISAS)):       # the heads split over threads: the same bits
        assert np.array_equal(results[2 * isa], results[2 * isa + 1])


def test_bad_calls_are_refused() -> None:
    q = np.zeros((1, 4, 8), dtype=np.float32)
    k = np.zeros((1, 2, 5, 8), dtype=np.float32)
    out = np.zeros((1, 4, 8), dtype=np.float32)
    auto = lib.COLI_FFN_ISA_AUTO
    for changes, message in (({"format": lib.COLI_TENSOR_F16}, "float32 or bfloat16"),
                             ({"kv_heads": 3}, "a multiple"),
                             ({"n": 0}, "at least 1"),
                             ({"k_token": 4}, "must not overlap"),
                             ({"out": ffi.cast("void *", q.ctypes.data)}, "overlaps q"),
                             ({"k": ffi.NULL}, "NULL"),
                             ({"isa": 99}, "kernel path")):
        rc, err = _run(_call((q, k, k, out), 1.0, auto, n=changes.pop("n", 5), **changes), ffi.NULL)
        assert rc == lib.COLI_EINVAL and message in err, (changes, err)
    rc, err = _run(ffi.NULL, ffi.NULL)
    assert rc == lib.COLI_EINVAL and "NULL" in err
