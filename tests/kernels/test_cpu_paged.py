"""The CPU fast paths: the C++ paged decode and chunk (prefill) attention and the
oneDNN-packed linears, each against the plain torch computation it replaces."""

from __future__ import annotations

import asyncio
import dataclasses
import gc

import pytest
import torch
from torch import nn

from asyncllm import SamplingParams
from asyncllm.attention import backend_registry, cpu_paged, torch_paged
from asyncllm.kernels import native
from asyncllm.layers import cpu_linear
from tests.conftest import chunked_engine

pytestmark = pytest.mark.skipif(
    not cpu_paged.available(), reason=f"CPU attention kernel unavailable: {cpu_paged.failure()}"
)


def _random_step(query_lens, seq_lens, bs, hkv, group, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-s // bs) for s in seq_lens)
    n_blocks = need + 7
    perm = torch.randperm(n_blocks, generator=g).tolist()
    tables, k = [], 0
    for s in seq_lens:
        n = -(-s // bs)
        tables.append(perm[k : k + n])
        k += n
    kc = torch.randn(n_blocks, bs, hkv, dim, generator=g)
    vc = torch.randn(n_blocks, bs, hkv, dim, generator=g)
    heads = hkv * group
    # transformers hands the rows over as a transposed view of [1, H, T, D].
    q = torch.randn(heads, sum(query_lens), dim, generator=g).transpose(0, 1)
    return q, kc, vc, tables


@pytest.mark.parametrize(
    ("hkv", "group", "dim", "bs"),
    # G=1, G > 4 (two register groups), head sizes with and without the AVX-512 code, blocks
    # of two tiles (32) and of half a tile (8).
    [(3, 3, 64, 16), (2, 4, 16, 16), (4, 1, 80, 32), (1, 8, 128, 16), (2, 5, 64, 32),
     (2, 3, 128, 8), (1, 1, 64, 16), (2, 2, 24, 16)],
)  # fmt: skip
def test_decode_kernel_matches_torch(hkv, group, dim, bs):
    seq_lens = [1, 15, 16, 17, 100, 3 * bs, 250]
    query_lens = [1] * len(seq_lens)
    q, kc, vc, tables = _random_step(query_lens, seq_lens, bs, hkv, group, dim)
    ref = torch_paged.paged_attention(
        q, kc, vc, torch_paged.PagedAttentionPlan.build(query_lens, seq_lens, tables, bs), 0.1
    )
    plan = cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, bs)
    out = cpu_paged.paged_attention_cpu(q, kc, vc, plan, 0.1)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding", [0, 3])
def test_write_and_decode_matches_write_then_attend(dtype, padding):
    """The decode-only fast path (K/V write and attention in one kernel call) gives the torch
    path's caches and output; padded rows (a compiled step's) come out as copies of the last
    real row and write nothing, and a negative slot is skipped."""
    seq_lens = [1, 17, 40, 33]
    bs, hkv, group, dim = 16, 3, 3, 64
    query_lens = [1] * len(seq_lens)
    q, kc, vc, tables = _random_step(query_lens, seq_lens, bs, hkv, group, dim, seed=2)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    g = torch.Generator().manual_seed(3)
    b, rows = len(seq_lens), len(seq_lens) + padding
    k = torch.randn(hkv, rows, dim, generator=g).to(dtype).transpose(0, 1)  # strided, as given
    v = torch.randn(rows, hkv, dim, generator=g).to(dtype)
    qp = torch.cat([q, torch.randn(padding, hkv * group, dim, generator=g).to(dtype)])
    slots = torch.tensor([tables[i][(s - 1) // bs] * bs + (s - 1) % bs
                          for i, s in enumerate(seq_lens)])  # fmt: skip
    slots[2] = -1  # not stored: the reference's write skips it too
    kc_ref, vc_ref = kc.clone(), vc.clone()
    torch_paged.write_kv_cache(k[:b], v[:b], kc_ref, vc_ref, slots)
    plan = torch_paged.PagedAttentionPlan.build(query_lens, seq_lens, tables, bs)
    ref = torch_paged.paged_attention(q.float(), kc_ref.float(), vc_ref.float(), plan, 0.1)
    cplan = cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, bs)
    out = cpu_paged.write_and_decode(qp, k, v, kc, vc, slots, cplan, 0.1)
    assert out is not None and out.shape == qp.shape and out.dtype == dtype
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:b].float(), ref, rtol=tol, atol=tol)
    assert torch.equal(out[b:], out[b - 1 : b].expand(padding, -1, -1))


