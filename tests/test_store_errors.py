"""Error paths: unknown keys, failed reads, malformed files, lease misuse, closed stores.

Each error must be of the colibri family and of the builtin it stands for
(KeyError, OSError, ValueError), say what and where, and leave the store
consistent: no lease held, no poisoned slot, the next lookup works.
"""

from __future__ import annotations

import errno
import gc
import json
import re
import struct
import warnings

import numpy as np
import pytest

import colibri
from conftest import ROLES, assert_expert_matches, expected_experts, load_all_tensors, tensor_ranges
import core_control  # the test build's control

# ---------------------------------------------------------------------------
# unknown keys


@pytest.mark.parametrize("key", [(0, 0), (99, 0), (-1, 0), (1, 8), (1, -1), (3, 10**6), (2**31 - 1, 0)])
def test_unknown_key_is_unknown_expert_error(small_model, key):
    with colibri.open_store(small_model.path) as store:
        before = store.stats()
        with pytest.raises(colibri.UnknownExpertError) as info:
            store.lease(*key)
        assert isinstance(info.value, KeyError)
        assert isinstance(info.value, colibri.ColibriError)
        assert str(key[0]) in str(info.value)
        assert store.active_leases == 0
        after = store.stats()
        assert after.requests == before.requests  # requests counts valid keys only
        assert after.misses == before.misses


@pytest.mark.parametrize("layer", [0, 99, -1])
def test_num_experts_and_slots_of_unknown_layer(small_model, layer):
    with colibri.open_store(small_model.path) as store:
        with pytest.raises(colibri.UnknownExpertError):
            store.num_experts(layer)
        with pytest.raises(KeyError):
            store.num_experts(layer)


def test_lease_many_with_one_unknown_expert_holds_nothing(small_model):
    with colibri.open_store(small_model.path, slots_per_layer=4) as store:
        with pytest.raises(colibri.UnknownExpertError):
            store.lease_many(1, [0, 1, 8, 2])
        assert store.active_leases == 0
        with pytest.raises(KeyError):
            store.lease_many(99, [0])
        assert store.active_leases == 0
        with store.lease_many(1, [0, 1, 2, 3]) as exs:  # still fully usable
            assert len(exs) == 4
        assert store.active_leases == 0


def test_lease_many_more_than_slots_is_cache_full_and_holds_nothing(small_model):
    with colibri.open_store(small_model.path, slots_per_layer=2, slot_wait_timeout=0.01) as store:
        with pytest.raises(colibri.CacheFullError):
            store.lease_many(2, [0, 1, 2])
        assert store.active_leases == 0
        with store.lease_many(2, [0, 1]):
            assert store.active_leases == 2
        assert store.active_leases == 0


def test_cache_full_after_timeout_then_ok_after_release(small_model):
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=2, slot_wait_timeout=0.01) as store:
        a = store.lease(3, 0)
        b = store.lease(3, 1)
        before = store.stats()
        with pytest.raises(colibri.CacheFullError) as info:
            store.lease(3, 2)
        assert not isinstance(info.value, (KeyError, OSError))
        after = store.stats()
        assert after.slot_waits == before.slot_waits + 1
        assert after.evictions == before.evictions
        assert store.active_leases == 2
        assert_expert_matches(a, want[(3, 0)])
        assert_expert_matches(b, want[(3, 1)])
        with store.lease(1, 2):  # another layer is not affected
            pass
        b.release()
        with store.lease(3, 2) as c:
            assert_expert_matches(c, want[(3, 2)])
        a.release()
        assert store.active_leases == 0


# ---------------------------------------------------------------------------
# failed reads


def _last_expert_in(model, path):
    """The expert whose earliest tensor byte is last in `path`, and that byte's offset."""
    ranges = tensor_ranges(model)
    best = None
    for key in model.keys():
        spans = [ranges[name] for name in model.tensor_names(*key).values()]
        if any(f != path for f, _, _ in spans):
            continue
        start = min(b for _, b, _ in spans)
        if best is None or start > best[1]:
            best = (key, start, sorted(b for _, b, _ in spans))
    return best


