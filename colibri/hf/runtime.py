"""What runs a model's routed experts once it is loaded: the
:class:`Runtime` (the store, PILOT with the model's own routers, progress
and routing hooks) and the experts' forward that transformers' experts
interface calls (:func:`colibri_experts_forward`).

The forward leases the union of the experts the batch chose
(``Store.lease_many``), in groups that fit the layer's slots, and releases
them before returning. By default (``kernels="native"``) each group is one
call of colibri's kernels over all its (token, expert) rows, straight from
the slots; ``kernels="torch"`` dequantizes each leased expert to torch
tensors and runs the module's own gating. A union larger than the cache
streams through it once: with I/O workers, half the slots hold the group
that computes while the next group is prefetched into the other half. With
workers, a union that fits computes its resident experts first while the
others load.
"""

from __future__ import annotations

import operator
import re
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from colibri.errors import ColibriError, UnknownExpertError
from colibri.pilot import Pilot
from colibri.store import LeaseGroup, Store
from colibri.hf.linears import DECODE_ROWS
from colibri.kernels import moe_combine, moe_ffn, torch_threads
from colibri.moe import LayerStream
from colibri.one_token_moe import OneTokenMoe
from colibri.torch_interop import as_torch, dequantize_torch

__all__ = ["KERNELS", "DecodeThreads", "LayerProgress", "OneTokenBlas", "Runtime", "RouterPilot", "colibri_experts_forward",
           "experts_modules"]

#: How the routed experts are computed: colibri's native kernels straight from
#: the slots (the default), or dequantized to torch tensors per lease.
KERNELS: tuple[str, ...] = ("native", "torch")

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
        """The experts of ``layer`` that ``hidden`` routes to, most voted
        first, at most as many as the layer has slots (a prefill's union may
        be larger: prefetching more would evict what was just prefetched)."""
        gate = self._gates.get(operator.index(layer))
        if gate is None or hidden.shape[0] == 0:
            return ()
        import torch

        with torch.no_grad():
            _, _, index = gate(hidden)
        # In Python: a decode step's few ids count faster than torch's unique and sort.
        votes = Counter(index.reshape(-1).tolist())
        ranked = sorted(votes, key=lambda e: (-votes[e], e))
        return tuple(ranked[:self._store.slots(layer)])


