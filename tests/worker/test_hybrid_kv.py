"""The hybrid KV pool end to end (:mod:`asyncllm.core.kv_groups`): a tiny random Gemma 3 of
six layers (two full, four with a window of 6: three groups of two layers, so each K/V
tensor is shared by a layer of every group) runs token for token like transformers'
greedy ``generate`` in float32, while its sliding groups give back the blocks behind the
window, mid-prefill too, under preemption (swap and recompute), prefix-cache hits and
parallel samples."""

from __future__ import annotations

import asyncio
import importlib.util
import pathlib

import pytest
import torch
import transformers as tf

from asyncllm import SamplingParams
from asyncllm.bench.tiny_model import TINY_CONFIG

WINDOW = 6
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
#: Blocks of 4 tokens, chunks of 16 (a 40-token prompt is prefilled in three steps).
SMALL = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, compile=False)
#: One block: 2 slots (layers per group) x K and V x 2 KV heads x head size 16 x float32
#: x 4 tokens; without groups it would hold all 6 layers (3x the bytes).
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4


@pytest.fixture(scope="module")
def gemma3_dir(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: pathlib.Path
) -> pathlib.Path:
    torch.manual_seed(0)
    config = tf.Gemma3TextConfig(
        **{**TINY_CONFIG, "num_hidden_layers": 6},
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
    )
    path = tmp_path_factory.mktemp("gemma3-hybrid")
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tf.AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(gemma3_dir: pathlib.Path):
    model = tf.AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()

    def greedy(prompt: list[int], max_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        return out[0, len(prompt) :].tolist()

    return greedy


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (n,), generator=g).tolist()


def _greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)


