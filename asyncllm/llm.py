"""A synchronous facade for scripts and notebooks: ``LLM(...).generate(prompts, params)``.

:class:`LLM` owns an :class:`~asyncllm.engine.async_engine.AsyncEngine` running on its own
event loop (asyncio, on uvloop when installed) in a background thread: anyio's blocking portal
(``anyio.from_thread.start_blocking_portal``), which enters and leaves the engine in one task
of that loop and runs each call there. Its blocking methods so work the same in a plain
script and inside Jupyter, where the main thread already runs a loop. Each call submits
every prompt at once (continuous batching does the rest), shows a tqdm progress bar, and
returns the outputs in prompt order.
"""

from __future__ import annotations

import concurrent.futures
import functools
import operator
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import anyio
import anyio.from_thread

from asyncllm.engine.async_engine import AsyncEngine, RequestStream, collect
from asyncllm.engine.input_processor import PromptType
from asyncllm.errors import InvalidRequestError
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["LLM"]

T = TypeVar("T")
Messages = Sequence[Mapping[str, Any]]


def _loop_options() -> dict[str, Any]:
    """The portal's asyncio options: uvloop when installed."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


def _shutdown(
    engine_cm: AbstractContextManager[Any],
    portal_cm: AbstractContextManager[Any],
    loop_thread: int,
) -> None:
    """Leave the engine's context on its loop, then stop the loop and join its thread
    (nothing when called on that thread: it cannot wait for itself)."""
    if threading.get_ident() == loop_thread:
        return
    try:
        engine_cm.__exit__(None, None, None)
    finally:
        portal_cm.__exit__(None, None, None)


def _first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first error of a task group's exception group (nested groups opened)."""
    first = group.exceptions[0]
    return _first_error(first) if isinstance(first, BaseExceptionGroup) else first


def _is_token_ids(x: object) -> bool:
    if isinstance(x, (str, bytes, Mapping)) or not isinstance(x, Sequence) or not x:
        return False
    try:
        return all(not isinstance(t, bool) and operator.index(t) is not None for t in x)
    except TypeError:
        return False


