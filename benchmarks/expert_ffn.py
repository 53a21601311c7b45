#!/usr/bin/env python3
"""The expert kernels (colibri.expert_ffn) per format and SIMD path, cold,
against baselines measured in the same run.

Shapes: a Qwen3-30B-A3B expert (hidden 2048, intermediate 768) and a
Mixtral 8x7B expert (4096, 14336). For each shape and format a checkpoint
of random experts is written under --dir (bytes only matter, not values),
big enough that rotating through its experts touches at least --rotate MiB
(256 by default): every call meets weights that are not in any CPU cache.
Every expert is leased once at set-up and stays resident, so no call
reads the disk.

Per (shape, tokens T, threads): every format on every SIMD path the CPU
runs, timed through the store's C entry (coli_store_expert_ffn with a call
built once: the kernel, what the bound is compared with), the default path
also through colibri.expert_ffn (the Python entry, its checks included),
and three baselines:

    torch    torch's bf16 FFN on bf16 weights (F.linear x3 + silu), the
             engine's bf16 path, with torch.set_num_threads(threads), rotating
             through as many bytes of bf16 experts
    numpy    today's numpy path for 4-bit experts: colibri.dequantize, then
             float32 matmuls (colibri.moe); Qwen shape only unless --numpy-mixtral
    bound    the format's packed bytes (values, scales, zero points, g_idx)
             over the streaming read bandwidth measured in the same round
             with the same threads (a sum over 256 MiB, torch or numpy)

Configurations run in --rounds rounds, in a new shuffled order each round;
ratios are taken within a round and the median (and the range) of the
rounds is printed. The kernels take bfloat16 activations (as torch does);
--dtype f32 measures float32 ones.

    python benchmarks/expert_ffn.py             # both shapes, T 1 and 16, threads 1 and 2
    python benchmarks/expert_ffn.py --quick     # Qwen shape, 64 MiB rotation, 2 rounds

Formats: bf16, fp8_block, int4 (symmetric), int4_asym (zero points),
mxfp4, gptq (no act order), gptq_act (act order: a shuffled g_idx, which
the store holds in group order), awq;
the grouped ones in groups of 128 weights, or --group's.

The machine this runs on may be shared: the figures are times of whole
calls (Python entry included) and noisy; read the spread. Both clocks are
measured for every call and printed: wall time, and the process's CPU time
(steadier when other jobs take the cores; with more than one thread it adds
the threads up). --clock names the one the goals are judged on.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

import colibri  # noqa: E402
from colibri import kernels, moe  # noqa: E402
from colibri._ffi import ffi, lib  # noqa: E402
from colibri.compute_threads import compute_pool  # noqa: E402
from colibri.synthetic_formats import write_format_checkpoint  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (2048, 768), "mixtral-8x7b": (4096, 14336)}
FORMATS = ("bf16", "fp8_block", "int4", "int4_asym", "mxfp4", "gptq", "gptq_act", "awq")
FOUR_BIT = ("int4", "int4_asym", "mxfp4", "gptq", "gptq_act", "awq")
# Benchmark names of checkpoint formats with options: int4 with zero points,
# GPTQ with act order (a shuffled g_idx).
_WRITE = {"int4_asym": ("int4", {"symmetric": False}), "gptq_act": ("gptq", {"g_idx": "act_order"})}
MIB = 1 << 20


@dataclass
class Rotation:
    """Experts of one (shape, format) leased for the run, used in turn."""

    leases: list[Any]
    expert_bytes: int
    cursor: int = 0
    contexts: list[Any] = field(default_factory=list)

    def next(self) -> Any:
        lease = self.leases[self.cursor % len(self.leases)]
        self.cursor += 1
        return lease


def _checkpoint(root: Path, shape: str, fmt: str, rotate_mib: int, group: int) -> tuple[Path, int]:
    hidden, inter = SHAPES[shape]
    path = root / f"{shape}-{fmt}-{rotate_mib}" if group == 128 else root / f"{shape}-{fmt}-{rotate_mib}-g{group}"
    per_weight = {"bf16": 2.0, "fp8_block": 1.0}.get(fmt, 0.5)
    experts = max(1, math.ceil(rotate_mib * MIB / (3 * hidden * inter * per_weight)))
    if not (path / "config.json").exists():
        print(f"  writing {path.name}: {experts} experts", flush=True)
        written, extra = _WRITE.get(fmt, (fmt, {}))
        options: dict[str, Any] = {"g_idx": "sorted", "symmetric": True, **extra}
        write_format_checkpoint(path, written, hidden=hidden, intermediate=inter, experts=experts,
                                group=group, seed=1, **options)
    return path, experts


def _open(path: Path, experts: int) -> tuple[Any, Rotation]:
    store = colibri.open_store(path, slots_per_layer=experts)
    rotation = Rotation([], 0)
    for e in range(experts):
        cm = store.lease(0, e)
        rotation.leases.append(cm.__enter__())
        rotation.contexts.append(cm)
    rotation.expert_bytes = rotation.leases[0].tensors.nbytes
    return store, rotation


CLOCKS = ("wall", "cpu")


def _c_entry(rot: Rotation, x: np.ndarray, threads: int, isa: str) -> Callable[[], None]:
    """A call of the store's C entry on the next lease of the rotation, its
    ColiFfnCall built once: the kernel without the Python entry's checks."""
    out = np.empty_like(x)
    handle = type(rot.leases[0])._store_handle
    views = [ffi.cast("ColiExpertView *", lease._view_address) for lease in rot.leases]
    code = lib.COLI_TENSOR_BF16 if x.dtype != np.float32 else lib.COLI_TENSOR_F32
    call = ffi.new("ColiFfnCall *", {
        "x": ffi.cast("const void *", x.ctypes.data), "x_format": code, "x_stride": x.shape[1],
        "out": ffi.cast("void *", out.ctypes.data), "out_format": code, "out_stride": x.shape[1],
        "tokens": x.shape[0], "isa": kernels.ISAS.index(isa)})
    err = ffi.new("char[]", lib.COLI_ERR_LEN)
    pool = compute_pool(threads)
    entry, n, cursor = lib.coli_store_expert_ffn, len(views), [0]

    def run() -> None:
        view = views[cursor[0] % n]
        cursor[0] += 1
        if entry(handle, view, 1, ffi.NULL, call, 0, 1.702, 7.0, pool, err, lib.COLI_ERR_LEN):
            raise RuntimeError(ffi.string(err).decode(errors="replace"))
    run.keep = (x, out, call, err)  # type: ignore[attr-defined]  # alive while run is
    return run


