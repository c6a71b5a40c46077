"""``structured_outputs`` in the sampler: the step's token bitmask (one per constrained
row, filled by the engine's grammar matchers) sets the tokens the grammar forbids to -inf
(xgrammar's kernel, one call for the sampled rows, one for the forbidden greedy picks), after
everything that could raise a logit and before everything that picks a token: temperature,
min-p, top-k and top-p only ever see allowed tokens. When a grammar allows only tokens
``min_tokens`` bans (its output is complete: only EOS may follow), the grammar wins for that
row. A sampled row is masked before its draw; a greedy row is masked only when its grammar
forbids its argmax (then its argmax is taken again).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncllm.worker.sampling.batch import SamplingBatch
from asyncllm.worker.sampling.pick import row_argmax

__all__ = ["GrammarRowCounts", "constrained_argmax"]


def constrained_argmax(
    logits: torch.Tensor, raw: torch.Tensor, batch: SamplingBatch, counts: GrammarRowCounts
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the step's grammars (module docstring) and take every row's argmax; the rows
    are counted in ``counts``.

    A sampled constrained row (temperature > 0) is masked before anything else: its draw
    must see only allowed tokens. A greedy one is checked first (:func:`_apply_grammar`):
    masked, and its argmax taken again, only when its grammar forbids its argmax.

    Why no "mask first" for greedy rows that keep being forbidden: W1J on the default
    model (64 greedy rows, float32, 1 thread; ``benchmarks/structured_cost.py
    --policies`` at 6e715d6, two interleaved rounds on a loaded 2-core machine) masked
    3,242 of 4,096 rows with a batch-wide mask-first policy (16 steps after a step with
    most picks forbidden: grammar 3.84% of the step), 3,351 with a per-request one
    (3.29%), and 1,062 checking every pick (2.37%): re-taking a masked row's argmax
    (``row_argmax``) costs a tenth of masking it.

    Args:
        logits: ``[B, V]`` float32 processed logits (:mod:`.logits_processors`).
        raw: ``[B, V]`` the model's raw logits (kept for logprobs and banned rows).
        batch: the rows' settings, with a ``token_bitmask``.
        counts: the sampler's counters of constrained rows.

    Returns:
        the logits (masked where a row was masked) and the ``[B]`` argmax tokens.
    """
    assert batch.token_bitmask is not None
    _, rows = batch.token_bitmask
    temps = batch.temperatures.tolist()
    sampled = [r for r in rows if temps[r] != 0]
    greedy = [r for r in rows if temps[r] == 0]
    if sampled:
        logits, _ = _apply_grammar(logits, raw, batch, sampled, None)
    tokens = row_argmax(logits)
    forbidden: list[int] = []
    if greedy:
        logits, forbidden = _apply_grammar(logits, raw, batch, greedy, tokens)
    counts.sampled += len(sampled)
    counts.checked += len(greedy)
    counts.forbidden += len(forbidden)
    return logits, tokens


def _apply_grammar(
    logits: torch.Tensor,
    raw: torch.Tensor,
    batch: SamplingBatch,
    rows: list[int],
    best: torch.Tensor | None,
) -> tuple[torch.Tensor, list[int]]:
    """Mask the tokens the grammars of ``rows`` (constrained rows) forbid (see the module
    docstring).

    Given ``best`` (the argmax of ``logits``; ``rows`` then greedy), a row whose best token
    its grammar allows is left as it is: masking only lowers other tokens, so that token
    stays the first maximum and greedy sampling reads nothing else. While a model follows
    its grammar that skips most of the mask's cost (xgrammar's CPU kernel takes far longer
    per row than the row's argmax: docs/tuning.md, "Costs behind smaller code choices"); a
    forbidden pick's
    row is masked and its argmax taken again, here (so the bench's timing of this function
    holds all of the grammar's sampler work). ``best`` None: every row of ``rows`` is masked.

    Returns:
        the logits and the rows masked (with ``best``: its entries for them taken again).
    """
    assert batch.token_bitmask is not None
    bitmask = batch.token_bitmask[0]
    if best is not None and rows:
        index = torch.tensor(rows)
        picks = best.cpu()[index]
        bits = (bitmask[index, picks >> 5].long() >> (picks & 31)) & 1
        rows = [r for r, ok in zip(rows, bits.tolist(), strict=True) if not ok]
    if not rows:
        return logits, []
    logits = _mask_rows(logits, raw, batch, rows)
    if best is not None:  # the masked rows' argmax, again (here: timed as the grammar's)
        best[rows] = row_argmax(logits[rows])
    return logits, rows


def _mask_rows(
    logits: torch.Tensor, raw: torch.Tensor, batch: SamplingBatch, rows: list[int]
) -> torch.Tensor:
    """Apply the step's token bitmask to ``rows`` (for :func:`_apply_grammar`)."""
    from asyncllm.structured_output import apply_token_bitmask

    assert batch.token_bitmask is not None
    bitmask = batch.token_bitmask[0]
    # float32 logits untouched so far are the raw ones: keep those for logprobs and for the
    # rows below (else mask in place: a copy of a [64, 49152] batch costs milliseconds).
    keep_raw = batch.max_num_logprobs is not None or batch.banned is not None
    if keep_raw and logits.data_ptr() == raw.data_ptr():
        logits = logits.clone()
    apply_token_bitmask(logits, bitmask, rows)
    if batch.banned is not None:
        top = logits[rows].amax(dim=-1).tolist()
        dead = [r for r, m in zip(rows, top, strict=True) if m == float("-inf")]
        if dead:  # the grammar allows only banned (stop) tokens: the grammar wins
            logits[dead] = raw[dead].float()
            apply_token_bitmask(logits, bitmask, dead)
    return logits


@dataclass
class GrammarRowCounts:
    """Constrained rows a :class:`Sampler` has seen, by how their grammar was applied.

    Attributes:
        sampled: sampled rows (temperature > 0), masked before their draw.
        checked: greedy rows whose argmax was checked against the bitmask.
        forbidden: checked rows whose argmax was forbidden (masked, argmax taken again).
    """

    sampled: int = 0
    checked: int = 0
    forbidden: int = 0
