"""The per-layer LRU, exactly: hits, misses, victims and counters.

A tiny pure-Python reference (one LRU per layer, empty slots first) predicts,
for single-threaded lease + immediate release, whether each lookup is a hit,
and the final requests / hits / misses / evictions / resident_bytes /
bytes_read. Hand-written cases pin down the less usual rules: a slot is most
recently used as of its last *release*, and layers never evict each other.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

import colibri
from conftest import assert_expert_matches, expected_experts
import core_control  # the test build's control


class ReferenceLRU:
    """Per-layer LRU with lease + immediate release: plain LRU of capacity `slots`."""

    def __init__(self, layers, slots: int):
        self.slots = slots
        self.order = {layer: OrderedDict() for layer in layers}  # LRU first
        self.evictions = 0

    def access(self, layer: int, expert: int) -> bool:
        order = self.order[layer]
        if expert in order:
            order.move_to_end(expert)
            return True
        if len(order) >= self.slots:
            order.popitem(last=False)
            self.evictions += 1
        order[expert] = None
        return False

    def resident(self) -> int:
        return sum(len(o) for o in self.order.values())


def _delta(after, before, name):
    return getattr(after, name) - getattr(before, name)


@given(
    slots=st.integers(min_value=1, max_value=4),
    accesses=st.lists(
        st.tuples(st.sampled_from([1, 2]), st.integers(min_value=0, max_value=5)),
        max_size=60,
    ),
)
def test_lru_matches_reference(tiny_model, slots, accesses):
    want = expected_experts(tiny_model)
    ref = ReferenceLRU(tiny_model.layers, slots)
    ref_hits = 0
    with colibri.open_store(tiny_model.path, slots_per_layer=slots) as store:
        assert all(store.slots(layer) == slots for layer in tiny_model.layers)
        for layer, expert in accesses:
            before = store.stats()
            with store.lease(layer, expert) as ex:
                assert_expert_matches(ex, want[(layer, expert)])
            after = store.stats()
            expect_hit = ref.access(layer, expert)
            ref_hits += expect_hit
            assert _delta(after, before, "requests") == 1
            assert _delta(after, before, "hits") == int(expect_hit), (layer, expert)
            assert _delta(after, before, "misses") == int(not expect_hit), (layer, expert)
            assert _delta(after, before, "bytes_read") == (0 if expect_hit else tiny_model.expert_nbytes)

        s = store.stats()
        assert s.requests == len(accesses)
        assert s.hits == ref_hits
        assert s.requests == s.hits + s.misses
        assert s.evictions == ref.evictions
        assert s.resident_bytes == ref.resident() * tiny_model.expert_nbytes
        assert s.resident_bytes <= s.capacity_bytes
        assert s.bytes_read == s.misses * tiny_model.expert_nbytes
        assert s.loads_started == s.misses
        assert s.loads_failed == 0
        assert s.transient_hits == s.hits
        assert s.persistent_hits == 0
        assert s.inflight_joins == 0
        assert s.slot_waits == 0
        assert s.prefetched == 0 and s.prefetch_hits == 0
        assert s.peak_inflight == (1 if s.misses else 0)
        assert store.active_leases == 0


def test_empty_slots_are_used_before_evicting(small_model):
    with colibri.open_store(small_model.path, slots_per_layer=3) as store:
        for e in (0, 1, 2):
            with store.lease(1, e):
                pass
        assert store.stats().evictions == 0
        for e in (0, 1, 2):
            with store.lease(1, e):
                pass
        s = store.stats()
        assert (s.hits, s.misses, s.evictions) == (3, 3, 0)
        with store.lease(1, 3):
            pass
        assert store.stats().evictions == 1


def test_recency_is_the_last_release_not_the_lookup(small_model):
    """A is leased before B but released after it: B is the LRU victim."""
    with colibri.open_store(small_model.path, slots_per_layer=2) as store:
        a = store.lease(1, 0)
        b = store.lease(1, 1)
        b.release()
        a.release()
        with store.lease(1, 2):  # evicts B (released first), not A
            pass
        before = store.stats()
        with store.lease(1, 0):
            pass
        assert _delta(store.stats(), before, "hits") == 1, "A was evicted though released last"
        before = store.stats()
        with store.lease(1, 1):
            pass
        assert _delta(store.stats(), before, "misses") == 1, "B should have been the victim"


def test_hit_on_leased_slot_shares_it(small_model):
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=1, slot_wait_timeout=0.01) as store:
        with store.lease(2, 4) as first:
            with store.lease(2, 4) as second:  # same expert: a hit on the leased slot
                assert store.active_leases == 2
                assert_expert_matches(second, want[(2, 4)])
                assert second.gate.__array_interface__["data"][0] == first.gate.__array_interface__["data"][0]
            assert_expert_matches(first, want[(2, 4)])
            with pytest.raises(colibri.CacheFullError):
                store.lease(2, 5)  # the only slot is still leased by `first`
        s = store.stats()
        assert (s.hits, s.misses) == (1, 1)
        assert s.evictions == 0
        with store.lease(2, 5) as ex:  # released: now the slot can be reused
            assert_expert_matches(ex, want[(2, 5)])
        assert store.stats().evictions == 1


def test_layers_never_evict_each_other(small_model):
    with colibri.open_store(small_model.path, slots_per_layer=2) as store:
        for e in (0, 1):
            with store.lease(1, e):
                pass
        for _ in range(3):
            for e in range(small_model.n_experts):
                with store.lease(2, e):
                    pass
                with store.lease(3, e):
                    pass
        before = store.stats()
        for e in (0, 1):
            with store.lease(1, e):
                pass
        after = store.stats()
        assert _delta(after, before, "hits") == 2
        assert _delta(after, before, "misses") == 0


def test_resident_bytes_and_capacity_with_slots(small_model):
    with colibri.open_store(small_model.path, slots_per_layer=2) as store:
        assert store.stats().resident_bytes == 0
        cap = store.stats().capacity_bytes
        assert cap >= 2 * len(small_model.layers) * small_model.expert_nbytes
        for layer in small_model.layers:
            for e in range(small_model.n_experts):
                with store.lease(layer, e):
                    pass
                s = store.stats()
                assert s.resident_bytes <= s.capacity_bytes == cap
        s = store.stats()
        assert s.resident_bytes == 2 * len(small_model.layers) * small_model.expert_nbytes


def test_capacity_bytes_is_split_evenly_across_layers(small_model):
    from colibri._ffi import lib

    n_layers = len(small_model.layers)
    with colibri.open_store(small_model.path, slots_per_layer=1) as probe:
        slot_bytes = core_control.slot_bytes(probe._handle, small_model.layers[0])
    assert slot_bytes >= small_model.expert_nbytes
    capacity = n_layers * slot_bytes * 3 + slot_bytes // 2  # 3.something slots per layer
    with colibri.open_store(small_model.path, capacity_bytes=capacity) as store:
        for layer in small_model.layers:
            assert store.slots(layer) == capacity // n_layers // slot_bytes == 3
        for layer in small_model.layers:
            for e in range(small_model.n_experts):
                with store.lease(layer, e):
                    pass
        s = store.stats()
        assert s.resident_bytes <= s.capacity_bytes <= capacity
        assert s.resident_bytes == 3 * n_layers * small_model.expert_nbytes


def test_capacity_below_one_slot_per_layer_is_a_format_error(small_model):
    capacity = small_model.expert_nbytes * len(small_model.layers) - 1
    with pytest.raises(colibri.FormatError) as info:
        colibri.open_store(small_model.path, capacity_bytes=capacity)
    assert isinstance(info.value, ValueError)


def test_slots_and_capacity_together_is_a_format_error(small_model):
    with pytest.raises(colibri.FormatError):
        colibri.open_store(small_model.path, slots_per_layer=2, capacity_bytes=10**9)


@pytest.mark.parametrize("slots", [0, -1])
def test_nonpositive_slots_is_a_format_error(small_model, slots):
    with pytest.raises(ValueError):
        colibri.open_store(small_model.path, slots_per_layer=slots)
