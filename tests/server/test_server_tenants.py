"""The server's tenants (API key, or the operator's tenant header), admission that waits for
a place instead of 429, and queue positions as server-sent-event comments."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import httpx
import pytest

from asyncllm import AsyncEngine
from asyncllm.server import create_app
from tests.conftest import check_pool_whole
from tests.server.test_server import MODEL, serving, wait_for

BODY = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 3, "ignore_eos": True}


def _record_tenants(engine: AsyncEngine) -> list[str]:
    seen: list[str] = []
    real = engine.stream

    def stream(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["tenant"])
        return real(*args, **kwargs)

    engine.stream = stream  # type: ignore[method-assign]
    return seen


def test_the_tenant_comes_from_the_header_else_the_api_key(tiny_llama_dir: Any) -> None:
    engine = AsyncEngine.from_pretrained(str(tiny_llama_dir), max_num_seqs=4)
    seen = _record_tenants(engine)
    app = create_app(engine, MODEL, api_keys=["k1"], tenant_header="X-Tenant")
    key = {"Authorization": "Bearer k1"}
    with serving(app) as base:
        for headers in (key, {**key, "X-Tenant": "bot-7"}, {**key, "X-Tenant": ""}):
            r = httpx.post(f"{base}/v1/completions", json=BODY, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
        long = {**key, "X-Tenant": "x" * 300}
        r = httpx.post(f"{base}/v1/completions", json=BODY, headers=long, timeout=30)
        assert r.status_code == 400 and "X-Tenant" in r.json()["error"]["message"]
    by_key = "apikey:" + hashlib.sha256(b"k1").hexdigest()
    assert seen[:3] == [by_key, "bot-7", by_key]  # an empty header names no tenant
    check_pool_whole(engine)


def test_queue_events_and_waiting_for_a_place(tiny_llama_dir: Any) -> None:
    """max_num_seqs=1, max_waiting=1, steps held: the second streamed request reads its
    queue position as SSE comments; a third waits for a place instead of 429."""
    engine = AsyncEngine.from_pretrained(
        str(tiny_llama_dir), max_num_seqs=1, max_waiting=1, block_size=4, kv_cache_bytes=2**20
    )
    core = engine.core
    real_step, permits = core.step, threading.Semaphore(0)
    gated = [True]

    def step() -> Any:
        if gated[0]:
            permits.acquire()
        return real_step()

    core.step = step  # type: ignore[method-assign]
    app = create_app(engine, MODEL, admission="wait", queue_events=True)
    results: dict[str, list[str]] = {}

    def post(name: str) -> None:
        body = {**BODY, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            results[name] = [line for line in r.iter_lines() if line]

    with serving(app) as base:
        threads: list[threading.Thread] = []
        try:
            for name in "abc":
                t = threading.Thread(target=post, args=(name,))
                t.start()
                threads.append(t)
                waiting = len(threads) - (len(threads) > 1)  # a runs once b is sent
                wait_for(lambda n=waiting: engine.stats()["num_waiting"] >= n)
                if name == "a":
                    permits.release()  # a starts
                    wait_for(lambda: core.num_steps == 1)
        finally:
            gated[0] = False
            permits.release()
            for t in threads:
                t.join(60)
    comments = {k: [x for x in v if x.startswith(":")] for k, v in results.items()}
    assert comments["a"] == [": queue_position=0 estimated_start_s=unknown"]  # no rate yet
    assert comments["b"][0].startswith(": queue_position=0 estimated_start_s=")
    assert comments["c"][0].startswith(": queue_position=1 ")
    for lines in results.values():
        assert lines[-1] == "data: [DONE]"
        assert sum(x.startswith("data: {") for x in lines) >= 3
    check_pool_whole(engine)


def test_bad_admission_is_refused(tiny_llama_dir: Any) -> None:
    engine = AsyncEngine.from_pretrained(str(tiny_llama_dir), max_num_seqs=1)
    with pytest.raises(ValueError, match="admission"):
        create_app(engine, MODEL, admission="later")
