"""Reasoning split from the answer (``<think>...</think>``): the streaming parser alone, then
through ``AsyncEngine.chat`` and the server's ``reasoning_content``.

The tiny random model does not think on its own, so its output is scripted
(``script_output``); the templates are small Qwen3- and DeepSeek-R1-style ones written for
these tests (Qwen3's closes an empty thinking block when ``enable_thinking`` is false; R1's
opens the thinking in the generation prompt).
"""

from __future__ import annotations

import itertools
import json
import pathlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm import SamplingParams
from asyncllm.engine.async_engine import collect
from asyncllm.tool_calling.reasoning import ReasoningParser, prompt_opens_thinking, thinks
from tests.conftest import script_output
from tests.frontend.test_tool_chat import ASK, SMALL, TOOLS, _with_template

QWEN3_TEMPLATE = """\
{%- if tools %}<|im_start|>system
<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>
Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.role == "assistant" %}{{ (message.content or "").split("</think>")[-1] \
| trim }}{% else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

R1_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.role == "assistant" %}{{ (message.content or "").split("</think>")[-1] \
}}{% else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""

THOUGHT = "<think>\nThe user asks. <tool_call> is not a call here.\n</think>\n\n"
ANSWER = "Paris is the capital."
PARAMS = SamplingParams(max_tokens=80, temperature=0.0)


def _split(text: str, cuts: list[int], in_reasoning: bool) -> tuple[str, str]:
    parser = ReasoningParser(in_reasoning=in_reasoning)
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    got = [parser.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    got.append(parser.finish())
    return "".join(r for r, _ in got), "".join(a for _, a in got)


@pytest.mark.parametrize(
    ("text", "in_reasoning", "want"),
    [
        ("<think>abc</think>\n\nAnswer", False, ("abc", "Answer")),
        ("  \n<think>x</think>y", False, ("x", "y")),
        ("Hello <think>x</think>", False, ("", "Hello <think>x</think>")),
        ("<thinking aloud", False, ("", "<thinking aloud")),
        ("abc</think>\nans", True, ("abc", "ans")),
        ("<think>cut at max_tokens</thi", False, ("cut at max_tokens</thi", "")),
        ("all reasoning", True, ("all reasoning", "")),
        ("<think></think>", False, ("", "")),
        ("", False, ("", "")),
    ],
)  # fmt: skip
def test_parser_cases(text, in_reasoning, want):
    assert _split(text, [], in_reasoning) == want
    assert _split(text, list(range(len(text))), in_reasoning) == want  # one char at a time


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet="<>/thinkab \n", max_size=40),
    st.lists(st.integers(min_value=0, max_value=60), max_size=8),
    st.booleans(),
)
def test_parser_split_anywhere_gives_the_same(text, cuts, in_reasoning):
    whole = _split(text, [], in_reasoning)
    assert _split(text, cuts, in_reasoning) == whole
    reasoning, answer = whole
    assert len(reasoning) + len(answer) <= len(text)


def test_which_templates_think():
    assert thinks(QWEN3_TEMPLATE) and thinks(R1_TEMPLATE)
    assert not thinks("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: pathlib.Path):
    return _with_template(tiny_llama_dir, tmp_path_factory.mktemp("qwen3"), QWEN3_TEMPLATE)


@pytest.fixture(scope="session")
def r1_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: pathlib.Path):
    return _with_template(tiny_llama_dir, tmp_path_factory.mktemp("r1"), R1_TEMPLATE)


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
async def test_chat_streams_reasoning_apart(qwen3_dir, make_engine):
    engine = make_engine(qwen3_dir, **SMALL)
    script_output(engine, THOUGHT + ANSWER)
    async with engine:
        items = [out async for out in engine.chat(ASK, PARAMS)]
        whole = await collect(engine.chat(ASK, PARAMS), "delta")
        kinds = {}
        for kind in ("cumulative", "final"):
            params = SamplingParams(max_tokens=80, temperature=0.0, output_kind=kind, n=2)
            kinds[kind] = [out async for out in engine.chat(ASK, params)]
    reasoning = "\nThe user asks. <tool_call> is not a call here.\n"
    assert "".join(it.reasoning or "" for it in items) == reasoning
    assert "".join(it.text for it in items) == ANSWER
    assert sum(1 for it in items if it.reasoning) > 1  # it streams, not at the end
    assert (whole.reasoning, whole.text) == (reasoning, ANSWER)
    assert engine.tokenizer.decode(whole.token_ids, skip_special_tokens=True) == THOUGHT + ANSWER
    for items in kinds.values():
        for index in (0, 1):
            last = [it for it in items if it.index == index][-1]
            assert (last.reasoning, last.text) == (reasoning, ANSWER)


async def test_enable_thinking_false_and_a_prompt_that_opens_the_thinking(
    qwen3_dir, r1_dir, make_engine
):
    engine = make_engine(qwen3_dir, **SMALL)
    script_output(engine, ANSWER)
    async with engine:
        off = {"enable_thinking": False}
        out = await collect(engine.chat(ASK, PARAMS, chat_template_kwargs=off), "delta")
    assert (out.reasoning, out.text) == (None, ANSWER)
    assert engine.tokenizer.decode(out.prompt_token_ids).endswith("<think>\n\n</think>\n\n")
    engine = make_engine(r1_dir, **SMALL)
    script_output(engine, "Thinking it over.\n</think>\n\n" + ANSWER)
    async with engine:
        out = await collect(engine.chat(ASK, PARAMS), "delta")
        cut = await collect(engine.chat(ASK, SamplingParams(max_tokens=3)), "delta")
    assert (out.reasoning, out.text) == ("Thinking it over.\n", ANSWER)
    assert cut.finish_reason == "length" and cut.text == "" and cut.reasoning


async def test_tool_calls_are_read_from_the_answer_only(qwen3_dir, make_engine):
    engine = make_engine(qwen3_dir, **SMALL)
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    script_output(engine, THOUGHT + call)
    async with engine:
        out = await collect(engine.chat(ASK, PARAMS, tools=TOOLS), "delta")
    assert [c.name for c in out.tool_calls] == ["get_time"]
    assert "<tool_call>" in out.reasoning and out.text == ""
    assert out.finish_reason == "tool_calls" and out.tool_call_error is None


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
def test_server_sends_reasoning_content(qwen3_dir):
    import openai

    from asyncllm import AsyncEngine
    from asyncllm.server import create_app
    from tests.conftest import check_pool_whole
    from tests.server.test_server import serving

    engine = AsyncEngine.from_pretrained(str(qwen3_dir), **SMALL)
    script_output(engine, THOUGHT + ANSWER)
    with serving(create_app(engine, "tiny")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        resp = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=80)
        message: Any = resp.choices[0].message
        stream = client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=80, stream=True
        )
        deltas = [c.choices[0].delta for c in stream if c.choices]
    check_pool_whole(engine)
    reasoning = "\nThe user asks. <tool_call> is not a call here.\n"
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == reasoning
    streamed = [json.loads(d.model_dump_json()) for d in deltas]
    assert "".join(d.get("reasoning_content") or "" for d in streamed) == reasoning
    assert "".join(d.get("content") or "" for d in streamed) == ANSWER
