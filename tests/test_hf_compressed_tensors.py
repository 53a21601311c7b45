"""colibri.hf on compressed-tensors int4 checkpoints, against compressed-tensors
and stock transformers.

The checkpoints are tiny models written by transformers (colibri.tiny_moe)
whose projections the ``compressed-tensors`` package itself quantizes and
packs (``pack-quantized``, its quantizer, compressor and config writer):
either only the routed experts, with everything else in ``ignore`` as most
int4 MoE releases do, or attention and dense/shared MLPs too.

The reference is the same checkpoint decompressed by compressed-tensors'
own decompressor into a float checkpoint and run by stock transformers
(and, for symmetric checkpoints, transformers' own compressed-tensors loader
in dequantize mode, which cannot load asymmetric experts). colibri must give
the same logits (float32: within 1e-5) and greedy tokens, load no routed
expert (the store has read 0 bytes, no expert parameter exists, and
transformers' dequantizer never sees an expert tensor), and refuse variants
it cannot serve before the store opens or transformers reads a weight.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors.pack_quantized.base import (  # noqa: E402
    PackedQuantizationCompressor,
)
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.integrations import compressed_tensors as hf_ct  # noqa: E402

import colibri  # noqa: E402
import colibri.hf as hf  # noqa: E402
from colibri.formats import INT4  # noqa: E402
from colibri.tiny_moe import write_tiny_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PAD = 1
F32_TOL = 1e-5

# (architecture, what is compressed, symmetric, dtype)
CASES = [
    ("qwen3_moe", "experts", True, "float32"),
    ("qwen3_moe", "all", False, "float32"),
    ("deepseek_v3", "all", True, "float32"),
    ("mixtral", "experts", False, "float32"),
    ("qwen2_moe", "all", True, "bfloat16"),
]


def _ids(case: tuple[str, str, bool, str]) -> str:
    arch, scope, symmetric, dtype = case
    return f"{arch}-{scope}-{'sym' if symmetric else 'asym'}-{dtype}"


def _scheme_of(quant: dict[str, Any], module: str) -> Any:
    """The config group quantizing ``module``: the one with a ``re:`` target
    matching its name, else the one with a class-name target (``Linear``)."""
    groups = list(quant["config_groups"].values())
    for group in groups:
        if any(t.startswith("re:") and re.match(t[3:], module) for t in group["targets"]):
            return QuantizationScheme.model_validate(group)
    (by_class,) = [g for g in groups if any(not t.startswith("re:") for t in g["targets"])]
    return QuantizationScheme.model_validate(by_class)


def _decompressed(path: str, out: Path) -> Path:
    """``path`` with every pack-quantized weight decompressed by
    compressed-tensors' own decompressor, as a float checkpoint."""
    shutil.copytree(path, out)
    cfg = json.loads((out / "config.json").read_text())
    quant = cfg.pop("quantization_config")
    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(shard)
        bases = {k[: -len("weight_packed")] for k in tensors if k.endswith(".weight_packed")}
        dense: dict[str, Any] = {k: v for k, v in tensors.items()
                                 if not any(k.startswith(b + "weight_") for b in bases)}
        for base in bases:
            state = {k[len(base):]: v for k, v in tensors.items() if k.startswith(base + "weight_")}
            dtype = state["weight_scale"].dtype
            scheme = _scheme_of(quant, base[:-1])
            dense[base + "weight"] = PackedQuantizationCompressor.decompress(state, scheme)["weight"].to(dtype)
        save_file(dense, str(shard), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    index = out / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[tuple[str, str, bool, str], tuple[str, Any]] = {}

    def get(case: tuple[str, str, bool, str]) -> tuple[str, Any]:
        if case not in cache:
            arch, scope, symmetric, dtype = case
            root = tmp_path_factory.mktemp(_ids(case))
            path = write_tiny_moe(str(root / "int4"), arch, dtype=dtype, hidden_size=32, seed=3,
                                  int4_group=16, int4_scope=scope, int4_symmetric=symmetric)
            ref = transformers.AutoModelForCausalLM.from_pretrained(
                _decompressed(path, root / "reference")).eval()
            cache[case] = (path, ref)
        return cache[case]

    return get


@pytest.fixture
def dequantized_by_transformers(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """The parameters transformers' compressed-tensors load operation saw, each
    with whether it came with quantized parts (it passes float weights through)."""
    seen: dict[str, bool] = {}
    convert = hf_ct.CompressedTensorsDequantize.convert

    def spy(self: Any, input_dict: Any, *args: Any, full_layer_name: Any = None, **kwargs: Any) -> Any:
        seen[str(full_layer_name)] = any("weight_" in key for key in input_dict)
        return convert(self, input_dict, *args, full_layer_name=full_layer_name, **kwargs)

    monkeypatch.setattr(hf_ct.CompressedTensorsDequantize, "convert", spy)
    return seen


def _batches(vocab: int) -> list[tuple[Any, Any]]:
    gen = torch.Generator().manual_seed(11)
    one = torch.randint(3, vocab, (1, 9), generator=gen)
    three = torch.randint(3, vocab, (3, 11), generator=gen)
    mask = torch.ones_like(three)
    for row, pad in ((1, 4), (2, 2)):
        three[row, :pad] = PAD
        mask[row, :pad] = 0
    return [(one, torch.ones_like(one)), (three, mask)]


def _max_diff(a: Any, b: Any, mask: Any) -> float:
    return float((a.float() - b.float())[mask.bool()].abs().max())


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_logits_and_tokens_equal_compressed_tensors_reference(ckpt, case, dequantized_by_transformers) -> None:
    path, ref = ckpt(case)
    scope = case[1]
    with colibri.open_store(path, slots_per_layer=1, prefetch_workers=0) as store:
        assert {store.model.expert(layer, 0).scheme for layer in store.layers} == {INT4}
    for slots, prefetch in ((1, "pilot"), (2, "off")):
        dequantized_by_transformers.clear()
        model = hf.from_pretrained(path, slots_per_layer=slots, prefetch=prefetch)
        try:
            # Loading read no routed expert: not the store, not transformers.
            assert hf.store_of(model).stats().bytes_read == 0
            assert not [n for n, _ in model.named_parameters() if ".mlp.experts." in n]
            assert not [n for n in dequantized_by_transformers if ".mlp.experts." in n]
            # What else was compressed, transformers dequantized with compressed-tensors' code.
            assert any(dequantized_by_transformers.values()) == (scope == "all")
            assert not hasattr(model.config, "quantization_config")
            reference = dict(ref.named_parameters())
            for name, p in model.named_parameters():
                assert torch.equal(p, reference[name]), name     # every non-expert weight, exactly
            assert model.dtype == ref.dtype
            for ids, mask in _batches(ref.config.vocab_size):
                with torch.no_grad():
                    want = ref(ids, attention_mask=mask).logits
                    got = model(ids, attention_mask=mask).logits
                if ref.dtype == torch.float32:
                    assert _max_diff(got, want, mask) <= F32_TOL
                else:
                    scale = float(want.float()[mask.bool()].abs().max())
                    assert _max_diff(got, want, mask) <= 4 * 2.0**-8 * scale
                kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD)
                assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))
            assert hf.store_of(model).stats().bytes_read > 0
        finally:
            model.colibri_close()


