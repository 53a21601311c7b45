"""Usage history: how often each MoE layer routed to each of its experts.

A :class:`Usage` holds decayed counts per layer: every time a layer's counts
grow by ``half_life`` requests, everything it counted before weighs half as
much (with top-k routing a token makes k requests of each layer, so a
half-life of ``h`` requests is ``h / k`` tokens). ``half_life_turns`` decays
every layer once more per turn (one store session, one ``end_turn()``).

``open_store(..., usage_file=PATH)`` loads the history at open, adds what
the store served, and saves it atomically on ``close()`` and on
``store.save_usage()``; ``pinned_bytes=N`` pins the hottest experts of the
history. The file carries a fingerprint of the model (layers, experts per
layer, each expert's byte layout) and is refused (:class:`FormatError`) for
another model unless the caller says to use it anyway. A corrupt or
truncated file is a FormatError naming it and changes nothing.

File format (numpy ``.npz``, uncompressed): ``version`` (int64), ``fingerprint``
(uint8, UTF-8 text), ``layers`` and ``num_experts`` (int32 ``(L,)``), ``counts``
(float64 ``(L, max experts)``, zero beyond a layer's experts), ``requests``
(float64 ``(L,)``, decayed requests counted), ``half_life`` and
``half_life_turns`` (float64; 0 = none), ``turns`` (int64), and ``digest``
(uint8 ``(32,)``: blake2b of everything else, so damage inside an array is
caught too).
"""

from __future__ import annotations

import hashlib
import operator
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from colibri._npz import PathLike, load_npz, save_npz_atomically
from colibri.errors import FormatError

__all__ = ["Usage", "model_fingerprint", "DEFAULT_HALF_LIFE"]

#: Requests of a layer after which older counts weigh half (a few hundred tokens of a top-8 model).
DEFAULT_HALF_LIFE = 4096.0
_VERSION = 1
_ARRAYS = ("version", "fingerprint", "layers", "num_experts", "counts", "requests", "half_life",
           "half_life_turns", "turns")


def model_fingerprint(num_experts: Mapping[int, int], layout: Iterable[Any] = ()) -> str:
    """A short text naming a model's shape: its MoE layers, experts per layer
    and (``layout``) anything describing the experts' bytes, e.g. per layer
    the dtype and shape of each tensor. Same model, same text."""
    h = hashlib.blake2b(digest_size=12)
    for layer in sorted(num_experts):
        h.update(f"{int(layer)}:{int(num_experts[layer])};".encode())
    for item in layout:
        h.update(repr(item).encode())
        h.update(b";")
    return f"moe-{len(num_experts)}x{max(num_experts.values(), default=0)}-{h.hexdigest()}"


