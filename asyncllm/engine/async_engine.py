"""The asyncio front end: streams, the background step loop, cancellation.

One background task owns the :class:`LLMEngine`. Calls from other tasks (new requests,
aborts) go through an inbox that the task applies between steps; each step runs in a single
worker thread so the event loop stays free while the model computes. Each request has a
mailbox that holds the not-yet-read delta: a slow reader gets several steps merged into one
item instead of an unbounded queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncllm.config import EngineConfig
from asyncllm.core.request import Request
from asyncllm.core.scheduler import RequestUpdate
from asyncllm.engine.detokenizer import IncrementalDetokenizer
from asyncllm.engine.llm_engine import LLMEngine
from asyncllm.errors import EngineDeadError, EngineNotRunningError, InvalidRequestError
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams

logger = logging.getLogger("asyncllm")


class _Mailbox:
    """One request's unread output, merged; the engine task writes, the stream reads."""

    __slots__ = (
        "detokenizer",
        "error",
        "event",
        "finish_reason",
        "num_generated",
        "num_prompt_tokens",
        "text",
        "token_ids",
    )

    def __init__(self, detokenizer: IncrementalDetokenizer, num_prompt_tokens: int) -> None:
        self.detokenizer = detokenizer
        self.num_prompt_tokens = num_prompt_tokens
        self.num_generated = 0
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.event = asyncio.Event()

    def post(self, token_id: int | None, finish_reason: str | None) -> None:
        if token_id is not None:
            self.token_ids.append(token_id)
            self.text += self.detokenizer.add_tokens([token_id])
            self.num_generated += 1
        if finish_reason is not None:
            self.text += self.detokenizer.flush()
            self.finish_reason = finish_reason
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()

    def take(self, request_id: str) -> RequestOutput:
        out = RequestOutput(
            request_id=request_id,
            token_ids=self.token_ids,
            text=self.text,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated,
        )
        self.token_ids = []
        self.text = ""
        self.event.clear()
        return out


class AsyncEngine:
    """An LLM engine for asyncio applications.

    Use it as an async context manager; inside, any number of tasks may call :meth:`stream`
    and :meth:`generate` concurrently and share the model through continuous batching::

        async with AsyncEngine.from_pretrained("default") as engine:
            async for out in engine.stream("Hello", SamplingParams(max_tokens=32)):
                print(out.text, end="")

    Args:
        engine: the synchronous engine it drives.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._mailboxes: dict[str, _Mailbox] = {}
        self._inbox_add: dict[str, Request] = {}
        self._inbox_abort: set[str] = set()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._closing = False
        self._dead: EngineDeadError | None = None
        self._ids = itertools.count()

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
        if self._task is not None:
            raise RuntimeError("AsyncEngine is already running")
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncllm-step")
        self._closing = False
        self._task = asyncio.create_task(self._run(), name="asyncllm-engine-loop")
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Abort every in-flight request, stop the loop and join its task and thread."""
        for request_id in list(self._mailboxes):
            self.abort(request_id)
        self._closing = True
        assert self._wakeup is not None and self._task is not None
        self._wakeup.set()
        with contextlib.suppress(Exception):
            await self._task
        self._task = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    async def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Generate for one prompt, yielding deltas as they are produced.

        Leaving the loop early (``break``, ``aclose()``, or cancelling the consuming task)
        aborts the request and frees its KV blocks before the next step.

        Args:
            prompt: text, or token ids.
            params: sampling parameters (default ``SamplingParams()``).
            request_id: unique among in-flight requests; generated when None.
            priority: lower is served first.

        Yields:
            :class:`RequestOutput` deltas; the last has ``finish_reason`` set.

        Raises:
            InvalidRequestError: bad prompt, params or a duplicate request id.
            EngineNotRunningError: outside ``async with engine``.
            EngineDeadError: the step loop failed.
        """
        mailbox, request_id = self._submit(prompt, params, request_id, priority)
        finished = False
        try:
            while True:
                await mailbox.event.wait()
                if mailbox.error is not None:
                    raise mailbox.error
                out = mailbox.take(request_id)
                finished = out.finished
                if out.token_ids or out.text or finished:
                    yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestOutput:
        """Generate for one prompt and return the whole output (see :meth:`stream`)."""
        token_ids: list[int] = []
        text: list[str] = []
        last: RequestOutput | None = None
        async for last in self.stream(prompt, params, request_id=request_id, priority=priority):
            token_ids.extend(last.token_ids)
            text.append(last.text)
        assert last is not None
        last.token_ids = token_ids
        last.text = "".join(text)
        return last

    def abort(self, request_id: str) -> None:
        """Abort a request from any task of the loop; unknown ids are ignored."""
        mailbox = self._mailboxes.pop(request_id, None)
        if mailbox is None:
            return
        if self._inbox_add.pop(request_id, None) is None:
            self._inbox_abort.add(request_id)
            if self._wakeup is not None:
                self._wakeup.set()
        mailbox.post(None, "abort")

    def stats(self) -> dict[str, int | float]:
        """Engine counters (see ``LLMEngine.stats``); read between steps."""
        s = self._engine.stats()
        s["num_waiting"] += len(self._inbox_add)
        return s

    def _submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        request_id: str | None,
        priority: int,
    ) -> tuple[_Mailbox, str]:
        if self._dead is not None:
            raise self._dead
        if self._task is None or self._closing:
            raise EngineNotRunningError("use `async with engine:` before sending requests")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._mailboxes:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        request = self._engine.make_request(
            request_id,
            prompt,
            params if params is not None else SamplingParams(),
            priority=priority,
        )
        detok = IncrementalDetokenizer(self._engine.tokenizer, request.prompt_token_ids)
        mailbox = _Mailbox(detok, len(request.prompt_token_ids))
        self._mailboxes[request_id] = mailbox
        self._inbox_add[request_id] = request
        assert self._wakeup is not None
        self._wakeup.set()
        return mailbox, request_id

    def _drain_inbox(self) -> None:
        for request_id in self._inbox_abort:
            self._engine.abort_request(request_id)
        self._inbox_abort.clear()
        for request in self._inbox_add.values():
            self._engine.add_request(request)
        self._inbox_add.clear()

    def _dispatch(self, updates: list[RequestUpdate]) -> None:
        for u in updates:
            mailbox = self._mailboxes.get(u.request_id)
            if mailbox is None:
                continue  # aborted by its consumer during the step
            mailbox.post(u.token_id, u.finish_reason)
            if u.finish_reason is not None:
                del self._mailboxes[u.request_id]

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
                updates = await loop.run_in_executor(self._executor, self._engine.step)
                self._dispatch(updates)
        except BaseException as exc:
            dead = EngineDeadError(f"engine loop failed: {exc!r}")
            dead.__cause__ = exc
            self._dead = dead
            for mailbox in self._mailboxes.values():
                mailbox.fail(dead)
            self._mailboxes.clear()
            if not isinstance(exc, Exception):
                raise
            logger.exception("asyncllm engine loop failed")
