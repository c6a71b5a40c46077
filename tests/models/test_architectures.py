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

from asyncllm import ModelLoadError, SamplingParams, UnsupportedModelError
from asyncllm.attention.backend_registry import ATTN_IMPLEMENTATION
from asyncllm.bench.tiny_model import TINY_CONFIG
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
    "mixtral": (tf.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
}

_OWN_ATTENTION = "calls attention code of its own"

#: family -> (config class, fields, what the refusal names)
REFUSED: dict[str, tuple[type, dict[str, Any], str]] = {
    # their own attention code and no SDPA: building them raised transformers' ValueError,
    # reported as a ModelLoadError (GPT-Neo's local layers are refused by config too)
    "gpt_neo": (
        tf.GPTNeoConfig,
        dict(num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]]),
        _OWN_ATTENTION,
    ),
    "xglm": (
        tf.XGLMConfig,
        dict(d_model=64, num_layers=2, attention_heads=4, ffn_dim=128),
        _OWN_ATTENTION,
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

#: transformers' Falcon called torch's attention itself before 5.25 (chunks attended to
#: themselves only: refused by its class), and goes through the attention interface since:
#: served, token for token. Which one this transformers has, its own test says.
_FALCON = (tf.FalconConfig, dict(num_kv_heads=2, new_decoder_architecture=True))
if tf.FalconForCausalLM._can_set_attn_implementation():
    RUNS["falcon"] = _FALCON
else:
    REFUSED["falcon"] = (*_FALCON, _OWN_ATTENTION)

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
    prompts = [[*PROMPT[:9], 100 + i, 2000 + i, 30 + i] for i in range(4)]
    # one layer per block (a group per layer: one full, one sliding): K and V, KV heads,
    # head size, float32, tokens
    block_bytes = 2 * 2 * 16 * 4 * 4
    engine = make_engine(path, **{**SMALL, "kv_cache_bytes": 10 * block_bytes, "max_model_len": 20})

    async def run(prompt: list[int]) -> list[int]:
        return [t async for out in engine.stream(prompt, GREEDY) for t in out.token_ids]

    async with engine:
        first = await run(prompts[0])
        rest = await asyncio.gather(*(run(p) for p in prompts[1:]))
        stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert [first, *rest] == [_reference(path, p) for p in prompts]


async def test_a_longrope_model_serves_only_its_original_context(
    tmp_path, default_model_dir, make_engine
):
    """Longrope (Phi-3/3.5's long-context configs): transformers gives every position of a
    forward call the long factors once the call's largest position passes
    ``original_max_position_embeddings``, so past it a sequence's rotary would depend on its
    step's neighbours and its prompt's chunking (seen: 4 of 5 batched prompts off
    ``generate``'s tokens). The engine's limit is that original length: within it, token for
    token, batched and chunked; above it, a ValueError naming it."""
    rope = dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=[1.0] * 8,
        long_factor=[float(i + 1) for i in range(8)],
        original_max_position_embeddings=40,
    )
    config = tf.LlamaConfig(
        **{**TINY_CONFIG, "max_position_embeddings": 128, "rope_parameters": rope}
    )
    path = _save(tmp_path / "longrope", config, default_model_dir)
    prompts = [PROMPT, PROMPT * 2 + PROMPT[:7], PROMPT[:5]]  # 12, 31 (two chunks) and 5 tokens
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        make_engine(path, **{**SMALL, "max_model_len": 41})
    engine = make_engine(path, **SMALL)
    assert engine.core.max_model_len == 40
    async with engine:
        got = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    assert [o.token_ids for o in got] == [_reference(path, p) for p in prompts]


async def test_moe_experts_stay_dense_and_the_precision_says_so(
    tmp_path, default_model_dir, make_engine, monkeypatch
):
    """transformers keeps a MoE layer's experts as 3-D tensors, no ``nn.Linear``: int4
    quantizes the attention's linears only, and the precision says the experts stay dense;
    "auto" does not compile it (its routing does not trace)."""
    cls, fields = RUNS["mixtral"]
    path = _save(tmp_path / "mixtral", cls(**{**TINY_CONFIG, **fields}), default_model_dir)
    monkeypatch.delenv("ASYNCLLM_COMPILE", raising=False)  # "auto" as a user gets it
    engine = make_engine(path, **{**SMALL, "quantization": "int4", "compile": "auto"})
    assert engine.core.runner.compiled is None
    async with engine:
        got = [t async for out in engine.stream(PROMPT, GREEDY) for t in out.token_ids]
        precision = engine.stats()["precision"]
    assert precision.endswith("int4 g32 (MoE experts dense: 4 tensors)") and len(got) == 8


