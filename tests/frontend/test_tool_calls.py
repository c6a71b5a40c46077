"""Tool-call parsing (asyncllm.tool_calling.tool_calls) on fixed model outputs: whole, split at
every (hypothesis-drawn) set of points, parallel calls, malformed JSON; and the checks of
``tools``, ``tool_choice`` and assistant ``tool_calls`` messages."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm.errors import InvalidRequestError
from asyncllm.tool_calling import tool_calls as tc

WEATHER = {"city": "Paris", "unit": "°C"}
HERMES_TWO = (
    "Let me look that up.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
LLAMA_TWO = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}; '
    '{"name": "get_time", "parameters": {"tz": "CET"}}'
)
LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}'
HERMES_BAD = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
LLAMA_BAD = '{"name": "get_weather", "parameters": {"city": "Paris"'
MISTRAL_LIST = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}, '
    '{"name": "get_time", "arguments": {"tz": "CET"}}]'
)
MISTRAL_V11 = (
    'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "°C"}'
    '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}'
)
PYTHONIC_TWO = '[get_weather(city="Paris", unit="°C"), get_time(tz="CET")]'
QWEN_TWO = (
    "Looking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=unit>\n°C\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>\n"
    "</tool_call>"
)
QWEN_BAD = "<tool_call>\n<function=f>\nnot xml\n</function>\n</tool_call>"
TWO = [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]

# (format, model output, content, [(name, arguments)], error expected)
CASES = [
    (tc.HERMES, HERMES_TWO, "Let me look that up.\n",
     [("get_weather", WEATHER), ("get_time", {"tz": "CET"})], False),
    (tc.HERMES, "Just text, no call <tool_ here.", "Just text, no call <tool_ here.", [], False),
    (tc.HERMES, HERMES_BAD, HERMES_BAD, [], True),
    # unterminated, but complete JSON: taken (a model that stopped before the marker)
    (tc.HERMES, '<tool_call>{"name": "f", "arguments": {}}', "", [("f", {})], False),
    (tc.HERMES, '<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', [], True),
    # complete JSON cut by max_tokens inside its closing marker: the call is kept
    (tc.HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1}}</', "", [("f", {"a": 1})],
     False),
    (tc.HERMES, HERMES_TWO[: -len("l>")], "Let me look that up.\n",
     [("get_weather", WEATHER), ("get_time", {"tz": "CET"})], False),
    # other text after the JSON is no marker: malformed, closed or not
    (tc.HERMES, '<tool_call>{"name": "f", "arguments": {}} and </', '<tool_call>{"name": '
     '"f", "arguments": {}} and </', [], True),
    (tc.HERMES, '<tool_call>{"name": "f", "arguments": {}}</</tool_call>', '<tool_call>{"name": '
     '"f", "arguments": {}}</</tool_call>', [], True),
    # the arguments written as a JSON string
    (tc.HERMES, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "",
     [("f", {"a": 1})], False),
    (tc.HERMES, '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}'
     "</tool_call>", [], True),
    (tc.LLAMA3_JSON, LLAMA_TWO, "", [("get_weather", WEATHER), ("get_time", {"tz": "CET"})],
     False),
    (tc.LLAMA3_JSON, LLAMA_ONE, "", [("get_weather", WEATHER)], False),
    (tc.LLAMA3_JSON, "  " + LLAMA_ONE + "\n", "", [("get_weather", WEATHER)], False),
    (tc.LLAMA3_JSON, LLAMA_BAD, LLAMA_BAD, [], True),
    # a second call cut by max_tokens: the complete first one is kept
    (tc.LLAMA3_JSON, LLAMA_TWO[:-20], '{"name": "get_time", "paramet', [("get_weather", WEATHER)],
     True),
    (tc.LLAMA3_JSON, "The answer is 4.", "The answer is 4.", [], False),
    (tc.LLAMA3_JSON, '{"answer": 4}', '{"answer": 4}', [], False),  # JSON, not a call
    (tc.LLAMA3_JSON, '{"name": 3, "parameters": {}}', '{"name": 3, "parameters": {}}', [],
     True),
    (tc.MISTRAL, MISTRAL_LIST, "", TWO, False),
    (tc.MISTRAL, MISTRAL_V11, "Sure.", TWO, False),
    (tc.MISTRAL, "[TOOL_CALLS]get_time[ARGS]{}\n[TOOL_CALLS]", "", [("get_time", {})], False),
    (tc.MISTRAL, "Plain answer [TOOL", "Plain answer [TOOL", [], False),
    (tc.MISTRAL, '[TOOL_CALLS]f[ARGS]{"city": ', '[TOOL_CALLS]f[ARGS]{"city": ', [], True),
    (tc.PYTHONIC, PYTHONIC_TWO, "", TWO, False),
    (tc.PYTHONIC, '<|python_start|>[f(a=[1, 2], b={"k": None})]', "",
     [("f", {"a": [1, 2], "b": {"k": None}})], False),
    (tc.PYTHONIC, "The answer is [4].", "The answer is [4].", [], False),
    (tc.PYTHONIC, "[get_weather(city=Paris)]", "[get_weather(city=Paris)]", [], True),
    (tc.PYTHONIC, '[os.system("ls")]', '[os.system("ls")]', [], True),
    (tc.PYTHONIC, "[f(a=1), g(", "[f(a=1), g(", [], True),
    (tc.QWEN3_CODER, QWEN_TWO, "Looking.\n", TWO, False),
    (tc.QWEN3_CODER, QWEN_BAD, QWEN_BAD, [], True),
    (tc.QWEN3_CODER, "<tool_call>\n<function=f>", "<tool_call>\n<function=f>", [], True),
    (tc.QWEN3_CODER, "No call <tool", "No call <tool", [], False),
    # values JSON has no form for, literals Python will not hash: content and an error
    (tc.PYTHONIC, "[f(a={[1]: 2})]", "[f(a={[1]: 2})]", [], True),
    (tc.PYTHONIC, "[f(a={1, 2})]", "[f(a={1, 2})]", [], True),
    (tc.PYTHONIC, "[f(a=1e999)]", "[f(a=1e999)]", [], True),
    (tc.MISTRAL, '[TOOL_CALLS]f[ARGS]{"a": NaN}', '[TOOL_CALLS]f[ARGS]{"a": NaN}', [], True),
    (tc.HERMES, '<tool_call>{"name": "f", "arguments": {"a": Infinity}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"a": Infinity}}</tool_call>', [], True),
    # text after the calls, and whitespace before them, whatever the split
    (tc.PYTHONIC, '[get_weather(city="Paris")] Done.', " Done.",
     [("get_weather", {"city": "Paris"})], False),
    (tc.PYTHONIC, '[f(a="x]")]\n', "", [("f", {"a": "x]"})], False),
    (tc.MISTRAL, " [TOOL_CALLS]get_time[ARGS]{}", " ", [("get_time", {})], False),
    (tc.QWEN3_CODER, QWEN_TWO + "\n\nDone.", "Looking.\n\n\nDone.", TWO, False),
]  # fmt: skip


def _check(result: tuple[str, list, str | None], content, calls, error) -> None:
    got_content, got_calls, got_error = result
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert (got_error is not None) == error, got_error
    for c in got_calls:
        assert c.id.startswith("call_") and len(c.id) == 29
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize(("fmt", "text", "content", "calls", "error"), CASES)
def test_parse_whole(fmt, text, content, calls, error):
    _check(tc.parse_tool_calls(text, fmt), content, calls, error)


def _streamed(
    fmt: str, text: str, cuts: list[int], parallel: bool = True
) -> tuple[str, list, str | None]:
    parser = tc.make_parser(fmt, parallel=parallel)
    content, calls, deltas = [], [], []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for a, b in itertools.pairwise(bounds):
        part, new = parser.feed(text[a:b])
        content.append(part)
        calls.extend(new)
        deltas.extend(parser.take_deltas())
    part, new = parser.finish()
    content.append(part)
    calls.extend(new)
    deltas.extend(parser.take_deltas())
    assert calls == parser.calls
    _check_deltas(deltas, calls)
    return "".join(content), calls, parser.error


def _join_deltas(deltas: list) -> dict[int, list[str]]:
    """OpenAI's accumulation: index -> [id, name, arguments joined]."""
    joined: dict[int, list[str]] = {}
    for d in deltas:
        if d.id is not None:  # the first piece of a call: its id and name
            assert d.index not in joined and d.name is not None
            joined[d.index] = [d.id, d.name, ""]
        assert d.index in joined
        joined[d.index][2] += d.arguments
    return joined


