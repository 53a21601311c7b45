"""Run a transformers MoE model with its routed experts streamed by colibri.

    import colibri.hf
    model = colibri.hf.from_pretrained("path/to/model", slots_per_layer=8)
    out = model.generate(**tokenizer("Hello", return_tensors="pt"), max_new_tokens=32)
    model.colibri_close()            # or: with colibri.hf.store_of(model): ...

:func:`from_pretrained` returns the ordinary ``PreTrainedModel`` that
``AutoModelForCausalLM.from_pretrained`` returns for the checkpoint, built by
transformers itself, with two of transformers' own extension points:

* a loading hook registered as a quantization method (``quant_method =
  "colibri"``, through ``register_quantizer`` / ``register_quantization_config``)
  that, on the meta-device skeleton and before any weight is read, removes the
  routed experts' fused parameters (``gate_up_proj``, ``down_proj``). transformers
  then loads every other tensor as usual and skips the experts' tensors as keys
  the model does not have, so no routed expert is ever read or allocated at load;
* an experts implementation registered in ``ExpertsInterface`` under
  ``"colibri"`` and selected with ``experts_implementation="colibri"``. Each MoE
  block's router stays the model's own; its experts module calls colibri's
  forward, which leases the union of the experts the batch chose
  (``Store.lease_many``), in groups that fit the layer's slots, computes them
  and releases them before returning.

PILOT: while MoE layer L runs, the next MoE layer's own router module is
applied to layer L's router input and the experts it names are prefetched,
right after layer L's own experts are leased. Its precision and recall are
those of :class:`colibri.Pilot` (``colibri.hf.runtime_of(model).pilot.report()``).

Block-scaled FP8 checkpoints (``quant_method: fp8``) load through
transformers' FP8 loader in dequantize mode, subclassed the same way: the
non-expert weights are dequantized at load, each routed expert when leased.
gpt-oss MXFP4 checkpoints (``quant_method: mxfp4``) quantize only the routed
experts, so the rest loads as a float checkpoint and each expert is
dequantized when leased. compressed-tensors checkpoints whose routed experts
are ``pack-quantized`` int4 load through transformers' compressed-tensors
loader in its dequantize mode (whatever else the checkpoint quantizes is
dequantized at load by compressed-tensors' own code), minus the routed
experts, each dequantized when leased. :data:`ACCEPTED_QUANT_METHODS` is the
table of the ``quant_method`` values accepted.

Supported: transformers 5.x with the experts interface (tested on 5.24), and
the architectures in :data:`SUPPORTED_MODEL_TYPES`. See docs/hf.md.
"""

from __future__ import annotations

import operator
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from colibri.checkpoint.config import CONFIG_NAME, compressed_tensors_group, read_json
from colibri.errors import ColibriError, FormatError
from colibri.pilot import Pilot
from colibri.store import Store, open_store
from colibri.torch_interop import as_torch, dequantize_torch

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ACCEPTED_QUANT_METHODS",
    "QuantMethod",
    "UnsupportedModelError",
    "LayerProgress",
    "Runtime",
    "from_pretrained",
    "store_of",
    "runtime_of",
]

#: config.json ``model_type`` values colibri.hf runs, and the transformers class of each.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}

#: Architectures transformers has whose routed experts colibri.hf cannot serve, and why.
UNSUPPORTED_MOE_TYPES: dict[str, str] = {
    "llama4": "transformers' Llama 4 experts module does not dispatch through its experts "
              "interface (it runs every expert on every token, pre-weighted by the router), "
              "so there is no hook where colibri could serve them",
    "llama4_text": "transformers' Llama 4 experts module does not dispatch through its experts "
                   "interface (it runs every expert on every token, pre-weighted by the router), "
                   "so there is no hook where colibri could serve them",
}

#: The transformers versions colibri.hf supports (the experts interface and fused experts of 5.x).
SUPPORTED_TRANSFORMERS = ">=5.24,<6"

IMPLEMENTATION = "colibri"
FP8_IMPLEMENTATION = "colibri_fp8"
CT_IMPLEMENTATION = "colibri_compressed_tensors"
_EXPERTS_PATH = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts$")
_EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias",
                  "gate_up_proj_scale_inv", "down_proj_scale_inv")
