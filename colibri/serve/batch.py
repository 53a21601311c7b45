"""Forward passes over several sequences at once, each row computed as it would be alone.

Two kinds of forward serve a batch:

* a **packed prefill**: the prompts of the requests that join the batch are
  laid end to end in one row (``input_ids`` of shape ``(1, P1 + P2 + ...)``),
  each with its own positions (0, 1, ... again for each prompt), so the MoE
  layers see every new token at once and lease the union of their experts
  once;
* a **decode step**: one new token for each running sequence, ``input_ids``
  of shape ``(B, 1)``, over a KV cache whose rows are left-padded to the
  longest sequence.

Attention is where a batch could change a sequence's numbers: padding,
masks and longer key ranges change the reductions. So the model runs with
the ``"colibri_rows"`` attention (registered in transformers'
``AttentionInterface``), which, while a :class:`Layout` is active, computes
attention for each prompt segment or each decode row by itself, with
colibri.hf's SDPA function (:func:`colibri.hf.attention.decode_sdpa`, or
``grouped_sdpa`` for a ``kernels="torch"`` model, then ``"colibri_rows_grouped"``) called
on exactly the shapes a lone sequence has (its own keys, no mask, causal for
a prompt). Outside a layout it is that function alone. Positions are each sequence's own. What a batch still changes is
the row count of the matrix products (projections, experts, the LM head):
CPU BLAS kernels may round a row differently depending on how many rows
share the call (docs/serve.md says what was measured).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

from colibri.hf.attention import DECODE_SDPA, GROUPED_SDPA, decode_sdpa, grouped_sdpa, register_sdpa_like

__all__ = ["ATTENTION", "GROUPED_ATTENTION", "Layout", "batchable", "use_row_attention", "BatchCache", "new_cache"]

#: The names of the per-row attention in transformers' attention and mask
#: interfaces, over decode_sdpa and over grouped_sdpa.
ATTENTION = "colibri_rows"
GROUPED_ATTENTION = "colibri_rows_grouped"


@dataclass(frozen=True)
class Layout:
    """How the rows of the current forward belong to sequences.

    ``segments``: a packed prefill, one ``(start, end)`` column range per
    prompt in the single input row. ``lengths``: a decode step, the number of
    keys (cached tokens plus the new one) each batch row attends to; its
    keys are the last ``lengths[b]`` columns of row ``b``.
    """

    segments: tuple[tuple[int, int], ...] | None = None
    lengths: tuple[int, ...] | None = None


_current = threading.local()


class active:
    """``with active(layout): model(...)``: the layout the row attention reads in this thread."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def __enter__(self) -> Layout:
        _current.layout = self.layout
        return self.layout

    def __exit__(self, *exc: object) -> None:
        _current.layout = None


def _rows_over(inner: Any) -> Any:
    """The row attention over ``inner`` (colibri.hf's SDPA function the
    model had: :func:`~colibri.hf.attention.decode_sdpa`, or
    :func:`~colibri.hf.attention.grouped_sdpa` for ``kernels="torch"``)."""

    def row_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                      **kwargs: Any) -> tuple[Any, None]:
        """``inner``, one sequence at a time while a :class:`Layout` is active."""
        import torch

        layout: Layout | None = getattr(_current, "layout", None)
        if layout is None:
            return inner(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]
        outs = []
        if layout.segments is not None:
            # One row of packed prompts: each attends causally to its own keys only.
            for start, end in layout.segments:
                out, _ = inner(module, query[:, :, start:end], key[:, :, start:end],
                               value[:, :, start:end], None, **kwargs)
                outs.append(out)
            return torch.cat(outs, dim=1), None
        assert layout.lengths is not None and len(layout.lengths) == query.shape[0]
        width = key.shape[2]
        for row, n in enumerate(layout.lengths):
            out, _ = inner(module, query[row:row + 1], key[row:row + 1, :, width - n:],
                           value[row:row + 1, :, width - n:], None, **kwargs)
            outs.append(out)
        return torch.cat(outs, dim=0), None

    return row_attention


def batchable(model: Any) -> str | None:
    """None if ``model`` can run batches row-exactly, else why not.

    It needs SDPA attention (the row attention wraps it) and only full
    attention layers (a sliding window's cache cannot be padded and merged
    the way :class:`BatchCache` does)."""
    config = model.config
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", DECODE_SDPA, GROUPED_SDPA, ATTENTION, GROUPED_ATTENTION):
        return f"its attention implementation is {impl!r}, not 'sdpa'"
    types = set(getattr(config, "layer_types", None) or ())
    if types - {"full_attention"}:
        return f"it has {', '.join(sorted(types - {'full_attention'}))} layers"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return f"it uses a sliding window of {config.sliding_window}"
    return None


