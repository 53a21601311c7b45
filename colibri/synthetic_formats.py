"""Small MoE checkpoints of every expert format, for the kernels' tests and
benchmark.

:func:`write_format_checkpoint` writes routed experts (no attention, no
router) in one format and layout, from random values written straight in the
format's own packing (every 4-bit value and fp8 code occurs; random words
are random nibbles, however a format orders them), with the config.json a
loader needs. The values mean nothing, which is all a kernel test or
benchmark needs: the reference is :func:`colibri.dequantize` of the same
bytes.

Formats (:data:`FORMATS`): ``bf16``, ``f16``, ``f32``, ``f8_e4m3``,
``f8_e5m2`` (Qwen-style names, one tensor per role, (out, in));
``fp8_block`` (e4m3 with F32 block scales); ``gpt_oss`` (float, stacked,
(in, out), gate_up interleaved, biases); ``llama4`` (float, stacked,
(in, out), gate_up concatenated); ``stacked`` (float, (out, in), gate_up
concatenated); ``mxfp4`` (gpt-oss blocks and scales, biases); ``int4``
(compressed-tensors pack-quantized, ``symmetric`` or with zero points);
``stacked_int4`` (the same, stacked with a fused gate_up); ``gptq``,
``gptq_v2`` (with ``g_idx``: ``"act_order"``, ``"sorted"`` or None) and
``awq``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["FORMATS", "write_format_checkpoint", "format_constraints"]

FORMATS: tuple[str, ...] = ("bf16", "f16", "f32", "f8_e4m3", "f8_e5m2", "fp8_block", "gpt_oss",
                            "llama4", "stacked", "mxfp4", "int4", "stacked_int4", "gptq", "gptq_v2",
                            "awq")
_PLAIN = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}


def format_constraints(fmt: str) -> int:
    """What hidden and intermediate must be multiples of for ``fmt``."""
    if fmt == "mxfp4":
        return 32
    if fmt in ("int4", "stacked_int4", "gptq", "gptq_v2", "awq"):
        return 8
    return 1


def _words(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random int32 words: eight uniform 4-bit values each, however packed."""
    return rng.integers(0, 2**32, shape, dtype=np.uint32).view(np.int32)


