"""A step's sampled rows as tensors: each row's settings (:class:`SamplingBatch`) and the
tensors made once per request from its fixed data (:class:`RequestTensors`).

See :mod:`asyncllm.sampling_params` for each parameter's definition and source; the sampler
(:mod:`asyncllm.worker.sampling.sampler`) reads a batch.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncllm.sampling_params import SamplingParams

__all__ = ["RequestTensors", "SamplingBatch"]

_MIN_TOP_P = 1e-30  # the smallest top_p kept distinct from 0 in float32 (keeps the top token)


#: The most elements :class:`RequestTensors` keeps (int64/float32: at most ~64 MiB).
_CACHE_ELEMENTS = 2**23


class RequestTensors:
    """Tensors made from a request's fixed per-request data (its ``logit_bias``, its stop
    token ids), built once per request instead of once per step.

    Those collections hold up to a vocabulary's worth of entries each (49,152 for SmolLM2);
    turning them into tensors in Python at every step took 5 s per step for 64 samples with a
    full-vocabulary ``logit_bias``, stalling every stream. Entries are keyed by the source
    object's identity (the same object at every step of a request: the request's params and
    stop ids), keep that object alive (so an id is never reused while cached), and are
    evicted least recently used past ``max_elements`` elements in all.

    Args:
        max_elements: the most tensor elements kept.
    """

    def __init__(self, max_elements: int = _CACHE_ELEMENTS) -> None:
        self._max = max_elements
        self._size = 0
        self._entries: OrderedDict[
            tuple[int, str, str], tuple[object, tuple[torch.Tensor, ...], int]
        ] = OrderedDict()

    def get(
        self,
        source: object,
        kind: str,
        device: torch.device,
        build: Callable[[], tuple[torch.Tensor, ...]],
    ) -> tuple[torch.Tensor, ...]:
        """The tensors of ``source`` (``build()`` the first time, moved to ``device``)."""
        key = (id(source), kind, str(device))
        hit = self._entries.get(key)
        if hit is not None and hit[0] is source:
            self._entries.move_to_end(key)
            return hit[1]
        tensors = tuple(t.to(device) for t in build())
        size = sum(t.numel() for t in tensors)
        self._entries[key] = (source, tensors, size)
        self._size += size
        while self._size > self._max and len(self._entries) > 1:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self._size -= dropped
        return tensors


_REQUEST_TENSORS = RequestTensors()


def _bias_tensors(bias: dict[int, float]) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(list(bias), dtype=torch.long),
        torch.tensor(list(bias.values()), dtype=torch.float32),
    )


def _sorted_ids(ids: Any) -> tuple[torch.Tensor]:
    return (torch.tensor(sorted(ids), dtype=torch.long),)


def _flat_ids(
    lists: Sequence[Sequence[int]], rows: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row index, token id)`` int64 pairs of every id of ``lists[i]`` for row ``rows[i]``."""
    lengths = torch.tensor([len(x) for x in lists], dtype=torch.long)
    ids = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.long)
    row_idx = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.long), lengths)
    return row_idx.to(device), ids.to(device)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings of one step (B rows; V = vocabulary size).

    Attributes:
        temperatures: ``[B]`` float32; 0 means greedy.
        top_k: ``[B]`` int64; 0 means no limit.
        top_p: ``[B]`` float32 in (0, 1].
        min_p: ``[B]`` float32 in [0, 1].
        seeds: per row, None or the request's seed.
        token_indices: per row, the index of the token being generated (0 for the first).
        all_greedy, any_top_k, any_top_p, any_min_p: shortcuts.
        presence, frequency, repetition: ``[B]`` float32 penalties (0, 0, 1 = off), or None
            when no row has a penalty.
        output_ids: ``([N], [N])`` int64 (row, token id) of the penalized rows' generated
            tokens, or None.
        prompt_ids: the same for the prompts of rows with a repetition penalty, or None.
        bias: per biased row ``(row, token ids [M] int64, values [M] float32)``, or None.
        banned: per row in ``min_tokens`` ``(row, token ids [K] int64)`` set to -inf, or
            None. Per row, not flattened: the tensors are the request's own, built once
            (:class:`RequestTensors`), so a step joins none of them.
        num_logprobs: per row, None or how many top alternatives to return.
        token_bitmask: ``(bitmask [>= B, ceil(V / 32)] int32 on CPU, constrained rows)``
            from ``GrammarMatchers.fill`` (bit 0: the token is not allowed), or None.
    """

    temperatures: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: Sequence[int | None]
    token_indices: Sequence[int]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    min_p: torch.Tensor | None = None
    any_min_p: bool = False
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    output_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    prompt_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    bias: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None
    banned: list[tuple[int, torch.Tensor]] | None = None
    num_logprobs: Sequence[int | None] = ()
    token_bitmask: tuple[torch.Tensor, list[int]] | None = None

    @property
    def plain_greedy(self) -> bool:
        """Every row takes the argmax of its raw logits: greedy, no penalty, bias, banned
        token or grammar."""
        return (
            self.all_greedy
            and self.repetition is None
            and self.bias is None
            and self.banned is None
            and self.token_bitmask is None
        )

    @property
    def max_num_logprobs(self) -> int | None:
        """The largest ``logprobs`` of any row, or None when no row asks."""
        asked = [k for k in self.num_logprobs if k is not None]
        return max(asked) if asked else None

    @classmethod
    def from_chunks(
        cls,
        chunks: Sequence[Any],
        device: torch.device,
        token_bitmask: tuple[torch.Tensor, list[int]] | None = None,
    ) -> SamplingBatch:
        """Build the batch of a step's sampled chunks (``ScheduledChunk`` s, in row order);
        ``token_bitmask`` is kept as is (see the attribute).

        Reads each chunk's ``params`` (:class:`SamplingParams`), ``num_output_tokens``,
        ``stop_token_ids``, and, for penalized rows, the ``prompt_token_ids`` and
        ``output_token_ids`` the chunk references. One pass over the requests; token ids are
        flattened and converted to tensors in one call each.
        """
        params: list[SamplingParams] = [c.params for c in chunks]
        temps = [0.0 if p.greedy else p.temperature for p in params]
        rows = range(len(chunks))
        pen = [i for i in rows if params[i].has_penalties]
        presence = frequency = repetition = None
        output_ids = prompt_ids = None
        if pen:
            presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
            frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
            repetition = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
            presence, frequency, repetition = (
                t.to(device) for t in (presence, frequency, repetition)
            )
            output_ids = _flat_ids([chunks[i].output_token_ids for i in pen], pen, device)
            rep = [i for i in pen if params[i].repetition_penalty != 1.0]
            if rep:
                prompt_ids = _flat_ids([chunks[i].prompt_token_ids for i in rep], rep, device)
        bias: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None
        biased = [i for i in rows if params[i].logit_bias]
        if biased:  # tensors built once per request (RequestTensors), not per step
            bias = []
            for i in biased:
                ids, vals = _REQUEST_TENSORS.get(
                    params[i], "logit_bias", device,
                    lambda i=i: _bias_tensors(params[i].logit_bias),  # type: ignore[misc,arg-type]
                )  # fmt: skip
                bias.append((i, ids, vals))
        banned: list[tuple[int, torch.Tensor]] | None = None
        young = [
            i
            for i in rows
            if chunks[i].num_output_tokens < params[i].min_tokens and chunks[i].stop_token_ids
        ]
        if young:
            banned = []
            for i in young:
                (stop_ids,) = _REQUEST_TENSORS.get(
                    chunks[i].stop_token_ids, "stop_ids", device,
                    lambda i=i: _sorted_ids(chunks[i].stop_token_ids),  # type: ignore[misc]
                )  # fmt: skip
                banned.append((i, stop_ids))
        return cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            # float32 rounds a valid top_p below ~1e-45 to 0, which would mask every token.
            top_p=torch.tensor(
                [max(p.top_p, _MIN_TOP_P) for p in params], dtype=torch.float32, device=device
            ),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            seeds=[p.seed for p in params],
            token_indices=[c.num_output_tokens for c in chunks],
            all_greedy=all(t == 0.0 for t in temps),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
            presence=presence,
            frequency=frequency,
            repetition=repetition,
            output_ids=output_ids,
            prompt_ids=prompt_ids,
            bias=bias,
            banned=banned,
            num_logprobs=[p.logprobs for p in params],
            token_bitmask=token_bitmask,
        )
