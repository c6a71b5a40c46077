"""Preemption: which running requests give up their KV blocks, and how.

When a running request needs a block and none is free (:func:`allocate_or_preempt`), when the
best waiting request has a better priority than some running request and cannot be admitted
(too few free blocks for its first chunk, or ``max_num_seqs`` running:
:func:`preempt_for_priority`), or when a waiting request within its tenant's or call's fair
share finds the slots or blocks held above another's share (:func:`preempt_for_fairness`,
:mod:`asyncllm.core.fair_share`), running requests are preempted, worst first: unprotected
before protected, then the largest priority value, then the latest arrival. A victim's KV
blocks are either

* swapped out (offload): copied to a CPU block pool and freed on the device; on readmission
  they are copied back into new device blocks and decoding continues where it stopped; or
* dropped (recompute), when there is no CPU pool or it is full: ``num_computed_tokens`` goes
  back to 0 and the prompt and generated tokens are prefilled again on readmission.

Either way the request's output is unchanged. The copies of one step are listed in its plan
(``swap_out`` before ``swap_in``) and done by the worker before the forward pass. The host
tier of the prefix cache (:mod:`asyncllm.core.host_store`) shares the CPU pool: its copies
join the same lists, and it gives up slots whenever a swap out needs them.

Functions of the :class:`~asyncllm.core.scheduler.Scheduler` they act on; pure Python.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncllm.core.plan import SchedulerOutput
from asyncllm.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from asyncllm.core.scheduler import Scheduler

__all__ = [
    "allocate_or_preempt",
    "preempt",
    "preempt_for_fairness",
    "preempt_for_priority",
    "release_waiting_blocks",
    "wanted",
]


def wanted(sched: Scheduler, request: Request) -> int:
    """Blocks for the request's next chunk (at most a full budget, no prefix hits)."""
    start = request.num_computed_tokens
    n = min(request.num_tokens - start, sched.max_num_batched_tokens)
    return sched.block_manager.blocks_needed(request.request_id, start + n, start)


def preempt_for_priority(sched: Scheduler, out: SchedulerOutput) -> None:
    """Preempt running requests of worse priority until the best waiting request fits
    beside what the remaining running requests need this step."""
    if not sched.waiting:
        return
    head = sched.waiting[0]
    bm = sched.block_manager
    while len(sched.running) >= sched.max_num_seqs or (
        wanted(sched, head) + sum(wanted(sched, r) for r in sched.running) > bm.num_free_blocks
    ):
        victims = [
            r for r in sched.running
            if r.priority > head.priority and not sched.is_protected(r)
        ]  # fmt: skip
        if not victims:
            return
        preempt(sched, max(reversed(victims), key=sched.victim_key), out)


def preempt_for_fairness(sched: Scheduler, out: SchedulerOutput) -> None:
    """Preempt requests above their tenant's or call's share until the waiting requests
    within theirs fit, slots and blocks (see the module docstring)."""
    fair, bm = sched.fair, sched.block_manager
    if not sched.waiting or not fair.contended:
        return
    slots, blocks, tokens = len(sched.running), sum(wanted(sched, r) for r in sched.running), 0
    for head in list(sched.waiting):
        if tokens >= sched.max_num_batched_tokens:
            return  # these cannot all start this step anyway
        if fair.over_share(head):
            continue
        slots, blocks = slots + 1, blocks + wanted(sched, head)
        while slots > sched.max_num_seqs or blocks > bm.num_free_blocks:
            victim = fair.victim(head, sched.running, sched.protect_after_preemptions)
            if victim is None:
                return  # later waiting requests have no better priority
            slots, blocks = slots - 1, blocks - wanted(sched, victim)
            preempt(sched, victim, out)
        tokens += head.num_tokens - head.num_computed_tokens


def allocate_or_preempt(
    sched: Scheduler, request: Request, n: int, scheduled: set[str], out: SchedulerOutput
) -> bool:
    """Allocate blocks for ``n`` more tokens, preempting the worst running requests not
    yet scheduled this step if needed. Returns False when ``request`` itself was preempted.
    """
    start = request.num_computed_tokens
    while not sched.block_manager.allocate(
        request.request_id, start + n, write_from=start, copies=out.copies
    ):
        candidates = [r for r in reversed(sched.running) if r.request_id not in scheduled]
        victim = max(candidates, key=sched.victim_key)
        preempt(sched, victim, out)
        if victim is request:
            return False
    return True


def preempt(sched: Scheduler, request: Request, out: SchedulerOutput) -> None:
    """Swap the request out to the CPU pool if it has room, else drop its KV."""
    bm = sched.block_manager
    rid = request.request_id
    start = request.num_computed_tokens
    valid = bm.live_blocks(rid, start, -(-start // bm.block_size)) if start else []
    cpu, store = sched.cpu_pool, bm.host_store
    if (
        cpu is not None
        and valid
        and (store.make_room(len(valid)) if store is not None else len(valid) <= cpu.num_free)
    ):
        cpu_blocks = cpu.allocate(len(valid))
        out.swap_out.extend(zip(valid, cpu_blocks, strict=True))
        request.cpu_blocks = cpu_blocks
        sched.num_swapped_out_blocks += len(valid)
    else:
        sched.num_recomputed_tokens += request.num_computed_tokens
        request.num_computed_tokens = 0
    bm.free(rid)
    sched.running.remove(request)
    request.num_preemptions += 1
    out.preempted.append(rid)
    request.status = RequestStatus.WAITING
    sched.waiting.append(request)
    sched.fair.refresh(sched.running, sched.waiting)
    sched.waiting.sort(key=sched.admission_key)
    sched.num_preemptions += 1


def release_waiting_blocks(sched: Scheduler, head: Request) -> bool:
    """Drop the blocks a waiting forked sample holds (the worst one first), so that the
    head of the queue can be admitted; the sample recomputes later. False: none held."""
    bm = sched.block_manager
    holders = [r for r in sched.waiting if r is not head and bm.block_table(r.request_id)]
    if not holders:
        return False
    victim = max(holders, key=sched.victim_key)
    bm.free(victim.request_id)
    sched.num_recomputed_tokens += victim.num_computed_tokens
    victim.num_computed_tokens = 0
    return True
