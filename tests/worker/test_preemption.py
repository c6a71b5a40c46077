"""Priorities, preemption (offload and recompute) and starvation protection."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncllm import SamplingParams
from asyncllm.core.block_manager import BlockManager, BlockPool
from asyncllm.core.request import Request
from asyncllm.core.scheduler import Scheduler
from asyncllm.worker.device import resolve_dtype
from tests.conftest import core_request, wait_until

BS = 4
#: Bytes of one element of the KV cache in the default dtype ("auto" on this machine).
ELEM = resolve_dtype("auto", torch.device("cpu")).itemsize
TINY_BLOCK_BYTES = BS * 2 * 2 * 2 * 16 * ELEM  # 2 layers, 2 KV heads, head_dim 16
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _prompts(lens, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lens]


def _req(rid, n_prompt, *, priority=0, arrival=0.0, max_tokens=5):
    return Request(
        rid, list(range(1, n_prompt + 1)), max_tokens=max_tokens, max_model_len=1000,
        priority=priority, arrival_time=arrival,
    )  # fmt: skip


def test_waiting_order_and_victim_choice():
    bm = BlockManager(8, BS, enable_caching=False)
    sched = Scheduler(
        bm, max_num_seqs=8, max_num_batched_tokens=64, cpu_pool=BlockPool(8), clock=lambda: 5.0
    )
    for r in (_req("late", 4, arrival=2), _req("urgent", 4, priority=-1, arrival=3),
              _req("early", 4, arrival=1)):  # fmt: skip
        sched.add_request(r)
    plan = sched.schedule()
    assert [c.request_id for c in plan.chunks] == ["urgent", "early", "late"]
    sched.update_from_output(plan, {"urgent": 1, "early": 2, "late": 3})
    # A more urgent arrival that does not fit preempts the worst running request: the latest
    # arrival among the lowest priority ("late"), swapped out to the CPU pool.
    sched.add_request(_req("vip", 16, priority=-5, arrival=4))
    plan = sched.schedule()
    assert [r.request_id for r in sched.waiting] == ["late"]
    assert plan.swap_out and sched.requests["late"].cpu_blocks is not None
    assert "vip" in [c.request_id for c in plan.chunks]
    sched.update_from_output(plan, {c.request_id: 7 for c in plan.chunks if c.sample})
    # Aborting it while swapped out frees its CPU blocks.
    sched.abort_request("late")
    assert sched.cpu_pool.num_free == 8
    for rid in list(sched.requests):
        sched.abort_request(rid)
    bm.check_invariants()
    assert bm.num_free_blocks == 8


def test_protected_request_is_admitted_first_and_not_preempted():
    now = [0.0]
    bm = BlockManager(100, BS)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64, clock=lambda: now[0])
    sched.protect_after_wait_s = 10.0
    sched.add_request(_req("low", 4, priority=5, arrival=0.0))
    sched.add_request(_req("high", 4, priority=0, arrival=1.0))
    assert [c.request_id for c in sched.schedule().chunks] == ["high"]
    sched.abort_request("high")
    sched.add_request(_req("high2", 4, priority=0, arrival=2.0))
    now[0] = 11.0  # "low" has waited past the bound
    assert [c.request_id for c in sched.schedule().chunks] == ["low"]
    sched.add_request(_req("high3", 4, priority=-9, arrival=12.0))
    assert sched.schedule().chunks[0].request_id == "low"  # not preempted for priority


@pytest.mark.parametrize("mode", ["offload", "recompute"])
async def test_tiny_pool_outputs_equal_large_pool(mode, tiny_llama_dir, make_engine):
    """16 requests, a pool for about 3 of them: preempted requests still give W1's outputs."""
    prompts = _prompts([3, 7, 12, 20, 1, 9, 30, 16] * 2)
    kw = dict(block_size=BS, max_num_batched_tokens=32, max_model_len=48)
    big = make_engine(tiny_llama_dir, kv_cache_bytes=2**20, **kw)
    async with big:
        expected = await asyncio.gather(*(big.generate(p, GREEDY) for p in prompts))
    small = make_engine(
        tiny_llama_dir, kv_cache_bytes=16 * TINY_BLOCK_BYTES, preemption_mode=mode, **kw
    )
    async with small:
        got = await asyncio.gather(*(small.generate(p, GREEDY) for p in prompts))
        stats = small.stats()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert stats["num_preemptions"] > 0
    if mode == "offload":
        assert stats["num_swapped_out_blocks"] > 0
        assert stats["num_swapped_in_blocks"] == stats["num_swapped_out_blocks"]
        assert stats["swap_bytes"] == 2 * stats["num_swapped_out_blocks"] * TINY_BLOCK_BYTES
    else:
        assert stats["num_swapped_out_blocks"] == 0 and stats["num_recomputed_tokens"] > 0


