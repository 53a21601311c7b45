"""``colibri serve MODEL_DIR``: an OpenAI-compatible server for a MoE model whose
experts stream from disk through colibri, with batched decoding.

It listens on 127.0.0.1:8000 unless told otherwise, and only once the model is
loaded (until then connections are refused). SIGINT or SIGTERM stops it: new
requests are refused, running ones get --drain seconds to finish and are then
cancelled, the store is closed and the exit status is 0; a second signal
cancels at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

from colibri.errors import ColibriError, FormatError
from colibri.memory_room import ram_gb_argument
from colibri.serve.server import DEFAULT_POLICY
from colibri.store import POLICIES

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Register the ``serve`` subcommand on an argparse subparsers object."""
    s = sub.add_parser("serve", help="serve a MoE model over an OpenAI-compatible HTTP API",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model_dir")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000)
    budget = s.add_mutually_exclusive_group()
    budget.add_argument("--ram-gb", type=ram_gb_argument, default=None,
                        help="RAM for the expert cache in GiB, split evenly across MoE layers; auto: what "
                             "the machine or the memory cgroup leaves, less the rest of the model and a reserve")
    budget.add_argument("--slots", type=int, default=None, help="expert slots per MoE layer")
    s.add_argument("--prefetch", choices=["pilot", "off"], default="pilot")
    s.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY,
                   help=f"the expert cache's eviction policy (default {DEFAULT_POLICY}; docs/serve.md says why)")
    s.add_argument("--max-batch", type=int, default=8, help="most sequences that decode together (1: no batching)")
    s.add_argument("--api-key", default=os.environ.get("COLIBRI_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $COLIBRI_API_KEY, else none)")
    s.add_argument("--model-name", default=None, help="the model id clients use (default: MODEL_DIR's name)")
    s.add_argument("--context", type=int, default=None,
                   help="tokens a prompt plus its completion may take (default: the model's maximum)")
    s.add_argument("--drain", type=float, default=10.0,
                   help="seconds running requests get to finish on SIGINT/SIGTERM (default 10)")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ColibriError("colibri serve needs the serve extra: pip install 'colibri[serve]'") from None
    from colibri.serve.server import Server, bind, load

    if not 0 <= args.port <= 65535:
        raise FormatError(f"--port must be in 0..65535, got {args.port}")
    if args.max_batch < 1:
        raise FormatError(f"--max-batch must be >= 1, got {args.max_batch}")
    if isinstance(args.ram_gb, float) and not args.ram_gb > 0:
        raise FormatError(f"--ram-gb must be > 0, got {args.ram_gb}")
    if args.slots is not None and args.slots < 1:
        raise FormatError(f"--slots must be >= 1, got {args.slots}")
    if args.context is not None and args.context < 2:
        raise FormatError(f"--context must be >= 2, got {args.context}")
    if args.drain < 0:
        raise FormatError(f"--drain must be >= 0, got {args.drain}")
    err = sys.stderr
    sock = bind(args.host, args.port)     # a port in use fails now, not after the load
    try:
        model, tokenizer = load(args.model_dir, ram_gb=args.ram_gb, slots=args.slots,
                                prefetch=args.prefetch, policy=args.policy, out=err)
    except BaseException:
        sock.close()
        raise
    try:
        server = Server(model, tokenizer, max_batch=args.max_batch, api_key=args.api_key,
                        model_name=args.model_name, context=args.context, drain=args.drain, sock=sock,
                        model_dir=args.model_dir)
    except BaseException:
        sock.close()
        model.colibri_close()
        raise
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if stop.is_set():
            server.force()
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        engine = server.engine
        batching = (f"max batch {engine.max_batch}" if engine.unbatched_reason is None
                    else f"one request at a time ({engine.unbatched_reason})")
        print(f"colibri serve: ready on {server.url} (model '{server.model_name}', {batching}, "
              f"context {engine.context}{', API key required' if args.api_key else ''})", file=err, flush=True)
        while not stop.wait(0.5):
            if not server.running:
                print("colibri serve: the HTTP server stopped", file=err, flush=True)
                break
        print(f"colibri serve: stopping (running requests get {args.drain:g} s)", file=err, flush=True)
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("colibri serve: stopped; the store is closed", file=err, flush=True)
    return 0
