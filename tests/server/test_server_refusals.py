"""What the server refuses as OpenAI does, and the text it ends a cut answer with (issue 35):
an unknown message role, a ``max_tokens`` past the context, an empty prompt, an unknown
top-level field (400); ``max_completion_tokens`` on both endpoints; a
``max_tokens`` cut inside a multi-byte character leaves no U+FFFD in the text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams
from asyncllm.engine.input_processor import InputProcessor
from asyncllm.engine.streams import collect
from asyncllm.server import create_app
from tests.conftest import check_pool_whole
from tests.server.test_server import serving

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Say something."}]
CONTEXT = 256  # the tiny Llama's max_position_embeddings
#: SmolLM2's token 177 is the byte 0xE6: the first of a 3-byte character.
PARTIAL = {"177": 100}


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Any) -> Iterator[tuple[str, AsyncEngine]]:
    engine = AsyncEngine.from_pretrained(str(tiny_llama_dir), max_num_seqs=8)
    with serving(create_app(engine, MODEL)) as base:
        yield base, engine
    check_pool_whole(engine)


def post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base}/v1/{path}", json={"model": MODEL, **body}, timeout=60)


def error(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    return dict(r.json()["error"])


def streamed_text(r: httpx.Response, key: str) -> str:
    """The text of a server-sent-events body (``key``: "text" or "content")."""
    assert r.status_code == 200, r.text
    out = ""
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                out += (choice.get("delta") or choice).get(key) or ""
    return out


def test_an_unknown_message_role_is_refused(served: tuple[str, AsyncEngine]) -> None:
    base, _ = served
    for role in ("bot", "", "System"):
        messages = [*CHAT, {"role": role, "content": "hi"}]
        err = error(post(base, "chat/completions", {"messages": messages, "max_tokens": 2}))
        assert err["param"] == "messages[1].role" and err["code"] == "invalid_value"
        assert err["message"].startswith(f"Invalid value: {role!r}. Supported values are: ")
        assert "'developer'" in err["message"] and "'tool'" in err["message"]
    messages = [{"role": r, "content": "hi"} for r in ("developer", "user", "assistant", "user")]
    r = post(base, "chat/completions", {"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_past_the_context_is_refused(
    served: tuple[str, AsyncEngine], stream: bool
) -> None:
    """vLLM's (and OpenAI's) 400 naming the context length and both counts, for
    ``max_tokens`` and ``max_completion_tokens``; it was cut silently to what fits."""
    base, engine = served
    assert engine.max_model_len == CONTEXT
    prompt = list(range(1000, 1006))  # 6 tokens
    expected = (
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
        f"{6 + 10**6} tokens (6 in the messages, {10**6} in the completion)."
    )
    body = {"prompt": prompt, "max_tokens": 10**6, "stream": stream}
    assert error(post(base, "completions", body))["message"].startswith(expected)
    # The most that fits is accepted (ignore_eos: it is all generated).
    body = {"prompt": prompt, "max_tokens": CONTEXT - 6, "stream": stream, "ignore_eos": True}
    r = post(base, "completions", body)
    assert r.status_code == 200, r.text
    body["max_tokens"] = CONTEXT - 5
    assert "maximum context length is 256" in error(post(base, "completions", body))["message"]
    for field in ("max_tokens", "max_completion_tokens"):
        body = {"messages": CHAT, field: 5000, "stream": stream}
        message = error(post(base, "chat/completions", body))["message"]
        assert f"maximum context length is {CONTEXT} tokens" in message
        assert "in the messages, 5000 in the completion" in message


def test_completions_honour_max_completion_tokens(served: tuple[str, AsyncEngine]) -> None:
    """``/v1/completions`` takes OpenAI's current ``max_completion_tokens`` as chat does (it
    was ignored: 16 tokens came back), and it wins over ``max_tokens``."""
    base, _ = served
    for body in ({"max_completion_tokens": 3}, {"max_completion_tokens": 3, "max_tokens": 9}):
        r = post(base, "completions", {"prompt": "Hi", "ignore_eos": True, **body})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    err = error(post(base, "completions", {"prompt": "Hi", "max_completion_tokens": 10**6}))
    assert "maximum context length" in err["message"]
    err = error(post(base, "completions", {"prompt": "Hi", "max_completion_tokens": -1}))
    assert err["param"] == "max_completion_tokens"


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_unknown_fields_are_refused_as_openai_does(
    served: tuple[str, AsyncEngine], path: str
) -> None:
    """A top-level field the server does not know (a misspelt option) is a 400 in OpenAI's
    words, not silently dropped; the known fields still pass."""
    base, _ = served
    body = {"prompt": "Hi"} if path == "completions" else {"messages": CHAT}
    for field in ("max_token", "temprature", "functions"):
        err = error(post(base, path, {**body, field: 1}))
        assert err["message"] == f"Unrecognized request argument supplied: {field}"
        assert err["type"] == "invalid_request_error"
    assert post(base, path, {**body, "max_tokens": 2, "stream_options": None}).status_code == 200


async def test_strict_max_tokens_in_the_python_api(tiny_llama_dir: Any, make_engine: Any) -> None:
    """The Python API cuts a long ``max_tokens`` to the context by default (as vLLM's LLM
    does) and refuses it with ``strict_max_tokens``."""
    engine = make_engine(tiny_llama_dir, max_num_seqs=2)
    params = SamplingParams(max_tokens=1000, ignore_eos=True)
    async with engine:
        out = await engine.generate([5, 6, 7], params)
        assert len(out.token_ids) == CONTEXT - 3 and out.finish_reason == "length"
        with pytest.raises(InvalidRequestError, match="maximum context length is 256 tokens"):
            async for _ in engine.stream([5, 6, 7], params, strict_max_tokens=True):
                pass
        with pytest.raises(InvalidRequestError, match="3 in the messages, 1000 in the"):
            async for _ in engine.chat(CHAT, params, strict_max_tokens=True):
                pass


@pytest.mark.parametrize("stream", [False, True])
def test_a_cut_inside_a_character_leaves_no_replacement_char(
    served: tuple[str, AsyncEngine], stream: bool
) -> None:
    """``max_tokens`` reached on the first byte of a character: the text ends before it
    (it was U+FFFD, as ``decode`` renders an incomplete character), chat and completions."""
    base, _ = served
    body = {"max_tokens": 1, "logit_bias": PARTIAL, "ignore_eos": True, "stream": stream}
    chat = post(base, "chat/completions", {"messages": CHAT, **body})
    completion = post(base, "completions", {"prompt": "Hello", **body})
    if stream:
        texts = [streamed_text(chat, "content"), streamed_text(completion, "text")]
    else:
        assert chat.status_code == completion.status_code == 200, chat.text + completion.text
        choice = chat.json()["choices"][0]
        assert choice["logprobs"] is None and choice["finish_reason"] == "length"
        texts = [choice["message"]["content"], completion.json()["choices"][0]["text"]]
    assert texts == ["", ""]


async def test_a_cut_inside_a_character_in_the_python_api(
    tiny_llama_dir: Any, make_engine: Any
) -> None:
    engine = make_engine(tiny_llama_dir, max_num_seqs=2)
    params = SamplingParams(max_tokens=1, logit_bias={177: 100}, ignore_eos=True)
    async with engine:
        out = await engine.generate("Hello", params)
        chat = await collect(engine.chat(CHAT, params), "delta")
    assert out.token_ids == [177] and out.text == ""
    assert chat.token_ids == [177] and chat.text == ""


def test_empty_prompts_are_refused(served: tuple[str, AsyncEngine]) -> None:
    base, _ = served
    for prompt in ("", ["hi", ""], [[]], []):
        err = error(post(base, "completions", {"prompt": prompt, "max_tokens": 2}))
        assert "empty" in err["message"], err
    # A chat message may be empty: the template still renders a prompt (as OpenAI, vLLM).
    body = {"messages": [{"role": "user", "content": ""}], "max_tokens": 2}
    assert post(base, "chat/completions", body).status_code == 200


class _DroppingTokenizer:
    """A tokenizer whose normalizer drops whitespace: a blank text has no tokens."""

    bos_token = bos_token_id = None
    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    def __len__(self) -> int:
        return 100

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return ["x"] * len(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 100 for c in text if not c.isspace()]

    def apply_chat_template(self, messages: Any, tokenize: bool = True, **kw: Any) -> Any:
        text = "".join(m["content"] for m in messages)
        return self.encode(text) if tokenize else text


def test_a_prompt_of_no_tokens_is_refused() -> None:
    """A non-empty text that tokenizes to no tokens, and a chat template that renders none,
    are InvalidRequestError (a request of no tokens reached the scheduler)."""
    inputs = InputProcessor(
        _DroppingTokenizer(), max_model_len=64, vocab_size=100, eos_token_ids=frozenset(),
        max_num_seqs=4,
    )  # fmt: skip
    assert inputs.make_request("a", "h i", SamplingParams()).prompt_token_ids == [4, 5]
    with pytest.raises(InvalidRequestError, match="tokenizes to no tokens"):
        inputs.make_request("b", " \n ", SamplingParams())
    with pytest.raises(InvalidRequestError, match="rendered no tokens"):
        inputs.chat_prompt([{"role": "user", "content": "  "}])
