""":func:`from_pretrained`: a transformers model whose routed experts a
colibri store serves, and the ways back from the model to its store."""

from __future__ import annotations

import os
from typing import Any

from colibri.errors import ColibriError, FormatError
from colibri.hf.accept import (ACCEPTED_QUANT_METHODS, IMPLEMENTATION, SUPPORTED_MODEL_TYPES,
                               UnsupportedModelError, check_quantization, read_config)
from colibri.hf.attention import use_decode_sdpa
from colibri.hf.decode_layers import use_decode_layers
from colibri.hf.kv_cache import grow_given_cache
from colibri.hf.linears import pack_linears as swap_packed_linears
from colibri.hf.linears import use_decode_linears
from colibri.hf.norms import use_decode_norms
from colibri.hf.rotary import use_decode_rotary
from colibri.hf.routers import use_decode_routers
from colibri.hf.loaders import register
from colibri.hf.runtime import KERNELS, DecodeThreads, OneTokenBlas, RouterPilot, Runtime, experts_modules
from colibri.store import Store, open_store

__all__ = ["from_pretrained", "module_parent_gate", "runtime_of", "store_of"]

_PREFETCH_CHOICES = ("pilot", "off", None)


def from_pretrained(
    path: str | os.PathLike[str],
    *,
    capacity_bytes: int | str | None = None,
    slots_per_layer: int | None = None,
    prefetch: str | None = "pilot",
    prefetch_workers: int = 2,
    direct_io: bool | None = None,
    torch_dtype: Any = None,
    kernels: str = "native",
    decode_blas: bool = True,
    pack_linears: bool = True,
    decode_attention: bool = True,
    decode_linears: bool = True,
    decode_threads: bool = True,
    decode_norms: bool = True,
    decode_routers: bool = True,
    decode_rotary: bool = True,
    decode_layers: bool = True,
    grow_kv_cache: bool = True,
    **store_options: Any,
) -> Any:
    """The transformers model of the checkpoint at ``path`` with its routed
    experts served by a colibri store.

    ``capacity_bytes`` / ``slots_per_layer`` are the store's budget (at most
    one; neither: the store's default; ``capacity_bytes="auto"`` fills the
    memory left, see :func:`colibri.open_store`), ``prefetch="pilot"`` turns PILOT on,
    ``"off"`` or None off (the store then starts no I/O workers, whatever
    ``prefetch_workers`` says), ``direct_io`` reads with O_DIRECT,
    ``torch_dtype`` is transformers' ``dtype`` (None: what
    ``AutoModelForCausalLM.from_pretrained`` picks). ``kernels="native"``
    (the default) computes every routed expert with colibri's kernels
    straight from its slot, whatever its format, and every other linear
    layer the checkpoint stores as pack-quantized int4 or block-scaled FP8
    straight from those bytes (:func:`~colibri.hf.linears.pack_linears`);
    ``"torch"`` dequantizes each leased expert into torch tensors and runs
    the module's own code, and keeps the loader's float linear layers (the
    path before the kernels, for comparison and as a fallback);
    ``pack_linears=False`` keeps those float layers with the native experts.
    ``decode_blas`` (a bfloat16 model, torch with MKL): a forward of one
    token runs with oneDNN off, so its bfloat16 linear layers take MKL's
    matrix-vector product (:class:`~colibri.hf.runtime.OneTokenBlas`).
    ``decode_attention`` (a model with transformers' SDPA attention): its
    one-token steps of grouped-query attention run over the key/value heads,
    natively with ``kernels="native"``
    (:func:`~colibri.hf.attention.decode_sdpa`), with torch's SDPA otherwise
    (:func:`~colibri.hf.attention.grouped_sdpa`). ``decode_linears`` (with
    ``kernels="native"``): the linear layers left in float32 or bfloat16
    compute forwards of up to 4 rows without autograd with colibri's kernel
    on their own weights (:func:`~colibri.hf.linears.use_decode_linears`),
    larger ones with torch. ``decode_threads`` (with ``kernels="native"``):
    such a forward of up to 4 rows runs torch's own ops on one thread and
    colibri's kernels on ``torch.get_num_threads()``
    (:class:`~colibri.hf.runtime.DecodeThreads`). ``decode_norms`` (with
    ``kernels="native"``): RMS norms of transformers' two usual formulas
    compute such a forward in one native call
    (:func:`~colibri.hf.norms.use_decode_norms`). ``decode_routers`` (with
    ``kernels="native"``): softmax top-k routers route such a forward with
    colibri's kernels (:func:`~colibri.hf.routers.use_decode_routers`).
    ``decode_rotary`` (with ``kernels="native"``): transformers' usual
    rotary embedding function of the model's modeling module computes
    one-token calls natively, the same bits, for every model of that
    family in the process (:func:`~colibri.hf.rotary.use_decode_rotary`).
    ``decode_layers`` (with ``kernels="native"``): the decoder layers of a
    family :mod:`colibri.hf.decode_layers` knows compute a one-token step
    in one lean forward that calls the same native functions on buffers it
    keeps, the same bits (:func:`~colibri.hf.decode_layers.use_decode_layers`).
    ``grow_kv_cache``: a transformers ``DynamicCache`` given to the model's
    forward (as ``generate`` gives it) appends each step's keys and values
    in place instead of copying the whole cache
    (:mod:`colibri.hf.kv_cache`); the same values.
    Other keywords go to :func:`colibri.open_store`.

    Everything is checked and the store opened before transformers loads a
    weight; on any error nothing is left open. Close the store with
    ``model.colibri_close()`` or ``with colibri.hf.store_of(model): ...``.
    """
    path = os.fspath(path)
    if prefetch not in _PREFETCH_CHOICES:
        raise FormatError(f"prefetch must be 'pilot', 'off' or None, not {prefetch!r}")
    pilot_on = prefetch == "pilot"
    if kernels not in KERNELS:
        raise FormatError(f"kernels must be one of {', '.join(KERNELS)}, not {kernels!r}")
    if "layout" in store_options:
        raise FormatError("colibri.hf chooses the layout from the checkpoint; do not pass layout")
    method = check_quantization(path, read_config(path))
    loader = ACCEPTED_QUANT_METHODS[method].loader
    configs = register()
    if loader not in configs:
        raise UnsupportedModelError(
            f"{path}: loading {method!r} checkpoints needs the {method} package "
            f"(pip install {method}), which transformers' {method} loader imports")
    options: dict[str, Any] = dict(store_options)
    for key, value in (("capacity_bytes", capacity_bytes), ("slots_per_layer", slots_per_layer),
                       ("direct_io", direct_io)):
        if value is not None:
            options[key] = value
    options["prefetch_workers"] = prefetch_workers if pilot_on else 0
    store = open_store(path, **options)
    try:
        model = _load(path, configs[loader], loader, torch_dtype)
        _attach(path, model, store, pilot_on, kernels)
        if kernels == "native" and pack_linears:
            model.colibri.packed_linears = swap_packed_linears(model, path)
        if kernels == "native" and decode_linears:
            model.colibri.decode_linears = use_decode_linears(model)
        if kernels == "native" and decode_norms:
            model.colibri.decode_norms = use_decode_norms(model)
        if kernels == "native" and decode_routers:
            model.colibri.decode_routers = use_decode_routers(model)
        if kernels == "native" and decode_rotary:
            model.colibri.decode_rotary = use_decode_rotary(model)
        if kernels == "native" and decode_layers:
            model.colibri.decode_layers = use_decode_layers(model)
        if decode_blas and OneTokenBlas.wanted(model):
            hooks = OneTokenBlas()
            model.register_forward_pre_hook(hooks.before, with_kwargs=True)
            model.register_forward_hook(hooks.after, with_kwargs=True, always_call=True)
            model.colibri.decode_blas = True
        if kernels == "native" and decode_threads:
            threads = DecodeThreads()
            model.register_forward_pre_hook(threads.before, with_kwargs=True)
            model.register_forward_hook(threads.after, with_kwargs=True, always_call=True)
            model.colibri.decode_threads = True
        if decode_attention:
            use_decode_sdpa(model, native=kernels == "native")
        if grow_kv_cache:
            model.register_forward_pre_hook(grow_given_cache, with_kwargs=True)
            model.colibri.grow_kv_cache = True
        return model
    except BaseException:
        store.close()
        raise


