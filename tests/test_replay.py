"""Replay through the store and Belady's optimum.

- replay's counters equal a live store's fed the same lease_many sequence
  (random traces and the real ones);
- Belady equals a brute-force optimum over every demand schedule on tiny
  traces, and no replayed configuration ever beats it.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import colibri
from colibri import FormatError, Trace
from colibri.replay import batched, belady, distinct_rows, replay, resolve_slots
from colibri.synthetic import write_synthetic_model

DATA = Path(__file__).resolve().parent / "data" / "traces"
REAL = {p.stem: p for p in sorted(DATA.glob("*.npz"))}


def random_trace(rng: np.random.Generator, tokens: int, layers: list[int], experts: int, k: int,
                 skew: float = 1.0) -> Trace:
    """Zipf-ish popularity so that caches both hit and miss; rows may hold -1 pads."""
    p = 1.0 / np.arange(1, experts + 1) ** skew
    p /= p.sum()
    e = np.full((tokens, len(layers), k), -1, dtype=np.int32)
    for t in range(tokens):
        for i in range(len(layers)):
            width = rng.integers(1, k + 1) if rng.random() < 0.2 else k
            e[t, i, :width] = rng.choice(experts, size=width, replace=False, p=p)
    return Trace.from_arrays(layers, e, None, None, experts)


# -- brute force ------------------------------------------------------------


def brute_force_misses(rows: list[tuple[int, ...]], capacity: int) -> int:
    """Fewest misses over every schedule: after each step the cache may be any
    set holding the step's experts, within capacity, drawn from what was
    resident plus what the step loaded (loads only on demand)."""
    best: dict[frozenset[int], int] = {frozenset(): 0}
    for row in rows:
        need = frozenset(row)
        nxt: dict[frozenset[int], int] = {}
        for cache, cost in best.items():
            paid = cost + len(need - cache)
            extra = sorted(cache - need)
            room = capacity - len(need)
            for r in range(0, min(room, len(extra)) + 1):
                for keep in itertools.combinations(extra, r):
                    state = need | frozenset(keep)
                    if nxt.get(state, 1 << 30) > paid:
                        nxt[state] = paid
        best = nxt
    return min(best.values())


@given(seed=st.integers(0, 2**32 - 1), tokens=st.integers(1, 9), experts=st.integers(2, 6),
       k=st.integers(1, 3), extra=st.integers(0, 2))
def test_belady_equals_brute_force_on_tiny_traces(seed, tokens, experts, k, extra):
    k = min(k, experts)
    capacity = min(k + extra, experts)
    t = random_trace(np.random.default_rng(seed), tokens, [0], experts, k, skew=0.5)
    rows = [tuple(dict.fromkeys(e for e in r if e >= 0)) for r in t.experts[:, 0, :].tolist()]
    got = belady(t, capacity)
    assert got.misses == brute_force_misses(rows, capacity)
    assert got.hits + got.misses == got.requests == sum(len(r) for r in rows)


def brute_force_warm(rows, capacity, experts):
    """Like brute_force_misses, but free to start from any set of experts."""
    return min(brute_force_misses([start] + rows, capacity) - len(start)
               for r in range(capacity + 1) for start in itertools.combinations(range(experts), r))


@settings(max_examples=20)
@given(seed=st.integers(0, 2**32 - 1), tokens=st.integers(1, 7), experts=st.integers(2, 5),
       k=st.integers(1, 2), extra=st.integers(0, 2))
def test_warm_belady_equals_brute_force_from_the_best_start(seed, tokens, experts, k, extra):
    k = min(k, experts)
    capacity = min(k + extra, experts)
    t = random_trace(np.random.default_rng(seed), tokens, [0], experts, k, skew=0.5)
    rows = [tuple(dict.fromkeys(e for e in r if e >= 0)) for r in t.experts[:, 0, :].tolist()]
    assert belady(t, capacity, warm=True).misses == brute_force_warm(rows, capacity, experts)


def test_flattened_belady_would_not_be_a_valid_bound():
    """Why lease_many semantics matter: with 2 slots and steps {a,b} {c,d} {a,b},
    paging one request at a time could keep a across {c,d} (5 misses), which a
    cache that must hold c and d together cannot (6)."""
    t = Trace.from_arrays([0], [[[0, 1]], [[2, 3]], [[0, 1]]], num_experts=4)
    assert belady(t, 2).misses == 6 == brute_force_misses([(0, 1), (2, 3), (0, 1)], 2)


# -- replay against a live store -------------------------------------------


def live_replay(model_path, trace: Trace, slots, policy: str = "lru", pinned=None) -> dict:
    """Counters of a live store that leases each token's distinct experts of
    each layer with one lease_many and releases them before the next."""
    kwargs: dict = dict(slots_per_layer=slots, prefetch_workers=0)
    if policy != "lru":
        kwargs["policy"] = policy
    if pinned:
        kwargs["pin"] = list(pinned)
    with colibri.open_store(model_path, **kwargs) as store:
        if pinned:
            store.wait_idle(timeout=30)
        layers = trace.layers.tolist()
        for token in trace.experts.tolist():
            for layer, row in zip(layers, token):
                distinct = list(dict.fromkeys(e for e in row if e >= 0))
                if distinct:
                    with store.lease_many(layer, distinct):
                        pass
        total = store.stats()
        per = {l: store.layer_stats(l) for l in layers}
    return {"total": total, "per": per}


def assert_same_counters(result, live) -> None:
    total = live["total"]
    persistent = total.persistent_hits
    assert (result.hits, result.misses, result.requests, result.evictions, result.persistent_hits) == (
        total.hits, total.misses, total.requests, total.evictions, persistent)
    for layer, st_ in live["per"].items():
        r = result.per_layer[layer]
        assert (r.hits, r.misses, r.requests, r.evictions) == (st_.hits, st_.misses, st_.requests,
                                                               st_.evictions), layer


@pytest.fixture(scope="module")
def replay_model(tmp_path_factory):
    """MoE layers 1..3 x 7 experts, tiny tensors."""
    return write_synthetic_model(tmp_path_factory.mktemp("rm"), layout="mlp_experts", n_layers=4,
                                 n_experts=7, hidden=8, intermediate=4, dense_layers=1)


@settings(max_examples=25)
@given(seed=st.integers(0, 2**32 - 1), tokens=st.integers(0, 40), k=st.integers(1, 3),
       extra=st.integers(0, 4), mapped=st.booleans(), n_pins=st.integers(0, 2))
def test_replay_counters_equal_a_live_store(replay_model, seed, tokens, k, extra, mapped, n_pins):
    rng = np.random.default_rng(seed)
    t = random_trace(rng, tokens, [1, 2, 3], 7, k)
    slots = {l: min(7, k + int(rng.integers(0, extra + 1))) for l in (1, 2, 3)} if mapped else k + extra
    least = min(slots.values()) if isinstance(slots, dict) else slots
    pins = None
    if 0 < n_pins and least - n_pins >= k:
        pins = [(l, int(e)) for l in (1, 2, 3) for e in rng.choice(7, size=n_pins, replace=False)]
    for policy in colibri.POLICIES:
        got = replay(t, slots_per_layer=slots, policy=policy, pinned=pins)
        assert_same_counters(got, live_replay(replay_model.path, t, slots, policy, pins))
        assert got.hits + got.misses == got.requests
        assert got.misses >= belady(t, slots, warm=pins is not None).misses


@pytest.fixture(scope="module")
def real_models(tmp_path_factory):
    """Synthetic checkpoints shaped like the real traces' models (tiny tensors)."""
    out = {}
    for name, path in REAL.items():
        t = Trace.load(path)
        out[name] = write_synthetic_model(
            tmp_path_factory.mktemp(name[:8]), layout="mlp_experts", n_layers=len(t.layers),
            n_experts=t.num_experts, hidden=4, intermediate=2,
        )
    return out


