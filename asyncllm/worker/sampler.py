"""Token sampling and logprobs over a whole batch at once.

One call handles every sampled row of a step with batched tensor operations, in vLLM's
order (see :mod:`asyncllm.sampling_params` for each parameter's definition and source):

1. raw logprobs: ``log_softmax`` of the model's logits, when any row asks for logprobs;
2. ``logit_bias``, then the ``min_tokens`` mask (EOS and stop token ids to -inf while fewer
   than ``min_tokens`` tokens are generated), per row, from tensors built once per request
   (:class:`RequestTensors`);
3. penalties: per-row token counts of the output (and a prompt mask for the repetition
   penalty) are built with one ``index_put_`` each over the flattened ids of the penalized
   rows, then applied as ``[B, V]`` tensor arithmetic;
3b. ``structured_outputs``: the step's token bitmask (one per constrained row, filled by the
   engine's grammar matchers) sets the tokens the grammar forbids to -inf (xgrammar's
   kernel, one call for the sampled rows, one for the forbidden greedy picks), after
   everything that could raise a logit and before everything that picks a token:
   temperature, min-p, top-k and top-p only ever see allowed tokens. When a grammar allows
   only tokens ``min_tokens`` bans (its output is complete: only EOS may follow), the
   grammar wins for that row. A sampled row is masked before its draw; a greedy row is
   masked only when its grammar forbids its argmax (then its argmax is taken again);
4. greedy rows take the argmax; the others divide by their temperature, apply min-p on the
   probabilities, then top-k and top-p (:func:`top_k_top_p`: a cut-off logit per row found
   among its best few hundred logits, a full sort only for rows too flat to decide there),
   and draw with the exponential race (Gumbel-max in another guise): ``argmax(p_i / q_i)``
   with ``q_i = -log U_i ~ Exp(1)`` is a sample from ``p``.

The noise ``U`` of a seeded request comes from a generator seeded with :func:`derive_seed` of
(seed, index of the token), drawn over the whole vocabulary in token-id order, so its samples
do not depend on what else shares the batch, nor on preemption; that is the one per-row loop.
Unseeded rows draw their noise in one call from the engine's generator.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.argmax import row_argmax
from asyncllm.worker.logprobs import LogprobsTensors, compute_logprobs
from asyncllm.worker.runner_output import RunnerOutput
from asyncllm.worker.step_timing import StepTimings

_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, the usual odd mixing constant
_MASK63 = (1 << 63) - 1


_MIN_TOP_P = 1e-30  # the smallest top_p kept distinct from 0 in float32 (keeps the top token)
_MAX_LOGIT = 1e30  # penalized logits are clamped to this magnitude


def derive_seed(seed: int, token_index: int) -> int:
    """The generator seed for a request's ``token_index``-th generated token (63-bit)."""
    x = (seed * _GOLDEN + (token_index + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 31  # splitmix64 finalizer (Steele et al., 2014)
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 29)) & _MASK63


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
        if batch.token_bitmask is None:
            tokens = row_argmax(logits)
        else:
            clock = self.timings
            if clock is not None:
                clock.lap("sample")
            logits, tokens = self._constrained_argmax(logits, raw, batch)
            if clock is not None:
                clock.lap("grammar_mask")
        if not batch.all_greedy:
            rows = [r for r, t in enumerate(batch.temperatures.tolist()) if t > 0]
            tokens[rows] = self._sample(logits[rows], batch, rows)
        return tokens

    def _constrained_argmax(
        self, logits: torch.Tensor, raw: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the step's grammars (module docstring, 3b) and take every row's argmax.

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
        counts = self.grammar_rows
        counts.sampled += len(sampled)
        counts.checked += len(greedy)
        counts.forbidden += len(forbidden)
        return logits, tokens

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> torch.Tensor:
        """Draw for the non-greedy ``rows`` (``logits`` holds just those rows)."""
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
            draw = torch.empty((len(unseeded), probs.shape[-1]), device=dev)
            noise[unseeded] = draw.uniform_(generator=self._generator)
        for i, r in enumerate(rows):
            seed = batch.seeds[r]
            if seed is not None:
                self._row_generator.manual_seed(derive_seed(seed, batch.token_indices[r]))
                noise[i].uniform_(generator=self._row_generator)
        noise = noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_().neg_()
        return row_argmax(probs / noise)


def _apply_grammar(
    logits: torch.Tensor,
    raw: torch.Tensor,
    batch: SamplingBatch,
    rows: list[int],
    best: torch.Tensor | None,
) -> tuple[torch.Tensor, list[int]]:
    """Mask the tokens the grammars of ``rows`` (constrained rows) forbid (see the module
    docstring, 3b).

    Given ``best`` (the argmax of ``logits``; ``rows`` then greedy), a row whose best token
    its grammar allows is left as it is: masking only lowers other tokens, so that token
    stays the first maximum and greedy sampling reads nothing else. While a model follows
    its grammar that skips most of the mask's cost (xgrammar's CPU kernel: ~0.2 ms per row
    of 49,152 logits on 1 thread, against ~0.02 ms for the row's argmax); a forbidden pick's
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
