"""One token's routed experts in a decode step, with the native calls built once.

:func:`colibri.kernels.moe_ffn` and :func:`colibri.kernels.moe_combine`
check their operands and build their call structs at every call; for one
token in a small MoE layer that costs a tenth of the layer's kernels, at
every layer of every step. :class:`OneTokenMoe` keeps, for one layer, the
pairs' buffer, the call structs and the views' array, checks its first
call's operands through ``moe_ffn`` itself, and afterwards only that the
operands are still the ones it was made for (their dtype, shape and
store): the same native calls on the same values, so the same bits.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from colibri._ffi import LeaseBase, copy_views, ffi, lib
from colibri.compute_threads import compute_pool, default_threads
from colibri.errors import error_for
from colibri.kernels import ACTIVATIONS, call_isa, moe_combine, moe_ffn

__all__ = ["OneTokenMoe"]

_ERR_LEN = 256


class OneTokenMoe:
    """Pairs and combine of one token routed to ``k`` experts of one
    layer of ``hidden`` values: :meth:`ffn` per lease group (as
    ``moe_ffn``), then :meth:`combine` (as ``moe_combine``) into a
    ``(1, hidden)`` output. Operands are CPU torch tensors: ``x`` ``(1,
    hidden)`` float32 or bfloat16, ``index`` ``(1, k)`` int64, ``weights``
    ``(1, k)`` float32 or bfloat16, all contiguous. Not for concurrent use
    (the caller holds the layer)."""

    def __init__(self, k: int, hidden: int, activation: str, alpha: float, limit: float) -> None:
        torch = sys.modules["torch"]
        self.k, self.hidden = k, hidden
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.code = ACTIVATIONS.index(activation)
        self.pairs = torch.empty((k, hidden), dtype=torch.float32)
        self.views = ffi.new("ColiExpertView[]", k)
        self.views_at = int(ffi.cast("uintptr_t", self.views))
        self.call = ffi.new("ColiMoeCall *", {"tokens": 1, "k": k, "x_stride": hidden,
                                              "pairs": ffi.cast("float *", self.pairs.data_ptr())})
        self.err = ffi.new("char[]", _ERR_LEN)
        self.codes = {torch.float32: lib.COLI_TENSOR_F32, torch.bfloat16: lib.COLI_TENSOR_BF16}
        self.handle: Any = None         # the store of the leases the last checked call had
        self.x_dtype: Any = None        # the dtype of its x

    def fits(self, x: Any, index: Any) -> bool:
        """Whether ``x`` and ``index`` are operands this object computes."""
        torch = sys.modules["torch"]
        return x.dtype in self.codes and tuple(x.shape) == (1, self.hidden) \
            and x.is_contiguous() and x.is_cpu and index.dtype == torch.int64 \
            and tuple(index.shape) == (1, self.k) and index.is_contiguous() and index.is_cpu

    def ffn(self, leases: Sequence[Any], x: Any, index: Any) -> None:
        """The pairs of the experts of ``leases`` (one lease group of the
        layer) for ``x`` routed by ``index`` (see :meth:`fits`)."""
        n = len(leases)
        handle = getattr(type(leases[0]), "_store_handle", None) if n else None
        if handle is None or handle is not self.handle or x.dtype != self.x_dtype or n > self.k \
                or not all(isinstance(lease, LeaseBase) and type(lease) is type(leases[0]) for lease in leases):
            # the first call, or another store or dtype: every check, then remember what passed
            moe_ffn(leases, x, index, self.pairs, activation=self.activation, alpha=self.alpha, limit=self.limit)
            self.handle, self.x_dtype = handle, x.dtype
            return
        copy_views(leases, self.views_at)
        call = self.call
        call.index = ffi.cast("const int64_t *", index.data_ptr())
        call.x = ffi.cast("const void *", x.data_ptr())
        call.x_format = self.codes[x.dtype]
        call.isa = call_isa()
        rc = lib.coli_store_moe_ffn(handle, self.views, n, call, self.code, self.alpha, self.limit,
                                    compute_pool(default_threads(True)), self.err, _ERR_LEN)
        if rc < 0:
            raise error_for(rc, ffi.string(self.err).decode(errors="replace"))

    def combine(self, weights: Any, out: Any) -> Any:
        """``out`` ``(1, hidden)`` float32 or bfloat16 = the token's pairs
        weighted by ``weights`` ``(1, k)`` and added in routing order (as
        ``moe_combine``, which checks operands of other shapes)."""
        w_code, o_code = self.codes.get(weights.dtype), self.codes.get(out.dtype)
        if w_code is None or o_code is None or tuple(weights.shape) != (1, self.k) \
                or tuple(out.shape) != (1, self.hidden) or not (weights.is_contiguous() and out.is_contiguous()) \
                or not (weights.is_cpu and out.is_cpu):
            return moe_combine(self.pairs, weights, out)
        rc = lib.coli_moe_combine(ffi.cast("const float *", self.pairs.data_ptr()),
                                  ffi.cast("const void *", weights.data_ptr()), w_code, 1, self.k, self.hidden,
                                  ffi.cast("void *", out.data_ptr()), o_code, self.err, _ERR_LEN)
        if rc < 0:
            raise error_for(rc, ffi.string(self.err).decode(errors="replace"))
        return out
