"""The OpenAI-compatible server, driven by the official ``openai`` client over loopback.

Each server runs uvicorn in a background thread on 127.0.0.1 (a socket bound to port 0),
serving a tiny random Llama; after the module its engine must hold no request and have every
KV block free.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import prometheus_client
import pytest

from asyncllm import AsyncEngine
from asyncllm.server import create_app
from tests.conftest import check_pool_whole

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Say something."}]


@contextlib.contextmanager
def serving(app: Any, *, timeout: float = 20.0) -> Iterator[str]:
    """Run an ASGI app with uvicorn on 127.0.0.1 (a free port) in a thread; yields its
    base URL and stops the server (lifespan included) on exit."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True
    )
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def idle(engine: AsyncEngine) -> bool:
    s = engine.stats()
    return (
        s["num_running"] == 0
        and s["num_waiting"] == 0
        and s["num_free_blocks"] == s["num_total_blocks"]
    )


def metric(base: str, name: str, **labels: str) -> float:
    """A sample's value from /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def fail_steps_after(engine: AsyncEngine, steps: int, message: str) -> None:
    """Make the engine's step raise ``RuntimeError(message)`` from call ``steps + 1`` on."""
    core = engine.core
    real_step = core.step
    calls = 0

    def failing_step() -> Any:
        nonlocal calls
        calls += 1
        if calls > steps:
            raise RuntimeError(message)
        return real_step()

    core.step = failing_step  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Any) -> Iterator[tuple[str, AsyncEngine]]:
    engine = AsyncEngine.from_pretrained(str(tiny_llama_dir), max_num_seqs=8)
    with serving(create_app(engine, MODEL)) as base:
        yield base, engine
    check_pool_whole(engine)


@pytest.fixture
def client(served: tuple[str, AsyncEngine]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0, timeout=30)


def test_models_and_health(served: tuple[str, AsyncEngine], client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    r = httpx.get(f"{served[0]}/health")
    assert r.status_code == 200 and r.json() == {"status": "running"}


def test_completion_stream_matches_whole(
    served: tuple[str, AsyncEngine], client: openai.OpenAI
) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    whole = client.completions.create(**kw)
    prompt_tokens = len(served[1].tokenizer.encode("The quick brown fox"))
    assert whole.object == "text_completion" and whole.model == MODEL
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 6)
    assert whole.usage.total_tokens == prompt_tokens + 6

    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 6 and last.usage.prompt_tokens == prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # without include_usage no chunk carries usage
    plain = list(client.completions.create(**kw, stream=True))
    assert all(c.usage is None for c in plain)
    assert "".join(c.choices[0].text for c in plain) == text


def test_chat_stream_matches_whole(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL, messages=CHAT, max_completion_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    whole = client.chat.completions.create(**kw)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 6

    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump()["prompt_tokens"] == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 6


def test_parameters_reach_the_engine(
    served: tuple[str, AsyncEngine], client: openai.OpenAI
) -> None:
    """seed, logit_bias, stop, penalties and logprobs are applied."""
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=5,
        temperature=1.0,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logprobs=True,
        top_logprobs=3,
    )
    again = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=1.0, top_p=0.9, seed=7,
        presence_penalty=0.5, frequency_penalty=0.5,
    )  # fmt: skip
    assert out.choices[0].message.content == again.choices[0].message.content
    content = out.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob for e in content)

    # logit_bias +100 on one token forces it
    forced = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logit_bias={"42": 100},
        logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = forced.choices[0].logprobs
    tok = forced.choices[0].text
    assert lp is not None and lp.tokens == [served[1].tokenizer.decode([42])] * 3
    assert "".join(lp.tokens) == tok
    assert len(lp.token_logprobs) == 3 and len(lp.text_offset) == 3

    # a stop string cuts the text and is reported
    free = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    stop = free.text[len(free.text) // 2 :][:3]
    if stop.strip():
        cut = client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=8, temperature=0, stop=[stop],
            extra_body={"ignore_eos": True},
        ).choices[0]  # fmt: skip
        assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]


