#!/usr/bin/env python3
"""transformers' generate on a MoE model larger than its RAM budget: colibri against accelerate.

A Qwen3-MoE model (transformers' own ``Qwen3MoeConfig``, scaled down, random
weights in bfloat16) is written with ``save_pretrained`` to a temporary
directory, unless ``--model`` names one. Its routed experts are at least 4x
colibri's cache and a few GB on disk. In one run, in ``--rounds`` rounds with
the configurations in a shuffled order each round, ``model.generate`` runs a
sampled continuation of a fixed random prompt under:

    (a) in RAM     stock transformers, everything loaded: the ceiling
    (b) offload    transformers + accelerate: ``device_map="auto"`` with
                   ``max_memory={"cpu": B}`` and ``offload_folder``, B = the
                   non-expert weights + colibri's cache (the same weights budget)
    (c) colibri    ``colibri.hf.from_pretrained(prefetch=None)``, the cache of
                   ``--slots`` slots per layer, O_DIRECT reads
    (d) PILOT      the same with ``prefetch="pilot"`` and 2 I/O workers

Every configuration runs in a child process of its own, started cold: the
page cache is dropped before it (``sync; echo 3 > drop_caches``) and the
child runs inside a cgroup-v1 memory cgroup whose limit, page cache included,
is the same for (b), (c) and (d): the non-expert weights + the cache + a
fixed allowance for the Python, torch and transformers runtime
(``--overhead-mb``). So reads come from disk, as on the small machine a user
has. (a) must hold the whole model: its cgroup has no limit (it only records
the peak), and it is the ceiling, not a contender.

Measured per run, over the decode only (from the first generated token to the
last, timestamps taken by a transformers streamer): tokens/s; the prefill and
load times; the I/O wait share, time spent waiting for expert weights over
the decode time: for (c) and (d) the time inside the store's ``lease_many`` /
``lease`` (where a miss waits for its read; hits cost microseconds), timed by
wrapping those two methods of the model's store, for (b) the time inside
accelerate's ``AlignDevicesHook.pre_forward`` (a lower bound: accelerate maps
the offloaded tensors, and most reads happen as page faults in the forward); hit rate and store MB read per token for (c) and (d);
for every configuration the MB its process read from disk per token
(``read_bytes`` of ``/proc/self/io``, page faults on mmap included) and the
cgroup's peak memory. Ratios are taken within a round, medians over rounds
are reported.

The compute ratio of the colibri runs, in the decode simulation's sense, is
the engine's own compute per MoE layer, (c)'s decode time minus its wait, over
what one demand miss cost (c), (c)'s wait over its misses. Unless
``--no-sim``, ``benchmarks/decode_sim.py`` then runs at that ratio (cold,
PILOT with 2 workers, its predictability p set to (d)'s measured PILOT
recall), so that (d)'s wait share can be compared with the simulation's.

Goals, as ratios in one run: (d) >= 10x (b) in tokens/s; (d) faster than
(c); (d)'s I/O wait share no worse than decode_sim's PILOT w=2 at the same
measured compute ratio.

Needs root (cgroups, drop_caches) and a mounted cgroup-v1 memory controller;
``--no-limit`` runs without them (then the figures are not cold).

    python benchmarks/generate.py              # a 5 GB model, 3 rounds: ~30 min on a loaded 2-core VM
    python benchmarks/generate.py --quick      # a 40 MB model, 1 round: ~3 min
    python benchmarks/generate.py --model DIR  # an existing checkpoint
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
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
from _common import drop_caches  # noqa: E402

DEFAULT_JSON = HERE / "results" / "generate.json"
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
MB = 1e6
MiB = 1 << 20

CONFIGS = {
    "a": "(a) in RAM",
    "b": "(b) accelerate offload",
    "c": "(c) colibri, no prefetch",
    "d": "(d) colibri + PILOT",
}

# The model written when --model is not given: Qwen3-MoE's layout (128
# experts, top-8, norm_topk_prob) with the widths scaled down.
FULL_MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=384,
                  num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                  num_experts=128, num_experts_per_tok=8)
QUICK_MODEL = dict(vocab_size=8000, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   num_experts=32, num_experts_per_tok=4)


# ---------------------------------------------------------------------------
# the model on disk


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


def run_child(config: str, args: argparse.Namespace, model_dir: Path, workdir: Path, rnd: int,
              limit: int | None, plan: dict[str, Any]) -> dict[str, Any]:
    """One configuration in a fresh process, cold, under its memory cgroup."""
    out = workdir / f"result-{config}-{rnd}.json"
    log = workdir / f"log-{config}-{rnd}.txt"
    offload = workdir / f"offload-{config}-{rnd}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", config, "--model", str(model_dir),
           "--child-out", str(out), "--offload-folder", str(offload),
           "--child-plan", json.dumps(plan)]
    cold = drop_caches() if not args.no_limit else False
    group = None
    if not args.no_limit:
        group = MemoryCgroup(f"colibri-genbench-{os.getpid()}-{config}-{rnd}", limit)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(args.threads),
               OPENBLAS_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    try:
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
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text(errors="replace").splitlines()[-15:]
        why = "killed by the OOM killer" if memory.get("oom_kills") else f"exit {proc.returncode}"
        return {"config": config, "ok": False, "error": why, "log_tail": tail, "memory": memory,
                "wall_s": wall, "cold": cold}
    result = json.loads(out.read_text())
    out.unlink()
    log.unlink()
    result.update(ok=True, memory=memory, wall_s=wall, cold=cold)
    return result


# ---------------------------------------------------------------------------
# the child: one configuration


def child(config: str, model_dir: Path, out: Path, offload: Path, plan: dict[str, Any]) -> None:
    t_start = time.perf_counter()
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(plan["threads"])
    t_import = time.perf_counter() - t_start
    waited = [0.0]
    store = None
    runtime = None
    extra: dict[str, Any] = {}

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                waited[0] += clock() - t0
        return wrapper

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

        model = colibri.hf.from_pretrained(
            model_dir, slots_per_layer=plan["slots"], prefetch="pilot" if config == "d" else None,
            prefetch_workers=2 if config == "d" else 0, direct_io=plan["direct_io"],
            torch_dtype=torch.bfloat16)
        store = colibri.hf.store_of(model)
        runtime = getattr(model, "colibri", None)
        # Every expert the engine uses goes through one of these two: the
        # time inside them is the time it waited for a read (a hit returns
        # in microseconds).
        store.lease_many = timed(store.lease_many)  # type: ignore[method-assign]
        store.lease = timed(store.lease)  # type: ignore[method-assign]
    model.eval()
    t_load = time.perf_counter() - t0

    def read_bytes() -> int:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
        return 0

    marks: list[tuple[float, float, int, dict[str, int] | None]] = []

    class Clock(BaseStreamer):  # type: ignore[misc]
        """Marks every step of generate: the prompt, then each new token."""

        def put(self, value: Any) -> None:
            stats = store.stats().as_dict() if store is not None else None
            marks.append((time.perf_counter(), waited[0], read_bytes(), stats))

        def end(self) -> None:
            pass

    g = torch.Generator().manual_seed(plan["seed"])
    prompt = torch.randint(0, model.config.vocab_size, (1, plan["prompt_len"]), generator=g)
    tokens = plan["tokens_offload"] if config == "b" else plan["tokens"]
    torch.manual_seed(plan["seed"])
    with torch.no_grad():
        output = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                                min_new_tokens=tokens, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                streamer=Clock(), pad_token_id=0)
    generated = output[0, plan["prompt_len"]:].tolist()
    (t_p, w_p, r_p, s_p), (t_1, w_1, r_1, s_1), (t_n, w_n, r_n, s_n) = marks[0], marks[1], marks[-1]
    steps = len(marks) - 2           # decode steps timed: token 2 .. token N
    decode_s = t_n - t_1
    result: dict[str, Any] = {
        "config": config, "tokens": len(generated), "decode_steps": steps,
        "import_s": t_import, "load_s": t_load, "prefill_s": t_1 - t_p, "decode_s": decode_s,
        "tokens_per_s": steps / decode_s, "ms_per_token": 1e3 * decode_s / steps,
        "wait_s": w_n - w_1, "io_wait_share": (w_n - w_1) / decode_s if config != "a" else 0.0,
        "prefill_wait_s": w_1 - w_p,
        "disk_mb_per_token": (r_n - r_1) / MB / steps, "prefill_disk_mb": (r_1 - r_p) / MB,
        "generated": generated, "colibri": colibri_origin(), **extra,
    }
    if store is not None and s_1 is not None and s_n is not None:
        d = {k: s_n[k] - s_1[k] for k in ("requests", "hits", "misses", "prefetched", "prefetch_hits",
                                           "bytes_read")}
        result.update(
            decode_stats=d, final_stats=s_n,
            hit_rate=d["hits"] / d["requests"] if d["requests"] else 0.0,
            prefetch_hit_rate=d["prefetch_hits"] / d["prefetched"] if d["prefetched"] else None,
            store_mb_per_token=d["bytes_read"] / MB / steps,
            ms_per_miss=1e3 * (w_n - w_1) / d["misses"] if d["misses"] else None,
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an existing checkpoint (else one is written)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp"),
                    help="where the model, offload folders and logs go")
    ap.add_argument("--keep-model", action="store_true")
    ap.add_argument("--embed-std", type=float, default=0.6,
                    help="std of the written model's token embedding (see write_model)")
    ap.add_argument("--slots", type=int, default=None, help="colibri slots per layer (default: experts / 4)")
    ap.add_argument("--tokens", type=int, default=24, help="new tokens for (a), (c), (d)")
    ap.add_argument("--tokens-offload", type=int, default=6, help="new tokens for (b)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="abcd", help="which configurations to run (letters)")
    ap.add_argument("--overhead-mb", type=int, default=1024,
                    help="memory limit allowance for the runtime (Python, torch, transformers, "
                         "activations) on top of the weights budget")
    ap.add_argument("--buffered", action="store_true", help="colibri reads through the page cache "
                    "(default: O_DIRECT)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in every configuration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-limit", action="store_true", help="no cgroup, no drop_caches (not cold)")
    ap.add_argument("--no-sim", action="store_true", help="skip the decode simulation at the same ratio")
    ap.add_argument("--sim-rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a small model, one round: a smoke run")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--child", choices=["write", *CONFIGS], help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child-plan", help=argparse.SUPPRESS)
    ap.add_argument("--offload-folder", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child == "write":
        write_model(args.model, json.loads(args.child_plan), args.seed)
        return 0
    if args.child:
        child(args.child, args.model, args.child_out, args.offload_folder, json.loads(args.child_plan))
        return 0

    if args.quick:
        args.tokens = min(args.tokens, 8)
        args.tokens_offload = min(args.tokens_offload, 4)
        args.rounds = 1
        args.sim_rounds = 1
    configs = [c for c in "abcd" if c in args.configs]
    if not args.no_limit:
        if os.geteuid() != 0 or not (CGROUP_ROOT / "memory.limit_in_bytes").exists():
            ap.error(f"needs root and a cgroup-v1 memory controller at {CGROUP_ROOT} (or --no-limit)")

    t_start = time.perf_counter()
    import platform

    print(f"colibri generate benchmark (python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"torch threads {args.threads})", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="colibri-genbench-", dir=args.workdir))
    try:
        if args.model is None:
            shape = dict(QUICK_MODEL if args.quick else FULL_MODEL, embed_std=args.embed_std)
            model_dir = workdir / "model"
            approx = 2 * 3 * shape["hidden_size"] * shape["moe_intermediate_size"] * shape["num_experts"] \
                * shape["num_hidden_layers"]
            free = shutil.disk_usage(args.workdir).free
            if approx * 2.2 > free:   # the model, and accelerate's offload copy of it
                ap.error(f"a model of {approx / 1e9:.1f} GB (and its offload copy) does not fit in "
                         f"{args.workdir} ({free / 1e9:.1f} GB free)")
            t0 = time.perf_counter()
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "write",
                            "--model", str(model_dir), "--child-plan", json.dumps(shape),
                            "--seed", str(args.seed)], check=True, cwd=str(ROOT),
                           env=dict(os.environ, TRANSFORMERS_VERBOSITY="error"))
            print(f"model written in {time.perf_counter() - t0:.0f} s: Qwen3MoeForCausalLM "
                  + ", ".join(f"{k}={v}" for k, v in shape.items()), flush=True)
        else:
            model_dir = args.model
        sizes = safetensors_sizes(model_dir)
        if not sizes["layers"]:
            ap.error(f"{model_dir}: no routed experts found")
        n_experts = min(sizes["experts_per_layer"].values())
        slots = args.slots or max(1, n_experts // 4)
        cache_bytes = slots * len(sizes["layers"]) * sizes["one_expert"]
        weights_budget = sizes["other_bytes"] + cache_bytes
        limit = weights_budget + args.overhead_mb * MiB
        print(f"model: {(sizes['expert_bytes'] + sizes['other_bytes']) / 1e9:.2f} GB in "
              f"{len(sizes['files'])} shards: routed experts {sizes['expert_bytes'] / 1e9:.2f} GB "
              f"({len(sizes['layers'])} MoE layers x {n_experts} x {sizes['one_expert'] / MB:.2f} MB), "
              f"the rest {sizes['other_bytes'] / 1e9:.2f} GB")
        print(f"colibri cache: {slots} slots/layer = {cache_bytes / 1e9:.2f} GB "
              f"(experts / cache = {sizes['expert_bytes'] / cache_bytes:.1f}x); weights budget "
              f"(non-expert + cache) {weights_budget / 1e9:.2f} GB = accelerate's max_memory['cpu']")
        if args.no_limit:
            print("NO memory limit and no cache drop (--no-limit): these runs are not cold")
        else:
            print(f"memory limit of (b), (c), (d), page cache included: {limit / 1e9:.2f} GB "
                  f"(weights budget + {args.overhead_mb} MiB runtime allowance); (a): none; "
                  f"page cache dropped before every run")
        print(f"decode: prompt {args.prompt_len} random tokens, sampled (seed {args.seed}), "
              f"{args.tokens} new tokens ((b): {args.tokens_offload}); colibri reads "
              f"{'through the page cache' if args.buffered else 'with O_DIRECT'}", flush=True)

        plan = {"slots": slots, "cpu_budget": weights_budget, "direct_io": not args.buffered,
                "threads": args.threads, "seed": args.seed, "prompt_len": args.prompt_len,
                "tokens": args.tokens, "tokens_offload": args.tokens_offload}
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        rounds: list[dict[str, dict[str, Any]]] = []
        rng = random.Random(args.seed)
        for rnd in range(args.rounds):
            order = configs[:]
            rng.shuffle(order)
            this: dict[str, dict[str, Any]] = {}
            t_round = time.perf_counter()
            for c in order:
                r = run_child(c, args, model_dir, workdir, rnd, None if c == "a" else limit, plan)
                this[c] = r
                runs[c].append(r)
                if r["ok"]:
                    extra = ""
                    if "hit_rate" in r:
                        extra = (f", hit {r['hit_rate']:.0%}, wait {r['io_wait_share']:.0%}, "
                                 f"store {r['store_mb_per_token']:.0f} MB/token")
                    elif c == "b":
                        extra = f", wait {r['io_wait_share']:.0%}, {len(r['device_map_disk'])} blocks on disk"
                    print(f"  round {rnd + 1} {CONFIGS[c]:<26} {r['tokens_per_s']:8.2f} tok/s "
                          f"(load {r['load_s']:.0f} s, prefill {r['prefill_s']:.1f} s, "
                          f"disk {r['disk_mb_per_token']:.0f} MB/token, peak "
                          f"{r['memory'].get('peak', 0) / 1e9:.2f} GB{extra})", flush=True)
                else:
                    print(f"  round {rnd + 1} {CONFIGS[c]:<26} FAILED: {r['error']}\n    "
                          + "\n    ".join(r["log_tail"]), flush=True)
            rounds.append(this)
            print(f"round {rnd + 1}/{args.rounds}: {time.perf_counter() - t_round:.0f} s, order "
                  f"{''.join(order)}", flush=True)

        def ok(c: str) -> list[dict[str, Any]]:
            return [r for r in runs.get(c, []) if r["ok"]]

        def ratio(num: str, den: str) -> list[float]:
            return [r[num]["tokens_per_s"] / r[den]["tokens_per_s"] for r in rounds
                    if num in r and den in r and r[num]["ok"] and r[den]["ok"]]

        # the table
        a_tps = med([r["tokens_per_s"] for r in ok("a")])
        rows = []
        for c in configs:
            rs = ok(c)
            if not rs:
                rows.append((CONFIGS[c], "failed", "", "", "", "", "", "", "", ""))
                continue
            hit = med([r["hit_rate"] for r in rs]) if "hit_rate" in rs[0] else None
            store_mb = med([r["store_mb_per_token"] for r in rs]) if "store_mb_per_token" in rs[0] else None
            rows.append((
                CONFIGS[c],
                fmt(med([r["tokens_per_s"] for r in rs]), ".2f"),
                fmt(med([r["ms_per_token"] for r in rs]), ".0f"),
                fmt(med(ratio(c, "a")), ".3f", "x") if c != "a" else "1x",
                fmt(med(ratio("d", c)), ".2f", "x") if c != "d" else "1x",
                fmt(med([r["io_wait_share"] for r in rs]) * 100, ".1f", "%") if c != "a" else "-",
                fmt(hit * 100 if hit is not None else None, ".0f", "%"),
                fmt(store_mb, ".0f"),
                fmt(med([r["disk_mb_per_token"] for r in rs]), ".0f"),
                fmt(med([r["memory"].get("peak", 0) for r in rs]) / 1e9, ".2f"),
            ))
        header = ("configuration", "tok/s", "ms/token", "vs (a)", "(d) / this", "I/O wait", "hit",
                  "store MB/tok", "disk MB/tok", "peak GB")
        widths = [max(len(str(x[i])) for x in [header, *rows]) for i in range(len(header))]
        print(f"\ndecode, median of {args.rounds} round(s); ratios taken within a round")
        print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
        for row in rows:
            print("  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w)
                            for i, (v, w) in enumerate(zip(row, widths))))
        for c in configs:
            rs = ok(c)
            if rs:
                print(f"  {CONFIGS[c]}: load {med([r['load_s'] for r in rs]):.1f} s, prefill "
                      f"{med([r['prefill_s'] for r in rs]):.1f} s ({args.prompt_len} tokens), "
                      f"max RSS {med([r['memory'].get('max_rss', 0) for r in rs]) / 1e9:.2f} GB"
                      + (f", PILOT precision {rs[-1]['pilot']['precision']:.0%} recall "
                         f"{rs[-1]['pilot']['recall']:.0%}" if rs[-1].get("pilot") else "")
                      + (f", resident weights {rs[-1]['resident_bytes'] / 1e9:.2f} GB, "
                         f"{len(rs[-1]['device_map_disk'])} of "
                         f"{len(rs[-1]['device_map_disk']) + len(rs[-1]['device_map_cpu'])} "
                         f"device-map blocks on disk" if c == "b" else ""))
        if ok("a"):
            ref = ok("a")[0]["generated"]
            same = {c: sum(r["generated"] == ref for r in ok(c)) for c in configs}
            print("  same tokens as (a): " + ", ".join(f"{c} {same[c]}/{len(ok(c))}" for c in configs))

        # compute ratio of the colibri engine, as decode_sim defines it
        per_round_ratio = []
        for r in rounds:
            c = r.get("c")
            if c and c["ok"] and c["decode_stats"]["misses"]:
                layer_ms = 1e3 * (c["decode_s"] - c["wait_s"]) / c["decode_steps"] / c["moe_layers"]
                per_round_ratio.append(layer_ms / c["ms_per_miss"])
        measured_ratio = med(per_round_ratio)
        if per_round_ratio:
            print(f"\ncompute ratio of (c) (engine compute per MoE layer / wait per demand miss): "
                  f"{measured_ratio:.2f} (rounds: {', '.join(f'{x:.2f}' for x in per_round_ratio)})")
        if ok("a"):
            a_layer = med([1e3 / r["tokens_per_s"] for r in ok("a")]) / len(sizes["layers"])
            print(f"(a) per layer, everything in RAM: {a_layer:.2f} ms")

        sim: dict[str, Any] = {"ok": False}
        d_runs = ok("d")
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
        d_b, d_c = ratio("d", "b"), ratio("d", "c")
        if d_b:
            goals.append(("(d) / (b) tokens/s", f"{med(d_b):.1f}x (rounds {', '.join(f'{x:.1f}' for x in d_b)})",
                          ">= 10x", med(d_b) >= 10))
        if d_c:
            goals.append(("(d) / (c) tokens/s", f"{med(d_c):.2f}x (rounds {', '.join(f'{x:.2f}' for x in d_c)})",
                          "> 1x", med(d_c) > 1))
        if d_runs and sim.get("ok"):
            dw = med([r["io_wait_share"] for r in d_runs])
            goals.append(("(d) I/O wait share vs decode_sim", f"{dw:.1%} vs {sim['pilot_wait_share']:.1%}",
                          "<= decode_sim", dw <= sim["pilot_wait_share"]))
        if goals:
            print("\ngoals")
            for name, value, target, met in goals:
                print(f"  {name:<34} {value:<40} target {target:<14} {'met' if met else 'MISSED'}")
        elapsed = time.perf_counter() - t_start
        print(f"\ntotal time {elapsed:.0f} s")

        payload = {
            "benchmark": "generate",
            "command": " ".join(["benchmarks/generate.py"] + (sys.argv[1:] if argv is None else list(argv))),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "sizes": {k: v for k, v in sizes.items() if k != "experts_per_layer"},
            "plan": plan, "limit": limit, "cache_bytes": cache_bytes,
            "rounds": rounds, "compute_ratio": per_round_ratio, "decode_sim": sim,
            "goals": [dict(goal=g[0], value=g[1], target=g[2], met=g[3]) for g in goals],
            "elapsed_s": elapsed, "unix_time": time.time(), "colibri": colibri_origin(),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1, default=str))
        print(f"results written to {args.json}")
        del a_tps
    finally:
        if args.keep_model and args.model is None:
            print(f"model kept in {workdir / 'model'}")
            for p in workdir.iterdir():
                if p.name != "model":
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