_SKIPPED_KEYS = r"(^|\.)layers\.\d+\.mlp\.experts\.(\d+\.)?(gate_up_proj|down_proj|gate_proj|up_proj|w1|w2|w3)"
_PREFETCH_CHOICES = ("pilot", "off", None)


class UnsupportedModelError(FormatError):
    """The checkpoint is not a MoE architecture colibri.hf runs (or transformers is too old)."""


def _supported_list() -> str:
    return ", ".join(sorted(SUPPORTED_MODEL_TYPES))


@dataclass(frozen=True)
class QuantMethod:
    """How :func:`from_pretrained` loads checkpoints of one config.json
    ``quantization_config.quant_method``.

    ``check(path, config)`` raises :class:`UnsupportedModelError` for a
    variant colibri cannot serve; it runs before the store opens or
    transformers reads anything. ``loader`` names the loading hook:
    ``"colibri"`` (the non-expert weights are a float checkpoint; the
    checkpoint's ``quantization_config`` is dropped from the model config),
    ``"colibri_fp8"`` (transformers' FP8 loader dequantizing at load) or
    ``"colibri_compressed_tensors"`` (transformers' compressed-tensors loader
    dequantizing at load). ``summary`` says what is accepted, for errors and docs.
    """

    summary: str
    check: Callable[[str, dict[str, Any]], None]
    loader: str


def _check_nothing(path: str, cfg: dict[str, Any]) -> None:
    del path, cfg


def _check_mxfp4(path: str, cfg: dict[str, Any]) -> None:
    if cfg.get("model_type") != "gpt_oss":
        raise UnsupportedModelError(
            f"{path}: quantization 'mxfp4' is only supported for 'gpt_oss', not {cfg.get('model_type')!r}")


#: The compressed-tensors weight strategies whose scales colibri reads (one per group of columns).
CT_STRATEGIES = ("group", "channel")


def _check_compressed_tensors(path: str, cfg: dict[str, Any]) -> None:
    where = f"{path}: compressed-tensors quantization_config"
    found = compressed_tensors_group(cfg["quantization_config"])
    if found is None:
        raise UnsupportedModelError(f"{where} has no config_groups")
    where = f"{where} group {found.name!r} (the routed experts' group)"
    fmt = found.format
    if fmt != "pack-quantized":
        raise UnsupportedModelError(
            f"{where}: format {fmt!r} is not supported; colibri.hf serves routed experts in "
            "'pack-quantized' int4")
    group = found.group
    weights = found.weights
    if not isinstance(weights, dict):
        raise UnsupportedModelError(f"{where} quantizes no weights")
    bits, kind, strategy = weights.get("num_bits"), weights.get("type", "int"), weights.get("strategy")
    if bits != 4 or kind != "int":
        raise UnsupportedModelError(
            f"{where}: {bits}-bit {kind} weights are not supported; colibri reads 4-bit int "
            "pack-quantized experts")
    if strategy not in CT_STRATEGIES:
        raise UnsupportedModelError(
            f"{where}: weight strategy {strategy!r} is not supported; colibri reads "
            + " and ".join(repr(s) for s in CT_STRATEGIES) + " scales")
    if weights.get("actorder") not in (None, False, "static"):
        raise UnsupportedModelError(
            f"{where}: activation ordering {weights.get('actorder')!r} (weight_g_idx) is not supported")
    if weights.get("dynamic") not in (None, False):
        raise UnsupportedModelError(f"{where}: dynamic weight quantization is not supported")
    if group.get("input_activations") is not None:
        raise UnsupportedModelError(
            f"{where}: quantized input activations are not supported (colibri computes the "
            "experts on float inputs: weight-only schemes such as W4A16)")


#: config.json ``quantization_config.quant_method`` values :func:`from_pretrained`
#: accepts (None: a float checkpoint), and how each loads. Another method
#: (a format the store reads) is accepted by adding its entry here.
ACCEPTED_QUANT_METHODS: dict[str | None, QuantMethod] = {
    None: QuantMethod("float checkpoints (f32, bf16, f16)", _check_nothing, IMPLEMENTATION),
    "fp8": QuantMethod("block-scaled FP8 (weight_scale_inv, as DeepSeek-V3 ships)", _check_nothing,
                       FP8_IMPLEMENTATION),
    "mxfp4": QuantMethod("gpt-oss's MXFP4 experts", _check_mxfp4, IMPLEMENTATION),
    "compressed-tensors": QuantMethod(
        "compressed-tensors with pack-quantized int4 routed experts (group or channel scales, "
        "symmetric or with zero points)", _check_compressed_tensors, CT_IMPLEMENTATION),
}


