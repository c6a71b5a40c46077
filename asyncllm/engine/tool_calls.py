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

A template that never mentions ``tools`` has no tool support: passing tools raises
:class:`~asyncllm.errors.InvalidRequestError` (the model would never see them).

Streaming: :class:`ToolCallParser` is fed text deltas and returns the content outside calls
as it comes (holding back only text that could still begin a call marker) and each call
once its JSON is complete; meanwhile it streams each call as OpenAI does
(:meth:`ToolCallParser.take_deltas`: id and name once the name is complete, then the
arguments text as it grows, canonical JSON from
:class:`~asyncllm.engine.json_stream.JsonCanonStream`, so the pieces join to the call's
``arguments``). Output the model gets wrong is never an error raised: a call whose JSON
does not parse, or that is not an object with a string ``name`` and object arguments, is
kept as content (its raw text, markers included) and described in
:attr:`ToolCallParser.error` (pieces of it already streamed stay sent; its index is not
reused).

Pure Python (``json``); no torch.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from asyncllm.engine.json_stream import JsonCanonStream
from asyncllm.errors import InvalidRequestError
from asyncllm.outputs import RequestOutput, ToolCall, ToolCallDelta
from asyncllm.sampling_params import StructuredOutputsParams

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
#: The formats :class:`ToolCallParser` reads.
FORMATS = (HERMES, LLAMA3_JSON)

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
#: What the grammar writes between parallel "llama3_json" calls (the parser takes ``;``
#: with any whitespace around it).
LLAMA3_SEPARATOR = "; "

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

# _LENIENT: calls are read with strict=False (raw control characters allowed in strings):
# xgrammar 0.2.9 lets a string with maxLength hold them (mlc-ai/xgrammar#800), and a
# grammar-constrained call must still parse. Arguments are re-encoded by json.dumps, so
# callers get valid JSON either way.

#: OpenAI's rule for function names.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def new_call_id() -> str:
    """A fresh tool-call id: ``"call_"`` and 24 hex digits (OpenAI's shape)."""
    return "call_" + uuid.uuid4().hex[:24]


def detect_format(template: str) -> str:
    """The tool-call format a chat template's model writes (see the module docstring).

    Args:
        template: the Jinja text of the template that renders the request (for a tokenizer
            with several named templates, the one ``get_chat_template(tools=...)`` picks).

    Raises:
        InvalidRequestError: the template has no tool support, or writes calls in a format
            not listed in :data:`FORMATS`.
    """
    if HERMES_START in template:
        return HERMES
    if "tools" not in template:
        raise InvalidRequestError(
            "this model's chat template has no tool support (it never renders `tools`), "
            "so the model cannot be given tools"
        )
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
        choice = tool_choice["function"]["name"]
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


