"""benchmarks/_prefill.py, the prefill goal's figures: which experts a
prefill touched, their byte ranges in the files, and the O_DIRECT read of
them (on a synthetic checkpoint; the timing itself is not asserted)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri.checkpoint.scan import scan_model

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "_prefill.py"


@pytest.fixture(scope="module")
def prefill() -> object:
    spec = importlib.util.spec_from_file_location("benchmark_prefill", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module           # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_touched_experts_count_only_the_prefill(prefill) -> None:
    touched = prefill.TouchedExperts()
    touched(3, np.array([[1, 2], [2, 5], [1, 1]]), None)
    touched(3, np.array([[7, 1]]), None)          # a decode step: one token
    touched(4, np.array([[0, 9], [9, 0]]))
    assert touched.experts == {3: {1, 2, 5}, 4: {0, 9}} and touched.count == 5


def test_ranges_cover_every_part_of_the_touched_experts(prefill, small_model) -> None:
    experts = {1: [0, 2], 2: [3]}
    ranges = prefill.expert_ranges(small_model.path, experts)
    model = scan_model(small_model.path)
    for layer, chosen in experts.items():
        for e in chosen:
            for t in model.expert(layer, e).tensors():
                spans = ranges[model.files[t.file]]
                assert any(lo <= t.offset and t.offset + t.nbytes <= hi for lo, hi in spans)
    for spans in ranges.values():
        assert all(lo % 4096 == 0 and hi % 4096 == 0 for lo, hi in spans)
        assert all(a[1] < b[0] for a, b in zip(spans, spans[1:]))   # merged: disjoint, sorted


def test_the_read_reads_those_bytes(prefill, small_model) -> None:
    experts = {1: [0, 2], 2: [3]}
    bound = prefill.direct_read_time(small_model.path, experts, chunk=8192)
    spans = prefill.expert_ranges(small_model.path, experts)
    rounded_out = sum(hi - lo for s in spans.values() for lo, hi in s)   # the last may pass the end
    model = scan_model(small_model.path)
    parts = sum(t.nbytes for layer, chosen in experts.items() for e in chosen
                for t in model.expert(layer, e).tensors())
    assert parts <= bound.bytes <= rounded_out
    assert bound.experts == 3 and bound.seconds > 0 and bound.direct in (True, False)
    assert prefill.prefill_ratio(2.6, 2.0, 1.0) == pytest.approx(1.3)
    assert prefill.prefill_ratio(2.0, 1.0, 4.0) == pytest.approx(0.5)
