"""Per-request front-end state: token updates in, :class:`RequestOutput` items out.

The engine task feeds each step's update of a request into its :class:`RequestState`
(detokenization, stop strings, logprobs, timings); the request's stream reads it. What the
stream has not read yet is merged, so a slow reader gets several steps in one item instead
of an unbounded queue. Everything here runs on the event loop; nothing holds model state.
A state reads its core request only when it is made (before the core has it); what the core
learns later (first scheduling, prefix-cache hits, preemptions) arrives as plain data in each
step's :class:`~asyncllm.output_processing.step_output.StepOutput` (:func:`process_step`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import anyio

from asyncllm.core.request import Request
from asyncllm.output_processing.detokenizer import IncrementalDetokenizer, token_bytes
from asyncllm.output_processing.step_output import StepOutput
from asyncllm.output_processing.stop_checker import StopChecker
from asyncllm.output_processing.wakeup import Wakeup
from asyncllm.outputs import Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.runner_output import TokenLogprobs

__all__ = ["RequestState", "TokenTextCache", "merge_outputs", "process_step"]


class TokenTextCache:
    """Each token id's own bytes and text, memoised; for logprobs.

    The bytes are the tokenizer's own token-to-bytes mapping (:func:`token_bytes`: a byte
    token's one byte, ``"▁Hello"``'s ``b" Hello"``, a special token's content), the text is
    those bytes decoded as UTF-8 with U+FFFD for a piece of a character (so the text of the
    byte token ``<0xE6>`` or of byte-level ``"æ"`` is U+FFFD, its bytes ``b"\\xe6"``).

    Args:
        tokenizer: the model's tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._tokens: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        """The token's (text, bytes)."""
        token = self._tokens.get(token_id)
        if token is None:
            data = token_bytes(self._tokenizer, token_id)
            token = (data.decode("utf-8", errors="replace"), data)
            self._tokens[token_id] = token
        return token

    def entry(self, chosen: int, lp: TokenLogprobs) -> PositionLogprobs:
        """One position's dict: the chosen token first, then the top alternatives."""
        logprob, rank, top_ids, top_lps = lp
        out = {chosen: Logprob(logprob, rank, *self(chosen))}
        for i, (tid, tlp) in enumerate(zip(top_ids, top_lps, strict=True)):
            if tid not in out:
                out[tid] = Logprob(tlp, i + 1, *self(tid))
        return out


