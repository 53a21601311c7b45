#!/usr/bin/env python3
"""Faster with use, measured: cache configurations on routing they were not tuned on.

    python benchmarks/tiering.py            # the real traces (both folds) + synthetic drift
    python benchmarks/tiering.py --quick    # fewer synthetic tokens

For each trace the history is split in two: a *learn* part (usage history,
plans, pins) and an *evaluation* part replayed cold, as a new session would
see it (other prompts of the same model; both ways round). Synthetic traces
add drift: the evaluation part's popularity and locality differ from the
learn part's. At 12.5%, 25% and 50% of each layer's experts (equal bytes:
every configuration's slots, pinned ones included, add up to the same
total) it replays:

- ``lru``: uniform per-layer LRU (the baseline), and every other policy
  this build has, uniform;
- ``pin¼+<policy>``: a quarter of each layer's slots pinned to the learn
  part's hottest experts (hot in every prompt: ``colibri.plan.hot_order``);
- ``planned``: per-layer slots planned on the learn part (LRU curves);
- ``plan``: what ``colibri.plan`` chooses on the learn part alone (kind and
  policy by its own held-out check inside the learn part): the
  non-clairvoyant configuration the acceptance is about;
- ``warm+<policy>`` and ``plan+warm``: the same with a warm start from the
  learn part's history (``open_store(usage_file=..., warm_start=True)``,
  replayed by ``replay(..., usage=learn)``): every unpinned slot starts
  with the layer's hottest experts of the learn part;
- Belady's optimum (cold) and with a free warm start (the bound of pinned
  and warm configurations, whose experts load before they are asked for).

Two shares of the gap are printed: "cold gap", the share of the distance
from LRU to cold Belady that a configuration closes, for configurations
that start empty (pins aside), and "warm gap", the share of the distance to
the warm Belady bound, which bounds everything here and is the honest one
for pinned and warm configurations (negative: worse than LRU). Nothing is
tuned to a trace:
every constant here is structural (quarter pins, half splits) and the same
for all traces. Ends with the replay speed (lookups per second) of
colibri.replay against a per-layer LRU with the same semantics written in
Python (``python_lru_replay`` below), measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT  # noqa: E402  (and colibri found as installed first)

from colibri.plan import _fit, available_policies, hot_order, plan  # noqa: E402
from colibri.replay import (  # noqa: E402
    LayerResult, ReplayResult, _distinct_rows, _pins_by_layer, belady, replay, resolve_slots,
)
from colibri.trace import Trace  # noqa: E402

TRACES = ROOT / "tests" / "data" / "traces"
BUDGETS = (0.125, 0.25, 0.5)


# -- synthetic traces with drift ------------------------------------------------


def synthetic_drift(tokens: int, seed: int, *, layers: int = 16, experts: int = 64, k: int = 4,
                    shift: float = 0.5) -> tuple[Trace, Trace]:
    """(learn, evaluate): per layer a Zipf popularity (exponent varying by
    layer) and a probability of reusing the previous token's experts
    (varying by layer); within each part the popularity drifts slowly (two
    ranks swap every few tokens), and between the parts a share ``shift`` of
    each layer's ranks is reshuffled (a new domain)."""
    rng = np.random.default_rng(seed)
    zipf = rng.uniform(0.6, 1.4, size=layers)
    reuse = rng.uniform(0.05, 0.5, size=layers)
    perm = [rng.permutation(experts) for _ in range(layers)]

    def part(n: int, perms: list[np.ndarray], seq0: int) -> Trace:
        e = np.full((n, layers, k), -1, dtype=np.int32)
        for i in range(layers):
            p = 1.0 / np.arange(1, experts + 1) ** zipf[i]
            p /= p.sum()
            order = perms[i].copy()
            prev: list[int] = []
            for t in range(n):
                if t % 8 == 0:  # slow drift: two ranks swap
                    a, b = rng.integers(0, experts, size=2)
                    order[[a, b]] = order[[b, a]]
                keep = [x for x in prev if rng.random() < reuse[i]][:k]
                rest = [int(order[j]) for j in rng.choice(experts, size=experts, replace=False, p=p)
                        if int(order[j]) not in keep][: k - len(keep)]
                row = keep + rest
                e[t, i, :] = row
                prev = row
        seq = seq0 + np.arange(n, dtype=np.int32) // 64
        return Trace.from_arrays(np.arange(layers), e, None, seq, experts)

    learn = part(tokens, perm, 0)
    moved = []
    for i in range(layers):
        q = perm[i].copy()
        idx = rng.choice(experts, size=int(experts * shift), replace=False)
        q[idx] = q[rng.permutation(idx)]
        moved.append(q)
    return learn, part(tokens, moved, 1000)


