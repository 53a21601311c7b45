"""The Python face of the C expert store: open_store, leases, stats.

The layer is thin on purpose: every lookup, release and prefetch is one call
into C (which releases the GIL while it may block). What Python adds is
lifetime safety. A lease's arrays are numpy views over the slot's memory,
shared by every lease of the same slot tenancy (colibri/_tenancy.py), and the
C lease ends only when the lease has ended *and* no array from it is alive any
more. So an array kept past its ``with`` block stays valid (and a
``ResourceWarning`` says so) instead of silently reading another expert's bytes.
"""

from __future__ import annotations

import logging
import math
import operator
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, Sequence, Union

import numpy as np

from colibri._ffi import LeaseBase, Leaser, Tenancies, ffi, lib
from colibri._tenancy import Parts, TenancyBuilder, defer
from colibri.errors import (
    FormatError,
    LeaseError,
    StoreClosedError,
    UnknownExpertError,
    error_for,
)
from colibri.checkpoint.experts import ROLES, SOURCE_FIELDS, ExpertTensors, ModelExperts, TensorSource
from colibri.checkpoint.naming import AnyLayout
from colibri.checkpoint.scan import scan_model
from colibri.checkpoint.safetensors import ModelSource
from colibri.memory_room import AVAILABLE_MEMORY_ENV, auto_capacity, available_memory
from colibri.stats import StoreStats
from colibri import usage as _usage

__all__ = [
    "open_store",
    "open_replay_store",
    "Store",
    "ExpertLease",
    "LeaseGroup",
    "DEFAULT_SLOTS_PER_LAYER",
    "AVAILABLE_MEMORY_ENV",
    "POLICIES",
]

log = logging.getLogger("colibri")

DEFAULT_SLOTS_PER_LAYER = 8
_ERR_LEN: int = lib.COLI_ERR_LEN
_INT_MAX = 2 ** (8 * ffi.sizeof("int") - 1) - 1  # keys are C ints
_U64_MAX = 2 ** (8 * ffi.sizeof("uint64_t")) - 1  # byte settings are uint64_t; C caps them further


def _policy_names() -> tuple[str, ...]:
    names: list[str] = []
    while (name := lib.coli_store_policy_name(len(names))) != ffi.NULL:
        names.append(ffi.string(name).decode())
    return tuple(names)


#: The eviction policies the C core has, by name (``open_store(policy=...)``).
POLICIES: tuple[str, ...] = _policy_names()

#: Slots of every layer, or of each layer by layer index.
SlotsPerLayer = Union[int, Mapping[int, int]]


def _check(rc: int, err: Any) -> None:
    if rc != 0:
        raise error_for(rc, ffi.string(err).decode("utf-8", "replace"))


class ExpertLease(LeaseBase):
    """One leased expert: ``gate``, ``up``, ``down`` are read-only numpy arrays
    over the cache slot, valid while the lease (or any array from it) lives;
    ``gate_scale``, ``up_scale``, ``down_scale`` are their scales (FP8
    blocks, MXFP4, int4, GPTQ, AWQ), else None. For a fused layout ``gate`` is
    the fused gate_up and ``up`` is None. ``parts`` has every part by name
    (biases, zero points and g_idx too), ``tensors`` where each is in the files and how it is
    stored; :func:`colibri.dequantize` turns any of them into float32 gate,
    up and down. ``layer``, ``expert`` and ``key`` name the expert.

    Use it as a context manager; leaving the block releases it. ``release()``
    does the same explicitly; releasing twice is a :class:`LeaseError`.
    ``released`` says whether it was. A lease belongs to one thread at a time.

    Taking, entering and releasing a lease and getting its arrays run in C
    (csrc/py_lease.c); a lease is made only by :meth:`Store.lease` and
    :meth:`Store.lease_many`.
    """

    __slots__ = ()
    # Per store (a subclass made by Store): the model, the part names of
    # each layer in the C core's order (ExpertTensors.part_names), and the C
    # store (for the kernels).
    _model: ModelExperts | None = None
    _part_names: dict[int, tuple[str | None, ...]] = {}
    _store_handle: Any = None

    @property
    def tensors(self) -> ExpertTensors:
        """Where this expert's parts are in the files, and how they are stored
        (scheme, fused, transposed, group size)."""
        assert self._model is not None
        return self._model.expert(self.layer, self.expert)

    @property
    def key(self) -> tuple[int, int]:
        return (self.layer, self.expert)

    @property
    def parts(self) -> dict[str, np.ndarray]:
        """Every part of the expert as the slot holds it, by name: ``gate``,
        ``up``, ``down`` (or ``gate_up`` for a fused layout), ``<role>_scale``,
        ``<role>_bias``, ``<role>_zero``, ``<role>_g_idx``. As stored, except
        GPTQ with act order, held in group order (rows moved, ``g_idx``
        negative: see :mod:`colibri.formats.qmodule`). A new dict each time;
        its arrays are the lease's (read-only, valid while the lease or they
        live)."""
        arrays = self._all_parts
        return {name: array for name, array in zip(self._part_names[self.layer], arrays)
                if name is not None and array is not None}

    def ffn(self, x: Any, **options: Any) -> Any:
        """The expert applied to ``x`` by the native kernel, straight from the
        slot: :func:`colibri.expert_ffn` (its keywords: ``activation``,
        ``out``, ``threads``, ``isa``, ``alpha``, ``limit``)."""
        from colibri.kernels import expert_ffn

        return expert_ffn(self, x, **options)

    def __repr__(self) -> str:
        return f"store.lease({self.layer}, {self.expert})"


