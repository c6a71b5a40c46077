"""The two generation endpoints as pure functions: a decoded request body to the engine's
arguments (:class:`EngineCall`: prompts, :class:`SamplingParams`, the engine method's other
keywords), and engine outputs to response bodies and chunks (:class:`CompletionShape`,
:class:`ChatShape`, the :class:`~asyncllm.server.drivers.Shape` the drivers call).

Nothing here does I/O: the route (:mod:`asyncllm.server.app`) reads the body, adds what
depends on the HTTP request (the request id, the tenant's ``cache_salt``) and hands the
call to a driver (:mod:`asyncllm.server.drivers`).

Chat tool calls come from the engine already parsed (``RequestOutput.tool_calls``, see
``AsyncEngine.chat``); they are only shaped here as OpenAI's ``message.tool_calls`` and
``delta.tool_calls`` (from ``RequestOutput.tool_call_deltas``: a call's id and name as soon
as its name is generated, then its arguments text in pieces, numbered per choice).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from msgspec import UNSET

from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.server import protocol as p
from asyncllm.server import responses as r
from asyncllm.server.drivers import Choice, total_usage


@dataclass(frozen=True)
class EngineCall:
    """What one endpoint call asks of the engine.

    Attributes:
        prompts: one engine prompt per request (a string or token ids; for chat one
            message list).
        n: samples per prompt.
        params: the sampling parameters of every request.
        kwargs: the engine method's other keywords (``priority``, chat template options,
            tools...).
        stream: the client asked for server-sent events.
        include_usage: a streamed response ends with a ``usage`` chunk.
    """

    prompts: list[Any]
    n: int
    params: SamplingParams
    kwargs: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False


def check_priority(priority: int | None, allowed: tuple[int, int]) -> int:
    """The request's ``priority`` (default 0).

    Raises:
        APIError: 400 (``param`` "priority") outside ``allowed`` (inclusive).
    """
    lo, hi = allowed
    value = 0 if priority is None else priority
    if not lo <= value <= hi:
        raise p.APIError(
            f"priority must be in [{lo}, {hi}] on this server, got {value}", param="priority"
        )
    return value


def _include_usage(req: p.CompletionRequest | p.ChatCompletionRequest) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def completion_call(req: p.CompletionRequest, priorities: tuple[int, int]) -> EngineCall:
    """The engine's arguments for a ``/v1/completions`` body (``max_completion_tokens``, else
    ``max_tokens``, defaults to 16; ``engine.stream`` per prompt; a limit the prompt leaves
    no room for is refused by the engine, ``strict_max_tokens``).

    Raises:
        APIError: 400 naming the field: an unsupported option (``suffix``, ``best_of`` other
            than ``n``, ``echo`` with ``logprobs``), a field out of range, a bad prompt.
    """
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
    max_tokens, field = p.requested_max_tokens(req)
    params = p.sampling_params(
        req,
        n=n,
        max_tokens=16 if max_tokens is None else max_tokens,
        logprobs=req.logprobs,
        rename={"max_tokens": field},
    )
    # strict_max_tokens: a max_tokens past the context is a 400 naming it (OpenAI, vLLM)
    kwargs = {"priority": check_priority(req.priority, priorities), "strict_max_tokens": True}
    return EngineCall(prompts, n, params, kwargs, bool(req.stream), _include_usage(req))


def chat_call(
    req: p.ChatCompletionRequest,
    priorities: tuple[int, int],
    reserved_template_options: frozenset[str],
    *,
    trust_template: bool,
    server_template: str | None = None,
) -> EngineCall:
    """The engine's arguments for a ``/v1/chat/completions`` body (``engine.chat``; the
    maximum tokens default to the rest of ``max_model_len``, and more than that rest is
    refused, ``strict_max_tokens``). ``server_template``: the server's chat template (see
    :func:`~asyncllm.server.protocol.chat_template_kwargs`).

    Raises:
        APIError: 400 naming the field (see :mod:`asyncllm.server.protocol`).
    """
    n = p.check_common(req, 1)
    p.check_tools(req)
    messages = p.chat_messages(req.messages)
    top = req.top_logprobs
    if top is not None and not req.logprobs:
        raise p.APIError("top_logprobs needs logprobs=true", param="top_logprobs")
    max_tokens, field = p.requested_max_tokens(req)
    params = p.sampling_params(
        req,
        n=n,
        max_tokens=max_tokens,
        logprobs=(top or 0) if req.logprobs else None,
        rename={"logprobs": "top_logprobs", "max_tokens": field},
    )
    kwargs = {
        "priority": check_priority(req.priority, priorities),
        "chat_template_kwargs": p.chat_template_kwargs(
            req,
            reserved_template_options,
            trust_template=trust_template,
            server_template=server_template,
        ),
        "add_generation_prompt": req.add_generation_prompt is not False,
        "tools": req.tools,
        "tool_choice": req.tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "strict_max_tokens": True,
    }
    return EngineCall([messages], n, params, kwargs, bool(req.stream), _include_usage(req))


@dataclass(frozen=True)
class CompletionShape:
    """``/v1/completions`` bodies: ``text_completion`` objects (the body and each chunk).

    Attributes:
        id: the response id; created: its Unix time (s); model: the served name.
        logprobs: alternatives per token of the legacy logprobs, or None for none.
        include_usage: chunks carry ``usage`` (null but in the last).
    """

    id: str
    created: int
    model: str
    logprobs: int | None
    include_usage: bool

    def _completion(self, choices: list[r.CompletionChoice], usage: Any) -> r.Completion:
        return r.Completion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _logprobs(self, ids: list[int], lps: list[Any], offset: int) -> tuple[Any, int]:
        if self.logprobs is None:
            return None, offset
        return r.completion_logprobs(ids, lps, self.logprobs, offset)

    def body(self, choices: list[Choice]) -> r.Completion:
        """The body: each choice's whole text (after the prompt with ``echo``)."""
        out = []
        for c in choices:
            assert c.last is not None
            lps, _ = self._logprobs(c.token_ids, c.logprobs, 0)
            text = "".join(c.text)
            out.append(
                r.CompletionChoice(
                    index=c.index,
                    text=text if c.prompt_text is None else c.prompt_text + text,
                    logprobs=lps,
                    finish_reason=c.last.finish_reason,
                    stop_reason=c.last.stop_reason,
                )
            )
        return self._completion(out, total_usage(choices))

    def preamble(self, choices: list[Choice]) -> list[r.Completion]:
        """None: a completion stream starts with its first text."""
        return []

    def chunk(self, choice: Choice, out: RequestOutput, first: bool) -> r.Completion | None:
        """One output's chunk (None when it carries nothing); advances ``choice.offset``."""
        text = out.text
        if first and choice.prompt_text is not None:
            text = choice.prompt_text + text
        lps, choice.offset = self._logprobs(out.token_ids, out.logprobs or [], choice.offset)
        if not text and out.finish_reason is None and not (lps and out.token_ids):
            return None
        item = r.CompletionChoice(
            index=choice.index,
            text=text,
            logprobs=lps,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        return self._completion([item], None if self.include_usage else UNSET)

    def usage_chunk(self, usage: r.Usage) -> r.Completion | None:
        """The last chunk (empty ``choices``) when the client asked for usage."""
        return self._completion([], usage) if self.include_usage else None


@dataclass(frozen=True)
class ChatShape:
    """``/v1/chat/completions`` bodies (``chat.completion``, ``chat.completion.chunk``).

    Attributes:
        id: the response id; created: its Unix time (s); model: the served name.
        logprobs: send logprobs; top: alternatives per token.
        include_usage: chunks carry ``usage`` (null but in the last).
    """

    id: str
    created: int
    model: str
    logprobs: bool
    top: int
    include_usage: bool

    def _logprobs(self, ids: list[int], lps: list[Any]) -> r.ChatLogprobs | None:
        if not self.logprobs:
            return None
        return r.ChatLogprobs(content=r.chat_logprobs(ids, lps, self.top))

    def _chunk(self, item: r.ChatChunkChoice | None, usage: Any = UNSET) -> r.ChatCompletionChunk:
        if usage is UNSET and self.include_usage:
            usage = None
        return r.ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[] if item is None else [item],
            usage=usage,
        )

    def body(self, choices: list[Choice]) -> r.ChatCompletion:
        """The body: each choice's message (``content`` null when it was only tool calls)."""
        out = []
        for c in choices:
            assert c.last is not None
            message = r.ChatMessage(content="".join(c.text))
            if c.reasoning:
                message.reasoning_content = "".join(c.reasoning)
            if c.tool_calls:
                message.content = message.content or None
                message.tool_calls = [r.tool_call_json(t) for t in c.tool_calls]
            out.append(
                r.ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(c.token_ids, c.logprobs),
                    finish_reason=c.last.finish_reason,
                    stop_reason=c.last.stop_reason,
                )
            )
        return r.ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=out,
            usage=total_usage(choices),
        )  # fmt: skip

    def preamble(self, choices: list[Choice]) -> list[r.ChatCompletionChunk]:
        """One chunk per choice with its role (``{"role": "assistant", "content": ""}``)."""
        return [
            self._chunk(
                r.ChatChunkChoice(
                    index=c.index,
                    delta=r.Delta(role="assistant", content=""),
                    logprobs=None,
                    finish_reason=None,
                )
            )
            for c in choices
        ]

    def chunk(
        self, choice: Choice, out: RequestOutput, first: bool
    ) -> r.ChatCompletionChunk | None:
        """One output's chunk: its text, reasoning and tool-call pieces (None when it
        carries nothing)."""
        if (
            not out.text
            and not out.reasoning
            and not out.tool_call_deltas
            and out.finish_reason is None
            and not (self.logprobs and out.token_ids)
        ):
            return None
        delta = r.Delta(content=out.text) if out.text else r.Delta()
        if out.reasoning:
            delta.reasoning_content = out.reasoning
        if out.tool_call_deltas:  # calls stream as OpenAI's: name, then argument pieces
            delta.tool_calls = r.tool_call_deltas_json(out.tool_call_deltas)
        item = r.ChatChunkChoice(
            index=choice.index,
            delta=delta,
            logprobs=self._logprobs(out.token_ids, out.logprobs or []),
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        return self._chunk(item)

    def usage_chunk(self, usage: r.Usage) -> r.ChatCompletionChunk | None:
        """The last chunk (empty ``choices``) when the client asked for usage."""
        return self._chunk(None, usage) if self.include_usage else None