def test_logprobs_bytes_of_partial_tokens(served: tuple[str, AsyncEngine]) -> None:
    """SmolLM2's token 177 is the byte 0xE6 (part of a character): ``bytes`` is [230], not
    U+FFFD's [239, 191, 189], and ``token`` names it OpenAI's way, "bytes:\\xe6"."""
    base, engine = served
    body = {
        "model": MODEL, "messages": CHAT, "max_tokens": 1, "logprobs": True,
        "top_logprobs": 1, "logit_bias": {"177": 100},
    }  # fmt: skip
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    entry = r.json()["choices"][0]["logprobs"]["content"][0]
    assert entry["bytes"] == [230] and entry["token"] == "bytes:\\xe6"
    top = entry["top_logprobs"][0]
    if "bytes:" not in top["token"]:  # a whole token: its text's UTF-8
        assert bytes(top["bytes"]) == top["token"].encode()
    # A whole token, forced: its bytes are its text's.
    body["logit_bias"] = {"42": 100}
    entry = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).json()
    entry = entry["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == engine.tokenizer.decode([42])
    assert bytes(entry["bytes"]) == entry["token"].encode()

    # Legacy completions: tokens named the same way, text_offset in characters.
    for stream in (False, True):
        lps: dict[str, list[Any]] = {"tokens": [], "text_offset": []}
        text = ""
        body = {
            "model": MODEL, "prompt": "Hello", "max_tokens": 3, "logprobs": 0,
            "logit_bias": {"177": 100}, "stream": stream, "ignore_eos": True,
        }  # fmt: skip
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        if stream:
            for line in r.text.splitlines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    if choice["logprobs"]:
                        for k in lps:
                            lps[k] += choice["logprobs"][k]
        else:
            choice = r.json()["choices"][0]
            text, lps = choice["text"], choice["logprobs"]
        assert lps["tokens"] == ["bytes:\\xe6"] * 3
        # The first two 0xE6 are invalid (no continuation byte follows): U+FFFD each; the
        # last could still begin a character when max_tokens cut it: left out of the text.
        assert lps["text_offset"] == [0, 1, 2] and text == "\ufffd" * 2


def test_legacy_text_offset_of_partial_tokens() -> None:
    """OpenAI's convention: the pieces of one character share its offset (its example: "，"
    "bytes:\\xe9\\x80" "bytes:\\x82" "合" at 5, 6, 6, 7), also across stream chunks and
    when the output completes a character the prompt began."""
    from asyncllm.outputs import Logprob
    from asyncllm.server.responses import completion_logprobs

    def positions(pieces: list[bytes]) -> list[dict[int, Logprob]]:
        return [{i: Logprob(-1.0, 1, b.decode(errors="replace"), b)} for i, b in enumerate(pieces)]

    pieces = ["，".encode(), b"\xe9\x80", b"\x82", "合".encode(), b" the"]
    obj, state = completion_logprobs(range(5), positions(pieces), 0, 0)
    assert obj.tokens == ["，", "bytes:\\xe9\\x80", "bytes:\\x82", "合", " the"]
    assert obj.text_offset == [0, 1, 1, 2, 3] and state == len("，适合 the")
    # The same in two chunks, split inside the character.
    first, state = completion_logprobs(range(2), positions(pieces[:2]), 0, 0)
    rest, _ = completion_logprobs(range(3), positions(pieces[2:]), 0, state)
    assert first.text_offset + rest.text_offset == obj.text_offset
    # The output completes the prompt's "🤖" (its text is "🤖ab").
    obj, _ = completion_logprobs(range(3), positions([b"\xa4", b"\x96", b"ab"]), 0, 0)
    assert obj.text_offset == [0, 0, 1]


def test_rendered_chat_text_gets_one_bos(bos_llama_dir: Any) -> None:
    """/v1/completions with a rendered Llama-2 style chat template (it starts with BOS and the
    tokenizer adds BOS): the prompt has one BOS, the same ids as /v1/chat/completions."""
    engine = AsyncEngine.from_pretrained(str(bos_llama_dir), max_num_seqs=4)
    tok = engine.tokenizer
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert tok.encode(text)[:2] == [tok.bos_token_id] * 2
    expected = tok.encode(text, add_special_tokens=False)
    with serving(create_app(engine, MODEL)) as base:
        for prompt in (text, [text, "Hi"]):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(expected) + (
                len(tok.encode("Hi")) if isinstance(prompt, list) else 0
            )
        chat = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
        r = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=30)
        assert r.json()["usage"]["prompt_tokens"] == len(expected)
    check_pool_whole(engine)


