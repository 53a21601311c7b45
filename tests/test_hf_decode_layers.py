"""colibri.hf's lean decode layers: with kernels="native" (and decode_layers,
the default) a decoder layer of a family colibri.hf.decode_layers knows
computes a one-token step by calling the modules' native functions itself,
on buffers it keeps. It must give the bits the modules' own forwards give,
step after step, and leave to them every step it does not take: more
tokens, autograd, hooks (transformers' output recording), another
attention implementation, a layer busy in another thread.

Needs torch and transformers; skipped without them."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import colibri.hf as hf  # noqa: E402
from colibri.hf import decode_layers  # noqa: E402
from colibri.tiny_moe import write_tiny_moe  # noqa: E402
from conftest import assert_same_greedy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS = {
    # bfloat16 projections through the decode linears
    "qwen3_moe-bf16": ("qwen3_moe", dict(dtype="bfloat16")),
    # int4 attention projections (packed linears), float32 activations
    "qwen3_moe-int4-f32": ("qwen3_moe", dict(dtype="float32", int4_group=16, int4_scope="all")),
    "qwen3_moe-int4-bf16": ("qwen3_moe", dict(dtype="bfloat16", int4_group=16, int4_scope="all")),
    # no query and key norms
    "mixtral-bf16": ("mixtral", dict(dtype="bfloat16")),
    "mixtral-int4-f32": ("mixtral", dict(dtype="float32", int4_group=16, int4_scope="all")),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Any]]:
    family, options = VARIANTS[request.param]
    path = write_tiny_moe(str(tmp_path_factory.mktemp(f"decode-layers-{request.param}")), family,
                          hidden_size=64, seed=7, **options)
    dtype = torch.float32 if options["dtype"] == "float32" else torch.bfloat16
    # a cache of half the experts, PILOT on: the experts' path as in real use
    slots = 8 if family == "qwen3_moe" else 4
    lean = hf.from_pretrained(path, torch_dtype=dtype, slots_per_layer=slots)
    modules = hf.from_pretrained(path, torch_dtype=dtype, slots_per_layer=slots, decode_layers=False)
    try:
        yield lean, modules, dtype
    finally:
        lean.colibri_close()
        modules.colibri_close()


@pytest.fixture()
def taken(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """How many layer steps the lean path computed (appended to per step)."""
    counts: list[bool] = []
    step = decode_layers._Plan.step

    def counted(self: Any, *args: Any) -> Any:
        out = step(self, *args)
        counts.append(out is not None)
        return out

    monkeypatch.setattr(decode_layers._Plan, "step", counted)
    return counts


def _steps(model: Any, steps: int = 6, **options: Any) -> list[Any]:
    """Logits of a 5-token prompt and ``steps`` one-token steps (fixed tokens)."""
    ids = torch.randint(3, model.config.vocab_size, (1, 5 + steps), generator=torch.Generator().manual_seed(3))
    out = model(ids[:, :5], use_cache=True, **options)
    logits = [out.logits]
    for i in range(5, 5 + steps):
        out = model(ids[:, i:i + 1], past_key_values=out.past_key_values, use_cache=True, **options)
        logits.append(out.logits)
    return logits


def test_every_layer_of_the_family_takes_the_path(case: tuple[Any, Any, Any]) -> None:
    lean, modules, _ = case
    assert lean.colibri.decode_layers == lean.config.num_hidden_layers
    assert modules.colibri.decode_layers == 0
    assert all("forward" in vars(layer) for layer in lean.model.layers)


def test_decode_steps_give_the_bits_of_the_modules(case: tuple[Any, Any, Any], taken: list[bool]) -> None:
    lean, modules, _ = case
    with torch.no_grad():
        got, want = _steps(lean), _steps(modules)
    layers = lean.config.num_hidden_layers
    assert sum(taken) == 6 * layers          # every one-token step, and no prompt
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_greedy_generation_is_the_same(case: tuple[Any, Any, Any], taken: list[bool]) -> None:
    lean, modules, _ = case
    assert_same_greedy(lean, modules, 0.0)
    assert sum(taken) > 0


def test_steps_it_does_not_take_go_to_the_layers_forward(case: tuple[Any, Any, Any], taken: list[bool]) -> None:
    lean, modules, _ = case
    # autograd on: the class's forward, the same logits
    got, want = _steps(lean, 2), _steps(modules, 2)
    assert not any(taken)
    for a, b in zip(got, want):
        assert torch.equal(a.detach(), b.detach())


def test_recording_hooks_make_the_path_step_aside(tmp_path_factory: pytest.TempPathFactory,
                                                  taken: list[bool]) -> None:
    """Asking for the routers' logits makes transformers hook the routers
    (for good): the layers' own forwards then run, and record them all."""
    path = write_tiny_moe(str(tmp_path_factory.mktemp("decode-layers-hooks")), "qwen3_moe", hidden_size=64, seed=8)
    lean = hf.from_pretrained(path, torch_dtype=torch.bfloat16)
    modules = hf.from_pretrained(path, torch_dtype=torch.bfloat16, decode_layers=False)
    try:
        with torch.no_grad():
            got, want = (_steps(m, 2, output_router_logits=True) for m in (lean, modules))
            recorded = [_last_router_logits(m) for m in (lean, modules)]
            assert not any(taken)
            got_after, want_after = _steps(lean, 2), _steps(modules, 2)
    finally:
        lean.colibri_close()
        modules.colibri_close()
    for a, b in zip(got + got_after, want + want_after):
        assert torch.equal(a, b)
    assert len(recorded[0]) == len(recorded[1]) >= lean.config.num_hidden_layers
    assert all(torch.equal(a, b) for a, b in zip(*recorded))


