"""The JSON bodies the server answers with, as msgspec structs (encoded with
``msgspec.json``), and the conversions of engine outputs' pieces (logprobs, tool calls) to
their OpenAI shapes.

Field names and order follow OpenAI's API reference (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``). ``None`` is sent as ``null``; a field whose value
is :data:`msgspec.UNSET` is left out (``usage`` of a streamed chunk without
``stream_options.include_usage``, ``message.tool_calls`` without calls, the keys a
``delta`` does not carry).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from asyncllm.outputs import PositionLogprobs, ToolCall, ToolCallDelta

__all__ = [
    "ChatChoice", "ChatChunkChoice", "ChatCompletion", "ChatCompletionChunk", "ChatLogprobs",
    "ChatMessage", "Completion", "CompletionChoice", "CompletionLogprobs", "Delta",
    "ErrorBody", "ErrorInfo", "Health", "ModelCard", "ModelList", "Usage", "api_token",
    "chat_logprobs", "completion_logprobs", "encode", "tool_call_deltas_json",
    "tool_call_json", "usage",
]  # fmt: skip

encode = msgspec.json.Encoder().encode


class _Body(msgspec.Struct, kw_only=True):
    """Base of the response structs (keyword-only, so optional fields may come first)."""


class ErrorInfo(_Body, kw_only=True):
    """OpenAI's ``error`` object."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(_Body, kw_only=True):
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class PromptTokensDetails(_Body, kw_only=True):
    """``usage.prompt_tokens_details``: ``cached_tokens`` were served from the prefix cache."""

    cached_tokens: int


class Usage(_Body, kw_only=True):
    """OpenAI's ``usage`` (token counts)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Usage:
    """OpenAI's ``usage`` object (``prompt_tokens_details.cached_tokens``: prompt tokens
    served from the prefix cache; left out when None)."""
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=UNSET
        if cached_tokens is None
        else PromptTokensDetails(cached_tokens=cached_tokens),
    )


class ModelCard(_Body, kw_only=True):
    """One ``/v1/models`` entry (``max_model_len``: tokens, vLLM's extension)."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "asyncllm"
    max_model_len: int


class ModelList(_Body, kw_only=True):
    """The ``/v1/models`` list."""

    object: str = "list"
    data: list[ModelCard]


class Health(_Body, kw_only=True):
    """The ``/health`` body: the engine's state ("running"...)."""

    status: str


# ---------------------------------------------------------------------------- logprobs


class CompletionLogprobs(_Body, kw_only=True):
    """The legacy ``choices[].logprobs`` object of ``/v1/completions``."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprob(_Body, kw_only=True):
    """One alternative of ``logprobs.content[].top_logprobs``."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(_Body, kw_only=True):
    """One ``logprobs.content[]`` entry of a chat choice."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body, kw_only=True):
    """A chat choice's ``logprobs``."""

    content: list[TokenLogprob]
    refusal: str | None = None


def _ranked(position: PositionLogprobs, k: int) -> list[tuple[int, Any]]:
    return sorted(position.items(), key=lambda kv: kv[1].rank)[:k]


def api_token(data: bytes) -> str:
    """A token's ``token`` string in OpenAI's logprobs, from its raw bytes (see
    :class:`~asyncllm.outputs.Logprob`'s ``token_bytes``).

    Bytes that are valid UTF-8 give their text. A token that holds part of a character (a
    byte token, SmolLM2's ``"æ"`` = 0xE6) gives ``"bytes:"`` and its bytes as ``\\xNN``
    escapes (printable ASCII kept), OpenAI's convention: ``"bytes:\\xe6"``. (vLLM answers
    ``decode([id])`` there, i.e. U+FFFD, and then the U+FFFD's bytes.) The exact bytes are
    in the ``bytes`` field either way.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(
            chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in data
        )


def _utf8_starts(data: bytes) -> int:
    """How many characters start in ``data``: its bytes that are not UTF-8 continuations."""
    return sum(1 for b in data if b & 0xC0 != 0x80)


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[PositionLogprobs], top: int
) -> list[TokenLogprob]:
    """``choices[].logprobs.content`` entries for generated tokens: ``token`` as
    :func:`api_token` names it and ``bytes`` the token's raw bytes (the tokenizer's own
    mapping, so the bytes of a piece of a character are that piece); ``top`` alternatives
    each, by rank."""
    content = []
    for tid, pos in zip(token_ids, logprobs, strict=False):
        chosen = pos[tid]
        content.append(
            TokenLogprob(
                token=api_token(chosen.token_bytes),
                logprob=chosen.logprob,
                bytes=list(chosen.token_bytes),
                top_logprobs=[
                    TopLogprob(
                        token=api_token(lp.token_bytes),
                        logprob=lp.logprob,
                        bytes=list(lp.token_bytes),
                    )
                    for _, lp in _ranked(pos, top)
                ],
            )
        )
    return content


def completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[PositionLogprobs], top: int, offset: int
) -> tuple[CompletionLogprobs, int]:
    """The legacy ``choices[].logprobs`` object (``tokens``, ``token_logprobs``,
    ``top_logprobs``, ``text_offset``) and the offset state after these tokens.

    Tokens are named by :func:`api_token`. ``text_offset`` is, as OpenAI reports it, the
    index in the choice's text (in characters) of the character the token's first byte
    belongs to: the tokens ``"bytes:\\xe9\\x80"``, ``"bytes:\\x82"`` of one character
    share its offset, and the next token's offset is one more. ``offset`` (0 for a new
    choice) and the returned state count the characters started so far (UTF-8 lead bytes),
    so a stream's chunks can be converted one by one.
    """
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for tid, pos in zip(token_ids, logprobs, strict=False):
        chosen = pos[tid]
        name = api_token(chosen.token_bytes)
        out.tokens.append(name)
        out.token_logprobs.append(chosen.logprob)
        alternatives = {api_token(lp.token_bytes): lp.logprob for _, lp in _ranked(pos, top)}
        alternatives.setdefault(name, chosen.logprob)
        out.top_logprobs.append(alternatives)
        data = chosen.token_bytes
        if data and data[0] & 0xC0 == 0x80:  # starts inside a character: at its offset
            if offset == 0:  # a character the prompt began: the text's first
                offset = 1
            out.text_offset.append(offset - 1)
        else:
            out.text_offset.append(offset)
        offset += _utf8_starts(data)
    return out, offset


# ---------------------------------------------------------------------------- tool calls


class FunctionCall(_Body, kw_only=True):
    """``tool_calls[].function``: the called function and its arguments (JSON text)."""

    name: str
    arguments: str


class ToolCallJSON(_Body, kw_only=True):
    """One ``message.tool_calls[]`` item."""

    id: str
    type: str = "function"
    function: FunctionCall


class FunctionDelta(_Body, kw_only=True):
    """``delta.tool_calls[].function``: the name (first piece only) and arguments text."""

    name: str | UnsetType = UNSET
    arguments: str = ""


class ToolCallDeltaJSON(_Body, kw_only=True):
    """One ``delta.tool_calls[]`` item: a call's first has ``id``, ``type`` and the name."""

    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: FunctionDelta


