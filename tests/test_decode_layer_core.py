"""coli_decode_qkv and coli_decode_route, a decoder layer's one-token step
in two calls, called directly on numpy buffers: each must give the bits of
its pieces (coli_rms_norm, coli_linear, coli_rotary, coli_decode_attention,
a rounded add, coli_router_topk) called one by one, and name the piece
that failed. Needs neither torch nor transformers, so the sanitizer builds
run it (.ci/sanitizers); test_hf_decode_layers.py checks the same step
against transformers' modules."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from colibri._ffi import ffi, lib
from colibri.compute_threads import compute_pool

BF16 = ml_dtypes.bfloat16
FORMATS = {np.dtype(np.float32): lib.COLI_TENSOR_F32, np.dtype(BF16): lib.COLI_TENSOR_BF16}
ERR = 256


def _ptr(a: np.ndarray) -> Any:
    return ffi.cast("void *", a.ctypes.data)


def _matrix(w: np.ndarray, keep: list[Any]) -> Any:
    """A ColiFfnMatrix of a plain (outputs, inputs) matrix."""
    m = ffi.new("ColiFfnMatrix *")
    m.view.format = FORMATS[w.dtype]
    m.view.data, m.view.data_bytes = _ptr(w), w.nbytes
    m.view.rows, m.view.columns = w.shape
    keep += [m, w]
    return m


def _norm(norm: Any, w: np.ndarray, eps: float, order: int) -> None:
    norm.weight, norm.eps, norm.order = _ptr(w), eps, order


class _Layer:
    """Random weights and inputs of one layer's step."""

    def __init__(self, dtype: Any, hidden: int, heads: int, kv_heads: int, d: int, experts: int, n: int,
                 seed: int) -> None:
        rng = np.random.default_rng(seed)

        def r(*shape: int, scale: float = 1.0) -> np.ndarray:
            return (rng.standard_normal(shape) * scale).astype(dtype)

        self.dtype, self.fmt = dtype, FORMATS[np.dtype(dtype)]
        self.hidden, self.heads, self.kv_heads, self.d, self.experts, self.n = hidden, heads, kv_heads, d, experts, n
        self.h = r(hidden)
        self.w_in, self.w_post, self.w_q, self.w_k = r(hidden), r(hidden), r(d), r(d)
        self.q, self.k, self.v = r(heads * d, hidden, scale=0.1), r(kv_heads * d, hidden, scale=0.1), \
            r(kv_heads * d, hidden, scale=0.1)
        self.o, self.router = r(hidden, heads * d, scale=0.1), r(experts, hidden, scale=0.1)
        angles = rng.random(d) * 20
        self.cos, self.sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
        self.keys, self.values = r(kv_heads, n, d), r(kv_heads, n, d)


def _buffers(t: _Layer) -> dict[str, np.ndarray]:
    """Zeroed buffers of every activation of the step."""
    nq, nk = t.heads * t.d, t.kv_heads * t.d
    sizes = {"normed": t.hidden, "q": nq, "k": nk, "v": nk, "q_normed": nq, "k_normed": nk, "q_rotated": nq,
             "k_rotated": nk, "attended": nq, "o": t.hidden, "residual": t.hidden, "post": t.hidden,
             "logits": t.experts}
    return {name: np.zeros(size, t.dtype) for name, size in sizes.items()}