class Runtime:
    """What :func:`from_pretrained` attached to a model: the store, the
    PILOT (None when prefetch is off), and hooks for progress and routing
    traces. Reach it with :func:`runtime_of`."""

    def __init__(self, store: Store, pilot: RouterPilot | None, moe_layers: tuple[int, ...],
                 kernels: str = "native") -> None:
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, not {kernels!r}")
        self.store = store
        #: "native": routed experts computed by colibri's kernels from the slots; "torch": dequantized
        self.kernels = kernels
        self.pilot = pilot
        self.moe_layers = moe_layers
        self._position = {layer: i for i, layer in enumerate(moe_layers)}
        #: Called after each MoE layer with a :class:`LayerProgress` (e.g. a prefill progress bar).
        self.progress: Callable[[LayerProgress], None] | None = None
        #: How many non-expert linear layers compute from the checkpoint's packed bytes
        #: (colibri.hf.linears.pack_linears; 0 with kernels="torch").
        self.packed_linears = 0
        #: How many float linear layers compute forwards of a few rows with colibri's kernel
        #: (colibri.hf.linears.use_decode_linears; 0 with kernels="torch" or decode_linears=False).
        self.decode_linears = 0
        #: How many RMS norms compute a forward of a few rows natively
        #: (colibri.hf.norms.use_decode_norms; 0 with kernels="torch" or decode_norms=False).
        self.decode_norms = 0
        #: How many softmax top-k routers route a forward of a few rows natively
        #: (colibri.hf.routers.use_decode_routers; 0 with kernels="torch" or decode_routers=False).
        self.decode_routers = 0
        #: How many modeling modules' rotary embedding computes one-token calls natively
        #: (colibri.hf.rotary.use_decode_rotary; 0 with kernels="torch" or decode_rotary=False).
        self.decode_rotary = 0
        #: How many decoder layers compute a one-token step in one lean forward
        #: (colibri.hf.decode_layers.use_decode_layers; 0 with kernels="torch" or decode_layers=False).
        self.decode_layers = 0
        #: True when a forward of one token runs with oneDNN off (from_pretrained's decode_blas).
        self.decode_blas = False
        #: True when a forward of a few rows gives torch's threads to the kernels (decode_threads).
        self.decode_threads = False
        #: True when a DynamicCache given to the model appends in place (grow_kv_cache).
        self.grow_kv_cache = False
        #: Called with (layer, top_k_index (tokens, k) int64 numpy, top_k_weights float32 numpy).
        self.routing: Callable[[int, np.ndarray, np.ndarray], None] | None = None
        self._predicted: dict[int, tuple[int, ...]] = {}
        # Each layer's kernel activation (None: the torch path), asked once.
        self._activations: dict[int, tuple[str, float, float] | None] = {}
        # Each layer's native calls for one token (one_token_experts).
        self._one_token: dict[int, OneTokenMoe] = {}
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
        taken = set(first)
        return first + [e for e in union if e not in taken]

    def experts_forward(self, module: Any, layer: int, hidden_states: Any, top_k_index: Any,
                        top_k_weights: Any) -> Any:
        store = self.store
        if store.closed:
            raise ColibriError(f"layer {layer}: the model's colibri store is closed "
                               "(colibri_close() was called)")
        if self.routing is not None:
            self.routing(layer, top_k_index.detach().cpu().numpy().astype(np.int64),
                         top_k_weights.detach().float().cpu().numpy())
        index = top_k_index.detach().to(device="cpu", dtype=_torch().int64).contiguous()
        union = shared_first(layer, index.numpy())
        stream = self._stream(layer, union)
        kernel = self._kernel_of(layer, module)
        if kernel is None:
            out = self._forward_torch(module, layer, hidden_states, top_k_weights, _Pairs(index), stream)
        else:
            out = self._forward_native(kernel, layer, hidden_states, top_k_weights, index, stream)
        self._report(layer, int(index.shape[0]), union, stream)
        return out

    def one_token_experts(self, module: Any, layer: int, x: Any, index: Any, weights: Any) -> Any:
        """:meth:`experts_forward` of one token whose ``index`` ``(1, k)``
        names k distinct experts, with the native calls of the layer built
        once (:class:`~colibri.one_token_moe.OneTokenMoe`): the same store
        calls in the same order, the same bits. ``x`` is ``(1, hidden)``
        float32 or bfloat16, ``index`` int64 and ``weights`` float32 or
        bfloat16, contiguous CPU tensors. Returns the ``(1, hidden)`` output
        in ``x``'s dtype, or None when the call is not one of those (the
        caller then calls the module): a routing hook, the torch path,
        repeated experts, or a closed store (whose module call raises)."""
        if self.routing is not None or self.store.closed:
            return None
        kernel = self._kernel_of(layer, module)
        union = index[0].tolist()
        if kernel is None or len(set(union)) != len(union) or min(union) < 0:
            return None
        step = self._one_token.get(layer)
        if step is None or step.k != len(union) or (step.activation, step.alpha, step.limit) != kernel:
            step = self._one_token[layer] = OneTokenMoe(len(union), int(x.shape[-1]), *kernel)
        if not step.fits(x, index):
            return None
        stream = self._stream(layer, union)
        for leased in self._groups(stream, layer, x):
            step.ffn(leased, x, index)
        out = step.combine(weights, _torch().empty((1, step.hidden), dtype=x.dtype))
        self._report(layer, 1, union, stream)
        return out

    def _stream(self, layer: int, union: list[int]) -> LayerStream:
        """The layer's union of experts through its cache (a union larger
        than the cache streams through it), after PILOT's guess for the layer
        is scored against it; the guessed experts are leased first."""
        if self.pilot is not None:
            self.pilot.observe(layer, sorted(union))
        return LayerStream(self.store, layer, self._order(layer, union))

    def _groups(self, stream: LayerStream, layer: int, hidden_states: Any) -> Iterator[LeaseGroup]:
        """The stream's lease groups; once the first is leased, PILOT
        predicts the next layer's experts from ``hidden_states``."""
        for g, leased in enumerate(stream):
            if g == 0:
                self._predict(layer, hidden_states)
            yield leased

    def _report(self, layer: int, tokens: int, union: list[int], stream: LayerStream) -> None:
        if self.progress is not None:
            self.progress(LayerProgress(layer, self._position[layer], len(self.moe_layers), tokens, len(union),
                                        len(stream)))

    def _kernel_of(self, layer: int, module: Any) -> tuple[str, float, float] | None:
        """How the native kernel computes ``module``'s experts: (activation,
        alpha, limit), or None for the torch path (kernels="torch", or gating
        the kernels do not have). Asked once per layer."""
        if self.kernels == "torch":
            return None
        if layer not in self._activations:
            self._activations[layer] = _kernel_activation(module)
        return self._activations[layer]

    def _predict(self, layer: int, hidden_states: Any) -> None:
        pilot = self.pilot
        if pilot is None:
            return
        nxt = pilot.next_layer(layer)
        if nxt is not None:
            self._predicted[nxt] = pilot.predict_next(layer, hidden_states)

    def _forward_torch(self, module: Any, layer: int, hidden_states: Any, top_k_weights: Any,
                       pairs: "_Pairs", stream: LayerStream) -> Any:
        """Each leased expert dequantized to torch tensors and run with the
        module's own gating (``kernels="torch"``)."""
        import torch

        tokens, k = pairs.tokens, pairs.k
        out_dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
        out = torch.zeros(tokens, k, hidden_states.shape[-1], dtype=out_dtype,
                          device=hidden_states.device)
        ffn = _expert_ffn(module)
        compute_dtype = hidden_states.dtype
        for leased in self._groups(stream, layer, hidden_states):
            for ex in leased:
                ts, js = pairs.rows[ex.key[1]]
                weights = _weights(ex, compute_dtype)
                if len(ts) == 1:
                    t, j = ts[0], js[0]
                    y = ffn(hidden_states[t:t + 1], *weights)
                    # a 1-element weight, not a 0-d one: bf16 * f32 must promote as in transformers
                    out[t, j] = (y[0] * top_k_weights[t, j:j + 1]).to(out_dtype)
                else:
                    token_idx = torch.tensor(ts, device=hidden_states.device)
                    pos = torch.tensor(js, device=hidden_states.device)
                    y = ffn(hidden_states[token_idx], *weights)
                    out[token_idx, pos] = (y * top_k_weights[token_idx, pos, None]).to(out_dtype)
                del weights
        return out.sum(dim=1).to(hidden_states.dtype)

    def _forward_native(self, kernel: tuple[str, float, float], layer: int, hidden_states: Any,
                        top_k_weights: Any, index: Any, stream: LayerStream) -> Any:
        """Each lease group's (token, position) pairs computed in one native
        call straight from the slots, each pair into its own row (moe_ffn),
        then each token's rows weighted and added in routing order
        (moe_combine): a token's sum is the same bits alone or in any batch."""
        torch = _torch()
        activation, alpha, limit = kernel
        x = hidden_states
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        if x.stride(-1) != 1:
            x = x.contiguous()
        tokens, k = (int(n) for n in index.shape)
        pairs = torch.empty(tokens * k, x.shape[-1], dtype=torch.float32)
        for leased in self._groups(stream, layer, hidden_states):
            moe_ffn(leased, x, index, pairs, activation=activation, alpha=alpha, limit=limit)
        w = top_k_weights.detach()
        if w.dtype not in (torch.float32, torch.bfloat16):
            w = w.float()
        out_dtype = hidden_states.dtype if hidden_states.dtype in (torch.float32, torch.bfloat16) \
            else torch.float32
        out = moe_combine(pairs, w.contiguous(), torch.empty(tokens, x.shape[-1], dtype=out_dtype))
        return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)


