"""Automatic prefix caching: block-pool properties and engine outputs with caching on/off."""

from __future__ import annotations

import asyncio

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm import SamplingParams
from asyncllm.core.block_manager import BlockManager, hash_block
from asyncllm.models.loader import stored_dtype
from asyncllm.worker.device import resolve_dtype
from tests.conftest import core_request_ids

BS = 4


class _Tokens:
    def __init__(self, ids):
        self.ids = ids

    def token_ids(self, start, stop):
        return self.ids[start:stop]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["admit", "compute", "free"]),
            st.integers(0, 4),  # request slot
            st.lists(st.integers(0, 2), min_size=1, max_size=14),  # prompt (small alphabet)
            st.integers(1, 9),  # tokens to compute
            st.sampled_from([None, "tenant-a"]),
        ),
        max_size=50,
    )
)
def test_block_pool_properties(ops):
    """Random admit (with prefix hits) / compute / free / evict sequences.

    Checked after every operation: reference counts equal the tables' holdings, no block is
    free and held, a block that is written is neither shared nor cached, and a cached block's
    contents are what its hash says (unchanged while cached).
    """
    bm = BlockManager(num_blocks=10, block_size=BS)
    content: dict[int, list[int]] = {}  # what each physical block holds
    live: dict[str, tuple[_Tokens, str | None, int]] = {}  # id -> (tokens, salt, computed)
    for op, slot, prompt, n, salt in ops:
        rid = f"r{slot}"
        if op == "admit" and rid not in live:
            toks = _Tokens(prompt)
            hits = bm.find_cached_prefix(rid, toks, len(prompt), salt)
            for i, b in enumerate(hits.tables[0]):  # a hit holds the tokens it is hashed for
                assert content[b] == prompt[i * BS : (i + 1) * BS]
            assert len(hits) * BS <= len(prompt) - 1
            if bm.allocate(rid, len(hits) * BS + 1, hits):
                live[rid] = (toks, salt, len(hits) * BS)
            else:
                bm.free(rid)  # drops the hash list the lookup made
        elif op == "compute" and rid in live:
            toks, salt, done = live[rid]
            end = min(done + n, len(toks.ids))
            if end > done and bm.allocate(rid, end):
                table = bm.block_table(rid)
                for p in range(done, end):
                    b = table[p // BS]
                    assert bm.pool.ref_count(b) == 1 and bm.pool.block_hash(b) is None
                    # A write lands right after what this request wrote before; a block
                    # taken from the free queue restarts at offset 0.
                    kept = content.get(b, [])[: p % BS]
                    assert len(kept) == p % BS
                    content[b] = [*kept, toks.ids[p]]
                bm.cache_full_blocks(rid, toks, salt, end)
                live[rid] = (toks, salt, end)
        elif op == "free" and rid in live:
            bm.free(rid)
            del live[rid]
        bm.check_invariants()
        for b in range(bm.num_total_blocks):  # cached contents match their hashes
            h = bm.pool.block_hash(b)
            if h is not None:
                assert len(content[b]) == BS
    for rid in list(live):
        bm.free(rid)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_total_blocks


def test_hash_chain_and_salt():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert a != hash_block(None, [1, 2, 3, 5])
    assert a != hash_block(None, [1, 2, 3, 4], "salt")
    assert hash_block(a, [5]) != hash_block(hash_block(None, [9, 2, 3, 4]), [5])
    assert len(a) == 32


def _prompts(n_shared: int, tails: list[list[int]]) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 49152, (n_shared,), generator=g).tolist()
    return [shared + t for t in tails]


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


async def _run_sequentially(engine, prompts, salts=None):
    outs = []
    async with engine:
        for i, p in enumerate(prompts):
            salt = salts[i] if salts else None
            outs.append((await engine.generate(p, GREEDY, cache_salt=salt)).token_ids)
        stats = engine.stats()
    return outs, stats


async def test_outputs_equal_with_caching_on_and_off(tiny_llama_dir, make_engine):
    cases = {
        # differ only in their last token
        "last_token": _prompts(21, [[7], [8], [9]]),
        # a whole number of blocks (16 and 32 tokens): the last block is always computed
        "block_multiple": _prompts(16, [[], [], list(range(100, 116))]),
    }
    for name, prompts in cases.items():
        kw = dict(block_size=BS, max_num_batched_tokens=16, kv_cache_bytes=2**20)
        on, s_on = await _run_sequentially(make_engine(tiny_llama_dir, **kw), prompts)
        off, s_off = await _run_sequentially(
            make_engine(tiny_llama_dir, enable_prefix_caching=False, **kw), prompts
        )
        assert on == off, name
        assert s_off["prefix_cache_hits"] == 0
        assert s_on["prefix_cache_hits"] >= (len(prompts) - 1) * 4, name  # >= 4 blocks hit


async def test_concurrent_requests_share_blocks(tiny_llama_dir, make_engine):
    prompts = _prompts(40, [[i] for i in range(6)])
    # float32: the tokens are compared across batch shapes (concurrent against one at a
    # time), where bfloat16's rounding may flip a near-tie of the random tiny model.
    kw = dict(block_size=BS, max_num_batched_tokens=64, kv_cache_bytes=2**20, dtype="float32")
    engine = make_engine(tiny_llama_dir, **kw)
    async with engine:
        first = await engine.generate(prompts[0], GREEDY)
        rest = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts[1:]))
        stats = engine.stats()
    off, _ = await _run_sequentially(
        make_engine(tiny_llama_dir, enable_prefix_caching=False, **kw), prompts
    )
    assert [first.token_ids] + [r.token_ids for r in rest] == off
    assert stats["prefix_cache_hits"] == 5 * 40  # 10 full blocks each for the other five
    assert first.num_cached_tokens == 0 and all(r.num_cached_tokens == 40 for r in rest)


