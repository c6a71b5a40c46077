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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from asyncllm.engine.async_engine import AsyncEngine
from asyncllm.errors import (
    EngineDeadError,
    EngineNotRunningError,
    InvalidRequestError,
    QueueFull,
)
from asyncllm.outputs import RequestOutput
from asyncllm.server import protocol as p
from asyncllm.server.metrics import RequestTracker, ServerMetrics

logger = logging.getLogger("asyncllm.server")

T = TypeVar("T")

#: Status for a response to a client that already went away (nginx's convention; never
#: seen by the client, only in access logs).
CLIENT_CLOSED = 499


def error_response(err: p.APIError) -> JSONResponse:
    """OpenAI's error JSON with the error's status."""
    return JSONResponse(err.body(), status_code=err.status)


def api_error(exc: BaseException) -> p.APIError:
    """Map an exception to the error the client sees."""
    if isinstance(exc, p.APIError):
        return exc
    if isinstance(exc, QueueFull):
        return p.APIError(str(exc), 429, type="rate_limit_error", code="rate_limit_exceeded")
    if isinstance(exc, (EngineDeadError, EngineNotRunningError)):
        return p.APIError(str(exc), 503, type="server_error", code="engine_unavailable")
    if isinstance(exc, (InvalidRequestError, ValueError)):
        return p.APIError(str(exc), 400)
    logger.error("unexpected error in a request", exc_info=exc)
    return p.APIError(f"internal error: {exc!r}", 500, type="server_error")


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
        trackers: list[RequestTracker] = [self._metrics.tracker() for _ in prompt.choices]
        stream = self._open(prompt)
        try:
            async for out in stream:
                trackers[out.index].on_output(out)
                await self._queue.put((prompt.choices[out.index], out, None))
        except Exception as e:
            await self._queue.put((None, None, e))
        finally:
            await stream.aclose()  # no-op after the end; aborts the request otherwise
            for t in trackers:
                t.on_close()

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

    Attributes:
        engine: the engine.
        model_name: the served model name.
        metrics: the :class:`~asyncllm.server.metrics.ServerMetrics` behind ``/metrics``
            (its ``registry`` is a prometheus_client ``CollectorRegistry``).
    """

    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.metrics = ServerMetrics(engine, served_model_name)
        self.created = int(time.time())

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
        except EngineDeadError as e:
            return error_response(api_error(e))
        return JSONResponse({"status": state}, status_code=200 if state == "running" else 503)

    async def metrics_route(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request) -> Response:
        try:
            req = p.decode_body(await request.body(), p.CompletionRequest)
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
        except Exception as e:
            return error_response(api_error(e))
        rid = f"cmpl-{uuid.uuid4().hex}"
        calls = self._prompts(prompts, n, rid)
        if req.echo:
            tok = self.engine.tokenizer
            for call in calls:
                text = call.prompt if isinstance(call.prompt, str) else tok.decode(call.prompt)
                for c in call.choices:
                    c.prompt_text = text
        priority = req.priority or 0
        salt = req.cache_salt

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
            req = p.decode_body(await request.body(), p.ChatCompletionRequest)
            self._check_model(req.model)
            n = p.check_common(req, 1)
            if req.tools:
                raise p.APIError("tools are not supported", param="tools")
            fmt = (req.response_format or {}).get("type", "text")
            if fmt != "text":
                raise p.APIError(
                    f"response_format {fmt!r} is not supported", param="response_format"
                )
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
        except Exception as e:
            return error_response(api_error(e))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        calls = self._prompts([messages], n, rid)
        priority = req.priority or 0
        salt = req.cache_salt
        add_gen = True if req.add_generation_prompt is None else req.add_generation_prompt
        template_kwargs = req.chat_template_kwargs

        def open_stream(call: _Prompt) -> AsyncIterator[RequestOutput]:
            return self.engine.chat(
                call.prompt,
                params,
                add_generation_prompt=add_gen,
                chat_template_kwargs=template_kwargs,
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
                    out.append(
                        {
                            "index": c.index,
                            "message": {"role": "assistant", "content": "".join(c.text)},
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
            if not out.text and out.finish_reason is None and not (req.logprobs and out.token_ids):
                return []
            return [
                {
                    **head,
                    "choices": [
                        {
                            "index": c.index,
                            "delta": {"content": out.text} if out.text else {},
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
    err = p.APIError(
        exc.detail or "error",
        exc.status_code,
        type="invalid_request_error" if exc.status_code < 500 else "server_error",
        code="not_found" if exc.status_code == 404 else None,
    )
    return error_response(err)


async def _server_error(request: Request, exc: Exception) -> Response:
    return error_response(api_error(exc))


def create_app(engine: AsyncEngine, served_model_name: str | None = None) -> Starlette:
    """Build the OpenAI-compatible Starlette app for ``engine``.

    The app's lifespan runs the engine (``async with engine``): serve it with uvicorn or
    any ASGI server that runs lifespans. ``app.state.server`` is the
    :class:`OpenAIServer` (its ``metrics``, ``engine``, ``model_name``).

    Args:
        engine: a built, not yet started :class:`AsyncEngine`.
        served_model_name: the name clients pass as ``model``; default the engine's
            ``config.model`` ("default", or the path it was given).
    """
    server = OpenAIServer(engine, served_model_name or engine.config.model)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with engine:
            yield

    app = Starlette(
        routes=[
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/v1/models/{model:path}", server.models, methods=["GET"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
            Route("/health", server.health, methods=["GET"]),
            Route("/metrics", server.metrics_route, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.server = server
    return app
