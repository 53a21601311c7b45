"""open_store(usage_file=..., pinned_bytes=...): the usage history of a live store."""

from __future__ import annotations

import os

import numpy as np
import pytest

import colibri
from colibri import FormatError, Usage
from colibri.synthetic import write_synthetic_model


def serve(store, layer_experts: dict[int, list[list[int]]]) -> None:
    for layer, rows in layer_experts.items():
        for row in rows:
            with store.lease_many(layer, row):
                pass


def test_history_counts_requests_and_survives_reopen(small_model, tmp_path):
    path = tmp_path / "usage.npz"
    with colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=0, usage_file=path,
                           usage_half_life=None) as store:
        assert store.usage is not None and store.usage.requests(1) == 0
        serve(store, {1: [[0, 1], [0, 2]], 3: [[5, 6]]})
        store.save_usage()
        saved = Usage.load(path)
        assert saved.counts(1).tolist()[:3] == [2.0, 1.0, 1.0] and saved.counts(3)[5] == 1.0
        assert saved.turns == 0
        serve(store, {1: [[0, 1]]})
    after = Usage.load(path)  # close saved again and ended the turn
    assert after.counts(1).tolist()[:3] == [3.0, 2.0, 1.0] and after.turns == 1
    with colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=0, usage_file=path,
                           usage_half_life=None) as store:
        assert store.usage.counts(1).tolist()[:3] == [3.0, 2.0, 1.0]
        serve(store, {2: [[7]]})
    assert Usage.load(path).counts(2)[7] == 1.0 and Usage.load(path).counts(1)[0] == 3.0


def test_decay_applies_per_layer_requests(small_model, tmp_path):
    path = tmp_path / "usage.npz"
    with colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=0, usage_file=path,
                           usage_half_life=2.0) as store:
        serve(store, {1: [[0, 1]]})
        store.save_usage()
        serve(store, {1: [[2, 3]]})  # two more requests of layer 1: the first two weigh half
    c = Usage.load(path).counts(1)
    assert c[:4].tolist() == pytest.approx([0.5, 0.5, 1.0, 1.0])


def test_another_models_history_is_refused_unless_told(small_model, tmp_path):
    other = write_synthetic_model(tmp_path / "other", layout="mixtral", n_layers=4, n_experts=8, dense_layers=1,
                                  dtype="float16")
    path = tmp_path / "usage.npz"
    with colibri.open_store(other.path, slots_per_layer=2, prefetch_workers=0, usage_file=path) as store:
        serve(store, {1: [[3]]})
    before = path.read_bytes()
    with pytest.raises(FormatError, match="usage.npz.*another model"):
        colibri.open_store(small_model.path, slots_per_layer=2, prefetch_workers=0, usage_file=path)
    assert path.read_bytes() == before
    with colibri.open_store(small_model.path, slots_per_layer=2, prefetch_workers=0, usage_file=path,
                           usage_any_model=True) as store:
        assert store.usage.counts(1)[3] > 0  # same layers and expert counts: carried over


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_damaged_history_is_a_format_error_and_left_alone(small_model, tmp_path, damage):
    path = tmp_path / "usage.npz"
    with colibri.open_store(small_model.path, slots_per_layer=2, prefetch_workers=0, usage_file=path) as store:
        serve(store, {1: [[0, 1]]})
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[len(data) // 3] ^= 0xFF
    else:
        data = bytearray(os.urandom(200))
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="usage.npz"):
        colibri.open_store(small_model.path, slots_per_layer=2, prefetch_workers=0, usage_file=path)
    assert path.read_bytes() == bytes(data)  # nothing was applied or rewritten


def test_failed_save_keeps_the_old_file(small_model, tmp_path, monkeypatch):
    path = tmp_path / "usage.npz"
    with colibri.open_store(small_model.path, slots_per_layer=2, prefetch_workers=0, usage_file=path) as store:
        serve(store, {1: [[0]]})
    before = path.read_bytes()
    store = colibri.open_store(small_model.path, slots_per_layer=2, prefetch_workers=0, usage_file=path)
    serve(store, {1: [[1, 2]]})

    def refuse(src, dst):
        raise OSError("injected: rename failed")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="injected"):
        store.save_usage()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["usage.npz"]
    monkeypatch.undo()
    store.close()
    assert Usage.load(path).counts(1)[1] > 0


