"""lease_many with several misses: the reads are shared with the I/O workers
(ahead of queued prefetches), and the batch stays all or nothing."""

from __future__ import annotations

import errno

import pytest

import colibri
from conftest import assert_expert_matches, expected_experts
import core_control  # the test build's control


@pytest.mark.parametrize("workers", [0, 1, 2, 4])
def test_batch_of_misses_reads_each_expert_once(small_model, workers):
    want = expected_experts(small_model)
    layer = small_model.layers[0]
    with colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=workers) as store:
        with store.lease_many(layer, [3, 1, 2, 1]) as group:
            for ex in group:
                assert_expert_matches(ex, want[(layer, ex.expert)])
        s = store.stats()
        assert s.misses == 3 and s.loads_started == 3 and s.hits == 1
        assert s.bytes_read == 3 * small_model.expert_nbytes
        assert store.active_leases == 0


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_failed_read_in_a_batch_holds_nothing_and_poisons_nothing(small_model, nth):
    want = expected_experts(small_model)
    layer = small_model.layers[0]
    with colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=2) as store:
        core_control.inject_read_fault(store, nth, errno.EIO)
        with pytest.raises(colibri.ExpertLoadError) as info:
            store.lease_many(layer, [0, 1, 2])
        assert "offset" in str(info.value) and str(small_model.files[0]) in str(info.value)
        assert store.active_leases == 0
        s = store.stats()
        assert s.loads_failed == 1
        with store.lease_many(layer, [0, 1, 2]) as group:
            for ex in group:
                assert_expert_matches(ex, want[(layer, ex.expert)])


def test_batch_reads_go_ahead_of_queued_prefetches(small_model):
    layer = small_model.layers[-1]
    with colibri.open_store(small_model.path, slots_per_layer=6, prefetch_workers=1) as store:
        # Fill the queue of the single worker with prefetches of another layer.
        other = small_model.layers[0]
        store.prefetch([(other, e) for e in range(small_model.n_experts)])
        with store.lease_many(layer, [4, 5, 6]) as group:
            assert [ex.expert for ex in group] == [4, 5, 6]
        store.wait_idle(timeout=30)
        s = store.stats()
        assert s.requests == s.hits + s.misses
        assert s.loads_failed == 0
