"""Logprobs from raw logits: of sampled tokens (:func:`compute_logprobs`, used by the
sampler) and of prompt tokens (``SamplingParams.prompt_logprobs``: :class:`PromptRows`,
:func:`prompt_logprobs`). Raw means before temperature, penalties and masks, as vLLM's
default ``logprobs_mode`` ("raw_logprobs"); computed in float32.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncllm.worker.runner_output import TokenLogprobs

__all__ = ["LogprobsTensors", "PromptRows", "compute_logprobs", "prompt_logprobs"]


@dataclass(frozen=True)
class LogprobsTensors:
    """Logprobs of N positions: the chosen token's and the top ``k`` alternatives.

    Attributes:
        token_logprobs: ``[N]`` float32 logprob of the chosen token.
        token_ranks: ``[N]`` int64 1-based rank of the chosen token (tokens with a logprob
            >= its own, as vLLM counts).
        top_ids: ``[N, k]`` int64 most likely tokens, best first.
        top_logprobs: ``[N, k]`` float32 their logprobs.
    """

    token_logprobs: torch.Tensor
    token_ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def to_lists(self, num_top: Sequence[int]) -> list[tuple[float, int, list[int], list[float]]]:
        """Per position ``(logprob, rank, top ids, top logprobs)``, the top lists cut to
        ``num_top[i]`` entries; one device-to-host copy per tensor."""
        lp = self.token_logprobs.tolist()
        rk = self.token_ranks.tolist()
        ids = self.top_ids.tolist()
        tlp = self.top_logprobs.tolist()
        return [(lp[i], rk[i], ids[i][:k], tlp[i][:k]) for i, k in enumerate(num_top)]


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Raw logprobs of ``token_ids`` under ``logits`` and the top ``k`` alternatives.

    Args:
        logits: ``[N, V]`` raw model logits (any float dtype; computed in float32).
        token_ids: ``[N]`` int64 chosen token per row.
        k: alternatives per row (>= 0).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1)
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
    else:
        top_lp = logprobs.new_empty((logprobs.shape[0], 0))
        top_ids = token_ids.new_empty((logprobs.shape[0], 0))
    return LogprobsTensors(chosen[:, 0], ranks, top_ids, top_lp)


@dataclass(frozen=True)
class PromptRows:
    """The logits rows of one chunk that score prompt tokens (``prompt_logprobs``).

    The row of position ``p`` scores prompt token ``p + 1``.

    Attributes:
        request_id: the request.
        first_token_index: index in the prompt of the token the first row scores (>= 1).
        target_ids: the prompt tokens scored, one per row.
        num_top: alternatives to return per row.
    """

    request_id: str
    first_token_index: int
    target_ids: list[int]
    num_top: int

    @classmethod
    def of_chunk(cls, chunk: Any) -> PromptRows | None:
        """The rows of a ``ScheduledChunk`` whose params ask for prompt logprobs, or None.

        The chunk computes positions ``[start_pos, start_pos + len(token_ids))``; those below
        the prompt's last position score the next prompt token.
        """
        k = getattr(chunk.params, "prompt_logprobs", None)
        if k is None:
            return None
        start = chunk.start_pos
        stop = min(start + len(chunk.token_ids), len(chunk.prompt_token_ids) - 1)
        if stop <= start:
            return None
        return cls(chunk.request_id, start + 1, chunk.prompt_token_ids[start + 1 : stop + 1], k)


def prompt_logprobs(
    logits: torch.Tensor, rows: Sequence[PromptRows]
) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """Score the prompt tokens of ``rows`` (their logits rows stacked in order, ``[N, V]``)
    in one batched pass."""
    targets = list(itertools.chain.from_iterable(r.target_ids for r in rows))
    num_top = [r.num_top for r in rows for _ in r.target_ids]
    ids = torch.tensor(targets, dtype=torch.long, device=logits.device)
    lists = compute_logprobs(logits, ids, max(num_top)).to_lists(num_top)
    out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    i = 0
    for r in rows:
        out[r.request_id] = (r.first_token_index, lists[i : i + len(r.target_ids)])
        i += len(r.target_ids)
    return out
