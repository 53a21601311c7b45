"""One token's routed experts with the native calls built once
(colibri.one_token_moe.OneTokenMoe, Runtime.one_token_experts, which the
lean decode layers call instead of the experts module).

* OneTokenMoe gives the bits of moe_ffn then moe_combine, at its first call
  (which checks the operands through moe_ffn) and at later ones (which do
  not), for float32 and bfloat16 activations, over lease groups; leases of
  another store, or another dtype, go through moe_ffn's checks again.
* In a model: every one-token step of a lean layer computes its experts
  this way, with the same store calls as the module path (the same counters
  with a deterministic store: no workers), the same logits; a hook on the
  experts module, a routing hook or a closed store leave the step to the
  module, which runs them.

Needs torch (and transformers for the model tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

torch = pytest.importorskip("torch")

import colibri  # noqa: E402
from colibri.errors import ColibriError  # noqa: E402
from colibri.kernels import moe_combine, moe_ffn  # noqa: E402
from colibri.one_token_moe import OneTokenMoe  # noqa: E402
from colibri.synthetic_formats import write_format_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HIDDEN = 64
EXPERTS = 6


@pytest.fixture(scope="module")
def int4_path(tmp_path_factory: Any) -> Path:
    return write_format_checkpoint(tmp_path_factory.mktemp("int4"), "int4", hidden=HIDDEN, intermediate=32,
                                   experts=EXPERTS, layers=2, group=32, seed=3, symmetric=True, block=(32, 32))


def _operands(seed: int, dtype: Any, k: int = 3) -> tuple[Any, Any, Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((1, HIDDEN), generator=g).to(dtype)
    index = torch.randperm(EXPERTS, generator=g)[:k].reshape(1, k).to(torch.int64)
    weights = torch.softmax(torch.randn((1, k), generator=g), dim=-1).to(dtype)
    return x, index, weights


def _checked(store: colibri.Store, layer: int, x: Any, index: Any, weights: Any, groups: list[list[int]]) -> Any:
    pairs = torch.zeros((index.shape[1], HIDDEN), dtype=torch.float32)
    for group in groups:
        with store.lease_many(layer, group) as leased:
            moe_ffn(leased, x, index, pairs)
    return moe_combine(pairs, weights, torch.empty((1, HIDDEN), dtype=x.dtype))


def _built_once(step: OneTokenMoe, store: colibri.Store, layer: int, x: Any, index: Any, weights: Any,
                groups: list[list[int]]) -> Any:
    for group in groups:
        with store.lease_many(layer, group) as leased:
            step.ffn(leased, x, index)
    return step.combine(weights, torch.empty((1, HIDDEN), dtype=x.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calls_built_once_give_the_bits_of_moe_ffn_and_moe_combine(int4_path: Path, dtype: Any) -> None:
    with colibri.open_store(int4_path, slots_per_layer=EXPERTS, prefetch_workers=0) as store:
        step = OneTokenMoe(3, HIDDEN, "silu", 1.702, 7.0)
        for seed in range(6):        # the first call checks, the later ones do not
            x, index, weights = _operands(seed, dtype)
            chosen = index[0].tolist()
            groups = [chosen] if seed % 2 else [chosen[:1], chosen[1:]]      # one lease group, or two
            assert step.fits(x, index)
            got = _built_once(step, store, seed % 2, x, index, weights, groups)
            want = _checked(store, seed % 2, x, index, weights, groups)
            assert got.dtype == dtype and torch.equal(got, want)


def test_another_dtype_or_store_is_checked_again(int4_path: Path) -> None:
    step = OneTokenMoe(3, HIDDEN, "silu", 1.702, 7.0)
    with colibri.open_store(int4_path, slots_per_layer=EXPERTS, prefetch_workers=0) as store:
        for dtype in (torch.float32, torch.bfloat16, torch.float32):
            x, index, weights = _operands(7, dtype)
            groups = [index[0].tolist()]
            assert torch.equal(_built_once(step, store, 0, x, index, weights, groups),
                               _checked(store, 0, x, index, weights, groups))
        first = step.handle
    with colibri.open_store(int4_path, slots_per_layer=EXPERTS, prefetch_workers=0) as other:
        x, index, weights = _operands(8, torch.float32)
        groups = [index[0].tolist()]
        assert torch.equal(_built_once(step, other, 1, x, index, weights, groups),
                           _checked(other, 1, x, index, weights, groups))
        assert step.handle is not first
        # a released lease is refused by the native call, as by moe_ffn
        with other.lease_many(1, groups[0]) as leased:
            pass
        with pytest.raises(ColibriError):
            step.ffn(leased, x, index)


def test_operands_of_other_shapes_do_not_fit() -> None:
    step = OneTokenMoe(3, HIDDEN, "silu", 1.702, 7.0)
    x, index, _ = _operands(1, torch.float32)
    assert step.fits(x, index)
    assert not step.fits(x.double(), index)
    assert not step.fits(torch.cat([x, x]), index)
    assert not step.fits(x, index.to(torch.int32))
    assert not step.fits(x, torch.cat([index, index], dim=1))
    assert not step.fits(torch.randn((HIDDEN, 2)).t()[:1], index)      # not contiguous


# -- in a model --

transformers = pytest.importorskip("transformers")

import colibri.hf as hf  # noqa: E402
from colibri.hf.runtime import Runtime  # noqa: E402
from colibri.tiny_moe import write_tiny_moe  # noqa: E402


@pytest.fixture()
def taken(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each one_token_experts call computed the experts (appended per call)."""
    counts: list[bool] = []
    fast = Runtime.one_token_experts

    def counted(self: Any, *args: Any) -> Any:
        out = fast(self, *args)
        counts.append(out is not None)
        return out

    monkeypatch.setattr(Runtime, "one_token_experts", counted)
    return counts


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """A lean model and one with decode_layers off, stores without workers
    (their counters do not depend on timing) and a cache of half the experts."""
    path = write_tiny_moe(str(tmp_path_factory.mktemp("one-token")), "qwen3_moe", hidden_size=64, seed=5,
                          dtype="bfloat16", int4_group=16, int4_scope="all")
    options = dict(torch_dtype=torch.bfloat16, slots_per_layer=8, prefetch=None, prefetch_workers=0)
    lean, modules = hf.from_pretrained(path, **options), hf.from_pretrained(path, decode_layers=False, **options)
    try:
        yield lean, modules
    finally:
        lean.colibri_close()
        modules.colibri_close()


