"""The arm64 build of the kernels under qemu-user: the neon path against the
scalar one, the float64 reference and this machine's scalar path.

tests/c/ffn_cases.c is cross-compiled statically with the product's kernel
sources and run under qemu-aarch64 on expert descriptions written here (the
store's own ColiFfnExpert of a lease, its bytes copied): every format of
colibri.synthetic_formats, odd widths where a format allows them, groups,
act order, biases, both activations, float32 and bfloat16 calls of 1 to 33
tokens, and the plain formats also stored (in, out). Each matrix must run a
NEON kernel of its own (the arm64 build's coli_ffn_kernel_name), and each
token the same bits alone, batched and on three threads; where arm64's
sanitizer runtimes are installed, the same cases run again built with
ASan+UBSan, for no report and the same bits. Skipped without
aarch64-linux-gnu-gcc or qemu-aarch64.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import build_ffi_loader  # noqa: F401  (puts the project root on sys.path)
import colibri
from build_ffi import SOURCES as CORE
from colibri import kernels
from colibri._ffi import ffi, lib
from colibri.synthetic_formats import write_format_checkpoint
from test_kernels import BF16, BF16_BOUND, F32_BOUND, reference, relative_error

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
# The driver and the product's kernel sources: every path's file and the pool.
SOURCES = [ROOT / "tests" / "c" / "ffn_cases.c",
           *(CSRC / s for s in CORE if s.startswith("ffn") or s == "compute_pool.c")]
BLOB_NULL = 2 ** 64 - 1
TOKENS = (1, 2, 3, 5, 16, 33)
# Every format the store computes has a NEON kernel of its own, in every
# orientation it is computed in.
NEON_FORMATS = {"BF16", "F16", "F32", "F8_E4M3", "F8_E5M2", "FP8_E4M3_BLOCK", "FP4_NATIVE_BLOCK",
                "INT4_BLOCK", "INT4_GPTQ", "INT4_AWQ"}

pytestmark = pytest.mark.skipif(CC is None or QEMU is None,
                                reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (arm64 under qemu-user)")

# (format, hidden, intermediate, write_format_checkpoint options): odd widths
# where the format takes any, partial SIMD blocks, groups that do and do not
# divide the inputs, every GPTQ g_idx kind.
CHECKPOINTS: list[tuple[str, int, int, dict[str, Any]]] = [
    *((fmt, 37, 23, {}) for fmt in ("bf16", "f16", "f32", "f8_e4m3", "f8_e5m2", "gpt_oss", "llama4",
                                   "stacked")),
    *((fmt, 160, 96, {}) for fmt in ("bf16", "f32", "f8_e4m3", "gpt_oss")),
    ("fp8_block", 37, 23, {"block": (7, 13)}),
    ("fp8_block", 160, 96, {"block": (64, 32)}),
    ("mxfp4", 64, 32, {}),
    ("mxfp4", 160, 96, {}),
    *(("int4", h, i, {"group": g, "symmetric": s})
      for h, i, g in ((40, 24, 8), (96, 64, 32), (160, 96, 16), (256, 128, 128)) for s in (True, False)),
    ("stacked_int4", 96, 64, {"group": 32, "symmetric": False}),
    *((fmt, h, i, {"group": g, "g_idx": gi})
      for fmt in ("gptq", "gptq_v2", "awq") for h, i, g in ((40, 24, 8), (160, 96, 32), (200, 136, 24),
                                                           (72, 48, -1))
      for gi in (("act_order", "sorted", None) if fmt != "awq" else (None,))),
]


def _blob(address: Any, size: int) -> bytes:
    if address == ffi.NULL:
        return struct.pack("<Q", BLOB_NULL)
    return struct.pack("<Q", size) + bytes(ffi.buffer(address, size))


# Element bytes of the formats a test also stores transposed.
PLAIN_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "FP8_E4M3_BLOCK": 1}
# Checkpoints (stored (out, in)) whose cases run a second time with every
# matrix stored (in, out): the plain formats the synthetic checkpoints only
# write one way.
TRANSPOSED = {"f16", "f8_e4m3", "f8_e5m2", "fp8_block"}


def _matrix(m: Any, transpose: bool = False) -> bytes:
    """A matrix of the driver's file; transposed: a plain (out, in) one
    stored (in, out) (its FP8 block scales and block shape too)."""
    v = m.view
    rows, cols, brows, bcols, flags = v.rows, v.columns, v.block_rows, v.block_columns, m.flags
    data, scales = _blob(v.data, v.data_bytes), _blob(v.scales, v.scale_bytes)
    if transpose:
        fmt = _format_name(v.format)
        assert not flags & lib.COLI_FFN_IN_OUT and fmt in PLAIN_BYTES, fmt
        el = np.dtype(f"V{PLAIN_BYTES[fmt]}")
        grid = np.frombuffer(ffi.buffer(v.data, v.data_bytes), el).reshape(rows, cols)
        data = struct.pack("<Q", v.data_bytes) + np.ascontiguousarray(grid.T).tobytes()
        if v.scales != ffi.NULL:
            sg = np.frombuffer(ffi.buffer(v.scales, v.scale_bytes), np.float32).reshape(
                -(-rows // brows), -(-cols // bcols))
            scales = struct.pack("<Q", v.scale_bytes) + np.ascontiguousarray(sg.T).tobytes()
        rows, cols, brows, bcols, flags = cols, rows, bcols, brows, flags | lib.COLI_FFN_IN_OUT
    head = struct.pack("<iiqqIIII", v.format, v.scale_format, rows, cols, brows, bcols, flags,
                       m.bias_format if m.bias != ffi.NULL else 0)
    return head + b"".join((data, scales, _blob(m.zeros, m.zero_bytes),
                            _blob(m.g_idx, 4 * m.g_idx_count), _blob(m.bias, m.bias_bytes)))


def _format_name(number: int) -> str:
    return next(n[len("COLI_TENSOR_"):] for n in dir(lib)
                if n.startswith("COLI_TENSOR_") and getattr(lib, n) == number)


def _case(store: colibri.Store, ex: Any, activation: str, x: np.ndarray,
          matrices: set[tuple[int, int]], transpose: bool = False) -> bytes:
    """One case of the driver's file: the store's description of the lease
    (transposed: every matrix stored (in, out)) and x; adds each matrix's
    (format, stored (in, out)) to matrices."""
    e = ffi.new("ColiFfnExpert *")
    err = ffi.new("char[]", 256)
    rc = lib.coli_store_ffn_expert(store._handle, ffi.cast("ColiExpertView *", ex._view_address),
                                   kernels.ACTIVATIONS.index(activation), 1.702, 7.0, e, err, 256)
    assert rc == 0, ffi.string(err)
    for r in ("gate", "up", "down"):
        m = getattr(e, r)
        if m.view.data != ffi.NULL:
            matrices.add((m.view.format, int(transpose or bool(m.flags & lib.COLI_FFN_IN_OUT))))
    fmt = lib.COLI_TENSOR_BF16 if x.dtype == BF16 else lib.COLI_TENSOR_F32
    head = struct.pack("<iiiiffqq", e.fused, e.activation, fmt, fmt, e.alpha, e.limit, *x.shape)
    return head + b"".join(_matrix(getattr(e, r), transpose) for r in ("gate", "up", "down")) + \
        _blob(ffi.from_buffer(x), x.nbytes)


def _calls(ckpt: int) -> Iterator[tuple[int, str, Any]]:
    """Each checkpoint's calls: every token count, alternating the input type
    and the activation (offset per checkpoint, so each format sees both)."""
    for i, tokens in enumerate(TOKENS):
        yield tokens, kernels.ACTIVATIONS[(i + ckpt) % 2], BF16 if (i // 2 + ckpt) % 2 else np.float32


@pytest.fixture(scope="module")
def arm64_driver(tmp_path_factory: Any) -> Path:
    exe = tmp_path_factory.mktemp("arm64") / "ffn_cases"
    assert CC is not None
    subprocess.run([CC, "-std=c11", "-Wall", "-Wextra", "-Werror", "-O2", "-static", f"-I{CSRC}",
                    *map(str, SOURCES), "-o", str(exe), "-lpthread", "-lm"],
                   check=True, capture_output=True, text=True)
    return exe


# arm64's sanitizer runtimes, for a build of the driver under ASan+UBSan.
ARM64_LIBS = Path("/usr/aarch64-linux-gnu")


@pytest.fixture(scope="module")
def arm64_sanitized(tmp_path_factory: Any) -> Path | None:
    """The driver built with ASan+UBSan (any report aborts), or None
    without arm64's sanitizer runtimes."""
    if not list((ARM64_LIBS / "lib").glob("libasan.so*")) or not list((ARM64_LIBS / "lib").glob("libubsan.so*")):
        return None
    exe = tmp_path_factory.mktemp("arm64-san") / "ffn_cases"
    assert CC is not None
    subprocess.run([CC, "-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-g",
                    "-fsanitize=address,undefined", "-fno-sanitize-recover=all", f"-I{CSRC}",
                    *map(str, SOURCES), "-o", str(exe), "-lpthread", "-lm"],
                   check=True, capture_output=True, text=True)
    return exe


