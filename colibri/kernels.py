"""Native expert kernels: a leased expert's FFN computed from its bytes as stored.

:func:`expert_ffn` (also ``lease.ffn(x)``) runs ``down(act(gate x + b_gate,
up x + b_up)) + b_down`` for a batch of tokens routed to one expert, for
every format the store reads (BF16, F16, F32, FP8 with or without block
scales, MXFP4, compressed-tensors int4, GPTQ, AWQ), straight from the
lease's slot: no float copy of the weights is made. :func:`experts_ffn`
(also ``group.ffn(x, counts)``) does several leased experts of one layer in
one call, each on its own rows. Inputs and outputs are float32 or bfloat16,
numpy (bfloat16 through ml_dtypes) or torch CPU tensors, used in place.

The store fills the kernels' description of each expert from the slot in C
(``coli_store_expert_ffn``): Python only checks the operands. The C call
releases the GIL and holds the leases' slots while it computes. Threads:
``threads=`` per call, else ``torch.get_num_threads()`` for torch tensors
(inside :func:`torch_threads`, its number), else :func:`set_threads`'s
number (default: the CPUs this process may use).

The instruction-set path (``"scalar"``, ``"avx2"``, ``"avx512"``,
``"neon"``) is the best the CPU runs, unless the ``COLIBRI_KERNEL_ISA``
environment variable or :func:`set_isa` (or a call's ``isa=``) forces one;
forcing a path the CPU cannot run is an error. docs/kernels.md describes
the tiles and how a format's kernel is added.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Sequence

import ml_dtypes
import numpy as np

from colibri._ffi import LeaseBase, copy_views, ffi, lib
from colibri.errors import ColibriError, error_for
from colibri.checkpoint.experts import ExpertTensors
from colibri.compute_threads import check_threads, compute_pool, default_threads, set_threads, torch_threads
from colibri.formats import GPTQ
from colibri.linear import PackedWeight

__all__ = ["expert_ffn", "experts_ffn", "linear", "moe_ffn", "moe_combine", "ACTIVATIONS", "ISAS", "available_isas", "default_isa",
           "set_isa", "kernel_name", "amx_tiles", "set_threads", "default_threads", "torch_threads"]

ACTIVATIONS: tuple[str, ...] = ("silu", "gpt_oss")
ISAS: tuple[str, ...] = tuple(ffi.string(lib.coli_ffn_isa_name(i)).decode()
                              for i in range(lib.COLI_FFN_N_ISA))
_BF16 = np.dtype(ml_dtypes.bfloat16)
_F32 = np.dtype(np.float32)
_CODES = {_F32: lib.COLI_TENSOR_F32, _BF16: lib.COLI_TENSOR_BF16}
_BIAS_FORMATS = {np.dtype(np.float32): lib.COLI_TENSOR_F32, np.dtype(np.float16): lib.COLI_TENSOR_F16,
                 _BF16: lib.COLI_TENSOR_BF16}
_ERR_LEN: int = lib.COLI_ERR_LEN
_VIEW_SIZE: int = ffi.sizeof("ColiExpertView")

_state_lock = threading.Lock()
_forced: int | None = None                # set_isa's choice; None: the process default


def _isa_number(name: str) -> int:
    if name not in ISAS:
        raise ValueError(f"unknown kernel path {name!r}; the paths are {', '.join(ISAS)}")
    number = ISAS.index(name)
    if not lib.coli_ffn_isa_supported(number):
        raise ColibriError(f"the {name} kernel path cannot run on this CPU or build "
                           f"(runnable: {', '.join(available_isas())})")
    return number


def call_isa(isa: str | None = None) -> int:
    """The ``COLI_FFN_ISA_*`` number a native call is given: path ``isa``
    (checked), else :func:`set_isa`'s, else AUTO (the C side resolves it to
    ``COLIBRI_KERNEL_ISA``'s or the best the CPU runs)."""
    if isa is not None:
        return _isa_number(isa)
    return _forced if _forced is not None else lib.COLI_FFN_ISA_AUTO


