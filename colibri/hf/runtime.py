"""What runs a model's routed experts once it is loaded: the
:class:`Runtime` (the store, PILOT with the model's own routers, progress
and routing hooks) and the experts' forward that transformers' experts
interface calls (:func:`colibri_experts_forward`).

The forward leases the union of the experts the batch chose
(``Store.lease_many``), in groups that fit the layer's slots, computes them
with the module's own gating and releases them before returning.
"""

from __future__ import annotations

import operator
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from colibri.errors import ColibriError
from colibri.pilot import Pilot
from colibri.store import Store
from colibri.torch_interop import as_torch, dequantize_torch

__all__ = ["LayerProgress", "Runtime", "RouterPilot", "colibri_experts_forward", "experts_modules"]

_EXPERTS_PATH = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts$")


@dataclass(frozen=True)
class LayerProgress:
    """One MoE layer of one forward pass, as :attr:`Runtime.progress` sees it.

    ``position`` counts MoE layers from 0 to ``layers - 1`` within a forward;
    ``tokens`` is how many token rows the layer routed, ``experts`` the size
    of their union and ``groups`` how many slot-sized lease groups it took.
    """

    layer: int
    position: int
    layers: int
    tokens: int
    experts: int
    groups: int


class RouterPilot(Pilot):
    """A :class:`Pilot` that predicts with the model's own router modules
    (softmax top-k, or sigmoid with bias and expert groups), so the
    prediction is exactly what layer L+1 would choose for layer L's input."""

    def __init__(self, store: Store, gates: dict[int, Any], top_k: dict[int, int]) -> None:
        routers = {layer: gate.weight.detach().float().cpu().numpy() for layer, gate in gates.items()}
        super().__init__(store, routers, top_k=max(top_k.values()), extra=0)
        self._gates = gates

    def predict(self, layer: int, hidden: Any) -> tuple[int, ...]:
        gate = self._gates.get(operator.index(layer))
        if gate is None or hidden.shape[0] == 0:
            return ()
        import torch

        with torch.no_grad():
            _, _, index = gate(hidden)
        chosen, votes = torch.unique(index, return_counts=True)
        order = torch.argsort(votes, descending=True, stable=True)
        return tuple(int(e) for e in chosen[order].tolist())


