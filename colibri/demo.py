"""The built-in demo: a synthetic MoE streamed through a small cache."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass

import numpy as np

from colibri.moe import moe_layer, route
from colibri.pilot import Pilot
from colibri.stats import StoreStats
from colibri.store import open_store
from colibri.synthetic import write_synthetic_model


@dataclass(frozen=True)
class DemoConfig:
    tokens: int = 24
    layers: int = 6
    experts: int = 16
    top_k: int = 2
    slots: int = 4
    hidden: int = 256
    intermediate: int = 512
    dtype: str = "bfloat16"
    prefetch_workers: int = 2
    lookahead: bool = True


def run_demo(cfg: DemoConfig) -> StoreStats:
    """Write the model to a temporary directory, decode cfg.tokens tokens one
    at a time through every MoE layer, and return the store's counters."""
    with tempfile.TemporaryDirectory(prefix="colibri-demo-") as tmp:
        model = write_synthetic_model(
            tmp, layout="mixtral", n_layers=cfg.layers, n_experts=cfg.experts,
            hidden=cfg.hidden, intermediate=cfg.intermediate, dtype=cfg.dtype,
        )
        routers = model.routers()
        total = sum(f.stat().st_size for f in model.files)
        print(f"model: {cfg.layers} MoE layers x {cfg.experts} experts, "
              f"{model.expert_nbytes / 2**20:.2f} MiB per expert, {total / 2**20:.1f} MiB on disk")
        rng = np.random.default_rng(0)
        with open_store(tmp, slots_per_layer=cfg.slots, prefetch_workers=cfg.prefetch_workers) as store:
            cap = store.stats().capacity_bytes
            print(f"cache: {cfg.slots} slots per layer = {cap / 2**20:.1f} MiB, "
                  f"{cfg.prefetch_workers} prefetch workers, lookahead {'on' if cfg.lookahead else 'off'}")
            pilot = Pilot(store, routers, top_k=cfg.top_k, enabled=cfg.lookahead)
            start = time.perf_counter()
            for _ in range(cfg.tokens):
                x = rng.standard_normal((1, cfg.hidden)).astype(np.float32)
                for layer in store.layers:
                    pilot.predict_next(layer, x)   # prefetch the next layer's likely experts
                    experts, _ = route(routers[layer], x, cfg.top_k)
                    pilot.observe(layer, experts.ravel().tolist())
                    y = moe_layer(store, layer, routers[layer], x, cfg.top_k)
                    x = x + y
                    x = x / np.sqrt((x * x).mean() + 1e-6)
            elapsed = time.perf_counter() - start
            stats = store.stats()
        print(f"decoded {cfg.tokens} tokens in {elapsed:.2f} s ({elapsed / cfg.tokens * 1e3:.1f} ms/token)")
        if cfg.lookahead:
            report = pilot.report()
            print(f"lookahead: precision {report.precision:.1%}, recall {report.recall:.1%} "
                  f"over {report.predictions} predictions")
        return stats


def format_stats(stats: StoreStats) -> str:
    rows = [(k, v) for k, v in stats.as_dict().items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(
        f"  {k:<{width}}  {v:.3f}" if isinstance(v, float) else f"  {k:<{width}}  {v:,}" for k, v in rows
    )
