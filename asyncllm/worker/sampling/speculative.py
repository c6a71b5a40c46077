"""Verification of speculative chunks: sample every row, keep the agreeing prefix.

A speculative chunk (``ScheduledChunk.spec_token_ids``: ``x_1 .. x_k`` after the request's
last token) has ``k + 1`` logits rows; row ``i`` predicts the token after ``x_1 .. x_i``.
Each row is sampled by the ordinary :class:`~asyncllm.worker.sampling.sampler.Sampler`, as
the row of a request whose output already holds ``x_1 .. x_i``: penalties count those tokens, the
``min_tokens`` mask and the noise of a seeded request use token index ``len(output) + i``.
Row ``i``'s token ``t_i`` is then what plain decoding would sample at that position had the
proposals before it been generated. The chunk yields ``t_0 .. t_j``, ``j`` the first row
whose ``t_j`` differs from the proposal ``x_{j+1}`` (``j = k``: every proposal accepted,
``t_k`` is the bonus token).

Greedy rows take the argmax, so greedy output is token-identical to decoding without
speculation. For a sampled row this is speculative rejection sampling with a point-mass draft
(Leviathan et al., 2023; Chen et al., 2023) in its coupled form: ``t_i`` is a draw from the
target distribution ``p`` (temperature, min-p, top-k, top-p and penalties applied exactly as
in plain sampling), so the proposal is accepted with probability ``p(x)``, and on rejection
the output is ``t_i`` given ``t_i != x``: a draw from ``p`` with ``x``'s mass removed and
renormalised. The output sequence is the one plain sampling draws with the same noise, so its
distribution is that of plain sampling, and a seeded request's output is identical to its
output without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncllm.worker.runner_output import RunnerOutput
from asyncllm.worker.sampling.batch import SamplingBatch
from asyncllm.worker.sampling.sampler import Sampler

__all__ = ["accept_prefix", "verify_chunks"]


@dataclass(frozen=True, slots=True)
class _Row:
    """A speculative row as the sampler reads a chunk: the request's output extended by the
    proposals before the row."""

    request_id: str
    params: Any
    num_output_tokens: int
    stop_token_ids: frozenset[int]
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


def spec_rows(chunk: Any) -> list[_Row]:
    """Rows ``1 .. k`` of a speculative chunk (row 0 is the chunk itself)."""
    proposals = list(chunk.spec_token_ids)
    output = list(chunk.output_token_ids)
    return [
        _Row(
            chunk.request_id,
            chunk.params,
            chunk.num_output_tokens + i,
            chunk.stop_token_ids,
            chunk.prompt_token_ids,
            output + proposals[:i],
        )
        for i in range(1, len(proposals) + 1)
    ]


def accept_prefix(targets: Sequence[int], proposals: Sequence[int]) -> int:
    """How many of ``targets`` (``k + 1`` row tokens) a chunk yields: one more than the
    proposals accepted (``proposals[i]`` is accepted while it equals ``targets[i]``)."""
    j = 0
    while j < len(proposals) and proposals[j] == targets[j]:
        j += 1
    return j + 1


def verify_chunks(
    sampler: Sampler,
    logits: torch.Tensor,
    chunks: Sequence[Any],
    device: torch.device,
    token_bitmask: tuple[torch.Tensor, list[int]] | None = None,
) -> RunnerOutput:
    """Sample and verify one step's sampled chunks, some of them speculative.

    Args:
        sampler: the runner's sampler.
        logits: ``[B + K, V]``: first one row per chunk (a speculative chunk's row 0, the
            position of its last token), then rows ``1 .. k`` of each speculative chunk, in
            chunk order (``K`` the step's proposals).
        chunks: the step's chunks with ``sample`` set (``ScheduledChunk`` s).
        device: the logits' device.
        token_bitmask: the grammar mask of the first ``B`` rows (requests with a grammar
            never speculate), or None.

    Returns:
        ``sampled``: each chunk's first token; ``spec_tokens``: per speculative chunk the
        tokens it yields (:func:`accept_prefix`); logprobs per yielded token where asked
        (``logprobs`` for the first, ``spec_logprobs`` for all of a speculative chunk's).
    """
    rows: list[Any] = list(chunks)
    extra_at: list[int] = []  # per chunk, the index of its row 1
    for c in chunks:
        extra_at.append(len(rows))
        if c.spec_token_ids:
            rows.extend(spec_rows(c))
    if token_bitmask is not None and token_bitmask[0].shape[0] < len(rows):
        # xgrammar's kernel reads one bitmask row per logits row; speculative rows are free.
        mask, constrained = token_bitmask
        pad = mask.new_full((len(rows) - mask.shape[0], mask.shape[1]), -1)
        token_bitmask = (torch.cat([mask, pad]), constrained)
    batch = SamplingBatch.from_chunks(rows, device, token_bitmask)
    result = sampler(logits, batch)
    tokens = result.token_ids.tolist()
    lists = None
    if result.logprobs is not None:
        lists = result.logprobs.to_lists([k or 0 for k in batch.num_logprobs])
    out = RunnerOutput({}, spec_tokens={})
    if lists is not None:
        out.logprobs, out.spec_logprobs = {}, {}
    for b, c in enumerate(chunks):
        rid = c.request_id
        out.sampled[rid] = tokens[b]
        wants = lists is not None and batch.num_logprobs[b] is not None
        if wants:
            assert lists is not None and out.logprobs is not None
            out.logprobs[rid] = lists[b]
        if not c.spec_token_ids:
            continue
        at = extra_at[b]
        order = [b, *range(at, at + len(c.spec_token_ids))]
        targets = [tokens[r] for r in order]
        n = accept_prefix(targets, c.spec_token_ids)
        assert out.spec_tokens is not None
        out.spec_tokens[rid] = targets[:n]
        if wants:
            assert lists is not None and out.spec_logprobs is not None
            out.spec_logprobs[rid] = [lists[r] for r in order[:n]]
    return out
