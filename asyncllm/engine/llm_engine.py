"""The synchronous engine: scheduler, block manager and model runner wired into ``step()``.

The async front end runs :meth:`LLMEngine.step` in the engine's compute thread and touches
the engine only between steps, so nothing here needs a lock.
"""

from __future__ import annotations

import functools
import logging
import operator
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence, Sized
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

import msgspec
import torch

from asyncllm.config import EngineConfig
from asyncllm.core.block_manager import BlockManager, BlockPool
from asyncllm.core.request import SAMPLE_ID_SEP, Request, RequestStatus
from asyncllm.core.scheduler import RequestUpdate, Scheduler
from asyncllm.engine.tool_calls import check_message_tool_calls, template_messages
from asyncllm.errors import InvalidRequestError
from asyncllm.models.loader import LoadedModel, load_model
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured_output import GrammarCompiler, GrammarMatchers
from asyncllm.worker.device import default_num_threads, resolve_device, resolve_dtype
from asyncllm.worker.kv_cache import KVCache, default_kv_cache_bytes
from asyncllm.worker.model_runner import ModelRunner, kv_cache_spec
from asyncllm.worker.offload import CPUOffloadPool
from asyncllm.worker.sampler import RunnerOutput, TokenLogprobs
from asyncllm.worker.step_timing import StepObserver, StepTimings

logger = logging.getLogger("asyncllm")

_T = TypeVar("_T")

#: A prompt: text, token ids, or vLLM's prompt dicts ``{"prompt": str}`` /
#: ``{"prompt_token_ids": [int, ...]}``.
PromptType = str | Sequence[int] | Mapping[str, Any]


class StepOutput(list[RequestUpdate]):
    """What :meth:`LLMEngine.step` returns: the list of :class:`RequestUpdate` s (one per
    sampled request), plus the logprobs the step computed (plain Python, for the front end).

    Attributes:
        logprobs: request id -> the sampled token's (logprob, rank, top ids, top logprobs).
        prompt_logprobs: request id -> (index in the prompt of the first token scored, one
            entry as above per prompt token scored this step).
    """

    logprobs: dict[str, TokenLogprobs]
    #: True when nothing could be scheduled (requests wait for blocks or protection).
    idle = False
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]]

    def __init__(self, updates: list[RequestUpdate], out: RunnerOutput | None = None) -> None:
        super().__init__(updates)
        self.logprobs = (out.logprobs if out else None) or {}
        self.prompt_logprobs = (out.prompt_logprobs if out else None) or {}


def resolve_compile(compile: str | bool) -> bool:
    """``EngineConfig.compile`` -> whether to compile. "auto" is off on every device for
    now: on the 2-core CPU it was not faster (docs/tuning.md), and on CUDA the compiled
    forward has not been run yet."""
    return compile is True


class ComputeThread(ThreadPoolExecutor):
    """A single-thread executor for all of an engine's torch work (see
    :meth:`LLMEngine.from_config` for why one thread). Its thread starts at once and ends
    when the executor is shut down or garbage-collected."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="asyncllm-step")
        # A plain function, not a bound method: the thread must not keep the executor alive.
        self.ident: int = self.submit(threading.get_ident).result()

    def call(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` on the compute thread: directly when called there, else submitted and
        waited for (exceptions propagate)."""
        if threading.get_ident() == self.ident:
            return fn()
        return self.submit(fn).result()


