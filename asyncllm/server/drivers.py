"""The two response drivers both generation endpoints share: one streamed (server-sent
events) and one not, over a fan-out of engine streams on an anyio task group.

Each choice of a call (one per prompt and sample, ``n`` samples per prompt) comes from one
engine request per prompt, read by its own task of the response's task group into one
memory stream. A further task of the group watches for the client's disconnect: a client
that goes away cancels the group, which closes every engine stream (aborting its request,
so its KV blocks are free before the next step).

A streamed response starts (status 200 and headers) only once the first output is ready,
so a request the engine refuses still gets its status code and OpenAI's error JSON.

What the responses hold is the endpoint's :class:`Shape` (pure functions of the outputs,
:mod:`asyncllm.server.endpoints`); the drivers only move outputs and bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import anyio.abc
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from asyncllm.outputs import RequestOutput, ToolCall
from asyncllm.server.metrics import RequestTracker, ServerMetrics
from asyncllm.server.protocol import api_error
from asyncllm.server.responses import Usage, encode, usage

#: Status for a response to a client that already went away (nginx's convention; never
#: seen by the client, only in access logs).
CLIENT_CLOSED = 499


def json_response(
    body: msgspec.Struct | dict[str, Any],
    status: int = 200,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """A response with ``body`` (a struct or a dict) encoded by msgspec as JSON."""
    return Response(encode(body), status, headers, media_type="application/json")


@dataclass
class Choice:
    """One choice of a response: sample ``sample`` of prompt ``prompt_index``, and what its
    outputs brought so far."""

    index: int
    prompt_index: int
    sample: int
    prompt_text: str | None = None  # prepended for ``echo``
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    last: RequestOutput | None = None
    offset: int = 0  # legacy logprobs text offset of a stream (characters so far)


@dataclass
class Prompt:
    """One engine request of a call (its ``n`` samples are choices)."""

    index: int
    prompt: Any
    request_id: str
    choices: list[Choice]


def make_prompts(prompts: list[Any], n: int, prefix: str) -> list[Prompt]:
    """One :class:`Prompt` per engine prompt, request ids ``{prefix}-{i}``, choices numbered
    prompt x n + sample."""
    return [
        Prompt(pi, prompt, f"{prefix}-{pi}", [Choice(pi * n + i, pi, i) for i in range(n)])
        for pi, prompt in enumerate(prompts)
    ]


def all_choices(prompts: list[Prompt]) -> list[Choice]:
    """The choices of every prompt, in index order."""
    return [c for prompt in prompts for c in prompt.choices]


def accumulate(choice: Choice, out: RequestOutput) -> None:
    """Add one delta output to its choice."""
    choice.text.append(out.text)
    if out.reasoning:
        choice.reasoning.append(out.reasoning)
    choice.token_ids.extend(out.token_ids)
    if out.logprobs:
        choice.logprobs.extend(out.logprobs)
    if out.tool_calls:
        choice.tool_calls.extend(out.tool_calls)
    choice.last = out


def total_usage(choices: list[Choice]) -> Usage:
    """Prompt tokens counted once per prompt, completion tokens summed over choices."""
    prompt: dict[int, tuple[int, int]] = {}
    completion = 0
    for c in choices:
        if c.last is None:
            continue
        completion += c.last.num_generated_tokens
        prompt.setdefault(c.prompt_index, (c.last.num_prompt_tokens, c.last.num_cached_tokens))
    return usage(
        sum(n for n, _ in prompt.values()),
        completion,
        sum(cached for _, cached in prompt.values()),
    )


class Shape(Protocol):
    """An endpoint's response bodies, as pure functions of the choices' outputs."""

    def body(self, choices: list[Choice]) -> msgspec.Struct | dict[str, Any]:
        """The non-streamed body, once every choice has finished."""

    def preamble(self, choices: list[Choice]) -> Sequence[msgspec.Struct | dict[str, Any]]:
        """Chunks sent first in a stream (chat: each choice's role)."""

    def chunk(
        self, choice: Choice, out: RequestOutput, first: bool
    ) -> msgspec.Struct | Sequence[dict[str, Any]] | None:
        """The chunk for one output (``first``: the choice's first), a list of events
        (``/v1/responses``), or None to send none."""

    def usage_chunk(self, usage: Usage) -> msgspec.Struct | None:
        """The stream's last chunk with ``usage``, or None when the client did not ask."""


_Item = tuple[Choice | None, RequestOutput | None, Exception | None]


class Fanout:
    """Reads every prompt's engine stream in its own task of a task group into one memory
    stream; :meth:`next` hands out the outputs of all choices in arrival order.

    Args:
        prompts: the call's engine requests.
        open_stream: opens one prompt's engine stream (delta outputs).
        metrics: the server's metrics (one tracker per engine request).
    """

    def __init__(
        self,
        prompts: list[Prompt],
        open_stream: Callable[[Prompt], AsyncIterator[RequestOutput]],
        metrics: ServerMetrics,
    ) -> None:
        self.prompts = prompts
        self.choices = all_choices(prompts)
        self._open = open_stream
        self._metrics = metrics
        self._unfinished = len(self.choices)
        self._send: MemoryObjectSendStream[_Item]
        self._receive: MemoryObjectReceiveStream[_Item]
        self._send, self._receive = anyio.create_memory_object_stream[_Item](4 * len(self.choices))

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Start one reader per prompt in ``tg``; cancelling ``tg`` aborts their requests."""
        for prompt in self.prompts:
            tg.start_soon(self._pump, prompt)

    async def _pump(self, prompt: Prompt) -> None:
        # one tracker per engine request: its n samples count once (see metrics.py)
        tracker: RequestTracker = self._metrics.tracker(len(prompt.choices))
        stream: AsyncIterator[RequestOutput] | None = None
        error: Exception | None = None
        try:
            stream = self._open(prompt)
            async for out in stream:
                if out.queue_position is None:  # a queue report is no output yet
                    tracker.on_output(out)
                await self._send.send((prompt.choices[out.index], out, None))
        except Exception as e:  # whatever fails, the reader learns of it (never hangs)
            error = e
            await self._send.send((None, None, e))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):  # runs when the group is cancelled too
                    await aclose()  # no-op after the end; aborts the request otherwise
            tracker.on_close(error)

    @property
    def done(self) -> bool:
        """Every choice has delivered its last output."""
        return self._unfinished == 0

    async def next(self) -> tuple[Choice, RequestOutput]:
        """The next output of any choice; raises the first error of any prompt."""
        choice, out, err = await self._receive.receive()
        if err is not None:
            raise err
        assert choice is not None and out is not None
        if out.finished:
            self._unfinished -= 1
        return choice, out

    def close(self) -> None:
        """Close the memory stream (after the readers are done)."""
        self._send.close()
        self._receive.close()


def sse(obj: msgspec.Struct | dict[str, Any]) -> bytes:
    """One server-sent event holding ``obj`` as JSON."""
    return b"data: " + encode(obj) + b"\n\n"


def queue_comment(out: RequestOutput) -> bytes:
    """A server-sent-events comment (ignored by clients that do not read it) with a
    request's queue position and estimated seconds to its start (``--queue-events``):
    ``: queue_position=2 estimated_start_s=1.25``."""
    eta = "unknown" if out.estimated_start_s is None else f"{out.estimated_start_s:.2f}"
    return f": queue_position={out.queue_position} estimated_start_s={eta}\n\n".encode()


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator.

    Starlette stops iterating when the client disconnects (or a send fails) but leaves the
    async generator suspended; closing it runs its ``finally`` now rather than at garbage
    collection.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def _disconnected(receive: Receive) -> None:
    """Return when the client disconnects (the body must have been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class GenerationResponse:
    """The ASGI response of a generation call: runs the fan-out and the disconnect watcher
    in one task group for the response's lifetime, and answers with the streamed or the
    non-streamed driver.

    Non-streamed: every choice is read to its end, then ``shape.body`` is sent. Streamed:
    the first output is awaited before the status is sent; then ``shape.preamble``, one
    ``shape.chunk`` per output, ``shape.usage_chunk`` and ``data: [DONE]``; an engine
    failure mid-stream ends it with an error event (OpenAI's error JSON). Either way an
    error before the response starts is answered with its status and error JSON, and a
    client that went away before it started gets status 499 (for access logs).

    Args:
        fan: the call's fan-out (not started).
        shape: the endpoint's bodies.
        stream: stream server-sent events.
    """

    def __init__(self, fan: Fanout, shape: Shape, stream: bool) -> None:
        self._fan = fan
        self._shape = shape
        self._streaming = stream
        self._gone = False
        self._started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    await _disconnected(receive)
                    self._gone = True
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                self._fan.start(tg)
                try:
                    drive = self._stream if self._streaming else self._respond
                    await drive(scope, receive, send)
                finally:
                    tg.cancel_scope.cancel()  # ends the watcher; aborts unfinished requests
        finally:
            self._fan.close()
        if self._gone and not self._started:
            with contextlib.suppress(OSError):
                await Response(status_code=CLIENT_CLOSED)(scope, receive, send)

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        fan = self._fan
        try:
            while not fan.done:
                choice, out = await fan.next()
                if out.queue_position is None:
                    accumulate(choice, out)
        except Exception as e:
            err = api_error(e)
            response = json_response(err.body(), err.status)
        else:
            response = json_response(self._shape.body(fan.choices))
        self._started = True
        with contextlib.suppress(ClientDisconnect, OSError):
            await response(scope, receive, send)

    async def _stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            first = await self._fan.next()
        except Exception as e:
            err = api_error(e)
            self._started = True
            await json_response(err.body(), err.status)(scope, receive, send)
            return
        self._started = True
        response = ClosingStreamingResponse(
            self._events(first),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        try:
            await response(scope, receive, send)
        except (ClientDisconnect, OSError):  # a send failed: the client went away
            self._gone = True

    async def _events(self, first: tuple[Choice, RequestOutput]) -> AsyncIterator[bytes]:
        fan, shape = self._fan, self._shape
        started: set[int] = set()
        try:
            for obj in shape.preamble(fan.choices):
                yield sse(obj)
            item: tuple[Choice, RequestOutput] | None = first
            while item is not None:
                choice, out = item
                if out.queue_position is not None:  # before its first token: a comment
                    yield queue_comment(out)
                    item = await fan.next()
                    continue
                accumulate(choice, out)
                chunk = shape.chunk(choice, out, choice.index not in started)
                started.add(choice.index)
                for event in chunk if isinstance(chunk, Sequence) else (chunk,):
                    if event is not None:
                        yield sse(event)
                item = None if fan.done else await fan.next()
            last = shape.usage_chunk(total_usage(fan.choices))
            if last is not None:
                yield sse(last)
            yield b"data: [DONE]\n\n"
        except Exception as e:  # the engine failed mid-stream
            yield sse(api_error(e).body())
