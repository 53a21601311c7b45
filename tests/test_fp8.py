"""FP8 block-scaled experts (DeepSeek-V3 style): leased bytes and dequantize."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors import deserialize
from safetensors.numpy import save_file

import colibri
from colibri import moe
from colibri.errors import FormatError
from colibri.formats.fp8 import fp8_to_float

F8 = ml_dtypes.float8_e4m3fn
ROLES = ("gate", "up", "down")
PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


_NUMPY = {"F8_E4M3": np.dtype(F8), "F32": np.dtype(np.float32)}


def load_file(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a file as parsed by the safetensors package.

    (safetensors.numpy.load_file cannot build F8_E4M3 arrays under numpy 2,
    which has no float8 dtype, so its parsed bytes are viewed with ml_dtypes.)
    """
    with open(path, "rb") as fh:
        parsed = deserialize(fh.read())
    return {name: np.frombuffer(bytes(t["data"]), dtype=_NUMPY[t["dtype"]]).reshape(t["shape"])
            for name, t in parsed}


def _gate_up_down(ex) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    weights = colibri.dequantize(ex)
    return weights["gate"], weights["up"], weights["down"]


def reference_dequantize(w: np.ndarray, s: np.ndarray, br: int, bc: int) -> np.ndarray:
    """The definition, block by block."""
    out = np.empty(w.shape, np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            block = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].astype(np.float32)
            out[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = block * s[i, j]
    return out


def fp8_values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return (rng.standard_normal(shape) * 2).astype(F8)


def scales_for(rng: np.random.Generator, shape: tuple[int, int], block: int = 128) -> np.ndarray:
    return (rng.random((-(-shape[0] // block), -(-shape[1] // block))) * 0.01 + 1e-3).astype(np.float32)


def deepseek_fp8_tensors(hidden: int = 320, inter: int = 200, experts: int = 4,
                         layers: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    """A DeepSeek-V3-like fp8 checkpoint: layer 0 dense, then MoE layers with
    a router, e_score_correction_bias, shared experts and fp8 routed experts
    (shapes not multiples of 128, so the last blocks are partial)."""
    rng = np.random.default_rng(seed)
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((16, hidden)).astype(np.float32)}

    def mlp(prefix: str, width: int) -> None:
        for role in ROLES:
            shape = (hidden, width) if role == "down" else (width, hidden)
            t[f"{prefix}.{PROJ[role]}.weight"] = fp8_values(rng, shape)
            t[f"{prefix}.{PROJ[role]}.weight_scale_inv"] = scales_for(rng, shape)

    for layer in range(layers):
        t[f"model.layers.{layer}.input_layernorm.weight"] = np.ones(hidden, np.float32)
        if layer == 0:
            mlp("model.layers.0.mlp", 3 * inter)
            continue
        t[f"model.layers.{layer}.mlp.gate.weight"] = rng.standard_normal((experts, hidden)).astype(np.float32)
        t[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] = rng.random(experts).astype(np.float32)
        mlp(f"model.layers.{layer}.mlp.shared_experts", inter)
        for e in range(experts):
            mlp(f"model.layers.{layer}.mlp.experts.{e}", inter)
    return t


def write(directory: Path, tensors: dict[str, np.ndarray], shards: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return directory
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(directory / fname))
        weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


@pytest.fixture(scope="module", params=[1, 3], ids=["single", "sharded"])
def fp8_model(request, tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    tensors = deepseek_fp8_tensors()
    path = write(tmp_path_factory.mktemp("fp8"), tensors, shards=request.param)
    # What safetensors itself reads back, the reference for every byte.
    files = sorted(path.glob("*.safetensors"))
    loaded: dict[str, np.ndarray] = {}
    for f in files:
        loaded.update(load_file(str(f)))
    return path, loaded


def _expect_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def test_leased_fp8_weights_and_scales_equal_the_file(fp8_model) -> None:
    path, loaded = fp8_model
    with colibri.open_store(path, slots_per_layer=2, prefetch_workers=1) as store:
        assert store.layers == (1, 2)
        for layer in store.layers:
            assert store.num_experts(layer) == 4
            for e in range(4):
                info = store.model.expert(layer, e)
                for role in ROLES:
                    assert info.coli_format(role) == 4          # COLI_TENSOR_FP8_E4M3_BLOCK
                    assert info.block_shape(role) == (128, 128)
                with store.lease(layer, e) as ex:
                    for role in ROLES:
                        name = f"model.layers.{layer}.mlp.experts.{e}.{PROJ[role]}.weight"
                        _expect_same(getattr(ex, role), loaded[name])
                        _expect_same(getattr(ex, f"{role}_scale"), loaded[name + "_scale_inv"])
                    assert ex.gate.dtype == np.dtype(F8) and ex.gate_scale.dtype == np.float32
                    assert ex.gate_scale.shape == (2, 3) and ex.down_scale.shape == (3, 2)


def test_dequantize_lease_matches_the_reference(fp8_model) -> None:
    path, loaded = fp8_model
    with colibri.open_store(path, slots_per_layer=1, prefetch_workers=0) as store:
        with store.lease(2, 3) as ex:
            got = _gate_up_down(ex)
        for role, array in zip(ROLES, got):
            name = f"model.layers.2.mlp.experts.3.{PROJ[role]}.weight"
            want = reference_dequantize(loaded[name], loaded[name + "_scale_inv"], 128, 128)
            assert array.dtype == np.float32 and array.flags.c_contiguous
            np.testing.assert_array_equal(array, want)
        assert store.active_leases == 0   # the results do not hold the lease


def test_moe_layer_on_fp8_experts(fp8_model) -> None:
    path, loaded = fp8_model
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 320)).astype(np.float32)
    router = loaded["model.layers.1.mlp.gate.weight"]
    with colibri.open_store(path, slots_per_layer=4, prefetch_workers=0) as store:
        got = moe.moe_layer(store, 1, router, x, 2)
    idx, w = moe.route(router, x, 2)
    want = np.zeros_like(x)
    for t in range(len(x)):
        for k in range(2):
            parts = []
            for role in ROLES:
                name = f"model.layers.1.mlp.experts.{idx[t, k]}.{PROJ[role]}.weight"
                parts.append(reference_dequantize(loaded[name], loaded[name + "_scale_inv"], 128, 128))
            g, u, d = (p.astype(np.float64) for p in parts)
            h = g @ x[t]
            want[t] += w[t, k] * (d @ (h / (1 + np.exp(-h)) * (u @ x[t])))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@given(
    rows=st.integers(1, 300), cols=st.integers(1, 300),
    br=st.sampled_from([5, 16, 100, 128]), bc=st.sampled_from([7, 64, 128]),
    seed=st.integers(0, 2**32 - 1),
)
def test_dequantize_matches_the_definition(rows: int, cols: int, br: int, bc: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    w = fp8_values(rng, (rows, cols))
    s = rng.random((-(-rows // br), -(-cols // bc))).astype(np.float32) * 4
    got = fp8_to_float(w, s, block=(br, bc))
    assert got.dtype == np.float32 and got.shape == (rows, cols)
    np.testing.assert_array_equal(got, reference_dequantize(w, s, br, bc))
    # uint8 bytes of the same weight give the same result.
    np.testing.assert_array_equal(fp8_to_float(w.view(np.uint8), s, block=(br, bc)), got)


def test_dequantize_default_block_and_inference() -> None:
    rng = np.random.default_rng(0)
    w = fp8_values(rng, (256, 384))
    s = scales_for(rng, (256, 384))
    np.testing.assert_array_equal(fp8_to_float(w, s), reference_dequantize(w, s, 128, 128))
    np.testing.assert_array_equal(fp8_to_float(w, s, block=None), fp8_to_float(w, s))
    # block=None infers the block: 128 where it tiles the weight, else the smallest that does
    for shape, scales, edge in [((200, 320), (2, 3), (128, 128)), ((64, 96), (2, 3), (32, 32))]:
        wi, si = fp8_values(rng, shape), rng.uniform(0.5, 2, scales).astype(np.float32)
        np.testing.assert_array_equal(fp8_to_float(wi, si, block=None), reference_dequantize(wi, si, *edge))
    w.flags.writeable = False
    fp8_to_float(w, s)   # read-only input is fine, and untouched
    np.testing.assert_array_equal(w.astype(np.float32), fp8_values(np.random.default_rng(0), (256, 384)).astype(np.float32))


def test_dequantize_rejects_bad_input() -> None:
    w = np.zeros((200, 320), F8)
    with pytest.raises(FormatError, match=r"needs scales of shape \[2, 3\]"):
        fp8_to_float(w, np.ones((1, 3), np.float32))
    with pytest.raises(FormatError, match="2-D"):
        fp8_to_float(np.zeros(10, F8), np.ones((1, 1), np.float32))
    with pytest.raises(FormatError, match="fp8 array"):
        fp8_to_float(np.zeros((4, 4), np.float32), np.ones((1, 1), np.float32))
    with pytest.raises(FormatError, match="positive"):
        fp8_to_float(w, np.ones((2, 3), np.float32), block=(0, 128))
    with pytest.raises(FormatError, match="do not tile"):
        fp8_to_float(np.zeros((10, 10), F8), np.ones((11, 1), np.float32), block=None)


def test_dequantize_lease_of_unscaled_experts(model_factory) -> None:
    model = model_factory(layout="mlp_experts", n_layers=2, n_experts=3, dtype="bfloat16")
    with colibri.open_store(model.path, prefetch_workers=0) as store:
        layer = store.layers[0]
        with store.lease(layer, 1) as ex:
            want = [getattr(ex, r).astype(np.float32) for r in ROLES]
            got = _gate_up_down(ex)
            assert ex.gate_scale is None
        for g, w_ in zip(got, want):
            np.testing.assert_array_equal(g, w_)
        del want
        assert store.active_leases == 0