def _check_deltas(deltas: list, calls: list) -> None:
    """Every delivered call was streamed whole, under its id, at increasing indexes."""
    joined = _join_deltas(deltas)
    streamed = {j[0]: (i, j[1], j[2]) for i, j in joined.items()}
    indexes = [streamed[c.id][0] for c in calls]
    assert indexes == sorted(indexes)
    assert [streamed[c.id][1:] for c in calls] == [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize(("fmt", "text", "content", "calls", "error"), CASES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_parse_streamed_any_split(fmt, text, content, calls, error, data):
    """Any split into deltas gives what the whole text gives."""
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    _check(_streamed(fmt, text, cuts), content, calls, error)


def test_streamed_calls_arrive_when_complete():
    """A call is delivered by the delta that completes it, content as soon as it is sure."""
    parser = tc.ToolCallParser(tc.HERMES)
    assert parser.feed("Checking <tool") == ("Checking ", [])  # "<tool" held back
    assert parser.feed('_call>{"name": "f", "arguments": {"x": 1}') == ("", [])
    content, calls = parser.feed("}</tool_call>")
    assert content == "" and [c.name for c in calls] == ["f"]
    assert parser.feed('\n<tool_call>{"name": "g"}</tool_call>')[1][0].name == "g"
    assert parser.finish() == ("", [])
    llama = tc.ToolCallParser(tc.LLAMA3_JSON)
    assert llama.feed('{"name": "f", "parameters": {"x": 1}') == ("", [])
    assert [c.name for c in llama.feed("}")[1]] == ["f"]


ODD = (  # spacing, escapes and numbers that json.dumps writes otherwise
    '{"name": "f", "arguments": { "a" :[1 ,2.50, -0, 1E2] ,\n "b": "\\u00e9\\ud83d\\ude00\\/\t",'
    ' "c": {"d": [true, null, {}]}, "e": "\\"{x}\\""}}'
)


@pytest.mark.parametrize("fmt", tc.JSON_FORMATS)
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_argument_deltas_join_to_the_arguments(fmt, data):
    """Streamed argument pieces join to exactly the call's arguments (which are what the
    whole text gives, json.dumps of the decoded object), however the text is split;
    parallel calls get indexes 0, 1."""
    if fmt == tc.HERMES:
        text = f"Hi <tool_call>{ODD}</tool_call>\n<tool_call>{ODD}</tool_call>"
    else:
        text = f"<|python_tag|>{ODD.replace('arguments', 'parameters')}; {ODD}"
    args = json.loads(ODD, strict=False)["arguments"]  # a raw tab, as the parser allows
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=20))
    _, calls, error = _streamed(fmt, text, cuts)
    assert error is None and len(calls) == 2
    assert [c.arguments for c in calls] == [json.dumps(args, ensure_ascii=False)] * 2
    _, whole, _ = tc.parse_tool_calls(text, fmt)
    assert [c.arguments for c in whole] == [c.arguments for c in calls]
    one = _streamed(fmt, text, cuts, parallel=False)[1]  # deltas of the first call only
    assert len(one) == 1


