"""Tests of the checkpoint scanner (colibri.checkpoint): which tensors are routed experts, and their validation."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable

import ml_dtypes
import numpy as np
import pytest
import safetensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri.errors import FormatError, UnknownExpertError
from colibri.checkpoint.experts import ExpertTensors, ModelExperts
from colibri.checkpoint.naming import BUILTIN_LAYOUTS, MIXTRAL, MLP_EXPERTS, Layout, detect_layout
from colibri.checkpoint.safetensors import INDEX_NAME, TensorInfo
from colibri.checkpoint.scan import scan_model
from colibri.formats.fp8 import scale_block

# ---------------------------------------------------------------- model writers

MIXTRAL_ROLES = {"gate": "w1", "up": "w3", "down": "w2"}
MLP_ROLES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
F8 = ml_dtypes.float8_e4m3fn


def expert_name(layout: str, layer: int, expert: int, role: str, prefix: str = "model.") -> str:
    if layout == "mixtral":
        return f"{prefix}layers.{layer}.block_sparse_moe.experts.{expert}.{MIXTRAL_ROLES[role]}.weight"
    return f"{prefix}layers.{layer}.mlp.experts.{expert}.{MLP_ROLES[role]}.weight"


def role_shape(role: str, inter: int, hidden: int) -> tuple[int, int]:
    return (hidden, inter) if role == "down" else (inter, hidden)


_counter = [0]


def values(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Distinct contents per call, so a swapped role shows up as different bytes."""
    _counter[0] += 1
    rng = np.random.default_rng(_counter[0])
    return rng.uniform(-2, 2, shape).astype(dtype)


