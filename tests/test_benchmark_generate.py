"""The size accounting of benchmarks/generate.py, which sets every memory budget of that benchmark.

The benchmark itself (minutes, root, cgroups) is not part of the suite
(tests/test_benchmark_install.py runs its smoke mode); this checks that it
splits a checkpoint into routed-expert bytes and the rest the way the store
sees it, that its 4-bit checkpoint is what transformers and llama.cpp's Q4_0
expect, that the disk's readahead comes back after a failed run, and which
runs it plans.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import colibri
from colibri.synthetic import write_synthetic_model

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "generate.py"


def _generate_module():
    spec = importlib.util.spec_from_file_location("benchmark_generate", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tensor_bytes(files) -> int:
    total = 0
    for path in files:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        total += sum(m["data_offsets"][1] - m["data_offsets"][0] for k, m in header.items()
                     if k != "__metadata__")
    return total


def test_sizes_split_routed_experts_from_the_rest(tmp_path):
    model = write_synthetic_model(tmp_path / "m", layout="mlp_experts", n_layers=4, n_experts=6,
                                  hidden=16, intermediate=8, dtype="bfloat16", shards=3,
                                  dense_layers=1, shared_experts=True)
    sizes = _generate_module().safetensors_sizes(model.path)
    assert sizes["layers"] == list(model.layers)
    assert sizes["experts_per_layer"] == {layer: 6 for layer in model.layers}
    assert sizes["one_expert"] == model.expert_nbytes
    assert sizes["expert_bytes"] == len(model.keys()) * model.expert_nbytes
    assert sizes["expert_bytes"] + sizes["other_bytes"] == _tensor_bytes(model.files)
    assert sizes["other_bytes"] > 0            # embeddings, attention, dense MLP, shared experts
    with colibri.open_store(model.path, slots_per_layer=1, prefetch_workers=0) as store:
        assert store.layers == model.layers


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", _PATH.parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_int4_checkpoint_has_the_tensors_transformers_saves(tmp_path):
    """The 4-bit writer names and shapes every tensor as save_pretrained does, and each projection
    becomes compressed-tensors' packed weight, scale and shape."""
    pytest.importorskip("compressed_tensors")
    generate = _generate_module()
    int4 = _bench_module("_int4")
    shape = dict(generate.QUICK_MODEL, num_hidden_layers=2, num_experts=8, vocab_size=512, embed_std=0.6)
    generate.write_model(tmp_path / "bf16", shape, 0)
    int4.write_int4_model(tmp_path / "int4", shape, 0)

    def header(d):
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                out.update({k: v for k, v in json.loads(fh.read(n)).items() if k != "__metadata__"})
        return out

    saved, ours = header(tmp_path / "bf16"), header(tmp_path / "int4")
    assert dict(int4.tensor_shapes(shape)) == {k: tuple(v["shape"]) for k, v in saved.items()}
    for name, dims in int4.tensor_shapes(shape):
        if name.endswith("_proj.weight"):
            base = name[: -len("weight")]
            assert ours[base + "weight_packed"]["shape"] == [dims[0], dims[1] // 8]
            assert ours[base + "weight_scale"] == {**ours[base + "weight_scale"], "dtype": "BF16",
                                                   "shape": [dims[0], dims[1] // int4.GROUP]}
            assert ours[base + "weight_shape"]["shape"] == [2]
        else:
            assert ours[name]["shape"] == list(dims) and ours[name]["dtype"] == "BF16"
    config = json.loads((tmp_path / "int4" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == int4.GROUP
    sizes = generate.safetensors_sizes(tmp_path / "int4")
    assert sizes["experts_per_layer"] == {0: 8, 1: 8}


def _q4_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's reference Q4_0 of rows of 32 (ggml's quantize_row_q4_0_ref): d = the value of
    largest magnitude / -8 (stored as fp16), q = min(15, trunc(x / d + 8.5))."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    peak = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(1)]
    d = peak / -8
    inv = np.where(d != 0, 1 / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.minimum(15, (blocks * inv[:, None] + 8.5).astype(np.int8))
    return q.astype(np.int32) - 8, d.astype(np.float16)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), std=st.sampled_from([0.002, 0.02, 0.6]))
def test_int4_groups_survive_q4_0_exactly(seed, std):
    """What the 4-bit checkpoint stores (scale x int4, scale in bf16) is what Q4_0 of those
    dequantized weights stores: the same integers and the same scale, so the same weights."""
    torch = pytest.importorskip("torch")
    int4 = _bench_module("_int4")
    w = torch.randn((16, 128), generator=torch.Generator().manual_seed(seed)) * std
    w, scale = int4.q4_0_exact_groups(w)
    q = torch.clamp(torch.round(w / scale.repeat_interleave(int4.GROUP, 1)), -8, 7)
    ours = (q * scale.repeat_interleave(int4.GROUP, 1)).numpy()
    q_gguf, d = _q4_0(ours)
    assert np.array_equal(d.astype(np.float32), scale.numpy().reshape(-1))
    assert np.array_equal(q_gguf.reshape(q.shape), q.numpy().astype(np.int32))
    assert (q.reshape(-1, 32).min(1).values == -8).all()   # each group's largest weight is -8 scales


def test_readahead_is_restored_after_a_failure(tmp_path, monkeypatch):
    llama = _bench_module("_llama")
    ra = tmp_path / "read_ahead_kb"
    ra.write_text("8192\n")
    monkeypatch.setattr(llama, "readahead_file", lambda path: ra)
    with pytest.raises(RuntimeError):
        with llama.readahead(tmp_path, 128) as now:
            assert now == 128 and ra.read_text().strip() == "128"
            raise RuntimeError("the run failed")
    assert ra.read_text().strip() == "8192"
    with llama.readahead(tmp_path, None) as now:    # None: read, not changed
        assert now == 8192


def test_runs_pair_each_format_with_its_engines():
    generate = _generate_module()
    pairs = {"bf16": {"gguf": {"bf16": "m.gguf"}}, "4bit": {"gguf": {"q4_0": "a.gguf", "q4_k_m": "b.gguf"}}}
    runs = generate.plan_runs(["bf16", "4bit"], "abcdefgh", [1, 2], ["q4_0", "q4_k_m"], pairs, False)
    keys = {generate.run_key(r) for r in runs}
    assert len(keys) == len(runs)
    assert {"bf16/1t/a", "bf16/2t/b", "bf16/1t/e/bf16", "4bit/2t/g/q4_k_m", "4bit/1t/h"} <= keys
    assert not [k for k in keys if k.startswith("4bit") and k.split("/")[2] in "ab"]
    assert sum(k.startswith("4bit/1t/") for k in keys) == 3 + 3 * 2   # c d h, and e f g per quant
    assert generate.differences([1, 2, 3], [1, 2, 3]) == []
    assert generate.differences([1, 5, 3, 7], [1, 2, 4]) == [1, 2]


def test_in_ram_rows_that_would_not_fit_the_machine_are_left_out_with_a_reason():
    generate = _generate_module()
    gb = 10**9
    pairs = {"bf16": {"fmt": "bf16", "gguf": {"bf16": "m.gguf"}, "gguf_sizes": {"bf16": {"file_bytes": 5 * gb}},
                      "sizes": {"expert_bytes": 4.8 * gb, "other_bytes": 0.2 * gb}},
             "4bit": {"fmt": "4bit", "gguf": {"q4_0": "a.gguf"}, "gguf_sizes": {"q4_0": {"file_bytes": 8.4 * gb}},
                      "sizes": {"expert_bytes": 8.2 * gb, "other_bytes": 0.2 * gb}}}

    def plan(mem_total):
        notes: list[str] = []
        runs = generate.plan_runs(["bf16", "4bit"], "acdfgh", [1, 2], ["q4_0"], pairs, False,
                                  mem_total=mem_total, notes=notes)
        return {generate.run_key(r) for r in runs}, notes

    everything, notes = plan(25.7 * gb)          # 24 GiB: every row
    assert notes == [] and {"4bit/2t/g/q4_0", "4bit/1t/h", "bf16/1t/a", "bf16/2t/g/bf16"} <= everything
    assert everything == {generate.run_key(r) for r in generate.plan_runs(
        ["bf16", "4bit"], "acdfgh", [1, 2], ["q4_0"], pairs, False)}   # no mem_total: nothing left out
    keys, notes = plan(16 * gb)                  # 16 GB: llama.cpp's 4-bit in RAM (17.6 GB) is left out
    assert everything - keys == {"4bit/1t/g/q4_0", "4bit/2t/g/q4_0"}
    assert len(notes) == 1 and "4bit" in notes[0] and "llama.cpp in RAM" in notes[0] and "17.6 GB" in notes[0]
    keys, notes = plan(8 * gb)                   # 8 GB: only the rows under a limit
    assert {k.split("/")[2] for k in keys} == {"c", "d", "f"}
    assert len(notes) == 5                       # bf16 (a) (g) (h), 4bit (g) (h): one note each, not per thread


def test_the_prompts_experts_are_recorded_after_a_routing_hook_already_set():
    generate = _generate_module()
    seen = []

    class Runtime:
        routing = staticmethod(lambda layer, index, weights: seen.append(layer))

    runtime = Runtime()
    before = runtime.routing
    done = generate.record_touched(runtime)
    runtime.routing(2, np.array([[4, 1], [1, 6]]), np.ones((2, 2), np.float32))
    runtime.routing(5, np.array([[3, 0]]), np.ones((1, 2), np.float32))   # a prompt of one token counts
    assert done() == {2: {1, 4, 6}, 5: {0, 3}}
    assert seen == [2, 5]                        # the earlier hook still saw every layer
    assert runtime.routing is before             # and is back for the decode steps


def _round(prefill: dict[str, float]) -> dict[str, dict]:
    return {k: {"ok": True, "prefill_s": s} for k, s in prefill.items()}


def test_prefill_ratio_against_the_in_ram_run_of_the_same_round():
    """(c) and (d) against the larger of (a) (else (h)) and the round's read, round by round;
    a round without the read or the reference gives no ratio."""
    generate = _generate_module()
    pairs = {"bf16": {"gguf": {}}, "4bit": {"gguf": {}}}
    runs = generate.plan_runs(["bf16", "4bit"], "acdh", [1], [], pairs, False)   # 4bit: no (a)
    rounds = [_round({"bf16/1t/a": 2.0, "bf16/1t/c": 3.0, "bf16/1t/d": 2.2, "bf16/1t/h": 9.0,
                      "4bit/1t/c": 1.5, "4bit/1t/d": 1.2, "4bit/1t/h": 0.5}),
              _round({"bf16/1t/a": 1.0, "bf16/1t/c": 4.0, "bf16/1t/d": 2.0, "4bit/1t/c": 1.0,
                      "4bit/1t/d": 1.0, "4bit/1t/h": 0.4}),
              _round({"bf16/1t/a": 1.0, "bf16/1t/c": 4.0, "bf16/1t/d": 2.0})]
    rounds[2]["bf16/1t/a"]["ok"] = False
    reads = [{"bf16": {"seconds": 1.0}, "4bit": {"seconds": 1.0}},
             {"bf16": {"seconds": 2.0}},
             {"bf16": {"seconds": 1.0}}]
    rows = {r["run"]: r for r in generate.prefill_rows(["bf16", "4bit"], [1], runs, rounds, reads)}
    assert set(rows) == {"bf16/1t/c", "bf16/1t/d", "4bit/1t/c", "4bit/1t/d"}
    assert rows["bf16/1t/c"]["in_ram"] == "(a)" and rows["4bit/1t/c"]["in_ram"] == "(h)"
    assert rows["bf16/1t/c"]["ratios"] == pytest.approx([1.5, 2.0])      # 3 / max(2, 1), 4 / max(1, 2)
    assert rows["bf16/1t/d"]["ratios"] == pytest.approx([1.1, 1.0])
    assert rows["bf16/1t/d"]["read_s"] == [1.0, 2.0] and rows["bf16/1t/d"]["in_ram_s"] == [2.0, 1.0]
    assert rows["4bit/1t/c"]["ratios"] == pytest.approx([1.5])           # round 2 has no 4bit read
    assert rows["4bit/1t/d"]["colibri_s"] == [1.2]


def test_the_read_covers_the_experts_the_rounds_colibri_runs_touched(tmp_path):
    """The union over (c) and (d) of one format, nothing of (a) or another format."""
    import argparse

    generate = _generate_module()
    model = write_synthetic_model(tmp_path / "m", layout="mixtral", n_layers=3, n_experts=4, hidden=64,
                                  intermediate=32, dtype="bfloat16")
    this = {"bf16/1t/c": {"fmt": "bf16", "config": "c", "ok": True, "touched_experts": {"0": [1], "2": [0, 3]}},
            "bf16/1t/d": {"fmt": "bf16", "config": "d", "ok": True, "touched_experts": {"0": [1, 2]}},
            "bf16/1t/a": {"fmt": "bf16", "config": "a", "ok": True},
            "4bit/1t/c": {"fmt": "4bit", "config": "c", "ok": False}}
    pairs = {f: {"hf": str(model.path), "n_experts": 4, "sizes": {"layers": [0, 1, 2]}} for f in ("bf16", "4bit")}
    reads = generate.measure_reads(this, pairs, argparse.Namespace(no_limit=True))
    assert set(reads) == {"bf16"}
    assert reads["bf16"]["experts"] == 4 and not reads["bf16"]["cold"]
    assert reads["bf16"]["bytes"] >= 4 * model.expert_nbytes and reads["bf16"]["seconds"] > 0
