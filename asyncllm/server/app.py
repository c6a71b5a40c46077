"""The Starlette app of the OpenAI-compatible server.

Routes: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /health``, ``GET /metrics``.

Each choice of a call (one per prompt and sample, ``n`` samples per prompt) is one engine
request, read by its own task into one queue. Sample ``i`` of a call with ``seed=s`` uses
``seed=(s + i) mod 2**63``, as the engine's parallel sampling documents.

A streamed response starts (status 200 and headers) only once the first output is ready,
so a bad request still gets its status code and OpenAI's error JSON. Until then a task
watches for the client's disconnect; afterwards Starlette does, and closing the response's
body closes every engine stream: a client that goes away aborts its requests and frees their
KV blocks before the next step.

Chat tool calls come from the engine already parsed (``RequestOutput.tool_calls``, see
``AsyncEngine.chat``); this module only shapes them as OpenAI's ``message.tool_calls`` and
``delta.tool_calls`` (from ``RequestOutput.tool_call_deltas``: a call's id and name as soon
as its name is generated, then its arguments text in pieces, numbered per choice).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from asyncllm.engine.async_engine import AsyncEngine
from asyncllm.errors import (
    EngineDeadError,
    EngineNotRunningError,
    InvalidRequestError,
    QueueFull,
)
from asyncllm.outputs import RequestOutput, ToolCall
from asyncllm.server import protocol as p
from asyncllm.server.metrics import RequestTracker, ServerMetrics

logger = logging.getLogger("asyncllm.server")

T = TypeVar("T")

#: Status for a response to a client that already went away (nginx's convention; never
#: seen by the client, only in access logs).
CLIENT_CLOSED = 499


#: Default of ``max_request_bytes``: the largest request body read (4 MiB: a prompt of
#: several hundred thousand tokens as text or token ids).
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20

#: The scope key under which the API-key check leaves the caller's tenant (a digest of the
#: key it presented), for prefix-cache isolation.
TENANT_KEY = "asyncllm.tenant"

ENGINE_FAILED = "the engine failed and serves no more requests; the server log has the details"
ENGINE_STOPPED = "the engine is not running"
INTERNAL_ERROR = "internal server error; the server log has the details"


def error_response(err: p.APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error JSON with the error's status."""
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def api_error(exc: BaseException) -> p.APIError:
    """Map an exception to the error the client sees.

    Only messages written for clients are passed on (:class:`~.protocol.APIError`, our
    typed input errors, :class:`QueueFull`); an engine failure or an unexpected exception
    gets a fixed message (the exception, which may name internals such as files or the
    failed step, goes to the server log), so no response carries a Python repr, a
    qualified name or a path.
    """
    if isinstance(exc, p.APIError):
        return exc
    if isinstance(exc, QueueFull):
        logger.info("request refused: %s", exc)
        return p.APIError(
            "the server's waiting queue is full; try again later",
            429,
            type="rate_limit_error",
            code="rate_limit_exceeded",
        )
    if isinstance(exc, EngineDeadError):
        logger.warning("request failed: the engine is dead: %s", exc)
        return p.APIError(ENGINE_FAILED, 503, type="server_error", code="engine_unavailable")
    if isinstance(exc, EngineNotRunningError):
        return p.APIError(ENGINE_STOPPED, 503, type="server_error", code="engine_unavailable")
    if isinstance(exc, RecursionError):  # a deeply nested value from the body
        return p.APIError("the request is nested too deeply")
    if isinstance(exc, (InvalidRequestError, ValueError)):
        # A grammar the engine cannot compile came from the request's response_format.
        grammar = isinstance(exc, InvalidRequestError) and str(exc).startswith("structured_outputs")
        return p.APIError(str(exc), 400, param="response_format" if grammar else None)
    logger.error("unexpected error in a request", exc_info=exc)
    return p.APIError(INTERNAL_ERROR, 500, type="server_error")


def _too_large(limit: int) -> p.APIError:
    return p.APIError(
        f"the request body is larger than this server's limit of {limit} bytes",
        413,
        code="request_too_large",
    )


