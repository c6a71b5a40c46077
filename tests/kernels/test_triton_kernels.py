"""The Triton kernels against the torch reference, on CPU under Triton's interpreter.

Triton's interpreter needs ``TRITON_INTERPRET=1`` before ``triton`` is first imported (its own
``tl.zeros``, ``tl.max``... are ``@triton.jit`` functions), and transformers imports Triton
through ``torch._dynamo`` while the shared conftest loads. So under a plain ``pytest`` this
module runs its :class:`TestUnderInterpreter` cases in one child pytest with the variable set
(``test_kernels_under_triton_interpreter``); with ``TRITON_INTERPRET=1 pytest
tests/kernels/test_triton_kernels.py`` they run in place, one by one.

Tolerances (output vs the float32 torch reference on the same rounded inputs): float32
``2e-5`` abs + rel; float16 ``2e-3`` abs + rel (output rounding and float16 probabilities in
the P @ V product); bfloat16 ``1.6e-2`` abs + rel (8-bit mantissa, same sources).

Sliding window and soft-cap are checked against :func:`_dense_reference`, float32 attention
with explicit masks written here (transformers' eager attention of Gemma 2: ``tanh`` soft-cap,
then causal and ``kv > q - window`` masks, then softmax).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

import asyncllm
from asyncllm import EngineConfig, SamplingParams
from asyncllm.attention import cpu_paged, torch_paged, triton_paged
from asyncllm.worker.model_runner import select_attention_backend
from tests.conftest import chunked_engine

INTERPRETED = not isinstance(tl.zeros, JITFunction)
"""Triton was imported with ``TRITON_INTERPRET=1``: the kernels run here on CPU tensors."""


def _triton_kernel_modules() -> list[str]:
    """The loaded modules of asyncllm.kernels that hold Triton kernels (``@triton.jit``);
    not the C++ kernels' loader and op declarations (native, ops, variants) nor their
    extension modules, which other test files load at their collection."""
    found = []
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None) or ""
        ours = name.startswith("asyncllm.kernels.") and path.endswith(".py")
        if ours and "@triton.jit" in pathlib.Path(path).read_text():
            found.append(name)
    return sorted(found)


# At collection nothing has run an engine yet: a kernel module loaded now came with an import.
KERNELS_LOADED_AT_IMPORT = _triton_kernel_modules()

TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def _step(seqs, block_size, num_kv_heads, gqa, head_dim, dtype, seed):
    """Random caches and queries for ``seqs`` = [(cached tokens, new tokens)].

    Returns a dict: the reference caches (zero-filled like the engine's), the kernel caches
    (NaN everywhere but the cached context, so any read past a sequence's context shows), the
    new K/V rows, their slot mapping, block tables (shuffled blocks) and the query.
    """
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    ref_k, ref_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, new_k, new_v, slots = [], [], [], []
    for cached, n in seqs:
        length = cached + n
        table = [perm.pop() for _ in range(-(-length // block_size))]
        tables.append(table)
        ks = torch.randn(length, num_kv_heads, head_dim, generator=g).to(dtype)
        vs = torch.randn(length, num_kv_heads, head_dim, generator=g).to(dtype)
        for p in range(cached):
            ref_k[table[p // block_size], p % block_size] = ks[p]
            ref_v[table[p // block_size], p % block_size] = vs[p]
        new_k.append(ks[cached:])
        new_v.append(vs[cached:])
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(cached, length)
        ]
    cached_slots = ref_k.flatten(0, 1).abs().sum((1, 2)) > 0
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    k_cache.flatten(0, 1)[cached_slots] = ref_k.flatten(0, 1)[cached_slots]
    v_cache.flatten(0, 1)[cached_slots] = ref_v.flatten(0, 1)[cached_slots]
    num_tokens = sum(n for _, n in seqs)
    query = torch.randn(num_tokens, num_kv_heads * gqa, head_dim, generator=g).to(dtype)
    return dict(
        ref_k=ref_k,
        ref_v=ref_v,
        k_cache=k_cache,
        v_cache=v_cache,
        key=torch.cat(new_k),
        value=torch.cat(new_v),
        slots=torch.tensor(slots),
        tables=tables,
        query=query,
        query_lens=[n for _, n in seqs],
        seq_lens=[c + n for c, n in seqs],
    )


def _reference(s, block_size, scale):
    torch_paged.write_kv_cache(s["key"], s["value"], s["ref_k"], s["ref_v"], s["slots"])
    plan = torch_paged.PagedAttentionPlan.build(
        s["query_lens"], s["seq_lens"], s["tables"], block_size
    )
    return torch_paged.paged_attention(
        s["query"].float(), s["ref_k"].float(), s["ref_v"].float(), plan, scale
    )


def _dense_reference(s, block_size, scale, window=0, softcap=0.0):
    """Float32 attention of each sequence over its whole context, masks spelled out."""
    ref_k, ref_v = s["ref_k"].flatten(0, 1), s["ref_v"].flatten(0, 1)
    ref_k[s["slots"]], ref_v[s["slots"]] = s["key"], s["value"]
    outs, row = [], 0
    for q_len, seq_len, table in zip(s["query_lens"], s["seq_lens"], s["tables"], strict=True):
        pos = torch.arange(seq_len)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        q = s["query"][row : row + q_len].float()  # [q_len, H, D]
        gqa = q.shape[1] // ref_k.shape[1]
        k = ref_k[slots].float().repeat_interleave(gqa, dim=1)  # [seq_len, H, D]
        v = ref_v[slots].float().repeat_interleave(gqa, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        visible = pos[None, :] <= q_pos
        if window:
            visible &= pos[None, :] > q_pos - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        row += q_len
    return torch.cat(outs)


def _poison_outside_window(s, block_size, window):
    """NaN into the kernel caches at the positions no query of their sequence may see, so a
    read of one (even with zero weight: 0 * NaN) shows."""
    if not window:
        return
    for q_len, seq_len, table in zip(s["query_lens"], s["seq_lens"], s["tables"], strict=True):
        for p in range(max(0, seq_len - q_len - window + 1)):
            for cache in (s["k_cache"], s["v_cache"]):
                cache[table[p // block_size], p % block_size] = float("nan")


def _run_windowed(seqs, block_size, gqa, head_dim, dtype, window, softcap, num_splits=None):
    s = _step(seqs, block_size, 2, gqa, head_dim, dtype, seed=window + 7 * block_size)
    scale = head_dim**-0.5
    expected = _dense_reference(s, block_size, scale, window, softcap)
    triton_paged.write_kv_cache(s["key"], s["value"], s["k_cache"], s["v_cache"], s["slots"])
    _poison_outside_window(s, block_size, window)
    plan = triton_paged.TritonPagedPlan.build(
        s["query_lens"], s["seq_lens"], s["tables"], block_size
    )
    out = _poisoned_out(s["query"])
    triton_paged.paged_attention(
        s["query"], s["k_cache"], s["v_cache"], plan, scale, window, softcap,
        num_splits=num_splits, out=out,
    )  # fmt: skip
    _check(out, expected, dtype)


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    # The kernels' tanh, reached through the package: its module loads on first use only.
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(y_ptr + i, asyncllm.kernels.paged_common.tanh_f32(x), mask=i < n)


def _poisoned_out(query):
    return torch.full(query.shape, float("nan"), dtype=query.dtype)


def _check(out, expected, dtype):
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements not written"
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


# (cached, new) per sequence. Decodes: contexts crossing several blocks of 4 and 16, a
# one-token context. Prefill: a fresh 37-token prompt (two 32-query tiles, the second starting
# inside the first's window), a 6-token chunk after 9 cached tokens. Mixed: both at once.
WINDOW_STEPS = {
    "decode": [(40, 1), (0, 1), (13, 1), (5, 1)],
    "prefill": [(0, 37), (9, 6)],
    "mixed": [(21, 1), (0, 37), (2, 1), (9, 6), (0, 1)],
}
# (step, window, softcap, block_size, dtype, gqa): windows 1, 3, 6 and one longer than every
# context (the kernels then run without one), the soft-cap alone and with windows.
WINDOW_CASES = [
    ("decode", 1, 0.0, 4, torch.float32, 2),
    ("decode", 6, 0.0, 16, torch.float32, 3),
    ("decode", 3, 5.0, 4, torch.float32, 3),
    ("decode", 0, 5.0, 16, torch.float32, 2),
    ("prefill", 1, 0.0, 16, torch.float32, 2),
    ("prefill", 3, 0.0, 4, torch.float32, 2),
    ("prefill", 6, 5.0, 16, torch.float32, 3),
    ("prefill", 0, 5.0, 4, torch.float32, 3),
    ("mixed", 1, 5.0, 4, torch.float32, 3),
    ("mixed", 3, 0.0, 16, torch.float32, 2),
    ("mixed", 6, 0.0, 4, torch.float32, 2),
    ("mixed", 1000, 0.0, 16, torch.float32, 3),
    ("mixed", 1000, 5.0, 4, torch.float32, 2),
    ("mixed", 3, 5.0, 16, torch.bfloat16, 2),
    ("mixed", 6, 5.0, 4, torch.float16, 3),
]

# Each row covers a dtype, a GQA ratio (1, 3, 8), a block size (16, 32) and a head_dim (64,
# 128); every pair of values appears across the rows.
CASES = [
    (torch.float32, 1, 16, 64),
    (torch.float32, 8, 32, 64),
    (torch.float32, 3, 16, 128),
    (torch.float16, 3, 32, 128),
    (torch.float16, 1, 16, 64),
    (torch.float16, 8, 16, 128),
    (torch.bfloat16, 8, 16, 128),
    (torch.bfloat16, 3, 32, 64),
    (torch.bfloat16, 1, 32, 128),
]


class TestUnderInterpreter:
    """The kernels themselves; collected only when Triton runs interpreted (see above)."""

    __test__ = INTERPRETED

    @pytest.mark.parametrize(("dtype", "gqa", "block_size", "head_dim"), CASES)
    def test_mixed_prefill_and_decode_step(self, dtype, gqa, block_size, head_dim):
        """One step through write + plan + attention: decodes and prefill chunks together."""
        # (cached, new): a decode over many blocks; a one-token context; a fresh prefill of
        # two query tiles with a partial last block; a chunk over an unaligned prefix; a
        # decode in a partial block; a two-token chunk over a long prefix.
        seqs = [(5 * block_size + 3, 1), (0, 1), (0, 37), (block_size + 5, 9), (7, 1), (70, 2)]
        s = _step(seqs, block_size, 2, gqa, head_dim, dtype, seed=gqa * block_size)
        scale = head_dim**-0.5
        expected = _reference(s, block_size, scale)

        triton_paged.write_kv_cache(s["key"], s["value"], s["k_cache"], s["v_cache"], s["slots"])
        flat_k, flat_v = s["k_cache"].flatten(0, 1), s["v_cache"].flatten(0, 1)
        written = s["ref_k"].flatten(0, 1).abs().sum((1, 2)) > 0
        assert torch.equal(flat_k[written], s["ref_k"].flatten(0, 1)[written])
        assert torch.equal(flat_v[written], s["ref_v"].flatten(0, 1)[written])
        assert flat_k[~written].isnan().all() and flat_v[~written].isnan().all()

        plan = triton_paged.TritonPagedPlan.build(
            s["query_lens"], s["seq_lens"], s["tables"], block_size
        )
        out = _poisoned_out(s["query"])
        triton_paged.paged_attention(s["query"], s["k_cache"], s["v_cache"], plan, scale, out=out)
        _check(out, expected, dtype)

    @pytest.mark.parametrize("num_splits", [1, 2, 5])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_decode_split_k(self, dtype, num_splits):
        """Flash-decoding splits, including splits wholly past the end of short contexts."""
        block_size, head_dim = 16, 64
        seqs = [(299, 1), (0, 1), (40, 1), (128, 1)]
        s = _step(seqs, block_size, 2, 3, head_dim, dtype, seed=num_splits)
        scale = head_dim**-0.5
        expected = _reference(s, block_size, scale)
        triton_paged.write_kv_cache(s["key"], s["value"], s["k_cache"], s["v_cache"], s["slots"])
        plan = triton_paged.TritonPagedPlan.build(
            s["query_lens"], s["seq_lens"], s["tables"], block_size
        )
        out = _poisoned_out(s["query"])
        triton_paged.paged_attention(
            s["query"], s["k_cache"], s["v_cache"], plan, scale, num_splits=num_splits, out=out
        )
        _check(out, expected, dtype)

    @pytest.mark.parametrize(
        ("step", "window", "softcap", "block_size", "dtype", "gqa"), WINDOW_CASES
    )
    def test_window_and_softcap(self, step, window, softcap, block_size, dtype, gqa):
        """Sliding window and soft-cap against the dense reference; the cache positions outside
        every query's window hold NaN, so the kernels must not read them."""
        _run_windowed(WINDOW_STEPS[step], block_size, gqa, 16, dtype, window, softcap)

    @pytest.mark.parametrize("num_splits", [1, 3])
    def test_window_decode_split_k(self, num_splits):
        """Split-K over the window only: splits start at the window's first position; the
        shorter contexts leave splits empty."""
        seqs = [(149, 1), (39, 1), (4, 1), (69, 1)]
        _run_windowed(seqs, 16, 2, 16, torch.float32, 70, 5.0, num_splits=num_splits)

    def test_tanh_f32_accuracy(self):
        """The kernels' tanh against torch's in float64: 1e-6 relative from 1e-8 to 30 (both
        branches and the switch between them), exact +-1 beyond, also at infinity."""
        import asyncllm.kernels.paged_common  # noqa: F401  (what _tanh_kernel calls)

        mag = torch.cat([torch.logspace(-8, 1.5, 20000), torch.linspace(0.24, 0.26, 2001)])
        x = torch.cat(
            [mag, -mag, torch.tensor([0.0, 40.0, -40.0, float("inf"), -float("inf")])]
        ).float()
        y = torch.empty_like(x)
        _tanh_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), BLOCK=4096)
        ref = torch.tanh(x.double())
        rel = (y.double() - ref).abs() / ref.abs().clamp_min(1e-30)
        assert rel.max() < 1e-6, (rel.max().item(), x[rel.argmax()].item())
        assert y[-4:].tolist() == [1.0, -1.0, 1.0, -1.0] and y[-5] == 0.0

    def test_window_softcap_rejected(self):
        s = _step([(3, 1)], 16, 2, 1, 16, torch.float32, seed=0)
        plan = triton_paged.TritonPagedPlan.build(s["query_lens"], s["seq_lens"], s["tables"], 16)
        args = (s["query"], s["k_cache"], s["v_cache"], plan, 0.25)
        with pytest.raises(ValueError, match="window"):
            triton_paged.paged_attention(*args, -1)
        for softcap in (-1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match="softcap"):
                triton_paged.paged_attention(*args, 0, softcap)

    def test_strided_rows_and_odd_head_dim(self):
        """Transposed views, as transformers passes them, a strided output buffer, and a
        head_dim that is not a power of two (masked lanes)."""
        block_size, head_dim, dtype = 16, 80, torch.float16
        s = _step([(20, 1), (3, 12)], block_size, 2, 2, head_dim, dtype, seed=7)
        scale = head_dim**-0.5
        expected = _reference(s, block_size, scale)

        def strided(x):
            return x.transpose(0, 1).contiguous().transpose(0, 1)

        triton_paged.write_kv_cache(
            strided(s["key"]), strided(s["value"]), s["k_cache"], s["v_cache"], s["slots"]
        )
        out = strided(_poisoned_out(s["query"]))
        plan = triton_paged.TritonPagedPlan.build(
            s["query_lens"], s["seq_lens"], s["tables"], block_size
        )
        query = strided(s["query"])
        triton_paged.paged_attention(query, s["k_cache"], s["v_cache"], plan, scale, out=out)
        _check(out, expected, dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    def test_kv_cache_write_skips_negative_slots(self, dtype):
        k_cache = torch.zeros(3, 32, 2, 64, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        key = torch.randn(4, 2, 64).to(dtype)
        value = torch.randn(4, 2, 64).to(dtype)
        slots = torch.tensor([70, -1, 0, 31])
        triton_paged.write_kv_cache(key, value, k_cache, v_cache, slots)
        flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
        keep = slots >= 0
        assert torch.equal(flat_k[slots[keep]], key[keep])
        assert torch.equal(flat_v[slots[keep]], value[keep])
        assert flat_k.count_nonzero() == key[keep].count_nonzero()  # nothing else written

    async def test_engine_greedy_matches_torch_backend(self, tiny_llama_dir, make_engine):
        """The tiny model end to end, chunked prefill beside decodes: triton vs torch."""
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 23, 1)]
        results = {}
        for backend in ("torch", "triton"):
            engine = chunked_engine(make_engine, tiny_llama_dir, backend)
            assert engine.core.runner.attention_backend.name == backend
            async with engine:
                outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
                assert engine.stats()["num_steps"] > params.max_tokens  # 23 tokens were chunked
            results[backend] = [o.token_ids for o in outs]
        assert results["triton"] == results["torch"]

    async def test_hybrid_engine_greedy_matches_torch_backend(self, tiny_qwen2_dir, make_engine):
        """The tiny Qwen2 (a full layer, a window of 8: two layer groups, each with its own
        block tables, the sliding one freeing blocks behind the window mid-prefill) end to
        end in blocks of 4 and chunks of 16: triton vs torch."""
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        g = torch.Generator().manual_seed(6)
        prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (3, 37)]
        results = {}
        for backend in ("torch", "triton"):
            engine = make_engine(
                tiny_qwen2_dir, block_size=4, max_num_batched_tokens=16, kv_cache_bytes=2**20,
                attention_backend=backend,
            )  # fmt: skip
            async with engine:
                outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
                layout = engine.stats()["kv_layout"]
            assert layout.startswith("2 groups of 1 layer (1 full, 1 window 8)"), layout
            results[backend] = [o.token_ids for o in outs]
        assert results["triton"] == results["torch"]


