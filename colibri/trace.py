"""Routing traces: which experts each MoE layer chose for each decoded token.

A :class:`Trace` is what a cache sees of a model: for token ``t`` and MoE
layer ``layers[i]``, the experts ``experts[t, i, :]`` (best first, ``-1``
pads when a row has fewer than ``k``). It is stored as a numpy ``.npz``:

==============  =====================  ==========================================
array           dtype, shape           meaning
==============  =====================  ==========================================
``layers``      int32 ``(L,)``         the MoE layer indices, in forward order
``experts``     int32 ``(T, L, k)``    experts chosen per token and layer; -1 pads
``weights``     float32 ``(T, L, k)``  router probabilities (optional)
``sequence``    int32 ``(T,)``         prompt/sequence of each token (optional)
``num_experts`` int32 ``()``           routed experts per layer (optional)
==============  =====================  ==========================================

Tokens are in decode order within a sequence and sequences follow each other,
as a cache that persists across requests sees them.

An engine records one by wrapping its store in a :class:`TraceRecorder`
(one line: ``store = colibri.TraceRecorder(store)``); every ``lease_many``
then also appends that layer's choice to the current token.
"""

from __future__ import annotations

import operator
import os
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, Union

import numpy as np

from colibri._npz import PathLike, load_npz, save_npz_atomically
from colibri.errors import FormatError

__all__ = ["Trace", "TraceRecorder"]

_REQUIRED = ("layers", "experts")
_OPTIONAL = ("weights", "sequence", "num_experts")


