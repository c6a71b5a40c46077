"""Streaming a JSON value's canonical text while its raw text is still being generated.

A model writes a tool call's arguments with its own spacing and escapes; OpenAI's clients
join streamed ``function.arguments`` pieces and expect the result to be the call's
arguments. :class:`JsonCanonStream` turns raw JSON text, fed in any pieces, into the text
``json.dumps(json.loads(raw), ensure_ascii=False)`` gives (Python's default separators
``", "`` and ``": "``), emitting each part as soon as it is certain, so every emitted prefix
is a prefix of the final text. A parse-then-diff approach (vLLM's, with
``partial_json_parser``) re-encodes a partial object and can emit text it must later take
back (a number still growing, a closing brace); this one emits a scalar only when it is
complete and never closes a container early.

It also notes where each value of the outermost object begins and ends in the canonical
text (:attr:`JsonCanonStream.values`), which is how a call's ``name`` and ``arguments``
are found while they stream. The only difference from ``json.dumps(json.loads(raw))`` is
an object with a repeated key: both are kept (``json.loads`` keeps the last), which a
client's ``json.loads`` of the text reads the same way.

Pure Python (``json``); no torch.
"""

from __future__ import annotations

import json
import re

_WS = " \t\n\r"
_DELIMS = _WS + ",:]}"
_STRING_RUN = re.compile(r'[^"\\]+')


def _decodable(raw: str) -> int:
    """Length of the longest prefix of a string's raw content (no quotes) that decodes to
    the same characters as it will in the whole string: not inside an escape, and not
    after a ``\\uD8xx`` escape whose low half may follow."""
    i, n = 0, len(raw)
    while i < n:
        if raw[i] != "\\":
            i += 1
        elif i + 1 == n:
            return i
        elif raw[i + 1] != "u":
            i += 2
        elif i + 6 > n:
            return i
        elif raw[i + 2 : i + 4].lower() not in ("d8", "d9", "da", "db"):
            i += 6
        elif raw[i + 6 : i + 8] in ("", "\\") or (raw[i + 6 : i + 8] == "\\u" and i + 12 > n):
            return i  # a high surrogate: its low half may be coming
        else:
            i += 12 if raw[i + 6 : i + 8] == "\\u" else 6
    return n


class JsonCanonStream:
    """One JSON value's canonical text (see the module docstring), fed raw text in pieces.

    Attributes:
        text: the canonical text emitted so far (only ever appended to).
        done: the value is complete (later input is ignored).
        broken: the raw text is not JSON (nothing more is emitted).
        values: outermost-object key -> ``[start, end]`` offsets of its value in
            :attr:`text` (``end`` None while the value is incomplete).
        first_char: outermost-object key -> the first character of its value (``{``, ``"``,
            ``[``, a digit...).
    """

    def __init__(self) -> None:
        self.text = ""
        self.done = False
        self.broken = False
        self.values: dict[str, list[int | None]] = {}
        self.first_char: dict[str, str] = {}
        self._stack: list[str] = []  # "{" or "["
        self._expect = "value"  # "value", "key", "colon", "comma" (or a close)
        self._string: str | None = None  # raw content of the open string
        self._string_is_key = False
        self._escaped = False  # the open string's raw content ends in a lone backslash
        self._scalar: str | None = None  # raw text of the open number or literal
        self._key: str | None = None  # the outermost object's key whose value is next
        self._key_raw = ""

    def feed(self, raw: str) -> None:
        """Take the next raw characters."""
        i, n = 0, len(raw)
        while i < n and not (self.done or self.broken):
            if self._string is not None:
                i = self._in_string(raw, i)
                continue
            c = raw[i]
            if self._scalar is not None:
                if c not in _DELIMS:
                    self._scalar += c
                    i += 1
                    continue
                self._end_scalar()
                continue  # the delimiter is read below, in the next round
            i += 1
            if c in _WS:
                continue
            self._token(c)
        if self._string is not None and not self.broken:
            self._flush_string()

    # ------------------------------------------------------------------ internals

    def _emit(self, s: str) -> None:
        self.text += s

    def _fail(self) -> None:
        self.broken = True

    def _value_start(self, c: str) -> None:
        if len(self._stack) == 1 and self._stack[0] == "{" and self._key is not None:
            self.values[self._key] = [len(self.text), None]
            self.first_char[self._key] = c

    def _value_end(self) -> None:
        """A value just ended: mark it if outermost-object level; expect a comma."""
        if not self._stack:
            self.done = True
            return
        if len(self._stack) == 1 and self._stack[0] == "{" and self._key is not None:
            self.values[self._key][1] = len(self.text)
            self._key = None
        self._expect = "comma"

    def _token(self, c: str) -> None:
        expect = self._expect
        if c == '"' and expect in ("value", "key"):
            self._string_is_key = expect == "key"
            if expect == "value":
                self._value_start(c)
            self._string, self._key_raw = "", ""
            self._emit('"')
        elif expect == "value" and c in "{[":
            self._value_start(c)
            self._stack.append(c)
            self._emit(c)
            self._expect = "key" if c == "{" else "value"
        elif c in "}]" and self._stack and expect in ("comma", "key" if c == "}" else "value"):
            if "{[".index(self._stack[-1]) != "}]".index(c):
                return self._fail()
            if expect != "comma" and self.text[-1] not in "{[":
                return self._fail()  # a trailing comma
            self._stack.pop()
            self._emit(c)
            self._value_end()
        elif c == ":" and expect == "colon":
            self._emit(": ")
            self._expect = "value"
        elif c == "," and expect == "comma":
            self._emit(", ")
            self._expect = "key" if self._stack[-1] == "{" else "value"
        elif expect == "value" and c not in _DELIMS + '"{[':
            self._value_start(c)
            self._scalar = c
        else:
            self._fail()

    def _end_scalar(self) -> None:
        assert self._scalar is not None
        try:
            value = json.loads(self._scalar)
        except ValueError:
            return self._fail()
        self._scalar = None
        self._emit(json.dumps(value, ensure_ascii=False))
        self._value_end()

    def _in_string(self, raw: str, i: int) -> int:
        assert self._string is not None
        if self._escaped:  # the character after a backslash that ended the last piece
            self._string += raw[i]
            self._escaped = False
            return i + 1
        run = _STRING_RUN.match(raw, i)
        if run is not None:
            self._string += run.group()
            return run.end()
        if raw[i] == "\\":
            self._string += raw[i : i + 2]
            self._escaped = i + 1 == len(raw)
            return i + 2
        self._flush_string(final=True)  # the closing quote
        if self.broken:
            return i + 1
        self._emit('"')
        was_key, self._string = self._string_is_key, None
        if was_key:
            if len(self._stack) == 1:
                self._key = json.loads('"' + self._key_raw + '"', strict=False)
            self._expect = "colon"
        else:
            self._value_end()
        return i + 1

    def _flush_string(self, final: bool = False) -> None:
        """Emit the decodable part of the open string's raw content (all of it when
        ``final``: the string has ended)."""
        assert self._string is not None
        cut = len(self._string) if final else _decodable(self._string)
        if not cut:
            return
        raw, self._string = self._string[:cut], self._string[cut:]
        try:
            chars = json.loads('"' + raw + '"', strict=False)  # raw control chars allowed
        except ValueError:
            return self._fail()
        if self._string_is_key:
            self._key_raw += raw
        self._emit(json.dumps(chars, ensure_ascii=False)[1:-1])