async def read_json(request: Request, kind: type[msgspec.Struct], limit: int) -> Any:
    """Read and decode a POST body: ``Content-Type: application/json`` (parameters such as
    ``charset`` allowed) and at most ``limit`` bytes.

    The body is read in chunks and reading stops at the first chunk past the limit,
    whatever ``Content-Length`` says (a larger declared length is refused unread).

    Raises:
        APIError: 415 for another (or no) content type (so a web page cannot post a
            "simple" cross-origin request without a CORS preflight), 413 past the limit,
            400 for a malformed body (:func:`~.protocol.decode_body`).
        ClientDisconnect: the client went away while sending it.
    """
    ctype = request.headers.get("content-type", "")
    if ctype.split(";", 1)[0].strip().lower() != "application/json":
        raise p.APIError(
            "Content-Type must be application/json",
            415,
            code="unsupported_media_type",
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return p.decode_body(b"".join(chunks), kind)


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator.

    Starlette stops iterating when the client disconnects (or a send fails) but leaves the
    async generator suspended; closing it runs its ``finally`` (which closes the engine
    streams, aborting their requests) now rather than at garbage collection.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body must have been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, aw: Awaitable[T]) -> tuple[bool, T | None]:
    """Await ``aw`` unless the client disconnects first (then ``aw`` is cancelled).

    Returns:
        (True, result), or (False, None) when the client went away.
    """
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled (server shutdown)
        watcher.cancel()
        task.cancel()
        raise
    watcher.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    await asyncio.wait({task})
    return False, None


@dataclass
class _Choice:
    """One choice of a response: sample ``sample`` of prompt ``prompt_index``."""

    index: int
    prompt_index: int
    sample: int
    prompt_text: str | None = None
    # filled as outputs arrive
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    last: RequestOutput | None = None
    offset: int = 0  # legacy logprobs text offset


@dataclass
class _Prompt:
    """One engine request of a call (its ``n`` samples are choices)."""

    index: int
    prompt: Any
    request_id: str
    choices: list[_Choice]