def _avx2_variant():  # type: ignore[no-untyped-def]
    try:
        return native.import_variant("attention", "avx2")
    except ImportError as e:
        pytest.skip(f"the avx2 variant is not installed: {e}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_variant_matches_torch(dtype):
    """The avx2 variant (no AVX-512 intrinsics: the C++ a CPU without AVX-512 runs)
    against the float32 reference."""
    mod = _avx2_variant()
    # Decodes over scattered blocks, and over shared prefixes (cascade attention).
    plain = [1, 15, 16, 17, 100, 250]
    shared, groups = SHARED_STEPS[0]
    for hkv, group, dim, bs in [(3, 3, 64, 16), (1, 5, 128, 32), (2, 1, 80, 8)]:
        steps = [
            (plain, _random_step([1] * len(plain), plain, bs, hkv, group, dim, seed=4)),
            (shared, _shared_prefix_step(shared, groups, bs, hkv, group, dim, seed=4)),
        ]
        for seq_lens, (q, kc, vc, tables) in steps:
            query_lens = [1] * len(seq_lens)
            q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
            tplan = torch_paged.PagedAttentionPlan.build(query_lens, seq_lens, tables, bs)
            ref = torch_paged.paged_attention(q.float(), kc.float(), vc.float(), tplan, 0.1)
            d = cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, bs).base.decodes
            assert d is not None
            out = torch.empty(q.shape, dtype=dtype)
            mod.paged_decode(q, kc, vc, d.block_tables, torch.tensor(seq_lens), 0.1, 0, 0.0, out)
            tol = 2e-5 if dtype == torch.float32 else 2**-8
            torch.testing.assert_close(out.float(), ref, rtol=tol, atol=max(tol, 1e-5))
    # The chunk kernel's portable tiles: prefills over cached prefixes and from scratch,
    # across block and query-tile boundaries, decodes mixed in.
    query_lens, seq_lens = [20, 1, 37, 3], [20, 70, 37 + 21, 3 + 16]
    q, kc, vc, tables = _random_step(query_lens, seq_lens, 8, 2, 3, 80, seed=5)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    tplan = torch_paged.PagedAttentionPlan.build(query_lens, seq_lens, tables, 8)
    ref = torch_paged.paged_attention(q.float(), kc.float(), vc.float(), tplan, 0.1)
    c = cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, 8).chunks
    assert c is not None
    out = torch.empty(q.shape, dtype=dtype)
    mod.paged_prefill(q, kc, vc, c.tables, c.seq_lens, c.query_start, c.query_lens, 0.1, 0, 0.0,
                      out, None, None, None)  # fmt: skip
    tol = 2e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=max(tol, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_variant_matches_the_loaded_one(dtype):
    """The avx2 variant's decode and chunk kernels give the outputs of the variant loaded
    here (AVX-512), up to summation order and one output rounding."""
    mod, loaded = _avx2_variant(), cpu_paged.load()
    if loaded is mod:
        pytest.skip("only the avx2 variant runs here (against torch: the test above)")
    tol = 4e-5 if dtype == torch.float32 else 2**-7
    plain = [1, 15, 16, 17, 100, 250]
    for hkv, group, dim, bs in [(3, 3, 64, 16), (1, 5, 128, 32), (2, 1, 80, 8)]:
        q, kc, vc, tables = _random_step([1] * len(plain), plain, bs, hkv, group, dim, seed=6)
        q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
        d = cpu_paged.CpuPagedPlan.build([1] * len(plain), plain, tables, bs).base.decodes
        assert d is not None
        outs = [torch.empty(q.shape, dtype=dtype) for _ in range(2)]
        for m, out in zip((mod, loaded), outs, strict=True):
            m.paged_decode(q, kc, vc, d.block_tables, torch.tensor(plain), 0.1, 0, 0.0, out)
        torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=tol, atol=tol)
    query_lens, seq_lens = [20, 1, 37, 3], [20, 70, 37 + 21, 3 + 16]
    q, kc, vc, tables = _random_step(query_lens, seq_lens, 8, 2, 3, 80, seed=7)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    c = cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, 8).chunks
    assert c is not None
    outs = [torch.empty(q.shape, dtype=dtype) for _ in range(2)]
    for m, out in zip((mod, loaded), outs, strict=True):
        m.paged_prefill(q, kc, vc, c.tables, c.seq_lens, c.query_start, c.query_lens, 0.1, 0,
                        0.0, out, None, None, None)  # fmt: skip
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_op_runs_an_armed_decode_step_in_cpp(dtype):
    """Inside step_metadata of a decode-only step, ``asyncllm::paged_attention`` (what a
    compiled graph calls) runs the C++ kernel directly: the same caches and output as the
    Python implementation, padded rows copies of the last real one (a padded token repeats
    it: the linears compute it once); after the step nothing stays armed, and a mixed
    step or no step at all goes to the Python implementation."""
    seq_lens, bs, hkv, group, dim, layers = [1, 17, 40], 16, 3, 3, 64, 2
    query_lens = [1] * len(seq_lens)
    q, kc, vc, tables = _random_step(query_lens, seq_lens, bs, hkv, group, dim, seed=5)
    q = torch.cat([q, torch.randn(2, hkv * group, dim)]).to(dtype)  # 2 rows of padding
    kv = [torch.randn(len(q), hkv, dim).to(dtype) for _ in range(2)]
    slots = torch.tensor([tables[i][(s - 1) // bs] * bs + (s - 1) % bs
                          for i, s in enumerate(seq_lens)])  # fmt: skip

    def step(kind: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        kcs = [kc.to(dtype).clone() for _ in range(layers)]
        vcs = [vc.to(dtype).clone() for _ in range(layers)]
        plan = cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, bs)
        meta = backend_registry.AttentionMetadata(kcs, vcs, slots, plan, cpu_paged.CPU_BACKEND)
        if kind == "python":  # the same backend without the native op
            backend = dataclasses.replace(cpu_paged.CPU_BACKEND, arm_step=None)
            meta = dataclasses.replace(meta, backend=backend)
        with backend_registry.step_metadata(meta, len(seq_lens)):
            assert cpu_paged.load().decode_armed() == (kind == "native")
            out = torch.ops.asyncllm.paged_attention(q, *kv, 1, 0.1, 0, 0.0)
        return out, kcs + vcs

    in_cpp, caches = step("native")
    python, want = step("python")
    assert not cpu_paged.load().decode_armed()
    assert in_cpp.dtype == dtype and torch.equal(in_cpp, python)
    n = len(seq_lens)
    assert torch.equal(in_cpp[n:], in_cpp[n - 1 : n].expand(2, -1, -1))
    assert all(torch.equal(a, b) for a, b in zip(caches, want, strict=True))
    # no step armed: the Python implementation's dry run (zeros)
    assert not torch.ops.asyncllm.paged_attention(q, *kv, 0, 0.1, 0, 0.0).any()
    # a step with a prefill chunk is not armed
    plan = cpu_paged.CpuPagedPlan.build([1, 4], [9, 4], tables[:2], bs)
    meta = backend_registry.AttentionMetadata([kc], [vc], torch.arange(5), plan,
                                              cpu_paged.CPU_BACKEND)  # fmt: skip
    with backend_registry.step_metadata(meta, 5):
        assert not cpu_paged.load().decode_armed()


def test_an_armed_decode_step_reads_each_layers_group():
    """Layer groups (a hybrid KV cache): three layers, two groups (layers 0 and 2 in group
    0's slots 0 and 1, layer 1 in group 1's slot 0, sharing its tensors with layer 0), each
    group with its own block tables and slots. The armed C++ op gives each layer its group's
    and computes what the Python implementation does; windows on the sliding group."""
    seq_lens, bs, hkv, group, dim = [3, 17, 40], 4, 2, 2, 16
    query_lens = [1] * len(seq_lens)
    q, *_ = _random_step(query_lens, seq_lens, bs, hkv, group, dim, seed=8)
    need = [-(-s // bs) for s in seq_lens]
    gen = torch.Generator().manual_seed(9)
    n_blocks = 2 * sum(need) + 3
    kc, vc = torch.randn(2, n_blocks, bs, hkv, dim, generator=gen)
    perm = torch.randperm(n_blocks, generator=gen).tolist()
    tables = [[], []]  # per group, per sequence: disjoint blocks
    at = 0
    for grp in range(2):
        for n in need:
            tables[grp].append(perm[at : at + n])
            at += n
    kv = [torch.randn(len(q), hkv, dim) for _ in range(2)]
    slots = [
        [t[(s - 1) // bs] * bs + (s - 1) % bs for t, s in zip(tables[grp], seq_lens, strict=True)]
        for grp in range(2)
    ]
    windows = {0: 0, 1: 6, 2: 0}

    def step(kind: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        k_slots = [kc.clone(), kc.clone()]
        v_slots = [vc.clone(), vc.clone()]
        backend = cpu_paged.CPU_BACKEND
        if kind == "python":
            backend = dataclasses.replace(backend, arm_step=None)
        meta = backend_registry.grouped_metadata(
            [k_slots[0], k_slots[0], k_slots[1]], [v_slots[0], v_slots[0], v_slots[1]],
            (0, 1, 0), backend, query_lens, seq_lens,
            [[tables[0][i], tables[1][i]] for i in range(len(seq_lens))], slots, bs,
            torch.device("cpu"),
        )  # fmt: skip
        with backend_registry.step_metadata(meta, len(seq_lens)):
            assert cpu_paged.load().decode_armed() == (kind == "native")
            outs = [torch.ops.asyncllm.paged_attention(q, *kv, layer, 0.1, windows[layer], 0.0)
                    for layer in range(3)]  # fmt: skip
        return outs, k_slots + v_slots

    native_outs, native_caches = step("native")
    python_outs, python_caches = step("python")
    assert all(torch.equal(a, b) for a, b in zip(native_outs, python_outs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(native_caches, python_caches, strict=True))
    # layers 0 and 1 share slot 0's tensors through different tables: different outputs
    assert not torch.equal(native_outs[0], native_outs[1])


def test_write_and_decode_leaves_mixed_steps_to_write_then_attend():
    # (The chunk kernel attends them after the K/V write: test_chunk_kernel_matches_torch.)
    q, kc, vc, tables = _random_step([1, 4], [9, 4], 16, 3, 3, 64)
    plan = cpu_paged.CpuPagedPlan.build([1, 4], [9, 4], tables, 16)
    k = torch.randn(5, 3, 64)
    assert cpu_paged.write_and_decode(q, k, k, kc, vc, torch.arange(5), plan, 0.1) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_attends_to_the_same_bits_in_any_batch_on_any_threads(dtype):
    """A long sequence is attended in parts of 256 positions (the work items when the batch
    has few sequences, merged in order; one item with all its parts when it has many): its
    output is bit for bit the same alone or beside 7 others, on 1 or 2 threads, with its
    window or without."""
    seq_lens = [1750, 300, 40, 256, 257, 900, 5, 600]
    q, kc, vc, tables = _random_step([1] * 8, seq_lens, 16, 3, 3, 64, seed=4)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    for window in (0, 700):
        alone = cpu_paged.CpuPagedPlan.build([1], seq_lens[:1], tables[:1], 16)
        batch = cpu_paged.CpuPagedPlan.build([1] * 8, seq_lens, tables, 16)
        outs = []
        for threads in (1, 2):
            old = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                outs.append(cpu_paged.paged_attention_cpu(q[:1], kc, vc, alone, 0.1, window))
                outs.append(cpu_paged.paged_attention_cpu(q, kc, vc, batch, 0.1, window)[:1])
            finally:
                torch.set_num_threads(old)
        assert all(torch.equal(o, outs[0]) for o in outs[1:])
        ref = torch_paged.paged_attention(
            q[:1].float(), kc.float(), vc.float(),
            torch_paged.PagedAttentionPlan.build([1], seq_lens[:1], tables[:1], 16), 0.1,
            window=window,
        )  # fmt: skip
        tol = 2e-5 if dtype == torch.float32 else 2**-8
        torch.testing.assert_close(outs[0].float(), ref, rtol=tol, atol=max(tol, 1e-5))


def test_decode_kernel_splits_long_contexts_when_sequences_are_fewer_than_threads():
    # Parts of a sequence as work items (the W3 and W7 shapes with 2 threads).
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for seq_lens in ([250], [7, 33], [1750], [600, 20]):
            query_lens = [1] * len(seq_lens)
            q, kc, vc, tables = _random_step(query_lens, seq_lens, 16, 3, 3, 64, seed=1)
            plan = torch_paged.PagedAttentionPlan.build(query_lens, seq_lens, tables, 16)
            ref = torch_paged.paged_attention(q, kc, vc, plan, 0.1)
            cplan = cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, 16)
            out = cpu_paged.paged_attention_cpu(q, kc, vc, cplan, 0.1)
            torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    finally:
        torch.set_num_threads(threads)


def _attend_on_threads(q, kc, vc, plan, threads):
    """The CPU backend's attention of a planned step (scale 0.1) on ``threads`` threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return cpu_paged.paged_attention_cpu(q, kc, vc, plan, 0.1)
    finally:
        torch.set_num_threads(old)


def _shared_prefix_step(seq_lens, groups, bs, hkv, group, dim, seed=0):
    """Like :func:`_random_step`, but the block tables of each ``(members, blocks)`` of
    ``groups`` start with the same ``blocks`` blocks, as prefix caching hands them out."""
    q, kc, vc, _ = _random_step([1] * len(seq_lens), seq_lens, bs, hkv, group, dim, seed)
    free = torch.randperm(kc.shape[0], generator=torch.Generator().manual_seed(seed)).tolist()
    tables: list[list[int]] = [[] for _ in seq_lens]
    for members, blocks in groups:
        shared = [free.pop() for _ in range(blocks)]
        for b in members:
            tables[b] = list(shared)
    for b, s in enumerate(seq_lens):
        tables[b] += [free.pop() for _ in range(-(-s // bs) - len(tables[b]))]
    return q, kc, vc, tables


#: (seq_lens, groups) of decode steps whose sequences share prefix blocks: many sharers of
#: two blocks (one whose context is exactly those blocks, one with a partly filled third
#: block); a pair sharing three blocks of which the third is partly filled (only two count);
#: a pair sharing a first block only; a sequence too short for a full block beside a
#: sharer of its block; sequences that share nothing; a group of more query rows than one
#: work item takes (split into parts).
SHARED_STEPS = [
    ([100, 100, 37, 32, 250, 40, 40, 20, 33, 16, 5, 70],
     [([0, 1, 2, 3, 4], 2), ([5, 6], 3), ([7, 8], 1), ([9, 10], 1)]),
    ([600, 601, 602, 17], [([0, 1, 2], 33)]),
    ([40 + i % 7 for i in range(40)], [(list(range(40)), 2)]),
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("hkv", "group", "dim", "bs", "threads"),
    [(3, 3, 64, 16, 1), (3, 3, 64, 16, 2), (1, 8, 128, 16, 2), (2, 2, 24, 16, 1),
     (4, 1, 80, 8, 2), (3, 3, 64, 8, 2)],
)  # fmt: skip
@pytest.mark.parametrize("step", range(len(SHARED_STEPS)))
def test_decode_kernel_with_shared_prefixes_matches_torch(dtype, hkv, group, dim, bs, threads,
                                                          step):  # fmt: skip
    """Cascade attention (a shared prefix's blocks read once for all its sequences, the rest
    per sequence) gives the attention of each sequence alone; in bfloat16 with D = 64 or 128
    the shared part runs as two GEMMs where brgemm runs natively (shared_item_gemm: panels of
    64 positions and a tail, blocks of 16 and of 8 positions)."""
    seq_lens, groups = SHARED_STEPS[step]
    if bs == 8:  # the same positions shared: twice the blocks
        groups = [(m, 2 * n) for m, n in groups]
    q, kc, vc, tables = _shared_prefix_step(seq_lens, groups, bs, hkv, group, dim, seed=step)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    query_lens = [1] * len(seq_lens)
    tplan = torch_paged.PagedAttentionPlan.build(query_lens, seq_lens, tables, bs)
    ref = torch_paged.paged_attention(q.float(), kc.float(), vc.float(), tplan, 0.1)
    plan = cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, bs)
    out = _attend_on_threads(q, kc, vc, plan, threads)
    tol = 2e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=max(tol, 1e-5))


#: (query_lens, seq_lens) of steps with prefill chunks: fresh prompts of one token, of a
#: block, across blocks and across the kernel's 16-token query tiles; chunks after a
#: prefix-cache hit (a whole number of blocks cached) and after a chunk boundary inside a
#: block; decodes mixed in; a fresh prompt long enough that its later query tiles see whole
#: blocks of its own (attended by a GEMM where brgemm runs).
CHUNK_STEPS = [
    ([1, 37, 1, 9, 1], [70, 37, 1, 9 + 40, 16]),
    ([130, 3], [130, 64 + 3]),
    ([16, 17, 2, 33], [16, 17, 2, 33]),
    ([12, 12, 28, 5], [12 + 528, 12 + 32, 28 + 512, 5 + 11]),
    ([50, 1, 1], [50 + 7, 300, 2]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("hkv", "group", "dim", "bs", "threads"),
    # The default model's shape on 1 and 2 threads, G=1, G=8 (two register groups of four
    # rows), head sizes without the AVX-512 code (24) and with it (80, 128), blocks of two
    # tiles (32) and of half a tile (8).
    [(3, 3, 64, 16, 1), (3, 3, 64, 16, 2), (4, 1, 80, 32, 1), (1, 8, 128, 8, 2),
     (2, 2, 24, 16, 1)],
)  # fmt: skip
def test_chunk_kernel_matches_torch(monkeypatch, dtype, hkv, group, dim, bs, threads):
    """Every sequence of a step with prefills through the chunk kernel (no chunk is routed
    to the torch path here): causal within each chunk, full over its cached context, GQA,
    scattered block tables; the float32 attention of the same numbers, rounded once."""
    monkeypatch.setattr(cpu_paged, "TORCH_MIN_PAIRS", 1 << 62)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seed, (query_lens, seq_lens) in enumerate(CHUNK_STEPS):
            q, kc, vc, tables = _random_step(query_lens, seq_lens, bs, hkv, group, dim, seed)
            q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
            tplan = torch_paged.PagedAttentionPlan.build(query_lens, seq_lens, tables, bs)
            ref = torch_paged.paged_attention(q.float(), kc.float(), vc.float(), tplan, 0.1)
            plan = cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, bs)
            assert not plan.torch_part.prefills and plan.short_chunks is plan.chunks
            assert plan.chunks is not None and plan.chunks.query_lens.tolist() == query_lens
            out = cpu_paged.CPU_BACKEND.attend(q, kc, vc, plan, 0.1)
            assert out.dtype == dtype and out.is_contiguous()
            tol = 2e-5 if dtype == torch.float32 else 2**-8
            torch.testing.assert_close(out.float(), ref, rtol=tol, atol=max(tol, 1e-5))
    finally:
        torch.set_num_threads(old)


def test_long_chunks_go_to_torch_beside_the_kernel(monkeypatch):
    """A bfloat16 step with long chunks (``q_len * seq_len >= TORCH_MIN_PAIRS``) next to
    short ones and decodes: the long ones through the torch path, the rest through the chunk
    kernel, into one output; a step of long chunks only never calls the kernel. In float32
    every chunk goes through the kernel."""
    monkeypatch.setattr(cpu_paged, "TORCH_MIN_PAIRS", 28_000)  # as on CPUs with AMX
    query_lens = [300, 7, 1, 48]
    seq_lens = [300 + 32, 7, 50, 48 + 600]
    assert 48 * 648 >= cpu_paged.TORCH_MIN_PAIRS > 7 * 7
    q, kc, vc, tables = _random_step(query_lens, seq_lens, 16, 3, 3, 64, seed=6)
    q16, kc16, vc16 = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    tplan = torch_paged.PagedAttentionPlan.build(query_lens, seq_lens, tables, 16)
    ref = torch_paged.paged_attention(q16.float(), kc16.float(), vc16.float(), tplan, 0.1)
    ref16 = torch_paged.paged_attention(q16, kc16, vc16, tplan, 0.1)
    plan = cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, 16)
    assert [p.start for p in plan.torch_part.prefills] == [0, 308]
    assert plan.short_chunks is not None and plan.short_chunks.query_start.tolist() == [300, 307]
    calls: list[int] = []
    real = cpu_paged.chunk_attention

    def spy(query, key_cache, value_cache, tables, *args, **kwargs):
        calls.append(tables.shape[0])
        return real(query, key_cache, value_cache, tables, *args, **kwargs)

    monkeypatch.setattr(cpu_paged, "chunk_attention", spy)
    out = cpu_paged.paged_attention_cpu(q16, kc16, vc16, plan, 0.1)
    long_rows = torch.cat([torch.arange(0, 300), torch.arange(308, 356)])
    assert torch.equal(out[long_rows], ref16[long_rows])  # the torch path's own rows
    torch.testing.assert_close(out.float(), ref, rtol=2**-8, atol=2e-2)
    only = cpu_paged.CpuPagedPlan.build([300], [332], tables[:1], 16)
    assert only.short_chunks is None
    assert torch.equal(cpu_paged.paged_attention_cpu(q16[:300], kc16, vc16, only, 0.1),
                       ref16[:300])  # fmt: skip
    assert calls == [2]
    out32 = cpu_paged.paged_attention_cpu(q, kc, vc, plan, 0.1)  # all 4 in the kernel
    assert calls == [2, 4]
    ref32 = torch_paged.paged_attention(q, kc, vc, tplan, 0.1)
    torch.testing.assert_close(out32, ref32, rtol=2e-5, atol=2e-5)


#: (query_lens, seq_lens, groups) of steps with chunks after a shared prefix: W2's second
#: step (chunks after 512 shared tokens, a decode among them); members with more cached
#: context of their own beside a sequence outside the group; shared blocks past a member's
#: cached context (only those before both chunks count).
SHARED_CHUNK_STEPS = [
    ([28] * 5 + [1], [540] * 5 + [545], [(list(range(6)), 32)]),
    ([10, 10, 10, 7], [300, 310, 290, 40], [([0, 1, 2], 10)]),
    ([20, 20], [170, 175], [([0, 1], 10)]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("hkv", "group", "dim", "bs", "threads"),
    [(3, 3, 64, 16, 1), (3, 3, 64, 16, 2), (1, 8, 128, 16, 2), (2, 2, 24, 16, 1)],
)  # fmt: skip
@pytest.mark.parametrize("step", range(len(SHARED_CHUNK_STEPS)))
def test_chunk_kernel_with_shared_prefixes_matches_torch(
    monkeypatch, dtype, hkv, group, dim, bs, threads, step
):
    """Cascade attention for chunks (a shared prefix attended for all the group's rows by
    torch's flash attention, the kernel going on from that state) gives each chunk's own
    attention; bfloat16 steps take it as routed, float32 ones when handed the groups."""
    monkeypatch.setattr(cpu_paged, "MIN_SHARED_PAIRS", 1)
    query_lens, seq_lens, groups = SHARED_CHUNK_STEPS[step]
    q, kc, vc, tables = _shared_prefix_step(seq_lens, groups, bs, hkv, group, dim, seed=step)
    q = torch.randn(hkv * group, sum(query_lens), dim).transpose(0, 1)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    tplan = torch_paged.PagedAttentionPlan.build(query_lens, seq_lens, tables, bs)
    ref = torch_paged.paged_attention(q.float(), kc.float(), vc.float(), tplan, 0.1)
    plan = cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, bs)
    chunks = plan.chunks
    assert chunks is not None and chunks.shared is not None
    members = groups[0][0]
    ctx_blocks = min((seq_lens[b] - query_lens[b]) // bs for b in members)
    assert chunks.shared.skip.tolist() == [
        min(groups[0][1], ctx_blocks) if b in members else 0 for b in range(len(seq_lens))
    ]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if dtype == torch.bfloat16:
            out = cpu_paged.paged_attention_cpu(q, kc, vc, plan, 0.1)
        else:
            args = (chunks.tables, chunks.seq_lens, chunks.query_start, chunks.query_lens)
            out = cpu_paged.chunk_attention(q, kc, vc, *args, 0.1, shared=chunks.shared)
    finally:
        torch.set_num_threads(old)
    # bfloat16: the prefix's part is rounded to bfloat16 once more (flash attention's output)
    tol = 2e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=max(tol, 1e-5))


def test_shared_prefix_state_must_precede_the_chunks():
    q, kc, vc, tables = _random_step([4, 4], [40, 40], 16, 2, 2, 16, seed=3)
    args = (
        torch.tensor(tables),
        torch.tensor([40, 40]),
        torch.tensor([0, 4]),
        torch.tensor([4, 4]),
    )
    init = (torch.zeros(8, 4, 16), torch.zeros(8, 4))
    mod = cpu_paged.load()
    out = torch.empty(8, 4, 16)
    with pytest.raises(RuntimeError, match="before sequence"):  # 3 blocks: 48 > 36 cached
        mod.paged_prefill(q, kc, vc, *args, 0.25, 0, 0.0, out, torch.tensor([3, 0]), *init)
    with pytest.raises(RuntimeError, match="init_out"):
        mod.paged_prefill(
            q, kc, vc, *args, 0.25, 0, 0.0, out, torch.tensor([1, 0]), init[0].bfloat16(), init[1]
        )


def test_chunk_kernel_refuses_bad_layouts():
    q, kc, vc, tables = _random_step([4], [20], 16, 2, 2, 16, seed=2)
    args = (torch.tensor(tables), torch.tensor([20]), torch.tensor([0]), torch.tensor([4]))
    with pytest.raises(ValueError, match="must share"):
        cpu_paged.chunk_attention(q.bfloat16(), kc, vc, *args, 0.25)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_paged.chunk_attention(q, kc, vc, args[0], args[1], args[2].int(), args[3], 0.25)
    with pytest.raises(RuntimeError, match="shapes"):
        cpu_paged.chunk_attention(q, kc, vc, *args, 0.25, out=torch.empty(5, 4, 16))


async def test_engine_greedy_matches_torch_backend(tiny_llama_dir, make_engine):
    """The tiny model end to end through the "cpu" backend's kernels (chunked prefill beside
    decodes, a prompt after a prefix-cache hit): the torch backend's greedy tokens."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 49152, (40,), generator=g).tolist()
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 23, 1)]
    results = {}
    for backend in ("torch", "auto"):  # "auto" is "cpu" where the kernel builds
        engine = chunked_engine(make_engine, tiny_llama_dir, backend)
        assert engine.core.runner.attention_backend.name == backend.replace("auto", "cpu")
        kernels = dict(kv.split("=") for kv in str(engine.stats()["cpu_kernels"]).split())
        assert (kernels["attention"] == "off") == (backend == "torch")
        async with engine:
            outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            first = await engine.generate([*shared, 7, 8], params)
            hit = await engine.generate([*shared, 9, 10, 11], params)  # 32 tokens cached
            stats = engine.stats()
            assert stats["num_steps"] > params.max_tokens  # 23 tokens were chunked
            assert stats["prefix_cache_hits"] > 0
        results[backend] = [o.token_ids for o in [*outs, first, hit]]
    assert results["auto"] == results["torch"]


@pytest.mark.parametrize(
    ("hkv", "group", "dim", "bs", "threads"),
    [(3, 3, 64, 16, 1), (3, 3, 64, 16, 2), (1, 8, 128, 16, 1), (4, 1, 80, 32, 1)],
)
def test_bfloat16_decode_kernel_matches_float32_reference(hkv, group, dim, bs, threads):
    # bfloat16 caches and queries: the kernel computes in float32 and rounds the output once,
    # so it is the float32 attention of the same (bfloat16) numbers to bfloat16's precision.
    seq_lens = [1, 15, 16, 17, 100, 3 * bs, 250]
    query_lens = [1] * len(seq_lens)
    q, kc, vc, tables = _random_step(query_lens, seq_lens, bs, hkv, group, dim, seed=3)
    q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    tplan = torch_paged.PagedAttentionPlan.build(query_lens, seq_lens, tables, bs)
    ref = torch_paged.paged_attention(q.float(), kc.float(), vc.float(), tplan, 0.1)
    plan = cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, bs)
    out = _attend_on_threads(q, kc, vc, plan, threads)
    assert out.dtype == torch.bfloat16
    # One rounding to bfloat16 (8 significant bits): relative error <= 2**-9.
    torch.testing.assert_close(out.float(), ref, rtol=2**-8, atol=1e-5)
    # And it agrees with the torch path run in bfloat16 (which rounds along the way too).
    ref16 = torch_paged.paged_attention(q, kc, vc, tplan, 0.1)
    torch.testing.assert_close(out, ref16, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("query_lens", "seq_lens"), [([1, 1], [20, 5]), ([1, 6, 3], [20, 6, 40])])
def test_float16_falls_back_to_torch(query_lens, seq_lens):
    # Decode-only and with prefill chunks: the kernels read float32 and bfloat16 only.
    q, kc, vc, tables = _random_step(query_lens, seq_lens, 16, 2, 2, 16, seed=2)
    q, kc, vc = q.half(), kc.half(), vc.half()
    ref = torch_paged.paged_attention(
        q, kc, vc, torch_paged.PagedAttentionPlan.build(query_lens, seq_lens, tables, 16), 0.25
    )
    plan = cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, 16)
    assert torch.equal(cpu_paged.paged_attention_cpu(q, kc, vc, plan, 0.25), ref)


def test_decode_kernel_refuses_mixed_dtypes():
    q, kc, vc, tables = _random_step([1], [20], 16, 2, 2, 16, seed=2)
    lens = torch.tensor([20])
    table = torch.tensor(tables)
    with pytest.raises(ValueError, match="must share"):
        cpu_paged.decode_attention(q.bfloat16(), kc, vc, table, lens, 0.25)
    with pytest.raises(ValueError, match="must share"):
        cpu_paged.decode_attention(q.half(), kc.half(), vc.half(), table, lens, 0.25)


def test_many_row_gemms_run_wherever_the_cpu_has_native_bfloat16():
    """The int4 and Q8_0 many-row paths (oneDNN's bfloat16 brgemm) are on exactly where the
    CPU has AVX-512 BF16 or AMX-BF16 (torch's could_pack says AMX only; brgemm runs on
    ``vdpbf16ps`` too: 1.5-2.7x the dequantize-then-mm path on a Zen 5 EPYC)."""
    from asyncllm.kernels import int4_dequant
    from asyncllm.layers import q8_linear

    if int4_dequant.kernel() is None or q8_linear.kernel() is None:
        pytest.skip(f"kernels unavailable: {native.failure('int4') or native.failure('q8')}")
    bf16 = bool(native.cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert int4_dequant.fused_available() == q8_linear.mm_available() == bf16


def test_packed_linear_matches_linear():
    torch.manual_seed(0)
    lin = nn.Linear(48, 80, bias=True)
    packed = cpu_linear.PackedLinear(lin)
    for shape in [(1, 48), (3, 48), (1, 70, 48)]:
        x = torch.randn(*shape)
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.weight, lin.weight.detach())  # rebuilt from the packing


#: oneDNN reorders bfloat16 weights only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT (not on an
#: AVX2 CPU, where pack_linears leaves bfloat16 models to nn.Linear).
ONEDNN_BF16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.mark.skipif(not ONEDNN_BF16, reason="oneDNN's bfloat16 reorder needs AVX-512 BW/VL/DQ")
@pytest.mark.parametrize("bias", [True, False])
def test_bfloat16_packed_linear_matches_float32_reference(bias):
    # bfloat16 weights and rows, packed for oneDNN: float32 accumulation, one rounding of the
    # output, so the float32 product of the same bfloat16 numbers to bfloat16's precision.
    torch.manual_seed(0)
    lin = nn.Linear(96, 80, bias=bias).bfloat16()
    packed = cpu_linear.PackedLinear(lin)
    assert packed.packed.dtype == torch.bfloat16
    b = None if lin.bias is None else lin.bias.float()
    # Exact bucket, a padded bucket (17 -> 18 rows), chunks of CHUNK_ROWS plus a padded rest.
    for shape in [(1, 96), (3, 96), (17, 96), (1, cpu_linear.CHUNK_ROWS + 21, 96)]:
        x = torch.randn(*shape).bfloat16()
        with torch.inference_mode():
            out = packed(x)
        ref = nn.functional.linear(x.float(), lin.weight.float(), b)
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        torch.testing.assert_close(out.float(), ref, rtol=2**-8, atol=1e-3)
    torch.testing.assert_close(packed.weight, lin.weight.detach(), rtol=0, atol=0)
    # Another dtype than the weight's takes the plain path (no oneDNN dtype mix-up).
    x32 = torch.randn(2, 96)
    with pytest.raises(RuntimeError):
        packed(x32)  # F.linear refuses float32 rows against bfloat16 weights, as nn.Linear


def test_pack_linears_packs_bfloat16_models():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).bfloat16()
    x = torch.randn(4, 16).bfloat16()
    with torch.inference_mode():
        ref = model(x)
        assert cpu_linear.pack_linears(model) == (2 if ONEDNN_BF16 else 0)
        out = model(x)
    assert all(type(m) is not nn.Linear for m in model) or not ONEDNN_BF16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    half = nn.Sequential(nn.Linear(16, 8)).half()
    assert cpu_linear.pack_linears(half) == 0  # float16: left to nn.Linear


def test_bucket_rows_ladder():
    rows = range(1, cpu_linear.CHUNK_ROWS + 1)
    buckets = [cpu_linear.bucket_rows(m) for m in rows]
    assert all(b >= m for m, b in zip(rows, buckets, strict=True))
    assert buckets == sorted(buckets)
    assert len(set(buckets)) == 48 and max(buckets) == cpu_linear.CHUNK_ROWS
    # Exact up to 16 rows (small decode batches), then padding < 12.5%.
    assert buckets[:16] == list(rows[:16])
    assert all(b < 1.125 * m for m, b in zip(rows[16:], buckets[16:], strict=True))


def test_packed_linear_runs_only_bucketed_row_counts(monkeypatch):
    """oneDNN caches a JIT-built primitive per input shape (~1 MiB each, 2 x 1024 entries):
    every row count from 1 to a token budget must map onto the few buckets, else a server's
    RSS grows for minutes (the soak's +440 MiB over 16 bursts)."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 40, bias=True)
    packed = cpu_linear.PackedLinear(lin)
    seen: set[int] = set()
    real = cpu_linear._onednn_linear

    def spy(rows, w, b):
        seen.add(rows.shape[0])
        return real(rows, w, b)

    monkeypatch.setattr(cpu_linear, "_onednn_linear", spy)
    with torch.inference_mode():
        for m in [*range(1, 70), 255, 256, 257, 300, 513, 600]:
            x = torch.randn(m, 32)
            out = packed(x)
            assert out.shape == (m, 40)
            torch.testing.assert_close(out, lin(x), rtol=1e-5, atol=1e-5)
        assert packed(torch.randn(2, 3, 32)).shape == (2, 3, 40)
        assert packed(torch.randn(0, 32)).shape == (0, 40)
    ladder = {cpu_linear.bucket_rows(m) for m in range(cpu_linear.CHUNK_ROWS + 1)}
    assert seen <= ladder


def test_pack_linears_keeps_tied_weights(tiny_llama_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    model.lm_head.weight = model.model.embed_tokens.weight  # tie them
    ids = torch.tensor([[1, 5, 9, 300, 42]])
    with torch.inference_mode():
        ref = model(ids).logits
    n_linear = sum(1 for m in model.modules() if type(m) is nn.Linear)
    assert cpu_linear.pack_linears(model) == n_linear
    assert cpu_linear.pack_linears(model) == 0  # idempotent
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-4, atol=1e-4)
    monkeypatch.setenv(cpu_linear.ENV_DISABLE, "0")
    fresh = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    assert cpu_linear.pack_linears(fresh) == 0


@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "default_model_dir"])
def test_packing_releases_the_weight_file(model_dir, request):
    """transformers maps the safetensors file and the weights point into it. After packing,
    the embedding, the norms and a tied head still did, and kept the whole mapping (every
    weight's pages, read by the packing) resident: a float32 engine held its weights twice.
    Packing copies them out (a tie kept: the default model's head) and the file is unmapped."""
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(model_dir)

    def mapped() -> int:
        with open("/proc/self/maps") as f:
            return sum(str(path) in line for line in f)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    assert mapped() > 0
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (model_dir == "default_model_dir")
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.inference_mode():
        ref = model(ids).logits
        assert cpu_linear.pack_linears(model) > 0
        out = model(ids).logits
    gc.collect()
    assert mapped() == 0
    assert all(p.untyped_storage().resizable() for p in model.parameters())
    if tied:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=5e-3)  # oneDNN's summation order
    assert cpu_linear.own_weights(model) == 0  # nothing left to copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("hkv", "group", "dim", "bs"),
    # the AVX-512 tiles (64, 128, 256) and the portable ones (24); blocks of 4 to 32 tokens
    [(2, 3, 64, 16), (1, 4, 256, 32), (2, 2, 24, 8), (2, 1, 128, 4)],
)
@pytest.mark.parametrize(("window", "softcap"), [(1, 0.0), (7, 0.0), (40, 0.0), (0, 3.0), (9, 2.0)])
def test_window_and_softcap_match_torch(dtype, hkv, group, dim, bs, window, softcap):
    """Sliding windows (shorter than a tile, across blocks, past most contexts) and
    soft-capped scores in the decode kernel, the chunk kernel (prefills from scratch and
    over cached context, decodes mixed in) and the fused write-and-decode, against the torch
    path in float32 (itself against dense attention:
    tests/kernels/test_torch_paged_attention.py)."""
    # absolute, of values ~3; bfloat16: plus the output's rounding (relative)
    tol, rtol = (6e-5, 0.0) if dtype == torch.float32 else (3 * 2**-8, 2**-7)
    steps = [([1] * 6, [1, 15, 17, 40, 100, 250]), ([20, 1, 37, 3], [20, 70, 58, 19])]
    for seed, (query_lens, seq_lens) in enumerate(steps):
        q, kc, vc, tables = _random_step(query_lens, seq_lens, bs, hkv, group, dim, seed=seed)
        q, kc, vc = (t.to(dtype) * 3 for t in (q, kc, vc))  # scores the cap bends
        tplan = torch_paged.PagedAttentionPlan.build(query_lens, seq_lens, tables, bs)
        ref = torch_paged.paged_attention(
            q.float(), kc.float(), vc.float(), tplan, 0.1, window, softcap
        )
        plan = cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, bs)
        out = cpu_paged.paged_attention_cpu(q, kc, vc, plan, 0.1, window, softcap)
        torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=tol)
        if plan.chunks is None:  # decode-only: the fused write-and-decode too
            k = kc[[t[(n - 1) // bs] for t, n in zip(tables, seq_lens, strict=True)],
                   [(n - 1) % bs for n in seq_lens]]  # fmt: skip
            slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs
                                  for t, n in zip(tables, seq_lens, strict=True)])  # fmt: skip
            v = vc.view(-1, hkv, dim)[slots]
            fused = cpu_paged.write_and_decode(
                q, k, v, kc.clone(), vc.clone(), slots, plan, 0.1, window, softcap
            )
            assert fused is not None
            torch.testing.assert_close(fused.float(), ref, rtol=rtol, atol=tol)


