"""The front end's book of requests: calls by the caller's id, request states by internal
id, the inbox of additions, aborts and prefix-cache resets that the step loop hands to the
core between steps, and the calls held until the waiting queue has room for them
(``admission="wait"``, :mod:`asyncllm.engine.admission`).

Request ids: the caller's id names a call (for ``abort`` and the duplicate check) and is what
its outputs carry; inside, every call gets an internal id unique for the engine's lifetime
(the caller's id, ``SAMPLE_ID_SEP`` and a counter, as vLLM v1 suffixes ids), and the core,
the states, the inbox and a call's parallel samples are keyed by internal ids. So an update of
a step that was in flight when a call ended early can never reach a later call that reuses
the caller's id.

Everything here runs on the engine's event loop thread, between steps (no locks); nothing
holds model state.
"""

from __future__ import annotations

import collections
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from asyncllm.core.request import SAMPLE_ID_SEP, Request, RequestStatus
from asyncllm.errors import InvalidRequestError
from asyncllm.output_processing.output_processor import RequestState, process_step
from asyncllm.output_processing.step_output import StepOutput

if TYPE_CHECKING:  # the engine core imports torch; the front end does not
    from asyncllm.engine.llm_engine import LLMEngine

__all__ = ["Call", "Reply", "RequestTable", "check_timeout", "check_token_ids"]


def check_token_ids(token_ids: Sequence[int], max_len: int, vocab_size: int) -> list[int]:
    """``token_ids`` as a list of ints, checked for ``AsyncEngine.decode``.

    Raises:
        InvalidRequestError: more than ``max_len`` ids, non-integers (bools included), or
            ids outside ``[0, vocab_size)``.
    """
    if len(token_ids) > max_len:
        raise InvalidRequestError(
            f"{len(token_ids)} token ids to decode; max_model_len is {max_len}"
        )
    try:
        ids = [operator.index(t) if not isinstance(t, bool) else -1 for t in token_ids]
    except TypeError:
        raise InvalidRequestError("token ids must be integers") from None
    if any(not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"token ids must be ints in [0, {vocab_size})")
    return ids


def check_timeout(timeout: object) -> None:
    """Raise InvalidRequestError unless ``timeout`` is None or a positive finite number."""
    if timeout is not None and (
        not isinstance(timeout, (int, float))
        or isinstance(timeout, bool)
        or not 0 < timeout < math.inf
    ):
        raise InvalidRequestError(
            f"timeout must be a positive number of seconds or None, got {timeout!r}"
        )


class Reply:
    """A result the step loop hands back to a waiting task (a prefix-cache reset)."""

    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.value = 0
        self.error: BaseException | None = None

    def resolve(self, value: int = 0, error: BaseException | None = None) -> None:
        self.value, self.error = value, error
        self.done.set()


class Call:
    """One call (``stream``/``generate``/``chat``) in the front end: its core requests (one,
    or its n parallel samples) and how many of them are not finished yet.

    Attributes:
        requests: the call's core requests (internal ids).
        queued: still in the inbox (or held), not yet handed to the core.
        live: requests whose state has no finish reason yet.
        grammar: the compiled ``structured_outputs`` grammar, or None.
        tenant: its requests' tenant.
    """

    __slots__ = ("grammar", "live", "queued", "requests", "tenant")

    def __init__(self, requests: list[Request], grammar: Any = None) -> None:
        self.requests = requests
        self.queued = True
        self.live = len(requests)
        self.grammar = grammar
        self.tenant = requests[0].tenant if requests else ""


