"""Tool calling: checking OpenAI ``tools``/``tool_choice``, choosing the model's tool-call
format from its chat template, and parsing tool calls out of generated text (whole or
streamed).

Formats (the ones the chat templates of common Hugging Face models use; vLLM's tool parsers
of the same names are the reference):

- ``"hermes"`` (Hermes 2 Pro, Qwen 2/2.5/3, and the many templates that copied them): each
  call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; several calls may
  follow each other, with text before them. Chosen when the template contains
  ``<tool_call>``.
- ``"llama3_json"`` (Llama 3.1/3.2/3.3): the whole message is ``{"name": ...,
  "parameters": {...}}`` (optionally after ``<|python_tag|>``; several objects separated by
  ``;``). Chosen when the template renders ``"parameters"`` and mentions ``tools``.
- ``"mistral"``, ``"pythonic"`` and ``"qwen3_coder"``: see
  :mod:`asyncllm.tool_calling.tool_formats`. Their calls stream whole (one delta per call, when
  it is complete), and ``tool_choice`` "required" or a named function is refused for them
  (no grammar of their call syntax yet).

A template that never mentions ``tools`` has no tool support: passing tools raises
:class:`~asyncllm.errors.InvalidRequestError` (the model would never see them).
Parsing the model's output (whole or streamed) is :mod:`asyncllm.tool_calling.tool_parser`'s
(:class:`ToolCallParser`, re-exported here with the formats' names).

Pure Python (``json``); no torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from asyncllm.errors import InvalidRequestError
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import StructuredOutputsParams
from asyncllm.tool_calling.tool_formats import (
    FORMATS,
    MARKERS,
    MISTRAL,
    MISTRAL_MARKER,
    PYTHONIC,
    QWEN3_CODER,
    make_parser,
    parse_tool_calls,
)
from asyncllm.tool_calling.tool_parser import (
    HERMES,
    HERMES_END,
    HERMES_START,
    JSON_FORMATS,
    LLAMA3_JSON,
    LLAMA3_SEPARATOR,
    PYTHON_TAG,
    ToolCallParser,
    new_call_id,
)

__all__ = [
    "FORMATS",
    "HERMES",
    "HERMES_END",
    "HERMES_START",
    "HERMES_TEMPLATE",
    "JSON_FORMATS",
    "LLAMA3_JSON",
    "LLAMA3_SEPARATOR",
    "MISTRAL",
    "PYTHONIC",
    "PYTHON_TAG",
    "QWEN3_CODER",
    "ChatTools",
    "ToolCallParser",
    "call_schema",
    "check_message_tool_calls",
    "check_tool_choice",
    "check_tools",
    "detect_format",
    "make_parser",
    "new_call_id",
    "parse_tool_calls",
    "template_messages",
]

#: A small Hermes-style chat template (ChatML turns, tools in ``<tools>``, calls as
#: ``<tool_call>`` JSON, results as ``<tool_response>``): for a model whose own template has
#: no tool support, passed as ``chat_template_kwargs={"chat_template": HERMES_TEMPLATE}``.
#: Whether the model follows it depends on its training (Qwen and Hermes models do).
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

#: OpenAI's rule for function names.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def detect_format(template: str) -> str:
    """The tool-call format a chat template's model writes (see the module docstring).

    Args:
        template: the Jinja text of the template that renders the request (for a tokenizer
            with several named templates, the one ``get_chat_template(tools=...)`` picks).

    Raises:
        InvalidRequestError: the template has no tool support, or writes calls in a format
            not listed in :data:`FORMATS`.
    """
    if "<function=" in template and "<parameter=" in template:
        return QWEN3_CODER
    if HERMES_START in template:
        return HERMES
    if MISTRAL_MARKER in template:
        return MISTRAL
    if "tools" not in template:
        raise InvalidRequestError(
            "this model's chat template has no tool support (it never renders `tools`), "
            "so the model cannot be given tools"
        )
    if "func_name1(" in template:  # the pythonic templates' example call
        return PYTHONIC
    if '"parameters"' in template or PYTHON_TAG in template:
        return LLAMA3_JSON
    raise InvalidRequestError(
        "this model's chat template renders tools, but in a tool-call format asyncllm does "
        f"not parse (supported: {', '.join(FORMATS)})"
    )


def check_tools(tools: object) -> list[dict[str, Any]]:
    """Check OpenAI ``tools``: a non-empty list of ``{"type": "function", "function":
    {"name", "description"?, "parameters"?}}``, names unique.

    Returns:
        The tools as plain dicts (what the chat template gets).

    Raises:
        InvalidRequestError: naming the field (``tools[i].function.parameters`` ...): a
            tool that is not a dict of type "function", a name that is not 1-64 letters,
            digits, ``_`` or ``-``, a duplicate name, a description that is not a string,
            ``parameters`` that is not a JSON-schema object (a dict whose ``type``, when
            given, is "object").
    """
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)) or not tools:
        raise InvalidRequestError("tools must be a non-empty list of function tools")
    out = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise InvalidRequestError(f'{where} must be {{"type": "function", "function": ...}}')
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise InvalidRequestError(f"{where}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(
                f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}"
            )
        if name in names:
            raise InvalidRequestError(f"{where}.function.name {name!r} is given twice")
        names.add(name)
        if not isinstance(fn.get("description", ""), str):
            raise InvalidRequestError(f"{where}.function.description must be a string")
        schema = fn.get("parameters")
        if schema is not None and (
            not isinstance(schema, Mapping) or schema.get("type", "object") != "object"
        ):
            raise InvalidRequestError(
                f"{where}.function.parameters must be a JSON schema of an object "
                f'({{"type": "object", "properties": ...}}), got {schema!r:.80}'
            )
        out.append({"type": "function", "function": dict(fn)})
    return out


def check_tool_choice(tool_choice: object, tools: Sequence[Mapping[str, Any]] | None) -> str:
    """Check ``tool_choice`` against the (checked) tools.

    Returns:
        "none", "auto", "required", or the name of the function a named choice
        (``{"type": "function", "function": {"name": ...}}``) asks for.

    Raises:
        InvalidRequestError: another value; "required" or a named function without tools;
            a name that no tool has.
    """
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        choice = str(tool_choice)
    elif (
        isinstance(tool_choice, Mapping)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), Mapping)
        and isinstance(tool_choice["function"].get("name"), str)
    ):
        choice = str(tool_choice["function"]["name"])
        known = [t["function"]["name"] for t in tools or ()]
        if choice not in known:
            raise InvalidRequestError(
                f"tool_choice names the function {choice!r}, which is not in tools "
                f"({', '.join(map(repr, known)) or 'none given'})"
            )
        return choice
    else:
        raise InvalidRequestError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            f'"function": {{"name": ...}}}}, got {tool_choice!r:.80}'
        )
    if choice == "required" and not tools:
        raise InvalidRequestError('tool_choice "required" needs tools')
    return choice


def call_schema(tools: Sequence[Mapping[str, Any]], choice: str, fmt: str) -> dict[str, Any]:
    """The JSON schema one call object must follow when ``tool_choice`` is "required" or
    names a function: the hook for grammar-constrained decoding of tool calls.

    The object is what the format writes between its markers (``{"name": ..., "arguments":
    {...}}`` for "hermes", ``"parameters"`` for "llama3_json"): ``name`` fixed to the named
    function, or one of the tools' names (``anyOf``, one branch per tool) for "required".

    Args:
        tools: checked tools (:func:`check_tools`).
        choice: "required" or a function name (:func:`check_tool_choice`).
        fmt: one of :data:`FORMATS`.
    """
    key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    branches = []
    for tool in tools:
        fn = tool["function"]
        if choice not in ("required", fn["name"]):
            continue
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, key: params},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: an assistant ``tool_calls`` entry's
    ``function.arguments`` given as a JSON string (OpenAI's shape) becomes the object it
    encodes (templates write ``arguments | tojson``; vLLM converts the same way). Other
    messages are passed through (shallow copies)."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            m["tool_calls"] = [_template_call(c) for c in calls]
        out.append(m)
    return out


def _template_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call  # left as the string; check_message_tool_calls refused non-objects
    return {**call, "function": {**fn, "arguments": args}}


def check_message_tool_calls(i: int, message: Mapping[str, Any]) -> None:
    """Check message ``i``'s ``tool_calls`` (when present): a list of ``{"id"?, "type"?:
    "function", "function": {"name": str, "arguments": JSON-object string or object}}``.

    Raises:
        InvalidRequestError: naming ``messages[i].tool_calls[j]`` and what is wrong.
    """
    calls = message.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise InvalidRequestError(f"messages[{i}].tool_calls must be a list")
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError(f'{where} must be {{"function": {{"name": str, ...}}}}')
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise InvalidRequestError(
                    f"{where}.function.arguments is not valid JSON: {fn['arguments']!r:.80}"
                ) from None
        if not isinstance(args, Mapping):
            raise InvalidRequestError(f"{where}.function.arguments must be a JSON object")


class ChatTools:
    """The tool side of one ``chat`` call: what the template gets and how outputs are
    parsed (built by :meth:`from_request`, applied to each output by :meth:`apply`).

    Attributes:
        tools: the checked tools.
        choice: "none", "auto", "required" or a function name.
        fmt: the model's tool-call format (None with ``choice`` "none": nothing parsed).
        parallel: keep every call (False: the first only).
        output_kind: the request's ``SamplingParams.output_kind``.
    """

    def __init__(
        self,
        tools: list[dict[str, Any]],
        choice: str,
        fmt: str | None,
        *,
        parallel: bool = True,
        output_kind: str = "delta",
    ) -> None:
        self.tools = tools
        self.choice = choice
        self.fmt = fmt
        self.parallel = parallel
        self.output_kind = output_kind
        self._parsers: dict[int, Any] = {}  # a make_parser parser per sample
        self._content: dict[int, str] = {}  # cumulative: the content so far, per sample
        self._seen: dict[int, int] = {}  # cumulative: characters of text read, per sample

    @classmethod
    def from_request(
        cls,
        tokenizer: Any,
        tools: object,
        tool_choice: object,
        *,
        parallel_tool_calls: object = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        output_kind: str = "delta",
    ) -> ChatTools:
        """Check a chat call's tool arguments and pick the format from the template that
        will render it (``tokenizer.get_chat_template``, which prefers a "tool_use"
        template when a tokenizer has several).

        Raises:
            InvalidRequestError: bad ``tools``, ``tool_choice`` or
                ``parallel_tool_calls``; ``tools`` also given in ``chat_template_kwargs``;
                a template without tool support (unless ``tool_choice`` is "none");
                "required" or a named function for a format without a call grammar.
        """
        checked = check_tools(tools)
        choice = check_tool_choice(tool_choice, checked)
        if not isinstance(parallel_tool_calls, bool):
            raise InvalidRequestError("parallel_tool_calls must be a bool")
        if chat_template_kwargs and "tools" in chat_template_kwargs:
            raise InvalidRequestError("give tools once: as tools, not in chat_template_kwargs")
        fmt = None
        if choice != "none":
            override = (chat_template_kwargs or {}).get("chat_template")
            try:
                template = tokenizer.get_chat_template(override, checked)
            except ValueError as e:
                raise InvalidRequestError(f"no chat template to render tools: {e}") from e
            fmt = detect_format(template)
            if choice != "auto" and fmt not in JSON_FORMATS:
                raise InvalidRequestError(
                    f"tool_choice {choice!r} forces calls with a grammar, which asyncllm has "
                    f"for the {' and '.join(JSON_FORMATS)} formats only; this model writes "
                    f"{fmt!r} calls (use tool_choice 'auto')"
                )
        return cls(checked, choice, fmt, parallel=parallel_tool_calls, output_kind=output_kind)

    def template_kwargs(self, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """``chat_template_kwargs`` with the tools the template renders (a named
        ``tool_choice``: that tool alone, so the prompt asks for it) and ``tool_choice``
        (a template variable a few templates read)."""
        tools = self.tools
        if self.choice not in ("none", "auto", "required"):
            tools = [t for t in tools if t["function"]["name"] == self.choice]
        return {**(kwargs or {}), "tools": tools, "tool_choice": self.choice}

    @property
    def constrained(self) -> bool:
        """True when the output must be tool calls: ``tool_choice`` "required" or a named
        function (see :meth:`structured_outputs`)."""
        return self.fmt is not None and self.choice not in ("none", "auto")

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar that makes the whole output tool calls, when :attr:`constrained`
        (else None): for "hermes", ``<tool_call>\\n{json}\\n</tool_call>`` blocks joined by
        newlines, for "llama3_json" bare JSON objects joined by ``"; "`` (the separator
        vLLM's llama3_json parser reads; Llama 3.1's own template renders one call per
        message, and a model may stop after any call); one or more calls, exactly one when
        not :attr:`parallel`. Each call object follows :func:`call_schema`, so its name is an
        allowed one and its arguments match that function's parameter schema. JSON is
        compact (bounded whitespace), so a model cannot pad it forever. Builds the grammar
        text with xgrammar (imported on first use: call it off the event loop).

        Raises:
            InvalidRequestError: a parameter schema xgrammar cannot convert.
        """
        if not self.constrained:
            return None
        assert self.fmt is not None
        schema = call_schema(self.tools, self.choice, self.fmt)
        if self.fmt == LLAMA3_JSON and not self.parallel:
            return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        from asyncllm.structured_output import tagged_json_grammar

        if self.fmt == LLAMA3_JSON:
            begin, end, separator = "", "", LLAMA3_SEPARATOR
        else:
            begin, end, separator = HERMES_START + "\n", "\n" + HERMES_END, "\n"
        grammar = tagged_json_grammar(schema, begin, end, separator, at_most_one=not self.parallel)
        return StructuredOutputsParams(grammar=grammar)

    def keep_special_tokens(self, tokenizer: Any) -> bool:
        """True when the format's markers are special tokens of ``tokenizer``, which
        ``skip_special_tokens`` would drop from the text the parser reads (vLLM's hermes
        parser turns it off for the same reason)."""
        special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
        # llama3_json needs no marker: the JSON is found without the tag
        return any(m in special for m in MARKERS.get(self.fmt or "", ()))

    def apply(self, out: RequestOutput) -> RequestOutput:
        """One output of the call with its tool calls parsed out of ``text`` (see
        :attr:`RequestOutput.tool_calls`); the last item gets ``finish_reason``
        "tool_calls" when the model made calls and stopped on its own, and
        ``tool_call_error`` when something was wrong. With ``output_kind`` "delta", each
        item also gets the pieces of calls it generated (``tool_call_deltas``)."""
        if self.fmt is None:
            return out
        parser = self._parsers.get(out.index)
        if parser is None:
            schemas = {t["function"]["name"]: t["function"].get("parameters") for t in self.tools}
            parser = make_parser(self.fmt, parallel=self.parallel, schemas=schemas)
            self._parsers[out.index] = parser
        new = out.text
        if self.output_kind == "cumulative":
            seen = self._seen.get(out.index, 0)
            new, self._seen[out.index] = out.text[seen:], len(out.text)
        content, calls = parser.feed(new)
        if out.finished:
            more, last = parser.finish()
            content, calls = content + more, calls + last
        fields: dict[str, Any] = {}
        deltas = parser.take_deltas()
        if self.output_kind == "delta":
            fields["text"], fields["tool_calls"] = content, calls or None
            fields["tool_call_deltas"] = deltas or None
        else:
            content = self._content[out.index] = self._content.get(out.index, "") + content
            fields["text"], fields["tool_calls"] = content, list(parser.calls) or None
        if out.finished:
            error = parser.error
            if not parser.calls and self.choice != "auto":
                error = error or (
                    f"tool_choice {self.choice!r} asked for a tool call but the output has "
                    f"no complete one (finish_reason {out.finish_reason!r})"
                )
            elif self.choice not in ("auto", "required"):
                other = [c.name for c in parser.calls if c.name != self.choice]
                if other and error is None:
                    error = f"tool_choice named {self.choice!r} but the model called {other}"
            fields["tool_call_error"] = error
            if parser.calls and out.finish_reason == "stop":
                fields["finish_reason"] = "tool_calls"
        return msgspec.structs.replace(out, **fields)
