"""Decode steps of a colibri.hf model in RAM with one of its native decode
forwards switched on and off at every other step, in one process.

The machine's speed drifts by tens of percent within minutes; steps that
alternate share that drift, so the ratio of the two medians shows what the
switch changes. ``--switch routers`` toggles the native softmax top-k
routers (``decode_routers``), ``norms`` the native RMS norms
(``decode_norms``), ``rotary`` the native rotary embedding
(``decode_rotary``), ``attention`` the native one-query attention
(``attend_one_query``; off, the same steps use torch's SDPA with grouped
heads), ``kv_cache`` the key/value cache that appends in place
(``grow_kv_cache``: two caches of the same prompt, one plain, used at
alternate steps), ``layers`` the lean decode forward of the decoder
layers (``decode_layers``; fed random tokens, as below), ``one_token`` a
lean layer's experts computed with calls built once per layer
(``Runtime.one_token_experts``; off, by the experts module; random tokens).
Two switches are
about streaming, with random tokens: ``hits_first`` (a cache of a quarter
of the experts, PILOT, O_DIRECT) toggles computing a layer's resident
experts while the workers read the others, and ``pilot`` (in RAM) PILOT
itself, whose predictions are then all resident: what predicting costs.
The model is any checkpoint colibri.hf loads, e.g. the 4-bit one
``benchmarks/generate.py --models DIR`` keeps in ``DIR/4bit/hf``.

    python benchmarks/decode_switch.py --model DIR --switch routers --threads 1
    python benchmarks/decode_switch.py --model DIR --switch rotary --threads 2
    python benchmarks/decode_switch.py --model DIR --switch attention --threads 2 --prompt-len 2048
    python benchmarks/decode_switch.py --model DIR --switch kv_cache --prompt-len 2048
    python benchmarks/decode_switch.py --model DIR --switch layers --threads 2 --steps 300
    python benchmarks/decode_switch.py --model DIR --switch one_token --threads 2 --steps 300
    python benchmarks/decode_switch.py --model DIR --switch hits_first --threads 2 --steps 300
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

SWITCHES = {"routers": "colibri_router_form", "norms": "colibri_rms_form", "rotary": "__colibri_replaces__",
            "attention": "_native_fits", "kv_cache": "", "hits_first": "", "pilot": "", "layers": "colibri_qk_norm",
            "one_token": ""}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a checkpoint directory colibri.hf loads")
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="routers")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=400, help="decode steps, half of them with the switch on")
    ap.add_argument("--prompt-len", type=int, default=256)
    args = ap.parse_args(argv)

    import torch
    import transformers

    import colibri.hf

    torch.set_num_threads(args.threads)
    config = transformers.AutoConfig.from_pretrained(args.model)
    experts, layers = config.num_experts if hasattr(config, "num_experts") else config.num_local_experts, \
        config.num_hidden_layers
    if args.switch in ("hits_first", "pilot"):
        return _streamed(args, config, experts, layers)
    model = colibri.hf.from_pretrained(args.model, torch_dtype=torch.bfloat16, slots_per_layer=experts,
                                       prefetch=None, warm=[(layer, e) for layer in range(layers)
                                                            for e in range(experts)])
    model.eval()
    marker = SWITCHES[args.switch]
    if args.switch == "kv_cache":
        return _kv_cache(args, model, config)
    if args.switch == "one_token":
        return _one_token(args, model, config)
    if args.switch == "attention":   # the test that sends a decode step to the native attention
        switched = [(sys.modules["colibri.hf.attention"], getattr(sys.modules["colibri.hf.attention"], marker))]
    elif args.switch == "rotary":      # a function of each modeling module, not a module's forward
        names = {type(m).__module__ for m in model.modules()}
        switched = [(sys.modules[n], getattr(sys.modules[n], "apply_rotary_pos_emb")) for n in sorted(names)
                    if hasattr(getattr(sys.modules[n], "apply_rotary_pos_emb", None), marker)]
    else:
        switched = [(m, vars(m)["forward"]) for m in model.modules() if hasattr(m, marker) and "forward" in vars(m)]
    if not switched:
        raise SystemExit(f"{args.model}: no module has a native {args.switch} forward to switch")

    def switch(on: bool) -> None:
        for module, native in switched:
            if args.switch == "rotary":
                module.apply_rotary_pos_emb = native if on else getattr(native, marker)
            elif args.switch == "attention":
                module._native_fits = native if on else _never
            elif on:
                module.forward = native
            else:
                del module.forward

    times = _alternate(args, model, config, switch, random_tokens=args.switch == "layers")
    model.colibri_close()
    _report(args, f"{len(switched)} modules", times)
    return 0


def _one_token(args: argparse.Namespace, model: Any, config: Any) -> int:
    """``one_token``: a lean layer's experts by the runtime's one-token path
    (calls built once per layer) or, off, by the experts module."""
    import colibri.hf

    runtime = colibri.hf.runtime_of(model)

    def switch(on: bool) -> None:
        if on:
            vars(runtime).pop("one_token_experts", None)
        else:
            runtime.one_token_experts = lambda *args: None     # type: ignore[method-assign]

    times = _alternate(args, model, config, switch, random_tokens=True)
    model.colibri_close()
    _report(args, f"{len(runtime.moe_layers)} layers", times)
    return 0


def _alternate(args: argparse.Namespace, model: Any, config: Any, switch: Any,
               random_tokens: bool) -> dict[bool, list[float]]:
    """Decode steps after a prompt, switch on at even steps and off at odd
    ones; each step feeds the model's greedy token, or a random one (as
    generate.py's continuation does, so that routing keeps moving)."""
    import torch

    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    tokens = torch.Generator().manual_seed(1)
    times: dict[bool, list[float]] = {True: [], False: []}
    with torch.no_grad():
        out: Any = model(prompt, use_cache=True, logits_to_keep=1)
        for step in range(args.steps):
            on = step % 2 == 0
            switch(on)
            token = torch.randint(0, config.vocab_size, (1, 1), generator=tokens) if random_tokens \
                else out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            out = model(token, past_key_values=out.past_key_values, use_cache=True)
            times[on].append(time.perf_counter() - t0)
            if step % 64 == 63:       # back to the prompt's length: every step sees 256-320 tokens
                out.past_key_values.crop(-64)
    switch(True)
    return times