def _assert_answers_equal(model: Any, reference: Any) -> None:
    """The logits (in float32, within F32_TOL) and greedy tokens of a padded batch."""
    ids, mask = _batches(reference.config.vocab_size)[1]
    with torch.no_grad():
        want = reference(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
    if reference.dtype == torch.float32:
        assert _max_diff(got, want, mask) <= F32_TOL
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs))


@pytest.mark.parametrize("case", [c for c in CASES if c[2]], ids=_ids)
def test_symmetric_equals_transformers_compressed_tensors_loader(ckpt, case) -> None:
    """transformers' own compressed-tensors loader, dequantizing on a CPU."""
    path, _ = ckpt(case)
    stock = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.CompressedTensorsConfig(dequantize=True)).eval()
    model = hf.from_pretrained(path, slots_per_layer=2)
    try:
        _assert_answers_equal(model, stock)
    finally:
        model.colibri_close()


@pytest.fixture
def nothing_loaded(monkeypatch: pytest.MonkeyPatch):
    """Fails the test if the store opens or transformers starts loading."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a load started")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(hf.pretrained, "open_store", refuse)


def _edit_config(src: str, dst: Path, edit: Any) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _weights(quant: dict[str, Any]) -> dict[str, Any]:
    (group,) = quant["config_groups"].values()
    weights: dict[str, Any] = group["weights"]
    return weights


BAD = {
    "8-bit": (lambda q: _weights(q).update(num_bits=8), "8-bit int weights are not supported"),
    "float4": (lambda q: _weights(q).update(type="float"), "4-bit float weights are not supported"),
    "tensor strategy": (lambda q: _weights(q).update(strategy="tensor", group_size=None),
                        "strategy 'tensor' is not supported"),
    "block strategy": (lambda q: _weights(q).update(strategy="block", group_size=None,
                                                    block_structure=[16, 16]),
                       "strategy 'block' is not supported"),
    "activation order": (lambda q: _weights(q).update(actorder="group"), "activation ordering"),
    "W4A8": (lambda q: next(iter(q["config_groups"].values())).update(
        input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
        "input activations"),
    "other format": (lambda q: q.update(format="marlin-24"), "format 'marlin-24' is not supported"),
    "no groups": (lambda q: q.update(config_groups={}), "no config_groups"),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_unsupported_variants_are_refused_before_loading(ckpt, tmp_path, nothing_loaded, bad: str) -> None:
    path, _ = ckpt(CASES[0])
    edit, message = BAD[bad]
    broken = _edit_config(path, tmp_path / "bad", edit)
    with pytest.raises(hf.UnsupportedModelError, match=message) as err:
        hf.from_pretrained(broken)
    assert str(broken) in str(err.value)


def test_accepted_methods_are_one_table() -> None:
    assert set(hf.ACCEPTED_QUANT_METHODS) == {None, "fp8", "mxfp4", "compressed-tensors"}
    for method in hf.ACCEPTED_QUANT_METHODS.values():
        assert isinstance(method, hf.QuantMethod) and method.summary


def test_tiny_moe_cli_writes_an_int4_checkpoint(tmp_path) -> None:
    from colibri import tiny_moe

    out = tmp_path / "tiny"
    assert tiny_moe.main([str(out), "--arch", "olmoe", "--int4-group", "16"]) == 0
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "pack-quantized"
    with colibri.open_store(out, slots_per_layer=1, prefetch_workers=0) as store:
        ex = store.model.expert(store.layers[0], 0)
        assert ex.scheme == INT4 and ex.group_size == 16


def test_experts_of_a_later_config_group_are_read_by_that_group(tmp_path: Path) -> None:
    """The routed experts' settings come from the config group that targets
    them (transformers' rule), not from the first group: here the first
    group quantizes attention in groups of 8 columns, the second the routed
    experts in groups of 16. open_store and colibri.hf agree on it."""
    path = write_tiny_moe(str(tmp_path / "int4"), "qwen3_moe", dtype="float32", hidden_size=32, seed=3,
                          int4_group=16, int4_scope="attention_first")
    groups = json.loads((Path(path) / "config.json").read_text())["quantization_config"]["config_groups"]
    assert [name for name in groups] == ["group_0", "group_1"]
    assert [g["weights"]["group_size"] for g in groups.values()] == [8, 16]
    assert any("experts" in t for t in groups["group_1"]["targets"])
    assert not any("experts" in t for t in groups["group_0"]["targets"])
    with colibri.open_store(path, slots_per_layer=1, prefetch_workers=0) as store:
        for layer in store.layers:
            ex = store.model.expert(layer, 0)
            assert (ex.scheme, ex.group_size) == (INT4, 16)
            assert ex.block_shape("gate") == (1, 16)
    ref = transformers.AutoModelForCausalLM.from_pretrained(_decompressed(path, tmp_path / "reference")).eval()
    model = hf.from_pretrained(path, slots_per_layer=2)
    try:
        _assert_answers_equal(model, ref)
    finally:
        model.colibri_close()
