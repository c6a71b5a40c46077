"""Token sampling and logprobs over a whole batch at once.

One call handles every sampled row of a step with batched tensor operations, in vLLM's
order (see :mod:`asyncllm.sampling_params` for each parameter's definition and source):

1. raw logprobs: ``log_softmax`` of the model's logits, when any row asks for logprobs
   (:mod:`~asyncllm.worker.sampling.logprobs`);
2. ``logit_bias``, then the ``min_tokens`` mask (EOS and stop token ids to -inf while fewer
   than ``min_tokens`` tokens are generated), per row, from tensors built once per request
   (:class:`~asyncllm.worker.sampling.batch.RequestTensors`);
3. penalties: per-row token counts of the output (and a prompt mask for the repetition
   penalty) are built with one ``index_put_`` each over the flattened ids of the penalized
   rows, then applied as ``[B, V]`` tensor arithmetic (2 and 3:
   :mod:`~asyncllm.worker.sampling.logits_processors`);
3b. ``structured_outputs``: the step's token bitmask sets the tokens the grammar forbids to
   -inf, after everything that could raise a logit and before everything that picks a
   token; a greedy row is masked only when its grammar forbids its argmax
   (:mod:`~asyncllm.worker.sampling.grammar_mask`);
4. greedy rows take the argmax; the others divide by their temperature, apply min-p on the
   probabilities, then top-k and top-p, and draw with the exponential race, seeded rows
   from a generator of their own (:mod:`~asyncllm.worker.sampling.pick`).

A speculative chunk's rows are sampled here too, then verified
(:mod:`~asyncllm.worker.sampling.speculative`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncllm.worker.runner_output import RunnerOutput
from asyncllm.worker.sampling.batch import SamplingBatch
from asyncllm.worker.sampling.grammar_mask import GrammarRowCounts, constrained_argmax
from asyncllm.worker.sampling.logits_processors import process_logits
from asyncllm.worker.sampling.logprobs import LogprobsTensors, compute_logprobs
from asyncllm.worker.sampling.pick import draw, row_argmax
from asyncllm.worker.step_timing import StepTimings

__all__ = ["Sampler", "SamplerOutput", "sample_chunks"]


@dataclass(frozen=True)
class SamplerOutput:
    """What the sampler returns for B rows.

    Attributes:
        token_ids: ``[B]`` int64 sampled tokens.
        logprobs: raw logprobs of the sampled tokens and ``max_num_logprobs`` alternatives,
            or None when no row asked.
    """

    token_ids: torch.Tensor
    logprobs: LogprobsTensors | None = None


class Sampler:
    """Samples one token per row of a logits batch.

    Args:
        seed: seeds the generator used by rows without a seed of their own.
        device: where the logits live.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)
        self._row_generator = torch.Generator(device=device)
        #: Constrained rows so far, by how the grammar was applied (tests read these).
        self.grammar_rows = GrammarRowCounts()
        #: The step's timings while the engine has a step observer (the runner sets it).
        self.timings: StepTimings | None = None

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample.

        Args:
            logits: ``[B, vocab]`` raw model logits (any float dtype; computed in float32).
            batch: the rows' settings.

        Returns:
            The ``[B]`` int64 token ids and, when any row asks, their raw logprobs.
        """
        # The argmax of the raw logits is that of their float32 copy (widening is exact); at a
        # batch of 64 the copy was a fresh 12.6 MB allocation every step.
        tokens = row_argmax(logits) if batch.plain_greedy else self._pick(logits, batch)
        k = batch.max_num_logprobs
        lp = compute_logprobs(logits, tokens, k) if k is not None else None
        return SamplerOutput(tokens, lp)

    def _pick(self, raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The ``[B]`` tokens of rows that are processed, masked or sampled, from float32
        logits."""
        logits = process_logits(raw, batch)
        if batch.token_bitmask is None:
            tokens = row_argmax(logits)
        else:
            clock = self.timings
            if clock is not None:
                clock.lap("sample")
            logits, tokens = constrained_argmax(logits, raw, batch, self.grammar_rows)
            if clock is not None:
                clock.lap("grammar_mask")
        if not batch.all_greedy:
            rows = [r for r, t in enumerate(batch.temperatures.tolist()) if t > 0]
            tokens[rows] = draw(logits[rows], batch, rows, self._generator, self._row_generator)
        return tokens


def sample_chunks(
    sampler: Sampler,
    logits: torch.Tensor,
    chunks: Sequence[Any],
    device: torch.device,
    token_bitmask: tuple[torch.Tensor, list[int]] | None = None,
) -> RunnerOutput:
    """Sample the rows of ``chunks`` (the step's chunks with ``sample`` set, ``logits`` their
    rows in order; ``token_bitmask`` the grammars' mask of those rows, or None) and collect
    the logprobs they ask for."""
    batch = SamplingBatch.from_chunks(chunks, device, token_bitmask)
    result = sampler(logits, batch)
    tokens = result.token_ids.tolist()
    out = RunnerOutput({c.request_id: t for c, t in zip(chunks, tokens, strict=True)})
    if result.logprobs is not None:
        lists = result.logprobs.to_lists([k or 0 for k in batch.num_logprobs])
        out.logprobs = {
            c.request_id: lists[i]
            for i, (c, k) in enumerate(zip(chunks, batch.num_logprobs, strict=True))
            if k is not None
        }
    return out