def test_n_and_batched_prompts(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=1.0, seed=3, n=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    whole = client.chat.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert streamed == {c.index: c.message.content for c in whole.choices}

    batch = client.completions.create(
        model=MODEL, prompt=["One", "Two two"], n=2, max_tokens=3, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy: samples agree
    assert batch.usage is not None and batch.usage.completion_tokens == 12


def test_errors_use_openai_shape(served: tuple[str, AsyncEngine], client: openai.OpenAI) -> None:
    base, engine = served
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
    assert nf.value.body["code"] == "model_not_found"  # type: ignore[index]
    cases: list[tuple[dict[str, Any], str | None]] = [
        ({"top_p": 2.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"n": 0}, "n"),
        ({"prompt": "word " * 300}, None),  # longer than max_model_len
        ({"prompt": []}, "prompt"),
        ({"extra_body": {"stop_token_ids": [10**9]}}, None),  # outside the vocabulary
    ]
    for override, param in cases:
        kw: dict[str, Any] = {"model": MODEL, "prompt": "x", "max_tokens": 2, **override}
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as bad:
                client.completions.create(**kw, stream=stream)
            body = bad.value.body
            assert isinstance(body, dict) and body["type"] == "invalid_request_error"
            assert body["param"] == param and body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=CHAT, top_logprobs=30, logprobs=True)
    assert bad.value.body["param"] == "top_logprobs"  # type: ignore[index]

    # raw HTTP: malformed JSON, wrong types, unknown routes
    for body_bytes, param in (
        (b"{not json", None),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": "3"}', "max_tokens"),
        (b'{"model": "tiny"}', "prompt"),
    ):
        r = httpx.post(
            f"{base}/v1/completions",
            content=body_bytes,
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 400
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    r = httpx.get(f"{base}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]

    # a full waiting queue answers 429
    engine._loop.num_waiting = lambda tenant=None: 1024  # type: ignore[method-assign]
    try:
        with pytest.raises(openai.RateLimitError) as limited:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert limited.value.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
    finally:
        del engine._loop.num_waiting
    # a call the queue could never hold (n x prompts > max_waiting) is a 400, not a 429 that
    # a retrying client would repeat forever; one that fits is served
    engine.config.max_waiting = 2
    try:
        for kwargs in ({"prompt": "x", "n": 3}, {"prompt": ["a", "b", "c"]}):
            with pytest.raises(openai.BadRequestError) as bad:
                client.completions.create(model=MODEL, max_tokens=2, **kwargs)
            assert bad.value.body["param"] == "n"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, n=3)
        fits = client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2)
        assert len(fits.choices) == 2
    finally:
        engine.config.max_waiting = 1024
    wait_for(lambda: idle(engine))


def test_client_disconnect_aborts(served: tuple[str, AsyncEngine], client: openai.OpenAI) -> None:
    base, engine = served
    aborted = metric(base, "asyncllm:request_success_total", finished_reason="abort")
    generated = engine.stats()["num_generated_tokens"]
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got == 2:
            break
    stream.close()  # the client goes away mid-stream
    wait_for(lambda: idle(engine))
    assert engine.stats()["num_generated_tokens"] - generated < 200
    wait_for(
        lambda: metric(base, "asyncllm:request_success_total", finished_reason="abort") > aborted
    )

    # a non-streaming request whose client times out is aborted too
    generated = engine.stats()["num_generated_tokens"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            f"{base}/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True},
            timeout=0.15,
        )
    wait_for(lambda: idle(engine))
    assert engine.stats()["num_generated_tokens"] - generated < 200


def test_concurrent_clients(served: tuple[str, AsyncEngine]) -> None:
    base, engine = served

    async def main() -> list[int]:
        client = openai.AsyncOpenAI(
            base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60
        )

        async def one(i: int) -> int:
            kw: dict[str, Any] = dict(
                model=MODEL, messages=[{"role": "user", "content": f"Number {i}"}],
                max_tokens=5 + i % 3, temperature=0.8, seed=i,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            if i % 2:
                text = ""
                async for chunk in await client.chat.completions.create(**kw, stream=True):
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                    if chunk.choices and chunk.choices[0].finish_reason:
                        assert chunk.choices[0].finish_reason == "length"
            else:
                out = await client.chat.completions.create(**kw)
                assert out.usage is not None and out.usage.completion_tokens == 5 + i % 3
            return i

        try:
            return await asyncio.gather(*(one(i) for i in range(12)))
        finally:
            await client.close()

    steps_before = engine.stats()["num_steps"]
    assert asyncio.run(main()) == list(range(12))
    # 12 requests of 5-7 tokens in far fewer steps than 12 x 7: they were batched
    assert engine.stats()["num_steps"] - steps_before < 60
    wait_for(lambda: idle(engine))


def test_metrics(served: tuple[str, AsyncEngine], client: openai.OpenAI) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    base, _ = served
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0)
    r = httpx.get(f"{base}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name, kind in {
        "asyncllm:time_to_first_token_seconds": "histogram",
        "asyncllm:inter_token_latency_seconds": "histogram",
        "asyncllm:request_queue_time_seconds": "histogram",
        "asyncllm:e2e_request_latency_seconds": "histogram",
        "asyncllm:num_requests_running": "gauge",
        "asyncllm:num_requests_waiting": "gauge",
        "asyncllm:kv_cache_usage_perc": "gauge",
        "asyncllm:prefix_cache_queries": "counter",
        "asyncllm:prefix_cache_hits": "counter",
        "asyncllm:prefix_cache_hit_rate": "gauge",
        "asyncllm:num_preemptions": "counter",
        "asyncllm:generation_tokens": "counter",
        "asyncllm:request_success": "counter",
    }.items():
        assert families[name].type == kind, name
    assert metric(base, "asyncllm:time_to_first_token_seconds_count", model_name=MODEL) >= 1
    assert metric(base, "asyncllm:inter_token_latency_seconds_count") >= 3
    assert metric(base, "asyncllm:prefix_cache_queries_total") > 0
    assert metric(base, "asyncllm:request_success_total", finished_reason="length") >= 1
    assert 0.0 <= metric(base, "asyncllm:kv_cache_usage_perc") <= 1.0
    # The test suite's engines are eager (conftest): the compiled forward's state is "off".
    assert families["asyncllm:compiled_forward_state"].type == "gauge"
    for state in ("off", "compiling", "ready", "failed"):
        value = metric(base, "asyncllm:compiled_forward_state", state=state)
        assert value == (1.0 if state == "off" else 0.0), state


@pytest.mark.parametrize("state", ["compiling", "ready", "failed"])
def test_metrics_compiled_forward_state(served: tuple[str, AsyncEngine], state: str) -> None:
    """/metrics says where the compiled forward stands (``stats()["compile"]``): an
    operator sees whether steps run compiled yet, or a compile failed."""
    from prometheus_client.parser import text_string_to_metric_families

    from asyncllm.server.metrics import _EngineCollector

    _, engine = served
    stats = {**engine.stats(), "compile": state}
    collector = _EngineCollector(types.SimpleNamespace(stats=lambda: stats), MODEL)
    registry = prometheus_client.CollectorRegistry()
    registry.register(collector)
    text = prometheus_client.generate_latest(registry).decode()
    (family,) = [
        f
        for f in text_string_to_metric_families(text)
        if f.name == "asyncllm:compiled_forward_state"
    ]
    values = {s.labels["state"]: s.value for s in family.samples}
    assert values == {n: float(n == state) for n in ("off", "compiling", "ready", "failed")}


def test_engine_failure_answers_503(tiny_llama_dir: Any) -> None:
    """A dead engine: streams in flight end with an error event; later calls get 503."""
    engine = AsyncEngine.from_pretrained(str(tiny_llama_dir), max_num_seqs=4)
    with serving(create_app(engine, MODEL)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        fail_steps_after(engine, 3, "simulated device failure")
        stream = client.completions.create(
            model=MODEL, prompt="x", max_tokens=50, stream=True, extra_body={"ignore_eos": True}
        )
        with pytest.raises(openai.APIError) as died:
            for _ in stream:
                pass
        assert "engine" in str(died.value.message)
        with pytest.raises(openai.InternalServerError) as unavailable:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert unavailable.value.status_code == 503
        r = httpx.get(f"{base}/health")
        assert r.status_code == 503 and json.loads(r.text)["error"]["type"] == "server_error"
    check_pool_whole(engine)


def test_server_serve_refuses_replicas() -> None:
    """``asyncllm.server.serve`` serves one process; ``--replicas`` (Ray Serve) belongs to
    the command line above the server (``asyncllm.__main__.serve``), which builds on it, so
    the server never imports the Ray integration. Refused before anything loads."""
    import argparse

    from asyncllm.server import add_serve_arguments, serve

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    with pytest.raises(ValueError, match="--replicas serves on Ray Serve"):
        serve(parser.parse_args(["--replicas", "2"]))


def test_serve_freezes_what_it_loaded(tiny_llama_dir: Any, monkeypatch: Any) -> None:
    """The serve command moves what it loaded out of the cyclic collector's sight before it
    serves (a full collection would otherwise walk the model's objects mid-stream)."""
    import argparse
    import gc

    import uvicorn

    from asyncllm.server import add_serve_arguments, cli

    order: list[str] = []
    real = cli.freeze_loaded_objects
    monkeypatch.setattr(cli, "freeze_loaded_objects", lambda: order.append("freeze"))
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: order.append("run"))
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert cli.serve(parser.parse_args(["--model", str(tiny_llama_dir)])) == 0
    assert order == ["freeze", "run"]
    before = gc.get_freeze_count()
    try:
        real()
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()


def test_serve_command(tiny_llama_dir: Any) -> None:
    """``python -m asyncllm serve`` on 127.0.0.1 with port 0 (the OS picks a free one), API
    keys from $ASYNCLLM_API_KEY, the served name the model directory's base name; SIGINT
    stops it cleanly."""
    env = {**os.environ, "ASYNCLLM_API_KEY": "k1,k2"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncllm", "serve", "--model", str(tiny_llama_dir),
         "--host", "127.0.0.1", "--port", "0", "--max-num-seqs", "4"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    try:
        deadline = time.monotonic() + 90
        base = None
        seen: list[str] = []
        while base is None:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            seen.append(line)
            m = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
            base = m.group(1) if m else None
        # what it loads and runs is said before it serves (as `generate` says it)
        start = "".join(seen)
        assert "loading " in start and "computed in float32" in start, start
        assert "C++ kernels: attention=" in start and "loaded in " in start, start
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="k2", max_retries=0, timeout=30)
        name = os.path.basename(str(tiny_llama_dir))
        assert [m.id for m in client.models.list().data] == [name]
        text = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=name, messages=CHAT, max_tokens=4, stream=True
            )
            if c.choices
        )
        assert isinstance(text, str)
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert httpx.get(f"{base}/metrics").status_code == 401
        # stopped with a stream in flight: the request is aborted at once, the stream ends
        # with its final event and [DONE], the log has no traceback (it was cut off after
        # uvicorn's grace period, "Exception in ASGI application")
        events: list[str] = []

        def read_stream() -> None:
            # 250: the most the tiny model's 256-token context leaves (more is a 400)
            body = {"model": name, "prompt": "Once", "max_tokens": 250, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            auth = {"Authorization": "Bearer k1"}
            with httpx.stream(
                "POST", f"{base}/v1/completions", json=body, headers=auth, timeout=60
            ) as r:
                events.extend(x[6:] for x in r.iter_lines() if x.startswith("data: "))

        reader = threading.Thread(target=read_stream, daemon=True)
        reader.start()
        while len(events) < 3 and reader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGINT)
        reader.join(30)
        assert not reader.is_alive() and events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - stopped < 4  # not uvicorn's 5 s grace period
        log = "".join(lines.get_nowait() for _ in range(lines.qsize()))
        assert "Traceback" not in log and "Exception in ASGI" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _no_whitespace_bias(engine: AsyncEngine) -> dict[str, int]:
    """logit_bias -100 on the whitespace-only tokens: JSON with any whitespace (what
    response_format asks) then ends on a random model instead of running to max_tokens;
    the grammar still decides which tokens are possible."""
    tok = engine.tokenizer
    return {str(i): -100 for i in range(len(tok)) if tok.decode([i]).isspace()}