def _pieces(t: _Layer, qk_norm: bool, top_k: int, pool: Any) -> dict[str, np.ndarray]:
    """The step by the pieces' own calls, one by one."""
    err, keep = ffi.new("char[]", ERR), []
    out = _buffers(t)

    def ok(rc: int) -> None:
        assert rc == 0, ffi.string(err)

    def linear(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        call = ffi.new("ColiFfnCall *", {"x": _ptr(x), "x_format": t.fmt, "x_stride": x.size, "out": _ptr(y),
                                        "out_format": t.fmt, "out_stride": y.size, "tokens": 1, "isa": -1})
        ok(lib.coli_linear(_matrix(w, keep), call, pool, err, ERR))

    def norm(x: np.ndarray, y: np.ndarray, w: np.ndarray, rows: int) -> None:
        ok(lib.coli_rms_norm(_ptr(x), _ptr(y), _ptr(w), rows, w.size, t.fmt, t.fmt, t.fmt, 1e-6, 0, err, ERR))

    norm(t.h, out["normed"], t.w_in, 1)
    for name in "qkv":
        linear(getattr(t, name), out["normed"], out[name])
    q, k = out["q"], out["k"]
    if qk_norm:
        norm(q, out["q_normed"], t.w_q, t.heads)
        norm(k, out["k_normed"], t.w_k, t.kv_heads)
        q, k = out["q_normed"], out["k_normed"]
    for x, y, rows in ((q, out["q_rotated"], t.heads), (k, out["k_rotated"], t.kv_heads)):
        ok(lib.coli_rotary(_ptr(x), _ptr(y), rows, rows, t.d, _ptr(t.cos), _ptr(t.sin), t.fmt, err, ERR))
    a = _attention(t, out["q_rotated"], out["attended"])
    ok(lib.coli_decode_attention(a, pool, err, ERR))
    linear(t.o, out["attended"], out["o"])
    out["residual"] = (t.h.astype(np.float32) + out["o"].astype(np.float32)).astype(t.dtype)
    norm(out["residual"], out["post"], t.w_post, 1)
    linear(t.router, out["post"], out["logits"])
    out["scores"], out["index"] = np.zeros(top_k, np.float32), np.zeros(top_k, np.int64)
    ok(lib.coli_router_topk(_ptr(out["logits"]), t.fmt, 1, t.experts, top_k, 1, _ptr(out["scores"]),
                            lib.COLI_TENSOR_F32, ffi.cast("int64_t *", out["index"].ctypes.data), err, ERR))
    return out


def _attention(t: _Layer, q: np.ndarray, out: np.ndarray) -> Any:
    n, d = t.n, t.d
    return ffi.new("ColiDecodeAttention *", {
        "q": _ptr(q), "k": _ptr(t.keys), "v": _ptr(t.values), "out": _ptr(out), "batch": 1, "heads": t.heads,
        "kv_heads": t.kv_heads, "n": n, "d": d, "dv": d, "k_batch": t.kv_heads * n * d, "k_head": n * d,
        "k_token": d, "v_batch": t.kv_heads * n * d, "v_head": n * d, "v_token": d, "scale": d ** -0.5,
        "format": t.fmt, "isa": -1})


def _two_calls(t: _Layer, qk_norm: bool, top_k: int, pool: Any, attend: bool,
               attended: np.ndarray | None = None) -> dict[str, np.ndarray]:
    err, keep = ffi.new("char[]", ERR), []
    out = _buffers(t)
    s = ffi.new("ColiDecodeQkv *", {
        "format": t.fmt, "isa": -1, "hidden": t.hidden, "heads": t.heads, "kv_heads": t.kv_heads, "d": t.d,
        "qk_norm": int(qk_norm), "q_proj": _matrix(t.q, keep), "k_proj": _matrix(t.k, keep),
        "v_proj": _matrix(t.v, keep), "h": _ptr(t.h), "cos": _ptr(t.cos), "sin": _ptr(t.sin),
        **{name: _ptr(out[name]) for name in ("normed", "q", "k", "q_normed", "k_normed", "q_rotated",
                                              "k_rotated", "v")}})
    _norm(s.input_norm, t.w_in, 1e-6, 0)
    _norm(s.q_norm, t.w_q, 1e-6, 0)
    _norm(s.k_norm, t.w_k, 1e-6, 0)
    rc = lib.coli_decode_qkv(s, pool, err, ERR)
    assert rc == 0, ffi.string(err)
    if attended is not None:
        out["attended"][:] = attended
    out["scores"], out["index"] = np.zeros(top_k, np.float32), np.zeros(top_k, np.int64)
    r = ffi.new("ColiDecodeRoute *", {
        "format": t.fmt, "isa": -1, "hidden": t.hidden, "experts": t.experts, "attend": int(attend),
        "o_proj": _matrix(t.o, keep), "router": _matrix(t.router, keep), "h": _ptr(t.h),
        "top_k": top_k, "renorm": 1, "scores_format": lib.COLI_TENSOR_F32, "scores": _ptr(out["scores"]),
        "index": ffi.cast("int64_t *", out["index"].ctypes.data),
        **{name: _ptr(out[name]) for name in ("attended", "o", "residual", "post", "logits")}})
    r.attention = _attention(t, out["q_rotated"], out["attended"])[0]
    _norm(r.post_norm, t.w_post, 1e-6, 0)
    rc = lib.coli_decode_route(r, pool, err, ERR)
    assert rc == 0, ffi.string(err)
    return out


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from([np.float32, BF16]), kv_heads=st.integers(1, 3), group=st.integers(2, 4),
       half=st.integers(1, 24), hidden=st.integers(1, 300), experts=st.integers(1, 40), n=st.integers(1, 20),
       qk_norm=st.booleans(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2 ** 16))
