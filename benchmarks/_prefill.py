"""Prefill at the memory limit, and the figures it is held against.

The goal: with a 256-token prompt, colibri's prefill time at the memory
limit is at most ``GOAL`` (1.3) times the larger of two figures measured in
the same run:

* the in-RAM model's prefill (every weight loaded, nothing read);
* the time to read every expert the prompt touches at plain O_DIRECT
  bandwidth (:func:`direct_read_time`: the experts' byte ranges, merged per
  file, read in large aligned chunks past the page cache).

A benchmark records which experts the prompt touched in its colibri run
(:class:`TouchedExperts`, a ``colibri.hf`` ``Runtime.routing`` hook, or fed
by hand), measures the read figure once per round, and takes the ratio with
:func:`prefill_ratio`::

    touched = TouchedExperts()
    hf.runtime_of(model).routing = touched        # the colibri run's prefill records its experts
    ...
    bound = direct_read_time(model_dir, touched.experts)
    ratio = prefill_ratio(colibri_prefill_s, in_ram_prefill_s, bound.seconds)
    goals.check("prefill vs max(in RAM, O_DIRECT read)", ratio, f"<= {GOAL}", ratio <= GOAL)
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from colibri.checkpoint.scan import scan_model

__all__ = ["GOAL", "PROMPT_TOKENS", "TouchedExperts", "ReadBound", "expert_ranges",
           "direct_read_time", "prefill_ratio"]

GOAL = 1.3
PROMPT_TOKENS = 256
ALIGN = 4096


class TouchedExperts:
    """The experts each layer's routing chose, over the forwards of at least
    ``min_tokens`` tokens (default 2: the prefill, not the decode steps).
    Callable as ``Runtime.routing`` (layer, top_k_index, top_k_weights)."""

    def __init__(self, min_tokens: int = 2) -> None:
        self.min_tokens = min_tokens
        self.experts: dict[int, set[int]] = {}

    def __call__(self, layer: int, index: Any, weights: Any = None) -> None:
        index = np.asarray(index)
        if index.shape[0] >= self.min_tokens:
            self.experts.setdefault(int(layer), set()).update(int(e) for e in np.unique(index))

    @property
    def count(self) -> int:
        return sum(len(e) for e in self.experts.values())


@dataclass(frozen=True)
class ReadBound:
    """What reading a set of experts took: ``seconds``, the ``bytes`` read
    (their parts, merged ranges rounded out to 4 KiB), ``experts``, and
    whether the files took O_DIRECT (``direct``; False on a file system that
    refuses it, where the page cache may have served the reads)."""

    seconds: float
    bytes: int
    experts: int
    direct: bool

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


def expert_ranges(model_dir: str | os.PathLike[str], experts: Mapping[int, Iterable[int]],
                  layout: Any = "auto") -> dict[str, list[tuple[int, int]]]:
    """Each file's byte ranges holding those experts' parts (data, scales,
    extra parts), merged where they touch or overlap, rounded out to 4 KiB."""
    model = scan_model(model_dir, layout=layout)
    spans: dict[str, list[tuple[int, int]]] = {}
    for layer, chosen in experts.items():
        for e in chosen:
            for t in model.expert(layer, e).tensors():
                start = t.offset // ALIGN * ALIGN
                end = -(-(t.offset + t.nbytes) // ALIGN) * ALIGN
                spans.setdefault(model.files[t.file], []).append((start, end))
    merged: dict[str, list[tuple[int, int]]] = {}
    for path, ranges in spans.items():
        out: list[tuple[int, int]] = []
        for start, end in sorted(ranges):
            if out and start <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], end))
            else:
                out.append((start, end))
        merged[path] = out
    return merged


def _open(path: str) -> tuple[int, bool]:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    except OSError:      # a file system without O_DIRECT (tmpfs before 6.6, some FUSE)
        return os.open(path, os.O_RDONLY), False


def direct_read_time(model_dir: str | os.PathLike[str], experts: Mapping[int, Iterable[int]], *,
                     chunk: int = 8 << 20, layout: Any = "auto") -> ReadBound:
    """Reads every byte of those experts with O_DIRECT, file by file, in
    ``chunk``-byte preads of their merged ranges, and times it: the read
    figure of the prefill goal. The page cache is bypassed, so no drop of
    caches is needed before it."""
    ranges = expert_ranges(model_dir, experts, layout)
    chunk = max(ALIGN, chunk // ALIGN * ALIGN)
    buf = mmap.mmap(-1, chunk)            # page aligned, as O_DIRECT wants
    view = memoryview(buf)
    total, direct = 0, True
    start = time.perf_counter()
    try:
        for path, spans in ranges.items():
            fd, ok = _open(path)
            direct &= ok
            try:
                for lo, hi in spans:
                    for at in range(lo, hi, chunk):
                        got = os.preadv(fd, [view[:min(chunk, hi - at)]], at)
                        total += got
                        if got < min(chunk, hi - at):
                            break       # the file's end (the last range was rounded out)
            finally:
                os.close(fd)
        seconds = time.perf_counter() - start
    finally:
        view.release()
        buf.close()
    return ReadBound(seconds, total, sum(len(set(e)) for e in experts.values()), direct)


def prefill_ratio(colibri_s: float, in_ram_s: float, read_s: float) -> float:
    """colibri's prefill over the larger of the in-RAM prefill and the read
    figure: the goal is ``<= GOAL``."""
    return colibri_s / max(in_ram_s, read_s)
