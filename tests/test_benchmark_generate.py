"""The size accounting of benchmarks/generate.py, which sets every memory budget of that benchmark.

The benchmark itself (minutes, root, cgroups) is not part of the suite; this
checks only that it splits a checkpoint into routed-expert bytes and the rest
the way the store sees it, on a synthetic sharded checkpoint with a dense
first layer and shared experts (which are not routed experts).
"""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

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
