"""``POST /v1/responses`` through the official ``openai`` client: text, streamed events,
a tool round trip with ``previous_response_id``, reasoning items, limits and refusals.

The tiny model's output is scripted (``script_output``) where the test needs a known
answer; the rest (templates, parsing, the server's shapes and events) is the real path.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from asyncllm import AsyncEngine
from asyncllm.server import create_app
from asyncllm.server.protocol import APIError
from asyncllm.server.responses_api import ResponsesRequest, ResponseStore, responses_call
from asyncllm.tool_calling.tool_calls import HERMES_TEMPLATE
from tests.conftest import check_pool_whole, script_output
from tests.frontend.test_reasoning import ANSWER, QWEN3_TEMPLATE, THOUGHT
from tests.frontend.test_tool_chat import HERMES_OUT, SMALL, _with_template
from tests.server.test_server import serving

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}},
    {"type": "function", "name": "get_time", "parameters": {"type": "object"}},
]  # fmt: skip


def _serve(path: Any, output: str) -> Iterator[tuple[openai.OpenAI, Any]]:
    engine = AsyncEngine.from_pretrained(str(path), **SMALL)
    script_output(engine, output)
    app = create_app(engine, "tiny")
    with serving(app) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0), app
    check_pool_whole(engine)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory, tiny_llama_dir):
    path = _with_template(tiny_llama_dir, tmp_path_factory.mktemp("hermes"), HERMES_TEMPLATE)
    yield from _serve(path, HERMES_OUT)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, tiny_llama_dir):
    path = _with_template(tiny_llama_dir, tmp_path_factory.mktemp("qwen3"), QWEN3_TEMPLATE)
    yield from _serve(path, THOUGHT + ANSWER)


def test_text_whole_and_streamed(thinker):
    client, _ = thinker
    resp = client.responses.create(model="tiny", input="Capital of France?", max_output_tokens=80)
    assert resp.status == "completed" and resp.object == "response"
    assert resp.id.startswith("resp_") and resp.output_text == ANSWER
    kinds = [item.type for item in resp.output]
    assert kinds == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "\nThe user asks. <tool_call> is not a call here.\n"
    assert resp.usage.output_tokens > 0 and resp.usage.total_tokens == (
        resp.usage.input_tokens + resp.usage.output_tokens
    )
    longer = client.responses.create(
        model="tiny", input="Capital of France?", instructions="Be brief.", max_output_tokens=80
    )
    assert longer.usage.input_tokens > resp.usage.input_tokens  # instructions in the prompt
    events = list(client.responses.create(model="tiny", input="Hi", stream=True))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == ANSWER and thought == resp.output[0].content[0].text
    assert types.count("response.output_item.added") == types.count("response.output_item.done")
    with client.responses.stream(model="tiny", input="Hi") as stream:
        final = stream.get_final_response()
    assert final.output_text == ANSWER


def test_tool_round_trip_with_previous_response_id(hermes):
    client, app = hermes
    first = client.responses.create(model="tiny", input="Weather and time in Paris?",
                                    tools=TOOLS, max_output_tokens=80)  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {}),
    ]  # fmt: skip
    assert first.output[0].type == "message" and first.output_text == "Checking.\n"
    results = [
        {"type": "function_call_output", "call_id": c.call_id, "output": "21 C"} for c in calls
    ]
    second = client.responses.create(
        model="tiny", input=results, previous_response_id=first.id, max_output_tokens=80
    )
    assert second.previous_response_id == first.id
    stored = app.state.server.response_store.get(second.id)
    roles = [m["role"] for m in stored]
    assert roles == ["user", "assistant", "tool", "tool", "assistant"]
    assert [c["id"] for c in stored[1]["tool_calls"]] == [c.call_id for c in calls]
    alone = client.responses.create(model="tiny", input=results, max_output_tokens=80)
    assert second.usage.input_tokens > alone.usage.input_tokens  # the history was in it
    # streamed: a call's item, then its arguments in pieces that join to them
    events = list(client.responses.create(model="tiny", input="Weather?", tools=TOOLS,
                                          stream=True, max_output_tokens=80))  # fmt: skip
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["message", "function_call", "function_call"]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
              and e.item_id == added[1].id]  # fmt: skip
    assert "".join(pieces) == '{"city": "Paris"}'
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [d.arguments for d in done] == ['{"city": "Paris"}', "{}"]


def test_incomplete_and_store_false(hermes):
    client, _ = hermes
    resp = client.responses.create(model="tiny", input="Hi", max_output_tokens=3, store=False)
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model="tiny", input="Hi", previous_response_id=resp.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"format": "json_schema"}}, "text"),
        ({"text": {"format": [1]}}, "text"),
        ({"background": True}, None),  # unknown: "Unrecognized request argument"
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_refusals_name_the_field(hermes, body, param):
    client, _ = hermes
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{"model": "tiny", "input": "Hi", **body})
    assert info.value.body["param"] == param, info.value.body
    if param is None:
        assert "Unrecognized request argument supplied: background" in info.value.message


def test_text_format_becomes_the_grammar():
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}
    req = ResponsesRequest(
        input="A number?", text={"format": {"type": "json_schema", "name": "n", "schema": schema}}
    )
    call, conversation = responses_call(req, ResponseStore(), (0, 0), frozenset())
    assert call.params.structured_outputs.json == schema
    assert conversation == [{"role": "user", "content": "A number?"}]
    req = ResponsesRequest(input="A number?", text={"format": {"type": "json_object"}})
    assert responses_call(req, ResponseStore(), (0, 0), frozenset())[0].params.structured_outputs
    bad = ResponsesRequest(input="x", text={"format": {"type": "json_schema", "schema": [1]}})
    with pytest.raises(APIError) as info:
        responses_call(bad, ResponseStore(), (0, 0), frozenset())
    assert info.value.param == "text"


def test_store_keeps_the_most_recent():
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put(f"r{i}", [{"role": "user", "content": str(i)}])
    store.get("r1")  # used: r2 is now the oldest
    store.put("r3", [])
    with pytest.raises(APIError, match="not found"):
        store.get("r2")
    assert store.get("r1") and store.get("r3") == []
