"""The asyncio front end: streams, the background step loop, cancellation, failure.

One background task owns the :class:`LLMEngine`. Calls from other tasks (new requests,
aborts) go through an inbox that the task applies between steps; each step runs in a single
worker thread so the event loop stays free while the model computes. Each request has a
:class:`~asyncllm.engine.output_processor.RequestState` that holds its not-yet-read output
(detokenized, stop strings applied): a slow reader gets several steps merged into one item
instead of an unbounded queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import msgspec

from asyncllm.config import EngineConfig
from asyncllm.core.request import SAMPLE_ID_SEP, Request, RequestStatus
from asyncllm.core.scheduler import RequestUpdate
from asyncllm.engine.llm_engine import LLMEngine, PromptType
from asyncllm.engine.output_processor import RequestState, TokenTextCache, merge_outputs
from asyncllm.errors import (
    EngineDeadError,
    EngineNotRunningError,
    InvalidRequestError,
    QueueFull,
)
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams

logger = logging.getLogger("asyncllm")

#: Seconds the loop waits before planning again after a step found nothing to schedule.
IDLE_RETRY_S = 0.05


class AsyncEngine:
    """An LLM engine for asyncio applications.

    Use it as an async context manager; inside, any number of tasks may call :meth:`stream`,
    :meth:`chat` and :meth:`generate` concurrently and share the model through continuous
    batching::

        async with AsyncEngine.from_pretrained("default") as engine:
            async for out in engine.stream("Hello", SamplingParams(max_tokens=32)):
                print(out.text, end="")

    Failure: if a step raises (a model error, out of memory), every in-flight stream raises
    :class:`EngineDeadError` (``__cause__``: the step's exception), later calls raise it at
    once, and :meth:`health` raises it. The engine stays dead; build a new one.

    Args:
        engine: the synchronous engine it drives.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._states: dict[str, RequestState] = {}
        self._inbox_add: dict[str, Request] = {}
        # Parallel sampling (n > 1): caller's id -> its samples' core ids, and back.
        self._groups: dict[str, list[str]] = {}
        self._group_of: dict[str, str] = {}
        self._inbox_abort: set[str] = set()
        self._cache_resets: list[asyncio.Future[int]] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stepping = False  # a step is running in the worker thread
        self._closing = False
        self._dead: EngineDeadError | None = None
        self._ids = itertools.count()
        self._token_text = TokenTextCache(engine.tokenizer)

    @classmethod
    def from_pretrained(cls, model: str = "default", **config: Any) -> AsyncEngine:
        """Load a model and build an engine.

        Args:
            model: "default", a Hugging Face directory, or a ``.gguf`` file.
            **config: other :class:`EngineConfig` fields.

        Raises:
            ValueError: a bad config field; ModelNotFoundError, ModelLoadError or
                UnsupportedModelError (all ValueError) for the model.
        """
        return cls(LLMEngine.from_config(EngineConfig(model=model, **config)))

    @property
    def tokenizer(self) -> Any:
        """The model's transformers tokenizer (chat template included)."""
        return self._engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        """The engine's settings."""
        return self._engine.config

    async def __aenter__(self) -> AsyncEngine:
        if self._dead is not None:
            raise self._dead_error()
        if self._task is not None:
            raise RuntimeError("AsyncEngine is already running")
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._closing = False
        self._engine.driven_by_async = True
        self._task = asyncio.create_task(self._run(), name="asyncllm-engine-loop")
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        """Stop: abort in-flight requests (``shutdown_mode="abort"``, or whenever the block
        raised) or let them finish (``"drain"``); then join the loop task and its thread.

        New calls raise :class:`EngineNotRunningError` from here on. Cancelling a drain
        aborts what is left and still joins.
        """
        if self._task is None:
            return
        assert self._wakeup is not None
        self._closing = True
        if self.config.shutdown_mode != "drain" or exc_type is not None:
            self._abort_all()
        self._wakeup.set()
        try:
            await asyncio.shield(self._task)
        except asyncio.CancelledError:
            self._abort_all()
            self._wakeup.set()
            with contextlib.suppress(BaseException):
                await self._task
            raise
        except BaseException:  # the loop re-raised a BaseException; the engine is dead
            pass
        finally:
            self._task = None
            self._engine.stop_compute_thread()  # joins a step a cancelled task left running
            self._engine.driven_by_async = False
            if self._dead is not None:
                self._release_core()

    def health(self) -> str:
        """ "running" (inside ``async with``, loop alive) or "stopped".

        Raises:
            EngineDeadError: the step loop failed (``__cause__``: its exception).
        """
        if self._dead is not None:
            raise self._dead_error()
        return "running" if self._task is not None and not self._task.done() else "stopped"

    async def stream(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Generate for one prompt, yielding outputs as they are produced.

        The request is validated and queued when iteration starts; errors are raised by
        the first ``__anext__``, before anything is awaited. Leaving the loop early
        (``break``, ``aclose()``, or cancelling the consuming task) aborts the request and
        frees its KV blocks before the next step.

        Args:
            prompt: text, token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``.
            params: sampling parameters (default ``SamplingParams()``); its
                ``output_kind`` says whether items are deltas, cumulative, or one final item.
            request_id: unique among in-flight requests; generated when None.
            priority: lower is served first.
            cache_salt: requests share prefix-cache blocks only with requests of the same
                salt (None included); give tenants that must not share cache their own.
            timeout: seconds from the call; when they pass the request ends with
                finish_reason "timeout" (what was generated is kept) and its blocks are
                freed. None: no limit.

        Yields:
            :class:`RequestOutput` items; the last has ``finish_reason`` and ``metrics``.
            With ``params.n > 1`` the samples' items interleave, each tagged with its
            ``index``, and each sample ends with its own last item.

        Raises:
            InvalidRequestError: bad prompt, params, timeout or a duplicate request id.
            QueueFull: ``EngineConfig.max_waiting`` requests are already waiting.
            EngineNotRunningError: outside ``async with engine`` (or while it exits).
            EngineDeadError: the step loop failed (before or during the request).
        """
        states = self._submit(prompt, params, request_id, priority, cache_salt, timeout)
        event = states[0].event
        for state in states[1:]:  # one wake-up for all samples
            state.event = event
        pending = list(states)
        try:
            while pending:
                await event.wait()
                outs = []
                for state in pending:  # take every sample's news before yielding any
                    if state.error is not None:
                        raise self._dead_error() if self._dead is not None else state.error
                    out = state.take()
                    if out is not None:
                        outs.append((state, out))
                for state, out in outs:
                    if out.finished:
                        pending.remove(state)
                    yield out
        finally:
            for state in pending:
                self.abort(state.request_id)
            if len(states) > 1:
                for child in self._groups.pop(states[0].output_id, ()):
                    self._group_of.pop(child, None)

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the answer to chat ``messages``, like :meth:`stream`.

        The prompt is the model's chat template applied by transformers
        (``tokenizer.apply_chat_template``) to ``messages``.

        Args:
            messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
            add_generation_prompt: end the prompt with the assistant header.
            chat_template_kwargs: extra template variables / ``apply_chat_template``
                options (``tools``, ``documents``, ``enable_thinking``...).
            Other arguments as in :meth:`stream`.

        Raises:
            InvalidRequestError: malformed messages, no chat template, or a template error;
                and everything :meth:`stream` raises.
        """
        prompt = self._engine.chat_prompt(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        gen = self.stream(
            prompt,
            params,
            request_id=request_id,
            priority=priority,
            cache_salt=cache_salt,
            timeout=timeout,
        )
        try:
            async for out in gen:
                yield out
        finally:
            await gen.aclose()

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout: float | None = None,
    ) -> RequestOutput:
        """Generate for one prompt and return the whole output (see :meth:`stream`); with
        ``params.n > 1``, sample 0's output whose ``samples`` lists all n in index order."""
        stream = self.stream(
            prompt,
            params,
            request_id=request_id,
            priority=priority,
            cache_salt=cache_salt,
            timeout=timeout,
        )
        kind = params.output_kind if isinstance(params, SamplingParams) else "delta"
        return await collect(stream, kind)

    def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with finish_reason "abort" and its blocks are
        freed before the next step. Callable from any task, and from other threads (then
        applied on the engine's loop soon after). Unknown or finished ids are ignored; the id
        of a request with ``n > 1`` aborts all its samples."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop:
                loop.call_soon_threadsafe(self._finish_early, request_id, "abort")
                return
        self._finish_early(request_id, "abort")

    async def reset_prefix_cache(self) -> int:
        """Forget every prefix-cache block that no request holds (applied between steps);
        returns how many blocks were dropped. Blocks in use keep their hashes."""
        if self._task is None or self._task.done():
            return self._engine.reset_prefix_cache()
        assert self._loop is not None and self._wakeup is not None
        done: asyncio.Future[int] = self._loop.create_future()
        self._cache_resets.append(done)
        self._wakeup.set()
        return await done

    def stats(self) -> dict[str, int | float]:
        """Engine counters (see ``LLMEngine.stats``); read between steps."""
        s = self._engine.stats()
        s["num_waiting"] += len(self._inbox_add)
        return s

    def _num_waiting(self) -> int:
        return len(self._inbox_add) + self._engine.scheduler.num_waiting

    def _dead_error(self) -> EngineDeadError:
        """A fresh EngineDeadError per raise (one instance raised in many tasks would
        collect all their tracebacks), with the step's exception as its cause."""
        assert self._dead is not None
        err = EngineDeadError(str(self._dead))
        err.__cause__ = self._dead.__cause__
        return err

    def _finish_early(
        self, request_id: str, reason: str, state: RequestState | None = None
    ) -> None:
        """End a request from outside a step ("abort", "timeout")."""
        for child in self._groups.get(request_id, ()):
            self._finish_early(child, reason)
        current = self._states.get(request_id)
        if current is None or (state is not None and current is not state):
            return
        del self._states[request_id]
        if self._inbox_add.pop(request_id, None) is None:
            self._inbox_abort.add(request_id)
            if self._wakeup is not None:
                self._wakeup.set()
        current.finish(reason)

    def _abort_all(self) -> None:
        for request_id in list(self._states):
            self._finish_early(request_id, "abort")

    def _submit(
        self,
        prompt: PromptType,
        params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        cache_salt: str | None,
        timeout: float | None,
    ) -> list[RequestState]:
        if self._dead is not None:
            raise self._dead_error()
        if self._task is None or self._closing:
            raise EngineNotRunningError("use `async with engine:` before sending requests")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            raise EngineNotRunningError(
                "an AsyncEngine serves the event loop that entered it; call it from that loop "
                "(from another thread: asyncio.run_coroutine_threadsafe, or the LLM facade)"
            )
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id or SAMPLE_ID_SEP in request_id:
            raise InvalidRequestError(
                f"request_id must be a non-empty str without {SAMPLE_ID_SEP!r}, got {request_id!r}"
            )
        if request_id in self._states or request_id in self._groups:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        if timeout is not None and (
            not isinstance(timeout, (int, float))
            or isinstance(timeout, bool)
            or not 0 < timeout < math.inf
        ):
            raise InvalidRequestError(
                f"timeout must be a positive number of seconds or None, got {timeout!r}"
            )
        requests = self._engine.make_requests(
            request_id,
            prompt,
            params if params is not None else SamplingParams(),
            priority=priority,
            cache_salt=cache_salt,
        )
        limit = self.config.max_waiting
        if limit is not None and self._num_waiting() + len(requests) > limit:
            raise QueueFull(
                f"{self._num_waiting()} requests are waiting and this one adds "
                f"{len(requests)} (EngineConfig.max_waiting={limit}); try again later"
            )
        if len(requests) > 1:
            ids = [r.request_id for r in requests]
            if any(i in self._states for i in ids):
                raise InvalidRequestError(f"duplicate request id among {ids}")
            self._groups[request_id] = ids
            self._group_of.update(dict.fromkeys(ids, request_id))
        states = []
        for i, request in enumerate(requests):
            state = RequestState(
                request, request.params, self._engine.tokenizer, self._token_text,
                output_id=request_id, index=i,
            )  # fmt: skip
            if timeout is not None:
                assert self._loop is not None
                state.timeout_handle = self._loop.call_later(
                    timeout, self._finish_early, request.request_id, "timeout", state
                )
            self._states[request.request_id] = state
            self._inbox_add[request.request_id] = request
            states.append(state)
        assert self._wakeup is not None
        self._wakeup.set()
        return states

    def _drain_inbox(self) -> None:
        for done in self._cache_resets:
            if not done.done():
                done.set_result(self._engine.reset_prefix_cache())
        self._cache_resets.clear()
        for request_id in self._inbox_abort:
            self._engine.abort_request(request_id)
        self._inbox_abort.clear()
        groups: dict[str, list[Request]] = {}
        for request in self._inbox_add.values():
            group = self._group_of.get(request.request_id)
            if group is None:
                self._engine.add_request(request)
            else:
                groups.setdefault(group, []).append(request)
        for samples in groups.values():
            self._engine.add_parallel_requests(samples)
        self._inbox_add.clear()

    def _dispatch(self, updates: list[RequestUpdate]) -> None:
        logprobs = getattr(updates, "logprobs", None) or {}
        for request_id, (first, entries) in (
            getattr(updates, "prompt_logprobs", None) or {}
        ).items():
            state = self._states.get(request_id)
            if state is not None:
                state.add_prompt_logprobs(first, entries)
        for u in updates:
            state = self._states.get(u.request_id)
            if state is None:
                continue  # aborted by its consumer during the step
            if state.post(u.token_id, u.finish_reason, logprobs.get(u.request_id)):
                # A stop string: finish it in the core now, before the next step.
                self._engine.abort_request(u.request_id, RequestStatus.FINISHED_STOPPED)
            if state.finished:
                del self._states[u.request_id]

    def _step(self) -> list[RequestUpdate]:
        try:
            return self._engine.step()
        finally:
            self._stepping = False

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        try:
            while True:
                self._drain_inbox()
                if not self._engine.has_unfinished():
                    if self._closing:
                        return
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                self._stepping = True
                updates = await loop.run_in_executor(self._engine.compute_thread, self._step)
                self._dispatch(updates)
                if getattr(updates, "idle", False):
                    # Nothing was schedulable: do not spin; wait for news, re-plan soon.
                    self._wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), IDLE_RETRY_S)
        except BaseException as exc:
            self._die(exc)
            if not isinstance(exc, Exception):
                raise

    def _die(self, exc: BaseException) -> None:
        """Mark the engine dead and end every stream with EngineDeadError."""
        dead = EngineDeadError(f"engine loop failed: {exc!r}")
        dead.__cause__ = exc
        self._dead = dead
        states = list(self._states.values())
        self._states.clear()
        self._inbox_add.clear()
        self._inbox_abort.clear()
        for state in states:
            state.fail(self._dead_error())
        for done in self._cache_resets:
            if not done.done():
                done.set_exception(self._dead_error())
        self._cache_resets.clear()
        if not self._stepping:
            self._release_core()
        if isinstance(exc, Exception):
            logger.error("asyncllm engine loop failed", exc_info=exc)

    def _release_core(self) -> None:
        """After a failure, free what the core still holds (no step may be running)."""
        try:
            for request_id in list(self._engine.scheduler.requests):
                self._engine.abort_request(request_id)
        except Exception:  # the failure may have left the core inconsistent
            logger.exception("asyncllm: could not release the requests of a dead engine")


async def collect(stream: AsyncIterator[RequestOutput], output_kind: str) -> RequestOutput:
    """Read a stream to its end and return the whole output (deltas merged); with several
    parallel samples, sample 0's output with all of them in ``samples``."""
    by_index: dict[int, list[RequestOutput]] = {}
    async for out in stream:
        by_index.setdefault(out.index, []).append(out)
    merged = [merge_outputs(by_index[i], output_kind) for i in sorted(by_index)]
    if len(merged) == 1:
        return merged[0]
    first = msgspec.structs.replace(merged[0], samples=merged)
    return first
