#!/usr/bin/env python3
"""Decode the same MoE in bf16 and in 4-bit formats: bytes and time per token.

The sibling of decode_sim.py for formats. One set of float expert weights
is written six ways under /tmp:

    bf16   mlp_experts layout, BF16 gate_proj/up_proj/down_proj.weight
    int4   the same names as compressed-tensors pack-quantized
           (weight_packed I32, BF16 weight_scale per group of --group, weight_shape)
    mxfp4  gpt-oss layout: gate_up_proj_blocks/_scales interleaved, down_proj_blocks/_scales,
           BF16 biases (zero)
    gptq   mlp_experts names as GPTQ modules (qweight, qzeros, F16 scales, g_idx),
           symmetric, groups of --group input rows, the original format (zeros minus one)
    gptq_act  the same with act order: each matrix's input rows grouped in a shuffled
           order (desc_act), which the store holds in group order
    awq    the same as AWQ GEMM modules (qweight, qzeros, F16 scales), with zero points

A token-by-token decode leases each layer's top-k experts (routing from a
seeded Zipf trace, the same for every format) and computes them with
colibri's native kernels straight from the slots, one call per layer,
on bfloat16 activations as colibri.hf runs a bfloat16 model (--activations
f32: float32 ones; --compute numpy: colibri.dequantize, then float32
matmuls). Cold: every
configuration opens a fresh store with O_DIRECT reads (direct_io=True), so
nothing is served from the page cache, and the cache (--slots per layer)
is smaller than a layer's experts. With PILOT: the real colibri.Pilot
prefetches the next layer's experts from a prediction that keeps each true
expert with probability --p (routers are unit vectors, as in decode_sim).

Reported per format and prefetch mode: MB read per token, I/O wait per
token (time inside lease_many), compute per token (the kernels' call),
tokens/s, and the ratios to bf16 within the same round. Configurations run
in --rounds rounds, shuffled per round; the median of the per-round values
and ratios is printed.

The bytes are split, because with PILOT the total is not like for like.
Each format gets the same guesses (the same seeded draws), but a wrong
guess costs bytes only if its read ran before Pilot.observe retired it, and
that depends on timing: a 4-bit read is four times shorter, so its wrong
guesses are more often read in full where bf16's are still queued. Per layer, a cold load's bytes
are measured first (every expert leased once, O_DIRECT: the parts plus
alignment and in-run gaps); then

    demand MB    demand misses x a cold load's bytes (what the decode had to wait for)
    prefetch MB  the rest of the bytes read, (wasted) the part read for wrong guesses
    wrong read   the share of the wrong guesses' loads that was read before retiring
    issued       every load the store started (misses and accepted prefetches, right
                 or wrong) counted in full, as a ratio to bf16's: the same count whatever
                 the timing let the store cancel
    x own no-prefetch  this format's MB read with PILOT over its MB read without

The goals checked: a 4-bit format's MB per token is within 1.1x of a
quarter of bf16's plus the format's scales and biases, for the bytes read
without prefetch, and with PILOT for the demand bytes and the issued bytes.
The MB read with PILOT, and how much of each format's wrong guesses was
read, are printed after the table.

    python benchmarks/decode_formats.py            # about 2 min on 2 cores
    python benchmarks/decode_formats.py --quick    # smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Goals, table, write_json  # noqa: E402

import colibri  # noqa: E402
from colibri import kernels, moe  # noqa: E402
from colibri.checkpoint.scan import scan_model  # noqa: E402
from _prefill import GOAL as PREFILL_GOAL, PROMPT_TOKENS, direct_read_time, prefill_ratio  # noqa: E402
from colibri.formats.mxfp4 import E2M1_VALUES  # noqa: E402

BF16 = ml_dtypes.bfloat16
FORMATS = ("bf16", "int4", "mxfp4", "gptq", "gptq_act", "awq")
WARM, COLD = "warm", "cold, no prefetch"
PREFILLS = ("in RAM", "cold", "read")
QUANTIZED = FORMATS[1:]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_MIDPOINTS = (E2M1_VALUES[1:8] + E2M1_VALUES[0:7]) / 2


# ------------------------------------------------------------- quantizers --

def quantize_int4(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric group int4, packed as compressed-tensors does: (packed I32, BF16 scales)."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    scale = (np.abs(g).max(axis=2) / 7.0).astype(BF16)
    s = np.maximum(scale.astype(np.float32), 1e-12)
    q = np.clip(np.rint(g / s[:, :, None]), -8, 7).astype(np.int8).reshape(rows, cols)
    u = (q + 8).astype(np.uint8)
    packed = (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)
    return packed.view("<i4").reshape(rows, cols // 8), scale


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 of (rows, cols): blocks (rows, cols/32, 16) uint8, e8m0 scales (rows, cols/32)."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // 32, 32)
    top = np.maximum(np.abs(g).max(axis=2), 1e-30)
    exp = np.ceil(np.log2(top / 6.0)).astype(np.int32)  # the block maximum fits e2m1's 6
    scaled = g / np.ldexp(1.0, exp)[:, :, None]
    # nearest e2m1 magnitude (0, .5, 1, 1.5, 2, 3, 4, 6) by the midpoints between them
    codes = np.searchsorted(_MIDPOINTS, np.abs(scaled)).astype(np.uint8) | ((scaled < 0) << 3).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, np.clip(exp + 127, 0, 254).astype(np.uint8)


def _words(nibbles: np.ndarray) -> np.ndarray:
    """(..., 8) values 0..15 -> int32 words, nibble n in bits 4n..4n+3."""
    u = np.zeros(nibbles.shape[:-1], np.uint32)
    for n in range(8):
        u |= nibbles[..., n].astype(np.uint32) << np.uint32(4 * n)
    return u.view(np.int32)


def quantize_gptq(w: np.ndarray, group: int, act_order: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Symmetric GPTQ-format parts of a (out, in) weight, stored (in, out):
    round-to-nearest (GPTQ's error feedback changes the values, not the format).
    ``act_order``: the input rows in the order they are grouped (desc_act
    takes them by the Hessian's diagonal), None for their own order."""
    t = np.ascontiguousarray(w.T)  # (in, out)
    rows, cols = t.shape
    ranked = np.arange(rows) if act_order is None else act_order
    g = t[ranked].reshape(rows // group, group, cols)
    scale = (np.abs(g).max(axis=1) / 7.0).astype(np.float16)  # (groups, out)
    s = np.maximum(scale.astype(np.float32), 1e-12)
    q = np.empty((rows, cols), np.uint8)
    q[ranked] = np.clip(np.rint(g / s[:, None, :]) + 8, 0, 15).astype(np.uint8).reshape(rows, cols)
    g_idx = np.empty(rows, np.int32)
    g_idx[ranked] = np.arange(rows) // group
    zeros = np.full((rows // group, cols), 8 - 1, np.uint8)  # stored minus one
    return {"qweight": _words(q.reshape(rows // 8, 8, cols).transpose(0, 2, 1)),
            "qzeros": _words(zeros.reshape(rows // group, cols // 8, 8)),
            "scales": scale, "g_idx": g_idx}


def quantize_awq(w: np.ndarray, group: int) -> dict[str, np.ndarray]:
    """Asymmetric AWQ GEMM parts of a (out, in) weight, stored (in, out)."""
    t = np.ascontiguousarray(w.T)
    rows, cols = t.shape
    g = t.reshape(rows // group, group, cols)
    lo, hi = g.min(axis=1), g.max(axis=1)
    scale = (np.maximum(hi - lo, 1e-8) / 15.0).astype(np.float16)
    s = scale.astype(np.float32)
    zero = np.clip(np.rint(-lo / s), 0, 15).astype(np.uint8)
    q = np.clip(np.rint(g / s[:, None, :]) + zero[:, None, :], 0, 15).astype(np.uint8).reshape(rows, cols)
    order = list(AWQ_ORDER)
    return {"qweight": _words(q.reshape(rows, cols // 8, 8)[:, :, order]),
            "qzeros": _words(zero.reshape(rows // group, cols // 8, 8)[:, :, order]),
            "scales": scale}


# ------------------------------------------------------------------ model --

def write_models(root: Path, layers: int, experts: int, hidden: int, inter: int,
                 group: int, seed: int) -> dict[str, Path]:
    rng = np.random.default_rng(seed)
    act_rng = np.random.default_rng(seed + 1)  # act order's own draws: the weights stay the seed's
    out = {f: root / f for f in FORMATS}
    for p in out.values():
        p.mkdir(parents=True, exist_ok=True)
    for layer in range(layers):
        bf16: dict[str, np.ndarray] = {}
        int4: dict[str, np.ndarray] = {}
        gptq: dict[str, np.ndarray] = {}
        gptq_act: dict[str, np.ndarray] = {}
        awq: dict[str, np.ndarray] = {}
        gate_up_b, gate_up_s, down_b, down_s = [], [], [], []
        for e in range(experts):
            w = {r: (rng.standard_normal((hidden, inter) if r == "down" else (inter, hidden)) * 0.05)
                 .astype(np.float32) for r in ("gate", "up", "down")}
            for role, value in w.items():
                base = f"model.layers.{layer}.mlp.experts.{e}.{role}_proj."
                bf16[base + "weight"] = value.astype(BF16)
                packed, scale = quantize_int4(value, group)
                int4[base + "weight_packed"] = packed
                int4[base + "weight_scale"] = scale
                int4[base + "weight_shape"] = np.array(value.shape, np.int64)
                gptq.update({base + k: v for k, v in quantize_gptq(value, group).items()})
                shuffled = act_rng.permutation(value.shape[1])
                gptq_act.update({base + k: v for k, v in quantize_gptq(value, group, shuffled).items()})
                awq.update({base + k: v for k, v in quantize_awq(value, group).items()})
            fused = np.empty((2 * inter, hidden), np.float32)
            fused[0::2], fused[1::2] = w["gate"], w["up"]
            b, s = quantize_mxfp4(fused)
            gate_up_b.append(b)
            gate_up_s.append(s)
            b, s = quantize_mxfp4(w["down"])
            down_b.append(b)
            down_s.append(s)
        base = f"model.layers.{layer}.mlp.experts."
        mx = {base + "gate_up_proj_blocks": np.stack(gate_up_b), base + "gate_up_proj_scales": np.stack(gate_up_s),
              base + "gate_up_proj_bias": np.zeros((experts, 2 * inter), BF16),
              base + "down_proj_blocks": np.stack(down_b), base + "down_proj_scales": np.stack(down_s),
              base + "down_proj_bias": np.zeros((experts, hidden), BF16)}
        name = f"model-{layer:05d}.safetensors"
        save_file(bf16, str(out["bf16"] / name))
        save_file(int4, str(out["int4"] / name))
        save_file(mx, str(out["mxfp4"] / name))
        save_file(gptq, str(out["gptq"] / name))
        save_file(gptq_act, str(out["gptq_act"] / name))
        save_file(awq, str(out["awq"] / name))
    for fmt, act in (("gptq", False), ("gptq_act", True)):
        (out[fmt] / "config.json").write_text(json.dumps({"quantization_config": {
            "quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act, "sym": True,
            "checkpoint_format": "gptq"}}))
    (out["awq"] / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}}))
    return out


def zipf_trace(tokens: int, layers: int, experts: int, top_k: int, skew: float,
               seed: int) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    trace = []
    popularity = [rng.permutation(experts) for _ in range(layers)]
    weights = 1.0 / np.arange(1, experts + 1) ** skew
    weights /= weights.sum()
    for _ in range(tokens):
        trace.append([sorted(int(popularity[l][i]) for i in rng.choice(experts, top_k, replace=False, p=weights))
                      for l in range(layers)])
    return trace


# ------------------------------------------------------------------ decode --

def cold_load_bytes(path: Path) -> dict[int, float]:
    """Bytes one cold load of an expert reads, per layer (the mean over its
    experts): the expert's parts plus what O_DIRECT alignment and the gaps
    between parts read in one pread add. Every expert leased once, uncached."""
    out: dict[int, float] = {}
    with colibri.open_store(path, slots_per_layer=1, prefetch_workers=0, direct_io=True) as store:
        for layer in store.layers:
            before = store.stats().bytes_read
            for e in range(store.num_experts(layer)):
                with store.lease(layer, e):
                    pass
            out[layer] = (store.stats().bytes_read - before) / store.num_experts(layer)
    return out


def experts_out(leases: Any, h: np.ndarray, compute: str, threads: int, activations: str) -> np.ndarray:
    """The sum of the leased experts applied to h (1, hidden): one native
    kernel call for the group (its activations in ``activations``: bf16 as
    colibri.hf runs a bfloat16 model, or f32), or (numpy) each expert
    dequantized and multiplied, as colibri's engines did before the kernels."""
    if compute == "native":
        xs = np.repeat(h, len(leases), axis=0).astype(BF16 if activations == "bf16" else np.float32)
        y = leases.ffn(xs, [1] * len(leases), threads=threads)
        return y.astype(np.float32).sum(axis=0, keepdims=True)
    y = np.zeros_like(h)
    for ex in leases:
        w = colibri.dequantize(ex)
        g, u = h @ w["gate"].T, h @ w["up"].T
        y += (g / (1 + np.exp(-g)) * u) @ w["down"].T
        del w
    return y


def open_for(path: Path, experts: int, *, slots: int, warm: bool, workers: int) -> colibri.Store:
    """A cold store (O_DIRECT, ``slots`` per layer), or a warm one: every
    expert loaded before it is used (slots for all of them)."""
    if not warm:
        return colibri.open_store(path, slots_per_layer=slots, prefetch_workers=workers,
                                  direct_io=True, slot_wait_timeout=60.0)
    layers = scan_model(path).layers
    store = colibri.open_store(path, slots_per_layer=experts, prefetch_workers=2, direct_io=True,
                               warm=[(l, e) for l in layers for e in range(experts)],
                               slot_wait_timeout=60.0)
    store.wait_idle(timeout=600.0)
    return store


def decode(path: Path, trace: list[list[list[int]]], *, slots: int, pilot_p: float | None,
           warm: bool, compute: str, threads: int, activations: str, hidden: int, experts: int, seed: int,
           load_bytes: dict[int, float]) -> dict[str, float]:
    layers = len(trace[0])
    top_k = len(trace[0][0])
    rng = random.Random(seed)
    x = np.random.default_rng(seed).standard_normal((1, hidden)).astype(np.float32)
    io_wait = compute_s = 0.0
    with open_for(path, experts, slots=slots, warm=warm, workers=2 if pilot_p else 0) as store:
        before = store.stats()
        pilot = None
        if pilot_p is not None:
            routers = {l: np.eye(experts, hidden, dtype=np.float32) for l in store.layers}
            pilot = colibri.Pilot(store, routers, top_k)
        start = time.perf_counter()
        for token in trace:
            h = x
            for layer, chosen in enumerate(token):
                if pilot is not None:
                    pilot.observe(layer, chosen)
                t0 = time.perf_counter()
                with store.lease_many(layer, chosen) as leases:
                    t1 = time.perf_counter()
                    io_wait += t1 - t0
                    if pilot is not None and layer + 1 < layers:
                        # A hidden state whose router logits rank the prediction first.
                        truth = token[layer + 1]
                        guess = [e if rng.random() < pilot_p else rng.choice(
                            [o for o in range(experts) if o not in truth]) for e in truth]
                        hint = np.zeros((1, hidden), np.float32)
                        for rank, e in enumerate(guess):
                            hint[0, e] = max(hint[0, e], 2.0 - 0.1 * rank)
                        pilot.predict_next(layer, hint)
                    y = experts_out(leases, h, compute, threads, activations)
                    compute_s += time.perf_counter() - t1
                h = h + 0.01 * y
        total = time.perf_counter() - start
        store.wait_idle(timeout=60.0)
        stats = store.stats()
        assert not warm or stats.misses == before.misses, "a warm decode missed"
        per_layer = {layer: store.layer_stats(layer) for layer in store.layers}
    n = len(trace)

    def mb(count: str) -> float:
        """MB per token of ``count`` loads per layer, each costing what a cold load reads there."""
        return sum(getattr(st, count) * load_bytes[layer] for layer, st in per_layer.items()) / 1e6 / n

    read = stats.bytes_read / 1e6 / n
    demand = mb("misses")                   # every demand miss reads its expert in full
    useful = mb("prefetch_hits")            # prefetches a lease used were read in full
    wrong = mb("prefetched") - useful       # loads started for wrong guesses, if read in full
    return {"ms_per_token": 1e3 * total / n, "io_ms_per_token": 1e3 * io_wait / n,
            "compute_ms_per_token": 1e3 * compute_s / n, "tokens_per_s": n / total,
            "mb_per_token": read, "demand_mb_per_token": demand,
            "prefetch_mb_per_token": read - demand, "wasted_mb_per_token": read - demand - useful,
            # timing-free: every load the store started (demand misses and accepted
            # prefetches, right or wrong), each counted as a whole cold load
            "issued_mb_per_token": mb("loads_started"),
            # of the wrong guesses' loads, the share of their bytes read before
            # Pilot.observe retired them (0 when there were none)
            "wrong_read_share": (read - demand - useful) / wrong if wrong > 0 else 0.0,
            "hit_rate": stats.hit_rate, "prefetch_hit_rate": stats.prefetch_hit_rate}


def prefill(path: Path, prompt: list[list[list[int]]], *, slots: int, warm: bool, hidden: int,
            experts: int, seed: int) -> float:
    """Seconds of one forward over the prompt through colibri.moe (each
    layer's union streamed through its slots, each lease group one kernel
    call): cold at ``slots`` per layer with 2 I/O workers, or warm."""
    x = np.random.default_rng(seed).standard_normal((len(prompt), hidden)).astype(np.float32)
    with open_for(path, experts, slots=slots, warm=warm, workers=2) as store:
        start = time.perf_counter()
        h = x
        for layer in range(len(prompt[0])):
            idx = np.array([token[layer] for token in prompt])
            h = h + 0.01 * moe.experts_forward(store, layer, h, idx, np.ones(idx.shape, np.float32))
        return time.perf_counter() - start


def touched(prompt: list[list[list[int]]]) -> dict[int, set[int]]:
    """The experts each layer of the prompt's routing chose."""
    out: dict[int, set[int]] = {}
    for token in prompt:
        for layer, chosen in enumerate(token):
            out.setdefault(layer, set()).update(chosen)
    return out


def payload_split(path: Path) -> tuple[float, float]:
    """(bytes of weight values, bytes of scales and biases) of one expert."""
    model = scan_model(path)
    ex = model.expert(model.layers[0], 0)
    values = sum(t.nbytes for t in (ex.gate, ex.up, ex.down) if t is not None)
    return float(values), float(ex.nbytes - values)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--group", type=int, default=128, help="int4, GPTQ and AWQ group size")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=PROMPT_TOKENS, help="prefill prompt tokens (0: no prefill)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--p", type=float, default=0.72, help="PILOT's one-layer-ahead accuracy")
    ap.add_argument("--skew", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--compute", choices=("native", "numpy"), default="native",
                    help="the experts' compute: colibri's kernels from the slots, or numpy on "
                         "colibri.dequantize (the engines' path before the kernels)")
    ap.add_argument("--threads", type=int, default=1, help="kernel threads (native compute)")
    ap.add_argument("--activations", choices=("bf16", "f32"), default="bf16",
                    help="the kernels' activations at decode (native compute): bf16, as colibri.hf "
                         "runs a bfloat16 model, or f32")
    ap.add_argument("--dir", default=None, help="where to write the models (default: a temp dir in /tmp)")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.experts, args.hidden, args.intermediate = 3, 8, 256, 128
        args.tokens, args.rounds, args.prompt = 6, 1, 32
    return args


DecodeKey = tuple[str, str]


def run_rounds(args: argparse.Namespace, paths: dict[str, Path], modes: dict[str, Any],
               load_bytes: dict[str, dict[int, float]]) -> tuple[dict[DecodeKey, list[dict[str, float]]],
                                                                 dict[DecodeKey, list[dict[str, float]]],
                                                                 dict[str, list[dict[str, float]]]]:
    """Every decode configuration and every format's prefill (in RAM, cold,
    and the O_DIRECT read of the experts the prompt touches), shuffled per
    round. Returns the decode results, their ratios to bf16 (same round and
    mode), and the prefill figures per format."""
    trace = zipf_trace(args.tokens, args.layers, args.experts, args.top_k, args.skew, args.seed)
    prompt = zipf_trace(args.prompt, args.layers, args.experts, args.top_k, args.skew, args.seed + 7)
    configs = [(f, m) for f in FORMATS for m in modes]
    jobs: list[tuple[str, str]] = configs + ([(f, p) for f in FORMATS for p in PREFILLS]
                                             if args.prompt else [])
    results: dict[DecodeKey, list[dict[str, float]]] = {c: [] for c in configs}
    ratios: dict[DecodeKey, list[dict[str, float]]] = {c: [] for c in configs}
    prefills: dict[str, list[dict[str, float]]] = {f: [] for f in FORMATS}
    for r in range(args.rounds):
        order = jobs[:]
        random.Random(1000 + r).shuffle(order)
        done: dict[tuple[str, str], Any] = {}
        for fmt, what in order:
            if what in PREFILLS:
                done[(fmt, what)] = (direct_read_time(paths[fmt], touched(prompt)).seconds
                                     if what == "read" else
                                     prefill(paths[fmt], prompt, slots=args.slots, warm=what == "in RAM",
                                             hidden=args.hidden, experts=args.experts, seed=args.seed + r))
                continue
            mode = modes[what]
            done[(fmt, what)] = decode(paths[fmt], trace, slots=args.slots, pilot_p=mode["p"],
                                       warm=mode["warm"], compute=args.compute, threads=args.threads,
                                       activations=args.activations,
                                       hidden=args.hidden, experts=args.experts, seed=args.seed + r,
                                       load_bytes=load_bytes[fmt])
        for fmt, mode in configs:
            res, base = done[(fmt, mode)], done[("bf16", mode)]
            results[(fmt, mode)].append(res)
            rat = {k: res[k] / base[k] if base[k] else 1.0 for k in (
                "mb_per_token", "demand_mb_per_token", "issued_mb_per_token", "io_ms_per_token",
                "ms_per_token", "tokens_per_s")}
            if not modes[mode]["warm"]:
                # this format's own PILOT cost in bytes: its row over its cold no-prefetch row
                rat["pilot_over_off"] = res["mb_per_token"] / done[(fmt, COLD)]["mb_per_token"]
            ratios[(fmt, mode)].append(rat)
        if args.prompt:
            for fmt in FORMATS:
                ram, cold, read = (done[(fmt, p)] for p in PREFILLS)
                prefills[fmt].append({"in_ram_s": ram, "cold_s": cold, "read_s": read,
                                      "ratio": prefill_ratio(cold, ram, read)})
    return results, ratios, prefills


def med(values: list[dict[str, float]], key: str) -> float:
    return statistics.median(v[key] for v in values)


def decode_rows(configs: list[DecodeKey], modes: dict[str, Any], results: Any, ratios: Any) -> list[tuple[str, ...]]:
    rows = []
    for fmt, mode in configs:
        res, rat = results[(fmt, mode)], ratios[(fmt, mode)]
        cold = not modes[mode]["warm"]
        rows.append((f"{fmt:<8} {mode}", f"{med(res, 'mb_per_token'):.2f}",
                     f"{med(rat, 'mb_per_token'):.3f}" if cold else "-",
                     f"{med(res, 'demand_mb_per_token'):.2f}",
                     f"{med(rat, 'demand_mb_per_token'):.3f}" if cold else "-",
                     *((f"{max(med(res, 'prefetch_mb_per_token'), 0.0):.2f} "
                        f"({max(med(res, 'wasted_mb_per_token'), 0.0):.2f})",
                        f"{med(res, 'wrong_read_share'):.2f}", f"{med(rat, 'issued_mb_per_token'):.3f}",
                        f"{med(rat, 'pilot_over_off'):.2f}") if modes[mode]["p"] is not None
                       else ("-", "-", "-", "-")),
                     f"{med(res, 'io_ms_per_token'):.1f}", f"{med(rat, 'io_ms_per_token'):.2f}",
                     f"{med(res, 'compute_ms_per_token'):.2f}", f"{med(res, 'tokens_per_s'):.2f}",
                     f"{med(rat, 'tokens_per_s'):.2f}", f"{med(res, 'hit_rate'):.2f}"))
    return rows


def check_bytes(goals: Goals, paths: dict[str, Path], results: Any, pilot_mode: str) -> None:
    """A 4-bit format's MB per token is within 1.1x of a quarter of bf16's
    plus its scales and biases (cold: without prefetch, and PILOT's demand
    and issued bytes)."""
    bf16_values, _ = payload_split(paths["bf16"])
    for fmt in QUANTIZED:
        values, extra = payload_split(paths[fmt])
        bound = bf16_values / 4 + extra        # a quarter of bf16's bytes plus this format's scales, per expert

        def against_bound(mode: str, key: str) -> float:
            return statistics.median(res[key] / base[key] * bf16_values / bound
                                     for res, base in zip(results[(fmt, mode)], results[("bf16", mode)]))

        for mode, key, what in ((COLD, "mb_per_token", "MB read"),
                                (pilot_mode, "demand_mb_per_token", "demand MB"),
                                (pilot_mode, "issued_mb_per_token", "issued MB")):
            measured = against_bound(mode, key)
            goals.check(f"{fmt} {what}/token vs bf16/4 + scales ({mode})", measured, "<= 1.1",
                        measured <= 1.1, f"{measured:.3f}x (scales+biases {extra / bound:.1%})")
        read = against_bound(pilot_mode, "mb_per_token")
        share = med(results[(fmt, pilot_mode)], "wrong_read_share")
        base_share = med(results[("bf16", pilot_mode)], "wrong_read_share")
        print(f"{fmt}: MB read/token with PILOT is {read:.3f}x bf16/4 + scales; its wrong guesses were "
              f"{share:.0%} read before being retired, bf16's {base_share:.0%}")


def check_speed(goals: Goals, ratios: Any, prefills: dict[str, list[dict[str, float]]],
                pilot_mode: str) -> None:
    """Warm, each 4-bit format decodes at least 1.3x bf16's tokens/s; cold
    with PILOT at least 1.5x; each format's prefill at the limit within 1.3x
    of the larger of its in-RAM prefill and the O_DIRECT read of its experts."""
    for fmt in QUANTIZED:
        for mode, goal in ((WARM, 1.3), (pilot_mode, 1.5)):
            x = med(ratios[(fmt, mode)], "tokens_per_s")
            goals.check(f"{fmt} tokens/s vs bf16 ({mode})", x, f">= {goal}", x >= goal, f"{x:.2f}x")
    for fmt, rows in prefills.items():
        if rows:
            x = med(rows, "ratio")
            goals.check(f"{fmt} prefill at the limit vs max(in RAM, O_DIRECT read)", x,
                        f"<= {PREFILL_GOAL}", x <= PREFILL_GOAL, f"{x:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    kernels.set_threads(args.threads)
    root = Path(args.dir or tempfile.mkdtemp(prefix="colibri_formats_", dir="/tmp"))
    try:
        paths = write_models(root, args.layers, args.experts, args.hidden, args.intermediate,
                             args.group, args.seed)
        load_bytes = {fmt: cold_load_bytes(path) for fmt, path in paths.items()}
        pilot_mode = f"cold, PILOT p={args.p}"
        modes = {WARM: {"p": None, "warm": True}, COLD: {"p": None, "warm": False},
                 pilot_mode: {"p": args.p, "warm": False}}
        results, ratios, prefills = run_rounds(args, paths, modes, load_bytes)
        configs = [(f, m) for f in FORMATS for m in modes]
        rows = decode_rows(configs, modes, results, ratios)
        print(table(f"decode ({args.compute} compute, {args.activations} activations, {args.threads} thread(s)), {args.layers} layers x "
                    f"{args.experts} experts, top-{args.top_k}, {args.slots} slots/layer cold (O_DIRECT), "
                    f"H={args.hidden} I={args.intermediate}, median of {args.rounds} rounds",
                    ("format / mode", "MB read/token", "x bf16", "demand MB", "x bf16",
                     "prefetch MB (wasted)", "wrong read", "issued x bf16", "x own no-prefetch",
                     "I/O ms/token", "x bf16", "compute ms", "tokens/s", "tokens/s x bf16", "hit rate"),
                    rows))
        prefill_rows = [(fmt, f"{med(r, 'in_ram_s'):.3f}", f"{med(r, 'cold_s'):.3f}",
                         f"{med(r, 'read_s'):.3f}", f"{med(r, 'ratio'):.2f}")
                        for fmt, r in prefills.items() if r]
        if prefill_rows:
            print(table(f"prefill of {args.prompt} tokens (native compute): in RAM (every expert "
                        f"cached), cold at {args.slots} slots/layer (O_DIRECT, 2 I/O workers), and the "
                        "O_DIRECT read of the experts it touches; seconds",
                        ("format", "in RAM s", "cold s", "read s", "cold / max(RAM, read)"),
                        prefill_rows))
        goals = Goals()
        check_bytes(goals, paths, results, pilot_mode)
        check_speed(goals, ratios, prefills, pilot_mode)
        print()
        print(goals.render())
        write_json("decode_formats", {"args": vars(args), "rows": [list(r) for r in rows],
                                      "prefill": [list(r) for r in prefill_rows], "goals": goals.items})
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
