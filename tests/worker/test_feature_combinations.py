"""Features that meet in one KV block: an int8 KV cache (scales inside each row) through the
prefix cache's host and disk tiers, and speculative decoding beside them. Each run is
checked against the same engine with the feature off: greedy tokens equal, and the tier or
the proposals actually used (tiny random Llama, float32 activations)."""

from __future__ import annotations

import pytest

from asyncllm import SamplingParams
from tests.worker.test_kv_tiers import _prompt
from tests.worker.test_speculative import SPEC, _repetitive_prompts

BS = 4
#: One block of the tiny Llama's int8 cache: 2 layers x K and V x 2 KV heads x (16 codes + a
#: 2-byte scale) x 4 tokens.
INT8_BLOCK_BYTES = BS * 2 * 2 * 2 * (16 + 2)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
INT8 = dict(dtype="float32", kv_cache_dtype="int8", block_size=BS, max_num_batched_tokens=16,
            max_model_len=96, kv_cache_bytes=24 * INT8_BLOCK_BYTES, compile=False)  # fmt: skip


async def _one_by_one(engine, prompts, params=GREEDY):
    async with engine:
        outs = [(await engine.generate(p, params)).token_ids for p in prompts]
        return outs, engine.stats()


async def test_int8_blocks_come_back_from_host_memory(tiny_llama_dir, make_engine):
    """A's prompt blocks are evicted by B and C and swapped back in from the host tier with
    their scales: A's tokens equal its first run's and a recompute's."""
    a, b, c = _prompt(37, 1), _prompt(50, 2), _prompt(50, 3)
    prompts = [a, b, c, a]
    on, stats = await _one_by_one(make_engine(tiny_llama_dir, **INT8), prompts)
    off, _ = await _one_by_one(
        make_engine(tiny_llama_dir, **INT8, enable_prefix_caching=False), prompts
    )
    assert on == off and on[3] == on[0]
    assert stats["kv_cache_dtype"] == "int8" and stats["num_total_blocks"] == 24
    assert stats["prefix_cache_host_hits"] == stats["prefix_cache_hits"] == 36


async def test_int8_blocks_come_back_from_disk(tiny_llama_dir, make_engine, tmp_path):
    system = _prompt(33, 7)
    kw = dict(INT8, kv_cache_bytes=64 * INT8_BLOCK_BYTES, prefix_cache_dir=str(tmp_path))
    first, _ = await _one_by_one(make_engine(tiny_llama_dir, **kw), [[*system, 5]])
    second, stats = await _one_by_one(make_engine(tiny_llama_dir, **kw), [[*system, 6]])
    ref, _ = await _one_by_one(
        make_engine(tiny_llama_dir, **INT8, enable_prefix_caching=False),
        [[*system, 5], [*system, 6]],
    )
    assert first + second == ref
    assert stats["prefix_cache_disk_hits"] == 32 and stats["prefix_cache_dir_invalid"] == 0
    # the float32 cache's engine names other files: it never reads int8 blocks
    f32 = dict(kw, kv_cache_dtype="auto", kv_cache_bytes=64 * INT8_BLOCK_BYTES * 4)
    _, stats = await _one_by_one(make_engine(tiny_llama_dir, **f32), [[*system, 6]])
    assert stats["prefix_cache_hits"] == 0 and stats["prefix_cache_dir_invalid"] == 0


@pytest.mark.slow  # two engines, each over the prompts twice: ~35 s
async def test_speculation_over_an_int8_cache_with_host_hits(tiny_llama_dir, make_engine):
    """Repetitive prompts, twice each in a pool that evicts them: speculation on and off give
    the same greedy tokens over the int8 cache, with proposals accepted and host-tier hits."""
    prompts = _repetitive_prompts()
    prompts = prompts + prompts
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw = dict(INT8, kv_cache_bytes=40 * INT8_BLOCK_BYTES)
    on, s_on = await _one_by_one(make_engine(tiny_llama_dir, **kw, **SPEC), prompts, params)
    off, s_off = await _one_by_one(make_engine(tiny_llama_dir, **kw), prompts, params)
    assert on == off
    assert s_on["spec_num_accepted_tokens"] > 0 and s_off["spec_num_draft_tokens"] == 0
    assert s_on["prefix_cache_host_hits"] > 0
