"""Replay stores, per-layer budgets, pins and the per-layer and per-expert counters.

The central property: a replay store (no files, no slot memory) fed a routing
sequence through ``replay_tokens`` ends with exactly the counters of a live
store fed the same sequence one ``lease_many`` per (token, layer), released
before the next; so does a live store driven by ``replay_tokens``. Hypothesis
draws the sequences, the per-layer budgets, the pins and the worker count.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import colibri
from colibri.store import POLICIES, open_replay_store

LAYERS = (1, 2)   # tiny_model's MoE layers
EXPERTS = 6
COMPARED = [f.name for f in dataclasses.fields(colibri.StoreStats)
            if f.name not in ("peak_inflight", "prefetch_pauses")]


def distinct(row) -> list[int]:
    out: list[int] = []
    for e in row:
        if e >= 0 and e not in out:
            out.append(int(e))
    return out


def live_lease_many(store, layers, experts) -> None:
    """What replay_tokens does, from Python: stops at the first CacheFullError."""
    for t in range(experts.shape[0]):
        for i, layer in enumerate(layers):
            ids = distinct(experts[t, i])
            if ids:
                with store.lease_many(layer, ids):
                    pass


def run(fn) -> type | None:
    try:
        fn()
    except colibri.CacheFullError:
        return colibri.CacheFullError
    return None


def counters(store) -> dict:
    out = {"all": {n: getattr(store.stats(), n) for n in COMPARED}}
    for layer in LAYERS:
        out[layer] = {n: getattr(store.layer_stats(layer), n) for n in COMPARED}
        out[("requests", layer)] = store.expert_requests(layer).tolist()
    return out


@st.composite
def cases(draw):
    slots = {layer: draw(st.integers(1, EXPERTS)) for layer in LAYERS}
    uniform = draw(st.booleans())
    if uniform:
        slots = dict.fromkeys(LAYERS, min(slots.values()))
    pins = []
    for layer in LAYERS:
        chosen = draw(st.lists(st.integers(0, EXPERTS - 1), unique=True, max_size=slots[layer] - 1))
        pins += [(layer, e) for e in chosen]
    k = draw(st.integers(1, 3))
    tokens = draw(st.integers(0, 25))
    experts = np.array(draw(st.lists(st.integers(-1, EXPERTS - 1), min_size=tokens * 2 * k,
                                     max_size=tokens * 2 * k)), dtype=np.int32).reshape(tokens, 2, k)
    return ((slots[LAYERS[0]] if uniform else slots), pins, experts, draw(st.sampled_from([0, 2])),
            draw(st.sampled_from(POLICIES)))


@given(cases())
def test_replay_counters_equal_a_live_store(tiny_model, case):
    slots, pins, experts, workers, policy = case
    layers = np.array(LAYERS, dtype=np.int32)
    replay = open_replay_store({layer: EXPERTS for layer in LAYERS}, slots_per_layer=slots,
                               expert_nbytes=tiny_model.expert_nbytes, pin=pins, policy=policy)
    replay_error = run(lambda: replay.replay_tokens(layers, experts))
    results = [counters(replay)]
    for drive in (live_lease_many, lambda s, la, ex: s.replay_tokens(la, ex)):
        with colibri.open_store(tiny_model.path, slots_per_layer=slots, pin=pins, policy=policy,
                                prefetch_workers=workers, slot_wait_timeout=0.01) as live:
            live.wait_idle()  # the pins
            assert run(lambda: drive(live, LAYERS, experts)) is replay_error
            results.append(counters(live))
            assert live.pinned == tuple(sorted(pins))
    assert results[1] == results[0]
    assert results[2] == results[0]
    s = replay.stats()
    assert s.persistent_hits + s.transient_hits == s.hits
    assert s.resident_bytes <= s.capacity_bytes
    assert replay.pinned == tuple(sorted(pins))
    replay.close()


def test_pinned_experts_are_never_evicted():
    rng = np.random.default_rng(3)
    store = open_replay_store({0: 16, 5: 16}, slots_per_layer={0: 4, 5: 6}, pin=[(0, 3), (5, 0), (5, 9)])
    layers = np.array([0, 5], dtype=np.int32)
    experts = rng.integers(0, 16, size=(2000, 2, 2), dtype=np.int32)
    store.replay_tokens(layers, experts)
    s = store.stats()
    pinned_requests = sum(int(store.expert_requests(la)[e]) for la, e in store.pinned)
    assert store.pinned == ((0, 3), (5, 0), (5, 9))
    assert s.persistent_hits == pinned_requests > 0  # every lookup of a pin hit
    assert s.persistent_hits + s.transient_hits == s.hits
    assert s.evictions > 0 and s.resident_bytes <= s.capacity_bytes
    for layer in (0, 5):
        ls = store.layer_stats(layer)
        assert ls.persistent_hits + ls.transient_hits == ls.hits
        assert ls.requests == int(store.expert_requests(layer).sum())
    before = store.stats()
    store.replay_tokens(np.array([0], dtype=np.int32), np.array([[[3]]], dtype=np.int32))
    after = store.stats()
    assert (after.hits, after.persistent_hits, after.misses) == (before.hits + 1, before.persistent_hits + 1,
                                                                 before.misses)


def test_live_pins_load_in_the_background_and_hit(small_model):
    layer = small_model.layers[0]
    with colibri.open_store(small_model.path, slots_per_layer=3, pin=[(layer, 2)],
                            prefetch_workers=2) as store:
        store.wait_idle()
        s = store.stats()
        assert s.loads_started == 1 and s.requests == 0 and s.resident_bytes > 0
        for e in range(8):  # cycle the other experts through the two free slots
            with store.lease(layer, e):
                pass
        with store.lease(layer, 2) as ex:
            assert ex.gate.shape[0] > 0
        s = store.stats()
        assert s.persistent_hits == 2  # expert 2 in the loop, then again
        assert s.misses == 7 and store.pinned == ((layer, 2),)


def test_pins_without_workers_load_in_open(small_model):
    layer = small_model.layers[1]
    with colibri.open_store(small_model.path, slots_per_layer=2, pin=[(layer, 7)],
                            prefetch_workers=0) as store:
        assert store.stats().loads_started == 1
        with store.lease(layer, 7):
            pass
        assert store.stats().persistent_hits == 1 and store.stats().misses == 0


def test_slots_per_layer_mapping(small_model):
    layers = small_model.layers
    with colibri.open_store(small_model.path, slots_per_layer={layers[0]: 1, layers[1]: 5, layers[2]: 99}) as store:
        assert [store.slots(la) for la in layers] == [1, 5, 8]  # capped at the layer's experts
        assert store.layer_stats(layers[1]).capacity_bytes == 5 * store.layer_stats(layers[0]).capacity_bytes


def test_policies_come_from_the_library():
    assert POLICIES[:2] == ("lru", "lfu") and colibri.POLICIES == POLICIES
    assert all(isinstance(p, str) and p for p in POLICIES)


@pytest.mark.parametrize("policy, then", [("lru", "miss"), ("lfu", "hit")])
def test_lfu_keeps_the_most_used_expert(policy, then):
    """Two slots; expert 0 used three times, then 1, then 2: LRU evicts 0
    (least recent), LFU evicts 1 (fewest uses)."""
    store = open_replay_store({0: 4}, slots_per_layer=2, policy=policy)
    layers = np.array([0], dtype=np.int32)
    store.replay_tokens(layers, np.array([[[0]], [[0]], [[0]], [[1]], [[2]]], dtype=np.int32))
    before = store.stats()
    store.replay_tokens(layers, np.array([[[0]]], dtype=np.int32))
    assert ("hit" if store.stats().hits > before.hits else "miss") == then


@pytest.mark.parametrize("kwargs, match", [
    ({"policy": "nope"}, "unknown policy 'nope'"),
    ({"policy": 0}, "unknown policy 0"),
    ({"slots_per_layer": {1: 2}}, "gives no slots to layers"),
    ({"slots_per_layer": {1: 2, 2: 2, 3: 2, 9: 1}}, "without routed experts"),
    ({"slots_per_layer": {1: 2, 2: 0, 3: 2}}, r"slots_per_layer\[2\] must be >= 1"),
    ({"slots_per_layer": {1: 2, 2: "2", 3: 2}}, "must be an int"),
    ({"pin": [(1, 99)]}, "pinned expert 99 of layer 1 is not in the model"),
    ({"pin": [(1, 2), (1, 2)]}, "pinned twice"),
    ({"pin": [(1, 0), (1, 1), (1, 2)], "slots_per_layer": 2}, "pins more experts than"),
    ({"pin": [(1, 0), (1, 1)], "slots_per_layer": 2}, "leaving none for its other 6 experts"),
    ({"pin": [(1,)]}, r"pin takes \(layer, expert\) pairs"),
    ({"pin": [("a", 1)]}, r"pin takes \(layer, expert\) pairs"),
])
def test_bad_arguments_are_format_errors(small_model, kwargs, match):
    with pytest.raises(colibri.FormatError, match=match):
        colibri.open_store(small_model.path, **kwargs)


def test_all_slots_pinned_when_they_hold_every_expert():
    store = open_replay_store({0: 3}, slots_per_layer=3, pin=[(0, 0), (0, 1), (0, 2)])
    store.replay_tokens(np.array([0], dtype=np.int32), np.array([[[0, 1, 2]]] * 3, dtype=np.int32))
    s = store.stats()
    assert s.hits == s.persistent_hits == 9 and s.misses == 0


def test_replay_store_errors():
    store = open_replay_store({0: 8, 1: 8}, slots_per_layer=2, pin=[(1, 0)])
    layers = np.array([0, 1], dtype=np.int32)
    with pytest.raises(colibri.LeaseError, match="replay store"):
        store.lease(0, 1)
    with pytest.raises(colibri.LeaseError, match="replay store"):
        store.lease_many(0, [1])
    with pytest.raises(colibri.FormatError, match="second axis"):
        store.replay_tokens(layers, np.zeros((4, 3, 1), dtype=np.int32))
    with pytest.raises(colibri.FormatError, match="dimension"):
        store.replay_tokens(layers, np.zeros((4, 2), dtype=np.int32))
    with pytest.raises(colibri.FormatError, match="integers"):
        store.replay_tokens(layers, np.zeros((4, 2, 1), dtype=np.float32))
    with pytest.raises(colibri.FormatError, match="32-bit"):
        store.replay_tokens(layers, np.full((1, 2, 1), 2**40))
    with pytest.raises(colibri.UnknownExpertError, match="layer 7"):
        store.replay_tokens(np.array([7], dtype=np.int32), np.zeros((1, 1, 1), dtype=np.int32))
    with pytest.raises(colibri.UnknownExpertError, match="token 1, layer 0: layer 0 has no expert 8"):
        store.replay_tokens(layers, np.array([[[0], [0]], [[8], [0]]], dtype=np.int32))
    # Layer 1 has one slot besides its pin: two other experts never fit.
    with pytest.raises(colibri.CacheFullError, match="token 0, layer 1"):
        store.replay_tokens(layers, np.array([[[0, 1], [2, 3]]], dtype=np.int32))
    with pytest.raises(colibri.UnknownExpertError):
        store.layer_stats(5)
    with pytest.raises(colibri.UnknownExpertError):
        store.expert_requests(5)
    with pytest.raises(colibri.FormatError, match="num_experts"):
        open_replay_store({}, slots_per_layer=1)
    with pytest.raises(colibri.FormatError, match="slots_per_layer must be >= 1"):
        open_replay_store({0: 4}, slots_per_layer=0)
    store.close()
    with pytest.raises(colibri.StoreClosedError):
        store.replay_tokens(layers, np.zeros((1, 2, 1), dtype=np.int32))


def test_replay_reads_nothing_and_counts_what_it_would():
    store = open_replay_store({0: 4}, slots_per_layer=2, expert_nbytes=1000)
    store.replay_tokens(np.array([0], dtype=np.int32), np.array([[[0]], [[1]], [[2]], [[0]]], dtype=np.int32))
    s = store.stats()
    assert (s.misses, s.hits, s.evictions, s.bytes_read, s.resident_bytes) == (4, 0, 2, 4000, 2000)
    assert store.expert_requests(0).tolist() == [2, 1, 1, 0]


def test_replay_takes_any_k():
    """k is not bounded by a buffer: 48 choices a token, with pads and
    repeats, count as their distinct experts do."""
    rng = np.random.default_rng(3)
    rows = []
    for _ in range(30):
        chosen = rng.choice(64, size=40, replace=False)
        row = np.concatenate([chosen, chosen[:4], [-1] * 4])   # 40 distinct of 48
        rows.append(rng.permutation(row))
    wide = np.array(rows, dtype=np.int32)[:, None, :]
    compact = np.array([distinct(r) for r in rows], dtype=np.int32)[:, None, :]
    got = []
    for experts in (wide, compact):
        store = open_replay_store({0: 64}, slots_per_layer=48, policy="lru")
        store.replay_tokens(np.array([0], dtype=np.int32), experts)
        got.append(counters_of(store, 0))
        store.close()
    assert got[0] == got[1] and got[0][0] == 30 * 40


def test_replay_finds_an_unknown_expert_among_many():
    store = open_replay_store({0: 8}, slots_per_layer=8)
    row = np.array([[list(range(8)) + [9] + list(range(30, 60))]], dtype=np.int32)
    with pytest.raises(colibri.UnknownExpertError, match="layer 0 has no expert 9"):
        store.replay_tokens(np.array([0], dtype=np.int32), row)
    store.close()


def counters_of(store, layer) -> tuple[int, int, int, int]:
    s = store.layer_stats(layer)
    return s.requests, s.hits, s.misses, s.evictions


def test_replay_store_limits_come_from_the_library():
    from colibri._ffi import lib

    top = int(lib.COLI_MAX_LAYER_ID)
    store = open_replay_store({top: 2}, slots_per_layer=1)
    store.replay_tokens(np.array([top], dtype=np.int32), np.array([[[1]]], dtype=np.int32))
    assert store.layer_stats(top).misses == 1
    store.close()
    with pytest.raises(colibri.FormatError, match=f"<= {top}"):
        open_replay_store({top + 1: 2}, slots_per_layer=1)
    with pytest.raises(colibri.FormatError, match=f"<= {int(lib.COLI_MAX_EXPERT_ID) + 1}"):
        open_replay_store({0: int(lib.COLI_MAX_EXPERT_ID) + 2}, slots_per_layer=1)