def tool_call_json(call: ToolCall) -> ToolCallJSON:
    """A call as OpenAI's ``message.tool_calls[]`` item."""
    return ToolCallJSON(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def tool_call_deltas_json(deltas: Sequence[ToolCallDelta]) -> list[ToolCallDeltaJSON]:
    """Streamed call pieces as OpenAI's ``delta.tool_calls[]`` items: a call's first item
    has ``index``, ``id``, ``type`` and ``function.name`` (and the arguments so far), later
    ones ``index`` and ``function.arguments`` only; a call's pieces of one engine item are
    merged into one entry (vLLM and OpenAI send the same shapes)."""
    out: list[ToolCallDeltaJSON] = []
    for d in deltas:
        if out and out[-1].index == d.index:
            out[-1].function.arguments += d.arguments
        elif d.id is not None:
            name = UNSET if d.name is None else d.name
            out.append(
                ToolCallDeltaJSON(
                    index=d.index,
                    id=d.id,
                    type="function",
                    function=FunctionDelta(name=name, arguments=d.arguments),
                )
            )
        else:
            out.append(
                ToolCallDeltaJSON(index=d.index, function=FunctionDelta(arguments=d.arguments))
            )
    return out


# ---------------------------------------------------------------------------- bodies


class _Response(_Body, kw_only=True):
    """The head every generation body and chunk shares (``created``: Unix time, s)."""

    id: str
    object: str
    created: int
    model: str


class CompletionChoice(_Body, kw_only=True):
    """One ``choices[]`` item of ``/v1/completions`` (a body's or a streamed chunk's)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class Completion(_Response, kw_only=True):
    """A ``/v1/completions`` body, and each chunk of its stream (OpenAI's ``object`` is
    "text_completion" for both). ``usage``: left out of a chunk unless the client asked for
    usage, then null but in the last chunk (whose ``choices`` are empty)."""

    object: str = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | UnsetType | None = UNSET


class ChatMessage(_Body, kw_only=True):
    """A chat choice's ``message`` (``content`` null when the model made only tool calls;
    ``reasoning_content``, as vLLM names it, only from a thinking model)."""

    role: str = "assistant"
    content: str | None
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCallJSON] | UnsetType = UNSET


class ChatChoice(_Body, kw_only=True):
    """One ``choices[]`` item of a ``/v1/chat/completions`` body."""

    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletion(_Response, kw_only=True):
    """A ``/v1/chat/completions`` body."""

    object: str = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(_Body, kw_only=True):
    """A streamed chat choice's ``delta``: only the keys the chunk carries."""

    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDeltaJSON] | UnsetType = UNSET


class ChatChunkChoice(_Body, kw_only=True):
    """One ``choices[]`` item of a streamed chat chunk (the role chunk has no
    ``stop_reason``)."""

    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | UnsetType | None = UNSET


class ChatCompletionChunk(_Response, kw_only=True):
    """A chunk of a streamed ``/v1/chat/completions`` response; ``usage`` as in
    :class:`Completion`."""

    object: str = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | UnsetType | None = UNSET
