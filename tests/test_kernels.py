"""colibri.expert_ffn: every format, layout and activation against a float64
reference from colibri.dequantize of the same lease; every SIMD path the CPU
runs against the scalar one; threads; numpy and torch operands; errors.

Bounds (relative to the largest output magnitude): float32 activations
1e-4; bfloat16 activations and output 2^-8, the output's own rounding.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import colibri
from colibri import kernels
from colibri.errors import ColibriError
from colibri.synthetic_formats import FORMATS, format_constraints, write_format_checkpoint

BF16 = np.dtype(ml_dtypes.bfloat16)
F32_BOUND = 1e-4
BF16_BOUND = 2.0 ** -8
SIMD = [isa for isa in kernels.available_isas() if isa != "scalar"]
GPT_OSS_FORMATS = ("gpt_oss", "mxfp4")


def reference(weights: dict[str, np.ndarray], x: np.ndarray, activation: str,
              alpha: float = 1.702, limit: float = 7.0) -> np.ndarray:
    """The expert in float64 from dequantized weights. einsum, not matmul:
    OpenBLAS's threads are invisible to ThreadSanitizer, which reports
    their reuse of a freed buffer as a race."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    x = np.asarray(x, dtype=np.float64)
    g = np.einsum("ti,oi->to", x, w["gate"]) + w.get("gate_bias", 0.0)
    u = np.einsum("ti,oi->to", x, w["up"]) + w.get("up_bias", 0.0)
    with np.errstate(over="ignore"):
        if activation == "silu":
            h = g / (1.0 + np.exp(-g)) * u
        else:
            g = np.minimum(g, limit)
            u = np.clip(u, -limit, limit)
            h = (u + 1.0) * g / (1.0 + np.exp(-alpha * g))
    return np.einsum("ti,oi->to", h, w["down"]) + w.get("down_bias", 0.0)


def relative_error(got: Any, want: np.ndarray) -> float:
    got64 = np.asarray(got, dtype=np.float64) if not hasattr(got, "float") else \
        got.float().numpy().astype(np.float64)
    return float(np.abs(got64 - want).max() / max(np.abs(want).max(), 1e-30))


def _tokens(rng: np.random.Generator, tokens: int, hidden: int, dtype: Any) -> np.ndarray:
    return rng.standard_normal((tokens, hidden)).astype(np.float32).astype(dtype)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: Any) -> dict[str, Path]:
    """Each format at a shape that fills whole SIMD panels and blocks in
    places and leaves partial ones elsewhere (hidden 160 = 128 + 32, inter
    96), two experts."""
    out = {}
    for fmt in FORMATS:
        path = tmp_path_factory.mktemp(fmt)
        hidden, inter = (160, 96) if fmt != "mxfp4" else (160, 96)
        out[fmt] = write_format_checkpoint(
            path, fmt, hidden=hidden, intermediate=inter, group=32, seed=len(out),
            symmetric=fmt != "stacked_int4", block=(64, 32))
    return out


def _leased(path: Path, expert: int = 1) -> Iterator[Any]:
    with colibri.open_store(path, slots_per_layer=2) as store:
        with store.lease(0, expert) as ex:
            yield ex


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("activation", kernels.ACTIVATIONS)
@pytest.mark.parametrize("isa", kernels.available_isas())
def test_every_format_and_activation_matches_the_reference(checkpoints: dict[str, Path], fmt: str,
                                                           activation: str, isa: str) -> None:
    rng = np.random.default_rng(5)
    for ex in _leased(checkpoints[fmt]):
        weights = colibri.dequantize(ex)
        hidden = weights["down"].shape[0]
        for tokens in (1, 2, 3, 4, 5, 17):
            x = _tokens(rng, tokens, hidden, np.float32)
            got = kernels.expert_ffn(ex, x, activation=activation, isa=isa)
            assert got.dtype == np.float32 and got.shape == x.shape
            assert relative_error(got, reference(weights, x, activation)) <= F32_BOUND, tokens
            xb = x.astype(BF16)
            gotb = kernels.expert_ffn(ex, xb, activation=activation, isa=isa)
            assert gotb.dtype == BF16
            assert relative_error(gotb, reference(weights, xb, activation)) <= BF16_BOUND, tokens