def test_argument_deltas_stream_before_the_call_ends():
    """The id and name come as soon as the name is complete, the arguments as they grow
    (a number once it has ended); the complete call comes with the last piece."""
    parser = tc.ToolCallParser(tc.HERMES)
    parser.feed('<tool_call>\n{"name": "get_weather", "argu')
    (head,) = parser.take_deltas()
    assert (head.index, head.name, head.arguments) == (0, "get_weather", "")
    assert head.id and head.id.startswith("call_")
    parser.feed('ments": {"city": "Par')
    assert [d.arguments for d in parser.take_deltas()] == ['{"city": "Par']
    parser.feed('is", "days": 1')  # 1 may still become 10
    assert [d.arguments for d in parser.take_deltas()] == ['is", "days": ']
    assert parser.feed("2}}\n</tool") == ("", [])
    assert [(d.id, d.arguments) for d in parser.take_deltas()] == [(None, "12}")]
    _, (call,) = parser.feed("_call>")
    assert parser.take_deltas() == []
    assert (call.id, call.arguments) == (head.id, '{"city": "Paris", "days": 12}')


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (tc.HERMES, '<tool_call>{"name": "f", "arguments": {"x": }}</tool_call>'
         '<tool_call>{"name": "g", "arguments": {}}</tool_call>'),
        (tc.LLAMA3_JSON, '{"name": "f", "parameters": {"x": 1, "y": [}}'),
    ],
)  # fmt: skip
def test_a_streamed_call_that_turns_out_malformed(fmt, text):
    """Its pieces stay sent, it is no call, an error says why, and the next call gets the
    next index."""
    parser = tc.ToolCallParser(fmt)
    _, calls = parser.feed(text)
    _, last = parser.finish()
    deltas = parser.take_deltas()
    assert parser.error is not None and "f" not in [c.name for c in calls + last]
    assert deltas[0].name == "f" and deltas[0].index == 0
    assert [d.index for d in deltas if d.name == "g"] == ([1] if fmt == tc.HERMES else [])


