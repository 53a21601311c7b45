"""colibri.hf's hooks in transformers, registered once per process: the
``"colibri"`` entry of its experts interface, and one loading hook per way
of loading (:data:`~colibri.hf.accept.IMPLEMENTATION` and the FP8 and
compressed-tensors names), each registered as a quantization method.

Every loading hook removes the routed experts' parameters from the
meta-device skeleton before any weight is read, so transformers skips the
experts' tensors as keys the model does not have and never reads or
allocates one. The float hook does only that; the FP8 and compressed-tensors
hooks are transformers' own loaders in their dequantize mode, subclassed
by :func:`without_routed_experts`, so whatever else the checkpoint
quantizes is dequantized at load by their code.
"""

from __future__ import annotations

import threading
from typing import Any

from colibri.hf.accept import CT_IMPLEMENTATION, FP8_IMPLEMENTATION, IMPLEMENTATION, transformers_module
from colibri.hf.runtime import colibri_experts_forward, experts_modules

__all__ = ["register", "without_routed_experts", "dequantizing_config", "drop_routed_experts"]

# The parameters of transformers' fused experts modules (their MoE layers' routed experts).
_EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias",
                  "gate_up_proj_scale_inv", "down_proj_scale_inv")
# The checkpoint's expert tensors, which transformers then finds no parameter for.
_SKIPPED_KEYS = r"(^|\.)layers\.\d+\.mlp\.experts\.(\d+\.)?(gate_up_proj|down_proj|gate_proj|up_proj|w1|w2|w3)"
# The config keys that would undo the dequantize mode of a subclassed config.
_NOT_DEQUANTIZING = ("quant_method", "run_compressed", "use_optimized_inference")

_registered = False
_register_lock = threading.Lock()


def drop_routed_experts(model: Any) -> None:
    """On the meta skeleton: remove the routed experts' parameters so that
    transformers neither reads nor allocates them."""
    for module in experts_modules(model).values():
        for name in _EXPERT_PARAMS:
            if name in module._parameters:
                del module._parameters[name]
        # Nothing left for transformers' weight init to fill in.
        module._is_hf_initialized = True
    # The checkpoint's expert tensors are skipped on purpose: no warning.
    ignored = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    ignored.add(_SKIPPED_KEYS)
    model._keys_to_ignore_on_load_unexpected = ignored


def without_routed_experts(base: Any, name: str, *, pre_quantized: bool) -> Any:
    """transformers' loader class ``base`` (an ``HfQuantizer``), subclassed to
    drop the routed experts before any weight loads. ``pre_quantized``: the
    checkpoint is quantized (FP8, compressed-tensors). The model it loads
    cannot be saved or trained as it is: its routed experts are in the store."""

    class Loader(base):  # type: ignore[misc, valid-type]
        def __init__(self, quantization_config: Any, **kwargs: Any) -> None:
            if pre_quantized:
                kwargs["pre_quantized"] = True
            super().__init__(quantization_config, **kwargs)

        def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> Any:
            super()._process_model_before_weight_loading(model, **kwargs)
            drop_routed_experts(model)
            return model

        def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
            return False

        @property
        def is_trainable(self) -> bool:
            return False

    Loader.__name__ = Loader.__qualname__ = name
    Loader.__doc__ = f"{base.__name__} minus the routed experts (colibri.hf)."
    return Loader


def dequantizing_config(base: Any, name: str, method: str) -> Any:
    """transformers' config class ``base`` of a quantization method, in its
    dequantize mode, under the quant_method ``method`` colibri registers."""

    class Config(base):  # type: ignore[misc, valid-type]
        def __init__(self, **kwargs: Any) -> None:
            for key in _NOT_DEQUANTIZING:
                kwargs.pop(key, None)
            kwargs["dequantize"] = True
            super().__init__(**kwargs)
            self.quant_method = method

    Config.__name__ = Config.__qualname__ = name
    Config.__doc__ = f"{base.__name__} dequantizing at load, for colibri.hf (quant_method {method!r})."
    return Config


def _float_loader() -> tuple[Any, Any]:
    """The config and loader of float (and gpt-oss MXFP4) checkpoints."""
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class ColibriLoadConfig(QuantizationConfigMixin):
        """Marks a load by colibri.hf: routed experts stay in the store."""

        def __init__(self, **kwargs: Any) -> None:
            self.quant_method = IMPLEMENTATION  # type: ignore[assignment]

        def to_dict(self) -> dict[str, Any]:
            return {"quant_method": IMPLEMENTATION}

    return ColibriLoadConfig, without_routed_experts(HfQuantizer, "ColibriLoader", pre_quantized=False)


def _fp8_loader() -> tuple[Any, Any]:
    """transformers' FP8 config and loader: dequantize mode, minus the routed experts."""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    from transformers.utils.quantization_config import FineGrainedFP8Config

    return (dequantizing_config(FineGrainedFP8Config, "ColibriFP8LoadConfig", FP8_IMPLEMENTATION),
            without_routed_experts(FineGrainedFP8HfQuantizer, "ColibriFP8Loader", pre_quantized=True))


def _compressed_tensors_loader() -> tuple[Any, Any] | None:
    """transformers' compressed-tensors config and loader: dequantize mode,
    minus the routed experts. None when compressed-tensors is not installed."""
    try:
        import compressed_tensors  # noqa: F401
        from transformers.quantizers.quantizer_compressed_tensors import CompressedTensorsHfQuantizer
        from transformers.utils.quantization_config import CompressedTensorsConfig
    except ImportError:
        return None
    return (dequantizing_config(CompressedTensorsConfig, "ColibriCTLoadConfig", CT_IMPLEMENTATION),
            without_routed_experts(CompressedTensorsHfQuantizer, "ColibriCTLoader", pre_quantized=True))


def register() -> dict[str, Any]:
    """Register the experts implementation and the loading hooks (once);
    return transformers' table of loading config classes (by quant_method)."""
    global _registered
    transformers_module()
    from transformers.integrations.moe import ExpertsInterface
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
        register_quantization_config,
        register_quantizer,
    )

    with _register_lock:
        if not _registered:
            ExpertsInterface.register(IMPLEMENTATION, colibri_experts_forward)
            loaders = {IMPLEMENTATION: _float_loader(), FP8_IMPLEMENTATION: _fp8_loader(),
                       CT_IMPLEMENTATION: _compressed_tensors_loader()}
            for name, found in loaders.items():
                if found is None:
                    continue
                config_cls, loader_cls = found
                if name not in AUTO_QUANTIZATION_CONFIG_MAPPING:
                    register_quantization_config(name)(config_cls)
                if name not in AUTO_QUANTIZER_MAPPING:
                    register_quantizer(name)(loader_cls)
            _registered = True
    return AUTO_QUANTIZATION_CONFIG_MAPPING
