"""Native expert kernels: a leased expert's FFN computed from its bytes as stored.

:func:`expert_ffn` runs ``down(act(gate x + b_gate, up x + b_up)) + b_down``
for a batch of tokens routed to one expert, for every format the store
reads (BF16, F16, F32, FP8 with or without block scales, MXFP4,
compressed-tensors int4, GPTQ, AWQ), straight from the lease's parts: no
float copy of the weights is made. Inputs and outputs are float32 or
bfloat16, numpy (bfloat16 through ml_dtypes) or torch CPU tensors, used in
place. The C call releases the GIL.

The instruction-set path (``"scalar"``, ``"avx2"``, ``"avx512"``,
``"neon"``) is the best the CPU runs, unless the ``COLIBRI_KERNEL_ISA``
environment variable or :func:`set_isa` (or a call's ``isa=``) forces one;
forcing a path the CPU cannot run is an error. docs/kernels.md describes
the tiles and how a format's kernel is added.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any

import ml_dtypes
import numpy as np

from colibri._ffi import ffi, lib
from colibri.errors import ColibriError, error_for
from colibri.checkpoint.experts import CONCATENATED, INTERLEAVED, ROLES, ExpertTensors
from colibri.formats import GPTQ

__all__ = ["expert_ffn", "ACTIVATIONS", "ISAS", "available_isas", "default_isa", "set_isa",
           "kernel_name"]

ACTIVATIONS: tuple[str, ...] = ("silu", "gpt_oss")
ISAS: tuple[str, ...] = tuple(ffi.string(lib.coli_ffn_isa_name(i)).decode()
                              for i in range(lib.COLI_FFN_N_ISA))
_BF16 = np.dtype(ml_dtypes.bfloat16)
_F32 = np.dtype(np.float32)
_FUSED = {None: lib.COLI_FFN_SEPARATE, CONCATENATED: lib.COLI_FFN_CONCATENATED,
          INTERLEAVED: lib.COLI_FFN_INTERLEAVED}
_CODES = {_F32: lib.COLI_TENSOR_F32, _BF16: lib.COLI_TENSOR_BF16}
_BIAS_FORMATS = {np.dtype(np.float32): lib.COLI_TENSOR_F32, np.dtype(np.float16): lib.COLI_TENSOR_F16,
                 _BF16: lib.COLI_TENSOR_BF16}

_state_lock = threading.Lock()
_forced: int | None = None                # set_isa's choice; None: the process default
_pools: dict[int, Any] = {}               # threads -> ColiComputePool *


def _isa_number(name: str) -> int:
    if name not in ISAS:
        raise ValueError(f"unknown kernel path {name!r}; the paths are {', '.join(ISAS)}")
    number = ISAS.index(name)
    if not lib.coli_ffn_isa_supported(number):
        raise ColibriError(f"the {name} kernel path cannot run on this CPU or build "
                           f"(runnable: {', '.join(available_isas())})")
    return number


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


def kernel_name(lease: Any, role: str = "gate", isa: str | None = None) -> str:
    """The kernel a path uses for a role of this lease (e.g. ``"int4/avx512"``)."""
    info: ExpertTensors = lease.tensors
    number = _isa_number(isa or default_isa())
    name = lib.coli_ffn_kernel_name(number, info.coli_format(role), int(info.transposed))
    if name == ffi.NULL:
        raise ColibriError(f"no kernel computes {info.scheme} {role} stored "
                           f"{'(in, out)' if info.transposed else '(out, in)'}")
    return str(ffi.string(name).decode())


def _pool(threads: int) -> Any:
    if threads == 1:
        return ffi.NULL
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


def _address(a: np.ndarray) -> int:
    """Where a C-contiguous array's bytes start (cffi's buffer view is the
    cheapest way to ask)."""
    return int(ffi.cast("uintptr_t", ffi.from_buffer(a)))


def _fill_matrix(dst: Any, info: ExpertTensors, role: str, parts: dict[str, np.ndarray]) -> None:
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
        (lib.COLI_FFN_ZERO_PLUS_ONE if info.scheme == GPTQ else 0)
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


_POINTERS = (("view.data", ""), ("view.scales", "_scale"), ("zeros", "_zero"),
             ("g_idx", "_g_idx"), ("bias", "_bias"))
_EXPERT_SIZE = ffi.sizeof("ColiFfnExpert")


class _Template:
    """A layer's ColiFfnExpert with every field its experts share filled in
    (formats, shapes, blocks, flags, sizes), and where each part's address
    goes: all experts of a store's layer are stored alike, so a call only
    copies the bytes and writes the addresses."""

    def __init__(self, info: ExpertTensors, parts: dict[str, np.ndarray]) -> None:
        expert = ffi.new("ColiFfnExpert *")
        expert.fused = _FUSED[info.fused]
        pointers: list[tuple[int, str]] = []
        for role in ROLES:
            if role == "up" and info.fused:
                continue
            _fill_matrix(getattr(expert, role), info, role, parts)
            name = "gate_up" if role == "gate" and info.fused else role
            for field, suffix in _POINTERS:
                if name + suffix in parts:
                    pointers.append((ffi.offsetof("ColiFfnExpert", role, *field.split(".")) // 8,
                                     name + suffix))
        self.bytes = np.frombuffer(ffi.buffer(expert), dtype=np.uint8).copy()
        self.pointers = tuple(pointers)
        self.activation = ffi.offsetof("ColiFfnExpert", "activation")
        self.alpha = ffi.offsetof("ColiFfnExpert", "alpha")
        self.limit = ffi.offsetof("ColiFfnExpert", "limit")
        shape = info.shape("down")
        assert shape is not None
        self.hidden = shape[1] if info.transposed else shape[0]

    def fill(self, parts: dict[str, np.ndarray], activation: int, alpha: float,
             limit: float) -> np.ndarray:
        buf = self.bytes.copy()
        words = buf.view(np.uint64)
        for index, name in self.pointers:
            words[index] = _address(parts[name])
        buf[self.activation:self.activation + 4].view(np.int32)[0] = activation
        buf[self.alpha:self.alpha + 4].view(np.float32)[0] = alpha
        buf[self.limit:self.limit + 4].view(np.float32)[0] = limit
        return buf


# Per lease class (one per store) and layer.
_templates: "weakref.WeakKeyDictionary[type, dict[int, _Template]]" = weakref.WeakKeyDictionary()


def _template(lease: Any, parts: dict[str, np.ndarray]) -> _Template:
    per_layer = _templates.get(type(lease))
    if per_layer is None:
        per_layer = _templates.setdefault(type(lease), {})
    found = per_layer.get(lease.layer)
    if found is None:
        found = per_layer[lease.layer] = _Template(lease.tensors, parts)
    return found


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


def _new_like(x: _Operand) -> Any:
    if x.torch:
        import torch

        return torch.empty(x.shape, dtype=x.value.dtype)
    return np.empty(x.shape, dtype=x.value.dtype)


def _overlap(a: _Operand, b: _Operand) -> bool:
    return a.address < b.address + b.nbytes_span and b.address < a.address + a.nbytes_span


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
    ``threads``: the compute threads (default: ``torch.get_num_threads()``
    for a torch input, else 1). ``isa``: force a path for this call.
    Returns ``out``.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, not {activation!r}")
    parts = lease.parts
    template = _template(lease, parts)
    hidden = template.hidden
    xo = _Operand(x, "x", hidden, writable=False)
    if out is None:
        out = _new_like(xo)
    oo = _Operand(out, "out", hidden, writable=True)
    if oo.torch != xo.torch or oo.tokens != xo.tokens or len(oo.shape) != len(xo.shape):
        raise ValueError(f"out ({type(out).__name__} {list(oo.shape)}) must be the same kind and "
                         f"shape as x ({type(x).__name__} {list(xo.shape)})")
    if _overlap(xo, oo):
        raise ValueError("out overlaps x")
    if threads is None:
        import sys

        torch = sys.modules.get("torch")
        threads = int(torch.get_num_threads()) if xo.torch and torch is not None else 1
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, not {threads!r}")
    number = _isa_number(isa) if isa is not None else (
        _forced if _forced is not None else lib.COLI_FFN_ISA_AUTO)

    buf = template.fill(parts, ACTIVATIONS.index(activation), alpha, limit)
    expert = ffi.from_buffer("ColiFfnExpert *", buf)
    call = ffi.new("ColiFfnCall *")
    call.x = ffi.cast("const void *", xo.address)
    call.x_format, call.x_stride = xo.code, xo.stride
    call.out = ffi.cast("void *", oo.address)
    call.out_format, call.out_stride = oo.code, oo.stride
    call.tokens = xo.tokens
    call.isa = number
    err = ffi.new("char[]", 512)
    rc = lib.coli_expert_ffn(expert, call, _pool(threads), err, 512)
    del parts, buf
    if rc < 0:
        raise error_for(rc, f"expert ({lease.layer}, {lease.expert}): "
                            + ffi.string(err).decode(errors="replace"))
    return out
