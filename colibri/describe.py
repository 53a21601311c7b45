"""What `colibri inspect` reports about a checkpoint, as plain data.

:func:`describe` gathers the routed experts' layers, counts, sizes,
dtypes and format (plain, fp8_block, mxfp4, int4, gptq, gptq_v2, awq with its group size;
fused gate_up and (in, out) orientation), the router's top-k when the model's ``config.json`` gives it, and,
for a budget (slots per layer or bytes of RAM), the cache the store would
build for it. :func:`render` turns that into the table and summary line the
command prints; ``colibri inspect --json`` prints the data itself.

The cache figures come from the store itself: a store is created for the
budget (its slot memory is reserved, never touched, and it reads nothing)
and asked for its slots per layer and ``capacity_bytes``, so they include
the alignment of each slot and the cap at a layer's expert count.
"""

from __future__ import annotations

import os
from typing import Any

from colibri.checkpoint.config import CONFIG_NAME, read_json
from colibri.errors import FormatError
from colibri.checkpoint.experts import ModelExperts, format_ranges

__all__ = ["describe", "render", "read_top_k", "TOP_K_KEYS"]

# config.json keys that give the number of experts a token is routed to, as
# transformers names them (Mixtral, Qwen-MoE, OLMoE, DeepSeek, GLM, Llama 4
# and gpt-oss use the first; gpt-oss's original config the second).
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_top_k", "top_k")


def _config_path(source: Any) -> str | None:
    """The config.json beside a model directory or single file, if any."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        candidate = os.path.join(folder, CONFIG_NAME)
        if os.path.isfile(candidate):
            return candidate
    return None


def read_top_k(source: Any) -> int | None:
    """The top-k that the model's config.json states, else None (also when
    there is no config.json beside the model).

    Looks at the top level, then at ``text_config`` (multimodal models such
    as Llama 4 keep the language model's settings there). An unreadable or
    malformed config.json is a FormatError naming it.
    """
    path = _config_path(source)
    if path is None:
        return None
    config = read_json(path, FormatError)
    for section in (config, config.get("text_config") if isinstance(config, dict) else None):
        if not isinstance(section, dict):
            continue
        for key in TOP_K_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _cache(model: ModelExperts, slots: int | None, ram_bytes: int | None) -> dict[str, Any]:
    from colibri.store import Store, StoreOptions  # the store needs the compiled core; describing does not

    store = Store(model, StoreOptions(slots_per_layer=slots, capacity_bytes=ram_bytes, prefetch_workers=0,
                                      direct_io=False, slot_wait_timeout=0.0))
    try:
        per_layer = {layer: store.slots(layer) for layer in model.layers}
        capacity = store.stats().capacity_bytes
    finally:
        store.close()
    return {
        "slots_per_layer": slots,
        "ram_bytes": ram_bytes,
        "layer_slots": {str(layer): n for layer, n in per_layer.items()},
        "capacity_bytes": capacity,
        "resident_fraction": sum(per_layer.values()) / sum(model.num_experts(l) for l in model.layers),
    }


def describe(model: ModelExperts, source: Any = None, *, slots: int | None = None,
             ram_bytes: int | None = None) -> dict[str, Any]:
    """A checkpoint's routed experts as JSON-ready data.

    ``source`` is what the model was scanned from (for its config.json).
    Give ``slots`` (per layer) or ``ram_bytes`` (a budget split evenly
    across layers, as ``open_store(capacity_bytes=...)`` does) to include
    the cache that budget gives; FormatError if it cannot hold one slot per
    layer.
    """
    if slots is not None and ram_bytes is not None:
        raise FormatError("give --slots or --ram-gb, not both")
    layers: list[dict[str, Any]] = []
    for layer in model.layers:
        ex = model.expert(layer, next(iter(model.experts[layer])))
        layers.append({
            "layer": layer,
            "experts": model.num_experts(layer),
            "bytes_per_expert": model.expert_nbytes(layer),
            "dtypes": sorted({t.dtype for t in ex.tensors()}),
            "format": ex.scheme,
            "group_size": ex.group_size or None,
            "fused": ex.fused,
            "orientation": "in_out" if ex.transposed else "out_in",
            "parts": [name for name in ex.part_names() if name is not None],
        })
    counts = [model.num_experts(layer) for layer in model.layers]
    summary = {
        "moe_layers": len(layers),
        "layer_ranges": format_ranges(model.layers),
        "first_layer": model.layers[0] if layers else None,
        "last_layer": model.layers[-1] if layers else None,
        "experts_per_layer": {"min": min(counts, default=0), "max": max(counts, default=0)},
        "config_json": _config_path(source),
        "top_k": read_top_k(source),
        "routed_expert_bytes": sum(model.num_experts(l) * model.expert_nbytes(l) for l in model.layers),
    }
    out: dict[str, Any] = {
        "layout": model.layout,
        "files": list(model.files),
        "layers": layers,
        "summary": summary,
        "cache": None,
    }
    if slots is not None or ram_bytes is not None:
        out["cache"] = _cache(model, slots, ram_bytes)
    return out


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _span(low: int, high: int) -> str:
    return str(low) if low == high else f"{low}-{high}"


def render(data: dict[str, Any]) -> str:
    """The table of `colibri inspect` and its summary line."""
    lines = [f"layout: {data['layout']}", f"files: {len(data['files'])}",
             f"{'layer':>6} {'experts':>8} {'bytes/expert':>14}  {'format':<10} {'fused':<21}  dtypes"]
    for row in data["layers"]:
        fmt = row["format"] + (f"/{row['group_size']}" if row.get("group_size") else "")
        fused = (row["fused"] or "-") + (" (in,out)" if row["orientation"] == "in_out" else "")
        lines.append(f"{row['layer']:>6} {row['experts']:>8} {row['bytes_per_expert']:>14,}  "
                     f"{fmt:<10} {fused:<21}  {','.join(row['dtypes'])}")
    s = data["summary"]
    per_layer = s["experts_per_layer"]
    parts = [
        f"{s['moe_layers']} MoE layers ({s['layer_ranges']})",
        f"{_span(per_layer['min'], per_layer['max'])} experts per layer",
        (f"top-k {s['top_k']} (config.json)" if s["top_k"] is not None
         else "top-k not in config.json" if s["config_json"] else "top-k unknown (no config.json)"),
        f"routed-expert bytes: {s['routed_expert_bytes']:,} ({_size(s['routed_expert_bytes'])})",
    ]
    cache = data["cache"]
    if cache is not None:
        budget = (f"--slots {cache['slots_per_layer']}" if cache["slots_per_layer"] is not None
                  else f"--ram-gb {cache['ram_bytes'] / 2**30:.4g}")
        slot_counts = list(cache["layer_slots"].values())
        parts.append(
            f"{budget}: {_span(min(slot_counts), max(slot_counts))} slots per layer, "
            f"{cache['resident_fraction']:.1%} of the experts resident, "
            f"{cache['capacity_bytes']:,} bytes ({_size(cache['capacity_bytes'])}) of cache")
    lines.append("summary: " + "; ".join(parts))
    return "\n".join(lines)
