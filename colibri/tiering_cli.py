"""`colibri replay` and `colibri plan`: cache policies and budgets on a routing trace.

    colibri replay TRACE (--model PATH | --experts N) --budget 12.5%,25%,50% --policy lru,... [--usage HISTORY]
    colibri plan HISTORY (--model PATH | --experts N) --budget 25% [--top-k K]

A budget is a share of each layer's experts (``25%``), a slot count per
layer (``32``) or, with ``--model``, bytes (``12GiB``, ``3.5e9``).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any, Sequence

from colibri.errors import FormatError

__all__ = ["add_commands"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
#: A trace with more lookups than this shows a progress bar.
_LONG = 200_000


@dataclass(frozen=True)
class _Model:
    num_experts: int
    expert_nbytes: dict[int, int] | None  # None: no model, budgets in shares or slots


def _model_for(trace: Any, args: argparse.Namespace) -> _Model:
    if args.model:
        from colibri.checkpoint.scan import scan_model

        m = scan_model(args.model)
        layers = trace.layers.tolist()
        missing = [l for l in layers if l not in m.layers]
        if missing:
            raise FormatError(f"{args.model}: the trace's layers {missing} have no routed experts there")
        counts = {m.num_experts(l) for l in layers}
        if len(counts) != 1 or counts.pop() < trace.num_experts:
            raise FormatError(f"{args.model}: experts per layer do not match the trace's {trace.num_experts}")
        return _Model(m.num_experts(layers[0]), {l: m.expert_nbytes(l) for l in layers})
    n = int(args.experts)
    if n < trace.num_experts:
        raise FormatError(f"--experts {n}, but the trace names experts up to {trace.num_experts - 1}")
    return _Model(n, None)


def _slots_for(text: str, model: _Model, n_layers: int) -> tuple[str, int, int | None]:
    """(label, slots per layer, bytes or None) of one budget."""
    t = text.strip()
    if t.endswith("%"):
        share = float(t[:-1]) / 100
        if not 0 < share <= 1:
            raise FormatError(f"budget {text!r}: a share must be in (0%, 100%]")
        return t, max(1, int(model.num_experts * share)), None
    m = re.fullmatch(r"([0-9.eE+]+)\s*([KMGT]?I?B)?", t, flags=re.IGNORECASE)
    if not m:
        raise FormatError(f"budget {text!r}: give a share (25%), slots per layer (32) or bytes (12GiB)")
    unit = (m.group(2) or "").upper()
    if not unit and "." not in m.group(1) and "e" not in m.group(1).lower():
        return f"{int(m.group(1))} slots", int(m.group(1)), None
    if model.expert_nbytes is None:
        raise FormatError(f"budget {text!r} in bytes needs --model")
    nbytes = int(float(m.group(1)) * _UNITS[unit])
    per = nbytes // sum(model.expert_nbytes.values())
    return t, max(1, per), nbytes


def _replay_cmd(args: argparse.Namespace) -> int:
    from colibri.plan import available_policies
    from colibri.replay import belady, replay
    from colibri.trace import Trace

    trace = Trace.load(args.trace)
    model = _model_for(trace, args)
    history = _load_history(args.usage) if args.usage else None
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    known = available_policies()
    unknown = [p for p in policies if p not in known]
    if unknown:
        raise FormatError(f"unknown policy {', '.join(unknown)}; this build replays {', '.join(known)}")
    if "lru" not in policies:
        policies.insert(0, "lru")
    budgets = [_slots_for(b, model, len(trace.layers)) for b in args.budget.split(",") if b.strip()]
    k = max(1, max(_widest_all(trace)))
    lookups = trace.requests * len(budgets) * (len(policies) + 1)
    bar = _progress(total=lookups, enabled=args.progress or (args.progress is None and lookups > _LONG))
    print(f"{args.trace}: {len(trace)} tokens x {len(trace.layers)} layers, top-{trace.top_k} of "
          f"{model.num_experts}, {trace.requests:,} requests")
    if history is not None:
        print(f"warm start from {args.usage}: every layer's unpinned slots start with its hottest experts; "
              "Belady may fill every slot for free too")
    rows: list[tuple[str, int, dict[str, float], float]] = []
    for label, slots, _ in budgets:
        eff = min(max(slots, k), model.num_experts)
        note = f" (raised to top-k {k})" if slots < k else ""
        best = belady(trace, eff, warm=history is not None).hit_rate
        bar.update(trace.requests)
        rates: dict[str, float] = {}
        for pol in policies:
            rates[pol] = replay(trace, slots_per_layer=eff, policy=pol, usage=history).hit_rate
            bar.update(trace.requests)
        rows.append((label, eff, rates, best))
        bar.write(f"\nbudget {label}: {eff} slots per layer{note}")
        bar.write(f"  {'policy':<14} {'hit rate':>9} {'gap closed':>11}")
        lru = rates["lru"]
        for pol, hr in rates.items():
            gap = "" if best - lru <= 1e-12 else f"{(hr - lru) / (best - lru):>10.1%}"
            bar.write(f"  {pol:<14} {hr:>9.4f} {gap:>11}")
        bar.write(f"  {'belady':<14} {best:>9.4f} {'100.0%' if best - lru > 1e-12 else '':>11}")
    bar.close()
    if args.plot:
        _plot(args.plot, rows, args.trace)
        print(f"wrote {args.plot}")
    return 0


def _widest_all(trace: Any) -> list[int]:
    from colibri.replay import most_distinct

    return most_distinct(trace)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def write(self, text: str) -> None:
        print(text)

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: no bar then
        return _NoBar()
    return tqdm(total=total, unit="lookup", unit_scale=True, leave=False)


def _plot(path: str, rows: Sequence[tuple[str, int, dict[str, float], float]], title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FormatError("--plot needs matplotlib: pip install 'colibri[plot]'") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r[1] for r in rows]
    for pol in rows[0][2]:
        ax.plot(xs, [r[2][pol] for r in rows], marker="o", label=pol)
    ax.plot(xs, [r[3] for r in rows], marker="s", linestyle="--", color="black", label="Belady (optimum)")
    ax.set_xlabel("slots per layer")
    ax.set_ylabel("hit rate")
    ax.set_title(title.rsplit("/", 1)[-1], fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _load_history(path: str) -> Any:
    """A routing trace, or else a usage file: whichever ``path`` is."""
    from colibri.trace import Trace
    from colibri.usage import Usage

    try:
        return Trace.load(path)
    except FormatError as as_trace:
        try:
            return Usage.load(path)
        except FormatError:
            raise as_trace from None


def _plan_cmd(args: argparse.Namespace) -> int:
    from colibri.plan import plan
    from colibri.trace import Trace

    history = _load_history(args.history)
    if isinstance(history, Trace):
        model = _model_for(history, args)
    else:
        model = _Model(int(args.experts or max(history.num_experts(l) for l in history.layers)), None)
    label, slots, nbytes = _slots_for(args.budget, model, 0)
    layers = history.layers.tolist() if isinstance(history, Trace) else list(history.layers)
    per = model.expert_nbytes or {l: 1 for l in layers}
    capacity = nbytes if nbytes is not None else slots * sum(per.values())
    p = plan(history, capacity, expert_nbytes=per, top_k=args.top_k, pins=not args.no_pins)
    print(f"budget {label}: {capacity:,} {'bytes' if model.expert_nbytes else 'slots'}")
    print(p)
    kwargs = p.open_store_kwargs()
    text = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    print(f"open_store options: {text}")
    return 0


def add_commands(sub: Any) -> None:
    """Register `replay` and `plan` on the CLI's subparsers."""
    r = sub.add_parser("replay", help="hit rates of cache policies and Belady's optimum on a routing trace")
    r.add_argument("trace", help="a routing trace .npz (colibri.Trace)")
    g = r.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", help="the model's checkpoint (experts per layer and their bytes)")
    g.add_argument("--experts", type=int, help="routed experts per layer")
    r.add_argument("--budget", default="12.5%,25%,50%",
                   help="comma-separated budgets: shares (25%%), slots per layer (32) or bytes (12GiB)")
    r.add_argument("--policy", default="lru", help="comma-separated eviction policies")
    r.add_argument("--usage", metavar="HISTORY",
                   help="a routing trace or usage file: start every replay warm from its hottest experts, as "
                        "open_store(usage_file=..., warm_start=True) does, against Belady's warm bound")
    r.add_argument("--plot", metavar="FILE.png", help="draw hit rate against budget (needs matplotlib)")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: on long traces)")
    r.set_defaults(func=_replay_cmd)
    p = sub.add_parser("plan", help="per-layer slots, pins and policy for a budget, from a trace or usage file")
    p.add_argument("history", help="a routing trace .npz or a usage file")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", help="the model's checkpoint (experts per layer and their bytes)")
    g.add_argument("--experts", type=int, help="routed experts per layer")
    p.add_argument("--budget", required=True, help="a share (25%%), slots per layer (32) or bytes (12GiB)")
    p.add_argument("--top-k", type=int, default=None, help="experts per token (needed for a usage file)")
    p.add_argument("--no-pins", action="store_true", help="never pin experts")
    p.set_defaults(func=_plan_cmd)
