"""A synchronous facade for scripts and notebooks: ``LLM(...).generate(prompts, params)``.

:class:`LLM` owns an :class:`~asyncllm.engine.async_engine.AsyncEngine` running on its own
event loop (uvloop when installed) in a dedicated background thread, so its blocking methods
work the same in a plain script and inside Jupyter, where the main thread already runs a
loop. Each call submits every prompt at once (continuous batching does the rest), shows a
tqdm progress bar, and returns the outputs in prompt order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import operator
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from asyncllm.engine.async_engine import AsyncEngine, collect
from asyncllm.engine.input_processor import PromptType
from asyncllm.errors import InvalidRequestError, QueueFull
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams

__all__ = ["LLM"]

T = TypeVar("T")
Messages = Sequence[Mapping[str, Any]]


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()  # type: ignore[no-any-return]


def _shutdown(
    loop: asyncio.AbstractEventLoop, thread: threading.Thread, engine: AsyncEngine
) -> None:
    """Leave the engine's context on its loop, stop the loop, join the thread, close it."""
    if loop.is_closed():
        return
    if thread.is_alive():
        fut = asyncio.run_coroutine_threadsafe(engine.__aexit__(None, None, None), loop)
        try:
            fut.result(timeout=60)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=60)
    if not thread.is_alive():
        loop.close()


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
            whole batches); when set, submissions past it are retried as requests finish.

    Raises:
        ValueError: a bad config field or model (as ``AsyncEngine.from_pretrained``).
    """

    def __init__(self, model: str = "default", **config: Any) -> None:
        config.setdefault("max_waiting", None)
        engine = AsyncEngine.from_pretrained(model, **config)
        self._engine = engine
        self._loop = _new_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="asyncllm-llm-loop", daemon=True
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._thread, engine)
        try:
            self._call(engine.__aenter__())
        except BaseException:
            self._finalizer()
            raise

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
            (lambda p=p, sp=sp: engine.stream(p, sp), sp.output_kind)
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
        kw = {
            "add_generation_prompt": add_generation_prompt,
            "chat_template_kwargs": chat_template_kwargs,
            "tools": tools,
            "tool_choice": tool_choice,
            "parallel_tool_calls": parallel_tool_calls,
        }
        makers = [
            (lambda m=m, sp=sp: engine.chat(m, sp, **kw), sp.output_kind)
            for m, sp in zip(convs, per, strict=True)
        ]
        return self._call_with_bar(makers, use_tqdm, "Chatting")

    def close(self) -> None:
        """Finish: abort what is in flight, join the engine's task, its thread and the
        loop thread. Idempotent; also runs at garbage collection and interpreter exit."""
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
        if not isinstance(params, Sequence) or len(params) != n:
            raise InvalidRequestError(
                f"params must be SamplingParams or a list of {n} (one per prompt), got "
                f"{len(params) if isinstance(params, Sequence) else type(params)}"
            )
        for p in params:
            if not isinstance(p, SamplingParams):
                raise InvalidRequestError(f"params must be SamplingParams, got {type(p)}")
        return list(params)

    def _call_with_bar(
        self,
        makers: Sequence[tuple[Callable[[], AsyncIterator[RequestOutput]], str]],
        use_tqdm: bool,
        desc: str,
    ) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        # Made in the calling thread (a notebook displays the widget in the running cell);
        # updated from the loop thread.
        bar = tqdm(total=len(makers), desc=desc, unit="req", disable=not use_tqdm)
        try:
            return self._call(self._run_all(makers, bar))
        finally:
            bar.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the facade's loop and wait; Ctrl-C cancels it (aborting its
        requests) before re-raising."""
        if not self._finalizer.alive:
            coro.close()
            raise RuntimeError("this LLM is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LLM methods cannot be called from its own event loop thread")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            concurrent.futures.wait([fut], timeout=30)
            raise

    async def _run_all(
        self,
        makers: Sequence[tuple[Callable[[], AsyncIterator[RequestOutput]], str]],
        bar: Any,
    ) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(makers)
        start = time.monotonic()
        generated = 0

        async def one(i: int) -> None:
            nonlocal generated
            make, kind = makers[i]
            while True:
                try:
                    out = await collect(make(), kind)
                    break
                except QueueFull:  # only when the caller bounded max_waiting
                    await asyncio.sleep(0.02)
            results[i] = out
            generated += len(out.token_ids)
            elapsed = max(time.monotonic() - start, 1e-9)
            bar.set_postfix_str(f"{generated / elapsed:.1f} tok/s", refresh=False)
            bar.update(1)

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(makers))]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [r for r in results if r is not None]
