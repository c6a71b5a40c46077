"""Model-free speculative decoding (n-gram proposals): proposer, verification, engine.

Greedy outputs with speculation must be token-identical to those without it (float32 tiny
models); seeded sampled ones too (verification samples each row with the request's own
noise); the verification's output distribution is checked against plain sampling with a
chi-square statistic.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from asyncllm import SamplingParams
from asyncllm.config import EngineConfig
from asyncllm.core.block_manager import BlockManager
from asyncllm.core.ngram import NgramIndex
from asyncllm.core.request import Request
from asyncllm.core.scheduler import Scheduler
from asyncllm.core.speculation import RequestSpeculation, SpecConfig, Speculation
from asyncllm.worker.sampling.sampler import Sampler
from asyncllm.worker.sampling.speculative import accept_prefix, verify_chunks
from tests.worker.test_preemption import TINY_BLOCK_BYTES

# ---------------------------------------------------------------------------- proposer


def test_ngram_index_proposes_after_most_recent_longest_match():
    idx = NgramIndex(1, 3)
    idx.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    # Suffix (1, 2, 3) occurred at 0..3, followed by 4, 9, 2 ...
    assert idx.propose(3) == [4, 9, 2]
    idx.extend([7, 2, 3])
    # (7, 2, 3) and (3,)... longest match is (2, 3): most recent earlier end is 12 -> 7.
    assert idx.propose(2) == [7, 2]
    assert idx.propose(0) == []
    idx.extend([42])  # never seen: no proposal (the suffix never matches itself)
    assert idx.propose(4) == []


def test_ngram_index_incremental_equals_batch_and_clips_at_end():
    tokens = [5, 6, 5, 6, 5, 6, 7, 5, 6]
    one = NgramIndex(2, 2)
    one.extend(tokens)
    step = NgramIndex(2, 2)
    for t in tokens:
        step.extend([t])
    assert one.propose(5) == step.propose(5) == [7, 5, 6]  # after the most recent (5, 6)
    run = NgramIndex(1, 2)
    run.extend([8, 8, 8])  # (8, 8) ended at 2: only one token follows it so far
    assert run.propose(4) == [8]


def test_request_speculation_adapts_length_and_catches_up():
    spec = RequestSpeculation(SpecConfig(num_tokens=6, min_n=1, max_n=2, disable_by_batch_size=4))
    req = Request("r", [1, 2, 3, 1, 2], max_tokens=10, max_model_len=100)
    assert spec.propose(req, 10) == [3, 1, 2]
    req.append_token(3)
    assert spec.propose(req, 1) == [1]  # the index saw the new token; limit respected
    spec.record(proposed=6, accepted=1)
    assert spec.k == 2
    spec.record(proposed=2, accepted=2)
    assert spec.k == 4
    spec.record(proposed=4, accepted=4)
    assert spec.k == 6  # capped at speculative_tokens
    spec.record(proposed=6, accepted=0)
    assert spec.k == 1 and spec.pause == 0
    spec.record(proposed=1, accepted=0)  # a second miss in a row: two steps without
    assert [spec.propose(req, 4) for _ in range(3)] == [[], [], [1]]  # k is 1 now
    spec.record(proposed=1, accepted=0)
    assert spec.pause == 4
    spec.pause = 0
    spec.record(proposed=1, accepted=1)
    assert spec.misses == 0 and spec.k == 2


def test_accept_prefix():
    assert accept_prefix([4, 5, 6], [4, 5]) == 3  # both accepted, 6 the bonus token
    assert accept_prefix([4, 9, 6], [4, 5]) == 2  # 5 rejected: 9 is the model's token
    assert accept_prefix([7, 5, 6], [4, 5]) == 1


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("speculative_tokens", -1, "speculative_tokens must be an integer >= 0"),
        ("speculative_tokens", 1.5, "speculative_tokens"),
        ("prompt_lookup_min", 0, "prompt_lookup_min must be an integer >= 1"),
        ("prompt_lookup_max", 0, "prompt_lookup_max must be an integer >= 1"),
        ("speculative_disable_by_batch_size", 0, "speculative_disable_by_batch_size"),
        ("speculative_tokens", 512, "must be below max_num_batched_tokens"),
    ],
)
def test_config_validation(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{field: value})


def test_config_lookup_sizes_ordered():
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(5\) must be <= prompt_lookup_max"):
        EngineConfig(prompt_lookup_min=5, prompt_lookup_max=3)
    assert EngineConfig(speculative_tokens=4).speculative_tokens == 4


# ---------------------------------------------------------------------- verification


@dataclass(frozen=True)
class _Chunk:
    request_id: str
    params: Any
    spec_token_ids: tuple[int, ...]
    num_output_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    prompt_token_ids: tuple[int, ...] = (1, 2)
    output_token_ids: tuple[int, ...] = ()


#: chi-square critical value, 5 degrees of freedom, p = 0.001 (a fixed table value).
CHI2_5_DOF_999 = 20.515


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing drawn outside the support
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _target(logits: torch.Tensor, params: SamplingParams, output: list[int]) -> torch.Tensor:
    """Plain sampling's distribution, computed independently of the sampler."""
    x = logits.clone().double()
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=x.numel()).double()
    x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    x = x / params.temperature
    if params.top_k > 0:
        cut = x.topk(params.top_k).values[-1]
        x = x.masked_fill(x < cut, float("-inf"))
    return x.softmax(-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, presence_penalty=0.8, frequency_penalty=0.4),
    ],
    ids=["t1", "t0.7-topk4", "penalties"],
)
def test_rejection_sampling_matches_plain_sampling(params):
    """Six tokens, two proposals, 6,000 trials: the first yielded token follows row 0's
    target distribution, and the second, given the first proposal accepted, row 1's (which
    sees the proposal as generated: penalties apply)."""
    vocab, trials = 6, 6000
    logits_rows = torch.tensor(
        [[1.0, 0.5, 0.2, -0.3, 0.8, 0.0], [0.1, 1.2, -0.5, 0.4, 0.9, 0.3], [0.0] * vocab]
    )
    proposals = (4, 1)
    chunks = [_Chunk(f"r{i}", params, proposals) for i in range(trials)]
    # Row order of verify_chunks: every chunk's row 0, then each chunk's rows 1..k.
    logits = torch.cat([logits_rows[:1].expand(trials, -1), logits_rows[1:].repeat(trials, 1)])
    sampler = Sampler(seed=1, device=torch.device("cpu"))
    out = verify_chunks(sampler, logits, chunks, torch.device("cpu"))
    assert out.spec_tokens is not None
    yielded = [out.spec_tokens[c.request_id] for c in chunks]
    first = torch.bincount(torch.tensor([y[0] for y in yielded]), minlength=vocab).double()
    p0 = _target(logits_rows[0], params, [])
    assert _chi2(first, p0) < CHI2_5_DOF_999
    after = [y[1] for y in yielded if y[0] == proposals[0]]
    assert len(after) > 500
    second = torch.bincount(torch.tensor(after), minlength=vocab).double()
    p1 = _target(logits_rows[1], params, [proposals[0]])
    assert _chi2(second, p1) < CHI2_5_DOF_999
    # A run ends at the first token that differs from its proposal (or after the bonus).
    for y in yielded:
        agree = 0 if y[0] != proposals[0] else 1 if y[1] != proposals[1] else 2
        assert len(y) == agree + 1