def use_row_attention(model: Any) -> None:
    """Switch ``model`` (SDPA, see :func:`batchable`) to the row attention."""
    # Outside a layout the function is SDPA, so it gets SDPA's masks.
    impl = getattr(model.config, "_attn_implementation", None)
    if impl in (GROUPED_SDPA, GROUPED_ATTENTION):
        register_sdpa_like(GROUPED_ATTENTION, _rows_over(grouped_sdpa))
        model.set_attn_implementation(GROUPED_ATTENTION)
    else:
        register_sdpa_like(ATTENTION, _rows_over(decode_sdpa))
        model.set_attn_implementation(ATTENTION)


def new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _layers(cache: Any) -> list[Any]:
    return list(cache.layers)


class BatchCache:
    """The KV cache of the running batch: a transformers ``DynamicCache``
    whose row ``b`` holds sequence ``b``'s ``lengths[b]`` tokens in its last
    columns (left padding before them is never attended to).

    Rows join (:meth:`extend`) and leave (:meth:`keep`) between steps; a
    step that failed half way is undone with :meth:`rollback`."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache: Any = None
        self.lengths: list[int] = []
        self._before = 0

    @property
    def width(self) -> int:
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    def __len__(self) -> int:
        return len(self.lengths)

    def step_inputs(self) -> tuple[Any, Any, Layout]:
        """The attention mask, position ids and layout of the next decode step."""
        import torch

        width = self.width
        mask = torch.zeros(len(self.lengths), width + 1, dtype=torch.long)
        for row, n in enumerate(self.lengths):
            mask[row, width - n:] = 1
        positions = torch.tensor([[n] for n in self.lengths], dtype=torch.long)
        return mask, positions, Layout(lengths=tuple(n + 1 for n in self.lengths))

    def advanced(self) -> None:
        """Every row got one more token (after a successful step)."""
        self.lengths = [n + 1 for n in self.lengths]

    def mark(self) -> None:
        """Remember the width before a step, for :meth:`rollback`."""
        self._before = self.width

    def rollback(self) -> None:
        """Undo what a failed step appended: layers it reached lose their new column."""
        if self.cache is None:
            return
        for layer in _layers(self.cache):
            keys = getattr(layer, "keys", None)
            if keys is not None and keys.numel() and keys.shape[-2] > self._before:
                layer.crop(self._before - keys.shape[-2])

    def row(self, index: int) -> Any:
        """A new single-row cache with row ``index``'s tokens (no padding)."""
        n = self.lengths[index]
        out = new_cache(self.model)
        for layer, target in zip(_layers(self.cache), _layers(out)):
            target.update(layer.keys[index:index + 1, :, -n:].clone(),
                          layer.values[index:index + 1, :, -n:].clone())
        return out

    def extend(self, caches: Sequence[Any], lengths: Sequence[int]) -> None:
        """Append single-row caches as new rows (left-padding whichever side is shorter)."""
        import torch

        if not caches:
            return
        if self.cache is None and len(caches) == 1:
            self.cache = caches[0]
            self.lengths = [int(lengths[0])]
            return
        width = max([self.width, *lengths])
        merged = new_cache(self.model)
        sources = ([self.cache] if self.cache is not None else []) + list(caches)
        for i, target in enumerate(_layers(merged)):
            keys, values = [], []
            for src in sources:
                layer = _layers(src)[i]
                k, v = layer.keys, layer.values
                pad = width - k.shape[-2]
                if pad:
                    k = torch.cat([k.new_zeros(*k.shape[:-2], pad, k.shape[-1]), k], dim=-2)
                    v = torch.cat([v.new_zeros(*v.shape[:-2], pad, v.shape[-1]), v], dim=-2)
                keys.append(k)
                values.append(v)
            target.update(torch.cat(keys, dim=0), torch.cat(values, dim=0))
        self.cache = merged
        self.lengths = self.lengths + [int(n) for n in lengths]

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order) and drop the padding no kept row needs."""
        import torch

        if list(rows) == list(range(len(self.lengths))):
            return
        if not rows:
            self.cache = None
            self.lengths = []
            return
        lengths = [self.lengths[r] for r in rows]
        width = self.width
        start = width - max(lengths)
        index = torch.tensor(list(rows), dtype=torch.long)
        for layer in _layers(self.cache):
            layer.keys = layer.keys[index, :, start:].contiguous()
            layer.values = layer.values[index, :, start:].contiguous()
        self.lengths = lengths