class LeaseGroup(tuple):  # type: ignore[type-arg]
    """The leases of one ``lease_many`` call, in the order asked; a context
    manager that releases every lease still held on exit."""

    def __enter__(self) -> "LeaseGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        for lease in self:
            if not lease.released:
                lease.release()

    def release(self) -> None:
        self.__exit__()

    def ffn(self, x: Any, counts: Any, **options: Any) -> Any:
        """The leased experts applied to ``x`` in one native call, lease ``i``
        to the next ``counts[i]`` rows: :func:`colibri.experts_ffn`."""
        from colibri.kernels import experts_ffn

        return experts_ffn(self, x, counts, **options)


@dataclass(frozen=True)
class StoreOptions:
    """What a C store is created with (its ``ColiStoreConfig``), as
    :func:`open_store` and :func:`open_replay_store` checked them."""

    slots_per_layer: SlotsPerLayer | None
    capacity_bytes: int | None
    prefetch_workers: int
    direct_io: bool
    slot_wait_timeout: float | None
    prefetch_queue_depth: int = 0
    demand_first: bool = True
    prefetch_chunk_bytes: int = 0
    read_chunk_bytes: int = 0
    read_advice: bool = True
    populate_slots: bool = True
    policy: str = "lru"
    pin: Sequence[tuple[int, int]] = ()
    warm: Sequence[tuple[int, int]] = ()
    #: a replay store, whose experts count this many bytes and are never read
    replay_expert_nbytes: int | None = None


