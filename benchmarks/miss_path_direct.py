#!/usr/bin/env python3
"""The O_DIRECT miss path taken apart: what the store's reads differ in from plain O_DIRECT reads.

miss_path.py compares the store's O_DIRECT misses with plain O_DIRECT reads
of the same bytes in the same order. This takes that comparison apart, on
the same synthetic model, order and cold page cache, with rows that each
change one thing:

    plain t1 1buf        miss_path's baseline: one thread, one reused buffer
    plain t1 Nbuf        the same into N buffers in turn (N = the store's
                         slots), as the store's misses land in N slots
    plain t1 Nbuf fresh  the same into buffers never touched before the reads
    store w=0            the store, every slot filled before timing (miss_path)
    store w=0 fresh      the store, its slots never touched before timing (an
                         engine's first misses, the prefill's)
    plain t2 1buf / Nbuf two threads, as above (N / 2 buffers each)
    store w=2 1MiB       2 prefetch workers, prefetch reads in the default
                         1 MiB chunks (miss_path's w=2 row)
    store w=2 one read   the same with prefetch_chunk_bytes past an expert's
                         size: one pread per prefetched expert

Every row is a median of per-round ratios against the row's 1-buffer plain
baseline; the order of the rows is shuffled in each round.

    python benchmarks/miss_path_direct.py [--rounds N] [--quick]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import miss_path as M  # noqa: E402

from colibri.synthetic import write_synthetic_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="miss_path's quick model, 2 rounds")
    ap.add_argument("--rounds", type=int, default=0, help="rounds (default 5; 2 with --quick)")
    args = ap.parse_args(argv)
    layers, experts, rounds, slots, per_layer = M.shape(args.quick, args.rounds)
    n = slots * layers
    tmp = Path(tempfile.mkdtemp(prefix="colibri-direct-", dir="/tmp"))
    try:
        model = write_synthetic_model(tmp / "model", n_layers=layers, n_experts=experts, hidden=M.HIDDEN,
                                      intermediate=M.INTER, dtype="float16")
        path, files = str(model.files[0]), [str(f) for f in model.files]
        spans = M.expert_spans(model.path)
        one_read = 2 * model.expert_nbytes
        def store(workers: int, **kw: Any) -> Callable[[list[M.Span]], float]:
            return lambda o: M.store_pass(model.path, o, files, workers=workers, slots=slots, direct_io=True,
                                          cold=True, **kw)[0]

        def plain(threads: int, **kw: Any) -> Callable[[list[M.Span]], float]:
            return lambda o: M.plain_direct(path, o, threads=threads, **kw)

        rows: dict[str, tuple[str, Callable[[list[M.Span]], float]]] = {
            "plain t1 1buf": ("t1", plain(1)),
            f"plain t1 {n}buf": ("t1", plain(1, buffers=n)),
            f"plain t1 {n}buf fresh": ("t1", plain(1, buffers=n, touched=False)),
            "store w=0": ("t1", store(0)),
            "store w=0 fresh": ("t1", store(0, fill=False)),
            "plain t2 1buf": ("t2", plain(2)),
            f"plain t2 {n // 2}buf": ("t2", plain(2, buffers=n // 2)),
            "store w=2 1MiB": ("t2", store(2)),
            "store w=2 one read": ("t2", store(2, prefetch_chunk=one_read)),
        }
        print(f"[miss_path_direct] {layers} layers x {experts} experts x {model.expert_nbytes / 2**20:.0f} MiB, "
              f"{slots} slots/layer, {layers * per_layer} misses a pass, {rounds} rounds, MB/s", flush=True)
        got: dict[str, list[float]] = {name: [] for name in rows}
        for r in range(rounds):
            order = M.decode_order(spans, model.layers, experts, per_layer, seed=r)
            names = list(rows)
            random.Random(1000 + r).shuffle(names)
            for name in names:
                C.drop_page_cache(files)
                got[name].append(rows[name][1](order))
            print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1] / 1e6:.0f}" for k, v in got.items()), flush=True)
        table = []
        for name, (threads, _) in rows.items():
            base = got[f"plain {threads} 1buf"]
            ratio = statistics.median(a / b for a, b in zip(got[name], base))
            table.append((name, f"{statistics.median(got[name]) / 1e6:,.0f}", C.fmt_ratio(ratio)))
        print(C.table("O_DIRECT misses against plain O_DIRECT reads", ("reader", "MB/s (median)",
                      "vs 1-buffer plain (median of rounds)"), table))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