class LLM:
    """Blocking generation over an :class:`AsyncEngine`, for scripts and notebooks.

    Example::

        llm = LLM("default", max_num_seqs=32)
        outs = llm.generate(["Hello", "Bonjour"], SamplingParams(max_tokens=32))
        print(outs[0].text)
        llm.close()  # or use ``with LLM(...) as llm:``; also done at garbage collection

    Args:
        model: "default", a Hugging Face directory, or a ``.gguf`` file.
        **config: other :class:`~asyncllm.config.EngineConfig` fields. ``max_waiting``
            defaults to None here (the facade is the engine's only client and submits
            whole batches); when set, submissions past it wait for a place, in order.

    Raises:
        ValueError: a bad config field or model (as ``AsyncEngine.from_pretrained``).
    """

    def __init__(self, model: str = "default", **config: Any) -> None:
        config.setdefault("max_waiting", None)
        engine = AsyncEngine.from_pretrained(model, **config)
        self._engine = engine
        portal_cm = anyio.from_thread.start_blocking_portal(
            "asyncio", _loop_options(), name="asyncllm-llm-loop"
        )
        self._portal = portal_cm.__enter__()
        try:
            self._loop_thread: int = self._portal.call(threading.get_ident)
            engine_cm = self._portal.wrap_async_context_manager(engine)
            engine_cm.__enter__()
        except BaseException:
            portal_cm.__exit__(None, None, None)
            raise
        self._finalizer = weakref.finalize(self, _shutdown, engine_cm, portal_cm, self._loop_thread)

    @property
    def engine(self) -> AsyncEngine:
        """The underlying async engine (its coroutines run on this facade's loop only)."""
        return self._engine

    @property
    def tokenizer(self) -> Any:
        """The model's transformers tokenizer."""
        return self._engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; block until all are done.

        Args:
            prompts: one prompt or a list: text, token ids, or vLLM prompt dicts. A flat
                list of ints is one token-id prompt; a list of lists of ints is several.
            params: one :class:`SamplingParams` for all prompts, or one per prompt
                (default ``SamplingParams()``). Outputs are whole whatever ``output_kind``.
            use_tqdm: show a progress bar (requests done, generated tokens per second).

        Returns:
            One whole :class:`RequestOutput` per prompt, in order.

        Raises:
            InvalidRequestError: a bad prompt or params, or a params list of the wrong
                length (the other requests of the call are aborted).
            EngineDeadError: the engine failed.
        """
        if isinstance(prompts, (str, Mapping)) or _is_token_ids(prompts):
            items: list[Any] = [prompts]
        elif isinstance(prompts, Sequence):
            items = list(prompts)
        else:
            raise InvalidRequestError(
                f"prompts must be a str, token ids, or a list of them, got {type(prompts)}"
            )
        per = self._params_list(params, len(items))
        engine = self._engine
        makers = [
            (lambda p=p, sp=sp: engine.stream(p, sp, admission="wait"), sp.output_kind)
            for p, sp in zip(items, per, strict=True)
        ]
        return self._call_with_bar(makers, use_tqdm, "Generating")

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them (the model's chat template applied by
        transformers); block until all are done.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``, or a list of such lists.
            params, use_tqdm: as in :meth:`generate`.
            add_generation_prompt, chat_template_kwargs, tools, tool_choice,
                parallel_tool_calls: as in :meth:`AsyncEngine.chat` (each output's
                ``tool_calls`` holds all its calls).

        Returns:
            One whole :class:`RequestOutput` per conversation, in order.
        """
        if isinstance(messages, Sequence) and messages and isinstance(messages[0], Mapping):
            convs: list[Any] = [messages]
        elif isinstance(messages, Sequence) and not isinstance(messages, (str, bytes)):
            convs = list(messages)
        else:
            raise InvalidRequestError("messages must be a list of dicts, or a list of such lists")
        per = self._params_list(params, len(convs))
        engine = self._engine
        kw: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "chat_template_kwargs": chat_template_kwargs,
            "tools": tools,
            "tool_choice": tool_choice,
            "parallel_tool_calls": parallel_tool_calls,
        }
        makers = [
            (lambda m=m, sp=sp: engine.chat(m, sp, admission="wait", **kw), sp.output_kind)
            for m, sp in zip(convs, per, strict=True)
        ]
        return self._call_with_bar(makers, use_tqdm, "Chatting")

    def close(self) -> None:
        """Finish: abort what is in flight, join the engine's task group, its compute
        thread and the loop thread. Idempotent; also runs at garbage collection and
        interpreter exit."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _params_list(
        params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if isinstance(params, str | bytes) or not isinstance(params, Sequence):
            raise InvalidRequestError(
                f"params must be SamplingParams or a list of {n} (one per prompt), got "
                f"{type(params).__name__}"
            )
        if len(params) != n:
            raise InvalidRequestError(
                f"params must be SamplingParams or a list of {n} (one per prompt), got a "
                f"list of {len(params)}"
            )
        for p in params:
            if not isinstance(p, SamplingParams):
                raise InvalidRequestError(f"params must be SamplingParams, got {type(p)}")
        return list(params)

    def _call_with_bar(
        self,
        makers: Sequence[tuple[Callable[[], RequestStream], str]],
        use_tqdm: bool,
        desc: str,
    ) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        # Made in the calling thread (a notebook displays the widget in the running cell);
        # updated from the loop thread.
        bar = tqdm(total=len(makers), desc=desc, unit="req", disable=not use_tqdm)
        try:
            return self._call(functools.partial(self._run_all, makers, bar))
        finally:
            bar.close()

    def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()`` on the facade's loop (a task of its portal) and wait; Ctrl-C
        cancels it (aborting its requests) before re-raising."""
        if not self._finalizer.alive:
            raise RuntimeError("this LLM is closed")
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError("LLM methods cannot be called from its own event loop thread")
        fut = self._portal.start_task_soon(fn)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            concurrent.futures.wait([fut], timeout=30)
            raise

    async def _run_all(
        self,
        makers: Sequence[tuple[Callable[[], RequestStream], str]],
        bar: Any,
    ) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(makers)
        start = time.monotonic()
        generated = 0

        async def one(i: int) -> None:
            nonlocal generated
            make, kind = makers[i]
            out = await collect(make(), kind)  # admission="wait": in order, past max_waiting
            results[i] = out
            generated += len(out.token_ids)
            elapsed = max(time.monotonic() - start, 1e-9)
            bar.set_postfix_str(f"{generated / elapsed:.1f} tok/s", refresh=False)
            bar.update(1)

        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(makers)):
                    tg.start_soon(one, i)
        except BaseExceptionGroup as group:  # the first failure cancelled the others
            raise _first_error(group) from group
        return [r for r in results if r is not None]