def test_neon_path_under_qemu(arm64_driver: Path, arm64_sanitized: Path | None, tmp_path: Path) -> None:
    cases, expected = [], []
    matrices: set[tuple[int, int]] = set()
    rng = np.random.default_rng(7)
    for n, (fmt, hidden, inter, options) in enumerate(CHECKPOINTS):
        with tempfile.TemporaryDirectory() as tmp:
            write_format_checkpoint(tmp, fmt, hidden=hidden, intermediate=inter, experts=1, seed=n,
                                    **options)
            with colibri.open_store(tmp, slots_per_layer=1) as store, store.lease(0, 0) as ex:
                weights = colibri.dequantize(ex)
                for tokens, activation, dtype in _calls(n):
                    x = rng.standard_normal((tokens, hidden)).astype(np.float32).astype(dtype)
                    here = kernels.expert_ffn(ex, x, activation=activation, isa="scalar")
                    want = reference(weights, x, activation)
                    for transpose in (False, True) if fmt in TRANSPOSED else (False,):
                        cases.append(_case(store, ex, activation, x, matrices, transpose))
                        expected.append((f"{fmt} {hidden}x{inter} {options} T={tokens} {activation} "
                                         f"{np.dtype(dtype).name}{' (in, out)' if transpose else ''}",
                                         dtype, here, want))
    (tmp_path / "cases").write_bytes(b"CFC1" + struct.pack("<I", len(cases)) + b"".join(cases))
    assert QEMU is not None
    proc = subprocess.run([QEMU, str(arm64_driver), str(tmp_path / "cases"), str(tmp_path / "out"),
                           *(f"{f}:{io}" for f, io in sorted(matrices))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("path neon:"), proc.stdout  # arm64's default is the neon path
    # Each matrix of the cases runs the neon path's own kernel (never a
    # silent fallback to the scalar one).
    names = {(int(f), int(io)): name for _, f, io, name in
             (line.split() for line in proc.stdout.splitlines()[1:])}
    assert set(names) == matrices
    for (f, io), name in names.items():
        fmt = _format_name(f)
        assert fmt in NEON_FORMATS and name.endswith("/neon"), (fmt, io, name)
    assert {_format_name(f) for f, _ in matrices} == NEON_FORMATS
    # Each plain format both ways (f16 and FP8 (in, out) by transposing).
    assert {(_format_name(f), io) for f, io in matrices} >= {(f, io) for f in PLAIN_BYTES for io in (0, 1)}
    raw, at = (tmp_path / "out").read_bytes(), 0
    for name, dtype, here, want in expected:
        size = here.nbytes
        batch, pooled, alone, scalar = (np.frombuffer(raw, dtype, here.size, at + k * size).reshape(here.shape)
                                        for k in range(4))
        at += 4 * size
        bound = BF16_BOUND if dtype == BF16 else F32_BOUND
        # A token's bits do not depend on its batch nor on the threads.
        assert batch.tobytes() == alone.tobytes(), name
        assert batch.tobytes() == pooled.tobytes(), name
        assert relative_error(batch, want) <= bound, name
        assert relative_error(batch, scalar.astype(np.float64)) <= bound, name
        assert relative_error(scalar, here.astype(np.float64)) <= bound, name
    assert at == len(raw)
    if arm64_sanitized is None:
        return
    # The same cases under ASan+UBSan: no report, and the same bits.
    san = subprocess.run([QEMU, "-L", str(ARM64_LIBS), str(arm64_sanitized), str(tmp_path / "cases"),
                          str(tmp_path / "out-san")], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1"})
    assert san.returncode == 0, san.stdout + san.stderr
    assert (tmp_path / "out-san").read_bytes() == raw
