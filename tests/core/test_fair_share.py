"""Fair shares between tenants in the scheduler (weighted, virtual token counters), deadlines.

Scripted schedules on the pure-Python core: every step samples token 5 for each sampled
chunk, so the number of steps until a request starts is exact.
"""

from __future__ import annotations

import math

import pytest

from asyncllm.core.block_manager import BlockManager, BlockPool
from asyncllm.core.fair_share import FairShare
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.scheduler import Scheduler


def _sched(max_num_seqs=8, budget=64, blocks=2048, weights=None, cpu=0) -> Scheduler:
    return Scheduler(
        BlockManager(blocks, 4, enable_caching=False),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        cpu_pool=BlockPool(cpu) if cpu else None,
        clock=lambda: 0.0,
        tenant_weights=weights,
    )


def _req(rid, tenant="", n_prompt=3, max_tokens=50, **kw) -> Request:
    return Request(
        rid, list(range(1, n_prompt + 1)), max_tokens=max_tokens, max_model_len=4096,
        tenant=tenant, **kw,
    )  # fmt: skip


def _burst(sched: Scheduler, tenant: str, calls: int, n: int, n_prompt: int) -> list[Request]:
    """``calls`` calls of ``n`` parallel samples each, as the front end queues them."""
    samples = []
    for c in range(calls):
        group = [_req(f"{tenant}{c}-{i}", tenant, n_prompt, 40) for i in range(n)]
        for r in group:
            r.group_id = f"{tenant}{c}"
        sched.add_parallel_requests(group)
        samples += group
    return samples


def _step(sched: Scheduler) -> list[str]:
    plan = sched.schedule()
    sched.update_from_output(plan, {c.request_id: 5 for c in plan.chunks if c.sample})
    return [c.request_id for c in plan.chunks]


def _drain(sched: Scheduler) -> None:
    while sched.requests:
        _step(sched)
    sched.block_manager.check_invariants()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks
    if sched.cpu_pool is not None:
        assert sched.cpu_pool.num_free == sched.cpu_pool.num_blocks
    assert sched.fair.num_active_tenants == 0


@pytest.mark.parametrize("n_prompt", [3, 300])  # 300: A's prompts are prefilled in chunks
def test_a_lone_request_starts_beside_another_tenants_burst(n_prompt):
    # Tenant A: 64 prompts x n=2. The bound from the share rule: B is within its share (4 of
    # 8 slots), so its first step after arriving preempts one of A's (above its share) and
    # gives B's 3-token prompt its chunk before A's prefills: B samples in that very step.
    sched = _sched(max_num_seqs=8, budget=64, cpu=4096)
    a = _burst(sched, "A", 64, 2, n_prompt)
    while len(sched.running) < 8 or any(r.num_computed_tokens == 0 for r in sched.running):
        _step(sched)
    assert all(r.tenant == "A" for r in sched.running)
    b = _req("b", "B")
    sched.add_request(b)
    _step(sched)
    assert b.output_token_ids == [5]
    # A keeps the rest of the slots; B is never preempted (A's own calls share A's slots
    # among themselves, with preemptions of their own when the prompts are long).
    for _ in range(5):
        _step(sched)
        assert sum(r.tenant == "A" for r in sched.running) == 7
        assert b.status is RequestStatus.RUNNING and b.num_preemptions == 0
    _drain(sched)
    assert all(len(r.output_token_ids) == 40 for r in a) and len(b.output_token_ids) == 50


