"""colibri.kernels.linear (the C entry coli_linear): one matrix computed from
its bytes as stored, against a float64 reference from the format's own
decoder (colibri.dequantize for the experts' roles, PackedWeight.to_float
for linear layers): float32 within 1e-4 of the largest output, bfloat16
within 2^-8; every SIMD path the CPU runs agrees with the scalar one; bad
operands and bad matrices are refused with a message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import colibri
from colibri import kernels
from colibri._ffi import ffi, lib
from colibri.checkpoint.experts import INTERLEAVED
from colibri.errors import ColibriError
from colibri.formats import FP8_BLOCK, INT4
from colibri.linear import PackedWeight, plain_weight
from colibri.synthetic_formats import FORMATS, write_format_checkpoint

BF16 = np.dtype(ml_dtypes.bfloat16)
F32_BOUND = 1e-4
BF16_BOUND = 2.0 ** -8
SIMD = [isa for isa in kernels.available_isas() if isa != "scalar"]


def relative_error(got: Any, want: np.ndarray) -> float:
    got64 = np.asarray(got).astype(np.float64)
    return float(np.abs(got64 - want).max() / max(np.abs(want).max(), 1e-30))


def reference(w: np.ndarray, bias: np.ndarray | None, x: np.ndarray) -> np.ndarray:
    """x W^T + bias in float64. einsum, not matmul: OpenBLAS's threads are
    invisible to ThreadSanitizer, which reports their reuse of a buffer as a race."""
    y = np.einsum("...i,oi->...o", x.astype(np.float64), w.astype(np.float64))
    return y + bias.astype(np.float64) if bias is not None else y


def _words(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, 2**32, shape, dtype=np.uint32).view(np.int32)


def int4_weight(rng: np.random.Generator, n_out: int, n_in: int, group: int, *, zeros: bool,
                scale_dtype: Any, bias: bool) -> PackedWeight:
    scale = (rng.uniform(0.5, 1.5, (n_out, n_in // group)) * 0.05).astype(scale_dtype)
    zero = _words(rng, (-(-n_out // 8), n_in // group)) if zeros else None
    b = rng.standard_normal(n_out).astype(np.float32) if bias else None
    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16"}
    return PackedWeight(INT4, (n_out, n_in), _words(rng, (n_out, n_in // 8)), "I32", scale,
                        names[np.dtype(scale_dtype)], (1, group), zero, b)


def fp8_weight(rng: np.random.Generator, n_out: int, n_in: int, block: int) -> PackedWeight:
    codes = rng.integers(0, 256, (n_out, n_in), dtype=np.uint8)
    codes[(codes & 0x7f) == 0x7f] = 0x30                     # no NaN codes
    scale = rng.uniform(0.5, 1.5, (-(-n_out // block), -(-n_in // block))).astype(np.float32)
    return PackedWeight(FP8_BLOCK, (n_out, n_in), codes.view(ml_dtypes.float8_e4m3fn), "F8_E4M3",
                        scale, "F32", (block, block))


def check(w: PackedWeight, x: np.ndarray, isa: str, threads: int = 2) -> np.ndarray:
    """The kernel's output, checked against the reference; returned."""
    got = kernels.linear(w, x, isa=isa, threads=threads)
    assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], w.shape[0])
    bound = F32_BOUND if x.dtype == np.float32 else BF16_BOUND
    assert relative_error(got, reference(w.to_float(), w.bias, x)) <= bound
    return np.asarray(got)


@settings(max_examples=40, deadline=None)
# an output whose exact value lies just past a bfloat16 rounding midpoint:
# the scalar path and the integer kernels round it to neighbours
@example(n_out=57, groups=1, group=32, tokens=1, zeros=True, bias=True, scale=ml_dtypes.bfloat16,
         bf16=True, seed=57)