# -- configurations -------------------------------------------------------------


def configurations(learn: Trace, slots: int, policies: tuple[str, ...]) -> dict[str, Callable[[Trace], float]]:
    """name -> evaluate(trace) -> hit rate, everything fitted on ``learn``."""
    layers = learn.layers.tolist()
    budget = slots * len(layers)
    out: dict[str, Callable[[Trace], float]] = {}
    for pol in policies:
        out[pol] = lambda t, pol=pol: replay(t, slots_per_layer=slots, policy=pol).hit_rate
    counts = learn.counts()
    n_pin = slots // 4
    widest = max(1, learn.top_k)
    if n_pin and slots - n_pin >= widest:
        hot = hot_order(learn)
        pins = [(l, e) for l in layers for e in hot[l][:n_pin]]
        for pol in policies:
            out[f"pin¼+{pol}"] = lambda t, pol=pol: replay(t, slots_per_layer=slots, policy=pol,
                                                           pinned=pins).hit_rate
    planned = _fit("planned", learn, counts, {l: 1 for l in layers}, budget)
    if planned is not None:
        for pol in policies:
            out[f"planned+{pol}" if pol != "lru" else "planned"] = (
                lambda t, pol=pol: replay(t, slots_per_layer=planned.slots, policy=pol).hit_rate)
    for pol in policies:
        out[f"warm+{pol}"] = lambda t, pol=pol: replay(t, slots_per_layer=slots, policy=pol,
                                                       usage=learn).hit_rate
    p = plan(learn, budget, policies=policies)
    out["plan"] = lambda t: replay(t, slots_per_layer=dict(p.slots_per_layer), policy=p.policy,
                                   pinned=list(p.pin) or None).hit_rate
    out["plan"].__doc__ = f"{p.kind}/{p.policy}"  # type: ignore[union-attr]
    out["plan+warm"] = lambda t: replay(t, slots_per_layer=dict(p.slots_per_layer), policy=p.policy,
                                        pinned=list(p.pin) or None, usage=learn).hit_rate
    return out


def evaluate(name: str, learn: Trace, test: Trace, policies: tuple[str, ...], rows: list[dict]) -> None:
    for frac in BUDGETS:
        slots = max(int(learn.num_experts * frac), learn.top_k)
        note = "" if int(learn.num_experts * frac) >= learn.top_k else f" (raised to top-k {learn.top_k})"
        configs = configurations(learn, slots, policies)
        rates = {c: f(test) for c, f in configs.items()}
        cold = belady(test, slots).hit_rate
        warm = belady(test, slots, warm=True).hit_rate
        lru = rates["lru"]
        print(f"\n{name}, {frac:.1%} = {slots} slots/layer{note}: LRU {lru:.4f}, Belady {cold:.4f} "
              f"(warm {warm:.4f}); plan chose {configs['plan'].__doc__}")
        print(f"  {'configuration':<18} {'hit rate':>9} {'vs LRU':>8} {'cold gap':>9} {'warm gap':>9}")
        for c, hr in rates.items():
            starts_warm = c.startswith("warm") or c.endswith("warm") or c.startswith("pin")
            cold_share = f"{share(hr, lru, cold):>9.1%}" if not starts_warm else f"{'-':>9}"
            print(f"  {c:<18} {hr:>9.4f} {100 * (hr - lru):>+7.2f}p {cold_share} {share(hr, lru, warm):>9.1%}")
        best_name = max(rates, key=lambda c: rates[c])
        rows.append(dict(trace=name, budget=frac, slots=slots, lru=lru, belady=cold, warm=warm,
                         plan=rates["plan"], plan_warm=rates["plan+warm"], plan_kind=configs["plan"].__doc__,
                         best=best_name, best_rate=rates[best_name], rates=rates, requests=test.requests))


