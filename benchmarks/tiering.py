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
- Belady's optimum (cold) and with a free warm start (the bound of pinned
  configurations, whose pins load before they are asked for).

"gap" is the share of the distance from LRU to the warm Belady bound that a
configuration closes (negative: worse than LRU). Nothing is tuned to a trace:
every constant here is structural (quarter pins, half splits) and the same
for all traces. Ends with the replay speed (lookups per second) of
colibri.replay against the pure-Python LRU of colibri.replay's fallback,
measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from colibri.plan import _fit, available_policies, hot_order, plan  # noqa: E402
from colibri.replay import _replay_python, _pins_by_layer, belady, replay, resolve_slots  # noqa: E402
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
    p = plan(learn, budget, policies=policies)
    out["plan"] = lambda t: replay(t, slots_per_layer=dict(p.slots_per_layer), policy=p.policy,
                                   pinned=list(p.pin) or None).hit_rate
    out["plan"].__doc__ = f"{p.kind}/{p.policy}"  # type: ignore[union-attr]
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
        gap = warm - lru
        print(f"\n{name}, {frac:.1%} = {slots} slots/layer{note}: LRU {lru:.4f}, Belady {cold:.4f} "
              f"(warm {warm:.4f}); plan chose {configs['plan'].__doc__}")
        print(f"  {'configuration':<18} {'hit rate':>9} {'vs LRU':>8} {'gap':>8}")
        for c, hr in rates.items():
            share = (hr - lru) / gap if gap > 1e-12 else 0.0
            print(f"  {c:<18} {hr:>9.4f} {100 * (hr - lru):>+7.2f}p {share:>8.1%}")
        best_name = max(rates, key=lambda c: rates[c])
        rows.append(dict(trace=name, budget=frac, slots=slots, lru=lru, belady=cold, warm=warm,
                         plan=rates["plan"], plan_kind=configs["plan"].__doc__, best=best_name,
                         best_rate=rates[best_name]))


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
                _replay_python(trace, s, pins)
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
    print("\nsummary: plan (chosen on the learn part only) against uniform LRU on the evaluation part")
    print(f"  {'trace':<52} {'budget':>6} {'LRU':>7} {'plan':>7} {'Belady':>7} {'gap':>7}  chosen")
    for r in rows:
        gap = r["warm"] - r["lru"]
        share = (r["plan"] - r["lru"]) / gap if gap > 1e-12 else 0.0
        print(f"  {r['trace']:<52} {r['budget']:>6.1%} {r['lru']:>7.4f} {r['plan']:>7.4f} "
              f"{r['warm']:>7.4f} {share:>7.1%}  {r['plan_kind']}")
    worst = min(r["plan"] - r["lru"] for r in rows)
    print(f"worst plan - LRU: {100 * worst:+.2f} points")
    qwen = Trace.load(TRACES / "qwen3.6-35b-a3b-fever.npz")
    speed(Trace.concat([qwen] * 10), 3 if args.quick else 5)  # a long trace: opening the store is amortised
    return 0


if __name__ == "__main__":
    sys.exit(main())
