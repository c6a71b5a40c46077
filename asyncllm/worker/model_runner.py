"""Turns a scheduler plan into tensors, runs the model once, and samples.

One step is one forward pass over a flattened batch: the new tokens of every scheduled
request side by side (no padding), each with its own position and cache slot. Logits are
computed only for the rows that are sampled (the last token of each chunk that reaches the
end of its request).
"""

from __future__ import annotations

import importlib.util
import logging
import typing
from typing import Literal

import torch

from asyncllm.attention import cpu_paged
from asyncllm.attention.backend_registry import (
    METADATA_KWARG,
    TORCH_BACKEND,
    TRITON_BACKEND,
    AttentionBackend,
    AttentionMetadata,
    grouped_metadata,
    register,
    step_metadata,
)
from asyncllm.attention.triton_paged import interpreter_enabled
from asyncllm.core.plan import SchedulerOutput
from asyncllm.layers.cpu_linear import PackedLinear, pack_linears
from asyncllm.layers.q8_linear import Q8Linear
from asyncllm.layers.quant_linear import Int4Linear, load_kernels
from asyncllm.layers.sibling_linears import fuse_siblings
from asyncllm.worker.compiled import CompiledForward, ModelSource, pad_to
from asyncllm.worker.kv_cache import KVCache
from asyncllm.worker.native_forward import NativeForward
from asyncllm.worker.native_forward import build as build_native_forward
from asyncllm.worker.paged_check import check_paged_forward, native_forward_error
from asyncllm.worker.runner_output import RunnerOutput
from asyncllm.worker.sampling.logprobs import PromptRows, prompt_logprobs
from asyncllm.worker.sampling.sampler import Sampler, sample_chunks
from asyncllm.worker.sampling.speculative import verify_chunks
from asyncllm.worker.step_timing import StepTimings

logger = logging.getLogger("asyncllm")


def select_attention_backend(requested: str, device: torch.device) -> AttentionBackend:
    """The backend for ``EngineConfig.attention_backend``; "auto" is Triton on CUDA (when
    installed), on CPU the torch path with the C++ decode and chunk kernels of
    :mod:`asyncllm.attention.cpu_paged` ("cpu", where they are installed), torch elsewhere.

    Raises:
        ValueError: an unknown name; "cpu" on another device or without its installed
            kernels (naming why they do not load); "triton" without Triton, or on a device
            other than CUDA unless Triton's CPU interpreter is on (``TRITON_INTERPRET=1``
            from the start).
    """
    has_triton = importlib.util.find_spec("triton") is not None
    if requested == "auto":
        if device.type == "cuda" and has_triton:
            return TRITON_BACKEND
        if device.type == "cpu" and cpu_paged.available():
            return cpu_paged.CPU_BACKEND
        return TORCH_BACKEND
    if requested == "torch":
        return TORCH_BACKEND
    if requested == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU, not {device}")
        if not cpu_paged.available():
            raise ValueError(
                "attention_backend='cpu': the C++ attention kernels are not installed "
                f"({cpu_paged.failure()}); reinstall with a compiler (README) or use 'auto'"
            )
        return cpu_paged.CPU_BACKEND
    if requested != "triton":
        raise ValueError(
            f"attention_backend must be 'auto', 'cpu', 'torch' or 'triton', not {requested!r}"
        )
    if not has_triton:
        raise ValueError("attention_backend='triton' needs the triton package")
    if device.type != "cuda" and not interpreter_enabled():
        raise ValueError(
            f"attention_backend='triton' runs on CUDA devices, not {device}; use 'torch' or "
            "'auto' (or start the process with TRITON_INTERPRET=1 for Triton's slow CPU "
            "interpreter)"
        )
    return TRITON_BACKEND


#: Rows of :meth:`ModelRunner.warm_up_thread`'s calls: above every few-row kernel's limit
#: (``q8_linear.MAX_ROWS``, ``quant_linear.int4_max_rows``: 8, or 16 without the fused path).
WARM_UP_ROWS = 17


