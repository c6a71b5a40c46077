"""The int8 KV cache (``EngineConfig.kv_cache_dtype="int8"``): the quantization, the C++
kernels over it against the torch path, and the engine end to end (greedy against the
model-dtype cache, preemption by swap, a sliding-window model, prefix caching, the pool's
size)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from asyncllm import EngineConfig, SamplingParams
from asyncllm.attention import cpu_paged, kv_int8, torch_paged, triton_paged
from asyncllm.worker.kv_cache import KVCache, KVCacheSpec, copy_blocks_between, size_kv_cache
from asyncllm.worker.offload import CPUOffloadPool

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

#: Triton was imported with ``TRITON_INTERPRET=1`` (see tests/kernels/test_triton_kernels.py): the
#: Triton cases run here; otherwise in a child pytest.
INTERPRETED = not isinstance(tl.zeros, JITFunction)

needs_kernel = pytest.mark.skipif(
    not cpu_paged.available(), reason=f"CPU attention kernel unavailable: {cpu_paged.failure()}"
)


def _prompts(lens, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lens]


def test_quantize_round_trip_bounds():
    """Codes in [-127, 127], the float16 scale within half a float16 step of absmax / 127,
    each value within the bound kv_int8 proves (``s * (1/2 + 2**-15)``, or 3.8e-6 for a
    subnormal scale), an all-zero row exact; bfloat16 rows too."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-4, 3, 50)[:, None, None]
    x[7, 1] = 0.0
    x[9, 2, 5] = 1e4  # one outlier: the rest of its row rounds coarsely
    for src in (x, x.bfloat16()):
        packed = kv_int8.quantize(src)
        assert packed.dtype == torch.int8 and packed.shape == (50, 3, 66)
        codes = packed[..., :64]
        assert int(codes.min()) >= -127 and int(codes.max()) <= 127
        scale = kv_int8.scales(packed)
        amax = src.float().abs().amax(-1)
        exact = amax.double() / 127
        normal = exact >= 2**-14
        step = torch.where(normal, exact * 2**-11, torch.full_like(exact, 2**-25))
        assert bool(((scale.double() - exact).abs() <= step * (1 + 1e-6)).all())
        assert bool((codes.abs().amax(-1) == 127)[normal].all())  # the absmax maps to 127
        err = (kv_int8.dequantize(packed).double() - src.double()).abs()
        bound = torch.clamp_min(scale.double() * (0.5 + 2**-15), 3.8e-6)
        assert bool((err <= torch.where(normal, scale * (0.5 + 2**-15), bound)[..., None]).all())
        assert not kv_int8.dequantize(packed)[7, 1].any() and float(scale[7, 1]) == 0.0
    assert kv_int8.head_dim_of(packed) == 64 and kv_int8.row_dim(64, True) == 66


