"""What one engine step hands the front end: plain, immutable data (no torch).

:meth:`LLMEngine.step` runs on the engine's compute thread; the async front end reads its
result on the event loop. So the result carries everything the front end needs about the
step's requests (tokens, finish reasons, logprobs, first scheduling, preemptions) and the
front end never reads the core's live ``Request`` objects, which the next step mutates.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

from asyncllm.core.plan import RequestUpdate
from asyncllm.worker.runner_output import RunnerOutput, TokenLogprobs

__all__ = ["RequestStart", "StepOutput"]


class RequestStart(NamedTuple):
    """A request's first scheduling, as the front end's metrics need it.

    Attributes:
        time: ``time.monotonic()`` seconds when the step that first scheduled it began.
        num_cached_tokens: prompt tokens served from the prefix cache (fixed from then on).
    """

    time: float
    num_cached_tokens: int


#: The shared empty mapping of the fields a step left empty (no allocation per step).
_EMPTY: Mapping[str, Any] = MappingProxyType({})


def _empty() -> Mapping[str, Any]:
    return _EMPTY


@dataclass(frozen=True, slots=True)
class StepOutput:
    """The result of one :meth:`LLMEngine.step`.

    Iterating it (and ``len``) goes over :attr:`updates`.

    Attributes:
        updates: one :class:`RequestUpdate` per sampled request, in plan order.
        logprobs: request id -> the sampled token's (logprob, rank, top ids, top
            logprobs), for requests that ask for ``logprobs``.
        prompt_logprobs: request id -> (index in the prompt of the first token scored, one
            entry as above per prompt token scored this step).
        spec_logprobs: request id -> one entry as above per update of the request, for
            speculative requests (several updates in one step) that ask for ``logprobs``.
        started: request id -> :class:`RequestStart`, for requests scheduled for the first
            time this step.
        preempted: ids of the requests preempted this step (each counts once more).
        idle: nothing could be scheduled (requests wait for blocks or protection).
    """

    updates: Sequence[RequestUpdate] = ()
    logprobs: Mapping[str, TokenLogprobs] = field(default_factory=_empty)
    prompt_logprobs: Mapping[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=_empty)
    started: Mapping[str, RequestStart] = field(default_factory=_empty)
    preempted: Sequence[str] = ()
    idle: bool = False
    spec_logprobs: Mapping[str, Sequence[TokenLogprobs]] = field(default_factory=_empty)

    def __iter__(self) -> Iterator[RequestUpdate]:
        return iter(self.updates)

    def __len__(self) -> int:
        return len(self.updates)

    @classmethod
    def of(
        cls,
        updates: Sequence[RequestUpdate],
        out: RunnerOutput,
        started: Mapping[str, RequestStart] | None,
        preempted: Sequence[str],
    ) -> StepOutput:
        """A step's result from the scheduler's updates and the runner's output (None or
        empty parts share one empty mapping)."""
        return cls(
            updates,
            out.logprobs or _EMPTY,
            out.prompt_logprobs or _EMPTY,
            started or _EMPTY,
            preempted,
            spec_logprobs=out.spec_logprobs or _EMPTY,
        )


#: The result of a step that found nothing to schedule.
IDLE_STEP = StepOutput(idle=True)