def test_compile_auto_is_off_for_a_mixture_of_experts(monkeypatch):
    from asyncllm.worker.device import COMPILE_ENV, resolve_compile

    monkeypatch.delenv(COMPILE_ENV, raising=False)  # the suite's engines are eager
    cpu = torch.device("cpu")
    assert resolve_compile("auto", cpu) and not resolve_compile("auto", cpu, experts=True)
    assert resolve_compile(True, cpu, experts=True)  # asked for: tried (and served eagerly)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_family_is_refused_at_load(family, tmp_path, default_model_dir):
    """DeepSeek-V3 was accepted and the engine died at its first step (StableLM too, now
    served); Falcon, before transformers 5.25, was accepted and gave other tokens from the
    first one."""
    from asyncllm import AsyncEngine

    cls, fields, reason = REFUSED[family]
    path = _save(tmp_path / family, cls(**{**TINY_CONFIG, **fields}), default_model_dir)
    with pytest.raises(UnsupportedModelError, match=reason) as info:
        AsyncEngine.from_pretrained(str(path), **SMALL)
    assert repr(family) in str(info.value)


def test_attention_that_bypasses_the_cache_is_refused(tmp_path, default_model_dir, monkeypatch):
    """Past the class check (a modeling code it misjudges, as it did Falcon's before
    transformers 5.25): a Llama whose layers always take transformers' eager attention, never
    the interface's paged one; the probe counts the layer calls that reached the cache."""
    from transformers.models.llama import modeling_llama

    from asyncllm import AsyncEngine

    class OwnAttention:
        """Stands in for transformers' attention registry (looked up by name, or since 5.x
        releases through ``get_interface``): the layer's own eager code, always."""

        def __getitem__(self, name: str) -> Any:
            return modeling_llama.eager_attention_forward

        def get_interface(self, name: str, default: Any) -> Any:
            return modeling_llama.eager_attention_forward

    path = _save(tmp_path / "llama", tf.LlamaConfig(**TINY_CONFIG), default_model_dir)
    monkeypatch.setattr(modeling_llama, "ALL_ATTENTION_FUNCTIONS", OwnAttention())
    with pytest.raises(UnsupportedModelError, match="bypasses the paged KV cache"):
        AsyncEngine.from_pretrained(str(path), **SMALL)


@pytest.mark.parametrize(
    ("dtype", "std"), [("float32", 0.02), ("bfloat16", 0.02), ("bfloat16", 1.0)]
)
def test_a_model_computed_otherwise_than_it_says_is_refused(
    tmp_path, default_model_dir, monkeypatch, dtype, std
):
    """An attention that misses a feature (here it drops a sliding window of 4 tokens over
    the probe's 8): the engine refuses the model because its paged logits differ from its
    own eager forward's, not serve it wrongly; in bfloat16 too, also with weights large
    enough to widen the bound (std 1.0: rounding noise 0.3, the window's gap 1.2)."""
    from asyncllm import AsyncEngine
    from asyncllm.attention import backend_registry

    config = tf.MistralConfig(**TINY_CONFIG, sliding_window=4, initializer_range=std)
    path = _save(tmp_path / "mistral-window", config, default_model_dir)
    attend = backend_registry._write_and_attend

    def windowless(meta, layer, q, k, v, scale, window, softcap, num_tokens=None):
        return attend(meta, layer, q, k, v, scale, 0, softcap, num_tokens)

    monkeypatch.setattr(backend_registry, "_write_and_attend", windowless)
    # past the window check too (test_a_window_the_attention_is_not_handed_is_refused)
    monkeypatch.setattr(paged_check, "_check_windows", lambda *args: None)
    with pytest.raises(UnsupportedModelError, match="differ from its own eager forward"):
        AsyncEngine.from_pretrained(str(path), **{**SMALL, "dtype": dtype})


def test_a_window_the_attention_is_not_handed_is_refused(tmp_path, default_model_dir, monkeypatch):
    """A window of 64 tokens, longer than the probe's 8 (the logits cannot show it), which
    the modeling code would keep to its own mask: refused because the attention was not
    handed the window the config asks for."""
    from asyncllm import AsyncEngine
    from asyncllm.attention import backend_registry

    config = tf.MistralConfig(**TINY_CONFIG, sliding_window=64)
    path = _save(tmp_path / "mistral-64", config, default_model_dir)
    attend = backend_registry._write_and_attend

    def windowless(meta, layer, q, k, v, scale, window, softcap, num_tokens=None):
        return attend(meta, layer, q, k, v, scale, 0, softcap, num_tokens)

    monkeypatch.setattr(backend_registry, "_write_and_attend", windowless)
    with pytest.raises(UnsupportedModelError, match="sliding window of 64 tokens"):
        AsyncEngine.from_pretrained(str(path), **SMALL)


def test_expected_windows_follow_the_config():
    mixed = tf.Gemma3TextConfig(**TINY_CONFIG, head_dim=16, **_MIXED)
    assert paged_check.expected_windows(mixed) == [WINDOW, 0]
    assert paged_check.expected_windows(tf.MistralConfig(**TINY_CONFIG, sliding_window=9)) == [9, 9]
    off = tf.Qwen2Config(**TINY_CONFIG, use_sliding_window=False, sliding_window=32)
    assert paged_check.expected_windows(off) == [0, 0]
    # no shorter than the longest sequence the model takes (256): no window at all
    assert paged_check.expected_windows(tf.MistralConfig(**TINY_CONFIG, sliding_window=256)) == [
        0,
        0,
    ]


