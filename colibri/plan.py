"""Plan a cache for a byte budget from a routing history.

:func:`plan` chooses, for a byte budget, how many slots each MoE layer gets,
which experts to pin and which eviction policy to run, by replaying the
history (a :class:`colibri.Trace`, or a :class:`colibri.Usage`, whose counts
stand for a history whose order is unknown).

How:

1. **Miss-ratio curves.** With lease_many semantics (a token's experts of a
   layer resident together, released in order) per-layer LRU is a stack
   algorithm: after every step, a cache of ``c`` slots holds exactly the
   ``c`` most recently used experts. So one pass over a layer's requests,
   noting each request's recency rank, gives that layer's LRU hits at every
   slot count at once. With ``p`` pinned experts (the layer's ``p`` most
   used), the rest run an LRU of ``c - p`` slots over the other requests: one
   more pass per pin count.
2. **Allocation.** The slots of all layers are shared out to maximise the
   total hits within the budget: an exact multiple-choice knapsack (dynamic
   programming over the budget in slot units), since the curves need not be
   concave. Uniform per-layer slots are one of its choices, so on the
   history it is never worse than uniform LRU.
3. **Choice by held-out replay.** Candidates (uniform, planned slots, planned
   slots with pins; under each policy) are fitted on one half of the history
   and replayed on the other, cold, as a new session would see it, both ways
   round. A candidate's score is the worse of its two gains over uniform
   LRU, so it is chosen only if it wins in both directions (ties go to the
   simpler one, uniform LRU first); the winner is then fitted again on the
   whole history. A candidate that only fits its own past loses to one that
   carries over. Pins are chosen the same way inside a fit: the hottest of
   one half, kept where they win on the other; and "hottest" means hot in
   every prompt of the history (:func:`hot_order`), not on average.
"""

from __future__ import annotations

import bisect
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence, Union

import numpy as np

from colibri.errors import FormatError
from colibri.replay import ReplayResult, distinct_rows, most_distinct, replay
from colibri.store import POLICIES
from colibri.trace import Trace
from colibri.usage import Usage

__all__ = ["plan", "Plan", "lru_curves", "available_policies"]


def available_policies() -> tuple[str, ...]:
    """The eviction policies replay can run: every policy of the C core."""
    return POLICIES


@dataclass(frozen=True)
class Plan:
    """A cache configuration for a byte budget. ``open_store_kwargs()`` gives
    the options that build it (``open_store(path, **plan.open_store_kwargs())``)."""

    slots_per_layer: Mapping[int, int]
    pin: tuple[tuple[int, int], ...]
    policy: str
    kind: str  #: "uniform", "planned" or "planned+pins"
    capacity_bytes: int
    used_bytes: int
    #: hit rate of this configuration replayed on the whole history
    history_hit_rate: float
    #: hit rate of uniform per-layer LRU at the same budget, on the whole history
    uniform_lru_hit_rate: float
    #: per candidate "kind/policy": hit rate on the held-out part of the history
    validation: Mapping[str, float] = field(default_factory=dict)

    def open_store_kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"slots_per_layer": dict(self.slots_per_layer)}
        if self.policy != "lru":
            out["policy"] = self.policy
        if self.pin:
            out["pin"] = [list(k) for k in self.pin]
        return out

    def __str__(self) -> str:
        lines = [
            f"plan: {self.kind}, policy {self.policy}, {self.used_bytes:,} of {self.capacity_bytes:,} bytes",
            f"history hit rate {self.history_hit_rate:.4f} (uniform LRU {self.uniform_lru_hit_rate:.4f})",
            f"{'layer':>6} {'slots':>6} {'pinned':>7}",
        ]
        pins: dict[int, int] = {}
        for layer, _ in self.pin:
            pins[layer] = pins.get(layer, 0) + 1
        for layer, s in self.slots_per_layer.items():
            lines.append(f"{layer:>6} {s:>6} {pins.get(layer, 0):>7}")
        if self.validation:
            lines.append("held-out hit rate per candidate: " + ", ".join(
                f"{k} {v:.4f}" for k, v in sorted(self.validation.items(), key=lambda kv: -kv[1])))
        return "\n".join(lines)


# -- curves ------------------------------------------------------------------


