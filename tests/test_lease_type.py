"""The lease as a C type (csrc/py_lease.c, module colibri._lease).

store.lease() takes a hit holding the GIL and drops it only for a miss;
__enter__, __exit__, release(), the array getters and the tenancy cache are
C. These tests pin what that C code owns: key parsing, that only the store
makes leases, the lease life cycle, the tenancy cache's bound and its
checks, reference counts on every path (a leak or an extra decref in C
shows up as a count that drifts), and that a lookup that has to wait lets
other Python threads run.
"""

from __future__ import annotations

import copy
import gc
import pickle
import sys
import threading
import warnings

import numpy as np
import pytest

import colibri
from colibri._ffi import ffi, lib
from colibri._lease import LeaseBase, Leaser, Tenancies, Tenancy
from colibri._tenancy import defer
from colibri.errors import error_for
from conftest import LIVENESS_S, assert_expert_matches, expected_experts, wait_until


def test_keys_may_be_any_integer(small_model):
    want = expected_experts(small_model)
    layer = small_model.layers[0]
    with colibri.open_store(small_model.path) as store:
        for key in [(layer, 3), (np.int64(layer), np.int32(3)), (np.uint8(layer), 3)]:
            with store.lease(*key) as ex:
                assert (ex.layer, ex.expert, ex.key) == (layer, 3, (layer, 3))
                assert type(ex.layer) is int and type(ex.expert) is int
                assert_expert_matches(ex, want[(layer, 3)])


@pytest.mark.parametrize("key", [(1.0, 0), (1, "0"), (None, 0), (1, 2.5)])
def test_a_key_that_is_not_an_integer_is_a_type_error(small_model, key):
    with colibri.open_store(small_model.path) as store:
        with pytest.raises(TypeError):
            store.lease(*key)
        assert store.active_leases == 0 and store.stats().requests == 0


@pytest.mark.parametrize("key", [(2**31, 0), (1, 2**31), (-(2**40), 0), (1, 2**100), (1, -(2**31))])
def test_a_key_beyond_a_c_int_is_an_unknown_expert(small_model, key):
    with colibri.open_store(small_model.path) as store:
        with pytest.raises(colibri.UnknownExpertError) as info:
            store.lease(*key)
        assert str(key[0]) in str(info.value) and str(key[1]) in str(info.value)
        assert store.active_leases == 0 and store.stats().requests == 0


def test_lease_takes_exactly_two_arguments(small_model):
    with colibri.open_store(small_model.path) as store:
        with pytest.raises(TypeError):
            store._leaser.lease(1)
        with pytest.raises(TypeError):
            store._leaser.lease(1, 2, 3)


def test_only_the_store_makes_leases(small_model):
    with colibri.open_store(small_model.path) as store:
        with pytest.raises(TypeError):
            LeaseBase()
        with pytest.raises(TypeError):
            colibri.ExpertLease()
        with store.lease(1, 0) as ex:
            for clone in (copy.copy, copy.deepcopy, pickle.dumps):
                with pytest.raises(TypeError):
                    clone(ex)
            with pytest.raises(AttributeError):
                ex.layer = 2                      # read-only, as the lease's slot is fixed
            with pytest.raises(AttributeError):
                ex.anything = 1                   # no __dict__


def test_leaser_checks_what_it_is_given(small_model):
    with colibri.open_store(small_model.path) as store:
        args = dict(handle_owner=store._handle, handle=1, entry_points=1, tenancies=store._tenancies,
                    lease_type=colibri.ExpertLease, error_for=error_for, lease_error=colibri.LeaseError)
        with pytest.raises(TypeError):
            Leaser(**{**args, "lease_type": dict})
        with pytest.raises(TypeError):
            Leaser(**{**args, "tenancies": {}})
        with pytest.raises(ValueError):
            Leaser(**{**args, "handle": 0})
        with pytest.raises(ValueError):
            Leaser(**{**args, "entry_points": 0})


