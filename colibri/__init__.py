"""colibri: stream the routed experts of huge MoE models from disk into a
bounded, leased RAM cache.

    import colibri
    with colibri.open_store("path/to/model", slots_per_layer=8) as store:
        with store.lease(layer, expert) as ex:
            y = ex.down @ (silu(ex.gate @ x) * (ex.up @ x))
"""

from colibri.errors import (
    CacheFullError,
    CacheMemoryError,
    ColibriError,
    ExpertLoadError,
    FormatError,
    LeaseError,
    StoreClosedError,
    UnknownExpertError,
    WaitTimeoutError,
)
from colibri.dequant import dequantize
from colibri.checkpoint.naming import Layout, StackedLayout
from colibri.kernels import expert_ffn, experts_ffn
from colibri.pilot import Pilot, PilotReport
from colibri.stats import StoreStats
from colibri.store import POLICIES, ExpertLease, LeaseGroup, Store, open_store
from colibri.plan import Plan, plan
from colibri.replay import ReplayResult, belady, replay
from colibri.trace import Trace, TraceRecorder
from colibri.usage import Usage

__version__ = "0.1.0"

__all__ = [
    "open_store",
    "POLICIES",
    "Store",
    "ExpertLease",
    "LeaseGroup",
    "StoreStats",
    "Layout",
    "StackedLayout",
    "dequantize",
    "expert_ffn",
    "experts_ffn",
    "Pilot",
    "PilotReport",
    "Trace",
    "TraceRecorder",
    "Usage",
    "replay",
    "belady",
    "ReplayResult",
    "plan",
    "Plan",
    "ColibriError",
    "UnknownExpertError",
    "ExpertLoadError",
    "CacheFullError",
    "CacheMemoryError",
    "LeaseError",
    "StoreClosedError",
    "FormatError",
    "WaitTimeoutError",
]
