"""Small synthetic Mixture-of-Experts checkpoints for demos, tests and benchmarks.

:func:`write_synthetic_model` writes a model in one of the two layouts the store
understands, as real safetensors files (one ``model.safetensors``, or shards
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``)::

    mixtral      model.layers.L.block_sparse_moe.experts.E.w1/w3/w2.weight   gate/up/down
                 model.layers.L.block_sparse_moe.gate.weight                 router
    mlp_experts  model.layers.L.mlp.experts.E.gate_proj/up_proj/down_proj.weight
                 model.layers.L.mlp.gate.weight                              router

Beside the routed experts it writes what real checkpoints hold around them, so
a reader must tell them apart: token embeddings, per-layer attention and norm
weights, ``dense_layers`` leading layers with a dense MLP instead of experts,
and optionally shared experts. Values are ``normal * 0.05`` from a seeded
generator, so the same arguments always give the same bytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["SyntheticModel", "write_synthetic_model", "LAYOUTS", "DTYPES"]

LAYOUTS = ("mixtral", "mlp_experts")
DTYPES = ("float32", "float16", "bfloat16")

# role -> tensor name suffix, per layout
_ROLE_SUFFIX = {
    "mixtral": {"gate": "w1.weight", "up": "w3.weight", "down": "w2.weight"},
    "mlp_experts": {
        "gate": "gate_proj.weight",
        "up": "up_proj.weight",
        "down": "down_proj.weight",
    },
}
_MOE_BLOCK = {"mixtral": "block_sparse_moe", "mlp_experts": "mlp"}


def _numpy_dtype(dtype: str) -> np.dtype:
    if dtype == "float32":
        return np.dtype(np.float32)
    if dtype == "float16":
        return np.dtype(np.float16)
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def _expert_name(layout: str, layer: int, expert: int, role: str) -> str:
    block = _MOE_BLOCK[layout]
    return f"model.layers.{layer}.{block}.experts.{expert}.{_ROLE_SUFFIX[layout][role]}"


def _router_name(layout: str, layer: int) -> str:
    return f"model.layers.{layer}.{_MOE_BLOCK[layout]}.gate.weight"


@dataclass(frozen=True)
class SyntheticModel:
    """What :func:`write_synthetic_model` wrote, and where."""

    path: Path                      # the model directory
    files: tuple[Path, ...]         # the .safetensors files, in shard order
    layers: tuple[int, ...]         # model layer indices that have routed experts
    n_experts: int
    hidden: int
    intermediate: int
    dtype: str                      # "float32" | "float16" | "bfloat16"
    layout: str                     # "mixtral" | "mlp_experts"
    n_layers: int = 0               # all decoder layers, dense ones included
    dense_layers: int = 0
    shared_experts: bool = False
    weight_map: dict = field(default_factory=dict, compare=False, repr=False)
    _routers: dict = field(default_factory=dict, compare=False, repr=False)

    def tensor_names(self, layer: int, expert: int) -> dict[str, str]:
        """The tensor names of one routed expert: ``{"gate": ..., "up": ..., "down": ...}``."""
        if layer not in self.layers:
            raise KeyError(f"layer {layer} has no routed experts (MoE layers: {self.layers})")
        if not 0 <= expert < self.n_experts:
            raise KeyError(f"expert {expert} out of range 0..{self.n_experts - 1}")
        return {role: _expert_name(self.layout, layer, expert, role) for role in ("gate", "up", "down")}

    def file_of(self, name: str) -> Path:
        """The file that holds tensor ``name``."""
        return self.path / self.weight_map[name]

    def routers(self) -> dict[int, np.ndarray]:
        """Router weights ``(n_experts, hidden)`` per MoE layer, as float32 copies."""
        return {layer: w.copy() for layer, w in self._routers.items()}

    @property
    def np_dtype(self) -> np.dtype:
        return _numpy_dtype(self.dtype)

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert's three tensors."""
        return 3 * self.hidden * self.intermediate * self.np_dtype.itemsize

    def keys(self) -> list[tuple[int, int]]:
        """Every (layer, expert) key of the model."""
        return [(layer, e) for layer in self.layers for e in range(self.n_experts)]


