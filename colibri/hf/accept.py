"""What colibri.hf accepts: the architectures it runs, and the
``quantization_config.quant_method`` values it loads with a check of each
(:data:`ACCEPTED_QUANT_METHODS`). Every check runs before the store opens or
transformers reads a weight.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from colibri.checkpoint.config import CONFIG_NAME, compressed_tensors_group, read_json
from colibri.errors import FormatError
from colibri.formats import FORMATS, FP8_BLOCK

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "UNSUPPORTED_MOE_TYPES",
    "SUPPORTED_TRANSFORMERS",
    "IMPLEMENTATION",
    "FP8_IMPLEMENTATION",
    "CT_IMPLEMENTATION",
    "CT_STRATEGIES",
    "ACCEPTED_QUANT_METHODS",
    "QuantMethod",
    "UnsupportedModelError",
    "check_quantization",
    "read_config",
    "transformers_module",
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

#: The names colibri.hf registers with transformers: its experts implementation
#: and the loading hook of float (and MXFP4) checkpoints; the FP8 and
#: compressed-tensors loaders, subclassed.
IMPLEMENTATION = "colibri"
FP8_IMPLEMENTATION = "colibri_fp8"
CT_IMPLEMENTATION = "colibri_compressed_tensors"


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
    "fp8": QuantMethod(FORMATS[FP8_BLOCK].summary, _check_nothing, FP8_IMPLEMENTATION),
    "mxfp4": QuantMethod("gpt-oss's MXFP4 experts", _check_mxfp4, IMPLEMENTATION),
    "compressed-tensors": QuantMethod(
        "compressed-tensors with pack-quantized int4 routed experts (group or channel scales, "
        "symmetric or with zero points)", _check_compressed_tensors, CT_IMPLEMENTATION),
}


def check_quantization(path: str, cfg: dict[str, Any]) -> str | None:
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


def transformers_module() -> Any:
    """transformers, after checking it has the experts interface colibri.hf needs."""
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


def read_config(path: str) -> dict[str, Any]:
    """The config.json of the model directory ``path``, after checking that
    colibri.hf runs its architecture (UnsupportedModelError if not)."""
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
