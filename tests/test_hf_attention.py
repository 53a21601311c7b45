"""colibri.hf's one-query attention (colibri.hf.attention.decode_sdpa).

* A one-query step of a grouped-query layer, laid out over the key/value
  heads, agrees with transformers' SDPA function and with a float64
  reference, with and without masks (boolean and additive), in float32 and
  bfloat16.
* Every other call (several queries, one key/value head per query head, a
  per-head mask, keywords that change the math) is transformers' function:
  the same bits, the same errors.
* colibri.hf switches an SDPA model to it by default
  (``decode_attention=False`` keeps SDPA); greedy generation gives the same
  tokens either way, and the serve engine still batches the model.

Needs torch and transformers; skipped without them.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import colibri.hf as hf  # noqa: E402
from colibri.hf.attention import DECODE_SDPA, GROUPED_SDPA, attend_one_query, decode_sdpa  # noqa: E402
from colibri.tiny_moe import write_tiny_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Layer(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _tensors(batch: int, heads: int, kv_heads: int, queries: int, keys: int, dtype: Any,
             seed: int) -> tuple[Any, Any, Any]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, queries, 64, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, keys, 64, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, keys, 64, generator=g).to(dtype)
    return q, k, v


def _reference(q: Any, k: Any, v: Any, mask: Any, scale: float) -> Any:
    """float64 attention of every query head over its key/value head, (batch, queries, heads, dim)."""
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, dim=1)
    v = v.double().repeat_interleave(groups, dim=1)
    scores = q.double() @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.double()
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


def _mask(kind: str, batch: int, keys: int, dtype: Any) -> Any:
    if kind == "none":
        return None
    keep = torch.rand(batch, 1, 1, keys, generator=torch.Generator().manual_seed(7)) > 0.3
    keep[..., -1] = True        # the new token always sees itself
    if kind == "bool":
        return keep
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


# bfloat16: SDPA rounds the probabilities to bfloat16 before the product
# with the values, and then the output (transformers' own call measures up
# to about 1.05 * 2^-8 of the largest output here).
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 2.0 ** -7)])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("heads, kv_heads, keys", [(16, 4, 1), (16, 4, 300), (8, 2, 37), (6, 3, 129)])
def test_one_query_matches_sdpa_and_the_reference(dtype: Any, bound: float, mask_kind: str, heads: int,
                                                  kv_heads: int, keys: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _tensors(2, heads, kv_heads, 1, keys, dtype, seed=heads + keys)
    mask = _mask(mask_kind, 2, keys, dtype)
    layer = _Layer(heads // kv_heads)
    sdpa, shapes = torch.nn.functional.scaled_dot_product_attention, []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda query, *a, **kw: shapes.append(tuple(query.shape)) or sdpa(query, *a, **kw))
    out, weights = decode_sdpa(layer, q, k, v, mask, scaling=0.125)
    monkeypatch.undo()
    # with a mask, torch's SDPA over the key/value heads; without, the native call
    assert shapes == ([] if mask is None else [(2, kv_heads, heads // kv_heads, 64)])
    theirs, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.125)
    assert weights is None
    assert out.shape == theirs.shape == (2, 1, heads, 64) and out.dtype == dtype
    assert out.is_contiguous()
    ref = _reference(q, k, v, mask, 0.125)
    scale = ref.abs().max().item()
    assert (out.double() - ref).abs().max().item() <= bound * scale
    # no further from the reference than transformers' own call, give or take a rounding
    assert ((out.double() - ref).abs().max().item()
            <= (theirs.double() - ref).abs().max().item() + bound * scale)


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 2.0 ** -7)])
@pytest.mark.parametrize("heads, kv_heads, keys, room", [(16, 4, 300, 44), (12, 3, 17, 0), (8, 1, 65, 7),
                                                         (32, 4, 5, 251), (6, 6, 40, 3)])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_native_call_reads_a_cache_with_room_to_spare(dtype: Any, bound: float, heads: int, kv_heads: int,
                                                         keys: int, room: int, threads: int) -> None:
    """Key and value views of buffers longer than the cache (as the growing
    key/value cache returns them), any group size, on 1 and 2 threads."""
    q, k, v = _tensors(2, heads, kv_heads, 1, keys + room, dtype, seed=heads * keys + room)
    k, v = k[:, :, :keys], v[:, :, :keys]
    out = attend_one_query(q, k, v, 0.125, threads=threads)
    assert out.shape == (2, 1, heads, 64) and out.dtype == dtype and out.is_contiguous()
    ref = _reference(q, k, v, None, 0.125)
    assert (out.double() - ref).abs().max().item() <= bound * ref.abs().max().item()
    assert torch.equal(out, attend_one_query(q, k, v, 0.125, threads=3 - threads))   # threads: the same bits


def test_the_native_call_refuses_what_it_cannot_compute() -> None:
    q, k, v = _tensors(1, 8, 2, 1, 20, torch.float32, seed=5)
    for args, message in (((q, k.to(torch.bfloat16), v), "all be float32"),
                          ((q.to(torch.float16), k.to(torch.float16), v.to(torch.float16)), "all be float32"),
                          ((q, k[:, :1], v), "do not match"),
                          ((torch.randn(1, 8, 2, 64), k, v), "one query"),
                          ((q, k[..., ::2], v[..., ::2]), "do not match"),
                          ((q, k[:, :, :0], v[:, :, :0]), "do not match"),
                          ((q, k.transpose(2, 3).contiguous().transpose(2, 3), v), "contiguous")):
        with pytest.raises(ValueError, match=message):
            attend_one_query(*args)


def test_autograd_and_dropout_take_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _tensors(1, 8, 2, 1, 20, torch.float32, seed=6)
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    decode_sdpa(_Layer(4), q.requires_grad_(True), k, v, None, scaling=0.1)
    decode_sdpa(_Layer(4), q.detach(), k, v, None, dropout=0.5, scaling=0.1)
    assert len(calls) == 2
    decode_sdpa(_Layer(4), q.detach(), k, v, None, scaling=0.1)
    assert len(calls) == 2


@pytest.mark.parametrize("case", ["prefill", "one_group", "per_head_mask", "kv_heads_equal_heads"])
def test_other_calls_are_transformers_own(case: str) -> None:
    """Calls outside the one-query grouped case give SDPA's exact bits."""
    queries = 5 if case == "prefill" else 1
    kv_heads = 8 if case in ("one_group", "kv_heads_equal_heads") else 2
    q, k, v = _tensors(1, 8, kv_heads, queries, 20, torch.bfloat16, seed=3)
    mask = None
    if case == "per_head_mask":
        mask = torch.ones(1, 8, 1, 20, dtype=torch.bool)
        mask[..., :4] = False
    layer = _Layer(8 // kv_heads)
    out, _ = decode_sdpa(layer, q, k, v, mask, scaling=0.1)
    theirs, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.1)
    assert torch.equal(out, theirs)


