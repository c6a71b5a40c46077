"""The step scheduler: continuous batching with chunked prefill under a token budget.

Each step the scheduler decides, from scratch, which requests compute how many tokens:

1. running requests that decode (one token each) come first;
2. running requests still prefilling get the next chunk of their prompt from what is left of
   the budget (chunked prefill, as in vLLM and Sarathi-Serve, Agrawal et al., OSDI 2024);
3. waiting requests are admitted in arrival order while the budget, ``max_num_seqs`` and the
   free blocks allow; the longest cached prefix of full blocks is shared (prefix caching) and
   only the rest is computed; a long prompt's first chunk fills the rest of the budget.

When a running request needs a block and none is free, the running request that arrived last
is preempted by recomputation: its blocks are freed and it goes back to the front of the
waiting queue with ``num_computed_tokens = 0``; on readmission its prompt and generated tokens
are prefilled again, so its output is unchanged.

Pure Python: the plan crosses to the worker as a :class:`SchedulerOutput` of plain lists.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncllm.core.block_manager import BlockManager
from asyncllm.core.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """The tokens one request computes in one step.

    Attributes:
        request_id: the request.
        token_ids: token ids whose K/V this step computes (positions ``start_pos`` onward).
        start_pos: position of ``token_ids[0]``; tokens before it are already in the cache.
        block_table: the request's physical blocks, covering at least
            ``start_pos + len(token_ids)`` tokens.
        sample: whether the last token's logits are sampled (the chunk reaches the end of the
            request's tokens).
        num_output_tokens: tokens the request had generated before this step.
        params: the request's opaque worker parameters (sampling parameters).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    num_output_tokens: int
    params: Any


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. Chunks that sample come in the order their tokens are returned."""

    chunks: list[ScheduledChunk] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed this step (<= max_num_batched_tokens)."""
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute."""
        return not self.chunks


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    """What one step produced for one request: a new token and maybe its end."""

    request_id: str
    token_id: int
    finish_reason: str | None


class Scheduler:
    """Owns the waiting queue, the running list and the block manager.

    Args:
        block_manager: the KV cache block bookkeeping.
        max_num_seqs: the most requests running at once.
        max_num_batched_tokens: the token budget of one step.

    Raises:
        ValueError: a limit below 1.
    """

    def __init__(
        self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_cache_hits = 0  # of which served from cached blocks

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
        self.waiting.append(request)

    def abort_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> Request | None:
        """Finish a request from outside the step (abort, or a stop string the front end
        matched) with ``status`` and free its blocks; None if it is not here."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status)
        return request

    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the module docstring for the policy)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._allocate_or_preempt(request, n, scheduled):
                out.chunks.append(self._chunk(request, n))
                scheduled.add(request.request_id)
                budget -= n

        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            cached = bm.find_cached_prefix(
                request.request_id, request, request.num_tokens, request.cache_salt
            )
            num_cached = len(cached) * bm.block_size
            n = min(request.num_tokens - num_cached, budget)
            if not bm.allocate(request.request_id, num_cached + n, cached):
                break
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, n))
            budget -= n
        return out

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, int]
    ) -> list[RequestUpdate]:
        """Advance the requests of a finished step and apply stop conditions.

        Args:
            output: the plan that ran.
            sampled: request id -> the token sampled for it (chunks with ``sample``).

        Returns:
            One update per sampled request still running; finished requests' blocks are freed.
        """
        updates: list[RequestUpdate] = []
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += len(chunk.token_ids)
            self.block_manager.cache_full_blocks(
                request.request_id, request, request.cache_salt, request.num_computed_tokens
            )
            if not chunk.sample:
                continue
            token = sampled[chunk.request_id]
            status = request.append_token(token)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            updates.append(
                RequestUpdate(request.request_id, token, status.finish_reason if status else None)
            )
        return updates

    def _chunk(self, request: Request, n: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.token_ids(start, start + n),
            start_pos=start,
            block_table=list(self.block_manager.block_table(request.request_id)),
            sample=start + n == request.num_tokens,
            num_output_tokens=len(request.output_token_ids),
            params=request.params,
        )

    def _allocate_or_preempt(self, request: Request, n: int, scheduled: set[str]) -> bool:
        """Allocate blocks for ``n`` more tokens, preempting the latest arrivals if needed.

        Returns False when ``request`` itself had to be preempted.
        """
        while not self.block_manager.allocate(request.request_id, request.num_computed_tokens + n):
            candidates = [r for r in self.running if r.request_id not in scheduled]
            victim = max(candidates, key=lambda r: r.arrival_time)
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.block_manager.free(request.request_id)
        del self.requests[request.request_id]