def _int_array(value: Any, name: str, ndim: int, where: str) -> np.ndarray:
    a = np.asarray(value)
    if a.ndim != ndim:
        raise FormatError(f"{where}: {name} must have {ndim} dimensions, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise FormatError(f"{where}: {name} must hold integers, got dtype {a.dtype}")
    if a.size and (a.min() < -(2**31) or a.max() >= 2**31):
        raise FormatError(f"{where}: {name} holds values outside int32")
    return np.ascontiguousarray(a, dtype=np.int32)


class Trace:
    """A routing trace (see the module docstring for the arrays).

    Build one with :meth:`from_arrays`, :meth:`load` or a :class:`TraceRecorder`.
    The arrays are read-only; ``len(trace)`` is the number of tokens.
    """

    __slots__ = ("layers", "experts", "weights", "sequence", "num_experts")

    layers: np.ndarray
    experts: np.ndarray
    weights: np.ndarray | None
    sequence: np.ndarray
    num_experts: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("build a Trace with Trace.from_arrays(...) or Trace.load(path)")

    @classmethod
    def from_arrays(
        cls,
        layers: Any,
        experts: Any,
        weights: Any = None,
        sequence: Any = None,
        num_experts: int | None = None,
        *,
        _where: str = "trace",
    ) -> "Trace":
        """A trace from arrays (copied). ``layers`` (L,) distinct layer
        indices; ``experts`` (T, L, k) with -1 pads; ``weights`` the same
        shape or None; ``sequence`` (T,) or None (all tokens in sequence 0);
        ``num_experts`` routed experts per layer, or None for one more than
        the largest expert named. Anything inconsistent is a FormatError."""
        w = _where
        lay = _int_array(layers, "layers", 1, w)
        exp = _int_array(experts, "experts", 3, w)
        if lay.size and lay.min() < 0:
            raise FormatError(f"{w}: layer indices must be >= 0, got {int(lay.min())}")
        if len(np.unique(lay)) != len(lay):
            raise FormatError(f"{w}: layers repeat an index: {lay.tolist()}")
        if exp.shape[1] != len(lay):
            raise FormatError(f"{w}: experts has {exp.shape[1]} layers per token but layers lists {len(lay)}")
        if exp.shape[2] < 1 and exp.shape[0] > 0:
            raise FormatError(f"{w}: experts must have at least one expert per token and layer")
        if exp.size and exp.min() < -1:
            raise FormatError(f"{w}: experts holds {int(exp.min())}; only -1 pads a row")
        largest = int(exp.max()) if exp.size else -1
        if num_experts is None:
            n = max(largest + 1, 1)
        else:
            try:
                n = operator.index(num_experts)
            except TypeError:
                raise FormatError(f"{w}: num_experts must be an int, got {num_experts!r}") from None
            if n < 1:
                raise FormatError(f"{w}: num_experts must be >= 1, got {n}")
            if largest >= n:
                raise FormatError(f"{w}: expert {largest} named but num_experts is {n}")
        if weights is None:
            wt = None
        else:
            wt = np.asarray(weights)
            if wt.shape != exp.shape:
                raise FormatError(f"{w}: weights has shape {wt.shape}, experts {exp.shape}")
            if wt.size and wt.dtype.kind not in "fiu":
                raise FormatError(f"{w}: weights must be numbers, got dtype {wt.dtype}")
            wt = np.ascontiguousarray(wt, dtype=np.float32)
            if not np.isfinite(wt).all():
                raise FormatError(f"{w}: weights holds NaN or infinity")
        if sequence is None:
            seq = np.zeros(exp.shape[0], dtype=np.int32)
        else:
            seq = _int_array(sequence, "sequence", 1, w)
            if seq.shape[0] != exp.shape[0]:
                raise FormatError(f"{w}: sequence has {seq.shape[0]} tokens, experts {exp.shape[0]}")
        self = object.__new__(cls)
        for name, arr in (("layers", lay), ("experts", exp), ("weights", wt), ("sequence", seq)):
            if arr is not None:
                arr = np.array(arr, copy=True)  # never freeze or share the caller's array
                arr.flags.writeable = False
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "num_experts", n)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Trace is immutable")

    # -- facts --

    def __len__(self) -> int:
        return int(self.experts.shape[0])

    @property
    def top_k(self) -> int:
        """Experts per token and layer (the padded width ``k``)."""
        return int(self.experts.shape[2])

    @property
    def requests(self) -> int:
        """Expert requests in the trace: distinct experts per (token, layer), summed."""
        return int(sum(len(np.unique(row[row >= 0])) for row in self.experts.reshape(-1, self.top_k)))

    @property
    def sequences(self) -> tuple[int, ...]:
        """Distinct sequence ids, in order of first appearance."""
        _, first = np.unique(self.sequence, return_index=True)
        return tuple(int(self.sequence[i]) for i in sorted(first))

    def layer_experts(self, layer: int) -> np.ndarray:
        """``(T, k)`` experts of one model layer index."""
        hit = np.flatnonzero(self.layers == operator.index(layer))
        if not hit.size:
            raise KeyError(f"the trace has no layer {layer} (layers {self.layers.tolist()})")
        return self.experts[:, int(hit[0]), :]

    def counts(self) -> dict[int, np.ndarray]:
        """Per layer: how often each expert was routed to (int64 of num_experts)."""
        out: dict[int, np.ndarray] = {}
        for i, layer in enumerate(self.layers.tolist()):
            col = self.experts[:, i, :]
            out[layer] = np.bincount(col[col >= 0].ravel(), minlength=self.num_experts).astype(np.int64)
        return out

    # -- slicing --

    def tokens(self, index: Union[slice, Sequence[int], np.ndarray]) -> "Trace":
        """A trace of the tokens selected by a slice, indices or a boolean mask."""
        sel = np.arange(len(self))[index]
        return Trace.from_arrays(
            self.layers, self.experts[sel], None if self.weights is None else self.weights[sel],
            self.sequence[sel], self.num_experts,
        )

    def select_sequences(self, ids: Iterable[int]) -> "Trace":
        """A trace of the tokens of these sequences (kept in trace order)."""
        wanted = np.asarray(sorted({operator.index(i) for i in ids}), dtype=np.int32)
        return self.tokens(np.isin(self.sequence, wanted))

    @staticmethod
    def concat(traces: Sequence["Trace"]) -> "Trace":
        """The traces one after the other (same layers and num_experts; the
        narrower ones padded with -1; sequence ids kept)."""
        if not traces:
            raise FormatError("concat needs at least one trace")
        first = traces[0]
        k = max(t.top_k for t in traces)
        for t in traces[1:]:
            if not np.array_equal(t.layers, first.layers) or t.num_experts != first.num_experts:
                raise FormatError("concat: the traces differ in layers or num_experts")

        def pad(a: np.ndarray, fill: float) -> np.ndarray:
            return np.pad(a, ((0, 0), (0, 0), (0, k - a.shape[2])), constant_values=fill)

        weights = None
        if all(t.weights is not None for t in traces):
            weights = np.concatenate([pad(t.weights, 0.0) for t in traces])  # type: ignore[arg-type]
        return Trace.from_arrays(
            first.layers, np.concatenate([pad(t.experts, -1) for t in traces]), weights,
            np.concatenate([t.sequence for t in traces]), first.num_experts,
        )

    # -- files --

    @classmethod
    def load(cls, path: PathLike) -> "Trace":
        """Read a trace ``.npz``; a missing, malformed or inconsistent file is
        a FormatError naming it."""
        where, arrays = load_npz(path, "routing trace file", _REQUIRED, _OPTIONAL)
        raw = arrays.get("num_experts")
        n_experts: int | None = None
        if raw is not None:
            if raw.shape != () or raw.dtype.kind not in "iu":
                raise FormatError(f"{where}: num_experts must be an integer scalar, got {raw.dtype} {raw.shape}")
            n_experts = int(raw)
        return cls.from_arrays(
            arrays["layers"], arrays["experts"], arrays.get("weights"), arrays.get("sequence"), n_experts,
            _where=where,
        )

    def save(self, path: PathLike) -> None:
        """Write the trace as ``.npz`` (compressed), atomically: a temporary
        file in the same directory renamed over ``path``."""
        target = Path(os.fspath(path))
        arrays: dict[str, np.ndarray] = {
            "layers": self.layers, "experts": self.experts, "sequence": self.sequence,
            "num_experts": np.array(self.num_experts, dtype=np.int32),
        }
        if self.weights is not None:
            arrays["weights"] = self.weights
        save_npz_atomically(target, arrays, compressed=True)

    # -- comparisons and display --

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        same_w = (self.weights is None and other.weights is None) or (
            self.weights is not None and other.weights is not None
            and np.array_equal(self.weights, other.weights)
        )
        return (
            self.num_experts == other.num_experts and np.array_equal(self.layers, other.layers)
            and np.array_equal(self.experts, other.experts) and np.array_equal(self.sequence, other.sequence)
            and same_w
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"<colibri.Trace {len(self)} tokens x {len(self.layers)} layers, top-{self.top_k} "
            f"of {self.num_experts}, {len(self.sequences)} sequences>"
        )


