"""benchmarks/decode_formats.py's GPTQ writer: with and without act order,
its modules decode to the weight it quantized (within half a step of each
group's scale), and act order groups the rows in the order given."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from colibri.formats.gptq import gptq_to_float  # noqa: E402
from decode_formats import quantize_gptq  # noqa: E402


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_modules_decode_to_the_weight(act_order: bool) -> None:
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((48, 256)) * 0.05).astype(np.float32)  # (out, in)
    ranked = rng.permutation(256) if act_order else None
    parts = quantize_gptq(w, 64, ranked)
    g_idx = parts["g_idx"]
    assert np.array_equal(np.bincount(g_idx), [64] * 4)
    if ranked is not None:
        assert np.array_equal(g_idx[ranked], np.arange(256) // 64)
    else:
        assert np.array_equal(g_idx, np.arange(256) // 64)
    got = gptq_to_float(parts["qweight"], parts["scales"], parts["qzeros"], g_idx, group_size=64)
    step = parts["scales"].astype(np.float32)[g_idx]            # (in, out): each weight's scale
    assert np.all(np.abs(got - w.T) <= step / 2 + 1e-6)