def _digest(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    h = hashlib.blake2b(digest_size=32)
    for name in _ARRAYS:
        a = np.ascontiguousarray(arrays[name])
        h.update(name.encode())
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return np.frombuffer(h.digest(), dtype=np.uint8).copy()


class Usage:
    """Decayed counts of each layer's routed experts (see the module docstring).

    ``counts(layer)`` is a float64 array over the layer's experts. Build one
    empty (``Usage({layer: n_experts, ...})``), from a trace
    (:meth:`from_trace`) or from a file (:meth:`load`).
    """

    def __init__(
        self,
        num_experts: Mapping[int, int],
        *,
        half_life: float | None = DEFAULT_HALF_LIFE,
        half_life_turns: float | None = None,
        fingerprint: str | None = None,
    ) -> None:
        self._n = {operator.index(l): operator.index(n) for l, n in num_experts.items()}
        if not self._n or min(self._n) < 0 or min(self._n.values()) < 1:
            raise FormatError(f"Usage needs layers >= 0 with >= 1 expert each, got {dict(num_experts)}")
        self.half_life = _positive_or_none(half_life, "half_life")
        self.half_life_turns = _positive_or_none(half_life_turns, "half_life_turns")
        self.fingerprint = fingerprint if fingerprint is not None else model_fingerprint(self._n)
        self._counts = {l: np.zeros(n, dtype=np.float64) for l, n in self._n.items()}
        self._requests = {l: 0.0 for l in self._n}
        self.turns = 0

    # -- facts --

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self._n))

    def num_experts(self, layer: int) -> int:
        return self._n[self._layer(layer)]

    def _layer(self, layer: int) -> int:
        layer = operator.index(layer)
        if layer not in self._n:
            raise KeyError(f"the usage history has no layer {layer} (layers {self.layers})")
        return layer

    def counts(self, layer: int) -> np.ndarray:
        """The decayed counts of ``layer``'s experts (a copy)."""
        return self._counts[self._layer(layer)].copy()

    def requests(self, layer: int) -> float:
        """Decayed requests counted for ``layer`` (the sum of its counts)."""
        return self._requests[self._layer(layer)]

    def hottest(self, n: int | Mapping[int, int]) -> list[tuple[int, int]]:
        """The ``n`` (per layer: ``n[layer]``) most counted experts of each
        layer, hottest first, never one never counted."""
        out: list[tuple[int, int]] = []
        for layer in self.layers:
            want = n.get(layer, 0) if isinstance(n, Mapping) else n
            c = self._counts[layer]
            order = np.argsort(-c, kind="stable")[: max(0, int(want))]
            out += [(layer, int(e)) for e in order if c[e] > 0]
        return out

    def hottest_by_bytes(self, budget: int, expert_nbytes: Mapping[int, int],
                         max_per_layer: Mapping[int, int] | None = None) -> list[tuple[int, int]]:
        """The hottest experts over all layers (counts relative to their
        layer's requests, so each layer's share is comparable) whose bytes
        fit in ``budget``, at most ``max_per_layer[layer]`` per layer."""
        cand: list[tuple[float, int, int]] = []
        for layer in self.layers:
            total = self._requests[layer]
            if total <= 0:
                continue
            c = self._counts[layer] / total
            cand += [(-float(c[e]), layer, int(e)) for e in np.flatnonzero(c > 0)]
        cand.sort()
        used = 0
        per: dict[int, int] = {}
        out: list[tuple[int, int]] = []
        for _, layer, e in cand:
            size = int(expert_nbytes[layer])
            cap = None if max_per_layer is None else max_per_layer.get(layer, 0)
            if used + size > budget or (cap is not None and per.get(layer, 0) >= cap):
                continue
            used += size
            per[layer] = per.get(layer, 0) + 1
            out.append((layer, e))
        return out

    # -- counting --

    def add(self, layer: int, counts: Any) -> None:
        """Add one batch of ``layer``'s requests (counts per expert), decaying
        what was there by the batch's size in half-lives."""
        layer = self._layer(layer)
        c = np.asarray(counts, dtype=np.float64)
        if c.shape != (self._n[layer],) or not np.isfinite(c).all() or (c < 0).any():
            raise FormatError(f"usage of layer {layer}: counts must be {self._n[layer]} finite values >= 0")
        n = float(c.sum())
        if self.half_life is not None and n:
            f = 0.5 ** (n / self.half_life)
            self._counts[layer] *= f
            self._requests[layer] *= f
        self._counts[layer] += c
        self._requests[layer] += n

    def add_trace(self, trace: Any) -> None:
        """Count a :class:`colibri.Trace`'s requests in order: each request
        weighs 0.5 per ``half_life`` requests of its layer that follow it."""
        for col, layer in enumerate(trace.layers.tolist()):
            if layer not in self._n:
                raise FormatError(f"the trace's layer {layer} is not in the usage history")
            rows = trace.experts[:, col, :]
            flat = np.array([e for r in rows.tolist() for e in dict.fromkeys(x for x in r if x >= 0)],
                            dtype=np.int64)
            if flat.size and flat.max() >= self._n[layer]:
                raise FormatError(f"the trace names expert {int(flat.max())} of layer {layer}, "
                                  f"which has {self._n[layer]}")
            n = flat.size
            if self.half_life is None:
                weights = np.ones(n)
            else:
                weights = 0.5 ** (np.arange(n - 1, -1, -1, dtype=np.float64) / self.half_life)
            old = 0.5 ** (n / self.half_life) if self.half_life is not None else 1.0
            self._counts[layer] = self._counts[layer] * old + np.bincount(
                flat, weights=weights, minlength=self._n[layer])
            self._requests[layer] = self._requests[layer] * old + float(weights.sum())

    def end_turn(self) -> None:
        """One turn ended: with ``half_life_turns``, decay every layer by one turn."""
        self.turns += 1
        if self.half_life_turns is not None:
            f = 0.5 ** (1.0 / self.half_life_turns)
            for layer in self._n:
                self._counts[layer] *= f
                self._requests[layer] *= f

    @classmethod
    def from_trace(cls, trace: Any, *, half_life: float | None = DEFAULT_HALF_LIFE,
                   half_life_turns: float | None = None, fingerprint: str | None = None) -> "Usage":
        """The history of a :class:`colibri.Trace` (its sequences in order)."""
        u = cls({l: trace.num_experts for l in trace.layers.tolist()}, half_life=half_life,
                half_life_turns=half_life_turns, fingerprint=fingerprint)
        u.add_trace(trace)
        return u

    # -- files --

    def _arrays(self) -> dict[str, np.ndarray]:
        layers = list(self.layers)
        width = max(self._n.values())
        counts = np.zeros((len(layers), width), dtype=np.float64)
        for i, l in enumerate(layers):
            counts[i, : self._n[l]] = self._counts[l]
        arrays: dict[str, np.ndarray] = {
            "version": np.array(_VERSION, dtype=np.int64),
            "fingerprint": np.frombuffer(self.fingerprint.encode(), dtype=np.uint8).copy(),
            "layers": np.array(layers, dtype=np.int32),
            "num_experts": np.array([self._n[l] for l in layers], dtype=np.int32),
            "counts": counts,
            "requests": np.array([self._requests[l] for l in layers], dtype=np.float64),
            "half_life": np.array(self.half_life or 0.0, dtype=np.float64),
            "half_life_turns": np.array(self.half_life_turns or 0.0, dtype=np.float64),
            "turns": np.array(self.turns, dtype=np.int64),
        }
        arrays["digest"] = _digest(arrays)
        return arrays

    def save(self, path: PathLike, *, _before_rename: Any = None) -> None:
        """Write the history atomically: a temporary file in the same
        directory, flushed to disk, then renamed over ``path``. If anything
        fails the old file is left as it was."""
        target = Path(os.fspath(path))
        save_npz_atomically(target, self._arrays(), before_rename=_before_rename)

    @classmethod
    def load(cls, path: PathLike, *, fingerprint: str | None = None, any_model: bool = False) -> "Usage":
        """Read a history file. With ``fingerprint`` (the model's), a file of
        another model is a FormatError unless ``any_model`` (then it is taken
        as it is, labelled with ``fingerprint``; :meth:`conform` fits it to
        the model's layers). A corrupt or truncated file is a FormatError
        naming it; nothing is returned half-read."""
        where, arrays = load_npz(path, "colibri usage file", _ARRAYS + ("digest",))
        if not np.array_equal(arrays["digest"], _digest(arrays)):
            raise FormatError(f"{where}: corrupt usage file (its digest does not match its contents)")
        if int(arrays["version"]) != _VERSION:
            raise FormatError(f"{where}: usage file version {int(arrays['version'])}, expected {_VERSION}")
        try:
            text = arrays["fingerprint"].astype(np.uint8).tobytes().decode()
            layers = arrays["layers"].astype(np.int64).tolist()
            n = arrays["num_experts"].astype(np.int64).tolist()
            counts = np.asarray(arrays["counts"], dtype=np.float64)
            req = np.asarray(arrays["requests"], dtype=np.float64)
            if (len(layers) != len(n) or counts.shape != (len(layers), max(n, default=0))
                    or req.shape != (len(layers),) or not np.isfinite(counts).all() or (counts < 0).any()):
                raise ValueError("inconsistent arrays")
            hl = float(arrays["half_life"])
            hlt = float(arrays["half_life_turns"])
            u = cls(dict(zip(layers, n)), half_life=hl or None, half_life_turns=hlt or None, fingerprint=text)
        except (ValueError, UnicodeDecodeError, FormatError) as exc:
            raise FormatError(f"{where}: corrupt usage file ({exc})") from None
        if fingerprint is not None and text != fingerprint:
            if not any_model:
                raise FormatError(
                    f"{where}: usage history of another model ({text}; this model is {fingerprint}); "
                    "pass usage_any_model=True to use it anyway"
                )
            u.fingerprint = fingerprint
        for i, l in enumerate(layers):
            u._counts[l] = counts[i, : n[i]].copy()
            u._requests[l] = float(req[i])
        u.turns = int(arrays["turns"])
        return u

    def conform(self, num_experts: Mapping[int, int]) -> "Usage":
        """This history for a model with these layers: counts kept for each
        layer present in both with the same number of experts, others start
        at zero."""
        u = Usage(num_experts, half_life=self.half_life, half_life_turns=self.half_life_turns,
                  fingerprint=self.fingerprint)
        for layer, n in u._n.items():
            if self._n.get(layer) == n:
                u._counts[layer] = self._counts[layer].copy()
                u._requests[layer] = self._requests[layer]
        u.turns = self.turns
        return u

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Usage):
            return NotImplemented
        a, b = self._arrays(), other._arrays()
        return all(np.array_equal(a[k], b[k]) for k in a)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        total = sum(self._requests.values())
        return f"<colibri.Usage {len(self._n)} layers, {total:.0f} decayed requests, {self.fingerprint}>"


