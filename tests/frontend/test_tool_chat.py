"""Tool calling through ``AsyncEngine.chat`` and the server's /v1/chat/completions.

The tiny random model does not write tool calls on its own, so its output is scripted (the
sampler's choice replaced: ``script_output``); everything else (the template rendering the
tools, detokenization, streaming, parsing) is the real path. Two copies of the tiny Llama
get tool-capable templates: Hermes/Qwen style (``<tool_call>``) and Llama 3 JSON style.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import jsonschema
import msgspec
import pytest
from transformers import AutoTokenizer

from asyncllm import InvalidRequestError, SamplingParams
from asyncllm.engine.async_engine import collect
from asyncllm.tool_calling.tool_calls import HERMES_TEMPLATE
from tests.conftest import script_output
from tests.frontend.test_tool_calls import _join_deltas

LLAMA3_TEMPLATE = """\
{%- if tools %}<|start_header_id|>user<|end_header_id|>

Given the following functions, respond with a JSON for a function call. Respond in the \
format {"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{%- for message in messages %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{% if message.tool_calls %}{% for call in message.tool_calls %}{"name": "\
{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}\
{% endfor %}{% else %}{{ message.content }}{% endif %}<|eot_id|>{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]
HERMES_OUT = (
    "Checking.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
LLAMA_OUT = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
SMALL = dict(block_size=4, kv_cache_bytes=2**21, max_num_seqs=4)
PARAMS = SamplingParams(max_tokens=80, temperature=0.0)


def _with_template(src: pathlib.Path, dst: pathlib.Path, template: str) -> pathlib.Path:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(src)
    tok.chat_template = template
    tok.save_pretrained(dst)
    return dst


@pytest.fixture(scope="session")
def hermes_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: pathlib.Path):
    """The tiny Llama with a Hermes/Qwen-style tool template."""
    return _with_template(tiny_llama_dir, tmp_path_factory.mktemp("hermes"), HERMES_TEMPLATE)


@pytest.fixture(scope="session")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: pathlib.Path):
    """The tiny Llama with a Llama 3-style tool template."""
    return _with_template(tiny_llama_dir, tmp_path_factory.mktemp("llama3"), LLAMA3_TEMPLATE)


def _calls(out: Any) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls or ()]


async def test_hermes_calls_streamed_and_whole(hermes_dir, make_engine):
    engine = make_engine(hermes_dir, **SMALL)
    script_output(engine, HERMES_OUT)
    async with engine:
        items = [out async for out in engine.chat(ASK, PARAMS, tools=TOOLS)]
        # the prompt rendered the tools
        prompt = engine.tokenizer.decode(items[-1].prompt_token_ids)
        assert "<tools>" in prompt and '"get_weather"' in prompt
        streamed = [c for it in items for c in it.tool_calls or ()]
        assert [c.name for c in streamed] == ["get_weather", "get_time"]
        assert "".join(it.text for it in items) == "Checking.\n"
        assert items[-1].finish_reason == "tool_calls" and items[-1].tool_call_error is None
        # each call arrives once, on the item whose text completed it
        assert len({c.id for c in streamed}) == 2
        # and streams before that: id and name, then its arguments in pieces
        joined = _join_deltas([d for it in items for d in it.tool_call_deltas or ()])
        whole_calls = [(c.id, c.name, c.arguments) for c in streamed]
        assert [tuple(j) for j in joined.values()] == whole_calls
        whole = await collect(engine.chat(ASK, PARAMS, tools=TOOLS), "delta")
        assert _calls(whole) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
        assert whole.text == "Checking.\n" and whole.finish_reason == "tool_calls"
        # the token ids are the model's own, call text included
        assert engine.tokenizer.decode(whole.token_ids, skip_special_tokens=True) == HERMES_OUT


@pytest.mark.parametrize("kind", ["cumulative", "final"])
async def test_llama3_json_calls_other_output_kinds(llama3_dir, make_engine, kind):
    engine = make_engine(llama3_dir, **SMALL)
    script_output(engine, LLAMA_OUT)
    params = SamplingParams(max_tokens=40, temperature=0.0, output_kind=kind, n=2)
    async with engine:
        items = [out async for out in engine.chat(ASK, params, tools=TOOLS)]
    for index in (0, 1):  # each parallel sample parsed on its own
        last = [it for it in items if it.index == index][-1]
        assert _calls(last) == [("get_weather", {"city": "Paris"})]
        assert last.text == "" and last.finish_reason == "tool_calls"


