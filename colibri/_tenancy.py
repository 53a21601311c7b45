"""numpy arrays over one slot tenancy, shared by every lease of it.

A tenancy is one expert loaded into one slot; the C store gives each a
generation that is unique and never reused, so the arrays built for it can
be cached under that generation and handed to every later lease of it,
instead of building three arrays and a lifetime anchor per lease.

Safety rests on two facts:

* Each array's base chain ends at an :class:`_Owner` of ours (numpy's array
  interface), which holds only an address, so every object through which
  Python can reach the slot's bytes is an array or owner that we created and
  can count references to.
* The last lease of a tenancy to be released checks those counts. If nothing
  outside the cache refers to any of them, the C lease ends at once and the
  arrays stay cached (nobody can reach them until the next lease of the same
  generation, when the slot still holds the same expert). If something does
  (an array kept past its lease, a view of it, its ``.base``), the tenancy
  leaves the cache and the C lease is handed to its :class:`_Pin`, which every
  owner references: the lease ends when the last of those objects dies.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from colibri._lease import LeaseBase

__all__ = ["Tenancy", "Tenancies"]


class _Pin:
    """Referenced by every owner of a tenancy; its death ends deferred leases."""

    __slots__ = ("__weakref__",)


class _Owner:
    """The base of one array: exposes an address, shape and dtype to numpy."""

    __slots__ = ("__array_interface__", "pin")

    def __init__(self, address: int, shape: tuple[int, ...], typestr: str, pin: _Pin) -> None:
        self.__array_interface__ = {"shape": shape, "typestr": typestr, "data": (address, True), "version": 3}
        self.pin = pin


def _read_only_array(address: int, shape: tuple[int, int], dtype: np.dtype, pin: _Pin,
                     chain: list[Any]) -> np.ndarray:
    """A read-only array of dtype at address; every object of its base chain
    is appended to chain. The read-only flag cannot be turned back on, as
    the owner exposes its data as read-only."""
    if dtype.str[1] == "V":  # ml_dtypes (bf16, fp8): numpy knows them only by a view
        raw = np.asarray(_Owner(address, shape, f"<u{dtype.itemsize}", pin))
        arr = raw.view(dtype)
        chain += [raw.base, raw, arr]
    else:
        arr = np.asarray(_Owner(address, shape, dtype.str, pin))
        chain += [arr.base, arr]
    return arr


class Tenancy:
    """The arrays of one tenancy and the bookkeeping of its leases.

    ``active`` (leases using the arrays now) is changed only under the
    store's tenancy lock.
    """

    __slots__ = ("generation", "arrays", "active", "_pin", "_chain", "_baseline")

    def __init__(self, generation: int, base: int, offsets: list[int],
                 parts: tuple[tuple[np.dtype, tuple[int, int]] | None, ...]) -> None:
        self.generation = generation
        self.active = 0
        pin = self._pin = _Pin()
        chain: list[Any] = []
        arrays: list[np.ndarray | None] = []
        for part, offset in zip(parts, offsets):
            if part is None:
                arrays.append(None)
            else:
                dtype, shape = part
                arrays.append(_read_only_array(base + offset, shape, dtype, pin, chain))
        self.arrays = tuple(arrays)
        self._chain = chain
        del arrays  # the baseline counts only the references the tenancy keeps
        self._baseline = self._counts()

    def _counts(self) -> list[int]:
        # The same call at creation and at check, so the counts compare; a
        # count can only rise above its baseline (an outside reference).
        return list(map(sys.getrefcount, self._chain))

    def escaped(self) -> bool:
        """True when anything besides this tenancy refers to its arrays."""
        return self._counts() != self._baseline

    def defer(self, end_lease: Callable[[], None]) -> None:
        """Run end_lease once the last object reaching the slot's bytes dies."""
        weakref.finalize(self._pin, end_lease)


Parts = tuple[tuple[np.dtype, tuple[int, int]] | None, ...]


class Tenancies:
    """One store's cached tenancies, by generation, and the lease protocol
    around them: a lease joins its tenancy when it first hands out an array,
    and leaves it when released (called from the C lease type)."""

    __slots__ = ("_by_generation", "_lock", "_parts", "_limit")

    def __init__(self, parts: dict[int, Parts], limit: int) -> None:
        self._by_generation: dict[int, Tenancy] = {}
        self._lock = threading.Lock()  # guards _by_generation and Tenancy.active
        self._parts = parts            # per layer: (dtype, shape) of each array, as Tenancy takes
        self._limit = limit            # tenancies kept while unused, about two per slot

    def join(self, lease: LeaseBase) -> Tenancy:
        """The cached arrays of lease's tenancy (built on first use), counted
        as used by one more lease."""
        generation = lease._generation
        with self._lock:
            tenancy = self._by_generation.get(generation)
            if tenancy is not None:
                tenancy.active += 1
                return tenancy
        base, _span, *offsets = lease._layout()
        built = Tenancy(generation, base, offsets, self._parts[lease.layer])
        with self._lock:
            tenancy = self._by_generation.setdefault(generation, built)
            tenancy.active += 1
            if len(self._by_generation) > self._limit:
                self._prune()
        return tenancy

    def _prune(self) -> None:
        # Oldest first; a tenancy no lease uses is unreachable from outside
        # (checked when its last lease ended), so dropping it is always safe.
        # Caller holds _lock.
        unused = [g for g, t in self._by_generation.items() if t.active == 0]
        for generation in unused[: len(self._by_generation) // 2]:
            del self._by_generation[generation]

    def leave(self, lease: LeaseBase, tenancy: Tenancy) -> None:
        """lease, which used tenancy's arrays, was released: its C lease ends
        now, or, when the arrays escaped, with the last of them."""
        with self._lock:
            tenancy.active -= 1
            escaped = tenancy.active == 0 and tenancy.escaped()
            if escaped and self._by_generation.get(tenancy.generation) is tenancy:
                del self._by_generation[tenancy.generation]
        if not escaped:  # another lease still pins the slot, or nothing escaped
            lease._end_c_lease()
            return
        tenancy.defer(lease._end_c_lease)
        warnings.warn(
            f"arrays of expert {lease.expert} of layer {lease.layer} outlive their lease; "
            "the cache slot stays leased until they are deleted",
            ResourceWarning,
            stacklevel=2,  # the caller of release(), or the with block's frame
        )

    def clear(self) -> None:
        """Forget every cached tenancy (their addresses point into freed memory)."""
        with self._lock:
            self._by_generation.clear()
