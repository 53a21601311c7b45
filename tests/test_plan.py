"""Planning per-layer budgets, pins and policy from a history."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri import FormatError, Trace, Usage
from colibri.plan import _allocate, lru_curves, plan
from colibri.replay import replay

from test_replay import random_trace

DATA = Path(__file__).resolve().parent / "data" / "traces"


@settings(max_examples=30)
@given(seed=st.integers(0, 2**32 - 1), tokens=st.integers(1, 50), k=st.integers(1, 3), pins=st.integers(0, 2))
def test_curves_equal_replay_at_every_slot_count(seed, tokens, k, pins):
    t = random_trace(np.random.default_rng(seed), tokens, [0, 3], 8, k)
    pinned = {0: list(range(pins)), 3: list(range(7, 7 - pins, -1))}
    curves = lru_curves(t, pinned)
    for slots in range(k + pins, 9):
        if slots <= pins:
            continue
        r = replay(t, slots_per_layer=slots, pinned=[(l, e) for l, es in pinned.items() for e in es])
        for layer in (0, 3):
            assert curves[layer][slots] == r.per_layer[layer].hits, (layer, slots)


def test_curves_on_a_real_trace_equal_replay():
    t = Trace.load(DATA / "mixtral-8x7b-humaneval.npz")
    curves = lru_curves(t)
    for slots in range(2, 9):
        r = replay(t, slots_per_layer=slots)
        assert sum(int(c[slots]) for c in curves.values()) == r.hits


@given(seed=st.integers(0, 2**32 - 1), budget=st.integers(0, 14))
def test_allocation_is_the_best_split(seed, budget):
    rng = np.random.default_rng(seed)
    curves = {l: np.concatenate([[0], np.cumsum(rng.integers(0, 9, size=5))]) for l in (1, 2, 4)}
    cost = {1: 1, 2: 2, 4: 1}
    lo = {1: 1, 2: 1, 4: 2}
    got = _allocate(curves, lo, cost, budget)
    options = [
        (sum(int(curves[l][c]) for l, c in zip(curves, combo)), combo)
        for combo in itertools.product(*(range(lo[l], 6) for l in curves))
        if sum(c * cost[l] for l, c in zip(curves, combo)) <= budget
    ]
    if not options:
        assert got is None
        return
    assert got is not None
    assert sum(got[l] * cost[l] for l in got) <= budget and all(got[l] >= lo[l] for l in got)
    assert sum(int(curves[l][got[l]]) for l in got) == max(v for v, _ in options)


@pytest.mark.parametrize("name, frac", [("mixtral-8x7b-humaneval", 0.5), ("qwen3.6-35b-a3b-fever", 0.25)])
def test_plan_of_a_real_trace_fits_the_budget(name, frac):
    t = Trace.load(DATA / f"{name}.npz")
    nbytes = 3000
    slots = int(t.num_experts * frac)
    budget = slots * len(t.layers) * nbytes
    p = plan(t, budget, expert_nbytes=nbytes)
    assert p.used_bytes <= budget
    assert sum(p.slots_per_layer.values()) * nbytes == p.used_bytes
    assert all(s >= t.top_k for s in p.slots_per_layer.values())
    assert p.validation and "uniform/lru" in p.validation
    r = replay(t, slots_per_layer=dict(p.slots_per_layer), policy=p.policy, pinned=p.pin or None)
    assert r.hit_rate == pytest.approx(p.history_hit_rate)
    assert p.uniform_lru_hit_rate == pytest.approx(replay(t, slots_per_layer=slots).hit_rate)
    kwargs = p.open_store_kwargs()
    assert kwargs["slots_per_layer"] == dict(p.slots_per_layer)
    assert "plan:" in str(p)


def test_planned_allocation_follows_reuse():
    """A layer whose experts never repeat gets the minimum; the budget goes where it hits."""
    rng = np.random.default_rng(1)
    tokens = 200
    e = np.zeros((tokens, 2, 2), dtype=np.int32)
    e[:, 0, :] = np.arange(tokens * 2).reshape(tokens, 2) % 64  # a cycle longer than any cache: no reuse
    e[:, 1, :] = np.stack([rng.choice(8, size=2, replace=False) for _ in range(tokens)])
    t = Trace.from_arrays([0, 1], e, None, np.repeat([0, 1], tokens // 2), 64)
    p = plan(t, 12, pins=False)
    assert p.slots_per_layer[0] == 2 and p.slots_per_layer[1] == 8 and p.kind == "planned"
    assert p.history_hit_rate > p.uniform_lru_hit_rate


def test_plan_from_usage_needs_top_k_and_pins_hot_experts():
    u = Usage({0: 16, 1: 16}, half_life=None)
    skew = np.array([1000, 800] + [1] * 14, dtype=float)
    u.add(0, skew)
    u.add(1, skew[::-1])
    with pytest.raises(FormatError, match="top_k"):
        plan(u, 16)
    p = plan(u, 16, top_k=2, sample_tokens=256)
    assert sum(p.slots_per_layer.values()) <= 16


def test_budget_too_small_is_a_format_error():
    t = random_trace(np.random.default_rng(0), 10, [0, 1], 8, 2)
    with pytest.raises(FormatError, match="cannot hold"):
        plan(t, 3)


def test_hot_order_keeps_experts_every_prompt_used():
    from colibri.plan import hot_order

    e = np.array([[[0, 1]], [[0, 2]], [[0, 1]], [[1, 3]]], dtype=np.int32)  # 2 prompts of 2 tokens
    t = Trace.from_arrays([4], e, None, [0, 0, 1, 1], 5)
    assert hot_order(t) == {4: [0, 1]}        # 2 and 3 only one prompt used; 0 and 1 tie on fewest uses
    assert hot_order(t.select_sequences([0])) == {4: [0, 1, 2]}   # one prompt: by uses