def _check_quantization(path: str, cfg: dict[str, Any]) -> str | None:
    """The checkpoint's quant_method, after its entry's check; refuses the others."""
    quant = cfg.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    accepted = ACCEPTED_QUANT_METHODS.get(method) if isinstance(method, (str, type(None))) else None
    if accepted is None:
        raise UnsupportedModelError(
            f"{path}: quantization {method!r} is not supported for {cfg['model_type']!r}; colibri.hf "
            "runs " + "; ".join(q.summary for q in ACCEPTED_QUANT_METHODS.values()))
    accepted.check(path, cfg)
    return method


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise UnsupportedModelError(
            "colibri.hf needs torch and transformers: pip install 'colibri[hf]'") from exc
    major = int(transformers.__version__.split(".")[0])
    try:
        import transformers.integrations.moe as moe_integration
    except ImportError:
        moe_integration = None  # type: ignore[assignment]
    if major < 5 or not hasattr(moe_integration, "ExpertsInterface"):
        raise UnsupportedModelError(
            f"colibri.hf needs transformers {SUPPORTED_TRANSFORMERS} (its experts interface); "
            f"found {transformers.__version__}")
    return transformers


@dataclass(frozen=True)
class LayerProgress:
    """One MoE layer of one forward pass, as :attr:`Runtime.progress` sees it.

    ``position`` counts MoE layers from 0 to ``layers - 1`` within a forward;
    ``tokens`` is how many token rows the layer routed, ``experts`` the size
    of their union and ``groups`` how many slot-sized lease groups it took.
    """

    layer: int
    position: int
    layers: int
    tokens: int
    experts: int
    groups: int


class _RouterPilot(Pilot):
    """A :class:`Pilot` that predicts with the model's own router modules
    (softmax top-k, or sigmoid with bias and expert groups), so the
    prediction is exactly what layer L+1 would choose for layer L's input."""

    def __init__(self, store: Store, gates: dict[int, Any], top_k: dict[int, int]) -> None:
        routers = {layer: gate.weight.detach().float().cpu().numpy() for layer, gate in gates.items()}
        super().__init__(store, routers, top_k=max(top_k.values()), extra=0)
        self._gates = gates

    def predict(self, layer: int, hidden: Any) -> tuple[int, ...]:
        gate = self._gates.get(operator.index(layer))
        if gate is None or hidden.shape[0] == 0:
            return ()
        import torch

        with torch.no_grad():
            _, _, index = gate(hidden)
        chosen, votes = torch.unique(index, return_counts=True)
        order = torch.argsort(votes, descending=True, stable=True)
        return tuple(int(e) for e in chosen[order].tolist())