def test_kernels_under_triton_interpreter():
    """Runs :class:`TestUnderInterpreter` in a child pytest with ``TRITON_INTERPRET=1``."""
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", f"{__file__}::TestUnderInterpreter", "-q"]
    cmd += ["-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-12000:] + proc.stderr[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary


test_kernels_under_triton_interpreter.__test__ = not INTERPRETED


def test_plan_rejects_bad_layout():
    with pytest.raises(ValueError, match="q_len"):
        triton_paged.TritonPagedPlan.build([3], [2], [[0]], 16)
    with pytest.raises(ValueError, match="blocks"):
        triton_paged.TritonPagedPlan.build([1], [40], [[0, 1]], 16)


def test_backend_selection(monkeypatch):
    cpu = torch.device("cpu")
    # On CPU "auto" is the C++ decode kernel where it builds (asyncllm.attention.cpu_paged).
    assert select_attention_backend("auto", cpu).name == (
        "cpu" if cpu_paged.available() else "torch"
    )
    assert select_attention_backend("auto", torch.device("cuda")).name == "triton"
    assert select_attention_backend("torch", torch.device("cuda")).name == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_attention_backend("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if INTERPRETED:
        assert select_attention_backend("triton", cpu).name == "triton"
    else:  # set after Triton was imported: the interpreter is not on
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            select_attention_backend("triton", cpu)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


def test_cpu_backend_is_asked_for_by_name(monkeypatch):
    """ "cpu" (the C++ kernels, which "auto" picks on CPU) is refused on another device and
    where the kernels are not installed, naming why; "torch" keeps the plain path."""
    cpu = torch.device("cpu")
    assert select_attention_backend("torch", cpu).name == "torch"
    with pytest.raises(ValueError, match="runs on the CPU"):
        select_attention_backend("cpu", torch.device("cuda"))
    if cpu_paged.available():
        assert select_attention_backend("cpu", cpu) is cpu_paged.CPU_BACKEND
    monkeypatch.setattr(cpu_paged, "available", lambda: False)
    monkeypatch.setattr(cpu_paged, "failure", lambda: "no variant built")
    with pytest.raises(ValueError, match=r"not installed \(no variant built\)"):
        select_attention_backend("cpu", cpu)
    assert select_attention_backend("auto", cpu).name == "torch"


def test_import_does_not_load_the_kernels():
    """The kernel modules (their ``@triton.jit``) load on first use, never with the package."""
    assert KERNELS_LOADED_AT_IMPORT == []