def test_two_calls_give_the_bits_of_their_pieces(dtype: Any, kv_heads: int, group: int, half: int, hidden: int,
                                                 experts: int, n: int, qk_norm: bool, threads: int,
                                                 seed: int) -> None:
    t = _Layer(dtype, hidden, kv_heads * group, kv_heads, 2 * half, experts, n, seed)
    top_k = min(4, experts)
    pool = compute_pool(threads)
    want = _pieces(t, qk_norm, top_k, pool)
    got = _two_calls(t, qk_norm, top_k, pool, attend=True)
    kept = ["q_rotated", "k_rotated", "v", "attended", "o", "residual", "post", "logits", "scores", "index"]
    for name in kept:
        assert want[name].tobytes() == got[name].tobytes(), name


def test_without_attend_the_route_reads_the_attended_it_is_given() -> None:
    t = _Layer(BF16, 64, 4, 2, 16, 8, 5, seed=3)
    pool = compute_pool(1)
    want = _pieces(t, True, 2, pool)
    given = _two_calls(t, True, 2, pool, attend=False, attended=want["attended"])
    for name in ("o", "residual", "post", "logits", "scores", "index"):
        assert want[name].tobytes() == given[name].tobytes(), name
    other = _two_calls(t, True, 2, pool, attend=False, attended=np.zeros_like(want["attended"]))
    assert other["o"].tobytes() != want["o"].tobytes()


def test_bad_calls_name_the_piece() -> None:
    err = ffi.new("char[]", ERR)
    assert lib.coli_decode_qkv(ffi.NULL, ffi.NULL, err, ERR) == lib.COLI_EINVAL
    assert lib.coli_decode_route(ffi.NULL, ffi.NULL, err, ERR) == lib.COLI_EINVAL
    t = _Layer(np.float32, 32, 2, 1, 8, 4, 3, seed=1)
    h, normed = t.h, np.zeros(32, np.float32)
    s = ffi.new("ColiDecodeQkv *", {"format": lib.COLI_TENSOR_F16, "hidden": 32, "heads": 2, "kv_heads": 1, "d": 8,
                                    "h": _ptr(h), "normed": _ptr(normed)})
    assert lib.coli_decode_qkv(s, ffi.NULL, err, ERR) == lib.COLI_EINVAL
    assert "format" in ffi.string(err).decode()
    s.format = lib.COLI_TENSOR_F32
    _norm(s.input_norm, t.w_in, 1e-6, 0)
    assert lib.coli_decode_qkv(s, ffi.NULL, err, ERR) == lib.COLI_EINVAL   # no q projection
    assert ffi.string(err).decode().startswith("decode layer: q projection: ")
    o, residual = np.zeros(32, np.float32), np.zeros(32, np.float32)
    r = ffi.new("ColiDecodeRoute *", {"format": lib.COLI_TENSOR_F32, "hidden": 32, "experts": 4, "attend": 1,
                                      "h": _ptr(h), "o": _ptr(o)})
    assert lib.coli_decode_route(r, ffi.NULL, err, ERR) == lib.COLI_EINVAL
    assert "NULL h, o or residual" in ffi.string(err).decode()
    r.residual = _ptr(residual)
    assert lib.coli_decode_route(r, ffi.NULL, err, ERR) < 0
    assert ffi.string(err).decode().startswith("decode layer: attention: ")


@pytest.mark.parametrize("short", [1, 8, 40])
def test_a_short_message_buffer_is_not_overrun(short: int) -> None:
    err = ffi.new("char[]", short + 8)
    x = np.zeros(32, np.float32)
    r = ffi.new("ColiDecodeRoute *", {"format": lib.COLI_TENSOR_F32, "hidden": 32, "experts": 4, "attend": 1,
                                      "h": _ptr(x), "o": _ptr(x), "residual": _ptr(x)})
    assert lib.coli_decode_route(r, ffi.NULL, err, short) < 0
    assert len(ffi.string(err)) <= short - 1
    assert all(b == 0 for b in ffi.buffer(err)[short:])
