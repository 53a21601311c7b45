"""Fused expert layouts and 4-bit formats, checked against the formats' own code.

Checkpoints come from the projects that define them: gpt-oss and Llama 4 from
transformers' ``save_pretrained``, MXFP4 through transformers' loader and
``convert_moe_packed_tensors``, pack-quantized int4 from the
``compressed-tensors`` package's own compressor. Every leased part must equal
what ``safetensors`` loads for that name and slice; every dequantized weight
and MoE block must equal the reference implementation's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import colibri
from colibri import moe
from colibri.errors import FormatError
from colibri.checkpoint.scan import scan_model
from conftest import assert_lease_parts_equal_safetensors, load_safetensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors.pack_quantized.base import (  # noqa: E402
    PackedQuantizationCompressor,
)
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

import core_control  # noqa: E402  (the test build's control)

HIDDEN, INTER, EXPERTS, LAYERS = 64, 32, 4, 2


def _gpt_oss_config() -> Any:
    return transformers.GptOssConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=INTER,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_local_experts=EXPERTS, num_experts_per_tok=2, vocab_size=64,
        layer_types=["full_attention"] * LAYERS)


def _llama4_config() -> Any:
    return transformers.Llama4TextConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=INTER,
        intermediate_size_mlp=48, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_local_experts=EXPERTS, num_experts_per_tok=1, vocab_size=64)


def _randomize(model: Any, seed: int) -> None:
    """Random values everywhere (biases too: save_pretrained's init leaves them 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: Any) -> Path:
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(_gpt_oss_config())
    _randomize(model, 1)
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(path, max_shard_size="40KB")  # sharded: experts land in several files
    return Path(path)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: Any) -> Path:
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(_llama4_config())
    _randomize(model, 2)
    path = tmp_path_factory.mktemp("llama4")
    model.save_pretrained(path)
    return Path(path)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss: Path, tmp_path_factory: Any) -> Path:
    """gpt-oss with its experts as MXFP4 blocks and scales, the way the
    released checkpoints store them (biases stay float)."""
    path = Path(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    rng = np.random.default_rng(3)
    tensors: dict[str, np.ndarray] = {}
    for name, value in load_safetensors(gpt_oss).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, inp, out = value.shape
            tensors[name + "_blocks"] = rng.integers(0, 256, (experts, out, inp // 32, 16), dtype=np.uint8)
            tensors[name + "_scales"] = rng.integers(118, 131, (experts, out, inp // 32), dtype=np.uint8)
        else:
            tensors[name] = value
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((gpt_oss / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def stacked(tmp_path_factory: Any) -> tuple[Path, Any]:
    """A Mixtral saved the way transformers holds its experts in memory:
    gate_up_proj (E, 2I, H) concatenated, down_proj (E, H, I)."""
    config = transformers.MixtralConfig(
        num_hidden_layers=1, hidden_size=HIDDEN, intermediate_size=INTER,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=EXPERTS,
        num_experts_per_tok=2, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    _randomize(model, 4)
    block = model.model.layers[0].mlp
    path = Path(tmp_path_factory.mktemp("stacked"))
    save_file({
        "model.layers.0.mlp.experts.gate_up_proj": block.experts.gate_up_proj.detach().numpy(),
        "model.layers.0.mlp.experts.down_proj": block.experts.down_proj.detach().numpy(),
        "model.layers.0.mlp.gate.weight": block.gate.weight.detach().numpy(),
    }, str(path / "model.safetensors"))
    return path, block


def _int4_checkpoint(path: Path, *, symmetric: bool, scale_dtype: Any, group: int = 16,
                     seed: int = 5) -> dict[tuple[int, int, str], torch.Tensor]:
    """Qwen3-MoE-style experts compressed by compressed-tensors itself;
    returns the package's own decompression of each weight."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group",
                            group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, np.ndarray] = {}
    reference: dict[tuple[int, int, str], torch.Tensor] = {}
    for layer in range(LAYERS):
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = np.zeros((EXPERTS, HIDDEN), np.float32)
        for expert in range(EXPERTS):
            for role, shape in (("gate", (INTER, HIDDEN)), ("up", (INTER, HIDDEN)),
                                ("down", (HIDDEN, INTER))):
                w = torch.randn(shape, generator=gen)
                groups = w.reshape(shape[0], shape[1] // group, group)
                scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
                state = {"weight": w, "weight_scale": scale.to(scale_dtype), "weight_zero_point": zero}
                packed = PackedQuantizationCompressor.compress(state, scheme)
                reference[(layer, expert, role)] = PackedQuantizationCompressor.decompress(
                    dict(packed), scheme)["weight"]
                base = f"model.layers.{layer}.mlp.experts.{expert}.{role}_proj."
                for key, value in packed.items():
                    tensors[base + key] = value.contiguous().numpy() if value.dtype != torch.bfloat16 \
                        else value.view(torch.int16).numpy().view(_bf16())
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
            "group_size": group}}}}}))
    return reference


def _bf16() -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16


@pytest.fixture(scope="module", params=[(True, "bf16"), (False, "bf16"), (True, "f32")],
                ids=["symmetric-bf16", "asymmetric-bf16", "symmetric-f32"])
def int4(request: Any, tmp_path_factory: Any) -> tuple[Path, dict[tuple[int, int, str], Any], bool]:
    symmetric, scales = request.param
    path = Path(tmp_path_factory.mktemp("int4"))
    ref = _int4_checkpoint(path, symmetric=symmetric,
                           scale_dtype=torch.bfloat16 if scales == "bf16" else torch.float32)
    return path, ref, symmetric


# ---------------------------------------------------------------- byte equality


def test_gpt_oss_layout_and_bytes(gpt_oss: Path) -> None:
    model = scan_model(gpt_oss)
    assert model.layout == "gpt_oss" and len(set(t.file for t in model.expert(0, 0).tensors())) >= 1
    assert len(list(gpt_oss.glob("*.safetensors"))) > 1  # the sharded case
    ex = model.expert(1, 2)
    assert (ex.scheme, ex.fused, ex.transposed) == ("plain", "interleaved", True)
    assert ex.part_names() == ("gate_up", None, "down", None, None, None, "gate_up_bias", "down_bias")
    assert ex.gate.name == "model.layers.1.mlp.experts.gate_up_proj[2]"
    assert ex.gate.shape == (HIDDEN, 2 * INTER) and ex.down.shape == (INTER, HIDDEN)
    assert assert_lease_parts_equal_safetensors(gpt_oss) == LAYERS * EXPERTS * 4


def test_gpt_oss_mxfp4_layout_and_bytes(gpt_oss_mxfp4: Path) -> None:
    model = scan_model(gpt_oss_mxfp4)
    ex = model.expert(0, 3)
    assert (model.layout, ex.scheme, ex.fused, ex.transposed) == ("gpt_oss", "mxfp4", "interleaved", False)
    assert ex.shape("gate") == (2 * INTER, HIDDEN) and ex.shape("down") == (HIDDEN, INTER)
    assert ex.block_shape("gate") == (1, 32)
    assert ex.part_names() == ("gate_up", None, "down", "gate_up_scale", None, "down_scale",
                               "gate_up_bias", "down_bias")
    assert assert_lease_parts_equal_safetensors(gpt_oss_mxfp4) == LAYERS * EXPERTS * 6
    # A quarter of the f32 weights' bytes plus one scale byte per 32 values.
    values = 3 * INTER * HIDDEN
    assert ex.nbytes == values // 2 + values // 32 + 4 * (2 * INTER + HIDDEN)


def test_llama4_and_stacked_layouts_and_bytes(llama4: Path, stacked: tuple[Path, Any]) -> None:
    model = scan_model(llama4)
    ex = model.expert(0, 1)
    assert (model.layout, ex.fused, ex.transposed) == ("llama4", "concatenated", True)
    assert not any("shared_expert" in t.name for t in ex.tensors())
    assert assert_lease_parts_equal_safetensors(llama4) == LAYERS * EXPERTS * 2
    model = scan_model(stacked[0])
    ex = model.expert(0, 1)
    assert (model.layout, ex.fused, ex.transposed) == ("stacked", "concatenated", False)
    assert assert_lease_parts_equal_safetensors(stacked[0]) == EXPERTS * 2


def test_int4_layout_and_bytes(int4: tuple[Path, Any, bool]) -> None:
    path, _, symmetric = int4
    model = scan_model(path)
    ex = model.expert(1, 2)
    assert (model.layout, ex.scheme, ex.group_size) == ("mlp_experts", "int4", 16)
    assert ex.shape("gate") == (INTER, HIDDEN) and ex.shape("down") == (HIDDEN, INTER)
    assert ex.gate.name == "model.layers.1.mlp.experts.2.gate_proj.weight_packed"
    assert [n for n, _ in ex.extras] == ([] if symmetric else ["gate_zero", "up_zero", "down_zero"])
    assert assert_lease_parts_equal_safetensors(path) == LAYERS * EXPERTS * (6 if symmetric else 9)


# ---------------------------------------------------------------- numeric equality


def test_mxfp4_equals_transformers_convert(gpt_oss_mxfp4: Path) -> None:
    tensors = load_safetensors(gpt_oss_mxfp4)
    with colibri.open_store(gpt_oss_mxfp4, slots_per_layer=2) as store:
        for layer, expert in [(0, 0), (1, 3)]:
            with store.lease(layer, expert) as ex:
                got = colibri.dequantize(ex)
            for fused, roles in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
                base = f"model.layers.{layer}.mlp.experts.{fused}"
                ref = convert_moe_packed_tensors(torch.from_numpy(tensors[base + "_blocks"]),
                                                 torch.from_numpy(tensors[base + "_scales"]),
                                                 dtype=torch.float32)[expert].numpy()
                if fused == "gate_up_proj":  # transformers' (H, 2I), gate and up interleaved
                    np.testing.assert_array_equal(got["gate"], ref[:, 0::2].T)
                    np.testing.assert_array_equal(got["up"], ref[:, 1::2].T)
                else:
                    np.testing.assert_array_equal(got["down"], ref.T)
            bias = tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj_bias"][expert]
            np.testing.assert_array_equal(got["gate_bias"], bias[0::2])
            np.testing.assert_array_equal(got["up_bias"], bias[1::2])
            assert got["gate"].shape == (INTER, HIDDEN) and got["down"].shape == (HIDDEN, INTER)


def test_int4_equals_compressed_tensors(int4: tuple[Path, Any, bool]) -> None:
    path, reference, _ = int4
    with colibri.open_store(path, slots_per_layer=2) as store:
        for layer, expert in [(0, 0), (1, 3)]:
            with store.lease(layer, expert) as ex:
                got = colibri.dequantize(ex)
            for role in ("gate", "up", "down"):
                ref = reference[(layer, expert, role)]
                # The package computes in the scales' dtype; ours is float32, exact
                # for a 4-bit integer times a scale, so rounding it gives theirs.
                mine = torch.from_numpy(got[role]).to(ref.dtype)
                assert torch.equal(mine, ref), (layer, expert, role)


def test_dequantize_returns_copies(gpt_oss: Path) -> None:
    with colibri.open_store(gpt_oss, slots_per_layer=1) as store:
        with store.lease(0, 1) as ex:
            got = colibri.dequantize(ex)
        assert store.active_leases == 0
        assert all(a.dtype == np.float32 and a.flags.c_contiguous and a.flags.owndata
                   or a.base is not None and a.base.flags.owndata for a in got.values())
        assert set(got) == {"gate", "up", "down", "gate_bias", "up_bias", "down_bias"}


# ---------------------------------------------------------------- MoE blocks against transformers


def _tokens(n: int = 5, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, HIDDEN)).astype(np.float32)


def _gpt_oss_block(store: colibri.Store, mlp: Any, layer: int, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        _, scores, idx = mlp.router(torch.from_numpy(x))
    return moe.experts_forward(store, layer, x, idx.numpy(), scores.numpy(), activation="gpt_oss",
                               swiglu_limit=mlp.experts.limit, swiglu_alpha=mlp.experts.alpha)


@pytest.mark.parametrize("fixture", ["gpt_oss", "gpt_oss_mxfp4"])
def test_gpt_oss_moe_block_matches_transformers(fixture: str, request: Any) -> None:
    path = request.getfixturevalue(fixture)
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if fixture == "gpt_oss_mxfp4":  # the reference is dequantized by transformers
        kwargs["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    model = transformers.GptOssForCausalLM.from_pretrained(path, **kwargs)
    x = _tokens()
    with colibri.open_store(path, slots_per_layer=EXPERTS) as store:
        for layer in range(LAYERS):
            mlp = model.model.layers[layer].mlp
            with torch.no_grad():
                want, _ = mlp(torch.from_numpy(x)[None])
            got = _gpt_oss_block(store, mlp, layer, x)
            want = want[0].numpy()
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6 * np.abs(want).max())


def test_llama4_moe_block_matches_transformers(llama4: Path) -> None:
    model = transformers.Llama4ForCausalLM.from_pretrained(llama4, dtype=torch.float32)
    x = _tokens()
    with colibri.open_store(llama4, slots_per_layer=2) as store:
        for layer in range(LAYERS):
            ff = model.model.layers[layer].feed_forward
            with torch.no_grad():
                want, _ = ff(torch.from_numpy(x)[None])
                shared = ff.shared_expert(torch.from_numpy(x)).numpy()
                _, logits = ff.router(torch.from_numpy(x))
            # Llama 4: top-k by logit, weight = sigmoid(logit), applied to the input.
            idx = np.argsort(-logits.numpy(), axis=1, kind="stable")[:, :1]
            weight = 1 / (1 + np.exp(-np.take_along_axis(logits.numpy(), idx, axis=1)))
            got = shared + moe.experts_forward(store, layer, x, idx, weight, weights_on_input=True)
            np.testing.assert_allclose(got, want.reshape(x.shape).numpy(), rtol=2e-5, atol=2e-5)


def test_stacked_moe_block_matches_transformers(stacked: tuple[Path, Any]) -> None:
    path, block = stacked
    x = _tokens()
    with torch.no_grad():
        want = block(torch.from_numpy(x)[None])
        want = (want[0] if isinstance(want, tuple) else want).reshape(x.shape).numpy()
    with colibri.open_store(path, slots_per_layer=2) as store:
        got = moe.moe_layer(store, 0, block.gate.weight.detach().numpy(), x, 2)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_int4_moe_block_uses_the_dequantized_weights(int4: tuple[Path, Any, bool]) -> None:
    path, reference, _ = int4
    x = _tokens()
    idx = np.array([[0, 2], [1, 3], [2, 0], [3, 3], [1, 0]])
    weights = np.full(idx.shape, 0.5, np.float32)
    want = np.zeros_like(x)
    for t in range(len(x)):
        for e, w in zip(idx[t], weights[t]):
            g, u, d = (reference[(1, int(e), r)].float().numpy() for r in ("gate", "up", "down"))
            a, b = g @ x[t], u @ x[t]
            want[t] += w * (d @ (a / (1 + np.exp(-a)) * b))
    with colibri.open_store(path, slots_per_layer=2) as store:
        got = moe.experts_forward(store, 1, x, idx, weights)
    # Theirs is rounded to the scales' dtype (bf16: 3 significant digits).
    _, _, symmetric = int4
    tolerance = 2e-2 if reference[(1, 0, "gate")].dtype == torch.bfloat16 else 1e-5
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * np.abs(want).max())


# ---------------------------------------------------------------- torch interop


def _assert_torch_dequantize_matches(path: Path) -> None:
    from colibri.torch_interop import dequantize_torch

    with colibri.open_store(path, slots_per_layer=2) as store:
        with store.lease(1, 1) as ex:
            want = colibri.dequantize(ex)
            got = dequantize_torch(ex)
        assert store.active_leases == 0
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == torch.float32
        np.testing.assert_array_equal(got[name].numpy(), want[name])


@pytest.mark.parametrize("fixture", ["gpt_oss", "gpt_oss_mxfp4", "llama4"])
def test_torch_dequantize_matches_numpy(fixture: str, request: Any) -> None:
    _assert_torch_dequantize_matches(request.getfixturevalue(fixture))


def test_torch_dequantize_int4_matches_numpy(int4: tuple[Path, Any, bool]) -> None:
    _assert_torch_dequantize_matches(int4[0])


def test_torch_views_of_packed_parts(gpt_oss_mxfp4: Path) -> None:
    from colibri.torch_interop import as_torch

    with colibri.open_store(gpt_oss_mxfp4, slots_per_layer=2) as store:
        with store.lease(0, 0) as ex:
            parts = ex.parts
            blocks = as_torch(parts["gate_up"])
            assert blocks.dtype == torch.uint8 and blocks.data_ptr() == parts["gate_up"].ctypes.data
            del blocks, parts


# ---------------------------------------------------------------- hostile files


def _rewrite(src: Path, dst: Path, edit: Any) -> Path:
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        edit(tensors)
        save_file(tensors, str(f))
    return dst


def _expect_format_error(path: Path, *needles: str) -> None:
    with pytest.raises(FormatError) as err:
        colibri.open_store(path)
    for needle in needles:
        assert needle in str(err.value)


def test_mxfp4_hostile(gpt_oss_mxfp4: Path, tmp_path: Path) -> None:
    name = "model.layers.1.mlp.experts.down_proj"

    def drop_scales(t: dict[str, np.ndarray]) -> None:
        del t[name + "_scales"]

    def short_scales(t: dict[str, np.ndarray]) -> None:
        t[name + "_scales"] = t[name + "_scales"][:, :-1].copy()

    def wrong_block(t: dict[str, np.ndarray]) -> None:
        b = t[name + "_blocks"]
        t[name + "_blocks"] = b.reshape(b.shape[0], b.shape[1], -1, 8).copy()

    def fewer_experts(t: dict[str, np.ndarray]) -> None:
        t[name + "_blocks"] = t[name + "_blocks"][:-1].copy()
        t[name + "_scales"] = t[name + "_scales"][:-1].copy()

    def unknown_part(t: dict[str, np.ndarray]) -> None:
        t[name + "_zeros"] = np.zeros(3, np.float32)

    cases = [(drop_scales, name + "_blocks"), (short_scales, name + "_scales"),
             (wrong_block, name + "_blocks"), (fewer_experts, name + "_blocks"),
             (unknown_part, name + "_zeros")]
    for i, (edit, needle) in enumerate(cases):
        _expect_format_error(_rewrite(gpt_oss_mxfp4, tmp_path / str(i), edit), needle)


def test_fused_hostile(gpt_oss: Path, tmp_path: Path) -> None:
    tensors = load_safetensors(gpt_oss)
    base = "model.layers.0.mlp.experts."
    cases = {
        "bias": {base + "gate_up_proj_bias": tensors[base + "gate_up_proj_bias"][:, :-2].copy()},
        "shape": {base + "down_proj": np.zeros((EXPERTS, INTER + 1, HIDDEN), np.float32)},
        "dtype": {base + "down_proj": tensors[base + "down_proj"].astype(np.int32)},
    }
    for label, change in cases.items():
        d = tmp_path / label
        d.mkdir()
        save_file({**tensors, **change}, str(d / "model.safetensors"))
        _expect_format_error(d, next(iter(change)))


def test_int4_hostile(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _int4_checkpoint(src, symmetric=False, scale_dtype=torch.bfloat16)
    base = "model.layers.1.mlp.experts.2.up_proj.weight"

    def bad_shape(t: dict[str, np.ndarray]) -> None:  # packed size no longer matches weight_shape
        t[base + "_shape"] = np.array([INTER, HIDDEN + 16], np.int64)

    def short_packed(t: dict[str, np.ndarray]) -> None:
        t[base + "_packed"] = t[base + "_packed"][:, :-1].copy()

    def no_scale(t: dict[str, np.ndarray]) -> None:
        del t[base + "_scale"]

    def bad_scale(t: dict[str, np.ndarray]) -> None:
        t[base + "_scale"] = t[base + "_scale"][:, :3].copy()

    def bad_zero(t: dict[str, np.ndarray]) -> None:
        t[base + "_zero_point"] = t[base + "_zero_point"][:1].copy()

    def g_idx(t: dict[str, np.ndarray]) -> None:
        t[base + "_g_idx"] = np.zeros(HIDDEN, np.int32)

    cases = [(bad_shape, base + "_packed"), (short_packed, base + "_packed"),
             (no_scale, base + "_scale"), (bad_scale, base + "_scale"),
             (bad_zero, base + "_zero_point"), (g_idx, base + "_g_idx")]
    for i, (edit, needle) in enumerate(cases):
        _expect_format_error(_rewrite(src, tmp_path / str(i), edit), needle)
    # config.json's group size disagreeing with the scales
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32
    d = tmp_path / "group"
    shutil.copytree(src, d)
    (d / "config.json").write_text(json.dumps(cfg))
    _expect_format_error(d, "group_size 32")


def test_refused_c_formats(tmp_path: Path) -> None:
    """Formats no checkpoint maps to are refused by the C core, by number."""
    from colibri._ffi import ffi, lib

    path = tmp_path / "one.safetensors"
    save_file({"x": np.zeros((4, 8), np.uint8)}, str(path))
    offset = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    for fmt in (1, 2, 3, 6):  # Q8_ROW, Q4_ROW, Q2_ROW, INT8_BLOCK
        src = ffi.new("ColiExpertSource *")
        for role in ("gate", "up", "down"):
            t = getattr(src, role)
            t.file, t.offset, t.nbytes, t.format, t.rows, t.columns = 0, offset, 32, fmt, 4, 8
        cfg = ffi.new("ColiStoreConfig *")
        name = ffi.new("char[]", str(path).encode())
        files = ffi.new("const char *[]", [name])
        cfg.files, cfg.n_files, cfg.experts, cfg.n_experts = files, 1, src, 1
        cfg.slots_per_layer = 1
        out = ffi.new("ColiExpertStore **")
        err = ffi.new("char[]", 256)
        assert lib.coli_store_create(cfg, out, err, 256) == lib.COLI_ECONFIG
        assert b"not supported" in ffi.string(err)


# ---------------------------------------------------------------- inspect


def test_inspect_shows_format_and_fusion(gpt_oss_mxfp4: Path, llama4: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from colibri.__main__ import main

    assert main(["inspect", str(gpt_oss_mxfp4), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    row = data["layers"][0]
    assert (data["layout"], row["format"], row["group_size"], row["fused"], row["orientation"]) == (
        "gpt_oss", "mxfp4", 32, "interleaved", "out_in")
    assert row["parts"] == ["gate_up", "down", "gate_up_scale", "down_scale", "gate_up_bias", "down_bias"]
    assert row["bytes_per_expert"] == scan_model(gpt_oss_mxfp4).expert_nbytes(0)
    assert main(["inspect", str(llama4)]) == 0
    text = capsys.readouterr().out
    assert "plain" in text and "concatenated (in,out)" in text


def test_ranges_a_few_bytes_apart_are_one_read(tmp_path: Path) -> None:
    """A small tensor between an expert's parts (as weight_shape sits between
    a packed weight and its scales) does not cost a second read."""
    import errno

    tensors = {}
    for e in range(2):
        for role in ("w1", "w2", "w3"):
            shape = (16, 8) if role == "w2" else (8, 16)
            tensors[f"model.layers.0.block_sparse_moe.experts.{e}.{role}.weight"] = np.full(shape, e, np.float32)
        tensors[f"model.layers.0.block_sparse_moe.experts.{e}.w1x"] = np.zeros(2, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ex = scan_model(tmp_path).expert(0, 0)
    ranges = sorted((t.offset, t.end) for t in ex.tensors())
    gaps = [b[0] - a[1] for a, b in zip(ranges, ranges[1:])]
    assert max(gaps) > 0  # the parts do not touch
    with colibri.open_store(tmp_path, slots_per_layer=2, prefetch_workers=0) as store:
        core_control.inject_read_fault(store, 2, errno.EIO)  # the second read from now fails
        with store.lease(0, 0) as lease:  # one read
            assert float(lease.gate[0, 0]) == 0.0
        with pytest.raises(colibri.ExpertLoadError):
            store.lease(0, 1)


def test_mxfp4_extreme_scales_equal_transformers() -> None:
    """Scale bytes 0 (2**-127, subnormal) and 255 (past float32) decode as
    transformers' convert_moe_packed_tensors does."""
    from colibri.formats.mxfp4 import mxfp4_to_float

    rng = np.random.default_rng(11)
    blocks = rng.integers(0, 256, (2, 6, 3, 16), dtype=np.uint8)
    for scales in (rng.integers(0, 256, (2, 6, 3), dtype=np.uint8),
                   rng.integers(0, 255, (2, 6, 3), dtype=np.uint8)):
        scales[0, 0, 0], scales[1, 5, 2] = 0, 254
        ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                         dtype=torch.float32).transpose(1, 2).numpy()
        np.testing.assert_array_equal(mxfp4_to_float(blocks, scales), ref)


def test_parts_kept_past_the_lease_keep_it(gpt_oss_mxfp4: Path) -> None:
    """A parts dict is a new dict of the lease's arrays: kept past the lease
    it holds the slot (with a ResourceWarning) until it is deleted."""
    with colibri.open_store(gpt_oss_mxfp4, slots_per_layer=1) as store:
        with pytest.warns(ResourceWarning):
            with store.lease(0, 1) as ex:
                kept = ex.parts
        assert store.active_leases == 1
        blocks = bytes(kept["gate_up"].tobytes())
        with store.lease(0, 1) as again:  # the same slot, still holding expert 1
            assert again.parts["gate_up"].tobytes() == blocks
        del kept
        assert store.active_leases == 0
        with pytest.raises(colibri.LeaseError):
            ex.parts


def test_expert_parts_offsets(gpt_oss_mxfp4: Path) -> None:
    """coli_store_expert_parts: 6 + extra parts, UINT64_MAX for absent ones,
    at most cap written, ENOTFOUND for an unknown key."""
    from colibri._ffi import ffi, lib

    absent = 2**64 - 1
    with colibri.open_store(gpt_oss_mxfp4, slots_per_layer=1) as store:
        handle = store._handle
        out = ffi.new("uint64_t[]", [7] * 10)
        assert lib.coli_store_expert_parts(handle, 0, 2, out, 10) == 8
        offsets = list(out[0:8])
        assert offsets[1] == offsets[4] == absent  # up and its scale: fused into gate
        present = [o for o in offsets if o != absent]
        assert len(set(present)) == 6 and out[8] == 7 and out[9] == 7
        short = ffi.new("uint64_t[]", [7] * 3)
        assert lib.coli_store_expert_parts(handle, 0, 2, short, 2) == 8
        assert list(short[0:2]) == offsets[:2] and short[2] == 7
        assert lib.coli_store_expert_parts(handle, 0, EXPERTS, out, 10) == lib.COLI_ENOTFOUND
        assert lib.coli_store_expert_parts(handle, 9, 0, out, 10) == lib.COLI_ENOTFOUND
        # The slot's start plus each offset is where the lease's arrays are.
        with store.lease(0, 2) as ex:
            parts = ex.parts
            start = parts["gate_up"].ctypes.data - offsets[0]
            names = [n for n in ex.tensors.part_names()]
            for name, offset in zip(names, offsets):
                if name is not None:
                    assert parts[name].ctypes.data == start + offset, name
            del parts
