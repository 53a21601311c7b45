"""Command line: `colibri demo`, `inspect`, `generate`, `serve`, `replay` and `plan` (`colibri --help`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from colibri.demo import DemoConfig, format_stats, run_demo
from colibri.errors import ColibriError, FormatError


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
    from colibri.describe import describe, render
    from colibri.checkpoint.scan import scan_model

    if args.slots is not None and args.slots < 1:
        raise FormatError(f"--slots must be >= 1, got {args.slots}")
    if args.ram_gb is not None and not args.ram_gb > 0:
        raise FormatError(f"--ram-gb must be > 0, got {args.ram_gb}")
    model = scan_model(args.path, layout=args.layout)
    ram = None if args.ram_gb is None else int(args.ram_gb * 2**30)
    data = describe(model, args.path, slots=args.slots, ram_bytes=ram)
    print(json.dumps(data, indent=2) if args.json else render(data))
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
    budget = i.add_mutually_exclusive_group()
    budget.add_argument("--slots", type=int, help="show the cache this many slots per layer would take")
    budget.add_argument("--ram-gb", type=float, metavar="X",
                        help="show the slots per layer a cache of X GiB (2**30 bytes) would give")
    i.add_argument("--json", action="store_true", help="print the description as JSON, for scripts")
    i.set_defaults(func=_inspect)
    from colibri.tiering_cli import add_commands

    add_commands(sub)  # replay, plan
    from colibri.generate_cli import add_parser as add_generate

    add_generate(sub)
    from colibri.serve.cli import add_parser as add_serve

    add_serve(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except ColibriError as exc:
        print(f"colibri: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