class _Fanout:
    """Reads every prompt's engine stream in its own task into one queue."""

    def __init__(
        self,
        prompts: list[_Prompt],
        open_stream: Callable[[_Prompt], AsyncIterator[RequestOutput]],
        metrics: ServerMetrics,
    ) -> None:
        self.prompts = prompts
        self._open = open_stream
        self._metrics = metrics
        self._queue: asyncio.Queue[tuple[_Choice | None, RequestOutput | None, Exception | None]]
        self._queue = asyncio.Queue(maxsize=4 * sum(len(p.choices) for p in prompts))
        self._tasks: list[asyncio.Task[None]] = []
        self._unfinished = sum(len(p.choices) for p in prompts)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._pump(p)) for p in self.prompts]

    async def _pump(self, prompt: _Prompt) -> None:
        # one tracker per engine request: its n samples count once (see metrics.py)
        tracker: RequestTracker = self._metrics.tracker(len(prompt.choices))
        stream: AsyncIterator[RequestOutput] | None = None
        error: Exception | None = None
        try:
            stream = self._open(prompt)
            async for out in stream:
                tracker.on_output(out)
                await self._queue.put((prompt.choices[out.index], out, None))
        except Exception as e:  # whatever fails, the reader learns of it (never hangs)
            error = e
            await self._queue.put((None, None, e))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()  # no-op after the end; aborts the request otherwise
            tracker.on_close(error)

    @property
    def done(self) -> bool:
        """Every choice has delivered its last output."""
        return self._unfinished == 0

    async def next(self) -> tuple[_Choice, RequestOutput]:
        """The next output of any choice; raises the first error of any prompt."""
        choice, out, err = await self._queue.get()
        if err is not None:
            raise err
        assert choice is not None and out is not None
        if out.finished:
            self._unfinished -= 1
        return choice, out

    async def collect(self) -> None:
        """Read every choice to its end, accumulating text, tokens and logprobs."""
        while not self.done:
            choice, out = await self.next()
            accumulate(choice, out)

    async def aclose(self) -> None:
        """Cancel the readers (aborting unfinished requests) and wait for them."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def accumulate(choice: _Choice, out: RequestOutput) -> None:
    choice.text.append(out.text)
    choice.token_ids.extend(out.token_ids)
    if out.logprobs:
        choice.logprobs.extend(out.logprobs)
    if out.tool_calls:
        choice.tool_calls.extend(out.tool_calls)
    choice.last = out


def _usage(choices: list[_Choice]) -> dict[str, Any]:
    """Prompt tokens counted once per prompt, completion tokens summed over choices."""
    prompt: dict[int, tuple[int, int]] = {}
    completion = 0
    for c in choices:
        if c.last is None:
            continue
        completion += c.last.num_generated_tokens
        prompt.setdefault(c.prompt_index, (c.last.num_prompt_tokens, c.last.num_cached_tokens))
    return p.usage(
        sum(n for n, _ in prompt.values()),
        completion,
        sum(cached for _, cached in prompt.values()),
    )


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class OpenAIServer:
    """The state behind the routes (``app.state.server`` of :func:`create_app`'s app).

    Args:
        engine: an :class:`AsyncEngine`; the app's lifespan enters and leaves it.
        served_model_name: the name clients pass as ``model`` (and ``/v1/models`` lists).
        max_request_bytes: the largest request body read (bytes; past it: 413).
        trust_request_chat_template: let requests send their own ``chat_template``.
        client_priority_range: ``(lo, hi)`` with ``lo <= 0 <= hi``: the ``priority`` values
            a request may ask for (outside: 400); (0, 0) keeps clients from jumping ahead
            of others.
        share_prefix_cache: let requests made with different API keys share prefix-cache
            blocks (by default each key's requests hit only their own).

    Attributes:
        engine: the engine.
        model_name: the served model name.
        metrics: the :class:`~asyncllm.server.metrics.ServerMetrics` behind ``/metrics``
            (its ``registry`` is a prometheus_client ``CollectorRegistry``).

    Raises:
        ValueError: a ``max_request_bytes`` below 1 or a priority range without 0.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        served_model_name: str,
        *,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        trust_request_chat_template: bool = False,
        client_priority_range: tuple[int, int] = (0, 0),
        share_prefix_cache: bool = False,
    ) -> None:
        if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes!r}")
        lo, hi = client_priority_range
        if not (isinstance(lo, int) and isinstance(hi, int) and lo <= 0 <= hi):
            raise ValueError(
                f"client_priority_range must be (lo, hi) with lo <= 0 <= hi, got "
                f"{client_priority_range!r}"
            )
        self.engine = engine
        self.model_name = served_model_name
        self.metrics = ServerMetrics(engine, served_model_name)
        self.created = int(time.time())
        self.max_request_bytes = max_request_bytes
        self.trust_request_chat_template = trust_request_chat_template
        self.client_priority_range = (lo, hi)
        self.share_prefix_cache = share_prefix_cache
        self._reserved_template_options = p.reserved_template_options(engine.tokenizer)

    # ------------------------------------------------------------------ helpers

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise p.APIError(
                f"The model `{model}` does not exist (this server serves `{self.model_name}`).",
                404,
                param="model",
                code="model_not_found",
            )

    def _prompts(self, prompts: list[Any], n: int, prefix: str) -> list[_Prompt]:
        out = []
        for pi, prompt in enumerate(prompts):
            choices = [_Choice(pi * n + i, pi, i) for i in range(n)]
            out.append(_Prompt(pi, prompt, f"{prefix}-{pi}", choices))
        return out

    @staticmethod
    def _all_choices(prompts: list[_Prompt]) -> list[_Choice]:
        return [c for call in prompts for c in call.choices]

    def _priority(self, priority: int | None) -> int:
        lo, hi = self.client_priority_range
        value = 0 if priority is None else priority
        if not lo <= value <= hi:
            raise p.APIError(
                f"priority must be in [{lo}, {hi}] on this server, got {value}",
                param="priority",
            )
        return value

    async def _echo_text(self, prompt: str | list[int]) -> str:
        """A prompt's text for ``echo``. Token ids are checked first, by count (a prompt
        longer than ``max_model_len`` is refused before any work proportional to it) and
        range (the tokenizer would raise on ids outside the vocabulary), then decoded off
        the event loop."""
        if isinstance(prompt, str):
            return prompt
        try:
            return await self.engine.decode(prompt)
        except InvalidRequestError as e:
            raise p.APIError(str(e), param="prompt") from None

    def _cache_salt(self, request: Request, salt: str | None) -> str | None:
        """The client's ``cache_salt`` within its API key's own prefix-cache space."""
        tenant = None if self.share_prefix_cache else request.scope.get(TENANT_KEY)
        if tenant is None:
            return salt
        return tenant if salt is None else f"{tenant}\x00{salt}"

    def _head(self, rid: str, obj: str) -> dict[str, Any]:
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name}

    # ------------------------------------------------------------------ routes

    async def models(self, request: Request) -> Response:
        model = request.path_params.get("model")
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "asyncllm",
            "max_model_len": self.engine._engine.max_model_len,
        }
        if model is not None:
            if model != self.model_name:
                return error_response(
                    p.APIError(f"The model `{model}` does not exist.", 404, code="model_not_found")
                )
            return JSONResponse(card)
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        try:
            state = self.engine.health()
        except EngineDeadError as e:  # api_error gives a fixed message; the log has e
            return error_response(api_error(e))
        return JSONResponse({"status": state}, status_code=200 if state == "running" else 503)

    async def metrics_route(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        # An engine whose stats live elsewhere (ray_serve.EngineClient: the replicas') reads
        # them now, so the scrape's engine gauges are current; AsyncEngine has them at hand.
        refresh = getattr(self.engine, "refresh_stats", None)
        if refresh is not None:
            await refresh()
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request) -> Response:
        try:
            req = await read_json(request, p.CompletionRequest, self.max_request_bytes)
            self._check_model(req.model)
            prompts = p.completion_prompts(req.prompt)
            n = p.check_common(req, len(prompts))
            if req.suffix:
                raise p.APIError("suffix is not supported", param="suffix")
            if req.best_of is not None and req.best_of != n:
                raise p.APIError("best_of must equal n (or be left out)", param="best_of")
            if req.logprobs is not None and req.logprobs > p.MAX_COMPLETION_LOGPROBS:
                raise p.APIError(
                    f"logprobs must be in [0, {p.MAX_COMPLETION_LOGPROBS}], got {req.logprobs}",
                    param="logprobs",
                )
            if req.echo and req.logprobs is not None:
                raise p.APIError("echo with logprobs is not supported", param="echo")
            max_tokens = 16 if req.max_tokens is None else req.max_tokens
            params = p.sampling_params(req, n=n, max_tokens=max_tokens, logprobs=req.logprobs)
            priority = self._priority(req.priority)
            echoed = [await self._echo_text(prompt) for prompt in prompts] if req.echo else None
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED)
        except Exception as e:
            return error_response(api_error(e))
        rid = f"cmpl-{uuid.uuid4().hex}"
        calls = self._prompts(prompts, n, rid)
        if echoed is not None:
            for call, text in zip(calls, echoed, strict=True):
                for c in call.choices:
                    c.prompt_text = text
        salt = self._cache_salt(request, req.cache_salt)

        def open_stream(call: _Prompt) -> AsyncIterator[RequestOutput]:
            return self.engine.stream(
                call.prompt, params, request_id=call.request_id, priority=priority, cache_salt=salt
            )

        head = self._head(rid, "text_completion")

        def legacy_logprobs(c: _Choice, ids: list[int], lps: list[Any]) -> Any:
            if req.logprobs is None:
                return None
            obj, c.offset = p.completion_logprobs(ids, lps, req.logprobs, c.offset)
            return obj

        if not req.stream:

            def body(choices: list[_Choice]) -> dict[str, Any]:
                out = []
                for c in choices:
                    assert c.last is not None
                    text = "".join(c.text)
                    if c.prompt_text is not None:
                        text = c.prompt_text + text
                    out.append(
                        {
                            "index": c.index,
                            "text": text,
                            "logprobs": legacy_logprobs(c, c.token_ids, c.logprobs),
                            "finish_reason": c.last.finish_reason,
                            "stop_reason": c.last.stop_reason,
                        }
                    )
                return {**head, "choices": out, "usage": _usage(choices)}

            return await self._respond(request, calls, open_stream, body)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunks(c: _Choice, out: RequestOutput, first: bool) -> list[dict[str, Any]]:
            text = out.text
            if first and c.prompt_text is not None:
                text = c.prompt_text + text
            lps = legacy_logprobs(c, out.token_ids, out.logprobs or [])
            if not text and out.finish_reason is None and not (lps and out.token_ids):
                return []
            chunk: dict[str, Any] = {
                **head,
                "choices": [
                    {
                        "index": c.index,
                        "text": text,
                        "logprobs": lps,
                        "finish_reason": out.finish_reason,
                        "stop_reason": out.stop_reason,
                    }
                ],
            }
            if include_usage:
                chunk["usage"] = None
            return [chunk]

        return await self._stream(
            request, calls, open_stream, [], chunks, head if include_usage else None
        )

    async def chat_completions(self, request: Request) -> Response:
        try:
            req = await read_json(request, p.ChatCompletionRequest, self.max_request_bytes)
            self._check_model(req.model)
            n = p.check_common(req, 1)
            p.check_tools(req)
            messages = p.chat_messages(req.messages)
            top = req.top_logprobs
            if top is not None and not req.logprobs:
                raise p.APIError("top_logprobs needs logprobs=true", param="top_logprobs")
            max_tokens = req.max_completion_tokens
            if max_tokens is None:
                max_tokens = req.max_tokens
            params = p.sampling_params(
                req,
                n=n,
                max_tokens=max_tokens,
                logprobs=(top or 0) if req.logprobs else None,
                rename={
                    "logprobs": "top_logprobs",
                    "max_tokens": "max_completion_tokens"
                    if req.max_completion_tokens is not None
                    else "max_tokens",
                },
            )
            priority = self._priority(req.priority)
            template_kwargs = p.chat_template_kwargs(
                req,
                self._reserved_template_options,
                trust_template=self.trust_request_chat_template,
            )
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED)
        except Exception as e:
            return error_response(api_error(e))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        calls = self._prompts([messages], n, rid)
        salt = self._cache_salt(request, req.cache_salt)
        add_gen = True if req.add_generation_prompt is None else req.add_generation_prompt

        def open_stream(call: _Prompt) -> AsyncIterator[RequestOutput]:
            return self.engine.chat(
                call.prompt,
                params,
                add_generation_prompt=add_gen,
                chat_template_kwargs=template_kwargs,
                tools=req.tools,
                tool_choice=req.tool_choice,
                parallel_tool_calls=req.parallel_tool_calls is not False,
                request_id=call.request_id,
                priority=priority,
                cache_salt=salt,
            )

        head = self._head(rid, "chat.completion")

        def chat_lps(ids: list[int], lps: list[Any]) -> Any:
            if not req.logprobs:
                return None
            return {"content": p.chat_logprobs(ids, lps, top or 0), "refusal": None}

        if not req.stream:

            def body(choices: list[_Choice]) -> dict[str, Any]:
                out = []
                for c in choices:
                    assert c.last is not None
                    message: dict[str, Any] = {"role": "assistant", "content": "".join(c.text)}
                    if c.tool_calls:
                        message["content"] = message["content"] or None
                        message["tool_calls"] = [p.tool_call_json(t) for t in c.tool_calls]
                    out.append(
                        {
                            "index": c.index,
                            "message": message,
                            "logprobs": chat_lps(c.token_ids, c.logprobs),
                            "finish_reason": c.last.finish_reason,
                            "stop_reason": c.last.stop_reason,
                        }
                    )
                return {**head, "choices": out, "usage": _usage(choices)}

            return await self._respond(request, calls, open_stream, body)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head["object"] = "chat.completion.chunk"
        extra = {"usage": None} if include_usage else {}
        role_chunks = [
            {
                **head,
                "choices": [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                **extra,
            }
            for c in self._all_choices(calls)
        ]

        def chunks(c: _Choice, out: RequestOutput, first: bool) -> list[dict[str, Any]]:
            if (
                not out.text
                and not out.tool_call_deltas
                and out.finish_reason is None
                and not (req.logprobs and out.token_ids)
            ):
                return []
            delta: dict[str, Any] = {"content": out.text} if out.text else {}
            if out.tool_call_deltas:  # calls stream as OpenAI's: name, then argument pieces
                delta["tool_calls"] = p.tool_call_deltas_json(out.tool_call_deltas)
            return [
                {
                    **head,
                    "choices": [
                        {
                            "index": c.index,
                            "delta": delta,
                            "logprobs": chat_lps(out.token_ids, out.logprobs or []),
                            "finish_reason": out.finish_reason,
                            "stop_reason": out.stop_reason,
                        }
                    ],
                    **extra,
                }
            ]

        return await self._stream(
            request, calls, open_stream, role_chunks, chunks, head if include_usage else None
        )

    # ------------------------------------------------------------------ responses

    async def _respond(
        self,
        request: Request,
        calls: list[_Prompt],
        open_stream: Callable[[_Prompt], AsyncIterator[RequestOutput]],
        body: Callable[[list[_Choice]], dict[str, Any]],
    ) -> Response:
        fan = _Fanout(calls, open_stream, self.metrics)
        choices = self._all_choices(calls)
        fan.start()
        try:
            ok, _ = await until_disconnect(request, fan.collect())
        except Exception as e:
            return error_response(api_error(e))
        finally:
            await fan.aclose()
        if not ok:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(body(choices))

    async def _stream(
        self,
        request: Request,
        calls: list[_Prompt],
        open_stream: Callable[[_Prompt], AsyncIterator[RequestOutput]],
        preamble: list[dict[str, Any]],
        chunks: Callable[[_Choice, RequestOutput, bool], list[dict[str, Any]]],
        usage_head: dict[str, Any] | None,
    ) -> Response:
        fan = _Fanout(calls, open_stream, self.metrics)
        choices = self._all_choices(calls)
        fan.start()
        try:
            ok, first = await until_disconnect(request, fan.next())
        except Exception as e:
            await fan.aclose()
            return error_response(api_error(e))
        if not ok or first is None:
            await fan.aclose()
            return Response(status_code=CLIENT_CLOSED)

        async def events() -> AsyncIterator[bytes]:
            started: set[int] = set()
            try:
                for obj in preamble:
                    yield _sse(obj)
                item: tuple[_Choice, RequestOutput] | None = first
                while item is not None:
                    choice, out = item
                    accumulate(choice, out)
                    is_first = choice.index not in started
                    started.add(choice.index)
                    for obj in chunks(choice, out, is_first):
                        yield _sse(obj)
                    item = None if fan.done else await fan.next()
                if usage_head is not None:
                    yield _sse({**usage_head, "choices": [], "usage": _usage(choices)})
                yield b"data: [DONE]\n\n"
            except Exception as e:  # the engine failed mid-stream
                yield _sse(api_error(e).body())
            finally:
                await fan.aclose()

        return ClosingStreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    if status >= 500:
        logger.error("HTTP %d: %s", status, exc.detail)
    detail = exc.detail if status < 500 and isinstance(exc.detail, str) else None
    err = p.APIError(
        detail or ("error" if status < 500 else INTERNAL_ERROR),
        status,
        type="invalid_request_error" if status < 500 else "server_error",
        code="not_found" if status == 404 else None,
    )
    return error_response(err, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    return error_response(api_error(exc))


def split_commas(values: str | Iterable[str] | None) -> list[str]:
    """Items (API keys, origins) from a string or strings, each holding one item or several
    separated by commas (as ``--api-key``, ``$ASYNCLLM_API_KEY`` and ``--allowed-origins``
    take them); blanks are dropped."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    return [k.strip() for v in values for k in v.split(",") if k.strip()]


def _tenant(key: bytes) -> str:
    # a digest, so the key itself is never kept in request state or cache hashes
    return "apikey:" + hashlib.sha256(key).hexdigest()


class APIKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` with one of ``keys`` on every HTTP request
    but those to ``open_paths``; otherwise answer 401 with OpenAI's error JSON
    (``code`` "invalid_api_key"). Keys are compared with :func:`hmac.compare_digest`,
    against every key whatever matches (the time does not tell which key, or how much of
    one, matched). An accepted request's scope gets ``TENANT_KEY``: a digest of its key.

    Raises:
        ValueError: no keys.
    """

    def __init__(self, app: ASGIApp, keys: Iterable[str], open_paths: Iterable[str]) -> None:
        self.app = app
        self._keys = [k.encode() for k in keys]
        if not self._keys:
            raise ValueError("APIKeyMiddleware needs at least one key")
        self._tenants = [_tenant(k) for k in self._keys]
        self._open = frozenset(open_paths)

    def _match(self, authorization: str | None) -> int | None:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = token.strip().encode()
        match = None
        for i, key in enumerate(self._keys):
            if hmac.compare_digest(given, key) and match is None:
                match = i
        return match

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        index = self._match(Headers(scope=scope).get("authorization"))
        if index is None:
            err = p.APIError(
                "missing or invalid API key: send Authorization: Bearer <key>",
                401,
                code="invalid_api_key",
            )
            response = error_response(err, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        scope[TENANT_KEY] = self._tenants[index]
        await self.app(scope, receive, send)


def default_served_name(model: str) -> str:
    """The served model name for a ``--model`` value: the base name of a local directory or
    file (so no response shows a filesystem path), else the value itself ("default")."""
    if model and os.path.exists(model):
        return os.path.basename(os.path.normpath(os.path.abspath(model))) or model
    return model


def create_app(
    engine: AsyncEngine,
    served_model_name: str | None = None,
    *,
    api_keys: str | Iterable[str] | None = None,
    metrics_without_auth: bool = False,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    trust_request_chat_template: bool = False,
    client_priority_range: tuple[int, int] = (0, 0),
    share_prefix_cache_across_keys: bool = False,
    allowed_origins: Iterable[str] = (),
) -> Starlette:
    """Build the OpenAI-compatible Starlette app for ``engine``.

    The app's lifespan runs the engine (``async with engine``): serve it with uvicorn or
    any ASGI server that runs lifespans. ``app.state.server`` is the
    :class:`OpenAIServer` (its ``metrics``, ``engine``, ``model_name``). Each keyword is
    the ``serve`` option of the same name (see the module's Security section).

    Args:
        engine: a built, not yet started :class:`AsyncEngine`.
        served_model_name: the name clients pass as ``model``; default the base name of
            the engine's ``config.model`` ("default", or the directory or file it was
            loaded from).
        api_keys: keys a client must present (``Authorization: Bearer <key>``) on every
            route but ``/health``; a string may hold several, comma-separated. None or
            empty: no authentication.
        metrics_without_auth: serve ``/metrics`` without a key.
        max_request_bytes: the largest request body read (past it: 413).
        trust_request_chat_template: let requests send their own ``chat_template``.
        client_priority_range: ``(lo, hi)``, ``lo <= 0 <= hi``: the ``priority`` values
            requests may ask for (outside: 400).
        share_prefix_cache_across_keys: let requests made with different API keys share
            prefix-cache blocks (by default each key gets its own ``cache_salt`` space).
        allowed_origins: origins allowed to call the server from a browser (CORS; "*" for
            any); none by default.

    Raises:
        ValueError: a bad ``max_request_bytes`` or ``client_priority_range``.
    """
    server = OpenAIServer(
        engine,
        served_model_name or default_served_name(engine.config.model),
        max_request_bytes=max_request_bytes,
        trust_request_chat_template=trust_request_chat_template,
        client_priority_range=client_priority_range,
        share_prefix_cache=share_prefix_cache_across_keys,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with engine:
            yield

    middleware = []
    origins = list(allowed_origins)
    if origins:  # outermost: preflights are answered before the key check
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=origins,
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
            )
        )
    keys = split_commas(api_keys)
    if keys:
        open_paths = {"/health"} | ({"/metrics"} if metrics_without_auth else set())
        middleware.append(Middleware(APIKeyMiddleware, keys=keys, open_paths=open_paths))
    app = Starlette(
        routes=[
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/v1/models/{model:path}", server.models, methods=["GET"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
            Route("/health", server.health, methods=["GET"]),
            Route("/metrics", server.metrics_route, methods=["GET"]),
        ],
        middleware=middleware,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.server = server
    return app