@given(n_out=st.integers(1, 70), groups=st.integers(1, 4), group=st.sampled_from([8, 16, 32, 64, 128]),
       tokens=st.integers(1, 64), zeros=st.booleans(), bias=st.booleans(),
       scale=st.sampled_from([np.float32, ml_dtypes.bfloat16]), bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_int4_matches_the_reference_on_every_path(n_out: int, groups: int, group: int, tokens: int,
                                                  zeros: bool, bias: bool, scale: Any, bf16: bool,
                                                  seed: int) -> None:
    rng = np.random.default_rng(seed)
    w = int4_weight(rng, n_out, groups * group, group, zeros=zeros, scale_dtype=scale, bias=bias)
    x = rng.standard_normal((tokens, groups * group)).astype(np.float32).astype(BF16 if bf16 else np.float32)
    scalar = check(w, x, "scalar")
    for isa in SIMD:
        got = check(w, x, isa)
        # each within its bound of the exact result; bfloat16 outputs on either
        # side of a rounding midpoint differ by one unit in the last place
        assert relative_error(got, scalar.astype(np.float64)) <= (F32_BOUND if not bf16 else 2 * BF16_BOUND)


@pytest.mark.parametrize("scale", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("group, n_in", [(32, 96), (32, 416), (128, 128), (128, 384)])
@pytest.mark.parametrize("zeros", [False, True])
def test_int4_one_token_reads_each_rows_scales_in_every_format(scale: Any, group: int, n_in: int,
                                                               zeros: bool) -> None:
    """A decode step's call (one bfloat16 token) reads each row's own
    scales, whatever their format, in a last chunk of fewer groups too (96
    and 416 inputs), for a last block of fewer than four rows (37)."""
    rng = np.random.default_rng(n_in + group)
    w = int4_weight(rng, 37, n_in, group, zeros=zeros, scale_dtype=scale, bias=False)
    x = rng.standard_normal((1, n_in)).astype(BF16)
    scalar = check(w, x, "scalar")
    for isa in SIMD:
        assert relative_error(check(w, x, isa), scalar.astype(np.float64)) <= 2 * BF16_BOUND


@settings(max_examples=20, deadline=None)
@given(n_out=st.integers(1, 300), n_in=st.integers(1, 300), block=st.sampled_from([16, 64, 128]),
       tokens=st.integers(1, 64), bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_fp8_blocks_match_the_reference_on_every_path(n_out: int, n_in: int, block: int, tokens: int,
                                                      bf16: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    w = fp8_weight(rng, n_out, n_in, block)
    x = rng.standard_normal((tokens, n_in)).astype(np.float32).astype(BF16 if bf16 else np.float32)
    for isa in kernels.available_isas():
        check(w, x, isa)


def test_a_token_gets_the_same_bits_alone_in_a_batch_and_on_any_threads() -> None:
    rng = np.random.default_rng(3)
    w = int4_weight(rng, 200, 256, 32, zeros=True, scale_dtype=BF16, bias=True)
    x = rng.standard_normal((40, 256)).astype(np.float32)
    for isa in kernels.available_isas():
        batch = kernels.linear(w, x, isa=isa, threads=2)
        for t in (0, 7, 39):
            alone = kernels.linear(w, x[t], isa=isa, threads=1)
            assert alone.shape == (200,) and np.array_equal(alone, batch[t])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: Any) -> dict[str, Path]:
    """Each expert format (every orientation and fusion the store reads)."""
    return {fmt: write_format_checkpoint(tmp_path_factory.mktemp(fmt), fmt, hidden=160, intermediate=96,
                                         group=32, seed=i, symmetric=fmt != "stacked_int4", block=(64, 32))
            for i, fmt in enumerate(FORMATS)}


def _role_reference(weights: dict[str, np.ndarray], fused: str | None, role: str) -> tuple[Any, Any]:
    """(weight, bias) of a role as the linear sees it (a fused gate_up whole)."""
    if role != "gate" or not fused:
        return weights[role], weights.get(f"{role}_bias")
    pair = [weights["gate"], weights["up"]]
    biases = [weights.get("gate_bias"), weights.get("up_bias")]
    if fused == INTERLEAVED:
        stack = np.stack(pair, axis=1).reshape(-1, pair[0].shape[1])
        bias = None if biases[0] is None else np.stack(biases, axis=1).reshape(-1)
        return stack, bias
    return np.concatenate(pair), None if biases[0] is None else np.concatenate(biases)


def _role_linear(ex: Any, role: str, x: np.ndarray, isa: str) -> np.ndarray:
    """coli_linear of one role of a lease, described as the expert call describes it."""
    m = ffi.new("ColiFfnMatrix *")
    kernels._fill_matrix(m, ex.tensors, role, ex.parts)
    n_in = x.shape[1]
    n_out = int(m.view.columns if m.flags & lib.COLI_FFN_IN_OUT else m.view.rows)
    out = np.empty((x.shape[0], n_out), x.dtype)
    code = lib.COLI_TENSOR_F32 if x.dtype == np.float32 else lib.COLI_TENSOR_BF16
    call = ffi.new("ColiFfnCall *", {
        "x": ffi.cast("const void *", x.ctypes.data), "x_format": code, "x_stride": n_in,
        "out": ffi.cast("void *", out.ctypes.data), "out_format": code, "out_stride": n_out,
        "tokens": x.shape[0], "isa": kernels.ISAS.index(isa)})
    err = ffi.new("char[]", 256)
    assert lib.coli_linear(m, call, ffi.NULL, err, 256) == 0, ffi.string(err)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("isa", kernels.available_isas())
def test_every_expert_format_and_orientation(checkpoints: dict[str, Path], fmt: str, isa: str) -> None:
    rng = np.random.default_rng(9)
    with colibri.open_store(checkpoints[fmt], slots_per_layer=2) as store, store.lease(0, 1) as ex:
        weights = colibri.dequantize(ex)
        for role in ("gate", "down") if ex.tensors.fused else ("gate", "up", "down"):
            w, bias = _role_reference(weights, ex.tensors.fused, role)
            for tokens in (1, 5, 17):
                x = rng.standard_normal((tokens, w.shape[1])).astype(np.float32)
                assert relative_error(_role_linear(ex, role, x, isa), reference(w, bias, x)) <= F32_BOUND
                xb = x.astype(BF16)
                assert relative_error(_role_linear(ex, role, xb, isa), reference(w, bias, xb)) <= BF16_BOUND


def test_plain_torch_operands_and_threads() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    w = plain_weight(rng.standard_normal((48, 40)).astype(BF16), rng.standard_normal(48).astype(np.float32))
    x = torch.randn(6, 40)
    got = kernels.linear(w, x)
    assert isinstance(got, torch.Tensor) and got.shape == (6, 48)
    assert relative_error(got.numpy(), reference(w.to_float(), w.bias, x.numpy())) <= F32_BOUND
    out = torch.empty(6, 48, dtype=torch.bfloat16)
    assert kernels.linear(w, x.bfloat16(), out=out, threads=1) is out
    assert torch.equal(out, kernels.linear(w, x.bfloat16()))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        kernels.linear(w, x.double())
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.linear(w, torch.randn(40, 6).t())
    with pytest.raises(ValueError, match=r"expected \(tokens, 40\)"):
        kernels.linear(w, torch.randn(2, 3, 40))


def test_bad_operands_are_refused() -> None:
    rng = np.random.default_rng(5)
    w = int4_weight(rng, 16, 64, 32, zeros=False, scale_dtype=BF16, bias=False)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    with pytest.raises(ValueError, match=r"expected \(tokens, 64\)"):
        kernels.linear(w, x[:, :32].copy())
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        kernels.linear(w, x.astype(np.float64))
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.linear(w, np.asfortranarray(x))
    with pytest.raises(ValueError, match="rows of 16 values"):
        kernels.linear(w, x, out=np.empty((2, 16), np.float32))
    with pytest.raises(ValueError, match="expected"):
        kernels.linear(w, x, out=np.empty((3, 17), np.float32))
    with pytest.raises(ValueError, match="unknown kernel path"):
        kernels.linear(w, x, isa="no-such-path")
    with pytest.raises(ValueError, match="out overlaps x"):
        kernels.linear(plain_weight(np.ones((64, 64), np.float32)), x, out=x)


def test_bad_matrices_are_refused_by_the_c_entry() -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    short = int4_weight(rng, 16, 64, 32, zeros=True, scale_dtype=BF16, bias=False)
    short.zero = short.zero[:, :1].copy()                     # (2, 2) words wanted
    with pytest.raises(ColibriError, match="linear: .*zero points"):
        kernels.linear(short, x)
    scales = int4_weight(rng, 16, 64, 32, zeros=False, scale_dtype=BF16, bias=False)
    scales.scale = scales.scale[:8].copy()
    with pytest.raises(ColibriError, match="linear: .*scale bytes"):
        kernels.linear(scales, x)
    wrong = int4_weight(rng, 16, 64, 32, zeros=False, scale_dtype=BF16, bias=False)
    wrong.shape = (16, 72)
    with pytest.raises(ColibriError, match="linear: .*data bytes"):
        kernels.linear(wrong, rng.standard_normal((2, 72)).astype(np.float32))
    call = ffi.new("ColiFfnCall *", {"tokens": 1, "isa": -1})
    err = ffi.new("char[]", 256)
    assert lib.coli_linear(ffi.NULL, call, ffi.NULL, err, 256) == lib.COLI_EINVAL
    assert b"NULL matrix" in ffi.string(err)
    assert lib.coli_linear(scales.matrix(), call, ffi.NULL, err, 256) == lib.COLI_EINVAL
