"""Issue 34: one request, one answer, however the engine serves it (the real default model
in its default precision)."""

from __future__ import annotations

import asyncio

import pytest

from asyncllm import SamplingParams
from asyncllm.bench.fidelity.measures import load_questions

#: Loads the real default model five times and compiles its forward once (a child process).
pytestmark = pytest.mark.slow


async def test_a_request_gets_one_answer_however_it_is_served(default_model_dir, make_engine):
    """Issue 34: in the default precision (the GGUF file's Q4_1 and Q8_0 blocks, float32:
    the int4 and Q8_0 kernels' one-row and many-row paths), a greedy request gets the same
    tokens alone, in a batch of 48 with prefix-cache hits, after a preemption (swap and
    recompute), and on the compiled forward alone and batched."""
    questions = load_questions()[:6]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    settings: dict = {"max_model_len": 128, "compile": False}

    async def answers(copies: int, **config: object) -> tuple[list[list[int]], dict]:
        engine = make_engine("default", **{**settings, **config})
        compiled = engine.core.runner.compiled
        if compiled is not None:  # the compiled forward from the first step on
            assert await asyncio.to_thread(compiled.wait, 900) and compiled.ready
        tok = engine.tokenizer
        chats = [[{"role": "user", "content": q}] for q in questions]
        prompts = [
            tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
            for c in chats
        ]
        async with engine:
            if copies == 0:  # one at a time
                outs = [await engine.generate(p, params) for p in prompts]
            else:
                batch = [p for p in prompts for _ in range(copies)]
                outs = list(await asyncio.gather(*(engine.generate(p, params) for p in batch)))
            return [o.token_ids for o in outs], engine.stats()

    alone, _ = await answers(0, enable_prefix_caching=False)
    batched, stats = await answers(8, max_num_seqs=64)
    assert stats["prefix_cache_hits"] > 0
    assert batched == [a for a in alone for _ in range(8)]
    block = 30 * 2 * 3 * 64 * 4 * 16  # layers x K/V x KV heads x head dim x float32 x tokens
    for mode in ("offload", "recompute"):
        squeezed, stats = await answers(1, kv_cache_bytes=14 * block, preemption_mode=mode)
        assert stats["num_preemptions"] > 0 and squeezed == alone, mode
    settings["compile"] = True
    compiled_alone, _ = await answers(0)
    compiled_batched, _ = await answers(4, max_num_seqs=64)
    assert compiled_alone == alone
    assert compiled_batched == [a for a in alone for _ in range(4)]
