"""The batching engine behind ``colibri serve``: one thread runs the model.

Requests wait in a queue; between two steps the engine admits as many as
the batch has room for (``max_batch``), runs their prompts in one packed
prefill, and from then on every running sequence advances by one token per
decode step. A request leaves the batch between steps: when it ends (a stop
token, ``max_tokens``, the context), or when it is cancelled (its client went
away). The MoE layers of a step are :meth:`colibri.hf.Runtime.experts_forward`:
it leases the union of the batch's experts once, in groups that fit the
slots, and PILOT predicts for the whole batch; no lease outlives a step.

Each request gets its events (``token``, then ``done`` or ``error``) through
the ``sink`` it was submitted with, called on the engine thread.

A step that fails on an expert read (:class:`colibri.ExpertLoadError`) is
undone; if it ran one sequence, that request gets the error; if it ran
several, each runs that step alone, and only those whose own step fails get
the error (a transient fault then costs nobody anything). Any other failure
of a step fails the requests in it. The engine keeps serving either way.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from colibri.errors import ColibriError, ExpertLoadError
from colibri.serve.batch import BatchCache, Layout, active, batchable, new_cache, use_row_attention

__all__ = ["Sampling", "Event", "Request", "Engine", "EngineBusy", "EngineClosed", "EngineStats"]

log = logging.getLogger("colibri.serve")

#: Seconds of history behind the tokens/s figure.
RATE_WINDOW = 10.0


class EngineClosed(ColibriError):
    """The engine is shutting down and takes no more requests."""


class EngineBusy(ColibriError):
    """The queue of waiting requests is full."""


@dataclass(frozen=True)
class Sampling:
    """How one request picks its tokens: ``temperature`` 0 is greedy
    (argmax, as transformers' greedy ``generate``); otherwise softmax of
    logits / temperature, cut to the smallest set whose probability reaches
    ``top_p``, drawn from a generator seeded with ``seed`` (random if None)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True)
class Event:
    """``kind`` is ``"token"`` (``token`` set), ``"done"`` (``reason``:
    ``"stop"``, ``"length"`` or ``"cancelled"``) or ``"error"`` (``error`` set)."""

    kind: str
    token: int | None = None
    reason: str | None = None
    error: BaseException | None = None


