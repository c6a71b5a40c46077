"""Turning a call into queued requests: validation, tokenization (and grammar compiles) off
the event loop, admission (:mod:`asyncllm.engine.admission`), timers and states.

Text prompts and chat templates are tokenized on an anyio worker thread (never the loop or
the compute thread, which alone does torch work), one at a time (fast tokenizers are not
meant for concurrent encodes; vLLM's server does the same), after a length check
(``InputProcessor.check_prompt_chars``); grammars compile on another, one at a time. A call's
requests count as waiting from their admission on, so ``max_waiting`` bounds the tokenizer's
queue too. Nothing here holds model state; it runs on the engine's event loop.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import msgspec

from asyncllm.engine.admission import check_admission_mode, check_deadline, check_tenant
from asyncllm.engine.input_processor import PromptType
from asyncllm.engine.request_table import Call, check_timeout
from asyncllm.engine.step_loop import StepLoop
from asyncllm.errors import InvalidRequestError
from asyncllm.output_processing.output_processor import RequestState, TokenTextCache
from asyncllm.output_processing.parallel_sampling import num_samples
from asyncllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine core imports torch; the front end does not
    from asyncllm.engine.llm_engine import LLMEngine

__all__ = ["Submission"]

_T = TypeVar("_T")


class Submission:
    """The front end's way in for calls.

    Args:
        core: the engine core (its tokenizer, input processor and grammar compiler).
        loop: the step loop (its request table and admission limits).
        check_running: raises unless the engine takes calls now.
    """

    def __init__(self, core: LLMEngine, loop: StepLoop, check_running: Callable[[], None]) -> None:
        self._core = core
        self._loop = loop
        self._check_running = check_running
        self._token_text = TokenTextCache(core.tokenizer)
        self._tokenize_limiter: anyio.CapacityLimiter | None = None  # made on entry
        self._grammar_limiter: anyio.CapacityLimiter | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    def enter(self, tg: anyio.abc.TaskGroup) -> None:
        """Start taking calls; timers run in ``tg`` (the engine's task group)."""
        self._tokenize_limiter = anyio.CapacityLimiter(1)
        self._grammar_limiter = anyio.CapacityLimiter(1)
        self._tg = tg

    async def off_loop(
        self,
        fn: Callable[[], _T],
        num_requests: int = 0,
        *,
        grammar: bool = False,
        tenant: str = "",
        wait: bool = False,
    ) -> _T:
        """``fn()`` on a worker thread, after the tokenizer's other work (the grammar
        compiler's when ``grammar``), then check the engine still takes calls. The call's
        ``num_requests`` of ``tenant`` are admitted first (refused when the queue is full,
        unless the caller ``wait``s for a place) and count as waiting while ``fn`` waits or
        runs; a cancelled caller waits for ``fn`` (one tokenization at once)."""
        limiter = self._grammar_limiter if grammar else self._tokenize_limiter
        self.admit(num_requests, tenant, wait)
        tokenizing = self._loop.limits.tokenizing
        tokenizing[tenant] += num_requests
        try:
            result = await anyio.to_thread.run_sync(fn, limiter=limiter)
        finally:
            tokenizing[tenant] -= num_requests
            if not tokenizing[tenant]:
                del tokenizing[tenant]
            self._loop.wakeup.set()  # places freed: a held call may fit now
        self._check_running()
        return result

    def admit(self, num_requests: int, tenant: str, wait: bool) -> bool:
        """Whether a call of ``num_requests`` of ``tenant`` fits in the waiting queue now.

        Raises:
            InvalidRequestError: it never fits.
            QueueFull: it does not fit now and the caller does not ``wait``.
        """
        limits, loop = self._loop.limits, self._loop
        if wait:
            limits.check_size(num_requests)
            # Held calls go first: a newcomer waits behind them even if it would fit.
            held = loop.requests.num_held()
            waiting = loop.num_waiting(), loop.num_waiting(tenant)
            return not held and limits.blocking(*waiting, num_requests) is None
        limits.check(loop.num_waiting(), loop.num_waiting(tenant), num_requests)
        return True

    async def submit(
        self,
        prompt: PromptType,
        params: SamplingParams | None,
        request_id: str | None,
        timeout: float | None,
        *,
        tenant: str = "",
        deadline: object = None,
        admission: str = "refuse",
        report_queue: bool = False,
        **options: Any,
    ) -> list[RequestState]:
        """Validate, tokenize and queue a call (``options``: ``make_requests``'s keywords)."""
        self._check_running()
        request_id = self._loop.requests.caller_id(request_id)
        check_timeout(timeout)
        tenant = check_tenant(tenant)
        wait = check_admission_mode(admission)
        if not isinstance(report_queue, bool):
            raise InvalidRequestError(f"report_queue must be a bool, got {report_queue!r}")
        start_by = check_deadline(deadline, time.monotonic())
        grammar = None
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            params = msgspec.structs.replace(params)  # validated, and safe from the caller
            grammar = await self.off_loop(
                functools.partial(self._core.compile_grammar, params),
                num_samples(params),
                grammar=True, tenant=tenant, wait=wait,
            )  # fmt: skip
        make = functools.partial(
            self._core.inputs.make_requests,
            self._loop.requests.internal_id(request_id),
            prompt,
            params if params is not None else SamplingParams(),
            **options,
        )
        text = self._core.inputs.prompt_text(prompt)
        if text is None:  # token ids: cheap, validated here
            requests = make()
        else:
            self._core.inputs.check_prompt_chars(len(text))
            requests = await self.off_loop(make, num_samples(params), tenant=tenant, wait=wait)
        self._loop.requests.check_free(request_id)  # taken while this one was tokenized?
        hold = not self.admit(len(requests), tenant, wait)
        states: list[RequestState] = []
        tg = self._tg
        assert tg is not None
        for i, request in enumerate(requests):
            request.tenant, request.deadline = tenant, start_by
            state = RequestState(
                request, request.params, self._core.tokenizer, self._token_text,
                output_id=request_id, index=i,
            )  # fmt: skip
            state.report_queue = report_queue
            requests_table = self._loop.requests
            if timeout is not None:
                timer = requests_table.start_timer(tg, request.request_id, timeout, unstarted=False)
                state.timers.append(timer)
            if start_by is not None:
                left = start_by - time.monotonic()
                timer = requests_table.start_timer(tg, request.request_id, left, unstarted=True)
                state.timers.append(timer)
            state.event = states[0].event if states else state.event  # one for all samples
            states.append(state)
        self._loop.requests.add(request_id, Call(requests, grammar), states, hold=hold)
        return states