def moe_tensors(layout: str, layers: Iterable[int], experts: int, inter: int = 4,
                hidden: int = 6, dtype: Any = np.float32, prefix: str = "model.",
                scales: bool = False) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for layer in layers:
        for expert in range(experts):
            for role in ("gate", "up", "down"):
                shape = role_shape(role, inter, hidden)
                name = expert_name(layout, layer, expert, role, prefix)
                out[name] = values(shape, dtype)
                if scales:
                    out[name + "_scale_inv"] = values(
                        (-(-shape[0] // 128), -(-shape[1] // 128)), np.float32)
    return out


def surroundings(layout: str, layers: Iterable[int], experts: int, hidden: int = 6,
                 vocab: int = 10) -> dict[str, np.ndarray]:
    """Embeddings, attention, norms and routers: never experts."""
    out = {
        "model.embed_tokens.weight": values((vocab, hidden), np.float32),
        "model.norm.weight": values((hidden,), np.float32),
        "lm_head.weight": values((vocab, hidden), np.float32),
    }
    block = "block_sparse_moe" if layout == "mixtral" else "mlp"
    for layer in layers:
        out[f"model.layers.{layer}.self_attn.q_proj.weight"] = values((hidden, hidden), np.float32)
        out[f"model.layers.{layer}.input_layernorm.weight"] = values((hidden,), np.float32)
        out[f"model.layers.{layer}.{block}.gate.weight"] = values((experts, hidden), np.float32)
    return out


def save(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    """Any dtype, fp8 included (safetensors.numpy.save_file cannot write fp8)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keep = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    specs = {
        k: safetensors.TensorSpec(dtype=v.dtype.name, shape=v.shape,
                                  data_ptr=v.ctypes.data, data_len=v.nbytes)
        for k, v in keep.items()
    }
    safetensors.serialize_file(specs, str(path))
    return path


def save_sharded(root: Path, tensors: dict[str, np.ndarray], shards: int) -> list[Path]:
    """Split by sorted name across shards and write the index, as HF does."""
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    paths = []
    for i in range(shards):
        part = names[i::shards]
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        paths.append(save(root / shard, {n: tensors[n] for n in part}))
        weight_map.update({n: shard for n in part})
    (root / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return paths


def bytes_of(info: TensorInfo) -> bytes:
    with open(info.path, "rb") as fh:
        fh.seek(info.offset)
        return fh.read(info.nbytes)


def check_roles(model: ModelExperts, layout: str, tensors: dict[str, np.ndarray],
                prefix: str = "model.") -> None:
    """Every expert's gate/up/down is exactly the tensor the naming says."""
    for layer, expert in model.keys():
        ex = model.expert(layer, expert)
        for role in ("gate", "up", "down"):
            name = expert_name(layout, layer, expert, role, prefix)
            info = ex.weight(role)
            assert info.name == name
            assert info.shape == tensors[name].shape
            assert bytes_of(info) == tensors[name].tobytes()


# ---------------------------------------------------------------- detection


def test_mixtral_single_file(tmp_path: Path) -> None:
    experts = moe_tensors("mixtral", range(3), 4)
    tensors = {**experts, **surroundings("mixtral", range(3), 4)}
    path = save(tmp_path / "model.safetensors", tensors)
    for source in (path, tmp_path, str(path), [path]):
        model = scan_model(source)
        assert model.layout == "mixtral"
        assert model.files == (str(path),)
        assert model.layers == (0, 1, 2)
        assert [model.num_experts(layer) for layer in model.layers] == [4, 4, 4]
        assert list(model.keys()) == [(layer, e) for layer in range(3) for e in range(4)]
    check_roles(model, "mixtral", tensors)
    ex = model.expert(1, 2)
    assert ex.gate.shape == (4, 6) and ex.up.shape == (4, 6) and ex.down.shape == (6, 4)
    assert ex.gate_scale is ex.up_scale is ex.down_scale is None
    assert ex.nbytes == 3 * 4 * 6 * 4 == model.expert_nbytes(1)
    assert ex.coli_format("gate") == 0
    assert ex.block_shape("down") is None
    assert scan_model(path, layout="mixtral") == model
    assert scan_model(path, layout=MIXTRAL) == model


@pytest.mark.parametrize("dtype, code", [(np.float16, 8), (ml_dtypes.bfloat16, 9),
                                         (F8, 10), (ml_dtypes.float8_e5m2, 11)])
def test_mlp_experts_qwen_like(tmp_path: Path, dtype: Any, code: int) -> None:
    hidden, inter = 8, 4
    tensors = moe_tensors("mlp_experts", [0, 1], 3, inter, hidden, dtype)
    tensors.update(surroundings("mlp_experts", [0, 1], 3, hidden))
    for layer in (0, 1):  # Qwen2-MoE's single shared expert and its gate
        for proj, shape in (("gate_proj", (5, hidden)), ("up_proj", (5, hidden)),
                            ("down_proj", (hidden, 5))):
            tensors[f"model.layers.{layer}.mlp.shared_expert.{proj}.weight"] = values(shape, dtype)
        tensors[f"model.layers.{layer}.mlp.shared_expert_gate.weight"] = values((1, hidden), dtype)
    path = save(tmp_path / "m.safetensors", tensors)
    model = scan_model(path)
    assert model.layout == "mlp_experts"
    assert model.layers == (0, 1) and model.num_experts(0) == 3
    check_roles(model, "mlp_experts", tensors)
    for layer, expert in model.keys():
        ex = model.expert(layer, expert)
        assert all(ex.coli_format(r) == code for r in ("gate", "up", "down"))
        assert all("shared" not in t.name for t in ex.tensors())


def test_missing_model_prefix_is_tolerated(tmp_path: Path) -> None:
    tensors = moe_tensors("mlp_experts", [5], 2, prefix="")
    model = scan_model(save(tmp_path / "m.safetensors", tensors))
    assert model.layers == (5,)
    check_roles(model, "mlp_experts", tensors, prefix="")
    tensors = moe_tensors("mixtral", [0], 2, prefix="")
    assert scan_model(save(tmp_path / "x.safetensors", tensors)).layout == "mixtral"


def deepseek_like(fp8: bool, inter: int = 128, hidden: int = 256, experts: int = 4,
                  dense_layers: int = 2, moe_layers: int = 2) -> dict[str, np.ndarray]:
    """DeepSeek-V3 shape: dense first layers, shared experts, sigmoid router bias."""
    dtype = F8 if fp8 else ml_dtypes.bfloat16
    moe = range(dense_layers, dense_layers + moe_layers)
    tensors = moe_tensors("mlp_experts", moe, experts, inter, hidden, dtype, scales=fp8)
    tensors.update(surroundings("mlp_experts", range(dense_layers + moe_layers), experts, hidden))

    def mlp(prefix: str, width: int) -> None:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            shape = (hidden, width) if proj == "down_proj" else (width, hidden)
            tensors[f"{prefix}.{proj}.weight"] = values(shape, dtype)
            if fp8:
                tensors[f"{prefix}.{proj}.weight_scale_inv"] = values(
                    (-(-shape[0] // 128), -(-shape[1] // 128)), np.float32)

    for layer in range(dense_layers):
        mlp(f"model.layers.{layer}.mlp", 3 * inter)  # the dense MLP: no experts.E
        del tensors[f"model.layers.{layer}.mlp.gate.weight"]  # dense layers have no router
    for layer in moe:
        mlp(f"model.layers.{layer}.mlp.shared_experts", inter)
        tensors[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] = values((experts,), np.float32)
    return tensors


@pytest.mark.parametrize("fp8", [False, True])
def test_deepseek_like_sharded(tmp_path: Path, fp8: bool) -> None:
    tensors = deepseek_like(fp8)
    shards = save_sharded(tmp_path / "ds", tensors, 3)
    model = scan_model(tmp_path / "ds")
    assert model.layout == "mlp_experts"
    assert model.layers == (2, 3)
    assert model.files == tuple(str(p) for p in shards)
    assert model.num_experts(2) == model.num_experts(3) == 4
    check_roles(model, "mlp_experts", tensors)
    used = set()
    for layer, expert in model.keys():
        ex = model.expert(layer, expert)
        for info in ex.tensors():
            assert f"mlp.experts.{expert}." in info.name
            assert model.files[info.file] == info.path
            used.add(info.name)
        if fp8:
            assert ex.gate_scale is not None and ex.down_scale is not None
            assert ex.gate_scale.name == ex.gate.name + "_scale_inv"
            assert ex.gate_scale.shape == (1, 2) and ex.down_scale.shape == (2, 1)
            assert ex.block_shape("gate") == ex.block_shape("down") == (128, 128)
            assert ex.coli_format("up") == 4
            assert bytes_of(ex.up_scale) == tensors[ex.up.name + "_scale_inv"].tobytes()  # type: ignore[arg-type]
            assert ex.nbytes == 3 * 128 * 256 + 3 * 2 * 4
        else:
            assert ex.coli_format("up") == 9
    assert not any(("shared" in n or ".gate." in n or "layers.0." in n) for n in used)
    # The same shards given as a list scan the same.
    listed = scan_model(list(reversed(shards)))
    assert listed.layers == model.layers
    assert {k: listed.expert(*k).gate.name for k in listed.keys()} == {
        k: model.expert(*k).gate.name for k in model.keys()}


def test_fp8_blocks_not_dividing_the_shape(tmp_path: Path) -> None:
    # 200 rows with 2 scale rows: 128-blocks with a padded tail, as quantisers write.
    tensors = {}
    for role in ("gate", "up", "down"):
        shape = role_shape(role, 200, 320)
        name = expert_name("mlp_experts", 0, 0, role)
        tensors[name] = values(shape, F8)
        tensors[name + "_scale_inv"] = values((-(-shape[0] // 128), -(-shape[1] // 128)), np.float32)
    model = scan_model(save(tmp_path / "m.safetensors", tensors))
    ex = model.expert(0, 0)
    assert ex.gate_scale is not None and ex.gate_scale.shape == (2, 3)
    assert ex.block_shape("gate") == ex.block_shape("down") == (128, 128)


# ---------------------------------------------------------------- scale_block


def info(name: str, shape: tuple[int, ...], dtype: str = "F32") -> TensorInfo:
    return TensorInfo(name=name, file=0, path="/x", dtype=dtype, shape=shape, offset=0,
                      nbytes=int(np.prod(shape)) * 4)


@pytest.mark.parametrize(
    "weight, scale, block",
    [
        ((7168, 2048), (56, 16), (128, 128)),
        ((2048, 7168), (16, 56), (128, 128)),
        ((200, 300), (2, 3), (128, 128)),
        ((64, 96), (2, 3), (32, 32)),
        ((64, 96), (64, 1), (1, 128)),
        ((5, 7), (5, 7), (1, 1)),
        ((100, 100), (1, 1), (128, 128)),
        ((300, 90), (2, 3), (150, 30)),
    ],
)
def test_scale_block(weight: tuple[int, int], scale: tuple[int, int],
                     block: tuple[int, int]) -> None:
    assert scale_block(info("w", weight), info("s", scale)) == block
    rows, cols = block
    assert -(-weight[0] // rows) == scale[0] and -(-weight[1] // cols) == scale[1]


@pytest.mark.parametrize("weight, scale", [((5, 8), (4, 1)), ((8, 8), (9, 1)),
                                           ((8, 8), (0, 1)), ((8, 8), (2,)),
                                           ((8, 8, 1), (1, 1))])
def test_scale_block_rejects(weight: tuple[int, ...], scale: tuple[int, ...]) -> None:
    with pytest.raises(FormatError):
        scale_block(info("w", weight), info("s", scale))


# ---------------------------------------------------------------- custom layouts

T5_LIKE = r"transformer\.h\.(?P<layer>\d+)\.moe\.experts\.(?P<expert>\d+)\.(?P<role>wi_0|wi_1|wo)\.kernel"


def t5_tensors(layers: int, experts: int) -> dict[str, np.ndarray]:
    out = {}
    for layer in range(layers):
        for expert in range(experts):
            out[f"transformer.h.{layer}.moe.experts.{expert}.wi_0.kernel"] = values((4, 6), np.float32)
            out[f"transformer.h.{layer}.moe.experts.{expert}.wi_1.kernel"] = values((4, 6), np.float32)
            out[f"transformer.h.{layer}.moe.experts.{expert}.wo.kernel"] = values((6, 4), np.float32)
            out[f"transformer.h.{layer}.moe.router.kernel"] = values((experts, 6), np.float32)
    return out


def test_custom_layout(tmp_path: Path) -> None:
    tensors = t5_tensors(2, 3)
    path = save(tmp_path / "m.safetensors", tensors)
    with pytest.raises(FormatError, match="mixtral"):  # auto does not know it
        scan_model(path)
    layout = Layout("t5", T5_LIKE, {"wi_0": "gate", "wi_1": "up", "wo": "down"}, scale_suffix=None)
    model = scan_model(path, layout=layout)
    assert model.layout == "t5"
    assert model.layers == (0, 1) and model.num_experts(1) == 3
    ex = model.expert(1, 2)
    assert ex.gate.name == "transformer.h.1.moe.experts.2.wi_0.kernel"
    assert ex.up.name.endswith("wi_1.kernel") and ex.down.name.endswith("wo.kernel")
    assert bytes_of(ex.down) == tensors[ex.down.name].tobytes()
    # A compiled pattern is the same layout.
    same = Layout("t5", re.compile(T5_LIKE), {"wi_0": "gate", "wi_1": "up", "wo": "down"}, None)
    assert same == layout and hash(same) == hash(layout)
    assert scan_model(path, layout=same) == model
    assert layout.match("transformer.h.1.moe.experts.2.wo.kernel") == (1, 2, "down")
    assert layout.match("transformer.h.1.moe.router.kernel") is None


def test_custom_layout_role_text_outside_roles_is_ignored(tmp_path: Path) -> None:
    tensors = t5_tensors(1, 2)
    tensors["transformer.h.0.moe.experts.0.extra.kernel"] = values((3,), np.float32)
    pattern = T5_LIKE.replace("wi_0|wi_1|wo", r"\w+")
    layout = Layout("loose", pattern, {"wi_0": "gate", "wi_1": "up", "wo": "down"})
    model = scan_model(save(tmp_path / "m.safetensors", tensors), layout=layout)
    assert model.num_experts(0) == 2


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"name": "", "pattern": T5_LIKE}, "name"),
        ({"pattern": "(?P<layer>"}, "bad pattern"),
        ({"pattern": r"(?P<layer>\d+)\.(?P<role>\w+)"}, "expert"),
        ({"pattern": re.compile(rb"(?P<layer>\d+)(?P<expert>\d+)(?P<role>\w+)")}, "str regex"),
        ({"pattern": 42}, "str regex"),
        ({"roles": {"wi_0": "gate", "wi_1": "up"}}, "down"),
        ({"roles": {"wi_0": "gate", "wi_1": "up", "wo": "out"}}, "'out'"),
        ({"roles": ["gate"]}, "mapping"),
        ({"scale_suffix": ""}, "scale_suffix"),
    ],
)
def test_bad_layouts(kwargs: dict[str, Any], fragment: str) -> None:
    args: dict[str, Any] = {"name": "x", "pattern": T5_LIKE,
                            "roles": {"wi_0": "gate", "wi_1": "up", "wo": "down"}}
    args.update(kwargs)
    with pytest.raises(FormatError, match=re.escape(fragment)):
        Layout(**args)


def test_custom_layout_capturing_non_numbers(tmp_path: Path) -> None:
    layout = Layout("bad", r"l(?P<layer>\w+)\.e(?P<expert>\d+)\.(?P<role>g|u|d)",
                    {"g": "gate", "u": "up", "d": "down"})
    path = save(tmp_path / "m.safetensors", {"lx.e0.g": values((2, 3), np.float32)})
    with pytest.raises(FormatError, match="'x'"):
        scan_model(path, layout=layout)


def test_duplicate_role(tmp_path: Path) -> None:
    layout = Layout("dup", r"l(?P<layer>\d+)\.e(?P<expert>\d+)\.(?P<role>\w+)",
                    {"a": "gate", "b": "gate", "u": "up", "d": "down"})
    tensors = {"l0.e0.a": values((2, 3), np.float32), "l0.e0.b": values((2, 3), np.float32),
               "l0.e0.u": values((2, 3), np.float32), "l0.e0.d": values((3, 2), np.float32)}
    with pytest.raises(FormatError, match="both the gate"):
        scan_model(save(tmp_path / "m.safetensors", tensors), layout=layout)
    # With and without the "model." prefix the same expert appears twice.
    tensors = moe_tensors("mlp_experts", [0], 1)
    tensors.update(moe_tensors("mlp_experts", [0], 1, prefix=""))
    with pytest.raises(FormatError, match="layer 0 expert 0"):
        scan_model(save(tmp_path / "n.safetensors", tensors))


def test_builtin_layouts_table() -> None:
    assert set(BUILTIN_LAYOUTS) == {"mixtral", "mlp_experts"}
    assert MIXTRAL.match("model.layers.3.block_sparse_moe.experts.7.w3.weight") == (3, 7, "up")
    assert MLP_EXPERTS.match("model.layers.10.mlp.experts.255.down_proj.weight") == (10, 255, "down")
    never = [
        "model.layers.3.block_sparse_moe.gate.weight",
        "model.layers.3.mlp.gate.weight",
        "model.layers.3.mlp.gate.e_score_correction_bias",
        "model.layers.3.mlp.gate_proj.weight",
        "model.layers.3.mlp.shared_expert.gate_proj.weight",
        "model.layers.3.mlp.shared_experts.up_proj.weight",
        "model.layers.3.mlp.shared_expert_gate.weight",
        "model.layers.3.mlp.experts.0.gate_proj.weight_scale_inv",
        "model.layers.3.mlp.experts.0.gate_proj.bias",
        "model.layers.3.mlp.experts.gate_up_proj",
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.x.mlp.experts.0.gate_proj.weight",
        "model.layers.3.block_sparse_moe.experts.0.w4.weight",
    ]
    for name in never:
        assert MIXTRAL.match(name) is None and MLP_EXPERTS.match(name) is None, name
    assert detect_layout(["model.layers.0.mlp.experts.0.up_proj.weight"]) is MLP_EXPERTS


# ---------------------------------------------------------------- validation errors


def scan_error(tmp_path: Path, tensors: dict[str, np.ndarray], *fragments: str,
               layout: Any = "auto") -> str:
    path = save(tmp_path / "bad.safetensors", tensors)
    with pytest.raises(FormatError) as err:
        scan_model(path, layout=layout)
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, message
    assert isinstance(err.value, ValueError)
    return message


def test_no_routed_experts(tmp_path: Path) -> None:
    dense = {"model.layers.0.mlp.gate_proj.weight": values((4, 6), np.float32),
             "model.layers.0.mlp.up_proj.weight": values((4, 6), np.float32),
             "model.layers.0.mlp.down_proj.weight": values((6, 4), np.float32)}
    scan_error(tmp_path, dense, "no routed experts", "mixtral", "mlp_experts", "bad.safetensors")
    scan_error(tmp_path, moe_tensors("mixtral", [0], 2), "'mlp_experts'", "matches no",
               layout="mlp_experts")
    save_sharded(tmp_path / "sharded", dense, 3)
    with pytest.raises(FormatError, match="and 2 more files"):
        scan_model(tmp_path / "sharded")


def test_ambiguous_and_unknown_layout(tmp_path: Path) -> None:
    both = {**moe_tensors("mixtral", [0], 1), **moe_tensors("mlp_experts", [1], 1)}
    scan_error(tmp_path, both, "ambiguous", "mixtral", "mlp_experts")
    scan_error(tmp_path, moe_tensors("mixtral", [0], 1), "unknown layout 'qwen'", layout="qwen")
    scan_error(tmp_path, moe_tensors("mixtral", [0], 1), "unknown layout", layout=3)


def test_missing_role(tmp_path: Path) -> None:
    tensors = moe_tensors("mixtral", [0, 1], 3)
    del tensors[expert_name("mixtral", 1, 2, "up")]
    scan_error(tmp_path, tensors, "layer 1 expert 2", "no up tensor", "w1.weight")
    tensors = moe_tensors("mlp_experts", [4], 2)
    del tensors[expert_name("mlp_experts", 4, 0, "gate")]
    del tensors[expert_name("mlp_experts", 4, 0, "down")]
    scan_error(tmp_path, tensors, "layer 4 expert 0", "gate or down")


def test_gap_in_expert_numbers(tmp_path: Path) -> None:
    tensors = moe_tensors("mlp_experts", [0], 4)
    for role in ("gate", "up", "down"):
        del tensors[expert_name("mlp_experts", 0, 2, role)]
    scan_error(tmp_path, tensors, "layer 0", "expert 2 is missing")


def replace(tensors: dict[str, np.ndarray], layer: int, expert: int, role: str,
            array: np.ndarray, layout: str = "mlp_experts") -> dict[str, np.ndarray]:
    tensors = dict(tensors)
    tensors[expert_name(layout, layer, expert, role)] = array
    return tensors


def test_bad_expert_tensors(tmp_path: Path) -> None:
    base = moe_tensors("mlp_experts", [0], 3)  # gate/up (4, 6), down (6, 4)
    cases = [
        (replace(base, 0, 1, "gate", values((4, 6, 1), np.float32)), ["expert 1", "2-D"]),
        (replace(base, 0, 0, "down", values((24,), np.float32)), ["expert 0", "2-D"]),
        (replace(base, 0, 1, "up", np.zeros((4, 6), np.int32)), ["expert 1", "I32"]),
        (replace(base, 0, 1, "up", np.zeros((4, 6), np.float64)), ["expert 1", "F64"]),
        (replace(base, 0, 2, "up", values((5, 6), np.float32)), ["expert 2", "up [5, 6]"]),
        (replace(base, 0, 2, "down", values((4, 6), np.float32)), ["expert 2", "down (H, I)"]),
    ]
    for tensors, fragments in cases:
        scan_error(tmp_path, tensors, "layer 0", *fragments)
    empty = {expert_name("mlp_experts", 0, 0, r): np.zeros(s, np.float32)
             for r, s in (("gate", (0, 6)), ("up", (0, 6)), ("down", (6, 0)))}
    scan_error(tmp_path, empty, "non-empty")


def test_experts_of_a_layer_must_agree(tmp_path: Path) -> None:
    base = moe_tensors("mlp_experts", [0, 1], 3)
    wider = dict(base)
    for role in ("gate", "up", "down"):
        wider[expert_name("mlp_experts", 1, 2, role)] = values(role_shape(role, 8, 6), np.float32)
    scan_error(tmp_path, wider, "layer 1", "expert 2", "expert 0", "[8, 6]")
    other_dtype = dict(base)
    name = expert_name("mlp_experts", 0, 1, "down")
    other_dtype[name] = base[name].astype(np.float16)
    scan_error(tmp_path, other_dtype, "layer 0", "expert 1", "F16")
    # Different layers may differ.
    layer_1 = moe_tensors("mlp_experts", [1], 2, inter=8, dtype=np.float16)
    model = scan_model(save(tmp_path / "ok.safetensors",
                            {**moe_tensors("mlp_experts", [0], 3), **layer_1}))
    assert model.expert(0, 0).gate.shape == (4, 6) and model.expert(1, 0).gate.shape == (8, 6)
    assert model.num_experts(0) == 3 and model.num_experts(1) == 2


def test_scale_errors(tmp_path: Path) -> None:
    base = moe_tensors("mlp_experts", [0], 2, inter=128, hidden=256, dtype=F8, scales=True)
    scale = expert_name("mlp_experts", 0, 1, "gate") + "_scale_inv"

    bad = dict(base)
    bad[scale] = base[scale].astype(np.float16)
    scan_error(tmp_path, bad, "layer 0 expert 1", "F16", "F32")

    bad = dict(base)
    bad[scale] = values((200, 2), np.float32)
    scan_error(tmp_path, bad, "layer 0 expert 1", "does not tile")

    bad = dict(base)
    bad[scale] = values((2,), np.float32)
    scan_error(tmp_path, bad, "layer 0 expert 1", "2-D")

    bad = dict(base)
    del bad[scale]  # expert 1 unscaled, expert 0 scaled: disagreement
    scan_error(tmp_path, bad, "layer 0", "expert 1", "disagrees")

    bad = dict(base)
    bad[scale] = values((1, 1), np.float32)  # one block of (128, 256) is consistent ...
    scan_error(tmp_path, bad, "expert 1", "disagrees")  # ... but not what expert 0 has

    bf16 = moe_tensors("mlp_experts", [0], 1, inter=128, hidden=256,
                       dtype=ml_dtypes.bfloat16, scales=True)
    scan_error(tmp_path, bf16, "BF16", "only F8_E4M3")

    e5m2 = moe_tensors("mlp_experts", [0], 1, inter=128, hidden=256,
                       dtype=ml_dtypes.float8_e5m2, scales=True)
    scan_error(tmp_path, e5m2, "F8_E5M2", "only F8_E4M3")


def test_unknown_companion_tensors_are_refused(tmp_path: Path) -> None:
    # compressed-tensors FP8 names its scale "weight_scale"; ignoring it would be wrong.
    tensors = moe_tensors("mixtral", [0], 2, dtype=F8)
    name = expert_name("mixtral", 0, 1, "down")
    tensors[name + "_scale"] = values((), np.float32)
    scan_error(tmp_path, tensors, "'" + name + "_scale'", "not supported")
    # With no scales in the layout even the usual suffix is refused.
    tensors = t5_tensors(1, 1)
    tensors["transformer.h.0.moe.experts.0.wo.kernel_scale_inv"] = values((1, 1), np.float32)
    layout = Layout("t5", T5_LIKE, {"wi_0": "gate", "wi_1": "up", "wo": "down"}, scale_suffix=None)
    scan_error(tmp_path, tensors, "unscaled", layout=layout)


def test_orphan_scale(tmp_path: Path) -> None:
    tensors = moe_tensors("mlp_experts", [0], 2, inter=128, hidden=256, dtype=F8, scales=True)
    tensors["model.layers.0.mlp.experts.7.up_proj.weight_scale_inv"] = values((1, 2), np.float32)
    scan_error(tmp_path, tensors, "experts.7.up_proj.weight_scale_inv", "no weight")


def test_errors_from_the_reader_pass_through(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="no such"):
        scan_model(tmp_path / "nothing")


# ---------------------------------------------------------------- ModelExperts API


def test_model_experts_api(tmp_path: Path) -> None:
    model = scan_model(save(tmp_path / "m.safetensors", moe_tensors("mixtral", [3, 7], 2)))
    assert model.layers == (3, 7)
    for bad_layer in (0, 4, 8, -1):
        with pytest.raises(UnknownExpertError) as err:
            model.num_experts(bad_layer)
        assert isinstance(err.value, KeyError)
        assert "3, 7" in str(err.value)
    with pytest.raises(KeyError, match="not 2"):
        model.expert(3, 2)
    with pytest.raises(KeyError):
        model.expert(3, -1)
    with pytest.raises(TypeError):
        model.experts[3] = {}  # type: ignore[index]
    with pytest.raises(TypeError):
        model.experts[3][0] = model.expert(3, 0)  # type: ignore[index]
    ex = model.expert(7, 1)
    assert isinstance(ex, ExpertTensors)
    assert [t.name for t in ex.tensors()] == [ex.gate.name, ex.up.name, ex.down.name]
    with pytest.raises(KeyError):
        ex.weight("w1")
    with pytest.raises(KeyError):
        ex.scale("w1")
    with pytest.raises(Exception):
        ex.gate = ex.up  # type: ignore[misc]


def test_layer_ranges_in_messages(tmp_path: Path) -> None:
    layers = [1, 2, 3, 4, 9, 11, 12]
    model = scan_model(save(tmp_path / "m.safetensors", moe_tensors("mlp_experts", layers, 1)))
    with pytest.raises(UnknownExpertError, match=r"1-4, 9, 11-12"):
        model.num_experts(5)


# ---------------------------------------------------------------- property test


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    layout=st.sampled_from(["mixtral", "mlp_experts"]),
    layers=st.sets(st.integers(0, 60), min_size=1, max_size=4),
    experts=st.integers(1, 5),
    inter=st.integers(1, 5),
    hidden=st.integers(1, 5),
    dtype=st.sampled_from([np.float32, np.float16, ml_dtypes.bfloat16, F8]),
    shards=st.integers(1, 3),
)
def test_scan_finds_exactly_what_was_written(tmp_path_factory: pytest.TempPathFactory,
                                             layout: str, layers: set[int], experts: int,
                                             inter: int, hidden: int, dtype: Any,
                                             shards: int) -> None:
    root = tmp_path_factory.mktemp("prop")
    tensors = moe_tensors(layout, sorted(layers), experts, inter, hidden, dtype)
    tensors.update(surroundings(layout, sorted(layers), experts, hidden))
    save_sharded(root, tensors, shards)
    model = scan_model(root)
    assert model.layout == layout
    assert model.layers == tuple(sorted(layers))
    assert all(model.num_experts(layer) == experts for layer in layers)
    check_roles(model, layout, tensors)
    itemsize = np.dtype(dtype).itemsize
    assert model.expert_nbytes(min(layers)) == 3 * inter * hidden * itemsize
