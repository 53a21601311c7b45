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

The cache, the lease counts and the check are C (colibri._lease.Tenancies
and Tenancy, run under the GIL); this module builds a tenancy's arrays and
defers a lease whose arrays escaped.
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from colibri._ffi import Tenancy

if TYPE_CHECKING:
    from colibri._lease import LeaseBase

__all__ = ["Parts", "TenancyBuilder", "defer"]


class _Pin:
    """Referenced by every owner of a tenancy; its death ends deferred leases."""

    __slots__ = ("__weakref__",)


class _Owner:
    """The base of one array: exposes an address, shape and dtype to numpy."""

    __slots__ = ("__array_interface__", "pin")

    def __init__(self, address: int, shape: tuple[int, ...], typestr: str, pin: _Pin) -> None:
        self.__array_interface__ = {"shape": shape, "typestr": typestr, "data": (address, True), "version": 3}
        self.pin = pin


def _read_only_array(address: int, shape: tuple[int, ...], dtype: np.dtype, pin: _Pin,
                     chain: list[Any]) -> np.ndarray:
    """A read-only array of dtype at address; every object of its base chain
    is appended to chain. The read-only flag cannot be turned back on, as
    the owner exposes its data as read-only."""
    if dtype.type.__module__ == "ml_dtypes":  # bf16, fp8: numpy knows them only by a view
        raw = np.asarray(_Owner(address, shape, f"<u{dtype.itemsize}", pin))
        arr = raw.view(dtype)
        chain += [raw.base, raw, arr]
    else:
        arr = np.asarray(_Owner(address, shape, dtype.str, pin))
        chain += [arr.base, arr]
    return arr


Parts = tuple[tuple[np.dtype, tuple[int, ...]] | None, ...]
Locate = Callable[[int, int], tuple[int, ...]]


class TenancyBuilder:
    """Builds the arrays of a slot tenancy the first time a lease asks for
    one (called from C: colibri._lease.Tenancies)."""

    __slots__ = ("_parts", "_locate")

    def __init__(self, parts: dict[int, Parts], locate: Locate | None = None) -> None:
        # per layer: (dtype, shape) of each array, in coli_store_expert_parts's order
        self._parts = parts
        # (layer, expert) -> slot offset of each part; needed for extra parts,
        # which coli_view_layout does not cover
        self._locate = locate

    def build(self, lease: LeaseBase) -> Tenancy:
        base, _span, *offsets = lease._layout()
        parts = self._parts[lease.layer]
        if len(parts) > len(offsets):
            assert self._locate is not None
            in_slot = self._locate(lease.layer, lease.expert)
            anchor = 0 if parts[0] is not None else 2  # gate (or gate_up) is always present
            start = base + offsets[anchor] - in_slot[anchor]
            addresses = [start + o for o in in_slot]
        else:
            addresses = [base + o for o in offsets]
        pin = _Pin()
        chain: list[Any] = []
        listed: list[np.ndarray | None] = []
        for part, address in zip(parts, addresses):
            if part is None:
                listed.append(None)
            else:
                listed.append(_read_only_array(address, part[1], part[0], pin, chain))
        arrays = tuple(listed)
        # Tenancy counts the references each chain object has now as its
        # baseline: nothing transient (this list) may hold one any more.
        del listed
        return Tenancy(lease._generation, arrays, chain, pin)


def defer(tenancy: Tenancy, lease: LeaseBase) -> None:
    """tenancy's arrays escaped the lease being released: its C lease ends
    when the last object reaching the slot's bytes dies (called from C)."""
    weakref.finalize(tenancy.pin, lease._end_c_lease)
    warnings.warn(
        f"arrays of expert {lease.expert} of layer {lease.layer} outlive their lease; "
        "the cache slot stays leased until they are deleted",
        ResourceWarning,
        stacklevel=2,  # the caller of release(), or the with block's frame
    )
