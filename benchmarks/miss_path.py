#!/usr/bin/env python3
"""Miss path: the store's misses against the best plain reads of the same bytes in the same order.

A synthetic Mixtral-layout model (float16 experts of 1024x512 x3 = 3 MiB at
offsets that are not 4 KiB-aligned, as in any safetensors file) is written
under /tmp and deleted at the end. Each round draws a decode-like order: for
every layer in turn, K distinct experts in random order (K = a quarter of
the layer), so no expert repeats and every lease is a miss into a slot that
may have held another expert. Every reader below reads those bytes in that
order, cold: the page cache is dropped before each pass
(``sync; echo 3 > /proc/sys/vm/drop_caches``; ``POSIX_FADV_DONTNEED`` where
that is refused). Plain readers write into memory on huge pages, as the
store's slots are, and fill as many buffers, in turn, as the store has
slots (so each read lands in memory not written for a while, as each miss
does in the store), but for the "1 buffer" context rows.

    plain 1 call, 1 buffer  one buffered ``preadv`` per expert into one reused
                          buffer (which stays in the last-level CPU cache:
                          context; copies into it run faster warm)
    plain 1 call          one buffered ``preadv`` per expert
    plain 256K            buffered, 256 KiB per ``preadv``
    plain 256K+advice     the same with readahead off (POSIX_FADV_RANDOM)
                          and POSIX_FADV_WILLNEED over the expert first
    plain O_DIRECT tN     O_DIRECT reads of each expert's 4 KiB-aligned
                          superset, one call each, by N threads (1, 2) that
                          take the next expert of the order in turn, into as
                          many buffers in all as the store has slots (the
                          same work: every expert read lands in memory of
                          its own, as in a cache)
    plain O_DIRECT t1, 1 buffer  the same into one reused buffer (context:
                          its speed depends on where that one buffer lies
                          in physical memory, see docs/performance-io.md)
    store <mode> w=N      ``with store.lease(l, e): pass`` over the order,
                          every slot first filled with experts outside it;
                          with N prefetch workers the main thread first
                          prefetches the next 2N experts (capped by slots).
                          mode: default (``direct_io="auto"``), direct
                          (``True``), buffered (``False``), and auto low-mem:
                          auto with COLIBRI_AVAILABLE_MEMORY=0, which
                          emulates a model larger than RAM (takes O_DIRECT)

Each configuration runs ``--repeat`` passes a round (default 3), all of a
round's passes in one shuffled order, and its figure for the round is its
fastest pass: other processes' disk and CPU use only ever slow a pass down
(a pass is about 0.1 s of O_DIRECT reads, and a burst of another process's
reads or a few scheduling delays after completions take tens of percent of
it). Ratios are taken within a round; the tables give the range over rounds
and the acceptance lines the median ratio. Then, warm (files in the page
cache): the store's default against plain buffered reads, in rounds the
same way.

Acceptance: in O_DIRECT mode (forced or by auto) the store >= 0.9x plain
O_DIRECT with 0 workers (against 1 thread) and with 2 (against 2 threads);
in buffered mode >= 0.9x the best plain buffered read cold, and >= 0.9x a
plain buffered read warm; auto takes O_DIRECT when the memory is set low.

    python benchmarks/miss_path.py [--rounds N] [--repeat K] [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import ctypes
import mmap
import random
import shutil
import statistics
import sys
import tempfile
import threading
from functools import partial
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import colibri  # noqa: E402
from colibri.store import AVAILABLE_MEMORY_ENV  # noqa: E402
from colibri.synthetic import write_synthetic_model  # noqa: E402

HIDDEN, INTER = 1024, 512
ALIGN = 4096
CHUNK = 256 << 10
Span = tuple[tuple[int, int], int, int]   # key, file offset, bytes


def expert_spans(model_path) -> dict[tuple[int, int], tuple[int, int]]:
    """key -> (offset, nbytes) per expert; gate/up/down must be adjacent."""
    out = {}
    with colibri.open_store(model_path, slots_per_layer=1, prefetch_workers=0) as probe:
        for key in probe.model.keys():
            ts = sorted(probe.model.expert(*key).tensors(), key=lambda t: t.offset)
            for a, b in zip(ts, ts[1:]):
                assert a.end == b.offset, "benchmark expects adjacent gate/up/down"
            out[key] = (ts[0].offset, ts[-1].end - ts[0].offset)
    return out


def decode_order(spans, layers, experts, per_layer: int, seed: int) -> list[Span]:
    rng = random.Random(seed)
    order = []
    for layer in layers:
        for e in rng.sample(range(experts), per_layer):
            order.append(((layer, e), *spans[(layer, e)]))
    return order


HUGE = 2 << 20


def huge_buffer(nbytes: int, touched: bool = True) -> tuple[mmap.mmap, memoryview]:
    """A private anonymous mapping on transparent huge pages (as the store's
    slots are; a shared one would be shmem, on 4 KiB pages) and a view of
    nbytes of it from a 2 MiB boundary, faulted in before any timing unless
    not ``touched`` (then its first reads touch it first)."""
    buf = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    probe = ctypes.c_char.from_buffer(buf)
    skip = -ctypes.addressof(probe) % HUGE
    del probe
    view = memoryview(buf)[skip:skip + nbytes]
    if touched:
        probe = ctypes.c_char.from_buffer(view)
        ctypes.memset(ctypes.addressof(probe), 0, nbytes)
        del probe
    return buf, view


def release(buf: mmap.mmap, view: memoryview) -> None:
    view.release()
    buf.close()


def plain_buffered(path: str, order: list[Span], *, chunk: int, advice: bool, buffers: int = 1) -> float:
    fd = os.open(path, os.O_RDONLY)
    size = max(n for _, _, n in order)
    buf, whole = huge_buffer(size * buffers)
    try:
        if advice:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        t0 = C.ns()
        for i, (_, off, nb) in enumerate(order):
            at = (i % buffers) * size
            mv = whole[at:at + size]
            if advice:
                os.posix_fadvise(fd, off, nb, os.POSIX_FADV_WILLNEED)
            done = 0
            step = chunk or nb
            while done < nb:
                got = os.preadv(fd, [mv[done:min(nb, done + step)]], off + done)
                assert got > 0
                done += got
            mv.release()
        dt = C.ns() - t0
    finally:
        release(buf, whole)
        os.close(fd)
    return sum(n for _, _, n in order) / (dt / 1e9)


def plain_direct(path: str, order: list[Span], *, threads: int, buffers: int = 1, touched: bool = True,
                 mark: Callable[[], None] = lambda: None) -> float:
    """O_DIRECT reads of each expert's aligned superset by ``threads`` threads, each into its
    ``buffers`` buffers in turn (a fresh mapping each pass, faulted in before timing unless
    not ``touched``). ``mark`` is called right before and right after the timed reads."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    size = os.fstat(fd).st_size
    jobs = []
    for _, off, nb in order:
        start = off // ALIGN * ALIGN
        end = min(-(-(off + nb) // ALIGN) * ALIGN, -(-size // ALIGN) * ALIGN)
        jobs.append((start, end - start, off + nb - start))
    biggest = max(n for _, n, _ in jobs)
    bufs = [huge_buffer(biggest * buffers, touched) for _ in range(threads)]
    lock = threading.Lock()
    at = [0]

    def worker(mv: memoryview) -> None:
        used = 0
        while True:
            with lock:
                i = at[0]
                at[0] += 1
            if i >= len(jobs):
                return
            start, length, needed = jobs[i]
            o = (used % buffers) * biggest
            used += 1
            got = os.preadv(fd, [mv[o:o + length]], start)
            assert got >= needed

    try:
        mark()
        t0 = C.ns()
        ts = [threading.Thread(target=worker, args=(v,)) for _, v in bufs]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        dt = C.ns() - t0
        mark()
    finally:
        for b, v in bufs:
            release(b, v)
        os.close(fd)
    return sum(n for _, _, n in order) / (dt / 1e9)


def store_pass(model_path, order: list[Span], files, *, workers: int, slots: int,
               direct_io, cold: bool, low_memory: bool = False, prefetch_chunk: int = 0,
               fill: bool = True, mark: Callable[[], None] = lambda: None) -> tuple[float, bool]:
    """Bytes/s of leasing the order, and whether the store read with O_DIRECT.

    ``prefetch_chunk``: the store's prefetch_chunk_bytes (0: its default);
    ``fill``: fill every slot before timing (else the misses land in slots
    never touched); ``mark`` is called right before and right after the
    timed leases."""
    saved = os.environ.get(AVAILABLE_MEMORY_ENV)
    if low_memory:
        os.environ[AVAILABLE_MEMORY_ENV] = "0"
    try:
        store = colibri.open_store(model_path, slots_per_layer=slots, prefetch_workers=workers,
                                   direct_io=direct_io, prefetch_chunk_bytes=prefetch_chunk)
    finally:
        if low_memory:
            if saved is None:
                del os.environ[AVAILABLE_MEMORY_ENV]
            else:
                os.environ[AVAILABLE_MEMORY_ENV] = saved
    try:
        keys = [k for k, _, _ in order]
        depth = min(2 * workers, max(0, slots - 2))
        # Fill every slot with experts outside the order first, so that
        # each miss lands in a slot that held an expert (as in a running
        # engine), not in memory touched for the first time.
        wanted = set(keys)
        for layer in store.layers if fill else []:
            others = [e for e in range(store.num_experts(layer)) if (layer, e) not in wanted]
            for e in others[:store.slots(layer)]:
                with store.lease(layer, e):
                    pass
        if cold:
            C.drop_page_cache(files)
        lease, prefetch = store.lease, store.prefetch
        mark()
        t0 = C.ns()
        if workers and depth:
            for i, k in enumerate(keys):
                prefetch(keys[i + 1:i + 1 + depth])
                with lease(*k):
                    pass
        else:
            for k in keys:
                with lease(*k):
                    pass
        dt = C.ns() - t0
        mark()
        store.wait_idle(timeout=60)
        st = store.stats()
        assert st.loads_failed == 0
        return sum(n for _, _, n in order) / (dt / 1e9), store.direct_io
    finally:
        store.close()


def spread(values: list[float], fmt: Callable[[float], str]) -> str:
    lo, hi = min(values), max(values)
    return fmt(lo) if len(values) == 1 else f"{fmt(lo)} - {fmt(hi)}"


def ratios(values: list[float], bases: list[float]) -> str:
    """Median of per-round ratios, and their range."""
    r = [a / b for a, b in zip(values, bases)]
    med = C.fmt_ratio(statistics.median(r))
    return med if len(r) == 1 else f"{med} ({C.fmt_ratio(min(r))}-{C.fmt_ratio(max(r))})"


def run_round(configs: dict[str, Callable[[], float]], repeat: int, seed: int) -> dict[str, float]:
    """Each configuration's fastest of ``repeat`` passes, all passes in one shuffled order."""
    passes = list(configs) * repeat
    random.Random(seed).shuffle(passes)
    best: dict[str, float] = {}
    for name in passes:
        best[name] = max(best.get(name, 0.0), configs[name]())
    return best


def shape(quick: bool, rounds: int) -> tuple[int, int, int, int, int]:
    """Layers, experts per layer, rounds, slots per layer, misses per layer of a pass."""
    layers, experts = (2, 32) if quick else (4, 64)
    return layers, experts, rounds or (2 if quick else 5), experts // 4, experts // 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, 2 rounds (CI)")
    ap.add_argument("--rounds", type=int, default=0, help="rounds (default 5; 2 with --quick)")
    ap.add_argument("--repeat", type=int, default=0,
                    help="passes of each configuration a round, the fastest counts (default 3; 1 with --quick)")
    args = ap.parse_args(argv)
    repeat = args.repeat or (1 if args.quick else 3)
    layers, experts, rounds, slots, per_layer = shape(args.quick, args.rounds)

    free = shutil.disk_usage("/tmp").free
    need = layers * experts * 3 * HIDDEN * INTER * 2
    if free < 3 * need:
        print(f"not enough space under /tmp: {free:,} free, {need:,} needed", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="colibri-miss-", dir="/tmp"))
    goals = C.Goals()
    try:
        model = write_synthetic_model(tmp / "model", n_layers=layers, n_experts=experts,
                                      hidden=HIDDEN, intermediate=INTER, dtype="float16")
        path = str(model.files[0])
        files = list(model.files)
        spans = expert_spans(model.path)
        drop = "drop_caches" if C.can_drop_caches() else "POSIX_FADV_DONTNEED"
        with colibri.open_store(model.path, slots_per_layer=slots) as probe:
            default_direct = probe.direct_io
        print(f"[miss_path] {os.path.getsize(path) / 2**20:.0f} MiB model ({layers} layers x {experts} "
              f"experts x {model.expert_nbytes / 2**20:.0f} MiB); {slots} slots/layer; each pass "
              f"{layers * per_layer} misses in a random decode-like order; {rounds} rounds of the "
              f"fastest of {repeat} passes; "
              f"cold by {drop}; the default (auto) reads with "
              f"{'O_DIRECT' if default_direct else 'the page cache'} here", flush=True)

        # Plain readers fill as many buffers, in turn, as the store has slots:
        # a miss lands in memory not written for a while, as in the store.
        # (One reused 3 MiB buffer stays in the CPU's last-level cache, so
        # copies into it run faster warm; an O_DIRECT read into it runs at
        # the speed of the one place it lies in physical memory: the
        # "1 buffer" context rows.)
        nbuf = slots * layers
        plain: dict[str, Callable[[list[Span]], float]] = {
            "plain 1 call, 1 buffer": lambda o: plain_buffered(path, o, chunk=0, advice=False),
            "plain 1 call": lambda o: plain_buffered(path, o, chunk=0, advice=False, buffers=nbuf),
            "plain 256K": lambda o: plain_buffered(path, o, chunk=CHUNK, advice=False, buffers=nbuf),
            "plain 256K+advice": lambda o: plain_buffered(path, o, chunk=CHUNK, advice=True, buffers=nbuf),
            "plain O_DIRECT t1, 1 buffer": lambda o: plain_direct(path, o, threads=1),
            "plain O_DIRECT t1": lambda o: plain_direct(path, o, threads=1, buffers=nbuf),
            "plain O_DIRECT t2": lambda o: plain_direct(path, o, threads=2, buffers=nbuf // 2),
        }
        stores: dict[str, dict] = {}
        for w in (0, 1, 2, 4):
            stores[f"store default w={w}"] = dict(workers=w, direct_io="auto")
        for w in (0, 2):
            stores[f"store direct w={w}"] = dict(workers=w, direct_io=True)
        stores["store buffered w=0"] = dict(workers=0, direct_io=False)
        for w in (0, 2):
            stores[f"store auto low-mem w={w}"] = dict(workers=w, direct_io="auto", low_memory=True)
        names = list(plain) + list(stores)
        runs: dict[str, list[float]] = {n: [] for n in ["best plain buffered"] + names}
        direct_seen: dict[str, set[bool]] = {n: set() for n in stores}

        def cold_plain(name: str, order: list[Span]) -> float:
            C.drop_page_cache(files)
            return plain[name](order)

        def cold_store(name: str, order: list[Span]) -> float:
            bw, direct = store_pass(model.path, order, files, slots=slots, cold=True, **stores[name])
            direct_seen[name].add(direct)
            return bw

        for r in range(rounds):
            order = decode_order(spans, model.layers, experts, per_layer, seed=r)
            got = run_round({n: partial(cold_plain if n in plain else cold_store, n, order) for n in names},
                            repeat, 1000 + r)
            got["best plain buffered"] = max(got["plain 1 call"], got["plain 256K"],
                                             got["plain 256K+advice"])
            for name in ["best plain buffered"] + names:
                runs[name].append(got[name])
            print(f"  round {r + 1}: " + ", ".join(f"{n} {got[n] / 1e6:.0f}" for n in names), flush=True)

        def mode_of(name: str) -> str:
            if name not in stores:
                return ""
            seen = direct_seen[name]
            return "O_DIRECT" if seen == {True} else "page cache" if seen == {False} else "mixed"

        bases = ("plain 1 call", "best plain buffered", "plain O_DIRECT t1", "plain O_DIRECT t2")
        rows = []
        for name in ["best plain buffered"] + names:
            rows.append((name, mode_of(name), spread(runs[name], C.fmt_bw),
                         *(ratios(runs[name], runs[base]) for base in bases)))
        print()
        print(C.table(f"cold misses: {layers * per_layer} x {model.expert_nbytes / 2**20:.0f} MiB per pass, "
                      f"{rounds} rounds, each the fastest of {repeat} passes (MB/s: range over rounds; "
                      f"x: median of the ratios within each round, and their range)",
                      ("reader", "reads with", "MB/s", "x plain 1 call", "x best buffered",
                       "x O_DIRECT t1", "x O_DIRECT t2"), rows))
        print()

        # warm: every file in the page cache
        order = decode_order(spans, model.layers, experts, per_layer, seed=rounds)
        warm: dict[str, list[float]] = {}
        warm_names = ["plain 1 call, 1 buffer", "plain 1 call", "plain 256K", "store default w=0"]
        def warm_pass(name: str) -> float:
            C.warm_page_cache(files)
            if name.startswith("plain"):
                return plain[name](order)
            return store_pass(model.path, order, files, slots=slots, cold=False, **stores[name])[0]

        for r in range(rounds):
            for name, bw in run_round({n: partial(warm_pass, n) for n in warm_names}, repeat, 2000 + r).items():
                warm.setdefault(name, []).append(bw)
        best_warm = [max(a, b) for a, b in zip(warm["plain 1 call"], warm["plain 256K"])]
        warm["best plain buffered"] = best_warm
        print(C.table(f"warm misses (files in the page cache), {rounds} rounds of the fastest of {repeat} passes",
                      ("reader", "MB/s", "x best plain buffered"),
                      [(n, spread(v, C.fmt_bw), ratios(v, best_warm)) for n, v in warm.items()]))
        print()

        def ratio(name: str, base: str) -> float:
            return statistics.median(a / b for a, b in zip(runs[name], runs[base]))

        if default_direct:
            checks = (("store default w=0", "plain O_DIRECT t1"), ("store default w=2", "plain O_DIRECT t2"))
        else:
            checks = (("store default w=0", "best plain buffered"),)
        for name, base in checks + (("store direct w=0", "plain O_DIRECT t1"),
                           ("store auto low-mem w=0", "plain O_DIRECT t1"),
                           ("store direct w=2", "plain O_DIRECT t2"),
                           ("store auto low-mem w=2", "plain O_DIRECT t2"),
                           ("store buffered w=0", "best plain buffered")):
            v = ratio(name, base)
            goals.check(f"cold: {name} >= 0.9x {base}", v, ">= 0.9x", v >= 0.9,
                        f"{v:.2f}x (median of {rounds} rounds)")
        if not default_direct:
            wv = statistics.median(a / b for a, b in zip(warm["store default w=0"], best_warm))
            goals.check("warm: store default w=0 >= 0.9x best plain buffered", wv, ">= 0.9x", wv >= 0.9,
                        f"{wv:.2f}x (median of {rounds} rounds)")
        low = all(direct_seen[n] == {True} for n in stores if "low-mem" in n)
        goals.check(f"auto with {AVAILABLE_MEMORY_ENV}=0 takes O_DIRECT", float(low), "yes", low,
                    "yes" if low else "no")
        print(goals.render("miss path acceptance"))
        C.write_json("miss_path", {
            "model_bytes": os.path.getsize(path), "misses_per_pass": layers * per_layer,
            "expert_bytes": model.expert_nbytes, "slots_per_layer": slots, "rounds": rounds,
            "passes_per_round": repeat,
            "drop_method": drop, "default_direct_io": default_direct,
            "cold_bytes_per_s": runs, "warm_bytes_per_s": warm,
            "direct_io_in_use": {k: sorted(v) for k, v in direct_seen.items()}, "goals": goals.items})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
