"""The command line: the README's demo and `inspect`."""

from __future__ import annotations

import json

import pytest

import colibri
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
    summary = out.splitlines()[-1]
    assert summary.startswith("summary: 3 MoE layers (1-3); 6 experts per layer; top-k unknown")
    assert f"routed-expert bytes: {3 * 6 * 3 * 64 * 32 * 2:,}" in summary
    with colibri.open_store(tmp_path, slots_per_layer=2) as store:   # the cache the store builds
        capacity = store.stats().capacity_bytes
    assert f"--slots 2: 2 slots per layer, 33.3% of the experts resident, {capacity:,} bytes" in summary


@pytest.fixture
def model_dir(tmp_path):
    write_synthetic_model(tmp_path, layout="mixtral", n_layers=5, n_experts=8, hidden=64,
                          intermediate=32, dtype="float16", dense_layers=2)
    return tmp_path


def inspect_json(capsys, *args):
    assert main(["inspect", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_json_gives_the_same_as_the_table(model_dir, capsys):
    (model_dir / "config.json").write_text(json.dumps({"num_experts_per_tok": 2, "num_local_experts": 8}))
    data = inspect_json(capsys, model_dir, "--slots", 3)
    expert_bytes = 3 * 64 * 32 * 2
    assert data["layout"] == "mixtral"
    assert [row["layer"] for row in data["layers"]] == [2, 3, 4]
    assert all(row["experts"] == 8 and row["bytes_per_expert"] == expert_bytes and row["dtypes"] == ["F16"]
               for row in data["layers"])
    s = data["summary"]
    assert (s["moe_layers"], s["layer_ranges"], s["first_layer"], s["last_layer"]) == (3, "2-4", 2, 4)
    assert s["experts_per_layer"] == {"min": 8, "max": 8} and s["top_k"] == 2
    assert s["routed_expert_bytes"] == 3 * 8 * expert_bytes
    with colibri.open_store(model_dir, slots_per_layer=3) as store:
        want = {str(layer): store.slots(layer) for layer in store.layers}, store.stats().capacity_bytes
    assert (data["cache"]["layer_slots"], data["cache"]["capacity_bytes"]) == want
    assert data["cache"]["resident_fraction"] == pytest.approx(3 / 8)
    assert main(["inspect", str(model_dir), "--slots", "3"]) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    assert "3 MoE layers (2-4); 8 experts per layer; top-k 2 (config.json)" in summary
    assert f"{want[1]:,} bytes" in summary


def test_inspect_ram_budget_gives_the_stores_slots(model_dir, capsys):
    with colibri.open_store(model_dir, slots_per_layer=1) as store:
        slot = store.stats().capacity_bytes // 3   # one slot in each of the 3 layers
    ram_gb = (5 * 3 * slot + slot // 2) / 2**30     # 5.something slots per layer
    data = inspect_json(capsys, model_dir, "--ram-gb", repr(ram_gb))
    with colibri.open_store(model_dir, capacity_bytes=int(ram_gb * 2**30)) as store:
        assert data["cache"]["capacity_bytes"] == store.stats().capacity_bytes == 5 * 3 * slot
    assert set(data["cache"]["layer_slots"].values()) == {5}
    assert data["cache"]["ram_bytes"] == int(ram_gb * 2**30) and data["cache"]["slots_per_layer"] is None
    # more than every expert: capped at the experts of each layer, as the store does
    assert set(inspect_json(capsys, model_dir, "--ram-gb", 1)["cache"]["layer_slots"].values()) == {8}


def test_inspect_finds_top_k_in_text_config_and_says_when_it_is_absent(model_dir, capsys):
    (model_dir / "config.json").write_text(json.dumps({"text_config": {"num_experts_per_tok": 1}}))
    assert inspect_json(capsys, model_dir)["summary"]["top_k"] == 1
    (model_dir / "config.json").write_text(json.dumps({"hidden_size": 64}))
    data = inspect_json(capsys, model_dir)
    assert data["summary"]["top_k"] is None and data["cache"] is None
    assert main(["inspect", str(model_dir)]) == 0
    assert "top-k not in config.json" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--slots", "0"], "--slots must be >= 1"),
    (["--ram-gb", "0"], "--ram-gb must be > 0"),
    (["--ram-gb", "1e-9"], "too small"),
])
def test_inspect_refuses_a_bad_budget(model_dir, capsys, args, message):
    assert main(["inspect", str(model_dir), *args]) == 2
    assert message in capsys.readouterr().err


def test_inspect_with_a_broken_config_json_is_an_error(model_dir, capsys):
    (model_dir / "config.json").write_text("{not json")
    assert main(["inspect", str(model_dir)]) == 2
    assert "config.json" in capsys.readouterr().err


def test_inspect_of_a_missing_path_is_an_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "error" in capsys.readouterr().err
