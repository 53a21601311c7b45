"""colibri against real `transformers` MoE models (tiny, random weights).

Each case builds a tiny model with transformers, writes it with
``save_pretrained`` (Mixtral sharded through ``max_shard_size``, Qwen2-MoE in
bf16), opens the directory with ``colibri.open_store`` and checks:

* layout detection: the layers with routed experts and their expert counts
  (DeepSeek-V3 and GLM-4.5 have a dense first layer and shared experts;
  Qwen2-MoE has a shared expert), what ``colibri inspect`` prints;
* leased bytes equal the saved tensors, and equal transformers' in-memory
  fused expert parameters (``gate_up_proj[e]`` = gate rows then up rows,
  ``down_proj[e]``);
* ``colibri.moe.experts_forward`` with leased experts equals the model's own
  experts module for the same hidden states, top-k indices and weights;
* ``colibri.moe.route`` equals the model's router (softmax / norm_topk_prob
  for Mixtral, Qwen2/3-MoE, OLMoE; sigmoid + e_score_correction_bias +
  group-limited top-k + routed_scaling_factor for DeepSeek-V3 and GLM-4.5);
* for Mixtral and Qwen3-MoE, the whole sparse MoE block, routing included.

Needs ``torch`` and ``transformers``; skipped without them. A model class the
installed transformers lacks skips its case with the reason.
"""

from __future__ import annotations

import io
import os
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import colibri  # noqa: E402
from colibri import moe  # noqa: E402
from colibri.__main__ import main as cli_main  # noqa: E402
from colibri.tiny_moe import randomize_weights  # noqa: E402

HIDDEN = 32
TOKENS = 24
F32_REL = 1e-5


@dataclass(frozen=True)
class Case:
    config: str
    model: str
    kwargs: dict[str, Any]
    moe_layers: tuple[int, ...]
    n_experts: int
    intermediate: int
    top_k: int
    scoring: str                       # how colibri.moe.route must be called
    dtype: str = "float32"             # what save_pretrained writes
    shard: str | None = None           # max_shard_size, if sharded
    extra: dict[str, Any] = field(default_factory=dict)


_COMMON = dict(vocab_size=64, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64)

CASES: dict[str, Case] = {
    "mixtral": Case(
        "MixtralConfig", "MixtralForCausalLM",
        dict(num_hidden_layers=2, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2),
        moe_layers=(0, 1), n_experts=6, intermediate=48, top_k=2, scoring="softmax",
        shard="20KB"),
    "qwen2_moe": Case(
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
        dict(num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=24, num_experts=8,
             num_experts_per_tok=2, shared_expert_intermediate_size=40, norm_topk_prob=False),
        moe_layers=(0, 1), n_experts=8, intermediate=24, top_k=2, scoring="softmax",
        dtype="bfloat16"),
    "qwen3_moe": Case(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
             num_experts_per_tok=3, norm_topk_prob=True, head_dim=8, mlp_only_layers=[1]),
        moe_layers=(0, 2), n_experts=8, intermediate=16, top_k=3, scoring="softmax"),
    "olmoe": Case(
        "OlmoeConfig", "OlmoeForCausalLM",
        dict(num_hidden_layers=2, intermediate_size=20, num_experts=4, num_experts_per_tok=2,
             norm_topk_prob=False, eos_token_id=1, pad_token_id=0),
        moe_layers=(0, 1), n_experts=4, intermediate=20, top_k=2, scoring="softmax"),
    "deepseek_v3": Case(
        "DeepseekV3Config", "DeepseekV3ForCausalLM",
        dict(num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=16,
             n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
             first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
             norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=8),
        moe_layers=(1, 2), n_experts=8, intermediate=16, top_k=2, scoring="sigmoid"),
    "glm4_moe": Case(
        "Glm4MoeConfig", "Glm4MoeForCausalLM",
        dict(num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=16,
             n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
             first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.8,
             norm_topk_prob=True, head_dim=8),
        moe_layers=(1, 2), n_experts=4, intermediate=16, top_k=2, scoring="sigmoid"),
}


