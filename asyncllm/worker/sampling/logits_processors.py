"""The logits processors a row goes through before its token is picked, in vLLM's order
(see :mod:`asyncllm.sampling_params` for each parameter's definition and source):
``logit_bias``, then the ``min_tokens`` ban (EOS and stop token ids to -inf while fewer than
``min_tokens`` tokens are generated), then the repetition, frequency and presence penalties
as ``[B, V]`` tensor arithmetic over per-row token counts.
"""

from __future__ import annotations

import torch

from asyncllm.worker.sampling.batch import SamplingBatch

__all__ = ["apply_penalties", "process_logits"]

_MAX_LOGIT = 1e30  # penalized logits are clamped to this magnitude


def process_logits(raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``[B, V]`` float32 logits with every row's bias, ban and penalties applied.

    Args:
        raw: ``[B, V]`` raw model logits (any float dtype); left unchanged (a float32
            ``raw`` is returned as is when no row has a bias, a ban or a penalty).
        batch: the rows' settings.
    """
    logits = raw.float()
    if batch.bias is not None or batch.banned is not None:
        logits = logits.clone()  # the caller's logits stay raw
        for row, ids, vals in batch.bias or ():
            logits[row].index_add_(0, ids, vals)
        for row, ids in batch.banned or ():
            logits[row, ids] = float("-inf")
    logits = apply_penalties(logits, batch)
    if batch.repetition is not None:
        # An extreme (still valid) penalty can overflow to +-inf; keep softmax finite.
        logits = logits.clamp(-_MAX_LOGIT, _MAX_LOGIT)
    return logits


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (CTRL), frequency and presence penalties over ``[B, V]`` float32 logits.

    See :mod:`asyncllm.sampling_params` for the definitions. Rows without penalties carry
    neutral values (1, 0, 0) and no ids, so they come out unchanged.
    """
    if batch.output_ids is None or batch.repetition is None:
        return logits
    assert batch.frequency is not None and batch.presence is not None
    counts = torch.zeros_like(logits)
    rows, ids = batch.output_ids
    counts.index_put_((rows, ids), torch.ones_like(ids, dtype=logits.dtype), accumulate=True)
    generated = counts > 0
    seen = generated
    if batch.prompt_ids is not None:
        seen = generated.clone()
        seen[batch.prompt_ids] = True
    rep = batch.repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - batch.frequency[:, None] * counts
    return logits - batch.presence[:, None] * generated.to(logits.dtype)
