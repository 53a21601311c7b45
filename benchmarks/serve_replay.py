#!/usr/bin/env python3
"""What batched decoding does to expert reads, on recorded routing (nothing is read).

A server that decodes B requests together leases, per step and layer, the
union of their experts once (``colibri.replay.batched`` writes those
lease_many calls out as a trace); this replays them through the store's own
policies (``colibri.replay``, the C code a live store runs) and through
Belady's optimum (``colibri.belady``), next to the same sequences decoded
one at a time, and reports expert reads per decoded token and layer.

- **Traces**: the two real ones in tests/data/traces (Qwen3.6-35B-A3B on
  FEVER claims, Mixtral-8x7B on HumanEval) and any given with ``--trace``
  (e.g. one ``benchmarks/serve.py --record-routing`` wrote). A trace with
  fewer sequences than twice the largest batch has its sequences cut into
  pieces of ``--piece-tokens`` tokens (Mixtral's two problems become 13
  requests of 24 tokens, as long as Qwen3.6's): pieces of one problem are
  related requests, which flatters sharing there.
- **Regimes**: ``cold``, each batch from an empty cache (what
  benchmarks/serve.py's live run measures: a fresh server, one request per
  client); ``steady``, one cache across all batches run one after another (a
  server that has been up for a while: the cache persists across requests).
- **Groupings**: which requests decode together. ``trace order`` takes the
  trace's sequences in order; ``random`` is the mean over ``--perms`` seeded
  shuffles (independent users arriving in any order). The Qwen3.6 trace holds
  near-duplicate prompts next to each other, so its trace order shares far
  more than random groupings do.
- **Configurations**: each policy of ``colibri.POLICIES`` with the union
  leased in expert-id order (what colibri.hf does) or shared-first (experts
  more sequences chose first, then the better ranked), and Belady's bound on
  the same lease sequence. Cache sizes are fractions of a layer's experts
  (at least top-k slots; a fraction that gives the same slots as a smaller
  one is skipped).

    python benchmarks/serve_replay.py                  # both real traces, about a minute
    python benchmarks/serve_replay.py --trace run.npz  # and a recorded one
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import table, write_json  # noqa: E402

from colibri import POLICIES, Trace, belady, replay  # noqa: E402
from colibri.replay import batched  # noqa: E402

REAL = {
    "Qwen3.6-35B-A3B": HERE.parent / "tests" / "data" / "traces" / "qwen3.6-35b-a3b-fever.npz",
    "Mixtral-8x7B": HERE.parent / "tests" / "data" / "traces" / "mixtral-8x7b-humaneval.npz",
}
FRACTIONS = (0.125, 0.25, 0.5)
BATCHES = (1, 2, 4, 8)
REGIMES = ("cold", "steady")
#: (policy, order) columns; "belady" is the bound on that order's lease sequence.
CONFIGS: tuple[tuple[str, str], ...] = tuple(
    (p, o) for p in (*POLICIES, "belady") for o in ("id", "shared-first"))
TODAY = ("lru", "id")      # the store's default policy, colibri.hf's order


def label(config: tuple[str, str]) -> str:
    return f"{config[0]}/{'id' if config[1] == 'id' else 'shared'}"


def split_sequences(trace: Trace, tokens: int) -> Trace:
    """``trace`` with each sequence cut into pieces of ``tokens`` tokens (the
    last piece of a sequence takes what is left over), numbered in order."""
    ids = np.empty(len(trace), dtype=np.int32)
    n = 0
    for s in trace.sequences:
        where = np.flatnonzero(trace.sequence == s)
        pieces = max(1, len(where) // tokens)
        for p in range(pieces):
            ids[where[p * tokens:(p + 1) * tokens if p < pieces - 1 else len(where)]] = n
            n += 1
    return Trace.from_arrays(trace.layers, trace.experts, trace.weights, ids, trace.num_experts)


def groupings(trace: Trace, perms: int, seed: int) -> dict[str, list[list[int]]]:
    """The orders in which the sequences arrive: the trace's, and ``perms`` seeded shuffles."""
    order = list(trace.sequences)
    rng = random.Random(seed)
    shuffles = []
    for _ in range(perms):
        s = order[:]
        rng.shuffle(s)
        shuffles.append(s)
    return {"trace order": [order], f"random (mean of {perms})": shuffles}


def slot_counts(trace: Trace, fractions: Sequence[float]) -> dict[float, int]:
    """Slots per layer for each fraction (at least top-k); repeats dropped."""
    out: dict[float, int] = {}
    for f in fractions:
        slots = max(trace.top_k, int(trace.num_experts * f))
        if slots not in out.values():
            out[f] = slots
    return out


def misses(lease_trace: Trace, slots: int, policy: str, regime: str) -> int:
    """Misses of ``lease_trace`` (a batched trace) under ``policy`` or Belady,
    one cache throughout (steady) or an empty one for each batch (cold)."""
    parts = [lease_trace] if regime == "steady" else [lease_trace.select_sequences([g])
                                                      for g in lease_trace.sequences]
    if policy == "belady":
        return sum(belady(p, slots).misses for p in parts)
    return sum(replay(p, slots_per_layer=slots, policy=policy).misses for p in parts)