def test_one_tenant_keeps_first_come_first_served():
    sched = _sched(max_num_seqs=2)
    reqs = [_req(f"r{i}", n_prompt=4, max_tokens=2, arrival_time=i) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    order = []
    while sched.requests:
        for rid in _step(sched):
            if rid not in order:
                order.append(rid)
    assert order == [r.request_id for r in reqs] and sched.num_preemptions == 0


@pytest.mark.parametrize(("wa", "wb", "slots_a"), [(1, 1, 4), (1, 3, 2), (3, 1, 6)])
def test_slots_follow_the_weights(wa, wb, slots_a):
    sched = _sched(max_num_seqs=8, weights={"A": wa, "B": wb}, cpu=4096)
    for i in range(20):
        sched.add_request(_req(f"a{i}", "A", max_tokens=200, arrival_time=i))
    _step(sched)
    for i in range(20):
        sched.add_request(_req(f"b{i}", "B", max_tokens=200, arrival_time=100 + i))
    for _ in range(12):
        _step(sched)
    running_a = sum(r.tenant == "A" for r in sched.running)
    assert (running_a, len(sched.running)) == (slots_a, 8)
    for rid in list(sched.requests):
        sched.abort_request(rid)
    _drain(sched)


def test_token_budget_follows_the_virtual_counters():
    # Slots to spare, a budget that holds two chunks: long prompts of two tenants, A's
    # queued first. The budget alternates between the tenants by their counters; with
    # weight 2, B gets twice A's tokens.
    for wb, ratio in [(1.0, 1.0), (2.0, 2.0)]:
        sched = _sched(max_num_seqs=64, budget=32, weights={"B": wb})
        for i in range(6):
            sched.add_request(_req(f"a{i}", "A", n_prompt=160, max_tokens=1, arrival_time=i))
        for i in range(6):
            sched.add_request(_req(f"b{i}", "B", n_prompt=160, max_tokens=1, arrival_time=9 + i))
        tokens = {"A": 0, "B": 0}
        for _ in range(20):
            plan = sched.schedule()
            for c in plan.chunks:
                tokens[sched.requests[c.request_id].tenant] += len(c.token_ids)
            sched.update_from_output(plan, {c.request_id: 5 for c in plan.chunks if c.sample})
        assert tokens["A"] + tokens["B"] == 20 * 32
        assert tokens["B"] / tokens["A"] == pytest.approx(ratio, rel=0.15)
        _drain(sched)


def test_priorities_keep_their_meaning_across_tenants():
    sched = _sched(max_num_seqs=4)
    for i in range(8):
        sched.add_request(_req(f"a{i}", "A", max_tokens=3, priority=0, arrival_time=i))
    _step(sched)
    worse = _req("b", "B", priority=1, arrival_time=50)
    sched.add_request(worse)
    started = []
    while worse.status is RequestStatus.WAITING:
        started += [rid for rid in _step(sched) if rid.startswith("a")]
    # B's worse priority waited for every one of A's requests; nothing was preempted for it.
    assert set(started) == {f"a{i}" for i in range(8)} and sched.num_preemptions == 0
    # A better priority of a third tenant goes before A's waiting requests, and takes
    # B's slot (worse priority) rather than waiting for it.
    for i in range(4):
        sched.add_request(_req(f"a{8 + i}", "A", max_tokens=30, arrival_time=70))
    better = [_req(f"c{i}", "C", priority=-1, arrival_time=80 + i) for i in range(4)]
    for r in better:
        sched.add_request(r)
    for _ in range(2):
        assert not any(rid.startswith("a") for rid in _step(sched))
    assert all(r.status is RequestStatus.RUNNING for r in better)
    assert worse.status is RequestStatus.WAITING and worse.num_preemptions == 1
    _drain(sched)


def test_earliest_deadline_first_within_a_tenant():
    sched = _sched(max_num_seqs=1)
    deadlines = [None, 30.0, 10.0, None, 20.0]
    for i, d in enumerate(deadlines):
        sched.add_request(_req(f"r{i}", max_tokens=1, arrival_time=i, deadline=d))
    order = []
    while sched.requests:
        order += _step(sched)
    assert order == ["r2", "r4", "r1", "r0", "r3"]
    _drain(sched)


def test_a_tenant_that_was_idle_banks_no_credit():
    fair = FairShare(8)
    a, b, c = _req("a", "A"), _req("b", "B"), _req("c", "C")
    fair.arrive(a)
    fair.charge(a, 1000)
    fair.arrive(b)  # lifted to A's counter
    assert fair.counter(b) == fair.counter(a) == 1000
    fair.charge(b, 10)
    fair.arrive(c)  # lifted to the lowest active counter
    assert fair.counter(c) == 1000
    for r in (a, b, c):
        fair.leave(r)
    assert fair.num_active_tenants == 0 and fair.counter(a) == 0  # an idle engine: level


@pytest.mark.parametrize("weight", [0, -1, math.inf, math.nan, "2", True])
def test_bad_weights_are_refused(weight):
    with pytest.raises(ValueError, match="tenant weight"):
        FairShare(8, {"A": weight})


def test_a_tenant_holding_every_block_yields_blocks_too():
    # Slots to spare, but tenant A's requests fill the KV pool: B's request within its share
    # gets the blocks of one of A's (swapped out), in the next step.
    sched = _sched(max_num_seqs=64, blocks=64, cpu=256)
    a = [_req(f"a{i}", "A", n_prompt=24, max_tokens=60, arrival_time=i) for i in range(8)]
    for r in a:
        sched.add_request(r)
    while sched.block_manager.num_free_blocks > 0:
        _step(sched)
    b = _req("b", "B", n_prompt=8, max_tokens=4)
    sched.add_request(b)
    _step(sched)
    assert b.output_token_ids == [5] and sched.num_preemptions >= 1
    assert all(r.tenant == "A" for r in sched.waiting)
    _drain(sched)


def test_the_config_and_the_scheduler_bound_weights_alike():
    from asyncllm.config import MAX_TENANT_WEIGHT, EngineConfig
    from asyncllm.core.fair_share import MAX_WEIGHT

    assert MAX_TENANT_WEIGHT == MAX_WEIGHT
    FairShare(64, {"a": MAX_WEIGHT, "b": MAX_WEIGHT}).refresh([], [_req("x", "a")])
    for bad in ({"a": MAX_WEIGHT * 10}, {5: 1.0}, {"x" * 300: 1.0}, [("a", 1.0)]):
        with pytest.raises(ValueError, match="tenant_weights"):
            EngineConfig(tenant_weights=bad)  # type: ignore[arg-type]


def test_a_steady_tenant_finds_a_free_slot_instead_of_preempting():
    """A's burst fills the slots nobody wants, but leaves one free for each other active
    tenant below its share: B and C, each with a request running, start their next ones in
    the step they arrive with no preemption (without the headroom each arrival swapped out
    one of A's). Alone again, A takes every slot."""
    sched = _sched(max_num_seqs=8, cpu=4096)
    b0, c0 = _req("b0", "B", max_tokens=30), _req("c0", "C", max_tokens=30)
    sched.add_request(b0)
    sched.add_request(c0)
    a = [_req(f"a{i}", "A", max_tokens=4, arrival_time=i) for i in range(40)]
    for r in a:
        sched.add_request(r)
    for _ in range(3):
        _step(sched)
        # B and C run one each and keep one free slot each: A holds the other 4.
        assert sum(r.tenant == "A" for r in sched.running) == 4 and len(sched.running) == 6
    for t in ("B", "C"):
        late = _req(f"{t.lower()}1", t, max_tokens=2)
        sched.add_request(late)
        assert late.request_id in _step(sched) and late.output_token_ids == [5]
    assert sched.num_preemptions == 0
    while not (b0.status.is_finished and c0.status.is_finished):
        _step(sched)
    _step(sched)  # A alone: its share is every slot
    left = [r for r in a if not r.status.is_finished]
    assert len(left) > 8 and len(sched.running) == 8
    _drain(sched)
    assert sched.num_preemptions == 0
    assert all(len(r.output_token_ids) == 4 for r in a)