def _steps(model: Any, steps: int = 5) -> list[Any]:
    ids = torch.randint(3, model.config.vocab_size, (1, 4 + steps), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = model(ids[:, :4], use_cache=True)
        logits = [out.logits]
        for i in range(4, 4 + steps):
            out = model(ids[:, i:i + 1], past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits)
    return logits


def _counters(model: Any) -> tuple[int, ...]:
    s = model.colibri.store.stats()
    return s.hits, s.misses, s.evictions, s.loads_started


def test_a_steps_experts_take_the_path_with_the_module_paths_store_calls(models: tuple[Any, Any],
                                                                         taken: list[bool]) -> None:
    lean, modules = models
    before = _counters(lean), _counters(modules)
    got, want = _steps(lean), _steps(modules)
    assert taken and all(taken) and len(taken) == 5 * lean.config.num_hidden_layers
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    after = _counters(lean), _counters(modules)
    assert after[0][1] > before[0][1]           # the half cache missed: reads in the path
    assert [a - b for a, b in zip(after[0], before[0])] == [a - b for a, b in zip(after[1], before[1])]


def test_a_hook_on_the_experts_module_runs(models: tuple[Any, Any], taken: list[bool]) -> None:
    lean, modules = models
    seen: list[int] = []
    handle = lean.model.layers[0].mlp.experts.register_forward_hook(lambda *_: seen.append(0))
    try:
        got, want = _steps(lean, 2), _steps(modules, 2)
    finally:
        handle.remove()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert len(seen) == 3                      # the prompt and 2 steps
    assert len(taken) == 2 * (lean.config.num_hidden_layers - 1) and all(taken)


def test_a_routing_hook_sends_the_step_to_the_module(models: tuple[Any, Any], taken: list[bool]) -> None:
    lean, modules = models
    routed: list[int] = []
    lean.colibri.routing = lambda layer, index, weights: routed.append(layer)
    try:
        got, want = _steps(lean, 2), _steps(modules, 2)
    finally:
        lean.colibri.routing = None
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    layers = lean.config.num_hidden_layers
    assert len(routed) == 3 * layers and not any(taken)
