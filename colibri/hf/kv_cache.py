"""A key/value cache layer that appends in place.

transformers' ``DynamicLayer`` appends a step's keys and values with
``torch.cat``, which copies the whole cache at every step: at 2048 cached
tokens that copy costs more than the step's attention, so decoding slows
down with the length of the conversation. :class:`GrowingLayer` keeps them
in a buffer with room to spare (a quarter more than it holds, at least 256
tokens) and returns views of its filled part: the same values, so the same
attention and the same logits, with a copy only when the buffer is full.

A buffer is used again only while the layer's tensors are still views of
it (checked at every append); when anything replaced them (beam search's
reordering, a batch selection) the next append starts a new buffer from
what the layer holds. Tensors returned by earlier steps stay valid while
the cache only grows; after a ``crop``, the next appends overwrite the
cropped positions in place, as a static cache does.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["SPARE_TOKENS", "grow_given_cache", "grow_in_place", "growing_layer_class"]

#: Room a new buffer leaves: at least this many tokens, or a quarter more than it holds.
SPARE_TOKENS = 256

_class_lock = threading.Lock()
_classes: dict[str, Any] = {}


def growing_layer_class() -> Any:
    """The ``DynamicLayer`` subclass whose appends write in place (made on
    first use, so that importing colibri.hf needs no transformers)."""
    with _class_lock:
        made = _classes.get("growing")
        if made is None:
            made = _classes["growing"] = _make_class()
        return made


def _make_class() -> Any:
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):  # type: ignore[misc]
        """A ``DynamicLayer`` whose keys and values are views of buffers
        with room to spare (see the module's comment)."""

        _colibri_keys: Any = None
        _colibri_values: Any = None

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if key_states.dim() != 4 or value_states.dim() != 4 or not key_states.is_cpu:
                return super().update(key_states, value_states, *args, **kwargs)
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            keys: Any = self.keys
            values: Any = self.values
            kb, vb = self._colibri_keys, self._colibri_values
            held = keys.shape[2] if keys.dim() == 4 else 0
            new = held + key_states.shape[2]
            if not (held and kb is not None and new <= kb.shape[2] and _continues(keys, kb, key_states)
                    and _continues(values, vb, value_states)):
                kb, vb = self._room(keys, values, key_states, value_states, held, new)
            kb.narrow(2, held, new - held).copy_(key_states)
            vb.narrow(2, held, new - held).copy_(value_states)
            self.keys, self.values = kb.narrow(2, 0, new), vb.narrow(2, 0, new)
            return self.keys, self.values

        def _room(self, keys: Any, values: Any, key_states: Any, value_states: Any, held: int,
                  new: int) -> tuple[Any, Any]:
            """New buffers for ``new`` tokens and room to spare, holding the first ``held``."""
            room = max(new + SPARE_TOKENS, new + new // 4)
            kb = key_states.new_empty((*key_states.shape[:2], room, key_states.shape[3]))
            vb = value_states.new_empty((*value_states.shape[:2], room, value_states.shape[3]))
            if held:
                kb.narrow(2, 0, held).copy_(keys)
                vb.narrow(2, 0, held).copy_(values)
            self._colibri_keys, self._colibri_values = kb, vb
            return kb, vb

        def reset(self) -> None:
            self._colibri_keys = self._colibri_values = None
            super().reset()

    return GrowingLayer


def _continues(held: Any, buffer: Any, more: Any) -> bool:
    """Whether ``held`` is still the start of ``buffer`` (nothing replaced it)
    and ``more`` has its batch, heads, head size and dtype."""
    if held.data_ptr() != buffer.data_ptr() or held.stride() != buffer.stride() or more.dtype != buffer.dtype:
        return False
    a, b = more.shape, buffer.shape
    return a[0] == b[0] and a[1] == b[1] and a[3] == b[3]


def grow_in_place(cache: Any) -> int:
    """Turns the plain ``DynamicLayer`` layers of a transformers
    ``DynamicCache`` (not offloaded) into :class:`GrowingLayer` ones, their
    contents kept; returns how many layers are growing layers now. Other
    caches and layer classes are left alone."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if not isinstance(cache, DynamicCache) or getattr(cache, "offloading", False):
        return 0
    growing = growing_layer_class()
    count = 0
    for layer in getattr(cache, "layers", ()):
        if type(layer) is DynamicLayer:
            layer.__class__ = growing
        count += isinstance(layer, growing)
    return count


def grow_given_cache(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A model's forward pre-hook (``with_kwargs=True``): the ``DynamicCache``
    a forward is given appends in place (:func:`grow_in_place`). A cache the
    model makes itself in its first forward is taken over at the next."""
    for name in ("cache", "past_key_values"):
        cache = kwargs.get(name)
        if cache is not None:
            grow_in_place(cache)
