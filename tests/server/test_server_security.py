"""The server against hostile or careless clients: body size and type, malformed JSON,
request chat templates, API keys, CORS, client priorities, prefix-cache isolation per key,
and error messages that never leak internals (a Python repr, a qualified name, a path).

Apps are served one at a time over one tiny engine (each app's lifespan enters and leaves
it); checks that need exact ASGI framing (a lying Content-Length) call the app directly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import anyio.from_thread
import httpx
import openai
import pytest

from asyncllm import AsyncEngine, InvalidRequestError
from asyncllm.server import add_serve_arguments, app_options_from_args, create_app
from asyncllm.server import security as server_security
from asyncllm.server.app import DEFAULT_MAX_REQUEST_BYTES, TENANT_KEY, default_served_name
from tests.conftest import check_pool_whole
from tests.server.test_server import fail_steps_after, idle, serving, wait_for

MODEL = "tiny"
JSON = {"Content-Type": "application/json"}
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Any) -> Iterator[AsyncEngine]:
    engine = AsyncEngine.from_pretrained(str(tiny_llama_dir), max_num_seqs=8)
    yield engine
    check_pool_whole(engine)


@pytest.fixture
def base(engine: AsyncEngine) -> Iterator[str]:
    """A server with the default options (one app at a time runs the engine)."""
    with serving(create_app(engine, MODEL)) as url:
        yield url


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url, content=content, headers=JSON if headers is None else headers)


_LEAKS = re.compile(
    r"Traceback|File \"|\w+Error\(|\bobject at 0x|<\w+[ .]|asyncllm\.\w|site-packages|"
    r"/tmp/|/root/|/home/|/work/|\\\\"
)


def assert_error(r: httpx.Response, status: int, param: str | None = "any") -> dict[str, Any]:
    """OpenAI's error JSON with ``status``, and a message that leaks no internals."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert not _LEAKS.search(err["message"]), err["message"]
    if param != "any":
        assert err["param"] == param
    return dict(err)


# ------------------------------------------------------------------ body size (413)


def _asgi_post(
    app: Any, path: str, chunks: Iterator[bytes], headers: list[tuple[bytes, bytes]]
) -> tuple[int, bytes, int]:
    """POST through the ASGI interface, the body from ``chunks``; returns the status, the
    body and how many body messages the app read."""
    sent: list[dict[str, Any]] = []
    reads = 0

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        chunk = next(chunks, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], body, reads


def _endless(size: int) -> Iterator[bytes]:
    yield b'{"prompt": "'
    while True:
        yield b"x" * size


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content_length", [None, b"10", b"100"])
def test_body_cap_stops_reading(engine: AsyncEngine, path: str, content_length: Any) -> None:
    """An endless body, with no Content-Length or a lying one, is refused (413) after
    reading just past the limit."""
    app = create_app(engine, MODEL, max_request_bytes=100_000)
    headers = [] if content_length is None else [(b"content-length", content_length)]
    status, body, reads = _asgi_post(app, path, _endless(16_384), headers)
    assert status == 413
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and "100000" in err["message"]
    assert reads <= 100_000 // 16_384 + 2
    # the default limit applies too (the issue: a 50 MB body was read whole)
    status, _, reads = _asgi_post(create_app(engine, MODEL), path, _endless(65_536), headers)
    assert status == 413 and reads <= DEFAULT_MAX_REQUEST_BYTES // 65_536 + 2


def test_body_cap_over_http(engine: AsyncEngine) -> None:
    with serving(create_app(engine, MODEL, max_request_bytes=2000)) as url:
        small = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        assert post(f"{url}/v1/completions", small).status_code == 200
        big = {**small, "prompt": "word " * 500}
        for path in ("/v1/completions", "/v1/chat/completions"):
            assert_error(post(f"{url}{path}", big), 413)  # declared Content-Length > limit

        def chunked() -> Iterator[bytes]:  # no Content-Length: Transfer-Encoding: chunked
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(3):
                yield b"x" * 1000
            yield b'"}'

        r = httpx.post(f"{url}/v1/completions", content=chunked(), headers=JSON)
        assert_error(r, 413)
        assert r.json()["error"]["code"] == "request_too_large"
        wait_for(lambda: idle(engine))