async def test_no_calls_and_tool_choice_none(hermes_dir, make_engine):
    engine = make_engine(hermes_dir, **SMALL)
    script_output(engine, HERMES_OUT)
    async with engine:
        plain = await collect(engine.chat(ASK, PARAMS, tools=TOOLS, tool_choice="none"), "delta")
        assert plain.text == HERMES_OUT and plain.tool_calls is None
        assert plain.finish_reason == "stop"
        one = await collect(
            engine.chat(ASK, PARAMS, tools=TOOLS, parallel_tool_calls=False), "delta"
        )
        assert [c.name for c in one.tool_calls] == ["get_weather"]


async def test_malformed_call_is_content_with_an_error(hermes_dir, make_engine):
    engine = make_engine(hermes_dir, **SMALL)
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    script_output(engine, bad)
    async with engine:
        out = await collect(engine.chat(ASK, PARAMS, tools=TOOLS), "delta")
        assert out.text == bad and out.tool_calls is None
        assert out.finish_reason == "stop" and "invalid JSON" in out.tool_call_error


async def test_tool_messages_reach_the_template(hermes_dir, make_engine):
    """An assistant turn with OpenAI tool_calls (JSON-string arguments) and the tool's answer."""
    engine = make_engine(hermes_dir, **SMALL)
    script_output(engine, "It is sunny.")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    async with engine:
        out = await collect(engine.chat(messages, PARAMS, tools=TOOLS), "delta")
    prompt = engine.tokenizer.decode(out.prompt_token_ids)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert out.text == "It is sunny." and out.finish_reason == "stop" and out.tool_calls is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "array"}}}]}, r"tools\[0\].function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "'nope', which is not in tools"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "chat_template_kwargs": {"tools": TOOLS}}, "give tools once"),
    ],
)  # fmt: skip
async def test_bad_tool_arguments_are_refused(hermes_dir, make_engine, kwargs, message):
    engine = make_engine(hermes_dir, **SMALL)
    async with engine:
        with pytest.raises(InvalidRequestError, match=message):
            await collect(engine.chat(ASK, PARAMS, **kwargs), "delta")
        bad_call = [*ASK, {"role": "assistant", "tool_calls": [{"function": {"name": 1}}]}]
        with pytest.raises(InvalidRequestError, match=r"messages\[1\].tool_calls\[0\]"):
            await collect(engine.chat(bad_call, PARAMS), "delta")
        out = await collect(engine.chat(ASK, SamplingParams(max_tokens=2)), "delta")
        assert out.num_generated_tokens == 2  # the engine is unaffected


# Small templates of the other formats: what detect_format reads, and turns a model sees.
OTHER_FORMATS = {
    "mistral": (
        "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
        "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}"
        "{% else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        "Sure.",
    ),
    "pythonic": (
        "{% if tools %}Call as [func_name1(params_name1=params_value1), func_name2(params)]"
        "{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}",
        '[get_weather(city="Paris"), get_time()]',
        "",
    ),
    "qwen3_coder": (
        "{% if tools %}{{ tools | tojson }} <tool_call>\n<function=name>\n<parameter=key>\n"
        "value\n</parameter>\n</function>\n</tool_call>{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
        "</function>\n</tool_call>",
        "Checking.\n",
    ),
}


@pytest.mark.parametrize("fmt", sorted(OTHER_FORMATS))
async def test_other_formats_through_chat(fmt, tiny_llama_dir, make_engine, tmp_path):
    template, output, content = OTHER_FORMATS[fmt]
    engine = make_engine(_with_template(tiny_llama_dir, tmp_path / fmt, template), **SMALL)
    script_output(engine, output)
    async with engine:
        items = [out async for out in engine.chat(ASK, PARAMS, tools=TOOLS)]
        with pytest.raises(InvalidRequestError, match=f"writes '{fmt}' calls"):
            await collect(engine.chat(ASK, PARAMS, tools=TOOLS, tool_choice="required"), "delta")
    calls = [c for it in items for c in it.tool_calls or ()]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert "".join(it.text for it in items) == content
    assert items[-1].finish_reason == "tool_calls" and items[-1].tool_call_error is None
    joined = _join_deltas([d for it in items for d in it.tool_call_deltas or ()])
    assert [tuple(j) for j in joined.values()] == [(c.id, c.name, c.arguments) for c in calls]


async def test_template_without_tool_support(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, **SMALL)
    async with engine:
        with pytest.raises(InvalidRequestError, match="no tool support"):
            await collect(engine.chat(ASK, PARAMS, tools=TOOLS), "delta")
        # tool_choice "none" parses nothing, so it needs no format
        out = await collect(
            engine.chat(ASK, SamplingParams(max_tokens=2), tools=TOOLS, tool_choice="none"),
            "delta",
        )
        assert out.num_generated_tokens == 2


