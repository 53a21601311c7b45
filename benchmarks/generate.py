#!/usr/bin/env python3
"""transformers' generate on a MoE model larger than its RAM budget: colibri against llama.cpp and accelerate.

Two synthetic Qwen3-MoE checkpoints (transformers' own ``Qwen3MoeConfig``,
scaled down, random weights) are written to a work directory, unless
``--models DIR`` keeps them between runs or ``--model`` names a bf16 one:

    bf16   ``save_pretrained`` in bf16; for llama.cpp, llama.cpp's own
           converter makes a bf16 GGUF of it
    4bit   the same layout, wider experts and more layers, written as
           compressed-tensors pack-quantized int4 (group 32, see _int4.py);
           llama.cpp's converter makes a bf16 GGUF of it and
           ``llama_model_quantize`` a Q4_0 one (and Q4_K_M with ``--quants``),
           then the bf16 GGUF is deleted. The Q4_0 file holds exactly the
           checkpoint's int4 weights (checked), so both engines compute on the
           same numbers

For each format, one memory limit from one formula: the non-expert weights,
plus a cache of a quarter of the routed experts (both as the checkpoint
stores them), plus a fixed allowance for the runtime (``--overhead-mb``).
In ``--rounds`` rounds, with all configurations in a shuffled order each
round, each decodes the same continuation of the same prompt (256 token
ids drawn at random, ``--prompt-len``), one token a step, and records its
greedy prediction at each step, at each of ``--threads`` thread counts (the
same for every engine):

    (a) transformers in RAM    stock transformers, everything loaded: a ceiling
                               (bf16; 4bit only when its dequantized bf16 fits)
    (b) accelerate offload     ``device_map="auto"``, ``max_memory={"cpu": B}``,
                               ``offload_folder``, B = the non-expert weights +
                               the cache (bf16 only)
    (c) colibri, no prefetch   ``colibri.hf.from_pretrained(prefetch=None)``,
                               a quarter of the experts cached, O_DIRECT reads
    (d) colibri + PILOT        the same with ``prefetch="pilot"``, 2 I/O workers
    (e) llama.cpp mmap         llama-cpp-python on the GGUF, mmap (its
                               default), at the disk's own readahead
    (f) llama.cpp mmap 128K    the same with the disk's readahead
                               (``/sys/block/<dev>/queue/read_ahead_kb``) at
                               128 KiB for the run, restored afterwards
    (g) llama.cpp in RAM       the GGUF read whole (no mmap), no limit: its ceiling
    (h) colibri in RAM         every expert cached and loaded at open, no limit
    (i) colibri + PILOT, auto  (d) with ``capacity_bytes="auto"``: the cache
                               fills what the limit leaves beside the runtime
                               (as llama.cpp's page cache does), not a quarter

(b)-(f) and (i) run under the limit, (a), (g), (h) without one (their peak is
recorded). Every run is a child process of its own, started cold: the page
cache is dropped before it (``sync; echo 3 > drop_caches``) and the child
runs in a cgroup-v1 memory cgroup whose limit counts page cache and
anonymous memory alike, so what a configuration reads comes from the disk.

Measured per run, over the decode (from the first generated token to the
last): tokens/s; prefill (the prompt's forward and the first token) and load
times; disk MB per token (``read_bytes`` of the child's ``/proc/self/io``,
page faults on mmap and readahead included); the cgroup's peak memory; for
colibri the I/O wait share (time inside the store's ``lease``/``lease_many``
over the decode time), hit rate and store MB per token; for (b) the time in
accelerate's hooks. Ratios are taken within a round; medians over rounds are
reported.

Prefill at the limit: each colibri run records which experts its prompt's
routing chose (a ``Runtime.routing`` hook, for the prompt's forward only).
After each round, the parent reads every expert the round's (c) and (d)
runs touched with O_DIRECT (``_prefill.direct_read_time``, after a drop of
the page cache), and takes for (c) and (d) the ratio of their prefill to the
larger of that read time and the in-RAM prefill of the same round and
threads ((a); (h) where (a) is not run, as for the full 4bit model).

The greedy predictions are compared with (a)'s (else (c)'s) step by
step. (The continuation is fixed rather than the model's own greedy output:
greedy decoding of these random models falls into a two-token loop within a
few steps, which would repeat the same experts and make every cache look
good; a fixed random continuation routes like sampled text and is the same
input in every engine, so a numerical difference at one step does not carry
over to the next.)

Then, unless ``--no-sim``, ``benchmarks/decode_sim.py`` runs at the compute
ratio (c) measured on bf16, so that (d)'s I/O wait can be compared with the
simulation's.

Goals, as ratios within a round, per format and thread count: (d) >= 1.5x
the faster of (e) and (f); (h) >= 0.8x (g); on bf16 (d) >= 10x (b); (d)
faster than (c); (d)'s I/O wait share no worse than decode_sim's PILOT w=2;
(c) and (d)'s prefill at most 1.3x the larger of the in-RAM prefill and the
O_DIRECT read of the prompt's experts.

Needs root (cgroups, drop_caches, readahead) and a cgroup-v1 memory
controller; ``--no-limit`` runs without them (then nothing is cold). The
llama.cpp rows need llama-cpp-python (``pip install '.[bench]'``, built for
this CPU); ``--quick`` leaves them out when it is missing.

    python benchmarks/generate.py                # both formats, 1 and 2 threads, 3 rounds: hours on 2 cores
    python benchmarks/generate.py --models /var/tmp/genbench   # the same, models kept and reused
    python benchmarks/generate.py --quick        # small models, 1 round, 1 thread: a few minutes
    python benchmarks/generate.py --model DIR    # an existing bf16 checkpoint
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import _llama  # noqa: E402
from _common import drop_caches, timed_into  # noqa: E402
from _prefill import GOAL as PREFILL_GOAL, PROMPT_TOKENS, TouchedExperts  # noqa: E402
from _prefill import direct_read_time, prefill_ratio  # noqa: E402

DEFAULT_JSON = HERE / "results" / "generate.json"
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
MB = 1e6
MiB = 1 << 20

CONFIGS = {
    "a": "(a) transformers in RAM",
    "b": "(b) accelerate offload",
    "c": "(c) colibri, no prefetch",
    "d": "(d) colibri + PILOT",
    "e": "(e) llama.cpp mmap",
    "f": "(f) llama.cpp mmap, RA 128K",
    "g": "(g) llama.cpp in RAM",
    "h": "(h) colibri in RAM",
    "i": "(i) colibri + PILOT, cache auto",
}
LIMITED = frozenset("bcdefi")    # under the format's memory limit
LLAMA = frozenset("efg")
COLIBRI = frozenset("cdhi")
FORMATS = ("bf16", "4bit")

# The models written when --model is not given: Qwen3-MoE's layout (128
# experts, top-8, norm_topk_prob) with the widths scaled down.
FULL_MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=384,
                  num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                  num_experts=128, num_experts_per_tok=8)
QUICK_MODEL = dict(vocab_size=8000, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   num_experts=32, num_experts_per_tok=4)
# 4bit: twice the expert width and 48 layers: int4 experts of 8.2 GB (29 GB in
# bf16), 2.6x what their limit leaves them (the limit's fixed runtime allowance
# keeps that under 4x at any size); llama.cpp in RAM, its file plus a repacked
# copy, peaks at 17 GB, about what a 24 GiB machine can hold
FULL_MODEL_4BIT = dict(FULL_MODEL, moe_intermediate_size=768, num_hidden_layers=48)
QUICK_MODEL_4BIT = QUICK_MODEL


# ---------------------------------------------------------------------------
# the models on disk


def write_model(directory: Path, shape: dict[str, Any], seed: int) -> None:
    """Qwen3MoeForCausalLM from its config, random bf16 weights, save_pretrained (1 GB shards).

    Weights are drawn directly instead of by transformers' initializer (which
    takes minutes on 2.4 billion parameters): N(0, 0.02) as the config's
    ``initializer_range``, norms 1, and each layer's experts cycled from a
    pool of 7 random ones (the page cache does not deduplicate, so every
    expert is still a distinct read). The token embedding is drawn with std
    ``embed_std``: with 0.02 the residual stream of an untrained model is
    dominated by what every token shares, and the routing of all tokens
    nearly collapses (95% LRU hit rate with a quarter of the experts cached,
    which no trained model shows); with 0.6 the token dominates it, as in a
    trained model whose residual stream is large against each layer's update.
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    from transformers.initialization import no_init_weights

    shape = dict(shape)
    embed_std = float(shape.pop("embed_std"))
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**shape, norm_topk_prob=True, max_position_embeddings=4096,
                            tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                            pad_token_id=None)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    std = config.initializer_range
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif "embed_tokens" in name:
                param.normal_(0.0, embed_std)
            elif ".experts." in name:
                pool = torch.randn((7, *param.shape[1:]), dtype=torch.float32).mul_(std).to(param.dtype)
                for e in range(param.shape[0]):
                    param[e].copy_(pool[e % len(pool)])
            else:
                param.normal_(0.0, std)
    model.generation_config.eos_token_id = None
    model.save_pretrained(directory, max_shard_size="1GB")