def study(trace: Trace, fractions: Sequence[float], batches: Sequence[int], perms: int,
          seed: int) -> list[dict[str, Any]]:
    """One row per (grouping, regime, fraction, batch): expert reads per
    decoded token and layer of every configuration, and the union's size."""
    per_token = len(trace) * len(trace.layers)
    rows = []
    for grouping, orders in groupings(trace, perms, seed).items():
        for slots in slot_counts(trace, fractions).values():
            for batch in batches:
                acc: dict[tuple[str, str, str], list[float]] = {}
                union: list[float] = []
                for arrival in orders:
                    for order in ("id", "shared-first"):
                        lease_trace = batched(trace, batch, slots_per_layer=slots, order=order, sequences=arrival)
                        if order == "id":
                            union.append(float((lease_trace.experts >= 0).sum()) / per_token)
                        for regime in REGIMES:
                            for policy in (*POLICIES, "belady"):
                                acc.setdefault((regime, policy, order), []).append(
                                    misses(lease_trace, slots, policy, regime) / per_token)
                for regime in REGIMES:
                    rows.append({"grouping": grouping, "regime": regime, "fraction": slots / trace.num_experts,
                                 "slots": slots,
                                 "batch": batch, "union": statistics.mean(union),
                                 "reads": {label(c): statistics.mean(acc[(regime, c[0], c[1])])
                                           for c in CONFIGS}})
    return rows


def ratio(rows: list[dict[str, Any]], row: dict[str, Any], config: str) -> float:
    """``row``'s reads of ``config`` against the same configuration at batch 1."""
    base = next(r for r in rows if r["batch"] == 1 and all(r[k] == row[k] for k in ("grouping", "regime", "fraction")))
    return row["reads"][config] / base["reads"][config]


def render(name: str, trace: Trace, rows: list[dict[str, Any]]) -> str:
    """Per grouping and regime: reads per token and layer (ratio to batch 1)."""
    out = []
    head = (f"{name}: {len(trace.sequences)} requests, {len(trace)} tokens; {len(trace.layers)} layers x "
            f"{trace.num_experts} experts, top-{trace.top_k}")
    configs = [label(c) for c in CONFIGS]
    for grouping in dict.fromkeys(r["grouping"] for r in rows):
        for regime in REGIMES:
            sel = [r for r in rows if r["grouping"] == grouping and r["regime"] == regime]
            body = [(f"{r['fraction']:.1%} ({r['slots']})", str(r["batch"]), f"{r['union']:.2f}",
                     *(f"{r['reads'][c]:.2f} ({ratio(rows, r, c):.2f}x)" for c in configs)) for r in sel]
            out.append(table(f"{head}; {regime}, {grouping}: expert reads per token and layer (vs 1 request)",
                             ("cache (slots)", "B", "union", *configs), body))
    return "\n\n".join(out)


def headline(name: str, rows: list[dict[str, Any]], batch: int) -> list[tuple[str, ...]]:
    """``batch`` requests against 1: today's server; the configuration that
    reads least at ``batch``, against itself at 1 and against the one that
    reads least at 1; and Belady's (the ceiling on that lease sequence)."""
    out: list[tuple[str, ...]] = []
    for r in rows:
        if r["batch"] != batch:
            continue
        base = next(b for b in rows if b["batch"] == 1 and all(b[k] == r[k] for k in ("grouping", "regime", "fraction")))
        stores = [c for c in r["reads"] if not c.startswith("belady")]
        best = min(stores, key=r["reads"].__getitem__)
        best_one = min(base["reads"][c] for c in stores)
        ceiling = min(r["reads"]["belady/id"], r["reads"]["belady/shared"]) / base["reads"]["belady/id"]
        out.append((name, f"{r['fraction']:.1%}", r["regime"], r["grouping"], f"{ratio(rows, r, label(TODAY)):.2f}x",
                    f"{best}: {ratio(rows, r, best):.2f}x", f"{r['reads'][best] / best_one:.2f}x",
                    f"{ceiling:.2f}x"))
    return out


def load(paths: Sequence[Path], piece_tokens: int, batches: Sequence[int]) -> dict[str, Trace]:
    """The named traces, with too few sequences cut into pieces."""
    out = {}
    for name, path in [*REAL.items(), *((p.stem, p) for p in paths)]:
        trace = Trace.load(path)
        if len(trace.sequences) < 2 * max(batches):
            trace = split_sequences(trace, piece_tokens)
            name += f" ({piece_tokens}-token pieces)"
        out[name] = trace
    return out


def run(paths: Sequence[Path] = (), *, fractions: Sequence[float] = FRACTIONS, batches: Sequence[int] = BATCHES,
        perms: int = 8, seed: int = 0, piece_tokens: int = 24, focus: int = 4) -> dict[str, Any]:
    """The whole study; prints the tables and returns the rows by trace."""
    t0 = time.perf_counter()
    results = {}
    summary = []
    for name, trace in load(paths, piece_tokens, batches).items():
        rows = study(trace, fractions, batches, perms, seed)
        results[name] = rows
        print(render(name, trace, rows), end="\n\n", flush=True)
        summary += headline(name, rows, focus) if focus in batches and 1 in batches else []
    if summary:
        print(table(f"{focus} requests decoding together against 1: expert reads per token (goal <= 0.5x)",
                    ("trace", "cache", "regime", "grouping", f"today ({label(TODAY)})",
                     f"least reads at {focus}: vs itself at 1", "vs least at 1", "Belady (ceiling)"), summary))
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, action="append", default=[], help="another routing trace (.npz)")
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)), help="cache sizes, fractions of a layer")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--perms", type=int, default=8, help="random groupings averaged")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--piece-tokens", type=int, default=24, help="piece length for traces with few sequences")
    args = ap.parse_args(argv)
    results = run(args.trace, fractions=[float(f) for f in args.fractions.split(",")],
                  batches=[int(b) for b in args.batches.split(",")], perms=args.perms, seed=args.seed,
                  piece_tokens=args.piece_tokens)
    path = write_json("serve-replay", {"args": {k: str(v) for k, v in vars(args).items()}, "results": results})
    print(f"results written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