class ModelRunner:
    """Executes plans on one transformers causal LM over one :class:`KVCache`.

    Args:
        model: a transformers ``*ForCausalLM`` in eval mode; its attention implementation is
            switched to the paged one.
        kv_cache: the engine's KV cache.
        seed: seeds sampling for requests without their own seed.
        attention_backend: "auto", "cpu", "torch" or "triton" (:func:`select_attention_backend`).
        compile: compile the forward with ``torch.compile`` in the background and switch to
            it between two steps once ready (:mod:`asyncllm.worker.compiled`), where the C++
            forward does not run the model (:mod:`asyncllm.worker.native_forward`); "cached":
            only where an earlier engine saved it for this model and machine (loaded, never
            built; eager otherwise).
        model_source: how a child process loads the same model to compile it there (None:
            compile on a background thread of this process).

    Raises:
        ValueError: an attention backend that cannot run on the model's device.
        UnsupportedModelError: the model's attention does not run on the paged cache
            (:func:`~asyncllm.worker.paged_check.check_paged_forward`).
        ModelLoadError: its weights give non-finite logits (a corrupt file; the same check).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        *,
        seed: int,
        attention_backend: str = "auto",
        compile: bool | Literal["cached"] = False,
        model_source: ModelSource | None = None,
    ) -> None:
        model.set_attn_implementation(register())  # type: ignore[operator]
        # q/k/v and gate/up as one call each, then (float32 or bfloat16 on CPU) oneDNN-prepacked
        # linears (docs/benchmarks.md; off with ASYNCLLM_CPU_PACKED_LINEAR=0). Both idempotent:
        # engines may share a model.
        fuse_siblings(model)
        if next(model.parameters()).device.type == "cpu":
            load_kernels(model)
        self.num_packed_linears = pack_linears(model)
        self.model = model
        self.kv_cache = kv_cache
        self.device = next(model.parameters()).device
        self.attention_backend = select_attention_backend(attention_backend, self.device)
        # Refuse a model whose attention does not run on the paged cache before serving it.
        check_paged_forward(model, kv_cache, self.attention_backend)
        self.block_size = kv_cache.spec.block_size
        self.num_groups = kv_cache.spec.layer_groups.num_groups
        self.sampler = Sampler(seed, self.device)
        #: The C++ forward (:mod:`asyncllm.worker.native_forward`) of every step where it runs
        #: the model; None: the modeling code (eager, or compiled) runs them.
        self.native: NativeForward | None = self._checked_native(model, kv_cache)
        #: The current step's timings when the engine has a step observer (its ``prep``,
        #: ``forward`` and ``sample`` phases are lapped here); None: nothing is measured.
        self.timings: StepTimings | None = None
        #: The compiled forward (None: eager only, or the C++ forward runs every step);
        #: used once ``ready``.
        self.compiled: CompiledForward | None = None
        if compile and self.native is None:
            compiled = CompiledForward(model, self.device, model_source, compile != "cached")
            if compiled.build or compiled.path.is_file():
                self.compiled = compiled
                compiled.start()

    def _checked_native(self, model: torch.nn.Module, kv_cache: KVCache) -> NativeForward | None:
        """The model's C++ forward where it runs the model and its logits on the load-time
        probe agree with the eager forward's (:func:`native_forward_error`); else None, with
        one warning where it was built but disagrees or fails (the modeling code serves)."""
        native = build_native_forward(model)
        if native is None:
            return None
        try:
            err = native_forward_error(native.forward, model, kv_cache, self.attention_backend)
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as e:
            logger.warning("asyncllm: the C++ forward fails on the load-time probe (%r); the "
                           "modeling code serves this model", e)  # fmt: skip
            return None
        if err is not None:
            logger.warning("asyncllm: the C++ forward's logits differ from the modeling "
                           "code's by %.3g of their scale on the load-time probe; the "
                           "modeling code serves this model", err)  # fmt: skip
            return None
        native.steps = 0
        return native

    @torch.inference_mode()
    def warm_up_thread(self) -> None:
        """Run each quantized or packed linear of the decoder once, on the calling thread (a
        new compute thread), with :data:`WARM_UP_ROWS` rows of zeros: more than any few-row
        kernel takes, so the many-row path runs. A new compute thread's first prefill was
        slower than the next ones (oneDNN's brgemm sets its kernels up per thread), and one
        call per distinct shape left part of that (docs/tuning.md, "Gemma 3's prefill").
        The LM head is left out (its many-row path runs only past 8 rows of logits).
        Nothing is written: no KV cache, no state. A no-op off CPU."""
        if self.device.type != "cpu":
            return
        head = self.model.get_output_embeddings()  # type: ignore[operator]
        dtype = next(self.model.parameters()).dtype
        layers = [
            m for m in self.model.modules() if type(m) in (Q8Linear, Int4Linear, PackedLinear)
        ]
        for m in typing.cast(list[Q8Linear | Int4Linear | PackedLinear], layers):
            if m is not head:
                m(torch.zeros(WARM_UP_ROWS, m.in_features, dtype=dtype))

    @torch.inference_mode()
    def execute(
        self,
        plan: SchedulerOutput,
        token_bitmask: tuple[torch.Tensor, list[int]] | None = None,
    ) -> RunnerOutput:
        """Run one step.

        Logits are kept for the sampled rows (every row of a speculative chunk:
        :mod:`asyncllm.worker.sampling.speculative` verifies them) and, for requests with
        ``prompt_logprobs``, for the rows of their chunk that score prompt tokens.

        Args:
            plan: the scheduler's plan.
            token_bitmask: the grammar mask of the sampled rows (in the order of the plan's
                chunks with ``sample`` set), from ``GrammarMatchers.fill``; None: no row is
                constrained.

        Returns:
            the sampled token of each chunk with ``sample`` set, and the logprobs asked for.
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(self.num_groups)]
        sample_rows: list[int] = []
        spec_rows: list[int] = []  # rows 1..k of speculative chunks (row 0 is a sample row)
        prompt_rows: list[PromptRows] = []
        prompt_flat: list[int] = []
        for chunk in plan.chunks:
            start = chunk.start_pos
            end = start + len(chunk.token_ids)
            rows = PromptRows.of_chunk(chunk)
            if rows is not None:
                prompt_rows.append(rows)
                first = len(input_ids)
                prompt_flat.extend(range(first, first + len(rows.target_ids)))
            input_ids.extend(chunk.token_ids)
            positions.extend(range(start, end))
            for group_slots, table in zip(slots, chunk.block_tables, strict=True):
                group_slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if chunk.sample:
                k = len(chunk.spec_token_ids)
                sample_rows.append(len(input_ids) - 1 - k)
                spec_rows.extend(range(len(input_ids) - k, len(input_ids)))
        dev = self.device
        meta = self._metadata(plan, slots, spread=not prompt_rows)
        sample_rows += spec_rows
        keep = torch.tensor(sample_rows + prompt_flat, dtype=torch.long, device=dev)
        clock = self.sampler.timings = self.timings
        if clock is not None:
            clock.lap("prep")
        logits = self._forward(input_ids, positions, meta, keep)
        if clock is not None:
            clock.lap("forward")
        if not sample_rows and not prompt_rows:
            return RunnerOutput({})
        n = len(sample_rows)
        sampled = [c for c in plan.chunks if c.sample]
        pick = verify_chunks if spec_rows else sample_chunks
        out = pick(self.sampler, logits[:n], sampled, dev, token_bitmask) if n else RunnerOutput({})
        if prompt_rows:
            out.prompt_logprobs = prompt_logprobs(logits[n:], prompt_rows)
        if clock is not None:
            clock.lap("sample")
        return out

    def _metadata(
        self, plan: SchedulerOutput, slots: list[list[int]], spread: bool
    ) -> AttentionMetadata:
        """The step's attention metadata; ``spread``: a step of decodes and speculative
        verifications only (no prompt rows) gets one decode row per token."""
        cache, chunks = self.kv_cache, plan.chunks
        if spread and all(len(c.token_ids) == 1 + len(c.spec_token_ids) for c in chunks):
            # Each row attends as the decode of its own position (the kernels write every
            # row's K/V before attending), so a chunk of k + 1 proposals runs the decode
            # kernel, as the plain decode steps do.
            rows = [(c, i) for c in chunks for i in range(len(c.token_ids))]
            query_lens = [1] * len(rows)
            seq_lens = [c.start_pos + i + 1 for c, i in rows]
            tables = [c.block_tables for c, _ in rows]
        else:
            query_lens = [len(c.token_ids) for c in chunks]
            seq_lens = [c.start_pos + len(c.token_ids) for c in chunks]
            tables = [c.block_tables for c in chunks]
        return grouped_metadata(
            cache.key_caches,
            cache.value_caches,
            cache.layer_groups,
            self.attention_backend,
            query_lens,
            seq_lens,
            tables,
            slots,
            self.block_size,
            self.device,
        )

    def _forward(
        self,
        input_ids: list[int],
        positions: list[int],
        meta: AttentionMetadata,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        dev = self.device
        if self.native is not None:
            try:
                with step_metadata(meta, len(input_ids)):
                    return self.native.forward(input_ids, positions, keep)
            except Exception as e:  # never a dead engine: the modeling code from now on
                logger.warning(
                    "asyncllm: the C++ forward failed (%r); the modeling code runs the "
                    "steps from now on, eagerly",
                    e,
                )
                self.native = None
        compiled = self.compiled
        if compiled is not None and compiled.ready:
            try:
                return self._forward_compiled(compiled, input_ids, positions, meta, keep)
            except Exception as e:  # never a dead engine: eager from now on
                compiled.fail(e)  # not ready any more: stats() says "failed"
        with step_metadata(meta, len(input_ids)):
            out = self.model(
                input_ids=torch.tensor([input_ids], dtype=torch.long, device=dev),
                position_ids=torch.tensor([positions], dtype=torch.long, device=dev),
                use_cache=False,
                logits_to_keep=keep.to(dev),
                **{METADATA_KWARG: meta},
            )
        logits: torch.Tensor = out.logits[0]  # [len(keep), vocab]
        return logits

    def _forward_compiled(
        self,
        compiled: CompiledForward,
        input_ids: list[int],
        positions: list[int],
        meta: AttentionMetadata,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        # Padded to the compiled graph's least sizes: an extra token repeats the last real one
        # (its id and position; its attention output is a copy, it writes no K/V), so every
        # layer computes it as that token and the linear kernels compute the repeated row
        # once; an extra kept row repeats the last one. Both are dropped. A step of prompt
        # chunks that sample nothing (a long prompt alone) keeps its last token's row, unused:
        # the graph was compiled for at least MIN_ROWS kept rows.
        n, k = len(input_ids), keep.numel()
        pad = pad_to(n) - n
        ids = torch.tensor([input_ids + input_ids[-1:] * pad], dtype=torch.long)
        pos = torch.tensor([positions + positions[-1:] * pad], dtype=torch.long)
        if k == 0:
            keep = keep.new_tensor([n - 1])
        if keep.numel() < pad_to(k):
            keep = torch.cat([keep, keep[-1:].expand(pad_to(k) - keep.numel())])
        dev = self.device
        with step_metadata(meta, n):
            logits = compiled(ids.to(dev), pos.to(dev), keep.to(dev))
        return logits[:k]
