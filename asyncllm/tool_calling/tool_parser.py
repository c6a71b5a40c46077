"""Reading tool calls out of generated text, whole or streamed: the formats'
markers and :class:`ToolCallParser` (see :mod:`asyncllm.tool_calling.tool_calls` for the formats,
how one is chosen from a chat template, and the checks of OpenAI's ``tools``).

Streaming: :class:`ToolCallParser` is fed text deltas and returns the content outside calls
as it comes (holding back only text that could still begin a call marker) and each call
once its JSON is complete; meanwhile it streams each call as OpenAI does
(:meth:`ToolCallParser.take_deltas`: id and name once the name is complete, then the
arguments text as it grows, canonical JSON from
:class:`~asyncllm.tool_calling.json_stream.JsonCanonStream`, so the pieces join to the call's
``arguments``). Output the model gets wrong is never an error raised: a call whose JSON
does not parse, or that is not an object with a string ``name`` and object arguments, is
kept as content (its raw text, markers included) and described in
:attr:`ToolCallParser.error` (pieces of it already streamed stay sent; its index is not
reused).

Pure Python (``json``); no torch.
"""

from __future__ import annotations

import json
import uuid

from asyncllm.outputs import ToolCall, ToolCallDelta
from asyncllm.tool_calling.json_stream import JsonCanonStream

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
#: The formats :class:`ToolCallParser` reads (the others are
#: :mod:`asyncllm.tool_calling.tool_formats`').
JSON_FORMATS = (HERMES, LLAMA3_JSON)

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
#: What the grammar writes between parallel "llama3_json" calls (the parser takes ``;``
#: with any whitespace around it).
LLAMA3_SEPARATOR = "; "

# _LENIENT: calls are read with strict=False (raw control characters allowed in strings):
# xgrammar 0.2.9 lets a string with maxLength hold them (mlc-ai/xgrammar#800), and a
# grammar-constrained call must still parse. Arguments are re-encoded by json.dumps, so
# callers get valid JSON either way.


def new_call_id() -> str:
    """A fresh tool-call id: ``"call_"`` and 24 hex digits (OpenAI's shape)."""
    return "call_" + uuid.uuid4().hex[:24]


def _as_call(
    obj: object, args_keys: tuple[str, ...], stream: _CallStream | None = None
) -> ToolCall | None:
    """A ToolCall from a decoded call object, or None when it is not one. With the
    ``stream`` that read the call's text: its id, and its canonical arguments text."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in args_keys if k in obj), None)
    args = obj[key] if key is not None else {}
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    try:  # NaN and infinities have no JSON form (json.loads reads them)
        arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None
    streamed = stream.arguments(key) if stream is not None and key is not None else None
    if streamed is not None and isinstance(obj[key], dict):
        return ToolCall(id=stream.id, name=obj["name"], arguments=streamed)  # type: ignore[union-attr]
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


def held_prefix(text: str, marker: str) -> int:
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
        fmt: one of :data:`JSON_FORMATS`.
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
        if fmt not in JSON_FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(JSON_FORMATS)}")
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
            keep = 0 if final else held_prefix(buf, HERMES_START)
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
        except (ValueError, RecursionError) as e:
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
            except (ValueError, RecursionError) as e:
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