def available_isas() -> tuple[str, ...]:
    """The paths this CPU and build can run, the portable scalar one first."""
    return tuple(n for i, n in enumerate(ISAS) if lib.coli_ffn_isa_supported(i))


def default_isa() -> str:
    """The path calls use now: :func:`set_isa`'s, else ``COLIBRI_KERNEL_ISA``'s,
    else the best one the CPU runs."""
    if _forced is not None:
        return ISAS[_forced]
    err = ffi.new("char[]", 256)
    rc = lib.coli_ffn_isa_default(err, 256)
    if rc < 0:
        raise error_for(rc, ffi.string(err).decode(errors="replace"))
    return ISAS[rc]


def set_isa(name: str | None) -> None:
    """Forces every later call onto path ``name`` (None: back to the default)."""
    global _forced
    number = None if name is None else _isa_number(name)
    with _state_lock:
        _forced = number


def amx_tiles() -> bool:
    """Whether bfloat16 calls of more than one token of compressed-tensors
    int4 (groups of a multiple of 32) and MXFP4 use AMX tiles on the
    avx512 path here: the CPU has AMX-TILE and AMX-INT8, the OS grants the
    tile state, and the ``COLIBRI_KERNEL_AMX`` environment variable is not
    ``"0"``. The results are the same bits either way."""
    return bool(lib.coli_ffn_amx_usable())


def kernel_name(lease: Any, role: str = "gate", isa: str | None = None) -> str:
    """The kernel a path uses for a role of this lease (e.g. ``"int4/avx512"``)."""
    info: ExpertTensors = lease.tensors
    number = _isa_number(isa or default_isa())
    name = lib.coli_ffn_kernel_name(number, info.coli_format(role), int(info.transposed))
    if name == ffi.NULL:
        raise ColibriError(f"no kernel computes {info.scheme} {role} stored "
                           f"{'(in, out)' if info.transposed else '(out, in)'}")
    return str(ffi.string(name).decode())


def _address(a: np.ndarray) -> int:
    """Where a C-contiguous array's bytes start (cffi's buffer view is the
    cheapest way to ask)."""
    return int(ffi.cast("uintptr_t", ffi.from_buffer(a)))


def _fill_matrix(dst: Any, info: ExpertTensors, role: str, parts: dict[str, np.ndarray]) -> None:
    """One matrix of a ``ColiFfnExpert`` built in Python from a lease's
    arrays: what ``coli_store_ffn_expert`` fills in C, kept as an independent
    construction for tests that break one field of a valid description."""
    name = "gate_up" if role == "gate" and info.fused else role
    data = parts[name]
    v = dst.view
    v.format = info.coli_format(role)
    v.data = ffi.cast("const void *", _address(data))
    v.data_bytes = data.nbytes
    shape = info.shape(role)
    assert shape is not None
    v.rows, v.columns = shape
    scale = parts.get(f"{name}_scale")
    v.scale_format = info.coli_scale_format(role)
    if scale is not None:
        v.scales = ffi.cast("const void *", _address(scale))
        v.scale_bytes = scale.nbytes
        block = info.block_shape(role)
        assert block is not None
        v.block_rows, v.block_columns = block
    dst.flags = (lib.COLI_FFN_IN_OUT if info.transposed else 0) | \
        (lib.COLI_FFN_ZERO_PLUS_ONE if info.scheme == GPTQ else 0) | \
        (lib.COLI_FFN_ORDER_CHECKED if v.format == lib.COLI_TENSOR_INT4_GPTQ else 0)
    zero = parts.get(f"{name}_zero")
    if zero is not None:
        dst.zeros = ffi.cast("const void *", _address(zero))
        dst.zero_bytes = zero.nbytes
    g_idx = parts.get(f"{name}_g_idx")
    if g_idx is not None:
        dst.g_idx = ffi.cast("const void *", _address(g_idx))
        dst.g_idx_count = g_idx.size
    bias = parts.get(f"{name}_bias")
    if bias is not None:
        fmt = _BIAS_FORMATS.get(bias.dtype)
        if fmt is None:
            raise ColibriError(f"{name}_bias is {bias.dtype}; the kernels take F32, F16 or BF16 biases")
        dst.bias = ffi.cast("const void *", _address(bias))
        dst.bias_format = fmt
        dst.bias_bytes = bias.nbytes


