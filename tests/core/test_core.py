"""The pure-Python core alone: block pool, block manager and scheduler, with fake tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm.core.block_manager import BlockManager, BlockPool, BlockPoolError
from asyncllm.core.request import Request
from asyncllm.core.scheduler import Scheduler


def test_block_pool_allocate_free_and_double_free():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    with pytest.raises(BlockPoolError):
        pool.allocate(2)
    pool.free(a[:1])
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free(a[:1])
    with pytest.raises(BlockPoolError, match="out of range"):
        pool.free([7])
    pool.free(a[1:])
    pool.check_invariants()
    assert pool.num_free == 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40)), max_size=60))
def test_block_manager_random_grow_and_free(ops):
    """Random growth and release of 6 requests: no leak, no double allocation."""
    bm = BlockManager(num_blocks=16, block_size=4)
    sizes = {}
    for rid, n in ops:
        key = f"r{rid}"
        if n == 0:
            bm.free(key)
            sizes.pop(key, None)
        else:
            target = sizes.get(key, 0) + n
            if bm.allocate(key, target):
                sizes[key] = target
                assert len(bm.block_table(key)) == -(-target // 4)
        bm.check_invariants()
        held = [b for k in sizes for b in bm.block_table(k)]
        assert len(held) == len(set(held))
        assert bm.num_free_blocks + len(held) == 16
    for key in list(sizes):
        bm.free(key)
    bm.check_invariants()
    assert bm.num_free_blocks == 16


def _fake_next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 1000


def _run(scheduler: Scheduler, requests: list[Request], max_steps: int = 10_000):
    """Drive the scheduler with a fake model; check every plan against the limits, and that
    a request's first chunk ever (only it, preemptions notwithstanding) tells the front end
    its prefix-cache hit."""
    for r in requests:
        scheduler.add_request(r)
    outputs = {r.request_id: r for r in requests}
    started: dict[str, int] = {}
    plans = []
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            break
        plan = scheduler.schedule()
        assert plan.num_batched_tokens <= scheduler.max_num_batched_tokens
        assert len(plan.chunks) <= scheduler.max_num_seqs
        sampled = {}
        for c in plan.chunks:
            r = outputs[c.request_id]
            assert (c.first_num_cached_tokens is not None) == (c.request_id not in started)
            started.setdefault(c.request_id, c.first_num_cached_tokens or 0)
            assert c.token_ids == r.token_ids(c.start_pos, c.start_pos + len(c.token_ids))
            bs = scheduler.block_manager.block_size
            assert len(c.block_table) * bs >= c.start_pos + len(c.token_ids)
            if c.sample:
                sampled[c.request_id] = _fake_next_token(r.token_ids(0, r.num_tokens))
        scheduler.update_from_output(plan, sampled)
        scheduler.block_manager.check_invariants()
        plans.append(plan)
    assert not scheduler.num_unfinished
    assert started == {r.request_id: r.num_cached_tokens for r in requests}
    return plans


def _requests(lens, max_tokens=5):
    return [
        Request(f"r{i}", list(range(1, n + 1)), max_tokens=max_tokens, max_model_len=1000,
                arrival_time=float(i))
        for i, n in enumerate(lens)
    ]  # fmt: skip


def test_decodes_first_then_chunked_prefill_fills_budget():
    bm = BlockManager(100, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    reqs = _requests([3, 25])
    sched.add_request(reqs[0])
    plan = sched.schedule()
    sched.update_from_output(plan, {"r0": 7})
    sched.add_request(reqs[1])
    plan = sched.schedule()
    assert [(c.request_id, len(c.token_ids)) for c in plan.chunks] == [("r0", 1), ("r1", 9)]
    assert not plan.chunks[1].sample
    sched.update_from_output(plan, {"r0": 8})
    plan = sched.schedule()  # r0 decodes; r1's second chunk fills the rest
    assert [(c.request_id, len(c.token_ids)) for c in plan.chunks] == [("r0", 1), ("r1", 9)]
    assert plan.chunks[1].start_pos == 9


def test_outputs_equal_with_and_without_preemption():
    lens = [5, 17, 9, 30, 2, 12]
    roomy = _requests(lens, max_tokens=12)
    _run(Scheduler(BlockManager(200, 4), max_num_seqs=8, max_num_batched_tokens=16), roomy)
    tight = _requests(lens, max_tokens=12)
    sched = Scheduler(BlockManager(12, 4), max_num_seqs=8, max_num_batched_tokens=16)
    _run(sched, tight)
    assert sched.num_preemptions > 0
    assert [r.output_token_ids for r in tight] == [r.output_token_ids for r in roomy]
    assert all(r.finish_reason == "length" for r in (x.status for x in tight))


def test_max_num_seqs_and_abort_free_blocks():
    bm = BlockManager(50, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100)
    for r in _requests([4, 4, 4]):
        sched.add_request(r)
    plan = sched.schedule()
    assert [c.request_id for c in plan.chunks] == ["r0", "r1"]
    sched.update_from_output(plan, {"r0": 1, "r1": 2})
    assert sched.abort_request("r0").status.finish_reason == "abort"
    assert sched.abort_request("r2") is not None  # still waiting
    assert sched.abort_request("nope") is None
    sched.abort_request("r1")
    bm.check_invariants()
    assert bm.num_free_blocks == 50


def test_duplicate_request_id_rejected():
    sched = Scheduler(BlockManager(8, 4), max_num_seqs=2, max_num_batched_tokens=8)
    sched.add_request(_requests([2])[0])
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(_requests([3])[0])


def test_stop_token_and_max_model_len():
    r = Request("a", [1, 2], max_tokens=10, stop_token_ids=frozenset({9}), max_model_len=5)
    assert r.append_token(3) is None
    assert r.append_token(9).finish_reason == "stop"
    r = Request("b", [1, 2], max_tokens=10, max_model_len=4)
    assert r.append_token(3) is None
    assert r.append_token(4).finish_reason == "length"


def test_parallel_samples_fork_and_copy_on_write():
    """3 samples of a 6-token prompt (block size 4): the prefix request computes 5 tokens,
    the samples fork its 2 blocks; the shared partial block is copied on write by the first
    two writers, the last writer owns it alone and writes in place."""
    bm = BlockManager(20, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    samples = [Request(f"s{i}", [1, 2, 3, 4, 5, 6], max_tokens=3, max_model_len=100)
               for i in range(3)]  # fmt: skip
    sched.add_parallel_requests(samples)
    plan = sched.schedule()
    assert [(c.request_id, len(c.token_ids), c.sample) for c in plan.chunks] == [
        ("s0\x1fprefix", 5, False)
    ]
    prefix_blocks = plan.chunks[0].block_table
    sched.update_from_output(plan, {})
    assert all(bm.block_table(f"s{i}") == prefix_blocks for i in range(3))
    assert bm.pool.ref_count(prefix_blocks[1]) == 3
    plan = sched.schedule()
    assert [(c.request_id, c.token_ids, c.start_pos) for c in plan.chunks] == [
        (f"s{i}", [6], 5) for i in range(3)
    ]
    assert [src for src, _ in plan.copies] == [prefix_blocks[1]] * 2
    tables = [c.block_table for c in plan.chunks]
    assert all(t[0] == prefix_blocks[0] for t in tables)  # the full block stays shared
    assert len({t[1] for t in tables}) == 3 and tables[2][1] == prefix_blocks[1]
    sched.update_from_output(plan, {f"s{i}": 10 + i for i in range(3)})
    bm.check_invariants()
    while sched.num_unfinished:
        plan = sched.schedule()
        assert not plan.copies
        sched.update_from_output(plan, {c.request_id: 7 for c in plan.chunks if c.sample})
    assert [s.output_token_ids for s in samples] == [[10, 7, 7], [11, 7, 7], [12, 7, 7]]
    bm.check_invariants()
    assert bm.num_free_blocks == 20


def test_aborting_every_unforked_sample_aborts_the_prefix():
    bm = BlockManager(20, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=2)
    samples = [Request(f"s{i}", list(range(1, 11)), max_tokens=3, max_model_len=100)
               for i in range(2)]  # fmt: skip
    sched.add_parallel_requests(samples)
    sched.update_from_output(sched.schedule(), {})  # 2 of the 9 prefix tokens
    sched.abort_request("s0")
    assert "s0\x1fprefix" in sched.requests
    sched.abort_request("s1")
    assert not sched.requests and bm.num_free_blocks == 20


def test_a_block_computed_in_this_step_is_waited_for_not_computed_again():
    """Requests sent together after one system prompt: the first one's chunk completes the
    prompt's last shared block; the others wait one step and hit it then, instead of
    computing it again beside it. A request that needs no block in flight is admitted at
    once; the outputs equal those without prefix caching."""
    shared = list(range(1, 23))  # blocks of 4: five full shared blocks, then 2 tokens

    def requests() -> list[Request]:
        prompts = [[*shared, 100 + i, 200 + i, 300 + i] for i in range(3)] + [[7, 8, 9, 10, 11]]
        return [
            Request(f"r{i}", p, max_tokens=4, max_model_len=1000, arrival_time=float(i))
            for i, p in enumerate(prompts)
        ]

    sched = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=16)
    reqs = requests()
    for r in reqs:
        sched.add_request(r)
    steps, first = [], {}
    while sched.num_unfinished:
        plan = sched.schedule()
        steps.append([(c.request_id, len(c.token_ids)) for c in plan.chunks])
        first.update(
            (c.request_id, c.first_num_cached_tokens)
            for c in plan.chunks
            if c.first_num_cached_tokens is not None
        )
        sampled = {c.request_id: 5 for c in plan.chunks if c.sample}
        sched.update_from_output(plan, sampled)
        sched.block_manager.check_invariants()
    assert steps[0] == [("r0", 16)]
    # r0 completes shared blocks 4 and 5 (its own): r1 and r2 wait for block 4, r3 goes on.
    assert steps[1] == [("r0", 9), ("r3", 5)]
    assert steps[2] == [("r0", 1), ("r3", 1), ("r1", 5), ("r2", 5)]
    assert [r.num_cached_tokens for r in reqs] == [0, 20, 20, 0]
    assert first == {"r0": 0, "r1": 20, "r2": 20, "r3": 0}  # what each first chunk told

    outs = {}
    for caching in (True, False):
        reqs = requests()
        bm = BlockManager(100, 4, enable_caching=caching)
        _run(Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16), reqs)
        outs[caching] = [r.output_token_ids for r in reqs]
    assert outs[True] == outs[False]
