"""GPTQ with act order (a g_idx that scatters each group over the inputs)
through colibri.expert_ffn on every path. A real checkpoint's groups have
equal sizes; the kernels must not depend on it, so these tests also take
groups of uneven, odd and zero sizes and one of 389 inputs (more than three
times 128), with outputs in partial panels and vectors."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import colibri
from colibri import kernels
from colibri.synthetic_formats import write_format_checkpoint
from test_kernels import BF16, BF16_BOUND, F32_BOUND, reference, relative_error

HIDDEN, INTER, GROUP = 1088, 352, 32  # outputs: 8.5 blocks of 128 for down, 2.75 for gate and up


def _uneven(rng: np.random.Generator, n_in: int, groups: int) -> np.ndarray:
    """Group 0 takes 389 inputs, the last group none, the others a random
    share."""
    g_idx = rng.integers(1, groups - 1, n_in)
    g_idx[rng.choice(n_in, min(389, n_in // 2), replace=False)] = 0
    return g_idx.astype(np.int32)


def _checkpoint(path: Path, g_idx: str) -> Path:
    write_format_checkpoint(path, "gptq", hidden=HIDDEN, intermediate=INTER, experts=1, seed=3,
                            group=GROUP, g_idx="act_order")
    if g_idx == "uneven":
        rng = np.random.default_rng(11)
        for file in path.glob("*.safetensors"):
            tensors = load_file(file)
            for name in [n for n in tensors if n.endswith(".g_idx")]:
                groups = tensors[name[:-len("g_idx")] + "scales"].shape[0]
                tensors[name] = _uneven(rng, tensors[name].shape[0], groups)
            save_file(tensors, file)
    return path


@pytest.fixture(scope="module", params=["act_order", "uneven"])
def lease(request: Any) -> Iterator[Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = _checkpoint(Path(tmp), request.param)
        with colibri.open_store(path, slots_per_layer=1) as store, store.lease(0, 0) as ex:
            yield ex


@pytest.mark.parametrize("isa", kernels.available_isas())
def test_act_order_matches_the_reference(lease: Any, isa: str) -> None:
    weights = colibri.dequantize(lease)
    rng = np.random.default_rng(5)
    for tokens in (1, 3, 37):
        x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
        for dtype, bound in ((BF16, BF16_BOUND), (np.float32, F32_BOUND)):
            xd = x.astype(dtype)
            got = kernels.expert_ffn(lease, xd, isa=isa)
            assert relative_error(got, reference(weights, xd, "silu")) <= bound, (tokens, dtype)


@pytest.mark.parametrize("isa", kernels.available_isas())
def test_act_order_gives_a_token_the_same_bits_alone_or_batched(lease: Any, isa: str) -> None:
    x = np.random.default_rng(8).standard_normal((37, HIDDEN)).astype(np.float32).astype(BF16)
    x[4] = 0
    alone = [kernels.expert_ffn(lease, x[p:p + 1].copy(), isa=isa, threads=1)[0].tobytes()
             for p in range(len(x))]
    for threads in (1, 3):
        for rows in (slice(0, 37), slice(2, 9), slice(3, 5)):
            got = kernels.expert_ffn(lease, x[rows].copy(), isa=isa, threads=threads)
            for i, p in enumerate(range(*rows.indices(len(x)))):
                assert got[i].tobytes() == alone[p], (threads, rows, p)
