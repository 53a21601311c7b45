"""A store holds GPTQ with act order in group order: as an expert arrives in
its slot, each matrix whose g_idx has the format's groups (group g of
exactly ``min(group, rows - g * group)`` rows, ``group`` a multiple of 8)
has its rows moved so that row ``j`` is in group ``j // group``, and g_idx
entry ``j`` becomes ``-1 -`` the input row it holds.

These tests check the held bytes against a numpy construction of the same
thing (``conftest.gptq_group_order``), that ``colibri.dequantize`` gives
back exactly the checkpoint's weights, that other g_idx stay as stored, and
that the kernels refuse a malformed group-order g_idx."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

import colibri
from colibri import kernels
from colibri.checkpoint.scan import scan_model
from colibri.dequant import NUMPY, decode_expert
from colibri.synthetic_formats import write_format_checkpoint
from conftest import gptq_group_order, load_safetensors
from test_kernels import F32_BOUND, f32_call, reference, relative_error

ROLES = ("gate", "up", "down")


def _file_parts(path: Path, layer: int, expert: int) -> tuple[Any, dict[str, np.ndarray]]:
    """The expert's description and its parts as the checkpoint stores them."""
    tensors = load_safetensors(path)
    info = scan_model(path).expert(layer, expert)
    parts = {name: tensors[where.name] for name, where in zip(info.part_names(), info.part_infos())
             if name is not None and where is not None}
    return info, parts


def _check_expert(path: Path, store: colibri.Store, layer: int, expert: int) -> list[bool]:
    """Checks one expert's held parts and weights; returns, per role,
    whether it is held in group order."""
    info, stored = _file_parts(path, layer, expert)
    held = []
    with store.lease(layer, expert) as ex:
        parts = ex.parts
        for role in ROLES:
            block = info.block_shape(role)
            assert block is not None
            words, g_idx = gptq_group_order(stored[role], stored[f"{role}_g_idx"], block[0])
            assert parts[role].tobytes() == words.tobytes(), role
            assert parts[f"{role}_g_idx"].tobytes() == g_idx.tobytes(), role
            held.append(bool(parts[f"{role}_g_idx"][0] < 0))
        got = colibri.dequantize(ex)
        in_torch = _dequantize_torch(ex)
        del parts
    want = decode_expert(info, stored, NUMPY)
    for role in ROLES:
        assert np.array_equal(got[role], want[role]), role
        if in_torch is not None:
            assert np.array_equal(in_torch[role].numpy(), want[role]), role
    return held


def _dequantize_torch(ex: Any) -> dict[str, Any] | None:
    """colibri.dequantize computed in torch (its own decoder), if torch is
    here; on one torch thread (the suite also runs under TSan, which cannot
    see OpenMP's own synchronisation)."""
    try:
        import torch

        from colibri.torch_interop import dequantize_torch
    except ImportError:
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return dequantize_torch(ex)
    finally:
        torch.set_num_threads(before)


@settings(max_examples=12, deadline=None)
@given(hidden=st.sampled_from([32, 64, 96, 136]), inter=st.sampled_from([16, 48, 80]),
       group=st.sampled_from([8, 12, 16, 24, 32, 64]), workers=st.sampled_from([0, 1]),
       seed=st.integers(0, 2**16))
def test_act_order_is_held_in_group_order_and_dequantizes_to_the_checkpoint(
        hidden: int, inter: int, group: int, workers: int, seed: int) -> None:
    """Through demand reads (no workers) and a worker's prefetch, for groups
    that are whole words (moved) and that are not (12: left as stored)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_format_checkpoint(Path(tmp), "gptq", hidden=hidden, intermediate=inter,
                                       experts=2, seed=seed, group=group, g_idx="act_order")
        with colibri.open_store(path, slots_per_layer=2, prefetch_workers=workers) as store:
            if workers:
                store.prefetch([(0, 0), (0, 1)])
                store.wait_idle()
            for expert in range(2):
                held = _check_expert(path, store, 0, expert)
                if group % 8:
                    assert not any(held)


def test_a_real_act_order_checkpoint_is_held_in_group_order() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_format_checkpoint(Path(tmp), "gptq", hidden=256, intermediate=128,
                                       experts=1, seed=4, group=32, g_idx="act_order")
        with colibri.open_store(path, slots_per_layer=1) as store:
            assert _check_expert(path, store, 0, 0) == [True, True, True]


def test_wide_matrices_move_a_panel_of_columns_at_a_time() -> None:
    """Matrices wider than one panel of the mover's copy (256 KiB of every
    word row's columns), with a last panel that ends inside a step of 16
    columns: gate and up 1048 columns over 128 word rows, down 1024 over
    131."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_format_checkpoint(Path(tmp), "gptq", hidden=1024, intermediate=1048,
                                       experts=1, seed=8, group=64, g_idx="act_order")
        with colibri.open_store(path, slots_per_layer=1) as store:
            assert _check_expert(path, store, 0, 0) == [True, True, True]


