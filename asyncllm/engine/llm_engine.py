"""The synchronous engine: scheduler, block manager and model runner wired into ``step()``.

:class:`LLMEngine` builds the parts (:meth:`LLMEngine.from_config`), takes requests
(:meth:`~LLMEngine.add_request`, made and validated by its :class:`InputProcessor`,
``engine.inputs``), aborts them, runs steps and reports counters. The async front end runs
:meth:`LLMEngine.step` in the engine's compute thread and touches the engine only between
steps, so nothing here needs a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from asyncllm import envs
from asyncllm.config import EngineConfig
from asyncllm.core.block_manager import BlockManager, BlockPool
from asyncllm.core.host_store import HostPrefixStore
from asyncllm.core.plan import SchedulerOutput
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.scheduler import Scheduler
from asyncllm.core.speculation import RequestSpeculation, SpecConfig, Speculation
from asyncllm.engine.input_processor import InputProcessor, PromptType
from asyncllm.kernels import native
from asyncllm.layers.quant_linear import holds_experts
from asyncllm.models.fingerprint import fingerprints
from asyncllm.models.loader import LoadedModel, load_model, stored_dtype
from asyncllm.output_processing.parallel_sampling import shares_prompt
from asyncllm.output_processing.step_output import IDLE_STEP, RequestStart, StepOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured_output import GrammarCompiler, GrammarMatchers
from asyncllm.worker.compiled import ModelSource
from asyncllm.worker.device import (
    resolve_compile,
    resolve_device,
    resolve_dtype,
    set_cpu_threads,
    trim_host_memory,
)
from asyncllm.worker.disk_tier import DiskPrefixCache, namespace_digest
from asyncllm.worker.kv_cache import KVCache, size_kv_cache
from asyncllm.worker.model_runner import ModelRunner, select_attention_backend
from asyncllm.worker.offload import CPUOffloadPool
from asyncllm.worker.runner_output import RunnerOutput
from asyncllm.worker.step_timing import StepObserver, StepTimings

__all__ = ["ComputeThread", "LLMEngine", "PromptType", "StepOutput"]

logger = logging.getLogger("asyncllm")

_T = TypeVar("_T")


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
            ``max_position_embeddings``, or a longrope model's
            ``original_max_position_embeddings``: :func:`asyncllm.preflight.context_length`;
            vLLM refuses the former too), or a KV cache budget that cannot hold one block per
            layer or one sequence of ``max_model_len`` tokens.
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
        self.device = next(loaded.model.parameters()).device
        if config.max_model_len is not None and config.max_model_len > loaded.max_model_len:
            # Positions past the model's limit were never trained (or do not exist).
            raise ValueError(
                f"EngineConfig.max_model_len={config.max_model_len} is above the model's "
                f"limit of {loaded.max_model_len} tokens (max_position_embeddings, or a "
                "longrope model's original_max_position_embeddings); use at "
                f"most {loaded.max_model_len} or leave it None"
            )
        self.max_model_len = config.max_model_len or loaded.max_model_len
        model: Any = loaded.model  # a transformers PreTrainedModel
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        #: Validates and tokenizes calls into requests (see :class:`InputProcessor`).
        self.inputs = InputProcessor(
            loaded.tokenizer,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=frozenset(loaded.eos_token_ids),
            max_num_seqs=config.max_num_seqs,
        )
        #: The dtype the model runs in ("auto" resolved); the KV cache takes it too.
        self.dtype = next(loaded.model.parameters()).dtype
        self._build_core(config, loaded)
        #: Compiles ``structured_outputs`` (cached; never on the compute thread).
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        #: The grammar matchers of the constrained requests, by internal request id.
        self.grammar_matchers = GrammarMatchers(self.vocab_size, config.max_num_seqs)
        self.num_steps = 0
        self.num_generated_tokens = 0
        trim_host_memory()  # what loading and packing freed

    def _build_core(self, config: EngineConfig, loaded: LoadedModel) -> None:
        """The KV cache (sized by :func:`~asyncllm.worker.kv_cache.size_kv_cache`), the
        CPU offload pool, the block manager, the scheduler and the model runner."""
        spec, num_blocks = size_kv_cache(
            loaded.config,
            self.dtype,
            self.device,
            block_size=config.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            kv_cache_bytes=config.kv_cache_bytes,
            max_num_batched_tokens=config.max_num_batched_tokens,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        self.kv_cache = KVCache(spec, num_blocks, self.device)
        logger.info(
            "KV cache: %s, %s; %d bytes per token, %d blocks of %d tokens = %d tokens, %.1f MiB",
            spec.layer_groups.describe(),
            spec.kv_dtype_name,
            spec.bytes_per_token,
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            self.kv_cache.num_bytes / 2**20,
        )
        self.offload, cpu_pool, store = host_pools(config, self.kv_cache)
        #: The disk tier of the prefix cache (``EngineConfig.prefix_cache_dir``), or None.
        self.disk: DiskPrefixCache | None = None
        if config.prefix_cache_dir is not None and self.offload is not None and store is not None:
            self.disk = DiskPrefixCache(
                config.prefix_cache_dir,
                kv_namespace(loaded, spec),
                self.offload.key_blocks + self.offload.value_blocks,
                config.prefix_cache_dir_bytes,
            )
            store.disk = self.disk
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            groups=spec.layer_groups,
            host_store=store,
        )
        if self.disk is not None:
            self.block_manager.new_cached = []  # written through to the disk tier
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            cpu_pool=cpu_pool if config.preemption_mode == "offload" else None,
            tenant_weights=config.tenant_weights,
        )
        if config.speculative_tokens > 0:
            self.scheduler.spec = Speculation(
                SpecConfig(
                    config.speculative_tokens,
                    config.prompt_lookup_min,
                    config.prompt_lookup_max,
                    config.speculative_disable_by_batch_size,
                )
            )
        self.runner = ModelRunner(
            loaded.model,
            self.kv_cache,
            seed=config.seed,
            attention_backend=config.attention_backend,
            compile=resolve_compile(config.compile, self.device, holds_experts(loaded.model)),
            model_source=ModelSource(
                str(config.model),
                str(self.dtype).removeprefix("torch."),
                config.quantization,
                config.quantization_group_size,
            ),
        )

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (the input processor's)."""
        return self.inputs.tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end a request unless ``ignore_eos`` (the input processor's)."""
        return self.inputs.eos_token_ids

    @property
    def compute_thread(self) -> ComputeThread:
        """The thread that runs :meth:`step` (and the async front end's steps). A new one
        (after :meth:`stop_compute_thread`) gets ``config.num_threads`` itself: a thread
        takes torch's process-wide count at its first parallel op, which any thread's
        ``torch.set_num_threads`` changes; and runs ``runner.warm_up_thread`` there."""
        if self._compute_thread is None:
            thread = ComputeThread()
            thread.submit(set_cpu_threads, self.device, self.config.num_threads).result()
            runner = getattr(self, "runner", None)
            if runner is not None:  # kernels set up per thread, before a request waits
                thread.submit(runner.warm_up_thread).result()
            self._compute_thread = thread
        return self._compute_thread

    def stop_compute_thread(self) -> None:
        """Join the compute thread (and a step still running on it); stop a compile still
        running in a child process; finish the disk tier's queued writes and join its
        thread (a later step starts it again)."""
        compiled = getattr(getattr(self, "runner", None), "compiled", None)
        if compiled is not None:
            compiled.close()
        if self._compute_thread is not None:
            self._compute_thread.shutdown(wait=True)
            self._compute_thread = None
        disk = getattr(self, "disk", None)
        if disk is not None:  # after the last step: no save starts its thread again
            disk.close()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load ``config.model`` and build the engine on its compute thread (which sets
        torch's CPU thread count there).

        Loading, KV cache allocation and (through :class:`AsyncEngine`) every step run on
        that one thread. torch's OpenMP runtime (libgomp) gives each thread that runs a
        parallel region its own team of helper threads; once the process holds more of them
        than cores, it stops spin-waiting between parallel regions and a decode step, made of
        hundreds of small ones, slows down markedly (docs/tuning.md, "Torch threads on CPU").
        """
        device = resolve_device(config.device)
        compute_thread = ComputeThread()

        def build() -> LLMEngine:
            set_cpu_threads(device, config.num_threads)
            dtype = resolve_dtype(config.dtype, device, stored_dtype(config.model))
            # Checked before the load: a backend that cannot run here fails before the
            # weights are read.
            select_attention_backend(config.attention_backend, device)
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
        """Queue a request made by ``inputs.make_request``.

        Args:
            request: the request.
            grammar: its :meth:`compile_grammar`, when its params have
                ``structured_outputs``; compiled here when None.

        Raises:
            InvalidRequestError: its grammar cannot be compiled (nothing is queued).
        """
        self._add_matchers([request], grammar)
        self._add_speculation([request])
        self.scheduler.add_request(request)

    def _add_matchers(self, requests: Sequence[Request], grammar: Any) -> None:
        """A grammar matcher for each request, when their params are constrained."""
        params = requests[0].params
        if params.structured_outputs is None:
            return
        if grammar is None:
            grammar = self.compile_grammar(params)
        for r in requests:
            stops = r.stop_token_ids.union(self.eos_token_ids)  # EOS too under ignore_eos
            self.grammar_matchers.add(r.request_id, grammar, stops)

    def _add_speculation(self, requests: Sequence[Request]) -> None:
        """A proposer for each request when speculative decoding is on (requests with
        ``structured_outputs`` decode plainly: their proposals are not checked against the
        grammar)."""
        spec = self.scheduler.spec
        if spec is None or requests[0].params.structured_outputs is not None:
            return
        for r in requests:
            r.spec = RequestSpeculation(spec.config)

    def add_parallel_requests(self, samples: Sequence[Request], grammar: Any = None) -> None:
        """Queue the samples of one call made by ``inputs.make_requests``, sharing the
        prompt's KV blocks when :func:`~asyncllm.output_processing.parallel_sampling.shares_prompt`
        (each with a grammar matcher of its own when constrained; ``grammar`` as in
        :meth:`add_request`)."""
        self._add_matchers(samples, grammar)
        self._add_speculation(samples)
        if shares_prompt(samples):
            self.scheduler.add_parallel_requests(samples)
        else:
            for r in samples:
                self.scheduler.add_request(r)

    def abort_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> bool:
        """Finish a request from outside a step (an abort; a stop string the front end
        matched, with ``FINISHED_STOPPED``) and free its blocks; False if it was not in the
        engine."""
        self.grammar_matchers.free((request_id,))
        return self.scheduler.abort_request(request_id, status) is not None

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds, in the device pool and the host
        tier; returns how many were dropped."""
        store = self.block_manager.host_store
        dropped = store.clear() if store is not None else 0
        return dropped + self.block_manager.pool.evict_free_cached()

    def num_waiting(self, tenant: str | None = None) -> int:
        """Requests waiting in the scheduler (of ``tenant`` only, unless None), parallel
        samples waiting for their prefix included."""
        sched = self.scheduler
        return sched.num_waiting if tenant is None else sched.num_waiting_of(tenant)

    def waiting_order(self) -> dict[str, int]:
        """Request id -> how many waiting requests the scheduler admits before it (its
        order as of the last step); a parallel sample waiting for its prefix request takes
        the prefix's place."""
        return self.scheduler.waiting_order()

    def has_unfinished(self) -> bool:
        """Requests waiting or running."""
        return self.scheduler.num_unfinished > 0

    def step(self) -> StepOutput:
        """Schedule, run the model once, sample, and apply stop conditions, on the engine's
        compute thread (the caller's thread waits when it is another one).

        Returns:
            one update per sampled request, with the step's logprobs, first schedulings and
            preemptions (:class:`StepOutput`; plain data the caller may keep).

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
            return IDLE_STEP
        started = self._mark_started(plan)
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
        updates = self.scheduler.update_from_output(plan, out.sampled, finished, out.spec_tokens)
        new_cached = self.block_manager.new_cached
        if self.disk is not None and new_cached:  # computed by this step's forward
            kv = self.kv_cache
            self.disk.save(kv.key_slots + kv.value_slots, [(b, (g, h)) for b, g, h in new_cached])
            new_cached.clear()
        if mask is not None:
            matchers.free(u.request_id for u in updates if u.finish_reason is not None)
        self.num_steps += 1
        self.num_generated_tokens += len(updates)
        if observer is not None and clock is not None:
            clock.lap("update")
            clock.finish()
            observer(clock, plan)
        return StepOutput.of(updates, out, started, plan.preempted)

    def _mark_started(self, plan: SchedulerOutput) -> dict[str, RequestStart] | None:
        """The :class:`RequestStart` of the requests the plan starts (their first chunks)."""
        now = time.monotonic()
        started = {
            c.request_id: RequestStart(now, c.first_num_cached_tokens)
            for c in plan.chunks
            if c.first_num_cached_tokens is not None
        }
        return started or None

    def _cpu_kernels(self) -> str:
        """What runs per C++ kernel family on CPU ("" elsewhere); attention "off" when the
        engine's backend is not the C++ one."""
        if self.device.type != "cpu":
            return ""
        status = native.status()
        if self.runner.attention_backend.name != "cpu":
            status["attention"] = "off"
        return " ".join(f"{k}={v}" for k, v in status.items())

    def stats(self) -> dict[str, int | float | str]:
        """Counters: requests running and waiting; KV blocks free and total; preemptions,
        blocks swapped out and in, bytes they moved and tokens dropped for recompute; CPU pool
        blocks free and total; prefix-cache queries and hits (tokens) and hit rate, the hits
        split by tier (``prefix_cache_device_hits``: shared from the device pool;
        ``prefix_cache_host_hits``: swapped in from the host tier, of which
        ``prefix_cache_disk_hits`` the disk tier had read; queries minus hits were
        computed), the disk tier's files written and files found invalid (torn, corrupt or
        foreign: deleted, never loaded; ``prefix_cache_dir_writes``,
        ``prefix_cache_dir_invalid``), the host tier's blocks held and its capacity
        (``num_host_cache_blocks``, ``num_total_host_cache_blocks``); steps and
        generated tokens; the weights' ``precision`` (e.g. "float32", "int4 g32", "gguf
        (...)") and ``weight_bytes`` (bytes of parameters and buffers, as loaded);
        ``dtype``: the activations' and KV cache's dtype (``EngineConfig.dtype`` resolved,
        e.g. "float32"); the compiled forward's ``compile`` state ("off", "compiling",
        "ready" or "failed"; ``EngineConfig.compile``) and ``compile_seconds`` (seconds it
        took, or has taken so far; 0.0 when off); ``native_steps``: steps the C++ forward
        ran (:mod:`asyncllm.worker.native_forward`; 0 where it does not run the model, which
        the modeling code runs then, compiled where ``compile`` says); ``cpu_kernels``: per
        C++ kernel family, what runs on CPU (the instruction-set variant installed, "off" or
        "torch":
        :func:`asyncllm.kernels.native.status`), "" on other devices; ``kv_layout``: the
        KV pool's shape and element type, e.g. "6 groups of 3 layers (1 full, 5 window 512),
        9000 blocks of 16, int8" (:mod:`asyncllm.core.kv_groups`); ``kv_cache_dtype``: the
        cache's element type ("int8" with ``EngineConfig.kv_cache_dtype="int8"``, else the
        model's dtype) and ``kv_bytes_per_token``: its bytes per token, scales included;
        ``env``: the asyncllm environment variables set to other than their default
        (:func:`asyncllm.envs.non_default`), "" when none; speculative decoding's ``spec_*``
        counters (:meth:`~asyncllm.core.speculation.Speculation.stats`; zeros when it is
        off)."""
        compiled = self.runner.compiled
        bm = self.block_manager
        sched = self.scheduler
        store = bm.host_store
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
            "prefix_cache_device_hits": sched.prefix_cache_hits - sched.prefix_cache_host_hits,
            "prefix_cache_host_hits": sched.prefix_cache_host_hits,
            "prefix_cache_disk_hits": sched.prefix_cache_disk_hits,
            "prefix_cache_dir_writes": self.disk.num_written if self.disk else 0,
            "prefix_cache_dir_invalid": self.disk.num_invalid if self.disk else 0,
            "num_host_cache_blocks": len(store) if store is not None else 0,
            "num_total_host_cache_blocks": store.max_blocks if store is not None else 0,
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
            "precision": self.loaded.precision,
            "weight_bytes": self.loaded.weight_bytes,
            "dtype": str(self.dtype).removeprefix("torch."),
            "compile": compiled.state if compiled else "off",
            "compile_seconds": compiled.seconds if compiled else 0.0,
            "native_steps": self.runner.native.steps if self.runner.native else 0,
            "cpu_kernels": self._cpu_kernels(),
            "kv_layout": f"{bm.groups.describe()}, {bm.num_total_blocks} blocks of "
            f"{bm.block_size}, {self.kv_cache.spec.kv_dtype_name}",
            "kv_cache_dtype": self.kv_cache.spec.kv_dtype_name,
            "kv_bytes_per_token": self.kv_cache.spec.bytes_per_token,
            "env": " ".join(f"{k}={v}" for k, v in envs.non_default().items()),
            **(sched.spec.stats() if sched.spec else Speculation.off_stats()),
        }


def host_pools(
    config: EngineConfig, kv_cache: KVCache
) -> tuple[CPUOffloadPool | None, BlockPool | None, HostPrefixStore | None]:
    """The host memory beside the device KV cache: the CPU offload pool's tensors, its
    block bookkeeping, and the host tier of the prefix cache in it (each None when off).

    Sizes (``EngineConfig``): ``cpu_offload_bytes`` (None: the device cache's bytes) under
    "offload"; the store takes up to ``host_prefix_cache_bytes`` of that pool (None: all of
    it); under "recompute" a pool of ``host_prefix_cache_bytes`` (None: with a
    ``prefix_cache_dir``, ``cpu_offload_bytes``) serves the store alone.
    """
    per_block = kv_cache.spec.bytes_per_block
    offload = config.preemption_mode == "offload"
    cpu_bytes = config.cpu_offload_bytes
    if cpu_bytes is None:
        cpu_bytes = kv_cache.num_bytes
    store_bytes = config.host_prefix_cache_bytes
    if not config.enable_prefix_caching:
        store_bytes = 0
    elif store_bytes is None:  # the disk tier reads through the host tier: it needs one
        store_bytes = cpu_bytes if offload or config.prefix_cache_dir else 0
    if not offload:
        cpu_bytes = store_bytes
    num_cpu_blocks = cpu_bytes // per_block
    if num_cpu_blocks <= 0:
        return None, None, None
    pool = BlockPool(num_cpu_blocks)
    store_blocks = min(store_bytes // per_block, num_cpu_blocks)
    store = HostPrefixStore(pool, store_blocks) if store_blocks > 0 else None
    return CPUOffloadPool(kv_cache, num_cpu_blocks), pool, store


def kv_namespace(loaded: LoadedModel, spec: Any) -> str:
    """What the disk tier keys its files by besides the block (:func:`~asyncllm.worker.
    disk_tier.namespace_digest`): the fingerprint of the model directory's weight, config
    and tokenizer files (:func:`~asyncllm.models.fingerprint.fingerprints`), the precision,
    and the KV layout (:class:`~asyncllm.worker.kv_cache.KVCacheSpec`: layers, heads, head
    size, dtype, block size, layer groups)."""
    files = sorted(
        p for p in loaded.model_dir.iterdir()
        if p.is_file() and p.suffix in (".safetensors", ".bin", ".json", ".model", ".gguf")
    )  # fmt: skip
    return namespace_digest(
        weights=fingerprints(files),
        precision=loaded.precision,
        kv=repr(spec),
        tokenizer_vocab=len(loaded.tokenizer),
    )