@pytest.mark.parametrize("fmt", ["int4", "gptq", "gptq_in_order", "awq", "mxfp4"])
@pytest.mark.parametrize("isa", kernels.available_isas())
def test_4bit_inputs_of_any_magnitude_zeros_and_non_finite_ones(checkpoints: dict[str, Path],
                                                                isa: str, fmt: str, tmp_path: Path) -> None:
    """The avx512 path quantises a bfloat16 call's inputs of these formats
    per block of at most 128 (to 2^-15 of the block's largest): inputs
    spread over 2^42 still meet the bound, a token of zeros gets its exact
    result, and a token with a NaN or an infinity gets no finite output
    while its batch is unharmed. (The fixture's GPTQ has act order, which
    bfloat16 calls compute in float32; gptq_in_order takes the integer
    kernel.)"""
    rng = np.random.default_rng(23)
    path = checkpoints.get(fmt) or write_format_checkpoint(tmp_path, "gptq", hidden=160, intermediate=96,
                                                           group=32, seed=9, g_idx=None)
    for ex in _leased(path):
        weights = colibri.dequantize(ex)
        hidden = weights["down"].shape[0]
        x = (rng.standard_normal((5, hidden)) * 2.0 ** rng.uniform(-30, 12, (5, hidden))).astype(np.float32)
        x[1] = 0.0
        x[2, 7] = np.nan
        x[3, hidden - 1] = np.inf
        for dtype, bound in ((np.float32, F32_BOUND), (BF16, BF16_BOUND)):
            xd = x.astype(dtype)
            got = np.asarray(kernels.expert_ffn(ex, xd, isa=isa), dtype=np.float64)
            for t in (0, 1, 4):
                want = reference(weights, xd[t:t + 1], "silu")
                assert relative_error(got[t:t + 1], want) <= bound, (dtype, t)
            alone = np.asarray(kernels.expert_ffn(ex, xd[1:2], isa=isa), dtype=np.float64)
            assert np.array_equal(got[1:2], alone)
            assert not np.isfinite(got[2:4]).any(), dtype


@pytest.mark.parametrize("isa", kernels.available_isas())
def test_mxfp4_subnormal_scales(isa: str, tmp_path: Path) -> None:
    """Scale bytes 0 to 3 weigh 2^-127 to 2^-124: subnormal and barely
    normal weights. With down's scales all there and no down bias, the
    output is itself that small, and every path still meets the bounds
    (a scale decoded wrong, or flushed to zero, misses them by far)."""
    from safetensors.numpy import load_file, save_file
    path = write_format_checkpoint(tmp_path / "ckpt", "mxfp4", hidden=160, intermediate=96, group=32, seed=4)
    shard = path / "model.safetensors"
    tensors = load_file(shard)
    rng = np.random.default_rng(29)
    scales = "model.layers.0.mlp.experts.down_proj_scales"
    tensors[scales] = rng.integers(0, 4, tensors[scales].shape).astype(np.uint8)
    tensors["model.layers.0.mlp.experts.down_proj_bias"][...] = 0
    save_file(tensors, shard)
    for ex in _leased(path):
        weights = colibri.dequantize(ex)
        assert 0 < np.abs(weights["down"]).max() < 2.0 ** -120
        for tokens in (1, 5):
            x = _tokens(rng, tokens, 160, np.float32)
            for dtype, bound in ((np.float32, F32_BOUND), (BF16, BF16_BOUND)):
                xd = x.astype(dtype)
                want = reference(weights, xd, "gpt_oss")
                assert 0 < np.abs(want).max() < 2.0 ** -100
                got = np.asarray(kernels.expert_ffn(ex, xd, activation="gpt_oss", isa=isa), dtype=np.float64)
                # relative_error's floor (1e-30) is far above these outputs
                assert np.abs(got - want).max() <= bound * np.abs(want).max(), (tokens, dtype)


