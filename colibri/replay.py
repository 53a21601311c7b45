"""Replay a routing trace through the store, and Belady's offline optimum.

:func:`replay` feeds a :class:`colibri.Trace` to the same C code a live store
runs, in a mode that reads no bytes and allocates no slot memory: for every
token and every layer, one ``lease_many`` of that layer's distinct experts
(in the order the trace lists them, -1 pads dropped), all released before the
next, with prefetch off. Its counters are those a live store fed the same
sequence would show.

:func:`belady` gives the best any cache can do under the same per-layer slot
budgets and the same rule (a token's experts of a layer are resident
together, loads happen only on demand): at each miss it evicts, among the
resident experts the current token does not use, the one used again furthest
in the future. With a set of k experts per step that must be resident
together and every load costing the same, this is still exactly optimal in
misses (the exchange argument of Belady's proof goes through step by step:
an optimal schedule that evicts y instead of the furthest x can evict x and
keep y at no extra cost, because y is needed no later than x and nothing the
step needs is ever a candidate). tests/test_replay.py checks it against a
brute-force optimum over every schedule on small traces.

:func:`batched` turns a trace into the lease_many calls of a server that
decodes its sequences several at a time (one lease of the union of the
batch's experts per step and layer, in groups that fit the slots); replay
and belady then answer what batching does to a cache on that routing.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Union

import numpy as np

from colibri.errors import FormatError
from colibri.store import open_replay_store
from colibri.trace import Trace
from colibri.usage import Usage, warm_order

__all__ = ["replay", "belady", "batched", "BATCH_ORDERS", "ReplayResult", "LayerResult", "resolve_slots",
           "SlotsSpec", "distinct_rows", "most_distinct"]

SlotsSpec = Union[int, Mapping[int, int]]


@dataclass(frozen=True)
class LayerResult:
    """Counters of one layer's replay."""

    slots: int
    requests: int
    hits: int
    misses: int
    evictions: int
    persistent_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class ReplayResult:
    """What a replay (or :func:`belady`) counted, in total and per layer
    (``per_layer`` keyed by the model's layer index). ``persistent_hits``
    are hits on pinned experts; ``hits - persistent_hits`` are the cache's."""

    policy: str
    hits: int
    misses: int
    requests: int
    evictions: int
    persistent_hits: int
    per_layer: Mapping[int, LayerResult] = field(repr=False)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def slots(self) -> dict[int, int]:
        """Slots per layer the replay ran with."""
        return {layer: r.slots for layer, r in self.per_layer.items()}

    @classmethod
    def from_layers(cls, policy: str, per_layer: Mapping[int, LayerResult]) -> "ReplayResult":
        rows = list(per_layer.values())
        return cls(
            policy=policy,
            hits=sum(r.hits for r in rows),
            misses=sum(r.misses for r in rows),
            requests=sum(r.requests for r in rows),
            evictions=sum(r.evictions for r in rows),
            persistent_hits=sum(r.persistent_hits for r in rows),
            per_layer=MappingProxyType(dict(per_layer)),
        )


def distinct_rows(trace: Trace, column: int) -> list[tuple[int, ...]]:
    """Each token's distinct experts of one layer column, first occurrence first."""
    out: list[tuple[int, ...]] = []
    for row in trace.experts[:, column, :].tolist():
        out.append(tuple(dict.fromkeys(e for e in row if e >= 0)))
    return out


def resolve_slots(trace: Trace, slots_per_layer: SlotsSpec) -> dict[int, int]:
    """Slots of every layer of ``trace``: an int for all of them or a mapping
    from layer to slots covering each layer; capped at ``num_experts``. A
    layer whose slots cannot hold one token's distinct experts is a
    FormatError (lease_many would find the cache full)."""
    layers = trace.layers.tolist()
    if isinstance(slots_per_layer, Mapping):
        missing = [l for l in layers if l not in slots_per_layer]
        if missing:
            raise FormatError(f"slots_per_layer has no entry for layers {missing}")
        raw = {l: slots_per_layer[l] for l in layers}
    else:
        raw = {l: slots_per_layer for l in layers}
    out: dict[int, int] = {}
    widest = most_distinct(trace)
    for i, layer in enumerate(layers):
        value = raw[layer]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise FormatError(f"slots of layer {layer} must be an int, not {type(value).__name__}")
        n = min(int(value), trace.num_experts)
        if n < max(widest[i], 1):
            raise FormatError(
                f"layer {layer}: {int(value)} slots cannot hold a token's {widest[i]} distinct experts"
            )
        out[layer] = n
    return out


def most_distinct(trace: Trace) -> list[int]:
    """Per layer column, the most distinct experts one token asks of it."""
    e = np.sort(trace.experts, axis=2)
    distinct = (e >= 0) & np.concatenate(
        [np.ones(e.shape[:2] + (1,), dtype=bool), e[:, :, 1:] != e[:, :, :-1]], axis=2
    )
    per = distinct.sum(axis=2)
    return per.max(axis=0).tolist() if len(trace) else [0] * len(trace.layers)