def test_life_cycle(small_model):
    with colibri.open_store(small_model.path) as store:
        ex = store.lease(1, 2)
        assert not ex.released and store.active_leases == 1
        assert ex.__enter__() is ex
        ex.release()
        assert ex.released and store.active_leases == 0
        assert ex.__exit__(None, None, None) is None   # leaving after release() is fine
        with pytest.raises(colibri.LeaseError, match="already released"):
            ex.release()
        with pytest.raises(colibri.LeaseError, match="used after"):
            ex.gate
        held = store.lease(1, 3)
        with pytest.raises(RuntimeError, match="still held"):
            held._end_c_lease()                   # only a released lease's C lease may end
        assert store.active_leases == 1
        held.release()
        assert repr(ex) == "store.lease(1, 2)"


def test_exit_never_swallows_the_exception(small_model):
    with colibri.open_store(small_model.path) as store:
        with pytest.raises(RuntimeError, match="inside"):
            with store.lease(1, 2):
                raise RuntimeError("inside")
        assert store.active_leases == 0


def test_a_lease_dropped_unreleased_is_released_with_a_warning(small_model):
    """As Python does for a file left open; else its slot stayed leased for good."""
    layer = small_model.layers[0]
    with colibri.open_store(small_model.path, slots_per_layer=1, slot_wait_timeout=0.01) as store:
        with pytest.warns(ResourceWarning, match="never released"):
            store.lease(layer, 2)                 # dropped at once
            gc.collect()
        assert store.active_leases == 0
        with store.lease(layer, 3):               # the only slot is free again
            pass


def test_a_dropped_lease_whose_arrays_live_on_keeps_its_slot_until_they_go(small_model):
    layer = small_model.layers[0]
    want = expected_experts(small_model)[(layer, 2)]["gate"]
    with colibri.open_store(small_model.path, slots_per_layer=1, slot_wait_timeout=0.01) as store:
        with pytest.warns(ResourceWarning):
            gate = store.lease(layer, 2).gate     # the lease is garbage, its array is not
            gc.collect()
        assert store.active_leases == 1
        with pytest.raises(colibri.CacheFullError):
            store.lease(layer, 3)
        assert gate.tobytes() == want.tobytes()
        del gate
        gc.collect()
        assert store.active_leases == 0


def test_the_resource_warning_points_at_the_with_block(small_model):
    with colibri.open_store(small_model.path, slots_per_layer=2) as store:
        with pytest.warns(ResourceWarning) as record:
            with store.lease(1, 4) as ex:
                kept = ex.up
        assert record[0].filename == __file__
        assert store.active_leases == 1
        del kept
        gc.collect()
        assert store.active_leases == 0


def test_reference_counts_stay_put_on_every_path(small_model):
    layer = small_model.layers[0]
    with colibri.open_store(small_model.path, slots_per_layer=2) as store:
        watched = [store._leaser, store._tenancies, store._handle, colibri.ExpertLease,
                   colibri.UnknownExpertError]

        def counts() -> list[int]:
            gc.collect()
            return [sys.getrefcount(o) for o in watched]

        def paths() -> None:
            for e in (0, 1, 0, 2, 0):              # hits and misses
                with store.lease(layer, e) as ex:
                    ex.gate, ex.down                  # joins and leaves a tenancy
            with store.lease_many(layer, [0, 1, 0]) as group:
                [lease.up for lease in group]
            for bad in [(layer, 99), (layer, 2**40), (layer, "x")]:
                try:
                    store.lease(*bad)
                except (colibri.UnknownExpertError, TypeError):
                    pass
            try:
                store.lease_many(layer, [0, 99])
            except colibri.UnknownExpertError:
                pass
            with pytest.warns(ResourceWarning):
                with store.lease(layer, 1) as ex:
                    kept = ex.gate
            del kept

        paths()                                   # warm every cache first
        before = counts()
        for _ in range(50):
            paths()
        assert counts() == before
        assert store.active_leases == 0