def _noisy_phi3(path: pathlib.Path, tokenizer_dir: pathlib.Path) -> pathlib.Path:
    """A tiny Phi-3 with weights 25x the usual (std 0.5) and jittered norms: exact on the
    paged path in float32, but bfloat16 rounding moves its logits by ~0.16 of their scale
    (float32 against bfloat16 eager), and its paged logits by 0.078 from its eager ones."""
    config = tf.Phi3Config(**TINY_CONFIG, sliding_window=None, pad_token_id=0)
    config.initializer_range = 0.5
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    tf.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


async def test_a_bfloat16_model_with_large_rounding_noise_is_served(
    tmp_path, default_model_dir, make_engine
):
    """The fixed bfloat16 bound (0.05) refused it; its gap is under twice what one rounding
    step of its input does to its eager logits (0.19 here), so it is served, and in float32
    it runs token for token like transformers."""
    path = _noisy_phi3(tmp_path / "phi3", default_model_dir)
    for dtype in ("bfloat16", "float32"):
        engine = make_engine(path, **{**SMALL, "dtype": dtype})
        async with engine:
            got = [t async for out in engine.stream(PROMPT, GREEDY) for t in out.token_ids]
        assert len(got) == GREEDY.max_tokens
    assert got == _reference(path)


def test_a_chunk_that_attends_only_to_itself_is_refused_in_noisy_bfloat16(
    tmp_path, default_model_dir, monkeypatch
):
    """Falcon's failure (each chunk attends to itself only) put into the probe's paged
    logits of the noisy Phi-3: off by 1.3 of their scale, above any widened bound."""
    from asyncllm import AsyncEngine

    real = paged_check._paged_logits

    def self_only(model, kv_cache, backend, ids):  # type: ignore[no-untyped-def]
        logits = real(model, kv_cache, backend, ids)  # layer calls still counted
        first = paged_check.PROBE_CHUNKS[0]
        model.set_attn_implementation("eager")
        try:
            with torch.inference_mode():
                tail = model(
                    input_ids=torch.tensor([ids[first:]]),
                    position_ids=torch.arange(first, len(ids))[None],
                    use_cache=False,
                ).logits[0]
        finally:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        return torch.cat([logits[:first], tail])

    path = _noisy_phi3(tmp_path / "phi3", default_model_dir)
    monkeypatch.setattr(paged_check, "_paged_logits", self_only)
    with pytest.raises(UnsupportedModelError, match="more than bfloat16 rounding explains"):
        AsyncEngine.from_pretrained(str(path), **{**SMALL, "dtype": "bfloat16"})


def test_logits_agree_within_the_dtype_rounding():
    want = torch.linspace(-8, 8, 64).reshape(2, 32)
    assert paged_check.logits_agree(want + 1e-5, want, torch.float32)[0]
    assert not paged_check.logits_agree(want + 0.1, want, torch.float32)[0]
    assert not paged_check.logits_agree(want + 0.1, want, torch.float32, noise=1.0)[0]
    assert paged_check.logits_agree(want + 0.1, want, torch.bfloat16)[0]
    agree, err = paged_check.logits_agree(want.roll(1, 1), want, torch.bfloat16)
    assert not agree and err > 0.1
    # bfloat16: twice the measured noise where that is larger, never above the ceiling
    assert not paged_check.logits_agree(want + 1.0, want, torch.bfloat16)[0]  # 0.125
    assert paged_check.logits_agree(want + 1.0, want, torch.bfloat16, noise=0.07)[0]
    assert not paged_check.logits_agree(want + 1.0, want, torch.bfloat16, noise=0.06)[0]
    assert not paged_check.logits_agree(want + 2.4, want, torch.bfloat16, noise=5.0)[0]
    assert not paged_check.logits_agree(want * float("nan"), want, torch.bfloat16, 5.0)[0]


@pytest.mark.parametrize(("value", "dtype"), [("inf", "float32"), ("nan", "bfloat16")])
def test_non_finite_weights_are_refused_as_a_corrupt_file(tiny_llama_dir, tmp_path, value, dtype):
    """One inf/NaN weight (what a Q4_K block with an inf scale dequantizes to) made every
    logit NaN, and the check blamed the paged cache ("differ by nan"); the weights are."""
    from asyncllm import AsyncEngine

    model = tf.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float(value)
    path = tmp_path / "corrupt"
    model.save_pretrained(path)
    tf.AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(path)
    with pytest.raises(ModelLoadError, match="hold non-finite values") as info:
        AsyncEngine.from_pretrained(str(path), **{**SMALL, "dtype": dtype})
    assert "model.layers.0.mlp." in str(info.value) and "paged" not in str(info.value)


def test_activations_that_overflow_are_refused_as_such(tiny_llama_dir, tmp_path):
    """Finite weights whose activations overflow the dtype: not a corrupt file, and not
    the paged cache's doing."""
    from asyncllm import AsyncEngine

    model = tf.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        model.model.norm.weight.fill_(3e38)
    path = tmp_path / "overflow"
    model.save_pretrained(path)
    tf.AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(path)
    with pytest.raises(UnsupportedModelError, match=r"activations overflow float32.*model\.norm"):
        AsyncEngine.from_pretrained(str(path), **SMALL)


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
