"""Data integrity: every leased tensor is, byte for byte, the tensor in the file.

Covers single-file models, sharded models (3 shards, an expert's tensors may
straddle two files), one .safetensors path and a list of files; F32, F16 and
BF16; both layouts; dense leading layers and shared experts that must not be
mistaken for routed experts; odd tensor sizes; re-reads after eviction.
"""

from __future__ import annotations

import tempfile
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import colibri
from colibri.synthetic import write_synthetic_model
from conftest import ROLES, assert_expert_matches, expected_experts, load_all_tensors

DTYPES = ("float32", "float16", "bfloat16")
LAYOUTS = ("mixtral", "mlp_experts")
INPUTS = ("dir_single", "dir_sharded", "file", "file_list")


def _model_and_path(model_factory, layout, dtype, kind):
    shards = 3 if kind in ("dir_sharded", "file_list") else 1
    model = model_factory(
        layout=layout, dtype=dtype, shards=shards, n_layers=4, n_experts=8,
        dense_layers=1, shared_experts=True,
    )
    if kind in ("dir_single", "dir_sharded"):
        path = model.path
    elif kind == "file":
        path = model.files[0]
    else:
        path = [str(f) for f in model.files]
    return model, path


@pytest.mark.parametrize("kind", INPUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_expert_matches_the_file(model_factory, layout, dtype, kind):
    model, path = _model_and_path(model_factory, layout, dtype, kind)
    want = expected_experts(model)
    # 3 slots per layer for 8 experts: two passes force evictions and re-reads.
    with colibri.open_store(path, slots_per_layer=3) as store:
        assert tuple(store.layers) == model.layers  # dense layer 0 has no experts
        for layer in model.layers:
            assert store.num_experts(layer) == model.n_experts  # shared experts not counted
            assert store.slots(layer) == 3
        for _ in range(2):
            for layer, expert in model.keys():
                with store.lease(layer, expert) as ex:
                    assert ex.layer == layer and ex.expert == expert
                    assert ex.key == (layer, expert)
                    assert_expert_matches(ex, want[(layer, expert)])
        assert store.active_leases == 0
        stats = store.stats()
        assert stats.misses >= len(model.keys())
        assert stats.evictions > 0
        assert stats.loads_failed == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_and_shape_are_the_files(model_factory, dtype):
    model = model_factory(layout="mlp_experts", dtype=dtype, n_layers=2, n_experts=4,
                          hidden=20, intermediate=12)
    with colibri.open_store(model.path) as store:
        with store.lease(model.layers[-1], 3) as ex:
            assert ex.gate.shape == (12, 20)
            assert ex.up.shape == (12, 20)
            assert ex.down.shape == (20, 12)
            for role in ROLES:
                assert getattr(ex, role).dtype == model.np_dtype
            assert_expert_matches(ex, expected_experts(model)[(model.layers[-1], 3)])


def test_bf16_arrays_are_ml_dtypes_bfloat16(model_factory):
    import ml_dtypes

    model = model_factory(dtype="bfloat16", n_layers=2, n_experts=2)
    with colibri.open_store(model.path) as store:
        with store.lease(0, 1) as ex:
            assert ex.gate.dtype == np.dtype(ml_dtypes.bfloat16)
            want = expected_experts(model)[(0, 1)]["gate"]
            # Values too, not only bytes: bf16 decodes to the same floats.
            np.testing.assert_array_equal(ex.gate.astype(np.float32), want.astype(np.float32))


def test_arrays_are_read_only_and_zero_copy(small_model):
    with colibri.open_store(small_model.path, slots_per_layer=2) as store:
        with store.lease(1, 0) as ex:
            for role in ROLES:
                a = getattr(ex, role)
                assert not a.flags.writeable
                assert not a.flags.owndata  # a view over the slot, not a copy
                with pytest.raises(ValueError):
                    a[0, 0] = 1
                with pytest.raises(ValueError):
                    a.setflags(write=True)
                del a
            # Two reads of the same attribute see the same memory.
            assert ex.gate.__array_interface__["data"][0] == ex.gate.__array_interface__["data"][0]


def test_distinct_experts_have_distinct_memory(small_model):
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=4) as store:
        with store.lease_many(2, [0, 1, 2, 3]) as exs:
            addresses = set()
            for ex in exs:
                for role in ROLES:
                    a = getattr(ex, role)
                    start = a.__array_interface__["data"][0]
                    addresses.add((start, start + a.nbytes))
                    del a
                assert_expert_matches(ex, want[ex.key])
            ranges = sorted(addresses)
            assert len(ranges) == 12
            for (_, end), (nxt, _) in zip(ranges, ranges[1:]):
                assert end <= nxt, "two leased tensors overlap in memory"