def test_greedy_verification_takes_argmax():
    params = SamplingParams(temperature=0.0)
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    out = verify_chunks(sampler, logits, [_Chunk("g", params, (1, 0))], torch.device("cpu"))
    assert out.spec_tokens == {"g": [1, 0, 2]} and out.sampled == {"g": 1}
    out = verify_chunks(sampler, logits, [_Chunk("g", params, (1, 2))], torch.device("cpu"))
    assert out.spec_tokens == {"g": [1, 0]}


# ------------------------------------------------------------------------- engine

SPEC = dict(speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def _repetitive_prompts(seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(3, 49152, (6,), generator=g).tolist()
    b = torch.randint(3, 49152, (5,), generator=g).tolist()
    c = torch.randint(3, 49152, (23,), generator=g).tolist()
    return [a * 4, b * 3 + a, c, a + b + a + b, c[:7] * 2]


async def _generate(engine, prompts, params):
    async with engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        stats = engine.stats()
    return outs, stats


def _ids(outs):
    return [o.token_ids for o in outs]


KW = dict(block_size=4, max_num_batched_tokens=24, kv_cache_bytes=2**20, dtype="float32")
GREEDY40 = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"])
async def test_greedy_identical_with_and_without_speculation(model, request, make_engine):
    """Mixed prefill (a 24-token budget chunks the prompts) and decode, several requests;
    Qwen2's second layer has a sliding window of 8 (a hybrid KV layout)."""
    path = request.getfixturevalue(model)
    prompts = _repetitive_prompts()
    plain, off = await _generate(make_engine(path, **KW), prompts, GREEDY40)
    spec, on = await _generate(make_engine(path, **KW, **SPEC), prompts, GREEDY40)
    assert _ids(spec) == _ids(plain)
    assert on["spec_num_accepted_tokens"] > 0 and off["spec_num_draft_tokens"] == 0
    assert 0 < on["spec_acceptance_rate"] <= 1 and on["spec_mean_tokens_per_step"] > 1
    assert on["num_generated_tokens"] == off["num_generated_tokens"]


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
async def test_prefix_cache_hits_with_speculation(tiny_llama_dir, make_engine):
    prompts = _repetitive_prompts()
    engine = make_engine(tiny_llama_dir, **KW, **SPEC)
    async with engine:
        first = [await engine.generate(p, GREEDY40) for p in prompts]
        again = await asyncio.gather(*(engine.generate(p, GREEDY40) for p in prompts))
        # The first calls' outputs as prompts: their blocks were computed speculatively.
        longer = [p + o.token_ids for p, o in zip(prompts, first, strict=True)]
        cont = await asyncio.gather(*(engine.generate(p, GREEDY40) for p in longer))
        stats = engine.stats()
    plain, _ = await _generate(make_engine(tiny_llama_dir, **KW), prompts + longer, GREEDY40)
    assert _ids(first) == _ids(again) == _ids(plain[: len(prompts)])
    assert _ids(cont) == _ids(plain[len(prompts) :])
    assert stats["prefix_cache_hits"] > 0 and stats["spec_num_accepted_tokens"] > 0


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
@pytest.mark.parametrize("mode", ["offload", "recompute"])
async def test_preemption_with_speculation(mode, tiny_llama_dir, make_engine):
    prompts = _repetitive_prompts() + _repetitive_prompts(seed=5) + _repetitive_prompts(seed=7)
    kw = dict(block_size=4, max_num_batched_tokens=32, max_model_len=80, dtype="float32")
    big, _ = await _generate(make_engine(tiny_llama_dir, kv_cache_bytes=2**20, **kw), prompts,
                             GREEDY40)  # fmt: skip
    small = make_engine(
        tiny_llama_dir, kv_cache_bytes=24 * TINY_BLOCK_BYTES, preemption_mode=mode, **kw, **SPEC
    )
    got, stats = await _generate(small, prompts, GREEDY40)
    assert _ids(got) == _ids(big)
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0
    if mode == "offload":
        assert stats["num_swapped_out_blocks"] > 0
    else:
        assert stats["num_recomputed_tokens"] > 0


async def test_stops_and_max_tokens_mid_accepted_run(tiny_llama_dir, make_engine):
    """Stop token ids, stop strings and max_tokens landing inside a run of tokens that one
    verification yields: the output ends at the same token as without speculation."""
    prompt = _repetitive_prompts()[0]
    ref_engine = make_engine(tiny_llama_dir, **KW)
    spec_engine = make_engine(tiny_llama_dir, **KW, **SPEC)
    async with ref_engine:
        full = (await ref_engine.generate(prompt, GREEDY40)).token_ids
        text = (await ref_engine.generate(prompt, GREEDY40)).text
    # Tokens late in the output (inside accepted runs once the loop is found).
    cases = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in range(9, 40, 3)
    ]
    for j in (12, 21, 30):
        cases.append(SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[full[j]]))
        cases.append(
            SamplingParams(
                max_tokens=40, temperature=0.0, stop_token_ids=[full[j]], min_tokens=j + 3
            )
        )
    for cut in (len(text) // 2, 3 * len(text) // 4):
        cases.append(SamplingParams(max_tokens=40, temperature=0.0, stop=[text[cut : cut + 4]]))
        cases.append(
            SamplingParams(max_tokens=40, temperature=0.0, stop=[text[cut : cut + 4]],
                           include_stop_str_in_output=True)
        )  # fmt: skip
    results = {}
    for name, engine in (("ref", ref_engine), ("spec", spec_engine)):
        async with engine:
            outs = await asyncio.gather(*(engine.generate(prompt, p) for p in cases))
            results[name] = [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs]
            stats = engine.stats()
    assert results["spec"] == results["ref"]
    assert stats["spec_num_accepted_tokens"] > 0


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
async def test_logprobs_and_parallel_seeded_sampling(tiny_llama_dir, make_engine):
    """Greedy logprobs per accepted token equal those without speculation; seeded sampling
    (penalties, top-k, n = 3) gives the same tokens, since every row draws the request's
    own noise for its token index."""
    prompts = _repetitive_prompts()
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(
        max_tokens=30, temperature=0.8, top_k=20, seed=7, n=3, ignore_eos=True,
        presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1,
    )  # fmt: skip
    results = []
    for cfg in ({}, SPEC):
        engine = make_engine(tiny_llama_dir, **KW, **cfg)
        async with engine:
            g = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))
            s = await asyncio.gather(*(engine.generate(p, sampled) for p in prompts))
            results.append((g, s, engine.stats()))
    (g0, s0, _), (g1, s1, stats) = results
    assert _ids(g1) == _ids(g0)
    for a, b in zip(g0, g1, strict=True):
        assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
        for pa, pb in zip(a.logprobs, b.logprobs, strict=True):
            assert list(pa) == list(pb)  # the same chosen and top tokens, in order
            for tid in pa:
                assert pa[tid].logprob == pytest.approx(pb[tid].logprob, abs=1e-4)
                assert pa[tid].rank == pb[tid].rank
    assert [[x.token_ids for x in o.samples] for o in s1] == [
        [x.token_ids for x in o.samples] for o in s0
    ]
    assert stats["spec_num_accepted_tokens"] > 0