@pytest.mark.parametrize("g_idx", ["sorted", "uneven"])
def test_other_g_idx_are_held_as_stored(g_idx: str) -> None:
    """No act order, and act order whose groups are not the format's (one
    group takes what another lacks), stay byte for byte as stored."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_format_checkpoint(Path(tmp), "gptq", hidden=128, intermediate=64, experts=1,
                                       seed=5, group=32, g_idx="act_order" if g_idx == "uneven" else g_idx)
        if g_idx == "uneven":
            for file in path.glob("*.safetensors"):
                tensors = load_file(file)
                for name in [n for n in tensors if n.endswith(".g_idx")]:
                    g = tensors[name].copy()
                    g[np.flatnonzero(g == 1)[:8]] = 0  # group 0 takes 8 of group 1's rows
                    tensors[name] = g
                save_file(tensors, file)
        with colibri.open_store(path, slots_per_layer=1) as store:
            assert _check_expert(path, store, 0, 0) == [False, False, False]
            _, stored = _file_parts(path, 0, 0)
            with store.lease(0, 0) as ex:
                for role in ROLES:
                    assert ex.parts[role].tobytes() == stored[role].tobytes()


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("fault", ["repeated", "out of range", "not negative"])
def test_the_kernels_refuse_a_malformed_group_order(fault: str, checked: bool) -> None:
    """Without COLI_FFN_ORDER_CHECKED every fault is refused; with it (a
    store's matrices: the store made or checked the order) only entries out
    of range are, so nothing is ever read past the inputs."""
    from colibri._ffi import ffi, lib

    with tempfile.TemporaryDirectory() as tmp:
        path = write_format_checkpoint(Path(tmp), "gptq", hidden=64, intermediate=32, experts=1,
                                       seed=6, group=16, g_idx="act_order")
        with colibri.open_store(path, slots_per_layer=1) as store, store.lease(0, 0) as ex:
            x = np.ones((1, 64), np.float32)
            kernels.expert_ffn(ex, x)  # valid as held
            parts = ex.parts
            assert parts["down_g_idx"][0] < 0
            bad = parts["down_g_idx"].copy()
            bad[5] = {"repeated": bad[2], "out of range": -33, "not negative": 7}[fault]
            expert = ffi.new("ColiFfnExpert *")
            for role in ROLES:
                kernels._fill_matrix(getattr(expert, role), ex.tensors, role, parts)
            assert expert.down.flags & lib.COLI_FFN_ORDER_CHECKED  # as the store fills it
            if not checked:
                expert.down.flags &= ~lib.COLI_FFN_ORDER_CHECKED
            expert.down.g_idx = ffi.cast("const void *", bad.ctypes.data)
            out = np.empty_like(x)
            call = f32_call(x, out)
            err = ffi.new("char[]", 256)
            rc = lib.coli_expert_ffn(expert, call, ffi.NULL, err, 256)
            if checked and fault == "repeated":
                assert rc == lib.COLI_OK
            else:
                assert rc == lib.COLI_EINVAL
                assert f"down: g_idx[5] = {bad[5]}; a g_idx in group order".encode() in ffi.string(err)
            del parts


def test_a_stored_g_idx_in_group_order_is_checked_when_read() -> None:
    """A checkpoint whose g_idx is already negative: read as group order if
    it names each input once, else the load fails naming the entry (the
    store's kernels trust what a slot holds)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_format_checkpoint(Path(tmp), "gptq", hidden=64, intermediate=32, experts=2,
                                       seed=7, group=16, g_idx="sorted")
        rng = np.random.default_rng(2)
        for file in path.glob("*.safetensors"):
            tensors = load_file(file)
            for name in [n for n in tensors if n.endswith(".g_idx")]:
                g = (-1 - rng.permutation(tensors[name].size)).astype(np.int32)
                if ".1." in name and "down" in name:
                    g[9] = g[3]
                tensors[name] = g
            save_file(tensors, file)
        with colibri.open_store(path, slots_per_layer=2) as store:
            with store.lease(0, 0) as ex:
                parts = ex.parts
                _, stored = _file_parts(path, 0, 0)
                assert parts["down_g_idx"].tobytes() == stored["down_g_idx"].tobytes()
                x = np.ones((1, 64), np.float32)
                want = kernels.expert_ffn(ex, x)
                weights = colibri.dequantize(ex)
                del parts
            assert relative_error(want, reference(weights, x, "silu")) <= F32_BOUND
            with pytest.raises(colibri.FormatError, match=r"down: g_idx\[9\] = .*group order"):
                store.lease(0, 1).__enter__()
            assert store.stats().loads_failed == 1


def test_dequantize_refuses_a_malformed_group_order() -> None:
    from colibri.errors import FormatError
    from colibri.formats.gptq import gptq_to_float

    words = np.zeros((2, 8), np.int32)
    scales, zeros = np.ones((2, 8), np.float16), np.zeros((2, 1), np.int32)
    order = -1 - np.arange(16, dtype=np.int32)
    assert gptq_to_float(words, scales, zeros, order, group_size=8).shape == (16, 8)
    order[3] = order[4]
    with pytest.raises(FormatError, match="group order"):
        gptq_to_float(words, scales, zeros, order, group_size=8)