async def test_evicted_blocks_are_recomputed_correctly(tiny_llama_dir, make_engine):
    """A's cached blocks are evicted by B and C (pool of 24 blocks), then A runs again."""
    a, b, c = _prompts(0, [list(range(10, 50)), list(range(60, 110)), list(range(200, 250))])
    prompts = [a, b, c, a]
    kw = dict(block_size=BS, max_num_batched_tokens=16, max_model_len=96)
    # the default dtype's bytes for this model on this CPU
    elem = resolve_dtype("auto", torch.device("cpu"), stored_dtype(tiny_llama_dir)).itemsize
    kv = 24 * BS * 2 * 2 * 2 * 16 * elem  # 24 blocks of 4 tokens for the tiny model
    engine = make_engine(tiny_llama_dir, kv_cache_bytes=kv, **kw)
    on, _ = await _run_sequentially(engine, prompts)
    assert engine.core.block_manager.pool.num_evictions > 0
    off, _ = await _run_sequentially(
        make_engine(tiny_llama_dir, enable_prefix_caching=False, kv_cache_bytes=kv, **kw), prompts
    )
    assert on == off
    assert on[3] == on[0]


async def test_different_cache_salts_share_no_block(tiny_llama_dir, make_engine):
    prompt = _prompts(40, [[1]])[0]
    engine = make_engine(tiny_llama_dir, block_size=BS, kv_cache_bytes=2**20)
    core = engine.core
    tables = {}
    async with engine:
        for salt in ("tenant-a", "tenant-b", "tenant-a"):
            gen = engine.stream(prompt, GREEDY, cache_salt=salt)
            await gen.__anext__()  # prefilled: its table is complete for the prompt
            tables.setdefault(salt, []).append(list(core.block_manager.block_table(_last_id(core))))
            async for _ in gen:
                pass
        stats = engine.stats()
    a1, a2 = tables["tenant-a"]
    (b1,) = tables["tenant-b"]
    assert not set(b1) & set(a1)
    assert a2[:10] == a1[:10]  # same salt: the ten full prompt blocks are shared
    assert stats["prefix_cache_hits"] == 40


def _last_id(core):
    return max(core.scheduler.requests, key=lambda r: core.scheduler.requests[r].arrival_time)


async def test_parallel_samples_equal_separate_seeded_runs(tiny_llama_dir, make_engine):
    """n=4 with a seed: each sample equals a separate n=1 run with seed + index, while the
    samples share the prompt's blocks (the forked partial block is copied on write)."""
    prompt = _prompts(13, [[]])[0]  # 13 tokens: 3 full blocks and a partial one
    params = SamplingParams(n=4, max_tokens=10, temperature=1.0, top_k=50, seed=1234)
    engine = make_engine(tiny_llama_dir, block_size=BS, kv_cache_bytes=2**20)
    async with engine:
        together = await engine.generate(prompt, params)
        stats = engine.stats()
        alone = [
            await engine.generate(prompt, SamplingParams(max_tokens=10, top_k=50, seed=1234 + i))
            for i in range(4)
        ]
        streamed = {}
        bm = engine.core.block_manager
        tables = None
        async for out in engine.stream(prompt, params, request_id="par"):
            assert out.request_id == "par"
            streamed.setdefault(out.index, []).extend(out.token_ids)
            if tables is None:  # all four have sampled their first token by now
                tables = [list(bm.block_table(i)) for i in core_request_ids(engine, "par")]
    assert [s.index for s in together.samples] == [0, 1, 2, 3]
    assert [s.token_ids for s in together.samples] == [a.token_ids for a in alone]
    assert together.token_ids == together.samples[0].token_ids
    assert [streamed[i] for i in range(4)] == [a.token_ids for a in alone]
    assert len({tuple(a.token_ids) for a in alone}) > 1  # the seeds differ
    assert stats["num_generated_tokens"] == 40
    # The three full prompt blocks are shared; each sample has its own fourth block.
    assert all(t[:3] == tables[0][:3] for t in tables)
    assert len({t[3] for t in tables}) == 4


async def test_parallel_samples_abort_and_cancel(tiny_llama_dir, make_engine):
    prompt = _prompts(30, [[]])[0]
    params = SamplingParams(n=3, max_tokens=50, ignore_eos=True)
    engine = make_engine(tiny_llama_dir, block_size=BS, kv_cache_bytes=2**20)
    async with engine:
        seen = set()
        async for out in engine.stream(prompt, params, request_id="a"):
            seen.add(out.index)
            if len(seen) == 3:
                break  # leaving the loop aborts all three samples
        task = asyncio.create_task(engine.generate(prompt, params, request_id="b"))
        await asyncio.sleep(0.05)
        engine.abort("b")
        out = await task
        assert {s.finish_reason for s in (out.samples or [out])} == {"abort"}
        greedy = await engine.generate(prompt, SamplingParams(n=2, max_tokens=5, temperature=0))
        assert greedy.samples[0].token_ids == greedy.samples[1].token_ids


async def test_reset_prefix_cache_forgets_unused_blocks(tiny_llama_dir, make_engine):
    prompt = _prompts(40, [[1]])[0]
    engine = make_engine(tiny_llama_dir, block_size=BS, kv_cache_bytes=2**20)
    async with engine:
        await engine.generate(prompt, GREEDY)
        assert await engine.reset_prefix_cache() >= 10
        again = await engine.generate(prompt, GREEDY)
    assert again.num_cached_tokens == 0
