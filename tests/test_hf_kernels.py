"""colibri.hf with the native kernels (the default) against the same model
with kernels="torch" (each leased expert dequantized into torch tensors),
on tiny checkpoints of every format colibri.hf accepts: bf16, FP8 with
block scales, compressed-tensors int4 (symmetric and with zero points),
gpt-oss float and MXFP4 (interleaved gate_up, biases, clamped SwiGLU).
GPTQ and AWQ checkpoints are not accepted by colibri.hf (their kernels are
tested through the store in test_store_ffn.py).

* float32 activations: logits within 1e-4 of the largest logit; greedy
  generate gives the same tokens.
* bfloat16 activations, each MoE layer on the inputs it really got: within
  2^-8 of its largest magnitude of the same layer in float32, and no further
  than the torch path (which rounds the dequantized weights to bfloat16).
* prefill with the union of experts larger than the cache: with 1 slot per
  layer it still runs (and PILOT's prefetch of a later layer's first expert
  is hit); with more slots the union streams through half of them while the
  next group is prefetched into the other half (the first MoE layer, which
  PILOT never predicts, has prefetched loads hit), every expert of a layer's
  union leased once per forward.

Needs torch and transformers; skipped without them.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import colibri  # noqa: E402
import colibri.hf as hf  # noqa: E402
from colibri.tiny_moe import write_tiny_gpt_oss, write_tiny_moe  # noqa: E402

PAD = 1
F32_BOUND = 1e-4
BF16_BOUND = 2.0 ** -8

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# name -> writer of the checkpoint into a directory
CHECKPOINTS: dict[str, Callable[[str], str]] = {
    "bf16": lambda d: write_tiny_moe(d, "qwen3_moe", dtype="bfloat16", hidden_size=32, seed=1),
    "fp8_block": lambda d: write_tiny_moe(d, "deepseek_v3", dtype="bfloat16", hidden_size=32,
                                          seed=2, fp8_block=16),
    "int4": lambda d: write_tiny_moe(d, "qwen3_moe", dtype="bfloat16", hidden_size=64, seed=3,
                                     int4_group=16),
    "int4_zero_points": lambda d: write_tiny_moe(d, "mixtral", dtype="bfloat16", hidden_size=64,
                                                 seed=4, int4_group=32, int4_symmetric=False),
    "gpt_oss": lambda d: write_tiny_gpt_oss(d, seed=5),
    "mxfp4": lambda d: write_tiny_gpt_oss(d, seed=6, mxfp4=True),
}
NEEDS = {"int4": "compressed_tensors", "int4_zero_points": "compressed_tensors"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name in NEEDS:
            pytest.importorskip(NEEDS[name])
        if name not in cache:
            cache[name] = CHECKPOINTS[name](str(tmp_path_factory.mktemp(name)))
        return cache[name]

    return get


def _batch(vocab: int) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(3, vocab, (3, 10), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in ((1, 3), (2, 1)):            # left padding, as generate wants it
        ids[row, :pad] = PAD
        mask[row, :pad] = 0
    return ids, mask


def _relative(a: Any, b: Any, mask: Any) -> float:
    keep = mask.bool()
    diff = (a.float() - b.float())[keep].abs().max()
    return float(diff / b.float()[keep].abs().max())


def _run(path: str, kernels: str, dtype: Any, ids: Any, mask: Any, **options: Any) -> tuple[Any, Any]:
    """Prefill logits, and greedy generate's tokens, of one load."""
    model = hf.from_pretrained(path, kernels=kernels, torch_dtype=dtype, **options)
    try:
        assert hf.runtime_of(model).kernels == kernels
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                    pad_token_id=PAD)
        assert hf.store_of(model).active_leases == 0
        return logits, tokens
    finally:
        model.colibri_close()


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_float32_activations_equal_the_torch_path(ckpt: Callable[[str], str], name: str) -> None:
    path = ckpt(name)
    vocab = int(transformers.AutoConfig.from_pretrained(path).vocab_size)
    ids, mask = _batch(vocab)
    want = _run(path, "torch", torch.float32, ids, mask, slots_per_layer=2)
    got = _run(path, "native", torch.float32, ids, mask, slots_per_layer=2)
    assert got[0].dtype == torch.float32
    assert _relative(got[0], want[0], mask) <= F32_BOUND, name
    assert torch.equal(got[1], want[1]), name


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_bfloat16_activations_within_rounding(ckpt: Callable[[str], str], name: str) -> None:
    """Each MoE layer of a bfloat16 model, on the inputs it really got: the
    native kernels' output is within bfloat16 rounding (2^-8 of its largest
    magnitude) of the same layer computed in float32, and no further from it
    than the torch path's. (End to end, a rounding may flip a near-tied
    routing choice in either path, so whole-model bfloat16 runs are not
    compared token for token.)"""
    path = ckpt(name)
    ids, mask = _batch(int(transformers.AutoConfig.from_pretrained(path).vocab_size))
    model = hf.from_pretrained(path, torch_dtype=torch.bfloat16, slots_per_layer=2, prefetch=None)
    try:
        runtime = hf.runtime_of(model)
        forward = runtime.experts_forward
        calls: list[tuple[Any, ...]] = []

        def spy(*args: Any) -> Any:
            calls.append(args)
            return forward(*args)

        runtime.experts_forward = spy  # type: ignore[method-assign]
        with torch.no_grad():
            model(ids, attention_mask=mask)
            assert len(calls) == len(runtime.moe_layers)
            for module, layer, h, index, weights in calls:
                native = forward(module, layer, h, index, weights)
                runtime.kernels = "torch"
                dequantized = forward(module, layer, h, index, weights)
                exact = forward(module, layer, h.float(), index, weights.float())
                runtime.kernels = "native"
                assert native.dtype == torch.bfloat16
                scale = float(exact.abs().max())
                err = float((native.float() - exact).abs().max()) / scale
                assert err <= BF16_BOUND, (name, layer, err)
                assert err <= float((dequantized.float() - exact).abs().max()) / scale + 1e-6
    finally:
        model.colibri_close()


