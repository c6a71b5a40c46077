"""The families users bring, as 2-layer random models: each runs token for token like
transformers' ``generate`` (float32, chunked prefill of 16, block size 4), or is refused at
load with ``UnsupportedModelError``, never accepted and then wrong or dead
(:mod:`asyncllm.worker.paged_check`)."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import pytest
import torch
import transformers as tf

from asyncllm import SamplingParams, UnsupportedModelError
from asyncllm.bench.tiny_model import TINY_CONFIG
from asyncllm.models import loader
from asyncllm.worker import paged_check

_MLA = dict(
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)
_MHA = dict(num_key_value_heads=4)  # families without GQA: their config ignores the field
#: A sliding window shorter than the prompt (12 tokens) and its 8 generated ones, crossing
#: the blocks of 4 tokens.
WINDOW = 6
_MIXED = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])

#: family -> (config class, fields over the tiny Llama's)
RUNS: dict[str, tuple[type, dict[str, Any]]] = {
    "llama": (tf.LlamaConfig, {}),
    "qwen3": (tf.Qwen3Config, dict(head_dim=16)),
    "mistral": (tf.MistralConfig, dict(sliding_window=None)),
    "phi": (tf.PhiConfig, _MHA),
    "gemma": (tf.GemmaConfig, dict(head_dim=16)),
    "gpt_neox": (tf.GPTNeoXConfig, _MHA),
    "gpt2": (tf.GPT2Config, dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, **_MHA)),
    "olmo2": (tf.Olmo2Config, {}),
    "granite": (tf.GraniteConfig, {}),
    "starcoder2": (tf.Starcoder2Config, dict(sliding_window=None)),
    "cohere": (tf.CohereConfig, {}),
    # its decoder layers drop the engine's keyword: the step's metadata on the thread serves
    "stablelm": (tf.StableLmConfig, dict(use_qkv_bias=True, use_parallel_residual=True)),
    # sliding windows (every layer, or mixed with full layers) and soft-capping
    "mistral-window": (tf.MistralConfig, dict(sliding_window=WINDOW)),
    "starcoder2-window": (tf.Starcoder2Config, dict(sliding_window=WINDOW)),
    "phi3-window": (tf.Phi3Config, dict(sliding_window=WINDOW, pad_token_id=0)),
    "qwen2-window": (
        tf.Qwen2Config,
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "gemma2": (
        tf.Gemma2Config,
        dict(head_dim=16, attn_logit_softcapping=0.05, final_logit_softcapping=0.5, **_MIXED),
    ),
    "gemma3": (tf.Gemma3TextConfig, dict(head_dim=16, **_MIXED)),
    "cohere2": (tf.Cohere2Config, _MIXED),
}

#: family -> (config class, fields, what the refusal names)
REFUSED: dict[str, tuple[type, dict[str, Any], str]] = {
    # transformers' Falcon calls torch's attention itself: chunks attended to themselves only
    "falcon": (
        tf.FalconConfig,
        dict(num_kv_heads=2, new_decoder_architecture=True),
        "bypasses the paged KV cache",
    ),
    # MLA: K and V head sizes differ from the cache's: the first step raised
    "deepseek_v3": (tf.DeepseekV3Config, _MLA, "first step on the paged KV cache fails"),
    # attention sinks: a learned per-head logit in every softmax, which the kernels lack
    "gpt_oss": (
        tf.GptOssConfig,
        dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, **_MIXED),
        "attention sinks",
    ),
}

PROMPT = [5, 77, 1000, 23, 9, 400, 31, 8, 12000, 7, 66, 3]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SMALL = dict(
    dtype="float32", block_size=4, max_num_batched_tokens=16, kv_cache_bytes=2**20, compile=False
)


def _save(path: pathlib.Path, config: Any, tokenizer_dir: pathlib.Path) -> pathlib.Path:
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tf.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


def _reference(path: pathlib.Path, prompt: list[int] = PROMPT) -> list[int]:
    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = ref.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=GREEDY.max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", sorted(RUNS))
async def test_family_runs_like_transformers(family, tmp_path, default_model_dir, make_engine):
    cls, fields = RUNS[family]
    path = _save(tmp_path / family, cls(**{**TINY_CONFIG, **fields}), default_model_dir)
    engine = make_engine(path, **SMALL)
    async with engine:
        got = [t async for out in engine.stream(PROMPT, GREEDY) for t in out.token_ids]
    assert got == _reference(path)


async def test_windows_survive_prefix_caching_and_preemption(
    tmp_path, default_model_dir, make_engine
):
    """Gemma 3's sliding and full layers: four prompts after one 9-token prefix (the later
    ones hit the prefix cache), in a pool of 10 blocks that preempts them (offload), each
    give transformers' tokens."""
    cls, fields = RUNS["gemma3"]
    path = _save(tmp_path / "gemma3", cls(**{**TINY_CONFIG, **fields}), default_model_dir)
    prompts = [PROMPT[:9] + [100 + i, 2000 + i, 30 + i] for i in range(4)]
    block_bytes = 2 * 2 * 2 * 16 * 4 * 4  # layers, K and V, KV heads, head size, float32, tokens
    engine = make_engine(path, **{**SMALL, "kv_cache_bytes": 10 * block_bytes, "max_model_len": 32})

    async def run(prompt: list[int]) -> list[int]:
        return [t async for out in engine.stream(prompt, GREEDY) for t in out.token_ids]

    async with engine:
        first = await run(prompts[0])
        rest = await asyncio.gather(*(run(p) for p in prompts[1:]))
        stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert [first, *rest] == [_reference(path, p) for p in prompts]


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_family_is_refused_at_load(family, tmp_path, default_model_dir):
    """Falcon was accepted and gave other tokens from the first one; DeepSeek-V3 was
    accepted and the engine died at its first step (StableLM too, now served)."""
    from asyncllm import AsyncEngine

    cls, fields, reason = REFUSED[family]
    path = _save(tmp_path / family, cls(**{**TINY_CONFIG, **fields}), default_model_dir)
    with pytest.raises(UnsupportedModelError, match=reason) as info:
        AsyncEngine.from_pretrained(str(path), **SMALL)
    assert repr(family) in str(info.value)