def test_response_format_json_schema_and_object(
    served: tuple[str, AsyncEngine], client: openai.OpenAI
) -> None:
    from typing import Literal

    import pydantic

    base, engine = served

    class Forecast(pydantic.BaseModel):
        city: Literal["paris", "rome", "oslo"]
        days: int = pydantic.Field(ge=1, le=7)
        rain: bool
        tags: list[Literal["a", "b"]] = pydantic.Field(max_length=2)

    bias = _no_whitespace_bias(engine)
    for seed in range(4):
        done = client.chat.completions.parse(
            model=MODEL, messages=CHAT, response_format=Forecast, max_completion_tokens=60,
            seed=seed, logit_bias=bias,
        )  # fmt: skip
        choice = done.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Forecast)
    doc_schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}
    schema = {"type": "json_schema", "json_schema": {"name": "F", "schema": doc_schema}}
    for endpoint, body in (
        ("completions", {"prompt": "x"}),
        ("chat/completions", {"messages": CHAT}),
    ):
        for fmt in (schema, {"type": "json_object"}):
            for stream in (False, True):
                r = httpx.post(f"{base}/v1/{endpoint}", json={
                    **body, "response_format": fmt, "max_tokens": 60, "seed": 3,
                    "logit_bias": bias, "stream": stream}, timeout=30)  # fmt: skip
                assert r.status_code == 200, r.text
                if stream:
                    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                              if line.startswith("data: {")]  # fmt: skip
                    parts = [c["choices"][0] for c in chunks if c["choices"]]
                    text = "".join(
                        c["text"] if "text" in c else c["delta"].get("content") or "" for c in parts
                    )
                    reason = parts[-1]["finish_reason"]
                else:
                    ch = r.json()["choices"][0]
                    text = ch["text"] if "text" in ch else ch["message"]["content"]
                    reason = ch["finish_reason"]
                if fmt is schema:  # a short document: always complete
                    assert reason == "stop" and json.loads(text)["n"] in (1, 2, 3)
                elif reason == "stop":  # any object: random strings may reach max_tokens
                    assert isinstance(json.loads(text, strict=False), dict)
                else:
                    assert reason == "length" and text.startswith("{")
    # Bad formats and schemas the engine cannot compile: 400 naming response_format.
    bad_formats: list[Any] = [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        {"type": "json_schema", "json_schema": {"schema": {}}},  # no name
        {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
        {"type": "yaml"},
    ]
    for fmt in bad_formats:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as bad:
                client.chat.completions.create(
                    model=MODEL, messages=CHAT, max_tokens=5, response_format=fmt, stream=stream
                )
            assert bad.value.body["param"] == "response_format", bad.value.body  # type: ignore[index]
    ok = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert ok.choices[0].message.content is not None
    wait_for(lambda: idle(engine))
    assert len(engine.core.grammar_matchers) == 0