def _report(args: argparse.Namespace, what: str, times: dict[bool, list[float]]) -> None:
    on, off = (statistics.median(times[k]) for k in (True, False))
    mean_on, mean_off = (statistics.fmean(times[k]) for k in (True, False))
    print(f"{args.switch} ({what}), {args.threads} thread(s), {args.steps} steps: "
          f"on {1e3 * on:.2f} ms, off {1e3 * off:.2f} ms a step (medians); on / off {on / off:.3f} "
          f"(means: {mean_on / mean_off:.3f})")


def _streamed(args: argparse.Namespace, config: Any, experts: int, layers: int) -> int:
    """``hits_first``: a cache of a quarter of the experts, PILOT, O_DIRECT;
    on, a layer whose experts are partly resident computes those while the
    workers read the others (LayerStream); off, it leases them all at once.
    ``pilot``: in RAM; on, PILOT predicts and prefetches (every guess is
    already resident, so this is its own cost); off, no PILOT. Random
    tokens, so that the routing moves as in a real text."""
    import torch

    import colibri.hf
    from colibri.moe import LayerStream

    if args.switch == "hits_first":
        model = colibri.hf.from_pretrained(args.model, torch_dtype=torch.bfloat16, prefetch="pilot",
                                           slots_per_layer=max(1, experts // 4), direct_io=True)
    else:
        model = colibri.hf.from_pretrained(args.model, torch_dtype=torch.bfloat16, prefetch="pilot",
                                           slots_per_layer=experts,
                                           warm=[(layer, e) for layer in range(layers) for e in range(experts)])
    model.eval()
    runtime = colibri.hf.runtime_of(model)
    pilot, hits_first = runtime.pilot, LayerStream.__iter__

    def at_once(self: Any) -> Any:
        for group in self.groups:
            with self.store.lease_many(self.layer, group) as leased:
                yield leased

    def switch(on: bool) -> None:
        if args.switch == "hits_first":
            LayerStream.__iter__ = hits_first if on else at_once  # type: ignore[method-assign]
        else:
            runtime.pilot = pilot if on else None

    store = runtime.store
    times = _alternate(args, model, config, switch, random_tokens=True)
    s = store.stats()
    model.colibri_close()
    _report(args, f"{s.misses / max(1, s.requests):.1%} of the requests missed", times)
    return 0


def _never(*args: Any) -> bool:
    return False


def _kv_cache(args: argparse.Namespace, model: Any, config: Any) -> int:
    """Two caches of one prompt, growing in place and plain (a DynamicLayer
    subclass, which the model's hook leaves alone), stepped alternately."""
    import torch
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class PlainLayer(DynamicLayer):  # type: ignore[misc]
        pass

    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    times: dict[bool, list[float]] = {True: [], False: []}
    outs: dict[bool, Any] = {}
    with torch.no_grad():
        for on in (True, False):
            cache = DynamicCache()
            if not on:
                cache.layers = [PlainLayer() for _ in range(config.num_hidden_layers)]
            outs[on] = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for step in range(args.steps):
            on = step % 2 == 0
            token = outs[on].logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            outs[on] = model(token, past_key_values=outs[on].past_key_values, use_cache=True)
            times[on].append(time.perf_counter() - t0)
            if step % 128 >= 126:       # both caches back to the prompt's length
                outs[on].past_key_values.crop(-64)
    kinds = {on: sorted({type(layer).__name__ for layer in outs[on].past_key_values.layers}) for on in outs}
    model.colibri_close()
    on_ms, off_ms = (statistics.median(times[k]) for k in (True, False))
    print(f"kv_cache ({kinds[True]} against {kinds[False]}), {args.threads} thread(s), prompt {args.prompt_len}, "
          f"{args.steps} steps: on {1e3 * on_ms:.2f} ms, off {1e3 * off_ms:.2f} ms a step (medians); "
          f"on / off {on_ms / off_ms:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