def safetensors_sizes(directory: Path) -> dict[str, Any]:
    """Bytes of the routed experts and of everything else, from the shards' headers."""
    expert_bytes = other = 0
    per_expert: dict[tuple[int, int], int] = {}
    files = sorted(directory.glob("*.safetensors"))
    for path in files:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            size = meta["data_offsets"][1] - meta["data_offsets"][0]
            parts = name.split(".")
            if ".experts." in name and "shared" not in name and parts[parts.index("experts") + 1].isdigit():
                key = (int(parts[parts.index("layers") + 1]), int(parts[parts.index("experts") + 1]))
                per_expert[key] = per_expert.get(key, 0) + size
                expert_bytes += size
            else:
                other += size
    layers = sorted({layer for layer, _ in per_expert})
    experts = {layer: sum(1 for (l, _) in per_expert if l == layer) for layer in layers}
    return {"files": [str(p) for p in files], "expert_bytes": expert_bytes, "other_bytes": other,
            "layers": layers, "experts_per_layer": experts,
            "one_expert": max(per_expert.values()) if per_expert else 0}


# ---------------------------------------------------------------------------
# cold starts: page cache and memory cgroups


class MemoryCgroup:
    """A cgroup-v1 memory cgroup for one child process: page cache and
    anonymous memory both count against ``limit`` (None: no limit, only the
    peak is recorded)."""

    def __init__(self, name: str, limit: int | None) -> None:
        self.path = CGROUP_ROOT / name
        self.path.mkdir()
        if limit is not None:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
        self.limit = limit

    def enter(self) -> None:
        """Moves the calling process in (run in the child before exec)."""
        with open(self.path / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    def read(self) -> dict[str, Any]:
        def num(name: str) -> int:
            try:
                return int((self.path / name).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                return -1
        oom_kills = 0
        try:
            for line in (self.path / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    oom_kills = int(line.split()[1])
        except OSError:
            pass
        return {"limit": self.limit, "peak": num("memory.max_usage_in_bytes"),
                "failcnt": num("memory.failcnt"), "oom_kills": oom_kills}

    def remove(self) -> None:
        try:
            (self.path / "memory.force_empty").write_text("0")
        except OSError:
            pass
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def approx_bytes(shape: dict[str, Any]) -> dict[str, float]:
    """Parameters of a Qwen3-MoE shape: routed experts, attention, the rest (embeddings, routers)."""
    h, layers, experts = shape["hidden_size"], shape["num_hidden_layers"], shape["num_experts"]
    attn = layers * h * shape["head_dim"] * 2 * (shape["num_attention_heads"] + shape["num_key_value_heads"])
    return {"experts": 3.0 * h * shape["moe_intermediate_size"] * experts * layers, "attention": float(attn),
            "other": 2.0 * shape["vocab_size"] * h + layers * experts * h}


def disk_needed(formats: list[str], shapes: dict[str, dict[str, Any]], configs: str, quants: list[str]) -> float:
    """Bytes the benchmark's files take at their peak (4bit is prepared first: its bf16 GGUF is transient)."""
    llama = any(c in LLAMA for c in configs)
    peak = kept = 0.0
    if "4bit" in formats:
        p = approx_bytes(shapes["4bit"])
        int4 = 0.5625 * (p["experts"] + p["attention"]) + 2 * p["other"]
        kept = int4 * (1 + (len(quants) * 1.15 if llama else 0))
        peak = kept + (2 * sum(p.values()) if llama else 0)
    if "bf16" in formats:
        bf16 = 2 * sum(approx_bytes(shapes["bf16"]).values())
        peak = max(peak, kept + bf16 * (1 + llama + ("b" in configs)))
    return peak


def prepare_format(fmt: str, args: argparse.Namespace, base: Path, shape: dict[str, Any], quants: list[str],
                   converter: Path | None) -> dict[str, Any]:
    """The checkpoint of ``fmt`` and its GGUFs under ``base/fmt`` (reused when already there, same shape)."""
    d = base / fmt
    hf = args.model if (fmt == "bf16" and args.model) else d / "hf"
    marker = d / "shape.json"
    want = json.dumps({"shape": shape, "seed": args.seed}, sort_keys=True)
    if hf != args.model and not (marker.exists() and marker.read_text() == want):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", f"write-{fmt}",
                        "--model", str(hf), "--child-plan", json.dumps(shape), "--seed", str(args.seed)],
                       check=True, cwd=str(ROOT), env=dict(os.environ, TRANSFORMERS_VERBOSITY="error"))
        marker.write_text(want)
        print(f"{fmt}: checkpoint written in {time.perf_counter() - t0:.0f} s: Qwen3MoeForCausalLM "
              + ", ".join(f"{k}={v}" for k, v in shape.items()), flush=True)
    d.mkdir(parents=True, exist_ok=True)
    ggufs: dict[str, Path] = {}
    if converter is not None:
        wanted = ["bf16"] if fmt == "bf16" else quants
        for kind in wanted:
            path = d / f"{kind}.gguf"
            ggufs[kind] = path
            if path.exists():
                continue
            full = d / "bf16.gguf"
            if not full.exists():
                if not (hf / "tokenizer.json").exists():
                    _llama.write_tokenizer(hf)
                secs = _llama.convert(converter, hf, full)
                print(f"{fmt}: {full.name} written by llama.cpp's convert_hf_to_gguf.py in {secs:.0f} s "
                      f"({full.stat().st_size / 1e9:.2f} GB)", flush=True)
            if kind != "bf16":
                secs = _llama.quantize(full, path, kind, threads=os.cpu_count() or 1)
                print(f"{fmt}: {path.name} written by llama_model_quantize in {secs:.0f} s "
                      f"({path.stat().st_size / 1e9:.2f} GB)", flush=True)
        if fmt == "4bit":
            (d / "bf16.gguf").unlink(missing_ok=True)
    sizes = safetensors_sizes(hf)
    if not sizes["layers"]:
        raise SystemExit(f"{hf}: no routed experts found")
    n_experts = min(sizes["experts_per_layer"].values())
    slots = args.slots or max(1, n_experts // 4)
    cache_bytes = slots * len(sizes["layers"]) * sizes["one_expert"]
    pair = {"fmt": fmt, "hf": str(hf), "gguf": {k: str(v) for k, v in ggufs.items()}, "sizes": sizes,
            "n_experts": n_experts, "slots": slots, "cache_bytes": cache_bytes,
            "weights_budget": sizes["other_bytes"] + cache_bytes,
            "limit": sizes["other_bytes"] + cache_bytes + args.overhead_mb * MiB,
            "gguf_sizes": {k: _llama.gguf_sizes(v, converter) for k, v in ggufs.items()} if converter else {},
            "same_weights": None}
    if fmt == "4bit" and "q4_0" in ggufs and converter is not None:
        import _int4

        layer = sizes["layers"][-1]
        tensor = _llama.gguf_tensor(ggufs["q4_0"], f"blk.{layer}.ffn_gate_exps.weight", converter)
        pair["same_weights"] = max(_int4.max_abs_difference(hf, tensor, layer, e) for e in (0, n_experts - 1))
    return pair


def describe(pair: dict[str, Any], args: argparse.Namespace) -> None:
    s, fmt = pair["sizes"], pair["fmt"]
    experts, other = s["expert_bytes"], s["other_bytes"]
    left = pair["limit"] - other
    print(f"{fmt}: checkpoint {(experts + other) / 1e9:.2f} GB in {len(s['files'])} shards: routed experts "
          f"{experts / 1e9:.2f} GB ({len(s['layers'])} MoE layers x {pair['n_experts']} x "
          f"{s['one_expert'] / MB:.2f} MB), the rest {other / 1e9:.2f} GB")
    print(f"{fmt}: colibri cache {pair['slots']} slots/layer = {pair['cache_bytes'] / 1e9:.2f} GB (experts / "
          f"cache = {experts / pair['cache_bytes']:.1f}x); memory limit {pair['limit'] / 1e9:.2f} GB = the rest + "
          f"the cache + {args.overhead_mb} MiB; it leaves the experts {left / 1e9:.2f} GB "
          f"(experts / that = {experts / left:.2f}x)")
    for kind, g in pair["gguf_sizes"].items():
        print(f"{fmt}: {kind}.gguf {g['file_bytes'] / 1e9:.2f} GB: experts {g['expert_bytes'] / 1e9:.2f} GB, "
              f"the rest {g['other_bytes'] / 1e9:.2f} GB ({g['file_bytes'] / pair['limit']:.2f}x the limit)")
    if pair["same_weights"] is not None:
        print(f"{fmt}: Q4_0 GGUF against the int4 checkpoint, two experts of the last layer: max |difference| "
              f"{pair['same_weights']:.3g}" + (" (the same weights)" if pair["same_weights"] == 0 else ""))


# ---------------------------------------------------------------------------
# one run: a configuration of one format at one thread count


def run_key(run: dict[str, Any]) -> str:
    return f"{run['fmt']}/{run['threads']}t/{run['config']}" + (f"/{run['quant']}" if run.get("quant") else "")


def run_label(run: dict[str, Any]) -> str:
    quant = f" {run['quant'].upper()}" if run.get("quant") and run["quant"] != "bf16" else ""
    return CONFIGS[run["config"]] + quant


def run_child(run: dict[str, Any], pair: dict[str, Any], args: argparse.Namespace, workdir: Path,
              rnd: int, plan: dict[str, Any]) -> dict[str, Any]:
    """One configuration in a fresh process, cold, under its memory cgroup."""
    config = run["config"]
    tag = run_key(run).replace("/", "-")
    out = workdir / f"result-{tag}-{rnd}.json"
    log = workdir / f"log-{tag}-{rnd}.txt"
    offload = workdir / f"offload-{tag}-{rnd}"
    limit = pair["limit"] if config in LIMITED else None
    plan = dict(plan, threads=run["threads"], model=pair["hf"], slots=pair["slots"], n_experts=pair["n_experts"],
                layers=pair["sizes"]["layers"], cpu_budget=pair["weights_budget"],
                gguf=pair["gguf"].get(run.get("quant") or "", ""))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", config, "--child-out", str(out),
           "--offload-folder", str(offload), "--child-plan", json.dumps(plan)]
    threads = str(run["threads"])
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads,
               MKL_NUM_THREADS=threads, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    group = None
    t0 = time.perf_counter()
    with _llama.readahead(Path(plan["gguf"] or plan["model"]), args.readahead_kb if config == "f" else None) as ra:
        cold = drop_caches() if not args.no_limit else False
        try:
            if not args.no_limit:
                group = MemoryCgroup(f"colibri-genbench-{os.getpid()}-{tag}-{rnd}", limit)
            with open(log, "w") as logf:
                proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                        preexec_fn=group.enter if group else None)
                try:
                    _, status, usage = os.wait4(proc.pid, 0)
                except BaseException:
                    proc.kill()
                    proc.wait()
                    raise
                proc.returncode = os.waitstatus_to_exitcode(status)
            memory = group.read() if group else {}
        finally:
            if group:
                group.remove()
            shutil.rmtree(offload, ignore_errors=True)
    memory["max_rss"] = usage.ru_maxrss * 1024
    wall = time.perf_counter() - t0
    base = {"run": run_key(run), **run, "memory": memory, "wall_s": wall, "cold": cold, "read_ahead_kb": ra}
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text(errors="replace").splitlines()[-15:]
        why = "killed by the OOM killer" if memory.get("oom_kills") else f"exit {proc.returncode}"
        return {**base, "ok": False, "error": why, "log_tail": tail}
    result = json.loads(out.read_text())
    out.unlink()
    log.unlink()
    return {**result, **base, "ok": True}