def test_pinned_bytes_pins_the_hottest(small_model, tmp_path):
    path = tmp_path / "usage.npz"
    with colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=0, usage_file=path,
                           usage_half_life=None) as store:
        serve(store, {1: [[6, 7]] * 5 + [[0]], 2: [[3]] * 4 + [[1]], 3: [[2]]})
    nbytes = store.model.expert_nbytes(1)
    with colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=0, usage_file=path,
                           pinned_bytes=3 * nbytes) as store:
        pinned = set(store.pinned)
        assert len(pinned) == 3
        assert pinned == {(3, 2), (2, 3), (1, 6)}  # by share of their layer's requests: 1.0, 0.8, 5/11
        assert all(sum(1 for l, _ in pinned if l == layer) <= 2 for layer in (1, 2, 3))  # half the slots
        serve(store, {l: [[e]] for l, e in pinned})
        serve(store, {1: [[0], [1], [2], [3], [4], [5]]})
        s = store.stats()
        assert s.persistent_hits == len(pinned)
        assert s.persistent_hits + s.transient_hits == s.hits
        for layer, e in pinned:
            with store.lease(layer, e) as ex:
                assert ex.key == (layer, e)
        assert set(store.pinned) == pinned  # never evicted


def test_pinned_bytes_needs_a_history(small_model, tmp_path):
    with pytest.raises(FormatError, match="usage_file"):
        colibri.open_store(small_model.path, pinned_bytes=1000)
    with pytest.raises(FormatError, match="no usage history"):
        with colibri.open_store(small_model.path, prefetch_workers=0) as store:
            store.save_usage()


def test_usage_seeds_plan_and_replay_on_a_trace(small_model, tmp_path):
    """A history recorded by a live store plans the same budgets as the trace it saw."""
    path = tmp_path / "usage.npz"
    rng = np.random.default_rng(0)
    rec_rows = {l: [list(rng.choice(8, size=2, replace=False)) for _ in range(30)] for l in (1, 2, 3)}
    with colibri.open_store(small_model.path, slots_per_layer=4, prefetch_workers=0, usage_file=path,
                           usage_half_life=None) as store:
        rec = colibri.TraceRecorder(store)
        for t in range(30):
            for l in (1, 2, 3):
                with rec.lease_many(l, rec_rows[l][t]):
                    pass
        trace = rec.trace()
    u = Usage.load(path)
    for l in (1, 2, 3):
        assert u.counts(l).tolist() == trace.counts()[l].astype(float).tolist()


def _odd_model_and_history(tmp_path):
    """A model whose experts are 13,440 bytes (a 16 KiB slot each) and a
    usage history in which twelve experts of each layer are hot."""
    model = write_synthetic_model(tmp_path / "m", n_layers=2, n_experts=16, hidden=40, intermediate=56,
                                  dtype="float16")
    path = tmp_path / "usage.npz"
    with colibri.open_store(model.path, slots_per_layer=12, prefetch_workers=0, usage_file=path,
                           usage_half_life=None) as store:
        serve(store, {layer: [list(range(12))] * 3 for layer in store.layers})
    return model, path, store.model.expert_nbytes(0)


def test_pinned_bytes_pin_at_most_half_of_the_slots_c_gives(tmp_path):
    """The slots come from C, which divides the budget by each expert's
    footprint rounded up to 4 KiB: an expert of 13,440 bytes takes a 16 KiB
    slot, so a budget of ten experts a layer is eight slots, of which four may
    be pinned (not five, as ten slots would allow)."""
    model, path, nbytes = _odd_model_and_history(tmp_path)
    assert nbytes == 13_440
    with colibri.open_store(model.path, capacity_bytes=10 * nbytes * 2, prefetch_workers=0, usage_file=path,
                           pinned_bytes=100 * nbytes) as store:
        for layer in store.layers:
            slots = store.slots(layer)
            assert slots < 10  # the rounding this test is about
            pins = sum(1 for l, _ in store.pinned if l == layer)
            assert 0 < pins <= slots // 2, (layer, pins, slots)
            assert pins == slots // 2  # the history has more hot experts than that


def test_warm_start_fills_the_slots_c_gives(tmp_path):
    model, path, nbytes = _odd_model_and_history(tmp_path)
    with colibri.open_store(model.path, capacity_bytes=10 * nbytes * 2, prefetch_workers=0, usage_file=path,
                           warm_start=True) as store:
        for layer in store.layers:
            assert store.layer_stats(layer).resident_bytes == store.slots(layer) * nbytes