def _pins_by_layer(trace: Trace, pinned: Iterable[tuple[int, int]] | None) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {layer: [] for layer in trace.layers.tolist()}
    for key in pinned or ():
        layer, expert = operator.index(key[0]), operator.index(key[1])
        if layer not in out or not 0 <= expert < trace.num_experts:
            raise FormatError(f"pinned expert ({layer}, {expert}) is not in the trace's model")
        if expert not in out[layer]:
            out[layer].append(expert)
    return out


def replay(
    trace: Trace,
    *,
    slots_per_layer: SlotsSpec,
    policy: str = "lru",
    pinned: Iterable[tuple[int, int]] | None = None,
    usage: Any = None,
) -> ReplayResult:
    """Replay ``trace`` through the store's C code with these per-layer
    budgets, eviction ``policy`` and ``pinned`` experts (a list of
    ``(layer, expert)``, each taking one slot of its layer). ``usage`` (a
    :class:`colibri.Usage`, or a Trace whose counts stand for one) is the
    history a store opened with ``usage_file`` and ``warm_start=True``
    would have: each layer's unpinned slots start with its hottest experts
    that are not pinned, the hottest the most recent, loaded for free
    before the first token (compare with ``belady(..., warm=True)``)."""
    slots = resolve_slots(trace, slots_per_layer)
    pins = _pins_by_layer(trace, pinned)
    for layer, experts in pins.items():
        if len(experts) >= slots[layer]:
            raise FormatError(
                f"layer {layer}: {len(experts)} pinned experts leave no slot of its {slots[layer]} for the rest"
            )
    warm = _warm_from(usage, trace, slots, pins) if usage is not None else []
    layers = trace.layers.tolist()
    pin_list = [(layer, e) for layer in layers for e in pins[layer]]
    store = open_replay_store({layer: trace.num_experts for layer in layers}, slots_per_layer=slots,
                              policy=policy, pin=pin_list or None, warm=warm or None)
    try:
        store.replay_tokens(trace.layers, trace.experts)
        per = {}
        for layer in layers:
            st = store.layer_stats(layer)
            per[layer] = LayerResult(
                slots=slots[layer], requests=st.requests, hits=st.hits, misses=st.misses,
                evictions=st.evictions, persistent_hits=st.persistent_hits,
            )
    finally:
        store.close()
    return ReplayResult.from_layers(policy, per)


def _warm_from(usage: Any, trace: Trace, slots: dict[int, int],
               pins: dict[int, list[int]]) -> list[tuple[int, int]]:
    """What ``warm_start`` would load from this history: each layer's
    hottest unpinned experts, as many as its unpinned slots, hottest last."""
    if isinstance(usage, Trace):
        usage = Usage.from_trace(usage)
    if not isinstance(usage, Usage):
        raise FormatError(f"usage must be a colibri.Usage or a colibri.Trace, not {type(usage).__name__}")
    for layer in trace.layers.tolist():
        if layer not in usage.layers or usage.num_experts(layer) != trace.num_experts:
            raise FormatError(f"usage: its layer {layer} does not match the trace's "
                              f"({trace.num_experts} experts)")
    room = {layer: slots[layer] - len(pins[layer]) for layer in slots}
    return warm_order(usage, room, [(layer, e) for layer in pins for e in pins[layer]])


def belady(trace: Trace, slots_per_layer: SlotsSpec, *, warm: bool = False) -> ReplayResult:
    """The fewest misses any cache can have on ``trace`` under these
    per-layer slot budgets, with lease_many semantics (each token's experts
    of a layer resident together; loads on demand only).

    It starts empty, like a store without pins (it may keep any expert as
    long as it likes, so it bounds every eviction policy). ``warm=True``
    lets it fill every slot for free before the first token, with the
    experts used soonest (the best such choice): that bounds configurations
    whose pinned experts are loaded before they are asked for, too."""
    slots = resolve_slots(trace, slots_per_layer)
    per: dict[int, LayerResult] = {}
    for col, layer in enumerate(trace.layers.tolist()):
        per[layer] = _belady_layer(distinct_rows(trace, col), slots[layer], trace.num_experts, warm)
    return ReplayResult.from_layers("belady-warm" if warm else "belady", per)


def _belady_layer(rows: list[tuple[int, ...]], capacity: int, num_experts: int, warm: bool) -> LayerResult:
    n = len(rows)
    never = n + 1
    # next_at[t][j]: the next step after t that asks for rows[t][j]
    next_at: list[list[int]] = [[] for _ in range(n)]
    upcoming = [never] * num_experts
    for t in range(n - 1, -1, -1):
        next_at[t] = [upcoming[e] for e in rows[t]]
        for e in rows[t]:
            upcoming[e] = t
    nxt = [never] * num_experts  # next use of each resident expert
    resident: set[int] = set()
    heap: list[tuple[int, int]] = []  # (-next use, expert), stale entries skipped
    if warm:  # free fill: the experts whose first use comes soonest
        first = sorted((u, e) for e, u in enumerate(upcoming) if u != never)[:capacity]
        for u, e in first:
            resident.add(e)
            nxt[e] = u
            heap.append((-u, e))
        heapq.heapify(heap)
    hits = misses = evictions = 0
    for t, row in enumerate(rows):
        missing = [e for e in row if e not in resident]
        hits += len(row) - len(missing)
        misses += len(missing)
        over = len(resident) + len(missing) - capacity
        while over > 0:
            neg, victim = heapq.heappop(heap)
            if victim in resident and nxt[victim] == -neg and -neg > t:
                resident.discard(victim)
                evictions += 1
                over -= 1
        for e, after in zip(row, next_at[t]):
            resident.add(e)
            nxt[e] = after
            heapq.heappush(heap, (-after, e))
    return LayerResult(capacity, hits + misses, hits, misses, evictions, 0)


