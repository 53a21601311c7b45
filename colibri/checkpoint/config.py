"""The one reader of a checkpoint's JSON settings: ``config.json`` and the
quantization settings beside it (``quantization_config`` in config.json,
AutoGPTQ's ``quantize_config.json``, AutoAWQ's ``quant_config.json``).

What the store's scanner and :mod:`colibri.hf` both need to know comes from
here, so the two cannot disagree; in particular which compressed-tensors
config group quantizes the routed experts (:func:`experts_group`, the rule
transformers applies).

Lenient readers (:func:`load_config`, :func:`model_type`,
:func:`compressed_tensors_weights`) return None or ``{}`` for a file that is
missing or is not JSON: a checkpoint without settings is read from its
tensors alone. :func:`read_json` with an ``error`` class and
:func:`module_quant_config` raise instead.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from colibri.errors import FormatError
from colibri.formats.qmodule import AWQ, GPTQ, GPTQ_V2
from colibri.formats.record import Declared

__all__ = [
    "CONFIG_NAME",
    "GPTQ_CONFIG_NAME",
    "AWQ_CONFIG_NAME",
    "read_json",
    "folder_of",
    "load_config",
    "model_type",
    "ExpertsGroup",
    "experts_group",
    "compressed_tensors_group",
    "compressed_tensors_weights",
        "module_quant_config",
]

CONFIG_NAME = "config.json"
GPTQ_CONFIG_NAME = "quantize_config.json"  # AutoGPTQ
AWQ_CONFIG_NAME = "quant_config.json"      # AutoAWQ


def read_json(path: str, error: type[FormatError] | None = None) -> Any:
    """The JSON value in ``path``. A missing or unreadable file, or one that
    is not JSON, gives None, or with ``error`` raises that class with a
    message naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        if error is None:
            return None
        raise error(f"{path}: cannot read it as JSON ({exc})") from None


def folder_of(files: Sequence[str]) -> str | None:
    """The folder of a model's first file (where its settings lie), or None."""
    return os.path.dirname(files[0]) if files else None


def load_config(folder: str | None, name: str = CONFIG_NAME) -> dict[str, Any] | None:
    """The JSON object ``name`` in ``folder``; None if there is none."""
    if folder is None:
        return None
    found = read_json(os.path.join(folder, name))
    return found if isinstance(found, dict) else None


def model_type(files: Sequence[str]) -> str | None:
    """``model_type`` of the config.json beside the first file, if any."""
    config = load_config(folder_of(files))
    found = config.get("model_type") if config is not None else None
    return found if isinstance(found, str) else None


def _quantization_config(files: Sequence[str]) -> dict[str, Any] | None:
    config = load_config(folder_of(files))
    found = config.get("quantization_config") if config is not None else None
    return found if isinstance(found, dict) else None


@dataclass(frozen=True)
class ExpertsGroup:
    """The compressed-tensors config group that quantizes the routed experts."""

    name: str
    group: Mapping[str, Any]
    format: Any     # the group's ``format``, else the config's
    weights: Any    # the group's ``weights`` entry (a dict when it quantizes weights)


def experts_group(groups: Mapping[str, Mapping[str, Any]]) -> tuple[str, Mapping[str, Any]]:
    """The config group that quantizes the routed experts: the one whose
    ``re:`` targets name the experts, else the first with a class-name
    target (``Linear``), else the first (the rule transformers applies).
    ``groups`` is a non-empty ``config_groups``."""
    named = list(groups.items())
    for name, group in named:
        targets = group.get("targets") or []
        if any(isinstance(t, str) and t.startswith("re:") and "experts" in t for t in targets):
            return name, group
    for name, group in named:
        targets = group.get("targets") or []
        if any(isinstance(t, str) and not t.startswith("re:") for t in targets):
            return name, group
    return named[0]


def compressed_tensors_group(quant: Mapping[str, Any]) -> ExpertsGroup | None:
    """The experts' group of a compressed-tensors ``quantization_config``;
    None when it has no usable ``config_groups``."""
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        return None
    name, group = experts_group(groups)
    return ExpertsGroup(name, group, group.get("format") or quant.get("format"), group.get("weights"))


def compressed_tensors_weights(files: Sequence[str]) -> dict[str, Any]:
    """The ``weights`` entry of the experts' config group of the
    compressed-tensors config.json beside the files ({} when there is none)."""
    quant = _quantization_config(files)
    found = compressed_tensors_group(quant) if quant is not None else None
    weights = found.weights if found is not None else None
    return weights if isinstance(weights, dict) else {}