def _layer_curve(rows: list[tuple[int, ...]], pinned: frozenset[int], num_experts: int) -> np.ndarray:
    """hits[c] of an LRU of c slots (c = 0..num_experts) over the requests
    not pinned, plus every pinned request (as persistent hits).

    Each release gets the next stamp (a step releases its experts in
    order); an expert's recency rank before a step is the number of experts
    whose last stamp is larger than its own."""
    stamp: dict[int, int] = {}
    live: list[int] = []  # the last stamp of every expert seen, ascending
    ranks = [0] * (num_experts + 1)  # ranks[r]: requests found at rank r
    persistent = 0
    clock = 0
    for row in rows:
        free = [e for e in row if e not in pinned] if pinned else row
        persistent += len(row) - len(free)
        n_live = len(live)
        for e in free:
            mine = stamp.get(e)
            if mine is not None:
                ranks[n_live - bisect.bisect_right(live, mine)] += 1
        for e in free:
            mine = stamp.get(e)
            if mine is not None:
                del live[bisect.bisect_left(live, mine)]
            stamp[e] = clock
            live.append(clock)  # the newest stamp is the largest
            clock += 1
    hits = np.concatenate([[0], np.cumsum(ranks[:-1])]).astype(np.int64)  # hits[c]: ranks < c
    return hits + persistent


def lru_curves(trace: Trace, pins: Mapping[int, Sequence[int]] | None = None) -> dict[int, np.ndarray]:
    """Per layer, LRU hits at every slot count ``c`` (index c, 0..num_experts)
    on ``trace`` with ``pins[layer]`` pinned (their hits included; ``c``
    then counts the pinned slots too, so entries below ``len(pins)`` are
    meaningless). Equal to :func:`colibri.replay` with LRU at each count."""
    out: dict[int, np.ndarray] = {}
    for col, layer in enumerate(trace.layers.tolist()):
        p = list((pins or {}).get(layer, ()))
        curve = _layer_curve(distinct_rows(trace, col), frozenset(p), trace.num_experts)
        if p:  # c slots = len(p) pinned + an LRU of c - len(p)
            shifted = np.full_like(curve, -1)
            shifted[len(p):] = curve[: len(curve) - len(p)]
            curve = shifted
        out[layer] = curve
    return out


# -- allocation --------------------------------------------------------------


def _allocate(curves: Mapping[int, np.ndarray], lo: Mapping[int, int], cost: Mapping[int, int],
              budget_units: int) -> dict[int, int] | None:
    """Slots per layer maximising the summed curves, with cost[layer] units a
    slot and at least lo[layer] slots; None if even the minimum does not fit."""
    layers = list(curves)
    neg = np.iinfo(np.int64).min // 4
    best = np.full(budget_units + 1, neg, dtype=np.int64)
    best[0] = 0
    choice: list[np.ndarray] = []
    for layer in layers:
        curve, w = curves[layer], cost[layer]
        new = np.full_like(best, neg)
        pick = np.full(budget_units + 1, -1, dtype=np.int32)
        for c in range(lo[layer], len(curve)):
            if curve[c] < 0:
                continue
            used = c * w
            if used > budget_units:
                break
            cand = np.full_like(best, neg)
            cand[used:] = best[: budget_units + 1 - used] + curve[c]
            better = cand > new
            new[better] = cand[better]
            pick[better] = c
        best = new
        choice.append(pick)
    end = int(np.argmax(best))
    if best[end] <= neg // 2:
        return None
    out: dict[int, int] = {}
    for layer, pick in zip(reversed(layers), reversed(choice)):
        c = int(pick[end])
        out[layer] = c
        end -= c * cost[layer]
    return {layer: out[layer] for layer in layers}


def _units(trace: Trace, expert_nbytes: Mapping[int, int], capacity_bytes: int) -> tuple[dict[int, int], int]:
    unit = min(expert_nbytes.values())
    cost = {l: max(1, math.ceil(expert_nbytes[l] / unit)) for l in trace.layers.tolist()}
    return cost, capacity_bytes // unit


def _pin_grid(slots_max: int, k: int) -> list[int]:
    """Pin counts tried: 0 and powers of two leaving room for a token's experts."""
    out, p = [0], 1
    while p <= slots_max - k:
        out.append(p)
        p *= 2
    return out


def hot_order(trace: Trace) -> dict[int, list[int]]:
    """Per layer, the pin candidates of the history, hottest first. With
    several sequences (prompts), only experts every one of them used, ranked
    by their fewest uses in any sequence, then by total uses: an expert only
    some prompts love is a poor pin for the next prompt; one every prompt
    uses is a good one. With one sequence, every expert used, by uses."""
    total = trace.counts()
    seqs = trace.sequences
    per = [trace.select_sequences([s]).counts() for s in seqs] if len(seqs) >= 2 else []
    out: dict[int, list[int]] = {}
    for layer, c in total.items():
        least = np.min([p[layer] for p in per], axis=0) if per else np.zeros_like(c)
        order = np.lexsort((-c, -least))
        out[layer] = [int(e) for e in order if (least[e] > 0 if per else c[e] > 0)]
    return out