class Store:
    """A bounded, per-layer LRU cache of a model's routed experts.

    Thread-safe: many threads may lease, release, prefetch and read stats at
    once. Build it with :func:`open_store`.
    """

    _usage: Any = None  # a colibri.usage.UsageTracker with open_store(usage_file=...)

    def __init__(self, model: ModelExperts, options: StoreOptions, config: "_Config | None" = None) -> None:
        self.model = model
        self._closed = False
        #: True for a replay store (:func:`open_replay_store`): no bytes, no files
        self.replay = options.replay_expert_nbytes is not None
        self.policy = options.policy
        self._handle = (config or _Config(model, options)).create()
        self._ops = self._handle.ops
        self._lease: Any
        if self.replay:
            self._lease = self._no_bytes
            self.prefetch_workers = 0
            self._direct = False
            return
        # Arrays shared by the leases of one slot tenancy; about one cached
        # tenancy per slot is enough to keep every hot expert's arrays.
        self._tenancies = Tenancies(
            TenancyBuilder({layer: _layer_arrays(model, layer) for layer in model.layers},
                           _locator(self._handle)).build,
            defer,
            limit=2 * sum(int(lib.coli_store_layer_slots(self._handle, l)) for l in model.layers) + 16,
        )
        self._leaser = Leaser(
            self._handle,
            int(ffi.cast("uintptr_t", self._handle)),
            int(ffi.cast("uintptr_t", lib.coli_lease_entry_points())),
            self._tenancies,
            type("ExpertLease", (ExpertLease,), {
                "__slots__": (),
                "_model": model,
                "_part_names": {layer: model.expert(layer, 0).part_names() for layer in model.layers},
                "_store_handle": self._handle,
            }),
            error_for,
            LeaseError,
        )
        self._lease = self._leaser.lease
        self.prefetch_workers = options.prefetch_workers
        self._direct = options.direct_io and not lib.coli_store_direct_io_fallback(self._handle)

    @property
    def direct_io(self) -> bool:
        """True when the store reads with O_DIRECT (past the page cache);
        False when it reads through the page cache, by choice or because the
        file system refused O_DIRECT."""
        return self._direct

    # -- model facts --

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")

    @property
    def layers(self) -> tuple[int, ...]:
        """Model layer indices that have routed experts, ascending."""
        self._check_open()
        return self.model.layers

    def num_experts(self, layer: int) -> int:
        """Routed experts of ``layer`` (UnknownExpertError if it has none)."""
        self._check_open()
        return self.model.num_experts(layer)

    def slots(self, layer: int) -> int:
        """Slots in ``layer``'s LRU."""
        self.num_experts(layer)
        return int(lib.coli_store_layer_slots(self._handle, layer))

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def active_leases(self) -> int:
        """C leases held now, including those kept alive by surviving arrays."""
        self._check_open()
        return int(lib.coli_store_active_leases(self._handle))

    # -- leases --

    def _no_bytes(self, layer: int, expert: int | Sequence[int]) -> Any:
        raise LeaseError(
            f"a replay store holds no expert bytes (layer {layer}): drive it with replay_tokens"
        )

    def lease(self, layer: int, expert: int) -> ExpertLease:
        """Lease one expert (blocking on a miss). Use as a context manager."""
        if self._closed:
            raise StoreClosedError("the store is closed")
        # C: a hit is taken holding the GIL; a miss drops it to read or wait.
        return self._lease(layer, expert)  # type: ignore[return-value]

    def lease_many(self, layer: int, experts: Iterable[int]) -> LeaseGroup:
        """Lease several experts of one layer, all or nothing, in the given
        order (duplicates allowed). Use as a context manager."""
        layer = operator.index(layer)
        wanted = [operator.index(e) for e in experts]
        if not wanted:
            self.num_experts(layer)  # closed store or unknown layer raise even for no experts
            return LeaseGroup(())
        self._check_open()
        for e in (layer, *wanted):
            if not -_INT_MAX <= e <= _INT_MAX:
                raise UnknownExpertError(f"layer {layer} has no expert {e}")
        if self.replay:
            self._no_bytes(layer, wanted)
        return LeaseGroup(self._leaser.lease_many(layer, wanted))

    def lease_hits(self, layer: int, experts: Iterable[int]) -> LeaseGroup:
        """Lease those of ``experts`` (of one layer, no repeats) that are
        resident now, in the given order, and nothing else: it never waits
        for a read. Each counts as a hit, like a lease; the others are not
        counted. An engine that starts the others' reads (``start_reads``)
        can compute with these while they load. Use as a context manager."""
        layer = operator.index(layer)
        wanted = [operator.index(e) for e in experts]
        self.num_experts(layer)  # closed store or unknown layer raise
        if len(set(wanted)) != len(wanted):
            raise ValueError(f"lease_hits: experts of layer {layer} repeat: {wanted}")
        if self.replay:
            self._no_bytes(layer, wanted)
        return LeaseGroup(self._leaser.lease_hits(layer, [e for e in wanted if 0 <= e <= _INT_MAX]))

    def replay_tokens(self, layers: Any, experts: Any) -> None:
        """Run routing choices through the store in C: for each token ``t``
        and each ``i``, one ``lease_many`` on layer ``layers[i]`` of the
        experts ``experts[t, i, :]`` that are >= 0 (repeats dropped), released
        before the next. ``layers`` is 1-D, ``experts`` has shape (tokens,
        len(layers), k), any k; both integer arrays. Counters move as
        they would for those calls from Python; on a replay store nothing is
        read. Raises the lookup's error (e.g. CacheFullError when a token asks
        more distinct experts of a layer than fit) naming token and layer.
        """
        self._check_open()
        lay = _int32_array(layers, "layers", 1)
        ex = _int32_array(experts, "experts", 3)
        if ex.shape[1] != lay.shape[0]:
            raise FormatError(
                f"experts has shape {ex.shape}: its second axis must match the {lay.shape[0]} layers"
            )
        err = ffi.new("char[]", _ERR_LEN)
        rc = lib.coli_store_replay(
            self._handle,
            ffi.cast("int *", ffi.from_buffer(lay)),
            lay.shape[0],
            ffi.cast("int32_t *", ffi.from_buffer(ex)),
            ex.shape[0],
            ex.shape[2],
            err,
            _ERR_LEN,
        )
        _check(rc, err)

    # -- prefetch --

    def prefetch(self, keys: Iterable[tuple[int, int]]) -> int:
        """Ask the I/O workers to load these experts in the background.

        Advisory: returns how many were accepted (0 with no workers, for keys
        already resident or loading, unknown keys, or no free slot or queue
        room). It holds no lease and never evicts a leased or loading slot.
        """
        self._check_open()
        clean: list[tuple[int, int]] = []
        for key in keys:
            try:
                layer, expert = operator.index(key[0]), operator.index(key[1])
            except (TypeError, IndexError):
                continue
            if 0 <= layer <= _INT_MAX and 0 <= expert <= _INT_MAX:
                clean.append((layer, expert))
        if not clean:
            return 0
        return int(self._ops.prefetch(self._handle, ffi.new("ColiExpertKey[]", clean), len(clean)))

    def start_reads(self, layer: int, experts: Iterable[int]) -> int:
        """Have the I/O workers read these experts of ``layer`` now, ahead of
        every queued prefetch, for leases the caller takes right after
        (computing meanwhile with the resident ones, see ``lease_hits``).
        Not guesses: the first lease of each counts a miss, as if that lease
        had read it. Returns how many reads were queued (0 without workers;
        experts resident or loading, unknown, or without a slot to take now
        are skipped)."""
        self._check_open()
        layer = operator.index(layer)
        ids = [e for e in map(operator.index, experts) if 0 <= e <= _INT_MAX]
        if not ids or not 0 <= layer <= _INT_MAX:
            return 0
        return int(lib.coli_store_start_reads(self._handle, layer, ffi.new("int[]", ids), len(ids)))

    def retire_prefetches(self, layer: int, keep: Iterable[int] = ()) -> int:
        """Say which experts of ``layer`` the engine really used: prefetches
        of that layer for other experts were wrong guesses. Queued ones are
        cancelled, running reads stop before their next chunk unless a lookup
        waits for them, and loaded ones never hit are evicted first. Returns
        how many were retired (a retired read that was on its last chunk still
        completes). :class:`colibri.Pilot` calls this from ``observe``.
        """
        self._check_open()
        layer = operator.index(layer)
        kept = [e for e in map(operator.index, keep) if 0 <= e <= _INT_MAX]
        if not 0 <= layer <= _INT_MAX:
            return 0  # no such layer: nothing to retire, as in C
        ids = ffi.new("int[]", kept) if kept else ffi.NULL
        return int(lib.coli_store_retire_prefetches(self._handle, layer, ids, len(kept)))

    def wait_idle(self, layer: int | None = None, timeout: float | None = None) -> None:
        """Wait until no load is queued or in flight (in ``layer``, or anywhere).

        Raises WaitTimeoutError if that takes longer than ``timeout`` seconds.
        """
        self._check_open()
        if layer is not None:
            self.model.num_experts(layer)
        ns = _nanoseconds(timeout)
        rc = lib.coli_store_wait_idle(self._handle, -1 if layer is None else layer, ns)
        if rc != 0:
            where = "the store" if layer is None else f"layer {layer}"
            raise error_for(rc, f"loads in {where} still running after {timeout} s")

    # -- stats and life cycle --

    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        self._check_open()
        out = ffi.new("ColiExpertStoreStats *")
        self._ops.stats(self._handle, out)
        return StoreStats.from_c(out, prefetch_pauses=int(lib.coli_store_prefetch_pauses(self._handle)))

    def layer_stats(self, layer: int) -> StoreStats:
        """A snapshot of ``layer``'s counters (``capacity_bytes``: its slots;
        ``peak_inflight`` and ``prefetch_pauses`` are store-wide, so 0 here)."""
        self.num_experts(layer)
        out = ffi.new("ColiExpertStoreStats *")
        if lib.coli_store_layer_stats(self._handle, layer, out) != 0:  # pragma: no cover - checked above
            raise UnknownExpertError(f"layer {layer} has no routed experts")
        return StoreStats.from_c(out, prefetch_pauses=0)

    def expert_requests(self, layer: int) -> np.ndarray:
        """Requests of each expert of ``layer`` since the store opened (they
        sum to the layer's ``requests``), indexed by expert."""
        n = self.num_experts(layer)
        out = np.zeros(n, dtype=np.uint64)
        lib.coli_store_expert_requests(self._handle, layer, ffi.cast("uint64_t *", ffi.from_buffer(out)), n)
        return out

    @property
    def pinned(self) -> tuple[tuple[int, int], ...]:
        """The pinned experts, as (layer, expert), by layer and expert. A pin
        whose load failed is dropped from it (its slot serves the layer's LRU)."""
        self._check_open()
        n = int(lib.coli_store_pinned(self._handle, ffi.NULL, 0))
        keys = ffi.new("ColiExpertKey[]", max(n, 1))
        n = min(n, int(lib.coli_store_pinned(self._handle, keys, n)))
        return tuple((int(keys[i].layer), int(keys[i].expert)) for i in range(n))

    def close(self) -> None:
        """Free the cache memory. Refuses (LeaseError) while leases are held
        or another thread is inside a lookup; a second close does nothing."""
        if self._closed:
            return
        if self._usage is not None:
            self._usage.collect()
        err = ffi.new("char[]", _ERR_LEN)
        _check(lib.coli_store_close(self._handle, err, _ERR_LEN), err)
        self._closed = True
        if not self.replay:
            self._tenancies.clear()  # their addresses point into freed slot memory now
        if self._usage is not None:
            self._usage.finish()  # ends the turn and saves the history

    @property
    def usage(self) -> Any:
        """The usage history (a :class:`colibri.Usage`) of
        ``open_store(usage_file=...)``, else None. Counts up to the last
        save; :meth:`save_usage` brings it up to date."""
        return None if self._usage is None else self._usage.usage

    def save_usage(self) -> None:
        """Add what the store served since the last save to the usage
        history and write it to its file, atomically (``close`` does too)."""
        self._check_open()
        if self._usage is None:
            raise FormatError("this store keeps no usage history: open it with usage_file=PATH")
        self._usage.save()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is on its way out: do not replace it with ours
            self.close()
        except LeaseError as err:
            log.warning("store left open while an exception propagates: %s", err)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.layers)} layers"
        return f"<colibri.Store {self.model.layout} {state}>"


