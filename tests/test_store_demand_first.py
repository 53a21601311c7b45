"""Demand reads first: a miss is never kept waiting by speculative work.

Made deterministic with a test hook that holds begun prefetch reads before
their first chunk: while a prefetch is held, a lease_many that needs it and
another expert must still read the other one; a held prefetch retired as a
wrong guess stops without counting a failure; one a lookup waits for is
finished, retired or not; and a joined prefetch whose read fails is read by
the batch itself. No assertion depends on timing: the polls below only bound
how long a state that must come is waited for.
"""

from __future__ import annotations

import errno
import threading
from typing import Any, Callable

import colibri
from conftest import LIVENESS_S, assert_expert_matches, expected_experts, wait_until
import core_control  # the test build's control


def held_prefetch(store, key: tuple[int, int]) -> None:
    """Prefetch key and wait until a worker has begun it and is held."""
    core_control.hold_prefetch_reads(store, True)
    assert store.prefetch([key]) == 1
    wait_until(lambda: core_control.held_prefetch_reads(store) == 1, "the worker begins the prefetch")


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def joined(t: threading.Thread, out: dict) -> Any:
    t.join(LIVENESS_S)
    assert not t.is_alive(), "the lookup never returned"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def batch_in_thread(store, model, layer: int, experts: list[int]) -> tuple[threading.Thread, dict]:
    """lease_many(layer, experts) in a thread that checks every byte; returns
    once the batch has read its one miss (the prefetch it joins is held)."""
    want = expected_experts(model)

    def batch() -> None:
        with store.lease_many(layer, experts) as group:
            for e, ex in zip(experts, group):
                assert_expert_matches(ex, want[(layer, e)])

    t, out = in_thread(batch)
    wait_until(lambda: store.stats().bytes_read == model.expert_nbytes, "the batch reads its miss")
    return t, out


def test_batch_reads_its_miss_while_a_prefetch_it_needs_is_loading(small_model):
    layer, nbytes = small_model.layers[0], small_model.expert_nbytes
    with colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=1) as store:
        held_prefetch(store, (layer, 0))
        # Expert 1 is read while expert 0's load cannot end: the batch did not
        # wait for the prefetch before starting its own miss.
        t, out = batch_in_thread(store, small_model, layer, [0, 1])
        assert t.is_alive() and store.stats().misses == 1
        core_control.hold_prefetch_reads(store, False)
        joined(t, out)
        s = store.stats()
        assert (s.requests, s.hits, s.misses) == (2, 1, 1)
        assert s.prefetch_hits == 1 and s.inflight_joins >= 1
        assert s.bytes_read == 2 * nbytes and s.loads_failed == 0


def test_joined_prefetch_that_fails_is_read_by_the_batch(small_model):
    layer, nbytes = small_model.layers[1], small_model.expert_nbytes
    with colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=1) as store:
        held_prefetch(store, (layer, 2))
        t, out = batch_in_thread(store, small_model, layer, [3, 2])
        core_control.inject_read_fault(store, 1, errno.EIO)   # the held prefetch's read fails
        core_control.hold_prefetch_reads(store, False)
        joined(t, out)                            # ... and the batch reads expert 2 itself
        s = store.stats()
        assert s.loads_failed == 1
        assert s.misses == 2 and s.bytes_read == 2 * nbytes
        assert store.active_leases == 0


def test_retired_prefetch_stops_reading_and_is_no_failure(small_model):
    want = expected_experts(small_model)
    layer = small_model.layers[2]
    with colibri.open_store(small_model.path, slots_per_layer=2, prefetch_workers=1) as store:
        held_prefetch(store, (layer, 5))
        assert store.retire_prefetches(layer, keep=[1]) == 1   # 5 was a wrong guess
        core_control.hold_prefetch_reads(store, False)
        store.wait_idle(timeout=LIVENESS_S)
        s = store.stats()
        assert (s.bytes_read, s.loads_failed, s.resident_bytes) == (0, 0, 0)
        with store.lease(layer, 5) as ex:          # still loadable: a plain miss
            assert_expert_matches(ex, want[(layer, 5)])
        s = store.stats()
        assert (s.misses, s.prefetch_hits, s.bytes_read) == (1, 0, small_model.expert_nbytes)


def test_retired_prefetch_a_lookup_waits_for_is_finished(small_model):
    want = expected_experts(small_model)
    layer = small_model.layers[0]
    with colibri.open_store(small_model.path, slots_per_layer=2, prefetch_workers=1) as store:
        held_prefetch(store, (layer, 6))

        def lookup() -> None:
            with store.lease(layer, 6) as ex:
                assert_expert_matches(ex, want[(layer, 6)])

        t, out = in_thread(lookup)
        wait_until(lambda: store.stats().inflight_joins == 1, "the lookup joins the load")
        assert store.retire_prefetches(layer, keep=[]) == 1
        core_control.hold_prefetch_reads(store, False)
        joined(t, out)
        s = store.stats()
        assert (s.misses, s.hits, s.prefetch_hits) == (0, 1, 1)
        assert s.bytes_read == small_model.expert_nbytes and s.loads_failed == 0


def test_close_lifts_the_hold_on_prefetch_reads(small_model):
    store = colibri.open_store(small_model.path, slots_per_layer=2, prefetch_workers=2)
    held_prefetch(store, (small_model.layers[0], 1))
    t, out = in_thread(store.close)                # must not wait for the held read forever
    joined(t, out)
    assert store.closed


def test_prefetch_reads_never_pause_when_demand_first_is_off(small_model):
    want = expected_experts(small_model)
    layer = small_model.layers[0]
    with colibri.open_store(small_model.path, slots_per_layer=8, prefetch_workers=2,
                            demand_first=False) as store:
        for e in range(small_model.n_experts):
            store.prefetch([(layer, (e + 1) % small_model.n_experts)])
            with store.lease(layer, e) as ex:
                assert_expert_matches(ex, want[(layer, e)])
        store.wait_idle(timeout=LIVENESS_S)
        assert store.stats().prefetch_pauses == 0
