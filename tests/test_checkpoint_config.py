"""The one reader of a checkpoint's settings (colibri.checkpoint.config):
which compressed-tensors config group quantizes the routed experts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from colibri.checkpoint.config import (
    compressed_tensors_group,
    compressed_tensors_weights,
    experts_group,
    model_type,
    read_json,
)
from colibri.errors import FormatError

ATTENTION = {"targets": ["re:.*self_attn.*"], "weights": {"num_bits": 8, "group_size": 32}}
EXPERTS = {"targets": ["re:.*mlp\\.experts\\..*"], "weights": {"num_bits": 4, "group_size": 16}}
LINEAR = {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 64}}


@pytest.mark.parametrize("groups, chosen", [
    ({"a": ATTENTION, "b": EXPERTS}, "b"),          # the group naming the experts, wherever it is
    ({"a": EXPERTS, "b": LINEAR}, "a"),
    ({"a": ATTENTION, "b": LINEAR}, "b"),           # else the first with a class-name target
    ({"a": ATTENTION, "b": dict(ATTENTION)}, "a"),  # else the first
])
def test_experts_group_is_the_one_targeting_the_experts(groups: dict[str, Any], chosen: str) -> None:
    assert experts_group(groups) == (chosen, groups[chosen])


def _model(tmp_path: Path, config: Any) -> tuple[str, ...]:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return (str(tmp_path / "model.safetensors"),)


def test_compressed_tensors_weights_are_the_experts_groups(tmp_path: Path) -> None:
    files = _model(tmp_path, {"model_type": "qwen3_moe", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": ATTENTION, "group_1": EXPERTS}}})
    assert compressed_tensors_weights(files) == EXPERTS["weights"]
    assert model_type(files) == "qwen3_moe"
    found = compressed_tensors_group(json.loads((tmp_path / "config.json").read_text())["quantization_config"])
    assert found is not None and (found.name, found.format) == ("group_1", "pack-quantized")


@pytest.mark.parametrize("config", [None, {}, {"quantization_config": {"config_groups": {}}},
                                    {"quantization_config": {"config_groups": ["x"]}}, "not an object"])
def test_missing_settings_read_as_none(tmp_path: Path, config: Any) -> None:
    files = _model(tmp_path, config) if config is not None else (str(tmp_path / "m.safetensors"),)
    assert compressed_tensors_weights(files) == {}
    assert model_type(files) is None
    assert compressed_tensors_weights(()) == {} and model_type(()) is None


def test_read_json_names_the_file_when_asked(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert read_json(str(bad)) is None
    with pytest.raises(FormatError, match="config.json: cannot read it as JSON"):
        read_json(str(bad), FormatError)