def _module_settings(folder: str | None) -> tuple[dict[str, Any], str, str]:
    """(settings, file name, implied quant_method) of a GPTQ/AWQ checkpoint:
    config.json's ``quantization_config``, else ``quantize_config.json``
    (GPTQ), else ``quant_config.json`` (AWQ); ``({}, "", "")`` if none."""
    config = load_config(folder)
    found = config.get("quantization_config") if config is not None else None
    if isinstance(found, dict):
        return found, CONFIG_NAME, ""
    for name, implied in ((GPTQ_CONFIG_NAME, "gptq"), (AWQ_CONFIG_NAME, "awq")):
        settings = load_config(folder, name)
        if settings is not None:
            return settings, name, implied
    return {}, "", ""


def _group_size(where: str, cfg: Mapping[str, Any]) -> int | None:
    group = cfg.get("group_size", cfg.get("q_group_size"))
    if group is not None and (not isinstance(group, int) or isinstance(group, bool)
                              or not (group == -1 or group > 0)):
        raise FormatError(f"{where}: group_size {group!r} is neither -1 nor a positive size")
    return None if group is None else max(group, 0)


def _packing(where: str, method: str, cfg: Mapping[str, Any]) -> Any:
    """The packing: GPTQModel reads checkpoint_format, format and version as one field."""
    given = {key: cfg[key] for key in ("checkpoint_format", "format", "version")
             if cfg.get(key) is not None}
    packings = {v.lower() if isinstance(v, str) else v for v in given.values()}
    if len(packings) > 1:
        raise FormatError(f"{where}: " + ", ".join(f"{k} {v!r}" for k, v in given.items())
                          + " disagree about the packing")
    return packings.pop() if packings else ("gptq" if method == "gptq" else "gemm")


def _gptq_scheme(where: str, fmt: Any, cfg: Mapping[str, Any]) -> str:
    if fmt not in (GPTQ, GPTQ_V2) or cfg.get("is_marlin_format"):
        raise FormatError(f"{where}: GPTQ checkpoint format "
                          f"{'marlin' if cfg.get('is_marlin_format') else fmt!r}; only the "
                          "'gptq' and 'gptq_v2' packings are supported")
    pack = cfg.get("pack_dtype")
    if pack not in (None, "int32", "torch.int32"):
        raise FormatError(f"{where}: pack_dtype {pack!r}; only int32 words are supported")
    if cfg.get("dynamic"):
        raise FormatError(f"{where}: per-module overrides ('dynamic') are not supported")
    return str(fmt)


def _awq_scheme(where: str, fmt: Any, cfg: Mapping[str, Any]) -> str:
    if fmt != "gemm":
        raise FormatError(f"{where}: AWQ version {fmt!r}; only the GEMM packing is supported")
    if cfg.get("zero_point", True) is not True:
        raise FormatError(f"{where}: AWQ without zero points is not supported")
    return AWQ


def module_quant_config(files: Sequence[str], first_name: str) -> Declared:
    """The GPTQ/AWQ settings beside the files (``first_name``, a qweight, is
    named in errors): the scheme (``"gptq"``, ``"gptq_v2"``, ``"awq"``; None
    without settings: the shapes tell), the group size (0: one group over the
    input; None: from the scales) and the file they came from. Refuses what colibri cannot read exactly: other bit
    widths, packings and formats."""
    cfg, source, default = _module_settings(folder_of(files))
    if not source:
        return Declared(None, 4, None, "no quantization config")
    where = f"{first_name!r} ({source})"
    found_method = cfg.get("quant_method", default)
    method = found_method.lower() if isinstance(found_method, str) else found_method
    if method not in ("gptq", "awq"):
        raise FormatError(f"{where}: quant_method {method!r}, but the experts are GPTQ/AWQ "
                          "modules (qweight, qzeros, scales)")
    bits = cfg.get("bits", cfg.get("w_bit", 4))
    if bits != 4:
        raise FormatError(f"{where}: bits {bits!r}; only 4-bit GPTQ and AWQ are supported")
    group_size = _group_size(where, cfg)
    fmt = _packing(where, method, cfg)
    scheme = _gptq_scheme(where, fmt, cfg) if method == "gptq" else _awq_scheme(where, fmt, cfg)
    return Declared(scheme, 4, group_size, source)