def _scales(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return (rng.uniform(0.5, 1.5, shape) * rng.choice([-1, 1], shape) * 0.02).astype(dtype)


def _fp8_codes(rng: np.random.Generator, shape: tuple[int, ...], e5m2: bool) -> np.ndarray:
    """Random finite codes: every e4m3 code but NaN; e5m2 codes of magnitude
    at most 3.5 (exponent field 0..16: its whole range, 2^-16 to 57344, would
    make float32 sums of random weights cancel beyond any tolerance)."""
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    if e5m2:
        exponent = rng.integers(0, 17, shape, dtype=np.uint8)
        return (codes & 0x83) | (exponent << 2)
    codes[(codes & 0x7F) == 0x7F] &= 0xBF  # clear an exponent bit: a finite code
    return codes


def _float_like(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Random values of magnitude 2^-8 to 2^-4, either sign, every mantissa,
    written as bits (no float64 temporaries: benchmark experts are large)."""
    dt = np.dtype(dtype)
    if dt.itemsize == 4:
        words: np.dtype[Any] = np.dtype(np.uint32)
        mantissa, bias = 23, 127
    elif dt == np.dtype(ml_dtypes.bfloat16):
        words, mantissa, bias = np.dtype(np.uint16), 7, 127
    else:  # float16
        words, mantissa, bias = np.dtype(np.uint16), 10, 15
    top = (1 << (8 * dt.itemsize)) - 1
    raw = rng.integers(0, top, shape, endpoint=True, dtype=np.uint64).astype(words)
    sign_and_mantissa = raw & words.type((top + 1) // 2 | ((1 << mantissa) - 1))
    exponent = ((bias - 8 + (raw >> words.type(mantissa)) % 4).astype(words)
                << words.type(mantissa))
    return (sign_and_mantissa | exponent).view(dt)


def write_format_checkpoint(path: str | os.PathLike[str], fmt: str, *, hidden: int,
                            intermediate: int, experts: int = 2, layers: int = 1, seed: int = 0,
                            group: int = 32, scale_dtype: Any = ml_dtypes.bfloat16,
                            symmetric: bool = True, g_idx: str | None = "act_order",
                            block: tuple[int, int] = (128, 128)) -> Path:
    """Writes ``layers`` MoE layers of ``experts`` experts in ``fmt`` into
    the directory ``path`` (created); returns it. ``group``: inputs per
    scale of int4 (must divide the inputs), GPTQ and AWQ (-1: one group);
    ``scale_dtype`` their scales' dtype; ``block``: FP8's scale block."""
    from safetensors.numpy import save_file

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; the formats are {', '.join(FORMATS)}")
    H, I = hidden, intermediate
    multiple = format_constraints(fmt)
    if H % multiple or I % multiple:
        raise ValueError(f"{fmt} needs hidden and intermediate to be multiples of {multiple}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    config: dict[str, Any] = {"model_type": "qwen3_moe"}
    roles = (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))
    for layer in range(layers):
        base = f"model.layers.{layer}.mlp.experts"
        if fmt in _PLAIN or fmt in ("f8_e4m3", "f8_e5m2", "fp8_block"):
            for e in range(experts):
                for role, shape in roles:
                    name = f"{base}.{e}.{role}_proj.weight"
                    if fmt in _PLAIN:
                        tensors[name] = _float_like(rng, shape, _PLAIN[fmt])
                        continue
                    codes = _fp8_codes(rng, shape, fmt == "f8_e5m2")
                    dtype = ml_dtypes.float8_e5m2 if fmt == "f8_e5m2" else ml_dtypes.float8_e4m3fn
                    tensors[name] = codes.view(dtype)
                    if fmt == "fp8_block":
                        grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
                        tensors[name + "_scale_inv"] = _scales(rng, grid, np.float32) * 0.05
        elif fmt in ("gpt_oss", "llama4", "stacked"):
            prefix = f"model.layers.{layer}.feed_forward.experts" if fmt == "llama4" else base
            if fmt == "stacked":
                tensors[f"{prefix}.gate_up_proj"] = _float_like(rng, (experts, 2 * I, H), np.float32)
                tensors[f"{prefix}.down_proj"] = _float_like(rng, (experts, H, I), np.float32)
            else:
                dtype = ml_dtypes.bfloat16 if fmt == "gpt_oss" else np.float32
                tensors[f"{prefix}.gate_up_proj"] = _float_like(rng, (experts, H, 2 * I), dtype)
                tensors[f"{prefix}.down_proj"] = _float_like(rng, (experts, I, H), dtype)
            if fmt == "gpt_oss":
                tensors[f"{prefix}.gate_up_proj_bias"] = _float_like(rng, (experts, 2 * I), np.float32)
                tensors[f"{prefix}.down_proj_bias"] = _float_like(rng, (experts, H), np.float32)
                config["model_type"] = "gpt_oss"
        elif fmt == "mxfp4":
            for name, (rows, cols) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
                tensors[f"{base}.{name}_blocks"] = rng.integers(
                    0, 256, (experts, rows, cols // 32, 16), dtype=np.uint8)
                tensors[f"{base}.{name}_scales"] = rng.integers(
                    118, 131, (experts, rows, cols // 32), dtype=np.uint8)
                tensors[f"{base}.{name}_bias"] = _float_like(rng, (experts, rows), ml_dtypes.bfloat16)
            config["model_type"] = "gpt_oss"
            config["quantization_config"] = {"quant_method": "mxfp4"}
        elif fmt in ("int4", "stacked_int4"):
            per_role = roles if fmt == "int4" else (("gate_up", (2 * I, H)), ("down", (H, I)))
            for role, (rows, cols) in per_role:
                stack: dict[str, list[np.ndarray]] = {}
                for e in range(experts):
                    parts = {"weight_packed": _words(rng, (rows, cols // 8)),
                             "weight_scale": _scales(rng, (rows, cols // group), scale_dtype),
                             "weight_shape": np.array([rows, cols], np.int64)}
                    if not symmetric:
                        parts["weight_zero_point"] = _words(rng, (-(-rows // 8), cols // group))
                    if fmt == "int4":
                        for key, value in parts.items():
                            tensors[f"{base}.{e}.{role}_proj.{key}"] = value
                    else:
                        for key, value in parts.items():
                            stack.setdefault(key, []).append(value)
                for key, values in stack.items():
                    tensors[f"{base}.{role}_proj.{key}"] = np.stack(values)
            config["quantization_config"] = {
                "quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
                    "group_size": group}}}}
        else:  # GPTQ, AWQ: (in, out) modules
            for e in range(experts):
                for role, (o, i) in roles:
                    name = f"{base}.{e}.{role}_proj."
                    groups = -(-i // group) if group > 0 else 1
                    tensors[name + "scales"] = _scales(rng, (groups, o), scale_dtype)
                    tensors[name + "qzeros"] = _words(rng, (groups, o // 8))
                    if fmt == "awq":
                        tensors[name + "qweight"] = _words(rng, (i, o // 8))
                        continue
                    tensors[name + "qweight"] = _words(rng, (i // 8, o))
                    rows_group = np.arange(i) // (group if group > 0 else i)
                    if g_idx == "act_order":
                        tensors[name + "g_idx"] = rng.permutation(rows_group).astype(np.int32)
                    elif g_idx == "sorted":
                        tensors[name + "g_idx"] = rows_group.astype(np.int32)
            if fmt == "awq":
                config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                                 "zero_point": True, "version": "gemm"}
            else:
                config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group,
                                                 "desc_act": g_idx == "act_order", "sym": False,
                                                 "checkpoint_format": fmt}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out