def test_a_model_computed_otherwise_than_it_says_is_refused(
    tmp_path, default_model_dir, monkeypatch
):
    """An attention that misses a feature (here it drops a sliding window of 4 tokens over
    the probe's 8): the engine refuses the model because its paged logits differ from its
    own eager forward's, not serve it wrongly."""
    from asyncllm import AsyncEngine
    from asyncllm.attention import backend_registry

    config = tf.MistralConfig(**TINY_CONFIG, sliding_window=4)
    path = _save(tmp_path / "mistral-window", config, default_model_dir)
    attend = backend_registry._write_and_attend

    def windowless(meta, layer, q, k, v, scale, window, softcap, num_tokens=None):
        return attend(meta, layer, q, k, v, scale, 0, softcap, num_tokens)

    monkeypatch.setattr(backend_registry, "_write_and_attend", windowless)
    with pytest.raises(UnsupportedModelError, match="differ from its own eager forward"):
        AsyncEngine.from_pretrained(str(path), **SMALL)


def test_logits_agree_within_the_dtype_rounding():
    want = torch.linspace(-8, 8, 64).reshape(2, 32)
    assert paged_check.logits_agree(want + 1e-5, want, torch.float32)[0]
    assert not paged_check.logits_agree(want + 0.1, want, torch.float32)[0]
    assert paged_check.logits_agree(want + 0.1, want, torch.bfloat16)[0]
    agree, err = paged_check.logits_agree(want.roll(1, 1), want, torch.bfloat16)
    assert not agree and err > 0.1


@pytest.mark.parametrize("error", [RuntimeError("boom"), MemoryError()])
def test_a_failing_eager_forward_refuses_and_memory_errors_pass(tiny_llama_dir, monkeypatch, error):
    """The check's reference forward failing refuses the model (it cannot be checked); running
    out of memory is the machine's limit, not the model's, and is raised as it is."""
    from asyncllm import AsyncEngine

    def fail(model, ids):  # type: ignore[no-untyped-def]
        raise error

    monkeypatch.setattr(paged_check, "_eager_logits", fail)
    want = MemoryError if isinstance(error, MemoryError) else UnsupportedModelError
    with pytest.raises(want) as info:
        AsyncEngine.from_pretrained(str(tiny_llama_dir), **SMALL)
    if want is UnsupportedModelError:
        assert "its own eager forward fails (RuntimeError: boom)" in str(info.value)
