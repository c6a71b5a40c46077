"""Token sampling over a whole batch at once.

Greedy rows take the argmax. Other rows apply temperature, then top-k and top-p on one
descending sort of the logits, and draw with the exponential race (Gumbel-max in another
guise): ``argmax(p_i / q_i)`` with ``q_i ~ Exp(1)`` is a sample from ``p``. The noise ``q`` of a
seeded request comes from a generator seeded with :func:`derive_seed` of (seed, index of the
token), so its samples do not depend on what else shares the batch, nor on preemption.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, the usual odd mixing constant
_MASK63 = (1 << 63) - 1


def derive_seed(seed: int, token_index: int) -> int:
    """The generator seed for a request's ``token_index``-th generated token (63-bit)."""
    x = (seed * _GOLDEN + (token_index + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 31  # splitmix64 finalizer (Steele et al., 2014)
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 29)) & _MASK63


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings of one step.

    Attributes:
        temperatures: ``[B]`` float32; 0 means greedy.
        top_k: ``[B]`` int64; 0 means no limit.
        top_p: ``[B]`` float32 in (0, 1].
        seeds: per row, None or the request's seed.
        token_indices: per row, the index of the token being generated (0 for the first).
    """

    temperatures: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: Sequence[int | None]
    token_indices: Sequence[int]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool


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

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Sample.

        Args:
            logits: ``[B, vocab]`` float (any float dtype; computed in float32).
            batch: the rows' settings.

        Returns:
            ``[B]`` int64 token ids.
        """
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy
        temps = batch.temperatures.clamp_min(1e-5)[:, None]
        scaled = logits / temps
        if batch.any_top_k or batch.any_top_p:
            scaled, order = scaled.sort(dim=-1, descending=True)
            vocab = scaled.shape[-1]
            if batch.any_top_k:
                k = torch.where(batch.top_k > 0, batch.top_k, vocab)
                rank = torch.arange(vocab, device=logits.device)[None, :]
                scaled = scaled.masked_fill(rank >= k[:, None], float("-inf"))
            if batch.any_top_p:
                probs = scaled.softmax(dim=-1)
                before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
                scaled = scaled.masked_fill(before >= batch.top_p[:, None], float("-inf"))
        else:
            order = None
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for row, (seed, index) in enumerate(zip(batch.seeds, batch.token_indices, strict=True)):
            if seed is None:
                noise[row].exponential_(generator=self._generator)
            else:
                self._row_generator.manual_seed(derive_seed(seed, index))
                noise[row].exponential_(generator=self._row_generator)
        choice = (probs / noise).argmax(dim=-1)
        if order is not None:
            choice = order.gather(-1, choice[:, None])[:, 0]
        return torch.where(batch.temperatures == 0, greedy, choice)
