"""How many compute threads a kernel call uses when it gives no ``threads=``.

For torch tensors: :func:`torch_threads`'s number inside its block (per
calling thread), else ``torch.get_num_threads()``. For numpy arrays:
:func:`set_threads`'s number, else the CPUs this process may run on.
:mod:`colibri.kernels` re-exports these. :func:`compute_pool` keeps one
native compute pool per thread count for the life of the process.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import Any, Iterator

from colibri._ffi import ffi, lib
from colibri.errors import error_for

__all__ = ["default_threads", "set_threads", "torch_threads"]

_state_lock = threading.Lock()
_threads: int | None = None               # set_threads's choice; None: the CPUs we may use
_torch_override = threading.local()
_pools: dict[int, Any] = {}               # threads -> ColiComputePool *


def _cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def set_threads(threads: int | None) -> None:
    """The compute threads of calls on numpy arrays that give no ``threads=``
    (None: the CPUs this process may run on). Calls on torch tensors follow
    ``torch.get_num_threads()``."""
    global _threads
    if threads is not None:
        check_threads(threads)
    with _state_lock:
        _threads = threads


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Within the block, calls on torch tensors made by this thread without
    ``threads=`` use ``threads`` instead of ``torch.get_num_threads()`` (so
    that an engine may run torch's own ops on fewer threads than the
    kernels). Blocks nest; the number before is restored on exit."""
    check_threads(threads)
    before = getattr(_torch_override, "threads", None)
    _torch_override.threads = threads
    try:
        yield
    finally:
        _torch_override.threads = before


def default_threads(torch_operand: bool = False) -> int:
    """The threads a call without ``threads=`` uses: for torch tensors,
    :func:`torch_threads`'s number inside its block, else
    ``torch.get_num_threads()``; else :func:`set_threads`'s number, else the
    CPUs this process may run on."""
    if torch_operand:
        override = getattr(_torch_override, "threads", None)
        if override is not None:
            return int(override)
        torch = sys.modules.get("torch")
        if torch is not None:
            return int(torch.get_num_threads())
    return _threads if _threads is not None else _cpus()


def check_threads(threads: Any) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 256:
        raise ValueError(f"threads must be an int from 1 to 256, not {threads!r}")
    return threads


def compute_pool(threads: int) -> Any:
    """The ``ColiComputePool *`` native calls of ``threads`` threads share
    (NULL for one thread: the calling thread computes alone), made at its
    first use."""
    if threads == 1:
        return ffi.NULL
    pool = _pools.get(threads)
    if pool is not None:
        return pool
    with _state_lock:
        pool = _pools.get(threads)
        if pool is None:
            out = ffi.new("ColiComputePool **")
            err = ffi.new("char[]", 256)
            rc = lib.coli_compute_pool_create(threads, out, err, 256)
            if rc < 0:
                raise error_for(rc, ffi.string(err).decode(errors="replace"))
            pool = _pools[threads] = out[0]
        return pool


@atexit.register
def _close_pools() -> None:
    with _state_lock:
        for pool in _pools.values():
            lib.coli_compute_pool_destroy(pool)
        _pools.clear()
