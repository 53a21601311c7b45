"""colibri.hf's decode norms: with kernels="native" (and decode_norms, the
default) every RMS norm whose forward is one of transformers' two usual
formulas computes forwards of at most DECODE_NORM_VALUES values without
autograd in one native call (coli_rms_norm), and the rest with its own
forward.

The native call rounds where the formula rounds; only the sum of squares
runs in another order (double here, float32 in torch). So each value is
within one rounding of the output dtype of torch's (2^-8 relative for
bfloat16, 2^-22 for float32), and greedy tokens are equal.

Needs torch and transformers; skipped without them."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import example, given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import colibri.hf as hf  # noqa: E402
from colibri.hf import norms  # noqa: E402
from colibri.hf.norms import DECODE_NORM_VALUES, norm_form, rms_norm, use_decode_norms  # noqa: E402
from colibri.tiny_moe import write_tiny_moe  # noqa: E402
from conftest import assert_relative_within, assert_same_greedy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROUNDING = {torch.float32: 2.0 ** -22, torch.bfloat16: 2.0 ** -8}
DTYPES = [torch.float32, torch.bfloat16]


def _classes() -> dict[str, type]:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    return {"llama": LlamaRMSNorm, "qwen3_moe": Qwen3MoeRMSNorm, "gpt_oss": GptOssRMSNorm,
            "olmo2": Olmo2RMSNorm, "gemma": GemmaRMSNorm}


def test_the_two_formulas_are_recognised_and_others_are_not() -> None:
    classes = _classes()
    assert norm_form(classes["llama"]) == norm_form(classes["qwen3_moe"]) == "after_cast"
    assert norm_form(classes["gpt_oss"]) == norm_form(classes["olmo2"]) == "before_cast"
    assert norm_form(classes["gemma"]) is None          # (1 + weight), in float32

    class Shifted(torch.nn.Module):
        def forward(self, hidden_states: Any) -> Any:
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return (1.0 + self.weight) * hidden_states.to(input_dtype)

    assert norm_form(Shifted) is None
    assert norm_form(torch.nn.Linear) is None


def _close(got: Any, want: Any) -> None:
    assert_relative_within(got, want, 2 * ROUNDING[want.dtype])


@settings(max_examples=60, deadline=None)
@given(cls=st.sampled_from(["llama", "gpt_oss"]), x_dtype=st.sampled_from(DTYPES),
       w_dtype=st.sampled_from(DTYPES), rows=st.integers(1, 9), n=st.integers(1, 300),
       scale=st.sampled_from([1e-3, 1.0, 40.0]), seed=st.integers(0, 2 ** 16))
# three normalised values 1 float32 step from a bfloat16 tie, rounded the other way
@example(cls="llama", x_dtype=torch.bfloat16, w_dtype=torch.float32, rows=4, n=284, scale=1.0, seed=49705)
def test_the_native_norm_is_the_formula(cls: str, x_dtype: Any, w_dtype: Any, rows: int, n: int,
                                        scale: float, seed: int) -> None:
    module = _classes()[cls](n).to(w_dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.copy_(torch.randn(n, generator=g))
        x = (torch.randn(rows, n, generator=g) * scale).to(x_dtype)
        got, want = rms_norm(x, module.weight, module.variance_epsilon, norm_form(type(module)) or ""), module(x)
    tie = _at_a_bfloat16_tie(x, module.variance_epsilon) if norm_form(type(module)) == "after_cast" \
        and x_dtype == torch.bfloat16 and want.dtype == torch.float32 else torch.zeros_like(want, dtype=torch.bool)
    _close(got[~tie], want[~tie])
    if tie.any():   # there the two sums' orders may round the normalised value to either neighbour: one step
        assert_relative_within(got[tie], want[tie], 2 * ROUNDING[torch.bfloat16])


def _at_a_bfloat16_tie(x: Any, eps: float) -> Any:
    """Where "after_cast" rounds a bfloat16 row's normalised value (a float32)
    to bfloat16 before the weight's product, the values within a few float32
    roundings of halfway between two bfloat16 numbers: an order of the
    sum of squares other than torch's may round them the other way."""
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    near = 4 * ROUNDING[torch.float32]
    return (exact * (1 - near)).float().to(torch.bfloat16) != (exact * (1 + near)).float().to(torch.bfloat16)


@pytest.mark.parametrize("cls", ["llama", "gpt_oss"])
@pytest.mark.parametrize("w_dtype", DTYPES)
def test_bfloat16_rows_round_where_the_formula_rounds(cls: str, w_dtype: Any) -> None:
    """Rounding once too few or too many times shows on a share of the
    values; the sum's order alone moves almost none of them."""
    module = _classes()[cls](4096).to(w_dtype)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        module.weight.copy_(torch.randn(4096, generator=g) * 3)
        x = (torch.randn(4, 4096, generator=g) * 5).to(torch.bfloat16)
        got, want = rms_norm(x, module.weight, module.variance_epsilon, norm_form(type(module)) or ""), module(x)
    assert got.dtype == want.dtype
    assert float((got == want).float().mean()) >= 0.99


