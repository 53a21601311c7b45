"""The OpenAI-compatible HTTP API of ``colibri serve`` (FastAPI).

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``,
``POST /v1/completions`` (each streaming as server-sent events ending with
``data: [DONE]``, or not), ``GET /health`` and ``GET /metrics`` (Prometheus
text). With an API key set, every ``/v1`` route needs ``Authorization:
Bearer KEY``.

Every refusal is OpenAI's error body, ``{"error": {"message", "type",
"param", "code"}}``, with a 4xx status for bad input (malformed JSON, unknown
fields or model, missing messages, a prompt the context cannot hold,
``max_tokens`` below 1 or beyond the context, a wrong key) and 5xx when the
server fails a request (an expert read that failed: 500; shutting down or a
full queue: 503). A streamed request waits for its first token before
answering, so a failure that early still gets its status; one later ends the
stream with an error event.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from colibri.errors import ColibriError, ExpertLoadError
from colibri.serve.engine import Engine, EngineBusy, EngineClosed, Event, Request, Sampling
from colibri.serve.metrics import render
from colibri.serve.text import TextStream

__all__ = ["ApiError", "create_app"]

#: Seconds between two checks that a client waiting for a whole completion is still there.
DISCONNECT_POLL = 0.25


class ApiError(Exception):
    """An error answered as OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- request bodies --

class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _TextPart(_Body):
    type: Literal["text"]
    text: str