def _positive_or_none(value: float | None, name: str) -> float | None:
    if value is None:
        return None
    v = float(value)
    if not v > 0 or v == float("inf"):
        raise FormatError(f"{name} must be > 0 (or None for no decay), got {value!r}")
    return v


def fingerprint_of_model(model: Any) -> str:
    """The fingerprint of a scanned checkpoint (colibri.layouts.ModelExperts):
    its MoE layers, experts per layer, and per layer each expert tensor's
    role, dtype and shape (and its scale's), i.e. the expert byte layout."""
    layout = []
    for layer in model.layers:
        ex = model.expert(layer, next(iter(model.experts[layer])))
        parts: list[Any] = [layer, model.expert_nbytes(layer)]
        for role in ("gate", "up", "down"):
            w = ex.weight(role)
            s = ex.scale(role)
            parts.append((role, w.dtype, tuple(w.shape), None if s is None else (s.dtype, tuple(s.shape))))
        layout.append(tuple(parts))
    return model_fingerprint({l: model.num_experts(l) for l in model.layers}, layout)


def load_for_store(path: PathLike, num_experts: Mapping[int, int], fingerprint: str, *,
                   half_life: float | None, half_life_turns: float | None, any_model: bool) -> Usage:
    """The history a store opens with: the file's if it exists (checked
    against the model's fingerprint), else an empty one. The half-lives
    given win over the file's."""
    if not os.path.exists(os.fspath(path)):
        return Usage(num_experts, half_life=half_life, half_life_turns=half_life_turns, fingerprint=fingerprint)
    u = Usage.load(path, fingerprint=fingerprint, any_model=any_model).conform(num_experts)
    u.half_life = _positive_or_none(half_life, "usage_half_life")
    u.half_life_turns = _positive_or_none(half_life_turns, "usage_half_life_turns")
    return u