def test_arguments_as_a_json_string_come_whole():
    parser = tc.ToolCallParser(tc.HERMES)
    parser.feed('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1')
    assert [(d.name, d.arguments) for d in parser.take_deltas()] == [("f", "")]
    parser.feed('}"}</tool_call>')
    assert [d.arguments for d in parser.take_deltas()] == ['{"a": 1}']


def test_parallel_off_keeps_the_first_call():
    parser = tc.ToolCallParser(tc.HERMES, parallel=False)
    content, calls = parser.feed(HERMES_TWO)
    more, last = parser.finish()
    assert [c.name for c in calls + last] == ["get_weather"]
    assert content + more == "Let me look that up.\n"


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("{% if tools %}<tools>{{ tools }}</tools> <tool_call>{% endif %}", tc.HERMES),
        ('{% if tools %}{"name": function name, "parameters": ...}{% endif %}', tc.LLAMA3_JSON),
    ],
)
def test_detect_format(template, fmt):
    assert tc.detect_format(template) == fmt


def test_detect_format_refuses_templates_without_tools():
    with pytest.raises(InvalidRequestError, match="no tool support"):
        tc.detect_format("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(InvalidRequestError, match="format asyncllm does not parse"):
        tc.detect_format("{% if tools %}<|tool_calls_begin|>{% endif %}")


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("{% if tools %}<tool_call>{{ tools }}{% endif %}", tc.HERMES),
        ('{{ tools }} {"name": name, "parameters": ...}', tc.LLAMA3_JSON),
        ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]{% endif %}", tc.MISTRAL),
        ("{{ tools }} [func_name1(params_name1=params_value1), func_name2(params)]",
         tc.PYTHONIC),
        ("{{ tools }} <tool_call>\n<function=example>\n<parameter=x>\n1\n</parameter>",
         tc.QWEN3_CODER),
    ],
)  # fmt: skip
def test_detect_format_of_each_template(template, fmt):
    assert tc.detect_format(template) == fmt


DEEP = [
    "[TOOL_CALLS]f[ARGS]" + '{"a":' * 3000 + "1" + "}" * 3000,
    '<tool_call>{"name": "f", "arguments": ' + '{"a":' * 3000 + "1" + "}" * 3001 + "</tool_call>",
    '{"name": "f", "parameters": ' + "[" * 3000 + "]" * 3000 + "}",
    "[f(a=" + "-" * 3000 + "1)]",
    "[f(a=" + "[" * 3000 + "]" * 3000 + ")]",
    "<tool_call><function=f><parameter=a>" + "[" * 3000 + "]" * 3000 + "</parameter></function>"
    "</tool_call>",
]