class _Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class _StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def unsupported(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"n={self.n} is not supported: one choice per request", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise ApiError(400, f"{name} is not supported (only 0)", param=name)
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 4:
            raise ApiError(400, "stop takes at most 4 strings", param="stop")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class _ChatBody(_Common):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")


class _CompletionBody(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = False
    logprobs: int | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if self.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    where = ".".join(str(x) for x in err["loc"] if not (isinstance(x, str) and x in ("str", "list[int]")))
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"unknown field '{where}'", where
    if kind == "missing":
        return f"missing required field '{where}'", where
    return f"{where}: {err['msg']}", where


async def _json_body(raw: bytes, model: type[_Body]) -> Any:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise ApiError(400, message, param=param) from None


# -- the app --

def _usage(prompt: list[int], tokens: int) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": tokens, "total_tokens": len(prompt) + tokens}


def _failure(event: Event) -> ApiError:
    """The error answered for an event that ended a request without a completion."""
    exc = event.error
    if event.kind == "done":    # cancelled by the server itself: it is stopping
        return ApiError(503, "the server is shutting down", "server_error", code="shutting_down")
    if isinstance(exc, ExpertLoadError):
        return ApiError(500, f"reading an expert failed: {exc}", "server_error", code="expert_load_error")
    if isinstance(exc, EngineClosed):
        return ApiError(503, str(exc), "server_error", code="shutting_down")
    kind = type(exc).__name__ if exc is not None else "error"
    return ApiError(500, f"generation failed: {kind}: {exc}", "server_error",
                    code="colibri_error" if isinstance(exc, ColibriError) else "internal_error")


async def _next_event(events: asyncio.Queue[Event], http: HttpRequest) -> Event | None:
    """The next engine event, or None once the client has gone away."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), DISCONNECT_POLL)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                return None


class _Api:
    """What the routes do, for one engine, tokenizer and model id."""

    def __init__(self, engine: Engine, tokenizer: Any, model_id: str, api_key: str | None) -> None:
        self.engine, self.tokenizer, self.model_id, self.api_key = engine, tokenizer, model_id, api_key
        self.created = int(time.time())

    def authorize(self, request: HttpRequest) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    def check_model(self, name: str) -> None:
        if name != self.model_id:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves '{self.model_id}'",
                           param="model", code="model_not_found")

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "colibri"}

    def health(self) -> Any:
        engine = self.engine
        stats = engine.stats()
        ok = engine.alive and not engine.store.closed and engine.accepting
        body = {"status": "ok" if ok else "unavailable", "model": self.model_id,
                "running": stats.running, "waiting": stats.waiting}
        return JSONResponse(body, status_code=200 if ok else 503)

    def max_tokens(self, body: _Common, prompt_len: int, requested: int | None, default: int | None) -> int:
        context = self.engine.context
        limit = context - prompt_len
        if prompt_len >= context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens, and the prompt "
                           f"is {prompt_len} tokens; shorten the prompt",
                           param="messages" if isinstance(body, _ChatBody) else "prompt",
                           code="context_length_exceeded")
        if requested is None:
            return limit if default is None else min(default, limit)
        if requested < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {requested}", param="max_tokens",
                           code="invalid_value")
        if requested > limit:
            raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you "
                           f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                           f"{requested} in the completion); reduce max_tokens",
                           param="max_tokens", code="context_length_exceeded")
        return requested

    def chat_prompt(self, body: _ChatBody) -> list[int]:
        tokenizer = self.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, f"the model '{self.model_id}' has no chat template: use /v1/completions",
                           param="messages")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:   # the template itself refuses (e.g. roles out of order)
            raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def completion_prompt(self, body: _CompletionBody) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            vocab = len(self.tokenizer)
            if any(not 0 <= int(x) < vocab for x in prompt):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            return [int(x) for x in prompt]
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request (a list of one string, or a string)",
                               param="prompt")
            return list(self.tokenizer(str(prompt[0]))["input_ids"])
        return list(self.tokenizer(prompt)["input_ids"])

    async def submit(self, prompt: list[int], body: _Common,
                     limit: int) -> tuple[Request, asyncio.Queue[Event]]:
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        sampling = Sampling(max_tokens=limit, temperature=body.temperature, top_p=body.top_p, seed=body.seed)
        try:
            return self.engine.submit(prompt, sampling, sink), events
        except ValueError as exc:     # the engine's own check of prompt and max_tokens
            raise ApiError(400, str(exc), code="context_length_exceeded") from None
        except EngineClosed as exc:
            raise ApiError(503, str(exc), "server_error", code="shutting_down") from None
        except EngineBusy as exc:
            raise ApiError(503, str(exc), "server_error", code="server_busy") from None

    async def complete(self, http: HttpRequest, chat: bool) -> Any:
        """One chat or text completion: validated, queued, then streamed or collected."""
        self.authorize(http)
        body = await _json_body(await http.body(), _ChatBody if chat else _CompletionBody)
        self.check_model(body.model)
        body.unsupported()
        if isinstance(body, _ChatBody):
            prompt = await run_in_threadpool(self.chat_prompt, body)
            requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            limit = self.max_tokens(body, len(prompt), requested, None)
        else:
            prompt = await run_in_threadpool(self.completion_prompt, body)
            limit = self.max_tokens(body, len(prompt), body.max_tokens, 16)
        request, events = await self.submit(prompt, body, limit)
        reply = _Reply(chat, self.model_id, prompt, TextStream(self.tokenizer, prompt, body.stops()))
        try:
            first = await _next_event(events, http)
        except BaseException:
            request.cancel()
            raise
        if first is None:
            request.cancel()
            return Response(status_code=499)   # the client is gone; nobody reads this
        if first.kind != "token":
            raise _failure(first)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _EventStream(_stream(request, events, first, reply, include_usage), request)
        try:
            return await reply.collect(first, events, http)
        finally:
            request.cancel()


def create_app(engine: Engine, tokenizer: Any, *, model_id: str, api_key: str | None = None) -> Any:
    """The FastAPI application serving ``engine`` (already started) as ``model_id``."""
    app = FastAPI(title="colibri serve", docs_url=None, redoc_url=None, openapi_url=None)
    api = _Api(engine, tokenizer, model_id, api_key)
    app.state.engine = engine

    def error(exc: ApiError) -> Any:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: HttpRequest, exc: ApiError) -> Any:
        return error(exc)

    @app.exception_handler(HTTPException)
    async def _http_error(request: HttpRequest, exc: HTTPException) -> Any:
        what = "not found" if exc.status_code == 404 else str(exc.detail)
        return error(ApiError(exc.status_code, f"{request.method} {request.url.path}: {what}"))

    @app.exception_handler(Exception)
    async def _crash(request: HttpRequest, exc: Exception) -> Any:
        return error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))

    @app.get("/v1/models")
    async def models(request: HttpRequest) -> Any:
        api.authorize(request)
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str, request: HttpRequest) -> Any:
        api.authorize(request)
        api.check_model(name)
        return api.model_card()

    @app.get("/health")
    async def health() -> Any:
        return api.health()

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(render(engine), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest) -> Any:
        return await api.complete(http, chat=True)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest) -> Any:
        return await api.complete(http, chat=False)

    return app


class _Reply:
    """The OpenAI objects of one completion: whole, or chunk by chunk."""

    def __init__(self, chat: bool, model: str, prompt: list[int], text: TextStream) -> None:
        self.chat, self.model, self.prompt, self.text = chat, model, prompt, text
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.tokens = 0

    def usage(self) -> dict[str, int]:
        return _usage(self.prompt, self.tokens)

    def add(self, event: Event) -> tuple[str, str | None]:
        """Text to send for an event, and the finish reason once there is one
        (raises the ApiError of an event that failed the request)."""
        if event.kind == "token":
            self.tokens += 1
            piece = self.text.push(int(event.token or 0))
            return piece, "stop" if self.text.stopped else None
        if event.kind == "done" and event.reason in ("stop", "length"):
            return self.text.finish(), event.reason
        raise _failure(event)

    async def collect(self, first: Event, events: asyncio.Queue[Event], http: HttpRequest) -> Any:
        event: Event | None = first
        while True:
            if event is None:
                return Response(status_code=499)   # the client is gone; nobody reads this
            _, reason = self.add(event)
            if reason is not None:
                break
            event = await _next_event(events, http)
        head = {"id": self.id, "created": self.created, "model": self.model}
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": self.text.text},
                                      "logprobs": None, "finish_reason": reason}
            return {**head, "object": "chat.completion", "choices": [choice], "usage": self.usage()}
        choice = {"index": 0, "text": self.text.text, "logprobs": None, "finish_reason": reason}
        return {**head, "object": "text_completion", "choices": [choice], "usage": self.usage()}

    def chunk(self, text: str | None, reason: str | None, include_usage: bool, role: bool = False) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        data: dict[str, Any] = {"id": self.id, "object": self.object, "created": self.created,
                                "model": self.model, "choices": [choice]}
        if include_usage:
            data["usage"] = None
        return _sse(data)

    def usage_chunk(self) -> bytes:
        return _sse({"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                     "choices": [], "usage": self.usage()})


class _EventStream(StreamingResponse):
    """Server-sent events that cancel their request however the response
    ends: done, the client gone, or the server cancelling it."""

    def __init__(self, chunks: AsyncIterator[bytes], request: Request) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._chunks = chunks
        self._request = request

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._request.cancel()
            aclose = getattr(self._chunks, "aclose", None)
            if aclose is not None:
                await aclose()


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _stream(request: Request, events: asyncio.Queue[Event], first: Event, reply: _Reply,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """The server-sent events of one streamed completion: text chunks, the
    finish reason, usage if asked, ``[DONE]``; or an error event."""
    try:
        if reply.chat:
            yield reply.chunk("", None, include_usage, role=True)
        event = first
        while True:
            try:
                piece, reason = reply.add(event)
            except ApiError as exc:
                yield _sse(exc.body())
                return
            if piece:
                yield reply.chunk(piece, None, include_usage)
            if reason is not None:
                break
            event = await events.get()
        request.cancel()
        yield reply.chunk(None if reply.chat else "", reason, include_usage)
        if include_usage:
            yield reply.usage_chunk()
        yield b"data: [DONE]\n\n"
    finally:
        request.cancel()