def _load(path: str, config_cls: Any, loader: str, torch_dtype: Any) -> Any:
    """The model transformers loads with the loading hook ``loader``, whose config class is ``config_cls``."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    quant_cfg = getattr(config, "quantization_config", None)
    if loader == IMPLEMENTATION:
        # A float checkpoint, or gpt-oss MXFP4 where only the routed experts
        # are quantized (transformers converts nothing else): they are
        # dequantized per lease by colibri, everything else is float.
        load_config = config_cls()
    else:
        # FP8 or compressed-tensors: the experts are dequantized per lease by
        # colibri, everything else by transformers' own loader at load time.
        assert quant_cfg is not None
        quant_options = dict(quant_cfg if isinstance(quant_cfg, dict) else quant_cfg.to_dict())
        for key in ("quant_method", "dequantize"):
            quant_options.pop(key, None)
        load_config = config_cls(**quant_options)
    if quant_cfg is not None:
        del config.quantization_config
    kwargs: dict[str, Any] = {"config": config, "experts_implementation": IMPLEMENTATION,
                              "quantization_config": load_config}
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    model_cls = getattr(transformers, SUPPORTED_MODEL_TYPES[config.model_type])
    return model_cls.from_pretrained(path, **kwargs)


def _attach(path: str, model: Any, store: Store, pilot_on: bool, kernels: str) -> None:
    """Binds the model's experts modules to a :class:`Runtime` over ``store``,
    after checking that the model and the checkpoint agree on them."""
    experts = experts_modules(model)
    moe_layers = tuple(sorted(experts))
    if moe_layers != store.layers:
        raise FormatError(
            f"{path}: the model's MoE layers {list(moe_layers)} differ from the layers "
            f"with routed experts in the checkpoint {list(store.layers)}")
    for layer, module in experts.items():
        n = int(getattr(module, "num_experts"))
        if n != store.num_experts(layer):
            raise FormatError(f"{path}: layer {layer} has {store.num_experts(layer)} experts "
                              f"in the checkpoint but {n} in config.json")
    pilot = None
    if pilot_on:
        gates = {layer: module_parent_gate(model, layer) for layer in moe_layers}
        top_k = {layer: int(g.top_k) for layer, g in gates.items()}
        pilot = RouterPilot(store, gates, top_k)
    runtime = Runtime(store, pilot, moe_layers, kernels)
    for layer, module in experts.items():
        module.colibri_binding = (runtime, layer)
    model.colibri = runtime
    model.colibri_close = runtime.close


def module_parent_gate(model: Any, layer: int) -> Any:
    """The router module of MoE layer ``layer`` (``layers[layer].mlp.gate``,
    or ``.mlp.router`` as gpt-oss names it)."""
    ends = (f"layers.{layer}.mlp.gate", f"layers.{layer}.mlp.router")
    for name, module in model.named_modules():
        if name.endswith(ends) and hasattr(module, "weight"):
            return module
    raise FormatError(f"layer {layer}: no router module at layers.{layer}.mlp.gate or .mlp.router")


def runtime_of(model: Any) -> Runtime:
    """The :class:`Runtime` that :func:`from_pretrained` attached to ``model``."""
    runtime = getattr(model, "colibri", None)
    if not isinstance(runtime, Runtime):
        raise ColibriError("this model was not made by colibri.hf.from_pretrained")
    return runtime


def store_of(model: Any) -> Store:
    """The :class:`colibri.Store` serving ``model``'s routed experts (stats,
    ``close()``; usable as a context manager that closes it)."""
    return runtime_of(model).store
