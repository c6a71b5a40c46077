"""Per-phase wall time of one engine step: the hook profilers and the benchmark use.

Set :attr:`asyncllm.engine.llm_engine.LLMEngine.step_observer` to a callable; each step that
runs a batch (an idle step, with nothing schedulable, is not observed) then
measures its phases with a :class:`StepTimings` and calls the observer with it and the step's
plan, on the compute thread, at the end of the step (before the front end sees its outputs).
Unset (None, the default), a step measures nothing: it only checks that the attribute is None.
Pure Python (no torch), so that the front end and tools can import it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from asyncllm.core.plan import SchedulerOutput

#: The phases a step may record, in the order they run (a phase that did not run is absent):
#: ``schedule`` (``Scheduler.schedule``), ``kv_copy`` (swaps and copy-on-write block copies),
#: ``grammar_fill`` (the constrained rows' token bitmask, ``GrammarMatchers.fill``), ``prep``
#: (the runner's input tensors and attention plan), ``forward`` (the model), ``sample``
#: (sampling and prompt logprobs), ``grammar_mask`` (the sampler's check of constrained rows
#: against the bitmask, their mask and re-argmax), ``grammar_accept`` (the
#: matchers' advance), ``update`` (``Scheduler.update_from_output``: stop checks, block frees).
PHASES = (
    "schedule", "kv_copy", "grammar_fill", "prep", "forward", "grammar_mask", "sample",
    "grammar_accept", "update",
)  # fmt: skip


class StepTimings:
    """Wall time (seconds, ``time.perf_counter``) of the phases of one step.

    Attributes:
        start: when the step began (``perf_counter`` seconds).
        end: when it ended (set before the observer is called).
        phases: seconds per phase name (:data:`PHASES`), for the phases that ran.
    """

    __slots__ = ("_mark", "end", "phases", "start")

    def __init__(self) -> None:
        self.start = self._mark = self.end = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap (or the start) to ``phase``."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._mark
        self._mark = now

    def finish(self) -> None:
        """Stamp :attr:`end`."""
        self.end = time.perf_counter()


class StepObserver(Protocol):
    """Called once per step with its timings and its plan (``plan.chunks`` is the batch;
    ``plan.num_batched_tokens`` its tokens). Runs on the compute thread inside the step, so
    it may read the engine's state; what it costs is charged to no phase but lengthens the
    step's cycle: keep it short."""

    def __call__(self, timings: StepTimings, plan: SchedulerOutput) -> None: ...