def test_bad_operands_are_refused() -> None:
    w = torch.ones(8)
    with pytest.raises(ValueError, match="form"):
        rms_norm(torch.ones(2, 8), w, 1e-6, "gemma")
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        rms_norm(torch.ones(2, 8, dtype=torch.float16), w, 1e-6)
    with pytest.raises(ValueError, match="rows of 8"):
        rms_norm(torch.ones(2, 7), w, 1e-6)
    with pytest.raises(ValueError, match="rows of 8"):
        rms_norm(torch.ones(8, 2).t(), w, 1e-6)
    with pytest.raises(ValueError, match="CPU tensors"):
        rms_norm(torch.ones(2, 8, device="meta"), w, 1e-6)


def _norm(cls: str = "llama", n: int = 32, dtype: Any = torch.bfloat16) -> Any:
    module = _classes()[cls](n).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.linspace(-2, 2, n))
    holder = torch.nn.Sequential(module)
    assert use_decode_norms(holder) == 1
    return module


def test_small_forwards_go_native_and_large_or_autograd_ones_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _norm()
    calls = []
    native = norms._compute
    monkeypatch.setattr(norms, "_compute", lambda *a: calls.append(a[0].shape) or native(*a))
    small = torch.randn(1, 1, 32).to(torch.bfloat16)
    large = torch.randn(DECODE_NORM_VALUES // 32 + 1, 32).to(torch.bfloat16)
    with torch.no_grad():
        module(small)
        module(large)
    assert calls == [small.shape]
    x = torch.randn(2, 32, requires_grad=True)
    module.float()(x).sum().backward()       # autograd: torch's forward, gradients flow
    assert x.grad is not None and module.weight.grad is not None
    assert calls == [small.shape]
    with torch.no_grad():
        module(torch.randn(32, 2).t())       # not contiguous: torch's
    assert len(calls) == 1


def test_a_decode_step_computes_what_the_modules_compute(path: str) -> None:
    native = hf.from_pretrained(path, torch_dtype=torch.bfloat16)
    off = hf.from_pretrained(path, torch_dtype=torch.bfloat16, decode_norms=False)
    plain = hf.from_pretrained(path, torch_dtype=torch.bfloat16, kernels="torch")
    try:
        layers = native.config.num_hidden_layers
        assert native.colibri.decode_norms == 4 * layers + 1     # 2 + q/k per layer, the final norm
        assert off.colibri.decode_norms == plain.colibri.decode_norms == 0
        assert_same_greedy(native, off, 2.0 ** -7)
    finally:
        for m in (native, off, plain):
            m.colibri_close()


def test_a_deep_copy_computes_with_its_own_weight() -> None:
    module = _norm()
    twin = copy.deepcopy(torch.nn.Sequential(module))[0]
    x = torch.randn(1, 32).to(torch.bfloat16)
    with torch.no_grad():
        before = module(x)
        twin.weight.mul_(-1)
        assert torch.equal(module(x), before)
        assert torch.equal(twin(x), -before)
        assert use_decode_norms(torch.nn.Sequential(module)) == 0      # already set: left alone


def test_a_norm_keeps_its_class_parameters_and_state() -> None:
    module = _norm("gpt_oss", 16, torch.float32)
    assert type(module).__name__ == "GptOssRMSNorm"
    assert list(module.state_dict()) == ["weight"]
    with torch.no_grad():
        module.weight.mul_(3)                # in place: the native path sees it
        x = torch.randn(2, 16)
        want = type(module).forward(module, x)
        _close(module(x), want)


def test_the_core_refuses_what_the_formula_does_not_give() -> None:
    """coli_rms_norm's own checks: an out format other than the formula's,
    an unknown order, no rows' width."""
    lib, ffi = norms.lib, norms.ffi
    x, out, w = (torch.ones(4) for _ in range(3))
    err = ffi.new("char[]", 256)
    f32, bf16 = lib.COLI_TENSOR_F32, lib.COLI_TENSOR_BF16

    def call(out_format: int, order: int = 0, n: int = 4) -> tuple[int, str]:
        rc = lib.coli_rms_norm(ffi.cast("void *", x.data_ptr()), ffi.cast("void *", out.data_ptr()),
                               ffi.cast("void *", w.data_ptr()), 1, n, f32, f32, out_format, 1e-6, order,
                               err, 256)
        return rc, ffi.string(err).decode()

    assert call(f32) == (0, "")
    assert torch.allclose(out, torch.ones(4))
    for args, message in (((bf16,), "out must have format"), ((f32, 2), "unknown weight order"),
                          ((f32, 0, 0), "0 values")):
        rc, text = call(*args)
        assert rc == lib.COLI_EINVAL and message in text


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_moe(str(tmp_path_factory.mktemp("decode-norms")), "qwen3_moe", dtype="bfloat16",
                          hidden_size=64, seed=5)
