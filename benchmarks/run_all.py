#!/usr/bin/env python3
"""Runs every benchmark with a goal in docs/performance.md in turn, each in a fresh interpreter,
prints their tables and a summary of the goals, and leaves one JSON file per
benchmark in benchmarks/results/ (plus summary.json).

    python benchmarks/run_all.py            # the full suite, under 10 minutes on 2 cores
    python benchmarks/run_all.py --quick    # CI-sized: about a minute
    python benchmarks/run_all.py hit_path scale   # a subset

decode_sim.py is not part of this suite; run it on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SUITE = ("c_hit_path", "hit_path", "scale", "memory", "miss_path")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    ap.add_argument("names", nargs="*", choices=[*SUITE, []], help="benchmarks to run (default: all)")
    args = ap.parse_args(argv)
    names = args.names or list(SUITE)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t_all = time.monotonic()
    timings, failed = {}, []
    for name in names:
        cmd = [sys.executable, str(C.HERE / f"{name}.py")] + (["--quick"] if args.quick else [])
        print(f"\n### {name}: {' '.join(cmd[1:])}\n", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run(cmd, env=env).returncode
        timings[name] = time.monotonic() - t0
        if rc != 0:
            failed.append(name)
            print(f"!!! {name} exited with {rc}", flush=True)
    total = time.monotonic() - t_all

    rows, goals = [], []
    for name in names:
        path = C.RESULTS / f"{name}.json"
        if name in failed or not path.exists():
            continue
        for g in json.loads(path.read_text()).get("goals", []):
            if g.get("info"):
                continue
            goals.append({"benchmark": name, **g})
            rows.append((name, g["goal"], g["detail"], g["target"], "met" if g["met"] else "MISSED"))
    print()
    print(C.table("summary: goals, this run", ("benchmark", "goal", "measured", "target", "status"), rows,
                  note=f"{sum(g['met'] for g in goals)} of {len(goals)} met; "
                       + ", ".join(f"{n} {t:.0f} s" for n, t in timings.items())
                       + f"; total {total:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else "")))
    C.write_json("summary", {"quick": args.quick, "seconds": timings, "total_seconds": total,
                             "failed": failed, "goals": goals})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
