"""PILOT: one-layer lookahead prediction, its prefetches and its accounting.

Prediction arithmetic is checked against a recording fake store (so the
exact keys handed to prefetch are known); the prefetch path against a real
store over a synthetic model. No test depends on timing.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import colibri
from colibri.pilot import LayerAccuracy, Pilot, PilotReport
from colibri.synthetic import write_synthetic_model
from conftest import LIVENESS_S


class FakeStore:
    """Records prefetch calls; accepts every key it has not seen yet."""

    def __init__(self, layers, n_experts):
        self.layers = tuple(layers)
        self._n = n_experts
        self.calls: list[list[tuple[int, int]]] = []
        self.seen: set[tuple[int, int]] = set()
        self.retired: list[tuple[int, tuple[int, ...]]] = []

    def num_experts(self, layer):
        return self._n

    def prefetch(self, keys):
        keys = list(keys)
        self.calls.append(keys)
        new = [k for k in keys if k not in self.seen and 0 <= k[1] < self._n]
        self.seen.update(new)
        return len(new)

    def lease_many(self, layer, experts):
        return ("leased", layer, tuple(experts))

    def retire_prefetches(self, layer, keep):
        self.retired.append((layer, tuple(keep)))
        return 0


def eye_routers(layers, n_experts, hidden):
    """Router rows = unit vectors: the logits are the first n_experts hidden entries."""
    return {layer: np.eye(n_experts, hidden, dtype=np.float32) for layer in layers}


def signal(hidden, scores: dict[int, float]) -> np.ndarray:
    h = np.zeros(hidden, dtype=np.float32)
    for e, v in scores.items():
        h[e] = v
    return h


@pytest.fixture
def synth(tmp_path):
    return write_synthetic_model(
        tmp_path / "model", n_layers=4, dense_layers=1, n_experts=8, hidden=64, intermediate=32, seed=3
    )


# ---------------------------------------------------------------------------
# arithmetic on known inputs


def test_precision_recall_arithmetic():
    store = FakeStore([1, 2, 3], 8)
    pilot = Pilot(store, eye_routers([1, 2, 3], 8, 16), top_k=2)

    # at layer 1 predict layer 2: experts 5 and 3 (5 has the larger logit)
    assert pilot.predict_next(1, signal(16, {5: 3.0, 3: 2.0, 0: 1.0})) == (5, 3)
    assert store.calls[-1] == [(2, 5), (2, 3)]
    assert pilot.observe(2, [3, 7]) == (0.5, 0.5)

    # at layer 2 predict layer 3: experts 1 and 4; both right
    assert pilot.predict_next(2, signal(16, {1: 1.0, 4: 2.0})) == (4, 1)
    assert pilot.observe(3, [1, 4]) == (1.0, 1.0)

    # at layer 3 there is no next MoE layer
    assert pilot.predict_next(3, signal(16, {0: 1.0})) == ()
    assert pilot.observe(1, [0, 1]) is None           # nothing was predicted for layer 1

    rep = pilot.report()
    assert isinstance(rep, PilotReport)
    assert (rep.predictions, rep.predicted, rep.actual, rep.correct) == (2, 4, 4, 3)
    assert rep.precision == pytest.approx(0.75)
    assert rep.recall == pytest.approx(0.75)
    assert rep.prefetch_requested == 4 and rep.prefetch_accepted == 4
    assert rep.unscored == 0
    assert set(rep.per_layer) == {2, 3}
    assert rep.per_layer[2] == LayerAccuracy(layer=2, predictions=1, predicted=2, actual=2, correct=1,
                                            prefetch_accepted=2)
    assert rep.per_layer[2].precision == 0.5 and rep.per_layer[2].recall == 0.5
    assert rep.per_layer[3].precision == 1.0 and rep.per_layer[3].recall == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        rep.predictions = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        rep.per_layer[2] = None  # type: ignore[index]

    d = rep.as_dict()               # JSON-ready: every field, the scores, layers by name
    assert json.loads(json.dumps(d)) == d
    assert (d["predictions"], d["predicted"], d["actual"], d["correct"]) == (2, 4, 4, 3)
    assert (d["enabled"], d["top_k"], d["extra"], d["unscored"]) == (True, 2, 0, 0)
    assert d["precision"] == pytest.approx(0.75) and d["recall"] == pytest.approx(0.75)
    assert d["per_layer"]["2"] == {"layer": 2, "predictions": 1, "predicted": 2, "actual": 2, "correct": 1,
                                   "prefetch_accepted": 2, "precision": 0.5, "recall": 0.5}
    assert set(d["per_layer"]) == {"2", "3"}


def test_precision_and_recall_differ_with_extra_candidates():
    store = FakeStore([0, 1], 8)
    pilot = Pilot(store, eye_routers([0, 1], 8, 8), top_k=2, extra=1)
    predicted = pilot.predict_next(0, signal(8, {6: 4.0, 2: 3.0, 7: 2.0, 1: 1.0}))
    assert predicted == (6, 2, 7)
    # actual uses 4 experts (a batch of two tokens), 2 of which were predicted
    precision, recall = pilot.observe(1, [np.array([6, 0]), np.array([2, 5])])
    assert precision == pytest.approx(2 / 3)
    assert recall == pytest.approx(2 / 4)
    rep = pilot.report()
    assert (rep.predicted, rep.actual, rep.correct) == (3, 4, 2)


def test_batch_prediction_is_union_of_top_k():
    store = FakeStore([0, 1], 8)
    pilot = Pilot(store, eye_routers([0, 1], 8, 8), top_k=2)
    batch = np.stack([
        signal(8, {0: 5.0, 1: 4.0}),
        signal(8, {1: 5.0, 2: 4.0}),
        signal(8, {1: 3.0, 3: 6.0}),
    ])
    predicted = pilot.predict_next(0, batch)
    assert set(predicted) == {0, 1, 2, 3}
    assert predicted[0] == 1                          # chosen by all three tokens: first
    assert sorted(store.calls[-1]) == [(1, 0), (1, 1), (1, 2), (1, 3)]
    assert pilot.predict(1, np.zeros((0, 8), dtype=np.float32)) == ()


def test_replaced_prediction_counts_as_unscored():
    store = FakeStore([0, 1], 8)
    pilot = Pilot(store, eye_routers([0, 1], 8, 8), top_k=1)
    pilot.predict_next(0, signal(8, {2: 1.0}))
    pilot.predict_next(0, signal(8, {3: 1.0}))        # replaces the first guess
    assert pilot.observe(1, [3]) == (1.0, 1.0)
    rep = pilot.report()
    assert rep.predictions == 1 and rep.unscored == 1
    pilot.predict_next(0, signal(8, {4: 1.0}))        # still pending: unscored too
    assert pilot.report().unscored == 2
    pilot.reset()
    rep = pilot.report()
    assert (rep.predictions, rep.unscored, rep.prefetch_requested) == (0, 0, 0)


def test_dense_layer_predicts_the_first_moe_layer():
    store = FakeStore([1, 2], 8)                      # layer 0 is dense
    pilot = Pilot(store, eye_routers([1, 2], 8, 8), top_k=1)
    assert pilot.next_layer(0) == 1
    assert pilot.next_layer(1) == 2
    assert pilot.next_layer(2) is None
    assert pilot.predict_next(0, signal(8, {6: 1.0})) == (6,)
    assert store.calls[-1] == [(1, 6)]


def test_wrong_predictions_never_raise():
    # The router knows 12 experts but the store has only 8: rows 8..11 are
    # never predicted, and nothing raises.
    store = FakeStore([0, 1], 8)
    routers = {1: np.eye(12, 16, dtype=np.float32)}
    pilot = Pilot(store, routers, top_k=2)
    predicted = pilot.predict_next(0, signal(16, {10: 9.0, 11: 8.0, 3: 1.0, 4: 0.5}))
    assert predicted == (3, 4)
    # observing experts the store does not know is only a miss of the guess
    assert pilot.observe(1, [100, 101]) == (0.0, 0.0)
    # a NaN hidden state gives some prediction, never an exception
    pilot.predict_next(0, np.full(16, np.nan, dtype=np.float32))
    # no router for a layer: no prediction
    assert Pilot(store, {}, top_k=2).predict_next(0, signal(16, {1: 1.0})) == ()


def test_bad_arguments():
    store = FakeStore([0, 1], 8)
    with pytest.raises(ValueError):
        Pilot(store, {1: np.zeros(8, dtype=np.float32)}, top_k=1)
    with pytest.raises(ValueError):
        Pilot(store, eye_routers([1], 8, 8), top_k=0)
    with pytest.raises(ValueError):
        Pilot(store, eye_routers([1], 8, 8), top_k=1, extra=-1)
    with pytest.raises(TypeError):
        Pilot(store, eye_routers([1], 8, 8), top_k=1.5)
    pilot = Pilot(store, eye_routers([1], 8, 8), top_k=1)
    with pytest.raises(ValueError, match="hidden"):
        pilot.predict_next(0, np.zeros(9, dtype=np.float32))


def test_lease_many_wrapper_observes():
    store = FakeStore([0, 1], 8)
    pilot = Pilot(store, eye_routers([0, 1], 8, 8), top_k=2)
    pilot.predict_next(0, signal(8, {1: 2.0, 2: 1.0}))
    assert pilot.lease_many(1, [2, 5]) == ("leased", 1, (2, 5))
    rep = pilot.report()
    assert rep.predictions == 1 and rep.correct == 1


# ---------------------------------------------------------------------------
# disabled mode


def test_disabled_does_nothing(synth):
    routers = synth.routers()
    with colibri.open_store(synth.path, slots_per_layer=4, prefetch_workers=2) as store:
        pilot = Pilot(store, routers, top_k=2, enabled=False)
        before = store.stats()
        rng = np.random.default_rng(0)
        for layer in store.layers:
            assert pilot.predict_next(layer, rng.standard_normal(synth.hidden, dtype=np.float32)) == ()
            assert pilot.observe(layer, [0, 1]) is None
        store.wait_idle(timeout=LIVENESS_S)
        after = store.stats()
        assert after.prefetched == before.prefetched == 0
        assert after.loads_started == before.loads_started
        rep = pilot.report()
        assert not rep.enabled
        assert (rep.predictions, rep.prefetch_requested, rep.prefetch_accepted, rep.unscored) == (0, 0, 0, 0)
        assert rep.per_layer == {}

    fake = FakeStore([0, 1], 8)
    pilot = Pilot(fake, eye_routers([0, 1], 8, 8), top_k=1)
    pilot.predict_next(0, signal(8, {1: 1.0}))
    pilot.enabled = False                             # switching off drops the pending guess
    assert pilot.observe(1, [1]) is None
    assert pilot.predict_next(0, signal(8, {1: 1.0})) == ()
    assert len(fake.calls) == 1
    pilot.enabled = True
    assert pilot.predict_next(0, signal(8, {1: 1.0})) == (1,)


# ---------------------------------------------------------------------------
# a real store


def route(router: np.ndarray, h: np.ndarray, k: int) -> list[int]:
    logits = router @ h
    return [int(e) for e in np.argsort(-logits, kind="stable")[:k]]


def test_prefetch_really_happens(synth):
    routers = synth.routers()
    with colibri.open_store(synth.path, slots_per_layer=4, prefetch_workers=2) as store:
        pilot = Pilot(store, routers, top_k=2)
        h = np.random.default_rng(1).standard_normal(synth.hidden, dtype=np.float32)
        first = store.layers[0]
        predicted = pilot.predict_next(first, h)
        assert len(predicted) == 2
        store.wait_idle(timeout=LIVENESS_S)
        stats = store.stats()
        assert stats.prefetched == 2
        assert pilot.report().prefetch_accepted == 2
        nxt = pilot.next_layer(first)
        read_before = stats.bytes_read
        with pilot.lease_many(nxt, predicted) as group:
            assert [lease.expert for lease in group] == list(predicted)
        stats = store.stats()
        assert stats.bytes_read == read_before           # served by the prefetch
        assert stats.prefetch_hits == 2 and stats.hits == 2
        # asking again for resident experts is not accepted a second time
        pilot.predict_next(first, h)
        assert pilot.report().prefetch_accepted == 2


def test_no_workers_accepts_nothing(synth):
    with colibri.open_store(synth.path, slots_per_layer=4, prefetch_workers=0) as store:
        pilot = Pilot(store, synth.routers(), top_k=2)
        assert len(pilot.predict_next(store.layers[0], np.ones(synth.hidden, dtype=np.float32))) == 2
        rep = pilot.report()
        assert rep.prefetch_requested == 2 and rep.prefetch_accepted == 0
        assert store.stats().prefetched == 0


@pytest.mark.parametrize("batch", [1, 3])
def test_next_layer_router_is_100_percent_precise(synth, batch):
    """When the engine's layer L+1 routing is layer L+1's router applied to the
    hidden state seen at L, PILOT's prediction is exactly right."""
    routers = synth.routers()
    k = 2
    rng = np.random.default_rng(5)
    with colibri.open_store(synth.path, slots_per_layer=8, prefetch_workers=2) as store:
        pilot = Pilot(store, routers, top_k=k)
        for _token in range(6):
            h = rng.standard_normal((batch, synth.hidden), dtype=np.float32)
            for layer in store.layers:
                pilot.predict_next(layer, h if batch > 1 else h[0])
                experts = sorted({e for row in h for e in route(routers[layer], row, k)})
                with pilot.lease_many(layer, experts) as group:
                    assert len(group) == len(experts)
        store.wait_idle(timeout=LIVENESS_S)
        stats = store.stats()
        assert stats.prefetched > 0
        assert stats.requests == stats.hits + stats.misses
    rep = pilot.report()
    assert rep.predictions == 6 * (len(synth.layers) - 1)
    assert rep.precision == 1.0 and rep.recall == 1.0
    assert all(acc.precision == 1.0 and acc.recall == 1.0 for acc in rep.per_layer.values())
    assert set(rep.per_layer) == set(synth.layers[1:])
    assert rep.unscored == 0


def test_observe_retires_wrong_guesses_only():
    store = FakeStore(layers=[0, 1], n_experts=8)
    pilot = Pilot(store, eye_routers([0, 1], 8, 16), top_k=2)
    h = np.zeros(16, dtype=np.float32)
    h[[3, 5]] = [2.0, 1.0]
    assert set(pilot.predict_next(0, h)) == {3, 5}
    pilot.observe(1, [3, 5])                 # all right: nothing to retire
    assert store.retired == []
    pilot.predict_next(0, h)
    pilot.observe(1, [3, 6])                 # 5 was a wrong guess
    assert store.retired == [(1, (3, 6))]
