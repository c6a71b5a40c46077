"""Picking each row's token from its processed logits: the greedy pick (:func:`row_argmax`)
and the draw of a sampled row (:func:`draw`).

A sampled row is divided by its temperature, then min-p is applied on the probabilities,
then top-k and top-p (:func:`top_k_top_p`: a cut-off logit per row found among its best few
hundred logits, a full sort only for rows too flat to decide there), and the token drawn
with the exponential race (Gumbel-max in another guise): ``argmax(p_i / q_i)`` with
``q_i = -log U_i ~ Exp(1)`` is a sample from ``p``.

The noise ``U`` of a seeded request comes from a generator seeded with :func:`derive_seed` of
(seed, index of the token), drawn over the whole vocabulary in token-id order, so its samples
do not depend on what else shares the batch, nor on preemption; that is the one per-row loop.
Unseeded rows draw their noise in one call from the engine's generator.
"""

from __future__ import annotations

import functools

import torch

from asyncllm.worker.sampling.batch import SamplingBatch

__all__ = ["derive_seed", "draw", "row_argmax", "top_k_top_p"]

_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, the usual odd mixing constant
_MASK63 = (1 << 63) - 1


@functools.lru_cache(maxsize=64)
def _argmax_chunk(vocab: int) -> int:
    """The divisor of ``vocab`` nearest 1024 within [256, 4096]; 0 when there is none."""
    for d in sorted(range(256, 4097), key=lambda d: abs(d - 1024)):
        if vocab % d == 0:
            return d
    return 0


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a ``[B, V]`` tensor, the same indices (the first maximum; the
    first NaN where a row has one), in two vectorized passes.

    torch's CPU argmax reduces element by element with the running index; ``amax`` is
    vectorized. So: the max of each of ``V / c`` chunks (``c`` a divisor of ``V`` near 1024),
    the first chunk holding the row's max, then argmax over that chunk only: much faster than
    torch's argmax at the sampler's shapes (docs/tuning.md, "Costs behind smaller code
    choices").

    Returns:
        ``[B]`` int64 indices.
    """
    rows, vocab = x.shape
    c = _argmax_chunk(vocab)
    if c == 0 or not x.is_contiguous():
        return x.argmax(dim=-1)
    starts = x.view(rows, vocab // c, c).amax(dim=-1).argmax(dim=-1) * c
    offsets = torch.arange(c, device=x.device)
    return starts + x.gather(1, starts[:, None] + offsets).argmax(dim=-1)


def derive_seed(seed: int, token_index: int) -> int:
    """The generator seed for a request's ``token_index``-th generated token (63-bit)."""
    x = (seed * _GOLDEN + (token_index + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 31  # splitmix64 finalizer (Steele et al., 2014)
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 29)) & _MASK63


def draw(
    logits: torch.Tensor,
    batch: SamplingBatch,
    rows: list[int],
    generator: torch.Generator,
    row_generator: torch.Generator,
) -> torch.Tensor:
    """Draw for the non-greedy ``rows`` (``logits`` holds just those rows, ``[R, V]``
    float32); unseeded rows draw their noise from ``generator``, seeded ones from
    ``row_generator`` reseeded per row (module docstring).

    Returns:
        ``[R]`` int64 token ids.
    """
    dev = logits.device
    scaled = logits / batch.temperatures[rows].clamp_min(1e-5)[:, None]
    if batch.any_min_p and batch.min_p is not None:
        probs = scaled.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * batch.min_p[rows][:, None]
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    if batch.any_top_k or batch.any_top_p:
        scaled = top_k_top_p(scaled, batch.top_k[rows], batch.top_p[rows])
    probs = scaled.softmax(dim=-1)
    # Exponential race noise q = -log(U), U uniform in [tiny, 1): one vocabulary-order
    # draw per row, so a seeded row meets the same noise whatever shares its batch.
    noise = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(rows) if batch.seeds[r] is None]
    if unseeded:
        fresh = torch.empty((len(unseeded), probs.shape[-1]), device=dev)
        noise[unseeded] = fresh.uniform_(generator=generator)
    for i, r in enumerate(rows):
        seed = batch.seeds[r]
        if seed is not None:
            row_generator.manual_seed(derive_seed(seed, batch.token_indices[r]))
            noise[i].uniform_(generator=row_generator)
    noise = noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_().neg_()
    return row_argmax(probs / noise)


#: Candidates :func:`top_k_top_p` examines before falling back to a full sort of a row.
TOP_CANDIDATES = 256


def _keep_counts(
    vals: torch.Tensor, k: torch.Tensor, p: torch.Tensor, lse: torch.Tensor
) -> torch.Tensor:
    """How many of each row's best tokens top-k then top-p keep.

    Args:
        vals: ``[R, C]`` the row's C largest logits, descending.
        k: ``[R]`` top-k (the vocabulary size when off).
        p: ``[R]`` top-p (1 when off).
        lse: ``[R]`` log of the normaliser of the top-k set (its logsumexp).
    """
    cols = vals.shape[-1]
    in_k = torch.arange(cols, device=vals.device)[None, :] < k[:, None]
    probs = (vals - lse[:, None]).exp().masked_fill(~in_k, 0.0)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    by_p = ((before < p[:, None]) & in_k).sum(dim=-1)
    return torch.where(p < 1.0, by_p, k.clamp_max(cols))


def top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits outside each row's top-k, then outside its top-p nucleus of the
    renormalised top-k distribution (vLLM's order). Ties with the last kept logit are kept.

    Works on the rows' :data:`TOP_CANDIDATES` best logits (one ``topk``); only rows whose
    nucleus is not decided among them (flat distributions) are fully sorted.

    Args:
        scaled: ``[R, V]`` float32 temperature-scaled logits.
        top_k: ``[R]`` int64, 0 = off.
        top_p: ``[R]`` float32 in (0, 1], 1 = off.
    """
    vocab = scaled.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp_max(vocab)
    finite_k = [x for x in k.tolist() if x < vocab]
    cap = min(vocab, max([TOP_CANDIDATES, *finite_k]))
    vals = scaled.topk(cap, dim=-1).values
    # k <= cap: the top-k set is among the candidates; otherwise k is the whole vocabulary.
    in_k = torch.arange(cap, device=scaled.device)[None, :] < k[:, None]
    lse = torch.where(
        k <= cap, vals.masked_fill(~in_k, float("-inf")).logsumexp(-1), scaled.logsumexp(-1)
    )
    keep = _keep_counts(vals, k, top_p, lse)
    cutoff = vals.gather(-1, (keep - 1)[:, None])
    undecided = ((k > cap) & (top_p < 1.0) & (keep == cap)).nonzero()[:, 0]
    if len(undecided):
        full = scaled[undecided].sort(dim=-1, descending=True).values
        n = _keep_counts(full, k[undecided], top_p[undecided], lse[undecided])
        cutoff[undecided] = full.gather(-1, (n - 1)[:, None])
    active = (k < vocab) | (top_p < 1.0)
    return scaled.masked_fill(active[:, None] & (scaled < cutoff), float("-inf"))
