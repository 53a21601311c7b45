"""The 4-bit checkpoint of benchmarks/generate.py: a Qwen3-MoE written as compressed-tensors int4, shard by shard.

Every projection (attention and routed experts) is ``pack-quantized``
symmetric int4 with one bf16 scale per group of 32 input columns, packed by
the ``compressed-tensors`` package's own compressor; the token embedding,
output head, routers and norms stay bf16. The checkpoint is written
directly, a tensor at a time, never as a bf16 model in memory: the
benchmark's 4-bit model is 29 GB in bf16.

The scales follow llama.cpp's Q4_0 rule rather than compressed-tensors'
default one: in each group the weight of largest magnitude is made negative
when drawn (the draw is random, its sign is a free choice) and the scale is
that magnitude / 8 rounded to bf16, so that weight is exactly -8 scales.
Q4_0 of the dequantized group then finds the same scale (its maximum / -8,
exact in fp16) and the same integers, so the Q4_0 GGUF that llama.cpp's
converter and quantizer make from this checkpoint holds exactly these
weights (checked by :func:`max_abs_difference`): the two 4-bit engines
compute on the same numbers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np

GROUP = 32
POOL = 7           # experts per layer drawn; the others cycle through them, as in the bf16 model
SHARD_BYTES = 1 << 30


def tensor_shapes(shape: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The tensors of a Qwen3MoeForCausalLM checkpoint as transformers saves it, in its order of layers."""
    h, v, i_moe = shape["hidden_size"], shape["vocab_size"], shape["moe_intermediate_size"]
    hd, nh, nkv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
    yield "model.embed_tokens.weight", (v, h)
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (nh * hd, h)
        yield p + "self_attn.k_proj.weight", (nkv * hd, h)
        yield p + "self_attn.v_proj.weight", (nkv * hd, h)
        yield p + "self_attn.o_proj.weight", (h, nh * hd)
        yield p + "self_attn.q_norm.weight", (hd,)
        yield p + "self_attn.k_norm.weight", (hd,)
        yield p + "mlp.gate.weight", (shape["num_experts"], h)
        for e in range(shape["num_experts"]):
            yield p + f"mlp.experts.{e}.gate_proj.weight", (i_moe, h)
            yield p + f"mlp.experts.{e}.up_proj.weight", (i_moe, h)
            yield p + f"mlp.experts.{e}.down_proj.weight", (h, i_moe)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def _quantized(name: str) -> bool:
    return name.endswith("_proj.weight")


