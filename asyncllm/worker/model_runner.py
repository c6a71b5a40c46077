"""Turns a scheduler plan into tensors, runs the model once, and samples.

One step is one forward pass over a flattened batch: the new tokens of every scheduled
request side by side (no padding), each with its own position and cache slot. Logits are
computed only for the rows that are sampled (the last token of each chunk that reaches the
end of its request).
"""

from __future__ import annotations

import torch

from asyncllm.attention.hf_integration import METADATA_KWARG, AttentionMetadata, register
from asyncllm.attention.torch_paged import PagedAttentionPlan
from asyncllm.core.scheduler import SchedulerOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.kv_cache import KVCache, KVCacheSpec
from asyncllm.worker.sampler import Sampler, SamplingBatch


def kv_cache_spec(config: object, dtype: torch.dtype, block_size: int) -> KVCacheSpec:
    """The per-token K/V shape of a transformers decoder config."""
    heads = config.num_attention_heads  # type: ignore[attr-defined]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # type: ignore[attr-defined]
    return KVCacheSpec(
        num_layers=config.num_hidden_layers,  # type: ignore[attr-defined]
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        dtype=dtype,
        block_size=block_size,
    )


class ModelRunner:
    """Executes plans on one transformers causal LM over one :class:`KVCache`.

    Args:
        model: a transformers ``*ForCausalLM`` in eval mode; its attention implementation is
            switched to the paged one.
        kv_cache: the engine's KV cache.
        seed: seeds sampling for requests without their own seed.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, *, seed: int) -> None:
        model.set_attn_implementation(register())  # type: ignore[operator]
        self.model = model
        self.kv_cache = kv_cache
        self.device = next(model.parameters()).device
        self.block_size = kv_cache.spec.block_size
        self.sampler = Sampler(seed, self.device)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        """Run one step.

        Returns:
            request id -> sampled token id, for each chunk with ``sample`` set.
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        for chunk in plan.chunks:
            table = chunk.block_table
            start = chunk.start_pos
            end = start + len(chunk.token_ids)
            input_ids.extend(chunk.token_ids)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if chunk.sample:
                sample_rows.append(len(input_ids) - 1)
        dev = self.device
        attn_plan = PagedAttentionPlan.build(
            [len(c.token_ids) for c in plan.chunks],
            [c.start_pos + len(c.token_ids) for c in plan.chunks],
            [c.block_table for c in plan.chunks],
            bs,
            dev,
        )
        meta = AttentionMetadata(
            key_caches=self.kv_cache.key_caches,
            value_caches=self.kv_cache.value_caches,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            plan=attn_plan,
        )
        if not sample_rows:
            self._forward(input_ids, positions, meta, torch.zeros(0, dtype=torch.long))
            return {}
        keep = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        logits = self._forward(input_ids, positions, meta, keep)
        sampled = [c for c in plan.chunks if c.sample]
        tokens = self.sampler(logits, self._sampling_batch(sampled)).tolist()
        return {c.request_id: t for c, t in zip(sampled, tokens, strict=True)}

    def _forward(
        self,
        input_ids: list[int],
        positions: list[int],
        meta: AttentionMetadata,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        dev = self.device
        out = self.model(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=dev),
            position_ids=torch.tensor([positions], dtype=torch.long, device=dev),
            use_cache=False,
            logits_to_keep=keep.to(dev),
            **{METADATA_KWARG: meta},
        )
        return out.logits[0]  # [len(keep), vocab]

    def _sampling_batch(self, chunks: list) -> SamplingBatch:  # type: ignore[type-arg]
        params: list[SamplingParams] = [c.params for c in chunks]
        dev = self.device
        temps = [p.temperature if not p.greedy else 0.0 for p in params]
        return SamplingBatch(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=dev),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            seeds=[p.seed for p in params],
            token_indices=[c.num_output_tokens for c in chunks],
            all_greedy=all(t == 0.0 for t in temps),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
        )
