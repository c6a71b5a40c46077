"""Tool-call formats whose calls are not JSON objects between markers: Mistral's
``[TOOL_CALLS]``, the pythonic list of Llama 3.2/4, and Qwen3-Coder's XML. vLLM's tool
parsers of the same names are the reference for what each format means.

- ``"mistral"``: calls follow ``[TOOL_CALLS]``, either as a JSON list of ``{"name",
  "arguments"}`` objects (Mistral 7B v0.3, Mixtral, Mistral Nemo) or, from tokenizer v11
  on, as ``name[ARGS]{...}`` (one ``[TOOL_CALLS]`` per call, or several calls after one);
  text before the marker is content. Chosen when the template contains ``[TOOL_CALLS]``.
- ``"pythonic"`` (Llama 3.2's and Llama 4's pythonic templates): the whole message is a
  Python list of calls with keyword arguments, ``[get_weather(city="Paris"), get_time()]``
  (optionally after ``<|python_start|>``); argument values are Python literals, read with
  :func:`ast.literal_eval` (never evaluated as code). Chosen when the template shows the
  ``func_name1(params_name1=...)`` form.
- ``"qwen3_coder"`` (Qwen3-Coder): each call is ``<tool_call><function=NAME><parameter=KEY>
  value</parameter>...</function></tool_call>``, text between calls is content; a value is
  raw text (one newline trimmed at each end), converted by the type its tool's parameter
  schema gives (integer, number, boolean, object, array; a string or an unknown parameter
  stays text). Chosen when the template contains ``<function=`` and ``<parameter=``.

Each parser streams the content outside calls as it comes (holding back text that could
still begin a marker) and delivers each call whole once its text is complete, with one
:class:`~asyncllm.outputs.ToolCallDelta` carrying its id, name and arguments. Output that is
not a valid call is kept as content and described in ``error``, as with the JSON formats.

Pure Python (``ast``, ``json``, ``re``); no torch.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any

from asyncllm.outputs import ToolCall, ToolCallDelta
from asyncllm.tool_calling.tool_parser import (
    HERMES,
    HERMES_END,
    HERMES_START,
    JSON_FORMATS,
    ToolCallParser,
    held_prefix,
    new_call_id,
)

MISTRAL = "mistral"
PYTHONIC = "pythonic"
QWEN3_CODER = "qwen3_coder"

MISTRAL_MARKER = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
PYTHON_START = "<|python_start|>"
XML_START = "<tool_call>"
XML_END = "</tool_call>"

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class _WholeCallParser:
    """What the three formats share: calls delivered whole, the content outside them, the
    error noted once, ``parallel`` off keeping the first call only.

    Args:
        parallel: keep every call (False: the first only; the rest and their text dropped).
        schemas: each tool's parameter schema by function name (``qwen3_coder`` converts
            values by it).
    """

    def __init__(self, *, parallel: bool = True, schemas: Mapping[str, Any] | None = None):
        self.parallel = parallel
        self.schemas = dict(schemas or {})
        self.calls: list[ToolCall] = []
        self.error: str | None = None
        self._buf = ""
        self._deltas: list[ToolCallDelta] = []
        self._finished = False
        self._held = ""  # whitespace after a call, held until other text follows

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Take the next piece of generated text; returns (content released, calls
        completed by it)."""
        if self._finished:
            raise RuntimeError("tool-call parser fed after finish")
        self._buf += text
        return self._read(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the generation: release held-back text; an incomplete call is content."""
        self._finished = True
        return self._read(final=True)

    def take_deltas(self) -> list[ToolCallDelta]:
        """The calls' pieces since the last call (one per call: id, name and arguments)."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def _read(self, *, final: bool) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def _deliver(self, name: str, arguments: str, calls: list[ToolCall]) -> None:
        """Deliver a call (``arguments``: its JSON text, :func:`_arguments`)."""
        self._held = ""  # whitespace between calls is not content
        if not self.parallel and self.calls:
            return
        call = ToolCall(id=new_call_id(), name=name, arguments=arguments)
        self._deltas.append(
            ToolCallDelta(index=len(self.calls), id=call.id, name=name, arguments=arguments)
        )
        self.calls.append(call)
        calls.append(call)

    def _note(self, message: str) -> None:
        if self.error is None:
            self.error = f"tool call {len(self.calls) + 1}: {message}"

    def _content(self, text: str, final: bool) -> str:
        """``text`` as content: dropped after the first call with ``parallel`` off; after a
        call, whitespace alone is not content, so it is held until other text follows (the
        same content however the text was split)."""
        if not self.parallel and self.calls:
            return ""
        if not self.calls:
            return text
        text, self._held = self._held + text, ""
        if not text.strip():
            self._held = "" if final else text
            return ""
        return text


def _arguments(args: object) -> str | None:
    """A call's arguments as a JSON object's text, or None when they are not one (not a
    dict, or values JSON has no form for: NaN, infinities, sets, bytes...)."""
    if not isinstance(args, dict):
        return None
    try:
        return json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def _decode(text: str) -> tuple[Any, int] | None:
    """``raw_decode`` of the JSON value at the start of ``text`` (lenient strings, see
    :mod:`asyncllm.tool_calling.tool_parser`), or None when it is incomplete, malformed or nested
    past Python's recursion limit."""
    try:
        return json.JSONDecoder(strict=False).raw_decode(text)
    except (ValueError, RecursionError):
        return None


class MistralParser(_WholeCallParser):
    """Mistral's ``[TOOL_CALLS]`` calls (see the module docstring). Nothing after the marker
    is consumed until a call is complete, so a call's text is re-read from its start."""

    def __init__(self, *, parallel: bool = True, schemas: Mapping[str, Any] | None = None):
        super().__init__(parallel=parallel, schemas=schemas)
        self._in_calls = False

    def _read(self, *, final: bool) -> tuple[str, list[ToolCall]]:
        content = ""
        if not self._in_calls:
            at = self._buf.find(MISTRAL_MARKER)
            if at < 0:
                cut = len(self._buf) - (0 if final else held_prefix(self._buf, MISTRAL_MARKER))
                text, self._buf = self._buf[:cut], self._buf[cut:]
                return self._content(text, final), []
            content = self._content(self._buf[:at], final)
            self._buf, self._in_calls = self._buf[at:], True
        calls: list[ToolCall] = []
        while (step := self._next_call()) is not None:
            name, arguments, used = step
            self._buf = self._buf[used:]
            self._deliver(name, arguments, calls)
        if final:
            rest, self._buf = self._buf, ""
            if rest[self._skip(rest) :]:
                self._note(f"not a call: {rest.strip()[:40]!r}")
                content += self._content(rest, final)
        return content, calls

    @staticmethod
    def _skip(text: str) -> int:
        """Characters at the start of ``text`` that only separate calls: markers, the
        list's brackets, commas, whitespace."""
        i = 0
        while i < len(text):
            if text.startswith(MISTRAL_MARKER, i):
                i += len(MISTRAL_MARKER)
            elif text[i] in " \n\t,[]":
                i += 1
            else:
                break
        return i

    def _next_call(self) -> tuple[str, str, int] | None:
        """The next complete call at the start of the buffer: (name, arguments' JSON text,
        characters used, separators before it included), or None while it is incomplete or
        not one."""
        i = self._skip(self._buf)
        rest = self._buf[i:]
        if rest.startswith("{"):  # {"name": ..., "arguments": {...}}
            got = _decode(rest)
            if got is None or not isinstance(got[0], dict):
                return None
            obj, end = got
            arguments = _arguments(obj.get("arguments", obj.get("parameters", {})))
            if arguments is None or not isinstance(obj.get("name"), str):
                return None
            return obj["name"], arguments, i + end
        name = _NAME.match(rest)  # name[ARGS]{...}
        if name is None or not rest.startswith(MISTRAL_ARGS, name.end()):
            return None
        start = name.end() + len(MISTRAL_ARGS)
        got = _decode(rest[start:])
        arguments = None if got is None else _arguments(got[0])
        if got is None or arguments is None:
            return None
        return name.group(), arguments, i + start + got[1]


class PythonicParser(_WholeCallParser):
    """A pythonic list of calls (see the module docstring): content unless the message
    starts with ``[``; the calls are delivered when the list closes (at the first ``]``
    where the text so far is a whole list), and what follows is content."""

    def __init__(self, *, parallel: bool = True, schemas: Mapping[str, Any] | None = None):
        super().__init__(parallel=parallel, schemas=schemas)
        self._mode = "undecided"  # then "calls" or "content"

    def _read(self, *, final: bool) -> tuple[str, list[ToolCall]]:
        if self._mode == "undecided":
            head = self._buf.lstrip()
            if head.startswith(PYTHON_START):
                head = head[len(PYTHON_START) :].lstrip()
            if head.startswith("["):
                self._mode = "calls"
            elif head and not PYTHON_START.startswith(head):
                self._mode = "content"
            elif not final:
                return "", []
            else:
                self._mode = "content"
        if self._mode == "content":
            text, self._buf = self._buf, ""
            return self._content(text, final), []
        text = self._buf.lstrip()
        if text.startswith(PYTHON_START):
            text = text[len(PYTHON_START) :]
        end = text.find("]")
        while end >= 0:
            parsed = _pythonic_calls(text[: end + 1])
            if not isinstance(parsed, str):
                calls: list[ToolCall] = []
                for name, arguments in parsed:
                    self._deliver(name, arguments, calls)
                self._mode, self._buf = "content", ""  # what follows the list is content
                return self._content(text[end + 1 :], final), calls
            end = text.find("]", end + 1)
        if final:
            why = _pythonic_calls(text)
            self._note(why if isinstance(why, str) else "text after the list of calls")
            self._mode, text, self._buf = "content", self._buf, ""
            return text, []
        return "", []


def _pythonic_calls(text: str) -> list[tuple[str, str]] | str:
    """The calls of a pythonic list (name, arguments' JSON text), or what is wrong with it.
    Only literals are read (``ast.literal_eval``); nothing is evaluated."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return f"not a Python list of calls ({getattr(e, 'msg', type(e).__name__)})"
    if not isinstance(tree, ast.List):
        return "not a Python list of calls"
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return "each call must be name(keyword=value, ...)"
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return f"{node.func.id}: an argument is not a Python literal"
        arguments = _arguments(args)
        if arguments is None:
            return f"{node.func.id}: an argument has no JSON form"
        calls.append((node.func.id, arguments))
    return calls


class Qwen3CoderParser(_WholeCallParser):
    """Qwen3-Coder's XML calls (see the module docstring)."""

    def __init__(self, *, parallel: bool = True, schemas: Mapping[str, Any] | None = None):
        super().__init__(parallel=parallel, schemas=schemas)
        self._in_call = False

    def _read(self, *, final: bool) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self._in_call:
                at = self._buf.find(XML_START)
                if at < 0:
                    cut = len(self._buf) - (0 if final else held_prefix(self._buf, XML_START))
                    content.append(self._content(self._buf[:cut], final))
                    self._buf = self._buf[cut:]
                    break
                content.append(self._content(self._buf[:at], final))
                self._buf, self._in_call = self._buf[at:], True
            end = self._buf.find(XML_END)
            if end < 0:
                if final:
                    self._note(f"no closing {XML_END}")
                    content.append(self._content(self._buf, final))
                    self._buf = ""
                break
            raw = self._buf[: end + len(XML_END)]
            self._buf, self._in_call = self._buf[end + len(XML_END) :], False
            parsed = self._call(raw[len(XML_START) : end])
            if isinstance(parsed, str):
                self._note(parsed)
                content.append(self._content(raw, final))
            else:
                self._deliver(*parsed, calls)
        return "".join(content), calls

    def _call(self, body: str) -> tuple[str, str] | str:
        m = _FUNCTION.match(body)
        if m is None:
            return "not <function=NAME>...</function>"
        name, inner = m.group(1).strip(), m.group(2)
        schema = self.schemas.get(name)
        props = schema.get("properties") if isinstance(schema, Mapping) else None
        if not isinstance(props, Mapping):
            props = {}
        args: dict[str, Any] = {}
        pos = 0
        while (p := _PARAMETER.match(inner, pos)) is not None:
            key = p.group(1).strip()
            args[key] = _typed(p.group(2), props.get(key))
            pos = p.end()
        if inner[pos:].strip():
            return f"{name}: not <parameter=KEY>value</parameter>: {inner[pos:].strip()[:40]!r}"
        arguments = _arguments(args)
        return (name, arguments) if arguments is not None else f"{name}: a value has no JSON form"


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as the type its schema names (the text itself when it is a
    string, has no schema, or does not read as that type)."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if kind in (None, "string") or not isinstance(kind, str):
        return value
    try:
        got = json.loads(value)
    except (ValueError, RecursionError):
        return value
    types: dict[str, type | tuple[type, ...]] = {
        "integer": int, "number": (int, float), "boolean": bool, "object": dict,
        "array": list, "null": type(None),
    }  # fmt: skip
    want = types.get(kind)
    if want is None or (isinstance(got, bool) and kind in ("integer", "number")):
        return value
    return got if isinstance(got, want) else value


_PARSERS: dict[str, type[_WholeCallParser]] = {
    MISTRAL: MistralParser,
    PYTHONIC: PythonicParser,
    QWEN3_CODER: Qwen3CoderParser,
}

#: Every tool-call format asyncllm reads.
FORMATS = (*JSON_FORMATS, *_PARSERS)

#: Each format's markers: special tokens among them must stay in the decoded text.
MARKERS = {
    HERMES: (HERMES_START, HERMES_END),
    MISTRAL: (MISTRAL_MARKER, MISTRAL_ARGS),
    PYTHONIC: (PYTHON_START,),
    QWEN3_CODER: (XML_START, XML_END),
}


def make_parser(
    fmt: str, *, parallel: bool = True, schemas: Mapping[str, Any] | None = None
) -> ToolCallParser | _WholeCallParser:
    """A parser of one generation's calls in format ``fmt`` (one of :data:`FORMATS`);
    ``schemas``: each tool's parameter schema by name (values of ``qwen3_coder`` are
    converted by it).

    Raises:
        ValueError: an unknown ``fmt``.
    """
    if fmt in JSON_FORMATS:
        return ToolCallParser(fmt, parallel=parallel)
    if fmt not in _PARSERS:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}")
    return _PARSERS[fmt](parallel=parallel, schemas=schemas)


def parse_tool_calls(
    text: str, fmt: str, schemas: Mapping[str, Any] | None = None
) -> tuple[str, list[ToolCall], str | None]:
    """Parse a whole generation: ``(content, calls, error)`` as the format's parser gives
    them."""
    parser = make_parser(fmt, schemas=schemas)
    content, calls = parser.feed(text)
    more, last = parser.finish()
    return content + more, calls + last, parser.error
