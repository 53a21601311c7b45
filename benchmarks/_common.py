"""Shared helpers of the benchmark scripts: timing, tables, goals, JSON, the page cache.

Every benchmark measures its baseline in the same run and reports ratios
against it next to the absolute numbers. Goals (docs/performance.md) are marked
``met`` / ``MISSED``; nothing here asserts, a missed goal is a finding.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# where write_json puts its files; COLIBRI_BENCH_RESULTS moves them (a test run of a benchmark)
RESULTS = Path(os.environ.get("COLIBRI_BENCH_RESULTS") or HERE / "results")

# colibri as installed, plainly or editable, comes first on sys.path; this
# checkout is searched last, for a tree built in place and not installed.
# Before an installed package it would shadow it with one whose extensions
# were never compiled. Child processes of the benchmarks find colibri the same
# way (they import this module), so none of them sets PYTHONPATH.
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

ns = time.perf_counter_ns


# ---------------------------------------------------------------- timing --

def timed_into(acc: dict[str, float], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped to add the seconds each call takes to ``acc[key]``."""
    clock = time.perf_counter

    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = clock()
        try:
            return fn(*a, **k)
        finally:
            acc[key] = acc.get(key, 0.0) + clock() - t0
    return wrapper


def timer_overhead_ns(samples: int = 20000) -> float:
    """Median cost of one back-to-back perf_counter_ns pair (subtracted from per-call samples)."""
    out = []
    for _ in range(samples):
        t0 = ns()
        t1 = ns()
        out.append(t1 - t0)
    return float(statistics.median(out))


def per_call(fn: Callable[[], Any], calls: int, *, warmup: int = 200, overhead: float = 0.0) -> list[float]:
    """Times ``fn()`` one call at a time; returns per-call ns (timer overhead removed).

    The garbage collector is off while timing so every candidate is measured
    alike (a cycle collection in the middle of one candidate is noise, not
    its cost).
    """
    for _ in range(warmup):
        fn()
    samples = [0.0] * calls
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(calls):
            t0 = ns()
            fn()
            t1 = ns()
            samples[i] = t1 - t0 - overhead
    finally:
        if was_enabled:
            gc.enable()
    return samples


def batched(fn: Callable[[], Any], calls: int, *, batches: int = 7) -> float:
    """Mean ns per call over ``batches`` batches of ``calls // batches`` calls; the best batch."""
    per = max(1, calls // batches)
    best = float("inf")
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(batches):
            t0 = ns()
            for _ in range(per):
                fn()
            best = min(best, (ns() - t0) / per)
    finally:
        if was_enabled:
            gc.enable()
    return best


def summary(samples: Sequence[float]) -> dict[str, float]:
    """median, p99 and mean of per-call samples (ns)."""
    s = sorted(samples)
    n = len(s)
    return {
        "median_ns": float(s[n // 2]),
        "p99_ns": float(s[min(n - 1, int(n * 0.99))]),
        "mean_ns": float(sum(s) / n),
        "calls": n,
    }


def fmt_ns(v: float) -> str:
    if v != v:  # NaN
        return "-"
    if abs(v) >= 1e9:
        return f"{v / 1e9:.2f} s"
    if abs(v) >= 1e6:
        return f"{v / 1e6:.2f} ms"
    if abs(v) >= 1e4:
        return f"{v / 1e3:.1f} us"
    if abs(v) >= 1e3:
        return f"{v / 1e3:.2f} us"
    return f"{v:.0f} ns"


def fmt_bw(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e6:,.0f} MB/s"


def fmt_ratio(v: float | None) -> str:
    if v is None or v != v:
        return "-"
    if v >= 100:
        return f"{v:.0f}x"
    if v >= 10:
        return f"{v:.1f}x"
    return f"{v:.2f}x"


# ----------------------------------------------------------------- tables --

def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]], note: str | None = None) -> str:
    """A plain-text table; the first column is left-aligned, the rest right-aligned."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        parts = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        return "  ".join(parts).rstrip()

    out = [title, "=" * len(title), line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    if note:
        out.append(note)
    return "\n".join(out)


class Goals:
    """Goals checked in one run: each is a measured value against a target."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def check(self, goal: str, value: float, target: str, met: bool, detail: str = "",
              info: bool = False) -> bool:
        """Records one goal; ``info`` marks a context line that is not a goal."""
        self.items.append({"goal": goal, "value": value, "target": target, "met": bool(met),
                           "detail": detail, "info": info})
        return bool(met)

    def render(self, title: str = "goals") -> str:
        rows = [
            (g["goal"], g["detail"] or f"{g['value']:.3g}", g["target"],
             ("(info) " if g.get("info") else "") + ("met" if g["met"] else "MISSED"))
            for g in self.items
        ]
        return table(title, ("goal", "measured", "target", "status"), rows)


# ------------------------------------------------------------ environment --

def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numpy as np

    spec = importlib.util.find_spec("colibri")
    return {
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "colibri": spec.origin if spec is not None else None,
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "kernel": platform.release(),
    }


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": machine(), "unix_time": time.time(), **payload}
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str))
    os.replace(tmp, path)
    return path


def fadvise_dontneed(paths: Sequence[os.PathLike[str] | str]) -> None:
    """Drops these files' pages from the page cache (POSIX_FADV_DONTNEED)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``: whether it was permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def drop_page_cache(paths: Sequence[os.PathLike[str] | str] = ()) -> str:
    """Empties the page cache: :func:`drop_caches` when permitted, else
    ``POSIX_FADV_DONTNEED`` on ``paths``. Returns the method used."""
    if drop_caches():
        return "drop_caches"
    fadvise_dontneed(paths)
    return "fadvise"


def can_drop_caches() -> bool:
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def warm_page_cache(paths: Sequence[os.PathLike[str] | str]) -> None:
    """Reads these files whole, so that their pages are cached."""
    buf = bytearray(16 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