def test_keywords_that_change_the_math_go_to_transformers() -> None:
    """softcap: SDPA refuses it, and so does decode_sdpa (not silently dropped)."""
    q, k, v = _tensors(1, 8, 2, 1, 20, torch.float32, seed=4)
    with pytest.raises(ValueError, match="softcap"):
        decode_sdpa(_Layer(4), q, k, v, None, softcap=30.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_moe(str(tmp_path_factory.mktemp("attn")), "qwen3_moe", dtype="bfloat16",
                          hidden_size=32, seed=11)


@pytest.mark.parametrize("decode_attention, expected", [(True, DECODE_SDPA), (False, "sdpa")])
def test_from_pretrained_switches_sdpa_models(tiny: str, decode_attention: bool, expected: str) -> None:
    model = hf.from_pretrained(tiny, torch_dtype=torch.float32, slots_per_layer=2, prefetch=None,
                               decode_attention=decode_attention)
    try:
        assert model.config._attn_implementation == expected
        from colibri.serve.batch import batchable

        assert batchable(model) is None
    finally:
        model.colibri_close()


def test_torch_kernels_keep_torchs_attention(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels="torch" rounds as stock transformers: its one-query steps
    take torch's grouped SDPA, never the native call."""
    import colibri.hf.attention as attention

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the native attention ran under kernels='torch'")

    monkeypatch.setattr(attention, "attend_one_query", refuse)
    model = hf.from_pretrained(tiny, torch_dtype=torch.bfloat16, slots_per_layer=2, prefetch=None,
                               kernels="torch")
    try:
        assert model.config._attn_implementation == GROUPED_SDPA
        from colibri.serve.batch import batchable

        assert batchable(model) is None
        with torch.no_grad():
            model.generate(torch.tensor([[3, 9, 4, 7, 2]]), max_new_tokens=4, do_sample=False, pad_token_id=1)
    finally:
        model.colibri_close()


def test_greedy_generation_is_the_same_with_either_attention(tiny: str) -> None:
    runs = []
    for decode_attention in (True, False):
        model = hf.from_pretrained(tiny, torch_dtype=torch.float32, slots_per_layer=2, prefetch=None,
                                   decode_attention=decode_attention)
        try:
            with torch.no_grad():
                out = model.generate(torch.tensor([[3, 9, 4, 7, 2]]), max_new_tokens=8, do_sample=False,
                                     output_scores=True, return_dict_in_generate=True, pad_token_id=1)
            runs.append((out.sequences, torch.stack(out.scores)))
        finally:
            model.colibri_close()
    (seq_a, scores_a), (seq_b, scores_b) = runs
    assert torch.equal(seq_a, seq_b)
    assert (scores_a - scores_b).abs().max().item() <= 1e-4 * scores_b.abs().max().item()
