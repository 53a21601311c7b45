#!/usr/bin/env python3
"""Scale: does the hit cost stay flat as the model grows?

Synthetic models with tiny float16 experts (16x8 x3, 768 bytes) from 2
layers x 8 experts up to 75 layers x 256 experts (GLM-5's 19,456 routed
experts) are written under /tmp; a store with a slot for every expert is
opened and warmed, and hits are timed over a decode-like key sequence (for
each layer in turn, 8 pseudo-random experts), so the working set is the whole
model:

    store.lease          ``with store.lease(l, e): pass`` (median per call)
    raw cffi pair        coli_store_lookup + coli_expert_release via cffi
    dict-LRU             OrderedDict + lock get of the same keys (context)
    C pair (scatter)     the C driver of c_hit_path.py on a model of the same
                         shape, same kind of key sequence, ns per pair

Ratios are against the smallest model measured in the same run. Also shown:
the time open_store takes (header scan + store creation). The check: the
largest model's hit costs at most 1.5x the smallest's (not a goal of docs/performance.md,
marked as info).

    python benchmarks/scale.py [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import random
import shutil
import sys
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import c_hit_path  # noqa: E402

import colibri  # noqa: E402
from colibri._ffi import ffi, lib  # noqa: E402
from colibri.synthetic import write_synthetic_model  # noqa: E402

HIDDEN, INTER = 16, 8
TOPK = 8


def key_sequence(layers, experts: int, n: int, seed: int = 1) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out: list[tuple[int, int]] = []
    while len(out) < n:
        for layer in layers:
            out.extend((layer, e) for e in rng.sample(range(experts), min(TOPK, experts)))
    return out[:n]


def bench(layers: int, experts: int, tmp: Path, calls: int, overhead: float) -> dict:
    d = tmp / f"m{layers}x{experts}"
    t0 = C.ns()
    model = write_synthetic_model(d, n_layers=layers, n_experts=experts, hidden=HIDDEN,
                                  intermediate=INTER, dtype="float16")
    t_write = (C.ns() - t0) / 1e9
    t0 = C.ns()
    store = colibri.open_store(model.path, slots_per_layer=experts, prefetch_workers=0)
    t_open = (C.ns() - t0) / 1e9
    try:
        for k in store.model.keys():
            with store.lease(*k):
                pass
        seq = key_sequence(store.layers, experts, 8192)
        it = iter(seq * (calls // len(seq) + 2))
        nxt = it.__next__
        lease = store.lease

        def f_lease():
            with lease(*nxt()):
                pass

        handle = store._handle
        view = ffi.new("ColiExpertView *")
        err_len = lib.COLI_ERR_LEN
        err = ffi.new("char[]", err_len)
        it2 = iter(seq * (calls // len(seq) + 2))
        nxt2 = it2.__next__
        lookup, release = lib.coli_store_lookup, lib.coli_expert_release

        def f_raw():
            k = nxt2()
            lookup(handle, k[0], k[1], view, err, err_len)
            release(handle, view)

        od: OrderedDict = OrderedDict((k, (None, None, None)) for k in store.model.keys())
        lock = threading.Lock()
        it3 = iter(seq * (calls // len(seq) + 2))
        nxt3 = it3.__next__

        def f_dict():
            k = nxt3()
            with lock:
                v = od[k]
                od.move_to_end(k)
            return v

        res = {
            "lease": C.summary(C.per_call(f_lease, calls, warmup=100, overhead=overhead)),
            "raw": C.summary(C.per_call(f_raw, calls, warmup=100, overhead=overhead)),
            "dict": C.summary(C.per_call(f_dict, calls, warmup=100, overhead=overhead)),
        }
        st = store.stats()
        assert st.misses == layers * experts, "every timed lookup must be a hit"
    finally:
        store.close()
        shutil.rmtree(d, ignore_errors=True)
    res.update(layers=layers, experts=experts, write_s=t_write, open_s=t_open)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, smaller models (CI)")
    args = ap.parse_args(argv)
    if args.quick:
        grid = [(2, 8), (2, 256), (16, 64), (75, 64)]
        calls, c_iters, c_reps = 10_000, 300_000, 3
    else:
        grid = [(2, 8), (2, 64), (2, 256), (16, 64), (75, 8), (75, 64), (75, 256)]
        calls, c_iters, c_reps = 30_000, 1_000_000, 3
    overhead = C.timer_overhead_ns()
    tmp = Path(tempfile.mkdtemp(prefix="colibri-scale-", dir="/tmp"))
    out = []
    try:
        exe = c_hit_path.build(tmp)
        bench(*grid[0], tmp, calls // 3, overhead)   # warm-up, discarded: the first model is the baseline
        for layers, experts in grid:
            r = bench(layers, experts, tmp, calls, overhead)
            cr = c_hit_path.run(exe, tmp, max(2, layers), experts, c_iters, c_reps, HIDDEN, INTER)
            r["c"] = cr
            out.append(r)
            print(f"[scale] {layers:3d} x {experts:3d}: lease {C.fmt_ns(r['lease']['median_ns'])}, "
                  f"C scatter {cr['scatter_pair_ns']:.0f} ns, open {r['open_s']:.2f} s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    b = out[0]
    rows = []
    for r in out:
        rows.append((f"{r['layers']} x {r['experts']}", f"{r['layers'] * r['experts']:,}",
                     C.fmt_ns(r["lease"]["median_ns"]), C.fmt_ratio(r["lease"]["median_ns"] / b["lease"]["median_ns"]),
                     C.fmt_ns(r["lease"]["p99_ns"]),
                     C.fmt_ns(r["raw"]["median_ns"]), C.fmt_ratio(r["raw"]["median_ns"] / b["raw"]["median_ns"]),
                     C.fmt_ns(r["dict"]["median_ns"]),
                     f"{r['c']['scatter_pair_ns']:.0f} ns",
                     C.fmt_ratio(r["c"]["scatter_pair_ns"] / b["c"]["scatter_pair_ns"]),
                     f"{r['open_s']:.2f} s"))
    print()
    print(C.table(f"scale: hit cost vs model size (tiny {HIDDEN}x{INTER} f16 experts, every expert resident, "
                  f"decode-like keys over all layers)",
                  ("layers x experts", "experts", "lease med", "vs smallest", "lease p99", "raw cffi",
                   "vs smallest", "dict-LRU", "C pair", "vs smallest", "open_store"), rows))
    print()
    goals = C.Goals()
    big = out[-1]
    for label, get in (("store.lease", lambda r: r["lease"]["median_ns"]),
                       ("raw cffi pair", lambda r: r["raw"]["median_ns"]),
                       ("C pair", lambda r: r["c"]["scatter_pair_ns"])):
        ratio = get(big) / get(b)
        goals.check(f"{label} flat: {big['layers']}x{big['experts']} vs {b['layers']}x{b['experts']}", ratio,
                    "<= 1.5x", ratio <= 1.5, f"{ratio:.2f}x", info=True)
    print(goals.render("scale check (informational, not a goal)"))
    C.write_json("scale", {"hidden": HIDDEN, "intermediate": INTER, "results": out, "goals": goals.items})
    return 0


if __name__ == "__main__":
    sys.exit(main())
