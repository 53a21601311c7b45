#!/usr/bin/env python3
"""Memory: peak RSS of a process holding a full cache, against capacity_bytes.

For each expert size a synthetic model (float16) is written under /tmp. A
fresh Python subprocess imports numpy and colibri, records its RSS, opens a
store with ``capacity_bytes`` (a quarter to a half of the model), leases
every expert once so every slot is filled, and reports its peak RSS
(``VmHWM`` from /proc/self/status; ``ru_maxrss`` as a cross-check). The
store's overhead is ``peak - rss_before_open - capacity_bytes``.

Baseline in the same run: a subprocess that fills a Python dict with numpy
arrays (``os.preadv`` into ``np.empty``) holding the same bytes as the
store's slots, i.e. what a dict-LRU costs for the same cache.

Goal (docs/performance.md): overhead <= 5% of capacity_bytes + a fixed few MiB (8 MiB here).

    python benchmarks/memory.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

FIXED_MIB = 8

CHILD = r"""
import json, os, resource, sys
import numpy as np
import colibri

def status(field):
    for ln in open("/proc/self/status"):
        if ln.startswith(field + ":"):
            return int(ln.split()[1]) * 1024
    return 0

mode, path, capacity = sys.argv[1], sys.argv[2], int(sys.argv[3])
before = status("VmRSS")
hwm_before = status("VmHWM")
if mode == "store":
    store = colibri.open_store(path, capacity_bytes=capacity, prefetch_workers=0)
    for key in store.model.keys():
        with store.lease(*key):
            pass
    st = store.stats()
    held = st.resident_bytes
    cap = st.capacity_bytes
    info = {"resident_bytes": held, "store_capacity_bytes": cap,
            "slots": {int(l): store.slots(l) for l in store.layers}}
else:  # dict of numpy arrays with the same number of experts per layer
    from colibri.checkpoint.scan import scan_model
    model = scan_model(path)
    per_layer = int(sys.argv[4])
    fds = {}
    cache = {}
    for layer in model.layers:
        for e in range(per_layer):
            ex = model.expert(layer, e)
            arrs = []
            for t in (ex.gate, ex.up, ex.down):
                fd = fds.get(t.path)
                if fd is None:
                    fd = fds[t.path] = os.open(t.path, os.O_RDONLY)
                a = np.empty(t.nbytes, dtype=np.uint8)
                os.preadv(fd, [a], t.offset)
                arrs.append(a.view(np.float16).reshape(t.shape))
            cache[(layer, e)] = tuple(arrs)
    held = sum(a.nbytes for v in cache.values() for a in v)
    info = {"resident_bytes": held}
after = status("VmRSS")
print(json.dumps({"rss_before": before, "hwm_before": hwm_before, "rss_after": after,
                  "vm_hwm": status("VmHWM"),
                  "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **info}))
"""


def child(mode: str, path: Path, capacity: int, per_layer: int = 0) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(path), str(capacity), str(per_layer)],
                         check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller models (CI)")
    args = ap.parse_args(argv)
    from colibri.synthetic import write_synthetic_model

    # name: (layers, experts, hidden, intermediate, cache fraction)
    configs = {
        "3 MiB experts": (4, 16 if args.quick else 32, 1024, 512, 0.5),
        "96 KiB experts": (8, 64 if args.quick else 256, 256, 64, 0.25),
    }
    tmp = Path(tempfile.mkdtemp(prefix="colibri-mem-", dir="/tmp"))
    goals = C.Goals()
    results = {}
    rows = []
    try:
        for name, (layers, experts, hidden, inter, frac) in configs.items():
            model = write_synthetic_model(tmp / name.split()[0], n_layers=layers, n_experts=experts,
                                          hidden=hidden, intermediate=inter, dtype="float16")
            per_layer = max(1, int(experts * frac))
            capacity = per_layer * layers * model.expert_nbytes
            st = child("store", model.path, capacity)
            dc = child("dict", model.path, capacity, per_layer)
            s_over = st["vm_hwm"] - st["rss_before"] - capacity
            d_over = dc["vm_hwm"] - dc["rss_before"] - capacity
            allowed = 0.05 * capacity + FIXED_MIB * 2**20
            results[name] = {"capacity_bytes": capacity, "expert_bytes": model.expert_nbytes,
                             "experts": layers * experts, "store": st, "dict": dc,
                             "store_overhead": s_over, "dict_overhead": d_over, "allowed": allowed}
            mib = 2**20
            rows.append((f"store, {name}", f"{capacity / mib:.1f}", f"{st['resident_bytes'] / mib:.1f}",
                         f"{(st['vm_hwm'] - st['rss_before']) / mib:.1f}", f"{s_over / mib:+.1f}",
                         f"{(st['vm_hwm'] - st['rss_before'] - st['resident_bytes']) / mib:+.1f}",
                         f"{100 * s_over / capacity:+.1f}%", f"{st['vm_hwm'] / mib:.1f}"))
            rows.append((f"dict of numpy, {name}", f"{capacity / mib:.1f}", f"{dc['resident_bytes'] / mib:.1f}",
                         f"{(dc['vm_hwm'] - dc['rss_before']) / mib:.1f}", f"{d_over / mib:+.1f}",
                         f"{(dc['vm_hwm'] - dc['rss_before'] - dc['resident_bytes']) / mib:+.1f}",
                         f"{100 * d_over / capacity:+.1f}%", f"{dc['vm_hwm'] / mib:.1f}"))
            goals.check(f"store overhead <= 5% + {FIXED_MIB} MiB ({name})", s_over, "<= 5% + 8 MiB",
                        s_over <= allowed,
                        f"{s_over / mib:+.1f} MiB = {100 * s_over / capacity:+.1f}% of {capacity / mib:.0f} MiB "
                        f"(allowed {allowed / mib:.1f}); dict {d_over / mib:+.1f} MiB")
        print(C.table("memory: peak RSS of a fresh process holding a full cache (MiB)",
                      ("process", "capacity", "held", "peak - start", "overhead", "over held", "of capacity",
                       "peak RSS"),
                      rows, note="(overhead = VmHWM - RSS before opening - capacity_bytes; over held = the same "
                                 "minus the bytes actually held (resident_bytes / bytes in the dict) instead)"))
        print()
        print(goals.render("goals: memory"))
        C.write_json("memory", {"configs": results, "fixed_allowance_mib": FIXED_MIB, "goals": goals.items})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