# ------------------------------------------------------------------ content type (415), CORS


def test_only_json_bodies(base: str, engine: AsyncEngine) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    chat = json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 1}).encode()
    for path, data in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        for ctype in (
            "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x", "application/jsonx", None,
        ):  # fmt: skip
            headers = {} if ctype is None else {"Content-Type": ctype}
            r = httpx.post(f"{base}{path}", content=data, headers=headers)
            err = assert_error(r, 415)
            assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
        for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
            r = httpx.post(f"{base}{path}", content=data, headers={"Content-Type": ctype})
            assert r.status_code == 200, r.text
    # no CORS headers by default
    r = httpx.get(f"{base}/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    wait_for(lambda: idle(engine))


def test_allowed_origins(engine: AsyncEngine) -> None:
    app = create_app(engine, MODEL, allowed_origins=["https://ok.example"], api_keys="k")
    with serving(app) as url:
        pre = {"Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
        r = httpx.options(f"{url}/v1/completions", headers={"Origin": "https://ok.example", **pre})
        assert r.status_code == 200  # the preflight needs no key
        assert r.headers["access-control-allow-origin"] == "https://ok.example"
        evil = {"Origin": "https://evil.example", **pre}
        r = httpx.options(f"{url}/v1/completions", headers=evil)
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = httpx.get(
            f"{url}/v1/models",
            headers={"Origin": "https://ok.example", "Authorization": "Bearer k"},
        )
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://ok.example"


# ------------------------------------------------------------------ malformed bodies (400)


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deep_nesting_answers_400(base: str, depth: int) -> None:
    deep = _nested(depth)
    cases = [
        ("/v1/completions", deep),  # the body itself
        ("/v1/completions", b'{"model": "tiny", "prompt": ' + deep + b"}"),  # a known field
        ("/v1/completions", b'{"prompt": "x", "ignored": ' + deep + b"}"),  # an ignored one
        ("/v1/completions", b'{"prompt": "x", "logit_bias": {"1": ' + deep + b"}}"),
        ("/v1/chat/completions", b'{"messages": ' + deep + b"}"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + deep + b"}]}"),
        ("/v1/chat/completions", b'{"messages": [], "chat_template_kwargs": {"a": ' + deep + b"}}"),
    ]
    for path, body in cases:
        assert_error(post(f"{base}{path}", body), 400)


def test_nesting_limit_does_not_follow_the_recursion_limit(base: str) -> None:
    """The nesting bound is MAX_NESTING levels whatever Python's recursion limit is
    (Inductor raises it to 2,000 when it compiles in the process: a 1,000-deep ignored
    field was then accepted); brackets inside strings do not count, and a large shallow
    body (decoded on a worker thread) is served. The deep values ride in a field the server
    reads and ignores (``response_format``'s extra keys: unknown top-level fields are
    refused), one level below the top."""
    from asyncllm.server.protocol import MAX_NESTING
    from asyncllm.server.security import THREAD_DECODE_BYTES

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(5000)
    try:
        over = (
            b'{"prompt": "x", "response_format": {"type": "text", "x": '
            + _nested(MAX_NESTING)
            + b"}}"
        )
        assert_error(post(f"{base}/v1/completions", over), 400)
        at = (
            b'{"prompt": "x", "max_tokens": 1, "response_format": {"type": "text", "x": '
            + _nested(MAX_NESTING - 2)
            + b"}}"
        )
        assert post(f"{base}/v1/completions", at).status_code == 200
    finally:
        sys.setrecursionlimit(old)
    in_string = "[{" * MAX_NESTING
    body = json.dumps(
        {"prompt": "x", "max_tokens": 1, "response_format": {"type": "text", "x": in_string}}
    ).encode()
    assert post(f"{base}/v1/completions", body).status_code == 200
    wide = [[i] for i in range(THREAD_DECODE_BYTES // 4)]
    body = json.dumps(
        {"prompt": "x", "max_tokens": 1, "response_format": {"type": "text", "x": wide}}
    ).encode()
    assert len(body) > THREAD_DECODE_BYTES
    assert post(f"{base}/v1/completions", body).status_code == 200


def test_malformed_bodies_answer_400(base: str, engine: AsyncEngine) -> None:
    from asyncllm.server.protocol import MAX_NESTING

    moderately_deep = _nested(MAX_NESTING - 8)  # decodes; must not crash what reads it later
    cases = [
        b"",
        b"   ",
        b"null",
        b"[]",
        b'[{"prompt": "x"}]',
        b'"prompt"',
        b"{not json",
        b'{"prompt": "\xff\xfe"}',  # invalid UTF-8
        b'\xef\xbb\xbf{"prompt": "x"}',  # a byte-order mark
        b'{"prompt": "x", "max_tokens": 1e400}',
        b'{"prompt": "x", "max_tokens": -99999999999999999999999999}',
        b'{"prompt": "x", "n": 1000000000000}',
        b'{"prompt": "x", "logit_bias": {"abc": 1}}',
        b'{"prompt": ' + moderately_deep + b"}",
        b'{"prompt": [[1, 2], "x"]}',
    ]
    for body in cases:
        assert_error(post(f"{base}/v1/completions", body), 400)
    for ids in ([10**12], [-1], [5, 49152]):  # echo decodes the prompt: checked first
        body = {"prompt": ids, "echo": True, "max_tokens": 1}
        assert_error(post(f"{base}/v1/completions", body), 400, "prompt")
    for fmt in ({"a": 1}, ["x"], 3):
        body = {"messages": CHAT, "response_format": {"type": fmt}}
        err = assert_error(post(f"{base}/v1/chat/completions", body), 400, "response_format")
        assert "{" not in err["message"] and "[" not in err["message"]
    chat_cases: list[Any] = [
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": 3, "content": "x"}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"messages": [{"role": "user", "content": [[]]}]},
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": '
        + moderately_deep
        + b"}]}]}",
    ]
    for body in chat_cases:
        assert_error(post(f"{base}/v1/chat/completions", body), 400, "messages")
    # a deep value the template never reads renders (or is refused), but never fails
    r = post(
        f"{base}/v1/chat/completions",
        b'{"max_tokens": 1, "messages": [{"role": "user", "content": "x", "extra": '
        + moderately_deep
        + b"}]}",
    )
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert_error(r, 400)
    wait_for(lambda: idle(engine))


def test_echo_decodes_token_ids_off_the_loop_after_the_length_check(
    base: str, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``echo`` with token ids decodes them for the response: a prompt longer than
    max_model_len is refused before that (600,000 ids took 0.4 s to decode on the loop),
    and a fitting one is decoded on a worker thread (neither the loop nor the compute
    thread)."""
    import threading

    tok = engine.tokenizer
    real = tok.decode
    decoded: list[tuple[str, int]] = []  # (thread name, ids) of each decode of 8+ ids

    def spy(ids: Any, *args: Any, **kw: Any) -> Any:
        if len(ids) >= 8:
            decoded.append((threading.current_thread().name, len(ids)))
        return real(ids, *args, **kw)

    monkeypatch.setattr(tok, "decode", spy)
    limit = engine.max_model_len
    for ids in ([5] * (limit + 1), [5] * 100_000):
        body = {"prompt": ids, "echo": True, "max_tokens": 1}
        err = assert_error(post(f"{base}/v1/completions", body), 400, "prompt")
        assert f"max_model_len is {limit}" in err["message"]
    assert decoded == []
    ids = list(range(100, 110))
    r = post(f"{base}/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 1})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"].startswith(real(ids))
    assert [n for _, n in decoded] == [10]
    loop_thread = anyio.from_thread.run_sync(
        lambda: threading.current_thread().name,
        token=engine._token,  # type: ignore[arg-type]
    )
    assert decoded[0][0] not in (loop_thread, "MainThread")
    assert not decoded[0][0].startswith("asyncllm-step")

    async def bad_ids() -> None:
        for ids in ([5.5], ["5"], [True], [-1], [engine.core.vocab_size]):
            with pytest.raises(InvalidRequestError, match="token ids"):
                await engine.decode(ids)  # type: ignore[arg-type]

    anyio.from_thread.run(bad_ids, token=engine._token)  # type: ignore[arg-type]


def test_too_many_stop_strings_answer_400(base: str) -> None:
    """350,000 stop strings (3.5 MB) with n=8 stalled the loop over 5 s per step."""
    stops = [f"q{i}" for i in range(65)]
    for path, body in (
        ("/v1/completions", {"prompt": "Hi", "stop": stops, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": CHAT, "stop": stops, "n": 8, "max_tokens": 2}),
    ):
        err = assert_error(post(base + path, body), 400, "stop")
        assert "at most 64" in err["message"]


def test_unexpected_errors_leak_nothing(
    base: str, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception answers 500 with a fixed message; routes and methods that
    do not exist answer OpenAI's error JSON."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"boom in {os.path.abspath(__file__)}")

    monkeypatch.setattr(engine, "stream", broken)
    for stream in (False, True):
        r = post(f"{base}/v1/completions", {"prompt": "x", "max_tokens": 1, "stream": stream})
        err = assert_error(r, 500)
        assert err["type"] == "server_error" and "boom" not in err["message"]
    monkeypatch.undo()
    assert_error(httpx.get(f"{base}/v1/nothing"), 404)
    assert_error(httpx.get(f"{base}/v1/completions"), 405)
    assert_error(httpx.delete(f"{base}/health"), 405)


def test_engine_failure_leaks_nothing(tiny_llama_dir: Any) -> None:
    """The step's exception text (here a path) reaches no client: not the stream's error
    event, the next call's 503 nor /health; the failed n=2 request counts once, as error."""
    from tests.server.test_server_metrics import delta, scrape

    engine = AsyncEngine.from_pretrained(str(tiny_llama_dir), max_num_seqs=4)
    secret = f"device failure in {os.path.abspath(__file__)}"
    with serving(create_app(engine, MODEL)) as url:
        before = scrape(url)
        fail_steps_after(engine, 3, secret)
        body = {"prompt": "x", "max_tokens": 50, "n": 2, "stream": True, "ignore_eos": True}
        with httpx.stream(
            "POST", f"{url}/v1/completions", content=json.dumps(body), headers=JSON
        ) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: {")]
        last = json.loads(events[-1][len("data: ") :])
        assert set(last) == {"error"} and "engine" in last["error"]["message"]
        for text in events:
            assert "device failure" not in text and "RuntimeError" not in text
        err = assert_error(post(f"{url}/v1/completions", {"prompt": "x", "max_tokens": 2}), 503)
        assert err["code"] == "engine_unavailable" and "device failure" not in err["message"]
        err = assert_error(httpx.get(f"{url}/health"), 503)
        assert "device failure" not in err["message"]
        d = delta(before, scrape(url))
        assert d["asyncllm:request_success_total"] == 1
        assert d["asyncllm:request_success_total{error}"] == 1
    check_pool_whole(engine)


def test_served_model_name_is_no_path(engine: AsyncEngine, tiny_llama_dir: Any) -> None:
    name = os.path.basename(str(tiny_llama_dir))
    assert default_served_name(str(tiny_llama_dir)) == name
    assert default_served_name(str(tiny_llama_dir) + "/") == name
    assert default_served_name("default") == "default"
    assert engine.config.model == str(tiny_llama_dir)
    with serving(create_app(engine)) as url:
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == name
        err = assert_error(post(f"{url}/v1/completions", {"model": "x", "prompt": "x"}), 404)
        assert str(tiny_llama_dir) not in err["message"]


# ------------------------------------------------------------------ request chat templates


RESERVED = [
    "tokenize", "return_dict", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "return_tensors", "tokenizer_kwargs", "truncation",
    "max_length", "padding", "return_assistant_tokens_mask", "conversation",
]  # fmt: skip


def test_request_chat_template_refused(base: str, engine: AsyncEngine) -> None:
    url = f"{base}/v1/chat/completions"
    heavy = "{{ 'x' * 6000000 }}"
    ok = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
    assert_error(post(url, {**ok, "chat_template": heavy}), 400, "chat_template")
    err = assert_error(
        post(url, {**ok, "chat_template_kwargs": {"chat_template": heavy}}),
        400,
        "chat_template_kwargs",
    )
    assert "--trust-request-chat-template" in err["message"]
    for key in RESERVED:
        err = assert_error(
            post(url, {**ok, "chat_template_kwargs": {key: True}}), 400, "chat_template_kwargs"
        )
        assert key in err["message"]
    # template variables are fine
    r = post(url, {**ok, "chat_template_kwargs": {"enable_thinking": False, "x": [1]}})
    assert r.status_code == 200, r.text
    wait_for(lambda: idle(engine))


def test_trusted_request_chat_template(engine: AsyncEngine) -> None:
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    expected = len(engine.tokenizer.encode("<Say something.>", add_special_tokens=False))
    app = create_app(engine, MODEL, trust_request_chat_template=True)
    with serving(app) as url:
        ok = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
        for extra in ({"chat_template": template},
                      {"chat_template_kwargs": {"chat_template": template}}):  # fmt: skip
            r = post(f"{url}/v1/chat/completions", {**ok, **extra})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == expected
        both = {"chat_template": template, "chat_template_kwargs": {"chat_template": template}}
        assert_error(post(f"{url}/v1/chat/completions", {**ok, **both}), 400, "chat_template")
        r = post(f"{url}/v1/chat/completions", {**ok, "chat_template_kwargs": {"tokenize": 0}})
        assert_error(r, 400, "chat_template_kwargs")
        wait_for(lambda: idle(engine))


# ------------------------------------------------------------------ API keys


def test_api_keys(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[bytes] = []
    real = server_security.hmac.compare_digest

    def counting(a: Any, b: Any) -> bool:
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(server_security.hmac, "compare_digest", counting)
    app = create_app(engine, MODEL, api_keys=["k1", "k2,k3"])
    with serving(app) as url:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"},
                        {"Authorization": "Basic k1"}, {"Authorization": "Bearer k1x"},
                        {"Authorization": "Bearer"}):  # fmt: skip
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                                 ("POST", "/v1/chat/completions"), ("GET", "/metrics"),
                                 ("GET", "/v1/nothing")):  # fmt: skip
                r = httpx.request(
                    method, f"{url}{path}", content=json.dumps(body), headers={**JSON, **headers}
                )
                err = assert_error(r, 401)
                assert err["code"] == "invalid_api_key"
                assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{url}/health").status_code == 200
        compared.clear()
        for key in ("k1", "k2", "k3"):
            auth = {"Authorization": f"Bearer {key}"}
            assert httpx.get(f"{url}/v1/models", headers=auth).status_code == 200
            assert httpx.get(f"{url}/metrics", headers=auth).status_code == 200
            assert post(f"{url}/v1/completions", body, {**JSON, **auth}).status_code == 200
        # every key is compared on every request, whichever matches
        assert len(compared) == 9 * 3
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "bearer k2"}).is_success
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k3", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="bad", max_retries=0).models.list()
    with serving(create_app(engine, MODEL, api_keys="k", metrics_without_auth=True)) as url:
        assert httpx.get(f"{url}/metrics").status_code == 200
        assert_error(httpx.get(f"{url}/v1/models"), 401)
    wait_for(lambda: idle(engine))


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_options() -> None:
    """Every security option is settable from the command line (keys also from
    $ASYNCLLM_API_KEY) and maps to create_app's keyword."""
    opts = app_options_from_args(_args(), environ={})
    assert opts == {
        "api_keys": [], "metrics_without_auth": False,
        "max_request_bytes": DEFAULT_MAX_REQUEST_BYTES, "trust_request_chat_template": False,
        "client_priority_range": (0, 0), "share_prefix_cache_across_keys": False,
        "allowed_origins": [], "chat_template": None, "tenant_header": None,
        "admission": "refuse", "queue_events": False,
    }  # fmt: skip
    assert app_options_from_args(_args(), environ={"ASYNCLLM_API_KEY": "a, b"})["api_keys"] == [
        "a",
        "b",
    ]
    args = _args(
        "--api-key", "a", "--api-key", "b,c", "--metrics-without-auth",
        "--max-request-bytes", "1000", "--trust-request-chat-template",
        "--client-priority-range=-5,3", "--share-prefix-cache-across-keys",
        "--allowed-origins", "https://a.example,https://b.example",
        "--tenant-header", "X-Tenant", "--admission", "wait", "--queue-events",
    )  # fmt: skip
    opts = app_options_from_args(args, environ={"ASYNCLLM_API_KEY": "ignored"})
    assert opts == {
        "api_keys": ["a", "b", "c"], "metrics_without_auth": True, "max_request_bytes": 1000,
        "trust_request_chat_template": True, "client_priority_range": (-5, 3),
        "share_prefix_cache_across_keys": True,
        "allowed_origins": ["https://a.example", "https://b.example"], "chat_template": None,
        "tenant_header": "X-Tenant", "admission": "wait", "queue_events": True,
    }  # fmt: skip
    for bad in (["--client-priority-range", "1,5"], ["--client-priority-range", "x"],
                ["--max-request-bytes", "0"], ["--admission", "later"]):  # fmt: skip
        with pytest.raises(SystemExit):
            _args(*bad)


# ------------------------------------------------------------------ priority, prefix cache


def test_client_priority_range(engine: AsyncEngine) -> None:
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    with serving(create_app(engine, MODEL)) as base:
        url = f"{base}/v1/completions"
        for prio in (-1, 1, -(10**6)):
            err = assert_error(post(url, {**ok, "priority": prio}), 400, "priority")
            assert "[0, 0]" in err["message"]
        chat = {"messages": CHAT, "priority": -1}
        assert_error(post(f"{base}/v1/chat/completions", chat), 400, "priority")
        assert post(url, {**ok, "priority": 0}).status_code == 200
        assert post(url, ok).status_code == 200
        wait_for(lambda: idle(engine))
    with serving(create_app(engine, MODEL, client_priority_range=(-5, 5))) as wide:
        assert post(f"{wide}/v1/completions", {**ok, "priority": -5}).status_code == 200
        err = assert_error(post(f"{wide}/v1/completions", {**ok, "priority": 6}), 400)
        assert "[-5, 5]" in err["message"]
    for bad in ((1, 5), (-5, -1), (3, 2)):
        with pytest.raises(ValueError, match="client_priority_range"):
            create_app(engine, MODEL, client_priority_range=bad)
    with pytest.raises(ValueError, match="max_request_bytes"):
        create_app(engine, MODEL, max_request_bytes=0)
    wait_for(lambda: idle(engine))


def _cached(url: str, key: str, prompt: list[int], salt: str | None = None) -> int:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    r = post(f"{url}/v1/completions", body, {**JSON, "Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_prefix_cache_isolated_per_key(engine: AsyncEngine) -> None:
    block = engine.config.block_size
    with serving(create_app(engine, MODEL, api_keys=["a", "b"])) as url:
        prompt = list(range(2000, 2000 + 4 * block + 3))
        assert _cached(url, "a", prompt) == 0
        assert _cached(url, "a", prompt) >= 3 * block  # the same key hits its own blocks
        assert _cached(url, "b", prompt) == 0  # another key does not
        # a client salt stays inside the key's space; it cannot name another key's space
        assert _cached(url, "a", prompt, salt="s") == 0
        assert _cached(url, "a", prompt, salt="s") >= 3 * block
        tenant_a = server_security._tenant(b"a")
        assert _cached(url, "b", prompt, salt=tenant_a) == 0
        wait_for(lambda: idle(engine))
    shared = create_app(engine, MODEL, api_keys=["a", "b"], share_prefix_cache_across_keys=True)
    with serving(shared) as url:
        prompt = list(range(3000, 3000 + 4 * block + 3))
        assert _cached(url, "a", prompt) == 0
        assert _cached(url, "b", prompt) >= 3 * block
        wait_for(lambda: idle(engine))
    assert TENANT_KEY.startswith("asyncllm.")