def _int32_array(value: Any, name: str, ndim: int) -> np.ndarray:
    """value as a C-contiguous int32 array of ndim dimensions (FormatError if
    it is not an integer array of that shape or a value does not fit)."""
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"{name} must be an integer array: {exc}") from exc
    if arr.ndim != ndim:
        raise FormatError(f"{name} must have {ndim} dimension(s), not shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise FormatError(f"{name} must hold integers, not {arr.dtype}")
    if arr.size and (int(arr.min()) < -(2**31) or int(arr.max()) > _INT_MAX):
        raise FormatError(f"{name} holds values outside the 32-bit range")
    return np.ascontiguousarray(arr, dtype=np.int32)


class _NoTensors(Mapping[int, Any]):
    """The experts 0..n-1 of a replay store's layer: counted, no tensors."""

    def __init__(self, n: int) -> None:
        self._n = n

    def __getitem__(self, expert: int) -> Any:
        raise KeyError(expert)

    def get(self, expert: int, default: Any = None) -> Any:
        return default

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._n))

    def __len__(self) -> int:
        return self._n


def _layer_arrays(model: ModelExperts, layer: int) -> Parts:
    """How to view one layer's slot bytes: (dtype, shape) of each part as
    stored, in coli_store_expert_parts's order (gate, up, down, their scales,
    then the extra parts; None where absent). All experts of a layer agree."""
    return model.expert(layer, next(iter(model.experts[layer]))).part_views()


