"""Leased experts computed from their slots: coli_store_expert_ffn (through
lease.ffn, colibri.expert_ffn, colibri.experts_ffn and LeaseGroup.ffn) and
coli_store_ffn_expert.

* For every stored format and layout, the description C fills from a slot
  equals the one built independently in Python from the lease's arrays, and
  the result equals the float64 reference from colibri.dequantize (float32
  activations within 1e-4 of the output's largest magnitude, bfloat16 within
  2^-8).
* A batch of one layer's experts, each on its own rows (empty ones, repeated
  experts, one expert holding most rows), equals its experts computed one by
  one, bit for bit, on 1 to 3 threads, for numpy and torch operands.
* Wrong calls fail with a clear error and compute nothing: released and stale
  views, a closed store, a replay store, views of two layers, bad row
  offsets; a store is refused at creation when its sources describe their
  parts or flags inconsistently.
* A computation holds its slots: it is not a request, a release meanwhile
  frees nothing under it, and the leases held afterwards are the caller's.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import colibri
from colibri import kernels
from colibri._ffi import ffi, lib
from colibri.synthetic_formats import FORMATS, write_format_checkpoint
from test_kernels import BF16_BOUND, F32_BOUND, GPT_OSS_FORMATS, reference, relative_error

BF16 = np.dtype(ml_dtypes.bfloat16)
ERR = lib.COLI_ERR_LEN


def _activation(fmt: str) -> str:
    return "gpt_oss" if fmt in GPT_OSS_FORMATS else "silu"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: Any) -> dict[str, Path]:
    """Every format, two layers of five experts (hidden 96, intermediate 64)."""
    return {fmt: write_format_checkpoint(tmp_path_factory.mktemp(fmt), fmt, hidden=96,
                                         intermediate=64, experts=5, layers=2, group=32,
                                         seed=i, symmetric=fmt != "int4", block=(32, 64))
            for i, fmt in enumerate(FORMATS)}


def _store(path: Path, **options: Any) -> colibri.Store:
    return colibri.open_store(path, slots_per_layer=5, prefetch_workers=0, **options)


def _rows(rng: np.random.Generator, tokens: int, hidden: int = 96) -> np.ndarray:
    return rng.standard_normal((tokens, hidden)).astype(np.float32)


# ---------------------------------------------------------------- one expert


def _c_description(store: colibri.Store, ex: Any, activation: int = 0) -> Any:
    out = ffi.new("ColiFfnExpert *")
    err = ffi.new("char[]", ERR)
    view = ffi.cast("ColiExpertView *", ex._view_address)
    rc = lib.coli_store_ffn_expert(store._handle, view, activation, 1.702, 7.0, out, err, ERR)
    assert rc == 0, ffi.string(err)
    return out


def _matrix_fields(m: Any) -> tuple[Any, ...]:
    v = m.view
    return (v.format, v.scale_format, v.data, v.scales, v.data_bytes, v.scale_bytes, v.rows,
            v.columns, v.block_rows, v.block_columns, m.flags, m.zeros, m.zero_bytes, m.g_idx,
            m.g_idx_count, m.bias, m.bias_format if m.bias != ffi.NULL else 0, m.bias_bytes)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_store_fills_what_python_builds(checkpoints: dict[str, Path], fmt: str) -> None:
    with _store(checkpoints[fmt]) as store, store.lease(1, 3) as ex:
        got = _c_description(store, ex)
        parts = ex.parts
        want = ffi.new("ColiFfnExpert *")
        info = ex.tensors
        for role in ("gate", "down") if info.fused else ("gate", "up", "down"):
            kernels._fill_matrix(getattr(want, role), info, role, parts)
        for role in ("gate", "up", "down"):
            assert _matrix_fields(getattr(got, role)) == _matrix_fields(getattr(want, role)), role
        fused = {None: lib.COLI_FFN_SEPARATE, "interleaved": lib.COLI_FFN_INTERLEAVED,
                 "concatenated": lib.COLI_FFN_CONCATENATED}[info.fused]
        assert got.fused == fused and got.activation == 0
        del parts


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_from_the_slot(checkpoints: dict[str, Path], fmt: str) -> None:
    rng = np.random.default_rng(3)
    activation = _activation(fmt)
    with _store(checkpoints[fmt]) as store, store.lease(0, 2) as ex:
        weights = colibri.dequantize(ex)
        for tokens in (1, 3, 9):
            x = _rows(rng, tokens)
            got = ex.ffn(x, activation=activation)
            assert relative_error(got, reference(weights, x, activation)) <= F32_BOUND
            xb = x.astype(BF16)
            gotb = colibri.expert_ffn(ex, xb, activation=activation, threads=2)
            assert gotb.dtype == BF16
            assert relative_error(gotb, reference(weights, xb, activation)) <= BF16_BOUND


# ---------------------------------------------------------------- batches


def _one_by_one(leases: Any, x: Any, counts: list[int], activation: str) -> Any:
    out = x.clone() * 0 if hasattr(x, "clone") else np.zeros_like(x)
    start = 0
    for lease, n in zip(leases, counts):
        if n:
            kernels.expert_ffn(lease, x[start:start + n], out=out[start:start + n],
                               activation=activation, threads=1)
        start += n
    return out


@pytest.mark.parametrize("fmt", ["int4", "gptq", "gpt_oss", "bf16", "awq"])
@pytest.mark.parametrize("counts", [[3, 0, 1, 2, 1], [40, 1, 2, 1, 1], [1, 1, 1, 1, 1]])
def test_a_batch_equals_its_experts_one_by_one(checkpoints: dict[str, Path], fmt: str,
                                               counts: list[int]) -> None:
    rng = np.random.default_rng(sum(counts))
    activation = _activation(fmt)
    x = _rows(rng, sum(counts))
    with _store(checkpoints[fmt]) as store, store.lease_many(0, [4, 1, 1, 0, 2]) as group:
        want = _one_by_one(group, x, counts, activation)
        for threads in (1, 2, 3):
            got = group.ffn(x, counts, activation=activation, threads=threads)
            np.testing.assert_array_equal(got, want)
        assert store.active_leases == 5   # the group's leases: the calls hold none after


def test_a_torch_batch_in_place(checkpoints: dict[str, Path]) -> None:
    torch = pytest.importorskip("torch")
    x = torch.randn(12, 96)
    big = torch.zeros(12, 100)
    out = big[:, :96]          # rows 100 apart
    counts = [5, 4, 3]
    with _store(checkpoints["fp8_block"]) as store, store.lease_many(1, [2, 0, 4]) as group:
        assert colibri.experts_ffn(group, x, counts, out=out) is out
        want = _one_by_one(group, x, counts, "silu")
        assert torch.equal(out, want)
        xb = x.bfloat16()
        yb = colibri.experts_ffn(group, xb, np.array(counts))
        assert yb.dtype == torch.bfloat16 and yb.shape == xb.shape
        assert big[:, 96:].abs().sum() == 0


def test_batch_arguments_are_checked(checkpoints: dict[str, Path]) -> None:
    x = np.ones((4, 96), np.float32)
    with _store(checkpoints["int4"]) as store, _store(checkpoints["int4"]) as other:
        with store.lease_many(0, [0, 1]) as group, other.lease(0, 0) as foreign:
            with pytest.raises(ValueError, match="add up to 3 rows; x has 4"):
                group.ffn(x, [1, 2])
            with pytest.raises(ValueError, match="2 ints"):
                group.ffn(x, [4])
            with pytest.raises(ValueError, match=">= 0"):
                group.ffn(x, [5, -1])
            with pytest.raises(ValueError, match="2 ints"):
                group.ffn(x, [2.0, 2.0])
            with pytest.raises(ValueError, match="takes \\(tokens, 96\\)"):
                group.ffn(x[0], [1, 0])
            with pytest.raises(ValueError, match="overlaps"):
                group.ffn(x, [2, 2], out=x)
            with pytest.raises(ValueError, match="leases\\[1\\] is not a lease of leases\\[0\\]'s store"):
                colibri.experts_ffn([group[0], foreign], x, [2, 2])
            with pytest.raises(TypeError, match="must be a lease of a colibri store"):
                colibri.experts_ffn([object()], x, [4])
            with pytest.raises(ValueError, match="at least one lease"):
                colibri.experts_ffn([], x, [])
            with store.lease(1, 0) as elsewhere:
                with pytest.raises(colibri.ColibriError, match="a batch is one layer's experts"):
                    colibri.experts_ffn([group[0], elsewhere], x, [2, 2])
        with pytest.raises(colibri.LeaseError, match="released"):
            group.ffn(x, [2, 2])
        with pytest.raises(colibri.LeaseError, match="released"):
            group[0].ffn(x)


# ---------------------------------------------------------------- the C entry


class _Entry:
    """A raw C call on copies of leased views, to reach the states Python
    never lets a lease object get into."""

    def __init__(self, store: colibri.Store, leases: Any, tokens: int = 2) -> None:
        self.store = store
        self.views = ffi.new("ColiExpertView[]", len(leases))
        colibri._ffi.copy_views(leases, int(ffi.cast("uintptr_t", self.views)))
        self.x = np.ones((tokens, 96), np.float32)
        self.out = np.zeros((tokens, 96), np.float32)
        self.rows = np.array([0, *([tokens] * len(leases))], dtype=np.int64)
        self.call = ffi.new("ColiFfnCall *", {
            "x": ffi.cast("const void *", self.x.ctypes.data), "x_format": lib.COLI_TENSOR_F32,
            "x_stride": 96, "out": ffi.cast("void *", self.out.ctypes.data),
            "out_format": lib.COLI_TENSOR_F32, "out_stride": 96, "tokens": tokens, "isa": -1})
        self.count = len(leases)

    def run(self, handle: Any = None, *, count: int | None = None, rows: Any = None,
            call: Any = None, activation: int = 0) -> tuple[int, str]:
        err = ffi.new("char[]", ERR)
        rc = lib.coli_store_expert_ffn(
            self.store._handle if handle is None else handle, self.views,
            self.count if count is None else count,
            ffi.cast("int64_t *", (self.rows if rows is None else rows).ctypes.data),
            self.call if call is None else call, activation, 1.702, 7.0, ffi.NULL, err, ERR)
        return rc, ffi.string(err).decode()


def test_the_c_entry_computes_copied_views(checkpoints: dict[str, Path]) -> None:
    with _store(checkpoints["gptq"]) as store, store.lease_many(0, [3, 1]) as group:
        entry = _Entry(store, group)
        before = store.stats()
        assert entry.run() == (0, "")
        want = kernels.expert_ffn(group[0], entry.x, threads=1)
        np.testing.assert_array_equal(entry.out, want)       # rows 0, 2, 2: expert 3 has them all
        after = store.stats()
        assert (after.requests, after.hits, after.misses) == (before.requests, before.hits,
                                                              before.misses)
        assert store.active_leases == 2


@pytest.mark.parametrize("case,code,needle", [
    ("rows_start", "EINVAL", "rows run from 1"),
    ("rows_down", "EINVAL", "is less than"),
    ("count", "EINVAL", "0 views"),
    ("activation", "EINVAL", "activation"),
    ("x_format", "EINVAL", "F32 or BF16"),
    ("stride", "EINVAL", "strides"),
    ("overlap", "EINVAL", "overlaps"),
    ("not_a_store", "EINVAL", "not an expert store"),
    ("two_layers", "EINVAL", "one layer's experts"),
    ("forged", "ELEASE", "holds no lease"),
    ("no_layer", "ELEASE", "no such layer"),
])
def test_the_c_entry_refuses_bad_calls(checkpoints: dict[str, Path], case: str, code: str,
                                       needle: str) -> None:
    with _store(checkpoints["int4"]) as store, store.lease_many(0, [0, 1]) as group:
        entry = _Entry(store, group)
        kwargs: dict[str, Any] = {}
        if case == "rows_start":
            entry.rows[0] = 1
        elif case == "rows_down":
            entry.rows[:] = [0, 3, 2]
        elif case == "count":
            kwargs["count"] = 0
        elif case == "activation":
            kwargs["activation"] = 5
        elif case == "x_format":
            entry.call.x_format = lib.COLI_TENSOR_F16
        elif case == "stride":
            entry.call.x_stride = 95
        elif case == "overlap":
            entry.call.out = ffi.cast("void *", entry.x.ctypes.data + 4)
        elif case == "not_a_store":
            kwargs["handle"] = ffi.new("ColiExpertStore *")
        elif case == "two_layers":
            entry.views[1].key.layer = 1
        elif case == "forged":
            entry.views[1].lease_generation += 1000
        elif case == "no_layer":
            entry.views[0].key.layer = entry.views[1].key.layer = 7
        rc, message = entry.run(**kwargs)
        assert rc == getattr(lib, f"COLI_{code}") and needle in message, (rc, message)
        assert not entry.out.any()
        assert store.active_leases == 2


def test_released_stale_and_closed(checkpoints: dict[str, Path]) -> None:
    store = colibri.open_store(checkpoints["bf16"], slots_per_layer=1, prefetch_workers=0)
    with store.lease(0, 0) as ex:
        entry = _Entry(store, [ex])
    rc, message = entry.run()
    assert rc == lib.COLI_ELEASE and "layer 0 expert 0: the view holds no lease" in message
    with store.lease(0, 1):            # the slot now holds another expert
        assert entry.run()[0] == lib.COLI_ELEASE
    store.close()
    rc, message = entry.run()
    assert rc == lib.COLI_ECLOSED and "closed" in message
    description = ffi.new("ColiFfnExpert *")
    err = ffi.new("char[]", ERR)
    assert lib.coli_store_ffn_expert(store._handle, entry.views, 0, 1.0, 1.0, description, err,
                                     ERR) == lib.COLI_ECLOSED
    assert not entry.out.any()


def test_a_replay_store_has_nothing_to_compute() -> None:
    from colibri.store import open_replay_store

    store = open_replay_store({0: 4}, slots_per_layer=2)
    view = ffi.new("ColiExpertView *")
    assert lib.coli_store_lookup(store._handle, 0, 1, view, ffi.NULL, 0) == 0
    out = np.zeros((1, 8), np.float32)
    call = ffi.new("ColiFfnCall *", {"x": ffi.cast("const void *", out.ctypes.data),
                                     "out": ffi.cast("void *", out.ctypes.data), "tokens": 1})
    err = ffi.new("char[]", ERR)
    rc = lib.coli_store_expert_ffn(store._handle, view, 1, ffi.NULL, call, 0, 0.0, 0.0, ffi.NULL,
                                   err, ERR)
    assert rc == lib.COLI_EINVAL and b"replay store" in ffi.string(err)
    lib.coli_expert_release(store._handle, view)
    store.close()


# ---------------------------------------------------------------- holds


def test_a_release_during_a_call_frees_nothing_under_it(checkpoints: dict[str, Path]) -> None:
    """Another thread releases the lease while the kernel computes from it:
    the computation holds the slot, so its result is right however the two
    interleave, and the slot is free once both are done."""
    rng = np.random.default_rng(9)
    x = _rows(rng, 2048)
    with _store(checkpoints["f32"]) as store:
        with store.lease(0, 0) as ex:
            want = kernels.expert_ffn(ex, x, threads=1)
        for _ in range(3):
            ex = store.lease(0, 0)
            out = np.zeros_like(x)
            started = threading.Event()

            def compute() -> None:
                started.set()
                entry_views = ffi.cast("ColiExpertView *", address)
                call = ffi.new("ColiFfnCall *", {
                    "x": ffi.cast("const void *", x.ctypes.data), "x_format": lib.COLI_TENSOR_F32,
                    "x_stride": 96, "out": ffi.cast("void *", out.ctypes.data),
                    "out_format": lib.COLI_TENSOR_F32, "out_stride": 96, "tokens": len(x),
                    "isa": -1})
                err = ffi.new("char[]", ERR)
                results.append(lib.coli_store_expert_ffn(store._handle, entry_views, 1, ffi.NULL,
                                                         call, 0, 0.0, 0.0, ffi.NULL, err, ERR))

            view = ffi.new("ColiExpertView *")
            colibri._ffi.copy_views([ex], int(ffi.cast("uintptr_t", view)))
            address = int(ffi.cast("uintptr_t", view))
            results: list[int] = []
            worker = threading.Thread(target=compute)
            worker.start()
            started.wait()
            ex.release()
            worker.join()
            assert results in ([0], [lib.COLI_ELEASE])   # the release may come first
            if results == [0]:
                np.testing.assert_array_equal(out, want)
            assert store.active_leases == 0
            with store.lease(0, 1), store.lease(0, 2):   # the slot is reusable
                pass


# ---------------------------------------------------------------- sources


@pytest.mark.parametrize("edit,needle", [
    (lambda src, part: setattr(part, "kind", 9), "unknown kind 9"),
    (lambda src, part: setattr(part, "role", 3), "role 3 is not a matrix"),
    (lambda src, part: setattr(src, "flags", src.flags | 16), "unknown flags"),
    (lambda src, part: setattr(src, "flags", lib.COLI_SOURCE_INTERLEAVED), "interleaved without"),
])
def test_sources_describe_their_parts_consistently(checkpoints: dict[str, Path], edit: Any,
                                                   needle: str) -> None:
    from colibri.checkpoint.scan import scan_model
    from colibri.store import StoreOptions, _Config

    config = _Config(scan_model(checkpoints["gptq"]), StoreOptions(
        slots_per_layer=1, capacity_bytes=None, prefetch_workers=0, direct_io=False,
        slot_wait_timeout=1.0))
    src = config.cfg.experts[3]
    assert src.n_parts >= 3 and src.flags == lib.COLI_SOURCE_IN_OUT | lib.COLI_SOURCE_ZERO_PLUS_ONE
    kinds = sorted((src.parts[k].kind, src.parts[k].role) for k in range(src.n_parts))
    assert kinds[:3] == [(lib.COLI_PART_ZERO, 0), (lib.COLI_PART_ZERO, 1), (lib.COLI_PART_ZERO, 2)]
    edit(src, src.parts[0])
    with pytest.raises(colibri.FormatError, match=needle):
        config.create()


def test_a_part_given_twice_is_refused(checkpoints: dict[str, Path]) -> None:
    from colibri.checkpoint.scan import scan_model
    from colibri.store import StoreOptions, _Config

    config = _Config(scan_model(checkpoints["gptq"]), StoreOptions(
        slots_per_layer=1, capacity_bytes=None, prefetch_workers=0, direct_io=False,
        slot_wait_timeout=1.0))
    src = config.cfg.experts[0]
    src.parts[1].kind, src.parts[1].role = src.parts[0].kind, src.parts[0].role
    with pytest.raises(colibri.FormatError, match="is already of kind"):
        config.create()