@pytest.mark.parametrize("fmt", tc.FORMATS)
@pytest.mark.parametrize("text", DEEP, ids=range(len(DEEP)))
def test_deep_nesting_never_raises(fmt, text):
    """Nesting past Python's recursion limit is a malformed call (or content), not an
    exception: the model's text must never fail the request."""
    content, calls, _ = tc.parse_tool_calls(
        text, fmt, {"f": {"properties": {"a": {"type": "array"}}}}
    )
    assert calls or content
    _streamed(fmt, text, [len(text) // 3, len(text) // 2])  # the streamed path too


def test_a_schema_validation_let_through_does_not_break_parsing():
    """``properties`` that is not an object passes the tools check (it is the schema's
    business); the call's values then stay text."""
    text = "<tool_call><function=f><parameter=n>\n1\n</parameter></function></tool_call>"
    _, (call,), error = tc.parse_tool_calls(text, tc.QWEN3_CODER, {"f": {"properties": [1]}})
    assert error is None and json.loads(call.arguments) == {"n": "1"}


def test_qwen3_coder_values_take_their_schema_types():
    text = (
        "<tool_call>\n<function=f>\n<parameter=n>\n12\n</parameter>\n"
        "<parameter=x>\n1.5\n</parameter>\n<parameter=ok>\ntrue\n</parameter>\n"
        '<parameter=cfg>\n{"a": [1]}\n</parameter>\n<parameter=id>\n007\n</parameter>\n'
        "<parameter=code>\ndef f():\n    return 1\n</parameter>\n"
        "<parameter=bad>\nmany\n</parameter>\n<parameter=extra>\n3\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    props = {"n": "integer", "x": "number", "ok": "boolean", "cfg": "object", "id": "string",
             "code": "string", "bad": "integer"}  # fmt: skip
    schema = {"properties": {k: {"type": v} for k, v in props.items()}}
    _, (call,), error = tc.parse_tool_calls(text, tc.QWEN3_CODER, {"f": schema})
    assert error is None
    assert json.loads(call.arguments) == {
        "n": 12, "x": 1.5, "ok": True, "cfg": {"a": [1]}, "id": "007",
        "code": "def f():\n    return 1", "bad": "many", "extra": "3",
    }  # fmt: skip


def _tool(name="get_weather", **fn):
    return {"type": "function", "function": {"name": name, **fn}}


@pytest.mark.parametrize(
    ("tools", "field"),
    [
        ([], "tools must be a non-empty list"),
        ("get_weather", "tools must be a non-empty list"),
        ([{"type": "retrieval"}], r"tools\[0\] must be"),
        ([{"type": "function"}], r"tools\[0\].function must be an object"),
        ([_tool("has space")], r"tools\[0\].function.name"),
        ([_tool(), _tool()], r"tools\[1\].function.name 'get_weather' is given twice"),
        ([_tool(parameters={"type": "string"})], r"tools\[0\].function.parameters"),
        ([_tool(parameters=["city"])], r"tools\[0\].function.parameters"),
        ([_tool(description=3)], r"tools\[0\].function.description"),
    ],
)
def test_check_tools_names_the_field(tools, field):
    with pytest.raises(InvalidRequestError, match=field):
        tc.check_tools(tools)


def test_check_tool_choice():
    tools = tc.check_tools([_tool(parameters={"type": "object"}), _tool("get_time")])
    assert tc.check_tool_choice(None, tools) == "auto"
    assert tc.check_tool_choice(None, None) == "none"
    assert tc.check_tool_choice("required", tools) == "required"
    named = {"type": "function", "function": {"name": "get_time"}}
    assert tc.check_tool_choice(named, tools) == "get_time"
    with pytest.raises(InvalidRequestError, match="'nope', which is not in tools"):
        tc.check_tool_choice({"type": "function", "function": {"name": "nope"}}, tools)
    with pytest.raises(InvalidRequestError, match="tool_choice must be"):
        tc.check_tool_choice("always", tools)
    with pytest.raises(InvalidRequestError, match="needs tools"):
        tc.check_tool_choice("required", None)


def test_call_schema_is_the_grammar_hook():
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = tc.check_tools([_tool(parameters=params), _tool("get_time")])
    one = tc.call_schema(tools, "get_weather", tc.HERMES)
    assert one["properties"] == {"name": {"const": "get_weather"}, "arguments": params}
    both = tc.call_schema(tools, "required", tc.LLAMA3_JSON)
    assert [b["properties"]["name"]["const"] for b in both["anyOf"]] == [
        "get_weather",
        "get_time",
    ]
    assert "parameters" in both["anyOf"][0]["required"]


def test_template_messages_decode_arguments():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": '{"a": 1}'}}  # fmt: skip
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    out = tc.template_messages(messages)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # untouched
    tc.check_message_tool_calls(0, messages[0])
    bad = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}
    with pytest.raises(InvalidRequestError, match=r"messages\[2\].tool_calls\[0\]"):
        tc.check_message_tool_calls(2, bad)
    with pytest.raises(InvalidRequestError, match="must be a JSON object"):
        tc.check_message_tool_calls(
            0, {"tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}
        )


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(
    obj=st.dictionaries(st.text(max_size=4), _VALUES, max_size=4),
    ascii_=st.booleans(),
    indent=st.sampled_from([None, 0, 2]),
    data=st.data(),
)
def test_json_canon_stream(obj, ascii_, indent, data):
    """JsonCanonStream: any JSON text of an object, in any pieces, gives json.dumps of its
    value, and every emitted prefix stays a prefix (nothing is taken back)."""
    from asyncllm.tool_calling.json_stream import JsonCanonStream

    raw = json.dumps(obj, ensure_ascii=ascii_, indent=indent)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12)))
    stream, seen = JsonCanonStream(), ""
    for a, b in itertools.pairwise([0, *cuts, len(raw)]):
        stream.feed(raw[a:b])
        assert stream.text.startswith(seen)
        seen = stream.text
    assert stream.done and not stream.broken
    assert stream.text == json.dumps(obj, ensure_ascii=False)
    assert {k: json.loads(stream.text[a:b]) for k, (a, b) in stream.values.items()} == obj


@pytest.mark.parametrize("raw", ['{"a": }', '{"a":1,}', '{"a" 1}', '{"a": [1}', '{"a": tru }',
                                 '{"a": "\\x"}', "{,}", '{"a": 1]'])  # fmt: skip
def test_json_canon_stream_stops_on_bad_json(raw):
    from asyncllm.tool_calling.json_stream import JsonCanonStream

    stream = JsonCanonStream()
    for c in raw:
        stream.feed(c)
    assert stream.broken and not stream.done