# Per lease class (one per store) and layer: the hidden size.
_hidden: "weakref.WeakKeyDictionary[type, dict[int, int]]" = weakref.WeakKeyDictionary()


def _store_of(lease: Any, what: str) -> tuple[Any, int]:
    """The C store handle of a colibri lease, and its layer's hidden size."""
    handle = getattr(type(lease), "_store_handle", None)
    if not isinstance(lease, LeaseBase) or handle is None:
        raise TypeError(f"{what} must be a lease of a colibri store, not {type(lease).__name__}")
    per_layer = _hidden.get(type(lease))
    if per_layer is None:
        per_layer = _hidden.setdefault(type(lease), {})
    hidden = per_layer.get(lease.layer)
    if hidden is None:
        info: ExpertTensors = getattr(lease, "tensors")
        shape = info.shape("down")
        assert shape is not None
        hidden = per_layer[lease.layer] = shape[1] if info.transposed else shape[0]
    return handle, hidden


class _Operand:
    """A numpy array or torch tensor seen as rows of floats: address, row
    stride, dtype code and shape, checked."""

    def __init__(self, value: Any, what: str, hidden: int, *, writable: bool) -> None:
        self.torch = type(value).__module__.startswith("torch")
        if self.torch:
            import torch

            if value.device.type != "cpu":
                raise ValueError(f"{what} is on {value.device}; the kernels run on CPU tensors")
            dtypes = {torch.float32: lib.COLI_TENSOR_F32, torch.bfloat16: lib.COLI_TENSOR_BF16}
            code = dtypes.get(value.dtype)
            shape, strides = tuple(value.shape), tuple(value.stride())
            self.address = int(value.data_ptr())
        elif isinstance(value, np.ndarray):
            code = _CODES.get(value.dtype)
            shape = value.shape
            strides = tuple(s // value.itemsize if s % value.itemsize == 0 else -1
                            for s in value.strides)
            if writable and not value.flags.writeable:
                raise ValueError(f"{what} is read-only")
            self.address = int(value.__array_interface__["data"][0])  # rows may be strided
        else:
            raise TypeError(f"{what} must be a numpy array or a torch tensor, not {type(value).__name__}")
        if code is None:
            raise TypeError(f"{what} is {value.dtype}; the kernels take float32 or bfloat16")
        if len(shape) not in (1, 2) or shape[-1] != hidden:
            raise ValueError(f"{what} has shape {list(shape)}; expected (tokens, {hidden}) or ({hidden},)")
        if shape[0] == 0 or (len(shape) == 2 and shape[0] == 0):
            raise ValueError(f"{what} has no tokens")
        if strides[-1] != 1 or (len(shape) == 2 and shape[0] > 1 and strides[0] < hidden):
            raise ValueError(f"{what} must have contiguous rows (strides {list(strides)} in elements)")
        self.code = code
        self.shape = shape
        self.tokens = shape[0] if len(shape) == 2 else 1
        self.stride = strides[0] if len(shape) == 2 and shape[0] > 1 else hidden
        self.value = value
        self.nbytes_span = ((self.tokens - 1) * self.stride + hidden) * (4 if code == lib.COLI_TENSOR_F32 else 2)


def _new_like(x: _Operand, columns: int | None = None) -> Any:
    """An array of x's kind, dtype and tokens; rows of ``columns`` (None: x's)."""
    shape = x.shape if columns is None else (*x.shape[:-1], columns)
    if x.torch:
        import torch

        return torch.empty(shape, dtype=x.value.dtype)
    return np.empty(shape, dtype=x.value.dtype)


def _overlap(a: _Operand, b: _Operand) -> bool:
    return a.address < b.address + b.nbytes_span and b.address < a.address + a.nbytes_span


