"""colibri.hf's decode routers: with kernels="native" (and decode_routers,
the default) every router whose forward is one of transformers' softmax
top-k forms routes forwards of at most DECODE_ROWS rows without autograd
natively (the logits by colibri's linear kernel, the routing by
coli_router_topk), and the rest with its own forward.

The routing of given logits takes the same experts in the same order as
torch (equal probabilities: the lower expert first), with scores within a
rounding of torch's; the logits differ from torch's matmul only by the
order of the sum, so greedy tokens are equal.

Needs torch and transformers; skipped without them."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import colibri.hf as hf  # noqa: E402
from colibri.errors import ColibriError  # noqa: E402
from colibri.hf import routers  # noqa: E402
from colibri.hf.linears import DECODE_ROWS  # noqa: E402
from colibri.hf.routers import router_form, router_topk, use_decode_routers  # noqa: E402
from colibri.tiny_moe import write_tiny_moe  # noqa: E402
from conftest import assert_relative_within, assert_same_greedy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DTYPES = [torch.float32, torch.bfloat16]
ROUNDING = {torch.float32: 2.0 ** -20, torch.bfloat16: 2.0 ** -8}


def _classes() -> dict[str, type]:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextTopKRouter

    return {"qwen3_moe": Qwen3MoeTopKRouter, "olmoe": OlmoeTopKRouter, "mixtral": MixtralTopKRouter,
            "qwen3_vl_moe": Qwen3VLMoeTextTopKRouter, "gpt_oss": GptOssTopKRouter,
            "deepseek_v3": DeepseekV3TopkRouter}


def test_the_softmax_top_k_forms_are_recognised_and_others_are_not() -> None:
    classes = _classes()
    assert router_form(classes["qwen3_moe"]) == router_form(classes["olmoe"]) == "softmax_topk"
    assert router_form(classes["qwen3_vl_moe"]) == "softmax_topk_renorm"
    assert router_form(classes["mixtral"]) == "softmax_float_topk_renorm"
    assert router_form(classes["gpt_oss"]) is None        # top-k of the logits, then softmax
    assert router_form(classes["deepseek_v3"]) is None    # sigmoid, expert groups

    class Sharper(torch.nn.Module):
        def forward(self, hidden_states: Any) -> Any:
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
            router_logits = torch.nn.functional.linear(hidden_states, self.weight)
            router_probs = torch.nn.functional.softmax(2 * router_logits, dtype=torch.float, dim=-1)
            router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
            router_top_value = router_top_value.to(router_logits.dtype)
            router_scores = router_top_value
            return (router_logits, router_scores, router_indices)

    assert router_form(Sharper) is None
    assert router_form(torch.nn.Linear) is None


def _reference(logits: Any, k: int, renorm: bool, scores_dtype: Any) -> tuple[Any, Any]:
    probs = torch.softmax(logits.float(), dim=-1)
    values, index = torch.topk(probs, k, dim=-1)
    if renorm:
        values = values / values.sum(dim=-1, keepdim=True)
    return values.to(scores_dtype), index


def _close(got: Any, want: Any) -> None:
    assert_relative_within(got, want, 2 * ROUNDING[want.dtype])


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from(DTYPES), scores_dtype=st.sampled_from(DTYPES), rows=st.integers(1, 5),
       n=st.integers(1, 256), k=st.integers(1, 16), renorm=st.booleans(),
       spread=st.sampled_from([2.0 ** -4, 2.0 ** -2, 1.0]), seed=st.integers(0, 2 ** 16))
def test_the_routing_is_torchs_softmax_top_k(dtype: Any, scores_dtype: Any, rows: int, n: int, k: int,
                                             renorm: bool, spread: float, seed: int) -> None:
    k = min(k, n)
    g = torch.Generator().manual_seed(seed)
    # distinct logits, exact in bfloat16, so that the order is torch's alone
    logits = torch.stack([(torch.randperm(n, generator=g) - n // 2).float() * spread for _ in range(rows)])
    logits = logits.to(dtype)
    scores, index = router_topk(logits, k, renorm, scores_dtype)
    want_scores, want_index = _reference(logits, k, renorm, scores_dtype)
    assert torch.equal(index, want_index)
    _close(scores, want_scores)


def test_equal_probabilities_take_the_lower_expert_first() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0, 1.0]])
    scores, index = router_topk(logits, 4, False)
    assert index.tolist() == [[1, 3, 5, 0]]
    assert torch.equal(scores[0, :3], scores[0, :3].new_full((3,), float(scores[0, 0])))
    scores, index = router_topk(torch.zeros(2, 5, dtype=torch.bfloat16), 3, True)
    assert index.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert scores.dtype == torch.bfloat16
    _close(scores, torch.full((2, 3), 1 / 3).to(torch.bfloat16))


def test_bad_operands_are_refused() -> None:
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        router_topk(torch.zeros(1, 4, dtype=torch.float16), 2, True)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        router_topk(torch.zeros(1, 4), 2, True, torch.int64)
    with pytest.raises(ValueError, match="contiguous CPU rows"):
        router_topk(torch.zeros(4, 2).t(), 1, True)
    with pytest.raises(ValueError, match="contiguous CPU rows"):
        router_topk(torch.zeros(1, 4, device="meta"), 1, True)
    for k in (0, 5):
        with pytest.raises(ColibriError, match="k "):
            router_topk(torch.zeros(1, 4), k, True)


def _router(name: str = "qwen3_moe", hidden: int = 32, experts: int = 16, top_k: int = 4,
            dtype: Any = torch.bfloat16, norm: bool = True) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.for_model(name, hidden_size=hidden, num_experts=experts, num_local_experts=experts,
                                  num_experts_per_tok=top_k, norm_topk_prob=norm)
    module = _classes()[name](config).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(experts, hidden, generator=torch.Generator().manual_seed(3)))
    assert use_decode_routers(torch.nn.Sequential(module)) == 1
    return module


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
def test_a_router_routes_as_its_class_does(name: str, dtype: Any, norm: bool) -> None:
    module = _router(name, dtype=dtype, norm=norm)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.no_grad():
        logits, scores, index = module(x)
        want_logits, want_scores, want_index = type(module).forward(module, x)
    assert logits.dtype == want_logits.dtype and scores.dtype == want_scores.dtype
    assert float((logits.float() - want_logits.float()).abs().max()) <= \
        2 * ROUNDING[dtype] * float(want_logits.float().abs().max())
    # the same logits route the same way; a near tie may follow the logits' last bit
    ref_scores, ref_index = _reference(logits, module.top_k, norm or name == "mixtral", want_scores.dtype)
    assert torch.equal(index, ref_index)
    _close(scores, ref_scores)


def test_small_forwards_go_native_and_large_or_autograd_ones_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _router()
    calls = []
    native = routers._compute
    monkeypatch.setattr(routers, "_compute", lambda *a: calls.append(a[0].shape) or native(*a))
    with torch.no_grad():
        module(torch.randn(1, 1, 32).to(torch.bfloat16))
        module(torch.randn(DECODE_ROWS + 1, 32).to(torch.bfloat16))
    assert calls == [(1, 16)]
    module.float()
    x = torch.randn(2, 32, requires_grad=True)
    _, scores, _ = module(x)                             # autograd: torch's forward, gradients flow
    scores.sum().backward()
    assert x.grad is not None and module.weight.grad is not None
    assert len(calls) == 1


def test_a_deep_copy_routes_with_its_own_weight() -> None:
    module = _router(dtype=torch.float32)
    twin = copy.deepcopy(torch.nn.Sequential(module))[0]
    x = torch.randn(1, 32)
    with torch.no_grad():
        logits, _, _ = module(x)
        twin.weight.copy_(-twin.weight)                   # a new weight for the twin only
        assert torch.equal(module(x)[0], logits)
        assert torch.allclose(twin(x)[0], -logits)
        module.weight.mul_(2)                             # in place: the native path sees it
        assert torch.allclose(module(x)[0], 2 * logits)
    assert use_decode_routers(torch.nn.Sequential(module)) == 0      # already set: left alone
    assert list(module.state_dict()) == ["weight"] and type(module).__name__ == "Qwen3MoeTopKRouter"


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_model_decodes_as_with_its_own_routers(tmp_path_factory: pytest.TempPathFactory, family: str) -> None:
    path = write_tiny_moe(str(tmp_path_factory.mktemp(f"decode-routers-{family}")), family, dtype="bfloat16",
                          hidden_size=64, seed=6)
    native = hf.from_pretrained(path, torch_dtype=torch.bfloat16)
    off = hf.from_pretrained(path, torch_dtype=torch.bfloat16, decode_routers=False)
    try:
        assert native.colibri.decode_routers == native.config.num_hidden_layers
        assert off.colibri.decode_routers == 0
        assert_same_greedy(native, off, 2.0 ** -7)
    finally:
        for m in (native, off):
            m.colibri_close()