# ----------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def hermes_server(hermes_dir):
    from asyncllm import AsyncEngine
    from asyncllm.server import create_app
    from tests.conftest import check_pool_whole
    from tests.server.test_server import serving

    engine = AsyncEngine.from_pretrained(str(hermes_dir), **SMALL)
    script_output(engine, HERMES_OUT)
    with serving(create_app(engine, "tiny")) as base:
        yield base, engine
    check_pool_whole(engine)


def _client(base: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
def test_server_tool_calls(hermes_server):
    base, _ = hermes_server
    client = _client(base)
    resp = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking.\n"
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}),
        ("function", "get_time", {}),
    ]
    # the loop's next turn: the calls and their results go back to the model
    messages = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        *[{"role": "tool", "tool_call_id": c.id, "content": "21 C"} for c in calls],
    ]
    # (without tools this time: the tiny model's 256 positions hold no more)
    again = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=80, temperature=0
    )
    assert again.choices[0].finish_reason == "stop"  # no tools: nothing parsed
    assert again.choices[0].message.content == HERMES_OUT
    one = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, parallel_tool_calls=False, max_tokens=80
    )
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
def test_server_streams_tool_calls_as_openai_does(hermes_server):
    """A call's first delta has its index, id, type and name; its arguments follow in
    pieces (more than one: they stream as generated) that join to the final arguments."""
    base, _ = hermes_server
    client = _client(base)
    deltas = []
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0, stream=True
    )
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            deltas.extend(choice.delta.tool_calls or ())
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    heads = [(d.index, d.type, d.function.name) for d in deltas if d.id]
    assert heads == [(0, "function", "get_weather"), (1, "function", "get_time")]
    assert all(d.id.startswith("call_") for d in deltas if d.id)
    assert all(d.type is None and d.function.name is None for d in deltas if not d.id)
    pieces = [d.function.arguments for d in deltas if d.index == 0]
    assert len(pieces) > 2 and "".join(pieces) == '{"city": "Paris"}'
    # the client's own stream helper reassembles the message
    with client.chat.completions.stream(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0
    ) as helper:
        final = helper.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Checking.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "string"}}}]}, "tools", "parameters must be a JSON schema"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "not in tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {
            "name": "f", "arguments": "{oops"}}]}]}, None, "not valid JSON"),
    ],
)  # fmt: skip
def test_server_bad_tools_are_400(hermes_server, body, param, message):
    import httpx

    base, engine = hermes_server
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "tiny", "messages": ASK, "max_tokens": 4, **body},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert message in err["message"]
    assert engine.health() == "running"
    ok = _client(base).chat.completions.create(model="tiny", messages=ASK, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


# ------------------------------------------------- "required" / named: grammar-constrained

SET_TEMP = {
    "type": "function",
    "function": {
        "name": "set_temp",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"enum": ["c", "f"]},
                "level": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["unit", "level"],
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
        },
    },
}
SMALL_TOOLS = [SET_TEMP, LOOKUP]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in SMALL_TOOLS}
LOOKUP_ONLY = {"type": "function", "function": {"name": "lookup"}}
# Llama 3 style in few tokens (LLAMA3_TEMPLATE's prompt nearly fills the tiny model's 256).
LLAMA3_SHORT = """\
{%- if tools %}Call one as {"name": ..., "parameters": {...}}:\
{% for t in tools %} {{ t.function.name }}{% endfor %}
{% endif %}{% for message in messages %}{{ message.content }}
{% endfor %}"""


@pytest.fixture(scope="module")
def llama3_short_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: pathlib.Path):
    return _with_template(tiny_llama_dir, tmp_path_factory.mktemp("llama3s"), LLAMA3_SHORT)


async def _chat_samples(engine: Any, params: SamplingParams, stream: bool, **kw: Any) -> list:
    """Each sample's (text, calls, finish_reason, tool_call_error), streamed or final."""
    if not stream:
        params = SamplingParams(**{**msgspec.structs.asdict(params), "output_kind": "final"})
    text: dict[int, str] = {}
    calls: dict[int, list] = {}
    last: dict[int, Any] = {}
    async for out in engine.chat(ASK, params, **kw):
        text[out.index] = text.get(out.index, "") + out.text
        calls.setdefault(out.index, []).extend(out.tool_calls or ())
        last[out.index] = out
    return [(text[i], calls[i], last[i].finish_reason, last[i].tool_call_error) for i in last]


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
@pytest.mark.parametrize("template", ["hermes", "llama3_short"])
@pytest.mark.parametrize("stream", [False, True])
async def test_required_and_named_calls_follow_the_schema(request, make_engine, template, stream):
    """Random weights: the grammar alone makes every finished output valid tool calls."""
    engine = make_engine(request.getfixturevalue(f"{template}_dir"), **SMALL)
    async with engine:
        for choice, allowed in [("required", {"set_temp", "lookup"}), (LOOKUP_ONLY, {"lookup"})]:
            results = []
            for seed in range(3):
                params = SamplingParams(max_tokens=60, seed=seed, n=2)
                results += await _chat_samples(
                    engine, params, stream, tools=SMALL_TOOLS, tool_choice=choice,
                    parallel_tool_calls=template == "hermes",  # Llama 3's: one call, in budget
                )  # fmt: skip
            finished = [r for r in results if r[2] == "tool_calls"]
            assert len(finished) >= len(results) // 2, results
            for text, calls, reason, error in results:
                if reason != "tool_calls":
                    assert reason == "length" and error, (text, reason)
                    continue
                assert error is None and text.strip() == "", (text, error)
                assert calls
                for call in calls:
                    assert call.name in allowed
                    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