def _operands(x: Any, out: Any, hidden: int, outputs: int | None = None) -> tuple[_Operand, _Operand, Any]:
    """x and out (made like x when None), checked against each other; rows
    of out are ``outputs`` long (None: ``hidden``, the shape of x)."""
    xo = _Operand(x, "x", hidden, writable=False)
    if out is None:
        out = _new_like(xo, outputs)
    oo = _Operand(out, "out", outputs or hidden, writable=True)
    if oo.torch != xo.torch or oo.tokens != xo.tokens or len(oo.shape) != len(xo.shape):
        rows = "" if outputs is None else f" but for rows of {outputs} values"
        raise ValueError(f"out ({type(out).__name__} {list(oo.shape)}) must be the same kind and "
                         f"shape as x ({type(x).__name__} {list(xo.shape)}){rows}")
    if _overlap(xo, oo):
        raise ValueError("out overlaps x")
    return xo, oo, out


def _call(xo: _Operand, oo: _Operand, threads: int | None, isa: str | None) -> tuple[Any, Any]:
    """The ``ColiFfnCall *`` of x and out, and the compute pool of ``threads``."""
    threads = default_threads(xo.torch) if threads is None else check_threads(threads)
    number = call_isa(isa)
    call = ffi.new("ColiFfnCall *", {
        "x": ffi.cast("const void *", xo.address), "x_format": xo.code, "x_stride": xo.stride,
        "out": ffi.cast("void *", oo.address), "out_format": oo.code, "out_stride": oo.stride,
        "tokens": xo.tokens, "isa": number})
    return call, compute_pool(threads)


def _run(handle: Any, views: Any, count: int, rows: Any, xo: _Operand, oo: _Operand,
         activation: str, threads: int | None, isa: str | None, alpha: float, limit: float) -> None:
    """One coli_store_expert_ffn call (the GIL is released for it)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, not {activation!r}")
    call, pool = _call(xo, oo, threads, isa)
    err = ffi.new("char[]", _ERR_LEN)
    rc = lib.coli_store_expert_ffn(handle, views, count, rows, call, ACTIVATIONS.index(activation),
                                   alpha, limit, pool, err, _ERR_LEN)
    if rc < 0:
        raise error_for(rc, ffi.string(err).decode(errors="replace"))


def expert_ffn(lease: Any, x: Any, *, activation: str = "silu", out: Any = None,
               threads: int | None = None, isa: str | None = None, alpha: float = 1.702,
               limit: float = 7.0) -> Any:
    """The routed expert of ``lease`` applied to ``x``: ``(tokens, hidden)``
    or ``(hidden,)``, float32 or bfloat16, a numpy array or a CPU torch
    tensor, rows contiguous.

    ``activation``: ``"silu"`` (``silu(gate x) * up x``) or ``"gpt_oss"``
    (gate clamped at ``limit``, up to +-``limit``, ``(up + 1) * gate *
    sigmoid(alpha * gate)``). Biases are added where the checkpoint has them.
    ``out``: where to write the result (same shape and kind as ``x``,
    float32 or bfloat16); by default a new array of ``x``'s dtype.
    ``threads``: the compute threads (default: :func:`default_threads`).
    ``isa``: force a path for this call. Returns ``out``. A released lease
    is a :class:`~colibri.LeaseError`.
    """
    handle, hidden = _store_of(lease, "lease")
    xo, oo, out = _operands(x, out, hidden)
    address = lease._view_address
    if not address:
        raise _released(lease)
    _run(handle, ffi.cast("ColiExpertView *", address), 1, ffi.NULL, xo, oo, activation, threads,
         isa, alpha, limit)
    return out


def linear(weight: PackedWeight, x: Any, *, out: Any = None, threads: int | None = None,
           isa: str | None = None) -> Any:
    """``out = x W^T (+ bias)`` for a :class:`~colibri.linear.PackedWeight`
    ``W`` of shape ``(outputs, inputs)``, computed from its stored bytes (no
    float copy of ``W``). ``x``: ``(tokens, inputs)`` or ``(inputs,)``,
    float32 or bfloat16, a numpy array or a CPU torch tensor, rows
    contiguous; ``out``: ``(tokens, outputs)`` (or ``(outputs,)``) of the
    same kind, float32 or bfloat16, by default new of ``x``'s dtype.
    ``threads`` and ``isa`` as :func:`expert_ffn` (the same compute pools).
    Returns ``out``."""
    n_out, n_in = weight.shape
    code = _torch_rows(x, n_in) if out is None and isa is None else -1
    if code >= 0:  # a model's forward: checked here in a few attribute reads
        out = x.new_empty((*x.shape[:-1], n_out))
        tokens = x.numel() // n_in
        call = ffi.new("ColiFfnCall *", {
            "x": ffi.cast("const void *", x.data_ptr()), "x_format": code, "x_stride": n_in,
            "out": ffi.cast("void *", out.data_ptr()), "out_format": code, "out_stride": n_out,
            "tokens": tokens, "isa": call_isa()})
        pool = compute_pool(default_threads(True) if threads is None else check_threads(threads))
    else:
        xo, oo, out = _operands(x, out, n_in, n_out)
        call, pool = _call(xo, oo, threads, isa)
    err = ffi.new("char[]", _ERR_LEN)
    rc = lib.coli_linear(weight.matrix(), call, pool, err, _ERR_LEN)
    if rc < 0:
        raise error_for(rc, ffi.string(err).decode(errors="replace"))
    return out


def _torch_rows(x: Any, n_in: int) -> int:
    """The format code of ``x`` when it is a contiguous CPU torch tensor of
    one or more rows of ``n_in`` float32 or bfloat16 values, else -1."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor) or not x.is_cpu or x.dim() not in (1, 2) \
            or x.shape[-1] != n_in or not x.numel() or not x.is_contiguous():
        return -1
    code: int = _codes("float32", "bfloat16").get(x.dtype, -1)
    return code