def _prefill(path: str, slots: int) -> tuple[dict[int, Any], list[hf.LayerProgress]]:
    """One prefill at ``slots`` per layer with PILOT, checked against the
    torch path without prefetch: each MoE layer's counters after it, and the
    layers' progress reports."""
    ids, mask = _batch(int(transformers.AutoConfig.from_pretrained(path).vocab_size))
    want = _run(path, "torch", torch.float32, ids, mask, slots_per_layer=slots, prefetch=None)
    model = hf.from_pretrained(path, slots_per_layer=slots, torch_dtype=torch.float32)
    seen: list[hf.LayerProgress] = []
    hf.runtime_of(model).progress = seen.append
    try:
        with torch.no_grad():
            got = model(ids, attention_mask=mask).logits
        assert _relative(got, want[0], mask) <= F32_BOUND
        store = hf.store_of(model)
        store.wait_idle()
        return {layer: store.layer_stats(layer) for layer in store.layers}, seen
    finally:
        model.colibri_close()


def test_prefill_with_one_slot_per_layer(ckpt: Callable[[str], str]) -> None:
    """Every layer's union streams through its one slot, expert by expert;
    PILOT's prediction of a later layer's first expert is loaded while the
    layer before computes, and hit."""
    stats, seen = _prefill(ckpt("bf16"), 1)
    assert all(p.groups == p.experts > 1 for p in seen)
    first = min(stats)
    assert stats[first].prefetch_hits == 0      # nothing predicts the first layer
    assert sum(s.prefetch_hits for layer, s in stats.items() if layer != first) > 0


