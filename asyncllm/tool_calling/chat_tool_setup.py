"""How a chat call's tools shape its request: the template's tool variables, the sampling
parameters tool parsing needs, and the grammar of a forced call ("required", a named tool).

:meth:`AsyncEngine.chat` calls these before rendering the prompt; parsing the model's calls
out of its output is :class:`~asyncllm.tool_calling.tool_calls.ChatTools`'s job.

What a chat call with tools returns (OpenAI's tool calling; vLLM's tool parsers are the
reference): ``tools`` are rendered by the template (transformers'
``apply_chat_template(tools=...)``) and the model's calls are parsed out of its output in the
format its template uses (``<tool_call>`` JSON as Hermes/Qwen write it, or Llama 3's JSON;
see :mod:`asyncllm.tool_calling.tool_calls`): items carry them in ``tool_calls`` (a call is
delivered whole, on the item whose text completed it; ``text`` holds only the content outside
calls); with ``output_kind`` "delta" they also stream in ``tool_call_deltas`` (id and name,
then the arguments text in pieces, as OpenAI streams ``delta.tool_calls``), and the last item
has ``finish_reason`` "tool_calls" when the model made calls and stopped on its own. Output
that is not a valid call stays in ``text`` and is described in ``tool_call_error``; it never
raises.

``tool_choice`` "required" and a named function (``{"type": "function", "function":
{"name": ...}}``) constrain the output with a grammar (``structured_outputs``, set by
:func:`constrain_to_calls`): the whole output is tool calls in the template's format, each
naming an allowed function with arguments that match its parameter schema
(``ChatTools.structured_outputs``); only ``max_tokens`` can cut a call short (finish_reason
"length", ``tool_call_error`` set).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

from asyncllm.errors import InvalidRequestError
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams, StructuredOutputsParams
from asyncllm.tool_calling.reasoning import THINK_END, ReasoningSplit, thinks
from asyncllm.tool_calling.tool_calls import ChatTools

__all__ = ["ChatOutputs", "ChatToolSetup", "constrain_to_calls", "render_chat_call"]


class ChatToolSetup(NamedTuple):
    """A chat call's tool arguments (see :meth:`AsyncEngine.chat`)."""

    tools: Sequence[Mapping[str, Any]] | None  # OpenAI function tools
    tool_choice: str | Mapping[str, Any] | None  # "auto", "none", "required" or a tool
    parallel_tool_calls: bool  # False keeps only the first call

    def prepare(
        self,
        tokenizer: Any,
        params: SamplingParams | None,
        chat_template_kwargs: Mapping[str, Any] | None,
    ) -> tuple[ChatTools | None, SamplingParams | None, Mapping[str, Any] | None]:
        """Validate the tools and derive the call's parser (None without tools), its
        params and its template variables (with the tools); cheap, on the event loop.

        Special tokens are kept in the output when the template's call markers are special
        tokens (the parser must see them), as vLLM's tool parsers ask.

        Raises:
            InvalidRequestError: malformed ``tools``, a ``tool_choice`` naming no tool or
                given without tools, tools for a template without tool support, or
                "required" / a named function together with ``params.structured_outputs``.
        """
        if isinstance(params, SamplingParams) and params.skip_special_tokens:
            template = _template(tokenizer, chat_template_kwargs, self.tools)
            if template is not None and thinks(template) and _special(tokenizer, THINK_END):
                params = msgspec.structs.replace(params, skip_special_tokens=False)
        if self.tools is None:
            if self.tool_choice not in (None, "none", "auto"):
                raise InvalidRequestError(f"tool_choice {self.tool_choice!r:.80} needs tools")
            return None, params, chat_template_kwargs
        kind = params.output_kind if isinstance(params, SamplingParams) else "delta"
        calls = ChatTools.from_request(
            tokenizer,
            self.tools,
            self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
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
        return calls, params, template_kwargs


def constrain_to_calls(
    params: SamplingParams | None, spec: StructuredOutputsParams | None
) -> SamplingParams:
    """``params`` (default ``SamplingParams()``) with the forced-call grammar ``spec``
    (``ChatTools.structured_outputs``, built off the loop: it imports xgrammar)."""
    return msgspec.structs.replace(params or SamplingParams(), structured_outputs=spec)


def _template(tokenizer: Any, kwargs: Mapping[str, Any] | None, tools: object) -> str | None:
    """The template that renders the call (None when the tokenizer has none: rendering
    then fails with its own error)."""
    try:
        return str(tokenizer.get_chat_template((kwargs or {}).get("chat_template"), tools))
    except ValueError:
        return None


def _special(tokenizer: Any, marker: str) -> bool:
    """``marker`` is a special token, which ``skip_special_tokens`` drops from the text."""
    return marker in set(getattr(tokenizer, "all_special_tokens", ()) or ())


class ChatOutputs:
    """What a chat call does to each output of its stream: the reasoning split off
    (:class:`~asyncllm.tool_calling.reasoning.ReasoningSplit`), then tool calls parsed from the
    answer alone (:class:`~asyncllm.tool_calling.tool_calls.ChatTools`)."""

    def __init__(self, reasoning: ReasoningSplit | None, calls: ChatTools | None) -> None:
        self.reasoning = reasoning
        self.calls = calls

    def apply(self, out: RequestOutput) -> RequestOutput:
        """``out`` with its reasoning and tool calls taken out of ``text``."""
        if self.reasoning is not None:
            out = self.reasoning.apply(out)
        return out if self.calls is None else self.calls.apply(out)


def render_chat_call(
    inputs: Any,
    messages: Sequence[Mapping[str, Any]],
    calls: ChatTools | None,
    params: SamplingParams | None,
    *,
    add_generation_prompt: bool,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> tuple[list[int], SamplingParams | None, ChatOutputs | None]:
    """Render and tokenize a chat call (``InputProcessor.render_chat``), constrain its
    ``params`` to tool calls when :attr:`ChatTools.constrained` (:func:`constrain_to_calls`;
    this imports xgrammar), and build what its outputs go through (None when nothing: no
    tools, no thinking). Time proportional to the messages: call it off the event loop.

    Raises:
        InvalidRequestError: as ``InputProcessor.render_chat`` and
            ``ChatTools.structured_outputs``.
    """
    if calls is not None and calls.constrained:
        params = constrain_to_calls(params, calls.structured_outputs())
    ids: list[int] = inputs.render_chat(
        messages,
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=chat_template_kwargs,
    )
    kwargs = chat_template_kwargs or {}
    template = _template(inputs.tokenizer, kwargs, kwargs.get("tools"))
    kind = params.output_kind if isinstance(params, SamplingParams) else "delta"
    split = None
    if template is not None:
        split = ReasoningSplit.for_prompt(inputs.tokenizer, template, ids, kind)
    if split is None and calls is None:
        return ids, params, None
    return ids, params, ChatOutputs(split, calls)