@dataclass(eq=False)
class Request:
    """One generation. ``cancel()`` may be called from any thread; the
    request leaves the batch before the next step."""

    id: int
    prompt: list[int]
    sampling: Sampling
    sink: Callable[[Event], None]
    engine: "Engine" = field(repr=False)
    generated: list[int] = field(default_factory=list)
    finished: bool = False
    cancelled: bool = False
    _generator: Any = field(default=None, repr=False)

    def cancel(self) -> None:
        if not self.finished:
            self.cancelled = True
            self.engine._wake()


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics and /health."""

    waiting: int
    running: int
    max_batch: int
    tokens_per_s: float
    generated_tokens: int
    prompt_tokens: int
    steps: int
    step_rows: int
    prefills: int
    finished: dict[str, int]
    pilot_precision: float | None
    pilot_recall: float | None


def _sample(logits: Any, sampling: Sampling, generator: Any) -> int:
    import torch

    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        ordered, index = torch.sort(probs, descending=True)
        # Keep each token whose predecessors do not already reach top_p (so at least one).
        ordered = ordered * ((torch.cumsum(ordered, dim=-1) - ordered) < sampling.top_p)
        return int(index[torch.multinomial(ordered, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))


class Engine:
    """Runs ``model`` (made by :func:`colibri.hf.from_pretrained`) for many
    requests at once.

    ``max_batch`` sequences decode together (1: one request at a time);
    models whose attention cannot be batched row-exactly
    (:func:`colibri.serve.batch.batchable`) run with 1. ``context`` caps a
    sequence's prompt plus completion (default: the model's
    ``max_position_embeddings``). ``eos`` are the token ids that end a
    completion. ``max_queue`` requests may wait; more are refused with
    :class:`EngineBusy`. ``max_prefill_tokens`` bounds the prompt tokens
    packed into one prefill (a longer prompt still runs, alone).
    """

    def __init__(self, model: Any, *, max_batch: int = 8, context: int | None = None,
                 eos: Iterable[int] = (), max_queue: int = 256, max_prefill_tokens: int = 4096) -> None:
        import colibri.hf

        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.runtime = colibri.hf.runtime_of(model)
        self.store = self.runtime.store
        limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.context = min(context, limit) if context and limit else (context or limit or 2048)
        self.eos = frozenset(int(t) for t in eos)
        self.max_queue = max_queue
        self.max_prefill_tokens = max_prefill_tokens
        self.unbatched_reason = batchable(model) if max_batch > 1 else None
        if self.unbatched_reason is not None:
            log.warning("batching is off for this model: %s; requests run one at a time",
                        self.unbatched_reason)
            max_batch = 1
        self.rows_exact = max_batch > 1
        if self.rows_exact:
            use_row_attention(model)
        self.max_batch = max_batch
        self._cond = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._rows: list[Request] = []
        self._kv = BatchCache(model)
        self._ids = itertools.count(1)
        self._accepting = True
        self._closing = False
        self._thread: threading.Thread | None = None
        # statistics (written by the engine thread)
        self._rate_lock = threading.Lock()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._generated = self._prompt_tokens = self._steps = self._step_rows = self._prefills = 0
        self._finished: dict[str, int] = collections.Counter()
        self._pilot: tuple[float, float] | None = None

    # -- the public side (any thread) --

    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="colibri-serve-engine", daemon=True)
            self._thread.start()
        return self

    def submit(self, prompt: Sequence[int], sampling: Sampling, sink: Callable[[Event], None]) -> Request:
        """Queue a request. Raises :class:`EngineClosed` when shutting down,
        :class:`EngineBusy` when the queue is full, ValueError for a prompt
        or ``max_tokens`` the context cannot hold."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty")
        if sampling.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
        if len(prompt) + sampling.max_tokens > self.context:
            raise ValueError(f"{len(prompt)} prompt tokens + max_tokens {sampling.max_tokens} exceed the "
                             f"context of {self.context} tokens")
        with self._cond:
            if not self._accepting:
                raise EngineClosed("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise EngineBusy(f"the server is busy: {len(self._waiting)} requests are waiting")
            request = Request(next(self._ids), prompt, sampling, sink, self)
            if sampling.temperature > 0:
                import torch

                seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
                request._generator = torch.Generator().manual_seed(seed)
            self._waiting.append(request)
            self._cond.notify_all()
        return request

    def stats(self) -> EngineStats:
        now = time.monotonic()
        with self._rate_lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW:
                self._recent.popleft()
            recent = sum(n for _, n in self._recent)
        pilot = self._pilot
        return EngineStats(
            waiting=len(self._waiting), running=len(self._rows), max_batch=self.max_batch,
            tokens_per_s=recent / RATE_WINDOW, generated_tokens=self._generated,
            prompt_tokens=self._prompt_tokens, steps=self._steps, step_rows=self._step_rows,
            prefills=self._prefills, finished=dict(self._finished),
            pilot_precision=None if pilot is None else pilot[0],
            pilot_recall=None if pilot is None else pilot[1])

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting

    def stop_accepting(self) -> None:
        """Refuse new requests and end those still waiting (they get an EngineClosed error)."""
        with self._cond:
            self._accepting = False
            waiting = list(self._waiting)
            self._waiting.clear()
        for request in waiting:
            self._fail(request, EngineClosed("the server is shutting down"))

    def cancel_running(self) -> None:
        """Cancel every request in the batch (they leave it before the next step)."""
        for request in list(self._rows):
            request.cancel()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting, cancel every running request and stop the thread
        (after the step in progress). The store stays open: closing it is the
        owner's (``colibri.hf.runtime_of(model).close()``)."""
        self.stop_accepting()
        with self._cond:
            self._closing = True
            for request in self._rows:
                request.cancelled = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError("the engine thread did not stop in time")

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- the engine thread --

    def _run(self) -> None:
        import torch

        with torch.no_grad():
            while True:
                with self._cond:
                    while not self._waiting and not self._rows and not self._closing:
                        self._cond.wait()
                    if self._closing and not self._rows:
                        return
                    joining = self._admit()
                try:
                    if joining:
                        self._prefill(joining)
                    self._leave()
                    if self._rows:
                        self._step()
                        self._leave()
                except BaseException as exc:   # a bug: fail what is running, keep the thread alive
                    log.exception("colibri serve: the engine failed")
                    for request in self._rows + joining:
                        self._fail(request, exc)
                    self._rows, self._kv = [], BatchCache(self.model)

    def _admit(self) -> list[Request]:
        """Requests that join now (the caller holds the condition)."""
        joining: list[Request] = []
        tokens = 0
        while self._waiting and len(self._rows) + len(joining) < self.max_batch:
            request = self._waiting[0]
            if request.cancelled:
                self._waiting.popleft()
                self._done(request, "cancelled")
                continue
            if joining and tokens + len(request.prompt) > self.max_prefill_tokens:
                break
            joining.append(self._waiting.popleft())
            tokens += len(request.prompt)
        return joining

    def _emit(self, request: Request, event: Event) -> None:
        try:
            request.sink(event)
        except Exception:   # the consumer is gone: stop generating for it
            log.debug("request %d: its sink failed; cancelling", request.id, exc_info=True)
            request.cancelled = True

    def _done(self, request: Request, reason: str) -> None:
        if not request.finished:
            request.finished = True
            self._finished[reason] += 1
            self._emit(request, Event("done", reason=reason))

    def _fail(self, request: Request, error: BaseException) -> None:
        if not request.finished:
            request.finished = True
            self._finished["error"] += 1
            self._emit(request, Event("error", error=error))

    def _accept_token(self, request: Request, logits: Any) -> None:
        """Sample the next token from ``logits`` (vocab,), send it, end the request if it is done."""
        token = _sample(logits, request.sampling, request._generator)
        request.generated.append(token)
        self._generated += 1
        with self._rate_lock:
            self._recent.append((time.monotonic(), 1))
        self._emit(request, Event("token", token=token))
        if token in self.eos:
            self._done(request, "stop")
        elif (len(request.generated) >= request.sampling.max_tokens
              or len(request.prompt) + len(request.generated) >= self.context):
            self._done(request, "length")

    def _prefill(self, joining: list[Request]) -> None:
        """Run the prompts of ``joining`` (one packed forward) and add the
        unfinished ones to the batch."""
        try:
            caches = self._forward_prompts(joining)
        except ExpertLoadError as exc:
            if len(joining) == 1:
                self._fail(joining[0], exc)
                return
            log.warning("a read failed in a prefill of %d prompts; running them one by one: %s",
                        len(joining), exc)
            caches = []
            for request in joining:
                try:
                    caches += self._forward_prompts([request])
                except ExpertLoadError as one:
                    self._fail(request, one)
                    caches.append(None)
        except Exception as exc:
            log.exception("a prefill failed")
            for request in joining:
                self._fail(request, exc)
            return
        rows = [(r, c) for r, c in zip(joining, caches) if c is not None and not r.finished]
        self._kv.extend([c for _, c in rows], [len(r.prompt) for r, _ in rows])
        self._rows += [r for r, _ in rows]

    def _forward_prompts(self, joining: list[Request]) -> list[Any]:
        """One forward over the prompts, first token of each sampled; their caches."""
        import torch

        self._prefills += 1
        cache = new_cache(self.model)
        if len(joining) == 1:
            ids = torch.tensor([joining[0].prompt], dtype=torch.long)
            out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            self._prompt_tokens += len(joining[0].prompt)
            self._accept_token(joining[0], out.logits[0, -1])
            self._note_pilot()
            return [cache]
        segments, start = [], 0
        for request in joining:
            segments.append((start, start + len(request.prompt)))
            start += len(request.prompt)
        ids = torch.tensor([list(itertools.chain.from_iterable(r.prompt for r in joining))], dtype=torch.long)
        positions = torch.cat([torch.arange(len(r.prompt)) for r in joining])[None]
        last = torch.tensor([end - 1 for _, end in segments])
        with active(Layout(segments=tuple(segments))):
            out = self.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                             logits_to_keep=last)
        caches = []
        for j, (request, (a, b)) in enumerate(zip(joining, segments)):
            self._prompt_tokens += b - a
            self._accept_token(request, out.logits[0, j])
            own = new_cache(self.model)
            for layer, target in zip(cache.layers, own.layers):
                target.update(layer.keys[:, :, a:b].clone(), layer.values[:, :, a:b].clone())
            caches.append(own)
        self._note_pilot()
        return caches

    def _leave(self) -> None:
        """Drop finished and cancelled rows from the batch."""
        keep = []
        for i, request in enumerate(self._rows):
            if request.cancelled:
                self._done(request, "cancelled")
            elif not request.finished:
                keep.append(i)
        if len(keep) != len(self._rows):
            self._kv.keep(keep)
            self._rows = [self._rows[i] for i in keep]

    def _decode(self, kv: BatchCache, rows: list[Request]) -> Any:
        """One decode step of ``rows`` over ``kv``; the logits (rows, vocab)."""
        import torch

        mask, positions, layout = kv.step_inputs()
        ids = torch.tensor([[r.generated[-1]] for r in rows], dtype=torch.long)
        kv.mark()
        try:
            with active(layout) if self.rows_exact else contextlib.nullcontext():
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                 cache=kv.cache, use_cache=True)
        except BaseException:
            kv.rollback()
            raise
        kv.advanced()
        return out.logits[:, -1]

    def _step(self) -> None:
        rows = self._rows
        self._steps += 1
        self._step_rows += len(rows)
        try:
            logits = self._decode(self._kv, rows)
        except ExpertLoadError as exc:
            if len(rows) == 1:
                self._fail(rows[0], exc)
            else:
                log.warning("a read failed in a step of %d sequences; running it one by one: %s",
                            len(rows), exc)
                self._isolate()
            return
        except Exception as exc:
            log.exception("a decode step failed")
            for request in rows:
                self._fail(request, exc)
            return
        for request, row in zip(rows, logits):
            self._accept_token(request, row)
        self._note_pilot()

    def _isolate(self) -> None:
        """Run the step of each row alone; rows whose own step fails get the error."""
        caches, lengths, rows = [], [], []
        for index, request in enumerate(self._rows):
            single = BatchCache(self.model)
            single.extend([self._kv.row(index)], [self._kv.lengths[index]])
            try:
                logits = self._decode(single, [request])
            except ExpertLoadError as exc:
                self._fail(request, exc)
                continue
            self._accept_token(request, logits[0])
            caches.append(single.cache)
            lengths.append(single.lengths[0])
            rows.append(request)
        self._kv = BatchCache(self.model)
        self._kv.extend(caches, lengths)
        self._rows = rows

    def _note_pilot(self) -> None:
        pilot = self.runtime.pilot
        if pilot is not None:
            report = pilot.report()
            self._pilot = (report.precision, report.recall)
