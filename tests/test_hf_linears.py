"""colibri.hf's packed linear layers: with kernels="native" every nn.Linear
the checkpoint stores as pack-quantized int4 or block-scaled FP8 (attention,
dense MLPs, shared experts) is a PackedLinear computed from those bytes, and
no float copy of its weight is left; kernels="torch" keeps the loader's
float layers.

The loader's float layers are the weights rounded to the checkpoint's
bfloat16 (compressed-tensors and transformers' FP8 dequantize in it), the
packed ones are exact; so the reference is the kernels="torch" model with
each packed layer's weight set to its exact decoding
(PackedWeight.to_float). float32 activations: logits within 1e-4 of the
largest, the same greedy tokens. bfloat16 activations: no further from the
float32 reference than the kernels="torch" model in bfloat16 is.

Needs torch, transformers and compressed-tensors; skipped without them."""

from __future__ import annotations

from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import colibri.hf as hf  # noqa: E402
from colibri.checkpoint.safetensors import read_model_tensors  # noqa: E402
from colibri.hf.linears import packed_linear_class  # noqa: E402
from colibri.linear import packed_scheme, read_packed  # noqa: E402
from colibri.tiny_moe import write_tiny_moe  # noqa: E402

F32_BOUND = 1e-4

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHECKPOINTS: dict[str, Callable[[str], str]] = {
    "int4": lambda d: write_tiny_moe(d, "qwen3_moe", dtype="bfloat16", hidden_size=64, seed=3,
                                     int4_group=16, int4_scope="all"),
    "int4_zero_points": lambda d: write_tiny_moe(d, "mixtral", dtype="bfloat16", hidden_size=64, seed=4,
                                                 int4_group=32, int4_symmetric=False, int4_scope="all"),
    "fp8_block": lambda d: write_tiny_moe(d, "deepseek_v3", dtype="bfloat16", hidden_size=32, seed=2,
                                          fp8_block=16),
}
NEEDS = {"int4": "compressed_tensors", "int4_zero_points": "compressed_tensors"}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Each checkpoint, written once for the tests that take it."""
    name = request.param
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    return CHECKPOINTS[name](str(tmp_path_factory.mktemp(name)))


def _packed_names(path: str) -> set[str]:
    """The layers the checkpoint stores packed, outside the routed experts."""
    _, tensors = read_model_tensors(path)
    bases = {name.rsplit(".", 1)[0] for name in tensors if ".experts." not in name}
    return {b for b in bases if packed_scheme(tensors, b) is not None}


def _exact(model: Any, path: str) -> Any:
    """A kernels="torch" model's packed layers given their exact weights."""
    _, tensors = read_model_tensors(path)
    with torch.no_grad():
        for name in _packed_names(path):
            layer = model.get_submodule(name)
            layer.weight.copy_(torch.from_numpy(read_packed(tensors, name).to_float()))
    return model


def _ids(vocab: int) -> Any:
    return torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(7))


def test_the_packed_layers_replace_the_float_ones(path: str) -> None:
    wanted = _packed_names(path)
    assert wanted, "the checkpoint stores no non-expert layer packed"
    cls = packed_linear_class()
    native = hf.from_pretrained(path, torch_dtype=torch.float32)
    plain = hf.from_pretrained(path, torch_dtype=torch.float32, kernels="torch")
    kept = hf.from_pretrained(path, torch_dtype=torch.float32, pack_linears=False)
    try:
        assert kept.colibri.packed_linears == 0 and kept.colibri.kernels == "native"
        assert not [n for n, m in kept.named_modules() if isinstance(m, cls)]
        packed = {n for n, m in native.named_modules() if isinstance(m, cls)}
        assert packed == wanted and native.colibri.packed_linears == len(wanted)
        for n in wanted:
            assert not list(native.get_submodule(n).parameters())
            assert type(plain.get_submodule(n)) is torch.nn.Linear
        assert plain.colibri.packed_linears == 0
        names = {n for n, _ in native.named_parameters()}
        assert not any(n.startswith(tuple(f"{w}." for w in wanted)) for n in names)
        floats = sum(plain.get_submodule(n).weight.nbytes for n in wanted)
        size = lambda m: sum(p.nbytes for p in m.parameters())  # noqa: E731
        assert size(native) == size(plain) - floats
    finally:
        for m in (native, plain, kept):
            m.colibri_close()


def test_float32_logits_and_greedy_tokens_equal_the_exact_reference(path: str) -> None:
    native = hf.from_pretrained(path, torch_dtype=torch.float32)
    plain = _exact(hf.from_pretrained(path, torch_dtype=torch.float32, kernels="torch"), path)
    try:
        ids = _ids(native.config.vocab_size)
        with torch.no_grad():
            got, want = native(ids).logits, plain(ids).logits
        assert float((got - want).abs().max() / want.abs().max()) <= F32_BOUND
        options = dict(max_new_tokens=6, do_sample=False, pad_token_id=1)
        assert torch.equal(native.generate(ids, **options), plain.generate(ids, **options))
    finally:
        native.colibri_close()
        plain.colibri_close()


def _logits_and_routes(model: Any, ids: Any) -> tuple[Any, Any]:
    """The logits, and each layer's chosen experts per token (sorted), or
    None when the model reports no router logits."""
    out = model(ids, output_router_logits=True)
    logits = getattr(out, "router_logits", None)
    if not logits:
        return out.logits.float(), None
    k = model.config.num_experts_per_tok
    return out.logits.float(), torch.stack([r.float().topk(k, dim=-1).indices.sort(dim=-1).values
                                            .reshape(*ids.shape, k) for r in logits])


def test_bfloat16_no_further_than_the_torch_path(path: str) -> None:
    """Both bfloat16 models against the exact float32 one, on the tokens
    before any layer routes one of a sequence's tokens to other experts in
    either model: the tiny models' router logits have near ties (margins of
    1e-3), which bfloat16 noise from any path decides either way, and a
    token routed elsewhere, and every later token of its sequence, then
    differs by far more than the kernels' error. The two paths round at
    different places, and over a few layers either one's error comes out
    up to a quarter larger than the other's depending on the prompt, so
    the native path may be at most 1.5 times as far as the torch one (a
    wrong scale or a lost bit of the inputs is far more)."""
    exact = _exact(hf.from_pretrained(path, torch_dtype=torch.float32, kernels="torch"), path)
    native = hf.from_pretrained(path, torch_dtype=torch.bfloat16)
    plain = hf.from_pretrained(path, torch_dtype=torch.bfloat16, kernels="torch")
    try:
        ids = _ids(native.config.vocab_size)
        with torch.no_grad():
            want, routes = _logits_and_routes(exact, ids)
            got = [_logits_and_routes(m, ids) for m in (native, plain)]
        kept = torch.ones(ids.shape, dtype=torch.bool)
        if routes is not None:
            for _, r in got:
                kept &= torch.cumprod((r == routes).all(-1).all(0).int(), dim=-1).bool()
        assert int(kept.sum()) >= ids.numel() // 4, kept
        errors = [float((g[kept] - want[kept]).abs().max() / want[kept].abs().max()) for g, _ in got]
        assert errors[0] <= 1.5 * max(errors[1], 2.0 ** -8), errors
    finally:
        for m in (exact, native, plain):
            m.colibri_close()
