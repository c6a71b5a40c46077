"""The step scheduler: continuous batching with chunked prefill under a token budget.

Each step the scheduler decides, from scratch, which requests compute how many tokens:

1. running requests that decode (one token each) come first;
2. running requests still prefilling get the next chunk of their prompt from what is left of
   the budget (chunked prefill, as in vLLM and Sarathi-Serve, Agrawal et al., OSDI 2024);
3. waiting requests are admitted in arrival order while the budget, ``max_num_seqs`` and the
   free blocks allow; the longest cached prefix of full blocks is shared (prefix caching) and
   only the rest is computed; a long prompt's first chunk fills the rest of the budget. A
   request whose next uncached block is one that a request scheduled in this step computes
   (agents sent together with one system prompt: the first one's last prompt blocks) waits
   for the next step and hits it then, rather than computing the same block again.

Priorities: a lower ``priority`` value is served first, ties by fair share and then earlier
arrival (vLLM's convention); the waiting queue is admitted in that order and running requests
get the budget in that order.

Preemption (:mod:`asyncllm.core.preemption`): when a running request needs a block and none
is free, when a better priority waits, or when a tenant within its share waits for a slot
held above another's share, running requests are preempted, their KV blocks swapped out to a
CPU block pool or dropped for recompute; either way the request's output is unchanged.

Layer groups (models with sliding-window layers, :mod:`asyncllm.core.kv_groups`): a request
holds one block table per group, and every count of blocks here is over all of them. After
each step a sliding group's blocks that fell behind the window of the tokens still to be
computed go back to the pool, so such a request holds a bounded number of them; a swap moves
the blocks each group still reads, and a swapped-in request gets new blocks only for those.

Parallel sampling (n > 1), kept in :class:`~asyncllm.core.parallel.SampleGroups`: the n
samples of one prompt share its KV blocks. A hidden prefix request computes all prompt tokens
but the last; then each sample forks its block table (reference counts, no copies) and
computes the last prompt token itself, which samples its first token. The partly filled last
block is copied on write by each sample that writes into it while others still share it; the
copies of a step are in its plan (``copies``).

Fair shares (:mod:`asyncllm.core.fair_share`): within a priority band, tenants share the
running slots by weight and, inside a tenant, the calls of several samples share its slots
evenly; a request whose tenant or call would hold more than its share is admitted after the
other waiting requests of its priority and preempted first. When the slots or the blocks
are all taken, a waiting request within its shares gets them: the most recently admitted
requests above their share (another tenant's, or another call's of its tenant), of the same
or worse priority and preempted fewer than ``PROTECT_AFTER_PREEMPTIONS`` times, are
preempted for it, for at most a step's token budget of such chunks per step. The token
budget and the admission order follow each tenant's virtual token counter (lowest first);
running prefills of a tenant above the first waiting request's counter take their chunks
after the step's admissions. Within a
tenant, an earlier ``deadline`` goes first, then earlier arrival. So a new stream starts
within a step or two beside another tenant's burst or a call of ``n = max_num_seqs`` samples.

Starvation: a request is protected once it has been preempted ``PROTECT_AFTER_PREEMPTIONS``
times or has waited ``PROTECT_AFTER_WAIT_S`` seconds since it arrived. A protected request
within its shares is admitted before every unprotected one and is preempted only when no
unprotected request can be, so it finishes under any sustained load of higher priority.

Speculative decoding (:mod:`asyncllm.core.speculation`): a decode may also compute its
n-gram proposals, verified by the worker; the verified tokens come back in one update each.

Pure Python: the plan crosses to the worker as a :class:`~asyncllm.core.plan.SchedulerOutput`
of plain lists (:mod:`asyncllm.core.plan`).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence

from asyncllm.core.block_manager import BlockManager, BlockPool
from asyncllm.core.fair_share import FairShare
from asyncllm.core.parallel import SampleGroups
from asyncllm.core.plan import RequestUpdate, ScheduledChunk, SchedulerOutput
from asyncllm.core.preemption import (
    allocate_or_preempt,
    preempt_for_fairness,
    preempt_for_priority,
    release_waiting_blocks,
)
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.speculation import Speculation

PROTECT_AFTER_PREEMPTIONS = 3
"""Preemptions after which a request is protected from further preemption."""

PROTECT_AFTER_WAIT_S = 30.0
"""Seconds since arrival after which a request is protected (and admitted first)."""


class Scheduler:
    """Owns the waiting queue, the running list and the block manager.

    Args:
        block_manager: the KV cache block bookkeeping.
        max_num_seqs: the most requests running at once.
        max_num_batched_tokens: the token budget of one step.
        cpu_pool: the CPU block pool that preempted requests are swapped out to; None means
            preemption always recomputes.
        clock: seconds, monotonic (for the starvation bound).
        tenant_weights: tenant -> share weight (:mod:`asyncllm.core.fair_share`; 1 if unset).

    Raises:
        ValueError: a limit below 1, or a weight that is not positive.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        cpu_pool: BlockPool | None = None,
        clock: Callable[[], float] = time.monotonic,
        tenant_weights: Mapping[str, float] | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cpu_pool = cpu_pool
        self.clock = clock
        self.protect_after_preemptions = PROTECT_AFTER_PREEMPTIONS
        self.protect_after_wait_s = PROTECT_AFTER_WAIT_S
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        #: Parallel sampling: the samples of a call share its prompt.
        self.groups = SampleGroups()
        #: Shares of the slots and the budget between tenants and between calls.
        self.fair = FairShare(max_num_seqs, tenant_weights)
        self.num_preemptions = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_recomputed_tokens = 0  # computed tokens dropped by recompute preemption
        # Prompt tokens looked up in the prefix cache at first admission (not readmission).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0  # of which served from cached blocks
        #: Speculative decoding (None: off; the engine sets it).
        self.spec: Speculation | None = None
        self.prefix_cache_host_hits = 0  # of which loaded from the host tier
        self.prefix_cache_disk_hits = 0  # of which the disk tier had supplied

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self.requests)

    def add_request(self, request: Request) -> None:
        """Queue a new request.

        Raises:
            ValueError: a request with the same id is still in the scheduler.
        """
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.fair.arrive(request)
        self.waiting.append(request)

    def add_parallel_requests(self, samples: Sequence[Request]) -> None:
        """Queue the n samples of one prompt so that they share its KV blocks (see the module
        docstring). Their ids must be distinct; the prompt is the first sample's.

        Raises:
            ValueError: a duplicate request id.
        """
        prefix = self.groups.split(samples, self.requests)
        if prefix is None:
            for r in samples:
                self.add_request(r)
            return
        self.add_request(prefix)
        for r in samples:
            r.status = RequestStatus.WAITING
            self.requests[r.request_id] = r
            self.fair.arrive(r)

    def abort_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> Request | None:
        """Finish a request from outside the step (abort, or a stop string the front end
        matched) with ``status`` and free its blocks; None if it is not here."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        unforked, orphan_prefix = self.groups.discard(request)  # not forked: holds no blocks
        if orphan_prefix is not None:
            self.abort_request(orphan_prefix)
        if not unforked:
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
        self._finish(request, status)
        return request

    def is_protected(self, request: Request) -> bool:
        """Protected from preemption and admitted first (see the module docstring)."""
        return (
            request.num_preemptions >= self.protect_after_preemptions
            or self.clock() - request.arrival_time >= self.protect_after_wait_s
        )

    def admission_key(self, request: Request) -> tuple[bool, int, bool, float, float, float]:
        """The waiting queue's order (smallest first): protected (by preemptions or age)
        first, then priority, within share before over share, the tenant's virtual token
        counter, deadline (earliest first), arrival. The largest is the worst victim for
        preemption (:data:`victim_key`)."""
        # Age protects no request above its tenant's or call's share: they keep theirs.
        over = self.fair.over_share(request)
        return (
            over or not self.is_protected(request),
            request.priority,
            over,
            self.fair.counter(request),
            math.inf if request.deadline is None else request.deadline,
            request.arrival_time,
        )

    def _running_key(self, request: Request) -> tuple[int, float, float, float]:
        """The order in which running requests get the step's budget."""
        deadline = math.inf if request.deadline is None else request.deadline
        return request.priority, self.fair.counter(request), deadline, request.arrival_time

    #: The worst request to preempt is the max; ties go to the most recently admitted
    #: (callers pass the running list reversed).
    victim_key = admission_key

    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the module docstring for the policy)."""
        out = SchedulerOutput()
        store = self.block_manager.host_store
        if store is not None:
            store.new_step()
        self.fair.refresh(self.running, self.waiting)
        self.waiting.sort(key=self.admission_key)
        preempt_for_priority(self, out)
        preempt_for_fairness(self, out)
        order = sorted(self.running, key=self._running_key)
        decodes = [r for r in order if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in order if r.num_tokens - r.num_computed_tokens > 1]
        later = self._deferred_prefills(prefills)
        step = _Step(out, self.max_num_batched_tokens)
        self._schedule_running(decodes, [r for r in prefills if r not in later], step)
        self._schedule_waiting(step)
        self._schedule_running([], later, step)
        if store is not None:  # evicted blocks spilled and host hits loaded, before the forward
            store.drain(out.swap_out, out.swap_in)
        return out

    def _add_chunk(self, request: Request, n: int, step: _Step) -> None:
        chunk = self._chunk(request, n)
        step.out.chunks.append(chunk)
        step.scheduled.add(request.request_id)
        step.budget -= n
        self.fair.charge(request, n)
        if n > 1:
            self._note_computing(request, n, step.computing)

    def _schedule_running(
        self, decodes: list[Request], prefills: list[Request], step: _Step
    ) -> None:
        """Decodes (one token each, or their proposals too), then prefill chunks."""
        out = step.out
        spec = self.spec if self.spec is not None and self.spec.active(len(decodes)) else None
        for i, request in enumerate(decodes + prefills):
            if step.budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            n = min(request.num_tokens - request.num_computed_tokens, step.budget)
            # Speculation spends only the budget the decodes after this one do not need.
            if spec is not None and i < len(decodes):
                chunk = spec.chunk(self, request, step.budget - len(decodes) + i, out)
                if chunk is not None:
                    out.chunks.append(chunk)
                    step.scheduled.add(request.request_id)
                    step.budget -= len(chunk.token_ids)
                    self.fair.charge(request, len(chunk.token_ids))
                    continue
            if allocate_or_preempt(self, request, n, step.scheduled, out):
                self._add_chunk(request, n, step)

    def _schedule_waiting(self, step: _Step) -> None:
        """Admit waiting requests in order while the budget, the slots and the blocks allow."""
        bm, fair = self.block_manager, self.fair
        if fair.num_active_tenants > 1:  # the running chunks moved the counters
            self.waiting.sort(key=self.admission_key)
        i = 0
        while i < len(self.waiting) and step.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[i]
            computing = step.computing
            if (computing or bm.reads_disk) and self._waits_for_computing(request, computing):
                i += 1
                continue
            if (
                fair.contended
                and fair.over_share(request)
                and len(self.running) + 1 + fair.headroom(request) > self.max_num_seqs
            ):
                # The free slots left are other tenants' headroom; what follows in the
                # order is over share too, or of a worse priority.
                break
            n = self._admit(request, step.budget, step.out)
            if n == 0:
                if release_waiting_blocks(self, request):
                    continue
                break
            del self.waiting[i]
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_chunk(request, n, step)
            if fair.admitted(request) or fair.num_active_tenants > 1:
                # Its tenant or call reached its share, or its counter moved: others first.
                self.waiting.sort(key=self.admission_key)
                i = 0

    def _deferred_prefills(self, prefills: list[Request]) -> list[Request]:
        """Running prefills that wait for the step's admissions: those of another tenant
        whose counter is above that of the first waiting request within its shares, of the
        same or worse priority (so a tenant's long prompts do not keep another tenant's
        request from starting)."""
        fair = self.fair
        if not fair.contended or not self.waiting:
            return []
        head = next((w for w in self.waiting if not fair.over_share(w)), None)
        if head is None:
            return []
        first = fair.counter(head)
        return [
            r for r in prefills
            if r.tenant != head.tenant and r.priority >= head.priority and fair.counter(r) > first
        ]  # fmt: skip

    def _note_computing(self, request: Request, n: int, computing: set[bytes]) -> None:
        """Add the hashes of the blocks that ``request``'s chunk of ``n`` tokens fills."""
        bm = self.block_manager
        if not bm.enable_caching:
            return
        start = request.num_computed_tokens
        hashes = bm.block_hashes(request.request_id, request, request.cache_salt, start + n)
        computing.update(hashes[start // bm.block_size : (start + n) // bm.block_size])

    def _waits_for_computing(self, request: Request, computing: set[bytes]) -> bool:
        """Whether a fresh waiting request's next uncached block is in ``computing``, or
        is being read from the disk tier."""
        bm = self.block_manager
        rid = request.request_id
        if request.cpu_blocks is not None or bm.block_table(rid):
            return False  # swapped out or forked: it has its blocks
        if bm.fetch_from_disk(rid, request, request.num_tokens, request.cache_salt):
            return True
        cached = bm.find_cached_prefix(rid, request, request.num_tokens, request.cache_salt)
        hashes = bm.block_hashes(rid, request, request.cache_salt, request.num_tokens - 1)
        return len(cached) < len(hashes) and hashes[len(cached)] in computing

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Give a waiting request its blocks for its next chunk; return the chunk's size in
        tokens, or 0 (changing nothing) when the blocks are not free."""
        bm = self.block_manager
        rid = request.request_id
        if request.cpu_blocks is not None:  # swapped out: copy back, continue where it stopped
            start = request.num_computed_tokens
            n = min(request.num_tokens - start, budget)
            if not bm.allocate(rid, start + n, write_from=start):
                return 0
            device = bm.live_blocks(rid, start, -(-start // bm.block_size))
            out.swap_in.extend(zip(request.cpu_blocks, device, strict=True))
            out.cpu_blocks_to_free.extend(request.cpu_blocks)
            self.num_swapped_in_blocks += len(request.cpu_blocks)
            request.cpu_blocks = None
            return n
        if bm.block_table(rid):  # a forked sample: it already shares its prompt's blocks
            start = request.num_computed_tokens
            n = min(request.num_tokens - start, budget)
            ok = bm.allocate(rid, start + n, write_from=start, copies=out.copies)
            return n if ok else 0
        cached = bm.find_cached_prefix(rid, request, request.num_tokens, request.cache_salt)
        num_cached = len(cached) * bm.block_size
        n = min(request.num_tokens - num_cached, budget)
        if not bm.allocate(rid, num_cached + n, cached):
            return 0
        if not request.admitted:
            # First admission only (vLLM's definition): a request readmitted after a
            # recompute preemption finds its own blocks cached, which is no prefix sharing.
            request.admitted = True
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached
            self.prefix_cache_host_hits += cached.num_host_blocks * bm.block_size
            self.prefix_cache_disk_hits += cached.num_disk_blocks * bm.block_size
            request.num_cached_tokens = num_cached
        request.num_computed_tokens = num_cached
        return n

    @property
    def num_waiting(self) -> int:
        """Requests waiting: queued, plus parallel samples waiting for their prefix."""
        return len(self.waiting) + self.groups.num_unforked

    def num_waiting_of(self, tenant: str) -> int:
        """Requests of ``tenant`` waiting, parallel samples waiting for their prefix
        included."""
        unforked = (r for _, samples in self.groups.unforked() for r in samples)
        return sum(r.tenant == tenant for r in itertools.chain(self.waiting, unforked))

    def waiting_order(self) -> dict[str, int]:
        """Request id -> how many waiting requests are admitted before it (its order as of
        the last step); a parallel sample waiting for its prefix request takes the prefix's
        place."""
        order = {r.request_id: i for i, r in enumerate(self.waiting)}
        for prefix_id, samples in self.groups.unforked():
            if prefix_id in order:
                order.update((r.request_id, order[prefix_id]) for r in samples)
        return order

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, int],
        finished: Mapping[str, RequestStatus] | None = None,
        spec_tokens: Mapping[str, list[int]] | None = None,
    ) -> list[RequestUpdate]:
        """Advance the requests of a finished step and apply stop conditions.

        Args:
            output: the plan that ran.
            sampled: request id -> the token sampled for it (chunks with ``sample``).
            finished: request id -> a finished status the worker decided for the sampled
                token (a grammar that is complete), applied after the token is appended and
                before the request's own stop conditions.
            spec_tokens: request id -> the tokens a speculative chunk produced (accepted
                proposals and the model's own token; :mod:`asyncllm.core.speculation`).

        Returns:
            One update per sampled request still running; finished requests' blocks are freed.
        """
        updates: list[RequestUpdate] = []
        if self.cpu_pool is not None and output.cpu_blocks_to_free:
            self.cpu_pool.free(output.cpu_blocks_to_free)
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if chunk.spec_token_ids and self.spec is not None:  # none verified: row 0's token
                tokens = (spec_tokens or {}).get(request.request_id) or [sampled[chunk.request_id]]
                self.spec.apply(self, request, chunk, tokens, updates)
                continue
            request.num_computed_tokens += len(chunk.token_ids)
            bm = self.block_manager
            done = request.num_computed_tokens
            bm.cache_full_blocks(request.request_id, request, request.cache_salt, done)
            if bm.sliding:
                bm.free_behind_window(request.request_id, done)
            if request.prefill_only and request.num_computed_tokens == request.num_tokens:
                self._fork(request)
            if not chunk.sample:
                continue
            token = sampled[chunk.request_id]
            status = request.append_token(token)
            if finished and chunk.request_id in finished:
                status = finished[chunk.request_id]
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            updates.append(
                RequestUpdate(request.request_id, token, status.finish_reason if status else None)
            )
        return updates

    def _chunk(self, request: Request, n: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        first = not request.started
        request.started = True
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.token_ids(start, start + n),
            start_pos=start,
            block_tables=[list(t) for t in self.block_manager.block_tables(request.request_id)],
            sample=start + n == request.num_tokens and not request.prefill_only,
            num_output_tokens=len(request.output_token_ids),
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            stop_token_ids=request.stop_token_ids,
            first_num_cached_tokens=request.num_cached_tokens if first else None,
        )

    def _fork(self, prefix: Request) -> None:
        """The prefix is computed: its samples share its blocks and join the waiting queue."""
        self.waiting.extend(self.groups.fork(prefix, self.block_manager))
        self.waiting.sort(key=self.admission_key)
        self.running.remove(prefix)
        self._finish(prefix, RequestStatus.FINISHED_STOPPED)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.fair.leave(request)
        self.block_manager.free(request.request_id)
        if request.cpu_blocks is not None and self.cpu_pool is not None:
            self.cpu_pool.free(request.cpu_blocks)
            request.cpu_blocks = None
        del self.requests[request.request_id]


class _Step:
    """What one :meth:`Scheduler.schedule` call has planned so far."""

    __slots__ = ("budget", "computing", "out", "scheduled")

    def __init__(self, out: SchedulerOutput, budget: int) -> None:
        self.out = out
        self.budget = budget  # tokens left
        self.scheduled: set[str] = set()  # requests with a chunk
        self.computing: set[bytes] = set()  # hashes of the blocks this step's chunks complete