class TraceRecorder:
    """Records the experts an engine leases, as a :class:`Trace`.

    Wrap the store the engine uses; everything else passes through::

        store = colibri.TraceRecorder(store)   # the one line
        ...                                    # the engine runs as before
        store.save("run.npz")                  # or store.trace()

    Each ``lease_many(layer, experts)`` (also through a :class:`colibri.Pilot`
    built on the wrapped store) appends ``experts`` as that layer's choice of
    the current token; ``weights=`` may carry the router's probabilities
    (they are not passed on to the store). A layer that comes again, or an
    earlier layer, starts the next token. :meth:`record` does the same
    without a store (``TraceRecorder(None, layers=..., num_experts=...)``), and
    :meth:`next_sequence` marks the start of a new prompt.

    One recorder belongs to one engine thread; its calls are serialised by a
    lock, so sharing it cannot corrupt it, but tokens would interleave.
    """

    def __init__(
        self,
        store: Any = None,
        *,
        layers: Iterable[int] | None = None,
        num_experts: int | Mapping[int, int] | None = None,
    ) -> None:
        self._store = store
        if layers is None and store is not None:
            layers = store.layers
        self._layers: list[int] | None = None if layers is None else [operator.index(x) for x in layers]
        if num_experts is None and store is not None and self._layers:
            num_experts = max(int(store.num_experts(x)) for x in self._layers)
        elif isinstance(num_experts, Mapping):
            num_experts = max(int(v) for v in num_experts.values())
        self._num_experts = None if num_experts is None else operator.index(num_experts)
        self._lock = threading.Lock()
        self._tokens: list[dict[int, tuple[tuple[int, ...], tuple[float, ...] | None]]] = []
        self._sequence: list[int] = []
        self._seq = 0
        self._last_layer: int | None = None

    # -- recording --

    def record(self, layer: int, experts: Iterable[Any], weights: Iterable[Any] | None = None) -> None:
        """Append one layer's experts (best first) of the current token."""
        layer = operator.index(layer)
        chosen = tuple(operator.index(e) for e in np.asarray(
            experts if isinstance(experts, np.ndarray) else list(experts)).ravel().tolist())
        w = None if weights is None else tuple(float(x) for x in np.asarray(weights, dtype=np.float64).ravel())
        if w is not None and len(w) != len(chosen):
            raise FormatError(f"record: {len(chosen)} experts but {len(w)} weights for layer {layer}")
        with self._lock:
            if not self._tokens or self._last_layer is None or layer <= self._last_layer:
                self._tokens.append({})
                self._sequence.append(self._seq)
            self._tokens[-1][layer] = (chosen, w)
            self._last_layer = layer

    def next_sequence(self) -> None:
        """The next token starts a new sequence (prompt)."""
        with self._lock:
            if self._tokens:
                self._seq = self._sequence[-1] + 1
            self._last_layer = None

    def lease_many(self, layer: int, experts: Iterable[int], *, weights: Iterable[Any] | None = None) -> Any:
        """Record ``experts`` for ``layer``, then ``store.lease_many(layer, experts)``."""
        if self._store is None:
            raise FormatError("this TraceRecorder wraps no store; call record() instead")
        chosen = [operator.index(e) for e in experts]
        self.record(layer, chosen, weights)  # the routing happened, whether the lease succeeds or not
        return self._store.lease_many(layer, chosen)

    def __getattr__(self, name: str) -> Any:
        store = self.__dict__.get("_store")
        if store is None:
            raise AttributeError(name)
        return getattr(store, name)

    def __enter__(self) -> "TraceRecorder":
        if self._store is not None and hasattr(self._store, "__enter__"):
            self._store.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._store is not None and hasattr(self._store, "__exit__"):
            self._store.__exit__(*exc)

    # -- results --

    def __len__(self) -> int:
        return len(self._tokens)

    def clear(self) -> None:
        """Forget every recorded token."""
        with self._lock:
            self._tokens.clear()
            self._sequence.clear()
            self._seq = 0
            self._last_layer = None

    def trace(self) -> Trace:
        """The tokens recorded so far. A layer a token did not record is a
        row of -1; rows narrower than the widest are padded with -1."""
        with self._lock:
            tokens = [dict(t) for t in self._tokens]
            sequence = list(self._sequence)
        seen = sorted({layer for t in tokens for layer in t})
        layers = list(self._layers) if self._layers is not None else seen
        extra = [x for x in seen if x not in set(layers)]
        if extra:
            raise FormatError(f"recorded layers {extra} that are not among the store's layers {layers}")
        k = max([len(e) for t in tokens for e, _ in t.values()] + [1])
        experts = np.full((len(tokens), len(layers), k), -1, dtype=np.int32)
        has_w = bool(tokens) and all(w is not None for t in tokens for _, w in t.values())
        weights = np.zeros(experts.shape, dtype=np.float32) if has_w else None
        col = {layer: i for i, layer in enumerate(layers)}
        for ti, t in enumerate(tokens):
            for layer, (e, w) in t.items():
                experts[ti, col[layer], : len(e)] = e
                if weights is not None and w is not None:
                    weights[ti, col[layer], : len(w)] = w
        return Trace.from_arrays(layers, experts, weights, np.asarray(sequence, dtype=np.int32),
                                 self._num_experts)

    def save(self, path: PathLike) -> Trace:
        """Save the recorded tokens as a trace ``.npz``; returns the trace."""
        t = self.trace()
        t.save(path)
        return t

    def __repr__(self) -> str:
        return f"<colibri.TraceRecorder {len(self._tokens)} tokens, wrapping {self._store!r}>"
