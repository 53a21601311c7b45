#!/usr/bin/env python3
"""The O_DIRECT miss path taken apart: what the store's reads differ in from plain O_DIRECT reads.

miss_path.py compares the store's O_DIRECT misses with plain O_DIRECT reads
of the same bytes in the same order. This takes that comparison apart, on
the same synthetic model, order and cold page cache, with rows that each
change one thing:

    plain t1 Nbuf        miss_path's baseline: one thread, into as many
                         buffers in turn as the store has slots (N)
    plain t1 1buf        the same into one reused buffer
    plain t1 Nbuf fresh  into N buffers never touched before the reads
    plain t1 Nbuf 4K     into N buffers on 4 KiB pages (transparent huge
                         pages off for the process during the pass)
    store w=0            the store, every slot filled before timing (miss_path)
    store w=0 fresh      the store, its slots never touched before timing (an
                         engine's first misses, the prefill's)
    store w=0 4K         the store with its slot memory on 4 KiB pages (what
                         slot memory recycled from the heap gave)
    plain t2 N/2buf      two threads, N / 2 buffers each (miss_path's baseline)
    store w=2            2 prefetch workers, the default prefetch chunk
                         (4 MiB with O_DIRECT: one read per expert here)
    store w=2 1MiB       the same with prefetch_chunk_bytes = 1 MiB (a
                         3 MiB + 4 KiB expert in 4 reads)

Each row's figure for a round is the fastest of ``--repeat`` passes; a
round's passes run in one shuffled order, and each row gives the median of
its per-round ratios against the row's baseline (plain t1 Nbuf or plain t2
N/2buf). "requests/read" is the device's completed reads during the timed
loop (``/sys/dev/block/M:m/stat``) per expert read: a read into 4 KiB pages
needs more segments than one request takes and is split. Other processes'
reads of the same device are counted too: on a shared machine it is an
upper bound.

    python benchmarks/miss_path_direct.py [--rounds N] [--repeat K] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import miss_path as M  # noqa: E402

from colibri.synthetic import write_synthetic_model  # noqa: E402

PR_SET_THP_DISABLE = 41


@contextlib.contextmanager
def small_pages() -> Iterator[None]:
    """Transparent huge pages off for memory this process faults in meanwhile."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_THP_DISABLE)")
    try:
        yield
    finally:
        libc.prctl(PR_SET_THP_DISABLE, 0, 0, 0, 0)


class DeviceReads:
    """Completed reads of the block device holding a file, between marks."""

    def __init__(self, path: str) -> None:
        dev = os.stat(path).st_dev
        self.stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
        self.marks: list[int] = []

    def mark(self) -> None:
        if self.stat.exists():
            self.marks.append(int(self.stat.read_text().split()[0]))

    def since_start(self) -> int | None:
        """Reads between the last two marks, then forgets them."""
        got = self.marks[-1] - self.marks[-2] if len(self.marks) >= 2 else None
        self.marks.clear()
        return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="miss_path's quick model, 2 rounds")
    ap.add_argument("--rounds", type=int, default=0, help="rounds (default 5; 2 with --quick)")
    ap.add_argument("--repeat", type=int, default=0, help="passes a row a round (default 3; 1 with --quick)")
    args = ap.parse_args(argv)
    layers, experts, rounds, slots, per_layer = M.shape(args.quick, args.rounds)
    repeat = args.repeat or (1 if args.quick else 3)
    n = slots * layers
    misses = layers * per_layer
    tmp = Path(tempfile.mkdtemp(prefix="colibri-direct-", dir="/tmp"))
    try:
        model = write_synthetic_model(tmp / "model", n_layers=layers, n_experts=experts, hidden=M.HIDDEN,
                                      intermediate=M.INTER, dtype="float16")
        path, files = str(model.files[0]), [str(f) for f in model.files]
        spans = M.expert_spans(model.path)
        device = DeviceReads(path)
        requests: dict[str, list[float]] = {}

        def store(workers: int, pages_4k: bool = False, **kw: Any) -> Callable[[list[M.Span]], float]:
            def run(o: list[M.Span]) -> float:
                with small_pages() if pages_4k else contextlib.nullcontext():
                    return M.store_pass(model.path, o, files, workers=workers, slots=slots, direct_io=True,
                                        cold=True, mark=device.mark, **kw)[0]
            return run

        def plain(threads: int, pages_4k: bool = False, **kw: Any) -> Callable[[list[M.Span]], float]:
            def run(o: list[M.Span]) -> float:
                C.drop_page_cache(files)
                with small_pages() if pages_4k else contextlib.nullcontext():
                    return M.plain_direct(path, o, threads=threads, mark=device.mark, **kw)
            return run

        t1, t2 = "plain t1 Nbuf", "plain t2 N/2buf"
        rows: dict[str, tuple[str, Callable[[list[M.Span]], float]]] = {
            t1: (t1, plain(1, buffers=n)),
            "plain t1 1buf": (t1, plain(1)),
            "plain t1 Nbuf fresh": (t1, plain(1, buffers=n, touched=False)),
            "plain t1 Nbuf 4K": (t1, plain(1, pages_4k=True, buffers=n)),
            "store w=0": (t1, store(0)),
            "store w=0 fresh": (t1, store(0, fill=False)),
            "store w=0 4K": (t1, store(0, pages_4k=True)),
            t2: (t2, plain(2, buffers=n // 2)),
            "store w=2": (t2, store(2)),
            "store w=2 1MiB": (t2, store(2, prefetch_chunk=1 << 20)),
        }
        print(f"[miss_path_direct] {layers} layers x {experts} experts x {model.expert_nbytes / 2**20:.0f} MiB, "
              f"{slots} slots/layer (N = {n}), {misses} misses a pass, {rounds} rounds of the fastest of "
              f"{repeat} passes, MB/s", flush=True)
        got: dict[str, list[float]] = {name: [] for name in rows}

        def measured(name: str, order: list[M.Span]) -> float:
            bw = rows[name][1](order)
            reads = device.since_start()
            if reads is not None:
                requests.setdefault(name, []).append(reads / misses)
            return bw

        for r in range(rounds):
            order = M.decode_order(spans, model.layers, experts, per_layer, seed=r)
            best = M.run_round({name: (lambda name=name: measured(name, order)) for name in rows}, repeat, 1000 + r)
            for name, bw in best.items():
                got[name].append(bw)
            print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1] / 1e6:.0f}" for k, v in got.items()), flush=True)
        table = []
        for name, (base, _) in rows.items():
            ratios = [a / b for a, b in zip(got[name], got[base])]
            per_read = requests.get(name)
            table.append((name, f"{statistics.median(got[name]) / 1e6:,.0f}",
                          f"{C.fmt_ratio(statistics.median(ratios))} ({C.fmt_ratio(min(ratios))}-"
                          f"{C.fmt_ratio(max(ratios))})", base,
                          f"{statistics.median(per_read):.2f}" if per_read else "n/a"))
        print(C.table("O_DIRECT misses against plain O_DIRECT reads",
                      ("reader", "MB/s (median)", "x baseline (median of rounds, range)", "baseline",
                       "requests/read (median)"), table))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