class Runtime:
    """What :func:`from_pretrained` attached to a model: the store, the
    PILOT (None when prefetch is off), and hooks for progress and routing
    traces. Reach it with :func:`runtime_of`."""

    def __init__(self, store: Store, pilot: _RouterPilot | None, moe_layers: tuple[int, ...]) -> None:
        self.store = store
        self.pilot = pilot
        self.moe_layers = moe_layers
        self._position = {layer: i for i, layer in enumerate(moe_layers)}
        #: Called after each MoE layer with a :class:`LayerProgress` (e.g. a prefill progress bar).
        self.progress: Callable[[LayerProgress], None] | None = None
        #: Called with (layer, top_k_index (tokens, k) int64 numpy, top_k_weights float32 numpy).
        self.routing: Callable[[int, np.ndarray, np.ndarray], None] | None = None
        self._predicted: dict[int, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the store (idempotent). The model cannot run its MoE layers afterwards."""
        self.store.close()

    @property
    def closed(self) -> bool:
        return self.store.closed

    # -- the experts forward --

    def _order(self, layer: int, union: list[int]) -> list[int]:
        # Experts PILOT predicted for this layer first: they are the likeliest
        # to be resident, so they are used before later groups evict anything.
        predicted = self._predicted.pop(layer, ())
        if not predicted:
            return union
        wanted = set(union)
        first = [e for e in predicted if e in wanted]
        rest = [e for e in union if e not in set(first)]
        return first + rest

    def experts_forward(self, module: Any, layer: int, hidden_states: Any, top_k_index: Any,
                        top_k_weights: Any) -> Any:
        import torch
        store = self.store
        if store.closed:
            raise ColibriError(f"layer {layer}: the model's colibri store is closed "
                               "(colibri_close() was called)")
        tokens, k = top_k_index.shape
        hidden_dim = hidden_states.shape[-1]
        if self.routing is not None:
            self.routing(layer, top_k_index.detach().cpu().numpy().astype(np.int64),
                         top_k_weights.detach().float().cpu().numpy())
        # Which (token, position) pairs chose each expert, in one pass over a
        # small host list (cheaper than a torch.where per expert at decode).
        rows: dict[int, tuple[list[int], list[int]]] = {}
        for t, chosen in enumerate(top_k_index.tolist()):
            for j, e in enumerate(chosen):
                r = rows.get(e)
                if r is None:
                    r = rows[e] = ([], [])
                r[0].append(t)
                r[1].append(j)
        union = sorted(rows)
        pilot = self.pilot
        if pilot is not None:
            pilot.observe(layer, union)
        order = self._order(layer, union)
        slots = store.slots(layer)
        groups = [order[i:i + slots] for i in range(0, len(order), slots)]
        out_dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
        out = torch.zeros(tokens, k, hidden_dim, dtype=out_dtype, device=hidden_states.device)
        ffn = _expert_ffn(module)
        compute_dtype = hidden_states.dtype
        for g, group in enumerate(groups):
            with store.lease_many(layer, group) as leased:
                if g == 0 and pilot is not None:
                    nxt = pilot.next_layer(layer)
                    if nxt is not None:
                        predicted = pilot.predict_next(layer, hidden_states)
                        self._predicted[nxt] = predicted
                for ex in leased:
                    ts, js = rows[ex.key[1]]
                    weights = _weights(ex, compute_dtype)
                    if len(ts) == 1:
                        t, j = ts[0], js[0]
                        x = hidden_states[t:t + 1]
                        y = ffn(x, *weights)
                        # a 1-element weight, not a 0-d one: bf16 * f32 must promote as in transformers
                        out[t, j] = (y[0] * top_k_weights[t, j:j + 1]).to(out_dtype)
                    else:
                        token_idx = torch.tensor(ts, device=hidden_states.device)
                        pos = torch.tensor(js, device=hidden_states.device)
                        x = hidden_states[token_idx]
                        y = ffn(x, *weights)
                        out[token_idx, pos] = (y * top_k_weights[token_idx, pos, None]).to(out_dtype)
                    del weights
        if self.progress is not None:
            self.progress(LayerProgress(layer, self._position[layer], len(self.moe_layers),
                                        tokens, len(union), len(groups)))
        return out.sum(dim=1).to(hidden_states.dtype)


_Weights = tuple[Any, Any, Any, Any, Any, Any]


def _weights(ex: Any, dtype: Any) -> _Weights:
    """gate, up, down and their biases (None where the checkpoint has none)
    of a leased expert as torch tensors of ``dtype``, in the Mixtral
    orientation: the leased bytes themselves where the file has them so,
    otherwise dequantized (fused or (in, out) layouts, FP8, MXFP4, int4,
    GPTQ, AWQ, biases) into fresh tensors that live only for this expert."""
    info = ex.tensors
    if not info.format.zero_copy or info.fused or info.transposed or info.biased:
        w = dequantize_torch(ex)
        gate, up, down = (w[role].to(dtype) for role in ("gate", "up", "down"))
        biases = (w.get(f"{role}_bias") for role in ("gate", "up", "down"))
        gate_b, up_b, down_b = (None if b is None else b.to(dtype) for b in biases)
        return gate, up, down, gate_b, up_b, down_b
    gate, up, down = (_weight(ex, role, dtype) for role in ("gate", "up", "down"))
    return gate, up, down, None, None, None


def _expert_ffn(module: Any) -> Callable[..., Any]:
    """One expert's computation as ``module`` defines it: x -> down(gate(x) ... up(x)).

    Modules with transformers' default gating (``act_fn(gate) * up``) take
    the direct path; a module with its own ``_apply_gate`` (gpt-oss's clamped
    SwiGLU with ``up + 1``) gets the gate and up projections assembled in its
    own layout (interleaved or concatenated) and gates them itself."""
    import torch
    import torch.nn.functional as F

    custom = getattr(type(module), "_apply_gate", None)
    if custom is not None and custom is not _default_apply_gate():
        interleaved = not getattr(module, "is_concatenated", True)
        apply_gate = module._apply_gate

        def gated(x: Any, gate: Any, up: Any, down: Any, gate_b: Any, up_b: Any, down_b: Any) -> Any:
            g, u = F.linear(x, gate, gate_b), F.linear(x, up, up_b)
            gate_up = torch.stack((g, u), dim=-1).flatten(-2) if interleaved else torch.cat((g, u), dim=-1)
            return F.linear(apply_gate(gate_up), down, down_b)

        return gated
    act = module.act_fn

    def plain(x: Any, gate: Any, up: Any, down: Any, gate_b: Any, up_b: Any, down_b: Any) -> Any:
        return F.linear(act(F.linear(x, gate, gate_b)) * F.linear(x, up, up_b), down, down_b)

    return plain


def _default_apply_gate() -> Any:
    """transformers' default gating function (None where it has none)."""
    from transformers.integrations import moe

    return getattr(moe, "_default_apply_gate", None)


def _weight(ex: Any, role: str, dtype: Any) -> Any:
    """A leased float role as a torch tensor of ``dtype``: shared when the
    file already has that dtype, otherwise converted into a fresh tensor
    that lives only for this expert."""
    t = as_torch(getattr(ex, role))
    return t if t.dtype == dtype else t.to(dtype)


def _colibri_experts_forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """The ``"colibri"`` entry of transformers' ``ExpertsInterface``."""
    binding = getattr(self, "colibri_binding", None)
    if binding is None:
        raise ColibriError(
            "experts_implementation='colibri' needs a model made by colibri.hf.from_pretrained")
    runtime, layer = binding
    return runtime.experts_forward(self, layer, hidden_states, top_k_index, top_k_weights)


def _experts_modules(model: Any) -> dict[int, Any]:
    found: dict[int, Any] = {}
    for name, module in model.named_modules():
        m = _EXPERTS_PATH.search(name)
        if m is not None and (hasattr(module, "act_fn") or hasattr(module, "_apply_gate")):
            found[int(m.group(1))] = module
    return found


# -- registration with transformers (once per process) --

_registered = False
_register_lock = threading.Lock()


def _register() -> dict[str, Any]:
    """Register the experts implementation and the loading hooks; return
    transformers' table of loading config classes (by quant_method)."""
    global _registered
    transformers = _transformers()
    from transformers.integrations.moe import ExpertsInterface
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
        register_quantization_config,
        register_quantizer,
    )
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    del transformers
    with _register_lock:
        if not _registered:
            ExpertsInterface.register(IMPLEMENTATION, _colibri_experts_forward)

            class ColibriLoadConfig(QuantizationConfigMixin):
                """Marks a load by colibri.hf: routed experts stay in the store."""

                def __init__(self, **kwargs: Any) -> None:
                    self.quant_method = IMPLEMENTATION  # type: ignore[assignment]

                def to_dict(self) -> dict[str, Any]:
                    return {"quant_method": IMPLEMENTATION}

            class ColibriLoader(HfQuantizer):
                """Removes the routed experts' parameters from the meta skeleton
                before transformers reads any weight, so their tensors are never
                loaded; everything else loads as transformers loads it."""

                requires_calibration = False

                def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> Any:
                    _drop_routed_experts(model)
                    return model

                def is_serializable(self) -> bool:
                    return False

                @property
                def is_trainable(self) -> bool:
                    return False

            from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
            from transformers.utils.quantization_config import FineGrainedFP8Config

            class ColibriFP8LoadConfig(FineGrainedFP8Config):
                """A block-scaled FP8 checkpoint loaded by colibri.hf: transformers
                dequantizes the non-expert weights on load (as it does on a CPU),
                the routed experts stay FP8 in the store."""

                def __init__(self, **kwargs: Any) -> None:
                    kwargs["quant_method"] = FP8_IMPLEMENTATION
                    kwargs["dequantize"] = True
                    super().__init__(**kwargs)

            class ColibriFP8Loader(FineGrainedFP8HfQuantizer):
                """transformers' FP8 loader in dequantize mode, minus the routed experts."""

                def __init__(self, quantization_config: Any, **kwargs: Any) -> None:
                    kwargs["pre_quantized"] = True      # the checkpoint is FP8
                    super().__init__(quantization_config, **kwargs)

                def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> Any:
                    super()._process_model_before_weight_loading(model, **kwargs)
                    _drop_routed_experts(model)
                    return model

            loaders: list[tuple[str, Any, Any]] = [
                (IMPLEMENTATION, ColibriLoadConfig, ColibriLoader),
                (FP8_IMPLEMENTATION, ColibriFP8LoadConfig, ColibriFP8Loader)]
            ct = _compressed_tensors_loader()
            if ct is not None:
                loaders.append((CT_IMPLEMENTATION, *ct))
            for name, config_cls, loader_cls in loaders:
                if name not in AUTO_QUANTIZATION_CONFIG_MAPPING:
                    register_quantization_config(name)(config_cls)
                if name not in AUTO_QUANTIZER_MAPPING:
                    register_quantizer(name)(loader_cls)
            _registered = True
    return AUTO_QUANTIZATION_CONFIG_MAPPING