@pytest.mark.parametrize("backend", ["auto", "torch"])
async def test_long_generation_frees_sliding_blocks_and_matches_transformers(
    backend, gemma3_dir, reference, make_engine
):
    """A 40-token prompt in chunks of 16 and 60 generated tokens: after each step the
    sliding groups hold at most the 2 blocks the next token's window of 6 reaches (from
    the first chunk on: blocks freed mid-prefill), the full group every block; the tokens
    are transformers'."""
    engine = make_engine(gemma3_dir, **SMALL, kv_cache_bytes=200 * BLOCK_BYTES,
                         attention_backend=backend)  # fmt: skip
    core = engine.core
    bm = core.block_manager
    assert core.kv_cache.key_caches[0] is core.kv_cache.key_caches[2]  # layers 0, 2: slot 0
    held: list[tuple[int, ...]] = []
    free_behind = bm.free_behind_window

    def spy(request_id: str, num_computed: int) -> None:
        free_behind(request_id, num_computed)
        held.append((num_computed, *(bm.num_held_blocks(request_id, g) for g in range(3))))

    bm.free_behind_window = spy
    prompt = _prompt(40, seed=1)
    async with engine:
        got = [t async for out in engine.stream(prompt, _greedy(60)) for t in out.token_ids]
        stats = engine.stats()
    layout = "3 groups of 2 layers (1 full, 2 window 6), 200 blocks of 4, float32"
    assert stats["kv_layout"] == layout
    assert got == reference(prompt, 60)
    assert held[0] == (16, 4, 2, 2)  # the first chunk: sliding blocks 0 and 1 freed already
    assert all(s1 <= 2 and s2 <= 2 for _, _, s1, s2 in held)
    assert held[-1] == (99, 25, 2, 2)
    assert all(full == -(-n // 4) for n, full, _, _ in held)


@pytest.mark.parametrize("mode", ["offload", "recompute"])
async def test_small_pool_preempts_and_hits_the_prefix_cache(
    mode, gemma3_dir, reference, make_engine
):
    """Four prompts after one 13-token prefix (the last three hit the prefix cache), in a
    pool of 30 blocks (one sequence of 48 tokens needs up to 26): preempted, swapped out
    and in or recomputed, each gives transformers' tokens."""
    engine = make_engine(gemma3_dir, **SMALL, kv_cache_bytes=30 * BLOCK_BYTES,
                         max_model_len=48, preemption_mode=mode)  # fmt: skip
    shared = _prompt(13, seed=2)
    prompts = [[*shared, *_prompt(6 + i, seed=10 + i)] for i in range(4)]

    async def run(prompt: list[int]) -> list[int]:
        return [t async for out in engine.stream(prompt, _greedy(16)) for t in out.token_ids]

    async with engine:
        first = await run(prompts[0])
        rest = await asyncio.gather(*(run(p) for p in prompts[1:]))
        stats = engine.stats()
    assert [first, *rest] == [reference(p, 16) for p in prompts]
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] >= 3 * 12
    if mode == "offload":
        assert stats["num_swapped_out_blocks"] > 0
        assert stats["num_swapped_in_blocks"] == stats["num_swapped_out_blocks"]
    else:
        assert stats["num_recomputed_tokens"] > 0


async def test_parallel_samples_share_every_group(gemma3_dir, reference, make_engine):
    """n=3 greedy samples of a 30-token prompt: the prefix request computes 29 tokens
    (its sliding blocks behind the window freed), the samples fork its tables in every
    group and copy the partly filled last blocks on write; each gives transformers'
    tokens."""
    engine = make_engine(gemma3_dir, **SMALL, kv_cache_bytes=100 * BLOCK_BYTES)
    prompt = _prompt(30, seed=3)
    async with engine:
        out = await engine.generate(prompt, _greedy(12, n=3))
    want = reference(prompt, 12)
    assert [list(s.token_ids) for s in out.samples] == [want] * 3


async def test_a_budget_buys_three_times_the_blocks(gemma3_dir, make_engine):
    """The same bytes: 6 layers per block without groups, 2 with them."""
    engine = make_engine(gemma3_dir, **SMALL, kv_cache_bytes=300 * BLOCK_BYTES)
    async with engine:
        stats = engine.stats()
    assert stats["num_total_blocks"] == 300
    spec = engine.core.kv_cache.spec
    assert spec.num_slots == 2 and spec.num_layers == 6 and spec.bytes_per_block == BLOCK_BYTES


@pytest.mark.parametrize("steps", ["decode", "mixed"])
def test_a_plan_retabled_for_another_group_attends_like_a_new_one(steps):
    """:func:`grouped_metadata` plans the first group and retables the others: the same
    outputs as a plan built over those tables (torch and C++ paths), and the same tensors
    for Triton's plan."""
    from asyncllm.attention import cpu_paged, torch_paged, triton_paged

    g = torch.Generator().manual_seed(4)
    query_lens = [1, 1, 1] if steps == "decode" else [1, 5, 1]
    seq_lens = [9, 13, 20]
    first = [list(range(i * 5, i * 5 + 5)) for i in range(3)]
    other = [torch.randperm(40, generator=g)[15:20].tolist() for _ in range(3)]
    q = torch.randn(sum(query_lens), 4, 16, generator=g)
    k, v = torch.randn(2, 40, 4, 2, 16, generator=g)
    for cls, attend in (
        (torch_paged.PagedAttentionPlan, torch_paged.paged_attention),
        (cpu_paged.CpuPagedPlan, cpu_paged.paged_attention_cpu),
    ):
        plan = cls.build(query_lens, seq_lens, first, 4)
        retabled = plan.retable(query_lens, seq_lens, other, 4)
        fresh = cls.build(query_lens, seq_lens, other, 4)
        for window in (0, 6):
            want = attend(q, k, v, fresh, 0.25, window)
            assert torch.equal(attend(q, k, v, retabled, 0.25, window), want)
            assert not torch.equal(attend(q, k, v, plan, 0.25, window), want)
    if importlib.util.find_spec("triton") is not None:
        plan = triton_paged.TritonPagedPlan.build(query_lens, seq_lens, first, 4)
        retabled = plan.retable(query_lens, seq_lens, other, 4)
        fresh = triton_paged.TritonPagedPlan.build(query_lens, seq_lens, other, 4)
        assert torch.equal(retabled.block_tables, fresh.block_tables)


def test_the_load_check_finds_each_layer_of_a_shared_slot(tmp_path, default_model_dir, monkeypatch):
    """The load-time check tells the layers apart although layers of one slot share their
    K/V tensors (each reads its group's plan): one sliding layer (4) not handed its window of
    64 is named, the others pass."""
    from asyncllm import AsyncEngine, UnsupportedModelError
    from asyncllm.attention import backend_registry

    config = tf.Gemma3TextConfig(
        **{**TINY_CONFIG, "num_hidden_layers": 6},
        head_dim=16,
        sliding_window=64,
        layer_types=LAYER_TYPES,
    )
    path = tmp_path / "gemma3-64"
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tf.AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(path)
    attend = backend_registry._write_and_attend

    def drops_layer_4s(meta, layer, q, k, v, scale, window, softcap, num_tokens=None):
        window = 0 if layer == 4 else window
        return attend(meta, layer, q, k, v, scale, window, softcap, num_tokens)

    monkeypatch.setattr(backend_registry, "_write_and_attend", drops_layer_4s)
    with pytest.raises(UnsupportedModelError, match=r"layer 4 .* 64 tokens.*\(1 layer\(s\) so\)"):
        AsyncEngine.from_pretrained(str(path), **SMALL, kv_cache_bytes=200 * BLOCK_BYTES)