@pytest.mark.parametrize("isa", SIMD)
@pytest.mark.parametrize("fmt", FORMATS)
def test_simd_paths_agree_with_scalar(checkpoints: dict[str, Path], fmt: str, isa: str) -> None:
    rng = np.random.default_rng(11)
    activation = "gpt_oss" if fmt in GPT_OSS_FORMATS else "silu"
    for ex in _leased(checkpoints[fmt], expert=0):
        hidden = colibri.dequantize(ex)["down"].shape[0]
        for tokens in (1, 4, 9):
            x = _tokens(rng, tokens, hidden, np.float32)
            scalar = kernels.expert_ffn(ex, x, activation=activation, isa="scalar")
            simd = kernels.expert_ffn(ex, x, activation=activation, isa=isa)
            assert relative_error(simd, scalar.astype(np.float64)) <= F32_BOUND


# ---------------------------------------------------------------- shapes, groups, tokens


def _format_and_shape(draw: Any, hidden_max: int, inter_max: int) -> dict[str, Any]:
    fmt = draw(st.sampled_from(FORMATS))
    step = format_constraints(fmt)
    return {"fmt": fmt, "hidden": step * draw(st.integers(1, hidden_max // step + 1)),
            "inter": step * draw(st.integers(1, inter_max // step + 1)),
            "isa": draw(st.sampled_from(kernels.available_isas())),
            "bf16": draw(st.booleans()), "seed": draw(st.integers(0, 2**16))}


@st.composite
def cases(draw: Any) -> dict[str, Any]:
    case = _format_and_shape(draw, 200, 160)
    fmt, hidden, inter = case["fmt"], case["hidden"], case["inter"]
    case["tokens"] = draw(st.integers(1, 64))
    case["activation"] = draw(st.sampled_from(kernels.ACTIVATIONS))
    if fmt in ("int4", "stacked_int4"):  # groups divide both widths
        common = math.gcd(hidden, inter)
        case["group"] = draw(st.sampled_from([g for g in range(1, common + 1) if common % g == 0]))
        case["symmetric"] = fmt == "int4" and draw(st.booleans())
    elif fmt in ("gptq", "gptq_v2", "awq"):
        case["group"] = draw(st.sampled_from([-1, 8, 16, 24, 32, 40, 64, 128]))
        case["g_idx"] = draw(st.sampled_from(["act_order", "sorted", None]))
    elif fmt == "fp8_block":
        case["block"] = (draw(st.integers(1, 160)), draw(st.integers(1, 160)))
    return case


@settings(max_examples=int(os.environ.get("COLIBRI_KERNEL_EXAMPLES", "40")), deadline=None)
@given(cases())
def test_any_shape_group_and_batch(case: dict[str, Any]) -> None:
    options = {k: case[k] for k in ("group", "symmetric", "g_idx", "block") if k in case}
    with tempfile.TemporaryDirectory() as tmp:
        write_format_checkpoint(tmp, case["fmt"], hidden=case["hidden"], intermediate=case["inter"],
                                experts=1, seed=case["seed"], **options)
        for ex in _leased(Path(tmp), expert=0):
            weights = colibri.dequantize(ex)
            rng = np.random.default_rng(case["seed"])
            x = _tokens(rng, case["tokens"], case["hidden"], BF16 if case["bf16"] else np.float32)
            got = kernels.expert_ffn(ex, x, activation=case["activation"], isa=case["isa"])
            bound = BF16_BOUND if case["bf16"] else F32_BOUND
            assert relative_error(got, reference(weights, x, case["activation"])) <= bound


# ---------------------------------------------------------------- a token alone or batched


@st.composite
def batched(draw: Any) -> dict[str, Any]:
    case = _format_and_shape(draw, 160, 128)
    fmt, hidden, inter = case["fmt"], case["hidden"], case["inter"]
    case["tokens"] = draw(st.integers(2, 40))
    case["threads"] = draw(st.integers(1, 3))
    case["position"] = draw(st.integers(0, case["tokens"] - 1))
    if fmt in ("int4", "stacked_int4"):
        common = math.gcd(hidden, inter)
        case["group"] = draw(st.sampled_from([g for g in (8, 16, 32, 64, 96, 128) if common % g == 0]
                                             or [common]))
    elif fmt in ("gptq", "gptq_v2", "awq"):
        case["group"] = draw(st.sampled_from([-1, 8, 16, 32, 64, 128]))
        case["g_idx"] = draw(st.sampled_from(["act_order", "sorted", None]))
    return case


@settings(max_examples=int(os.environ.get("COLIBRI_KERNEL_EXAMPLES", "40")), deadline=None)
@given(batched())
def test_a_token_gets_the_same_bits_alone_or_batched(case: dict[str, Any]) -> None:
    """Greedy decoding must not depend on which tokens share a call: a
    token's output is bit for bit its output alone, whatever the batch, its
    place in it and the threads."""
    options = {k: case[k] for k in ("group", "g_idx") if k in case}
    with tempfile.TemporaryDirectory() as tmp:
        write_format_checkpoint(tmp, case["fmt"], hidden=case["hidden"], intermediate=case["inter"],
                                experts=1, seed=case["seed"], **options)
        for ex in _leased(Path(tmp), expert=0):
            rng = np.random.default_rng(case["seed"])
            x = _tokens(rng, case["tokens"], case["hidden"], BF16 if case["bf16"] else np.float32)
            p, isa = case["position"], case["isa"]
            batch = kernels.expert_ffn(ex, x, isa=isa, threads=case["threads"])
            alone = kernels.expert_ffn(ex, x[p:p + 1].copy(), isa=isa, threads=1)
            assert batch[p].tobytes() == alone[0].tobytes()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [8, 16, 23, 40])
def test_every_token_of_a_large_batch_gets_its_bits_alone(checkpoints: dict[str, Path], fmt: str,
                                                          tokens: int) -> None:
    """Batches the kernels split into blocks of 16, 8 and fewer tokens
    (16 + 8 + 4 + 2 + 1 for 23): each token's output is its output alone,
    on every path this CPU runs, and within the bound of the reference."""
    for ex in _leased(checkpoints[fmt]):
        weights = colibri.dequantize(ex)
        x = _tokens(np.random.default_rng(tokens), tokens, weights["down"].shape[0], BF16)
        want = reference(weights, x, "silu")
        for isa in kernels.available_isas():
            batch = kernels.expert_ffn(ex, x, isa=isa, threads=2)
            assert relative_error(batch, want) <= BF16_BOUND, isa
            for p in range(tokens):
                alone = kernels.expert_ffn(ex, x[p:p + 1].copy(), isa=isa)
                assert batch[p].tobytes() == alone[0].tobytes(), (isa, p)


def test_a_call_larger_than_one_batch() -> None:
    """More tokens than the buffers of one batch hold (an intermediate of
    90000 units keeps a batch at 64 tokens): every token is right, and the
    same bits as alone."""
    with tempfile.TemporaryDirectory() as tmp:
        write_format_checkpoint(tmp, "bf16", hidden=8, intermediate=90_000, experts=1, seed=2)
        for ex in _leased(Path(tmp), expert=0):
            weights = colibri.dequantize(ex)
            x = _tokens(np.random.default_rng(9), 150, 8, np.float32)
            got = kernels.expert_ffn(ex, x, threads=2)
            assert relative_error(got, reference(weights, x, "silu")) <= F32_BOUND
            for p in (0, 63, 64, 127, 128, 149):
                assert got[p].tobytes() == kernels.expert_ffn(ex, x[p:p + 1].copy())[0].tobytes()


@pytest.mark.parametrize("fmt,hidden,inter,options", [
    ("int4", 1152, 640, {"group": 128}), ("int4", 1280, 768, {"group": 256, "symmetric": False}),
    ("int4", 1088, 704, {"group": 64}), ("int4", 1056, 672, {"group": 96}),
    ("mxfp4", 1088, 640, {}),
    # MXFP4 over more than one slice of 1024 inputs, ending with a half block (32 inputs)
    ("mxfp4", 1056, 1120, {}), ("gptq", 1088, 768, {"group": 128, "g_idx": None}),
    ("gptq", 1088, 768, {"group": 24, "g_idx": None}),
    ("gptq", 1088, 768, {"group": 128, "g_idx": "act_order"}),
    # act order with many groups: one token's call runs several panels of outputs
    ("gptq", 1088, 2400, {"group": 16, "g_idx": "act_order"}),
    ("awq", 1088, 768, {"group": 128}), ("awq", 1088, 776, {"group": 10}),
    # groups of more than 128 inputs: the avx512 integer kernels quantise and
    # sum their inputs in parts of a group (128 inputs; 64 of 1088)
    ("gptq", 1024, 768, {"group": 256, "g_idx": None}), ("awq", 1088, 768, {"group": -1})])
def test_wide_matrices_and_many_tokens(fmt: str, hidden: int, inter: int,
                                       options: dict[str, Any]) -> None:
    """Shapes past the small ones hypothesis draws: several panels of
    outputs, a last partial block of inputs (1088 = 8 * 128 + 64), more
    tokens than a block of the kernels holds (48: more than one block of 32
    too), bfloat16 and float32: within the bounds, and each token the bits
    it gets alone."""
    with tempfile.TemporaryDirectory() as tmp:
        write_format_checkpoint(tmp, fmt, hidden=hidden, intermediate=inter, experts=1, seed=4,
                                **options)
        for ex in _leased(Path(tmp), expert=0):
            weights = colibri.dequantize(ex)
            for dtype, bound in ((BF16, BF16_BOUND), (np.float32, F32_BOUND)):
                x = _tokens(np.random.default_rng(6), 48, hidden, dtype)
                got = kernels.expert_ffn(ex, x, threads=2)
                assert relative_error(got, reference(weights, x, "silu")) <= bound
                for p in (0, 1, 33, 47):
                    alone = kernels.expert_ffn(ex, x[p:p + 1].copy(), threads=1)
                    assert got[p].tobytes() == alone[0].tobytes(), (dtype, p)


@pytest.mark.skipif(not kernels.amx_tiles(), reason="AMX tiles: not on this CPU or OS")
@pytest.mark.parametrize("fmt,hidden,inter,options", [
    ("int4", 1152, 640, {"group": 128}), ("int4", 1152, 640, {"group": 128, "symmetric": False}),
    ("int4", 1280, 768, {"group": 256, "symmetric": False}),
    # a scale per 32 inputs: tiles of a quarter of a chunk; 1056 = 8 * 128 + 32
    ("int4", 1152, 640, {"group": 32}), ("int4", 1056, 672, {"group": 96, "symmetric": False}),
    # MXFP4 ending with a half block (1056 = 16 * 64 + 32) and rows in tiles of 8
    ("mxfp4", 1056, 672, {})])
def test_amx_tiles_give_the_vector_kernels_bits(fmt: str, hidden: int, inter: int, options: dict[str, Any],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """int4 and MXFP4 in bfloat16 with AMX tiles (more than one token) and
    without (COLIBRI_KERNEL_AMX=0: the AVX-512 integer kernels): the same
    bits, for batches of one tile of tokens, more than one and a partial
    one, on threads that split the rows mid-tile."""
    with tempfile.TemporaryDirectory() as tmp:
        write_format_checkpoint(tmp, fmt, hidden=hidden, intermediate=inter, experts=1, seed=8, **options)
        for ex in _leased(Path(tmp), expert=0):
            weights = colibri.dequantize(ex)
            for tokens in (2, 16, 37):
                x = _tokens(np.random.default_rng(tokens), tokens, hidden, BF16)
                for threads in (1, 3):
                    monkeypatch.delenv("COLIBRI_KERNEL_AMX", raising=False)
                    tiles = kernels.expert_ffn(ex, x, isa="avx512", threads=threads)
                    monkeypatch.setenv("COLIBRI_KERNEL_AMX", "0")
                    assert not kernels.amx_tiles()
                    vectors = kernels.expert_ffn(ex, x, isa="avx512", threads=threads)
                    assert tiles.tobytes() == vectors.tobytes(), (tokens, threads)
                assert relative_error(tiles, reference(weights, x, "silu")) <= BF16_BOUND


# ---------------------------------------------------------------- operands and threads


def test_threads_give_the_same_bits(checkpoints: dict[str, Path]) -> None:
    rng = np.random.default_rng(3)
    for fmt in ("int4", "gptq", "mxfp4", "bf16"):
        for ex in _leased(checkpoints[fmt]):
            x = _tokens(rng, 6, 160, np.float32)
            one = kernels.expert_ffn(ex, x, threads=1)
            for threads in (2, 3, 5):
                assert np.array_equal(kernels.expert_ffn(ex, x, threads=threads), one)


def test_concurrent_callers_share_a_pool(checkpoints: dict[str, Path]) -> None:
    rng = np.random.default_rng(4)
    x = _tokens(rng, 3, 160, np.float32)
    for ex in _leased(checkpoints["awq"]):
        want = kernels.expert_ffn(ex, x, threads=2)
        errors: list[str] = []

        def worker() -> None:
            for _ in range(20):
                if not np.array_equal(kernels.expert_ffn(ex, x, threads=2), want):
                    errors.append("differs")

        workers = [threading.Thread(target=worker) for _ in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert not errors


def test_out_strided_rows_and_one_dimensional_input(checkpoints: dict[str, Path]) -> None:
    rng = np.random.default_rng(6)
    for ex in _leased(checkpoints["int4"]):
        weights = colibri.dequantize(ex)
        big = _tokens(rng, 4, 200, np.float32)
        x = big[:, :160]  # rows 200 apart
        out = np.zeros((4, 190), np.float32)[:, :160]
        assert kernels.expert_ffn(ex, x, out=out) is out
        assert relative_error(out, reference(weights, x, "silu")) <= F32_BOUND
        one = kernels.expert_ffn(ex, x[1].copy())
        assert one.shape == (160,)
        np.testing.assert_array_equal(one, out[1])


def test_torch_tensors_in_place() -> None:
    torch = pytest.importorskip("torch")
    with tempfile.TemporaryDirectory() as tmp:
        write_format_checkpoint(tmp, "gptq", hidden=64, intermediate=32, group=16)
        for ex in _leased(Path(tmp)):
            weights = colibri.dequantize(ex)
            x = torch.randn(5, 64)
            out = torch.empty(5, 64)
            assert kernels.expert_ffn(ex, x, out=out) is out
            assert relative_error(out.numpy(), reference(weights, x.numpy(), "silu")) <= F32_BOUND
            xb = x.bfloat16()
            yb = kernels.expert_ffn(ex, xb, threads=2)
            assert yb.dtype == torch.bfloat16
            want = reference(weights, xb.float().numpy(), "silu")
            assert relative_error(yb.float().numpy(), want) <= BF16_BOUND
            with pytest.raises(ValueError, match="same kind"):
                kernels.expert_ffn(ex, x, out=np.empty((5, 64), np.float32))
            with pytest.raises(ValueError, match="contiguous"):
                kernels.expert_ffn(ex, torch.randn(64, 5).T)


def test_operand_errors_are_clear(checkpoints: dict[str, Path]) -> None:
    for ex in _leased(checkpoints["int4"]):
        x = np.ones((2, 160), np.float32)
        with pytest.raises(TypeError, match="float64"):
            kernels.expert_ffn(ex, x.astype(np.float64))
        with pytest.raises(TypeError, match="numpy array or a torch tensor"):
            kernels.expert_ffn(ex, x.tolist())
        with pytest.raises(ValueError, match=r"\(tokens, 160\)"):
            kernels.expert_ffn(ex, np.ones((2, 159), np.float32))
        with pytest.raises(ValueError, match="contiguous"):
            kernels.expert_ffn(ex, np.ones((160, 2), np.float32).T)
        with pytest.raises(ValueError, match="no tokens"):
            kernels.expert_ffn(ex, np.ones((0, 160), np.float32))
        frozen = np.empty_like(x)
        frozen.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            kernels.expert_ffn(ex, x, out=frozen)
        with pytest.raises(ValueError, match="overlaps"):
            kernels.expert_ffn(ex, x, out=x)
        with pytest.raises(ValueError, match="shape"):
            kernels.expert_ffn(ex, x, out=np.empty((3, 160), np.float32))
        with pytest.raises(ValueError, match="activation"):
            kernels.expert_ffn(ex, x, activation="relu")
        with pytest.raises(ValueError, match="threads"):
            kernels.expert_ffn(ex, x, threads=0)
        with pytest.raises(ValueError, match="unknown kernel path"):
            kernels.expert_ffn(ex, x, isa="sse9")
        missing = [isa for isa in kernels.ISAS if isa not in kernels.available_isas()]
        for isa in missing:
            with pytest.raises(ColibriError, match="cannot run"):
                kernels.expert_ffn(ex, x, isa=isa)


def test_set_isa_forces_a_path(checkpoints: dict[str, Path]) -> None:
    for ex in _leased(checkpoints["mxfp4"]):
        try:
            for isa in kernels.available_isas():
                kernels.set_isa(isa)
                assert kernels.default_isa() == isa
                assert kernels.kernel_name(ex).endswith(isa) or kernels.kernel_name(ex) == "scalar"
        finally:
            kernels.set_isa(None)
        if "avx512" in kernels.available_isas():
            assert kernels.kernel_name(ex, isa="avx512") == "mxfp4/avx512"


@pytest.mark.parametrize("value,needle", [("sse9", "not a path"), ("neon", "cannot run")])
def test_environment_variable_names_a_path(value: str, needle: str) -> None:
    if value == "neon" and "neon" in kernels.available_isas():
        pytest.skip("this CPU runs the neon path")
    code = ("import numpy as np, colibri.kernels as k\n"
            "try:\n    k.default_isa()\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    env = dict(os.environ, COLIBRI_KERNEL_ISA=value)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True)
    assert needle in done.stdout and "COLIBRI_KERNEL_ISA" in done.stdout
    env["COLIBRI_KERNEL_ISA"] = "scalar"
    done = subprocess.run([sys.executable, "-c", "import colibri.kernels as k; print(k.default_isa())"],
                          env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "scalar"


# ---------------------------------------------------------------- the C entry refuses bad calls


class _CCall:
    """A valid C call on a BF16 expert (hidden 32, inter 16) built from
    numpy buffers, whose fields a test then breaks one at a time."""

    def __init__(self) -> None:
        from colibri._ffi import ffi, lib

        self.ffi, self.lib = ffi, lib
        rng = np.random.default_rng(0)
        self.keep = {r: rng.standard_normal(s).astype(BF16)
                     for r, s in (("gate", (16, 32)), ("up", (16, 32)), ("down", (32, 16)))}
        self.x = np.ones((2, 32), np.float32)
        self.out = np.zeros((2, 32), np.float32)
        self.expert = ffi.new("ColiFfnExpert *")
        for role, a in self.keep.items():
            v = getattr(self.expert, role).view
            v.format = lib.COLI_TENSOR_BF16
            v.data = ffi.cast("const void *", a.ctypes.data)
            v.data_bytes = a.nbytes
            v.rows, v.columns = a.shape
        self.call = ffi.new("ColiFfnCall *")
        self.call.x = ffi.cast("const void *", self.x.ctypes.data)
        self.call.x_format = self.call.out_format = lib.COLI_TENSOR_F32
        self.call.x_stride = self.call.out_stride = 32
        self.call.out = ffi.cast("void *", self.out.ctypes.data)
        self.call.tokens = 2
        self.call.isa = lib.COLI_FFN_ISA_AUTO

    def run(self, pool: Any = None) -> tuple[int, str]:
        err = self.ffi.new("char[]", 256)
        rc = self.lib.coli_expert_ffn(self.expert, self.call, pool or self.ffi.NULL, err, 256)
        return rc, self.ffi.string(err).decode()


def test_the_c_entry_computes_the_valid_call() -> None:
    c = _CCall()
    assert c.run() == (0, "")
    w = {k: v.astype(np.float32) for k, v in c.keep.items()}
    assert relative_error(c.out, reference(w, c.x, "silu")) <= F32_BOUND


@pytest.mark.parametrize("case,needle", [
    ("data_bytes", "data bytes"), ("format", "is not computed"), ("shape", "shape"),
    ("down_shape", "down is"), ("up_shape", "up is"), ("x_format", "F32 or BF16"),
    ("tokens", "tokens"), ("stride", "stride"), ("flags", "unknown flags"),
    ("activation", "activation"), ("fused", "fused"), ("fused_odd", "2 x"),
    ("scales", "takes no scales"), ("bias", "bias"), ("zeros", "no zero points"),
    ("isa", "path"), ("zero_plus_one", "GPTQ"),
])
def test_the_c_entry_refuses_bad_calls(case: str, needle: str) -> None:
    c = _CCall()
    e, lib = c.expert, c.lib
    if case == "data_bytes":
        e.gate.view.data_bytes -= 2
    elif case == "format":
        e.up.view.format = lib.COLI_TENSOR_Q8_ROW
    elif case == "shape":
        e.down.view.rows = 0
    elif case == "down_shape":
        e.down.view.rows, e.down.view.columns = 16, 32
    elif case == "up_shape":
        e.up.view.rows, e.up.view.columns, e.up.view.data_bytes = 8, 32, 8 * 32 * 2
    elif case == "x_format":
        c.call.x_format = lib.COLI_TENSOR_F16
    elif case == "tokens":
        c.call.tokens = 0
    elif case == "stride":
        c.call.out_stride = 31
    elif case == "flags":
        e.gate.flags = 64
    elif case == "activation":
        e.activation = 9
    elif case == "fused":
        e.fused = 7
    elif case == "fused_odd":
        e.fused = lib.COLI_FFN_CONCATENATED
        e.gate.view.rows, e.gate.view.data_bytes = 15, 15 * 32 * 2
    elif case == "scales":
        e.gate.view.scale_format = lib.COLI_SCALE_F32
    elif case == "bias":
        e.down.bias = e.gate.view.data
        e.down.bias_format, e.down.bias_bytes = lib.COLI_TENSOR_F32, 4 * 31
    elif case == "zeros":
        e.gate.zeros, e.gate.zero_bytes = e.gate.view.data, 8
    elif case == "isa":
        c.call.isa = 99
    elif case == "zero_plus_one":
        e.gate.flags = lib.COLI_FFN_ZERO_PLUS_ONE
    rc, message = c.run()
    assert rc == lib.COLI_EINVAL and needle in message, (rc, message)
    assert not c.out.any()


def f32_call(x: np.ndarray, out: np.ndarray) -> Any:
    """A ColiFfnCall of float32 rows ``x`` into ``out`` (both kept alive by
    the caller), on the default path."""
    from colibri._ffi import ffi, lib

    return ffi.new("ColiFfnCall *", {
        "x": ffi.cast("const void *", x.ctypes.data), "x_format": lib.COLI_TENSOR_F32,
        "x_stride": x.shape[1], "out": ffi.cast("void *", out.ctypes.data),
        "out_format": lib.COLI_TENSOR_F32, "out_stride": out.shape[1], "tokens": x.shape[0],
        "isa": -1})


def test_the_c_entry_refuses_bad_quantized_parts() -> None:
    """A GPTQ matrix whose g_idx names a group past its scales, and one whose
    zero points are short, fail with a message instead of reading past them."""
    from colibri._ffi import ffi, lib

    with tempfile.TemporaryDirectory() as tmp:
        write_format_checkpoint(tmp, "gptq", hidden=32, intermediate=16, group=8)
        for ex in _leased(Path(tmp)):
            x = np.ones((1, 32), np.float32)
            kernels.expert_ffn(ex, x)  # valid as written
            parts = ex.parts
            bad_g = parts["gate_g_idx"].copy()
            bad_g[3] = 4  # 32 inputs in groups of 8: groups 0..3
            expert = ffi.new("ColiFfnExpert *")
            for role in ("gate", "up", "down"):
                kernels._fill_matrix(getattr(expert, role), ex.tensors, role, parts)
            expert.gate.g_idx = ffi.cast("const void *", bad_g.ctypes.data)
            out = np.empty_like(x)
            call = f32_call(x, out)
            err = ffi.new("char[]", 256)
            assert lib.coli_expert_ffn(expert, call, ffi.NULL, err, 256) == lib.COLI_EINVAL
            assert b"g_idx[3] = 4" in ffi.string(err)
            expert.gate.g_idx = ffi.cast("const void *", parts["gate_g_idx"].ctypes.data)
            expert.down.zero_bytes -= 4
            assert lib.coli_expert_ffn(expert, call, ffi.NULL, err, 256) == lib.COLI_EINVAL
            assert b"zero points" in ffi.string(err)
            del parts


def test_compute_pool_sizes() -> None:
    from colibri._ffi import ffi, lib

    out = ffi.new("ColiComputePool **")
    err = ffi.new("char[]", 128)
    assert lib.coli_compute_pool_create(0, out, err, 128) == lib.COLI_EINVAL
    assert lib.coli_compute_pool_create(3, out, err, 128) == 0
    c = _CCall()
    assert c.run(out[0]) == (0, "")
    assert lib.coli_compute_pool_threads(out[0]) == 3
    lib.coli_compute_pool_destroy(out[0])