def test_truncated_shard_then_restored(fresh_model):
    path = fresh_model.files[0]
    (layer, expert), start, offsets = _last_expert_in(fresh_model, path)
    original = path.read_bytes()
    tensors = load_all_tensors(fresh_model)
    want = {role: tensors[name] for role, name in fresh_model.tensor_names(layer, expert).items()}
    with colibri.open_store(fresh_model.path, slots_per_layer=2) as store:
        with open(path, "r+b") as f:
            f.truncate(start)
        before = store.stats()
        with pytest.raises(colibri.ExpertLoadError) as info:
            store.lease(layer, expert)
        err = info.value
        assert isinstance(err, OSError)
        message = str(err)
        assert str(path) in message, message
        numbers = {int(n) for n in re.findall(r"\d+", message)}
        numbers |= {int(n, 16) for n in re.findall(r"0x([0-9a-fA-F]+)", message)}
        assert numbers & set(offsets), f"no tensor offset of {offsets} in {message!r}"
        assert store.active_leases == 0
        after = store.stats()
        assert after.loads_failed == before.loads_failed + 1
        assert after.resident_bytes == before.resident_bytes  # the failed load is not resident

        with open(path, "r+b") as f:
            f.write(original)
        with store.lease(layer, expert) as ex:  # no poisoned slot: it reads again
            assert_expert_matches(ex, want)
        assert store.stats().bytes_read > after.bytes_read


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_injected_read_fault_then_success(small_model, err):
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=2) as store:
        core_control.inject_read_fault(store, 1, err)
        with pytest.raises(colibri.ExpertLoadError) as info:
            store.lease(1, 5)
        assert isinstance(info.value, OSError)
        assert str(small_model.files[0]) in str(info.value)
        assert store.active_leases == 0
        s = store.stats()
        assert s.loads_failed == 1
        assert s.resident_bytes == 0
        with store.lease(1, 5) as ex:
            assert_expert_matches(ex, want[(1, 5)])
        s = store.stats()
        assert s.resident_bytes == small_model.expert_nbytes


def test_hit_does_no_io_while_fault_is_armed(small_model):
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=2) as store:
        with store.lease(2, 3):
            pass
        core_control.inject_read_fault(store, 1, errno.EIO)
        for _ in range(3):
            with store.lease(2, 3) as ex:  # hits: no read, so the fault does not fire
                assert_expert_matches(ex, want[(2, 3)])
        core_control.inject_read_fault(store, 0, 0)  # disarm
        with store.lease(2, 4) as ex:
            assert_expert_matches(ex, want[(2, 4)])
        assert store.stats().loads_failed == 0


def test_failed_load_does_not_evict_or_disturb_others(small_model):
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=2) as store:
        with store.lease(1, 0):
            pass
        with store.lease(1, 1):
            pass
        held = store.lease(1, 0)
        core_control.inject_read_fault(store, 1, errno.EIO)
        with pytest.raises(colibri.ExpertLoadError):
            store.lease(1, 2)
        assert_expert_matches(held, want[(1, 0)])
        held.release()
        assert store.active_leases == 0
        with store.lease(1, 2) as ex:
            assert_expert_matches(ex, want[(1, 2)])