@dataclass
class _Fitted:
    slots: dict[int, int]
    pins: list[tuple[int, int]]


def _fit(kind: str, trace: Trace, counts: Mapping[int, np.ndarray], expert_nbytes: Mapping[int, int],
         capacity_bytes: int) -> _Fitted | None:
    layers = trace.layers.tolist()
    widest = dict(zip(layers, (max(w, 1) for w in most_distinct(trace))))
    n = trace.num_experts
    if kind == "uniform":
        per = capacity_bytes // sum(expert_nbytes[l] for l in layers)
        even = {l: min(n, per) for l in layers}
        if any(even[l] < widest[l] for l in layers):
            return None
        return _Fitted(even, [])
    cost, units = _units(trace, expert_nbytes, capacity_bytes)
    curves = lru_curves(trace)
    pin_lists: dict[int, list[list[int]]] = {}  # per layer, per slot count: the experts to pin
    if kind == "planned+pins":
        # Pinning the hottest of the very requests it is scored on always
        # looks good; so pins come from the earlier part of the history and
        # are scored on the later part, and the pin count that wins there
        # (per layer and slot count) is kept.
        halves = _split(trace)
        source, scored = halves if halves is not None else (trace, trace)
        src_hot = hot_order(source)
        all_hot = hot_order(trace)
        curves = lru_curves(scored)
        best_curve: dict[int, np.ndarray] = {}
        for col, layer in enumerate(layers):
            hot = src_hot[layer]
            rows = distinct_rows(scored, col)
            options: list[tuple[int, np.ndarray]] = [(0, curves[layer])]
            for p in _pin_grid(n, widest[layer])[1:]:
                if p > len(hot):
                    break
                c = _layer_curve(rows, frozenset(hot[:p]), n)
                shifted = np.full_like(c, -1)
                # Charged one load per pin: a pin must earn its slot by the
                # hits it keeps, not by a free start (short halves overrate that).
                shifted[p:] = c[: len(c) - p] - p
                shifted[: p + widest[layer]] = -1  # the LRU part must hold a token's experts
                options.append((p, shifted))
            stack = np.stack([c for _, c in options])
            best_curve[layer] = stack.max(axis=0)
            pin_lists[layer] = [all_hot[layer][: options[i][0]] for i in stack.argmax(axis=0)]
        curves = best_curve
    slots = _allocate(curves, {l: widest[l] for l in layers}, cost, units)
    if slots is None:
        return None
    pins = [(layer, e) for layer in pin_lists for e in pin_lists[layer][slots[layer]]]
    return _Fitted(slots, pins)


# -- the planner ---------------------------------------------------------------


def _history(trace_or_usage: Union[Trace, Usage], top_k: int | None, tokens: int) -> Trace:
    if isinstance(trace_or_usage, Trace):
        return trace_or_usage
    if isinstance(trace_or_usage, Usage):
        if top_k is None:
            raise FormatError("planning from a Usage needs top_k (experts per token)")
        return _sampled_trace(trace_or_usage, top_k, tokens)
    raise FormatError(f"plan needs a Trace or a Usage, got {type(trace_or_usage).__name__}")


def _sampled_trace(usage: Usage, top_k: int, tokens: int) -> Trace:
    """A trace drawn from the usage counts as independent requests (the
    order the counts forgot): each token takes top_k distinct experts per
    layer in proportion to their counts. Seeded, so plans repeat."""
    rng = np.random.default_rng(0)
    layers = list(usage.layers)
    n = max(usage.num_experts(l) for l in layers)
    k = min(top_k, n)
    experts = np.full((tokens, len(layers), k), -1, dtype=np.int32)
    for i, layer in enumerate(layers):
        c = usage.counts(layer) + 1e-9
        p = c / c.sum()
        kk = min(k, usage.num_experts(layer))
        # Gumbel top-k: sampling without replacement in proportion to p
        g = np.log(p)[None, :] - np.log(-np.log(rng.random((tokens, len(p)))))
        experts[:, i, :kk] = np.argsort(-g, axis=1)[:, :kk]
    return Trace.from_arrays(layers, experts, None, None, n)