class Runtime:
    """What :func:`from_pretrained` attached to a model: the store, the
    PILOT (None when prefetch is off), and hooks for progress and routing
    traces. Reach it with :func:`runtime_of`."""

    def __init__(self, store: Store, pilot: RouterPilot | None, moe_layers: tuple[int, ...]) -> None:
        self.store = store
        self.pilot = pilot
        self.moe_layers = moe_layers
        self._position = {layer: i for i, layer in enumerate(moe_layers)}
        #: Called after each MoE layer with a :class:`LayerProgress` (e.g. a prefill progress bar).
        self.progress: Callable[[LayerProgress], None] | None = None
        #: Called with (layer, top_k_index (tokens, k) int64 numpy, top_k_weights float32 numpy).
        self.routing: Callable[[int, np.ndarray, np.ndarray], None] | None = None
        self._predicted: dict[int, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the store (idempotent). The model cannot run its MoE layers afterwards."""
        self.store.close()

    @property
    def closed(self) -> bool:
        return self.store.closed

    # -- the experts forward --

    def _order(self, layer: int, union: list[int]) -> list[int]:
        # Experts PILOT predicted for this layer first: they are the likeliest
        # to be resident, so they are used before later groups evict anything.
        predicted = self._predicted.pop(layer, ())
        if not predicted:
            return union
        wanted = set(union)
        first = [e for e in predicted if e in wanted]
        rest = [e for e in union if e not in set(first)]
        return first + rest

    def experts_forward(self, module: Any, layer: int, hidden_states: Any, top_k_index: Any,
                        top_k_weights: Any) -> Any:
        import torch
        store = self.store
        if store.closed:
            raise ColibriError(f"layer {layer}: the model's colibri store is closed "
                               "(colibri_close() was called)")
        tokens, k = top_k_index.shape
        hidden_dim = hidden_states.shape[-1]
        if self.routing is not None:
            self.routing(layer, top_k_index.detach().cpu().numpy().astype(np.int64),
                         top_k_weights.detach().float().cpu().numpy())
        # Which (token, position) pairs chose each expert, in one pass over a
        # small host list (cheaper than a torch.where per expert at decode).
        rows: dict[int, tuple[list[int], list[int]]] = {}
        for t, chosen in enumerate(top_k_index.tolist()):
            for j, e in enumerate(chosen):
                r = rows.get(e)
                if r is None:
                    r = rows[e] = ([], [])
                r[0].append(t)
                r[1].append(j)
        union = sorted(rows)
        pilot = self.pilot
        if pilot is not None:
            pilot.observe(layer, union)
        order = self._order(layer, union)
        slots = store.slots(layer)
        groups = [order[i:i + slots] for i in range(0, len(order), slots)]
        out_dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
        out = torch.zeros(tokens, k, hidden_dim, dtype=out_dtype, device=hidden_states.device)
        ffn = _expert_ffn(module)
        compute_dtype = hidden_states.dtype
        for g, group in enumerate(groups):
            with store.lease_many(layer, group) as leased:
                if g == 0 and pilot is not None:
                    nxt = pilot.next_layer(layer)
                    if nxt is not None:
                        predicted = pilot.predict_next(layer, hidden_states)
                        self._predicted[nxt] = predicted
                for ex in leased:
                    ts, js = rows[ex.key[1]]
                    weights = _weights(ex, compute_dtype)
                    if len(ts) == 1:
                        t, j = ts[0], js[0]
                        x = hidden_states[t:t + 1]
                        y = ffn(x, *weights)
                        # a 1-element weight, not a 0-d one: bf16 * f32 must promote as in transformers
                        out[t, j] = (y[0] * top_k_weights[t, j:j + 1]).to(out_dtype)
                    else:
                        token_idx = torch.tensor(ts, device=hidden_states.device)
                        pos = torch.tensor(js, device=hidden_states.device)
                        x = hidden_states[token_idx]
                        y = ffn(x, *weights)
                        out[token_idx, pos] = (y * top_k_weights[token_idx, pos, None]).to(out_dtype)
                    del weights
        if self.progress is not None:
            self.progress(LayerProgress(layer, self._position[layer], len(self.moe_layers),
                                        tokens, len(union), len(groups)))
        return out.sum(dim=1).to(hidden_states.dtype)


_Weights = tuple[Any, Any, Any, Any, Any, Any]


def _weights(ex: Any, dtype: Any) -> _Weights:
    """gate, up, down and their biases (None where the checkpoint has none)
    of a leased expert as torch tensors of ``dtype``, in the Mixtral
    orientation: the leased bytes themselves where the file has them so,
    otherwise dequantized (fused or (in, out) layouts, FP8, MXFP4, int4,
    GPTQ, AWQ, biases) into fresh tensors that live only for this expert."""
    info = ex.tensors
    if not info.format.zero_copy or info.fused or info.transposed or info.biased:
        w = dequantize_torch(ex)
        gate, up, down = (w[role].to(dtype) for role in ("gate", "up", "down"))
        biases = (w.get(f"{role}_bias") for role in ("gate", "up", "down"))
        gate_b, up_b, down_b = (None if b is None else b.to(dtype) for b in biases)
        return gate, up, down, gate_b, up_b, down_b
    gate, up, down = (_weight(ex, role, dtype) for role in ("gate", "up", "down"))
    return gate, up, down, None, None, None


def _expert_ffn(module: Any) -> Callable[..., Any]:
    """One expert's computation as ``module`` defines it: x -> down(gate(x) ... up(x)).

    Modules with transformers' default gating (``act_fn(gate) * up``) take
    the direct path; a module with its own ``_apply_gate`` (gpt-oss's clamped
    SwiGLU with ``up + 1``) gets the gate and up projections assembled in its
    own layout (interleaved or concatenated) and gates them itself."""
    import torch
    import torch.nn.functional as F

    custom = getattr(type(module), "_apply_gate", None)
    if custom is not None and custom is not _default_apply_gate():
        interleaved = not getattr(module, "is_concatenated", True)
        apply_gate = module._apply_gate

        def gated(x: Any, gate: Any, up: Any, down: Any, gate_b: Any, up_b: Any, down_b: Any) -> Any:
            g, u = F.linear(x, gate, gate_b), F.linear(x, up, up_b)
            gate_up = torch.stack((g, u), dim=-1).flatten(-2) if interleaved else torch.cat((g, u), dim=-1)
            return F.linear(apply_gate(gate_up), down, down_b)

        return gated
    act = module.act_fn

    def plain(x: Any, gate: Any, up: Any, down: Any, gate_b: Any, up_b: Any, down_b: Any) -> Any:
        return F.linear(act(F.linear(x, gate, gate_b)) * F.linear(x, up, up_b), down, down_b)

    return plain


def _default_apply_gate() -> Any:
    """transformers' default gating function (None where it has none)."""
    from transformers.integrations import moe

    return getattr(moe, "_default_apply_gate", None)


def _weight(ex: Any, role: str, dtype: Any) -> Any:
    """A leased float role as a torch tensor of ``dtype``: shared when the
    file already has that dtype, otherwise converted into a fresh tensor
    that lives only for this expert."""
    t = as_torch(getattr(ex, role))
    return t if t.dtype == dtype else t.to(dtype)


def colibri_experts_forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """The ``"colibri"`` entry of transformers' ``ExpertsInterface``."""
    binding = getattr(self, "colibri_binding", None)
    if binding is None:
        raise ColibriError(
            "experts_implementation='colibri' needs a model made by colibri.hf.from_pretrained")
    runtime, layer = binding
    return runtime.experts_forward(self, layer, hidden_states, top_k_index, top_k_weights)


def experts_modules(model: Any) -> dict[int, Any]:
    """The routed-experts module of each MoE layer of ``model``, by layer."""
    found: dict[int, Any] = {}
    for name, module in model.named_modules():
        m = _EXPERTS_PATH.search(name)
        if m is not None and (hasattr(module, "act_fn") or hasattr(module, "_apply_gate")):
            found[int(m.group(1))] = module
    return found
