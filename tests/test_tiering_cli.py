"""`colibri replay` and `colibri plan` on the real traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from colibri.__main__ import main
from colibri.replay import belady, replay
from colibri.trace import Trace

DATA = Path(__file__).resolve().parent / "data" / "traces"
QWEN = DATA / "qwen3.6-35b-a3b-fever.npz"
MIXTRAL = DATA / "mixtral-8x7b-humaneval.npz"


def test_replay_prints_each_budget_with_belady_and_the_gap(capsys):
    assert main(["replay", str(MIXTRAL), "--experts", "8", "--budget", "12.5%,50%,6",
                 "--policy", "lru", "--no-progress"]) == 0
    out = capsys.readouterr().out
    t = Trace.load(MIXTRAL)
    assert "budget 12.5%: 2 slots per layer (raised to top-k 2)" in out
    assert "budget 50%: 4 slots per layer" in out and "budget 6 slots: 6 slots per layer" in out
    for slots in (4, 6):
        assert f"{replay(t, slots_per_layer=slots).hit_rate:.4f}" in out
        assert f"{belady(t, slots).hit_rate:.4f}" in out


def test_replay_with_a_history_starts_warm(tmp_path, capsys):
    t = Trace.load(QWEN)
    half = t.sequences[: len(t.sequences) // 2]
    learn, test = t.select_sequences(half), t.select_sequences(t.sequences[len(half):])
    learn.save(tmp_path / "learn.npz")
    test.save(tmp_path / "test.npz")
    assert main(["replay", str(tmp_path / "test.npz"), "--experts", "256", "--budget", "25%",
                 "--policy", "lru,cooc", "--usage", str(tmp_path / "learn.npz"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "warm start from" in out
    for pol in ("lru", "cooc"):
        warm = replay(test, slots_per_layer=64, policy=pol, usage=learn).hit_rate
        assert warm > replay(test, slots_per_layer=64, policy=pol).hit_rate
        assert f"{warm:.4f}" in out
    assert f"{belady(test, 64, warm=True).hit_rate:.4f}" in out


def test_replay_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "hit.png"
    assert main(["replay", str(MIXTRAL), "--experts", "8", "--budget", "25%,50%",
                 "--plot", str(png), "--no-progress"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_refuses_unknown_policy_and_too_few_experts(capsys):
    assert main(["replay", str(MIXTRAL), "--experts", "8", "--policy", "nope"]) == 2
    assert "unknown policy nope" in capsys.readouterr().err
    assert main(["replay", str(QWEN), "--experts", "8"]) == 2
    assert "--experts 8" in capsys.readouterr().err


def test_replay_of_a_bad_file_names_it(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"nope")
    assert main(["replay", str(bad), "--experts", "8"]) == 2
    assert "bad.npz" in capsys.readouterr().err


def test_plan_prints_layers_and_open_store_options(capsys):
    assert main(["plan", str(MIXTRAL), "--experts", "8", "--budget", "50%"]) == 0
    out = capsys.readouterr().out
    rows = [l.split() for l in out.splitlines() if l.strip()[:1].isdigit() and len(l.split()) == 3]
    assert [int(r[0]) for r in rows] == list(range(32))
    assert sum(int(r[1]) for r in rows) <= 4 * 32
    assert "open_store options: slots_per_layer={0: " in out


def test_plan_with_a_model_budget_in_bytes(tmp_path, capsys):
    from colibri.synthetic import write_synthetic_model

    model = write_synthetic_model(tmp_path / "m", layout="mixtral", n_layers=32, n_experts=8, hidden=8,
                                  intermediate=4)
    per = 3 * 8 * 4 * 4
    assert main(["plan", str(MIXTRAL), "--model", str(model.path), "--budget", f"{per * 4 * 32}B"]) == 0
    out = capsys.readouterr().out
    assert f"{per * 4 * 32:,} bytes" in out


def test_progress_bar_on_request(capsys):
    pytest.importorskip("tqdm")
    assert main(["replay", str(MIXTRAL), "--experts", "8", "--budget", "50%", "--progress"]) == 0
    captured = capsys.readouterr()
    assert "lookup" in captured.err and "budget 50%" in captured.out
