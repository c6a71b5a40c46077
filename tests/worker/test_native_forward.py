"""The native decode path (``csrc/decoder_layer.cpp``, :mod:`asyncllm.worker.native_forward`)
against transformers' modeling code: token for token on tiny Llama, Qwen2 (biases, a window
on one layer), Qwen3 (per-head norms), Mistral (a window on every layer) and Gemma 3 (its
norms, tanh-GELU, a rotary embedding per layer type, a window on one layer) in float32, with
chunked prefill beside decodes, prefix hits, preemption in both modes, n > 1, int4 layers;
on the default model (int4 decoder layers, Q8_0 head) too. The architecture matrix
(tests/models/test_architectures.py) runs these families through it as well."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import pytest
import torch
import transformers as tf

from asyncllm import SamplingParams
from asyncllm.bench.tiny_model import TINY_CONFIG
from asyncllm.worker import native_forward

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
#: 16-token chunks and blocks of 4: prompts longer than the budget are prefilled in chunks
#: while the others decode, so decode-only steps and mixed ones alternate.
SMALL = dict(
    dtype="float32", block_size=4, max_num_batched_tokens=16, kv_cache_bytes=2**20, compile=False
)
FAMILIES = {
    "llama": (tf.LlamaConfig, {}),
    "qwen2": (
        tf.Qwen2Config,
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    "qwen3": (tf.Qwen3Config, dict(head_dim=16, attention_bias=True)),
    "mistral": (tf.MistralConfig, dict(sliding_window=6)),
    # attn_logit_softcapping: in the config, never applied by transformers' Gemma 3 (the C++
    # forward applied it once, and its load check refused it, or not, by the cap's size)
    "gemma3": (
        tf.Gemma3TextConfig,
        dict(
            head_dim=16,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=4.0,
        ),
    ),
}


def _prompts(n: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    lens = [3, 12, 21, 7, 30, 9][:n]
    return [torch.randint(5, 20000, (k,), generator=g).tolist() for k in lens]


@pytest.fixture(scope="module")
def family_dirs(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: pathlib.Path
) -> dict[str, pathlib.Path]:
    out = {}
    tok = tf.AutoTokenizer.from_pretrained(default_model_dir)
    for name, (cls, fields) in FAMILIES.items():
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cls(**{**TINY_CONFIG, **fields}))
        with torch.no_grad():  # random init leaves biases and norm weights plain
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.3)
            for layer in model.model.layers:  # peaked attention: positions matter
                attn = layer.self_attn
                for m in (attn.q_proj, attn.k_proj, getattr(attn, "q_norm", None)):
                    if m is not None:
                        m.weight.mul_(4)
                attn.o_proj.weight.mul_(4)
                layer.mlp.gate_proj.weight.mul_(
                    8
                )  # gates of a few units: the activation's shape matters
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        tok.save_pretrained(path)
        out[name] = path
    return out


async def _run(engine: Any, prompts: list[list[int]], params: SamplingParams) -> list[Any]:
    async with engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        stats = engine.stats()
    return [o.token_ids for o in outs] + [stats]


def _off(monkeypatch: pytest.MonkeyPatch, make: Any, *args: Any, **kw: Any) -> Any:
    with monkeypatch.context() as m:
        m.setenv("ASYNCLLM_NATIVE_FORWARD", "0")
        engine = make(*args, **kw)
    assert engine.core.runner.native is None
    return engine


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_native_forward_equals_the_modeling_code(
    family, family_dirs, make_engine, monkeypatch
):
    path = family_dirs[family]
    native = make_engine(path, **SMALL)
    assert native.core.runner.native is not None, native_forward.unsupported_reason(
        native.core.runner.model
    )
    *got, stats = await _run(native, _prompts(), GREEDY)
    *want, _ = await _run(_off(monkeypatch, make_engine, path, **SMALL), _prompts(), GREEDY)
    assert got == want
    assert stats["native_steps"] > 0
    # and transformers' own generate, for the first prompt
    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([_prompts()[0]])
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                       do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert got[0] == out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("mode", ["offload", "recompute"])
async def test_native_forward_through_prefix_hits_and_preemption(
    mode, family_dirs, make_engine, monkeypatch
):
    """Eight prompts after one 9-token prefix (hits) in a pool that preempts them."""
    path = family_dirs["qwen2"]
    base = _prompts(1)[0][:3] + _prompts(2)[1][:6]
    prompts = [[*base, 100 + i, 2000 + i, 30 + i] for i in range(8)]
    # a block of one layer: K and V, 2 KV heads, head size 16, float32, 4 tokens
    kw = {**SMALL, "kv_cache_bytes": 12 * 2 * 2 * 16 * 4 * 4, "max_model_len": 24}
    kw["preemption_mode"] = mode
    *got, stats = await _run(make_engine(path, **kw), prompts, GREEDY)
    *want, _ = await _run(_off(monkeypatch, make_engine, path, **kw), prompts, GREEDY)
    assert got == want
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["native_steps"] > 0


async def test_native_forward_with_parallel_samples_and_int4(family_dirs, make_engine, monkeypatch):
    """n = 3 seeded samples (their logits through the sampler) over int4 layers (the C++
    decoder calls asyncllm::int4_linear itself)."""
    path = family_dirs["llama"]
    params = SamplingParams(max_tokens=8, temperature=0.1, n=3, seed=7)
    kw = {**SMALL, "quantization": "int4"}
    native = make_engine(path, **kw)
    assert native.core.runner.native is not None
    *got, stats = await _run(native, _prompts(3), params)
    *want, _ = await _run(_off(monkeypatch, make_engine, path, **kw), _prompts(3), params)
    assert got == want and stats["native_steps"] > 0


async def test_q_k_fused_and_v_apart_feed_the_decoder_their_columns(
    family_dirs, make_engine, monkeypatch
):
    """q/k/v as a fused pair and one call (Gemma 3's Q5_0 q/k and Q8_0 v): the C++ decoder
    takes q and k from the pair's columns and v from its own call."""
    from asyncllm.layers import sibling_linears

    path = family_dirs["qwen3"]
    pairs = (("q_proj", "k_proj"), ("gate_proj", "up_proj"))
    monkeypatch.setattr(sibling_linears, "SIBLING_NAMES", pairs)
    native = make_engine(path, **SMALL)
    attn = native.core.runner.model.model.layers[0].self_attn
    assert isinstance(attn.k_proj, sibling_linears.SiblingLinear)
    assert not isinstance(attn.v_proj, sibling_linears.SiblingLinear)
    assert native.core.runner.native is not None
    *got, stats = await _run(native, _prompts(), GREEDY)
    *want, _ = await _run(_off(monkeypatch, make_engine, path, **SMALL), _prompts(), GREEDY)
    assert got == want and stats["native_steps"] > 0


async def test_default_model_decodes_natively_like_the_modeling_code(make_engine, monkeypatch):
    """The default model as users get it: int4 decoder layers and the Q8_0 head in C++."""
    prompts = [[1, 9690, 198, 2683, 314, 253, 5356, 11173, 30], [1, 4093, 253, 3565, 8233, 30]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    native = make_engine("default", compile=False, max_model_len=128)
    assert native.core.runner.native is not None
    *got, stats = await _run(native, prompts, params)
    off = _off(monkeypatch, make_engine, "default", compile=False, max_model_len=128)
    *want, _ = await _run(off, prompts, params)
    assert got == want and stats["native_steps"] >= 20


def test_models_outside_the_families_keep_the_modeling_code(family_dirs):
    model = tf.AutoModelForCausalLM.from_pretrained(family_dirs["llama"], dtype=torch.float32)
    assert native_forward.unsupported_reason(model) is None
    assert "bfloat16" in str(native_forward.unsupported_reason(model.to(torch.bfloat16)))
    phi = tf.AutoModelForCausalLM.from_config(tf.Phi3Config(**TINY_CONFIG, pad_token_id=0))
    assert "Phi3ForCausalLM is not one of" in str(native_forward.unsupported_reason(phi))
    cfg = tf.LlamaConfig(**{**TINY_CONFIG, "hidden_act": "gelu"})
    assert "hidden_act" in str(native_forward.unsupported_reason(tf.LlamaForCausalLM(cfg)))


async def test_speculative_verification_rows_attend_as_decodes(family_dirs, make_engine):
    """A step of decodes and k + 1 proposal rows gets one decode row per token (the decode
    kernel, as plain steps), and speculation gives the tokens of plain decoding."""
    from asyncllm.core.plan import ScheduledChunk, SchedulerOutput

    path = family_dirs["llama"]
    prompt = [5, 77, 1000, 23, 9, 400] * 4  # repetitive: proposals from the prompt
    *plain, _ = await _run(make_engine(path, **SMALL), [prompt], GREEDY)
    engine = make_engine(path, **SMALL, speculative_tokens=3)
    *spec, stats = await _run(engine, [prompt], GREEDY)
    assert spec == plain and stats["spec_num_draft_tokens"] > 0
    runner = engine.core.runner
    tables = [[0, 1, 2, 3, 4, 5, 6, 7]]
    chunk = ScheduledChunk(request_id="r", token_ids=[42, 7, 8, 9], start_pos=10,
                           block_tables=tables, sample=True, num_output_tokens=0,
                           params=GREEDY, spec_token_ids=(7, 8, 9))  # fmt: skip
    meta = runner._metadata(SchedulerOutput(chunks=[chunk]), [list(range(40, 44))], spread=True)
    assert not meta.plan.base.prefills and meta.plan.base.decodes is not None
    assert meta.plan.dec_lens.tolist() == [11, 12, 13, 14]


def test_a_native_forward_that_disagrees_at_load_is_not_used(
    family_dirs, make_engine, monkeypatch, caplog
):
    """The load-time probe (a prefill, a chunk, a decode) compares the C++ forward's logits
    with the model's eager forward: one that disagrees (here made to) or raises never serves;
    the modeling code does, with one warning."""
    real = native_forward.NativeForward.forward

    def off(self, *args):
        return real(self, *args) * 1.01

    monkeypatch.setattr(native_forward.NativeForward, "forward", off)
    with caplog.at_level("WARNING", logger="asyncllm"):
        engine = make_engine(family_dirs["llama"], **SMALL)
    assert engine.core.runner.native is None
    assert "differ from the modeling code's" in caplog.text

    def fails(self, *args):
        raise RuntimeError("boom")

    monkeypatch.setattr(native_forward.NativeForward, "forward", fails)
    caplog.clear()
    with caplog.at_level("WARNING", logger="asyncllm"):
        engine = make_engine(family_dirs["llama"], **SMALL)
    assert engine.core.runner.native is None and "fails on the load-time probe" in caplog.text
    *got, _ = asyncio.run(_run(engine, _prompts(2), GREEDY))
    assert [len(t) for t in got] == [10, 10]
