"""PILOT: one-layer lookahead prefetch, and a measure of how good it is.

While layer L computes, the engine already holds the hidden state that
layer L's router sees. Routing is strongly correlated from one layer to the
next (about 71.6% of layer L+1's experts are predictable one layer ahead), so
applying layer L+1's router to that hidden state names most of the experts
layer L+1 will want. :class:`Pilot` does exactly that, hands the prediction to
``store.prefetch`` (so the I/O workers load them while layer L computes) and,
once layer L+1's real experts are known, scores the prediction: precision
(how many prefetches were useful) and recall (how many needed experts were
prefetched), overall and per layer.

A prediction is only advice. A wrong one costs a wasted read and perhaps an
evicted slot, never correctness: the engine always leases the experts its
own router chose, and the store loads whatever was not prefetched.

Engine loop (one ``predict_next`` and one ``observe`` per MoE layer)::

    pilot = Pilot(store, routers, top_k=8, extra=2)   # routers: {layer: (n_experts, hidden)}
    for token in tokens:
        x = embed(token)
        for layer in model_layers:                    # dense layers may call predict_next too
            h = attention(layer, x)                   # router input of this layer
            experts, weights = route(layer, h)        # this layer's real top-k
            with pilot.lease_many(layer, experts) as group:   # = observe + store.lease_many
                pilot.predict_next(layer, h)          # prefetch the NEXT MoE layer's guess
                x = x + moe(group, weights, h)
    print(pilot.report())

Predicting right after the layer's lease rather than before it lets the
layer's own misses have the disk to themselves; the prefetch still overlaps
this layer's MoE and the next layer's attention.

``pilot.lease_many(layer, experts)`` is ``pilot.observe(layer, experts)``
followed by ``store.lease_many(layer, experts)``; an engine that leases
experts its own way calls ``observe`` itself. The prediction made at layer L
is scored by the ``observe`` of the next MoE layer, so the order is: predict
at L, (lease at L), observe at L+1.

A batch of hidden states ``(tokens, hidden)`` predicts the union of every
token's top-k, and ``observe`` takes the union of the batch's experts.

One Pilot belongs to one engine thread (it keeps the pending prediction
between calls); the store it drives may be shared.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Iterable, Mapping

import numpy as np

__all__ = ["Pilot", "PilotReport", "LayerAccuracy"]


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0


class _Scores:
    """precision and recall of anything counting predicted, actual and correct experts."""

    predicted: int
    actual: int
    correct: int

    @property
    def precision(self) -> float:
        """correct / predicted (0.0 before any scored prediction)."""
        return _ratio(self.correct, self.predicted)

    @property
    def recall(self) -> float:
        """correct / actual (0.0 before any scored prediction)."""
        return _ratio(self.correct, self.actual)

    def as_dict(self) -> dict[str, Any]:
        """Every field, then precision and recall."""
        # only dataclasses derive from _Scores, which mypy cannot know
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]
        d["precision"] = self.precision
        d["recall"] = self.recall
        return d


@dataclass(frozen=True)
class LayerAccuracy(_Scores):
    """Scored predictions of one MoE layer (the layer that was predicted).

    ``predicted`` and ``actual`` count experts (a batch counts its union
    once per call), ``correct`` those in both.
    """

    layer: int
    predictions: int
    predicted: int
    actual: int
    correct: int
    prefetch_accepted: int


@dataclass(frozen=True)
class PilotReport(_Scores):
    """What a :class:`Pilot` predicted and how well (a snapshot).

    - ``predictions``: predictions scored by an ``observe`` of their layer.
    - ``predicted`` / ``actual`` / ``correct``: experts summed over the
      scored predictions; ``precision = correct / predicted`` and
      ``recall = correct / actual`` (micro-averaged: every expert weighs the same).
    - ``unscored``: predictions never observed (replaced by a newer one for
      the same layer, or still pending).
    - ``prefetch_requested`` / ``prefetch_accepted``: keys handed to
      ``store.prefetch`` and how many it accepted (already resident or
      loading, rejected or unknown keys are not accepted).
    - ``per_layer``: :class:`LayerAccuracy` by predicted layer (read-only).
    """

    enabled: bool
    top_k: int
    extra: int
    predictions: int
    predicted: int
    actual: int
    correct: int
    unscored: int
    prefetch_requested: int
    prefetch_accepted: int
    per_layer: Mapping[int, LayerAccuracy]

    def as_dict(self) -> dict[str, Any]:
        d = super().as_dict()
        d["per_layer"] = {str(k): v.as_dict() for k, v in self.per_layer.items()}
        return d

    def __str__(self) -> str:
        return (
            f"PILOT top_k={self.top_k}+{self.extra}: {self.predictions} predictions, "
            f"precision {self.precision:.1%}, recall {self.recall:.1%}, "
            f"prefetches accepted {self.prefetch_accepted}/{self.prefetch_requested}"
        )


class _Counts:
    __slots__ = ("predictions", "predicted", "actual", "correct", "accepted")

    def __init__(self) -> None:
        self.predictions = self.predicted = self.actual = self.correct = self.accepted = 0


class Pilot:
    """One-layer lookahead: predict the next MoE layer's experts, prefetch
    them, and score the prediction when the real experts are known.

    ``store`` is a :class:`colibri.Store` (anything with ``layers`` and
    ``prefetch(keys) -> int`` will do). ``routers[layer]`` is MoE layer
    ``layer``'s router weight, shape ``(n_experts, hidden)``: logits are
    ``hidden @ router.T``. A layer without a router is never predicted.
    ``top_k`` experts per token are predicted, plus ``extra`` more candidates
    (the next best logits) to buy recall with bandwidth. ``enabled=False``
    (or setting ``pilot.enabled = False`` later) turns every call into a
    no-op: nothing is prefetched and nothing is counted.
    """

    def __init__(
        self,
        store: Any,
        routers: Mapping[int, Any],
        top_k: int,
        extra: int = 0,
        enabled: bool = True,
    ) -> None:
        self.top_k = _count(top_k, "top_k", minimum=1)
        self.extra = _count(extra, "extra", minimum=0)
        self._store = store
        self._layers: tuple[int, ...] = tuple(sorted(operator.index(layer) for layer in store.layers))
        self._routers: dict[int, np.ndarray] = {}
        self._n_experts: dict[int, int] = {}
        for layer, weight in routers.items():
            layer = operator.index(layer)
            w = np.asarray(weight)
            if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 1:
                raise ValueError(f"router of layer {layer} must have shape (n_experts, hidden), got {w.shape}")
            # float32 copy: bf16 / f16 routers get exact-enough logits and a
            # caller mutating its array later cannot change our predictions.
            self._routers[layer] = np.array(w, dtype=np.float32, order="C")
            n = w.shape[0]
            if layer in self._layers:
                try:
                    n = min(n, int(store.num_experts(layer)))
                except AttributeError:
                    pass
            self._n_experts[layer] = n
        self._enabled = bool(enabled)
        self._pending: dict[int, frozenset[int]] = {}
        self._counts: dict[int, _Counts] = {}
        self._unscored = 0
        self._requested = 0
        self._accepted = 0

    # -- switches --

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = bool(value)
        if not self._enabled:
            self._drop_pending()

    def reset(self) -> None:
        """Forget pending predictions and zero every counter."""
        self._pending.clear()
        self._counts.clear()
        self._unscored = self._requested = self._accepted = 0

    def _drop_pending(self) -> None:
        self._unscored += len(self._pending)
        self._pending.clear()

    # -- the engine protocol --

    def next_layer(self, layer: int) -> int | None:
        """The MoE layer after ``layer`` in the store's order (None after the last)."""
        layer = operator.index(layer)
        i = bisect.bisect_right(self._layers, layer)
        return self._layers[i] if i < len(self._layers) else None

    def predict(self, layer: int, hidden: Any) -> tuple[int, ...]:
        """``layer``'s experts that ``hidden`` would route to (top_k + extra
        per token, union over a batch), best first. No prefetch, no counting."""
        layer = operator.index(layer)
        router = self._routers.get(layer)
        if router is None:
            return ()
        h = np.asarray(hidden)
        if h.ndim == 1:
            h = h[None, :]
        if h.ndim != 2 or h.shape[1] != router.shape[1]:
            raise ValueError(
                f"hidden must have shape ({router.shape[1]},) or (tokens, {router.shape[1]}) "
                f"for layer {layer}'s router, got {np.shape(hidden)}"
            )
        if h.shape[0] == 0:
            return ()
        logits = h.astype(np.float32, copy=False) @ router.T        # (tokens, n_experts)
        n_valid = self._n_experts[layer]
        if n_valid < logits.shape[1]:
            logits = logits[:, :n_valid]     # router rows the store has no expert for
        # NaN logits (a broken hidden state) must not win a place.
        logits = np.where(np.isnan(logits), -np.inf, logits)
        n = min(self.top_k + self.extra, n_valid)
        if n == logits.shape[1]:
            top = np.broadcast_to(np.arange(n), logits.shape)
        else:
            top = np.argpartition(-logits, n - 1, axis=1)[:, :n]
        chosen = np.unique(top)
        votes = np.bincount(top.ravel(), minlength=logits.shape[1])[chosen]
        best = logits[:, chosen].max(axis=0)
        order = np.lexsort((-best, -votes))   # most votes first, then best logit
        return tuple(int(e) for e in chosen[order])

    def predict_next(self, layer: int, hidden: Any) -> tuple[int, ...]:
        """At layer ``layer``, predict the next MoE layer's experts from
        ``hidden`` (shape ``(hidden,)`` or ``(tokens, hidden)``), prefetch
        them and remember the guess for :meth:`observe`. Returns the
        predicted experts (empty when disabled or after the last MoE layer).
        """
        if not self._enabled:
            return ()
        target = self.next_layer(layer)
        if target is None or target not in self._routers:
            return ()
        predicted = self.predict(target, hidden)
        if not predicted:
            return ()
        if target in self._pending:
            self._unscored += 1
        self._pending[target] = frozenset(predicted)
        accepted = int(self._store.prefetch([(target, e) for e in predicted]))
        self._requested += len(predicted)
        self._accepted += accepted
        self._layer_counts(target).accepted += accepted
        return predicted

    def observe(self, layer: int, experts: Iterable[Any]) -> tuple[float, float] | None:
        """Score the pending prediction of ``layer`` against the experts the
        engine really uses there (ints, or arrays of a batch's top-k).

        Returns ``(precision, recall)`` of that prediction, or None when
        nothing was predicted for ``layer`` (disabled, first layer...).
        """
        if not self._enabled:
            return None
        layer = operator.index(layer)
        predicted = self._pending.pop(layer, None)
        if predicted is None:
            return None
        actual = _expert_set(experts)
        correct = len(predicted & actual)
        if predicted - actual:
            # Wrong guesses: cancel their reads if still queued, evict them first if loaded.
            self._store.retire_prefetches(layer, sorted(actual))
        c = self._layer_counts(layer)
        c.predictions += 1
        c.predicted += len(predicted)
        c.actual += len(actual)
        c.correct += correct
        return _ratio(correct, len(predicted)), _ratio(correct, len(actual))

    def lease_many(self, layer: int, experts: Iterable[int]) -> Any:
        """``observe(layer, experts)`` then ``store.lease_many(layer, experts)``."""
        experts = [operator.index(e) for e in experts]
        self.observe(layer, experts)
        return self._store.lease_many(layer, experts)

    # -- results --

    def _layer_counts(self, layer: int) -> _Counts:
        c = self._counts.get(layer)
        if c is None:
            c = self._counts[layer] = _Counts()
        return c

    def report(self) -> PilotReport:
        """A snapshot of the counters (pending predictions count as unscored)."""
        per_layer = {
            layer: LayerAccuracy(
                layer=layer,
                predictions=c.predictions,
                predicted=c.predicted,
                actual=c.actual,
                correct=c.correct,
                prefetch_accepted=c.accepted,
            )
            for layer, c in sorted(self._counts.items())
        }
        return PilotReport(
            enabled=self._enabled,
            top_k=self.top_k,
            extra=self.extra,
            predictions=sum(c.predictions for c in self._counts.values()),
            predicted=sum(c.predicted for c in self._counts.values()),
            actual=sum(c.actual for c in self._counts.values()),
            correct=sum(c.correct for c in self._counts.values()),
            unscored=self._unscored + len(self._pending),
            prefetch_requested=self._requested,
            prefetch_accepted=self._accepted,
            per_layer=MappingProxyType(per_layer),
        )

    def __repr__(self) -> str:
        state = "on" if self._enabled else "off"
        return f"<colibri.Pilot {state} top_k={self.top_k}+{self.extra} layers={len(self._routers)}>"


def _expert_set(experts: Any) -> set[int]:
    """Experts as a set of ints, from ints, arrays or a mix (a batch's top-k rows)."""
    if isinstance(experts, np.ndarray):
        return {int(e) for e in experts.ravel()}
    out: set[int] = set()
    for item in experts:
        if isinstance(item, np.ndarray) or isinstance(item, (list, tuple)):
            out.update(int(e) for e in np.ravel(item))
        else:
            out.add(operator.index(item))
    return out


def _count(value: Any, name: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)
