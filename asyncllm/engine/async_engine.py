"""The async front end on anyio (asyncio, uvloop, trio): streams, step loop, cancellation.

One task of the engine's task group (``async with engine``) owns the :class:`LLMEngine`.
Calls from other tasks (new requests, aborts) go through an inbox
(:mod:`asyncllm.engine.request_table`) that the task applies between steps; each step runs
on the engine's one compute thread (docs/tuning.md says why one) so the event loop stays
free while the model computes. Leaving a stream early (cancelled, timed out, ``break`` in
``async with``, ``aclose()``) aborts its request, which frees its KV blocks before the next
step. A request's :class:`~asyncllm.engine.output_processor.RequestState` holds its unread
output: a slow reader gets several steps merged into one item, not an unbounded queue.

Text prompts and chat templates are tokenized on an anyio worker thread (never the loop or
the compute thread, which alone does torch work), after a length check
(``InputProcessor.check_prompt_chars``); grammars (``structured_outputs``) compile on another,
one at a time, with a cache (``LLMEngine.compile_grammar``), before the request is queued: a
grammar that fails ends only its call; a slow one holds up neither the loop nor tokenization.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import msgspec

from asyncllm.config import EngineConfig
from asyncllm.engine.chat_tool_setup import ChatOutputs, ChatToolSetup, render_chat_call
from asyncllm.engine.input_processor import PromptType
from asyncllm.engine.output_processor import RequestState, TokenTextCache
from asyncllm.engine.parallel_sampling import num_samples
from asyncllm.engine.request_table import (
    Call,
    RequestTable,
    check_admission,
    check_timeout,
    check_token_ids,
)
from asyncllm.engine.step_output import StepOutput
from asyncllm.engine.streams import RequestStream, collect, stream_method
from asyncllm.engine.wakeup import Wakeup, wait_future
from asyncllm.errors import EngineDeadError, EngineNotRunningError
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine core imports torch; the front end does not
    from asyncllm.engine.llm_engine import LLMEngine

__all__ = ["AsyncEngine", "RequestStream", "collect"]

logger = logging.getLogger("asyncllm")

#: Seconds the loop waits before planning again after a step found nothing to schedule.
IDLE_RETRY_S = 0.05

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
        self._engine = engine
        self._wakeup = Wakeup()  # news for the step loop
        self._requests = RequestTable(self._wakeup.set)
        self._tg: anyio.abc.TaskGroup | None = None  # runs the step loop and timeouts
        self._token: anyio.lowlevel.EventLoopToken | None = None  # the loop that entered
        self._loop_thread = 0  # that loop's thread
        self._running = False  # the step loop runs
        self._closing = False
        self._dead: EngineDeadError | None = None
        self._token_text = TokenTextCache(engine.tokenizer)
        # Tokenization and chat templates (and grammar compiles) off the loop, one at a time
        # (vLLM's server too: fast tokenizers are not meant for concurrent encodes).
        self._tokenize_limiter: anyio.CapacityLimiter | None = None  # made on entry
        self._grammar_limiter: anyio.CapacityLimiter | None = None
        # Requests of calls being tokenized (or rendered) now: they count as waiting, so
        # max_waiting bounds the tokenizer's queue too.
        self._tokenizing = 0

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
        if self._tg is not None:
            raise RuntimeError("AsyncEngine is already running")
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg, self._token = tg, anyio.lowlevel.current_token()
        self._loop_thread = threading.get_ident()
        self._closing = False
        self._tokenize_limiter = anyio.CapacityLimiter(1)
        self._grammar_limiter = anyio.CapacityLimiter(1)
        self._engine.driven_by_async = True
        self._running = True
        tg.start_soon(self._run, name="asyncllm-engine-loop")
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
            self._engine.stop_compute_thread()
            self._engine.driven_by_async = False
            if self._dead is not None:
                self._release_core()

    def begin_shutdown(self) -> None:
        """Leaving ``async with``'s first part, now: new calls raise EngineNotRunningError;
        "abort" mode aborts in-flight requests ("drain": they run on). For servers, whose
        lifespan ends after the open responses (``serve`` calls it when a shutdown starts).
        Call it on the engine's loop; a no-op outside ``async with`` or a second time."""
        if self._tg is None or self._closing:
            return
        self._closing = True
        if self.config.shutdown_mode != "drain":
            self._requests.abort_all()
        self._wakeup.set()

    def health(self) -> str:
        """ "running" (inside ``async with``, loop alive) or "stopped".

        Raises:
            EngineDeadError: the step loop failed (``__cause__``: its exception).
        """
        if self._dead is not None:
            raise self._dead_error()
        return "running" if self._running else "stopped"

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
    ) -> AsyncGenerator[RequestOutput, None]:
        """Generate for one prompt; returns a :class:`RequestStream` of the outputs as they
        are produced.

        The request is validated and queued when iteration starts; errors are raised by
        the first ``__anext__`` (a text prompt is tokenized there, on a worker thread, after
        the cheap checks). Leaving early aborts the request and frees its KV blocks before
        the next step (``async with engine.stream(...) as s: async for out in s``, then
        ``break``, an exception, a cancellation or a timeout; or ``aclose()``): see
        :class:`RequestStream`.

        Args:
            prompt: text, token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``.
            params: sampling parameters (default ``SamplingParams()``); its
                ``output_kind`` says whether items are deltas, cumulative, or one final item.
            request_id: unique among in-flight requests (free again as soon as the call
                ends, early or not); generated when None. Outputs carry it.
            priority: lower is served first.
            cache_salt: requests share prefix-cache blocks only with requests of the same
                salt (None included); give tenants that must not share cache their own.
            timeout: seconds from when the request is queued (after its prompt is
                tokenized, and its grammar compiled); when they pass the request ends with
                finish_reason "timeout" (what was generated is kept) and its blocks are
                freed. None: no limit.
            strict_max_tokens: refuse a ``params.max_tokens`` that does not fit in
                ``max_model_len`` after the prompt, as OpenAI's API and vLLM's server do
                (by default the request ends there, with finish_reason "length").

        Yields:
            :class:`RequestOutput` items; the last has ``finish_reason`` and ``metrics``.
            With ``params.n > 1`` the samples' items interleave, each tagged with its
            ``index``, and each sample ends with its own last item.

        Raises:
            InvalidRequestError: bad prompt, params, timeout or a duplicate request id; a
                text that cannot fit ``max_model_len`` (refused before tokenizing it), or
                with ``strict_max_tokens`` a prompt and ``max_tokens`` that do not;
                ``params.n`` above ``EngineConfig.max_num_seqs`` or
                ``EngineConfig.max_waiting`` (never taken: not ``QueueFull``).
            QueueFull: ``EngineConfig.max_waiting`` requests are already waiting.
            EngineNotRunningError: outside ``async with engine`` (or while it exits).
            EngineDeadError: the step loop failed (before or during the request).
        """
        states = await self._submit(
            prompt, params, request_id, timeout,
            priority=priority, cache_salt=cache_salt, strict_max_tokens=strict_max_tokens,
        )  # fmt: skip
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
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the answer to chat ``messages``, like :meth:`stream` (a
        :class:`RequestStream`).

        The prompt is the model's chat template applied by transformers
        (``tokenizer.apply_chat_template``) to ``messages``.

        Tool calling (OpenAI's, vLLM's parsers the reference): ``tools`` are rendered by the
        template and the model's calls parsed out of its output into ``tool_calls`` (and
        ``tool_call_deltas``); :mod:`asyncllm.engine.chat_tool_setup` tells what items carry
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
        )
        gen = self.stream(prompt, params, request_id=request_id, priority=priority,
                          cache_salt=cache_salt, timeout=timeout,
                          strict_max_tokens=strict_max_tokens)  # fmt: skip
        async with gen:
            async for out in gen:
                yield out if post is None else post.apply(out)

    async def _chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None,
        tools: ChatToolSetup,
        *,
        add_generation_prompt: bool,
        chat_template_kwargs: Mapping[str, Any] | None,
    ) -> tuple[PromptType, SamplingParams | None, ChatOutputs | None]:
        """A chat call's prompt (rendered and tokenized off the loop), its params and what
        its outputs go through (reasoning split, tool calls parsed; see :meth:`chat`)."""
        self._check_running()
        self._engine.inputs.check_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        calls, params, chat_template_kwargs = tools.prepare(
            self._engine.tokenizer, params, chat_template_kwargs
        )
        render = functools.partial(
            render_chat_call,
            self._engine.inputs,
            messages,
            calls,
            params,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        return await self._off_loop(render, num_samples(params))

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
        stream = self.stream(prompt, params, request_id=request_id, priority=priority,
                             cache_salt=cache_salt, timeout=timeout)  # fmt: skip
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
        core = self._engine
        ids = check_token_ids(token_ids, core.max_model_len, core.vocab_size)
        return str(await self._off_loop(functools.partial(core.tokenizer.decode, ids)))

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
        if not self._running:
            return self._engine.reset_prefix_cache()
        reply = self._requests.reset_prefix_cache()
        await reply.done.wait()
        if reply.error is not None:
            raise reply.error
        return reply.value

    def stats(self) -> dict[str, int | float | str]:
        """Engine counters and the weights' precision and bytes (see ``LLMEngine.stats``);
        read between steps."""
        s = self._engine.stats()
        s["num_waiting"] = int(s["num_waiting"]) + self._num_queued()
        return s

    def _num_queued(self) -> int:
        return self._requests.num_queued() + self._tokenizing

    def _num_waiting(self) -> int:
        return self._num_queued() + self._engine.scheduler.num_waiting

    def _dead_error(self) -> EngineDeadError:
        """A fresh EngineDeadError per raise (one instance raised in many tasks would
        collect all their tracebacks), with the step's exception as its cause."""
        assert self._dead is not None
        err = EngineDeadError(str(self._dead))
        err.__cause__ = self._dead.__cause__
        return err

    def _check_running(self) -> None:
        """Raise unless new calls are accepted now, from this loop."""
        if self._dead is not None:
            raise self._dead_error()
        if self._tg is None or self._closing:
            raise EngineNotRunningError("use `async with engine:` before sending requests")
        if threading.get_ident() != self._loop_thread:  # one loop runs on a thread at a time
            raise EngineNotRunningError(
                "an AsyncEngine serves the event loop that entered it; call it from that loop "
                "(from another thread: anyio.from_thread.run with its token, or the LLM facade)"
            )

    async def _off_loop(
        self, fn: Callable[[], _T], num_requests: int = 0, *, grammar: bool = False
    ) -> _T:
        """``fn()`` on a worker thread, after the tokenizer's other work (the grammar
        compiler's when ``grammar``), then check the engine still takes calls. The call's
        ``num_requests`` are admitted first (``check_admission``) and count as waiting while
        ``fn`` waits or runs; a cancelled caller waits for ``fn`` (one tokenization at once)."""
        limiter = self._grammar_limiter if grammar else self._tokenize_limiter
        check_admission(self.config.max_waiting, self._num_waiting(), num_requests)
        self._tokenizing += num_requests
        try:
            result = await anyio.to_thread.run_sync(fn, limiter=limiter)
        finally:
            self._tokenizing -= num_requests
        self._check_running()
        return result

    async def _submit(
        self,
        prompt: PromptType,
        params: SamplingParams | None,
        request_id: str | None,
        timeout: float | None,
        **options: Any,
    ) -> list[RequestState]:
        """Validate, tokenize and queue a call (``options``: ``make_requests``'s keywords)."""
        self._check_running()
        request_id = self._requests.caller_id(request_id)
        check_timeout(timeout)
        grammar = None
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            params = msgspec.structs.replace(params)  # validated, and safe from the caller
            grammar = await self._off_loop(
                functools.partial(self._engine.compile_grammar, params),
                num_samples(params),
                grammar=True,
            )
        make = functools.partial(
            self._engine.inputs.make_requests,
            self._requests.internal_id(request_id),
            prompt,
            params if params is not None else SamplingParams(),
            **options,
        )
        text = self._engine.inputs.prompt_text(prompt)
        if text is None:  # token ids: cheap, validated here
            requests = make()
        else:
            self._engine.inputs.check_prompt_chars(len(text))
            requests = await self._off_loop(make, num_samples(params))
        self._requests.check_free(request_id)  # taken while this one was tokenized?
        check_admission(self.config.max_waiting, self._num_waiting(), len(requests))
        states = []
        for i, request in enumerate(requests):
            state = RequestState(
                request, request.params, self._engine.tokenizer, self._token_text,
                output_id=request_id, index=i,
            )  # fmt: skip
            if timeout is not None:
                assert self._tg is not None
                state.timeout_handle = self._requests.start_timer(
                    self._tg, request.request_id, timeout
                )
            states.append(state)
        self._requests.add(request_id, Call(requests, grammar), states)
        return states

    async def _run_step(self) -> StepOutput:
        """One step on the compute thread, waited for to its end even when the loop is
        cancelled (a step cannot be interrupted; the core must not change under it)."""
        return await wait_future(self._engine.compute_thread.submit(self._engine.step))

    async def _run(self) -> None:
        try:
            while True:
                self._requests.apply_inbox(self._engine)
                if not self._engine.has_unfinished():
                    if self._closing:
                        return
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                await anyio.lowlevel.checkpoint_if_cancelled()  # the step's wait is shielded
                updates = await self._run_step()
                self._requests.dispatch(updates, self._engine)
                if updates.idle:
                    # Nothing was schedulable: do not spin; wait for news, re-plan soon.
                    self._wakeup.clear()
                    with anyio.move_on_after(IDLE_RETRY_S):
                        await self._wakeup.wait()
        except anyio.get_cancelled_exc_class():
            # The engine's task group is cancelled (a cancelled or failed ``async with``
            # block, a cancelled drain): abort what is left, free its blocks in the core.
            self._requests.abort_all()
            self._requests.apply_inbox(self._engine)
            raise
        except BaseException as exc:
            self._die(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._running = False

    def _die(self, exc: BaseException) -> None:
        """Mark the engine dead and end every stream with EngineDeadError."""
        dead = EngineDeadError(f"engine loop failed: {exc!r}")
        dead.__cause__ = exc
        self._dead = dead
        self._requests.fail_all(self._dead_error)
        self._release_core()  # no step runs: _run_step waits for its end
        if isinstance(exc, Exception):
            logger.error("asyncllm engine loop failed", exc_info=exc)

    def _release_core(self) -> None:
        """After a failure, free what the core still holds (no step may be running)."""
        try:
            for request_id in list(self._engine.scheduler.requests):
                self._engine.abort_request(request_id)
        except Exception:  # the failure may have left the core inconsistent
            logger.exception("asyncllm: could not release the requests of a dead engine")

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt + generated) of one request (``EngineConfig.max_model_len``
        resolved against the model's limit)."""
        return int(self._engine.max_model_len)
