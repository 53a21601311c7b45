#!/usr/bin/env python3
"""Group decode_sim rounds by the compute ratio they really ran at.

Each round of ``decode_sim.py`` records the ratio it measured (the
compute-only floor's time per layer over what a demand miss cost the
no-prefetch engine) and its two target ratios (cold, p = 0.72). On a shared
VM the ratio drifts far from the one asked for, so this pools the rounds of
several result files and shows the targets per band of measured ratio.

    python benchmarks/decode_sim_by_ratio.py RESULT.json [RESULT.json ...]

Files of other benchmarks among them are skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

BANDS = [(0.0, 1.0), (1.0, 1.5), (1.5, 2.0), (2.0, float("inf"))]


def rounds_of(path: Path) -> list[tuple[float, float, float]]:
    """(measured ratio, PILOT w=2 wait-share ratio, oracle / compute-only) per cold round."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "calibrations" not in data:
        return []                 # another benchmark's results
    targets = data.get("targets", {})
    measured = targets.get("measured_compute_ratio") or [
        c["measured_ratio"] for c in data.get("calibrations", []) if c.get("section") == "cold"]
    pilot = targets.get("pilot_w2_wait_share_ratio", {}).get("per_round", [])
    oracle = targets.get("oracle_over_compute_only", {}).get("per_round", [])
    return list(zip(measured, pilot, oracle))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, nargs="+")
    args = ap.parse_args(argv)
    per_file = {path: rounds_of(path) for path in args.results}
    points = [p for rounds in per_file.values() for p in rounds]
    if not points:
        print("no cold rounds with p = 0.72 and PILOT w=2 in these files", file=sys.stderr)
        return 1
    print(f"{len(points)} rounds from {sum(1 for r in per_file.values() if r)} decode_sim result files")
    print(f"{'measured ratio':>16} {'rounds':>6}  {'PILOT w=2 wait share / none':>28}  {'oracle / compute-only':>22}")
    for lo, hi in BANDS:
        band = [p for p in points if lo <= p[0] < hi]
        if band:
            label = f"{lo:.1f}-{hi:.1f}" if hi != float("inf") else f">= {lo:.1f}"
            print(f"{label:>16} {len(band):>6}  {spread([p[1] for p in band]):>28}  "
                  f"{spread([p[2] for p in band]):>22}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