def _locator(handle: Any) -> Callable[[int, int], tuple[int, ...]]:
    """Slot offsets of every part of an expert (coli_store_expert_parts)."""
    size = int(lib.COLI_ROLE_PARTS) + int(lib.COLI_MAX_PARTS)  # each role's data and scales, then the extras

    def locate(layer: int, expert: int) -> tuple[int, ...]:
        out = ffi.new("uint64_t[]", size)
        n = int(lib.coli_store_expert_parts(handle, layer, expert, out, size))
        if n < 0:
            raise UnknownExpertError(f"layer {layer} has no expert {expert}")
        return tuple(out[0:n])

    return locate


def _fill_source(dst: Any, source: TensorSource | None) -> None:
    """Copies a role's record into its ColiTensorSource (left zeroed for None)."""
    if source is not None:
        for name, value in zip(SOURCE_FIELDS, source):
            setattr(dst, name, value)


def _nanoseconds(seconds: float | None) -> int:
    """A timeout for C: -1 waits forever (None or infinity), else >= 0 ns."""
    if seconds is None or math.isinf(seconds) and seconds > 0:
        return -1
    if not seconds >= 0:  # negative or NaN
        raise FormatError(f"a timeout must be >= 0 seconds or None, got {seconds}")
    return min(int(seconds * 1e9), 2**63 - 1)


def _destroy_handle(handle: Any) -> None:
    # Reached from close() or from garbage collection of an unclosed store.
    # A store collected with leases alive (only possible in a reference cycle)
    # is leaked rather than freed under them.
    if lib.coli_store_active_leases(handle):
        log.warning("a colibri store was garbage-collected with leases held; leaking it")
        return
    handle.ops.destroy(handle)


class _Config:
    """A store's ColiStoreConfig, built once from the model and its options,
    with every cffi object it points into: C plans its slots from it
    (:meth:`layer_slots`) and creates the store from it (:meth:`create`)."""

    def __init__(self, model: ModelExperts, o: StoreOptions) -> None:
        self.model = model
        self._keep: list[Any] = []  # what cfg points into, alive while it is
        cfg = self.cfg = ffi.new("ColiStoreConfig *")
        keys = list(model.keys())
        cfg.experts = self._sources(model, keys, replay=o.replay_expert_nbytes is not None)
        cfg.n_experts = len(keys)
        paths = [ffi.new("char[]", p.encode()) for p in model.files]
        cfg.files = self._hold(ffi.new("const char *[]", paths), *paths)
        cfg.n_files = len(paths)
        if isinstance(o.slots_per_layer, Mapping):
            cfg.layer_slots = self._hold(ffi.new("uint32_t[]", [o.slots_per_layer[l] for l in model.layers]))
            cfg.n_layer_slots = len(model.layers)
        else:
            cfg.slots_per_layer = o.slots_per_layer or 0
        cfg.capacity_bytes = o.capacity_bytes or 0
        cfg.policy = POLICIES.index(o.policy)
        cfg.replay = int(o.replay_expert_nbytes is not None)
        cfg.replay_expert_bytes = o.replay_expert_nbytes or 0
        cfg.prefetch_workers = o.prefetch_workers
        cfg.prefetch_queue_depth = o.prefetch_queue_depth
        cfg.direct_io = int(bool(o.direct_io))
        cfg.slot_wait_timeout_ns = _nanoseconds(o.slot_wait_timeout)
        cfg.prefetch_never_pauses = int(not o.demand_first)
        cfg.prefetch_chunk_bytes = o.prefetch_chunk_bytes
        cfg.read_chunk_bytes = o.read_chunk_bytes
        cfg.read_without_advice = int(not o.read_advice)
        cfg.lazy_slots = int(not o.populate_slots)
        self.preload(o.pin, o.warm)

    def _hold(self, obj: Any, *more: Any) -> Any:
        self._keep += [obj, *more]
        return obj

    def _sources(self, model: ModelExperts, keys: list[tuple[int, int]], replay: bool) -> Any:
        """Every expert's ColiExpertSource; a replay store's need only their keys."""
        sources = self._hold(ffi.new("ColiExpertSource[]", len(keys)))
        for i, (layer, expert) in enumerate(keys):
            src = sources[i]
            src.layer, src.expert = layer, expert
            if replay:
                continue
            ex = model.expert(layer, expert)
            for role in ROLES:
                _fill_source(getattr(src, role), ex.source(role))
            src.flags = ex.source_flags
            if ex.extras:
                parts = self._hold(ffi.new("ColiPartSource[]", len(ex.extras)))
                for k, (name, info) in enumerate(ex.extras):
                    p = parts[k]
                    p.file, p.offset, p.nbytes = info.file, info.offset, info.nbytes
                    p.kind, p.role, p.format = ex.part_use(name, info.dtype)
                src.n_parts, src.parts = len(ex.extras), parts
        return sources

    def preload(self, pin: Sequence[tuple[int, int]], warm: Sequence[tuple[int, int]]) -> None:
        """The experts the store pins and warms at create."""
        self.cfg.pinned = self._hold(ffi.new("ColiExpertKey[]", list(pin))) if pin else ffi.NULL
        self.cfg.n_pinned = len(pin)
        self.cfg.warm = self._hold(ffi.new("ColiExpertKey[]", list(warm))) if warm else ffi.NULL
        self.cfg.n_warm = len(warm)

    def layer_slots(self) -> dict[int, int]:
        """Each layer's slots as C will give them (coli_store_plan_slots)."""
        layers = self.model.layers
        out = ffi.new("uint32_t[]", max(len(layers), 1))
        err = ffi.new("char[]", _ERR_LEN)
        n = lib.coli_store_plan_slots(self.cfg, out, len(layers), err, _ERR_LEN)
        _check(min(n, 0), err)
        assert n == len(layers), (n, layers)
        return {layer: int(out[i]) for i, layer in enumerate(layers)}

    def create(self) -> Any:
        out = ffi.new("ColiExpertStore **")
        err = ffi.new("char[]", _ERR_LEN)
        _check(lib.coli_store_create(self.cfg, out, err, _ERR_LEN), err)
        return ffi.gc(out[0], _destroy_handle)