@dataclass
class Built:
    case: Case
    model: Any          # the transformers model, float32, weights as saved
    path: str


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name in cache:
            return cache[name]
        case = CASES[name]
        config_cls = getattr(transformers, case.config, None)
        model_cls = getattr(transformers, case.model, None)
        if config_cls is None or model_cls is None:
            pytest.skip(f"transformers {transformers.__version__} has no {case.model}")
        torch.manual_seed(0)
        config = config_cls(**_COMMON, **case.kwargs)
        model = model_cls(config).eval()
        randomize_weights(model, seed=len(cache) + 1)
        path = str(tmp_path_factory.mktemp(name))
        kwargs: dict[str, Any] = {}
        if case.shard:
            kwargs["max_shard_size"] = case.shard
        if case.dtype == "bfloat16":
            model = model.to(torch.bfloat16)
            model.save_pretrained(path, **kwargs)
            model = model.float()   # exactly the saved values, computed in float32
        else:
            model.save_pretrained(path, **kwargs)
        cache[name] = Built(case, model, path)
        return cache[name]

    return get


def _block(b: Built, layer: int) -> Any:
    return b.model.model.layers[layer].mlp


def _close(got: np.ndarray, want: np.ndarray, rel: float) -> None:
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max())
    assert err <= rel * scale, f"max abs error {err:.3g} > {rel:g} x max |want| {scale:.3g}"


def _routing(case: Case, block: Any) -> dict[str, Any]:
    """colibri.moe.route keywords for this model, read from its config and router."""
    gate = block.gate
    if case.scoring == "softmax":
        # Mixtral's router has no norm_topk_prob: it always renormalises.
        return {"norm_topk_prob": bool(getattr(gate, "norm_topk_prob", True))}
    return {
        "scoring": "sigmoid",
        "bias": gate.e_score_correction_bias.detach().numpy(),
        "n_group": gate.num_group,
        "topk_group": gate.topk_group,
        "norm_topk_prob": bool(gate.norm_topk_prob),
        "routed_scaling_factor": float(gate.routed_scaling_factor),
    }


def _random_routing(rng: np.random.Generator, n_experts: int, top_k: int):
    idx = np.argsort(rng.random((TOKENS, n_experts)), axis=1)[:, :top_k]
    w = rng.random((TOKENS, top_k)).astype(np.float32) + 0.1
    return idx, w