def shared_first(layer: int, index: np.ndarray) -> list[int]:
    """The experts a batch's routing ``index`` ((tokens, k) int64) chose,
    each once, in lease order: experts more of the batch's pairs chose
    first, then the better ranked (the sum of 1 / (1 + position) over their
    pairs), then by number. When the union streams through the cache in
    groups, the shared experts are leased once, early, before later groups
    evict anything. (One token's k distinct experts: its routing order.)"""
    tokens, k = index.shape
    if tokens == 1:
        chosen = index[0].tolist()
        if len(set(chosen)) == k and min(chosen) >= 0:
            return chosen
    flat = index.reshape(-1)
    if flat.size and int(flat.min()) < 0:
        raise UnknownExpertError(f"layer {layer} has no expert {int(flat.min())}")
    counts = np.bincount(flat)
    # float64 sums in pair order, as the rank is defined
    rank = np.bincount(flat, weights=np.tile(1.0 / np.arange(1, k + 1), tokens))
    union = np.flatnonzero(counts)
    return union[np.lexsort((union, -rank[union], -counts[union]))].tolist()


def _torch() -> Any:
    import torch

    return torch


class OneTokenBlas:
    """Forward hooks that run a forward of one token (a batch-1 decode
    step) with oneDNN off (``torch.backends.mkldnn``), so that torch
    computes the bfloat16 linear layers (attention, routers, the LM head)
    with MKL's matrix-vector product instead of oneDNN's matmul: on one
    row, read once from memory, the former is about twice as fast on the
    CPUs measured (docs/hf.md). Forwards of more rows are untouched (there
    oneDNN is far faster), and the flag is put back after the forward, even
    when it raises. The flag is process-wide: another thread's forward that
    runs meanwhile computes the same, only possibly slower."""

    def __init__(self) -> None:
        self._flipped = threading.local()

    def _stack(self) -> list[bool]:
        stack = getattr(self._flipped, "stack", None)
        if stack is None:
            stack = self._flipped.stack = []
        return stack

    def before(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        mkldnn = _torch().backends.mkldnn
        flip = _rows(args, kwargs) == 1 and bool(mkldnn.enabled)
        if flip:
            try:
                mkldnn.enabled = False
            except RuntimeError:        # torch's global flags frozen (its own test suite)
                flip = False
        self._stack().append(flip)

    def after(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        stack = self._stack()
        if stack and stack.pop():
            _torch().backends.mkldnn.enabled = True

    @staticmethod
    def wanted(model: Any) -> bool:
        """Whether a model gains from it: bfloat16 weights, and a torch with MKL (its gemv) and oneDNN."""
        torch = _torch()
        return (getattr(model, "dtype", None) == torch.bfloat16 and torch.backends.mkl.is_available()
                and torch.backends.mkldnn.is_available())


class DecodeThreads:
    """Forward hooks that run a forward of at most
    :data:`~colibri.hf.linears.DECODE_ROWS` token rows (a decode step) with
    torch on one thread in the calling thread and colibri's kernels on
    ``torch.get_num_threads()`` threads (:func:`colibri.kernels.torch_threads`).
    In such a step the kernels compute every expert and linear layer; what
    torch has left are small ops, which gain nothing from more threads,
    while its OpenMP workers, spinning after each op, would take the cores
    the kernels' workers need (measured on 2 cores: a 4-bit step 15-20%
    slower on 2 threads than on 1; with these hooks 1.15x faster than on 1,
    docs/hf.md). ``torch.set_num_threads`` is put back after the forward,
    even when it raises. What torch.get_num_threads() reads is process-wide:
    another thread's kernel call that takes its count from torch during the
    step runs on one thread (OpenMP's own count changes in the calling
    thread only)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _stack(self) -> list[tuple[Any, int]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def before(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        torch = _torch()
        threads = int(torch.get_num_threads())
        block = None
        if threads > 1 and 0 < _rows(args, kwargs) <= DECODE_ROWS:
            block = torch_threads(threads)
            block.__enter__()
            torch.set_num_threads(1)
        self._stack().append((block, threads))

    def after(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        stack = self._stack()
        if not stack:
            return
        block, threads = stack.pop()
        if block is not None:
            _torch().set_num_threads(threads)
            block.__exit__(None, None, None)


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Token rows of a causal LM forward's input (input_ids or inputs_embeds); -1 when unknown."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is not None:
        return int(ids.numel())
    embeds = kwargs.get("inputs_embeds")
    if embeds is not None and embeds.dim() >= 1 and embeds.shape[-1]:
        return int(embeds.numel() // embeds.shape[-1])
    return -1


class _Pairs:
    """The (token, position) pairs of a batch's routing, by expert (the torch path)."""

    def __init__(self, index: Any) -> None:
        self.tokens, self.k = (int(n) for n in index.shape)
        # Which (token, position) pairs chose each expert, in one pass over a
        # small host list (cheaper than a torch.where per expert at decode).
        rows: dict[int, tuple[list[int], list[int]]] = {}
        for t, chosen in enumerate(index.tolist()):
            for j, e in enumerate(chosen):
                r = rows.get(e)
                if r is None:
                    r = rows[e] = ([], [])
                r[0].append(t)
                r[1].append(j)
        self.rows = rows


def _kernel_activation(module: Any) -> tuple[str, float, float] | None:
    """(activation, alpha, limit) of the native kernel that computes what
    ``module``'s gating computes, or None when the kernels have no such
    gating: transformers' default ``act_fn(gate) * up`` with SiLU, and
    gpt-oss's clamped SwiGLU (its own ``_apply_gate``)."""
    custom = getattr(type(module), "_apply_gate", None)
    if custom is not None and custom is not _default_apply_gate():
        if type(module).__name__ == "GptOssExperts" and hasattr(module, "alpha"):
            return ("gpt_oss", float(module.alpha), float(module.limit))
        return None
    act = getattr(module, "act_fn", None)
    if type(act).__name__ in ("SiLU", "SiLUActivation"):
        return ("silu", 1.702, 7.0)
    return None


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
