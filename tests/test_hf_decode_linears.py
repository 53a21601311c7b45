"""colibri.hf's decode linears: with kernels="native" (and decode_linears,
the default) every float32 or bfloat16 nn.Linear the model keeps is a
DecodeLinear over the same parameter objects, whose forward of at most
DECODE_ROWS rows without autograd is colibri.kernels.linear on the weight's
own memory, and whose other forwards are nn.Linear's.

Both compute the same products accumulated in float32 and rounded once to
the output dtype, in different orders: float32 logits agree to 1e-5 of the
largest, bfloat16 ones to its rounding (2^-8), and greedy tokens are equal.

Needs torch and transformers; skipped without them."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import colibri.hf as hf  # noqa: E402
from colibri.hf.linears import DECODE_ROWS, decode_linear_class, use_decode_linears  # noqa: E402
from colibri.tiny_moe import write_tiny_moe  # noqa: E402
from conftest import assert_same_greedy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -8}


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_moe(str(tmp_path_factory.mktemp("decode-linears")), "qwen3_moe", dtype="bfloat16",
                          hidden_size=64, seed=5)


def _linears(model: Any) -> dict[str, Any]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_every_float_linear_is_swapped_over_the_same_parameters(path: str) -> None:
    cls = decode_linear_class()
    native = hf.from_pretrained(path, torch_dtype=torch.bfloat16)
    off = hf.from_pretrained(path, torch_dtype=torch.bfloat16, decode_linears=False)
    plain = hf.from_pretrained(path, torch_dtype=torch.bfloat16, kernels="torch")
    try:
        swapped = _linears(native)
        assert swapped and all(type(m) is cls for m in swapped.values())
        assert "lm_head" in swapped and any(".self_attn.q_proj" in n for n in swapped)
        assert native.colibri.decode_linears == len(swapped)
        for model in (off, plain):
            assert model.colibri.decode_linears == 0
            assert all(type(m) is torch.nn.Linear for m in _linears(model).values())
            assert set(_linears(model)) == set(swapped)
        assert native.state_dict().keys() == off.state_dict().keys()
        for name, module in _linears(native).items():
            assert module.weight.shape == (module.out_features, module.in_features)
            assert torch.equal(module.weight, off.get_submodule(name).weight)
    finally:
        for m in (native, off, plain):
            m.colibri_close()


def test_swapping_keeps_the_parameter_objects_and_ties() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(50, 24), torch.nn.Linear(24, 50, bias=False),
                                torch.nn.Linear(50, 7), torch.nn.Linear(7, 3).to(torch.float16))
    model[1].weight = model[0].weight        # tied, as an LM head to its embedding
    params = [model[1].weight, model[2].weight, model[2].bias]
    assert use_decode_linears(model) == 2    # the float16 layer stays nn.Linear's
    assert type(model[3]) is torch.nn.Linear
    assert model[1].weight is model[0].weight is params[0]
    assert model[2].weight is params[1] and model[2].bias is params[2]
    assert len(list(model.parameters())) == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_match_the_torch_layers(path: str, dtype: Any) -> None:
    native = hf.from_pretrained(path, torch_dtype=dtype)
    off = hf.from_pretrained(path, torch_dtype=dtype, decode_linears=False)
    try:
        assert_same_greedy(native, off, BOUNDS[dtype])
    finally:
        native.colibri_close()
        off.colibri_close()


def _layer(dtype: Any, bias: bool = True) -> tuple[Any, Any]:
    torch.manual_seed(3)
    ref = torch.nn.Linear(40, 33, bias=bias).to(dtype)
    return ref, decode_linear_class()(ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 40), (40,), (2, 1, 40), (DECODE_ROWS, 40), (DECODE_ROWS + 1, 40),
                                   (3, 5, 40), (0, 40)])
def test_a_layer_computes_what_nn_linear_computes(dtype: Any, shape: tuple[int, ...]) -> None:
    ref, layer = _layer(dtype)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.no_grad():
        got, want = layer(x), ref(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.numel():
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        assert err <= BOUNDS[dtype]
    if x.numel() // 40 > DECODE_ROWS:
        assert torch.equal(got, want)        # torch's own matmul


def test_autograd_and_other_dtypes_take_torch() -> None:
    ref, layer = _layer(torch.float32)
    x = torch.randn(1, 40, requires_grad=True)
    layer(x).sum().backward()
    ref(x).sum().backward()                  # the same parameters: their grads doubled
    assert layer.weight.grad is not None and x.grad is not None
    assert torch.allclose(layer.weight.grad, 2 * x.detach().expand(33, 40))
    with pytest.raises(RuntimeError):
        layer(torch.randn(1, 40, dtype=torch.bfloat16))   # nn.Linear's dtype mismatch, as before


def test_a_changed_weight_is_seen_by_the_next_forward() -> None:
    ref, layer = _layer(torch.bfloat16)
    x = torch.randn(1, 40).to(torch.bfloat16)
    with torch.no_grad():
        product = (layer(x) - ref.bias).float()
        layer.weight.mul_(2)                 # in place: a new version of the same memory
        layer.bias.zero_()
        assert torch.allclose(layer(x).float(), 2 * product, rtol=2 ** -6, atol=2e-2)
        layer.weight = torch.nn.Parameter(torch.zeros(33, 40, dtype=torch.bfloat16))   # replaced
        assert not layer(x).any()
        layer.load_state_dict({"weight": torch.ones(33, 40), "bias": torch.ones(33)})
        assert torch.allclose(layer(x).float(), x.float().sum() + 1, rtol=2 ** -7, atol=1e-1)
