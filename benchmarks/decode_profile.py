"""Where a decode step of a colibri.hf model goes, on 1 thread and on more.

Times, inside real decode steps in RAM, the calls into colibri's kernels
(the routed experts, the linear layers, the routers' logits), the
attention function, the key/value cache's appends, and the forwards of the
decoder layer, its attention and its MoE block; what is left is Python and
torch's small ops. Steps alternate between the thread counts in one process,
so that the machine's drift falls on both. The model is any checkpoint
colibri.hf loads, e.g. the 4-bit one ``benchmarks/generate.py --models DIR``
keeps in ``DIR/4bit/hf``. The model runs with its modules' forwards
(``decode_layers=False``): the lean decoder-layer forward calls the
kernels itself, past the functions this profile times.

    python benchmarks/decode_profile.py --model DIR --threads 1,2
"""

from __future__ import annotations

import argparse
import statistics
import time
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import timed_into  # noqa: E402

REST = "the rest (Python, torch's small ops)"
PARTS = ("step", "layers", "attention", "attention function", "kv cache appends", "moe block", "experts kernel",
         "linear kernels", "router kernels")


def _instrument(model: Any, acc: dict[str, float]) -> None:
    """Wraps the functions and class forwards the parts are timed by."""
    import transformers.cache_utils as cache_utils
    from transformers import AttentionInterface

    import colibri.hf.attention as attention
    import colibri.hf.kv_cache as kv_cache
    import colibri.hf.linears as linears
    import colibri.hf.routers as routers
    import colibri.hf.runtime as runtime

    runtime.moe_ffn = timed_into(acc, "experts kernel", runtime.moe_ffn)  # type: ignore[assignment]
    linears.linear = timed_into(acc, "linear kernels", linears.linear)  # type: ignore[assignment]
    routers.linear = timed_into(acc, "router kernels", routers.linear)  # type: ignore[assignment]
    AttentionInterface.register(attention.DECODE_SDPA, timed_into(acc, "attention function", attention.decode_sdpa))
    for cls in {cache_utils.DynamicLayer, kv_cache.growing_layer_class()}:
        cls.update = timed_into(acc, "kv cache appends", vars(cls)["update"])
    layer = model.model.layers[0]
    for key, cls in (("layers", type(layer)), ("attention", type(layer.self_attn)), ("moe block", type(layer.mlp))):
        cls.forward = timed_into(acc, key, cls.forward)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a checkpoint directory colibri.hf loads")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--steps", type=int, default=300, help="decode steps, shared by the thread counts")
    ap.add_argument("--prompt-len", type=int, default=256)
    args = ap.parse_args(argv)
    counts = [int(t) for t in args.threads.split(",")]

    import torch
    import transformers

    import colibri.hf

    config = transformers.AutoConfig.from_pretrained(args.model)
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    model = colibri.hf.from_pretrained(args.model, torch_dtype=torch.bfloat16, slots_per_layer=experts,
                                       prefetch=None, decode_layers=False,
                                       warm=[(layer, e) for layer in range(config.num_hidden_layers)
                                             for e in range(experts)])
    model.eval()
    acc: dict[str, float] = {}
    _instrument(model, acc)
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    rows: dict[int, list[dict[str, float]]] = {t: [] for t in counts}
    with torch.no_grad():
        out: Any = model(prompt, use_cache=True, logits_to_keep=1)
        for step in range(args.steps):
            threads = counts[step % len(counts)]
            torch.set_num_threads(threads)
            token = out.logits[:, -1:].argmax(-1)
            acc.clear()
            t0 = time.perf_counter()
            out = model(token, past_key_values=out.past_key_values, use_cache=True)
            acc["step"] = time.perf_counter() - t0
            rows[threads].append(dict(acc))
            if step % 64 == 63:       # back to the prompt's length: every step sees 256-320 tokens
                out.past_key_values.crop(-64)
    model.colibri_close()
    med = {t: {p: 1e3 * statistics.median(r.get(p, 0.0) for r in rows[t]) for p in PARTS} for t in counts}
    for t in counts:
        m = med[t]
        kernels = m["experts kernel"] + m["linear kernels"] + m["router kernels"]
        m["kernels"] = kernels
        m[REST] = m["step"] - kernels
    print(f"{args.model}: {args.steps} decode steps after a {args.prompt_len}-token prompt, medians in ms")
    print(f"{'part':40s}" + "".join(f"{str(t) + ' thread(s)':>14s}" for t in counts))
    for p in (*PARTS, "kernels", REST):
        print(f"{p:40s}" + "".join(f"{med[t][p]:14.2f}" for t in counts))
    base = counts[0]
    for t in counts[1:]:
        print(f"step time {t} / {base} thread(s): {med[t]['step'] / med[base]['step']:.3f}; the rest is "
              f"{100 * med[t][REST] / med[t]['step']:.0f}% of a step on {t}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
