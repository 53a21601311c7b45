"""Prefetch, single-threaded and deterministic: what is counted, what is evicted.

Prefetch is advisory: with no workers it accepts nothing; invalid keys are
skipped without raising; it never evicts a leased slot; a lookup of a
prefetched expert is a hit (joining the load if it is still in flight) and
counts one prefetch hit at most; a failed prefetch leaves no poisoned slot.
"""

from __future__ import annotations

import errno

import pytest

import colibri
from conftest import assert_expert_matches, expected_experts, wait_until
import core_control  # the test build's control


def test_no_workers_accepts_nothing(small_model):
    with colibri.open_store(small_model.path, prefetch_workers=0) as store:
        assert store.prefetch([(1, 0), (2, 3)]) == 0
        store.wait_idle(timeout=10)
        s = store.stats()
        assert (s.prefetched, s.loads_started, s.resident_bytes) == (0, 0, 0)
        with store.lease(1, 0):
            pass
        assert store.stats().misses == 1


def test_prefetched_expert_is_a_hit_counted_once(small_model):
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=3, prefetch_workers=2) as store:
        assert store.prefetch([(1, 0), (2, 5)]) == 2
        store.wait_idle(timeout=30)
        s = store.stats()
        assert s.prefetched == 2
        assert s.loads_started == 2
        assert s.misses == 0
        assert s.resident_bytes == 2 * small_model.expert_nbytes
        assert s.bytes_read == 2 * small_model.expert_nbytes
        for _ in range(3):
            with store.lease(1, 0) as ex:
                assert_expert_matches(ex, want[(1, 0)])
        s = store.stats()
        assert (s.requests, s.hits, s.misses) == (3, 3, 0)
        assert s.prefetch_hits == 1  # once per prefetched load
        assert s.bytes_read == 2 * small_model.expert_nbytes
        assert s.prefetch_hit_rate == pytest.approx(0.5)


def test_lookup_right_after_prefetch_reads_once(small_model):
    """Whether the load is still in flight (join) or done (hit), one read, no miss."""
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=2, prefetch_workers=1) as store:
        for e in range(small_model.n_experts):
            assert store.prefetch([(3, e)]) == 1
            with store.lease(3, e) as ex:
                assert_expert_matches(ex, want[(3, e)])
        store.wait_idle(timeout=30)
        s = store.stats()
        n = small_model.n_experts
        assert (s.requests, s.hits, s.misses) == (n, n, 0)
        assert s.prefetched == n and s.prefetch_hits == n
        assert s.inflight_joins <= s.hits
        assert s.bytes_read == n * small_model.expert_nbytes


def test_duplicate_and_resident_keys_start_no_second_load(small_model):
    with colibri.open_store(small_model.path, slots_per_layer=3, prefetch_workers=2) as store:
        store.prefetch([(1, 4), (1, 4), (1, 4)])
        store.wait_idle(timeout=30)
        assert store.stats().prefetched == 1
        with store.lease(2, 1):
            pass
        store.prefetch([(1, 4), (2, 1)])  # both resident already
        store.wait_idle(timeout=30)
        s = store.stats()
        assert s.prefetched == 1
        assert s.loads_started == 2  # the prefetch and the demand miss of (2, 1)
        assert s.bytes_read == 2 * small_model.expert_nbytes


def test_invalid_keys_are_skipped_never_raise(small_model):
    with colibri.open_store(small_model.path, slots_per_layer=2, prefetch_workers=2) as store:
        bad = [(99, 0), (0, 0), (-1, 2), (1, -1), (1, 8), (2, 10**9), (2**31 - 1, 0), (10**20, 1)]
        assert store.prefetch(bad) == 0
        assert store.prefetch([]) == 0
        assert store.prefetch(bad + [(1, 1)]) == 1
        store.wait_idle(timeout=30)
        s = store.stats()
        assert s.prefetched == 1
        assert s.resident_bytes == small_model.expert_nbytes


def test_prefetch_never_evicts_leased_slots(small_model):
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=2, prefetch_workers=2) as store:
        a = store.lease(2, 0)
        b = store.lease(2, 1)
        assert store.prefetch([(2, 2), (2, 3), (2, 4)]) == 0  # no unleased slot
        store.wait_idle(timeout=30)
        assert store.stats().prefetched == 0
        assert store.stats().evictions == 0
        assert_expert_matches(a, want[(2, 0)])
        assert_expert_matches(b, want[(2, 1)])
        b.release()
        assert store.prefetch([(2, 2)]) == 1  # b's slot is free now
        store.wait_idle(timeout=30)
        # The only unleased slot holds prefetched 2, not hit yet: a prefetch
        # never replaces an unhit prefetch (a batch must not undo itself).
        assert store.prefetch([(2, 3), (2, 4)]) == 0
        store.wait_idle(timeout=30)
        assert_expert_matches(a, want[(2, 0)])
        assert store.stats().prefetched == 1
        a.release()
        before = store.stats()
        with store.lease(2, 2) as ex:
            assert_expert_matches(ex, want[(2, 2)])
        assert store.stats().hits == before.hits + 1