def share(rate: float, lru: float, bound: float) -> float:
    """The share of the distance from LRU to ``bound`` that ``rate`` closes."""
    return (rate - lru) / (bound - lru) if bound - lru > 1e-12 else 0.0


HEADLINE = ("cooc", "warm+cooc", "plan", "plan+warm")


def pooled(rows: list[dict]) -> None:
    """Each real trace's two folds together (every token evaluated once, by
    a configuration learnt on the other half): hits summed over both
    evaluation halves, per budget; and each headline configuration's worst
    row against LRU over every trace, fold and budget."""
    print("\npooled over both folds of each real trace (hits over requests of the two evaluation halves)")
    print(f"  {'trace':<28} {'budget':>6} {'LRU':>7} {'Belady':>7} {'warm B.':>7}  " +
          "  ".join(f"{c + ' (gap)':>19}" for c in HEADLINE))
    traces = sorted({r["trace"].split(" learn ")[0] for r in rows if " learn " in r["trace"]})
    for name in traces:
        for frac in BUDGETS:
            folds = [r for r in rows if r["trace"].startswith(name + " learn ") and r["budget"] == frac]
            n = sum(r["requests"] for r in folds)

            def rate(get: Callable[[dict], float]) -> float:
                return sum(get(r) * r["requests"] for r in folds) / n

            lru, cold, warm = rate(lambda r: r["lru"]), rate(lambda r: r["belady"]), rate(lambda r: r["warm"])
            cells = []
            for c in HEADLINE:
                hr = rate(lambda r: r["rates"][c])
                preloads = "warm" in c or (c == "plan" and any("pins" in r["plan_kind"] for r in folds))
                bound = warm if preloads else cold
                cells.append(f"{hr:.4f} ({share(hr, lru, bound):>6.1%})")
            print(f"  {name:<28} {frac:>6.1%} {lru:>7.4f} {cold:>7.4f} {warm:>7.4f}  " + "  ".join(f"{x:>19}" for x in cells))
    print("  (gap: share of the LRU-to-cold-Belady distance for configurations that start empty; of the"
          " LRU-to-warm-Belady distance for warm ones and plans with pins)")
    for c in HEADLINE:
        low = min(rows, key=lambda r: r["rates"][c] - r["lru"])
        print(f"  worst {c} - LRU: {100 * (low['rates'][c] - low['lru']):+.2f} points "
              f"({low['trace']}, {low['budget']:.1%})")


def python_lru_replay(trace: Trace, slots: dict[int, int], pins: dict[int, list[int]]) -> ReplayResult:
    """colibri.replay's LRU in plain Python, the baseline of the speed
    figure: per layer, each token's distinct experts leased together
    (evicting the least recently released others), then released in order."""
    per: dict[int, LayerResult] = {}
    for col, layer in enumerate(trace.layers.tolist()):
        pinned = set(pins[layer])
        room = slots[layer] - len(pinned)
        order: dict[int, None] = {}  # least recently released first
        hits = misses = evictions = persistent = 0
        for row in _distinct_rows(trace, col):
            if not row:
                continue
            need = 0
            for e in row:
                if e in pinned:
                    hits += 1
                    persistent += 1
                elif e in order:
                    hits += 1
                else:
                    misses += 1
                    need += 1
            if need:
                over = len(order) + need - room
                for victim in list(order):
                    if over <= 0:
                        break
                    if victim not in row:
                        del order[victim]
                        evictions += 1
                        over -= 1
            for e in row:  # released in order: the last one is the most recent
                if e not in pinned:
                    order.pop(e, None)
                    order[e] = None
        per[layer] = LayerResult(slots[layer], hits + misses, hits, misses, evictions, persistent)
    return ReplayResult.from_layers("lru", per)