async def test_cancel_speculating_stream_frees_blocks(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, **KW, **SPEC)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    async with engine:
        stream = engine.stream(_repetitive_prompts()[0], params)
        got = 0
        async for out in stream:
            got += len(out.token_ids)
            if got >= 30:
                break
        await stream.aclose()
        other = await engine.generate(_repetitive_prompts()[1], GREEDY40)
        stats = engine.stats()
    assert len(other.token_ids) == 40 and stats["spec_num_steps"] > 0
    # make_engine's teardown checks that every block is free and the counts consistent.


def test_grammar_requests_do_not_speculate(tiny_llama_dir, make_engine):
    core = make_engine(tiny_llama_dir, **KW, **SPEC).core  # never started: no steps
    params = SamplingParams(
        max_tokens=12, temperature=0.0, structured_outputs={"regex": "(ab|cd){1,4}"}
    )
    req = core.inputs.make_request("g", _repetitive_prompts()[0], params)
    core.add_request(req, core.compile_grammar(params))
    plain = core.inputs.make_request("p", _repetitive_prompts()[0], GREEDY40)
    core.add_request(plain)
    assert req.spec is None and plain.spec is not None
    core.abort_request("g")
    core.abort_request("p")


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
async def test_grammar_request_beside_speculating_ones(tiny_llama_dir, make_engine):
    """A constrained request shares steps with speculating ones: its bitmask (rows for
    ``max_num_seqs`` = 4 sampled rows) is padded for the verification rows."""
    constrained = SamplingParams(
        max_tokens=60, temperature=0.0, structured_outputs={"regex": "(ab|cd){20}"}
    )
    prompts = _repetitive_prompts()[:3]
    results = []
    for cfg in ({}, SPEC):
        engine = make_engine(tiny_llama_dir, **KW, max_num_seqs=4, **cfg)
        async with engine:
            outs = await asyncio.gather(
                engine.generate(prompts[0], constrained),
                *(engine.generate(p, GREEDY40) for p in prompts),
            )
            results.append(([(o.token_ids, o.text) for o in outs], engine.stats()))
    (plain, _), (spec, stats) = results
    assert spec == plain
    assert re.fullmatch("(ab|cd){20}", spec[0][1])
    assert stats["spec_num_accepted_tokens"] > 0