def q4_0_exact_groups(weight: Any) -> tuple[Any, Any]:
    """``weight`` (float32, rows x cols) with each group's largest magnitude made negative, and the
    group scales (float32 holding bf16 values): that magnitude / 8, rounded to bf16."""
    import torch

    rows, cols = weight.shape
    g = weight.reshape(rows, cols // GROUP, GROUP)
    idx = g.abs().argmax(-1, keepdim=True)
    peak = g.gather(-1, idx)
    g.scatter_(-1, idx, -peak.abs())
    scale = (peak.abs().squeeze(-1) / 8).to(torch.bfloat16).to(torch.float32)
    return g.reshape(rows, cols), scale


def _pack(weight: Any, scheme: Any) -> dict[str, Any]:
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    weight, scale = q4_0_exact_groups(weight)
    state = {"weight": weight, "weight_scale": scale,
             "weight_zero_point": torch.zeros(scale.shape, dtype=torch.int8)}
    packed = PackedQuantizationCompressor.compress(state, scheme)
    packed["weight_scale"] = scale.to(torch.bfloat16)
    return {k: v.contiguous() for k, v in packed.items()}


def write_int4_model(directory: Path, shape: dict[str, Any], seed: int) -> None:
    """The checkpoint, its config (quantization_config by compressed-tensors) and shard index.

    Weights as the bf16 model of generate.py draws them: N(0, 0.02), norms 1,
    the token embedding N(0, ``embed_std``), each layer's experts cycled from
    a pool of ``POOL`` drawn ones.
    """
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    shape = dict(shape)
    embed_std = float(shape.pop("embed_std"))
    if shape["hidden_size"] % GROUP or shape["moe_intermediate_size"] % GROUP:
        raise ValueError(f"hidden and expert widths must be multiples of {GROUP}")
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    std = 0.02
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)

    def draw(dims: tuple[int, ...], scale: float) -> Any:
        return torch.randn(dims, generator=gen, dtype=torch.float32).mul_(scale)

    shard: dict[str, Any] = {}
    weight_map: dict[str, str] = {}
    files: list[str] = []
    size = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(directory / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            files.append(name)
        shard, size = {}, 0

    pool: dict[str, dict[str, Any]] = {}
    for name, dims in tensor_shapes(shape):
        parts = name.split(".")
        if ".experts." in name:
            expert = int(parts[parts.index("experts") + 1])
            proj = parts[-2]
            if expert < POOL:
                pool[f"{expert}.{proj}"] = _pack(draw(dims, std), scheme)
            tensors = {f"{name[:-len('weight')]}{k}": v.clone()
                       for k, v in pool[f"{expert % POOL}.{proj}"].items()}
        elif name.endswith("norm.weight"):
            tensors = {name: torch.ones(dims, dtype=torch.bfloat16)}
        elif "embed_tokens" in name:
            tensors = {name: draw(dims, embed_std).to(torch.bfloat16)}
        elif _quantized(name):
            tensors = {f"{name[:-len('weight')]}{k}": v for k, v in _pack(draw(dims, std), scheme).items()}
        else:
            tensors = {name: draw(dims, std).to(torch.bfloat16)}
        shard.update(tensors)
        size += sum(t.numel() * t.element_size() for t in tensors.values())
        if size >= SHARD_BYTES:
            flush()
    flush()
    total = sum(os.path.getsize(directory / f) for f in files)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = Qwen3MoeConfig(**shape, norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(directory)
    quant = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                               quantization_status="compressed", ignore=["lm_head", "re:.*mlp\\.gate$"])
    ModelCompressor(quantization_config=quant).update_config(str(directory))


def _raw_tensor(path: Path, name: str) -> np.ndarray:
    """One tensor of a safetensors file, read through its header (numpy has no bf16: ml_dtypes')."""
    import struct

    import ml_dtypes

    dtypes = {"BF16": ml_dtypes.bfloat16, "I32": np.int32, "I64": np.int64, "F32": np.float32}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))[name]
        start, stop = meta["data_offsets"]
        f.seek(8 + n + start)
        data = f.read(stop - start)
    return np.frombuffer(data, dtype=dtypes[meta["dtype"]]).reshape(meta["shape"])


def dequantized(directory: Path, name: str) -> np.ndarray:
    """One projection of the checkpoint as float32: its packed int4 times its group scales."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    base = name[: -len("weight")]

    def tensor(suffix: str) -> np.ndarray:
        return _raw_tensor(directory / index[base + suffix], base + suffix)

    rows, cols = (int(x) for x in tensor("weight_shape"))
    scale = tensor("weight_scale").astype(np.float32)
    words = tensor("weight_packed").view(np.uint32)
    nibbles = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    q = nibbles.reshape(rows, -1)[:, :cols].astype(np.float32) - 8
    return (q.reshape(rows, cols // GROUP, GROUP) * scale[..., None]).reshape(rows, cols)


def max_abs_difference(directory: Path, gguf_tensor: Any, layer: int = 0, expert: int = 0) -> float:
    """Largest |difference| between expert ``expert``'s gate projection of ``layer`` in the checkpoint
    and in a GGUF's ``blk.<layer>.ffn_gate_exps.weight`` (``gguf_tensor``: that tensor, dequantized)."""
    ours = dequantized(directory, f"model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight")
    theirs = np.asarray(gguf_tensor)[expert].reshape(ours.shape)
    return float(np.abs(ours - theirs).max())