def _released(lease: Any) -> ColibriError:
    """The error for a kernel call on a released lease."""
    return error_for(lib.COLI_ELEASE, f"layer {lease.layer} expert {lease.expert}: used after its "
                                      "lease was released")


def experts_ffn(leases: Sequence[Any], x: Any, counts: Sequence[int] | np.ndarray, *,
                activation: str = "silu", out: Any = None, threads: int | None = None,
                isa: str | None = None, alpha: float = 1.702, limit: float = 7.0) -> Any:
    """Several leased experts of one layer (e.g. a :class:`~colibri.LeaseGroup`)
    in one call, each on its own rows: ``leases[i]`` takes the next
    ``counts[i]`` rows of ``x`` (``(tokens, hidden)``, ``tokens`` the sum of
    ``counts``; a count may be 0) and writes the same rows of ``out``.
    Operands and keywords as :func:`expert_ffn`. The experts are split over
    the threads (whole experts, or one expert's output rows when it has a
    thread's share of the rows or more). Returns ``out``.
    """
    n = len(leases)
    handle, hidden = _group_of(leases, "experts_ffn")
    xo, oo, out = _operands(x, out, hidden)
    if len(xo.shape) != 2:
        raise ValueError(f"x has shape {list(xo.shape)}; experts_ffn takes (tokens, {hidden})")
    rows = _row_offsets(counts, n, xo.tokens)
    views = ffi.new("ColiExpertView[]", n)
    copy_views(leases, int(ffi.cast("uintptr_t", views)))
    _run(handle, views, n, ffi.cast("int64_t *", rows.ctypes.data), xo, oo, activation, threads,
         isa, alpha, limit)
    return out


def _group_of(leases: Sequence[Any], what: str) -> tuple[Any, int]:
    """The C store handle of leases of one store, and their layer's hidden size."""
    if len(leases) == 0:
        raise ValueError(f"{what} needs at least one lease")
    handle, hidden = _store_of(leases[0], "leases[0]")
    if len({type(lease) for lease in leases}) == 1:
        return handle, hidden       # one lease class: one store
    for i in range(1, len(leases)):
        if getattr(type(leases[i]), "_store_handle", None) is not handle:
            raise ValueError(f"leases[{i}] is not a lease of leases[0]'s store")
    return handle, hidden


