"""A tiny transformers MoE checkpoint with a local tokenizer, for trying
``colibri generate`` and :func:`colibri.hf.from_pretrained` without a download.

    python -m colibri.tiny_moe tiny-moe          # writes ./tiny-moe
    colibri generate tiny-moe --prompt "the cat" --slots 2 --stats

The model is built by transformers' own config class for the architecture
(Qwen3-MoE by default; any of :data:`colibri.hf.SUPPORTED_MODEL_TYPES`) and
written with ``save_pretrained``; its weights are random (seeded), so its text
is gibberish, but every routed expert really streams through the store. The
tokenizer is a word-level ``tokenizers`` model over a small fixed word list,
saved next to the weights, so nothing needs the network.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

__all__ = ["WORDS", "randomize_weights", "write_tiny_moe", "write_tiny_gpt_oss"]

#: The tokenizer's vocabulary after its special tokens.
WORDS = tuple(
    "the a an of to in and or is was are be it that this on for with as at by from cat dog bird "
    "fish tree river stone house road city sky sun moon star rain wind fire water light dark old "
    "new big small red blue green one two three many some all no not very then there here when "
    "where what who why how run walk fly swim see hear say know think make take give find keep "
    "open close read write store cache disk expert layer token model route lease slot fast slow "
    "hello world".split()
)
_SPECIALS = ("<unk>", "<pad>", "<eos>")

_ARCH: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, head_dim=16)),
    "mixtral": ("MixtralConfig", dict(
        num_hidden_layers=4, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32, num_experts=16,
        num_experts_per_tok=4, shared_expert_intermediate_size=64, norm_topk_prob=False)),
    "olmoe": ("OlmoeConfig", dict(
        num_hidden_layers=4, intermediate_size=32, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=False)),
    "deepseek_v2": ("DeepseekV2Config", dict(
        num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
        num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
        num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)),
    "glm4_moe": ("Glm4MoeConfig", dict(
        num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
        num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=1.8, norm_topk_prob=True, head_dim=16)),
}


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<eos>")


def randomize_weights(model: Any, seed: int) -> None:
    """Gives a transformers model well-spread random weights, seeded (the
    default init leaves routers at zero, so routing would be all ties), and
    DeepSeek-V3-style routers a random score-correction bias."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=gen) * 0.2)