# ---------------------------------------------------------------------------
# malformed files


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def _header_file(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    return _write(path, struct.pack("<Q", len(raw)) + raw + data)


def _expert_header(dtype="F32", shape=(2, 2), nbytes=16, offsets=None):
    header, pos = {}, 0
    for role, suffix in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
        off = offsets[role] if offsets else [pos, pos + nbytes]
        header[f"model.layers.0.block_sparse_moe.experts.0.{suffix}.weight"] = {
            "dtype": dtype, "shape": list(shape), "data_offsets": off,
        }
        pos += nbytes
    return header


MALFORMED = {
    "empty": lambda p: _write(p, b""),
    "short_length": lambda p: _write(p, b"\x10\x00\x00"),
    "length_past_end": lambda p: _write(p, struct.pack("<Q", 10**6) + b"{}"),
    "huge_length": lambda p: _write(p, struct.pack("<Q", 2**63) + b"{}"),
    "not_json": lambda p: _write(p, struct.pack("<Q", 8) + b"not json"),
    "json_not_object": lambda p: _write(p, struct.pack("<Q", 2) + b"[]"),
    "offsets_past_end": lambda p: _header_file(p, _expert_header(), b"\0" * 40),
    "shape_mismatch": lambda p: _header_file(p, _expert_header(shape=(3, 3)), b"\0" * 48),
    "unknown_dtype": lambda p: _header_file(p, _expert_header(dtype="Q7"), b"\0" * 48),
    "reversed_offsets": lambda p: _header_file(
        p,
        _expert_header(offsets={"gate": [16, 0], "up": [16, 32], "down": [32, 48]}),
        b"\0" * 48,
    ),
    "missing_role": lambda p: _header_file(
        p,
        {k: v for k, v in _expert_header().items() if ".w2." not in k},
        b"\0" * 48,
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_is_format_error(tmp_path, case):
    path = MALFORMED[case](tmp_path / "model.safetensors")
    with pytest.raises(colibri.FormatError) as info:
        colibri.open_store(path)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, colibri.ColibriError)


def test_wellformed_handmade_file_opens(tmp_path):
    """The baseline of the malformed cases: the same header, correct, opens."""
    data = np.arange(12, dtype=np.float32).tobytes()
    path = _header_file(tmp_path / "model.safetensors", _expert_header(), data)
    with colibri.open_store(path) as store:
        assert tuple(store.layers) == (0,)
        with store.lease(0, 0) as ex:
            assert ex.gate.tolist() == [[0.0, 1.0], [2.0, 3.0]]
            assert ex.up.tolist() == [[4.0, 5.0], [6.0, 7.0]]
            assert ex.down.tolist() == [[8.0, 9.0], [10.0, 11.0]]


def test_model_without_routed_experts_is_format_error(tmp_path):
    from safetensors.numpy import save_file

    save_file({"model.layers.0.mlp.gate_proj.weight": np.zeros((4, 4), np.float32)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(colibri.FormatError):
        colibri.open_store(tmp_path)


def test_index_pointing_at_a_corrupt_shard(tmp_path):
    from conftest import make_model

    model = make_model(tmp_path / "m", shards=3, n_layers=2, n_experts=4)
    model.files[1].write_bytes(b"\x05\x00")
    with pytest.raises(colibri.FormatError):
        colibri.open_store(model.path)


# ---------------------------------------------------------------------------
# lease misuse and closing


def test_release_twice_and_use_after_release(small_model):
    with colibri.open_store(small_model.path) as store:
        ex = store.lease(1, 1)
        assert not ex.released
        ex.release()
        assert ex.released
        assert store.active_leases == 0
        with pytest.raises(colibri.LeaseError):
            ex.release()
        for role in ROLES:
            with pytest.raises(colibri.LeaseError):
                getattr(ex, role)
        assert store.active_leases == 0
        with store.lease(1, 1) as ex2:
            pass
        with pytest.raises(colibri.LeaseError):
            ex2.release()


def test_close_with_active_leases_refuses_and_stays_usable(small_model):
    want = expected_experts(small_model)
    store = colibri.open_store(small_model.path, slots_per_layer=2)
    ex = store.lease(2, 6)
    with pytest.raises(colibri.LeaseError):
        store.close()
    assert not store.closed
    assert_expert_matches(ex, want[(2, 6)])
    with store.lease(3, 1) as other:
        assert_expert_matches(other, want[(3, 1)])
    ex.release()
    store.close()
    assert store.closed
    store.close()  # idempotent
    assert store.closed


CLOSED_CALLS = {
    "lease": lambda s: s.lease(1, 0),
    "lease_many": lambda s: s.lease_many(1, [0, 1]),
    "lease_many_empty": lambda s: s.lease_many(1, []),
    "prefetch_empty": lambda s: s.prefetch([]),
    "prefetch": lambda s: s.prefetch([(1, 0)]),
    "stats": lambda s: s.stats(),
    "wait_idle": lambda s: s.wait_idle(),
    "num_experts": lambda s: s.num_experts(1),
    "slots": lambda s: s.slots(1),
}


@pytest.mark.parametrize("call", sorted(CLOSED_CALLS))
def test_every_call_after_close_raises(small_model, call):
    with colibri.open_store(small_model.path, prefetch_workers=1) as store:
        with store.lease(1, 0):
            pass
    assert store.closed
    with pytest.raises(colibri.StoreClosedError):
        CLOSED_CALLS[call](store)
    store.close()  # still idempotent


def test_array_kept_after_its_with_block_warns(small_model):
    with colibri.open_store(small_model.path, slots_per_layer=2) as store:
        with pytest.warns(ResourceWarning):
            with store.lease(1, 4) as ex:
                a = ex.gate
        del a
        assert store.active_leases == 0


def test_array_kept_after_its_lease_stays_valid(small_model):
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=2) as store:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # its own test above
            with store.lease(1, 4) as ex:
                a = ex.gate
        assert store.active_leases == 1
        # Constant eviction pressure in that layer: every other expert, twice.
        for _ in range(2):
            for e in range(small_model.n_experts):
                if e != 4:
                    with store.lease(1, e) as other:
                        assert_expert_matches(other, want[(1, e)])
        assert store.stats().evictions > 0
        assert a.tobytes() == want[(1, 4)]["gate"].tobytes()
        assert store.active_leases == 1
        with pytest.raises(colibri.LeaseError):
            store.close()
        del a
        assert store.active_leases == 0


def test_view_of_a_kept_array_keeps_the_lease(small_model):
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=1, slot_wait_timeout=0.01) as store:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            with store.lease(3, 2) as ex:
                row = ex.up[1:3, ::2]  # a strided view of a view
                raw = ex.down.view(np.uint8)
        del ex
        assert store.active_leases == 1
        with pytest.raises(colibri.CacheFullError):
            store.lease(3, 5)
        np.testing.assert_array_equal(row, want[(3, 2)]["up"][1:3, ::2])
        assert raw.tobytes() == want[(3, 2)]["down"].tobytes()
        del row
        assert store.active_leases == 1
        del raw
        assert store.active_leases == 0


def test_array_kept_after_release_method_stays_valid(small_model):
    want = expected_experts(small_model)
    with colibri.open_store(small_model.path, slots_per_layer=1, slot_wait_timeout=0.01) as store:
        ex = store.lease(2, 0)
        down = ex.down
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # a warning here is allowed, not required
            ex.release()
        del ex
        gc.collect()
        assert store.active_leases == 1
        with pytest.raises(colibri.CacheFullError):
            store.lease(2, 1)  # the one slot is still held by `down`
        assert down.tobytes() == want[(2, 0)]["down"].tobytes()
        del down
        assert store.active_leases == 0
        with store.lease(2, 1) as ex:
            assert_expert_matches(ex, want[(2, 1)])


def test_exception_in_with_block_is_not_masked_by_close(small_model):
    with pytest.raises(ZeroDivisionError):
        with colibri.open_store(small_model.path, prefetch_workers=0) as store:
            ex = store.lease(small_model.layers[0], 0)
            1 / 0
    assert not store.closed  # a lease is still held, so it stayed open
    ex.release()
    store.close()
    assert store.closed


@pytest.mark.parametrize("timeout", [float("inf"), 1e30])
def test_huge_and_infinite_timeouts_mean_forever(small_model, timeout):
    with colibri.open_store(small_model.path, prefetch_workers=1, slot_wait_timeout=timeout) as store:
        store.prefetch([(small_model.layers[0], 0)])
        store.wait_idle(timeout=timeout)
        with store.lease(small_model.layers[0], 0):
            pass


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), float("-inf")])
def test_negative_or_nan_timeouts_are_refused(small_model, timeout):
    with pytest.raises(colibri.FormatError):
        colibri.open_store(small_model.path, slot_wait_timeout=timeout)
    with colibri.open_store(small_model.path, prefetch_workers=0) as store:
        with pytest.raises(colibri.FormatError):
            store.wait_idle(timeout=timeout)



def test_c_error_codes_map_onto_the_exception_family():
    from colibri.errors import error_for

    expected = {-2: (colibri.UnknownExpertError, KeyError), -3: (colibri.CacheFullError,),
                -4: (colibri.ExpertLoadError, OSError), -5: (colibri.CacheMemoryError, MemoryError),
                -6: (colibri.FormatError, ValueError), -7: (colibri.LeaseError,),
                -9: (colibri.WaitTimeoutError, TimeoutError), -10: (colibri.StoreClosedError,),
                -1: (colibri.ColibriError,), -8: (colibri.ColibriError,)}
    for code, classes in expected.items():
        err = error_for(code, f"message {code}")
        assert all(isinstance(err, c) for c in classes), (code, type(err))
        assert str(err) == f"message {code}"
