"""GPTQ and AWQ 4-bit experts, checked against their ecosystems' own code.

The references are AutoGPTQ's ``QuantLinear`` (its CPU path, in
``auto_gptq/nn_modules/qlinear/qlinear_cuda.py``: ``scales[g_idx] * (weight
- zeros[g_idx])`` with the stored zero points plus one) and AutoAWQ's
``dequantize_gemm`` (``awq/utils/packing_utils.py``). Both packages only
install without their dependencies next to this project's torch and
transformers (``pip install --no-deps auto-gptq==0.7.1 autoawq==0.2.9``, as
.ci/run does), and their package ``__init__`` imports modules that no longer
exist there, so the two reference modules are loaded from their files; each
imports only torch, numpy and transformers.

The checkpoints are written here from random packed words (every nibble
value, act-order g_idx), so the references decode exactly the bytes
colibri leases; every leased part must equal what ``safetensors`` loads.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import numpy as np
import pytest
from safetensors.numpy import save_file

import colibri
from colibri import moe
from colibri.errors import FormatError
from colibri.checkpoint.scan import scan_model
from conftest import assert_lease_parts_equal_safetensors, load_safetensors

torch = pytest.importorskip("torch")

HIDDEN, INTER, EXPERTS, LAYERS, GROUP = 64, 32, 4, 2, 16
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's AWQ_ORDER: column of each nibble
ROLE_NAMES = {"mlp_experts": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
              "mixtral": {"gate": "w1", "up": "w3", "down": "w2"}}


def _load_reference(package: str, relative: str) -> ModuleType:
    """One module file of an installed package, without running the package's __init__."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed (pip install --no-deps, see .ci/run)")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    module_spec = importlib.util.spec_from_file_location(f"_reference_{package}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def auto_gptq() -> ModuleType:
    return _load_reference("auto_gptq", "nn_modules/qlinear/qlinear_cuda.py")


@pytest.fixture(scope="module")
def autoawq() -> ModuleType:
    return _load_reference("awq", "utils/packing_utils.py")


# ------------------------------------------------------------ packing, written from the formats' definitions


def _words(nibbles: np.ndarray) -> np.ndarray:
    """(..., 8) values 0..15 -> int32 words, nibble n in bits 4n..4n+3."""
    u = np.zeros(nibbles.shape[:-1], np.uint32)
    for n in range(8):
        u |= nibbles[..., n].astype(np.uint32) << np.uint32(4 * n)
    return u.view(np.int32)


