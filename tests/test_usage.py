"""The usage history: counts with decay, its file, fingerprints, damage."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from colibri import FormatError, Trace
from colibri.usage import Usage, model_fingerprint

DATA = Path(__file__).resolve().parent / "data" / "traces"


def filled(seed: int = 0, half_life: float | None = 64.0) -> Usage:
    u = Usage({1: 6, 2: 6, 5: 4}, half_life=half_life)
    rng = np.random.default_rng(seed)
    for layer in u.layers:
        for _ in range(3):
            u.add(layer, rng.integers(0, 9, size=u.num_experts(layer)))
    return u


def test_round_trip(tmp_path):
    u = filled()
    u.end_turn()
    u.save(tmp_path / "u.npz")
    back = Usage.load(tmp_path / "u.npz", fingerprint=u.fingerprint)
    assert back == u
    assert back.turns == 1 and back.half_life == 64.0
    assert back.counts(5).shape == (4,)
    assert not list(tmp_path.glob(".*tmp"))


@given(seed=st.integers(0, 2**32 - 1), hl=st.one_of(st.none(), st.floats(1.0, 1e6)))
def test_round_trip_any_counts(tmp_path_factory, seed, hl):
    u = filled(seed, hl)
    path = tmp_path_factory.mktemp("u") / "u.npz"
    u.save(path)
    assert Usage.load(path) == u


def test_decay_halves_per_half_life():
    u = Usage({0: 3}, half_life=10.0)
    u.add(0, [10, 0, 0])
    u.add(0, [0, 10, 0])  # 10 more requests: the first batch weighs half
    c = u.counts(0)
    assert c[0] == pytest.approx(5.0) and c[1] == pytest.approx(10.0)
    assert u.requests(0) == pytest.approx(15.0)
    no = Usage({0: 3}, half_life=None)
    no.add(0, [10, 0, 0])
    no.add(0, [0, 10, 0])
    assert no.counts(0).tolist() == [10.0, 10.0, 0.0]


def test_turns_decay():
    u = Usage({0: 2}, half_life=None, half_life_turns=2.0)
    u.add(0, [8, 0])
    u.end_turn()
    u.end_turn()
    assert u.counts(0)[0] == pytest.approx(4.0) and u.turns == 2


def test_trace_counts_decay_by_position():
    t = Trace.from_arrays([3], [[[0]], [[1]], [[1]], [[2]]], num_experts=3)
    u = Usage.from_trace(t, half_life=1.0)
    # expert 0 is followed by 3 requests, expert 1 by 2 and 1, expert 2 by none
    assert u.counts(3) == pytest.approx([0.125, 0.25 + 0.5, 1.0])
    flat = Usage.from_trace(t, half_life=None)
    assert flat.counts(3).tolist() == [1.0, 2.0, 1.0]
    assert flat.hottest(1) == [(3, 1)]


def test_real_trace_hottest_are_its_most_routed():
    t = Trace.load(DATA / "qwen3.6-35b-a3b-fever.npz")
    u = Usage.from_trace(t, half_life=None)
    counts = t.counts()
    for layer, e in u.hottest(4):
        assert counts[layer][e] >= np.sort(counts[layer])[-4]
    pins = u.hottest_by_bytes(10 * 1000, {l: 1000 for l in u.layers}, {l: 2 for l in u.layers})
    assert len(pins) == 10 and all(sum(1 for l, _ in pins if l == x) <= 2 for x in u.layers)


def test_wrong_model_is_refused_unless_told(tmp_path):
    u = filled()
    path = tmp_path / "u.npz"
    u.save(path)
    other = model_fingerprint({1: 6, 2: 6, 5: 8})
    with pytest.raises(FormatError, match="another model"):
        Usage.load(path, fingerprint=other)
    taken = Usage.load(path, fingerprint=other, any_model=True)
    assert taken.fingerprint == other
    fitted = taken.conform({1: 6, 2: 6, 5: 8})
    assert fitted.counts(1).tolist() == u.counts(1).tolist()
    assert fitted.counts(5).tolist() == [0.0] * 8  # expert counts differ: not carried over


def test_fingerprint_depends_on_layout():
    a = model_fingerprint({0: 8, 1: 8}, [("F32", (64, 32))])
    assert a == model_fingerprint({1: 8, 0: 8}, [("F32", (64, 32))])
    assert a != model_fingerprint({0: 8, 1: 8}, [("BF16", (64, 32))])
    assert a != model_fingerprint({0: 8, 2: 8}, [("F32", (64, 32))])


def test_failed_save_leaves_the_old_file(tmp_path):
    path = tmp_path / "u.npz"
    old = filled(1)
    old.save(path)
    before = path.read_bytes()

    def boom(tmp):
        assert os.path.exists(tmp)
        raise OSError("injected: disk full")

    with pytest.raises(OSError, match="injected"):
        filled(2).save(path, _before_rename=boom)
    assert path.read_bytes() == before
    assert Usage.load(path) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["u.npz"]


def test_truncated_files_are_format_errors(tmp_path):
    good = tmp_path / "good.npz"
    filled().save(good)
    data = good.read_bytes()
    for cut in range(0, len(data), max(1, len(data) // 40)):
        path = tmp_path / f"cut{cut}.npz"
        path.write_bytes(data[:cut])
        with pytest.raises(FormatError, match=path.name):
            Usage.load(path)


@given(seed=st.integers(0, 2**32 - 1), flips=st.integers(1, 4))
def test_damaged_bytes_are_format_errors_or_the_same_history(tmp_path_factory, seed, flips):
    d = tmp_path_factory.mktemp("d")
    good = d / "good.npz"
    u = filled()
    u.save(good)
    data = bytearray(good.read_bytes())
    rng = np.random.default_rng(seed)
    for i in rng.integers(0, len(data), size=flips):
        data[i] ^= int(rng.integers(1, 256))
    path = d / "bad.npz"
    path.write_bytes(bytes(data))
    try:
        back = Usage.load(path)
    except FormatError as exc:
        assert "bad.npz" in str(exc)
    else:  # a flip in a part nothing reads (e.g. a zip comment field) may leave the history intact
        assert back == u


@given(data=st.binary(max_size=400))
def test_random_bytes_are_format_errors(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("r") / "rand.npz"
    path.write_bytes(data)
    with pytest.raises(FormatError, match="rand.npz"):
        Usage.load(path)


def test_trace_file_is_not_a_usage_file(tmp_path):
    with pytest.raises(FormatError, match="not a colibri usage file"):
        Usage.load(DATA / "mixtral-8x7b-humaneval.npz")


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_half_life(bad):
    with pytest.raises(FormatError):
        Usage({0: 2}, half_life=bad)


def test_bad_counts_are_refused():
    u = Usage({0: 2})
    with pytest.raises(FormatError):
        u.add(0, [1, 2, 3])
    with pytest.raises(FormatError):
        u.add(0, [-1, 2])
    with pytest.raises(KeyError):
        u.add(4, [1, 2])
