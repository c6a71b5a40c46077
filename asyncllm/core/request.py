"""Request state as the core sees it: token ids and counters, no tensors.

One model covers prefill, chunked prefill, decode and resumption alike (as in vLLM v1):
``num_computed_tokens`` (tokens whose K/V are in the cache) catches up with ``num_tokens``
(prompt plus generated). A step that brings it level samples one new token.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncllm.core.speculation import RequestSpeculation

SAMPLE_ID_SEP = "\x1f"
"""Joins a caller's request id and a parallel sample's index (or "prefix") into the id of a
core request; callers' ids may not contain it, so internal ids never collide with theirs."""


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        """True for the three terminal states."""
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The public ``finish_reason`` string: "stop", "length", "abort", or None."""
        return self.value if self in _FINISHED else None


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


class Request:
    """One generation request inside the core.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt, at least one token.
        max_tokens: the most tokens to generate (>= 1).
        stop_token_ids: generating one of these ends the request with "stop" (the model's EOS
            tokens unless the caller asked to ignore EOS, plus the caller's stop token ids).
        min_tokens: stop tokens do not end the request before this many tokens are generated.
        max_model_len: prompt plus generated tokens never exceed this (tokens).
        arrival_time: seconds (``time.monotonic()``) when the request was received.
        priority: lower is served first (vLLM's convention); ties go to earlier arrival.
        params: opaque per-request data for the worker (its sampling parameters); the core
            never looks inside.
        cache_salt: requests share cached KV blocks only when their salts are equal (None is
            a salt too); tenants that must not share cache get different salts.
        prefill_only: compute the prompt's K/V and sample nothing (the shared prefix of
            parallel samples).
        group_id: the call the request belongs to when it is one of several parallel
            samples (None: a call of its own); the scheduler shares running slots fairly
            between calls.
        tenant: who the request is for; tenants share the running slots and the token
            budget by weight (:mod:`asyncllm.core.fair_share`); "" is the shared tenant.
        deadline: seconds (``time.monotonic()``) by which it should start; the scheduler
            admits earlier deadlines first within a priority band and tenant share (None:
            after every deadline). The front end ends a request that has not started by
            then.
        spec: its speculative decoding proposer
            (:class:`~asyncllm.core.speculation.RequestSpeculation`); None: it never
            speculates.

    Attributes:
        admitted: the request has been admitted once (or forked from its admitted
            prefix); prefix-cache counters and ``num_cached_tokens`` are set then only, not
            again when it is readmitted after a preemption.
        started: a step's plan has carried a chunk of it (its first chunk carries
            ``num_cached_tokens`` for the front end: :class:`~asyncllm.core.plan.
            ScheduledChunk`).
    """

    __slots__ = (
        "admitted",
        "arrival_time",
        "cache_salt",
        "cpu_blocks",
        "deadline",
        "group_id",
        "max_model_len",
        "max_tokens",
        "min_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "output_token_ids",
        "params",
        "prefill_only",
        "priority",
        "prompt_token_ids",
        "request_id",
        "spec",
        "started",
        "status",
        "stop_token_ids",
        "tenant",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int,
        stop_token_ids: frozenset[int] = frozenset(),
        min_tokens: int = 0,
        max_model_len: int,
        arrival_time: float = 0.0,
        priority: int = 0,
        params: Any = None,
        cache_salt: str | None = None,
        prefill_only: bool = False,
        group_id: str | None = None,
        tenant: str = "",
        deadline: float | None = None,
        spec: RequestSpeculation | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.stop_token_ids = stop_token_ids
        self.min_tokens = min_tokens
        self.max_model_len = max_model_len
        self.started = False
        self.arrival_time = arrival_time
        self.priority = priority
        self.params = params
        self.cache_salt = cache_salt
        self.prefill_only = prefill_only
        self.group_id = group_id
        self.tenant = tenant
        self.deadline = deadline
        self.spec = spec
        self.admitted = False
        # Prompt tokens served from the prefix cache at first admission.
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # While swapped out: the CPU blocks holding its first num_computed_tokens tokens' KV
        # (with layer groups, each group's blocks that its window still reads, group by group:
        # BlockManager.live_blocks).
        self.cpu_blocks: list[int] | None = None
        self.status = RequestStatus.WAITING

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` of prompt + output, without copying the whole sequence."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n_prompt]

    def append_token(self, token_id: int) -> RequestStatus | None:
        """Append a sampled token; return the finished status it causes, if any.

        Stop conditions in order: a stop token once more than ``min_tokens`` tokens are
        generated ("stop"), then ``max_tokens`` generated or ``max_model_len`` reached
        ("length").
        """
        self.output_token_ids.append(token_id)
        if token_id in self.stop_token_ids and len(self.output_token_ids) > self.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.max_tokens or self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