def _save_shards(directory: Path, tensors: dict[str, np.ndarray], shards: int
                 ) -> tuple[list[Path], dict[str, str]]:
    """Saves ``tensors`` in order as one file, or cut into ``shards``
    contiguous runs with an index; returns the files and the weight map."""
    from safetensors.numpy import save_file

    names = list(tensors)
    if shards > len(names):
        raise ValueError(f"shards={shards} exceeds the {len(names)} tensors of the model")
    metadata = {"format": "pt"}
    weight_map: dict[str, str] = {}
    files: list[Path] = []
    if shards == 1:
        fname = "model.safetensors"
        save_file(tensors, str(directory / fname), metadata=metadata)
        files.append(directory / fname)
        weight_map = {name: fname for name in names}
    else:
        bounds = [round(i * len(names) / shards) for i in range(shards + 1)]
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            chunk = {name: tensors[name] for name in names[bounds[i]:bounds[i + 1]]}
            save_file(chunk, str(directory / fname), metadata=metadata)
            files.append(directory / fname)
            weight_map.update({name: fname for name in chunk})
        total = sum(int(a.nbytes) for a in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        tmp = directory / "model.safetensors.index.json.tmp"
        tmp.write_text(json.dumps(index, indent=2, sort_keys=True))
        os.replace(tmp, directory / "model.safetensors.index.json")

    return files, weight_map


def write_synthetic_model(
    directory,
    *,
    layout: str = "mixtral",
    n_layers: int = 4,
    n_experts: int = 8,
    hidden: int = 64,
    intermediate: int = 32,
    dtype: str = "float32",
    shards: int = 1,
    dense_layers: int = 0,
    shared_experts: bool = False,
    seed: int = 0,
) -> SyntheticModel:
    """Write a synthetic MoE checkpoint into ``directory`` (created if missing).

    Layers ``0 .. dense_layers-1`` get a dense MLP; layers ``dense_layers ..
    n_layers-1`` get ``n_experts`` routed experts and a router (and shared
    experts when ``shared_experts``). With ``shards > 1`` the tensors, in
    layer order, are cut into ``shards`` contiguous runs, so an expert's
    tensors may straddle two files, as the store must allow.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    np_dtype = _numpy_dtype(dtype)
    if n_layers < 1 or n_experts < 1 or hidden < 1 or intermediate < 1:
        raise ValueError("n_layers, n_experts, hidden and intermediate must be >= 1")
    if not 0 <= dense_layers < n_layers:
        raise ValueError(f"dense_layers must be in 0..{n_layers - 1}, got {dense_layers}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        values = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05)
        return values.astype(np_dtype)

    def ones(n: int) -> np.ndarray:
        return np.ones((n,), dtype=np_dtype)

    vocab = 32
    tensors: dict[str, np.ndarray] = {}  # insertion order = layer order
    routers: dict[int, np.ndarray] = {}
    moe_layers = tuple(range(dense_layers, n_layers))
    block = _MOE_BLOCK[layout]

    tensors["model.embed_tokens.weight"] = rand(vocab, hidden)
    for layer in range(n_layers):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.input_layernorm.weight"] = ones(hidden)
        tensors[f"{prefix}.self_attn.q_proj.weight"] = rand(hidden, hidden)
        tensors[f"{prefix}.self_attn.o_proj.weight"] = rand(hidden, hidden)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = ones(hidden)
        if layer < dense_layers:
            tensors[f"{prefix}.mlp.gate_proj.weight"] = rand(intermediate, hidden)
            tensors[f"{prefix}.mlp.up_proj.weight"] = rand(intermediate, hidden)
            tensors[f"{prefix}.mlp.down_proj.weight"] = rand(hidden, intermediate)
            continue
        router = rand(n_experts, hidden)
        tensors[_router_name(layout, layer)] = router
        routers[layer] = router.astype(np.float32)
        for expert in range(n_experts):
            tensors[_expert_name(layout, layer, expert, "gate")] = rand(intermediate, hidden)
            tensors[_expert_name(layout, layer, expert, "up")] = rand(intermediate, hidden)
            tensors[_expert_name(layout, layer, expert, "down")] = rand(hidden, intermediate)
        if shared_experts:
            shared = f"{prefix}.{block}.shared_experts"
            tensors[f"{shared}.gate_proj.weight"] = rand(intermediate, hidden)
            tensors[f"{shared}.up_proj.weight"] = rand(intermediate, hidden)
            tensors[f"{shared}.down_proj.weight"] = rand(hidden, intermediate)
    tensors["model.norm.weight"] = ones(hidden)
    tensors["lm_head.weight"] = rand(vocab, hidden)

    files, weight_map = _save_shards(directory, tensors, shards)
    return SyntheticModel(
        path=directory,
        files=tuple(files),
        layers=moe_layers,
        n_experts=n_experts,
        hidden=hidden,
        intermediate=intermediate,
        dtype=dtype,
        layout=layout,
        n_layers=n_layers,
        dense_layers=dense_layers,
        shared_experts=shared_experts,
        weight_map=weight_map,
        _routers=routers,
    )