def _split(trace: Trace) -> tuple[Trace, Trace] | None:
    """Earlier and later part of the history: by sequence when there are
    several, else by tokens; None when too short to split."""
    seqs = trace.sequences
    if len(seqs) >= 2:
        half = len(seqs) // 2
        return trace.select_sequences(seqs[:half]), trace.select_sequences(seqs[half:])
    if len(trace) >= 4:
        return trace.tokens(slice(0, len(trace) // 2)), trace.tokens(slice(len(trace) // 2, None))
    return None


def plan(
    trace_or_usage: Union[Trace, Usage],
    capacity_bytes: int,
    *,
    expert_nbytes: int | Mapping[int, int] = 1,
    policies: Iterable[str] | None = None,
    pins: bool = True,
    top_k: int | None = None,
    sample_tokens: int = 2048,
) -> Plan:
    """The per-layer slots, pins and policy for ``capacity_bytes``, chosen by
    replaying the history (see the module docstring). ``expert_nbytes`` is
    one expert's bytes (per layer, or one int for all; 1 makes the budget a
    slot count). ``policies`` are tried (default: every policy this build
    replays); ``pins=False`` never pins. A Usage is replayed as a sample of
    ``sample_tokens`` tokens of ``top_k`` experts drawn from its counts."""
    history = _history(trace_or_usage, top_k, sample_tokens)
    layers = history.layers.tolist()
    if isinstance(expert_nbytes, Mapping):
        nbytes = {l: operator.index(expert_nbytes[l]) for l in layers}
    else:
        nbytes = {l: operator.index(expert_nbytes) for l in layers}
    if min(nbytes.values()) < 1:
        raise FormatError("expert_nbytes must be >= 1")
    capacity_bytes = operator.index(capacity_bytes)
    pols = tuple(policies) if policies is not None else available_policies()
    if "lru" not in pols:
        pols = ("lru",) + pols
    kinds = ["uniform", "planned"] + (["planned+pins"] if pins else [])

    def fit_all(part: Trace) -> dict[str, _Fitted]:
        counts = part.counts()
        out = {}
        for kind in kinds:
            f = _fit(kind, part, counts, nbytes, capacity_bytes)
            if f is not None:
                out[kind] = f
        return out

    def run(part: Trace, f: _Fitted, policy: str) -> ReplayResult:
        return replay(part, slots_per_layer=f.slots, policy=policy, pinned=f.pins or None)

    whole = fit_all(history)
    if not whole:
        need = sum(nbytes[l] * max(w, 1) for l, w in zip(layers, most_distinct(history)))
        raise FormatError(f"capacity_bytes {capacity_bytes:,} cannot hold one token's experts "
                          f"in every layer ({need:,} bytes)")
    validation: dict[str, float] = {}
    split = _split(history)
    ranked: list[tuple[float, int, str, str]] = []
    order = [(kind, pol) for pol in pols for kind in kinds]  # simpler first: ties keep it
    if split is not None:
        # Both ways round: fitted on one half, replayed on the other. A
        # candidate's score is its worse gain over uniform LRU of the two,
        # so it must win in both directions to be chosen over uniform LRU.
        folds = [(split[0], split[1]), (split[1], split[0])]
        gains: dict[tuple[str, str], list[float]] = {}
        rates: dict[tuple[str, str], list[float]] = {}
        for fit_on, score_on in folds:
            fitted = fit_all(fit_on)
            if "uniform" not in fitted:
                continue
            base_hits = run(score_on, fitted["uniform"], "lru").hits
            for kind, pol in order:
                if kind in fitted and kind in whole:
                    r = run(score_on, fitted[kind], pol)
                    charged = r.hits - len(fitted[kind].pins)  # pins' loads count as misses here
                    gains.setdefault((kind, pol), []).append((charged - base_hits) / max(r.requests, 1))
                    rates.setdefault((kind, pol), []).append(r.hit_rate)
        for rank, (kind, pol) in enumerate(order):
            g = gains.get((kind, pol))
            if g and len(g) == len(gains.get(("uniform", "lru"), g)):
                validation[f"{kind}/{pol}"] = float(np.mean(rates[(kind, pol)]))
                ranked.append((-min(g), rank, kind, pol))
    if not ranked:
        for rank, (kind, pol) in enumerate(order):
            if kind in whole:
                ranked.append((-run(history, whole[kind], pol).hits, rank, kind, pol))
    ranked.sort()
    _, _, kind, pol = ranked[0]
    chosen = whole[kind]
    result = run(history, chosen, pol)
    uniform = whole.get("uniform")
    base = run(history, uniform, "lru").hit_rate if uniform is not None else 0.0
    used = sum(chosen.slots[l] * nbytes[l] for l in layers)
    return Plan(
        slots_per_layer=dict(chosen.slots), pin=tuple(chosen.pins), policy=pol, kind=kind,
        capacity_bytes=capacity_bytes, used_bytes=used, history_hit_rate=result.hit_rate,
        uniform_lru_hit_rate=base, validation=validation,
    )
