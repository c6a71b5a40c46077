"""``serve --chat-template`` (``create_app(chat_template=...)``) and the built-in "hermes"
template: tool calling for a model whose own chat template has none, such as the default
model's (issue 35: tools answered 400 unless the client sent a template to a server started
with ``--trust-request-chat-template``)."""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from asyncllm import AsyncEngine
from asyncllm.chat_templates import BUILTIN_TEMPLATES, load_chat_template
from asyncllm.server import add_serve_arguments, app_options_from_args, create_app
from asyncllm.tool_calling.tool_calls import HERMES, detect_format, template_messages
from tests.conftest import check_pool_whole, script_output
from tests.e2e.test_cli_preflight import HEAVY, run_cli
from tests.server.test_server import serving

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_the_builtin_hermes_template(default_model_dir: pathlib.Path, tmp_path: Any) -> None:
    template = load_chat_template("hermes")
    assert BUILTIN_TEMPLATES == ("hermes",) and detect_format(template) == HERMES
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "21 C"},
    ]  # fmt: skip
    text = tok.apply_chat_template(
        template_messages(messages), tools=[WEATHER], chat_template=template,
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    # one system turn: the caller's system message, then the tools
    assert text.startswith("<|im_start|>system\nBe brief.\n\n") and text.count("system") == 1
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n" + CALL in text
    # both results in one user turn, then the assistant's header
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n21 C\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    plain = tok.apply_chat_template(ASK, chat_template=template, tokenize=False)
    assert plain == "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    # a file, a template's own text; anything else is an error
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(path)) == load_chat_template("{{ messages[0].content }}")
    with pytest.raises(ValueError, match="neither a built-in name"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_serve_reads_the_chat_template_option() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    options = app_options_from_args(parser.parse_args(["--chat-template", "hermes"]), {})
    assert options["chat_template"] == load_chat_template("hermes")
    assert app_options_from_args(parser.parse_args([]), {})["chat_template"] is None
    # a template that does not exist fails at once, before torch is imported
    status, lines, modules, _ = run_cli("serve", "--chat-template", "/nonexistent.jinja")
    assert status == 2 and len(lines) == 1 and "neither a built-in name" in lines[0], lines
    assert not modules & set(HEAVY)


@pytest.fixture
def engine(tiny_llama_512_dir: pathlib.Path) -> Iterator[AsyncEngine]:
    """The tiny Llama with SmolLM2's tokenizer: its chat template has no tool support."""
    engine = AsyncEngine.from_pretrained(str(tiny_llama_512_dir), max_num_seqs=4)
    yield engine
    check_pool_whole(engine)


def chat(base: str, **body: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": ASK, "max_tokens": 60, **body}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)


def test_tools_with_the_servers_hermes_template(engine: AsyncEngine) -> None:
    """Without --chat-template: 400 (the model's template has no tool support); with
    ``--chat-template hermes``: the tools are rendered and the model's call parsed."""
    with serving(create_app(engine, "tiny")) as base:
        r = chat(base, tools=[WEATHER])
        assert r.status_code == 400 and "no tool support" in r.json()["error"]["message"]
        plain = chat(base, max_tokens=1).json()["usage"]["prompt_tokens"]
    script_output(engine, CALL)
    with serving(create_app(engine, "tiny", chat_template="hermes")) as base:
        r = chat(base, tools=[WEATHER])
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        # without tools too, the server's template renders the prompt (not the model's,
        # which adds a default system prompt)
        usage = chat(base, max_tokens=1).json()["usage"]
        hermes = load_chat_template("hermes")
        ids = engine.tokenizer.apply_chat_template(
            ASK, chat_template=hermes, add_generation_prompt=True, return_dict=False
        )
        assert usage["prompt_tokens"] == len(ids) < plain
        # a request's own template is still refused unless the server trusts them
        r = chat(base, chat_template="{{ 'x' }}")
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_required_call_with_the_servers_hermes_template(engine: AsyncEngine) -> None:
    """``tool_choice`` "required": a grammar makes even the random tiny model's output one
    valid call."""
    with serving(create_app(engine, "tiny", chat_template="hermes")) as base:
        body = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
        r = chat(base, **body, seed=0)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