def max_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token of ``tokenizer`` can cover: the longest token
    string of its vocabulary, added tokens included.

    A token's string is never shorter than the text it stands for: byte-level BPE (GPT-2,
    Llama 3, SmolLM2) spells each byte as one character and a character is at least one
    byte; SentencePiece spells a space as one "▁" and a byte fallback as "<0x0A>". (A
    tokenizer whose normalizer deletes characters could break this; none of the supported
    families does.) Falls back to 1024 when the vocabulary cannot be listed.
    """
    try:
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        return max((len(t) for t in tokens if isinstance(t, str)), default=0) or 1024
    except Exception:  # not a transformers tokenizer
        return 1024


class LLMEngine:
    """Everything but the async front end.

    Args:
        config: the engine's settings.
        loaded: the model, already loaded (``load_model``) on the config's device and dtype.
        compute_thread: the thread that runs this engine's torch work (see
            :meth:`from_config`); a new one is made when None and when needed again after
            :meth:`stop_compute_thread`.

    Raises:
        ValueError: ``config.max_model_len`` above the model's own limit (its
            ``max_position_embeddings``; vLLM refuses it too), or a KV cache budget that
            cannot hold one block per layer or one sequence of ``max_model_len`` tokens.
    """

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        compute_thread: ComputeThread | None = None,
    ) -> None:
        self._compute_thread = compute_thread
        #: Set by :class:`AsyncEngine` while it runs; :meth:`step` then refuses other callers.
        self.driven_by_async = False
        #: Profiling hook (:mod:`asyncllm.worker.step_timing`): called at the end of each step
        #: with its per-phase wall times; None (default): nothing is measured.
        self.step_observer: StepObserver | None = None
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.device = next(loaded.model.parameters()).device
        if config.max_model_len is not None and config.max_model_len > loaded.max_model_len:
            # Positions past the model's limit were never trained (or do not exist).
            raise ValueError(
                f"EngineConfig.max_model_len={config.max_model_len} is above the model's "
                f"limit of {loaded.max_model_len} tokens (max_position_embeddings); use at "
                f"most {loaded.max_model_len} or leave it None"
            )
        self.max_model_len = config.max_model_len or loaded.max_model_len
        #: Characters of a text prompt above which it cannot fit ``max_model_len`` tokens.
        self.max_prompt_chars = self.max_model_len * max_token_chars(self.tokenizer)
        self.vocab_size = int(loaded.model.get_output_embeddings().weight.shape[0])

        #: The dtype the model runs in ("auto" resolved); the KV cache takes it too.
        self.dtype = next(loaded.model.parameters()).dtype
        spec = kv_cache_spec(loaded.config, self.dtype, config.block_size)
        cap = config.max_num_seqs * self.max_model_len * spec.bytes_per_token
        budget = config.kv_cache_bytes or default_kv_cache_bytes(self.device, cap)
        num_blocks = budget // spec.bytes_per_block
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"kv_cache_bytes={budget} holds {num_blocks * config.block_size} tokens "
                f"({spec.bytes_per_token} bytes per token), fewer than max_model_len="
                f"{self.max_model_len}: raise kv_cache_bytes or lower max_model_len"
            )
        self.kv_cache = KVCache(spec, num_blocks, self.device)
        logger.info(
            "KV cache: %d bytes per token, %d blocks of %d tokens = %d tokens, %.1f MiB",
            spec.bytes_per_token,
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            self.kv_cache.num_bytes / 2**20,
        )
        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_caching=config.enable_prefix_caching
        )
        cpu_bytes = config.cpu_offload_bytes
        if cpu_bytes is None:
            cpu_bytes = self.kv_cache.num_bytes
        num_cpu_blocks = cpu_bytes // spec.bytes_per_block
        self.offload: CPUOffloadPool | None = None
        if config.preemption_mode == "offload" and num_cpu_blocks > 0:
            self.offload = CPUOffloadPool(self.kv_cache, num_cpu_blocks)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            cpu_pool=BlockPool(num_cpu_blocks) if self.offload else None,
        )
        self.runner = ModelRunner(
            loaded.model,
            self.kv_cache,
            seed=config.seed,
            attention_backend=config.attention_backend,
            compile=resolve_compile(config.compile),
        )
        #: Compiles ``structured_outputs`` (cached; never on the compute thread).
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        #: The grammar matchers of the constrained requests, by internal request id.
        self.grammar_matchers = GrammarMatchers(self.vocab_size, config.max_num_seqs)
        self.num_steps = 0
        self.num_generated_tokens = 0

    @property
    def compute_thread(self) -> ComputeThread:
        """The thread that runs :meth:`step` (and the async front end's steps)."""
        if self._compute_thread is None:
            self._compute_thread = ComputeThread()
        return self._compute_thread

    def stop_compute_thread(self) -> None:
        """Join the compute thread (and a step still running on it)."""
        if self._compute_thread is not None:
            self._compute_thread.shutdown(wait=True)
            self._compute_thread = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load ``config.model`` and build the engine on its compute thread (which sets
        torch's CPU thread count there).

        Loading, KV cache allocation and (through :class:`AsyncEngine`) every step run on
        that one thread. torch's OpenMP runtime (libgomp) gives each thread that runs a
        parallel region its own team of helper threads; once the process holds more of them
        than cores, it stops spin-waiting between parallel regions and a decode step, made of
        hundreds of small ones, slows by a third (2 cores, 2 threads: 38 ms -> 52 ms per step).
        """
        device = resolve_device(config.device)
        compute_thread = ComputeThread()

        def build() -> LLMEngine:
            if device.type == "cpu":
                torch.set_num_threads(config.num_threads or default_num_threads())
            dtype = resolve_dtype(config.dtype, device)
            loaded = load_model(
                config.model,
                dtype=dtype,
                device=device,
                quantization=config.quantization,
                quantization_group_size=config.quantization_group_size,
            )
            return cls(config, loaded, compute_thread)

        try:
            return compute_thread.submit(build).result()
        except BaseException:
            compute_thread.shutdown(wait=False)
            raise

    def make_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and tokenize a call into a core request (no engine state is changed).

        Args:
            prompt: text (tokenized with the model's tokenizer, special tokens added as
                transformers does by default, but no second BOS before a text that starts
                with the BOS token, such as a rendered chat template), token ids (ints, or
                anything with ``__index__``: numpy or torch integers), or vLLM's prompt dicts
                ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``.
            params: the request's sampling parameters; a validated copy is kept, so
                changing the caller's object later does not affect the request.
            cache_salt: isolates this request's prefix-cache sharing (see ``Request``).

        Raises:
            InvalidRequestError: empty prompt or one of the wrong type, token ids out of the
                vocabulary (prompt, ``stop_token_ids`` or ``logit_bias``), a prompt of
                ``max_model_len`` tokens or more (a text longer than ``max_prompt_chars``
                is refused before it is tokenized), or params that are not valid
                SamplingParams.
        """
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params)}")
        # A validated snapshot: a caller may have set a field to anything since construction.
        params = msgspec.structs.replace(params)
        self._refuse_oversized(prompt)
        token_ids = self._prompt_token_ids(prompt)
        if len(token_ids) >= self.max_model_len:
            self._refuse_tokens(len(token_ids))
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids or ()),
            ("logit_bias", params.logit_bias or ()),
        ):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name} holds token ids outside the vocabulary [0, {self.vocab_size}): "
                    f"{bad[:5]}"
                )
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a str or None, got {cache_salt!r}")
        if params.prompt_logprobs is not None:
            # Every prompt position must be computed to be scored, so the request must not
            # hit the prefix cache: a salt of its own shares no block (as vLLM skips the
            # cache for such requests).
            cache_salt = f"{cache_salt}\x00prompt_logprobs\x00{uuid.uuid4().hex}"
        stop_ids = frozenset(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        room = self.max_model_len - len(token_ids)
        return Request(
            request_id,
            token_ids,
            max_tokens=min(params.max_tokens or room, room),
            stop_token_ids=stop_ids,
            min_tokens=params.min_tokens,
            max_model_len=self.max_model_len,
            arrival_time=time.monotonic(),
            priority=priority,
            params=params,
            cache_salt=cache_salt,
        )

    @staticmethod
    def prompt_text(prompt: object) -> str | None:
        """The text of a text prompt (a str or ``{"prompt": str}``), else None."""
        if isinstance(prompt, Mapping):
            prompt = prompt.get("prompt")
        return prompt if isinstance(prompt, str) else None

    def check_prompt_chars(self, num_chars: int) -> None:
        """Refuse a text of ``num_chars`` characters that cannot fit ``max_model_len``
        tokens, before spending time proportional to it on tokenizing it.

        Raises:
            InvalidRequestError: ``num_chars`` above ``max_prompt_chars`` (``max_model_len``
                times the longest token's characters, :func:`max_token_chars`).
        """
        if num_chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"prompt has {num_chars} characters; it cannot fit max_model_len="
                f"{self.max_model_len} tokens (at most {self.max_prompt_chars} characters "
                "with this tokenizer)"
            )

    def _refuse_oversized(self, prompt: object) -> None:
        """Refuse a prompt that cannot fit before any work proportional to its size: a
        text by its characters, token ids by their count (one more than ``max_model_len``
        at least, so that no BOS handling can bring it under)."""
        if isinstance(prompt, Mapping):
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt))
        elif (
            isinstance(prompt, Sized)
            and not isinstance(prompt, (bytes, bytearray))  # refused as a type, later
            and len(prompt) > self.max_model_len
        ):
            self._refuse_tokens(len(prompt))

    def _refuse_tokens(self, num_tokens: int) -> NoReturn:
        raise InvalidRequestError(
            f"prompt has {num_tokens} tokens; max_model_len is {self.max_model_len} "
            "and at least one token must be generated"
        )

    def _prompt_token_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, Mapping):
            keys = set(prompt) & {"prompt", "prompt_token_ids"}
            if len(keys) != 1:
                raise InvalidRequestError(
                    "a prompt dict must have exactly one of 'prompt' and 'prompt_token_ids'"
                )
            prompt = prompt[keys.pop()]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            try:
                return _without_added_bos(self.tokenizer, prompt)
            except (TypeError, ValueError) as e:  # e.g. a lone surrogate
                raise InvalidRequestError(f"prompt cannot be tokenized: {e}") from e
        if isinstance(prompt, (bytes, bytearray)) or not hasattr(prompt, "__iter__"):
            raise InvalidRequestError(
                f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}"
            )
        try:
            token_ids = [
                operator.index(t) if not isinstance(t, bool) else -1
                for t in prompt  # type: ignore[attr-defined]
            ]
        except TypeError:
            raise InvalidRequestError("prompt token ids must be integers") from None
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be ints in [0, {self.vocab_size})")
        return token_ids

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the model's chat template (transformers'
        ``apply_chat_template``): :meth:`check_chat`, then :meth:`render_chat`.

        Args:
            messages: OpenAI-style ``[{"role": "user", "content": "..."}, ...]``.
            add_generation_prompt: end with the template's assistant header.
            chat_template_kwargs: extra template variables (e.g. ``{"enable_thinking":
                False}``) and ``apply_chat_template`` options (``tools``, ``documents``).

        Raises:
            InvalidRequestError: as :meth:`check_chat` and :meth:`render_chat`.
        """
        kw = {
            "add_generation_prompt": add_generation_prompt,
            "chat_template_kwargs": chat_template_kwargs,
        }
        self.check_chat(messages, **kw)
        return self.render_chat(messages, **kw)

    def check_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """The cheap checks of a chat call (time linear in the number of messages).

        Raises:
            InvalidRequestError: messages that are not a non-empty list of dicts with a
                str ``role`` and a str, list or None ``content``; malformed assistant
                ``tool_calls`` (``tool_calls.check_message_tool_calls``); contents of more than
                ``max_prompt_chars`` characters in all (text parts of list contents
                counted), which cannot fit ``max_model_len``; bad option types; a tokenizer
                without a chat template.
        """
        if (
            isinstance(messages, (str, bytes, Mapping))
            or not isinstance(messages, Sequence)
            or not messages
        ):
            raise InvalidRequestError("messages must be a non-empty list of dicts")
        num_chars = 0
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise InvalidRequestError(f"each message must be a dict with a str 'role': {m!r}")
            check_message_tool_calls(i, m)
            content = m.get("content")
            if isinstance(content, str):
                num_chars += len(content)
            elif isinstance(content, list):
                num_chars += sum(
                    len(part["text"])
                    for part in content
                    if isinstance(part, Mapping) and isinstance(part.get("text"), str)
                )
            elif content is not None:
                raise InvalidRequestError(f"message content must be a str or a list: {m!r}")
        # The rendered prompt holds every content, so it is at least this long.
        self.check_prompt_chars(num_chars)
        if not isinstance(add_generation_prompt, bool):
            raise InvalidRequestError("add_generation_prompt must be a bool")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise InvalidRequestError("chat_template_kwargs must be a dict or None")
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("the model's tokenizer has no chat template")

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Apply the chat template to messages that passed :meth:`check_chat` and tokenize
        (time proportional to the messages: the async front end runs it off its loop).
        Assistant ``tool_calls`` arguments given as JSON strings reach the template decoded
        (``tool_calls.template_messages``).

        The template is rendered to text first and the text's length checked
        (:meth:`check_prompt_chars`) before it is tokenized: a template also renders fields
        that :meth:`check_chat` does not count (roles, names, template variables), and
        tokenizing costs far more than rendering (a 3.5 MB role: 8 ms to render, 3 s to
        tokenize, holding the front end's one tokenizer thread). Then transformers' own
        ``apply_chat_template(tokenize=True)`` tokenizes, so the ids are exactly its ids.

        Raises:
            InvalidRequestError: a template that fails on the messages (the template's
                message is included); a rendered prompt too long to fit ``max_model_len``.
        """
        convs = template_messages(messages)
        kwargs = dict(chat_template_kwargs or {})
        try:
            text = self.tokenizer.apply_chat_template(
                convs, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
        except Exception as e:  # jinja errors, template-raised exceptions, bad kwargs
            raise InvalidRequestError(f"the chat template failed on these messages: {e}") from e
        if isinstance(text, str):
            self.check_prompt_chars(len(text))
        try:
            ids = self.tokenizer.apply_chat_template(
                convs,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                **kwargs,
            )
        except Exception as e:
            raise InvalidRequestError(f"the chat template failed on these messages: {e}") from e
        return list(ids)

    def make_requests(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> list[Request]:
        """The core requests of one call: one, or one per parallel sample when
        ``params.n > 1`` (ids ``request_id + SAMPLE_ID_SEP + str(i)``, params from
        :meth:`SamplingParams.sample_params`, ``group_id`` ``request_id``). Validates as
        :meth:`make_request` does.

        Raises:
            InvalidRequestError: as :meth:`make_request`; ``params.n`` above
                ``EngineConfig.max_num_seqs`` (the samples could never all run).
        """
        if isinstance(params, SamplingParams):
            params = msgspec.structs.replace(params)  # re-validates, n included
            if params.n > self.config.max_num_seqs:
                raise InvalidRequestError(
                    f"n={params.n} parallel samples exceed max_num_seqs="
                    f"{self.config.max_num_seqs} (the most requests running at once)"
                )
        if not isinstance(params, SamplingParams) or params.n == 1:
            return [self.make_request(request_id, prompt, params, priority=priority,
                                      cache_salt=cache_salt)]  # fmt: skip
        first = self.make_request(
            f"{request_id}{SAMPLE_ID_SEP}0", prompt, params.sample_params(0), priority=priority,
            cache_salt=cache_salt,
        )  # fmt: skip
        samples = [first]
        for i in range(1, params.n):
            r = self.make_request(
                f"{request_id}{SAMPLE_ID_SEP}{i}", first.prompt_token_ids, params.sample_params(i),
                priority=priority, cache_salt=cache_salt,
            )  # fmt: skip
            r.arrival_time = first.arrival_time
            samples.append(r)
        for r in samples:  # one call: the scheduler shares slots fairly between calls
            r.group_id = request_id
        return samples

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled grammar of ``params.structured_outputs`` (xgrammar's
        ``CompiledGrammar``, cached by the grammar's text), or None when unconstrained.
        Takes milliseconds to seconds for a new grammar: call it off the event loop.

        Raises:
            InvalidRequestError: a schema, regex or grammar the backend cannot compile
                (the message names ``structured_outputs.<field>``).
            RuntimeError: called on the compute thread (it must never wait for a compile).
        """
        spec = params.structured_outputs
        if spec is None:
            return None
        thread = self._compute_thread
        if thread is not None and threading.get_ident() == thread.ident:
            raise RuntimeError("grammars are compiled off the engine's compute thread")
        return self.grammar_compiler.compile(spec)

    def add_request(self, request: Request, grammar: Any = None) -> None:
        """Queue a request made by :meth:`make_request`.

        Args:
            request: the request.
            grammar: its :meth:`compile_grammar`, when its params have
                ``structured_outputs``; compiled here when None.

        Raises:
            InvalidRequestError: its grammar cannot be compiled (nothing is queued).
        """
        self._add_matchers([request], grammar)
        self.scheduler.add_request(request)

    def _add_matchers(self, requests: Sequence[Request], grammar: Any) -> None:
        """A grammar matcher for each request, when their params are constrained."""
        params = requests[0].params
        if params.structured_outputs is None:
            return
        if grammar is None:
            grammar = self.compile_grammar(params)
        for r in requests:
            self.grammar_matchers.add(r.request_id, grammar)

    def add_parallel_requests(self, samples: Sequence[Request], grammar: Any = None) -> None:
        """Queue the samples of one call made by :meth:`make_requests` so that they share
        the prompt's KV blocks (each with a grammar matcher of its own when constrained;
        ``grammar`` as in :meth:`add_request`). Samples that score their prompt
        (``prompt_logprobs``) each compute it, as separate requests."""
        self._add_matchers(samples, grammar)
        if samples[0].params.prompt_logprobs is not None:
            for r in samples:
                self.scheduler.add_request(r)
        else:
            self.scheduler.add_parallel_requests(samples)

    def abort_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> bool:
        """Finish a request from outside a step (an abort; a stop string the front end
        matched, with ``FINISHED_STOPPED``) and free its blocks; False if it was not in the
        engine."""
        self.grammar_matchers.free((request_id,))
        return self.scheduler.abort_request(request_id, status) is not None

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds; returns how many were dropped."""
        return self.block_manager.pool.evict_free_cached()

    def has_unfinished(self) -> bool:
        """Requests waiting or running."""
        return self.scheduler.num_unfinished > 0

    def step(self) -> StepOutput:
        """Schedule, run the model once, sample, and apply stop conditions, on the engine's
        compute thread (the caller's thread waits when it is another one).

        Returns:
            one update per sampled request, with the step's logprobs (:class:`StepOutput`).

        Raises:
            RuntimeError: an :class:`AsyncEngine` drives this engine and the call does not
                come from its step (the outputs would not reach its streams).
        """
        if self.driven_by_async and threading.get_ident() != self.compute_thread.ident:
            raise RuntimeError("an AsyncEngine drives this engine; use its API, not step()")
        return self.compute_thread.call(self._step)

    def _step(self) -> StepOutput:
        observer = self.step_observer
        clock = self.runner.timings = StepTimings() if observer is not None else None
        plan = self.scheduler.schedule()
        if plan.is_empty:
            idle = StepOutput([])
            idle.idle = True
            return idle
        now = time.monotonic()
        for chunk in plan.chunks:
            request = self.scheduler.requests.get(chunk.request_id)
            if request is not None and request.first_scheduled_time is None:
                request.first_scheduled_time = now
        if clock is not None:
            clock.lap("schedule")
        if self.offload is not None and (plan.swap_out or plan.swap_in):
            self.offload.swap(plan.swap_out, plan.swap_in)
        self.kv_cache.copy_blocks(plan.copies)
        if clock is not None:
            clock.lap("kv_copy")
        matchers = self.grammar_matchers
        mask = matchers.fill([c.request_id for c in plan.chunks if c.sample])
        if clock is not None and mask is not None:
            clock.lap("grammar_fill")
        out = self.runner.execute(plan, mask) if plan.chunks else RunnerOutput({})
        finished = matchers.accept(out.sampled) if mask is not None else None
        if clock is not None and mask is not None:
            clock.lap("grammar_accept")
        updates = self.scheduler.update_from_output(plan, out.sampled, finished)
        if mask is not None:
            matchers.free(u.request_id for u in updates if u.finish_reason is not None)
        self.num_steps += 1
        self.num_generated_tokens += len(updates)
        if observer is not None and clock is not None:
            clock.lap("update")
            clock.finish()
            observer(clock, plan)
        return StepOutput(updates, out)

    def stats(self) -> dict[str, int | float | str]:
        """Counters: requests running and waiting; KV blocks free and total; preemptions,
        blocks swapped out and in, bytes they moved and tokens dropped for recompute; CPU pool
        blocks free and total; prefix-cache queries and hits (tokens) and hit rate; steps and
        generated tokens; the weights' ``precision`` (e.g. "float32", "int4 g32", "gguf
        (...)") and ``weight_bytes`` (bytes of parameters and buffers, as loaded)."""
        bm = self.block_manager
        sched = self.scheduler
        queries = sched.prefix_cache_queries
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": self.scheduler.num_waiting,
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_total_blocks,
            "kv_cache_usage": 1.0 - bm.num_free_blocks / bm.num_total_blocks,
            "num_preemptions": sched.num_preemptions,
            "num_swapped_out_blocks": sched.num_swapped_out_blocks,
            "num_swapped_in_blocks": sched.num_swapped_in_blocks,
            "swap_bytes": (sched.num_swapped_out_blocks + sched.num_swapped_in_blocks)
            * self.kv_cache.spec.bytes_per_block,
            "num_recomputed_tokens": sched.num_recomputed_tokens,
            "num_free_cpu_blocks": sched.cpu_pool.num_free if sched.cpu_pool else 0,
            "num_total_cpu_blocks": sched.cpu_pool.num_blocks if sched.cpu_pool else 0,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": sched.prefix_cache_hits,
            "prefix_cache_hit_rate": sched.prefix_cache_hits / queries if queries else 0.0,
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
            "precision": self.loaded.precision,
            "weight_bytes": self.loaded.weight_bytes,
        }


def _without_added_bos(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text)`` (special tokens added, as transformers does by default), but
    without a second BOS: a text that already starts with the BOS token's text -- typically a
    chat template rendered with ``tokenize=False``, whose template writes ``{{ bos_token }}``
    -- keeps only its own BOS when the tokenizer would add one too (Llama-2 style
    post-processors). Silently doubled BOS tokens change what the model sees; llama.cpp warns
    about it, and vLLM's chat path tokenizes rendered templates without special tokens. Logged
    (a warning, once per process).
    """
    ids = list(tokenizer.encode(text))
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None or ids[:2] != [bos_id, bos_id] or not text.startswith(bos):
        return ids
    raw = list(tokenizer.encode(text, add_special_tokens=False))
    if raw[:1] != [bos_id] or ids[1 : 1 + len(raw)] != raw:
        return ids  # both BOS are the text's own
    _warn_added_bos(bos)
    return ids[1:]


@functools.cache
def _warn_added_bos(bos: str) -> None:
    logger.warning(
        "the prompt text starts with the BOS token %r and the tokenizer adds one too: the "
        "added BOS is dropped (logged once)",
        bos,
    )