def test_a_lookup_that_waits_lets_other_threads_run(small_model):
    """The lookup waits for a slot with the GIL dropped: the thread holding
    the slot can run Python and release it. A lookup that kept the GIL
    while waiting would stall this thread until its wait timed out
    (LIVENESS_S) with CacheFullError, and the test would fail."""
    layer = small_model.layers[0]
    with colibri.open_store(small_model.path, slots_per_layer=1, slot_wait_timeout=LIVENESS_S) as store:
        held = store.lease(layer, 0)
        got: dict = {}

        def waiter() -> None:
            try:
                with store.lease(layer, 1) as ex:
                    got["expert"] = ex.expert
            except colibri.CacheFullError as err:
                got["error"] = err

        t = threading.Thread(target=waiter, daemon=True)
        t.start()
        wait_until(lambda: store.stats().slot_waits == 1, "the second lookup waits for the slot")
        held.release()                            # Python in this thread, while the other waits
        t.join(LIVENESS_S)
        assert not t.is_alive() and got == {"expert": 1}


def _leaser(store, tenancies):
    """A second Leaser on store's C store, with tenancies of the test's making."""
    return Leaser(store._handle, int(ffi.cast("uintptr_t", store._handle)),
                  int(ffi.cast("uintptr_t", lib.coli_lease_entry_points())), tenancies,
                  colibri.ExpertLease, error_for, colibri.LeaseError)


def test_tenancy_and_tenancies_check_what_they_are_given():
    with pytest.raises(ValueError):
        Tenancy(1, (None,) * 5, [], object())            # six arrays or None, always
    with pytest.raises(TypeError):
        Tenancy(1, (None,) * 6, (), object())            # the chain is a list
    with pytest.raises(ValueError):
        Tenancies(len, defer, 0)
    with pytest.raises(ValueError):
        Tenancies(None, defer, 4)


def test_a_builder_that_fails_leaves_the_lease_releasable(small_model):
    layer = small_model.layers[0]
    with colibri.open_store(small_model.path) as store:
        for build in (lambda lease: 1 / 0, lambda lease: "not a Tenancy",
                      lambda lease: Tenancy(lease._generation + 1, (None,) * 6, [], object())):
            lr = _leaser(store, Tenancies(build, defer, 4))
            ex = lr.lease(layer, 1)
            with pytest.raises((ZeroDivisionError, TypeError)):
                ex.gate
            ex.release()
            assert store.active_leases == 0


def test_the_tenancy_cache_stays_bounded_and_right(small_model):
    """Every miss makes a new slot tenancy; unused ones beyond the limit are
    dropped, oldest first, and the arrays of every lease are its expert's."""
    want = expected_experts(small_model)
    layer = small_model.layers[1]
    with colibri.open_store(small_model.path, slots_per_layer=2) as store:
        limit = 2 * 2 * len(small_model.layers) + 16
        for i in range(6 * limit):
            e = (i * 3) % small_model.n_experts
            with store.lease(layer, e) as ex:
                assert_expert_matches(ex, want[(layer, e)])
            assert len(store._tenancies) <= limit
        assert store.stats().misses > 2 * limit        # the cache did fill and prune
        assert store.active_leases == 0


def test_arrays_used_only_inside_the_block_end_the_lease_at_once(small_model):
    """The escape check's baseline is exact: arrays used and dropped inside the
    block (first build of a tenancy, then its cached arrays, singly and in a
    group) raise no warning and leave no lease behind."""
    layer = small_model.layers[0]
    with colibri.open_store(small_model.path, slots_per_layer=2) as store:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                with store.lease(layer, 1) as ex:
                    assert float(np.asarray(ex.gate, dtype=np.float32).sum()) == float(
                        np.asarray(ex.gate, dtype=np.float32).sum())
                    ex.up.T @ ex.up, ex.down[0]        # views made and dropped inside
                assert store.active_leases == 0
                with store.lease_many(layer, [1, 2, 1]) as group:
                    [lease.gate for lease in group]
                assert store.active_leases == 0