async def test_high_priority_first_token_before_low_priority_finish(tiny_llama_dir, make_engine):
    engine = make_engine(
        tiny_llama_dir, block_size=BS, max_num_batched_tokens=32, max_model_len=96,
        kv_cache_bytes=24 * TINY_BLOCK_BYTES,
    )  # fmt: skip
    low_params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    core = engine.core
    finished: list[str] = []

    async def low(i, p):
        await engine.generate(p, low_params, request_id=f"low{i}", priority=1)
        finished.append(f"low{i}")

    async with engine:
        lows = [asyncio.create_task(low(i, p)) for i, p in enumerate(_prompts([20, 20, 20]))]
        await wait_until(lambda: core.block_manager.num_free_blocks < 6)  # pool nearly full
        stream = engine.stream(_prompts([20], seed=3)[0], GREEDY, priority=-1)
        first = await stream.__anext__()
        assert first.token_ids and not finished  # no low-priority request has finished yet
        await stream.aclose()
        await asyncio.gather(*lows)
        assert engine.stats()["num_preemptions"] > 0


async def test_cancel_while_swapped_out_frees_cpu_blocks(tiny_llama_dir, make_engine):
    engine = make_engine(
        tiny_llama_dir, block_size=BS, max_num_batched_tokens=32, max_model_len=64,
        kv_cache_bytes=16 * TINY_BLOCK_BYTES,
    )  # fmt: skip
    core = engine.core
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    async with engine:
        victim = asyncio.create_task(
            engine.generate(_prompts([20])[0], long, request_id="victim", priority=1)
        )
        await wait_until(
            lambda: (r := core_request(engine, "victim")) is not None and r.num_computed_tokens > 20
        )
        highs = [
            asyncio.create_task(engine.generate(p, long, priority=0))
            for p in _prompts([20, 20], seed=4)
        ]
        await wait_until(lambda: core_request(engine, "victim").cpu_blocks is not None)
        pool = core.scheduler.cpu_pool
        assert pool.num_free < pool.num_blocks
        victim.cancel()
        await wait_until(lambda: core_request(engine, "victim") is None)
        assert (
            pool.num_free
            + sum(len(r.cpu_blocks or ()) for r in core.scheduler.requests.values())
            + len(core.block_manager.host_store or ())
            == pool.num_blocks
        )
        await asyncio.gather(*highs)


async def test_low_priority_finishes_under_sustained_high_priority_load(
    tiny_llama_dir, make_engine
):
    engine = make_engine(tiny_llama_dir, block_size=BS, max_num_seqs=1, kv_cache_bytes=2**20)
    engine.core.scheduler.protect_after_wait_s = 0.5
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = _prompts([8] * 4)
    async with engine:
        highs = [asyncio.create_task(engine.generate(prompts[0], short, priority=0))]
        low = asyncio.create_task(engine.generate(prompts[1], short, priority=10))
        # Keep high-priority requests waiting at all times; the bound (60 s) only stops a
        # starved loop: a loaded machine takes far longer than the 0.5 s protection.
        for _ in range(12000):
            if low.done():
                break
            highs = [h for h in highs if not h.done()]
            while len(highs) < 3:
                highs.append(asyncio.create_task(engine.generate(prompts[2], short, priority=0)))
            await asyncio.sleep(0.005)
        assert low.done() and (await low).finish_reason == "length"
        assert any(not h.done() for h in highs)  # the high-priority load was still on
        await asyncio.gather(*highs)


@pytest.mark.parametrize("mode", ["offload", "recompute"])
async def test_waiting_parallel_samples_release_blocks_for_the_head(
    mode, tiny_llama_dir, make_engine
):
    """Forked samples waiting for a slot hold the prompt's blocks; a preempted request at the
    head of the queue must still be readmitted (no deadlock, no spinning)."""
    engine = make_engine(
        tiny_llama_dir, block_size=16, kv_cache_bytes=17 * 16 * 128 * ELEM, max_num_seqs=2,
        preemption_mode=mode,
    )  # fmt: skip
    async with engine:
        x = engine.generate(list(range(1000, 1100)), SamplingParams(max_tokens=100,
                            ignore_eos=True, temperature=0))  # fmt: skip
        y = engine.generate(list(range(2000, 2150)), SamplingParams(n=2, max_tokens=20,
                            ignore_eos=True))  # fmt: skip
        outs = await asyncio.wait_for(asyncio.gather(x, y), timeout=60)
        assert engine.stats()["num_preemptions"] > 0
    assert len(outs[0].token_ids) == 100
    assert [len(s.token_ids) for s in outs[1].samples] == [20, 20]
