"""Store counters as a frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of the store's counters (exact meanings: docs/contract.md, "Stats").

    Without load failures ``requests == hits + misses``; always
    ``resident_bytes <= capacity_bytes`` and ``prefetch_hits <= prefetched``.
    """

    requests: int
    hits: int
    misses: int
    prefetched: int
    prefetch_hits: int
    bytes_read: int
    resident_bytes: int
    capacity_bytes: int
    persistent_hits: int
    transient_hits: int
    inflight_joins: int
    loads_started: int
    loads_failed: int
    evictions: int
    slot_waits: int
    peak_inflight: int
    #: prefetch read chunks that paused for a demand read (``demand_first``)
    prefetch_pauses: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / requests (0.0 before the first request)."""
        return self.hits / self.requests if self.requests else 0.0

    @property
    def prefetch_hit_rate(self) -> float:
        """prefetch_hits / prefetched (0.0 before the first prefetch)."""
        return self.prefetch_hits / self.prefetched if self.prefetched else 0.0

    @classmethod
    def from_c(cls, c_stats: Any, **extra: int) -> "StoreStats":
        """From a ColiExpertStoreStats, plus counters kept outside it."""
        found = {f.name: int(getattr(c_stats, f.name)) for f in fields(cls)
                 if f.name not in extra and hasattr(c_stats, f.name)}
        return cls(**found, **extra)

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self)}
        d["hit_rate"] = self.hit_rate
        d["prefetch_hit_rate"] = self.prefetch_hit_rate
        return d