def test_chunk_kernel_refuses_shared_state_with_a_window():
    q, kc, vc, tables = _random_step([4, 4], [36, 36], 16, 2, 2, 16, seed=3)
    c = cpu_paged.CpuPagedPlan.build([4, 4], [36, 36], tables, 16).chunks
    assert c is not None
    init = (torch.zeros(8, 4, 16), torch.zeros(8, 4))
    with pytest.raises(RuntimeError, match="sliding window"):
        cpu_paged.load().paged_prefill(
            q, kc, vc, c.tables, c.seq_lens, c.query_start, c.query_lens, 0.25, 4, 0.0,
            torch.empty(8, 4, 16), torch.tensor([1, 1]), *init,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (300, 0.0), (600, 2.0), (0, 3.0)])
def test_long_contexts_match_torch_alone_or_batched(dtype, window, softcap):
    """Decode over long contexts (W7's 1,489 tokens; windows inside them; soft-caps) against
    the torch path; and each sequence's output has the same bits alone or in a batch, on 1
    or 2 threads (the work split follows the batch, the arithmetic of a row does not)."""
    tol, rtol = (6e-5, 0.0) if dtype == torch.float32 else (3 * 2**-8, 2**-7)
    seq_lens = [1489, 700, 257, 256, 30, 512]
    q, kc, vc, tables = _random_step([1] * 6, seq_lens, 16, 3, 3, 64, seed=11)
    q, kc, vc = (t.to(dtype) * 3 for t in (q, kc, vc))
    tplan = torch_paged.PagedAttentionPlan.build([1] * 6, seq_lens, tables, 16)
    ref = torch_paged.paged_attention(
        q.float(), kc.float(), vc.float(), tplan, 0.1, window, softcap
    )
    plan = cpu_paged.CpuPagedPlan.build([1] * 6, seq_lens, tables, 16)
    batched = {}
    for threads in (1, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            batched[threads] = cpu_paged.paged_attention_cpu(q, kc, vc, plan, 0.1, window, softcap)
            alone = [
                cpu_paged.paged_attention_cpu(
                    q[b : b + 1],
                    kc,
                    vc,
                    cpu_paged.CpuPagedPlan.build([1], [n], [tables[b]], 16),
                    0.1,
                    window,
                    softcap,
                )
                for b, n in enumerate(seq_lens)
            ]
        finally:
            torch.set_num_threads(old)
        torch.testing.assert_close(batched[threads].float(), ref, rtol=rtol, atol=tol)
        assert torch.equal(torch.cat(alone), batched[threads])
    assert torch.equal(batched[1], batched[2])