def _timed(fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    """Seconds per call on both clocks: wall, and the process's CPU time."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls, (time.process_time() - c0) / calls


def _bandwidth(threads: int, buf: Any) -> float:
    """Streaming read bytes/s: a sum over the whole buffer (best of three)."""
    if buf is None:
        return float("nan")
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    nbytes = buf.numel() * buf.element_size() if hasattr(buf, "numel") else buf.nbytes
    return float(nbytes / best)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default=None, help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--isas", default=None, help="paths (default: every one this CPU runs; "
                    "the Mixtral shape skips scalar unless named)")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--rotate", type=int, default=None, help="MiB of experts each rotation touches")
    ap.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    ap.add_argument("--group", type=int, default=128,
                    help="weights per scale of the grouped formats (int4, int4_asym, gptq, gptq_act, awq)")
    ap.add_argument("--numpy-mixtral", action="store_true")
    ap.add_argument("--clock", choices=CLOCKS, default="wall",
                    help="the clock the goals are judged on (both are measured and printed): wall "
                         "time, or the process's CPU time (all its threads; on a shared machine "
                         "the steadier figure for one thread)")
    ap.add_argument("--dir", default="/tmp/colibri-kernel-bench")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    quick = args.quick
    shapes = (args.shapes or ("qwen3-30b-a3b" if quick else ",".join(SHAPES))).split(",")
    formats = args.formats.split(",")
    tokens_list = [int(t) for t in args.tokens.split(",")]
    threads_list = [int(t) for t in (args.threads if not quick or args.threads != "1,2" else "1").split(",")]
    rounds = args.rounds or (2 if quick else 5)
    rotate = args.rotate or (64 if quick else 256)
    budget = 0.05 if quick else 0.15  # seconds per configuration per round, roughly
    try:
        import torch
    except ImportError:  # the baselines that need torch are skipped
        torch = None
    import ml_dtypes

    x_dtype = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bf16" else np.dtype(np.float32)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    print(f"kernel paths on this CPU: {', '.join(kernels.available_isas())} "
          f"(default {kernels.default_isa()})", flush=True)

    rotations: dict[tuple[str, str], Rotation] = {}
    stores = []
    for shape in shapes:
        for fmt in formats:
            path, experts = _checkpoint(root, shape, fmt, rotate, args.group)
            store, rotation = _open(path, experts)
            stores.append(store)
            rotations[(shape, fmt)] = rotation
    torch_weights: dict[str, list[Any]] = {}
    bw_buffer = None
    if torch is not None:
        for shape in shapes:
            hidden, inter = SHAPES[shape]
            n = max(1, math.ceil(rotate * MIB / (3 * hidden * inter * 2)))
            torch_weights[shape] = [tuple(torch.randn(s, dtype=torch.bfloat16) * 0.02
                                          for s in ((inter, hidden), (inter, hidden), (hidden, inter)))
                                    for _ in range(n)]
        bw_buffer = torch.ones(256 * MIB // 4, dtype=torch.float32)
    else:
        bw_buffer = np.ones(256 * MIB // 4, dtype=np.float32)

    # Every configuration: (kind, shape, tokens, threads, format, isa).
    configs: list[tuple[str, str, int, int, str, str]] = []
    for shape in shapes:
        runnable = kernels.available_isas()
        isas = args.isas.split(",") if args.isas else [
            i for i in runnable if i != "scalar" or shape == "qwen3-30b-a3b"]
        for t in tokens_list:
            for th in threads_list:
                if torch is not None:
                    configs.append(("torch", shape, t, th, "bf16", "-"))
                for fmt in formats:
                    for isa in isas:
                        configs.append(("kernel", shape, t, th, fmt, isa))
                    if kernels.default_isa() in isas:
                        configs.append(("python", shape, t, th, fmt, kernels.default_isa()))
                    if fmt in FOUR_BIT and th == threads_list[0] and (
                            shape == "qwen3-30b-a3b" or args.numpy_mixtral):
                        configs.append(("numpy", shape, t, th, fmt, "-"))
    rng = random.Random(args.seed)
    xs = {(shape, t): np.random.default_rng(t).standard_normal((t, SHAPES[shape][0])).astype(
        np.float32) for shape in shapes for t in tokens_list}
    times: dict[tuple[str, ...], list[float]] = {}
    bandwidth: dict[int, list[float]] = {}
    per_round: list[dict[tuple[str, ...], float]] = []

    def run_one(kind: str, shape: str, t: int, th: int, fmt: str, isa: str) -> tuple[float, float]:
        x32 = xs[(shape, t)]
        if kind == "torch":
            assert torch is not None
            torch.set_num_threads(th)
            xt = torch.from_numpy(x32).bfloat16()
            ws = torch_weights[shape]
            cursor = [0]
            F = torch.nn.functional

            def call() -> None:
                g, u, d = ws[cursor[0] % len(ws)]
                cursor[0] += 1
                F.linear(F.silu(F.linear(xt, g)) * F.linear(xt, u), d)
        elif kind == "numpy":
            rot = rotations[(shape, fmt)]

            def call() -> None:
                moe.swiglu(*moe.expert_weights(rot.next()), x32)
        elif kind == "python":
            rot = rotations[(shape, fmt)]
            x = x32.astype(x_dtype)
            out = np.empty_like(x)

            def call() -> None:
                kernels.expert_ffn(rot.next(), x, out=out, threads=th, isa=isa)
        else:
            call = _c_entry(rotations[(shape, fmt)], x32.astype(x_dtype), th, isa)
        first = _timed(call, 1)
        calls = max(1, min(64, int(budget / max(first[0], 1e-6))))
        return _timed(call, calls)

    for r in range(rounds):
        order = list(configs)
        rng.shuffle(order)
        this: dict[tuple[str, ...], float] = {}
        for th in threads_list:
            if torch is not None:
                torch.set_num_threads(th)
            bandwidth.setdefault(th, []).append(_bandwidth(th, bw_buffer))
        for cfg in order:
            key = tuple(str(c) for c in cfg)
            for clock, seconds in zip(CLOCKS, run_one(*cfg)):
                this[key + (clock,)] = seconds
                times.setdefault(key + (clock,), []).append(seconds)
        for th in threads_list:
            this[("bw", str(th))] = bandwidth[th][-1]
        per_round.append(this)
        print(f"  round {r + 1}/{rounds} done", flush=True)

    def ratio(key: tuple[str, ...], base: Callable[[dict[tuple[str, ...], float]], float | None]
              ) -> tuple[float, float, float]:
        values = []
        for this in per_round:
            b = base(this)
            if b and key in this:
                values.append(this[key] / b)
        if not values:
            return (float("nan"),) * 3
        return statistics.median(values), min(values), max(values)

    def span(r: tuple[float, float, float]) -> str:
        return f"{_common.fmt_ratio(r[0])} [{_common.fmt_ratio(r[1])}-{_common.fmt_ratio(r[2])}]"

    goals = _common.Goals()
    rows = []
    payload: list[dict[str, Any]] = []
    default = kernels.default_isa()
    for cfg in configs:
        kind, shape, t, th, fmt, isa = cfg
        base = tuple(str(c) for c in cfg)
        key = base + (args.clock,)
        sample = times[key]
        torch_keys = {c: ("torch", shape, str(t), str(th), "bf16", "-", c) for c in CLOCKS}
        by_clock = {c: ratio(base + (c,), lambda this, c=c: this.get(torch_keys[c]))
                    for c in CLOCKS}
        vs_torch = by_clock[args.clock]
        nbytes = rotations[(shape, fmt)].expert_bytes if kind not in ("torch",) else 3 * math.prod(
            SHAPES[shape]) * 2
        # The bound is a wall time; CPU time of one thread stands for it too.
        bound_clock = "wall" if th > 1 else args.clock
        vs_bound = ratio(base + (bound_clock,), lambda this: nbytes / this[("bw", str(th))])
        name = isa if kind == "kernel" else f"{isa} (python)" if kind == "python" else kind
        rows.append((shape, t, th, fmt if kind != "torch" else "bf16 (torch)", name,
                     _common.fmt_ns(statistics.median(sample) * 1e9),
                     f"{_common.fmt_ns(min(sample) * 1e9)}-{_common.fmt_ns(max(sample) * 1e9)}",
                     span(by_clock["wall"]), span(by_clock["cpu"]), span(vs_bound),
                     f"{nbytes / statistics.median(sample) / 1e9:.1f}"))
        payload.append({"kind": kind, "shape": shape, "tokens": t, "threads": th, "format": fmt,
                        "isa": isa, "seconds": {c: times[base + (c,)] for c in CLOCKS},
                        "x_torch": by_clock, "x_bound": vs_bound, "bytes": nbytes})
        if kind != "kernel" or isa != default:
            continue
        where = f"{shape} T={t} threads={th} {fmt}"
        if t == 1 and fmt in FOUR_BIT:
            goals.check(f"{where}: x torch bf16", vs_torch[0], "<= 0.45", vs_torch[0] <= 0.45,
                        f"{vs_torch[0]:.2f} [{vs_torch[1]:.2f}-{vs_torch[2]:.2f}]")
            goals.check(f"{where}: x bandwidth bound", vs_bound[0], "<= 1.5", vs_bound[0] <= 1.5,
                        f"{vs_bound[0]:.2f} [{vs_bound[1]:.2f}-{vs_bound[2]:.2f}]")
        elif t == 1 and fmt == "fp8_block":
            goals.check(f"{where}: x torch bf16", vs_torch[0], "<= 0.7", vs_torch[0] <= 0.7,
                        f"{vs_torch[0]:.2f} [{vs_torch[1]:.2f}-{vs_torch[2]:.2f}]")
        elif t == 16 and fmt in FOUR_BIT:
            goals.check(f"{where}: x torch bf16", vs_torch[0], "<= 1.0", vs_torch[0] <= 1.0,
                        f"{vs_torch[0]:.2f} [{vs_torch[1]:.2f}-{vs_torch[2]:.2f}]")
    print()
    print(_common.table(
        f"expert FFN, cold weights ({rotate} MiB rotation), {args.dtype} activations, "
        f"{rounds} rounds, {args.clock} clock",
        ("shape", "T", "threads", "format", "path", "median", "range", "x torch wall [range]",
         "x torch cpu [range]", "x bound [range]", "GB/s"), rows,
        note="x torch: time over torch's bf16 FFN of the same shape, T and threads in the same "
             "round, on each clock; x bound: over packed bytes / streaming read bandwidth of the "
             "same round (wall time with more than one thread); median and range: the goal "
             "clock's. "
             + "; ".join(f"read bandwidth, {th} thread(s): "
                         f"{statistics.median(v) / 1e9:.1f} GB/s [{min(v) / 1e9:.1f}-{max(v) / 1e9:.1f}]"
                         for th, v in bandwidth.items())))
    print()
    print(goals.render(f"goals (path {default}, {args.clock} clock)"))
    if args.json:
        Path(args.json).write_text(__import__("json").dumps(
            {"configs": payload, "bandwidth": bandwidth, "goals": goals.items}, indent=1))
    for rotation in rotations.values():
        for cm in rotation.contexts:
            cm.__exit__(None, None, None)
    for store in stores:
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
