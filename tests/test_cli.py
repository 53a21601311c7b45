"""The command line: the README's demo and `inspect`."""

from __future__ import annotations

from colibri.__main__ import main
from colibri.synthetic import write_synthetic_model


def test_demo_prints_stats(capsys):
    assert main(["demo", "--tokens", "3", "--layers", "3", "--experts", "8", "--slots", "2",
                 "--hidden", "32", "--intermediate", "16"]) == 0
    out = capsys.readouterr().out
    assert "store stats:" in out and "hit_rate" in out and "lookahead: precision" in out
    requests = int(next(l for l in out.splitlines() if l.strip().startswith("requests")).split()[-1].replace(",", ""))
    assert requests >= 3 * 3 * 1  # every token leases at least one expert per layer


def test_demo_without_lookahead_prefetches_nothing(capsys):
    assert main(["demo", "--tokens", "2", "--layers", "2", "--experts", "4", "--slots", "2",
                 "--hidden", "32", "--intermediate", "16", "--no-lookahead"]) == 0
    out = capsys.readouterr().out
    prefetched = next(l for l in out.splitlines() if l.strip().startswith("prefetched "))
    assert prefetched.split()[-1] == "0"


def test_inspect_describes_the_model(tmp_path, capsys):
    write_synthetic_model(tmp_path, layout="mlp_experts", n_layers=4, n_experts=6, hidden=64,
                          intermediate=32, dtype="bfloat16", dense_layers=1, shards=2)
    assert main(["inspect", str(tmp_path), "--slots", "2"]) == 0
    out = capsys.readouterr().out
    assert "layout: mlp_experts" in out
    rows = [l.split() for l in out.splitlines() if l.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3]            # dense layer 0 is not listed
    assert all(int(r[1]) == 6 and int(r[2].replace(",", "")) == 3 * 64 * 32 * 2 for r in rows)
    assert f"{3 * 6 * 3 * 64 * 32 * 2:,}" in out             # total routed-expert bytes
    assert f"{3 * 2 * 3 * 64 * 32 * 2:,}" in out             # RAM for 2 slots per layer


def test_inspect_of_a_missing_path_is_an_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "error" in capsys.readouterr().err
