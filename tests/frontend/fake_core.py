"""A fake engine core for the front end's tests: no torch, no model.

:class:`FakeCore` has the interface :class:`~asyncllm.engine.async_engine.AsyncEngine` drives
(``add_request``, ``add_parallel_requests``, ``abort_request``, ``step``, ``has_unfinished``,
``num_waiting``, ``waiting_order``, ``inputs``, ``tokenizer``, ``config``, ``scheduler``,
``compute_thread`` ...). Its planning is the real pure-Python core (``asyncllm.core``: the
scheduler and block manager, so continuous batching, chunked prefill, finish reasons and the
block pool are real); only the worker is replaced: each sampled chunk's token is
:meth:`FakeCore.next_token`'s, a function of the request alone (by default it echoes the
prompt), so every stream's exact text is known in advance.

The tokenizer is byte-level, one token per byte (:func:`byte_tokenizer`): text and ids
round-trip exactly. Nothing here imports torch (tests/core/test_torch_free.py checks it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncllm.config import EngineConfig
from asyncllm.core.block_manager import BlockManager
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.scheduler import Scheduler
from asyncllm.engine.input_processor import InputProcessor
from asyncllm.output_processing.parallel_sampling import shares_prompt
from asyncllm.output_processing.step_output import IDLE_STEP, RequestStart, StepOutput
from asyncllm.worker.runner_output import RunnerOutput

__all__ = ["EOS", "FakeCore", "byte_tokenizer", "echo"]

#: The end-of-sequence token's text (the byte-level tokenizer's one special token).
EOS = "<|eos|>"


def _byte_chars() -> dict[int, str]:
    """Byte -> the printable character byte-level BPE writes it as (GPT-2's mapping:
    printable Latin-1 bytes stand for themselves, the others are shifted past 255)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


def byte_tokenizer() -> Any:
    """A transformers fast tokenizer with one token per byte, its id the byte's value (the
    ids of a text are its UTF-8 bytes), and ``EOS`` as id 256; its chat template joins the
    messages' contents, each ended by a newline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _byte_chars().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return fast


def echo(request: Request, k: int) -> int:
    """The default script: the ``k``-th generated token repeats the prompt's ``k``-th
    (cycling)."""
    prompt = request.prompt_token_ids
    return prompt[k % len(prompt)]


class FakeCore:
    """The engine core without a worker (see the module's docstring).

    Args:
        script: ``(request, k) -> token``: the request's ``k``-th generated token
            (:func:`echo` by default).
        step_s: seconds each step sleeps on the compute thread (a slow "model").
        num_blocks: the KV pool's blocks (bookkeeping only: no tensors).
        **config: :class:`EngineConfig` fields (``block_size``, ``max_num_seqs``,
            ``max_waiting`` ...); ``max_model_len`` defaults to 256.

    Attributes:
        num_steps: steps that scheduled something.
        plans: every non-empty step's plan (:class:`~asyncllm.core.plan.SchedulerOutput`).
    """

    def __init__(
        self,
        script: Callable[[Request, int], int] = echo,
        *,
        step_s: float = 0.0,
        num_blocks: int = 64,
        **config: Any,
    ) -> None:
        config.setdefault("max_model_len", 256)
        self.config = EngineConfig(model="fake", **config)
        self.max_model_len = int(self.config.max_model_len or 256)
        self.script = script
        self.step_s = step_s
        tokenizer = byte_tokenizer()
        self.vocab_size = len(tokenizer)
        self.eos_token_ids = frozenset([tokenizer.eos_token_id])
        self.inputs = InputProcessor(
            tokenizer,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            max_num_seqs=self.config.max_num_seqs,
        )
        self.block_manager = BlockManager(
            num_blocks, self.config.block_size, enable_caching=self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            tenant_weights=self.config.tenant_weights,
        )
        self.driven_by_async = False
        self.num_steps = 0
        self.plans: list[Any] = []
        self._thread: ThreadPoolExecutor | None = None

    @property
    def tokenizer(self) -> Any:
        return self.inputs.tokenizer

    @property
    def compute_thread(self) -> ThreadPoolExecutor:
        """One worker thread, as the real core's (started again after a stop)."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="fake-step")
        return self._thread

    def stop_compute_thread(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def compile_grammar(self, params: Any) -> None:
        """No grammars here: the fake samples its script."""
        if params.structured_outputs is not None:
            raise NotImplementedError("FakeCore has no grammar support")

    def add_request(self, request: Request, grammar: Any = None) -> None:
        self.scheduler.add_request(request)

    def add_parallel_requests(self, samples: Sequence[Request], grammar: Any = None) -> None:
        if shares_prompt(samples):
            self.scheduler.add_parallel_requests(samples)
        else:
            for r in samples:
                self.scheduler.add_request(r)

    def abort_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> bool:
        return self.scheduler.abort_request(request_id, status) is not None

    def reset_prefix_cache(self) -> int:
        return self.block_manager.pool.evict_free_cached()

    def num_waiting(self, tenant: str | None = None) -> int:
        sched = self.scheduler
        return sched.num_waiting if tenant is None else sched.num_waiting_of(tenant)

    def waiting_order(self) -> dict[str, int]:
        return self.scheduler.waiting_order()

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> StepOutput:
        """Plan with the real scheduler, "sample" each sampled chunk's scripted token, and
        let the scheduler apply it (stop conditions, freed blocks), as ``LLMEngine.step``."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return IDLE_STEP
        if self.step_s:
            time.sleep(self.step_s)
        now = time.monotonic()
        started: dict[str, RequestStart] = {}
        sampled: dict[str, int] = {}
        for chunk in plan.chunks:
            request = self.scheduler.requests[chunk.request_id]
            if chunk.first_num_cached_tokens is not None:  # what the plan tells, as the core's
                started[chunk.request_id] = RequestStart(now, chunk.first_num_cached_tokens)
            if chunk.sample:
                sampled[chunk.request_id] = self.script(request, len(request.output_token_ids))
        updates = self.scheduler.update_from_output(plan, sampled)
        self.num_steps += 1
        self.plans.append(plan)
        return StepOutput.of(updates, RunnerOutput(sampled), started, plan.preempted)

    def stats(self) -> dict[str, int | float | str]:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": self.scheduler.num_waiting,
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_total_blocks,
            "num_steps": self.num_steps,
        }