class RequestTable:
    """The unfinished calls and requests of one :class:`AsyncEngine`.

    Args:
        wake: called when the step loop has news to apply (an abort for the core).
    """

    def __init__(self, wake: Callable[[], None]) -> None:
        self.states: dict[str, RequestState] = {}  # internal id -> unfinished request
        self.calls: dict[str, Call] = {}  # caller's id -> call with an unfinished request
        self._inbox_add: list[Call] = []  # calls not yet handed to the core
        self._held: collections.deque[Call] = collections.deque()  # waiting for a place
        self._reporting: dict[str, RequestState] = {}  # report_queue states not started
        self._inbox_abort: set[str] = set()  # internal ids to abort in the core
        self._cache_resets: list[Reply] = []
        self._wake = wake
        self._ids = itertools.count()

    def caller_id(self, request_id: object) -> str:
        """The caller's ``request_id`` checked, or a new one when None.

        Raises:
            InvalidRequestError: not a non-empty str, holds ``SAMPLE_ID_SEP``, or names an
                unfinished call.
        """
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self.calls:  # a caller chose this id
                request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id or SAMPLE_ID_SEP in request_id:
            raise InvalidRequestError(
                f"request_id must be a non-empty str without {SAMPLE_ID_SEP!r}, got {request_id!r}"
            )
        self.check_free(request_id)
        return request_id

    def check_free(self, caller_id: str) -> None:
        """Raise InvalidRequestError if an unfinished call has this id."""
        if caller_id in self.calls:
            raise InvalidRequestError(f"duplicate request id {caller_id!r}")

    def internal_id(self, caller_id: str) -> str:
        """A new internal id for a call of ``caller_id``, unique for the engine's life."""
        return f"{caller_id}{SAMPLE_ID_SEP}{next(self._ids)}"

    def reset_prefix_cache(self) -> Reply:
        """Queue a prefix-cache reset; its reply resolves between steps."""
        reply = Reply()
        self._cache_resets.append(reply)
        self._wake()
        return reply

    def num_queued(self, tenant: str | None = None) -> int:
        """Live requests of calls not yet handed to the core, held ones included (of
        ``tenant`` only, unless None)."""
        return sum(
            call.live
            for call in itertools.chain(self._inbox_add, self._held)
            if tenant is None or call.tenant == tenant
        )

    def num_held(self) -> int:
        """Live requests of calls held for a place in the waiting queue."""
        return sum(call.live for call in self._held)

    def add(
        self, caller_id: str, call: Call, states: list[RequestState], *, hold: bool = False
    ) -> None:
        """Register a call and its requests' states and queue it for the core (``hold``:
        after the calls held before it, once the waiting queue has room: :meth:`admit_held`)."""
        self.calls[caller_id] = call
        for state in states:
            self.states[state.request_id] = state
            if state.report_queue:
                self._reporting[state.request_id] = state
        (self._held if hold else self._inbox_add).append(call)
        self._wake()

    def start_timer(
        self, tg: anyio.abc.TaskGroup, internal_id: str, seconds: float, *, unstarted: bool
    ) -> anyio.CancelScope:
        """Finish ``internal_id`` with "timeout" in ``seconds``, on a task of ``tg`` (the
        engine's); ``unstarted``: only if the core has not scheduled it by then (a
        deadline). The request's end cancels the returned scope (its timer)."""
        scope = anyio.CancelScope()
        tg.start_soon(self._expire, scope, internal_id, seconds, unstarted)
        return scope

    async def _expire(
        self, scope: anyio.CancelScope, internal_id: str, seconds: float, unstarted: bool
    ) -> None:
        with scope:
            await anyio.sleep(max(seconds, 0.0))  # a deadline already past: at once
            state = self.states.get(internal_id)
            if state is not None and not (unstarted and state.first_scheduled_time is not None):
                self.finish_early(internal_id, "timeout")

    def finish_call(self, caller_id: str, reason: str) -> None:
        """End the call the caller's id names, all its samples; unknown: ignored."""
        call = self.calls.get(caller_id)
        if call is not None:
            for request in call.requests:
                self.finish_early(request.request_id, reason)

    def finish_early(self, internal_id: str, reason: str) -> None:
        """End one request from outside a step ("abort", "timeout"): the core drops it
        before the next step. A finished or unknown internal id is ignored."""
        state = self.states.get(internal_id)
        if state is None:
            return
        call = self._forget(state)
        if not call.queued:
            self._inbox_abort.add(internal_id)
            self._wake()
        state.finish(reason)

    def abort_all(self) -> None:
        """End every unfinished request with "abort"."""
        for internal_id in list(self.states):
            self.finish_early(internal_id, "abort")

    def apply_inbox(self, core: LLMEngine, blocking: Callable[[Call], str | None]) -> None:
        """Hand the queued cache resets, aborts and calls to the core (between steps), then
        the held calls in order while ``blocking`` names no limit they would pass: a call
        whose tenant is at ``max_waiting_per_tenant`` stays, later tenants' calls may go;
        one held by ``max_waiting`` stops the line."""
        for reply in self._cache_resets:
            reply.resolve(core.reset_prefix_cache())
        self._cache_resets.clear()
        for internal_id in self._inbox_abort:
            core.abort_request(internal_id)
        self._inbox_abort.clear()
        for call in self._inbox_add:
            self._to_core(call, core)
        self._inbox_add.clear()
        kept: collections.deque[Call] = collections.deque()
        while self._held:
            call = self._held.popleft()
            limit = blocking(call) if call.live else None
            if limit is None:
                self._to_core(call, core)
            elif limit == "max_waiting":
                kept.append(call)
                break
            else:
                kept.append(call)
        kept.extend(self._held)
        self._held = kept

    def _to_core(self, call: Call, core: LLMEngine) -> None:
        call.queued = False
        # Requests that ended while queued (abort, timeout) never reach the core.
        live = [r for r in call.requests if r.request_id in self.states]
        if len(call.requests) == 1 and live:
            core.add_request(live[0], call.grammar)
        elif live:
            core.add_parallel_requests(live, call.grammar)

    def report_queue(self, core: LLMEngine, eta: Callable[[int], float | None]) -> None:
        """Post the queue position (and ``eta(position)``) to every stream that asked for it
        and has not started: its place in the core's admission order, or after the core's
        waiting requests and the calls queued before it in the front end."""
        if not self._reporting:
            return
        for rid in [r for r, s in self._reporting.items() if s.first_scheduled_time or s.finished]:
            del self._reporting[rid]
        order = core.waiting_order()
        ahead = len(order)
        for call in itertools.chain(self._inbox_add, self._held):
            for r in call.requests:
                state = self._reporting.get(r.request_id)
                if state is not None:
                    state.post_queue(ahead, eta(ahead))
            ahead += call.live
        for rid, state in self._reporting.items():
            position = order.get(rid)
            if position is not None:
                state.post_queue(position, eta(position))

    def dispatch(self, updates: StepOutput, core: LLMEngine) -> None:
        """Feed a step's updates to their requests' states; a request a stop string ended
        is finished in the core at once (before the next step)."""
        # Keyed by internal ids: a request that ended during the step has no state, and
        # no later call (even one reusing the caller's id) shares its internal id.
        for state, must_stop_core in process_step(self.states, updates):
            if must_stop_core:
                # A stop string: finish it in the core now, before the next step.
                core.abort_request(state.request_id, RequestStatus.FINISHED_STOPPED)
            if state.finished:
                self._forget(state)

    def fail_all(self, make_error: Callable[[], BaseException]) -> None:
        """Forget everything; every unfinished stream and cache reset raises a fresh
        ``make_error()``."""
        states = list(self.states.values())
        self.states.clear()
        self.calls.clear()
        self._inbox_add.clear()
        self._held.clear()
        self._reporting.clear()
        self._inbox_abort.clear()
        for state in states:
            state.fail(make_error())
        for reply in self._cache_resets:
            reply.resolve(error=make_error())
        self._cache_resets.clear()

    def _forget(self, state: RequestState) -> Call:
        """Drop a finished (or finishing) request's state; the caller's id is free again
        once every request of its call is finished."""
        del self.states[state.request_id]
        self._reporting.pop(state.request_id, None)
        call = self.calls[state.output_id]
        call.live -= 1
        if call.live == 0:
            del self.calls[state.output_id]
        return call