def test_prefetch_evicted_before_use_is_not_a_prefetch_hit(small_model):
    with colibri.open_store(small_model.path, slots_per_layer=1, prefetch_workers=1) as store:
        assert store.prefetch([(1, 2)]) == 1
        store.wait_idle(timeout=30)
        with store.lease(1, 3):  # evicts the prefetched expert unused
            pass
        with store.lease(1, 2):  # read again: a miss, not a prefetch hit
            pass
        s = store.stats()
        assert (s.prefetched, s.prefetch_hits) == (1, 0)
        assert (s.hits, s.misses, s.evictions) == (0, 2, 2)
        assert s.prefetch_hit_rate == 0


def test_failed_prefetch_leaves_no_poisoned_slot(small_model):
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=2, prefetch_workers=1) as store:
        core_control.inject_read_fault(store, 1, errno.EIO)
        assert store.prefetch([(1, 6)]) == 1  # accepted: the failure comes later, in the worker
        store.wait_idle(timeout=30)
        s = store.stats()
        assert s.loads_failed == 1
        assert s.resident_bytes == 0
        with store.lease(1, 6) as ex:  # a fresh demand load succeeds
            assert_expert_matches(ex, want[(1, 6)])
        s = store.stats()
        assert s.misses == 1
        assert s.resident_bytes == small_model.expert_nbytes


def test_wait_idle_arguments(small_model):
    with colibri.open_store(small_model.path, prefetch_workers=1) as store:
        store.wait_idle()
        store.wait_idle(layer=2, timeout=0)
        with pytest.raises(colibri.UnknownExpertError):
            store.wait_idle(layer=0)
        store.prefetch([(2, 1)])
        store.wait_idle(layer=2, timeout=30)
        assert store.stats().resident_bytes == small_model.expert_nbytes


def test_close_with_prefetches_queued_and_running(small_model):
    """Closing stops the workers: queued loads are dropped, running ones end
    first; nothing hangs (run under ASan/TSan by .ci/sanitizers)."""
    for workers in (1, 2, 4):
        store = colibri.open_store(small_model.path, slots_per_layer=8, prefetch_workers=workers)
        keys = [(layer, e) for layer in small_model.layers for e in range(small_model.n_experts)]
        assert store.prefetch(keys) > 0
        store.close()
        assert store.closed
        with pytest.raises(colibri.StoreClosedError):
            store.prefetch(keys)


def test_retired_wrong_guesses_are_evicted_first(small_model):
    layer = small_model.layers[0]
    with colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=1) as store:
        with store.lease_many(layer, [0, 1]):
            pass                                  # 0 and 1 resident, 1 most recent
        assert store.prefetch([(layer, 2), (layer, 3)]) == 2
        store.wait_idle(timeout=30)               # 2 and 3 resident, unhit prefetches at the MRU end
        # The engine really used 2 (a hit) and not 3: 3 is retired to the LRU end.
        with store.lease(layer, 2):
            pass
        assert store.retire_prefetches(layer, keep=[2]) == 1
        before = store.stats()
        with store.lease(layer, 4):               # a miss evicts the retired guess, not expert 0
            pass
        after = store.stats()
        assert after.evictions == before.evictions + 1
        hits_before = after.hits
        with store.lease(layer, 0):               # still resident
            pass
        assert store.stats().hits == hits_before + 1
        with store.lease(layer, 3):               # was evicted: a miss
            pass
        assert store.stats().misses == after.misses + 1
        assert store.stats().prefetch_hits == 1   # only 2 was a prefetch hit


def test_retire_cancels_queued_wrong_guesses(small_model):
    layer, nbytes = small_model.layers[-1], small_model.expert_nbytes
    with colibri.open_store(small_model.path, slots_per_layer=8, prefetch_workers=1) as store:
        # The one worker begins expert 0 and is held there, so 1..7 are still queued
        # when they are retired (without the hold it may already have read some).
        core_control.hold_prefetch_reads(store, True)
        assert store.prefetch([(layer, e) for e in range(8)]) == 8
        wait_until(lambda: core_control.held_prefetch_reads(store) == 1, "the worker begins expert 0")
        assert store.retire_prefetches(layer, keep=[0]) == 7
        core_control.hold_prefetch_reads(store, False)
        store.wait_idle(timeout=30)
        s = store.stats()
        # The cancelled reads never started; the kept one finished; nothing failed.
        assert (s.bytes_read, s.resident_bytes, s.loads_failed) == (nbytes, nbytes, 0)
        with store.lease(layer, 0):
            pass
        assert store.stats().prefetch_hits == 1
        assert store.retire_prefetches(99, keep=[]) == 0   # unknown layer: nothing


def test_retire_of_out_of_range_layers_and_experts_retires_nothing(small_model):
    with colibri.open_store(small_model.path, prefetch_workers=1) as store:
        assert store.retire_prefetches(2**40, keep=[2**40, -1]) == 0
        assert store.retire_prefetches(-1) == 0