def test_a_union_past_the_cache_streams_through_half_of_it(ckpt: Callable[[str], str]) -> None:
    """4 slots per layer, a prefill that wants more experts per layer: groups
    of 2, the next group prefetched into the free half while one computes.
    The first MoE layer has no PILOT prediction, so its prefetched loads that
    were hit are the streaming's; each expert of a union is leased once."""
    by_layer, seen = _prefill(ckpt("bf16"), 4)
    first = min(by_layer)
    union = next(p.experts for p in seen if p.layer == first)
    assert union > 4 and next(p.groups for p in seen if p.layer == first) == -(-union // 2)
    stats = by_layer[first]
    assert stats.requests == union                    # each expert of the union leased once
    assert stats.prefetched > 0 and stats.prefetch_hits > 0
    assert stats.misses + stats.hits == union


def test_bad_kernels_option(ckpt: Callable[[str], str]) -> None:
    with pytest.raises(colibri.FormatError, match="kernels must be one of native, torch"):
        hf.from_pretrained(ckpt("bf16"), kernels="numpy")


def test_gating_the_kernels_lack_takes_the_torch_path() -> None:
    from colibri.hf.runtime import _kernel_activation

    class Silu(torch.nn.Module):
        def __init__(self, act: Any) -> None:
            super().__init__()
            self.act_fn = act

    class OwnGate(Silu):
        def _apply_gate(self, gate_up: Any) -> Any:
            return gate_up

    assert _kernel_activation(Silu(torch.nn.SiLU())) == ("silu", 1.702, 7.0)
    assert _kernel_activation(Silu(transformers.activations.ACT2FN["silu"]))[0] == "silu"
    assert _kernel_activation(Silu(torch.nn.GELU())) is None
    assert _kernel_activation(OwnGate(torch.nn.SiLU())) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["bf16", "int4", "mxfp4"])
