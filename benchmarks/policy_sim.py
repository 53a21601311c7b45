#!/usr/bin/env python3
"""Eviction policies on routing traces: the study of docs/policies.md.

The store's own policies (``lru``, ``lrfu``, ``cooc``) run in the store's C
code (colibri.replay) and Belady's optimum is colibri.belady. The policies
the store does not have (the research family behind ``lrfu`` and ``cooc``,
ARC, SLRU, and ``cooc`` with other constants) run in the simulator below,
which simulates colibri's per-layer caches with ``lease_many`` semantics:
for each token and layer the token's k experts (duplicates and -1 pads
dropped) are leased together, the misses take the victims the policy names
among the slots the token does not use, then all are released in the order
asked. An empty slot is taken before anything is evicted. The simulator also
writes the store's three policies out again, operation for operation
(``LRU``, ``CLrfu``, ``CCooc``): tests/test_policies.py checks the C store
against that independent mirror.

    python benchmarks/policy_sim.py                 # the study in docs/policies.md
    python benchmarks/policy_sim.py --quick         # fewer synthetic traces

Protocol: the constants of every policy are chosen before looking at the
evaluation parts. Qwen3.6's 16 prompts are split into two halves; a usage
history (where a policy uses one) is learnt on one half and the cache is run
over the other half, from empty; both directions are reported. Mixtral's two
problems are used the same way. Synthetic traces (skewed and flat popularity,
with and without drift) get their history from a separate draw of the same
generator.

Policies:

- ``lru``: least recently released first (the store's default).
- ``lrfu``: the store's LRFU policy, operation for operation (``CLrfu``): each
  expert keeps a decayed use count, a use adding 1 / (1 + rank) (its place in
  the request, best first), the count halving every 2 x slots requests of the
  layer (linearly in between); the smallest count is evicted. The count
  outlives an eviction.
- ``cooc``: the store's co-occurrence policy, operation for operation
  (``CCooc``): per layer, how often each expert followed each other one from
  one lookup to the next, decayed (half-life 64 lookups); the victim, among
  the older half of LRU's list, is the expert least likely to follow the
  current lookup. ``cooc:H`` changes the half-life, ``/prior=P`` the weight
  of an expert's overall share, ``/m=F`` the candidates (F x slots); the
  full run ends with each changed alone.
- ``crf:H``, ``crf-rank:H``, ``crf-router:H``: the research family behind it
  (exact exponential decay; a use adds 1, 1 / (1 + rank), or the router's
  weight from the trace). H is a half-life in tokens, or ``Nt`` for N x slots
  requests. Options: ``/noghost`` forgets an evicted expert's count;
  ``/pop=G`` multiplies each count by the expert's popularity in the usage
  history (((count + 1) / (mean + 1)) ** G).
- ``arc``, ``slru``: adaptive replacement cache (Megiddo and Modha), and a
  segmented LRU with half the slots protected, both respecting leases.
- ``belady``: the clairvoyant bound (colibri.belady).
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRACE_DIRS = [ROOT / "tests" / "data" / "traces"]
# The store's policies at their own constants: run by the store's C code.
STORE_POLICIES = ("lru", "lrfu", "cooc")


# ------------------------------------------------------------------ traces --

@dataclass
class Trace:
    """experts (T, L, k) int32 with -1 pads; weights (T, L, k) float32 or None."""

    name: str
    experts: np.ndarray
    weights: np.ndarray | None
    sequence: np.ndarray
    num_experts: int

    def select(self, mask: np.ndarray, name: str) -> "Trace":
        return Trace(name, self.experts[mask], None if self.weights is None else self.weights[mask],
                     self.sequence[mask], self.num_experts)


def load_trace(path: Path) -> Trace:
    with np.load(path) as d:
        w = d["weights"] if "weights" in d.files else None
        seq = d["sequence"] if "sequence" in d.files else np.zeros(len(d["experts"]), np.int32)
        return Trace(path.stem, d["experts"].astype(np.int32), w, seq.astype(np.int32),
                     int(d["num_experts"]))


def find_trace(filename: str) -> Path:
    for d in TRACE_DIRS:
        if (d / filename).exists():
            return d / filename
    raise FileNotFoundError(filename)


def synthetic(seed: int, *, tokens: int = 768, layers: int = 8, experts: int = 128, k: int = 8,
              zipf: float = 1.0, stick: float = 0.35, drift_every: int = 0,
              sequences: int = 16) -> Trace:
    """Routing with a per-layer popularity (Zipf exponent ``zipf``; 0 is flat),
    temporal reuse (each of the previous token's experts is kept with
    probability ``stick``, the best-ranked more often) and, if ``drift_every``,
    a popularity that moves: every ``drift_every`` tokens a tenth of the
    experts swap popularity ranks. Router weights are a softmax of noisy logits
    so that, as in real routers, the experts kept from the previous token tend
    to be the strong ones."""
    rng = np.random.default_rng(seed)
    out = np.empty((tokens, layers, k), np.int32)
    wts = np.empty((tokens, layers, k), np.float32)
    base = 1.0 / np.arange(1, experts + 1) ** zipf
    for li in range(layers):
        perm = rng.permutation(experts)
        prev = np.empty(0, np.int64)
        prev_w = np.empty(0)
        for t in range(tokens):
            if drift_every and t and t % drift_every == 0:
                a = rng.choice(experts, experts // 10, replace=False)
                perm[a] = perm[rng.permutation(a)]
            p = np.empty(experts)
            p[perm] = base
            keep_p = stick * (0.5 + prev_w * len(prev_w)) if len(prev) else prev_w
            kept = prev[rng.random(len(prev)) < np.clip(keep_p, 0, 0.95)][:k]
            p[kept] = 0
            p /= p.sum()
            fresh = rng.choice(experts, k - len(kept), replace=False, p=p)
            chosen = np.concatenate([kept, fresh])
            logits = rng.normal(0, 1, k) + np.log(np.where(np.isin(chosen, kept), 2.0, 1.0))
            order = np.argsort(-logits)
            chosen = chosen[order]
            w = np.exp(logits[order])
            w /= w.sum()
            out[t, li] = chosen
            wts[t, li] = w
            prev, prev_w = chosen.astype(np.int64), w
    seq = (np.arange(tokens) * sequences // tokens).astype(np.int32)
    tag = f"zipf{zipf:g}" + (f"-drift{drift_every}" if drift_every else "")
    return Trace(f"synthetic-{tag}-s{seed}", out, wts, seq, experts)


# ---------------------------------------------------------------- policies --

class Policy:
    """One layer's policy. Calls, per token: ``victim`` once per miss that
    finds no empty slot (``busy`` are the experts the token uses, never
    victims), then ``release(e, t, w, rank)`` for each expert of the token in
    request order, then ``evicted`` for nothing else: the simulator tells
    ``remove(e)`` when a victim leaves."""

    def victim(self, resident: Iterable[int], busy: set[int], t: int) -> int:
        raise NotImplementedError

    def release(self, e: int, t: int, w: float, rank: int, hit: bool) -> None:
        raise NotImplementedError

    def remove(self, e: int) -> None:
        pass


class Keyed(Policy):
    """Evicts the resident expert with the smallest (key, release sequence).
    Keys are fixed between an expert's uses, so a heap with lazy deletion
    finds the victim."""

    def __init__(self) -> None:
        self.key: dict[int, float] = {}
        self.seq: dict[int, int] = {}
        self.heap: list[tuple[float, int, int]] = []
        self.n = 0

    def victim(self, resident: Iterable[int], busy: set[int], t: int) -> int:
        held = []
        while True:
            kk, sq, e = heapq.heappop(self.heap)
            if self.seq.get(e) != sq or e not in self.key:
                continue
            if e in busy:
                held.append((kk, sq, e))
                continue
            break
        for h in held:
            heapq.heappush(self.heap, h)
        return e

    def release(self, e: int, t: int, w: float, rank: int, hit: bool) -> None:
        self.n += 1
        self.seq[e] = self.n
        self.key[e] = k = self.new_key(e, t, w, rank, hit)
        heapq.heappush(self.heap, (k, self.n, e))
        if len(self.heap) > 4 * len(self.key) + 64:
            self.heap = [(self.key[x], self.seq[x], x) for x in self.key]
            heapq.heapify(self.heap)

    def remove(self, e: int) -> None:
        del self.key[e]

    def new_key(self, e: int, t: int, w: float, rank: int, hit: bool) -> float:
        raise NotImplementedError


class LRU(Keyed):
    def new_key(self, e, t, w, rank, hit):
        return 0.0   # the release sequence alone orders them


class LRFU(Keyed):
    """Decayed use count ``c``; the key is log2(c) + t / H (+ a fixed bias
    per expert), which orders the experts as their counts at any common time
    do and never needs updating while an expert is not used. ``weight`` maps
    (router weight, rank) to the amount one use adds. With ``ghost`` an
    expert that is evicted and comes back keeps its decayed count (per-expert
    state, as the store has per-expert arrays anyway). ``bias`` (log2 units)
    multiplies an expert's count by a constant, e.g. its popularity in the
    usage history."""

    def __init__(self, half_life: float, weight: Callable[[float, int], float],
                 bias: np.ndarray | None = None, ghost: bool = True) -> None:
        super().__init__()
        self.h = half_life
        self.weight = weight
        self.ghost = ghost
        self.bias = bias
        self.crf: dict[int, float] = {}

    def new_key(self, e, t, w, rank, hit):
        add = self.weight(w, rank)
        now = t / self.h   # t and h in requests of the layer
        old = self.crf.get(e) if (hit or self.ghost) else None
        rest = -100.0 if old is None else old - now
        c = now + math.log2(add + 2.0 ** rest) if rest > -60 else now + math.log2(add)
        self.crf[e] = c
        return c + (self.bias[e] if self.bias is not None else 0.0)


class CLrfu(Keyed):
    """The store's ``lrfu`` policy, operation for operation (csrc/ls_policy.c),
    so that its counters can be checked against the C replay exactly: a use
    adds 1 / (1 + rank) times g(now) to the expert's count; g doubles every
    ``half`` = 2 x slots requests, linearly in between; at 512 doublings
    everything is scaled by 2**-512."""

    RESCALE = 512

    def __init__(self, slots: int) -> None:
        super().__init__()
        self.half = 2 * slots
        self.base = 0
        self.q = 0
        self.pow = 1.0
        self.count: dict[int, float] = {}

    def scale_now(self, now: int) -> float:
        d = now - self.base
        while d >= self.half * (self.q + 1):
            self.q += 1
            self.pow *= 2.0
            if self.q == self.RESCALE:
                for e in self.count:
                    self.count[e] *= 2.0 ** -512
                for e in self.key:
                    if self.key[e] > 0:
                        self.key[e] *= 2.0 ** -512
                self.heap = [(self.key[x], self.seq[x], x) for x in self.key]
                heapq.heapify(self.heap)
                self.base += self.RESCALE * self.half
                self.q = 0
                self.pow = 1.0
                d = now - self.base
        return self.pow * (1.0 + (d - self.q * self.half) / self.half)

    def new_key(self, e, t, w, rank, hit):
        g = self.scale_now(t)
        use = 0.0 + 1.0 / (1 + rank)
        c = self.count.get(e, 0.0) + use * g
        self.count[e] = c
        return c


class ARC(Policy):
    def __init__(self, slots: int) -> None:
        self.c = slots
        self.p = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.pending: set[int] = set()   # the ghost each miss came back from
        self.from_b2 = False

    def note_request(self, e: int) -> None:
        """Called for each requested expert before victims are chosen."""
        if e in self.b1:
            self.p = min(self.c, self.p + max(len(self.b2) / len(self.b1), 1.0))
        elif e in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))

    def victim(self, resident, busy, t):
        def lru_of(lst):
            for e in lst:
                if e not in busy:
                    return e
            return None
        first = self.t1 if (self.t1 and len(self.t1) > self.p) else self.t2
        other = self.t2 if first is self.t1 else self.t1
        v = lru_of(first)
        if v is None:
            v = lru_of(other)
        assert v is not None
        return v

    def remove(self, e):
        if e in self.t1:
            del self.t1[e]
            self.b1[e] = None
        else:
            del self.t2[e]
            self.b2[e] = None
        while len(self.b1) + len(self.t1) > self.c and self.b1:
            self.b1.popitem(last=False)
        while len(self.b1) + len(self.b2) + len(self.t1) + len(self.t2) > 2 * self.c and self.b2:
            self.b2.popitem(last=False)

    def release(self, e, t, w, rank, hit):
        if hit or e in self.b1 or e in self.b2:
            self.t1.pop(e, None)
            self.t2.pop(e, None)
            self.b1.pop(e, None)
            self.b2.pop(e, None)
            self.t2[e] = None
        else:
            self.t1[e] = None


class SLRU(Policy):
    def __init__(self, slots: int, protected: float = 0.5) -> None:
        self.cap = max(1, int(slots * protected))
        self.prob: OrderedDict[int, None] = OrderedDict()
        self.prot: OrderedDict[int, None] = OrderedDict()

    def victim(self, resident, busy, t):
        for lst in (self.prob, self.prot):
            for e in lst:
                if e not in busy:
                    return e
        raise AssertionError

    def remove(self, e):
        self.prob.pop(e, None)
        self.prot.pop(e, None)

    def release(self, e, t, w, rank, hit):
        if hit:
            self.prob.pop(e, None)
            self.prot.pop(e, None)
            self.prot[e] = None
            while len(self.prot) > self.cap:
                d, _ = self.prot.popitem(last=False)
                self.prob[d] = None
        else:
            self.prob[e] = None


# --------------------------------------------------------------- simulator --

@dataclass
class Counts:
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def requests(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    def add(self, o: "Counts") -> None:
        self.hits += o.hits
        self.misses += o.misses
        self.evictions += o.evictions


class CCooc(Policy):
    """The store's ``cooc`` policy, operation for operation (csrc/ls_policy.c):
    per layer it learns how often expert b was asked in the lookup right after
    one that asked a (``follow[a][b]``) and how often each expert was asked
    (``count``), each use adding g(now), g doubling every ``half`` lookups
    (2**-64 rescale at 64 doublings). The victim, among the m oldest
    evictable experts in LRU order (m = max(slots // 2, 2 x the lookup's
    experts), at most 64), has the lowest sum of follow[a][x] over the
    lookup's experts a plus prior x g x |S| x count[x] / total; ties go to
    the older. ``prior`` and ``fraction`` (of the slots in m) are the C
    constants 1 and 1/2 unless changed for the sensitivity study."""

    RESCALE = 64
    CANDIDATES = 64
    PRIOR = 1.0

    def __init__(self, slots: int, half: int = 64, prior: float = PRIOR, fraction: float = 0.5) -> None:
        self.slots = slots
        self.half = half
        self.prior = prior
        self.fraction = fraction
        self.follow: dict[int, dict[int, float]] = {}
        self.count: dict[int, float] = {}
        self.total = 0.0
        self.cur: list[int] = []
        self.steps = self.base = self.q = 0
        self.pow = 1.0
        self.g = 1.0
        self.lru: OrderedDict[int, None] = OrderedDict()   # oldest first

    def scale_now(self) -> float:
        d = self.steps - self.base
        while d >= self.half * (self.q + 1):
            self.q += 1
            self.pow *= 2.0
            if self.q == self.RESCALE:
                for row in self.follow.values():
                    for b in row:
                        row[b] *= 2.0 ** -64
                for b in self.count:
                    self.count[b] *= 2.0 ** -64
                self.total *= 2.0 ** -64
                self.base += self.RESCALE * self.half
                self.q = 0
                self.pow = 1.0
                d = self.steps - self.base
        return self.pow * (1.0 + (d - self.q * self.half) / self.half)

    def note_step(self, experts: list[int]) -> None:
        """A lookup_many of these distinct experts begins."""
        prev, self.cur = self.cur, list(experts)
        self.steps += 1
        g = self.scale_now()
        for a in prev:
            row = self.follow.setdefault(a, {})
            for b in self.cur:
                row[b] = row.get(b, 0.0) + g
        for b in self.cur:
            self.count[b] = self.count.get(b, 0.0) + g
        self.total += g * len(self.cur)
        self.g = g

    def victim(self, resident, busy, t):
        m = min(self.CANDIDATES, max(int(self.slots * self.fraction), 2 * len(self.cur)))
        c = self.prior * self.g * len(self.cur) / self.total if self.total > 0 else 0.0
        best, best_score = None, 0.0
        for x in [e for e in self.lru if e not in busy][:m]:
            score = 0.0
            for a in self.cur:
                score += self.follow.get(a, {}).get(x, 0.0)
            score += c * self.count.get(x, 0.0)
            if best is None or score < best_score:
                best, best_score = x, score
        assert best is not None
        return best

    def release(self, e, t, w, rank, hit):
        self.lru.pop(e, None)
        self.lru[e] = None

    def remove(self, e):
        del self.lru[e]


def _requests(experts: np.ndarray, weights: np.ndarray | None):
    """Per token: the distinct non-negative experts in request order, with
    their weight and rank."""
    out = []
    for t in range(len(experts)):
        seen = set()
        row = []
        for j, e in enumerate(experts[t].tolist()):
            if e < 0 or e in seen:
                continue
            seen.add(e)   # rank: the place among the distinct experts, as the store sees them
            row.append((e, float(weights[t, j]) if weights is not None else 1.0, len(row)))
        out.append(row)
    return out


def simulate_layer(experts: np.ndarray, weights: np.ndarray | None, slots: int, policy: Policy) -> Counts:
    """experts (T, k) of one layer through ``policy``."""
    reqs = _requests(experts, weights)
    c = Counts()
    resident: set[int] = set()
    note = getattr(policy, "note_request", None)
    step = getattr(policy, "note_step", None)
    now = 0   # the layer's requests so far: the policies' clock
    for t, row in enumerate(reqs):
        busy = {e for e, _, _ in row}
        if step and row:   # the store makes no lookup for an empty row
            step([e for e, _, _ in row])
        if len(busy) > slots:
            raise ValueError(f"{len(busy)} experts asked of a layer with {slots} slots")
        hit = {e: e in resident for e in busy}
        if note:
            for e, _, _ in row:
                if not hit[e]:
                    note(e)
        for e, _, _ in row:
            if hit[e]:
                c.hits += 1
                continue
            c.misses += 1
            if len(resident) >= slots:
                v = policy.victim(resident, busy, t)
                resident.discard(v)
                policy.remove(v)
                c.evictions += 1
            resident.add(e)
        now += len(row)
        for e, w, r in row:
            policy.release(e, now, w, r, hit[e])
    return c


def slots_for(fraction: float, num_experts: int, k: int) -> int:
    return max(k, int(round(fraction * num_experts)))


def run(trace: Trace, fraction: float, spec: str, prior: np.ndarray | None = None) -> float:
    """The hit rate of policy ``spec`` on ``trace`` with ``fraction`` of each
    layer's experts as slots: the store's C replay for its own policies,
    colibri.belady for ``belady``, the simulator for the rest."""
    k = trace.experts.shape[2]
    slots = slots_for(fraction, trace.num_experts, k)
    if spec in STORE_POLICIES or spec == "belady":
        import colibri

        routing = colibri.Trace.from_arrays(np.arange(trace.experts.shape[1]), trace.experts,
                                            num_experts=trace.num_experts)
        if spec == "belady":
            return colibri.belady(routing, slots).hit_rate
        return colibri.replay(routing, slots_per_layer=slots, policy=spec).hit_rate
    make = make_policy(spec, prior)
    K[0] = k
    total = Counts()
    for li in range(trace.experts.shape[1]):
        w = trace.weights[:, li] if trace.weights is not None else None
        total.add(simulate_layer(trace.experts[:, li], w, slots, make(li, slots)))
    return total.hit_rate


# ---------------------------------------------------------------- registry --

def rank_weight(w: float, rank: int) -> float:
    return 1.0 / (1 + rank)


def router_weight(w: float, rank: int) -> float:
    return max(w, 1e-6)


def one(w: float, rank: int) -> float:
    return 1.0


K = [8]   # top-k of the trace being run (set by run())


def make_policy(spec: str, prior: np.ndarray | None = None) -> Callable[[int, int], Policy]:
    """The simulator's policy of spec, per (layer index, slots): 'lru',
    'lrfu' and 'cooc' (the store's, written out again), 'cooc:H/prior=P/m=F',
    'arc', 'slru[:F]', or 'crf:H', 'crf-rank:H', 'crf-router:H' followed by
    options '/noghost' (forget the count of an evicted expert) and '/pop=G'
    (bias each expert's count by its popularity in the usage history
    ``prior``, an (L, E) array of counts: times ((count + 1) / (mean count
    + 1)) ** G)."""
    head, *opts = spec.split("/")
    name, _, arg = head.partition(":")
    ghost = "noghost" not in opts
    pop = 0.0
    for o in opts:
        if o.startswith("pop="):
            pop = float(o[4:])
    if name == "lru":
        return lambda li, s: LRU()
    if name == "lrfu":
        return lambda li, s: CLrfu(s)
    if name == "cooc":
        # options: /prior=P (weight of the overall share), /m=F (candidates: F x slots)
        kw = {}
        for o in opts:
            if o.startswith("prior="):
                kw["prior"] = float(o[6:])
            elif o.startswith("m="):
                kw["fraction"] = float(o[2:])
        return lambda li, s: CCooc(s, int(arg) if arg else 64, **kw)
    if name == "arc":
        return lambda li, s: ARC(s)
    if name == "slru":
        return lambda li, s: SLRU(s, float(arg) if arg else 0.5)
    weight = {"crf": one, "crf-router": router_weight, "crf-rank": rank_weight}[name]
    def mk(li: int, s: int) -> Policy:
        # H in requests: 'N' tokens of k requests, or 'Nt': N times the slots
        h = float(arg[:-1]) * s if arg.endswith("t") else float(arg) * K[0]
        bias = None
        if pop and prior is not None:
            c = prior[li]
            bias = pop * np.log2((c + 1.0) / (c.mean() + 1.0))
        return LRFU(h, weight, bias, ghost)
    return mk


def usage_prior(trace: Trace, half_life: float) -> np.ndarray:
    """Decayed counts (L, E) at the end of ``trace``, each use adding 1 —
    what a usage history holds."""
    T, L, k = trace.experts.shape
    out = np.zeros((L, trace.num_experts))
    decay = 2.0 ** (-1.0 / half_life)
    for t in range(T):
        out *= decay
        for li in range(L):
            row = trace.experts[t, li]
            out[li, np.unique(row[row >= 0])] += 1.0
    return out


# -------------------------------------------------------------------- study --

def splits(trace: Trace) -> list[tuple[Trace, Trace]]:
    """(train, eval) pairs on disjoint sequences: halves, both ways."""
    seqs = np.unique(trace.sequence)
    half = seqs[: max(1, len(seqs) // 2)]
    a = np.isin(trace.sequence, half)
    A = trace.select(a, trace.name + "[first half]")
    B = trace.select(~a, trace.name + "[second half]")
    return [(A, B), (B, A)]


DEFAULT_POLICIES = "lru,lrfu,cooc,crf:16,crf-router:2t,crf-rank:2t/pop=0.5,arc,slru,belady"


def budgets_for(trace: Trace, budgets: Sequence[float]) -> list[float]:
    """The budgets asked, less those that leave no choice (slots <= k: every
    token replaces the whole layer) plus, for such small layers, the
    fractions between 25% and 75% where a choice exists."""
    k = trace.experts.shape[2]
    out = [b for b in budgets if slots_for(b, trace.num_experts, k) > k]
    if len(out) < len(budgets):
        extra = [b for b in (0.375, 0.625, 0.75) if slots_for(b, trace.num_experts, k) > k]
        out = sorted(set(out) | set(extra))
    return out


def evaluate(cases, pols: Sequence[str], budgets: Sequence[float], show) -> list[dict]:
    rows = []
    for ev, tr in cases:
        prior = usage_prior(tr, 1e9) if tr is not None else None
        show(f"\n**{ev.name}** ({ev.experts.shape[0]} tokens x {ev.experts.shape[1]} layers, "
             f"{ev.num_experts} experts, top-{ev.experts.shape[2]}; history: "
             f"{tr.name if tr is not None else 'none'})\n")
        others = [p for p in pols if p not in ("lru", "belady")]
        show("| budget | slots | LRU | Belady | " + " | ".join(others) + " |")
        show("|---" * (4 + len(others)) + "|")
        for b in budgets_for(ev, budgets):
            res = {p: run(ev, b, p, prior) for p in pols}
            lo, hi = res["lru"], res["belady"]
            cells = []
            for p in others:
                gap = f", {100 * (res[p] - lo) / (hi - lo):+.0f}% of gap" if hi > lo else ""
                cells.append(f"{100 * res[p]:.2f} ({100 * (res[p] - lo):+.2f}{gap})")
            slots = slots_for(b, ev.num_experts, ev.experts.shape[2])
            show(f"| {100 * b:g}% | {slots} | {100 * lo:.2f} | {100 * hi:.2f} | " + " | ".join(cells) + " |")
            rows.append({"trace": ev.name, "budget": b, **res})
    return rows


def select_half_life(cases, budgets: Sequence[float], show) -> None:
    """Held-out check of the one constant of lrfu: the half-life, as a
    multiple N of the layer's slots (in requests), chosen on each training
    part alone (best mean share of the gap closed over the budgets), then
    measured on the parts it did not see, including the other model."""
    grid = [0.5, 1, 2, 4, 8]
    show("\n| chosen on | N chosen | held-out part | budget | LRU | Belady | crf-rank:Nt | share of gap |")
    show("|---|---|---|---|---|---|---|---|")
    parts = [tr for _, tr in cases]
    score: dict[tuple[str, float], float] = {}

    def closed(t: Trace, n: float, b: float) -> tuple[float, float, float, float]:
        lo = run(t, b, "lru")
        hi = run(t, b, "belady")
        r = run(t, b, f"crf-rank:{n}t")
        return lo, hi, r, (r - lo) / (hi - lo) if hi > lo else 0.0

    for tr in parts:
        for n in grid:
            score[(tr.name, n)] = float(np.mean([closed(tr, n, b)[3] for b in budgets_for(tr, budgets)]))
    for tr in parts:
        best = max(grid, key=lambda n: score[(tr.name, n)])
        for ev in parts:
            if ev.name == tr.name:
                continue
            for b in budgets_for(ev, budgets):
                lo, hi, r, g = closed(ev, best, b)
                show(f"| {tr.name} | {best:g} | {ev.name} | {100 * b:g}% | {100 * lo:.2f} | {100 * hi:.2f} | "
                     f"{100 * r:.2f} | {100 * g:+.0f}% |")


COOC_VARIANTS = ["cooc:32", "cooc:128", "cooc/prior=0.25", "cooc/prior=4", "cooc/m=0.375", "cooc/m=0.625"]


def cooc_sensitivity(cases, budgets: Sequence[float], show) -> None:
    """cooc's constants one at a time (half-life 32 / 64 / 128 lookups,
    prior 0.25 / 1 / 4, candidates 0.375 / 0.5 / 0.625 of the slots): the
    share of the LRU-to-Belady gap each closes on the real evaluation parts."""
    pols = ["cooc"] + COOC_VARIANTS
    show("\n| evaluated part | budget | " + " | ".join(pols) + " | spread |")
    show("|---" * (len(pols) + 3) + "|")
    for ev, _ in cases:
        for b in budgets_for(ev, budgets):
            lo = run(ev, b, "lru")
            hi = run(ev, b, "belady")
            shares = [(run(ev, b, p) - lo) / (hi - lo) if hi > lo else 0.0 for p in pols]
            show(f"| {ev.name} | {100 * b:g}% | " + " | ".join(f"{100 * g:+.1f}%" for g in shares)
                 + f" | {100 * (max(shares) - min(shares)):.1f} |")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one synthetic seed, no half-life check")
    ap.add_argument("--policies", default=DEFAULT_POLICIES)
    ap.add_argument("--budgets", default="0.125,0.25,0.5")
    ap.add_argument("--traces", default="real,synthetic")
    args = ap.parse_args(argv)
    pols = args.policies.split(",")
    for must in ("lru", "belady"):
        if must not in pols:
            pols.insert(0, must)
    budgets = [float(b) for b in args.budgets.split(",")]
    show = lambda line: print(line, flush=True)  # noqa: E731
    t0 = time.time()
    real: list[tuple[Trace, Trace]] = []
    if "real" in args.traces:
        for f in ["qwen3.6-35b-a3b-fever.npz", "mixtral-8x7b-humaneval.npz"]:
            t = load_trace(find_trace(f))
            real += [(ev, tr) for tr, ev in splits(t)]
    synth: list[tuple[Trace, Trace]] = []
    if "synthetic" in args.traces:
        for s in ([1] if args.quick else [1, 2]):
            for z, drift in [(1.0, 0), (0.0, 0), (1.0, 24)]:
                synth.append((synthetic(s, zipf=z, drift_every=drift),
                              synthetic(1000 + s, zipf=z, drift_every=drift)))
    show("## Hit rates (%), per policy: hit rate (points vs LRU, share of the LRU-to-Belady gap closed)")
    evaluate(real + synth, pols, budgets, show)
    if real and not args.quick:
        show("\n## lrfu's half-life chosen on one part, measured on the others")
        select_half_life(real, budgets, show)
        show("\n## cooc's constants, one at a time: share of the LRU-to-Belady gap closed")
        cooc_sensitivity(real, budgets, show)
    show(f"\n({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