def pack_gptq_qweight(q: np.ndarray) -> np.ndarray:
    """(in, out) -> (in / 8, out): input rows 8k..8k+7 in word row k."""
    rows, cols = q.shape
    return _words(q.reshape(rows // 8, 8, cols).transpose(0, 2, 1))


def pack_rows(v: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """(r, c) -> (r, c / 8): nibble n of word k holds column 8k + order[n]."""
    rows, cols = v.shape
    return _words(v.reshape(rows, cols // 8, 8)[:, :, list(order)])


def _write_checkpoint(path: Path, scheme: str, *, layout: str = "mlp_experts",
                      g_idx: str | None = "act_order", config: str | None = "config.json",
                      scale_dtype: Any = np.float16, seed: int = 11,
                      zero_range: tuple[int, int] = (0, 16), group: int = GROUP,
                      edit: Callable[[dict[str, np.ndarray]], None] | None = None) -> Path:
    """A two-shard MoE whose experts are GPTQ or AWQ modules of random words."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(LAYERS):
        prefix = (f"model.layers.{layer}.block_sparse_moe" if layout == "mixtral"
                  else f"model.layers.{layer}.mlp")
        tensors[f"{prefix}.gate.weight"] = rng.standard_normal((EXPERTS, HIDDEN)).astype(np.float32)
        for expert in range(EXPERTS):
            for role, (rows, cols) in (("gate", (HIDDEN, INTER)), ("up", (HIDDEN, INTER)),
                                       ("down", (INTER, HIDDEN))):
                base = f"{prefix}.experts.{expert}.{ROLE_NAMES[layout][role]}."
                groups = rows // group if group > 0 else 1
                q = rng.integers(0, 16, (rows, cols))
                z = rng.integers(zero_range[0], zero_range[1], (groups, cols))
                scales = (rng.standard_normal((groups, cols)) * 0.05).astype(scale_dtype)
                if scheme.startswith("gptq"):
                    tensors[base + "qweight"] = pack_gptq_qweight(q)
                    tensors[base + "qzeros"] = pack_rows(z)
                    if g_idx == "act_order":  # desc_act: rows visited in another order
                        tensors[base + "g_idx"] = rng.permutation(np.arange(rows) // (group if group > 0 else rows)).astype(np.int32)
                    elif g_idx == "sorted":
                        tensors[base + "g_idx"] = (np.arange(rows) // (group if group > 0 else rows)).astype(np.int32)
                else:
                    tensors[base + "qweight"] = pack_rows(q, AWQ_PACK_ORDER)
                    tensors[base + "qzeros"] = pack_rows(z, AWQ_PACK_ORDER)
                tensors[base + "scales"] = scales
    if edit is not None:
        edit(tensors)
    names = sorted(tensors)
    half = len(names) // 2
    weight_map: dict[str, str] = {}
    for i, chunk in enumerate((names[:half], names[half:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(path / shard))
        weight_map.update({n: shard for n in chunk})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if scheme.startswith("gptq"):
        quant: dict[str, Any] = {"quant_method": "gptq", "bits": 4, "group_size": group,
                                 "desc_act": g_idx == "act_order", "sym": False,
                                 "checkpoint_format": scheme}
    else:
        quant = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                 "version": "gemm"}
    model_type = "mixtral" if layout == "mixtral" else "qwen3_moe"
    if config == "config.json":
        (path / "config.json").write_text(json.dumps({"model_type": model_type,
                                                      "quantization_config": quant}))
    elif config == "own":  # AutoGPTQ's quantize_config.json / AutoAWQ's quant_config.json
        (path / "config.json").write_text(json.dumps({"model_type": model_type}))
        if scheme.startswith("gptq"):
            own = {k: v for k, v in quant.items() if k != "quant_method"}
            (path / "quantize_config.json").write_text(json.dumps(own))
        else:
            (path / "quant_config.json").write_text(json.dumps(
                {"zero_point": True, "q_group_size": GROUP, "w_bit": 4, "version": "GEMM"}))
    return path


CASES = {
    # GPTQ v1 (checkpoint_format gptq) with act-order g_idx, in config.json.
    "gptq-act-order": dict(scheme="gptq"),
    # Sorted g_idx (desc_act false), AutoGPTQ's own quantize_config.json, Mixtral names.
    "gptq-mixtral-own-config": dict(scheme="gptq", layout="mixtral", g_idx="sorted", config="own"),
    # gptq_v2 stores zero points as they are; bf16 scales.
    "gptq-v2": dict(scheme="gptq_v2", scale_dtype="bf16", zero_range=(1, 16)),
    # One group per column (group_size -1) with desc_act, as some Mixtral GPTQ releases are.
    "gptq-per-column": dict(scheme="gptq", layout="mixtral", group=-1),
    # AWQ GEMM, config.json.
    "awq": dict(scheme="awq"),
    # AWQ with AutoAWQ's quant_config.json, Mixtral names.
    "awq-mixtral-own-config": dict(scheme="awq", layout="mixtral", config="own"),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request: Any, tmp_path_factory: Any) -> tuple[Path, dict[str, Any]]:
    case = dict(CASES[request.param])
    if case.get("scale_dtype") == "bf16":
        import ml_dtypes

        case["scale_dtype"] = ml_dtypes.bfloat16
    path = Path(tmp_path_factory.mktemp(request.param))
    return _write_checkpoint(path, **case), case


# ---------------------------------------------------------------- layout and bytes


def test_layout_and_parts_equal_safetensors(checkpoint: tuple[Path, dict[str, Any]]) -> None:
    path, case = checkpoint
    layout = case.get("layout", "mlp_experts")
    model = scan_model(path)
    assert model.layout == layout and len(model.files) == 2
    ex = model.expert(1, 2)
    group = case.get("group", GROUP)
    assert (ex.scheme, ex.transposed, ex.fused, ex.group_size) == (case["scheme"], True, None,
                                                                   max(group, 0))
    assert ex.shape("gate") == (HIDDEN, INTER) and ex.shape("down") == (INTER, HIDDEN)
    assert ex.gate.name.endswith(f"experts.2.{ROLE_NAMES[layout]['gate']}.qweight")
    assert ex.block_shape("down") == (group if group > 0 else INTER, 1)
    has_g_idx = case["scheme"] != "awq" and case.get("g_idx", "act_order") is not None
    extras = ["gate_zero", "up_zero", "down_zero"] + (
        ["gate_g_idx", "up_g_idx", "down_g_idx"] if has_g_idx else [])
    assert [n for n, _ in ex.extras] == extras
    # Four bits per weight, plus scales, zero points (and g_idx): what the slot holds.
    scale_bytes = 2 * (2 * (HIDDEN // group) * INTER + (INTER // group) * HIDDEN) if group > 0 \
        else 2 * (2 * INTER + HIDDEN)
    zero_bytes = scale_bytes // 4
    assert ex.nbytes == 3 * HIDDEN * INTER // 2 + scale_bytes + zero_bytes \
        + (4 * (2 * HIDDEN + INTER) if has_g_idx else 0)
    checked = assert_lease_parts_equal_safetensors(path, prefetch_workers=1)
    assert checked == LAYERS * EXPERTS * (12 if has_g_idx else 9)


def test_two_ranges_per_expert(checkpoint: tuple[Path, dict[str, Any]]) -> None:
    """safetensors orders tensors by dtype, then name: an expert's int32
    parts (qweight, qzeros, g_idx) are one range and its scales another, in
    each shard it lies in; so two reads per shard."""
    path, _ = checkpoint
    model = scan_model(path)
    for layer, expert in model.keys():
        parts = sorted((t.file, t.offset, t.end) for t in model.expert(layer, expert).tensors())
        runs = 1 + sum(1 for a, b in zip(parts, parts[1:]) if a[0] != b[0] or b[1] != a[2])
        assert runs <= 2 * len({p[0] for p in parts}), (layer, expert, parts)


# ---------------------------------------------------------------- against the references


def _reference_weight(scheme: str, tensors: dict[str, np.ndarray], base: str,
                      auto_gptq: ModuleType, autoawq: ModuleType, group: int = GROUP) -> Any:
    """(in, out) float32 weight of one module, decoded by the ecosystem's code."""
    qweight = torch.from_numpy(tensors[base + "qweight"])
    qzeros = torch.from_numpy(tensors[base + "qzeros"])
    # float32 scales keep the references exact (theirs would round to the scales' dtype).
    scales = torch.from_numpy(tensors[base + "scales"].astype(np.float32))
    if scheme == "awq":
        return autoawq.dequantize_gemm(qweight, qzeros, scales, 4, GROUP)
    rows, cols = qweight.shape[0] * 8, qweight.shape[1]
    layer = auto_gptq.QuantLinear(4, group, rows, cols, bias=False, weight_dtype=torch.float32)
    if scheme == "gptq_v2":
        # AutoGPTQ reads the original format; gptq_v2 stores each zero point one higher.
        nibbles = (qzeros.numpy().view(np.uint32)[..., None] >> np.arange(0, 32, 4, dtype=np.uint32)) & 15
        qzeros = torch.from_numpy(_words(nibbles - 1))
    layer.qweight, layer.qzeros, layer.scales = qweight, qzeros, scales
    if base + "g_idx" in tensors:
        layer.g_idx = torch.from_numpy(tensors[base + "g_idx"])
    with torch.no_grad():  # x = I: the layer's output is its weight, (in, out)
        return layer(torch.eye(rows, dtype=torch.float32))


def test_dequantize_equals_references(checkpoint: tuple[Path, dict[str, Any]],
                                      auto_gptq: ModuleType, autoawq: ModuleType) -> None:
    from colibri.torch_interop import dequantize_torch

    path, case = checkpoint
    tensors = load_safetensors(path)
    model = scan_model(path)
    with colibri.open_store(path, slots_per_layer=2) as store:
        for layer, expert in [(0, 0), (1, 3), (1, 1)]:
            with store.lease(layer, expert) as ex:
                got = colibri.dequantize(ex)
                got_torch = dequantize_torch(ex)
            assert set(got) == {"gate", "up", "down"} == set(got_torch)
            for role in ("gate", "up", "down"):
                info = model.expert(layer, expert).weight(role)
                assert info is not None
                ref = _reference_weight(case["scheme"], tensors, info.name[: -len("qweight")],
                                        auto_gptq, autoawq, case.get("group", GROUP))
                # Theirs is (in, out); dequantize gives the Mixtral orientation (out, in).
                assert got[role].dtype == np.float32 and got[role].flags.c_contiguous
                np.testing.assert_array_equal(got[role], ref.numpy().T)
                assert got_torch[role].dtype == torch.float32
                np.testing.assert_array_equal(got_torch[role].numpy(), got[role])
    assert got["gate"].shape == (INTER, HIDDEN) and got["down"].shape == (HIDDEN, INTER)


def test_zero_point_sixteen_in_the_original_gptq_format(tmp_path: Path, auto_gptq: ModuleType,
                                                        autoawq: ModuleType) -> None:
    """A stored zero nibble of 15 is zero point 16 in the original format, as
    AutoGPTQ's grouped path reads it (15 + 1, not wrapped to 0)."""
    path = _write_checkpoint(tmp_path, "gptq", zero_range=(15, 16))
    tensors = load_safetensors(path)
    with colibri.open_store(path, slots_per_layer=1) as store:
        with store.lease(0, 0) as ex:
            got = colibri.dequantize(ex)
    base = "model.layers.0.mlp.experts.0.down_proj."
    ref = _reference_weight("gptq", tensors, base, auto_gptq, autoawq)
    np.testing.assert_array_equal(got["down"], ref.numpy().T)


def test_moe_block_equals_reference_modules(checkpoint: tuple[Path, dict[str, Any]],
                                            auto_gptq: ModuleType, autoawq: ModuleType) -> None:
    """colibri.moe over leased GPTQ/AWQ experts equals each expert computed
    with the references' own weights."""
    path, case = checkpoint
    tensors = load_safetensors(path)
    model = scan_model(path)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, HIDDEN)).astype(np.float32)
    idx = np.array([[0, 2], [1, 3], [2, 0], [3, 3], [1, 0], [2, 1]])
    weights = rng.uniform(0.2, 0.8, idx.shape).astype(np.float32)
    want = np.zeros_like(x, dtype=np.float64)
    for t in range(len(x)):
        for e, w in zip(idx[t], weights[t]):
            ex = model.expert(1, int(e))
            g, u, d = (_reference_weight(case["scheme"], tensors,
                                         ex.weight(r).name[: -len("qweight")],  # type: ignore[union-attr]
                                         auto_gptq, autoawq, case.get("group", GROUP)).double().numpy()
                       for r in ("gate", "up", "down"))
            a, b = x[t] @ g, x[t] @ u  # (in, out): x @ W
            want[t] += w * ((a / (1 + np.exp(-a)) * b) @ d)
    with colibri.open_store(path, slots_per_layer=2) as store:
        got = moe.experts_forward(store, 1, x, idx, weights)
        assert store.active_leases == 0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# ---------------------------------------------------------------- inspect


def test_inspect_shows_gptq_and_awq(checkpoint: tuple[Path, dict[str, Any]],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from colibri.__main__ import main

    path, case = checkpoint
    assert main(["inspect", str(path), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["layers"][0]
    group = case.get("group", GROUP)
    assert (row["format"], row["group_size"], row["orientation"]) == (
        case["scheme"], group if group > 0 else None, "in_out")
    assert row["bytes_per_expert"] == scan_model(path).expert_nbytes(0)
    assert row["parts"][:6] == ["gate", "up", "down", "gate_scale", "up_scale", "down_scale"]
    assert main(["inspect", str(path)]) == 0
    assert (f"{case['scheme']}/{group}" if group > 0 else case["scheme"]) in capsys.readouterr().out


# ---------------------------------------------------------------- hostile files


def _expect_format_error(path: Path, *needles: str) -> None:
    with pytest.raises(FormatError) as err:
        colibri.open_store(path)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


BASE = "model.layers.1.mlp.experts.2.up_proj."


def _drop(name: str) -> Callable[[dict[str, np.ndarray]], None]:
    def edit(t: dict[str, np.ndarray]) -> None:
        del t[name]
    return edit


def _set(name: str, value: Callable[[np.ndarray], np.ndarray]) -> Callable[[dict[str, np.ndarray]], None]:
    def edit(t: dict[str, np.ndarray]) -> None:
        t[name] = np.ascontiguousarray(value(t.get(name, np.zeros(1, np.int32))))
    return edit


@pytest.mark.parametrize("scheme,edit,needle", [
    ("gptq", _drop(BASE + "scales"), BASE + "scales"),
    ("gptq", _drop(BASE + "qzeros"), BASE + "qzeros"),
    ("awq", _drop(BASE + "scales"), BASE + "scales"),
    ("awq", _drop(BASE + "qzeros"), BASE + "qzeros"),
    # qweight no longer the size the scales and the other roles say
    ("gptq", _set(BASE + "qweight", lambda a: a[:-1]), "layer 1 expert 2"),
    ("gptq", _set(BASE + "qweight", lambda a: a[:, :-8]), BASE + "scales"),
    ("awq", _set(BASE + "qweight", lambda a: a[:, :-1]), BASE + "scales"),
    ("awq", _set(BASE + "qweight", lambda a: a.astype(np.int64)), BASE + "qweight"),
    ("gptq", _set(BASE + "scales", lambda a: a[:-1]), BASE + "scales"),
    ("gptq", _set(BASE + "scales", lambda a: a.astype(np.int32)), BASE + "scales"),
    ("awq", _set(BASE + "qzeros", lambda a: a[:, :-1]), BASE + "qzeros"),
    ("gptq", _set(BASE + "qzeros", lambda a: a.view(np.float32)), BASE + "qzeros"),
    ("gptq", _set(BASE + "g_idx", lambda a: a[:-8]), BASE + "g_idx"),
    ("gptq", _drop(BASE + "g_idx"), "only some roles have g_idx"),
    ("awq", _set(BASE + "g_idx", lambda a: np.zeros(HIDDEN, np.int32)), BASE + "g_idx"),
    ("gptq", _set(BASE + "bias", lambda a: np.zeros(INTER, np.float16)), BASE + "bias"),
    ("awq", _set(BASE + "weight", lambda a: np.zeros((INTER, HIDDEN), np.float16)), BASE + "weight"),
])
def test_hostile_tensors(tmp_path: Path, scheme: str, edit: Any, needle: str) -> None:
    _expect_format_error(_write_checkpoint(tmp_path, scheme, edit=edit), needle)


@pytest.mark.parametrize("scheme,change,needle", [
    ("gptq", {"bits": 8}, "bits 8"),
    ("gptq", {"bits": 3}, "bits 3"),
    ("gptq", {"checkpoint_format": "marlin"}, "'marlin'"),
    ("gptq", {"is_marlin_format": True}, "marlin"),
    ("gptq", {"group_size": 32}, "group_size 32"),
    ("gptq", {"group_size": -1}, "one group"),
    ("gptq", {"pack_dtype": "int16"}, "pack_dtype"),
    ("gptq", {"quant_method": "compressed-tensors"}, "quant_method"),
    ("awq", {"version": "gemv"}, "'gemv'"),
    ("awq", {"version": "exllama"}, "'exllama'"),
    ("awq", {"version": None, "format": "gemv_fast"}, "'gemv_fast'"),  # GPTQModel's name for it
    ("gptq", {"checkpoint_format": None, "format": "gptq_p"}, "'gptq_p'"),
    ("gptq", {"format": "gptq_v2"}, "disagree"),
    ("awq", {"zero_point": False}, "zero points"),
    ("awq", {"bits": 8}, "bits 8"),
    ("awq", {"quant_method": "gptq"}, "'gemm'"),
    ("awq", {"quant_method": "gptq", "version": None}, "scales"),  # AWQ words read as GPTQ do not fit
])
def test_hostile_configs(tmp_path: Path, scheme: str, change: dict[str, Any], needle: str) -> None:
    path = _write_checkpoint(tmp_path, scheme)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    _expect_format_error(path, needle, "model.layers.")


def test_out_of_range_g_idx_is_an_error_not_an_answer(tmp_path: Path) -> None:
    """g_idx values are read with the expert: one past the scales fails the
    dequantization, in numpy and in torch, instead of indexing past them."""
    from colibri.torch_interop import dequantize_torch

    path = _write_checkpoint(tmp_path, "gptq", edit=_set(BASE + "g_idx",
                                                         lambda a: np.full_like(a, HIDDEN // GROUP)))
    with colibri.open_store(path, slots_per_layer=1) as store:
        with store.lease(1, 2) as ex:
            with pytest.raises(FormatError, match="g_idx"):
                colibri.dequantize(ex)
            with pytest.raises(FormatError, match="g_idx"):
                dequantize_torch(ex)


@pytest.mark.parametrize("group", [2, 16])  # 2: groups shorter than the check's vectors
@pytest.mark.parametrize("bad_at,value", [(None, "groups"), (37, -1), (HIDDEN - 1, "groups")])
def test_a_g_idx_entry_naming_no_group_fails_the_kernel_call(tmp_path: Path, group: int,
                                                              bad_at: int | None, value: Any) -> None:
    """The kernels check g_idx with every call: an entry past the groups, or
    negative, anywhere in it fails the call and names the first one."""
    groups = HIDDEN // group
    bad = groups if value == "groups" else value

    def corrupt(a: np.ndarray) -> np.ndarray:
        a = a.copy()
        a[slice(None) if bad_at is None else bad_at] = bad
        return a

    path = _write_checkpoint(tmp_path, "gptq", g_idx="sorted", group=group,
                             edit=_set(BASE + "g_idx", corrupt))
    first = 0 if bad_at is None else bad_at
    with colibri.open_store(path, slots_per_layer=1) as store:
        with store.lease(1, 2) as ex:
            needle = rf"up: g_idx\[{first}\] = {bad}, but there are {groups} groups"
            with pytest.raises(colibri.ColibriError, match=needle):
                colibri.expert_ffn(ex, np.ones((1, HIDDEN), np.float32))
        with store.lease(1, 1) as fine:  # the same layer's other experts still compute
            assert np.isfinite(colibri.expert_ffn(fine, np.ones((1, HIDDEN), np.float32))).all()


def test_without_any_config_the_shapes_tell_gptq_from_awq(tmp_path: Path) -> None:
    (tmp_path / "gptq").mkdir()
    (tmp_path / "awq").mkdir()
    gptq = _write_checkpoint(tmp_path / "gptq", "gptq", config=None)
    awq = _write_checkpoint(tmp_path / "awq", "awq", config=None)
    assert scan_model(gptq).expert(0, 0).scheme == "gptq"
    ex = scan_model(awq).expert(0, 0)
    assert (ex.scheme, ex.group_size) == ("awq", GROUP)


def test_mixed_with_plain_or_pack_quantized_experts_is_refused(tmp_path: Path) -> None:
    def packed(t: dict[str, np.ndarray]) -> None:
        t["model.layers.0.mlp.experts.9.gate_proj.weight_packed"] = np.zeros((INTER, HIDDEN // 8), np.int32)
        t["model.layers.0.mlp.experts.9.gate_proj.weight_scale"] = np.zeros((INTER, 4), np.float32)
        t["model.layers.0.mlp.experts.9.gate_proj.weight_shape"] = np.array([INTER, HIDDEN], np.int64)

    _expect_format_error(_write_checkpoint(tmp_path, "gptq", edit=packed), "mixes")


def test_c_core_checks_the_packed_sizes(tmp_path: Path) -> None:
    """The C core's own check of the two formats: GPTQ words hold whole groups
    of eight input rows, AWQ words eight output columns, four bits each."""
    from colibri._ffi import ffi, lib

    path = tmp_path / "one.safetensors"
    save_file({"x": np.zeros(512, np.uint8)}, str(path))
    offset = 8 + int.from_bytes(path.read_bytes()[:8], "little")

    def create(fmt: int, rows: int, cols: int, nbytes: int) -> tuple[int, bytes]:
        src = ffi.new("ColiExpertSource *")
        for r, role in enumerate(("gate", "up", "down")):
            t = getattr(src, role)
            t.file, t.offset, t.nbytes, t.format = 0, offset + 64 * r, nbytes, fmt
            t.rows, t.columns = rows, cols
            # one F16 scale per column (a group of all the input rows), after the words
            t.scale_format, t.scale_file, t.scale_offset = lib.COLI_SCALE_F16, 0, offset + 256 + 64 * r
            t.scale_nbytes, t.block_rows, t.block_columns = 2 * cols, rows, 1
        cfg = ffi.new("ColiStoreConfig *")
        name = ffi.new("char[]", str(path).encode())
        files = ffi.new("const char *[]", [name])
        cfg.files, cfg.n_files, cfg.experts, cfg.n_experts = files, 1, src, 1
        cfg.slots_per_layer = 1
        out = ffi.new("ColiExpertStore **")
        err = ffi.new("char[]", 256)
        rc = lib.coli_store_create(cfg, out, err, 256)
        if rc == 0:
            out[0].ops.destroy(out[0])
        return rc, ffi.string(err)

    gptq, awq = lib.COLI_TENSOR_INT4_GPTQ, lib.COLI_TENSOR_INT4_AWQ
    assert create(gptq, 16, 8, 64) == (0, b"") and create(awq, 4, 16, 32) == (0, b"")
    rc, err = create(gptq, 12, 8, 48)  # 12 input rows: a word and a half
    assert rc == lib.COLI_ECONFIG and b"not whole words" in err
    assert b"not whole words" in create(awq, 4, 12, 24)[1]
    assert b"do not match" in create(gptq, 16, 8, 60)[1]
