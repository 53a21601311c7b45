"""Stacked compressed-tensors int4 experts: the 3-D form llm-compressor's
compressed MoE repack saves for transformers 5's fused experts.

Names per layer L: ``model.layers.L.mlp.experts.gate_up_proj.weight_packed``
(experts, 2I, H/8), ``.weight_scale`` (experts, 2I, H/group), ``.weight_shape``
(experts, 4: gate's then up's [I, H]) and, when asymmetric,
``.weight_zero_point`` (experts, 2I/8, H/group); ``down_proj`` the same with
(H, I). The checkpoints here are built that way from per-expert states that
the ``compressed-tensors`` package itself quantizes and packs, stacked along a
new first dimension, with gate and up concatenated along the rows.

Checked: layout detection; each part of an expert is one contiguous byte
range of its stacked tensor (one read each); every leased part equals what
``safetensors`` loads for that slice, sharded too; ``colibri.dequantize``
(numpy and torch) equals compressed-tensors' own decompression; a MoE block
through colibri.moe equals the same computation on the reference weights;
hostile files fail at open with a FormatError naming the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors.pack_quantized.base import (  # noqa: E402
    PackedQuantizationCompressor,
)
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import colibri  # noqa: E402
from colibri import moe  # noqa: E402
from colibri.errors import FormatError  # noqa: E402
from colibri.checkpoint.experts import CONCATENATED  # noqa: E402
from colibri.checkpoint.scan import scan_model  # noqa: E402
from colibri.formats import INT4  # noqa: E402
from colibri.torch_interop import dequantize_torch  # noqa: E402

HIDDEN, INTER, EXPERTS, LAYERS, GROUP = 64, 32, 4, 2, 16
ROLES = ("gate", "up", "down")
Reference = dict[tuple[int, int, str], Any]


def _stacked(states: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: torch.stack([s[key] for s in states]) for key in states[0]}


def _gate_up(gate: dict[str, Any], up: dict[str, Any]) -> dict[str, Any]:
    # Along the rows for (experts, rows, ...) tensors; the (experts, 2) shapes side by side.
    return {key: torch.cat([gate[key], up[key]], dim=1 if gate[key].ndim >= 3 else -1) for key in gate}


def _write(path: Path, *, symmetric: bool, scale_dtype: Any, shards: int = 1, seed: int = 3) -> Reference:
    """The stacked checkpoint; returns compressed-tensors' decompression of every weight."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group",
                            group_size=GROUP)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    gen = torch.Generator().manual_seed(seed)
    reference: Reference = {}
    files: list[dict[str, Any]] = [{} for _ in range(shards)]
    for layer in range(LAYERS):
        states: dict[str, list[dict[str, Any]]] = {r: [] for r in ROLES}
        for expert in range(EXPERTS):
            for role in ROLES:
                shape = (HIDDEN, INTER) if role == "down" else (INTER, HIDDEN)
                w = torch.randn(shape, generator=gen)
                groups = w.reshape(shape[0], shape[1] // GROUP, GROUP)
                scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
                packed = PackedQuantizationCompressor.compress(
                    {"weight": w, "weight_scale": scale.to(scale_dtype), "weight_zero_point": zero}, scheme)
                reference[(layer, expert, role)] = PackedQuantizationCompressor.decompress(
                    dict(packed), scheme)["weight"]
                # The same decompression with the scales' values in float32: exact.
                reference[(layer, expert, role + "_f32")] = PackedQuantizationCompressor.decompress(
                    {**packed, "weight_scale": packed["weight_scale"].float()}, scheme)["weight"]
                states[role].append(dict(packed))
        base = f"model.layers.{layer}.mlp.experts."
        gate_up = _gate_up(_stacked(states["gate"]), _stacked(states["up"]))
        down = _stacked(states["down"])
        for key, value in gate_up.items():
            files[0][base + "gate_up_proj." + key] = value.contiguous()
        for key, value in down.items():
            files[-1][base + "down_proj." + key] = value.contiguous()
        files[0][f"model.layers.{layer}.mlp.gate.weight"] = torch.randn(EXPERTS, HIDDEN, generator=gen)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    for name, tensors in zip(names, files):
        save_file(tensors, str(path / name), metadata={"format": "pt"})
    if shards > 1:
        weight_map = {key: name for name, tensors in zip(names, files) for key in tensors}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    group = {"targets": ["re:.*mlp\\.experts.*"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": GROUP}}
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": group}}
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": quant}))
    return reference


CASES = {"symmetric-bf16": (True, torch.bfloat16, 1), "asymmetric-f32": (False, torch.float32, 1),
         "asymmetric-bf16-sharded": (False, torch.bfloat16, 2)}


@pytest.fixture(scope="module", params=sorted(CASES))
def stacked(request: Any, tmp_path_factory: Any) -> tuple[Path, Reference, bool]:
    symmetric, scale_dtype, shards = CASES[request.param]
    path = Path(tmp_path_factory.mktemp("stacked-int4"))
    return path, _write(path, symmetric=symmetric, scale_dtype=scale_dtype, shards=shards), symmetric


def _tensor(path: Path, name: str) -> Any:
    """What safetensors loads for ``name`` or ``name[e]``."""
    base, index = name[:-1].rsplit("[", 1) if name.endswith("]") else (name, "")
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if base in st.keys():
                t = st.get_tensor(base)
                return t[int(index)] if index else t
    raise KeyError(name)


def test_layout_is_detected(stacked: tuple[Path, Reference, bool]) -> None:
    path, _, symmetric = stacked
    model = scan_model(path)
    assert model.layout == "stacked"
    for layer in range(LAYERS):
        assert model.num_experts(layer) == EXPERTS
        ex = model.expert(layer, 1)
        assert (ex.scheme, ex.fused, ex.transposed, ex.group_size) == (INT4, CONCATENATED, False, GROUP)
        assert ex.shapes == ((2 * INTER, HIDDEN), None, (HIDDEN, INTER))
        names = [n for n in ex.part_names() if n is not None]
        want = ["gate_up", "down", "gate_up_scale", "down_scale"]
        assert names == want + ([] if symmetric else ["gate_up_zero", "down_zero"])


def test_each_part_is_one_slice_and_bytes_equal_safetensors(stacked: tuple[Path, Reference, bool]) -> None:
    path, _, _ = stacked
    model = scan_model(path)
    checked = 0
    with colibri.open_store(path, slots_per_layer=2, prefetch_workers=0) as store:
        for layer, expert in model.keys():
            ex = model.expert(layer, expert)
            for name, info in zip(ex.part_names(), ex.part_infos()):
                if info is None:
                    continue
                base = info.name[: info.name.rindex("[")]
                whole = next(t for t in ex.tensors() if t.name == info.name)
                assert whole is info and info.name == f"{base}[{expert}]"
                # One contiguous range: the expert's slice of the stacked tensor.
                stacked_bytes = _tensor(path, base)
                per = stacked_bytes[0].numel() * stacked_bytes.element_size()
                assert info.nbytes == per
            with store.lease(layer, expert) as lease:
                for name, array in lease.parts.items():
                    info = dict(zip(ex.part_names(), ex.part_infos()))[name]
                    assert info is not None
                    want = _tensor(path, info.name)
                    got = torch.from_numpy(np.array(array).view(np.uint8))   # a copy
                    assert torch.equal(got, want.contiguous().view(torch.uint8).reshape(got.shape)), name
                    checked += 1
                del array
    assert checked >= LAYERS * EXPERTS * 4


def test_dequantize_equals_compressed_tensors(stacked: tuple[Path, Reference, bool]) -> None:
    path, reference, _ = stacked
    with colibri.open_store(path, slots_per_layer=2) as store:
        for layer in range(LAYERS):
            for expert in range(EXPERTS):
                with store.lease(layer, expert) as ex:
                    got = colibri.dequantize(ex)
                    got_torch = dequantize_torch(ex)
                assert set(got) == set(ROLES)
                for role in ROLES:
                    ref = reference[(layer, expert, role)]
                    # The package computes in the scales' dtype; float32 of a
                    # 4-bit integer times a scale is exact, so rounding gives theirs.
                    assert torch.equal(torch.from_numpy(got[role]).to(ref.dtype), ref), (layer, expert, role)
                    exact = reference[(layer, expert, role + "_f32")]
                    assert torch.equal(torch.from_numpy(got[role]), exact), (layer, expert, role)
                    assert torch.equal(got_torch[role], torch.from_numpy(got[role]))


def test_moe_block_equals_reference_weights(stacked: tuple[Path, Reference, bool]) -> None:
    path, reference, _ = stacked
    gen = np.random.default_rng(5)
    x = gen.standard_normal((6, HIDDEN)).astype(np.float32)
    idx = np.stack([gen.choice(EXPERTS, 2, replace=False) for _ in range(6)]).astype(np.int64)
    weights = gen.random((6, 2)).astype(np.float32)
    with colibri.open_store(path, slots_per_layer=2) as store:
        got = moe.experts_forward(store, 1, x, idx, weights)
    xt = torch.from_numpy(x)
    want = torch.zeros(6, HIDDEN)
    for t in range(6):
        for j in range(2):
            g, u, d = (reference[(1, int(idx[t, j]), r + "_f32")] for r in ROLES)
            y = (torch.nn.functional.silu(xt[t] @ g.T) * (xt[t] @ u.T)) @ d.T
            want[t] += float(weights[t, j]) * y
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6 * float(want.abs().max()))


# ---------------------------------------------------------------- hostile files


def _hostile(tmp_path: Path, change: Callable[[dict[str, Any]], None],
             config: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """A symmetric one-file checkpoint with ``change`` applied to its tensors."""
    from safetensors.torch import load_file

    path = tmp_path / "hostile"
    path.mkdir()
    _write(path, symmetric=False, scale_dtype=torch.bfloat16)
    (f,) = path.glob("*.safetensors")
    tensors = load_file(str(f))
    change(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((path / "config.json").read_text())
        config(next(iter(cfg["quantization_config"]["config_groups"].values()))["weights"])
        (path / "config.json").write_text(json.dumps(cfg))
    return path


L0 = "model.layers.0.mlp.experts."


def _set(name: str, value: Callable[[Any], Any]) -> Callable[[dict[str, Any]], None]:
    def change(t: dict[str, Any]) -> None:
        t[name] = value(t[name]).contiguous()
    return change


def _drop(name: str) -> Callable[[dict[str, Any]], None]:
    def change(t: dict[str, Any]) -> None:
        del t[name]
    return change


HOSTILE: dict[str, tuple[Callable[[dict[str, Any]], None], Any, str]] = {
    "packed does not match weight_shape": (
        _set(L0 + "down_proj.weight_packed", lambda v: v[:, :, :-1]), None, L0 + "down_proj.weight_packed"),
    "weight_shape disagrees with packed": (
        _set(L0 + "gate_up_proj.weight_shape", lambda v: v * 2), None, L0 + "gate_up_proj.weight_packed"),
    "experts of different shapes": (
        _set(L0 + "down_proj.weight_shape", lambda v: torch.cat([v[:1], v[1:] + 8])), None,
        L0 + "down_proj.weight_shape"),
    "scale missing": (_drop(L0 + "gate_up_proj.weight_scale"), None, L0 + "gate_up_proj.weight_scale"),
    "scale of the wrong shape": (
        _set(L0 + "down_proj.weight_scale", lambda v: v[:, :-1]), None, L0 + "down_proj.weight_scale"),
    "zero point of the wrong shape": (
        _set(L0 + "gate_up_proj.weight_zero_point", lambda v: v[:, :, :-1]), None,
        L0 + "gate_up_proj.weight_zero_point"),
    "stacks of different counts": (
        _set(L0 + "down_proj.weight_scale", lambda v: v[:-1]), None, L0 + "down_proj.weight_scale"),
    "activation ordering": (
        lambda t: t.__setitem__(L0 + "down_proj.weight_g_idx", torch.zeros(EXPERTS, INTER, dtype=torch.int32)),
        None, L0 + "down_proj.weight_g_idx"),
    "8-bit in config.json": (lambda t: None, lambda w: w.update(num_bits=8), "weight_packed"),
    "group size disagrees with config.json": (
        lambda t: None, lambda w: w.update(group_size=32), "weight_scale"),
    "packed and plain both": (
        lambda t: t.__setitem__(L0 + "down_proj", torch.zeros(EXPERTS, HIDDEN, INTER)), None,
        L0 + "down_proj"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_files_fail_at_open_naming_the_tensor(tmp_path: Path, case: str) -> None:
    change, config, named = HOSTILE[case]
    path = _hostile(tmp_path, change, config)
    with pytest.raises(FormatError) as err:
        scan_model(path)
    assert named in str(err.value), str(err.value)
    with pytest.raises(FormatError):
        colibri.open_store(path, slots_per_layer=1)