def test_lease_many_order_and_duplicates(small_model):
    want = expected_experts(small_model)
    order = [5, 2, 5, 7]
    with colibri.open_store(small_model.path, slots_per_layer=3) as store:
        with store.lease_many(3, order) as exs:
            assert isinstance(exs, tuple)
            assert [ex.expert for ex in exs] == order
            assert all(ex.layer == 3 for ex in exs)
            for ex in exs:
                assert_expert_matches(ex, want[ex.key])
            assert store.active_leases == len(order)
        assert store.active_leases == 0


def test_layers_use_model_indices_with_dense_prefix(model_factory):
    model = model_factory(n_layers=5, n_experts=3, dense_layers=2)
    with colibri.open_store(model.path) as store:
        assert tuple(store.layers) == (2, 3, 4)
        with store.lease(4, 2) as ex:
            assert_expert_matches(ex, expected_experts(model)[(4, 2)])


def test_default_slots_capped_at_expert_count(model_factory):
    few = model_factory(n_layers=2, n_experts=4)
    many = model_factory(n_layers=2, n_experts=12, hidden=16, intermediate=8)
    with colibri.open_store(few.path) as store:
        assert [store.slots(layer) for layer in store.layers] == [4, 4]
    with colibri.open_store(many.path) as store:
        assert [store.slots(layer) for layer in store.layers] == [8, 8]


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_direct_io_reads_the_same_bytes(model_factory, dtype, shards):
    """O_DIRECT needs aligned reads; odd tensor sizes (20x12 half) are not aligned."""
    model = model_factory(dtype=dtype, shards=shards, n_layers=3, n_experts=5, hidden=20, intermediate=12)
    want = expected_experts(model)
    with colibri.open_store(model.path, slots_per_layer=2, direct_io=True) as store:
        for _ in range(2):
            for key in model.keys():
                with store.lease(*key) as ex:
                    assert_expert_matches(ex, want[key])
        s = store.stats()
        assert s.resident_bytes == 2 * len(model.layers) * model.expert_nbytes
        assert s.resident_bytes <= s.capacity_bytes


@given(
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(DTYPES),
    n_layers=st.integers(1, 3),
    n_experts=st.integers(1, 5),
    hidden=st.integers(1, 24),
    intermediate=st.integers(1, 24),
    shards=st.integers(1, 4),
    shared=st.booleans(),
    slots=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_round_trip(layout, dtype, n_layers, n_experts, hidden, intermediate,
                                  shards, shared, slots, seed):
    with tempfile.TemporaryDirectory() as d:
        model = write_synthetic_model(
            d, layout=layout, dtype=dtype, n_layers=n_layers, n_experts=n_experts,
            hidden=hidden, intermediate=intermediate, shards=shards, shared_experts=shared, seed=seed,
        )
        tensors = load_all_tensors(model)
        with colibri.open_store(model.path, slots_per_layer=slots) as store:
            assert tuple(store.layers) == model.layers
            for key in model.keys() * 2:
                names = model.tensor_names(*key)
                with store.lease(*key) as ex:
                    assert_expert_matches(ex, {role: tensors[name] for role, name in names.items()})
            s = store.stats()
            assert s.requests == s.hits + s.misses == 2 * len(model.keys())
            assert s.bytes_read == s.misses * model.expert_nbytes
            assert s.resident_bytes <= s.capacity_bytes


def test_array_kept_from_a_lease_many_member(small_model):
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=2, slot_wait_timeout=0.01) as store:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            with store.lease_many(1, [3, 6]) as exs:
                kept = exs[1].up
        del exs
        assert store.active_leases == 1
        for e in (0, 1, 2):  # the other slot churns; 6's slot must not
            with store.lease(1, e) as ex:
                assert_expert_matches(ex, want[(1, e)])
        assert kept.tobytes() == want[(1, 6)]["up"].tobytes()
        del kept
        assert store.active_leases == 0
