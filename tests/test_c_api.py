"""The C lease contract (csrc/expert_store.h, csrc/coli_store.h) through cffi.

These tests drive ``coli_expert_lookup`` / ``coli_expert_release`` and the
``coli_store_*`` functions directly on the store's ``ColiExpertStore *``:
zeroed views, double releases, failed lookups, NULL stores, stale generations
after a slot was repurposed, lookups into a view that still holds a lease,
out-of-range keys, and that the stats struct maps onto StoreStats field for
field. Every raw lease taken here is released before the store closes.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import colibri
from colibri._ffi import ffi, lib
from conftest import ROLES, expected_experts
import core_control  # the test build's control

VIEW_SIZE = ffi.sizeof("ColiExpertView")
STATS_FIELDS = (
    "requests", "hits", "misses", "prefetched", "prefetch_hits", "bytes_read",
    "resident_bytes", "capacity_bytes", "persistent_hits", "transient_hits",
    "inflight_joins", "loads_started", "loads_failed", "evictions", "slot_waits",
    "peak_inflight",
)


def key(layer, expert):
    k = ffi.new("ColiExpertKey *")
    k.layer, k.expert = layer, expert
    return k[0]


def new_view():
    return ffi.new("ColiExpertView *")


def is_zeroed(view) -> bool:
    return ffi.buffer(view, VIEW_SIZE)[:] == b"\0" * VIEW_SIZE


def tensor_bytes(t) -> bytes:
    return ffi.buffer(t.data, t.data_bytes)[:]


def active(store) -> int:
    return int(lib.coli_store_active_leases(store._handle))


def assert_view_matches(view, want, layer, expert, model):
    assert (view.key.layer, view.key.expert) == (layer, expert)
    assert view.lease != ffi.NULL
    for role in ROLES:
        t = getattr(view, role)
        assert t.data != ffi.NULL
        assert t.format == lib.COLI_TENSOR_F32
        assert t.scale_format == lib.COLI_SCALE_NONE
        assert t.scales == ffi.NULL
        assert (t.rows, t.columns) == want[role].shape
        assert t.data_bytes == want[role].nbytes
        assert tensor_bytes(t) == want[role].tobytes(), f"{role} of ({layer}, {expert})"


@pytest.fixture
def store(small_model):
    s = colibri.open_store(small_model.path, slots_per_layer=1, slot_wait_timeout=0.01, prefetch_workers=0)
    yield s
    assert active(s) == 0, "a test leaked a raw lease"
    s.close()


def test_lookup_then_release_zeroes_the_view(store, small_model):
    want = expected_experts(small_model)
    view = new_view()
    assert lib.coli_expert_lookup(store._handle, key(1, 2), view) == 0
    assert_view_matches(view, want[(1, 2)], 1, 2, small_model)
    assert active(store) == 1
    assert store.active_leases == 1
    lib.coli_expert_release(store._handle, view)
    assert is_zeroed(view)
    assert active(store) == 0


def test_release_of_a_zeroed_view_is_a_noop(store):
    before = store.stats()
    view = new_view()
    lib.coli_expert_release(store._handle, view)
    assert is_zeroed(view)
    lib.coli_expert_release(store._handle, ffi.NULL)  # NULL view: nothing happens
    lib.coli_expert_release(ffi.NULL, view)           # NULL store: the view is zeroed
    assert is_zeroed(view)
    assert active(store) == 0
    assert store.stats() == before


def test_double_release_is_a_noop_the_second_time(store, small_model):
    want = expected_experts(small_model)
    held, view = new_view(), new_view()
    assert lib.coli_expert_lookup(store._handle, key(2, 0), held) == 0
    # A second lease of the same expert: the slot stays leased after one release.
    assert lib.coli_expert_lookup(store._handle, key(2, 0), view) == 0
    assert active(store) == 2
    lib.coli_expert_release(store._handle, view)
    lib.coli_expert_release(store._handle, view)
    assert is_zeroed(view)
    assert active(store) == 1, "the second release dropped another lease"
    assert_view_matches(held, want[(2, 0)], 2, 0, small_model)
    lib.coli_expert_release(store._handle, held)
    assert active(store) == 0


def test_failed_lookup_leaves_the_view_zeroed(store):
    view = new_view()
    view.key.layer, view.key.expert = 5, 5
    view.gate.rows = 123
    view.down.data_bytes = 77
    assert lib.coli_expert_lookup(store._handle, key(1, 99), view) == lib.COLI_ENOTFOUND
    assert is_zeroed(view)
    # Cache full: the layer's only slot is leased.
    held = new_view()
    assert lib.coli_expert_lookup(store._handle, key(3, 0), held) == 0
    view.up.columns = 9
    rc = lib.coli_expert_lookup(store._handle, key(3, 1), view)
    assert rc == lib.COLI_EFULL
    assert is_zeroed(view)
    assert active(store) == 1
    lib.coli_expert_release(store._handle, held)


def test_null_store_gives_minus_one_and_a_zeroed_view():
    view = new_view()
    view.key.layer = 3
    view.lease_generation = 42
    assert lib.coli_expert_lookup(ffi.NULL, key(1, 0), view) == -1
    assert is_zeroed(view)
    assert lib.coli_expert_lookup(ffi.NULL, key(1, 0), ffi.NULL) == -1


def test_stale_generation_is_ignored_after_the_slot_was_reused(store, small_model):
    want = expected_experts(small_model)
    first = new_view()
    assert lib.coli_expert_lookup(store._handle, key(1, 0), first) == 0
    generation = first.lease_generation
    # Forge a stale copy (test only: the contract forbids copying views).
    stale = new_view()
    ffi.memmove(stale, first, VIEW_SIZE)
    lib.coli_expert_release(store._handle, first)

    # One slot per layer: expert 1 repurposes the slot expert 0 had.
    second = new_view()
    assert lib.coli_expert_lookup(store._handle, key(1, 1), second) == 0
    assert second.lease == stale.lease, "expected the same physical slot"
    assert second.lease_generation != generation
    assert active(store) == 1

    lib.coli_expert_release(store._handle, stale)  # must be ignored
    assert is_zeroed(stale)
    assert active(store) == 1, "a stale release dropped another expert's lease"
    # The survivor still holds the slot: no one else can take it...
    third = new_view()
    assert lib.coli_expert_lookup(store._handle, key(1, 2), third) == lib.COLI_EFULL
    # ...and its bytes are intact.
    assert_view_matches(second, want[(1, 1)], 1, 1, small_model)

    lib.coli_expert_release(store._handle, second)
    assert active(store) == 0
    assert lib.coli_expert_lookup(store._handle, key(1, 2), third) == 0
    assert_view_matches(third, want[(1, 2)], 1, 2, small_model)
    lib.coli_expert_release(store._handle, third)


def test_stale_release_after_a_rehit_of_the_same_expert(store):
    """The same expert evicted and reloaded into the same slot: the old view is still stale."""
    first = new_view()
    assert lib.coli_expert_lookup(store._handle, key(2, 4), first) == 0
    stale = new_view()
    ffi.memmove(stale, first, VIEW_SIZE)
    lib.coli_expert_release(store._handle, first)
    other = new_view()
    assert lib.coli_expert_lookup(store._handle, key(2, 5), other) == 0  # evicts 4
    lib.coli_expert_release(store._handle, other)
    again = new_view()
    assert lib.coli_expert_lookup(store._handle, key(2, 4), again) == 0  # 4 reloaded
    lib.coli_expert_release(store._handle, stale)
    assert active(store) == 1, "a stale view of an earlier load of the same expert ended the lease"
    lib.coli_expert_release(store._handle, again)
    assert active(store) == 0


def test_lookup_into_a_view_holding_a_lease_fails_and_releases_it(store):
    view = new_view()
    assert lib.coli_expert_lookup(store._handle, key(1, 3), view) == 0
    assert active(store) == 1
    rc = lib.coli_expert_lookup(store._handle, key(2, 3), view)
    assert rc == lib.COLI_ELEASE == -7
    assert is_zeroed(view)
    assert active(store) == 0, "the lease the view held leaked"
    # Same key into a holding view: same answer.
    assert lib.coli_expert_lookup(store._handle, key(1, 3), view) == 0
    assert lib.coli_expert_lookup(store._handle, key(1, 3), view) == lib.COLI_ELEASE
    assert is_zeroed(view)
    assert active(store) == 0


@pytest.mark.parametrize(
    "layer,expert",
    [(-1, 0), (0, 0), (4, 0), (1000, 0), (-(2**31), 0), (2**31 - 1, 0),
     (1, -1), (1, 8), (1, 2**31 - 1), (1, -(2**31))],
)
def test_out_of_range_keys_are_not_found(store, layer, expert):
    before = store.stats()
    view = new_view()
    assert lib.coli_expert_lookup(store._handle, key(layer, expert), view) == lib.COLI_ENOTFOUND == -2
    assert is_zeroed(view)
    err = ffi.new("char[]", lib.COLI_ERR_LEN)
    assert lib.coli_store_lookup(store._handle, layer, expert, view, err, lib.COLI_ERR_LEN) == lib.COLI_ENOTFOUND
    message = ffi.string(err).decode()
    assert str(layer) in message
    assert is_zeroed(view)
    after = store.stats()
    assert after.requests == before.requests
    assert active(store) == 0


def test_lookup_many_failure_zeroes_every_view(small_model):
    with colibri.open_store(small_model.path, slots_per_layer=3, slot_wait_timeout=0.01) as store:
        views = ffi.new("ColiExpertView[]", 3)
        err = ffi.new("char[]", lib.COLI_ERR_LEN)
        ids = ffi.new("int[]", [0, 1, 42])
        assert lib.coli_store_lookup_many(store._handle, 2, ids, 3, views, err, lib.COLI_ERR_LEN) == lib.COLI_ENOTFOUND
        assert "42" in ffi.string(err).decode()
        for i in range(3):
            assert is_zeroed(views + i)
        assert active(store) == 0
        ids = ffi.new("int[]", [0, 1, 2])
        assert lib.coli_store_lookup_many(store._handle, 2, ids, 3, views, err, lib.COLI_ERR_LEN) == 0
        assert active(store) == 3
        for i in range(3):
            assert views[i].key.expert == i
            lib.coli_expert_release(store._handle, views + i)
        assert active(store) == 0


def test_stats_struct_maps_onto_store_stats(small_model):
    assert tuple(f.name for f in dataclasses.fields(colibri.StoreStats))[: len(STATS_FIELDS)] == STATS_FIELDS
    with colibri.open_store(small_model.path, slots_per_layer=2) as store:
        for e in (0, 1, 2, 0, 2):
            with store.lease(1, e):
                pass
        raw = ffi.new("ColiExpertStoreStats *")
        store._handle.ops.stats(store._handle, raw)
        py = store.stats()
        for name in STATS_FIELDS:
            assert getattr(py, name) == getattr(raw, name), name
        assert (py.requests, py.hits, py.misses, py.evictions) == (5, 1, 4, 2)
        assert py.hit_rate == pytest.approx(1 / 5)


def test_layer_slots_and_slot_bytes(small_model):
    with colibri.open_store(small_model.path, slots_per_layer=3) as store:
        h = store._handle
        for layer in small_model.layers:
            assert lib.coli_store_layer_slots(h, layer) == 3
            assert core_control.slot_bytes(h, layer) >= small_model.expert_nbytes
        for layer in (0, -1, 99):  # no experts there
            assert lib.coli_store_layer_slots(h, layer) == 0
            assert core_control.slot_bytes(h, layer) == 0


def test_prefetch_op_without_workers_accepts_nothing(store):
    keys = ffi.new("ColiExpertKey[]", [(1, 0), (1, 1)])
    assert store._handle.ops.prefetch(store._handle, keys, 2) == 0
    assert store._handle.ops.prefetch(store._handle, ffi.NULL, 0) == 0
    assert store.stats().prefetched == 0
    assert store.stats().resident_bytes == 0


def test_lookup_resident_takes_hits_only_and_changes_nothing_else(store, small_model):
    """coli_store_lookup_resident: the hit of coli_store_lookup, counted alike;
    anything else is COLI_EAGAIN with a zeroed view and nothing counted."""
    want = expected_experts(small_model)
    view = new_view()
    before = store.stats()
    for layer, expert in [(1, 2), (0, 0), (1, 99), (-1, 0), (99, 0)]:   # missing, unknown
        assert lib.coli_store_lookup_resident(store._handle, layer, expert, view) == lib.COLI_EAGAIN
        assert is_zeroed(view)
    assert lib.coli_store_lookup_resident(ffi.NULL, 1, 2, view) == lib.COLI_EAGAIN
    assert store.stats() == before and active(store) == 0

    assert lib.coli_store_lookup(store._handle, 1, 2, view, ffi.NULL, 0) == 0   # a miss loads it
    lib.coli_expert_release(store._handle, view)
    loaded = store.stats()
    assert lib.coli_store_lookup_resident(store._handle, 1, 2, view) == 0       # now a hit
    assert_view_matches(view, want[(1, 2)], 1, 2, small_model)
    after = store.stats()
    assert (after.requests, after.hits, after.misses) == (loaded.requests + 1, loaded.hits + 1, loaded.misses)
    assert after.bytes_read == loaded.bytes_read
    held = new_view()
    assert lib.coli_store_lookup_resident(store._handle, 1, 2, held) == 0       # a second lease of it
    lib.coli_expert_release(store._handle, held)
    lib.coli_expert_release(store._handle, view)

    store.close()
    assert lib.coli_store_lookup_resident(store._handle, 1, 2, view) == lib.COLI_EAGAIN   # closed
    assert is_zeroed(view)


def _plan_config(model_factory, **options):
    from colibri.layouts import scan_model
    from colibri.store import StoreOptions, _Config

    model = model_factory(n_layers=3, n_experts=9, hidden=40, intermediate=56, dtype="float16")
    base = dict(slots_per_layer=None, capacity_bytes=None, prefetch_workers=0, direct_io=False,
                slot_wait_timeout=1.0)
    return _Config(scan_model(model.path), StoreOptions(**{**base, **options}))


@given(per_layer=st.integers(1, 160_000), direct=st.booleans(), slots=st.none() | st.integers(1, 12))
@settings(max_examples=40, deadline=None)
def test_plan_slots_are_the_slots_create_gives(model_factory, per_layer, direct, slots):
    """coli_store_plan_slots gives each layer the slots coli_store_create gives
    it, for any budget (an expert of 13,440 bytes takes a 16 KiB slot)."""
    config = _plan_config(model_factory, capacity_bytes=None if slots else 3 * per_layer,
                          slots_per_layer=slots, direct_io=direct)
    try:
        planned = config.layer_slots()
    except colibri.FormatError as exc:
        with pytest.raises(colibri.FormatError, match="too small"):
            config.create()
        assert "too small" in str(exc)
        return
    handle = config.create()   # destroyed when collected
    assert planned == {layer: int(lib.coli_store_layer_slots(handle, layer)) for layer in planned}


def test_plan_slots_opens_no_file(model_factory, tmp_path):
    config = _plan_config(model_factory, capacity_bytes=3 * 10 * 13_440)
    gone = ffi.new("char[]", str(tmp_path / "missing.safetensors").encode())
    files = ffi.new("const char *[]", [gone] * config.cfg.n_files)
    config.cfg.files = files   # both stay alive as locals
    assert set(config.layer_slots().values()) == {8}   # ten experts' bytes, eight 16 KiB slots
    with pytest.raises(colibri.ColibriError, match="missing.safetensors"):
        config.create()


def test_plan_slots_refuses_what_create_refuses():
    err = ffi.new("char[]", lib.COLI_ERR_LEN)
    out = ffi.new("uint32_t[]", 4)
    assert lib.coli_store_plan_slots(ffi.NULL, out, 4, err, lib.COLI_ERR_LEN) == lib.COLI_EINVAL
    cfg = ffi.new("ColiStoreConfig *")
    assert lib.coli_store_plan_slots(cfg, out, 4, err, lib.COLI_ERR_LEN) == lib.COLI_ECONFIG
    assert b"no experts" in ffi.string(err)
    src = ffi.new("ColiExpertSource[]", 2)
    src[0].layer, src[0].expert, src[1].layer, src[1].expert = 0, 0, 5, 1
    cfg.experts, cfg.n_experts, cfg.slots_per_layer = src, 2, 4
    cfg.replay, cfg.replay_expert_bytes = 1, 5000
    assert lib.coli_store_plan_slots(cfg, out, 4, err, lib.COLI_ERR_LEN) == 2   # layers 0 and 5
    assert list(out)[:2] == [1, 1]   # capped at their experts: one each
    cfg.replay = 0   # replay_expert_bytes is for a replay store only
    assert lib.coli_store_plan_slots(cfg, out, 4, err, lib.COLI_ERR_LEN) == lib.COLI_ECONFIG
    assert b"replay_expert_bytes" in ffi.string(err)
