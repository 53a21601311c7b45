"""``colibri generate MODEL_DIR --prompt TEXT``: run a transformers MoE model
with its routed experts streamed by colibri, printing the text as it comes.

The text (prompt and continuation, as ``tokenizer.decode`` gives it) goes to
stdout through transformers' ``TextStreamer``; the prefill progress (layer
by layer, with the time so far) and the closing summary (prefill and decode
tokens/s, hit rate, prefetch precision) go to stderr, so
``colibri generate ... > out.txt`` keeps only the text. Decoding is greedy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

import numpy as np

from colibri.errors import FormatError
from colibri.memory_room import ram_gb_argument

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Register the ``generate`` subcommand on an argparse subparsers object."""
    g = sub.add_parser("generate", help="generate text with a transformers MoE model, experts from the store",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("model_dir")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=32)
    budget = g.add_mutually_exclusive_group()
    budget.add_argument("--ram-gb", type=ram_gb_argument, default=None,
                        help="RAM for the expert cache in GiB, split evenly across MoE layers; auto: what "
                             "the machine or the memory cgroup leaves, less the rest of the model and a reserve")
    budget.add_argument("--slots", type=int, default=None, help="expert slots per MoE layer")
    g.add_argument("--prefetch", choices=["pilot", "off"], default="pilot")
    g.add_argument("--kernels", choices=["native", "torch"], default="native",
                   help="compute the routed experts with colibri's kernels from the slots (native), "
                        "or dequantize each one into torch tensors (torch: for comparison)")
    g.add_argument("--stats", action="store_true", help="print every store counter and the PILOT report")
    g.add_argument("--trace", metavar="FILE", default=None,
                   help="record the routing of every token (prompt and new) as a colibri.Trace .npz")
    g.set_defaults(func=run)


class _Prefill:
    """Prints the progress of a forward pass over several tokens (the prefill)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.start = time.perf_counter()      # reset when generate starts
        self.first_done: float | None = None
        self._open = False

    def __call__(self, p: Any) -> None:
        if p.tokens > 1:
            # The streamer has printed the prompt on stdout: start below it.
            elapsed = time.perf_counter() - self.start
            self.out.write(("\r" if self._open else "\n")
                           + f"prefill: {p.tokens} tokens, MoE layer {p.position + 1}/{p.layers}, "
                           f"{p.experts} experts in {p.groups} lease group(s), {elapsed:.1f} s   ")
            self.out.flush()
            self._open = True
        if p.position == p.layers - 1:
            if self._open:
                self.out.write("\n")
                self.out.flush()
                self._open = False
            if self.first_done is None:
                self.first_done = time.perf_counter()


class _Routing:
    """Collects each forward's routing and appends it, token by token, to a TraceRecorder."""

    def __init__(self, recorder: Any, layers: tuple[int, ...]) -> None:
        self.recorder = recorder
        self.layers = layers
        self._pending: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, layer: int, index: np.ndarray, weights: np.ndarray) -> None:
        if layer == self.layers[0]:
            self.flush()
        self._pending[layer] = (index, weights)

    def flush(self) -> None:
        if not self._pending:
            return
        tokens = min(idx.shape[0] for idx, _ in self._pending.values())
        for t in range(tokens):
            for layer in self.layers:
                if layer in self._pending:
                    idx, w = self._pending[layer]
                    self.recorder.record(layer, idx[t], w[t])
        self._pending.clear()


def run(args: argparse.Namespace) -> int:
    import colibri.hf as hf

    if args.max_new_tokens < 1:
        raise FormatError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if isinstance(args.ram_gb, float) and not args.ram_gb > 0:
        raise FormatError(f"--ram-gb must be > 0, got {args.ram_gb}")
    hf.read_config(args.model_dir)     # unsupported checkpoints fail before anything loads
    try:
        import torch
        from transformers import AutoTokenizer, TextStreamer
    except ImportError as exc:
        raise hf.UnsupportedModelError("colibri generate needs torch and transformers: "
                                       "pip install 'colibri[hf]'") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    except (OSError, ValueError) as exc:
        raise FormatError(f"{args.model_dir}: no usable tokenizer ({exc})") from None
    budget: dict[str, Any] = {}
    if args.ram_gb is not None:
        budget["capacity_bytes"] = "auto" if args.ram_gb == "auto" else int(args.ram_gb * 2**30)
    if args.slots is not None:
        budget["slots_per_layer"] = args.slots
    err = sys.stderr
    t0 = time.perf_counter()
    model = hf.from_pretrained(args.model_dir, prefetch=args.prefetch, kernels=args.kernels, **budget)
    runtime = hf.runtime_of(model)
    try:
        load_s = time.perf_counter() - t0
        store = runtime.store
        print(f"colibri: {type(model).__name__}, {len(runtime.moe_layers)} MoE layers, "
              f"{store.slots(runtime.moe_layers[0])} slots per layer, prefetch {args.prefetch}, "
              f"{args.kernels} kernels, loaded in {load_s:.1f} s", file=err)
        prefill = _Prefill(err)
        runtime.progress = prefill
        recorder = routing = None
        if args.trace:
            from colibri.trace import TraceRecorder

            recorder = TraceRecorder(None, layers=runtime.moe_layers,
                                     num_experts=max(store.num_experts(x) for x in runtime.moe_layers))
            routing = _Routing(recorder, runtime.moe_layers)
            runtime.routing = routing
        inputs = tokenizer(args.prompt, return_tensors="pt")
        prompt_tokens = int(inputs["input_ids"].shape[1])
        streamer = TextStreamer(tokenizer, skip_special_tokens=True)
        start = prefill.start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 streamer=streamer, pad_token_id=tokenizer.pad_token_id)
        end = time.perf_counter()
        sys.stdout.flush()
        new_tokens = int(out.shape[1]) - prompt_tokens
        first = prefill.first_done if prefill.first_done is not None else end
        decode_s = end - first
        decode_rate = (new_tokens - 1) / decode_s if new_tokens > 1 and decode_s > 0 else 0.0
        stats = store.stats()
        pilot = runtime.pilot.report() if runtime.pilot is not None else None
        precision = f"{pilot.precision:.1%}" if pilot is not None else "off"
        prefill_s = first - start
        prefill_rate = prompt_tokens / prefill_s if prefill_s > 0 else 0.0
        print(f"colibri: {new_tokens} new tokens; prefill {prompt_tokens} tokens in {prefill_s:.2f} s "
              f"({prefill_rate:.1f} tokens/s); decode {decode_rate:.2f} tokens/s; hit rate {stats.hit_rate:.1%}; "
              f"prefetch precision {precision}; read {stats.bytes_read / 2**20:.1f} MiB", file=err)
        if args.stats:
            print("store stats:", file=err)
            for key, value in stats.as_dict().items():
                print(f"  {key:>16}: {value:.4g}" if isinstance(value, float) else f"  {key:>16}: {value}",
                      file=err)
            if pilot is not None:
                print(f"pilot: {json.dumps(pilot.as_dict(), indent=None)}", file=err)
        if recorder is not None and routing is not None:
            routing.flush()
            trace = recorder.save(args.trace)
            print(f"colibri: routing of {len(trace)} tokens written to {args.trace}", file=err)
        return 0
    finally:
        runtime.close()
