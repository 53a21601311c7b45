"""Warm start: experts loaded into unpinned slots at open, then evicted like any other.

``open_store(warm=[...])`` and ``open_replay_store(warm=[...])`` list them;
``open_store(usage_file=..., warm_start=True)`` takes each layer's hottest
experts of the usage history; ``colibri.replay(trace, usage=...)`` replays
that start. A replay store and a live store with no workers load them in
order, the last one the most recent.
"""

from __future__ import annotations

import numpy as np
import pytest

import colibri
from colibri import FormatError, Usage
from colibri.store import POLICIES, open_replay_store


def lookups(store, layer: int, rows: list[list[int]]) -> None:
    store.replay_tokens(np.array([layer], dtype=np.int32),
                        np.array(rows, dtype=np.int32).reshape(len(rows), 1, -1))


def test_warm_experts_are_resident_at_open_and_load_without_a_request():
    store = open_replay_store({0: 8}, slots_per_layer=4, expert_nbytes=100, warm=[(0, 5), (0, 6), (0, 7)])
    s = store.stats()
    assert (s.requests, s.hits, s.misses, s.bytes_read) == (0, 0, 0, 300)
    lookups(store, 0, [[5, 6, 7]])
    s = store.stats()
    assert (s.hits, s.misses, s.persistent_hits, s.transient_hits) == (3, 0, 0, 3)
    assert store.pinned == ()
    store.close()


def test_the_last_warm_expert_is_the_most_recent_and_warm_ones_are_evicted():
    store = open_replay_store({0: 8}, slots_per_layer=3, warm=[(0, 1), (0, 2), (0, 3)])
    lookups(store, 0, [[4]])          # evicts 1, the least recent
    lookups(store, 0, [[3], [2], [1]])
    s = store.stats()
    assert (s.hits, s.misses, s.evictions) == (2, 2, 2)
    store.close()


def test_a_layer_keeps_the_last_of_its_warm_list_beside_its_pins():
    warm = [(0, 1), (0, 2), (0, 3), (0, 4), (1, 0)]
    store = open_replay_store({0: 8, 1: 8}, slots_per_layer=3, pin=[(0, 7)], warm=warm)
    lookups(store, 0, [[3, 4, 7]])    # 1 and 2 did not fit beside the pin
    assert (store.stats().hits, store.stats().misses) == (3, 0)
    lookups(store, 0, [[1]])
    assert store.stats().misses == 1
    store.close()


@pytest.mark.parametrize("warm, match", [
    ([(0, 9)], "warm expert 9 of layer 0 is not in the model"),
    ([(2, 0)], "warm expert 0 of layer 2 is not in the model"),
    ([(0, 1), (0, 1)], "warm twice"),
    ([(0, 7)], "both pinned and warm"),
    ([(0, "x")], "warm takes"),
])
def test_bad_warm_lists_are_refused(warm, match):
    with pytest.raises(FormatError, match=match):
        open_replay_store({0: 8}, slots_per_layer=3, pin=[(0, 7)], warm=warm)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_live_store_loads_warm_experts_with_their_bytes(small_model, expected, workers):
    layer = small_model.layers[0]
    want = expected(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=3, prefetch_workers=workers,
                            warm=[(layer, 2), (layer, 4)]) as store:
        store.wait_idle(timeout=30)
        before = store.stats()
        assert before.requests == 0 and before.bytes_read == 2 * small_model.expert_nbytes
        for e in (2, 4):
            with store.lease(layer, e) as ex:
                for role in ("gate", "up", "down"):
                    assert np.array_equal(getattr(ex, role), want[(layer, e)][role])
        s = store.stats()
        assert (s.hits - before.hits, s.misses - before.misses) == (2, 0)


def record_history(small_model, path, rows_by_layer):
    with colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=0, usage_file=path,
                            usage_half_life=None) as store:
        for layer, rows in rows_by_layer.items():
            for row in rows:
                with store.lease_many(layer, row):
                    pass


def test_warm_start_loads_each_layers_hottest_experts(small_model, tmp_path):
    path = tmp_path / "usage.npz"
    l1, l2, l3 = small_model.layers
    record_history(small_model, path, {l1: [[6, 7]] * 5 + [[0], [1], [2]] + [[7]], l2: [[3]] * 4, l3: []})
    with colibri.open_store(small_model.path, slots_per_layer=3, prefetch_workers=0, usage_file=path,
                            warm_start=True, pin=[(l1, 6)]) as store:
        assert store.stats().requests == 0
        loaded = store.stats().bytes_read // small_model.expert_nbytes
        assert loaded == 1 + 2 + 1    # the pin; 7 and 0 (ties go to the lower index); 3, l2's only one
        for layer, e in [(l1, 7), (l1, 0), (l2, 3)]:
            with store.lease(layer, e):
                pass
        assert store.stats().misses == 0
        with store.lease(l1, 1):
            pass
        assert store.stats().misses == 1


def test_warm_start_needs_a_history(small_model):
    with pytest.raises(FormatError, match="usage_file"):
        colibri.open_store(small_model.path, warm_start=True)


@pytest.mark.parametrize("policy", POLICIES)
def test_replay_with_a_history_equals_a_live_store_with_warm_start(small_model, tmp_path, policy):
    path = tmp_path / "usage.npz"
    rng = np.random.default_rng(3)
    layers = small_model.layers
    record_history(small_model, path,
                   {l: [list(rng.choice(8, size=2, replace=False)) for _ in range(40)] for l in layers})
    history = Usage.load(path)
    experts = np.stack([rng.choice(8, size=(60, 2), replace=True) for _ in layers], axis=1).astype(np.int32)
    trace = colibri.Trace.from_arrays(np.array(layers), experts, num_experts=8)
    slots = {l: s for l, s in zip(layers, (3, 4, 5))}
    got = colibri.replay(trace, slots_per_layer=slots, policy=policy, usage=history, pinned=[(layers[0], 1)])
    with colibri.open_store(small_model.path, slots_per_layer=slots, prefetch_workers=0, policy=policy,
                            usage_file=path, warm_start=True, pin=[(layers[0], 1)]) as store:
        for t in range(len(experts)):
            for i, layer in enumerate(layers):
                row = list(dict.fromkeys(int(e) for e in experts[t, i]))
                with store.lease_many(layer, row):
                    pass
        for layer in layers:
            live = store.layer_stats(layer)
            mine = got.per_layer[layer]
            assert (mine.hits, mine.misses, mine.evictions, mine.persistent_hits) == \
                (live.hits, live.misses, live.evictions, live.persistent_hits)
    cold = colibri.replay(trace, slots_per_layer=slots, policy=policy, pinned=[(layers[0], 1)])
    assert got.requests == cold.requests


def test_replay_usage_may_be_a_trace_and_must_match_it():
    experts = np.array([[[0, 1]], [[2, 3]], [[0, 1]], [[4, 5]]], dtype=np.int32)
    trace = colibri.Trace.from_arrays(np.array([0]), experts, num_experts=6)
    warm = colibri.replay(trace, slots_per_layer=2, usage=trace)
    cold = colibri.replay(trace, slots_per_layer=2)
    assert warm.hits >= cold.hits + 1    # 0 and 1, the hottest, are there before the first token
    other = colibri.Trace.from_arrays(np.array([0]), experts, num_experts=7)
    with pytest.raises(FormatError, match="layer 0"):
        colibri.replay(trace, slots_per_layer=2, usage=other)
    with pytest.raises(FormatError, match="colibri.Usage"):
        colibri.replay(trace, slots_per_layer=2, usage={0: [1, 2]})