#: Orders :func:`batched` can lease a step's union in.
BATCH_ORDERS = ("id", "shared-first")


def batched(
    trace: Trace,
    batch: int,
    *,
    slots_per_layer: SlotsSpec | None = None,
    order: str = "id",
    sequences: Iterable[int] | None = None,
) -> Trace:
    """The lease_many calls of a server that decodes ``trace``'s sequences
    ``batch`` at a time, as a trace whose rows are those calls.

    The sequences (``sequences``: their ids in the order they arrive;
    default the trace's order) are taken ``batch`` at a time. The members of
    a batch start together and decode in lockstep, one token each per step,
    until the last one ends (one that ends sooner leaves). Each step leases,
    per layer, the union of the members' experts once, in groups of at most
    that layer's slots (``slots_per_layer`` as :func:`replay` takes it;
    None: one group), all released before the next: one row of the result
    per group, a layer that needs fewer groups than another padded with -1
    there (replay and belady skip an empty row). With sequences of equal
    length this is also what continuous batching with a full queue does.

    ``order`` is the order of the union, and so of the groups: ``"id"``,
    ascending expert id; ``"shared-first"``, the experts more members chose
    first, then the better ranked (the sum over members of 1 / (1 + rank),
    rank being the place in the member's row, best first), then by id.

    The result's ``sequence`` numbers the batches 0, 1, ... in order (so
    ``select_sequences([g])`` is batch g alone, e.g. to replay it from a cold
    cache); it has no weights. Its requests are the leases; the tokens
    decoded are those of the sequences taken, ``len(trace.select_sequences(...))``.
    """
    batch = operator.index(batch)
    if batch < 1:
        raise FormatError(f"batch must be >= 1, got {batch}")
    if order not in BATCH_ORDERS:
        raise FormatError(f"unknown order {order!r}; batched knows {', '.join(BATCH_ORDERS)}")
    known = trace.sequences
    chosen = list(known) if sequences is None else [operator.index(s) for s in sequences]
    if len(set(chosen)) != len(chosen) or not set(chosen) <= set(known):
        raise FormatError(f"sequences must be distinct ids of the trace's sequences {list(known)}")
    layers = trace.layers.tolist()
    if slots_per_layer is None:
        slots = [trace.num_experts] * len(layers)
    else:
        by_layer = resolve_slots(trace, slots_per_layer)
        slots = [by_layer[layer] for layer in layers]
    tokens = {s: np.flatnonzero(trace.sequence == s) for s in chosen}
    rows: list[list[tuple[int, ...]]] = []
    ids: list[int] = []
    for g, start in enumerate(range(0, len(chosen), batch)):
        members = [tokens[s] for s in chosen[start:start + batch]]
        for p in range(max(len(m) for m in members)):
            step = trace.experts[[int(m[p]) for m in members if p < len(m)]]
            groups = [_step_groups(step[:, i, :], slots[i], order) for i in range(len(layers))]
            for r in range(max(len(gr) for gr in groups)):
                rows.append([gr[r] if r < len(gr) else () for gr in groups])
                ids.append(g)
    width = max((len(c) for row in rows for c in row), default=1)
    experts = np.full((len(rows), len(layers), max(width, 1)), -1, dtype=np.int32)
    for t, row in enumerate(rows):
        for i, chunk in enumerate(row):
            experts[t, i, :len(chunk)] = chunk
    return Trace.from_arrays(trace.layers, experts, None, np.asarray(ids, dtype=np.int32), trace.num_experts)


def _step_groups(chosen: np.ndarray, slots: int, order: str) -> list[tuple[int, ...]]:
    """One layer of one batched step: the union of the members' rows
    (``chosen``, members x k, -1 pads) in ``order``, in groups of ``slots``."""
    votes: dict[int, int] = {}
    weight: dict[int, float] = {}
    for row in chosen.tolist():
        for rank, e in enumerate(dict.fromkeys(e for e in row if e >= 0)):
            votes[e] = votes.get(e, 0) + 1
            weight[e] = weight.get(e, 0.0) + 1.0 / (1 + rank)
    union = sorted(votes)
    if order == "shared-first":
        union.sort(key=lambda e: (-votes[e], -weight[e]))   # stable: ties stay by id
    return [tuple(union[i:i + slots]) for i in range(0, len(union), slots)]
