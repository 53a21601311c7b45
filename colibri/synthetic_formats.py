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
from dataclasses import dataclass
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


@dataclass
class _Spec:
    """What one call writes: the format, the widths and the options."""

    fmt: str
    hidden: int
    inter: int
    experts: int
    group: int
    scale_dtype: Any
    symmetric: bool
    g_idx: str | None
    block: tuple[int, int]

    def roles(self) -> tuple[tuple[str, tuple[int, int]], ...]:
        """(role, (outputs, inputs)) of the three matrices."""
        H, I = self.hidden, self.inter
        return (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))


def _plain(spec: _Spec, rng: np.random.Generator, base: str, out: dict[str, np.ndarray]) -> None:
    """Floats and FP8, one tensor per role and expert, (out, in)."""
    for e in range(spec.experts):
        for role, shape in spec.roles():
            name = f"{base}.{e}.{role}_proj.weight"
            if spec.fmt in _PLAIN:
                out[name] = _float_like(rng, shape, _PLAIN[spec.fmt])
                continue
            codes = _fp8_codes(rng, shape, spec.fmt == "f8_e5m2")
            out[name] = codes.view(ml_dtypes.float8_e5m2 if spec.fmt == "f8_e5m2"
                                   else ml_dtypes.float8_e4m3fn)
            if spec.fmt == "fp8_block":
                grid = (-(-shape[0] // spec.block[0]), -(-shape[1] // spec.block[1]))
                out[name + "_scale_inv"] = _scales(rng, grid, np.float32) * 0.05


def _stacked_float(spec: _Spec, rng: np.random.Generator, layer: int,
                   out: dict[str, np.ndarray]) -> None:
    """gpt-oss (interleaved, (in, out), biases), Llama 4 ((in, out)) or a
    transformers state dict ((out, in)): stacked experts, fused gate_up."""
    E, H, I = spec.experts, spec.hidden, spec.inter
    mlp = "feed_forward" if spec.fmt == "llama4" else "mlp"
    prefix = f"model.layers.{layer}.{mlp}.experts"
    if spec.fmt == "stacked":
        out[f"{prefix}.gate_up_proj"] = _float_like(rng, (E, 2 * I, H), np.float32)
        out[f"{prefix}.down_proj"] = _float_like(rng, (E, H, I), np.float32)
        return
    dtype = ml_dtypes.bfloat16 if spec.fmt == "gpt_oss" else np.float32
    out[f"{prefix}.gate_up_proj"] = _float_like(rng, (E, H, 2 * I), dtype)
    out[f"{prefix}.down_proj"] = _float_like(rng, (E, I, H), dtype)
    if spec.fmt == "gpt_oss":
        out[f"{prefix}.gate_up_proj_bias"] = _float_like(rng, (E, 2 * I), np.float32)
        out[f"{prefix}.down_proj_bias"] = _float_like(rng, (E, H), np.float32)


def _mxfp4(spec: _Spec, rng: np.random.Generator, base: str, out: dict[str, np.ndarray]) -> None:
    """gpt-oss's MXFP4 blocks and scales (scales near 2^0), BF16 biases."""
    E, H, I = spec.experts, spec.hidden, spec.inter
    for name, (rows, cols) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
        out[f"{base}.{name}_blocks"] = rng.integers(0, 256, (E, rows, cols // 32, 16), dtype=np.uint8)
        out[f"{base}.{name}_scales"] = rng.integers(118, 131, (E, rows, cols // 32), dtype=np.uint8)
        out[f"{base}.{name}_bias"] = _float_like(rng, (E, rows), ml_dtypes.bfloat16)


def _int4(spec: _Spec, rng: np.random.Generator, base: str, out: dict[str, np.ndarray]) -> None:
    """compressed-tensors pack-quantized, per expert or stacked with a fused gate_up."""
    H, I = spec.hidden, spec.inter
    per_role = spec.roles() if spec.fmt == "int4" else (("gate_up", (2 * I, H)), ("down", (H, I)))
    for role, (rows, cols) in per_role:
        stack: dict[str, list[np.ndarray]] = {}
        for e in range(spec.experts):
            parts = {"weight_packed": _words(rng, (rows, cols // 8)),
                     "weight_scale": _scales(rng, (rows, cols // spec.group), spec.scale_dtype),
                     "weight_shape": np.array([rows, cols], np.int64)}
            if not spec.symmetric:
                parts["weight_zero_point"] = _words(rng, (-(-rows // 8), cols // spec.group))
            for key, value in parts.items():
                if spec.fmt == "int4":
                    out[f"{base}.{e}.{role}_proj.{key}"] = value
                else:
                    stack.setdefault(key, []).append(value)
        for key, values in stack.items():
            out[f"{base}.{role}_proj.{key}"] = np.stack(values)


def _quant_modules(spec: _Spec, rng: np.random.Generator, base: str,
                   out: dict[str, np.ndarray]) -> None:
    """GPTQ and AWQ modules, (in, out), per expert and role."""
    for e in range(spec.experts):
        for role, (o, i) in spec.roles():
            name = f"{base}.{e}.{role}_proj."
            groups = -(-i // spec.group) if spec.group > 0 else 1
            out[name + "scales"] = _scales(rng, (groups, o), spec.scale_dtype)
            out[name + "qzeros"] = _words(rng, (groups, o // 8))
            if spec.fmt == "awq":
                out[name + "qweight"] = _words(rng, (i, o // 8))
                continue
            out[name + "qweight"] = _words(rng, (i // 8, o))
            rows_group = np.arange(i) // (spec.group if spec.group > 0 else i)
            if spec.g_idx == "act_order":
                out[name + "g_idx"] = rng.permutation(rows_group).astype(np.int32)
            elif spec.g_idx == "sorted":
                out[name + "g_idx"] = rows_group.astype(np.int32)


def _config(spec: _Spec) -> dict[str, Any]:
    """The config.json a loader reads for the format."""
    fmt, group = spec.fmt, spec.group
    config: dict[str, Any] = {"model_type": "gpt_oss" if fmt in ("gpt_oss", "mxfp4") else "qwen3_moe"}
    if fmt == "mxfp4":
        config["quantization_config"] = {"quant_method": "mxfp4"}
    elif fmt in ("int4", "stacked_int4"):
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": spec.symmetric, "strategy": "group",
                "group_size": group}}}}
    elif fmt == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                         "zero_point": True, "version": "gemm"}
    elif fmt in ("gptq", "gptq_v2"):
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group,
                                         "desc_act": spec.g_idx == "act_order", "sym": False,
                                         "checkpoint_format": fmt}
    return config


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
    multiple = format_constraints(fmt)
    if hidden % multiple or intermediate % multiple:
        raise ValueError(f"{fmt} needs hidden and intermediate to be multiples of {multiple}")
    spec = _Spec(fmt, hidden, intermediate, experts, group, scale_dtype, symmetric, g_idx, block)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(layers):
        base = f"model.layers.{layer}.mlp.experts"
        if fmt in ("gpt_oss", "llama4", "stacked"):
            _stacked_float(spec, rng, layer, tensors)
        elif fmt == "mxfp4":
            _mxfp4(spec, rng, base, tensors)
        elif fmt in ("int4", "stacked_int4"):
            _int4(spec, rng, base, tensors)
        elif fmt in ("gptq", "gptq_v2", "awq"):
            _quant_modules(spec, rng, base, tensors)
        else:
            _plain(spec, rng, base, tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_config(spec)))
    return out