class RequestState:
    """One request's output as the front end sees it.

    Args:
        request: the core request, not yet queued (read here only: its id, prompt and
            arrival time).
        params: its validated sampling parameters.
        tokenizer: the model's tokenizer.
        token_text: the engine's :class:`TokenTextCache`.
        output_id: the request id its outputs carry (the caller's id; a parallel sample's
            core request id differs); default: the core request's id.
        index: the parallel sample it is.

    The engine task calls :meth:`post` with each step's token (and :meth:`finish` or
    :meth:`fail` from outside a step); the stream awaits :attr:`event` and calls
    :meth:`take`.
    """

    def __init__(
        self,
        request: Request,
        params: SamplingParams,
        tokenizer: Any,
        token_text: TokenTextCache,
        *,
        output_id: str | None = None,
        index: int = 0,
    ) -> None:
        self.request_id = request.request_id
        self.prompt_token_ids = request.prompt_token_ids
        self.arrival_time = request.arrival_time
        #: From the step that first scheduled the request (:meth:`start`).
        self.first_scheduled_time: float | None = None
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.output_id = output_id or request.request_id
        self.index = index
        self.params = params
        self.kind = params.output_kind
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens
        )
        stop = params.stop_strings
        self.stop_checker = (
            StopChecker(stop, include_in_output=params.include_stop_str_in_output) if stop else None
        )
        self._stop_token_ids = frozenset(params.stop_token_ids or ())
        self._token_text = token_text
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_generated = 0
        # Unread output (delta), or all of it (cumulative, final).
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self._prompt_logprobs: list[PositionLogprobs | None] | None = None
        if params.prompt_logprobs is not None:
            self._prompt_logprobs = [None] * self.num_prompt_tokens
        self._prompt_logprobs_sent = False
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: BaseException | None = None
        self.event = Wakeup()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        #: The cancel scopes of the request's timeout and deadline timers.
        self.timers: list[anyio.CancelScope] = []
        #: Stream items report the queue position before the start (``report_queue``).
        self.report_queue = False
        self._queue: tuple[int, float | None] | None = None  # unread (position, eta)
        self._queue_sent: int | None = None

    @property
    def finished(self) -> bool:
        """A finish reason is set (the stream may still have an item to read)."""
        return self.finish_reason is not None

    # ------------------------------------------------------------------ engine task side

    def start(self, first_scheduled_time: float, num_cached_tokens: int) -> None:
        """The core scheduled the request for the first time (monotonic seconds), with
        ``num_cached_tokens`` prompt tokens from the prefix cache."""
        self.first_scheduled_time = first_scheduled_time
        self.num_cached_tokens = num_cached_tokens
        self._queue = None

    def post_queue(self, position: int, eta: float | None) -> None:
        """Report the queue position (requests that start first) and the estimated seconds
        to the start, when the position changed since the last report."""
        if position != self._queue_sent and self.first_scheduled_time is None:
            self._queue_sent = position
            self._queue = (position, eta)
            if self.kind != "final":
                self.event.set()

    def add_prompt_logprobs(self, first_index: int, entries: Sequence[TokenLogprobs]) -> None:
        """Store the logprobs of prompt tokens ``first_index ..`` (a recomputed prompt after
        preemption overwrites them with equal values)."""
        if self._prompt_logprobs is None:
            return
        ids = self.prompt_token_ids
        for i, lp in enumerate(entries, start=first_index):
            self._prompt_logprobs[i] = self._token_text.entry(ids[i], lp)

    def post(self, token_id: int, finish_reason: str | None, lp: TokenLogprobs | None) -> bool:
        """Add one generated token and the core's finish reason for it.

        Returns:
            True when a stop string matched while the core still runs the request: the
            caller must finish it in the core (``FINISHED_STOPPED``) before the next step.
        """
        if self.finish_reason is not None:
            return False
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.num_generated += 1
        self._token_ids.append(token_id)
        if self._logprobs is not None and lp is not None:
            self._logprobs.append(self._token_text.entry(token_id, lp))
            self.cumulative_logprob += lp[0]
        if finish_reason == "stop":  # EOS or a stop token id
            self.stop_reason = token_id if token_id in self._stop_token_ids else None
        if finish_reason == "stop" and not self.params.include_stop_str_in_output:
            delta = ""  # the stop token's text is left out (vLLM)
        else:
            delta = self.detokenizer.add_tokens([token_id])
        if finish_reason is not None:
            delta += self.detokenizer.flush()
        must_stop_core = False
        checker = self.stop_checker
        if checker is not None:
            released = checker.add(delta, match=self.num_generated >= self.params.min_tokens)
            if checker.matched is not None:
                must_stop_core = finish_reason is None
                finish_reason = "stop"
                self.stop_reason = checker.matched
            elif finish_reason is not None:
                released += checker.flush()
            delta = released
        if delta:
            self._text.append(delta)
        if finish_reason is not None:
            self._set_finished(finish_reason, now)
        if self.kind != "final" or finish_reason is not None:
            self.event.set()
        return must_stop_core

    def finish(self, reason: str) -> None:
        """End the request from outside a step ("abort", "timeout"): text still held back
        (an incomplete character, a possible stop string start) is released."""
        if self.finish_reason is not None:
            return
        delta = self.detokenizer.flush()
        if self.stop_checker is not None:
            delta = self.stop_checker.add(delta, match=False) + self.stop_checker.flush()
        if delta:
            self._text.append(delta)
        self._set_finished(reason, time.monotonic())
        self.event.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (raised to its reader)."""
        self.error = error
        self._cancel_timeout()
        self.event.set()

    def _set_finished(self, reason: str, now: float) -> None:
        self.finish_reason = reason
        self.finish_time = now
        self._cancel_timeout()

    def _cancel_timeout(self) -> None:
        for scope in self.timers:
            scope.cancel()
        self.timers.clear()

    # ------------------------------------------------------------------ stream side

    def take(self) -> RequestOutput | None:
        """The next item for the reader, or None when there is nothing new to report."""
        finished = self.finish_reason is not None
        self.event.clear()
        if self.kind == "final" and not finished:
            return None
        prompt_lps = None
        # Every prompt position is scored once the first token (or the end) is here.
        ready = self.num_generated > 0 or finished
        due = self.kind == "cumulative" or not self._prompt_logprobs_sent
        if self._prompt_logprobs is not None and ready and due:
            prompt_lps = list(self._prompt_logprobs)
            self._prompt_logprobs_sent = True
        text = "".join(self._text)
        queue, self._queue = self._queue, None
        if queue is not None and not finished and self.first_scheduled_time is None:
            return RequestOutput(
                request_id=self.output_id,
                index=self.index,
                token_ids=[],
                text="",
                num_prompt_tokens=self.num_prompt_tokens,
                queue_position=queue[0],
                estimated_start_s=queue[1],
            )
        if self.kind == "delta":
            token_ids, logprobs = self._token_ids, self._logprobs
            self._token_ids, self._text = [], []
            if logprobs is not None:
                self._logprobs = []
            if not (token_ids or text or finished or prompt_lps):
                return None
        else:
            self._text = [text] if text else []
            token_ids = list(self._token_ids)
            logprobs = list(self._logprobs) if self._logprobs is not None else None
        return RequestOutput(
            request_id=self.output_id,
            index=self.index,
            token_ids=token_ids,
            text=text,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_generated_tokens=self.num_generated,
            logprobs=logprobs,
            cumulative_logprob=self.cumulative_logprob if logprobs is not None else None,
            prompt_logprobs=prompt_lps,
            prompt_token_ids=list(self.prompt_token_ids) if finished else None,
            metrics=self.metrics() if finished else None,
        )

    def metrics(self) -> RequestMetrics:
        """Timings and counts so far (see :class:`RequestMetrics`)."""
        arrival = self.arrival_time
        scheduled = self.first_scheduled_time
        first, last = self.first_token_time, self.last_token_time
        n = self.num_generated
        return RequestMetrics(
            arrival_time=arrival,
            queue_time=scheduled - arrival if scheduled is not None else None,
            ttft=first - arrival if first is not None else None,
            mean_tpot=(
                (last - first) / (n - 1)
                if first is not None and last is not None and n > 1
                else None
            ),
            e2e_latency=(self.finish_time or time.monotonic()) - arrival,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_generated_tokens=n,
            num_preemptions=self.num_preemptions,
        )


def process_step(
    states: Mapping[str, RequestState], step: StepOutput
) -> Iterator[tuple[RequestState, bool]]:
    """Feed one step's result into the states of its requests (by internal request id;
    requests without a state, ended during the step, are skipped).

    A speculative request may have several updates in one step, one per token, in order;
    once one of them finishes its state, the later ones are dropped.

    Yields:
        (state, must_stop_core) for each sampled request that has a state, after its token
        was posted (:meth:`RequestState.post`): the caller finishes the request in the core
        when ``must_stop_core`` and forgets the state once it is ``finished``.
    """
    for request_id, start in step.started.items():
        state = states.get(request_id)
        if state is not None:
            state.start(*start)
    for request_id in step.preempted:
        state = states.get(request_id)
        if state is not None:
            state.num_preemptions += 1
    for request_id, (first, entries) in step.prompt_logprobs.items():
        state = states.get(request_id)
        if state is not None:
            state.add_prompt_logprobs(first, entries)
    logprobs = step.logprobs
    spec_logprobs = step.spec_logprobs
    seen: dict[str, int] = {}  # a speculative request's updates so far (several a step)
    for u in step.updates:
        rid = u.request_id
        lp = logprobs.get(rid)
        several = spec_logprobs.get(rid)
        if several is not None:
            i = seen[rid] = seen.get(rid, -1) + 1
            lp = several[i]
        state = states.get(rid)
        if state is not None:
            yield state, state.post(u.token_id, u.finish_reason, lp)


def merge_outputs(items: Sequence[RequestOutput], kind: str) -> RequestOutput:
    """The whole output of a request from the items its stream yielded."""
    last = items[-1]
    if kind != "delta":
        return last
    token_ids: list[int] = []
    text: list[str] = []
    logprobs: list[PositionLogprobs] | None = [] if last.logprobs is not None else None
    prompt_lps = None
    for it in items:
        token_ids.extend(it.token_ids)
        text.append(it.text)
        if logprobs is not None and it.logprobs:
            logprobs.extend(it.logprobs)
        if it.prompt_logprobs is not None:
            prompt_lps = it.prompt_logprobs
    last.token_ids = token_ids
    last.text = "".join(text)
    last.logprobs = logprobs
    last.prompt_logprobs = prompt_lps
    calls = [c for it in items for c in it.tool_calls or ()]
    last.tool_calls = calls or None
    last.reasoning = "".join(it.reasoning or "" for it in items) or None
    return last