# ---------------------------------------------------------------------------
# the child: one configuration


def record_touched(runtime: Any) -> Callable[[], dict[int, set[int]]]:
    """Records the experts the next forward's routing chooses (the prompt's),
    after any routing hook already set. The returned call stops recording
    (the decode steps' routing is not wanted, nor its cost) and gives them."""
    touched = TouchedExperts(min_tokens=1)
    before = runtime.routing

    def both(layer: int, index: Any, weights: Any) -> None:
        before(layer, index, weights)
        touched(layer, index, weights)

    runtime.routing = touched if before is None else both

    def done() -> dict[int, set[int]]:
        runtime.routing = before
        return touched.experts
    return done


def read_bytes() -> int:
    """Bytes this process has made the disk read (/proc/self/io), page faults and readahead included."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def decode_figures(marks: list[tuple[float, float, int]], predicted: list[int], limited_wait: bool) -> dict[str, Any]:
    """The figures of one decode from its marks (time, I/O wait so far, bytes read so far): the first
    mark before the prompt, then one after each token; ``predicted``: the greedy prediction at each step."""
    (t_p, w_p, r_p), (t_1, w_1, r_1), (t_n, w_n, r_n) = marks[0], marks[1], marks[-1]
    steps = len(marks) - 2           # decode steps timed: token 2 .. token N
    decode_s = t_n - t_1
    return {"tokens": len(predicted), "decode_steps": steps, "prefill_s": t_1 - t_p, "decode_s": decode_s,
            "tokens_per_s": steps / decode_s, "ms_per_token": 1e3 * decode_s / steps,
            "wait_s": w_n - w_1, "io_wait_share": (w_n - w_1) / decode_s if limited_wait else 0.0,
            "prefill_wait_s": w_1 - w_p, "disk_mb_per_token": (r_n - r_1) / MB / steps,
            "prefill_disk_mb": (r_1 - r_p) / MB, "predicted": predicted, "colibri": colibri_origin()}


def child_llama(config: str, out: Path, plan: dict[str, Any]) -> None:
    r = _llama.decode(Path(plan["gguf"]), plan["prompt"], plan["continuation"][:plan["tokens"]], plan["threads"],
                      use_mmap=config != "g", read_bytes=read_bytes)
    result = decode_figures([(t, 0.0, b) for t, b in r["marks"]], r["predicted"], False)
    result.update(config=config, load_s=r["load_s"], llama_cpp=r["llama_cpp"])
    out.write_text(json.dumps(result))


def child(config: str, out: Path, offload: Path, plan: dict[str, Any]) -> None:
    if config in LLAMA:
        child_llama(config, out, plan)
        return
    t_start = time.perf_counter()
    import torch
    import transformers
    from transformers import LogitsProcessor, LogitsProcessorList
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(plan["threads"])
    t_import = time.perf_counter() - t_start
    model_dir = plan["model"]
    waited = {"wait": 0.0}
    store = None
    runtime = None
    touched: Callable[[], dict[int, set[int]]] | None = None
    extra: dict[str, Any] = {}

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        return timed_into(waited, "wait", fn)

    t0 = time.perf_counter()
    if config == "a":
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    elif config == "b":
        import accelerate.hooks

        hook = accelerate.hooks.AlignDevicesHook
        hook.pre_forward = timed(hook.pre_forward)  # type: ignore[method-assign]
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, device_map="auto",
            max_memory={"cpu": plan["cpu_budget"]}, offload_folder=str(offload))
        device_map = getattr(model, "hf_device_map", {})
        extra["device_map_disk"] = sorted(k for k, v in device_map.items() if v == "disk")
        extra["device_map_cpu"] = sorted(k for k, v in device_map.items() if v != "disk")
        extra["resident_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters()
                                      if p.device.type != "meta")
    else:
        import colibri.hf

        if config == "h":     # every expert in the cache, read at open
            options: dict[str, Any] = dict(
                slots_per_layer=plan["n_experts"], prefetch=None, prefetch_workers=0, direct_io=plan["direct_io"],
                warm=[(layer, e) for layer in plan["layers"] for e in range(plan["n_experts"])])
        elif config == "i":   # the cache fills what the limit leaves (capacity_bytes="auto")
            options = dict(capacity_bytes="auto", prefetch="pilot", prefetch_workers=2, direct_io=plan["direct_io"])
        else:
            options = dict(slots_per_layer=plan["slots"], prefetch="pilot" if config == "d" else None,
                           prefetch_workers=2 if config == "d" else 0, direct_io=plan["direct_io"])
        model = colibri.hf.from_pretrained(model_dir, torch_dtype=torch.bfloat16, **options)
        store = colibri.hf.store_of(model)
        runtime = getattr(model, "colibri", None)
        # Every expert the engine uses goes through one of these two: the
        # time inside them is the time it waited for a read (a hit returns
        # in microseconds).
        store.lease_many = timed(store.lease_many)  # type: ignore[method-assign]
        store.lease = timed(store.lease)  # type: ignore[method-assign]
        touched = record_touched(colibri.hf.runtime_of(model))
    model.eval()
    t_load = time.perf_counter() - t0

    marks: list[tuple[float, float, int]] = []
    stats: list[dict[str, int] | None] = []

    class Clock(BaseStreamer):  # type: ignore[misc]
        """Marks every step of generate: the prompt, then each new token."""

        def put(self, value: Any) -> None:
            stats.append(store.stats().as_dict() if store is not None else None)
            marks.append((time.perf_counter(), waited["wait"], read_bytes()))
            if len(marks) == 2 and touched is not None:     # the prompt's forward is done
                extra["touched_experts"] = {str(layer): sorted(e) for layer, e in sorted(touched().items())}

        def end(self) -> None:
            pass

    class Forced(LogitsProcessor):  # type: ignore[misc]
        """Records the greedy prediction of each step, then makes the continuation's token the only choice."""

        def __init__(self, continuation: list[int]) -> None:
            self.continuation = continuation
            self.predicted: list[int] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            self.predicted.append(int(scores[0].argmax()))
            forced = torch.full_like(scores, float("-inf"))
            forced[:, self.continuation[len(self.predicted) - 1]] = 0.0
            return forced

    prompt = torch.tensor([plan["prompt"]], dtype=torch.long)
    tokens = plan["tokens_offload"] if config == "b" else plan["tokens"]
    forced = Forced(plan["continuation"][:tokens])
    with torch.no_grad():
        output = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                                min_new_tokens=tokens, do_sample=False, streamer=Clock(), pad_token_id=0,
                                logits_processor=LogitsProcessorList([forced]))
    if output[0, prompt.shape[1]:].tolist() != forced.continuation:
        raise RuntimeError("generate did not follow the forced continuation")
    result = decode_figures(marks, forced.predicted, config != "a")
    result.update(config=config, import_s=t_import, load_s=t_load, **extra)
    s_1, s_n = stats[1], stats[-1]
    if store is not None and s_1 is not None and s_n is not None:
        d = {k: s_n[k] - s_1[k] for k in ("requests", "hits", "misses", "prefetched", "prefetch_hits",
                                           "bytes_read")}
        steps = result["decode_steps"]
        result.update(
            decode_stats=d, final_stats=s_n,
            hit_rate=d["hits"] / d["requests"] if d["requests"] else 0.0,
            prefetch_hit_rate=d["prefetch_hits"] / d["prefetched"] if d["prefetched"] else None,
            store_mb_per_token=d["bytes_read"] / MB / steps,
            ms_per_miss=1e3 * result["wait_s"] / d["misses"] if d["misses"] else None,
            moe_layers=len(store.layers))
        pilot = getattr(runtime, "pilot", None)
        if pilot is not None:
            rep = pilot.report()
            result["pilot"] = {"precision": rep.precision, "recall": rep.recall}
        model.colibri_close()
    out.write_text(json.dumps(result))