def _last_router_logits(model: Any) -> tuple[Any, ...]:
    ids = torch.randint(3, model.config.vocab_size, (1, 2), generator=torch.Generator().manual_seed(4))
    first = model(ids[:, :1], use_cache=True)
    step = model(ids[:, 1:], past_key_values=first.past_key_values, use_cache=True, output_router_logits=True)
    return tuple(step.router_logits)


def test_a_layer_busy_in_another_thread_is_computed_by_its_forward(case: tuple[Any, Any, Any],
                                                                   taken: list[bool]) -> None:
    lean, modules, _ = case
    with torch.no_grad():
        _steps(lean, 1)                       # the plans exist
        plans = [decode_layers._plans[layer] for layer in lean.model.layers]
        held = [p for by_dtype in plans for _, p in by_dtype.values() if p is not None]
        assert len(held) == lean.config.num_hidden_layers
        for p in held:
            p.lock.acquire()
        taken.clear()
        try:
            got = _steps(lean, 2)
        finally:
            for p in held:
                p.lock.release()
        want = _steps(modules, 2)
    assert not any(taken)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_another_attention_implementation_is_left_to_the_layer(case: tuple[Any, Any, Any],
                                                               taken: list[bool]) -> None:
    lean, modules, _ = case
    before = lean.config._attn_implementation
    try:
        for model in (lean, modules):
            model.set_attn_implementation("eager")
        with torch.no_grad():
            got, want = _steps(lean, 2), _steps(modules, 2)
    finally:
        for model in (lean, modules):
            model.set_attn_implementation(before)
    assert not any(taken)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_keys_the_native_attention_cannot_read_go_to_the_attention_function(
        case: tuple[Any, Any, Any], taken: list[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache that returns its keys with strided rows: after the cache's
    update the lean step hands the attention to the attention function, as
    the module does (which computes it with torch's SDPA)."""
    from transformers.cache_utils import DynamicCache

    lean, modules, _ = case
    update = DynamicCache.update

    def strided(self: Any, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
        keys, values = update(self, key_states, value_states, *args, **kwargs)
        return keys.transpose(2, 3).contiguous().transpose(2, 3), values

    monkeypatch.setattr(DynamicCache, "update", strided)
    with torch.no_grad():
        got, want = _steps(lean, 2), _steps(modules, 2)
    assert sum(taken) == 2 * lean.config.num_hidden_layers
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_a_weight_changed_in_place_shows_through(case: tuple[Any, Any, Any], taken: list[bool]) -> None:
    lean, modules, _ = case
    norms = [m.model.layers[1].post_attention_layernorm.weight for m in (lean, modules)]
    with torch.no_grad():
        before = _steps(lean, 2)
        for w in norms:
            w.mul_(-0.5)
        try:
            got, want = _steps(lean, 2), _steps(modules, 2)
        finally:
            for w in norms:
                w.mul_(-2.0)
    assert not torch.equal(got[-1], before[-1])
    assert sum(taken) == 2 * 2 * lean.config.num_hidden_layers     # before and after, lean only
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_other_families_keep_their_layers(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = write_tiny_moe(str(tmp_path_factory.mktemp("decode-layers-olmoe")), "olmoe", hidden_size=64, seed=2)
    model = hf.from_pretrained(path, torch_dtype=torch.bfloat16)
    try:
        assert model.colibri.decode_layers == 0
        assert not any("forward" in vars(layer) for layer in model.model.layers)
    finally:
        model.colibri_close()


def test_a_swapped_module_makes_a_new_plan(tmp_path_factory: pytest.TempPathFactory, taken: list[bool]) -> None:
    """A projection replaced by a float nn.Linear, which the path does not
    compute: the layer's own forward from then on, the same logits; a
    dropped model's layers are freed (the plans hold no module)."""
    import gc
    import weakref

    path = write_tiny_moe(str(tmp_path_factory.mktemp("decode-layers-swap")), "qwen3_moe", hidden_size=64, seed=9)
    lean = hf.from_pretrained(path, torch_dtype=torch.bfloat16)
    modules = hf.from_pretrained(path, torch_dtype=torch.bfloat16, decode_layers=False)
    try:
        with torch.no_grad():
            _steps(lean, 1)
            assert sum(taken) == lean.config.num_hidden_layers
            for model in (lean, modules):
                attn = model.model.layers[2].self_attn
                plain = torch.nn.Linear(attn.o_proj.in_features, attn.o_proj.out_features, bias=False,
                                        dtype=torch.bfloat16)
                plain.weight.copy_(torch.linspace(-0.1, 0.1, plain.weight.numel()).view_as(plain.weight))
                attn.o_proj = plain
            taken.clear()
            got, want = _steps(lean, 2), _steps(modules, 2)
        assert sum(taken) == 2 * (lean.config.num_hidden_layers - 1)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        layer = weakref.ref(lean.model.layers[0])
    finally:
        lean.colibri_close()
        modules.colibri_close()
    del lean, modules
    gc.collect()
    assert layer() is None


def test_a_forward_of_a_modules_own_is_not_skipped(tmp_path_factory: pytest.TempPathFactory,
                                                   taken: list[bool]) -> None:
    """A router or a norm whose forward someone wrapped after loading: the
    layer's own forward runs, and so does the wrapper, at every step."""
    path = write_tiny_moe(str(tmp_path_factory.mktemp("decode-layers-wrapped")), "qwen3_moe", hidden_size=64,
                          seed=10)
    lean = hf.from_pretrained(path, torch_dtype=torch.bfloat16)
    modules = hf.from_pretrained(path, torch_dtype=torch.bfloat16, decode_layers=False)
    calls: list[str] = []

    def wrap(module: Any, name: str) -> None:
        native = module.forward

        def wrapped(x: Any) -> Any:
            calls.append(name)
            return native(x)

        module.forward = wrapped

    try:
        for model in (lean, modules):
            wrap(model.model.layers[0].mlp.gate, "router")
            wrap(model.model.layers[1].self_attn.q_norm, "q_norm")
        with torch.no_grad():
            got, want = _steps(lean, 2), _steps(modules, 2)
    finally:
        lean.colibri_close()
        modules.colibri_close()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    layers = lean.config.num_hidden_layers
    assert sum(taken) == 2 * (layers - 2)        # the two steps of the layers not wrapped
    assert calls.count("router") == calls.count("q_norm") == 2 * 3      # both models, the prompt and 2 steps


@pytest.mark.parametrize("how", ["parameter", "data"])
def test_weights_replaced_between_steps_are_the_ones_read(case: tuple[Any, Any, Any], taken: list[bool],
                                                          how: str) -> None:
    """A norm's, a projection's and a router's weight replaced after a step
    (a new Parameter, or new memory under the same one): the next steps
    read the new weights, on the lean path, and give the modules' bits."""
    lean, modules, _ = case

    def replace(model: Any) -> list[tuple[Any, Any, Any]]:
        layer = model.model.layers[1]
        olds = []
        for module in (layer.input_layernorm, layer.self_attn.q_proj, layer.mlp.gate):
            if "packed" in vars(module):
                continue    # a packed projection computes from the checkpoint's bytes, not a weight
            old = module.weight
            new = (old.detach() * -0.75).contiguous()
            olds.append((module, old, old.data))    # put back exactly, for the module's other tests
            if how == "parameter":
                module.weight = torch.nn.Parameter(new, requires_grad=False)
            else:
                old.data = new
        return olds

    def restore(olds: list[tuple[Any, Any, Any]]) -> None:
        for module, old, data in olds:
            old.data = data
            module.weight = old

    with torch.no_grad():
        before = _steps(lean, 2)
        changed = [replace(m) for m in (lean, modules)]
        taken.clear()
        try:
            got, want = _steps(lean, 2), _steps(modules, 2)
        finally:
            for olds in changed:
                restore(olds)
    assert not torch.equal(got[-1], before[-1])
    assert sum(taken) == 2 * lean.config.num_hidden_layers
    for a, b in zip(got, want):
        assert torch.equal(a, b)
