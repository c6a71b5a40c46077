"""The plan of one step as plain data: what the scheduler decides
(:class:`SchedulerOutput`: a :class:`ScheduledChunk` per request computed, block copies for
swap, copy-on-write and the prefix tiers) and what each request got back
(:class:`RequestUpdate`).

The plan crosses from the core (pure Python) to the worker, which turns it into tensors; the
updates cross back. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestUpdate", "ScheduledChunk", "SchedulerOutput"]


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """The tokens one request computes in one step.

    Attributes:
        request_id: the request.
        token_ids: token ids whose K/V this step computes (positions ``start_pos`` onward).
        start_pos: position of ``token_ids[0]``; tokens before it are already in the cache.
        block_tables: the request's physical blocks, one table per layer group
            (:mod:`asyncllm.core.kv_groups`; one for a model without sliding windows), each
            covering at least ``start_pos + len(token_ids)`` tokens (a sliding group's
            entries behind its window are placeholders no kernel reads).
        sample: whether the last token's logits are sampled (the chunk reaches the end of the
            request's tokens).
        num_output_tokens: tokens the request had generated before this step.
        params: the request's opaque worker parameters (sampling parameters).
        prompt_token_ids: the request's prompt (a read-only reference to its list, not a
            copy), for penalties and prompt logprobs.
        output_token_ids: the request's generated tokens so far (read-only reference).
        stop_token_ids: the tokens that stop the request (masked while ``min_tokens`` is
            not reached).
        spec_token_ids: speculative decoding's proposals, the last ``k`` of ``token_ids``
            (:mod:`asyncllm.core.speculation`): all ``1 + k`` rows are sampled and verified;
            () for a plain chunk.
        first_num_cached_tokens: on the request's first chunk ever, the prompt tokens its
            prefix-cache hit covered (the front end stamps the request started, for its
            queue time and ``num_cached_tokens``); None on every later chunk.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_tables: list[list[int]]
    sample: bool
    num_output_tokens: int
    params: Any
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    stop_token_ids: frozenset[int] = frozenset()
    spec_token_ids: tuple[int, ...] = ()
    first_num_cached_tokens: int | None = None

    @property
    def block_table(self) -> list[int]:
        """The first group's table (the only one of a model without sliding windows)."""
        return self.block_tables[0]


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan.

    Attributes:
        chunks: the tokens each scheduled request computes.
        swap_out: (device block, CPU block) pairs to copy to the CPU pool first.
        swap_in: (CPU block, device block) pairs to copy back, after ``swap_out``.
        cpu_blocks_to_free: CPU blocks released once this step's copies are done.
        copies: (source, destination) device blocks to copy after the swaps
            (copy-on-write of shared, partly filled blocks).
        preempted: ids of the requests preempted while planning (swapped out or dropped),
            for the front end's per-request counts.
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    cpu_blocks_to_free: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed this step (<= max_num_batched_tokens)."""
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and nothing to copy."""
        return not (self.chunks or self.swap_out or self.swap_in or self.copies)


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    """What one step produced for one request: a new token and maybe its end."""

    request_id: str
    token_id: int
    finish_reason: str | None
