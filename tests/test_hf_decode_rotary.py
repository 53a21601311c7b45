"""colibri.hf's decode rotary embedding: with kernels="native" (and
decode_rotary, the default) the modeling module's apply_rotary_pos_emb,
when it is transformers' usual one, computes one-token CPU calls with
coli_rotary and passes every other call to the function it replaced.

The native call rounds where torch's ops round, so its results are the
same bits: a model's logits are equal with and without it.

Needs torch and transformers; skipped without them."""

from __future__ import annotations

import types
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import colibri.hf as hf  # noqa: E402
from colibri.hf import rotary  # noqa: E402
from colibri.hf.rotary import rotary_form, use_decode_rotary  # noqa: E402
from colibri.tiny_moe import write_tiny_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DTYPES = [torch.float32, torch.bfloat16]


def _modeling(name: str) -> Any:
    import importlib

    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _original(module: Any) -> Any:
    f = module.apply_rotary_pos_emb
    return getattr(f, "__colibri_replaces__", f)


def _module_from(tmp_path: Any, name: str, source: str) -> Any:
    import importlib.util

    file = tmp_path / f"{name}.py"
    file.write_text("import torch\n" + source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_usual_rotary_function_is_recognised_and_others_are_not(tmp_path: Any) -> None:
    for name in ("llama", "qwen3_moe", "mixtral", "olmoe"):
        assert rotary_form(_modeling(name)), name
    assert not rotary_form(_modeling("gpt_oss"))            # its own rotation
    assert rotary_form(_module_from(tmp_path, "usual", rotary.FORM + rotary.ROTATE_HALF))
    turned = rotary.ROTATE_HALF.replace("(-x2, x1)", "(x2, -x1)")
    assert not rotary_form(_module_from(tmp_path, "turned", rotary.FORM + turned))
    assert not rotary_form(_module_from(tmp_path, "scaled", rotary.FORM.replace("q * cos", "q * cos * 2")
                                        + rotary.ROTATE_HALF))
    assert not rotary_form(types.ModuleType("empty"))


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from(DTYPES), batch=st.integers(1, 3), heads=st.integers(1, 16),
       kv_heads=st.integers(1, 8), half=st.integers(1, 80), seed=st.integers(0, 2 ** 16))
def test_one_token_is_the_same_bits_as_torch(dtype: Any, batch: int, heads: int, kv_heads: int, half: int,
                                             seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    d = 2 * half
    q = (torch.randn(batch, heads, 1, d, generator=g) * 3).to(dtype)
    k = (torch.randn(batch, kv_heads, 1, d, generator=g) * 3).to(dtype)
    angles = torch.rand(batch, 1, d, generator=g) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want_q, want_k = _original(_modeling("llama"))(q, k, cos, sin)
    assert torch.equal(rotary.rotary(q, cos, sin), want_q)
    assert torch.equal(rotary.rotary(k, cos, sin), want_k)


def test_the_replacement_passes_other_calls_to_the_original() -> None:
    calls: list[tuple[int, ...]] = []

    def original(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> Any:
        calls.append(tuple(q.shape))
        return _original(_modeling("llama"))(q, k, cos, sin, unsqueeze_dim)

    native = rotary._native(original)
    assert getattr(native, "__colibri_replaces__") is original
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8)
    cos, sin = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    native(q, k, cos, sin)
    assert calls == []
    prompt = (torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8))
    native(*prompt)                                     # more than one token
    native(q, k, cos, sin, unsqueeze_dim=2)             # another layout
    native(q.to(torch.bfloat16), k.to(torch.bfloat16), cos, sin)   # mixed dtypes: torch's promotion
    q.requires_grad_(True)
    out, _ = native(q, k, cos, sin)                     # autograd
    out.sum().backward()
    assert q.grad is not None
    assert calls == [(1, 4, 3, 8), (1, 4, 1, 8), (1, 4, 1, 8), (1, 4, 1, 8)]


def test_bad_operands_are_refused() -> None:
    x, c = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 8)
    for args in ((torch.randn(1, 2, 1, 7), torch.randn(1, 1, 7), torch.randn(1, 1, 7)),   # odd width
                 (x, c.to(torch.bfloat16), c),                                           # dtypes differ
                 (torch.randn(1, 2, 1, 16)[..., ::2], c, c),                              # not contiguous
                 (x.to(torch.float16), c.to(torch.float16), c.to(torch.float16)),        # float16
                 (torch.randn(1, 2, 2, 8), c, c),                                        # two tokens
                 (x.to("meta"), c, c)):
        with pytest.raises(ValueError, match="rotary"):
            rotary.rotary(*args)
    lib, ffi = rotary.lib, rotary.ffi
    err = ffi.new("char[]", 256)
    buf = torch.zeros(64)
    p = ffi.cast("void *", buf.data_ptr())
    for rows, heads, d, fmt, out, message in ((1, 1, 7, lib.COLI_TENSOR_F32, ffi.cast("void *", buf[32:].data_ptr()),
                                               "even"),
                                              (1, 1, 8, lib.COLI_TENSOR_F16, ffi.cast("void *", buf[32:].data_ptr()),
                                               "format"),
                                              (2, 1, 8, lib.COLI_TENSOR_F32, ffi.cast("void *", buf[8:].data_ptr()),
                                               "overlaps")):
        assert lib.coli_rotary(p, out, rows, heads, d, p, p, fmt, err, 256) == lib.COLI_EINVAL
        assert message in ffi.string(err).decode()


def test_a_model_gives_the_same_logits_with_and_without(tmp_path_factory: pytest.TempPathFactory,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_moe(str(tmp_path_factory.mktemp("decode-rotary")), "qwen3_moe", dtype="bfloat16",
                          hidden_size=64, seed=7)
    model = hf.from_pretrained(path, torch_dtype=torch.bfloat16)
    module = _modeling("qwen3_moe")
    try:
        assert model.colibri.decode_rotary == 1
        native = module.apply_rotary_pos_emb
        assert use_decode_rotary(model) == 1 and module.apply_rotary_pos_emb is native   # not wrapped twice
        ids = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2))
        options = dict(max_new_tokens=6, do_sample=False, pad_token_id=1, output_logits=True,
                       return_dict_in_generate=True)
        with torch.no_grad():
            with_native = model.generate(ids, **options)
            monkeypatch.setattr(module, "apply_rotary_pos_emb", _original(module))
            without = model.generate(ids, **options)
        assert torch.equal(with_native.sequences, without.sequences)
        for a, b in zip(with_native.logits, without.logits):
            assert torch.equal(a, b)
    finally:
        model.colibri_close()
    off = hf.from_pretrained(path, torch_dtype=torch.bfloat16, decode_rotary=False)
    try:
        assert off.colibri.decode_rotary == 0
    finally:
        off.colibri_close()
