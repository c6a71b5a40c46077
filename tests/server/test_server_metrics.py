"""What each server metric counts under parallel sampling (``n > 1``), streamed or not.

One request (a prompt with its n samples) counts once in ``request_success_total``, the
prompt-size histogram, TTFT, queue time, e2e latency and ``request_params_n``; the prompt's
tokens count once in ``prompt_tokens_total``; generated tokens add up over the samples,
so the token counters grow by exactly the response's ``usage``.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from asyncllm import AsyncEngine
from asyncllm.server.metrics import request_finish_reason
from tests.server import test_server
from tests.server.test_server import idle, wait_for

MODEL = test_server.MODEL
# test_server's fixtures: a module-scoped server over a tiny engine, and a client of it
served = test_server.served
client = test_server.client
PER_REQUEST = (
    "asyncllm:request_success_total",
    "asyncllm:request_prompt_tokens_count",
    "asyncllm:request_generation_tokens_count",
    "asyncllm:request_params_n_count",
    "asyncllm:time_to_first_token_seconds_count",
    "asyncllm:request_queue_time_seconds_count",
    "asyncllm:e2e_request_latency_seconds_count",
)


def scrape(base: str) -> dict[str, float]:
    """Every sample of /metrics summed over its labels but ``finished_reason``, which is
    kept as a suffix (``name{reason}``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for s in family.samples:
            name = s.name
            if "finished_reason" in s.labels:
                out[name] = out.get(name, 0.0) + s.value
                name = f"{name}{{{s.labels['finished_reason']}}}"
            out[name] = out.get(name, 0.0) + s.value
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def _usage(resp: Any, stream: bool) -> tuple[int, int]:
    if stream:
        chunks = list(resp)
        usage = chunks[-1].usage
    else:
        usage = resp.usage
    assert usage is not None
    return usage.prompt_tokens, usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_counts_a_request_once(
    served: tuple[str, AsyncEngine], client: openai.OpenAI, stream: bool, endpoint: str
) -> None:
    """One call with an 80-token prompt and n=4 adds 80 prompt tokens, 1 success, 1 to
    each per-request histogram, and exactly usage.completion_tokens generated tokens."""
    base, engine = served
    n, max_tokens = 4, 5
    ids = list(range(1000, 1080))  # 80 prompt tokens
    extra: dict[str, Any] = {"ignore_eos": True}
    kw: dict[str, Any] = dict(model=MODEL, n=n, max_tokens=max_tokens, temperature=1.0, seed=1)
    if stream:
        kw.update(stream=True, stream_options={"include_usage": True})
    before = scrape(base)
    if endpoint == "completions":
        resp = client.completions.create(prompt=ids, extra_body=extra, **kw)
    else:
        text = engine.tokenizer.decode(ids)
        resp = client.chat.completions.create(
            messages=[{"role": "user", "content": text}], extra_body=extra, **kw
        )
    prompt_tokens, completion_tokens = _usage(resp, stream)
    wait_for(lambda: idle(engine))
    d = delta(before, scrape(base))
    if endpoint == "completions":
        assert prompt_tokens == 80
    assert completion_tokens == n * max_tokens
    assert d["asyncllm:prompt_tokens_total"] == prompt_tokens
    assert d["asyncllm:generation_tokens_total"] == completion_tokens
    for name in PER_REQUEST:
        assert d[name] == 1, name
    assert d["asyncllm:request_success_total{length}"] == 1
    assert d["asyncllm:request_prompt_tokens_sum"] == prompt_tokens
    assert d["asyncllm:request_generation_tokens_sum"] == completion_tokens
    assert d["asyncllm:request_params_n_sum"] == n
    # per sample: at most one gap per consecutive pair of a sample's tokens
    assert 0 <= d["asyncllm:inter_token_latency_seconds_count"] <= n * (max_tokens - 1)


@pytest.mark.parametrize("stream", [False, True])
def test_batched_prompts_count_once_each(
    served: tuple[str, AsyncEngine], client: openai.OpenAI, stream: bool
) -> None:
    """Two prompts with n=3: two requests, each prompt's tokens once."""
    base, engine = served
    kw: dict[str, Any] = dict(
        model=MODEL, prompt=[list(range(500, 520)), list(range(600, 611))], n=3, max_tokens=2,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    if stream:
        kw.update(stream=True, stream_options={"include_usage": True})
    before = scrape(base)
    prompt_tokens, completion_tokens = _usage(client.completions.create(**kw), stream)
    wait_for(lambda: idle(engine))
    d = delta(before, scrape(base))
    assert (prompt_tokens, completion_tokens) == (31, 12)
    assert d["asyncllm:prompt_tokens_total"] == 31
    assert d["asyncllm:generation_tokens_total"] == 12
    for name in PER_REQUEST:
        assert d[name] == 2, name
    assert d["asyncllm:request_prompt_tokens_sum"] == 31
    assert d["asyncllm:request_params_n_sum"] == 6


def test_abort_with_n_counts_once(served: tuple[str, AsyncEngine], client: openai.OpenAI) -> None:
    """A client leaving an n=3 stream: one abort, no finished-request histogram."""
    base, engine = served
    before = scrape(base)
    stream = client.completions.create(
        model=MODEL, prompt=list(range(700, 740)), n=3, max_tokens=200, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            break
    stream.close()
    wait_for(lambda: idle(engine))
    wait_for(lambda: delta(before, scrape(base))["asyncllm:request_success_total"] >= 1)
    d = delta(before, scrape(base))
    assert d["asyncllm:request_success_total"] == 1
    assert d["asyncllm:request_success_total{abort}"] == 1
    assert d["asyncllm:prompt_tokens_total"] == 40
    assert d["asyncllm:request_prompt_tokens_count"] == 0


def test_rejected_requests_are_not_counted(
    served: tuple[str, AsyncEngine], client: openai.OpenAI
) -> None:
    """A prompt the engine refuses (too long) is not a request that ended."""
    base, _ = served
    before = scrape(base)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=list(range(300)), n=2, max_tokens=2)
    d = delta(before, scrape(base))
    assert d.get("asyncllm:request_success_total", 0) == 0
    assert d.get("asyncllm:prompt_tokens_total", 0) == 0


def test_request_finish_reason() -> None:
    assert request_finish_reason(["stop", "stop"]) == "stop"
    assert request_finish_reason(["stop", "length", "stop"]) == "length"
    assert request_finish_reason(["length", "abort"]) == "abort"
    assert request_finish_reason(["timeout", "length"]) == "timeout"
    assert request_finish_reason(["error", "abort"]) == "error"


def test_a_ray_serve_front_has_every_counter_before_its_first_refresh():
    """The Serve ingress builds the app (and its metrics collector, which reads every
    counter once) before any replica's stats arrive: its stand-in stats must name them all,
    and a real engine's stats must too."""
    from asyncllm.integrations.ray_serve import NO_STATS
    from asyncllm.server.metrics import _ENGINE_METRICS

    read = {source for *_, source in _ENGINE_METRICS if isinstance(source, str)}
    assert read <= set(NO_STATS)