@pytest.mark.parametrize("name", sorted(REAL))
def test_replay_of_real_traces_equals_a_live_store(real_models, name):
    t = Trace.load(REAL[name])
    assert t.layers.tolist() == list(range(len(t.layers)))  # the synthetic model's layer numbers
    for frac in (0.125, 0.5):
        slots = max(t.top_k, int(t.num_experts * frac))
        for policy in colibri.POLICIES:
            got = replay(t, slots_per_layer=slots, policy=policy)
            assert_same_counters(got, live_replay(real_models[name].path, t, slots, policy))


@pytest.mark.parametrize("name", sorted(REAL))
def test_belady_bounds_every_policy_on_real_traces(name):
    t = Trace.load(REAL[name])
    for frac in (0.125, 0.25, 0.5):
        slots = max(t.top_k, int(t.num_experts * frac))
        best = belady(t, slots)
        assert best.requests == t.requests
        for policy in colibri.POLICIES:
            got = replay(t, slots_per_layer=slots, policy=policy)
            assert got.requests == best.requests
            assert got.hits <= best.hits, (policy, frac)
            for layer, r in got.per_layer.items():
                assert r.hits <= best.per_layer[layer].hits
        # pinning the hottest experts is one more non-clairvoyant configuration
        counts = t.counts()
        pins = [(l, int(e)) for l, c in counts.items() for e in np.argsort(-c, kind="stable")[: slots // 4]]
        warm = belady(t, slots, warm=True)
        assert warm.hits >= best.hits
        if slots // 4:  # pins are loaded before they are asked for: bounded by the warm optimum
            assert replay(t, slots_per_layer=slots, pinned=pins).hits <= warm.hits


@settings(max_examples=40)
@given(seed=st.integers(0, 2**32 - 1), tokens=st.integers(1, 60), k=st.integers(1, 4),
       extra=st.integers(0, 6), pins=st.integers(0, 3))
def test_belady_bounds_every_policy_on_random_traces(seed, tokens, k, extra, pins):
    rng = np.random.default_rng(seed)
    t = random_trace(rng, tokens, [0, 5], 10, k)
    slots = k + extra
    best = belady(t, slots)
    for policy in colibri.POLICIES:
        assert replay(t, slots_per_layer=slots, policy=policy).hits <= best.hits
    if 0 < pins < slots - k + 1:
        hot = [(l, e) for l in (0, 5) for e in range(pins)]
        assert replay(t, slots_per_layer=slots, pinned=hot).hits <= belady(t, slots, warm=True).hits


def test_per_layer_budgets_and_results():
    t = random_trace(np.random.default_rng(3), 50, [2, 7], 8, 2)
    r = belady(t, {2: 2, 7: 8})
    assert r.slots == {2: 2, 7: 8}
    assert r.per_layer[7].misses == len(np.unique(t.layer_experts(7)[t.layer_experts(7) >= 0]))
    assert r.per_layer[7].evictions == 0
    assert r.hit_rate == r.hits / r.requests


@pytest.mark.parametrize(
    "slots, match",
    [({2: 3}, "no entry"), (1, "cannot hold"), ({2: 3, 7: 1}, "cannot hold"), (2.5, "must be an int")],
)
def test_bad_budgets_are_format_errors(slots, match):
    t = random_trace(np.random.default_rng(0), 5, [2, 7], 8, 2)
    with pytest.raises(FormatError, match=match):
        resolve_slots(t, slots)
    with pytest.raises(FormatError, match=match):
        belady(t, slots)


def test_pins_must_leave_room():
    t = random_trace(np.random.default_rng(0), 5, [2], 8, 2)
    with pytest.raises(FormatError, match="pinned"):
        replay(t, slots_per_layer=3, pinned=[(2, 0), (2, 1), (2, 2)])
    with pytest.raises(FormatError, match="not in the trace"):
        replay(t, slots_per_layer=3, pinned=[(3, 0)])


# -- batched decoding ------------------------------------------------------


def with_sequences(t: Trace, lengths: list[int]) -> Trace:
    """``t``'s tokens cut into sequences of these lengths (ids 10, 11, ...: not 0-based on purpose)."""
    ids = np.repeat(np.arange(10, 10 + len(lengths)), lengths)
    return Trace.from_arrays(t.layers, t.experts[:len(ids)], None, ids, t.num_experts)


def per_layer_leases(t: Trace) -> dict[int, list[tuple[int, ...]]]:
    """Each layer's lease_many calls in order (a row of -1 is no call)."""
    return {layer: [r for r in distinct_rows(t, i) if r] for i, layer in enumerate(t.layers.tolist())}


def expected_leases(t: Trace, batch: int, slots: int, arrival: list[int]) -> dict[int, list[tuple[int, ...]]]:
    """What a server decoding ``batch`` sequences in lockstep leases, per layer:
    for each batch and step, the union of the members' experts, ascending, in
    groups of ``slots``."""
    out: dict[int, list[tuple[int, ...]]] = {layer: [] for layer in t.layers.tolist()}
    rows = [np.flatnonzero(t.sequence == s) for s in arrival]
    for start in range(0, len(rows), batch):
        members = rows[start:start + batch]
        for p in range(max(len(m) for m in members)):
            for i, layer in enumerate(t.layers.tolist()):
                union = sorted({int(e) for m in members if p < len(m) for e in t.experts[m[p], i] if e >= 0})
                out[layer] += [tuple(union[j:j + slots]) for j in range(0, len(union), slots)]
    return out


@settings(max_examples=60)
@given(seed=st.integers(0, 2**32 - 1), lengths=st.lists(st.integers(1, 6), min_size=1, max_size=7),
       batch=st.integers(1, 4), k=st.integers(1, 3), extra=st.integers(0, 5), shuffle=st.booleans())
def test_batched_leases_each_steps_union_once_in_slot_groups(seed, lengths, batch, k, extra, shuffle):
    rng = np.random.default_rng(seed)
    t = with_sequences(random_trace(rng, sum(lengths), [1, 4], 9, k), lengths)
    arrival = list(t.sequences)
    if shuffle:
        rng.shuffle(arrival)
    slots = k + extra
    b = batched(t, batch, slots_per_layer=slots, sequences=arrival)
    assert per_layer_leases(b) == expected_leases(t, batch, slots, arrival)
    assert list(b.sequence) == sorted(b.sequence) and set(b.sequence) == set(range(-(-len(lengths) // batch)))
    assert b.requests <= t.requests            # a shared expert is leased once per step
    assert belady(b, slots).misses >= 0 and replay(b, slots_per_layer=slots).requests == b.requests
    if batch == 1 and not shuffle:             # one at a time: each token's own experts, and the same optimum
        assert b.requests == t.requests and belady(b, slots).misses == belady(t, slots).misses


def test_batched_members_leave_when_they_end():
    e = [[[0, 1]], [[2, 3]], [[4, 5]], [[1, 6]]]    # sequence 0: tokens 0-2; sequence 1: token 3
    t = Trace.from_arrays([0], e, None, [0, 0, 0, 1], 8)
    assert per_layer_leases(batched(t, 2)) == {0: [(0, 1, 6), (2, 3), (4, 5)]}
    assert per_layer_leases(batched(t, 2, sequences=[1, 0])) == {0: [(0, 1, 6), (2, 3), (4, 5)]}
    assert per_layer_leases(batched(t, 1, sequences=[1, 0])) == {0: [(1, 6), (0, 1), (2, 3), (4, 5)]}
    assert batched(t, 1).sequence.tolist() == [0, 0, 0, 1]


def test_batched_shared_first_orders_by_votes_then_rank():
    # step 0: 1 is chosen by both sequences; 3 is ranked first by one, 2 second by the other
    t = Trace.from_arrays([0], [[[3, 1]], [[1, 2]]], None, [0, 1], 4)
    assert per_layer_leases(batched(t, 2)) == {0: [(1, 2, 3)]}
    assert per_layer_leases(batched(t, 2, order="shared-first")) == {0: [(1, 3, 2)]}
    assert per_layer_leases(batched(t, 2, slots_per_layer=2, order="shared-first")) == {0: [(1, 3), (2,)]}
    assert per_layer_leases(batched(t, 2, slots_per_layer=2)) == {0: [(1, 2), (3,)]}


def test_batched_layers_with_fewer_groups_are_padded():
    t = Trace.from_arrays([0, 1], [[[0, 1], [0, 1]], [[2, 3], [0, 1]]], None, [0, 1], 4)
    b = batched(t, 2, slots_per_layer=2)
    assert b.experts.tolist() == [[[0, 1], [0, 1]], [[2, 3], [-1, -1]]]
    assert replay(b, slots_per_layer=2).per_layer[1].requests == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch=0), "batch must be"), (dict(batch=2, order="votes"), "unknown order"),
    (dict(batch=2, sequences=[0, 0]), "distinct"), (dict(batch=2, sequences=[5]), "distinct"),
    (dict(batch=2, slots_per_layer=1), "cannot hold"),
])
def test_batched_bad_arguments(kwargs, match):
    t = random_trace(np.random.default_rng(0), 6, [0], 8, 2)
    with pytest.raises(FormatError, match=match):
        batched(t, **kwargs)


@pytest.mark.parametrize("name", sorted(REAL))
def test_belady_bounds_every_policy_on_batched_real_traces(name):
    t = Trace.load(REAL[name])
    slots = max(t.top_k, t.num_experts // 4)
    for order in ("id", "shared-first"):
        b = batched(t, 4, slots_per_layer=slots, order=order)
        best = belady(b, slots)
        for policy in colibri.POLICIES:
            assert replay(b, slots_per_layer=slots, policy=policy).hits <= best.hits


def _serve_replay():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import serve_replay
    return serve_replay


def test_serve_replay_pieces_and_rows():
    """benchmarks/serve_replay.py: pieces cover every token in order, and in
    every row of its study Belady reads no more than any policy on the same
    lease order, and batch 1 has one expert per distinct choice."""
    sr = _serve_replay()
    t = with_sequences(random_trace(np.random.default_rng(5), 40, [0, 3], 12, 3), [7, 30, 3])
    pieces = sr.split_sequences(t, 6)
    assert [int((pieces.sequence == s).sum()) for s in pieces.sequences] == [7, 6, 6, 6, 6, 6, 3]
    assert pieces.experts.tolist() == t.experts.tolist() and list(pieces.sequence) == sorted(pieces.sequence)
    rows = sr.study(pieces, [0.25, 0.5], [1, 3], perms=2, seed=1)
    assert len(rows) == 2 * 2 * 2 * 2      # groupings x slots x batches x regimes
    for r in rows:
        for order in ("id", "shared"):
            assert all(r["reads"][f"belady/{order}"] <= r["reads"][f"{p}/{order}"] + 1e-12
                       for p in colibri.POLICIES)
        if r["batch"] == 1:
            assert r["union"] == pytest.approx(t.requests / len(t) / 2)