def _compressed_tensors_loader() -> tuple[Any, Any] | None:
    """transformers' compressed-tensors config and loader, subclassed: dequantize
    mode, minus the routed experts. None when compressed-tensors is not installed."""
    try:
        import compressed_tensors  # noqa: F401
        from transformers.quantizers.quantizer_compressed_tensors import CompressedTensorsHfQuantizer
        from transformers.utils.quantization_config import CompressedTensorsConfig
    except ImportError:
        return None

    class ColibriCTLoadConfig(CompressedTensorsConfig):
        """A compressed-tensors checkpoint loaded by colibri.hf: transformers
        dequantizes whatever non-expert weights it quantizes on load, with
        compressed-tensors' own code; the routed experts stay in the store."""

        def __init__(self, **kwargs: Any) -> None:
            kwargs["quant_method"] = "compressed-tensors"
            kwargs["dequantize"] = True
            kwargs.pop("run_compressed", None)
            kwargs.pop("use_optimized_inference", None)
            super().__init__(**kwargs)
            self.quant_method = CT_IMPLEMENTATION  # type: ignore[assignment]

    class ColibriCTLoader(CompressedTensorsHfQuantizer):
        """transformers' compressed-tensors loader in dequantize mode, minus the routed experts."""

        def __init__(self, quantization_config: Any, **kwargs: Any) -> None:
            kwargs["pre_quantized"] = True      # the checkpoint is compressed
            super().__init__(quantization_config, **kwargs)

        def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> Any:
            super()._process_model_before_weight_loading(model, **kwargs)
            _drop_routed_experts(model)
            return model

        def is_serializable(self) -> bool:
            return False

    return ColibriCTLoadConfig, ColibriCTLoader


