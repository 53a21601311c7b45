"""``/metrics``: the store's counters and the server's own, in Prometheus' text format."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from colibri.stats import StoreStats

__all__ = ["render"]

#: Store counters that go up and down (the rest only grow).
_STORE_GAUGES = frozenset({"resident_bytes", "capacity_bytes", "peak_inflight"})
_OUTCOMES = ("stop", "length", "cancelled", "error")


def _value(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "NaN"
    return repr(float(v)) if isinstance(v, float) else str(int(v))


def render(engine: Any) -> str:
    """The exposition of ``engine`` (a :class:`colibri.serve.engine.Engine`) and its store."""
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, value: float | None,
               samples: list[tuple[str, float]] | None = None) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for labels, v in samples if samples is not None else [("", value)]:
            out.append(f"{name}{labels} {_value(v)}")

    store = engine.store
    stats = None if store.closed else store.stats()
    for f in fields(StoreStats):
        gauge = f.name in _STORE_GAUGES
        name = f"colibri_store_{f.name}" + ("" if gauge else "_total")
        metric(name, "gauge" if gauge else "counter", f"the store's {f.name} counter",
               None if stats is None else getattr(stats, f.name))
    metric("colibri_store_hit_rate", "gauge", "store hits / requests", None if stats is None else stats.hit_rate)
    metric("colibri_store_active_leases", "gauge", "expert leases held now",
           None if store.closed else store.active_leases)
    metric("colibri_store_info", "gauge", "the store's eviction policy, as a label", None,
           [(f'{{policy="{store.policy}"}}', 1)])
    e = engine.stats()
    metric("colibri_prefetch_precision", "gauge",
           "share of the experts PILOT prefetched that the next layer used (NaN: prefetch off)",
           e.pilot_precision)
    metric("colibri_prefetch_recall", "gauge",
           "share of the experts a layer used that PILOT had predicted (NaN: prefetch off)", e.pilot_recall)
    metric("colibri_serve_tokens_per_second", "gauge", "tokens generated per second over the last 10 s",
           e.tokens_per_s)
    metric("colibri_serve_queue_depth", "gauge", "requests waiting to join the batch", e.waiting)
    metric("colibri_serve_batch_size", "gauge", "sequences in the running batch", e.running)
    metric("colibri_serve_max_batch", "gauge", "the most sequences that decode together", e.max_batch)
    metric("colibri_serve_generated_tokens_total", "counter", "tokens generated", e.generated_tokens)
    metric("colibri_serve_prompt_tokens_total", "counter", "prompt tokens prefilled", e.prompt_tokens)
    metric("colibri_serve_decode_steps_total", "counter", "decode steps (one token for each running sequence)",
           e.steps)
    metric("colibri_serve_decode_rows_total", "counter",
           "sequences summed over decode steps (over steps: the mean batch size)", e.step_rows)
    metric("colibri_serve_prefills_total", "counter", "prefill forwards (prompts that joined together)",
           e.prefills)
    metric("colibri_serve_requests_total", "counter", "requests ended, by outcome", None,
           [(f'{{outcome="{k}"}}', e.finished.get(k, 0)) for k in _OUTCOMES])
    return "\n".join(out) + "\n"