@pytest.mark.parametrize("name", list(CASES))
def test_layout_detection_and_inspect(built, name: str) -> None:
    b = built(name)
    case = b.case
    files = sorted(f for f in os.listdir(b.path) if f.endswith(".safetensors"))
    if case.shard:
        assert len(files) > 1 and os.path.exists(os.path.join(b.path, "model.safetensors.index.json"))
    with colibri.open_store(b.path, slots_per_layer=2, prefetch_workers=0) as store:
        expected_layout = "mixtral" if name == "mixtral" else "mlp_experts"
        assert store.model.layout == expected_layout
        assert store.layers == case.moe_layers
        for layer in store.layers:
            assert store.num_experts(layer) == case.n_experts
            for e in range(case.n_experts):
                ex = store.model.expert(layer, e)
                for info in ex.tensors():
                    assert f".experts.{e}." in info.name and "shared" not in info.name
                assert ex.gate.shape == (case.intermediate, HIDDEN)
                assert ex.down.shape == (HIDDEN, case.intermediate)
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(["inspect", b.path, "--slots", "2"]) == 0
    text = out.getvalue()
    itemsize = 2 if case.dtype == "bfloat16" else 4
    per_expert = 3 * case.intermediate * HIDDEN * itemsize
    assert f"layout: {expected_layout}" in text
    rows = [line.split() for line in text.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(case.moe_layers)
    assert all(int(r[1]) == case.n_experts for r in rows)
    assert all(int(r[2].replace(",", "")) == per_expert for r in rows)
    total = per_expert * case.n_experts * len(case.moe_layers)
    assert f"routed-expert bytes: {total:,}" in text


def _same_bytes(got: np.ndarray, want: np.ndarray) -> None:
    # A helper, so no leased array outlives its lease in a local variable.
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("name", list(CASES))
def test_leased_bytes_match_the_files_and_the_model(built, name: str) -> None:
    from safetensors.numpy import load_file

    b = built(name)
    case = b.case
    saved: dict[str, np.ndarray] = {}
    for f in os.listdir(b.path):
        if f.endswith(".safetensors"):
            saved.update(load_file(os.path.join(b.path, f)))
    inter = case.intermediate
    with colibri.open_store(b.path, slots_per_layer=3, prefetch_workers=1) as store:
        for layer in store.layers:
            experts = _block(b, layer).experts
            for e in range(case.n_experts):
                tensors = store.model.expert(layer, e)
                with store.lease(layer, e) as ex:
                    for role in ("gate", "up", "down"):
                        _same_bytes(getattr(ex, role), saved[tensors.weight(role).name])
                    # transformers' fused in-memory parameters: (E, 2I, H) gate rows
                    # first, then up rows; down (E, H, I).
                    gate_up = experts.gate_up_proj[e].detach().numpy()
                    down = experts.down_proj[e].detach().numpy()
                    assert gate_up.shape == (2 * inter, HIDDEN)
                    np.testing.assert_array_equal(ex.gate.astype(np.float32), gate_up[:inter])
                    np.testing.assert_array_equal(ex.up.astype(np.float32), gate_up[inter:])
                    np.testing.assert_array_equal(ex.down.astype(np.float32), down)


@pytest.mark.parametrize("name", list(CASES))
def test_experts_output_matches_transformers(built, name: str) -> None:
    b = built(name)
    case = b.case
    rng = np.random.default_rng(11)
    with colibri.open_store(b.path, slots_per_layer=case.n_experts, prefetch_workers=0) as store:
        for layer in store.layers:
            experts = _block(b, layer).experts
            x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
            idx, w = _random_routing(rng, case.n_experts, case.top_k)
            with torch.no_grad():
                want = experts(torch.from_numpy(x), torch.from_numpy(idx), torch.from_numpy(w)).numpy()
            got = moe.experts_forward(store, layer, x, idx, w)
            assert got.dtype == np.float32 and got.shape == want.shape
            _close(got, want, F32_REL)
            assert store.active_leases == 0


def test_bf16_experts_match_transformers_in_bf16(built) -> None:
    b = built("qwen2_moe")
    assert b.case.dtype == "bfloat16"
    rng = np.random.default_rng(5)
    layer = b.case.moe_layers[-1]
    experts = _block(b, layer).experts
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    idx, w = _random_routing(rng, b.case.n_experts, b.case.top_k)
    with colibri.open_store(b.path, prefetch_workers=0) as store:
        with store.lease(layer, 0) as ex:
            assert ex.gate.dtype.name == "bfloat16"
        got = moe.experts_forward(store, layer, x, idx, w)
    try:
        experts.to(torch.bfloat16)
        with torch.no_grad():
            want = experts(torch.from_numpy(x).bfloat16(), torch.from_numpy(idx),
                           torch.from_numpy(w).bfloat16()).float().numpy()
    finally:
        experts.float()
    _close(got, want, 3e-2)   # transformers rounds every step to bf16; we compute in f32


@pytest.mark.parametrize("name", list(CASES))
def test_routing_matches_transformers(built, name: str) -> None:
    b = built(name)
    case = b.case
    rng = np.random.default_rng(3)
    for layer in case.moe_layers:
        block = _block(b, layer)
        x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
        with torch.no_grad():
            _, t_weights, t_idx = block.gate(torch.from_numpy(x))
        t_idx, t_weights = t_idx.numpy(), t_weights.float().numpy()
        router = block.gate.weight.detach().float().numpy()
        idx, weights = moe.route(router, x, case.top_k, **_routing(case, block))
        # DeepSeek/GLM take top-k unsorted: compare per token, ordered by expert.
        order_t, order_c = np.argsort(t_idx, axis=1), np.argsort(idx, axis=1)
        np.testing.assert_array_equal(np.take_along_axis(idx, order_c, 1),
                                      np.take_along_axis(t_idx, order_t, 1))
        _close(np.take_along_axis(weights, order_c, 1), np.take_along_axis(t_weights, order_t, 1),
               F32_REL)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_whole_moe_block_matches_transformers(built, name: str) -> None:
    b = built(name)
    case = b.case
    rng = np.random.default_rng(19)
    with colibri.open_store(b.path, slots_per_layer=case.n_experts, prefetch_workers=2) as store:
        for layer in store.layers:
            block = _block(b, layer)
            x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
            with torch.no_grad():
                want = block(torch.from_numpy(x)[None])
            want = (want[0] if isinstance(want, tuple) else want)[0].numpy()
            router = block.gate.weight.detach().numpy()
            got = moe.moe_layer(store, layer, router, x, case.top_k, **_routing(case, block))
            _close(got, want, F32_REL)