def _drop_routed_experts(model: Any) -> None:
    """On the meta skeleton: remove the routed experts' parameters so that
    transformers neither reads nor allocates them."""
    for module in _experts_modules(model).values():
        for name in _EXPERT_PARAMS:
            if name in module._parameters:
                del module._parameters[name]
        # Nothing left for transformers' weight init to fill in.
        module._is_hf_initialized = True
    # The checkpoint's expert tensors are skipped on purpose: no warning.
    ignored = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    ignored.add(_SKIPPED_KEYS)
    model._keys_to_ignore_on_load_unexpected = ignored


# -- the public entry points --

def _read_config(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise UnsupportedModelError(f"{path}: not a model directory")
    cfg_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        raise UnsupportedModelError(f"{path}: no config.json, not a transformers checkpoint")
    cfg = read_json(cfg_path, UnsupportedModelError)
    if not isinstance(cfg, dict):
        raise UnsupportedModelError(f"{cfg_path}: not a JSON object")
    model_type = cfg.get("model_type")
    if model_type in UNSUPPORTED_MOE_TYPES:
        raise UnsupportedModelError(
            f"{path}: model_type {model_type!r} is not supported: {UNSUPPORTED_MOE_TYPES[model_type]}; "
            f"supported: {_supported_list()}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{path}: model_type {model_type!r} is not a MoE architecture colibri.hf runs; "
            f"supported: {_supported_list()}")
    return cfg


def from_pretrained(
    path: str | os.PathLike[str],
    *,
    capacity_bytes: int | None = None,
    slots_per_layer: int | None = None,
    prefetch: str | None = "pilot",
    prefetch_workers: int = 2,
    direct_io: bool | None = None,
    torch_dtype: Any = None,
    **store_options: Any,
) -> Any:
    """The transformers model of the checkpoint at ``path`` with its routed
    experts served by a colibri store.

    ``capacity_bytes`` / ``slots_per_layer`` are the store's budget (at most
    one; neither: the store's default), ``prefetch="pilot"`` turns PILOT on,
    ``"off"`` or None off (the store then starts no I/O workers, whatever
    ``prefetch_workers`` says), ``direct_io`` reads with O_DIRECT,
    ``torch_dtype`` is transformers' ``dtype`` (None: what
    ``AutoModelForCausalLM.from_pretrained`` picks). Other keywords go to
    :func:`colibri.open_store`.

    Everything is checked and the store opened before transformers loads a
    weight; on any error nothing is left open. Close the store with
    ``model.colibri_close()`` or ``with colibri.hf.store_of(model): ...``.
    """
    path = os.fspath(path)
    if prefetch not in _PREFETCH_CHOICES:
        raise FormatError(f"prefetch must be 'pilot', 'off' or None, not {prefetch!r}")
    pilot_on = prefetch == "pilot"
    if "layout" in store_options:
        raise FormatError("colibri.hf chooses the layout from the checkpoint; do not pass layout")
    cfg = _read_config(path)
    method = _check_quantization(path, cfg)
    loader = ACCEPTED_QUANT_METHODS[method].loader
    configs = _register()
    if loader not in configs:
        raise UnsupportedModelError(
            f"{path}: loading {method!r} checkpoints needs the {method} package "
            f"(pip install {method}), which transformers' {method} loader imports")
    import torch
    import transformers

    options: dict[str, Any] = dict(store_options)
    if capacity_bytes is not None:
        options["capacity_bytes"] = capacity_bytes
    if slots_per_layer is not None:
        options["slots_per_layer"] = slots_per_layer
    if direct_io is not None:
        options["direct_io"] = direct_io
    options["prefetch_workers"] = prefetch_workers if pilot_on else 0
    store = open_store(path, **options)
    try:
        config = transformers.AutoConfig.from_pretrained(path)
        quant_cfg = getattr(config, "quantization_config", None)
        if loader == IMPLEMENTATION:
            # A float checkpoint, or gpt-oss MXFP4 where only the routed experts
            # are quantized (transformers converts nothing else): they are
            # dequantized per lease by colibri, everything else is float.
            load_config = configs[IMPLEMENTATION]()
        else:
            # FP8 or compressed-tensors: the experts are dequantized per lease by
            # colibri, everything else by transformers' own loader at load time.
            assert quant_cfg is not None
            quant_options = dict(quant_cfg if isinstance(quant_cfg, dict) else quant_cfg.to_dict())
            for key in ("quant_method", "dequantize"):
                quant_options.pop(key, None)
            load_config = configs[loader](**quant_options)
        if quant_cfg is not None:
            del config.quantization_config
        kwargs: dict[str, Any] = {"config": config, "experts_implementation": IMPLEMENTATION,
                                  "quantization_config": load_config}
        if torch_dtype is not None:
            kwargs["dtype"] = torch_dtype
        model_cls = getattr(transformers, SUPPORTED_MODEL_TYPES[config.model_type])
        model = model_cls.from_pretrained(path, **kwargs)
        experts = _experts_modules(model)
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
            pilot = _RouterPilot(store, gates, top_k)
        runtime = Runtime(store, pilot, moe_layers)
        for layer, module in experts.items():
            module.colibri_binding = (runtime, layer)
        model.colibri = runtime
        model.colibri_close = runtime.close
        del torch
        return model
    except BaseException:
        store.close()
        raise


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