def _int8_step(query_lens, seq_lens, bs, hkv, heads, dim, dtype, seed=0):
    """Random int8 caches (quantized from float rows), block tables in a shuffled pool and
    a transposed-view query, as transformers hands it over."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-s // bs) for s in seq_lens) + 5
    perm = torch.randperm(n_blocks, generator=g).tolist()
    tables, k = [], 0
    for s in seq_lens:
        tables.append(perm[k : k + -(-s // bs)])
        k += -(-s // bs)
    kc = kv_int8.quantize(torch.randn(n_blocks, bs, hkv, dim, generator=g) * 2)
    vc = kv_int8.quantize(torch.randn(n_blocks, bs, hkv, dim, generator=g))
    q = torch.randn(heads, sum(query_lens), dim, generator=g).to(dtype).transpose(0, 1)
    return q, kc, vc, tables


def _check_against_torch(query_lens, seq_lens, hkv, group, dim, bs, dtype, **kw):
    q, kc, vc, tables = _int8_step(query_lens, seq_lens, bs, hkv, hkv * group, dim, dtype)
    plan = torch_paged.PagedAttentionPlan.build(query_lens, seq_lens, tables, bs)
    # the torch path over the same int8 cache, and float attention over its values
    ref = torch_paged.paged_attention(q, kc, vc, plan, 0.1, **kw)
    deq = torch_paged.paged_attention(
        q.float(), kv_int8.dequantize(kc), kv_int8.dequantize(vc), plan, 0.1, **kw
    )
    cplan = cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, bs)
    out = cpu_paged.paged_attention_cpu(q, kc, vc, cplan, 0.1, **kw)
    assert out.dtype == dtype
    # float32: the same sums up to their order; bfloat16: the output's rounding (the torch
    # path also rounds the dequantized K/V to bfloat16 before its attention)
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.float(), deq, rtol=tol, atol=tol)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 * tol, atol=2 * tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("hkv", "group", "dim", "bs"),
    # AVX-512 tiles (64, 80, 128), the portable tile (24, 36), G = 1 and G > 4
    [(2, 3, 64, 16), (1, 8, 128, 16), (4, 1, 80, 32), (2, 2, 24, 8), (3, 5, 36, 16)],
)
def test_cpu_decode_over_int8_matches_torch(hkv, group, dim, bs, dtype):
    seq_lens = [1, 15, 16, 17, 100, 250]
    _check_against_torch([1] * len(seq_lens), seq_lens, hkv, group, dim, bs, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (13, 0.0), (0, 5.0)])
@pytest.mark.parametrize(("dim", "bs"), [(64, 16), (36, 8)])
def test_cpu_prefill_over_int8_matches_torch(dim, bs, window, softcap, dtype):
    """Chunks after cached context and decodes in one step (the chunk kernel), with a
    sliding window and soft-capping."""
    query_lens, seq_lens = [1, 7, 17, 3, 40], [1, 15, 17, 100, 250]
    _check_against_torch(query_lens, seq_lens, 2, 3, dim, bs, dtype, window=window, softcap=softcap)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_write_and_decode_quantizes_as_torch(dtype):
    """The decode fast path writes the codes and scales ``kv_int8.quantize`` gives (the
    torch path's write) and attends as the torch path over them; a negative slot is
    skipped."""
    seq_lens, bs, hkv, group, dim = [1, 17, 40, 33], 16, 2, 3, 64
    q, kc, vc, tables = _int8_step([1] * 4, seq_lens, bs, hkv, hkv * group, dim, dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    k = (torch.randn(hkv, 4, dim, generator=g) * 3).to(dtype).transpose(0, 1)  # strided
    v = torch.randn(4, hkv, dim, generator=g).to(dtype)
    last = [t[(s - 1) // bs] * bs + (s - 1) % bs for t, s in zip(tables, seq_lens, strict=True)]
    slots = torch.tensor(last)
    slots[2] = -1
    kc_ref, vc_ref = kc.clone(), vc.clone()
    torch_paged.write_kv_cache(k, v, kc_ref, vc_ref, slots)
    cplan = cpu_paged.CpuPagedPlan.build([1] * 4, seq_lens, tables, bs)
    out = cpu_paged.write_and_decode(q, k, v, kc, vc, slots, cplan, 0.1)
    assert out is not None and out.dtype == dtype
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    plan = torch_paged.PagedAttentionPlan.build([1] * 4, seq_lens, tables, bs)
    ref = torch_paged.paged_attention(
        q.float(), kv_int8.dequantize(kc), kv_int8.dequantize(vc), plan, 0.1
    )
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_armed_decode_op_writes_and_reads_int8(dtype):
    """A compiled graph's ``asyncllm::paged_attention`` in a decode-only step runs the C++
    kernel straight over int8 caches (armed): the caches and output of the Python
    implementation, padded rows copies of the last real one."""
    import dataclasses

    from asyncllm.attention import backend_registry

    seq_lens, bs, hkv, group, dim = [1, 17, 40], 16, 2, 3, 64
    q, kc, vc, tables = _int8_step([1] * 3, seq_lens, bs, hkv, hkv * group, dim, dtype, seed=4)
    g = torch.Generator().manual_seed(6)
    q = torch.cat([q, torch.randn(2, hkv * group, dim, generator=g).to(dtype)])  # padding
    kv = [torch.randn(5, hkv, dim, generator=g).to(dtype) for _ in range(2)]
    last = [t[(s - 1) // bs] * bs + (s - 1) % bs for t, s in zip(tables, seq_lens, strict=True)]

    def step(native: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        kcs, vcs = [kc.clone(), kc.clone()], [vc.clone(), vc.clone()]
        plan = cpu_paged.CpuPagedPlan.build([1] * 3, seq_lens, tables, bs)
        backend = cpu_paged.CPU_BACKEND
        if not native:
            backend = dataclasses.replace(backend, arm_step=None)
        meta = backend_registry.AttentionMetadata(kcs, vcs, torch.tensor(last), plan, backend)
        with backend_registry.step_metadata(meta, 3):
            assert cpu_paged.load().decode_armed() == native
            out = torch.ops.asyncllm.paged_attention(q, *kv, 1, 0.1, 0, 0.0)
        return out, kcs + vcs

    in_cpp, caches = step(True)
    python, want = step(False)
    assert in_cpp.dtype == dtype and torch.equal(in_cpp, python)
    assert torch.equal(in_cpp[3:], in_cpp[2:3].expand(2, -1, -1))
    assert all(torch.equal(a, b) for a, b in zip(caches, want, strict=True))
    assert not torch.equal(caches[1], kc)  # layer 1's new K rows were written, quantized


def _spec(kv_cache_dtype: str, dtype=torch.bfloat16) -> KVCacheSpec:
    return KVCacheSpec(4, 2, 64, dtype, 16, kv_cache_dtype=kv_cache_dtype)


def test_pool_holds_about_twice_the_blocks(tiny_llama_dir):
    """The same KV bytes hold 2 x head_dim / (head_dim + 2) times the bfloat16 blocks (the
    scales counted), 4 x as many as float32 less the scales."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama_dir)  # head_dim 16
    kw = dict(block_size=4, max_model_len=64, max_num_seqs=4, kv_cache_bytes=2**20)
    cpu = torch.device("cpu")
    bf, n_bf = size_kv_cache(config, torch.bfloat16, cpu, **kw)
    q8, n_q8 = size_kv_cache(config, torch.bfloat16, cpu, kv_cache_dtype="int8", **kw)
    assert bf.bytes_per_token == 2 * 2 * 2 * 16 * 2 and q8.bytes_per_token == 2 * 2 * 2 * 18
    assert n_bf == 2**20 // bf.bytes_per_block and n_q8 == 2**20 // q8.bytes_per_block
    assert n_q8 / n_bf == pytest.approx(2 * 16 / 18, rel=0.01)
    # the default model's head size: 1.94x
    assert _spec("auto").bytes_per_token / _spec("int8").bytes_per_token == pytest.approx(128 / 66)
    cache = KVCache(_spec("int8"), 3, cpu)
    assert cache.key_slots[0].shape == (3, 16, 2, 66) and cache.key_slots[0].dtype == torch.int8
    assert cache.num_bytes == 3 * _spec("int8").bytes_per_block


def test_invalid_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs an even head_dim, got 31"):
        from transformers import GPT2Config  # no RoPE: an odd head size is a valid config

        size_kv_cache(
            GPT2Config(n_embd=62, n_head=2, n_layer=1),
            torch.float32, torch.device("cpu"), block_size=4, max_model_len=16,
            max_num_seqs=1, kv_cache_bytes=2**20, kv_cache_dtype="int8",
        )  # fmt: skip


def test_block_copies_carry_the_scales():
    """Copy-on-write and swap out/in move the codes and scales of every slot's K and V."""
    cpu = torch.device("cpu")
    cache = KVCache(_spec("int8"), 6, cpu)
    g = torch.Generator().manual_seed(5)
    for t in cache.block_tensors():
        t.copy_(kv_int8.quantize(torch.randn(6, 16, 2, 64, generator=g)))
    before = [t.clone() for t in cache.block_tensors()]
    cache.copy_blocks([(1, 4), (2, 5)])
    for t, b in zip(cache.block_tensors(), before, strict=True):
        assert torch.equal(t[4], b[1]) and torch.equal(t[5], b[2]) and torch.equal(t[:4], b[:4])
    pool = CPUOffloadPool(cache, 4)
    assert pool.key_blocks[0].shape == (4, 16, 2, 66) and pool.num_bytes == 4 * 16 * 2 * 4 * 66 * 2
    pool.swap([(0, 3), (4, 0)], [])
    for t in cache.block_tensors():
        t.zero_()
    pool.swap([], [(3, 2), (0, 1)])
    for t, b in zip(cache.block_tensors(), before, strict=True):
        assert torch.equal(t[2], b[0]) and torch.equal(t[1], b[1]) and not t[0].any()
    with pytest.raises(ValueError, match="cannot go to"):
        other = KVCache(_spec("auto", torch.float32), 2, cpu)
        copy_blocks_between(cache.block_tensors(), other.block_tensors(), [0], [0])


async def _greedy(engine, prompts, params=GREEDY):
    async with engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        stats = engine.stats()
    return [o.token_ids for o in outs], stats


#: A top-2 gap (log-prob) of the model-dtype cache below which an int8 cache may pick the
#: second token: on the tiny random models the int8 cache moves log-probs by ~5e-4 (their
#: logits are nearly flat: top-2 gaps of 6e-5 occur).
NEAR_TIE = 1e-3


def _equal_up_to_near_ties(want, got) -> int:
    """Each request's tokens equal the reference's until, at most, a near-tie (top-2 gap below
    :data:`NEAR_TIE`) where the int8 cache took the reference's second token; returns the
    tokens compared."""
    compared = 0
    for w, g in zip(want, got, strict=True):
        for t, (a, b) in enumerate(zip(w.token_ids, g.token_ids, strict=True)):
            compared += 1
            if a != b:
                top = sorted(w.logprobs[t].items(), key=lambda kv: -kv[1].logprob)
                assert top[0][1].logprob - top[1][1].logprob < NEAR_TIE and b == top[1][0]
                break
    return compared


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
async def test_greedy_equals_the_model_dtype_cache(arch, backend, request, make_engine):
    """Chunked prefill with decodes (budget 16, blocks of 4): an int8 cache gives the
    float32 cache's tokens on the tiny Llama and the tiny Qwen2 (its second layer a sliding
    window of 8, so a hybrid layout), up to a near-tie of the reference's top two log-probs
    (the tiny Llama's third prompt: a gap of 4e-4 at its ninth token); stats report the int8
    layout."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    prompts = _prompts([3, 9, 20, 30, 5, 17])
    kw = dict(block_size=4, max_num_batched_tokens=16, kv_cache_bytes=2**20, dtype="float32")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    engines = [make_engine(model_dir, attention_backend=backend, **kw, **kv)
               for kv in ({}, {"kv_cache_dtype": "int8"})]  # fmt: skip
    outs = []
    for engine in engines:
        async with engine:
            outs.append(await asyncio.gather(*(engine.generate(p, params) for p in prompts)))
            stats = engine.stats()
    assert _equal_up_to_near_ties(*outs) >= 60  # of 72
    assert stats["kv_cache_dtype"] == "int8" and stats["kv_layout"].endswith(", int8")
    slots = 2 if arch == "llama" else 1  # the hybrid layout: a block holds one layer's K/V
    assert stats["kv_bytes_per_token"] == 2 * slots * 2 * (16 + 2)


async def test_preemption_swap_keeps_int8_outputs(tiny_llama_dir, make_engine):
    """16 requests in a pool for about 3: swapped-out blocks come back with their scales
    (outputs equal to a large int8 pool's)."""
    prompts = _prompts([3, 7, 12, 20, 1, 9, 30, 16] * 2)
    kw = dict(block_size=4, max_num_batched_tokens=32, max_model_len=48, kv_cache_dtype="int8")
    big, _ = await _greedy(make_engine(tiny_llama_dir, kv_cache_bytes=2**20, **kw), prompts)
    block_bytes = 4 * 2 * 2 * 2 * 18  # 4 tokens, K and V, 2 layers, 2 heads, 16 + 2 bytes
    small, stats = await _greedy(
        make_engine(tiny_llama_dir, kv_cache_bytes=16 * block_bytes, **kw), prompts
    )
    assert small == big
    assert stats["num_preemptions"] > 0 and stats["num_swapped_out_blocks"] > 0
    assert stats["num_swapped_in_blocks"] == stats["num_swapped_out_blocks"]
    assert stats["swap_bytes"] == 2 * stats["num_swapped_out_blocks"] * block_bytes


async def test_prefix_cache_hits_over_int8_blocks(tiny_qwen2_dir, make_engine):
    """Prompts after one shared prefix: the later ones hit its int8 blocks and give the
    tokens of an engine that recomputes them (hybrid layout: the sliding group too)."""
    shared = _prompts([24], seed=3)[0]
    prompts = [shared + t for t in ([5], [6, 7], [8, 9, 10])]
    kw = dict(block_size=4, max_num_batched_tokens=16, kv_cache_bytes=2**20, kv_cache_dtype="int8")
    on_engine = make_engine(tiny_qwen2_dir, **kw)
    on = []
    async with on_engine:
        for p in prompts:
            on.append((await on_engine.generate(p, GREEDY)).token_ids)
        stats = on_engine.stats()
    off, _ = await _greedy(make_engine(tiny_qwen2_dir, enable_prefix_caching=False, **kw), prompts)
    assert on == off
    assert stats["prefix_cache_hits"] >= 2 * 24


class TestTritonInt8UnderInterpreter:
    """The Triton write and attention kernels over an int8 cache, against the torch path;
    collected only when Triton runs interpreted (``test_triton_int8_kernels``)."""

    __test__ = INTERPRETED

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_write_and_attention_match_torch(self, dtype):
        """The write quantizes to the torch path's codes and scales bit for bit; decodes
        (one split and two) and chunks after cached context, with a sliding window or
        soft-capping, match float attention over the dequantized cache."""
        bs, hkv, group, dim = 8, 2, 2, 32
        seqs = [(13, 1), (0, 1), (0, 19), (bs + 5, 9), (7, 1)]  # (cached, new)
        query_lens, seq_lens = [n for _, n in seqs], [c + n for c, n in seqs]
        g = torch.Generator().manual_seed(1)
        _, kc, vc, tables = _int8_step(query_lens, seq_lens, bs, hkv, hkv * group, dim, dtype)
        rows = sum(query_lens)
        key = (torch.randn(rows, hkv, dim, generator=g) * 3).to(dtype)
        value = torch.randn(rows, hkv, dim, generator=g).to(dtype)
        where = [(tables[b], p) for b, (c, n) in enumerate(seqs) for p in range(c, c + n)]
        slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in where])
        kc_ref, vc_ref = kc.clone(), vc.clone()
        torch_paged.write_kv_cache(key, value, kc_ref, vc_ref, slots)
        triton_paged.write_kv_cache(key, value, kc, vc, slots)
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
        q = torch.randn(rows, hkv * group, dim, generator=g).to(dtype)
        plan = triton_paged.TritonPagedPlan.build(query_lens, seq_lens, tables, bs)
        ref_plan = torch_paged.PagedAttentionPlan.build(query_lens, seq_lens, tables, bs)
        kf, vf = kv_int8.dequantize(kc), kv_int8.dequantize(vc)
        tol = 2e-5 if dtype == torch.float32 else 1.6e-2
        for window, softcap in ((0, 0.0), (5, 0.0), (0, 3.0)):
            ref = torch_paged.paged_attention(q.float(), kf, vf, ref_plan, 0.2, window, softcap)
            for splits in (1, 2):
                out = triton_paged.paged_attention(
                    q, kc, vc, plan, 0.2, window, softcap, num_splits=splits
                )
                torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_write_of_edge_rows_matches_torch(self, dtype):
        """The Triton write's float16 scales and codes for every edge case of
        tests/worker/test_kv_int8_scales.py (zero, underflow, subnormal, saturated, float16 ties,
        codes at .5), bit for bit as the torch write, heads of one token in one program."""
        from tests.worker.test_kv_int8_scales import _edge_rows

        rows = _edge_rows(32).to(dtype)
        m = len(rows) // 4  # tokens of 2 KV heads, K and V
        key, value = rows[: 2 * m].view(m, 2, 32), rows[2 * m : 4 * m].view(m, 2, 32)
        kc = torch.zeros(m, 4, 2, 34, dtype=torch.int8)
        vc, kc_ref, vc_ref = kc.clone(), kc.clone(), kc.clone()
        slots = torch.arange(m) * 4 + 1
        torch_paged.write_kv_cache(key, value, kc_ref, vc_ref, slots)
        triton_paged.write_kv_cache(key, value, kc, vc, slots)
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.mark.slow  # a child pytest runs the Triton int8 kernels under the interpreter: ~55 s
def test_triton_int8_kernels():
    """Runs :class:`TestTritonInt8UnderInterpreter` in a child pytest with
    ``TRITON_INTERPRET=1``."""
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", f"{__file__}::TestTritonInt8UnderInterpreter", "-q"]
    cmd += ["-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "4 passed" in summary and "skipped" not in summary, summary


test_triton_int8_kernels.__test__ = not INTERPRETED


def test_probe_bound_allows_int8_rounding_not_wrong_attention():
    """The load-time probe (paged_check.logits_agree) allows an int8 cache's rounding (up
    to the 0.081 Gemma 3 270M measured, docs in paged_check) but still refuses the gaps of a
    wrong attention (0.3 and more) in every dtype."""
    from asyncllm.worker.paged_check import logits_agree

    want = torch.linspace(-10, 10, 100)[None]
    for dtype in (torch.float32, torch.bfloat16):
        for gap, int8_kv, agree in ((0.08, True, True), (0.08, False, False),
                                    (0.3, True, False), (0.02, True, True)):  # fmt: skip
            got = want.clone()
            got[0, 0] += gap * 10
            assert logits_agree(got, want, dtype, kv_int8=int8_kv)[0] == agree, (gap, dtype)
