"""Arrays of a lease: shared by the leases of one slot tenancy, and never a
way to reach a slot's bytes after its lease ended.

Whatever object can reach the bytes (the array, a view or transpose of it,
its ``.base`` chain, a memoryview of it) keeps the C lease alive until it is
gone; only then may the slot be reused.
"""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest

import colibri
from conftest import expected_experts


def evict_all_but(store, layer, n_experts, keep):
    """Lease every other expert once, so any unleased slot gets reused."""
    for e in range(n_experts):
        if e != keep:
            with store.lease(layer, e):
                pass


@pytest.fixture(params=["float32", "bfloat16"])
def model(request, model_factory):
    return model_factory(layout="mixtral", n_layers=2, n_experts=6, hidden=32, intermediate=16,
                         dtype=request.param)


KEEPERS = {
    "array": lambda ex: ex.gate,
    "transpose": lambda ex: ex.gate.T,
    "slice": lambda ex: ex.gate[1:, ::2],
    "base": lambda ex: ex.gate.base,
    "base of base": lambda ex: ex.gate.base.base if isinstance(ex.gate.base, np.ndarray) else ex.gate.base,
    "memoryview": lambda ex: memoryview(ex.gate.view(f"u{ex.gate.itemsize}")),
    "frombuffer": lambda ex: np.frombuffer(ex.gate, dtype=np.uint8),
    "asarray": lambda ex: np.asarray(ex.gate),
}


@pytest.mark.parametrize("how", sorted(KEEPERS))
def test_anything_reaching_the_bytes_keeps_the_lease(model, how):
    layer = model.layers[0]
    want = expected_experts(model)[(layer, 0)]["gate"]
    with colibri.open_store(model.path, slots_per_layer=1, prefetch_workers=0, slot_wait_timeout=0.01) as store:
        with pytest.warns(ResourceWarning):
            with store.lease(layer, 0) as ex:
                kept = KEEPERS[how](ex)
        assert store.active_leases == 1          # the slot is still pinned
        with pytest.raises(colibri.CacheFullError):
            store.lease(layer, 1)                # so it cannot be reused
        gate = np.asarray(kept if not isinstance(kept, memoryview) else np.asarray(kept))
        if how in ("array", "asarray"):
            assert gate.tobytes() == want.tobytes()
        del kept, gate
        gc.collect()
        assert store.active_leases == 0
        with store.lease(layer, 1):              # and now it can
            pass


def test_leases_of_one_tenancy_share_their_arrays(model):
    layer = model.layers[1]
    with colibri.open_store(model.path, slots_per_layer=2, prefetch_workers=0) as store:
        with store.lease(layer, 3) as a:
            first = id(a.gate)
        with store.lease(layer, 3) as b:
            assert id(b.gate) == first             # the cached arrays, not new ones
            with store.lease(layer, 3) as c:       # two leases at once share them too
                assert c.gate is b.gate


def test_a_new_tenancy_gets_new_arrays_with_its_own_bytes(model):
    layer = model.layers[0]
    want = expected_experts(model)
    with colibri.open_store(model.path, slots_per_layer=1, prefetch_workers=0) as store:
        with store.lease(layer, 0) as a:
            assert a.gate.tobytes() == want[(layer, 0)]["gate"].tobytes()
        with store.lease(layer, 1) as b:           # same slot, another expert
            assert b.gate.tobytes() == want[(layer, 1)]["gate"].tobytes()
        with store.lease(layer, 0) as c:           # reloaded: a new generation
            assert c.gate.tobytes() == want[(layer, 0)]["gate"].tobytes()


def test_arrays_cannot_be_made_writeable(model):
    layer = model.layers[0]
    with colibri.open_store(model.path, prefetch_workers=0) as store:
        with store.lease(layer, 2) as ex:
            for arr in (ex.gate, ex.up, ex.down, ex.gate.T, ex.gate.base):
                if isinstance(arr, np.ndarray):
                    assert not arr.flags.writeable
                    with pytest.raises(ValueError):
                        arr.flags.writeable = True
            with pytest.raises(ValueError):
                ex.down[0, 0] = 1
            del arr  # a reference kept past the block would (rightly) keep the lease


def test_other_leases_of_the_tenancy_cover_arrays_in_use(model):
    """While another lease of the same expert is held, ending one lease is
    quiet even if arrays are in use: the other lease pins the slot."""
    layer = model.layers[0]
    with colibri.open_store(model.path, slots_per_layer=2, prefetch_workers=0) as store:
        b = store.lease(layer, 4)
        gate = b.gate
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            with store.lease(layer, 4) as a:
                assert a.gate is gate
        assert store.active_leases == 1
        del gate
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            b.release()
        assert store.active_leases == 0