# ---------------------------------------------------------------------------
# the decode simulation at the measured ratio


def run_decode_sim(ratio: float, p: float, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    out = workdir / "decode_sim.json"
    cmd = [sys.executable, str(HERE / "decode_sim.py"), "--cache", "cold", "--pilot-workers", "2",
           "--p", f"{p:.2f}", "--compute-ratio", f"{ratio:.3f}", "--rounds", str(args.sim_rounds),
           "--json", str(out), "--workdir", str(workdir)]
    if args.quick:
        cmd.append("--quick")
    print("\n$ " + " ".join(["python", "benchmarks/decode_sim.py"] + cmd[2:]), flush=True)
    proc = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-2000:] + proc.stderr[-2000:])
        return {"ok": False}
    data = json.loads(out.read_text())
    cold = data["tables"]["cold"]
    pilot = next(r for r in cold["rows"] if r["name"] == "PILOT w=2")
    none = next(r for r in cold["rows"] if r["name"] == "no prefetch")
    measured = [c["measured_ratio"] for c in data["calibrations"] if c.get("section") == "cold"]
    return {"ok": True, "command": " ".join(cmd[1:]), "colibri": data["environment"]["colibri"],
            "pilot_wait_share": pilot["io_wait_share"],
            "none_wait_share": none["io_wait_share"], "pilot_hit_rate": pilot["hit_rate"],
            "pilot_precision": pilot["precision"], "measured_ratios": measured,
            "asked_ratio": ratio, "p": p, "pilot_speedup": pilot["speedup"]}


