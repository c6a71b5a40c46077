"""The model runner alone, fed a hand-built plan: no scheduler, no engine.

The plan (:class:`~asyncllm.core.plan.SchedulerOutput` of
:class:`~asyncllm.core.plan.ScheduledChunk`) is written by hand: a prompt of 10 tokens
prefilled in two chunks (6 tokens, not sampled; then 4, sampled) into the non-contiguous
block table [7, 3, 12] (blocks of 4: positions 0-3 in block 7, 4-7 in block 3, 8-11 in
block 12, so the slot mapping is 28-31, 12-15, 48-51), then two decode steps. Each sampled
token and its logprob must equal transformers' own forward on the same weights (float32,
greedy), and the KV cache must hold values in exactly the table's blocks.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncllm import SamplingParams
from asyncllm.core.plan import ScheduledChunk, SchedulerOutput
from asyncllm.models.loader import load_model
from asyncllm.worker.kv_cache import KVCache, size_kv_cache
from asyncllm.worker.model_runner import ModelRunner

BLOCK = 4
TABLE = [7, 3, 12]
PROMPT = [101, 7, 2002, 45, 9, 318, 77, 1500, 64, 3]


def _chunk(tokens: list[int], start: int, *, sample: bool, output: list[int]) -> ScheduledChunk:
    return ScheduledChunk(
        request_id="r",
        token_ids=tokens,
        start_pos=start,
        block_tables=[TABLE],  # one layer group: every layer reads this table
        sample=sample,
        num_output_tokens=len(output),
        params=SamplingParams(temperature=0.0, max_tokens=8, logprobs=1),
        prompt_token_ids=PROMPT,
        output_token_ids=list(output),
    )


@pytest.fixture
def runner_and_reference(tiny_llama_dir):
    cpu = torch.device("cpu")
    loaded = load_model(tiny_llama_dir, dtype=torch.float32, device=cpu)
    spec, num_blocks = size_kv_cache(
        loaded.config,
        torch.float32,
        cpu,
        block_size=BLOCK,
        max_model_len=64,
        max_num_seqs=2,
        kv_cache_bytes=2**20,
    )
    assert num_blocks > max(TABLE)
    kv = KVCache(spec, num_blocks, cpu)
    runner = ModelRunner(loaded.model, kv, seed=0, attention_backend="torch")
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return runner, kv, ref


def _reference_next(ref: torch.nn.Module, ids: list[int]) -> tuple[int, float]:
    with torch.inference_mode():
        logprobs = ref(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    token = int(logprobs.argmax())
    return token, float(logprobs[token])


def test_hand_built_prefill_and_decode_match_transformers(runner_and_reference):
    runner, kv, ref = runner_and_reference
    before = [c.clone() for c in kv.key_caches + kv.value_caches]  # after the runner's warm-up
    first = runner.execute(SchedulerOutput(chunks=[_chunk(PROMPT[:6], 0, sample=False, output=[])]))
    assert first.sampled == {}  # no chunk sampled: nothing returned
    out = runner.execute(SchedulerOutput(chunks=[_chunk(PROMPT[6:], 6, sample=True, output=[])]))
    generated = [out.sampled["r"]]
    logprobs = [out.logprobs["r"][0]]
    for step in range(2):  # decodes: one token each, at positions 10 and 11
        chunk = _chunk(generated[-1:], len(PROMPT) + step, sample=True, output=generated)
        out = runner.execute(SchedulerOutput(chunks=[chunk]))
        generated.append(out.sampled["r"])
        logprobs.append(out.logprobs["r"][0])

    expected = []
    for _ in range(3):
        expected.append(_reference_next(ref, PROMPT + [t for t, _ in expected]))
    assert generated == [t for t, _ in expected]
    assert logprobs == pytest.approx([lp for _, lp in expected], abs=1e-4)

    # 12 positions written (10 prompt, 2 decoded), exactly in the table's blocks, in every
    # layer's K and V; every other block untouched by the plan.
    for old, cache in zip(before, kv.key_caches + kv.value_caches, strict=True):
        written = {b for b in range(cache.shape[0]) if not torch.equal(old[b], cache[b])}
        assert written == set(TABLE)
