"""The async front end on anyio (asyncio, uvloop, trio): the public API, streams, cancellation.

One task of the engine's task group (``async with engine``), the step loop
(:mod:`asyncllm.engine.step_loop`), owns the :class:`LLMEngine`. Calls from other tasks (new
requests, aborts) go through an inbox (:mod:`asyncllm.engine.request_table`) that the task
applies between steps; each step runs on the engine's one compute thread (docs/tuning.md says
why one) so the event loop stays free while the model computes. Admission (the waiting
queue's limits, callers that wait for a place, tenants, deadlines, queue positions) is in
:mod:`asyncllm.engine.admission`. Leaving a stream early (cancelled, timed out, ``break`` in
``async with``, ``aclose()``) aborts its request, which frees its KV blocks before the next
step. A request's :class:`~asyncllm.output_processing.output_processor.RequestState` holds
its unread output: a slow reader gets several steps merged into one item, not an unbounded queue.

Text prompts and chat templates are tokenized on an anyio worker thread (never the loop or
the compute thread, which alone does torch work), after a length check
(``InputProcessor.check_prompt_chars``); grammars (``structured_outputs``) compile on another,
one at a time, with a cache (``LLMEngine.compile_grammar``), before the request is queued: a
grammar that fails ends only its call; a slow one holds up neither the loop nor tokenization.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import threading
from collections.abc import AsyncGenerator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread

from asyncllm.config import EngineConfig
from asyncllm.engine.admission import (
    AdmissionLimits,
    check_admission_mode,
    check_tenant,
)
from asyncllm.engine.input_processor import PromptType
from asyncllm.engine.request_table import check_token_ids
from asyncllm.engine.step_loop import StepLoop
from asyncllm.engine.streams import RequestStream, collect, stream_method
from asyncllm.engine.submission import Submission
from asyncllm.errors import EngineNotRunningError
from asyncllm.output_processing.parallel_sampling import num_samples
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.tool_calling.chat_tool_setup import ChatOutputs, ChatToolSetup, render_chat_call

if TYPE_CHECKING:  # the engine core imports torch; the front end does not
    from asyncllm.engine.llm_engine import LLMEngine

__all__ = ["AsyncEngine", "RequestStream", "collect"]

_T = TypeVar("_T")


class AsyncEngine:
    """An LLM engine for asyncio (uvloop included) and trio applications, through anyio.

    Use it as an async context manager (entered and left by one task, as any anyio task
    group); inside, any number of tasks may call :meth:`stream`, :meth:`chat` and
    :meth:`generate` concurrently and share the model through continuous batching::

        async with AsyncEngine.from_pretrained("default") as engine:
            async with engine.stream("Hello", SamplingParams(max_tokens=32)) as stream:
                async for out in stream:
                    print(out.text, end="")

    Failure: if a step raises (a model error, out of memory), every in-flight stream raises
    :class:`EngineDeadError` (``__cause__``: the step's exception), later calls raise it at
    once, and :meth:`health` raises it. The engine stays dead; build a new one.

    Args:
        engine: the synchronous engine it drives.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self._core = engine
        self._loop = StepLoop(engine, AdmissionLimits(engine.config))
        self._requests = self._loop.requests
        self._tg: anyio.abc.TaskGroup | None = None  # runs the step loop and timeouts
        self._token: anyio.lowlevel.EventLoopToken | None = None  # the loop that entered
        self._loop_thread = 0  # that loop's thread
        self._submission = Submission(engine, self._loop, self._check_running)

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
        from asyncllm.engine.llm_engine import LLMEngine  # torch: only when building one

        return cls(LLMEngine.from_config(EngineConfig(model=model, **config)))

    @property
    def core(self) -> LLMEngine:
        """The engine core this front end drives (read its state between steps; requests go
        through this class, never the core's own methods, while the engine runs)."""
        return self._core

    @property
    def tokenizer(self) -> Any:
        """The model's transformers tokenizer (chat template included)."""
        return self._core.tokenizer

    @property
    def config(self) -> EngineConfig:
        """The engine's settings."""
        return self._core.config

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """Give ``tenant`` a share weight from the next step on (see ``tenant_weights`` in
        :class:`EngineConfig`); callable between steps, from the engine's loop.

        Raises:
            ValueError: ``weight`` is not a positive finite number.
        """
        self._core.scheduler.fair.set_weight(check_tenant(tenant), weight)

    async def __aenter__(self) -> AsyncEngine:
        if self._loop.dead is not None:
            raise self._loop.dead_error()
        if self._tg is not None:
            raise RuntimeError("AsyncEngine is already running")
        # The compute thread (a new one after an earlier exit, its kernels warmed up) before
        # the first request, whose time to first token would include it.
        await anyio.to_thread.run_sync(lambda: self._core.compute_thread)
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg, self._token = tg, anyio.lowlevel.current_token()
        self._loop_thread = threading.get_ident()
        self._loop.closing = False
        self._submission.enter(tg)
        self._core.driven_by_async = True
        self._loop.running = True
        tg.start_soon(self._loop.run, name="asyncllm-engine-loop")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop: :meth:`begin_shutdown` (abort in-flight requests, or let them finish in
        "drain" mode; new calls raise EngineNotRunningError), abort them anyway if the block
        raised, then join the step loop and the compute thread. Cancelling a drain aborts
        what is left and still joins."""
        tg = self._tg
        if tg is None:
            return
        self.begin_shutdown()
        if exc_type is not None:
            self._requests.abort_all()
            tg.cancel_scope.cancel()  # the step loop aborts what is left (_run)
        try:
            # Joins the loop (a cancellation here cancels it first). The block's own
            # exception is left out of the task group so that it propagates unwrapped.
            await tg.__aexit__(None, None, None)
        finally:
            self._tg = None
            self._core.stop_compute_thread()
            self._core.driven_by_async = False
            if self._loop.dead is not None:
                self._loop.release_core()

    def begin_shutdown(self) -> None:
        """Leaving ``async with``'s first part, now: new calls raise EngineNotRunningError;
        "abort" mode aborts in-flight requests ("drain": they run on). For servers, whose
        lifespan ends after the open responses (``serve`` calls it when a shutdown starts).
        Call it on the engine's loop; a no-op outside ``async with`` or a second time."""
        if self._tg is None or self._loop.closing:
            return
        self._loop.closing = True
        if self.config.shutdown_mode != "drain":
            self._requests.abort_all()
        self._loop.wakeup.set()

    def health(self) -> str:
        """ "running" (inside ``async with``, loop alive) or "stopped".

        Raises:
            EngineDeadError: the step loop failed (``__cause__``: its exception).
        """
        if self._loop.dead is not None:
            raise self._loop.dead_error()
        return "running" if self._loop.running else "stopped"

    @stream_method
    async def stream(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout: float | None = None,
        strict_max_tokens: bool = False,
        tenant: str = "",
        deadline: float | datetime.datetime | None = None,
        admission: str = "refuse",
        report_queue: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Generate for one prompt; returns a :class:`RequestStream` of the outputs as they
        are produced. The request is validated and queued when iteration starts (errors are
        raised by the first ``__anext__``); leaving early (``break`` in ``async with``, an
        exception, a cancellation, ``aclose()``) aborts it and frees its KV blocks before
        the next step: see :class:`RequestStream`.

        Args:
            prompt: text, token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``.
            params: sampling parameters (default ``SamplingParams()``); its
                ``output_kind`` says whether items are deltas, cumulative, or one final item.
            request_id: unique among in-flight calls; generated when None. Outputs carry it.
            priority: lower is served first.
            cache_salt: requests share prefix-cache blocks only with the same salt.
            timeout: seconds from when it is queued (tokenized) until it ends "timeout"
                (what was generated is kept). None: no limit.
            strict_max_tokens: refuse a ``max_tokens`` that does not fit ``max_model_len``
                after the prompt (OpenAI's API; by default it ends there, "length").
            tenant: who it is for; tenants share the slots and token budget of a priority
                band by weight (``EngineConfig.tenant_weights``); "": the shared tenant.
            deadline: seconds from now or an aware ``datetime``: earlier deadlines start
                first, and one not started by then ends "timeout" with no tokens.
            admission: "refuse": a full queue raises ``QueueFull``; "wait": wait for a
                place (:mod:`asyncllm.engine.admission`).
            report_queue: before the first token, yield token-less items with
                ``queue_position`` and ``estimated_start_s`` as the position changes.

        Yields:
            :class:`RequestOutput` items, the last with ``finish_reason`` and ``metrics``;
            with ``params.n > 1`` the samples' items interleave, tagged with ``index``.

        Raises:
            InvalidRequestError: a bad argument or a duplicate request id; a text that
                cannot fit ``max_model_len`` (refused before tokenizing it), or with
                ``strict_max_tokens`` a prompt and ``max_tokens`` that do not; ``params.n``
                above ``max_num_seqs`` or ``max_waiting`` (never taken: not ``QueueFull``).
            QueueFull: ``max_waiting`` requests (``max_waiting_per_tenant`` of the
                tenant's) wait already, with ``admission="refuse"``.
            EngineNotRunningError: outside ``async with engine`` (or while it exits).
            EngineDeadError: the step loop failed (before or during the request).
        """
        states = await self._submission.submit(
            prompt, params, request_id, timeout,
            priority=priority, cache_salt=cache_salt, strict_max_tokens=strict_max_tokens,
            tenant=tenant, deadline=deadline, admission=admission, report_queue=report_queue,
        )  # fmt: skip
        event = states[0].event  # one for all samples
        pending = list(states)
        try:
            while pending:
                await event.wait()
                outs = []
                for state in pending:  # take every sample's news before yielding any
                    if state.error is not None:
                        raise self._loop.dead_error() if self._loop.dead else state.error
                    out = state.take()
                    if out is not None:
                        outs.append((state, out))
                for state, out in outs:
                    if out.finished:
                        pending.remove(state)
                    yield out
        finally:
            for state in pending:
                self._requests.finish_early(state.request_id, "abort")

    @stream_method
    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout: float | None = None,
        strict_max_tokens: bool = False,
        tenant: str = "",
        deadline: float | datetime.datetime | None = None,
        admission: str = "refuse",
        report_queue: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the answer to chat ``messages``, like :meth:`stream` (a
        :class:`RequestStream`).

        The prompt is the model's chat template applied by transformers
        (``tokenizer.apply_chat_template``) to ``messages``.

        Tool calling (OpenAI's, vLLM's parsers the reference): ``tools`` are rendered by the
        template and the model's calls parsed out of its output into ``tool_calls`` (and
        ``tool_call_deltas``); :mod:`asyncllm.tool_calling.chat_tool_setup` tells what items carry
        and how "required" or a named ``tool_choice`` constrain the output. Output that is not
        a valid call stays in ``text`` and is described in ``tool_call_error``; it never raises.

        Args:
            messages: ``[{"role": "system" | "user" | "assistant" | "tool", "content":
                str}, ...]``; an assistant message may carry OpenAI ``tool_calls`` (their
                JSON ``arguments`` strings are decoded for the template) and a "tool"
                message answers one (``tool_call_id``).
            add_generation_prompt: end the prompt with the assistant header.
            chat_template_kwargs: extra template variables / ``apply_chat_template``
                options (``documents``, ``enable_thinking``...; ``tools`` there are only
                rendered, never parsed: pass them as ``tools``).
            tools: OpenAI function tools, ``[{"type": "function", "function": {"name",
                "description", "parameters": JSON schema of an object}}]``.
            tool_choice: "auto" (the default with tools), "none" (tools rendered, output
                not parsed), "required", or ``{"type": "function", "function": {"name":
                ...}}`` (only that tool rendered; "required" and this force calls).
            parallel_tool_calls: False keeps only the model's first call.
            Other arguments as in :meth:`stream`.

        The messages are checked on the loop (their contents' length included: see
        ``InputProcessor.check_prompt_chars``); the template is rendered and tokenized on the
        front end's tokenizer thread.

        Raises:
            InvalidRequestError: malformed messages (``tool_calls`` included), contents
                too long to fit ``max_model_len``, no chat template, or a template error;
                malformed ``tools`` (the message names the field), a ``tool_choice``
                naming no tool, tools for a template without tool support, "required" or
                a named function with ``params.structured_outputs`` set; and everything
                :meth:`stream` raises.
        """
        prompt, params, post = await self._chat_prompt(
            messages,
            params,
            ChatToolSetup(tools, tool_choice, parallel_tool_calls),
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            wait=check_admission_mode(admission),
            tenant=check_tenant(tenant),
        )
        gen = self.stream(prompt, params, request_id=request_id, priority=priority,
                          cache_salt=cache_salt, timeout=timeout,
                          strict_max_tokens=strict_max_tokens, tenant=tenant,
                          deadline=deadline, admission=admission,
                          report_queue=report_queue)  # fmt: skip
        async with gen:
            async for out in gen:
                # A queue report (no text yet) skips the reasoning and tool-call split.
                yield out if post is None or out.queue_position is not None else post.apply(out)

    async def _chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None,
        tools: ChatToolSetup,
        *,
        add_generation_prompt: bool,
        chat_template_kwargs: Mapping[str, Any] | None,
        wait: bool,
        tenant: str,
    ) -> tuple[PromptType, SamplingParams | None, ChatOutputs | None]:
        """A chat call's prompt (rendered and tokenized off the loop), its params and what
        its outputs go through (reasoning split, tool calls parsed; see :meth:`chat`)."""
        self._check_running()
        self._core.inputs.check_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        calls, params, chat_template_kwargs = tools.prepare(
            self._core.tokenizer, params, chat_template_kwargs
        )
        render = functools.partial(
            render_chat_call,
            self._core.inputs,
            messages,
            calls,
            params,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        return await self._submission.off_loop(
            render, num_samples(params), tenant=tenant, wait=wait
        )

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout: float | None = None,
        tenant: str = "",
        deadline: float | datetime.datetime | None = None,
        admission: str = "refuse",
    ) -> RequestOutput:
        """Generate for one prompt and return the whole output (see :meth:`stream`); with
        ``params.n > 1``, sample 0's output whose ``samples`` lists all n in index order."""
        stream = self.stream(prompt, params, request_id=request_id, priority=priority,
                             cache_salt=cache_salt, timeout=timeout, tenant=tenant,
                             deadline=deadline, admission=admission)  # fmt: skip
        kind = params.output_kind if isinstance(params, SamplingParams) else "delta"
        return await collect(stream, kind)

    async def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (``tokenizer.decode``, special tokens kept), decoded on
        the front end's tokenizer thread: time proportional to the ids never runs on the loop.

        Raises:
            InvalidRequestError: more than ``max_model_len`` ids (no prompt or output is
                longer), or ids outside the vocabulary.
            EngineNotRunningError: outside ``async with engine``.
        """
        self._check_running()
        core = self._core
        ids = check_token_ids(token_ids, core.max_model_len, core.vocab_size)
        return str(await self._submission.off_loop(functools.partial(core.tokenizer.decode, ids)))

    def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with finish_reason "abort" and its blocks are
        freed before the next step. Callable from any task, and from other threads (it waits
        there until the engine's loop has applied it). Unknown or finished ids are ignored;
        the id of a request with ``n > 1`` aborts all its samples."""
        token = self._token
        if token is not None and self._tg and threading.get_ident() != self._loop_thread:
            # Waits for the engine's loop to apply it; a loop that has ended runs nothing.
            with contextlib.suppress(anyio.RunFinishedError):
                finish = self._requests.finish_call
                anyio.from_thread.run_sync(finish, request_id, "abort", token=token)
            return
        self._requests.finish_call(request_id, "abort")

    async def reset_prefix_cache(self) -> int:
        """Forget every prefix-cache block that no request holds (applied between steps);
        returns how many blocks were dropped. Blocks in use keep their hashes."""
        if not self._loop.running:
            return self._core.reset_prefix_cache()
        reply = self._requests.reset_prefix_cache()
        await reply.done.wait()
        if reply.error is not None:
            raise reply.error
        return reply.value

    def stats(self) -> dict[str, int | float | str]:
        """Engine counters and the weights' precision and bytes (see ``LLMEngine.stats``);
        read between steps. ``num_waiting`` counts the front end's queued, held and
        tokenizing requests too."""
        s = self._core.stats()
        s["num_waiting"] = self._loop.num_waiting()
        return s

    def _check_running(self) -> None:
        """Raise unless new calls are accepted now, from this loop."""
        if self._loop.dead is not None:
            raise self._loop.dead_error()
        if self._tg is None or self._loop.closing:
            raise EngineNotRunningError("use `async with engine:` before sending requests")
        if threading.get_ident() != self._loop_thread:  # one loop runs on a thread at a time
            raise EngineNotRunningError(
                "an AsyncEngine serves the event loop that entered it; call it from that loop "
                "(from another thread: anyio.from_thread.run with its token, or the LLM facade)"
            )

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt + generated) of one request (``EngineConfig.max_model_len``
        resolved against the model's limit)."""
        return int(self._core.max_model_len)
