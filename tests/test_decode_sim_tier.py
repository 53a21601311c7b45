"""The decode simulation's tier options (benchmarks/decode_sim.py).

The tier's pins and warm start must come from the warm-up history, never
from the measured tokens, and the preloads' reads must not count as the
decode's: these check the helpers that guarantee it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "tests" / "data" / "traces"

sys.path.insert(0, str(ROOT / "benchmarks"))
_env = dict(os.environ)
import decode_sim  # noqa: E402  (it sets the BLAS thread variables for its own runs)

os.environ.clear()
os.environ.update(_env)


@pytest.mark.parametrize("half", [0, 1])
def test_routing_halves_are_disjoint_sequences(half):
    trace = colibri.Trace.load(TRACES / "mixtral-8x7b-humaneval.npz")
    r = decode_sim.load_routing(TRACES / "mixtral-8x7b-humaneval.npz", layers=5, half=half)
    seq = np.asarray(trace.sequence)
    first = np.asarray(trace.experts)[seq == seq.min(), :5]
    second = np.asarray(trace.experts)[seq != seq.min(), :5]
    measured, warmup = (second, first) if half == 1 else (first, second)
    np.testing.assert_array_equal(r["measured"], measured)
    np.testing.assert_array_equal(r["warmup"], warmup)
    assert r["num_experts"] == 8 and r["top_k"] == 2
    assert r["pops"].shape == (5, 8)
    np.testing.assert_allclose(r["pops"].sum(axis=1), 1.0)
    # the popularities are the warm-up's: its most used expert is the most popular
    for i in range(5):
        counts = np.bincount(warmup[:, i].ravel(), minlength=8)
        assert np.argmax(r["pops"][i]) in np.flatnonzero(counts == counts.max())


def test_tier_lists_pin_the_hottest_and_warm_the_next_hottest_last():
    # layer 0: expert 3 used 5 times, 1 four, 5 three, 0 twice, 6 once; layer 1: only expert 2
    rows = [3] * 5 + [1] * 4 + [5] * 3 + [0] * 2 + [6]
    experts = np.array([[[e], [2]] for e in rows], dtype=np.int64)
    usage = colibri.Usage.from_trace(colibri.Trace.from_arrays([0, 1], experts, num_experts=8), half_life=None)
    assert decode_sim.tier_lists(usage, (0, 1), 4, decode_sim.Tier()) == ([], [])
    pin, warm = decode_sim.tier_lists(usage, (0, 1), 4, decode_sim.Tier("cooc", 0.25, True))
    assert pin == [(0, 3), (1, 2)]
    assert warm == [(0, 0), (0, 5), (0, 1)]          # hottest last; layer 1 knows no other expert
    pin, warm = decode_sim.tier_lists(usage, (0, 1), 4, decode_sim.Tier("lru", 0.0, True))
    assert pin == [] and warm == [(0, 0), (0, 5), (0, 1), (0, 3), (1, 2)]
    assert decode_sim.Tier().suffix == "" and decode_sim.Tier("cooc", 0.25, True).suffix == " [cooc pin 25% warm]"


def test_stats_since_leaves_out_the_preloads():
    before = {"requests": 0, "hits": 0, "misses": 0, "prefetched": 0, "prefetch_hits": 0, "bytes_read": 300,
              "loads_started": 3, "resident_bytes": 300, "capacity_bytes": 800, "peak_inflight": 1,
              "hit_rate": 0.0, "prefetch_hit_rate": 0.0}
    after = {"requests": 10, "hits": 6, "misses": 4, "prefetched": 2, "prefetch_hits": 1, "bytes_read": 900,
             "loads_started": 9, "resident_bytes": 800, "capacity_bytes": 800, "peak_inflight": 2,
             "hit_rate": 0.6, "prefetch_hit_rate": 0.5}
    d = decode_sim.stats_since(after, before)
    assert d["bytes_read"] == 600 and d["loads_started"] == 6 and d["requests"] == 10
    assert d["resident_bytes"] == 800 and d["peak_inflight"] == 2
    assert d["hit_rate"] == 0.6 and d["prefetch_hit_rate"] == 0.5