def speed(trace: Trace, rounds: int) -> None:
    slots = trace.num_experts // 4
    lookups = trace.requests
    c_rates, py_rates = [], []
    s = resolve_slots(trace, slots)
    pins = _pins_by_layer(trace, None)
    for _ in range(rounds):
        order = [0, 1] if np.random.random() < 0.5 else [1, 0]
        for which in order:
            t0 = time.perf_counter()
            if which == 0:
                replay(trace, slots_per_layer=slots)
                c_rates.append(lookups / (time.perf_counter() - t0))
            else:
                python_lru_replay(trace, s, pins)
                py_rates.append(lookups / (time.perf_counter() - t0))
    c, py = float(np.median(c_rates)), float(np.median(py_rates))
    print(f"\nreplay speed (opening the store included) on {len(trace)} tokens x {len(trace.layers)} layers "
          f"({lookups:,} lookups, 25% budget), "
          f"median of {rounds} rounds: colibri.replay {c / 1e6:.2f} M lookups/s, Python LRU "
          f"{py / 1e6:.2f} M lookups/s, ratio {c / py:.1f}x "
          f"({'meets' if c >= 1e6 else 'MISSES'} the 1 M lookups/s goal)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter synthetic traces")
    args = ap.parse_args(argv)
    policies = available_policies()
    print(f"policies replayed: {', '.join(policies)}")
    rows: list[dict] = []
    for path in sorted(TRACES.glob("*.npz")):
        t = Trace.load(path)
        seqs = t.sequences
        half = len(seqs) // 2
        a, b = t.select_sequences(seqs[:half]), t.select_sequences(seqs[half:])
        evaluate(f"{path.stem} learn 1st half, eval 2nd", a, b, policies, rows)
        evaluate(f"{path.stem} learn 2nd half, eval 1st", b, a, policies, rows)
    tokens = 600 if args.quick else 2000
    for seed in (1, 2):
        learn, test = synthetic_drift(tokens, seed)
        evaluate(f"synthetic drift seed {seed}", learn, test, policies, rows)
    print("\nsummary: plan (chosen on the learn part only) against uniform LRU on the evaluation part;"
          " plan against cold Belady, plan+warm against warm Belady")
    print(f"  {'trace':<52} {'budget':>6} {'LRU':>7} {'plan':>7} {'Belady':>7} {'gap':>7}  "
          f"{'+warm':>7} {'warm B.':>7} {'gap':>7}  chosen")
    for r in rows:
        print(f"  {r['trace']:<52} {r['budget']:>6.1%} {r['lru']:>7.4f} {r['plan']:>7.4f} "
              f"{r['belady']:>7.4f} {share(r['plan'], r['lru'], r['belady']):>7.1%}  "
              f"{r['plan_warm']:>7.4f} {r['warm']:>7.4f} {share(r['plan_warm'], r['lru'], r['warm']):>7.1%}"
              f"  {r['plan_kind']}")
    worst = min(r["plan"] - r["lru"] for r in rows)
    print(f"worst plan - LRU: {100 * worst:+.2f} points")
    pooled(rows)
    qwen = Trace.load(TRACES / "qwen3.6-35b-a3b-fever.npz")
    speed(Trace.concat([qwen] * 10), 3 if args.quick else 5)  # a long trace: opening the store is amortised
    return 0


if __name__ == "__main__":
    sys.exit(main())