def test_a_token_gets_the_same_bits_alone_or_in_a_batch(ckpt: Callable[[str], str], name: str,
                                                        dtype: str) -> None:
    """The experts' forward of a batch gives each token the bits that token
    gets alone, whatever the other tokens routed to (so the lease order and
    grouping differ): the kernels' per-token sums, and the per-token sum of
    its k experts in routing order. A server's greedy output then does not
    depend on what it is batched with."""
    from colibri.hf.runtime import experts_modules

    path = ckpt(name)
    model = hf.from_pretrained(path, torch_dtype=getattr(torch, dtype), slots_per_layer=2,
                               prefetch=None)
    try:
        runtime = hf.runtime_of(model)
        layer, module = next(iter(experts_modules(model).items()))
        n_experts = hf.store_of(model).num_experts(layer)
        k = int(model.config.num_experts_per_tok)
        gen = torch.Generator().manual_seed(5)
        tokens = 7
        hidden = torch.randn(tokens, int(model.config.hidden_size), generator=gen).to(getattr(torch, dtype))
        index = torch.stack([torch.randperm(n_experts, generator=gen)[:k] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1).to(hidden.dtype)
        with torch.no_grad():
            batch = runtime.experts_forward(module, layer, hidden, index, weights)
            for t in range(tokens):
                alone = runtime.experts_forward(module, layer, hidden[t:t + 1], index[t:t + 1],
                                                weights[t:t + 1])
                assert torch.equal(alone[0], batch[t]), (name, dtype, t)
        assert hf.store_of(model).active_leases == 0
    finally:
        model.colibri_close()


def _mkldnn_seen(model: Any) -> list[bool]:
    """torch.backends.mkldnn.enabled as each MoE layer's forward saw it (a list that fills)."""
    runtime = hf.runtime_of(model)
    forward, one_token = runtime.experts_forward, runtime.one_token_experts
    seen: list[bool] = []

    def spy(*args: Any) -> Any:
        seen.append(bool(torch.backends.mkldnn.enabled))
        return forward(*args)

    def spy_one_token(*args: Any) -> Any:
        out = one_token(*args)
        if out is not None:       # else the module's forward, experts_forward, sees it
            seen.append(bool(torch.backends.mkldnn.enabled))
        return out

    runtime.experts_forward = spy  # type: ignore[method-assign]
    runtime.one_token_experts = spy_one_token  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("dtype, decode_blas, flips", [("bfloat16", True, True), ("bfloat16", False, False),
                                                       ("float32", True, False)])
def test_a_one_token_forward_takes_blas(ckpt: Callable[[str], str], dtype: str, decode_blas: bool,
                                        flips: bool) -> None:
    """decode_blas: a forward of one token of a bfloat16 model runs with
    oneDNN off (MKL's gemv for the linear layers), a prefill with it on;
    the flag is back as it was after each forward, also one that raised."""
    if flips and not (torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()):
        pytest.skip("this torch has no MKL or no oneDNN")
    model = hf.from_pretrained(ckpt("bf16"), torch_dtype=getattr(torch, dtype), slots_per_layer=2,
                               prefetch=None, decode_blas=decode_blas)
    try:
        assert hf.runtime_of(model).decode_blas == flips
        seen = _mkldnn_seen(model)
        layers = len(hf.runtime_of(model).moe_layers)
        assert torch.backends.mkldnn.enabled
        with torch.no_grad():
            out = model(torch.tensor([[5, 6, 7]]), use_cache=True)
            assert seen == [True] * layers
            model(torch.tensor([[8]]), past_key_values=out.past_key_values)
            assert seen[layers:] == [not flips] * layers
            model(inputs_embeds=torch.zeros(2, 1, model.config.hidden_size, dtype=model.dtype))
            assert seen[2 * layers:] == [True] * layers
        assert torch.backends.mkldnn.enabled
        hf.runtime_of(model).experts_forward = None  # type: ignore[assignment]
        hf.runtime_of(model).one_token_experts = None  # type: ignore[assignment]
        with pytest.raises(TypeError), torch.no_grad():
            model(torch.tensor([[8]]))
        assert torch.backends.mkldnn.enabled
    finally:
        model.colibri_close()


@pytest.mark.parametrize("name", ["bf16", "int4"])
def test_hits_first_gives_the_same_bits(ckpt: Callable[[str], str], name: str) -> None:
    """With I/O workers a layer computes its resident experts while the
    others load, in two kernel calls; each token's output is the same bits
    as one call over all its experts."""
    from colibri.hf.runtime import experts_modules

    path = ckpt(name)
    plain = hf.from_pretrained(path, torch_dtype=torch.bfloat16, slots_per_layer=4, prefetch=None)
    split = hf.from_pretrained(path, torch_dtype=torch.bfloat16, slots_per_layer=4, prefetch="pilot")
    try:
        layer, module = next(iter(experts_modules(split).items()))
        store = hf.store_of(split)
        n_experts, k = store.num_experts(layer), int(split.config.num_experts_per_tok)
        assert 2 <= k < n_experts
        gen = torch.Generator().manual_seed(3)
        hidden = torch.randn(1, int(split.config.hidden_size), generator=gen).to(torch.bfloat16)
        weights = torch.softmax(torch.randn(1, k, generator=gen), dim=-1).to(torch.bfloat16)
        order = torch.randperm(n_experts, generator=gen)
        first, second = order[:k][None], torch.cat([order[:1], order[k:2 * k - 1]])[None]
        started: list[list[int]] = []
        start_reads = store.start_reads
        store.start_reads = lambda layer, experts: started.append(sorted(experts)) or start_reads(layer, experts)
        with torch.no_grad():
            for index in (first, second):      # the second shares one expert with the first
                got = hf.runtime_of(split).experts_forward(module, layer, hidden, index, weights)
                want = hf.runtime_of(plain).experts_forward(module, layer, hidden, index, weights)
                assert torch.equal(got, want)
        assert started == [sorted(int(e) for e in order[k:2 * k - 1])]
        assert store.active_leases == 0
    finally:
        split.colibri_close()
        plain.colibri_close()
