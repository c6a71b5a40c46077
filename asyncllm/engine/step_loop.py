"""The engine's background task: between steps it hands the request table's inbox (new
calls, aborts, cache resets; held calls once the waiting queue has room) to the core, runs
each step on the core's compute thread, and feeds the step's updates back to the streams.

A step that raises kills the loop: every stream then raises
:class:`~asyncllm.errors.EngineDeadError` (``__cause__``: the step's exception) and the
core's requests are released. Nothing here holds model state; :class:`StepLoop` drives the
:class:`~asyncllm.engine.llm_engine.LLMEngine` it is given.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel

from asyncllm.engine.admission import AdmissionLimits, StartRate
from asyncllm.engine.request_table import Call, RequestTable
from asyncllm.errors import EngineDeadError
from asyncllm.output_processing.step_output import StepOutput
from asyncllm.output_processing.wakeup import Wakeup, wait_future

if TYPE_CHECKING:  # the engine core imports torch; the front end does not
    from asyncllm.engine.llm_engine import LLMEngine

__all__ = ["IDLE_RETRY_S", "StepLoop"]

logger = logging.getLogger("asyncllm")

#: Seconds the loop waits before planning again after a step found nothing to schedule.
IDLE_RETRY_S = 0.05


class StepLoop:
    """Drives one core for an :class:`~asyncllm.engine.async_engine.AsyncEngine`.

    Args:
        core: the synchronous engine.
        limits: the waiting queue's limits (held calls are admitted within them).

    Attributes:
        requests: the front end's book of calls (:class:`RequestTable`).
        wakeup: set when the loop has news to apply.
        dead: the error streams raise once a step failed (None while alive).
        running: the loop task runs.
        closing: no new calls; the loop returns once the core is empty.
        starts: the recent rate at which requests started (estimated start times).
    """

    def __init__(self, core: LLMEngine, limits: AdmissionLimits) -> None:
        self.core = core
        self.limits = limits
        self.wakeup = Wakeup()
        self.requests = RequestTable(self.wakeup.set)
        self.dead: EngineDeadError | None = None
        self.running = False
        self.closing = False
        self.starts = StartRate()

    def num_waiting(self, tenant: str | None = None) -> int:
        """Requests waiting: in the core, queued or held in the front end, and being
        tokenized (of ``tenant`` only, unless None)."""
        tokenizing = self.limits.tokenizing
        pending = sum(tokenizing.values()) if tenant is None else tokenizing[tenant]
        return pending + self.requests.num_queued(tenant) + self.core.num_waiting(tenant)

    def _blocking(self, call: Call) -> str | None:
        """The limit a held call would pass beside what the core and the tokenizer hold now
        (None: it fits)."""
        tokenizing = self.limits.tokenizing
        return self.limits.blocking(
            sum(tokenizing.values()) + self.core.num_waiting(),
            tokenizing[call.tenant] + self.core.num_waiting(call.tenant),
            call.live,
        )

    def _apply(self) -> None:
        self.requests.apply_inbox(self.core, self._blocking)
        self.requests.report_queue(self.core, self.starts.eta)

    async def _step(self) -> StepOutput:
        """One step on the compute thread, waited for to its end even when the loop is
        cancelled (a step cannot be interrupted; the core must not change under it)."""
        return await wait_future(self.core.compute_thread.submit(self.core.step))

    async def run(self) -> None:
        """The loop, until ``closing`` and the core has nothing left (or a cancellation)."""
        try:
            while True:
                self._apply()
                if not self.core.has_unfinished():
                    if self.closing and not self.requests.num_held():
                        return  # held calls are in flight too: a drain serves them
                    self.wakeup.clear()
                    await self.wakeup.wait()
                    continue
                await anyio.lowlevel.checkpoint_if_cancelled()  # the step's wait is shielded
                updates = await self._step()
                if updates.started:
                    self.starts.note(len(updates.started))
                self.requests.dispatch(updates, self.core)
                if updates.idle:
                    # Nothing was schedulable: do not spin; wait for news, re-plan soon.
                    self.wakeup.clear()
                    with anyio.move_on_after(IDLE_RETRY_S):
                        await self.wakeup.wait()
        except anyio.get_cancelled_exc_class():
            # The engine's task group is cancelled (a cancelled or failed ``async with``
            # block, a cancelled drain): abort what is left, free its blocks in the core.
            self.requests.abort_all()
            self.requests.apply_inbox(self.core, lambda call: None)
            raise
        except BaseException as exc:
            self.die(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self.running = False

    def dead_error(self) -> EngineDeadError:
        """A fresh EngineDeadError per raise (one instance raised in many tasks would
        collect all their tracebacks), with the step's exception as its cause."""
        assert self.dead is not None
        err = EngineDeadError(str(self.dead))
        err.__cause__ = self.dead.__cause__
        return err

    def die(self, exc: BaseException) -> None:
        """Mark the engine dead and end every stream with EngineDeadError."""
        dead = EngineDeadError(f"engine loop failed: {exc!r}")
        dead.__cause__ = exc
        self.dead = dead
        self.requests.fail_all(self.dead_error)
        self.release_core()  # no step runs: _step waits for its end
        if isinstance(exc, Exception):
            logger.error("asyncllm engine loop failed", exc_info=exc)

    def release_core(self) -> None:
        """After a failure, free what the core still holds (no step may be running)."""
        try:
            for request_id in list(self.core.scheduler.requests):
                self.core.abort_request(request_id)
        except Exception:  # the failure may have left the core inconsistent
            logger.exception("asyncllm: could not release the requests of a dead engine")
