"""Model-free speculative decoding in the core: proposals into the plan, verified tokens back.

A decoding request whose n-gram index (:class:`~asyncllm.core.ngram.NgramIndex`) proposes
tokens computes, in one step, its last sampled token followed by the ``k`` proposals: a chunk
of ``1 + k`` tokens whose rows are all sampled (``ScheduledChunk.spec_token_ids``). The
worker verifies them (:mod:`asyncllm.worker.sampling.speculative`) and returns the tokens it
accepted: the proposals that equal what the model samples at their position, then the model's
own token at the first mismatch (or a bonus token after all ``k``), ``1 + a`` tokens for ``a``
accepted proposals (Leviathan et al., 2023, "Fast Inference from Transformers via Speculative
Decoding", with a point-mass draft).

Then (:meth:`Speculation.apply`) the request appends them one by one, stopping at the first
stop condition (the rest are dropped), and its ``num_computed_tokens`` rolls back to the
accepted prefix: the last token and the ``a`` accepted proposals have valid K/V; the K/V
written at rejected positions is overwritten by later steps. Prefix caching registers only
full blocks below ``num_computed_tokens``, so a block holding rejected K/V is never cached;
the blocks allocated past the need stay with the request for its next step (freed with it).

Adaptive length, per request: after a step that accepted every proposal the next proposal may
be twice as long (up to ``speculative_tokens``); after a rejection at position ``a`` it is at
most ``a + 1``; a request whose proposals keep being rejected pauses for a growing number of
steps (:meth:`RequestSpeculation.record`). Speculation steps aside in steps with at least
``speculative_disable_by_batch_size`` decoding requests (vLLM's option name), where the
verification rows cost more than they save (docs/tuning.md), and never makes a request
preempt another: when the blocks for the proposals are not free the request decodes plainly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from asyncllm.core.ngram import NgramIndex
from asyncllm.core.plan import RequestUpdate, ScheduledChunk, SchedulerOutput
from asyncllm.core.request import Request

if TYPE_CHECKING:
    from asyncllm.core.scheduler import Scheduler

__all__ = ["RequestSpeculation", "SpecConfig", "Speculation"]


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """The engine's speculative decoding settings (``EngineConfig``'s fields of the same
    names).

    Attributes:
        num_tokens: the most tokens proposed per request and step (>= 1).
        min_n: the shortest n-gram looked up (tokens).
        max_n: the longest.
        disable_by_batch_size: no speculation in a step with at least this many decoding
            requests.
    """

    num_tokens: int
    min_n: int
    max_n: int
    disable_by_batch_size: int


class RequestSpeculation:
    """One request's proposer: its n-gram index and its current proposal length.

    Args:
        config: the engine's settings.
    """

    __slots__ = ("index", "k", "max_k", "misses", "pause")

    def __init__(self, config: SpecConfig) -> None:
        self.index = NgramIndex(config.min_n, config.max_n)
        self.max_k = config.num_tokens
        #: The proposal length now (adapted to the request's acceptance).
        self.k = config.num_tokens
        #: Verifications in a row that accepted nothing.
        self.misses = 0
        #: Steps left without proposals (after ``misses`` reached 2).
        self.pause = 0

    def propose(self, request: Request, limit: int) -> list[int]:
        """At most ``min(k, limit)`` proposals after the request's tokens (the index catches
        up with tokens appended since the last call first); [] while paused."""
        if self.pause > 0:
            self.pause -= 1
            return []
        index = self.index
        if len(index) < request.num_tokens:
            index.extend(request.token_ids(len(index), request.num_tokens))
        return index.propose(min(self.k, limit))

    def record(self, proposed: int, accepted: int) -> None:
        """Adapt to one verification: ``k`` doubled after full acceptance, else at most one
        more than the proposals accepted; after 2, 3, 4 ... verifications in a row that
        accepted nothing, no proposals for 2, 4, 8 ... (at most 32) steps."""
        if accepted >= proposed:
            self.k = min(self.max_k, max(1, 2 * proposed))
        else:
            self.k = max(1, min(self.k, accepted + 1))
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses >= 2:
            self.pause = min(2 ** (self.misses - 1), 32)


class Speculation:
    """The scheduler's side of speculative decoding, and its counters.

    Args:
        config: the settings.

    Attributes:
        num_draft_tokens: proposals verified so far.
        num_accepted_tokens: of which accepted.
        num_spec_steps: verifications (one per request and step that speculated).
        num_emitted_tokens: tokens those verifications produced (accepted plus the model's
            own one; before stop conditions drop any).
    """

    def __init__(self, config: SpecConfig) -> None:
        self.config = config
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_spec_steps = 0
        self.num_emitted_tokens = 0

    def active(self, num_decodes: int) -> bool:
        """Whether a step with ``num_decodes`` decoding requests speculates."""
        return num_decodes < self.config.disable_by_batch_size

    def chunk(
        self, sched: Scheduler, request: Request, extra: int, out: SchedulerOutput
    ) -> ScheduledChunk | None:
        """The speculative chunk of a decoding request (its last token plus at most
        ``extra`` proposals), its blocks allocated; None (nothing changed) when the request
        does not speculate, nothing is proposed or the blocks are not free."""
        spec = request.spec
        if spec is None:
            return None
        limit = min(
            extra,
            request.max_tokens - len(request.output_token_ids) - 1,
            request.max_model_len - request.num_tokens - 1,
        )
        if limit < 1:
            return None
        proposals = spec.propose(request, limit)
        if not proposals:
            return None
        start = request.num_computed_tokens
        n = 1 + len(proposals)
        bm = sched.block_manager
        if not bm.allocate(request.request_id, start + n, write_from=start, copies=out.copies):
            return None
        plain = sched._chunk(request, 1)
        return replace(
            plain, token_ids=plain.token_ids + proposals, spec_token_ids=tuple(proposals)
        )

    def apply(
        self,
        sched: Scheduler,
        request: Request,
        chunk: ScheduledChunk,
        tokens: list[int],
        updates: list[RequestUpdate],
    ) -> None:
        """Append a verified chunk's ``tokens`` (stopping at the first stop condition), roll
        ``num_computed_tokens`` back to the accepted prefix, register its full blocks in the
        prefix cache, free the blocks allocated for rejected proposals and sliding groups'
        blocks behind the window."""
        proposed = len(chunk.spec_token_ids)
        accepted = len(tokens) - 1
        self.num_spec_steps += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        self.num_emitted_tokens += len(tokens)
        if request.spec is not None:
            request.spec.record(proposed, accepted)
        rid = request.request_id
        for token in tokens:
            status = request.append_token(token)
            if status is not None:
                sched.running.remove(request)
                sched._finish(request, status)
                updates.append(RequestUpdate(rid, token, status.finish_reason))
                return
            updates.append(RequestUpdate(rid, token, None))
        # K/V is valid for the chunk's first token and the accepted proposals.
        request.num_computed_tokens += len(tokens)
        done = request.num_computed_tokens
        bm = sched.block_manager
        bm.cache_full_blocks(rid, request, request.cache_salt, done)
        if accepted < proposed:  # the next step computes from position done on
            bm.free_tail(rid, request.num_tokens)
        if bm.sliding:
            bm.free_behind_window(rid, done)

    @staticmethod
    def off_stats() -> dict[str, int | float]:
        """:meth:`stats` while speculative decoding is off: every counter 0."""
        return Speculation(SpecConfig(1, 1, 1, 1)).stats()

    def stats(self) -> dict[str, int | float]:
        """``spec_num_draft_tokens``, ``spec_num_accepted_tokens``, ``spec_num_steps`` (as
        the attributes), ``spec_acceptance_rate`` (accepted / draft tokens) and
        ``spec_mean_tokens_per_step`` (tokens per verification; 0.0 before any)."""
        steps = self.num_spec_steps
        drafts = self.num_draft_tokens
        return {
            "spec_num_draft_tokens": drafts,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_num_steps": steps,
            "spec_acceptance_rate": self.num_accepted_tokens / drafts if drafts else 0.0,
            "spec_mean_tokens_per_step": self.num_emitted_tokens / steps if steps else 0.0,
        }