def _as_call(
    obj: object, args_keys: tuple[str, ...], stream: _CallStream | None = None
) -> ToolCall | None:
    """A ToolCall from a decoded call object, or None when it is not one. With the
    ``stream`` that read the call's text: its id, and its canonical arguments text."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in args_keys if k in obj), None)
    args = obj[key] if key is not None else {}
    streamed = stream.arguments(key) if stream is not None and key is not None else None
    if streamed is not None and isinstance(args, dict):
        return ToolCall(id=stream.id, name=obj["name"], arguments=streamed)  # type: ignore[union-attr]
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    arguments = json.dumps(args, ensure_ascii=False)
    return ToolCall(
        id=stream.id if stream else new_call_id(), name=obj["name"], arguments=arguments
    )


class _CallStream:
    """The call being generated, read as it streams: its id, and the canonical text of its
    JSON object (:class:`JsonCanonStream`), from which its name and arguments are taken."""

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self.id = new_call_id()
        self.json = JsonCanonStream()
        self.fed = 0  # characters of the call's raw text fed
        self.args_keys = args_keys
        self.name: str | None = None
        self.header_sent = False
        self.args_sent = ""  # the arguments text sent so far

    def _span(self, key: str) -> tuple[int, int | None] | None:
        span = self.json.values.get(key)
        return None if span is None else (span[0], span[1])  # type: ignore[return-value]

    def arguments(self, key: str) -> str | None:
        """The canonical text of the complete object value of ``key``, or None."""
        span = self._span(key)
        if span is None or span[1] is None or self.json.first_char[key] != "{":
            return None
        return self.json.text[span[0] : span[1]]

    def pending(self, index: int) -> ToolCallDelta | None:
        """The piece that can be sent now, if any: the id and name once the name is
        complete, with the arguments text that follows what was sent. Arguments stream once
        their key is known (the first of ``args_keys`` that appears) and their value is an
        object (arguments written as a JSON string are sent whole, at the end)."""
        name = None
        if not self.header_sent:
            span = self._span("name")
            if span is None or span[1] is None or self.json.first_char["name"] != '"':
                return None
            name = json.loads(self.json.text[span[0] : span[1]])
            self.header_sent = True
        args = ""
        key = next((k for k in self.args_keys if k in self.json.values), None)
        if key is not None and self.json.first_char[key] == "{":
            start, end = self._span(key)  # type: ignore[misc]
            args = self.json.text[start + len(self.args_sent) : end]
            self.args_sent += args
        if name is not None:
            return ToolCallDelta(index=index, id=self.id, name=name, arguments=args)
        return ToolCallDelta(index=index, arguments=args) if args else None

    def last(self, index: int, call: ToolCall) -> ToolCallDelta | None:
        """The piece that completes ``call`` (read by this stream), or None when nothing is
        left to send; raises ValueError when what was sent does not begin its arguments
        (an object with both "arguments" and "parameters", say)."""
        if not self.header_sent:
            return ToolCallDelta(index=index, id=self.id, name=call.name, arguments=call.arguments)
        if not call.arguments.startswith(self.args_sent):
            raise ValueError("the streamed arguments are not those of the call")
        rest = call.arguments[len(self.args_sent) :]
        return ToolCallDelta(index=index, arguments=rest) if rest else None


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolCallParser:
    """Reads one generation's text, streamed or whole, in one tool-call format.

    Feed it text deltas with :meth:`feed` and end with :meth:`finish`; each returns
    ``(content, calls)``: the new content (text outside calls) and the calls completed by
    that text. Joined, the contents and calls are the same however the text was split.

    Args:
        fmt: one of :data:`FORMATS`.
        parallel: keep every call; False keeps only the first (OpenAI's
            ``parallel_tool_calls=false``; later calls and their text are dropped).

    Attributes:
        calls: every call delivered so far.
        error: None, or what was wrong with the model's calls (malformed JSON, not a call
            object, an unterminated call); the text in question was returned as content.

    Raises:
        ValueError: an unknown ``fmt``.
    """

    def __init__(self, fmt: str, *, parallel: bool = True) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}")
        self.fmt = fmt
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self.error: str | None = None
        self._buf = ""
        self._in_call = False  # hermes: inside <tool_call>...
        self._mode = "undecided"  # llama3_json: "undecided", "calls" or "content"
        self._raw = ""  # llama3_json: the text since the calls began (kept for errors)
        self._finished = False
        self._keys = (
            ("parameters", "arguments") if fmt == LLAMA3_JSON else ("arguments", "parameters")
        )
        self._stream: _CallStream | None = None  # the call being generated
        self._index = 0  # the streamed index of the next call
        self._deltas: list[ToolCallDelta] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Take the next piece of generated text.

        Returns:
            (content that can be released now, calls completed by this piece).
        """
        if self._finished:
            raise RuntimeError("ToolCallParser.feed after finish")
        self._buf += text
        if self.fmt == HERMES:
            return self._hermes(final=False)
        if self._mode == "calls" and self._stream is not None and "}" not in text:
            self._stream_feed(self._buf)  # no JSON object can have ended: no need to decode
            return "", []
        return self._llama(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the generation: release held-back text; an unterminated call whose
        JSON is complete is still taken (some models stop before the closing marker, and
        ``max_tokens`` may cut the text inside it: ``...}}</``)."""
        self._finished = True
        if self.fmt == HERMES:
            return self._hermes(final=True)
        return self._llama(final=True)

    def take_deltas(self) -> list[ToolCallDelta]:
        """The pieces of calls (:class:`~asyncllm.outputs.ToolCallDelta`) read since the last
        call: a call's id and name once its name is complete, then its arguments text as it
        grows; joined, a call's pieces give its :attr:`ToolCall.arguments`. With
        ``parallel`` off, only the first call's."""
        deltas, self._deltas = self._deltas, []
        return deltas

    # ------------------------------------------------------------------ internals

    def _stream_feed(self, text: str) -> None:
        """Feed the call being generated its text so far (from its start)."""
        if self._stream is None:
            self._stream = _CallStream(self._keys)
        st = self._stream
        st.json.feed(text[st.fed :])
        st.fed = len(text)
        delta = None if self._dropping() else st.pending(self._index)
        if delta is not None:
            self._deltas.append(delta)

    def _deliver(self, call: ToolCall, calls: list[ToolCall]) -> None:
        if self.parallel or not self.calls:
            assert self._stream is not None
            try:
                delta = self._stream.last(self._index, call)
            except ValueError as e:
                self._note(f"tool call {len(self.calls) + 1}: {e}")
                delta = None
            if delta is not None:
                self._deltas.append(delta)
            self._index += 1
            self.calls.append(call)
            calls.append(call)
        self._stream = None

    def _drop_stream(self) -> None:
        """The call being generated is not one: its index stays used if it was sent."""
        if self._stream is not None and self._stream.header_sent:
            self._index += 1
        self._stream = None

    def _note(self, message: str) -> None:
        if self.error is None:
            self.error = message

    def _dropping(self) -> bool:
        """With parallel off, everything after the first call is dropped."""
        return not self.parallel and bool(self.calls)

    def _hermes(self, *, final: bool) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            buf = self._buf
            if self._in_call:
                end = buf.find(HERMES_END)
                if end < 0 and not final:
                    self._stream_feed(buf)
                    break
                body = buf if end < 0 else buf[:end]
                self._stream_feed(body)
                self._buf = "" if end < 0 else buf[end + len(HERMES_END) :]
                self._in_call = False
                call = self._hermes_call(body, len(self.calls) + 1, closed=end >= 0)
                if call is not None:
                    self._deliver(call, calls)
                    continue
                self._drop_stream()
                if not self._dropping():
                    closing = "" if end < 0 else HERMES_END
                    if end < 0:
                        self._note(f"tool call {len(self.calls) + 1}: no closing {HERMES_END}")
                    content.append(HERMES_START + body + closing)
                if end < 0:
                    break
                continue
            start = buf.find(HERMES_START)
            if start >= 0:
                self._emit_text(buf[:start], content)
                self._buf = buf[start + len(HERMES_START) :]
                self._in_call = True
                continue
            keep = 0 if final else _held_prefix(buf, HERMES_START)
            text = buf[: len(buf) - keep]
            if self.calls and not text.strip() and not final:
                break  # whitespace after a call: held until something else follows
            self._emit_text(text, content)
            self._buf = buf[len(buf) - keep :]
            break
        return "".join(content), calls

    def _emit_text(self, text: str, content: list[str]) -> None:
        if self._dropping():
            return
        if self.calls and not text.strip():
            return  # the whitespace between and after calls is not content
        content.append(text)

    def _hermes_call(self, body: str, number: int, *, closed: bool) -> ToolCall | None:
        """The call in ``body`` (the text after ``<tool_call>``, up to ``</tool_call>`` when
        ``closed``), or None, with :attr:`error` noted.

        The JSON is read with ``raw_decode``: after it, only whitespace may follow, and, in
        a call cut before its closing marker (``max_tokens``), the start of that marker
        (``...}}</``): the call is complete, only its marker is missing.
        """
        text = body.lstrip()
        try:
            obj, end = json.JSONDecoder(strict=False).raw_decode(text)  # see _LENIENT
            rest = text[end:].strip()
            if rest and (closed or not HERMES_END.startswith(rest)):
                raise ValueError(f"Extra data after the JSON: {rest[:20]!r}")
        except ValueError as e:
            self._note(f"tool call {number}: invalid JSON ({e})")
            return None
        call = _as_call(obj, self._keys, self._stream)
        if call is None:
            self._note(f"tool call {number}: not an object with a string name and object arguments")
        return call

    def _llama(self, *, final: bool) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        if self._mode == "undecided":
            buf = self._buf
            head = buf.lstrip()
            if head.startswith(PYTHON_TAG):
                cut = len(buf) - len(head) + len(PYTHON_TAG)
            elif head.startswith("{"):
                cut = len(buf) - len(head)
            elif (not head or PYTHON_TAG.startswith(head)) and not final:
                return "", []  # not known yet
            else:
                cut = -1
            if cut < 0:
                self._mode = "content"
            else:
                self._mode, self._raw, self._buf = "calls", buf[:cut], buf[cut:]
        if self._mode == "content":
            text, self._buf = self._buf, ""
            return ("" if self._dropping() else text), []
        decoder = json.JSONDecoder(strict=False)  # see _LENIENT
        while True:
            buf = self._buf
            rest = buf.lstrip()
            while self.calls and rest.startswith(";"):  # the separator between calls
                rest = rest[1:].lstrip()
            self._raw += buf[: len(buf) - len(rest)]
            self._buf = rest
            if not rest:
                break
            try:
                obj, end = decoder.raw_decode(rest)
            except ValueError as e:
                self._stream_feed(rest)
                if final:  # incomplete until now; at the end, malformed
                    self._note(f"tool call {len(self.calls) + 1}: invalid JSON ({e})")
                    self._drop_stream()
                    self._to_content(content)
                break
            self._stream_feed(rest[:end])
            call = _as_call(obj, self._keys, self._stream)
            if call is None:
                self._drop_stream()
                if isinstance(obj, dict) and "name" in obj:  # meant as a call; other JSON is
                    self._note(  # an answer
                        f"tool call {len(self.calls) + 1}: not an object with a string name "
                        "and object parameters"
                    )
                self._to_content(content)
                self._mode = "content"
                break
            self._raw += rest[:end]
            self._buf = rest[end:]
            self._deliver(call, calls)
        return "".join(content), calls

    def _to_content(self, content: list[str]) -> None:
        """The model's text from here on is content: with no call delivered yet, all of it
        (the tag and the JSON as written)."""
        text = self._buf if self.calls else self._raw + self._buf
        self._buf = ""
        if not self._dropping():
            content.append(text)


def parse_tool_calls(text: str, fmt: str) -> tuple[str, list[ToolCall], str | None]:
    """Parse a whole generation: ``(content, calls, error)`` as :class:`ToolCallParser`
    gives them."""
    parser = ToolCallParser(fmt)
    content, calls = parser.feed(text)
    more, last = parser.finish()
    return content + more, calls + last, parser.error


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
        self._parsers: dict[int, ToolCallParser] = {}
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
                a template without tool support (unless ``tool_choice`` is "none").
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
        if self.fmt != HERMES:
            return False  # llama3_json needs no marker: the JSON is found without the tag
        special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
        return HERMES_START in special or HERMES_END in special

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
            parser = self._parsers[out.index] = ToolCallParser(self.fmt, parallel=self.parallel)
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