def test_rejected_proposals_give_their_blocks_back():
    """A verification that rejects the proposals keeps only the blocks the accepted tokens
    and the next position need; the pool stays whole (a rejected run's blocks were held
    until the request ended)."""
    bm = BlockManager(64, 2, enable_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    config = SpecConfig(num_tokens=8, min_n=1, max_n=2, disable_by_batch_size=8)
    sched.spec = Speculation(config)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 3  # repeats: prompt lookup proposes its next tokens
    request = Request("r", prompt, max_tokens=40, max_model_len=200)
    request.spec = RequestSpeculation(config)
    sched.add_request(request)
    plan = sched.schedule()
    sched.update_from_output(plan, {"r": 1})  # prefill; the sampled 1 continues the pattern
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert len(chunk.spec_token_ids) >= 2
    held = bm.num_held_blocks("r")
    assert held == -(-(request.num_tokens + len(chunk.spec_token_ids)) // 2)
    sched.update_from_output(plan, {"r": 9}, spec_tokens={"r": [9]})  # all rejected
    assert request.num_computed_tokens == len(prompt) + 1
    assert bm.num_held_blocks("r") == -(-request.num_tokens // 2) < held
    bm.check_invariants()
    sched.abort_request("r")
    assert bm.num_free_blocks == bm.num_total_blocks