class UsageTracker:
    """Feeds a store's per-expert request counters into its Usage and saves
    it: :meth:`save` adds what was served since the last save; at close the
    store calls :meth:`collect` before it closes and :meth:`finish` after. ``store`` needs ``layers`` and
    ``expert_requests(layer)`` (requests per expert since open)."""

    def __init__(self, store: Any, usage: Usage, path: PathLike) -> None:
        self.usage = usage
        self.path = os.fspath(path)
        self._store = store
        self._seen = {l: np.asarray(store.expert_requests(l), dtype=np.float64) for l in usage.layers}

    def collect(self) -> None:
        for layer in self.usage.layers:
            now = np.asarray(self._store.expert_requests(layer), dtype=np.float64)
            delta = now - self._seen[layer]
            if delta.any():
                self.usage.add(layer, delta)
            self._seen[layer] = now

    def save(self) -> None:
        self.collect()
        self.usage.save(self.path)

    def finish(self) -> None:
        """The store closed (after a last :meth:`collect`): end the turn, save."""
        self.usage.end_turn()
        self.usage.save(self.path)


def warm_order(history: Usage, room: Mapping[int, int], skip: Iterable[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """Up to ``room[layer]`` of each layer's hottest experts in the history,
    leaving out ``skip``, each layer's coldest first and hottest last (the
    last one warmed is the most recent)."""
    skipped = set(skip)
    out: list[tuple[int, int]] = []
    for layer in history.layers:
        want = room.get(layer, 0)
        if want <= 0:
            continue
        c = history.counts(layer)
        ranked = [(layer, int(e)) for e in np.argsort(-c, kind="stable") if c[e] > 0]
        out += list(reversed([k for k in ranked if k not in skipped][:want]))
    return out


def warm_for_store(history: Usage, slots: Mapping[int, int], pins: Iterable[tuple[int, int]],
                   warm: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``warm`` plus, for every layer, the history's hottest experts that are
    neither pinned nor in ``warm``, filling the layer's unpinned slots
    (``slots``: each layer's, as the store gives them)."""
    explicit = list(warm)
    pinned = list(pins)
    used: dict[int, int] = {}
    for layer, _ in pinned + explicit:
        used[layer] = used.get(layer, 0) + 1
    room = {l: max(0, slots[l] - used.get(l, 0)) for l in slots}
    return tuple(explicit + warm_order(history, room, pinned + explicit))


def pins_for_store(history: Usage, model: Any, pinned_bytes: int, slots: Mapping[int, int],
                   pin: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``pin`` plus the history's hottest experts up to ``pinned_bytes`` of
    expert bytes (:meth:`Usage.hottest_by_bytes`), at most half of each
    layer's slots (``slots``: as the store gives them) pinned in all, so
    every layer keeps room to load what a token asks."""
    explicit = list(pin)
    layers = list(model.layers)
    nbytes = {l: int(model.expert_nbytes(l)) for l in layers}
    taken: dict[int, int] = {}
    for layer, _ in explicit:
        taken[layer] = taken.get(layer, 0) + 1
    room = {l: max(0, slots[l] // 2 - taken.get(l, 0)) for l in layers}
    seen = set(explicit)
    budget = pinned_bytes - sum(nbytes.get(l, 0) for l, _ in explicit)
    chosen = [k for k in history.hottest_by_bytes(max(budget, 0), nbytes, room) if k not in seen]
    return tuple(explicit + chosen)