def _row_offsets(counts: Sequence[int] | np.ndarray, n: int, tokens: int) -> np.ndarray:
    """counts as n + 1 int64 offsets from 0 to tokens, checked."""
    c = np.asarray(counts)
    if c.shape != (n,) or (c.size and c.dtype.kind not in "iu"):
        raise ValueError(f"counts must be {n} ints (one per lease), not {c.shape} {c.dtype}")
    if c.size and int(c.min()) < 0:
        raise ValueError(f"counts must be >= 0, not {c.tolist()}")
    rows = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(c, out=rows[1:])
    if int(rows[-1]) != tokens:
        raise ValueError(f"counts add up to {int(rows[-1])} rows; x has {tokens}")
    return rows


# ---------------------------------------------------------------------------
# a MoE layer's (token, position) pairs: computed by expert, added by token


def _matrix(value: Any, what: str, codes: dict[Any, int], *, writable: bool = False) -> tuple[int, int, tuple[int, ...], int]:
    """(address, format code, shape, row stride in elements) of a 2-D torch
    tensor or numpy array with contiguous rows, its dtype one of ``codes``."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.is_cpu and value.dim() == 2 \
            and value.is_contiguous() and value.dtype in codes:
        # a model's own tensors, at every layer of a decode step: the few checks they need
        shape = tuple(value.shape)
        return int(value.data_ptr()), codes[value.dtype], shape, shape[1]
    if isinstance(value, np.ndarray):
        code = codes.get(value.dtype)
        shape = value.shape
        item = value.itemsize
        stride = value.strides[0] // item if len(shape) == 2 and value.strides[0] % item == 0 else -1
        ok = len(shape) == 2 and value.strides[1] == item and (not writable or value.flags.writeable)
        address = int(value.__array_interface__["data"][0])
    elif type(value).__module__.startswith("torch"):
        if value.device.type != "cpu":
            raise ValueError(f"{what} is on {value.device}; the kernels run on CPU tensors")
        code = codes.get(value.dtype)
        shape = tuple(value.shape)
        ok = value.dim() == 2 and value.stride(1) == 1
        stride = value.stride(0) if ok else -1
        address = int(value.data_ptr())
    else:
        raise TypeError(f"{what} must be a numpy array or a torch tensor, not {type(value).__name__}")
    if code is None:
        raise TypeError(f"{what} is {value.dtype}; expected {' or '.join(map(str, codes))}")
    if not ok or len(shape) != 2 or (shape[0] > 1 and stride < shape[1]):
        raise ValueError(f"{what} must be 2-D with contiguous rows" + (" and writable" if writable else "")
                         + f" (shape {list(shape)})")
    return address, code, shape, stride


_code_tables: dict[tuple[bool, tuple[str, ...]], dict[Any, int]] = {}


def _codes(*names: str) -> dict[Any, int]:
    """Format codes by numpy dtype and, once torch is imported, torch dtype."""
    torch = sys.modules.get("torch")
    key = (torch is not None, names)
    codes = _code_tables.get(key)
    if codes is None:
        by_name = {"float32": (_F32, lib.COLI_TENSOR_F32), "bfloat16": (_BF16, lib.COLI_TENSOR_BF16),
                   "int64": (np.dtype(np.int64), 0)}
        codes = {}
        for name in names:
            dtype, code = by_name[name]
            codes[dtype] = code
            if torch is not None:
                codes[getattr(torch, name)] = code
        _code_tables[key] = codes
    return codes


def moe_ffn(leases: Sequence[Any], x: Any, index: Any, pairs: Any, *, activation: str = "silu",
            threads: int | None = None, isa: str | None = None, alpha: float = 1.702,
            limit: float = 7.0) -> Any:
    """The (token, position) pairs of a MoE layer's routing that chose the
    experts of ``leases`` (leased experts of one layer, e.g. one
    :class:`~colibri.LeaseGroup` of the layer's union), each computed into
    its own row of ``pairs``: ``pairs[t * k + j] = expert index[t, j]
    applied to x[t]`` for every pair whose expert is leased; the other rows
    are left as they are.

    ``x`` is ``(tokens, hidden)`` float32 or bfloat16, ``index``
    ``(tokens, k)`` int64 expert numbers, ``pairs`` ``(tokens * k, hidden)``
    float32, numpy arrays or CPU torch tensors with contiguous rows. No row
    is copied for an expert that one pair chose; a row's bits do not depend
    on the other pairs. Keywords as :func:`expert_ffn`. Returns ``pairs``;
    :func:`moe_combine` then adds each token's pairs.
    """
    n = len(leases)
    handle, hidden = _group_of(leases, "moe_ffn")
    x_at, x_code, x_shape, x_stride = _matrix(x, "x", _codes("float32", "bfloat16"))
    i_at, _, i_shape, i_stride = _matrix(index, "index", _codes("int64"))
    p_at, _, p_shape, p_stride = _matrix(pairs, "pairs", _codes("float32"), writable=True)
    tokens, k = i_shape
    if x_shape != (tokens, hidden) or p_shape != (tokens * k, hidden) or (tokens > 1 and i_stride != k) or \
            (tokens * k > 1 and p_stride != hidden):
        raise ValueError(f"x {list(x_shape)}, index {list(i_shape)} and pairs {list(p_shape)} must be "
                         f"(tokens, {hidden}), (tokens, k) and (tokens * k, {hidden}), index and pairs "
                         "contiguous")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, not {activation!r}")
    threads = default_threads(not isinstance(x, np.ndarray)) if threads is None else check_threads(threads)
    number = call_isa(isa)
    views = ffi.new("ColiExpertView[]", n)
    copy_views(leases, int(ffi.cast("uintptr_t", views)))
    call = ffi.new("ColiMoeCall *", {
        "index": ffi.cast("const int64_t *", i_at), "tokens": tokens, "k": k,
        "x": ffi.cast("const void *", x_at), "x_format": x_code, "x_stride": x_stride if tokens > 1 else hidden,
        "pairs": ffi.cast("float *", p_at), "isa": number})
    err = ffi.new("char[]", _ERR_LEN)
    rc = lib.coli_store_moe_ffn(handle, views, n, call, ACTIVATIONS.index(activation), alpha, limit,
                                compute_pool(threads), err, _ERR_LEN)
    if rc < 0:
        raise error_for(rc, ffi.string(err).decode(errors="replace"))
    return pairs


def moe_combine(pairs: Any, weights: Any, out: Any) -> Any:
    """Each token's routed output from its pairs' rows (as :func:`moe_ffn`
    fills them): ``out[t] = sum of weights[t, j] * pairs[t * k + j]`` over
    ``j = 0 .. k - 1`` in that order, in float32 (each product rounded, then
    added), stored as ``out``'s dtype (float32, or bfloat16 rounded to
    nearest even). ``pairs`` is ``(tokens * k, hidden)`` float32,
    ``weights`` ``(tokens, k)`` float32 or bfloat16, ``out`` ``(tokens,
    hidden)``, all contiguous. A token's sum is the same bits whatever else
    is in the batch. Returns ``out``."""
    p_at, _, p_shape, p_stride = _matrix(pairs, "pairs", _codes("float32"))
    w_at, w_code, w_shape, w_stride = _matrix(weights, "weights", _codes("float32", "bfloat16"))
    o_at, o_code, o_shape, o_stride = _matrix(out, "out", _codes("float32", "bfloat16"), writable=True)
    tokens, k = w_shape
    hidden = o_shape[1]
    if p_shape != (tokens * k, hidden) or o_shape[0] != tokens or (tokens > 1 and (w_stride != k or o_stride != hidden)) \
            or (tokens * k > 1 and p_stride != hidden):
        raise ValueError(f"pairs {list(p_shape)}, weights {list(w_shape)} and out {list(o_shape)} must be "
                         "(tokens * k, hidden), (tokens, k) and (tokens, hidden), contiguous")
    err = ffi.new("char[]", _ERR_LEN)
    rc = lib.coli_moe_combine(ffi.cast("const float *", p_at), ffi.cast("const void *", w_at), w_code, tokens, k,
                              hidden, ffi.cast("void *", o_at), o_code, err, _ERR_LEN)
    if rc < 0:
        raise error_for(rc, ffi.string(err).decode(errors="replace"))
    return out
