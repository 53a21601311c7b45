"""colibri.hf's in-place key/value cache: a DynamicCache given to a colibri
model appends each step into a buffer with room to spare, and holds the
same keys and values as transformers' own layer after any sequence of
appends, crops and replacements.

Needs torch and transformers; skipped without them."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.cache_utils import DynamicCache, DynamicLayer  # noqa: E402

import colibri.hf as hf  # noqa: E402
from colibri.hf.kv_cache import SPARE_TOKENS, grow_in_place, growing_layer_class  # noqa: E402
from colibri.tiny_moe import write_tiny_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# One step of a random history: append n tokens, crop n, or replace the
# tensors with copies (as beam search's reordering does).
STEP = st.one_of(st.tuples(st.just("append"), st.integers(1, 300)),
                 st.tuples(st.just("crop"), st.integers(1, 40)),
                 st.tuples(st.just("replace"), st.just(0)))


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(STEP, min_size=1, max_size=25), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2 ** 16))
def test_it_holds_what_a_dynamic_layer_holds(steps: list[tuple[str, int]], dtype: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    plain, growing = DynamicLayer(), growing_layer_class()()
    for what, n in steps:
        held = plain.get_seq_length()
        if what == "append":
            k = torch.randn(2, 3, n, 8, generator=g).to(dtype)
            v = torch.randn(2, 3, n, 5, generator=g).to(dtype)
            want = plain.update(k, v)
            got = growing.update(k.clone(), v.clone())
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        elif what == "crop" and n < held:
            plain.crop(-n)
            growing.crop(-n)
        elif what == "replace" and held:
            growing.keys, growing.values = growing.keys.clone(), growing.values.clone()
        assert growing.get_seq_length() == plain.get_seq_length()
        if plain.get_seq_length():
            assert torch.equal(growing.keys, plain.keys) and torch.equal(growing.values, plain.values)


def test_appends_write_in_place_and_leave_earlier_results_alone() -> None:
    layer = growing_layer_class()()
    k0, v0 = layer.update(torch.ones(1, 2, 10, 4), torch.ones(1, 2, 10, 4))
    k1, v1 = layer.update(torch.full((1, 2, 1, 4), 2.0), torch.full((1, 2, 1, 4), 3.0))
    assert k1.data_ptr() == k0.data_ptr()                       # no copy: the same buffer
    assert k0.shape[-2] == 10 and torch.equal(k0, torch.ones(1, 2, 10, 4))
    assert torch.equal(k1[:, :, 10], torch.full((1, 2, 4), 2.0)) and torch.equal(v1[:, :, 10], torch.full((1, 2, 4), 3.0))
    for _ in range(SPARE_TOKENS):                               # past the room: a new, larger buffer
        k2, _ = layer.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert k2.shape[-2] == 11 + SPARE_TOKENS and k2.data_ptr() != k0.data_ptr()
    assert torch.equal(k2[:, :, :10], k0) and torch.equal(k1, k2[:, :, :11])


def test_a_deep_copy_is_independent() -> None:
    cache = DynamicCache()
    cache.update(torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8), 0)
    assert grow_in_place(cache) == 1
    twin = copy.deepcopy(cache)
    cache.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), 0)
    twin.update(torch.full((1, 2, 1, 8), 5.0), torch.full((1, 2, 1, 8), 5.0), 0)
    assert torch.equal(cache.layers[0].keys[:, :, 4], torch.zeros(1, 2, 8))
    assert torch.equal(twin.layers[0].keys[:, :, 4], torch.full((1, 2, 8), 5.0))
    assert torch.equal(cache.layers[0].keys[:, :, :4], twin.layers[0].keys[:, :, :4])


def test_only_plain_dynamic_caches_are_taken_over() -> None:
    from transformers.cache_utils import DynamicSlidingWindowLayer

    assert grow_in_place(object()) == 0 and grow_in_place(None) == 0
    cache = DynamicCache()
    cache.layers.append(DynamicSlidingWindowLayer(sliding_window=4))
    assert grow_in_place(cache) == 0 and type(cache.layers[0]) is DynamicSlidingWindowLayer
    cache = DynamicCache()
    cache.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2), 0)
    assert grow_in_place(cache) == 1 and grow_in_place(cache) == 1   # again: nothing more to do
    k, _ = cache.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 0)
    assert k.shape == (1, 1, 4, 2) and torch.equal(k[:, :, :3], torch.ones(1, 1, 3, 2))


def test_generate_gives_the_same_logits_with_and_without(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = write_tiny_moe(str(tmp_path_factory.mktemp("kv-cache")), "qwen3_moe", dtype="bfloat16",
                          hidden_size=64, seed=5)
    runs = {}
    for grow in (True, False):
        model = hf.from_pretrained(path, torch_dtype=torch.bfloat16, grow_kv_cache=grow)
        try:
            ids = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
            assert model.colibri.grow_kv_cache is grow
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
            kinds = {type(layer).__name__ for layer in cache.layers}
            assert kinds == ({"GrowingLayer"} if grow else {"DynamicLayer"})
            runs[grow] = (out.sequences, torch.stack(out.logits))
        finally:
            model.colibri_close()
    assert torch.equal(runs[True][0], runs[False][0])
    assert torch.equal(runs[True][1], runs[False][1])
