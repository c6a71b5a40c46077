"""How a chat call's tools shape its request: the template's tool variables, the sampling
parameters tool parsing needs, and the grammar of a forced call ("required", a named tool).

:meth:`AsyncEngine.chat` calls these before rendering the prompt; parsing the model's calls
out of its output is :class:`~asyncllm.engine.tool_calls.ChatTools`'s job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

from asyncllm.engine.tool_calls import ChatTools
from asyncllm.errors import InvalidRequestError
from asyncllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["ChatToolSetup", "constrain_to_calls", "prepare_tools"]


class ChatToolSetup(NamedTuple):
    """What :func:`prepare_tools` decided for one chat call."""

    calls: ChatTools | None  # parses the output's calls; None without tools
    params: SamplingParams | None  # the call's params, adjusted for tool parsing
    chat_template_kwargs: Mapping[str, Any] | None  # with the tools for the template


def prepare_tools(
    tokenizer: Any,
    params: SamplingParams | None,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    *,
    parallel_tool_calls: bool,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> ChatToolSetup:
    """Validate a chat call's tools and derive its parser, params and template variables
    (cheap: runs on the event loop).

    Special tokens are kept in the output when the template's call markers are special
    tokens (the parser must see them), as vLLM's tool parsers ask.

    Raises:
        InvalidRequestError: malformed ``tools``, a ``tool_choice`` naming no tool or given
            without tools, tools for a template without tool support, or "required" / a
            named function together with ``params.structured_outputs``.
    """
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError(f"tool_choice {tool_choice!r:.80} needs tools")
        return ChatToolSetup(None, params, chat_template_kwargs)
    kind = params.output_kind if isinstance(params, SamplingParams) else "delta"
    calls = ChatTools.from_request(
        tokenizer,
        tools,
        tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        chat_template_kwargs=chat_template_kwargs,
        output_kind=kind,
    )
    template_kwargs = calls.template_kwargs(chat_template_kwargs)
    if (
        isinstance(params, SamplingParams)
        and params.skip_special_tokens
        and calls.keep_special_tokens(tokenizer)
    ):
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    if (
        calls.constrained
        and isinstance(params, SamplingParams)
        and params.structured_outputs is not None
    ):
        raise InvalidRequestError(
            f"tool_choice {calls.choice!r} constrains the output to tool calls; "
            "it cannot be combined with structured_outputs (response_format)"
        )
    return ChatToolSetup(calls, params, template_kwargs)


def constrain_to_calls(
    params: SamplingParams | None, spec: StructuredOutputsParams | None
) -> SamplingParams:
    """``params`` (default ``SamplingParams()``) with the forced-call grammar ``spec``
    (``ChatTools.structured_outputs``, built off the loop: it imports xgrammar)."""
    return msgspec.structs.replace(params or SamplingParams(), structured_outputs=spec)
