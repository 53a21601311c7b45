"""Command line: `python -m colibri demo` and `python -m colibri inspect PATH`."""

from __future__ import annotations

import argparse
import logging
import sys

from colibri.demo import DemoConfig, format_stats, run_demo
from colibri.errors import ColibriError


def _demo(args: argparse.Namespace) -> int:
    cfg = DemoConfig(
        tokens=args.tokens, layers=args.layers, experts=args.experts, top_k=args.top_k,
        slots=args.slots, hidden=args.hidden, intermediate=args.intermediate, dtype=args.dtype,
        prefetch_workers=args.prefetch_workers, lookahead=not args.no_lookahead,
    )
    stats = run_demo(cfg)
    print("store stats:")
    print(format_stats(stats))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from colibri.layouts import scan_model

    model = scan_model(args.path, layout=args.layout)
    total = 0
    print(f"layout: {model.layout}")
    print(f"files: {len(model.files)}")
    print(f"{'layer':>6} {'experts':>8} {'bytes/expert':>14}  dtypes")
    for layer in model.layers:
        n = model.num_experts(layer)
        per = model.expert_nbytes(layer)
        ex = model.expert(layer, next(iter(model.experts[layer])))
        dtypes = sorted({t.dtype for t in ex.tensors()})
        total += n * per
        print(f"{layer:>6} {n:>8} {per:>14,}  {','.join(dtypes)}")
    print(f"routed-expert bytes: {total:,} ({total / 2**30:.2f} GiB)")
    if args.slots:
        ram = sum(min(args.slots, model.num_experts(l)) * model.expert_nbytes(l) for l in model.layers)
        print(f"slots_per_layer={args.slots} needs about {ram:,} bytes ({ram / 2**30:.2f} GiB) of cache")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="colibri", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="stream a synthetic MoE through a small cache and print stats")
    d.add_argument("--tokens", type=int, default=DemoConfig.tokens)
    d.add_argument("--layers", type=int, default=DemoConfig.layers)
    d.add_argument("--experts", type=int, default=DemoConfig.experts)
    d.add_argument("--top-k", type=int, default=DemoConfig.top_k)
    d.add_argument("--slots", type=int, default=DemoConfig.slots)
    d.add_argument("--hidden", type=int, default=DemoConfig.hidden)
    d.add_argument("--intermediate", type=int, default=DemoConfig.intermediate)
    d.add_argument("--dtype", default=DemoConfig.dtype, choices=["float32", "float16", "bfloat16"])
    d.add_argument("--prefetch-workers", type=int, default=DemoConfig.prefetch_workers)
    d.add_argument("--no-lookahead", action="store_true", help="do not prefetch the next layer")
    d.set_defaults(func=_demo)
    i = sub.add_parser("inspect", help="describe the routed experts of a checkpoint")
    i.add_argument("path")
    i.add_argument("--layout", default="auto")
    i.add_argument("--slots", type=int, default=0, help="show the RAM this many slots per layer would take")
    i.set_defaults(func=_inspect)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except ColibriError as exc:
        print(f"colibri: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