def write_tiny_moe(path: str | os.PathLike[str], model_type: str = "qwen3_moe", *,
                   dtype: str = "bfloat16", hidden_size: int = 64, seed: int = 0,
                   fp8_block: int | None = None, int4_group: int | None = None,
                   int4_scope: str = "experts", int4_symmetric: bool = True) -> str:
    """Write a tiny random ``model_type`` MoE checkpoint and its tokenizer
    to ``path`` (created); returns the path. ``dtype`` is what the weights
    are saved in (``"bfloat16"`` or ``"float32"``). ``fp8_block=B`` then
    rewrites every projection weight (attention, dense and shared MLPs,
    routed experts) as FP8 e4m3 with a float32 ``weight_scale_inv`` per
    B x B block and declares it in config.json as DeepSeek-V3's FP8
    checkpoints do (``quant_method: fp8``, ``weight_block_size: [B, B]``).
    ``int4_group=G`` instead compresses projections to compressed-tensors
    pack-quantized int4 with G columns per scale: the routed experts
    (``int4_scope="experts"``), every projection (``"all"``), or the routed
    experts in a second config group after one that quantizes attention in
    groups of G / 2 (``"attention_first"``)."""
    import torch
    import transformers

    if model_type not in _ARCH:
        raise ValueError(f"model_type must be one of {', '.join(sorted(_ARCH))}, not {model_type!r}")
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be 'bfloat16' or 'float32', not {dtype!r}")
    config_name, kwargs = _ARCH[model_type]
    tokenizer = _tokenizer()
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False)
    common.update(kwargs)
    config = getattr(transformers, config_name)(**common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize_weights(model, seed)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    out = os.fspath(path)
    os.makedirs(out, exist_ok=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if fp8_block is not None and int4_group is not None:
        raise ValueError("fp8_block and int4_group are two formats; pass one")
    if fp8_block is not None:
        _to_fp8(out, fp8_block)
    if int4_group is not None:
        _to_int4(out, int4_group, int4_scope, int4_symmetric)
    return out


_PROJECTION = re.compile(r"(_proj|_proj_with_mqa|\.w[123])\.weight$")


def _to_fp8(path: str, block: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    if block < 1:
        raise ValueError(f"fp8_block must be >= 1, got {block}")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    renamed: dict[str, list[str]] = {}
    for name in files:
        tensors = load_file(os.path.join(path, name))
        out: dict[str, Any] = {}
        for key, value in tensors.items():
            if value.ndim != 2 or not _PROJECTION.search(key):
                out[key] = value
                continue
            rows, cols = value.shape
            br, bc = -(-rows // block), -(-cols // block)
            padded = torch.zeros(br * block, bc * block)
            padded[:rows, :cols] = value.float()
            blocks = padded.view(br, block, bc, block)
            scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0   # e4m3's largest value
            quantized = (blocks / scale[:, None, :, None]).view(br * block, bc * block)[:rows, :cols]
            out[key] = quantized.contiguous().to(torch.float8_e4m3fn)
            out[key + "_scale_inv"] = scale.float().contiguous()
            renamed[key] = [key, key + "_scale_inv"]
        save_file(out, os.path.join(path, name), metadata={"format": "pt"})
    _rename_in_index(path, renamed)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)


_ROUTED = re.compile(r"\.experts\.[0-9]+\.[a-z_0-9]+\.weight$")
_ROUTED_TARGET = r"re:.*\.experts\.[0-9]+\.(gate_proj|up_proj|down_proj|w1|w2|w3)$"
_ATTENTION = re.compile(r"\.self_attn\.[a-z_]+_proj\.weight$")
_ATTENTION_TARGET = r"re:.*\.self_attn\.[a-z_]+_proj$"


def _rename_in_index(path: str, renamed: dict[str, list[str]]) -> None:
    """Replaces each key of ``renamed`` in the shard index (if any) by its new keys, in the same file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        return
    with open(index, encoding="utf-8") as f:
        data = json.load(f)
    for key, new_keys in renamed.items():
        file = data["weight_map"].pop(key)
        for new_key in new_keys:
            data["weight_map"][new_key] = file
    with open(index, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)


def _to_int4(path: str, group: int, scope: str, symmetric: bool) -> None:
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from safetensors.torch import load_file, save_file

    if group < 1:
        raise ValueError(f"int4_group must be >= 1, got {group}")
    if scope not in ("experts", "all", "attention_first"):
        raise ValueError(f"int4_scope must be 'experts', 'all' or 'attention_first', not {scope!r}")

    def scheme(targets: list[str], size: int) -> Any:
        return QuantizationScheme(targets=targets, weights=QuantizationArgs(
            num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=size))

    ignore = ["lm_head"]
    if scope == "all":
        groups = {"group_0": scheme(["Linear"], group)}
        ignore += ["re:.*mlp\\.gate$", "re:.*shared_expert_gate$"]
    elif scope == "experts":
        groups = {"group_0": scheme([_ROUTED_TARGET], group)}
    else:  # the experts' group second, with another group size than the first
        groups = {"group_0": scheme([_ATTENTION_TARGET], max(group // 2, 1)),
                  "group_1": scheme([_ROUTED_TARGET], group)}

    def group_of(key: str) -> Any:
        """The config group that quantizes weight ``key``, or None."""
        if _PROJECTION.search(key) is None:
            return None
        if scope == "all":
            return groups["group_0"]
        if _ROUTED.search(key) is not None:
            return groups["group_1" if scope == "attention_first" else "group_0"]
        return groups["group_0"] if scope == "attention_first" and _ATTENTION.search(key) else None

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    renamed: dict[str, list[str]] = {}
    for name in files:
        tensors = load_file(os.path.join(path, name))
        out: dict[str, Any] = {}
        for key, value in tensors.items():
            chosen = group_of(key) if value.ndim == 2 else None
            size = chosen.weights.group_size if chosen is not None else 1
            if chosen is None or value.shape[1] % size:
                out[key] = value
                continue
            args = chosen.weights
            weight = value.float()
            rows, cols = weight.shape
            blocks = weight.reshape(rows, cols // size, size)
            scale, zero = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args)
            state = {"weight": weight, "weight_scale": scale.to(value.dtype), "weight_zero_point": zero}
            packed = PackedQuantizationCompressor.compress(state, chosen)
            base = key[: -len("weight")]
            for suffix, tensor in packed.items():
                out[base + suffix] = tensor.contiguous()
            renamed[key] = [base + suffix for suffix in packed]
        save_file(out, os.path.join(path, name), metadata={"format": "pt"})
    _rename_in_index(path, renamed)
    config = QuantizationConfig(config_groups=groups, format="pack-quantized",
                                quantization_status="compressed", ignore=ignore)
    ModelCompressor(quantization_config=config).update_config(path)
    del torch


def write_tiny_gpt_oss(path: str | os.PathLike[str], *, seed: int = 0, mxfp4: bool = False) -> str:
    """Write a tiny random gpt-oss checkpoint (two layers, hidden 32, six
    experts, top-2; shards of 40 KB) to ``path`` (created); returns the
    path. Every parameter is drawn at random, biases too, and the experts'
    gate_up large enough that the clamped SwiGLU's limit (7) is reached.
    ``mxfp4``: the routed experts as MXFP4 blocks and scales, one file, as
    the released checkpoints store them (``quant_method: mxfp4``)."""
    import torch
    import transformers

    config = transformers.GptOssConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=6, num_experts_per_tok=2,
        vocab_size=64, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():                     # biases too: the init leaves them 0
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "gate_up" in name else 0.3))
    out = os.fspath(path)
    model.save_pretrained(out, max_shard_size="40KB")
    if mxfp4:
        _experts_to_mxfp4(out, seed + 2)
    return out


def _experts_to_mxfp4(path: str, seed: int) -> None:
    """Replaces the float routed experts of a gpt-oss checkpoint by random
    MXFP4 blocks and scales (the rest kept), in one model.safetensors."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, Any] = {}
    for shard in sorted(os.listdir(path)):
        if not shard.endswith(".safetensors"):
            continue
        for name, value in load_file(os.path.join(path, shard)).items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                experts, inp, outputs = value.shape
                tensors[name + "_blocks"] = torch.randint(0, 256, (experts, outputs, inp // 32, 16),
                                                          generator=gen, dtype=torch.uint8)
                tensors[name + "_scales"] = torch.randint(120, 128, (experts, outputs, inp // 32),
                                                          generator=gen, dtype=torch.uint8)
            else:
                tensors[name] = value
        os.remove(os.path.join(path, shard))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        os.remove(index)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colibri.tiny_moe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--arch", default="qwen3_moe", choices=sorted(_ARCH))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp8-block", type=int, default=None,
                        help="save the projections as block-scaled FP8 with B x B blocks")
    parser.add_argument("--int4-group", type=int, default=None,
                        help="compress the routed experts to compressed-tensors pack-quantized int4 "
                             "with one scale per G columns (needs compressed-tensors)")
    parser.add_argument("--int4-all", action="store_true",
                        help="with --int4-group: compress attention and dense/shared MLPs too")
    args = parser.parse_args(argv)
    print(write_tiny_moe(args.path, args.arch, dtype=args.dtype, seed=args.seed, fp8_block=args.fp8_block,
                         int4_group=args.int4_group, int4_scope="all" if args.int4_all else "experts"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