def _auto_direct_io(model: ModelExperts, slots_per_layer: SlotsPerLayer | None,
                    capacity_bytes: int | None, available: int | None) -> tuple[bool, str]:
    """The choice of ``direct_io="auto"`` and why: O_DIRECT when the routed
    experts are larger than the memory left for the page cache once the
    store holds its capacity (``available`` memory minus the store's bytes)."""
    experts = model.routed_nbytes()
    if capacity_bytes is not None:
        store = capacity_bytes
    else:
        slots = slots_per_layer or DEFAULT_SLOTS_PER_LAYER
        store = sum(min(slots[l] if isinstance(slots, Mapping) else slots, model.num_experts(l))
                    * model.expert_nbytes(l) for l in model.layers)
    if available is None:
        return False, "available memory unknown (no MemAvailable, no cgroup limit): reading through the page cache"
    left = available - store
    direct = experts > left
    return direct, (
        f"routed experts {experts:,} B {'>' if direct else '<='} available memory {available:,} B "
        f"minus the store's {store:,} B: {'O_DIRECT' if direct else 'reading through the page cache'}"
    )


def _count(value: Any, name: str, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"{name} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise FormatError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise FormatError(f"{name} must be <= {maximum}, got {value}")
    return value


def _slots(value: SlotsPerLayer, layers: Sequence[int]) -> SlotsPerLayer:
    """slots_per_layer checked: an int >= 1, or a mapping that gives every
    layer of the model (and no other) an int >= 1."""
    if not isinstance(value, Mapping):
        return _count(value, "slots_per_layer", minimum=1, maximum=2**32 - 1)
    missing = [layer for layer in layers if layer not in value]
    unknown = [layer for layer in value if layer not in layers]
    if unknown:
        raise FormatError(
            f"slots_per_layer names layers without routed experts: {sorted(unknown, key=str)[:8]} "
            f"(layers: {list(layers)[:8]}{'...' if len(layers) > 8 else ''})"
        )
    if missing:
        raise FormatError(f"slots_per_layer gives no slots to layers {missing[:8]}"
                          f"{'...' if len(missing) > 8 else ''}")
    return {layer: _count(value[layer], f"slots_per_layer[{layer}]", minimum=1, maximum=2**32 - 1)
            for layer in layers}


def _policy(value: Any) -> str:
    if value not in POLICIES:
        raise FormatError(f"unknown policy {value!r}; colibri has {', '.join(POLICIES)}")
    return str(value)


def _pins(value: Iterable[tuple[int, int]] | None, what: str = "pin") -> tuple[tuple[int, int], ...]:
    if value is None:
        return ()
    out: list[tuple[int, int]] = []
    for key in value:
        try:
            layer, expert = key
            layer, expert = operator.index(layer), operator.index(expert)
        except (TypeError, ValueError) as exc:
            raise FormatError(f"{what} takes (layer, expert) pairs of ints, not {key!r}") from exc
        if not (0 <= layer <= _INT_MAX and 0 <= expert <= _INT_MAX):
            adjective = "pinned" if what == "pin" else what
            raise FormatError(f"{adjective} expert {expert} of layer {layer} is not in the model")
        out.append((layer, expert))
    return tuple(out)


def open_store(
    path: Union[ModelSource, Sequence[ModelSource]],
    *,
    layout: Union[str, AnyLayout] = "auto",
    slots_per_layer: SlotsPerLayer | None = None,
    capacity_bytes: int | Literal["auto"] | None = None,
    prefetch_workers: int = 2,
    direct_io: Union[bool, Literal["auto"]] = "auto",
    slot_wait_timeout: float | None = 5.0,
    prefetch_queue_depth: int = 0,
    demand_first: bool = True,
    prefetch_chunk_bytes: int = 0,
    read_chunk_bytes: int = 0,
    read_advice: bool = True,
    populate_slots: bool = True,
    policy: str = "lru",
    pin: Iterable[tuple[int, int]] | None = None,
    warm: Iterable[tuple[int, int]] | None = None,
    usage_file: Union[str, "os.PathLike[str]", None] = None,
    usage_half_life: float | None = _usage.DEFAULT_HALF_LIFE,
    usage_half_life_turns: float | None = None,
    usage_any_model: bool = False,
    pinned_bytes: int | None = None,
    warm_start: bool = False,
) -> Store:
    """Open a model's routed experts as a leased, per-layer cache.

    ``path`` is a model directory (one file, or shards with
    ``model.safetensors.index.json``), one ``.safetensors`` file, or a list of
    them. Give at most one budget: ``slots_per_layer`` (capped at each layer's
    expert count; an int for every layer, or a mapping from each layer to its
    slots) or ``capacity_bytes`` (split evenly across layers); with neither,
    every layer gets ``DEFAULT_SLOTS_PER_LAYER`` slots. ``capacity_bytes="auto"``
    fills the memory this process may still take, cgroup limits included
    (:func:`colibri.memory_room.available_memory`), less the checkpoint's
    other tensors and a reserve of a quarter of it (at least 512 MiB) for
    the engine's activations and allocations: the size is logged and in
    ``store.stats().capacity_bytes``. ``policy`` (one of
    ``POLICIES``; "lru" by default) chooses each layer's victims. ``pin``
    lists (layer, expert) pairs kept resident for good: each takes one of its
    layer's slots (pinned plus the rest never exceed the budget; a layer
    cannot pin all its slots unless they hold all its experts), they load in
    the background after open (in open itself with no prefetch workers), and
    their hits count as ``persistent_hits``, all others as
    ``transient_hits``. ``warm`` lists (layer, expert) pairs loaded the same
    way into a layer's unpinned slots, but not pinned: a warm start, evicted
    by the policy like any other expert once loaded (the last of a layer's
    is the most recent when they load in order, as with no workers); a layer
    takes at most its unpinned slots.
    ``prefetch_workers`` I/O threads serve ``prefetch`` (0 turns it off).
    ``slot_wait_timeout`` is how long (seconds; None = forever) a lookup waits
    when every slot of its layer is leased before CacheFullError.
    ``demand_first`` (the default) makes running prefetch reads pause
    before each chunk of ``prefetch_chunk_bytes`` (0: 1 MiB, or 4 MiB with
    O_DIRECT, where each chunk is a device request of its own; at least
    64 KiB) while a lookup reads a missing expert, so that a miss shares
    the disk with at most one chunk per worker; False lets them share it
    (for comparisons).

    ``direct_io`` says how misses read the disk. ``"auto"`` (the default)
    reads with O_DIRECT, past the page cache, when the model's routed
    experts are larger than the memory the page cache could keep them in:
    the available memory (MemAvailable and any cgroup limit's room, or the
    environment variable ``COLIBRI_AVAILABLE_MEMORY``, in bytes) minus the
    store's own capacity. Such a model cannot stay
    cached, so the page cache would only copy every miss once more; a model
    that fits keeps buffered reads, and its misses run at memory speed once
    the files are cached (also across restarts). ``True`` and ``False``
    force either mode. Where the file system refuses O_DIRECT (ramfs, tmpfs
    before Linux 6.6, some FUSE and network file systems) the store reads
    through the page cache without an error. ``store.direct_io`` tells which mode is in use.
    Reads through the page cache go in preads of ``read_chunk_bytes``
    (0: 256 KiB, rounded up to 4 KiB), with the kernel's readahead off for
    the store's files; a miss whose first chunk is not in the page cache
    asks for the rest of the expert at once (``POSIX_FADV_WILLNEED``), so
    the copy of one chunk overlaps the disk's read of the next.
    ``read_advice=False`` leaves the readahead on and gives no advice (for
    comparisons).
    O_DIRECT reads take one call per expert.

    ``populate_slots`` (the default) faults the slots' memory in at open,
    zeroed once: no read then waits for the kernel to zero the pages it
    is about to fill (work an I/O worker would otherwise do on a core the
    compute needs), and a budget the machine cannot back fails at open.
    False leaves each slot's pages to its first read: a quicker open for a
    cache much larger than a run will fill.

    ``usage_file`` keeps a usage history (:class:`colibri.Usage`): it is
    loaded at open (a missing file starts an empty one; another model's file
    is a FormatError unless ``usage_any_model``), counts each layer's routed
    experts with decay (``usage_half_life`` requests of a layer halve what
    came before; ``usage_half_life_turns`` sessions, too) and is saved
    atomically on ``close()`` and ``store.save_usage()``. ``pinned_bytes``
    pins the history's hottest experts (at most half of a layer's slots),
    up to that many bytes of the budget, beside any ``pin``. ``warm_start``
    warms every layer's unpinned slots (after any ``warm``) with the
    history's hottest experts that are not pinned, the hottest last.
    """
    if slots_per_layer is not None and capacity_bytes is not None:
        raise FormatError("give slots_per_layer or capacity_bytes, not both")
    auto = capacity_bytes == "auto"
    if isinstance(capacity_bytes, str) and not auto:
        raise FormatError(f'capacity_bytes must be an int or "auto", not {capacity_bytes!r}')
    budget: int | None = None
    if capacity_bytes is not None and not auto:
        budget = _count(capacity_bytes, "capacity_bytes", minimum=1)
    if slots_per_layer is None and capacity_bytes is None:
        slots_per_layer = DEFAULT_SLOTS_PER_LAYER
    prefetch_workers = _count(prefetch_workers, "prefetch_workers", minimum=0)
    prefetch_queue_depth = _count(prefetch_queue_depth, "prefetch_queue_depth", minimum=0)
    prefetch_chunk_bytes = _count(prefetch_chunk_bytes, "prefetch_chunk_bytes", minimum=0)
    read_chunk_bytes = _count(read_chunk_bytes, "read_chunk_bytes", minimum=0)
    if direct_io != "auto" and not isinstance(direct_io, bool):
        raise FormatError(f'direct_io must be True, False or "auto", not {direct_io!r}')
    _nanoseconds(slot_wait_timeout)  # refuse a bad timeout before reading any file
    policy = _policy(policy)
    pins = _pins(pin)
    warms = _pins(warm, "warm")
    if slots_per_layer is not None and not isinstance(slots_per_layer, Mapping):
        slots_per_layer = _slots(slots_per_layer, ())
    model = scan_model(path, layout=layout)  # type: ignore[arg-type]
    # read once: the auto budget and the auto read mode see the same figure
    available = available_memory() if auto or direct_io == "auto" else None
    if auto:
        budget, why = auto_capacity(model, available)
        log.info('capacity_bytes="auto": %s', why)
    if slots_per_layer is not None:
        slots_per_layer = _slots(slots_per_layer, model.layers)
    history = None
    if usage_file is not None:
        history = _usage.load_for_store(
            usage_file, {l: model.num_experts(l) for l in model.layers}, _usage.fingerprint_of_model(model),
            half_life=usage_half_life, half_life_turns=usage_half_life_turns, any_model=usage_any_model)
    if pinned_bytes is not None:
        pinned_bytes = _count(pinned_bytes, "pinned_bytes", minimum=0)
        if history is None:
            raise FormatError("pinned_bytes pins the hottest experts of a usage history: give usage_file")
    if warm_start and history is None:
        raise FormatError("warm_start loads the hottest experts of a usage history: give usage_file")
    if direct_io == "auto":
        direct, why = _auto_direct_io(model, slots_per_layer, budget, available)
        log.info("direct_io=auto: %s", why)
    else:
        direct = direct_io
    options = StoreOptions(
        slots_per_layer=slots_per_layer,
        capacity_bytes=budget,
        prefetch_workers=prefetch_workers,
        direct_io=direct,
        slot_wait_timeout=slot_wait_timeout,
        prefetch_queue_depth=prefetch_queue_depth,
        demand_first=bool(demand_first),
        prefetch_chunk_bytes=min(prefetch_chunk_bytes, _U64_MAX),
        read_chunk_bytes=min(read_chunk_bytes, _U64_MAX),
        read_advice=bool(read_advice),
        populate_slots=bool(populate_slots),
        policy=policy,
        pin=pins,
        warm=warms,
    )
    config = _Config(model, options)
    if history is not None and (pinned_bytes is not None or warm_start):
        slots = config.layer_slots()  # as C gives them: the budget over each layer's slot size
        if pinned_bytes is not None:
            pins = _usage.pins_for_store(history, model, pinned_bytes, slots, pins)
        if warm_start:
            warms = _usage.warm_for_store(history, slots, pins, warms)
        options = replace(options, pin=pins, warm=warms)
        config.preload(pins, warms)
    store = Store(model, options, config)
    if direct_io is True and not store.direct_io:
        log.warning("direct_io: the file system refused O_DIRECT; reading through the page cache")
    if history is not None and usage_file is not None:
        store._usage = _usage.UsageTracker(store, history, usage_file)
    return store


def open_replay_store(
    num_experts: Mapping[int, int],
    *,
    slots_per_layer: SlotsPerLayer,
    expert_nbytes: int = 1,
    policy: str = "lru",
    pin: Iterable[tuple[int, int]] | None = None,
    warm: Iterable[tuple[int, int]] | None = None,
    slot_wait_timeout: float | None = 5.0,
) -> Store:
    """A replay store: the C store of :func:`open_store`, for a model of
    ``num_experts[layer]`` experts per layer of ``expert_nbytes`` bytes each,
    that opens no file, allocates no slot memory and reads nothing. Its
    lookups, evictions and counters are those of a live store fed the same
    calls (``bytes_read`` counts what reads would bring), so
    :meth:`Store.replay_tokens` measures a budget, policy and pins on a
    routing trace at millions of lookups a second. Pins and ``warm``
    experts (as in :func:`open_store`) are resident at once, the last warm
    expert of a layer the most recent. Its ``lease`` and ``lease_many`` raise LeaseError: there are no
    bytes to lend.
    """
    if not isinstance(num_experts, Mapping) or not num_experts:
        raise FormatError("num_experts must be a non-empty mapping from layer to expert count")
    experts: dict[int, Mapping[int, Any]] = {}
    for layer in sorted(num_experts):
        _count(layer, "a layer index", minimum=0, maximum=int(lib.COLI_MAX_LAYER_ID))
        n = _count(num_experts[layer], f"num_experts[{layer}]", minimum=1, maximum=int(lib.COLI_MAX_EXPERT_ID) + 1)
        experts[layer] = _NoTensors(n)
    expert_nbytes = _count(expert_nbytes, "expert_nbytes", minimum=1, maximum=1 << 40)
    model = ModelExperts(files=(), layout="replay", experts=experts)
    _nanoseconds(slot_wait_timeout)
    return Store(model, StoreOptions(
        slots_per_layer=_slots(slots_per_layer, model.layers),
        capacity_bytes=None,
        prefetch_workers=0,
        direct_io=False,
        slot_wait_timeout=slot_wait_timeout,
        policy=_policy(policy),
        pin=_pins(pin),
        warm=_pins(warm, "warm"),
        replay_expert_nbytes=expert_nbytes,
    ))