@pytest.mark.parametrize("parallel", [False, True])
async def test_llama3_required_parallel_calls(llama3_short_dir, make_engine, parallel):
    """Llama 3 JSON under the grammar: with parallel_tool_calls, several objects joined by
    "; " (vLLM's llama3_json form), each a valid call; without, exactly one. (min_tokens
    keeps the random model from stopping after its first call.)"""
    engine = make_engine(llama3_short_dir, **SMALL)
    async with engine:
        counts = []
        for seed in range(3):
            params = SamplingParams(
                max_tokens=120, min_tokens=40, seed=seed, n=2, output_kind="final"
            )
            async for out in engine.chat(
                ASK, params, tools=SMALL_TOOLS, tool_choice="required",
                parallel_tool_calls=parallel,
            ):  # fmt: skip
                if out.finish_reason != "tool_calls":
                    assert out.finish_reason == "length" and out.tool_call_error
                    continue
                assert out.tool_call_error is None and out.text == ""
                text = engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
                assert text.count("}; {") == len(out.tool_calls) - 1, text
                for call in out.tool_calls:
                    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
                counts.append(len(out.tool_calls))
    assert counts
    if parallel:
        assert max(counts) >= 2, counts
    else:
        assert set(counts) == {1}, counts


async def test_required_single_call_and_conflicts(hermes_dir, make_engine):
    engine = make_engine(hermes_dir, **SMALL)
    async with engine:
        for seed in range(3):
            params = SamplingParams(max_tokens=60, seed=seed)
            [(_, calls, reason, _)] = await _chat_samples(
                engine, params, False, tools=SMALL_TOOLS, tool_choice="required",
                parallel_tool_calls=False,
            )  # fmt: skip
            assert reason != "tool_calls" or len(calls) == 1
        # cut short: no complete call, said so
        out = await collect(
            engine.chat(ASK, SamplingParams(max_tokens=3), tools=SMALL_TOOLS,
                        tool_choice=LOOKUP_ONLY), "delta",
        )  # fmt: skip
        assert out.finish_reason == "length" and "no complete one" in out.tool_call_error
        prompt = engine.tokenizer.decode(out.prompt_token_ids)
        assert '"lookup"' in prompt and '"set_temp"' not in prompt  # the named tool only
        with pytest.raises(InvalidRequestError, match="cannot be combined with structured_outputs"):
            own = SamplingParams(max_tokens=4, structured_outputs={"json_object": True})
            await collect(engine.chat(ASK, own, tools=SMALL_TOOLS, tool_choice="required"), "delta")
        # "auto" leaves the output free (and the caller's own grammar allowed)
        own = SamplingParams(max_tokens=4, structured_outputs={"choice": ["hi"]})
        out = await collect(engine.chat(ASK, own, tools=SMALL_TOOLS), "delta")
        assert out.text == "hi" and out.tool_calls is None


def test_server_required_gives_a_valid_call(hermes_dir):
    from asyncllm import AsyncEngine
    from asyncllm.server import create_app
    from tests.conftest import check_pool_whole
    from tests.server.test_server import serving

    engine = AsyncEngine.from_pretrained(str(hermes_dir), **SMALL)
    with serving(create_app(engine, "tiny")) as base:
        resp = _client(base).chat.completions.create(
            model="tiny", messages=ASK, tools=SMALL_TOOLS, tool_choice="required",
            max_tokens=60, seed=1, n=2,
        )  # fmt: skip
        for choice in resp.choices:
            if choice.finish_reason != "tool_calls":
                assert choice.finish_reason == "length"
                continue
            for call in choice.message.tool_calls:
                args = json.loads(call.function.arguments)
                jsonschema.validate(args, SCHEMAS[call.function.name])
        assert any(c.finish_reason == "tool_calls" for c in resp.choices)
    check_pool_whole(engine)