# ---------------------------------------------------------------------------
# the parent: plan, rounds, tables


def colibri_origin() -> str | None:
    """The file ``import colibri`` loads in this process (whether or not it has been imported)."""
    spec = importlib.util.find_spec("colibri")
    return str(Path(spec.origin).resolve()) if spec is not None and spec.origin else None


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt(v: float | None, spec: str, unit: str = "") -> str:
    if v is None or v != v:
        return "-"
    return format(v, spec) + unit


def print_table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
    widths = [max(len(str(x[i])) for x in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w)
                        for i, (v, w) in enumerate(zip(row, widths))))


def differences(a: list[int], b: list[int]) -> list[int]:
    """The steps at which two runs' greedy predictions differ (over the steps both have)."""
    return [i for i, (x, y) in enumerate(zip(a, b)) if x != y]


def measure_reads(this: dict[str, dict[str, Any]], pairs: dict[str, dict[str, Any]],
                  args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Per format, the time to read every expert the round's colibri runs
    under the limit ((c), (d)) touched in their prefill, with O_DIRECT after
    a drop of the page cache (as before every run): the read figure of the
    prefill ratio. The union over those runs (their routing agrees up to ties
    in bf16 arithmetic)."""
    out: dict[str, dict[str, Any]] = {}
    for f, pair in pairs.items():
        experts: dict[int, set[int]] = {}
        for r in this.values():
            if r["fmt"] == f and r["config"] in "cd" and r["ok"] and "touched_experts" in r:
                for layer, es in r["touched_experts"].items():
                    experts.setdefault(int(layer), set()).update(es)
        if not experts:
            continue
        cold = drop_caches() if not args.no_limit else False
        bound = direct_read_time(pair["hf"], experts)
        out[f] = {"seconds": bound.seconds, "bytes": bound.bytes, "experts": bound.experts,
                  "direct": bound.direct, "cold": cold}
        print(f"  O_DIRECT read, {f}: the {bound.experts} experts the prompt touched "
              f"({bound.experts / (pair['n_experts'] * len(pair['sizes']['layers'])):.0%} of them), "
              f"{bound.bytes / MB:.0f} MB in {bound.seconds:.2f} s ({bound.mb_per_s:.0f} MB/s"
              + ("" if bound.direct else ", O_DIRECT refused: through the page cache") + ")", flush=True)
    return out


def prefill_rows(formats: list[str], threads: list[int], runs: list[dict[str, Any]],
                 rounds: list[dict[str, dict[str, Any]]],
                 reads: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each colibri configuration under the limit: its prefill, the in-RAM
    prefill of the same round and threads ((a), else (h) when (a) is not run),
    the round's O_DIRECT read of the prompt's experts, and their
    :func:`prefill_ratio`, per round that has all three."""
    planned = {run_key(r) for r in runs}
    rows = []
    for f in formats:
        for t in threads:
            key = {c: run_key({"fmt": f, "threads": t, "config": c}) for c in "ahcd"}
            ram = next((c for c in "ah" if key[c] in planned), None)
            for c in "cd":
                if key[c] not in planned or ram is None:
                    continue
                row: dict[str, Any] = {"run": key[c], "label": f"{f} {t}t {CONFIGS[c]}", "in_ram": f"({ram})",
                                       "colibri_s": [], "in_ram_s": [], "read_s": [], "ratios": []}
                for this, read in zip(rounds, reads):
                    mine, ref = this.get(key[c]), this.get(key[ram])
                    if not (mine and mine["ok"] and ref and ref["ok"] and f in read):
                        continue
                    row["colibri_s"].append(mine["prefill_s"])
                    row["in_ram_s"].append(ref["prefill_s"])
                    row["read_s"].append(read[f]["seconds"])
                    row["ratios"].append(prefill_ratio(mine["prefill_s"], ref["prefill_s"], read[f]["seconds"]))
                rows.append(row)
    return rows


# Peak memory of the unlimited in-RAM rows per byte of their files, as
# measured: llama.cpp in RAM holds its file and a repacked copy (2.0x),
# transformers its checkpoint and the page cache of it (2.15x, bf16; 4bit's
# (a) is decided by its dequantized size), colibri with every expert cached
# its checkpoint and the runtime (1.3x)
IN_RAM_PEAK = {"a": 2.2, "g": 2.1, "h": 1.4}


def in_ram_left_out(pair: dict[str, Any], config: str, quant: str | None, mem_total: int) -> str | None:
    """Why an unlimited in-RAM row of ``pair`` is left out on a machine of
    ``mem_total`` bytes (its expected peak would not fit), or None."""
    if config not in IN_RAM_PEAK or (config == "a" and pair["fmt"] != "bf16"):
        return None
    if config == "g":
        size = pair["gguf_sizes"].get(quant or "", {}).get("file_bytes", 0)
    else:
        size = pair["sizes"]["expert_bytes"] + pair["sizes"]["other_bytes"]
    peak = IN_RAM_PEAK[config] * size
    if peak <= 0.85 * mem_total:
        return None
    return (f"{pair['fmt']}: {CONFIGS[config]}{' ' + quant.upper() if quant and quant != 'bf16' else ''} left out: "
            f"it would peak at about {peak / 1e9:.1f} GB, this machine has {mem_total / 1e9:.1f} GB")


def plan_runs(formats: list[str], configs: str, threads: list[int], quants: list[str],
              pairs: dict[str, dict[str, Any]], fits_4bit_a: bool, mem_total: int | None = None,
              notes: list[str] | None = None) -> list[dict[str, Any]]:
    """The runs of a round. With ``mem_total``, the in-RAM rows whose peak
    would not fit are left out, each with its reason in ``notes``."""
    runs = []
    notes = [] if notes is None else notes

    def left_out(pair: dict[str, Any], config: str, quant: str | None) -> bool:
        why = in_ram_left_out(pair, config, quant, mem_total) if mem_total is not None else None
        if why is not None and why not in notes:
            notes.append(why)
        return why is not None

    for f in formats:
        for t in threads:
            for c in configs:
                if f == "4bit" and (c == "b" or (c == "a" and not fits_4bit_a)):
                    continue
                if c in LLAMA:
                    for q in (["bf16"] if f == "bf16" else quants):
                        if q in pairs[f]["gguf"] and not left_out(pairs[f], c, q):
                            runs.append({"fmt": f, "config": c, "threads": t, "quant": q})
                elif not left_out(pairs[f], c, None):
                    runs.append({"fmt": f, "config": c, "threads": t, "quant": None})
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an existing bf16 checkpoint (then only the bf16 format runs)")
    ap.add_argument("--models", type=Path, help="where the checkpoints and GGUFs are written and kept; "
                    "ones already there with the same shape and seed are reused (default: in the work "
                    "directory, deleted at the end)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp"),
                    help="where the models (without --models), offload folders and logs go")
    ap.add_argument("--formats", default=",".join(FORMATS), help="bf16, 4bit or both (comma-separated)")
    ap.add_argument("--quants", default="q4_0", help="the 4-bit GGUFs for llama.cpp: q4_0 (the same weights "
                    "as the int4 checkpoint), q4_k_m (its own quantization), comma-separated")
    ap.add_argument("--embed-std", type=float, default=0.6,
                    help="std of the written model's token embedding (see write_model)")
    ap.add_argument("--slots", type=int, default=None, help="colibri slots per layer (default: experts / 4)")
    ap.add_argument("--tokens", type=int, default=24, help="new tokens, but for (b)")
    ap.add_argument("--tokens-offload", type=int, default=6, help="new tokens for (b)")
    ap.add_argument("--prompt-len", type=int, default=PROMPT_TOKENS,
                    help="prompt tokens (default: the prefill goal's, also with --quick)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="".join(CONFIGS), help="which configurations to run (letters)")
    ap.add_argument("--overhead-mb", type=int, default=1024,
                    help="memory limit allowance for the runtime (Python, torch, transformers, "
                         "activations) on top of the weights budget")
    ap.add_argument("--readahead-kb", type=int, default=128, help="the disk's readahead for (f)")
    ap.add_argument("--buffered", action="store_true", help="colibri reads through the page cache "
                    "(default: O_DIRECT)")
    ap.add_argument("--threads", default=None, help="thread counts, the same for every engine "
                    "(comma-separated; default 1,2, with --quick 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-limit", action="store_true", help="no cgroup, no drop_caches (not cold)")
    ap.add_argument("--no-sim", action="store_true", help="skip the decode simulation at the same ratio")
    ap.add_argument("--sim-rounds", type=int, default=2)
    ap.add_argument("--llama-cpp-src", type=Path, help="a llama.cpp tree (or llama-cpp-python's unpacked "
                    "sdist) to take the converter from, instead of fetching the installed version's sdist")
    ap.add_argument("--quick", action="store_true", help="small models, one round: a smoke run "
                                                         "(llama.cpp rows only when it is installed)")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--child", choices=["write-bf16", "write-4bit", *CONFIGS], help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child-plan", help=argparse.SUPPRESS)
    ap.add_argument("--offload-folder", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child == "write-bf16":
        write_model(args.model, json.loads(args.child_plan), args.seed)
        return 0
    if args.child == "write-4bit":
        from _int4 import write_int4_model

        write_int4_model(args.model, json.loads(args.child_plan), args.seed)
        return 0
    if args.child:
        child(args.child, args.child_out, args.offload_folder, json.loads(args.child_plan))
        return 0

    if args.prompt_len < 2:
        ap.error("--prompt-len: at least 2 tokens (a prefill, not a decode step)")
    if args.quick:
        args.tokens = min(args.tokens, 8)
        args.tokens_offload = min(args.tokens_offload, 4)
        args.rounds = 1
        args.sim_rounds = 1
    threads = [int(t) for t in (args.threads or ("1" if args.quick else "1,2")).split(",")]
    formats = [f for f in FORMATS if f in args.formats.split(",")]
    if args.model is not None:
        formats = ["bf16"]
    quants = [q for q in args.quants.split(",") if q]
    if unknown := [q for q in quants if q not in _llama.FTYPES]:
        ap.error(f"--quants: unknown {', '.join(unknown)} (known: {', '.join(_llama.FTYPES)})")
    configs = "".join(c for c in CONFIGS if c in args.configs)
    notes: list[str] = []
    if any(c in LLAMA for c in configs) and _llama.installed() is None:
        if not args.quick:
            ap.error(_llama.INSTALL_HINT + "; or leave them out: --configs " +
                     "".join(c for c in configs if c not in LLAMA))
        notes.append(f"llama.cpp rows left out: {_llama.LLAMA_PACKAGE} is not installed")
        configs = "".join(c for c in configs if c not in LLAMA)
    if not args.no_limit:
        if os.geteuid() != 0 or not (CGROUP_ROOT / "memory.limit_in_bytes").exists():
            ap.error(f"needs root and a cgroup-v1 memory controller at {CGROUP_ROOT} (or --no-limit)")

    # SIGTERM unwinds like Ctrl-C: the readahead is restored, cgroups and files removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.perf_counter()
    import platform

    print(f"colibri generate benchmark (python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"threads {', '.join(map(str, threads))}, formats {', '.join(formats)})", flush=True)
    converter = None
    if any(c in LLAMA for c in configs):
        try:
            converter = _llama.converter_dir(args.llama_cpp_src)
        except (RuntimeError, FileNotFoundError) as e:
            if not args.quick:
                raise SystemExit(str(e))
            notes.append(f"llama.cpp rows left out: {e}")
            configs = "".join(c for c in configs if c not in LLAMA)
        else:
            print(f"llama.cpp: llama-cpp-python {_llama.installed()}, converter from {converter}; "
                  f"{_llama.system_info()}", flush=True)
    for n in notes:
        print(n, flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="colibri-genbench-", dir=args.workdir))
    try:
        shapes = {"bf16": dict(QUICK_MODEL if args.quick else FULL_MODEL, embed_std=args.embed_std),
                  "4bit": dict(QUICK_MODEL_4BIT if args.quick else FULL_MODEL_4BIT, embed_std=args.embed_std)}
        base = args.models or workdir / "models"
        base.mkdir(parents=True, exist_ok=True)
        need = disk_needed([f for f in formats if not (f == "bf16" and args.model)], shapes, configs, quants)
        free = shutil.disk_usage(base).free + sum(p.stat().st_size for p in base.rglob("*") if p.is_file())
        if need * 1.1 > free:
            ap.error(f"the models and their copies take about {need / 1e9:.1f} GB at their peak; {base} has "
                     f"{free / 1e9:.1f} GB")
        pairs = {}
        for f in sorted(formats, key=lambda f: f != "4bit"):   # 4bit first: its bf16 GGUF is transient
            pairs[f] = prepare_format(f, args, base, shapes[f], quants, converter)
        for f in formats:
            describe(pairs[f], args)
        if args.no_limit:
            print("NO memory limit and no cache drop (--no-limit): these runs are not cold")
        else:
            print("memory limit of (b)-(f), page cache included: the format's limit above; (a), (g), (h): "
                  "none; page cache dropped before every run")
        ra = _llama.readahead_file(Path(pairs[formats[0]]["hf"]))
        print(f"disk readahead: {ra.read_text().strip() + ' KiB' if ra else 'no block device'} ((e)); "
              f"{args.readahead_kb} KiB for (f)")
        mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        fits_4bit_a = "4bit" in shapes and 2 * 2 * sum(approx_bytes(shapes["4bit"]).values()) < 0.6 * mem_total
        if "4bit" in formats and "a" in configs and not fits_4bit_a:
            print("4bit: (a) left out: transformers dequantizes the whole model to bf16 at load "
                  f"({2 * sum(approx_bytes(shapes['4bit']).values()) / 1e9:.1f} GB, twice that at its peak)")
        rng = random.Random(args.seed)
        vocab = shapes["bf16"]["vocab_size"]
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        continuation = [rng.randrange(vocab) for _ in range(max(args.tokens, args.tokens_offload))]
        print(f"decode: the same {args.prompt_len} prompt token ids and {args.tokens} continuation token ids "
              f"((b): {args.tokens_offload}) in every engine, one a step, greedy predictions recorded; colibri reads "
              f"{'through the page cache' if args.buffered else 'with O_DIRECT'}", flush=True)

        plan = {"direct_io": not args.buffered, "seed": args.seed, "prompt": prompt, "continuation": continuation,
                "tokens": args.tokens, "tokens_offload": args.tokens_offload}
        left_out: list[str] = []
        runs = plan_runs(formats, configs, threads, quants, pairs, fits_4bit_a, mem_total=mem_total, notes=left_out)
        for n in left_out:
            print(n, flush=True)
        notes.extend(left_out)
        results: dict[str, list[dict[str, Any]]] = {run_key(r): [] for r in runs}
        rounds: list[dict[str, dict[str, Any]]] = []
        reads: list[dict[str, dict[str, Any]]] = []    # per round, per format: the O_DIRECT read bound
        for rnd in range(args.rounds):
            order = runs[:]
            rng.shuffle(order)
            this: dict[str, dict[str, Any]] = {}
            t_round = time.perf_counter()
            for run in order:
                key = run_key(run)
                r = run_child(run, pairs[run["fmt"]], args, workdir, rnd, plan)
                this[key] = r
                results[key].append(r)
                head = f"  round {rnd + 1} {run['fmt']:<4} {run['threads']}t {run_label(run):<32}"
                if r["ok"]:
                    extra = ""
                    if "hit_rate" in r:
                        extra = (f", hit {r['hit_rate']:.0%}, wait {r['io_wait_share']:.0%}, "
                                 f"store {r['store_mb_per_token']:.0f} MB/token")
                    elif run["config"] == "b":
                        extra = f", wait {r['io_wait_share']:.0%}, {len(r['device_map_disk'])} blocks on disk"
                    print(f"{head} {r['tokens_per_s']:8.2f} tok/s (load {r['load_s']:.1f} s, prefill "
                          f"{r['prefill_s']:.2f} s, disk {r['disk_mb_per_token']:.0f} MB/token, peak "
                          f"{r['memory'].get('peak', 0) / 1e9:.2f} GB{extra})", flush=True)
                else:
                    print(f"{head} FAILED: {r['error']}\n    " + "\n    ".join(r["log_tail"]), flush=True)
            rounds.append(this)
            reads.append(measure_reads(this, pairs, args))
            print(f"round {rnd + 1}/{args.rounds}: {time.perf_counter() - t_round:.0f} s", flush=True)

        def ok(key: str) -> list[dict[str, Any]]:
            return [r for r in results.get(key, []) if r["ok"]]

        def ratio(num: str, den: str | list[str]) -> list[float]:
            """num's tokens/s over den's (over the fastest of several) in each round that has them all."""
            dens = [den] if isinstance(den, str) else den
            out = []
            for r in rounds:
                if num in r and r[num]["ok"] and dens and all(d in r and r[d]["ok"] for d in dens):
                    out.append(r[num]["tokens_per_s"] / max(r[d]["tokens_per_s"] for d in dens))
            return out

        def key(f: str, t: int, c: str, q: str | None = None) -> str:
            return run_key({"fmt": f, "threads": t, "config": c, "quant": q})

        # the table, and the greedy predictions against a reference
        token_notes = []
        for f in formats:
            for t in threads:
                group = [r for r in runs if r["fmt"] == f and r["threads"] == t]
                if not group:
                    continue
                refs = [key(f, t, c) for c in "ach" if ok(key(f, t, c))]
                ref = ok(refs[0])[0]["predicted"] if refs else None
                rows = []
                for run in group:
                    k = run_key(run)
                    rs = ok(k)
                    if not rs:
                        rows.append((run_label(run), "failed", *[""] * 9))
                        continue
                    hit = med([r["hit_rate"] for r in rs]) if "hit_rate" in rs[0] else None
                    same = "-"
                    if ref:
                        steps = sum(min(len(r["predicted"]), len(ref)) for r in rs)
                        where = sorted({i for r in rs for i in differences(r["predicted"], ref)})
                        same = f"{steps - sum(len(differences(r['predicted'], ref)) for r in rs)}/{steps}"
                        if where:
                            same += " (at " + ",".join(map(str, where[:4])) + (",..." if len(where) > 4 else "") + ")"
                    rows.append((
                        run_label(run),
                        fmt(med([r["tokens_per_s"] for r in rs]), ".2f"),
                        fmt(med([r["ms_per_token"] for r in rs]), ".0f"),
                        fmt(med([r["prefill_s"] for r in rs]), ".2f"),
                        fmt(med(ratio(key(f, t, "d"), k)), ".2f", "x") if run["config"] != "d" else "1x",
                        fmt(med([r["io_wait_share"] for r in rs]) * 100, ".1f", "%")
                        if run["config"] in "bcdi" else "-",
                        fmt(hit * 100 if hit is not None else None, ".0f", "%"),
                        fmt(med([r["disk_mb_per_token"] for r in rs]), ".0f"),
                        fmt(med([r["memory"].get("peak", 0) for r in rs]) / 1e9, ".2f"),
                        fmt(med([r["memory"].get("max_rss", 0) for r in rs]) / 1e9, ".2f"),
                        same,
                    ))
                limit = pairs[f]["limit"] / 1e9
                print(f"\n{f}, {t} thread{'s' if t > 1 else ''}: decode, median of {args.rounds} round(s), "
                      f"ratios within a round; limit {limit:.2f} GB for (b)-(f), (i); greedy predictions compared with "
                      f"{CONFIGS[refs[0].split('/')[2]] if refs else 'nothing'}")
                print_table(("configuration", "tok/s", "ms/token", "prefill s", "(d) / this", "I/O wait",
                             "hit", "disk MB/tok", "peak GB", "max RSS GB", "same argmax"), rows)
                for run in group:
                    rs = ok(run_key(run))
                    if rs and run["config"] != "b":
                        token_notes.append(f"{f} {t}t {run_label(run)}: load {med([r['load_s'] for r in rs]):.1f}"
                                           f" s, prefill disk {med([r['prefill_disk_mb'] for r in rs]):.0f} MB"
                                           + (f", read_ahead_kb {rs[0]['read_ahead_kb']}"
                                              if run["config"] in LLAMA else "")
                                           + (f", PILOT precision {rs[-1]['pilot']['precision']:.0%} recall "
                                              f"{rs[-1]['pilot']['recall']:.0%}" if rs[-1].get("pilot") else ""))
        print()
        for n in token_notes:
            print("  " + n)

        prefill = prefill_rows(formats, threads, runs, rounds, reads)
        if prefill:
            print(f"\nprefill at the limit, {args.prompt_len}-token prompt: colibri's prefill / the larger of the "
                  f"in-RAM prefill (a) (else (h)) and the O_DIRECT read of every expert the prompt touched, "
                  f"within a round; medians of {args.rounds} round(s)")
            print_table(("configuration", "colibri prefill s", "in-RAM prefill s", "O_DIRECT read s", "ratio",
                         "rounds"),
                        [(p["label"], fmt(med(p["colibri_s"]), ".2f"),
                          fmt(med(p["in_ram_s"]), ".2f") + f" {p['in_ram']}", fmt(med(p["read_s"]), ".2f"),
                          fmt(med(p["ratios"]), ".2f", "x"), ", ".join(f"{x:.2f}" for x in p["ratios"]))
                         for p in prefill])

        # compute ratio of the colibri engine, as decode_sim defines it (bf16, the first thread count)
        per_round_ratio = []
        c_key = key("bf16", threads[0], "c")
        for r in rounds:
            c = r.get(c_key)
            if c and c["ok"] and c["decode_stats"]["misses"]:
                layer_ms = 1e3 * (c["decode_s"] - c["wait_s"]) / c["decode_steps"] / c["moe_layers"]
                per_round_ratio.append(layer_ms / c["ms_per_miss"])
        measured_ratio = med(per_round_ratio)
        if per_round_ratio:
            print(f"\ncompute ratio of bf16 (c) (engine compute per MoE layer / wait per demand miss): "
                  f"{measured_ratio:.2f} (rounds: {', '.join(f'{x:.2f}' for x in per_round_ratio)})")
        sim: dict[str, Any] = {"ok": False}
        d_runs = ok(key("bf16", threads[0], "d"))
        if not args.no_sim and per_round_ratio and d_runs and d_runs[-1].get("pilot"):
            p = round(med([r["pilot"]["recall"] for r in d_runs]), 2)
            sim = run_decode_sim(measured_ratio, p, args, workdir)
            if sim["ok"]:
                print(f"decode_sim at compute ratio {measured_ratio:.2f} (it measured "
                      f"{', '.join(f'{x:.2f}' for x in sim['measured_ratios'])}), p = {p:.2f}: "
                      f"PILOT w=2 I/O wait share {sim['pilot_wait_share']:.1%} "
                      f"(no prefetch {sim['none_wait_share']:.1%})")

        # goals
        goals = []

        def goal(name: str, values: list[float], target: str, met: bool, spec: str = ".2f") -> None:
            goals.append((name, f"{med(values):{spec}}x (rounds {', '.join(f'{x:{spec}}' for x in values)})",
                          target, met))

        for f in formats:
            q = "bf16" if f == "bf16" else (quants[0] if quants else None)
            for t in threads:
                d = key(f, t, "d")
                mmap = [key(f, t, c, q) for c in "ef" if key(f, t, c, q) in results]
                if (v := ratio(d, mmap)):
                    goal(f"{f} {t}t (d) / best of (e),(f)", v, ">= 1.5x", med(v) >= 1.5)
                if (v := ratio(key(f, t, "i"), mmap)):
                    goal(f"{f} {t}t (i) / best of (e),(f)", v, ">= 1.5x", med(v) >= 1.5)
                if (v := ratio(key(f, t, "h"), key(f, t, "g", q))):
                    goal(f"{f} {t}t (h) / (g) in RAM", v, ">= 0.8x", med(v) >= 0.8)
                if (v := ratio(d, key(f, t, "b"))):
                    goal(f"{f} {t}t (d) / (b)", v, ">= 10x", med(v) >= 10, ".1f")
                if (v := ratio(d, key(f, t, "c"))):
                    goal(f"{f} {t}t (d) / (c)", v, "> 1x", med(v) > 1)
        for p in prefill:
            if p["ratios"]:
                goal(f"{p['label']} prefill / max(in RAM, O_DIRECT read)", p["ratios"], f"<= {PREFILL_GOAL}x",
                     med(p["ratios"]) <= PREFILL_GOAL)
        if d_runs and sim.get("ok"):
            dw = med([r["io_wait_share"] for r in d_runs])
            goals.append((f"bf16 {threads[0]}t (d) I/O wait vs decode_sim",
                          f"{dw:.1%} vs {sim['pilot_wait_share']:.1%}", "<= decode_sim",
                          dw <= sim["pilot_wait_share"]))
        if goals:
            print("\ngoals")
            w = max(len(g[0]) for g in goals)
            for name, value, target, met in goals:
                print(f"  {name:<{w}}  {value:<44} target {target:<14} {'met' if met else 'MISSED'}")
        elapsed = time.perf_counter() - t_start
        print(f"\ntotal time {elapsed:.0f} s")

        payload = {
            "benchmark": "generate",
            "command": " ".join(["benchmarks/generate.py"] + (sys.argv[1:] if argv is None else list(argv))),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "formats": {f: {k: v for k, v in pairs[f].items() if k != "sizes"}
                        | {"sizes": {k: v for k, v in pairs[f]["sizes"].items() if k != "experts_per_layer"}}
                        for f in formats},
            "threads": threads, "plan": plan, "notes": notes, "llama_cpp": _llama.installed(),
            "rounds": rounds, "prefill_reads": reads, "prefill": prefill, "compute_ratio": per_round_ratio,
            "decode_sim": sim,
            "goals": [dict(goal=g[0], value=g[1], target=g[2], met=g[3]) for g in goals],
            "elapsed_s": elapsed, "unix_time": time.time(), "colibri": colibri_origin(),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1, default=str))
        print(f"results written to {args.json}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if args.models:
            print(f"models kept in {args.models}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
