"""Store.lease_hits (the resident experts only, never a read) and the
LayerStream that uses it: with I/O workers, a layer's resident experts are
leased and computed first while the workers read the others."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import colibri
from colibri.moe import LayerStream
from conftest import assert_expert_matches, expected_experts


def _warm(store: colibri.Store, layer: int, experts: list[int]) -> None:
    for e in experts:
        with store.lease(layer, e):
            pass


def test_lease_hits_leases_the_resident_ones_in_order_and_reads_nothing(small_model) -> None:
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=0) as store:
        _warm(store, 2, [6, 1, 3])
        before = store.layer_stats(2)
        with store.lease_hits(2, [0, 3, 5, 6, 1]) as hits:
            assert isinstance(hits, colibri.LeaseGroup)
            assert [lease.expert for lease in hits] == [3, 6, 1]
            for lease in hits:
                assert_expert_matches(lease, want[lease.key])
            assert store.active_leases == 3
            after = store.layer_stats(2)
        assert store.active_leases == 0
        assert after.hits - before.hits == 3 and after.requests - before.requests == 3
        assert after.misses == before.misses and after.bytes_read == before.bytes_read


def test_lease_hits_with_nothing_resident_or_nothing_asked(small_model) -> None:
    with colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=0) as store:
        assert store.lease_hits(1, [0, 1, 2]) == ()
        assert store.lease_hits(1, []) == ()
        assert store.stats().requests == 0 and store.active_leases == 0


def test_lease_hits_bad_calls(small_model) -> None:
    store = colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=0)
    _warm(store, 1, [2])
    with pytest.raises(ValueError, match="repeat"):
        store.lease_hits(1, [2, 2])
    with pytest.raises(colibri.UnknownExpertError):
        store.lease_hits(0, [1])                    # layer 0 is dense
    # an unknown expert is simply not resident: the lease that follows says what is wrong
    with store.lease_hits(1, [2, 99, -1]) as hits:
        assert [lease.expert for lease in hits] == [2]
        assert store.active_leases == 1
    store.close()
    with pytest.raises(colibri.StoreClosedError):
        store.lease_hits(1, [2])


def test_lease_hits_of_a_leased_expert_adds_a_lease(small_model) -> None:
    with colibri.open_store(small_model.path, slots_per_layer=2, prefetch_workers=0) as store:
        with store.lease(3, 4) as held:
            with store.lease_hits(3, [4]) as again:
                assert again[0].expert == 4
                assert np.shares_memory(np.asarray(again[0].gate), np.asarray(held.gate))
                assert store.active_leases == 2
            assert not held.released
        assert store.active_leases == 0


def test_a_stream_computes_its_hits_first_while_the_rest_loads(small_model) -> None:
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=6, prefetch_workers=2) as store:
        _warm(store, 2, [4, 0])
        before = store.layer_stats(2)
        seen: list[list[int]] = []
        for group in LayerStream(store, 2, [1, 0, 7, 4]):
            seen.append([lease.expert for lease in group])
            for lease in group:
                assert_expert_matches(lease, want[lease.key])
            assert store.active_leases == len(group)
        assert seen == [[0, 4], [1, 7]]
        after = store.layer_stats(2)
        # the two missing ones were read by the workers, and still count as misses
        assert after.hits - before.hits == 2 and after.misses - before.misses == 2
        assert after.prefetched == before.prefetched and after.prefetch_hits == before.prefetch_hits
        assert after.inflight_joins == before.inflight_joins
        assert after.requests == after.hits + after.misses
        assert store.active_leases == 0


def test_start_reads_counts_a_miss_at_the_first_lease(small_model) -> None:
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=2) as store:
        _warm(store, 1, [5])
        assert store.start_reads(1, [2, 5, 99, -3]) == 1    # 5 is resident, 99 and -3 unknown
        assert store.start_reads(1, [2]) == 0               # already loading or loaded
        store.wait_idle(1)
        assert store.retire_prefetches(1, []) == 0          # not a guess: never retired
        before = store.layer_stats(1)
        with store.lease(1, 2) as lease:
            assert_expert_matches(lease, want[lease.key])
        with store.lease(1, 2):
            pass
        after = store.layer_stats(1)
        assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
        assert after.bytes_read == before.bytes_read       # read once, by a worker
        assert after.prefetched == 0 and after.prefetch_hits == 0
        assert store.start_reads(7, [1]) == 0               # no such layer
    with colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=0) as store:
        assert store.start_reads(1, [2]) == 0               # no workers


@pytest.mark.parametrize("workers, resident, groups", [
    (2, [1, 0, 7, 4], [[1, 0, 7, 4]]),          # all resident: one group
    (2, [], [[1, 0, 7, 4]]),                    # none resident: one lease_many
    (0, [0, 4], [[1, 0, 7, 4]]),                # no workers: nothing could load meanwhile
])
def test_a_stream_stays_one_group(small_model, workers: int, resident: list[int],
                                  groups: list[list[int]]) -> None:
    with colibri.open_store(small_model.path, slots_per_layer=6, prefetch_workers=workers) as store:
        _warm(store, 2, resident)
        assert [[lease.expert for lease in g] for g in LayerStream(store, 2, [1, 0, 7, 4])] == groups
        assert store.active_leases == 0


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_stream_leases_each_expert_once(small_model, data: st.DataObject) -> None:
    """Whatever is resident, whatever the slots: every expert asked is
    leased exactly once, its own bytes, and nothing stays leased."""
    want = expected_experts(small_model)
    slots = data.draw(st.integers(1, 8), label="slots")
    workers = data.draw(st.sampled_from([0, 1, 2]), label="workers")
    with colibri.open_store(small_model.path, slots_per_layer=slots, prefetch_workers=workers) as store:
        for _ in range(3):
            asked = data.draw(st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True), label="asked")
            got: list[int] = []
            for group in LayerStream(store, 3, asked):
                assert len(group) <= slots
                for lease in group:
                    assert_expert_matches(lease, want[lease.key])
                got += [lease.expert for lease in group]
            assert sorted(got) == sorted(asked)
            assert store.active_leases == 0
            stats = store.stats()
            assert stats.requests == stats.hits + stats.misses
