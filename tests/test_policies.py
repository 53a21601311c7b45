"""Eviction policies: the C store against the reference simulator.

``benchmarks/policy_sim.py`` simulates per-layer caches with lease_many
semantics, each policy written out again in Python (the ``lrfu`` policy
operation for operation). A replay store fed the same routing must end with
the same hits, misses and evictions on every layer, for lru, lrfu and cooc:
on random routing (hypothesis), on long routing (the counts' rescaling
runs), and on the two real traces. Leased and pinned slots are never
evicted whatever the policy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import colibri
from colibri.store import POLICIES, open_replay_store

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import policy_sim  # noqa: E402

TRACES = ROOT / "tests" / "data" / "traces"
# The policies the simulator writes out exactly (lfu's ties fall to the
# C heap's order; its own tests cover it).
SIMULATED = [p for p in POLICIES if p in ("lru", "lrfu", "cooc")]


def store_counts(experts: np.ndarray, num_experts: int, slots, policy: str, pin=()):
    """Per layer (hits, misses, evictions) of a replay store fed experts (T, L, k)."""
    n_layers = experts.shape[1]
    store = open_replay_store(dict.fromkeys(range(n_layers), num_experts), slots_per_layer=slots,
                              policy=policy, pin=list(pin))
    try:
        store.replay_tokens(np.arange(n_layers, dtype=np.int32), experts)
        out = []
        for layer in range(n_layers):
            s = store.layer_stats(layer)
            out.append((s.hits, s.misses, s.evictions))
        return out
    finally:
        store.close()


def sim_counts(experts: np.ndarray, slots, policy: str):
    out = []
    for layer in range(experts.shape[1]):
        n = slots[layer] if isinstance(slots, dict) else slots
        c = policy_sim.simulate_layer(experts[:, layer], None, n, policy_sim.make_policy(policy)(layer, n))
        out.append((c.hits, c.misses, c.evictions))
    return out


def test_every_policy_is_listed_and_lru_stays_the_default():
    assert POLICIES[0] == "lru"
    assert "lrfu" in POLICIES
    assert colibri.POLICIES == POLICIES


@st.composite
def routings(draw):
    num_experts = draw(st.integers(2, 12))
    k = draw(st.integers(1, min(4, num_experts)))
    n_layers = draw(st.integers(1, 3))
    slots = {layer: draw(st.integers(k, num_experts)) for layer in range(n_layers)}
    tokens = draw(st.integers(0, 60))
    # -1 pads and repeats are dropped by the replay, as by the simulator
    flat = draw(st.lists(st.integers(-1, num_experts - 1), min_size=tokens * n_layers * k,
                         max_size=tokens * n_layers * k))
    experts = np.array(flat, dtype=np.int32).reshape(tokens, n_layers, k)
    return num_experts, slots, experts


@pytest.mark.parametrize("policy", SIMULATED)
@given(case=routings())
@settings(max_examples=60, deadline=None)
def test_store_counters_equal_the_simulator_on_random_routing(policy, case):
    num_experts, slots, experts = case
    assert store_counts(experts, num_experts, slots, policy) == sim_counts(experts, slots, policy)


@pytest.mark.parametrize("policy", SIMULATED)
def test_store_counters_equal_the_simulator_on_long_skewed_routing(policy):
    # lrfu's counts double every 2 x slots requests and are rescaled by
    # 2**-512 at 512 doublings: 20,000 requests of 3 slots pass that 6 times.
    # cooc's double every 64 lookups, rescaled at 64 doublings: 4 times.
    rng = np.random.default_rng(7)
    p = 1.0 / np.arange(1, 11) ** 1.2
    experts = rng.choice(10, size=(20000, 2, 1), p=p / p.sum()).astype(np.int32)
    slots = {0: 3, 1: 5}
    got = store_counts(experts, 10, slots, policy)
    assert got == sim_counts(experts, slots, policy)
    assert all(e > 0 for _, _, e in got)


@pytest.mark.parametrize("policy", SIMULATED)
@pytest.mark.parametrize("name", ["qwen3.6-35b-a3b-fever.npz", "mixtral-8x7b-humaneval.npz"])
def test_store_counters_equal_the_simulator_on_real_traces(policy, name):
    trace = policy_sim.load_trace(TRACES / name)
    k = trace.experts.shape[2]
    for fraction in (0.125, 0.5):
        slots = policy_sim.slots_for(fraction, trace.num_experts, k)
        assert store_counts(trace.experts, trace.num_experts, slots, policy) == \
            sim_counts(trace.experts, slots, policy)


def test_lrfu_keeps_an_often_used_expert_that_lru_evicts():
    # Three slots; expert 0 comes every third token, two strangers at a time
    # in between: the second pair finds 0 the least recent, so LRU evicts it
    # each time. lrfu keeps the expert whose decayed count has grown.
    rows = []
    for t in range(60):
        rows.append([0, -1] if t % 3 == 0 else [100 + 2 * t, 101 + 2 * t])
    experts = np.array(rows, dtype=np.int32)[:, None, :]
    returns = 19
    lru = store_counts(experts, 300, 3, "lru")[0]
    lrfu = store_counts(experts, 300, 3, "lrfu")[0]
    assert lru[0] == 0
    assert lrfu[0] >= returns - 2
    assert (lrfu[0], lrfu[1]) == sim_counts(experts, {0: 3}, "lrfu")[0][:2]


def test_cooc_learns_which_expert_comes_next_where_recency_thrashes():
    # Four experts in a cycle through three slots: the one LRU (and any
    # count of uses) evicts is always the next one asked, so they never hit.
    # cooc learns that d follows c, and so on, and evicts the resident expert
    # that is not asked next: after the first lap, every other lookup hits.
    experts = np.array([[t % 4] for t in range(400)], dtype=np.int32)[:, None, :]
    for policy in ("lru", "lrfu"):
        assert store_counts(experts, 4, 3, policy)[0][0] == 0
    hits, misses, _ = store_counts(experts, 4, 3, "cooc")[0]
    assert hits >= (400 - 8) // 2
    assert (hits, misses) == sim_counts(experts, {0: 3}, "cooc")[0][:2]


def test_cooc_falls_back_to_recency_without_history():
    # With nothing learnt every candidate scores the same: the oldest goes,
    # as with LRU (experts never repeat, so nothing is learnt).
    experts = np.arange(40, dtype=np.int32).reshape(20, 1, 2)
    for policy in ("lru", "cooc"):
        assert store_counts(experts, 40, 4, policy)[0] == (0, 40, 36)
    ring = np.array([[0, 1], [2, 3], [0, 1], [4, 5], [0, 1]], dtype=np.int32)[:, None, :]
    assert store_counts(ring, 6, 4, "cooc") == store_counts(ring, 6, 4, "lru")


@pytest.mark.parametrize("policy, first_stays", [("lru", False), ("lrfu", True)])
def test_lrfu_weights_uses_by_rank(policy, first_stays):
    # Two slots; experts 1 and 2 come together, 1 ranked first, then one
    # stranger takes a slot. LRU evicts 1 (released before 2); lrfu evicts
    # the lower-ranked 2.
    rows = []
    for t in range(30):
        rows.append([1, 2] if t % 2 == 0 else [100 + t, -1])
    experts = np.array(rows, dtype=np.int32)[:, None, :]
    store = open_replay_store({0: 200}, slots_per_layer=2, policy=policy)
    layers = np.array([0], dtype=np.int32)
    store.replay_tokens(layers, experts)
    hits = store.layer_stats(0).hits
    store.replay_tokens(layers, np.array([[[1, -1]]], dtype=np.int32))
    assert (store.layer_stats(0).hits == hits + 1) is first_stays
    store.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_pinned_experts_are_never_evicted(policy):
    rng = np.random.default_rng(11)
    pins = [(0, 3), (1, 0), (1, 9)]
    experts = rng.integers(0, 16, size=(3000, 2, 2), dtype=np.int32)
    store = open_replay_store({0: 16, 1: 16}, slots_per_layer={0: 4, 1: 6}, policy=policy, pin=pins)
    store.replay_tokens(np.array([0, 1], dtype=np.int32), experts)
    s = store.stats()
    pinned_requests = sum(int(store.expert_requests(la)[e]) for la, e in store.pinned)
    assert store.pinned == tuple(sorted(pins))
    assert s.persistent_hits == pinned_requests > 0   # every lookup of a pin hit
    assert s.persistent_hits + s.transient_hits == s.hits and s.evictions > 0
    store.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_leased_slots_are_never_evicted(small_model, policy):
    layer = small_model.layers[0]
    with colibri.open_store(small_model.path, slots_per_layer=3, policy=policy, prefetch_workers=0,
                            slot_wait_timeout=0.01) as store:
        with store.lease(layer, 5) as held:
            before = held.down.copy()
            for e in [0, 1, 2, 3, 4, 6, 7, 0, 1, 2, 7, 6]:   # churn the two other slots
                with store.lease(layer, e):
                    pass
            with store.lease_many(layer, [1, 2]):            # the two free slots, together
                with pytest.raises(colibri.CacheFullError):
                    with store.lease(layer, 3):              # no third slot: 5 is leased
                        pass
            assert np.array_equal(held.down, before)
        s = store.stats()
        assert s.resident_bytes <= s.capacity_bytes
        with store.lease(layer, 5):
            pass
        assert store.stats().hits == s.hits + 1           # 5 stayed resident all along


def test_an_unknown_policy_is_a_format_error():
    with pytest.raises(colibri.FormatError, match="unknown policy 'mru'"):
        open_replay_store({0: 4}, slots_per_layer=2, policy="mru")
