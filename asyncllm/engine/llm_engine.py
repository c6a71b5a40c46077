"""The synchronous engine: scheduler, block manager and model runner wired into ``step()``.

The async front end runs :meth:`LLMEngine.step` in a worker thread and touches the engine
only between steps, so nothing here needs a lock.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import torch

from asyncllm.config import EngineConfig
from asyncllm.core.block_manager import BlockManager
from asyncllm.core.request import Request
from asyncllm.core.scheduler import RequestUpdate, Scheduler
from asyncllm.errors import InvalidRequestError
from asyncllm.models.loader import LoadedModel, load_model
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.kv_cache import KVCache, default_kv_cache_bytes
from asyncllm.worker.model_runner import ModelRunner, kv_cache_spec

logger = logging.getLogger("asyncllm")


def resolve_device(device: str) -> torch.device:
    """ "auto" -> CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """None -> float32 on CPU, bfloat16 on CUDA."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)  # type: ignore[no-any-return]


def default_num_threads() -> int:
    """Torch intra-op threads on CPU: one core is left to the event loop, at least one."""
    return max(1, (os.cpu_count() or 1) - 1)


class LLMEngine:
    """Everything but the async front end.

    Args:
        config: the engine's settings.
        loaded: the model, already loaded (``load_model``) on the config's device and dtype.

    Raises:
        ValueError: the KV cache budget cannot hold one block per layer, or cannot hold one
            sequence of ``max_model_len`` tokens.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.device = next(loaded.model.parameters()).device
        self.max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        self.vocab_size = int(loaded.model.get_output_embeddings().weight.shape[0])

        dtype = next(loaded.model.parameters()).dtype
        spec = kv_cache_spec(loaded.config, dtype, config.block_size)
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
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.runner = ModelRunner(loaded.model, self.kv_cache, seed=config.seed)
        self.num_steps = 0
        self.num_generated_tokens = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load ``config.model`` and build the engine (sets torch's CPU thread count)."""
        device = resolve_device(config.device)
        if device.type == "cpu":
            torch.set_num_threads(config.num_threads or default_num_threads())
        loaded = load_model(config.model, dtype=resolve_dtype(config.dtype, device), device=device)
        return cls(config, loaded)

    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
    ) -> Request:
        """Validate and tokenize a call into a core request (no engine state is changed).

        Args:
            prompt: text (tokenized with the model's tokenizer, special tokens added as
                transformers does by default) or token ids.

        Raises:
            InvalidRequestError: empty prompt, token ids out of the vocabulary, a prompt of
                ``max_model_len`` tokens or more, or params that are not SamplingParams.
        """
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params)}")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            token_ids = list(self.tokenizer.encode(prompt))
        else:
            token_ids = list(prompt)
            if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in token_ids):
                raise InvalidRequestError(
                    f"prompt token ids must be ints in [0, {self.vocab_size})"
                )
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                "and at least one token must be generated"
            )
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        return Request(
            request_id,
            token_ids,
            max_tokens=params.max_tokens,
            stop_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            max_model_len=self.max_model_len,
            arrival_time=time.monotonic(),
            priority=priority,
            params=params,
        )

    def add_request(self, request: Request) -> None:
        """Queue a request made by :meth:`make_request`."""
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> bool:
        """Abort and free a request; False if it was not in the engine."""
        return self.scheduler.abort_request(request_id) is not None

    def has_unfinished(self) -> bool:
        """Requests waiting or running."""
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestUpdate]:
        """Schedule, run the model once, sample, and apply stop conditions."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        sampled = self.runner.execute(plan)
        updates = self.scheduler.update_from_output(plan, sampled)
        self.num_steps += 1
        self.num_generated_tokens += len(updates)
        return updates

    def stats(self) -> dict[str, int | float]:
        """Counters: requests running and waiting, KV blocks free and total, and totals."""
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_total_blocks,
            "kv_cache_usage": 1.0 - bm.num_free_blocks / bm.num_total_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
        }
