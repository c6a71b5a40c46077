"""Weight-only quantization: kernels against a dequantize-then-matmul reference, GGUF blocks
repacked without loss, bad settings refused at load, engines on the tiny model, and the real
model's perplexity at each precision."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import pathlib
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from asyncllm import EngineConfig, SamplingParams
from asyncllm.kernels import int4_dequant, native
from asyncllm.layers import q8_linear
from asyncllm.layers import quant_linear as ql
from asyncllm.models import quantization as qz
from asyncllm.models.gguf_quant import GGUFTensor, content_key, match_rows, read_tensors, unpack
from asyncllm.models.loader import LoadedModel, load_model
from asyncllm.preflight import default_gguf

TEXT = pathlib.Path(__file__).parents[1] / "data" / "public_domain.txt"

#: What "gguf" makes of the default model: its Q4_1 linears as int4 and, where the Q8_0
#: kernel has its AVX-512 path, its Q8_0 head (tied to the embedding) kept as codes.
DEFAULT_GGUF_PRECISION = "gguf (Q4_1 int4 x210%s)" % (", Q8_0 head x1" if q8_linear.fast() else "")


def _identity_dequant(layer: torch.nn.Module, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's own dequantized weight [out, in]: the layer applied to the identity."""
    with torch.inference_mode():
        return layer(torch.eye(k, dtype=dtype)).T.float()


# --- GGUF blocks -----------------------------------------------------------------------------


def test_q4_1_blocks_repack_without_loss():
    """The default model's Q4_1 weights through Int4Linear (float32 scales): the kernel's own
    dequantization equals gguf-py's bit for bit."""
    tensors = [t for t in read_tensors(default_gguf()) if t.kind == "Q4_1"]
    assert tensors
    for t in tensors[:3]:
        ref = t.dequantize()
        blocks = unpack(t.kind, t.raw, t.shape)
        assert torch.equal(blocks.dequantize(), ref), t.name
        layer = ql.Int4Linear(blocks.q, blocks.scale, blocks.offset, 32, None, torch.float32)
        assert torch.equal(_identity_dequant(layer, t.shape[1], torch.float32), ref), t.name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("cols", [64, 33])
def test_content_key_and_match_rows_find_a_row_permutation(dtype, cols):
    """A weight matches its GGUF tensor with rows reordered (llama.cpp's q/k), in the
    model's dtype (bfloat16 included: no numpy dtype) and at an odd byte count per row;
    a changed row, another dtype or shape does not match."""
    torch.manual_seed(cols)
    w = (torch.randn(96, cols) * 50).to(dtype)
    perm = torch.randperm(96)
    assert content_key(w[perm]) == content_key(w)
    idx = match_rows(w, w[perm])
    assert idx is not None and torch.equal(w[perm][idx], w)
    assert torch.equal(match_rows(w, w.clone()), torch.arange(96))
    other = w.clone()
    other[5, 0] = other[5, 0] + 1  # the first word of a row is always in its signature
    assert content_key(other) != content_key(w)
    assert match_rows(other, w[perm]) is None
    # The key reads some words of each row: a change elsewhere may keep it, never the match.
    off = w.clone()
    off[5, -1] = off[5, -1] + 1
    assert match_rows(off, w[perm]) is None
    assert match_rows(w, w[:95]) is None
    wider = torch.float64 if dtype != torch.float64 else torch.float32
    assert match_rows(w.to(wider), w) is None


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_gguf_block_layouts_match_gguf(kind):
    """Each supported block layout (quantized by gguf-py itself) unpacks to exactly gguf-py's
    dequantization, with a row permutation applied (as for llama.cpp's q/k reordering)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    raw = quantize(w, qtype)
    ref = torch.from_numpy(dequantize(raw, qtype).reshape(48, 128).astype(np.float32))
    blocks = unpack(kind, raw, (48, 128))
    assert torch.equal(blocks.dequantize(), ref)
    perm = torch.randperm(48)
    assert torch.equal(blocks.take_rows(perm).dequantize(), ref[perm])
    if kind not in ("Q8_0", "Q5_0"):
        layer = ql.Int4Linear(blocks.q, blocks.scale, blocks.offset, 32, None, torch.float32)
        assert torch.equal(_identity_dequant(layer, 128, torch.float32), ref)
    emb = ql.QuantEmbedding(blocks.q, blocks.scale, blocks.offset, torch.float32)
    ids = torch.tensor([[3, 0, 47]])
    assert torch.equal(emb(ids), ref[ids])


def _as_gguf(lm, kinds) -> list:
    """The GGUF tensors of ``lm``'s decoder linears quantized by gguf-py (types ``kinds`` in
    turn; the head and embedding float32), and ``lm`` given exactly the weights the file
    dequantizes to."""
    tensors = []
    with torch.no_grad():
        for i, (name, lin) in enumerate(qz._linears(lm)):
            w = lin.weight.detach().numpy()
            head = name == qz._head_name(lm)
            kind = GGMLQuantizationType.F32 if head else kinds[i % len(kinds)]
            raw = quantize(w, kind)
            lin.weight.copy_(torch.from_numpy(dequantize(raw, kind).reshape(w.shape)))
            tensors.append(GGUFTensor(name, kind.name, w.shape, raw, kind))
        emb = lm.get_input_embeddings().weight.detach()
        raw = emb.numpy().view(np.uint8).reshape(-1)
        tensors.append(
            GGUFTensor("token_embd", "F32", tuple(emb.shape), raw, GGMLQuantizationType.F32)
        )
    return tensors


def test_a_gguf_type_without_a_kernel_runs_dense(tiny_llama_dir):
    """quantization='gguf' with linear weights of a type without a kernel (Q5_1, as a
    Q3_K_M file's Q3_K layers): they stay the dense weights the conversion dequantized, and
    the precision names them; a type without a layout is refused by ``unpack``."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tensors = _as_gguf(lm, [GGMLQuantizationType.Q5_1])
    out, precision = qz._from_gguf(lm, tensors, torch.float32)
    assert out == {} and precision == f"gguf (Q5_1 dense x{len(tensors) - 2})"
    with pytest.raises(ValueError, match="Q3_K has no quantized kernel"):
        unpack("Q3_K", tensors[0].raw, tensors[0].shape)


@pytest.mark.skipif(not q8_linear.fast(), reason="Q8_0/Q5_0 codes need the AVX-512 kernel")
def test_q5_0_and_q8_0_linears_run_as_codes(tiny_llama_dir):
    """quantization='gguf' with Q5_0 and Q8_0 decoder linears (quantized by gguf-py; the
    model holds what the file dequantizes to): each becomes a ``Q8Linear`` of the file's
    codes (``logits=False``: float32 out in a float32 model; Q5_0's as 5-bit codes), the
    logits equal the dense model's within float32 summation order (one row and many), the
    modules round-trip the cache state, and with ``Q8_0_LINEAR = "dense"`` they stay dense as
    before."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tensors = _as_gguf(lm, [GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0])
    ids = torch.tensor([[1, 5, 300, 7, 12, 42, 9, 11, 3, 2, 8, 77]])
    with torch.inference_mode():
        want = lm(ids).logits
        want_one = lm(ids[:, :1]).logits
    n5 = sum(t.kind == "Q5_0" for t in tensors)
    n8 = sum(t.kind == "Q8_0" for t in tensors)
    old = qz.Q8_0_LINEAR
    try:
        qz.Q8_0_LINEAR = "dense"
        out, precision = qz._from_gguf(lm, tensors, torch.float32)
        assert out == {} and precision == f"gguf (Q5_0 dense x{n5}, Q8_0 dense x{n8})"
    finally:
        qz.Q8_0_LINEAR = old
    modules, precision = qz._from_gguf(lm, tensors, torch.float32)
    assert precision == f"gguf (Q5_0 int5 g32 x{n5}, Q8_0 int8 g32 x{n8})"
    assert all(isinstance(m, q8_linear.Q8Linear) and not m.logits for m in modules.values())
    assert {m.bits for m in modules.values()} == {5, 8}
    modules = {n: ql.module_from_state(ql.module_state(m)) for n, m in modules.items()}
    for name, module in modules.items():
        ql.replace_module(lm, name, module)
    with torch.inference_mode():
        got, got_one = lm(ids).logits, lm(ids[:, :1]).logits
    for g, w in ((got, want), (got_one, want_one)):
        assert g.dtype == torch.float32
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item())
        assert torch.equal(g.argmax(-1), w.argmax(-1))


# --- kernels against the reference ----------------------------------------------------------


@pytest.mark.parametrize("mode", ["int8", "int4-32", "int4-64", "int4-128"])
@pytest.mark.parametrize("rows", [1, 5])
def test_quantized_linear_matches_dequantized_reference(mode, rows):
    """y = x W_q^T + b against float32 matmul with the dequantized weight (x in bfloat16, the
    kernels' compute dtype): within bfloat16's output rounding."""
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.05
    bias = torch.randn(96)
    x = torch.randn(2, rows, 256)
    if mode == "int8":
        q, s = ql.int8_codes(w)
        deq = s[:, None] * q.float()
        layer: torch.nn.Module = ql.Int8Linear(q, s, bias, ql.COMPUTE_DTYPE)
        assert (deq - w).abs().max() <= s.max() / 2 + 1e-7
    else:
        gs = int(mode.split("-")[1])
        q, s, o = ql.int4_codes(w, gs)
        deq = s.repeat_interleave(gs, 1) * q.float() + o.repeat_interleave(gs, 1)
        layer = ql.Int4Linear(q, s, o, gs, bias, ql.COMPUTE_DTYPE)
        assert (deq - w).abs().max() <= s.max() / 2 + 1e-6
    ref = x.bfloat16().float() @ deq.bfloat16().float().T + bias
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (2, rows, 96)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def _int4_layer(n: int, k: int, gs: int, dtype: torch.dtype = ql.COMPUTE_DTYPE):
    """An Int4Linear of random codes [n, k] and its weight dequantized in float32 (rounded
    through the layer's scale dtype, as the kernels see them): (q - 8) * scale + zero from
    torch's layout, q * scale + offset from the tile-major one."""
    torch.manual_seed(n + k + gs)
    q, s, o = ql.int4_codes(torch.randn(n, k) * 0.05, gs)
    layer = ql.Int4Linear(q, s, o, gs, None, dtype)
    sz = layer.scales_and_zeros.float()
    if sz.dim() == 4:  # [n / 64, k / gs, 2, 64]
        scale, offset = (sz[:, :, i].permute(0, 2, 1).reshape(n, -1) for i in (0, 1))
        assert torch.equal(scale, s) and torch.equal(offset, o)  # as given, nothing rounded
        return layer, q.float() * scale.repeat_interleave(gs, 1) + offset.repeat_interleave(gs, 1)
    scale, zero = (sz[..., i].mT.repeat_interleave(gs, 1) for i in (0, 1))  # [k / gs, n, 2]
    return layer, (q.float() - 8) * scale + zero


needs_dequant = pytest.mark.skipif(
    int4_dequant.kernel() is None,
    reason=f"int4 dequant kernel unavailable: {native.failure('int4') or 'switched off'}",
)


@needs_dequant
@pytest.mark.parametrize("n, k, gs", [(64, 64, 32), (192, 128, 64), (128, 256, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_dequant_kernel_matches_reference(n, k, gs, dtype):
    """The C++ dequantization of torch's packed layout gives W^T equal, bit for bit, to
    (q - 8) * scale + zero (float32: q * scale + offset, tile-major) computed by torch in
    float32 from the original codes (rounded once to bfloat16): this also checks the layouts
    the kernel assumes."""
    layer, ref = _int4_layer(n, k, gs, dtype)
    got = torch.empty(k, n, dtype=dtype)
    int4_dequant.kernel().int4_dequant_t(layer.packed, layer.scales_and_zeros, gs, got)
    assert torch.equal(got, ref.T.to(dtype))


@needs_dequant
def test_int4_dequant_kernel_checks_its_inputs():
    """Buffers of the wrong size or dtype: a RuntimeError naming the argument, never a read
    or write out of bounds."""
    mod = int4_dequant.kernel()
    packed = torch.zeros(64, 32, dtype=torch.uint8)
    sz = torch.zeros(2, 64, 2, dtype=torch.bfloat16)
    out = torch.empty(64, 64, dtype=torch.bfloat16)
    mod.int4_dequant_t(packed, sz, 32, out)
    with pytest.raises(RuntimeError, match="packed must be"):
        mod.int4_dequant_t(packed[:, :16], sz, 32, out)
    with pytest.raises(RuntimeError, match="sz must be"):
        mod.int4_dequant_t(packed, sz.float(), 32, out)
    with pytest.raises(RuntimeError, match="out must be"):
        mod.int4_dequant_t(packed, sz, 32, torch.empty(64, 96, dtype=torch.bfloat16))


@needs_dequant
@pytest.mark.parametrize("rows", [1, "max", "max + 1", 40])
def test_int4_linear_few_and_many_rows(rows):
    """Up to int4_max_rows() rows run torch's int4 kernel (up to INT4_GEMV_MAX_ROWS the
    few-row kernel where it is built), more the dequantize-then-GEMM path; all agree with a
    matmul on the dequantized weight within bfloat16 rounding, a second call too (it reuses
    the scratch weight)."""
    rows = {"max": ql.int4_max_rows(), "max + 1": ql.int4_max_rows() + 1}.get(rows, rows)
    layer, ref_w = _int4_layer(128, 64, 32)
    x = torch.randn(rows, 64)
    before = ql.path_calls()
    with torch.inference_mode():
        got = layer(x)
        again = layer(x * 2)
    path = "int4" if rows <= ql.int4_max_rows() else "dequant"
    if rows <= ql.INT4_GEMV_MAX_ROWS and int4_dequant.gemv_available():
        path = "gemv"
    assert ql.path_calls()[path] - before[path] == 2
    ref = x.bfloat16().float() @ ref_w.bfloat16().float().T
    assert got.dtype == torch.float32 and got.shape == (rows, 128)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(again, 2 * ref, rtol=2e-2, atol=4e-2)


@needs_dequant
@pytest.mark.parametrize("fused", [True, False])
def test_int4_row_threshold_follows_the_many_row_path(fused, monkeypatch):
    """12 rows: the fused many-row path where it runs (crossover 8), torch's int4 kernel
    where only the whole-weight form does (crossover 16)."""
    if fused and not int4_dequant.fused_available():
        pytest.skip("no bfloat16 brgemm here")
    monkeypatch.setattr(int4_dequant, "fused_available", lambda: fused)
    assert ql.int4_max_rows() == (8 if fused else 16)
    layer, _ = _int4_layer(128, 64, 32)
    before = ql.path_calls()
    with torch.inference_mode():
        layer(torch.randn(12, 64))
    path = "dequant" if fused else "int4"
    assert ql.path_calls()[path] - before[path] == 1


def _close_to_exact(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got = x w^T (bfloat16 or float32) within one rounding of the float64 product (the
    GEMM accumulates in float32; bfloat16 output rounds once: half an ulp, 2^-8 relative)."""
    ref = x.double() @ w.double().T
    tol = (2.0**-8 if got.dtype == torch.bfloat16 else 1e-6) * ref.abs() + 1e-4
    assert ((got.double() - ref).abs() <= tol).all()


def _gemm_weight(ref_w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight the many-row path multiplies by for scales of ``dtype``: dequantized to
    bfloat16 where the kernel variant has bfloat16 dot products; exact (float32) where it
    has none (avx2: a bfloat16 GEMM would be emulated, so it multiplies in float32)."""
    native_bf16 = not int4_dequant.kernel().__name__.endswith("_avx2")
    return ref_w.to(dtype) if native_bf16 else ref_w


@needs_dequant
@pytest.mark.parametrize(
    "n, k, gs, rows, m_tile",
    [
        (64, 64, 32, 17, 64),  # one column block
        (192, 576, 32, 17, 64),  # 3 blocks for 2 threads: the rows split further
        (192, 576, 32, 64, 16),  # several row tiles per block
        (128, 96, 32, 513, 64),  # K not a multiple of 64; a row tail of 1
        (576, 128, 64, 513, 100),  # a row tile that is no multiple of 16
        (320, 256, 128, 40, 64),  # 5 blocks: an odd block count
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_many_row_path_tiles(n, k, gs, rows, m_tile, dtype):
    """The many-row path block by block (``int4_mm``; bfloat16: the fused path where oneDNN's
    brgemm runs natively; float32: each block dequantized exactly into scratch, then a float32
    GEMM) equals the product with the dequantized weight within the output rounding, at any
    tiling, and matches the whole-weight path (m_tile 0: the whole W^T, then one GEMM)."""
    layer, ref_w = _int4_layer(n, k, gs, dtype)
    x = torch.randn(rows, k).to(dtype)
    mod = int4_dequant.kernel()
    got = mod.int4_mm(x, layer.packed, layer.scales_and_zeros, gs, n, m_tile)
    whole = mod.int4_mm(x, layer.packed, layer.scales_and_zeros, gs, n, 0)
    assert got.dtype == dtype and got.shape == (rows, n)
    w = _gemm_weight(ref_w, dtype)
    _close_to_exact(got, x, w)
    _close_to_exact(whole, x, w)


@needs_dequant
@pytest.mark.parametrize("n, k, gs", [(64, 64, 32), (192, 576, 32), (128, 256, 128)])
def test_int4_many_row_path_dequantizes_exactly(n, k, gs):
    """The many-row path's weight values are the reference's bit for bit (the fused path
    computes ``(q - 8) * s + z`` with one fused multiply-add, which rounds as torch's mul
    then add because the product is exact): multiplied by the identity, every output is one
    product with 1 and is rounded once more to bfloat16, which keeps it."""
    layer, ref_w = _int4_layer(n, k, gs)
    mod = int4_dequant.kernel()
    eye = torch.eye(k, dtype=torch.bfloat16)
    for m_tile in (64, 0):
        got = mod.int4_mm(eye, layer.packed, layer.scales_and_zeros, gs, n, m_tile)
        assert torch.equal(got, ref_w.T.bfloat16())


@needs_dequant
@pytest.mark.parametrize("rows", [17, 513])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_linear_many_rows_with_bias(rows, dtype):
    """The layer's many-row path (fused, block by block, for bfloat16 and float32 scales)
    adds the bias and keeps x's shape and dtype."""
    layer, ref_w = _int4_layer(192, 96, 32, dtype)
    layer.bias = torch.randn(192)
    x = torch.randn(1, rows, 96)
    before = ql.path_calls()
    with torch.inference_mode():
        got = layer(x)
    assert ql.path_calls()["dequant"] - before["dequant"] == 1
    assert got.dtype == torch.float32 and got.shape == (1, rows, 192)
    w = _gemm_weight(ref_w, dtype)
    rounded = (x.to(dtype).to(w.dtype) @ w.T).to(dtype).float()  # the kernel's precision
    torch.testing.assert_close(got - layer.bias, rounded, rtol=2**-6, atol=1e-3)


@needs_dequant
def test_int4_mm_checks_its_inputs():
    """int4_mm refuses rows of another dtype than the scales, a negative row tile, or a
    weight of another size than the rows' K."""
    mod = int4_dequant.kernel()
    layer, _ = _int4_layer(64, 64, 32)
    args = (layer.packed, layer.scales_and_zeros, 32, 64)
    with pytest.raises(RuntimeError, match="rows must be"):
        mod.int4_mm(torch.zeros(3, 64), *args, 64)
    with pytest.raises(RuntimeError, match="m_tile"):
        mod.int4_mm(torch.zeros(3, 64, dtype=torch.bfloat16), *args, -1)
    with pytest.raises(RuntimeError, match="packed must be"):
        mod.int4_mm(torch.zeros(3, 128, dtype=torch.bfloat16), *args, 64)


@pytest.mark.parametrize("case", ["out 96", "switched off"])
def test_int4_linear_falls_back_to_the_int4_kernel(case, monkeypatch):
    """out_features not a multiple of 64 (the packing's row block), or the kernel switched
    off: many rows still run torch's int4 kernel, with the same result."""
    n = 96 if case == "out 96" else 128
    if case == "switched off":
        monkeypatch.setenv(int4_dequant.ENV_SWITCH, "0")
    layer, ref_w = _int4_layer(n, 64, 32)
    x = torch.randn(3 * ql.int4_max_rows(), 64)
    before = ql.path_calls()
    with torch.inference_mode():
        got = layer(x)
    assert ql.path_calls()["int4"] - before["int4"] == 1
    assert ql.path_calls()["dequant"] == before["dequant"]
    ref = x.bfloat16().float() @ ref_w.bfloat16().float().T
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


@needs_dequant
def test_int4_linear_compiles_without_a_row_count_guard():
    """Under torch.compile the layer is one op (asyncllm::int4_linear) that picks the
    path inside: a graph compiled with a dynamic row count runs both paths without
    recompiling, and matches eager."""
    from torch._dynamo.testing import CompileCounter

    layer, _ = _int4_layer(128, 64, 32)
    counter = CompileCounter()
    fn = torch.compile(lambda x: layer(x).relu(), backend=counter, dynamic=True)
    torch._dynamo.reset()
    before = ql.path_calls()
    with torch.inference_mode():
        for rows in (2, 3, ql.int4_max_rows() + 5, 40):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(fn(x), layer(x).relu(), rtol=0, atol=0)
    assert counter.frame_count == 1
    assert ql.path_calls()["dequant"] - before["dequant"] == 4  # compiled and eager, 2 each


def test_int4_group_size_must_divide_input():
    with pytest.raises(ValueError, match="in_features=96"):
        ql.int4_codes(torch.randn(8, 96), 64)
    with pytest.raises(ValueError, match="group size 48"):
        ql.Int4Linear(torch.zeros(8, 96, dtype=torch.int16), torch.ones(8, 2),
                      torch.zeros(8, 2), 48, None, ql.COMPUTE_DTYPE)  # fmt: skip


def test_int4_without_a_kernel_is_refused():
    with pytest.raises(ValueError, match=r"quantization='int4'.*meta"):
        ql.check_kernel("int4", torch.device("meta"), ql.COMPUTE_DTYPE)


@pytest.mark.parametrize(
    "field, value",
    [("quantization", "fp8"), ("quantization", "Q4_1"), ("quantization_group_size", 48)],
)
def test_config_rejects_bad_quantization(field, value):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
        EngineConfig(**{field: value})


def test_config_says_the_clis_none_is_none_in_python():
    with pytest.raises(ValueError, match="the CLI's 'none' is None in Python"):
        EngineConfig(quantization="none")  # type: ignore[arg-type]


# --- engines on the tiny model --------------------------------------------------------------


def test_bad_settings_fail_at_load(tiny_llama_dir, make_engine, quant_cache):
    """Group 128 does not divide the tiny model's width 64: ValueError naming the layer;
    'gguf' for a model that is no GGUF file: ValueError naming the setting."""
    with pytest.raises(ValueError, match=r"group_size=128.*width 64 of model\.layers\.0"):
        make_engine(tiny_llama_dir, quantization="int4", quantization_group_size=128)
    with pytest.raises(ValueError, match=r"quantization='gguf' needs a \.gguf model"):
        make_engine(tiny_llama_dir, quantization="gguf")


def _fake_quantized_dir(src: pathlib.Path, dst: pathlib.Path, mode: str, gs: int) -> None:
    """The tiny model with every non-head linear weight replaced by its dequantized codes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    head = qz._head_name(lm)
    with torch.no_grad():
        for name, lin in qz._linears(lm):
            if name == head:
                continue
            if mode == "int8":
                q, s = ql.int8_codes(lin.weight)
                lin.weight.copy_(s[:, None] * q.float())
            else:
                q, s, o = ql.int4_codes(lin.weight, gs)
                lin.weight.copy_(
                    s.repeat_interleave(gs, 1) * q.float() + o.repeat_interleave(gs, 1)
                )
    lm.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)


@pytest.mark.parametrize("mode, gs", [("int8", 32), ("int4", 32), ("int4", 64)])
def test_engine_greedy_matches_dequantized_model(
    tiny_llama_dir, tmp_path, make_engine, quant_cache, mode, gs
):
    """Greedy tokens of the tiny model run quantized equal those of a float32 model holding
    the dequantized weights, up to a near-tie (bfloat16 activations round differently)."""
    ref_dir = tmp_path / "ref"
    _fake_quantized_dir(tiny_llama_dir, ref_dir, mode, gs)
    # float32 models: the quantized layers' bfloat16 rounding is the only difference
    quant = make_engine(tiny_llama_dir, quantization=mode, quantization_group_size=gs,
                        kv_cache_bytes=8 * 2**20, dtype="float32")  # fmt: skip
    ref = make_engine(ref_dir, quantization=None, kv_cache_bytes=8 * 2**20, dtype="float32")
    stats = quant.stats()
    assert stats["precision"] == ("int8" if mode == "int8" else f"int4 g{gs}")
    assert ref.stats()["precision"] == "float32"
    assert 0 < int(stats["weight_bytes"]) < int(ref.stats()["weight_bytes"])
    # a second engine finds the converted weights in the cache
    (cached,) = (quant_cache / "quant").glob("*.pt")
    mtime = cached.stat().st_mtime_ns
    again = make_engine(tiny_llama_dir, quantization=mode, quantization_group_size=gs,
                        kv_cache_bytes=8 * 2**20, dtype="float32")  # fmt: skip
    assert again.stats()["weight_bytes"] == stats["weight_bytes"]
    assert cached.stat().st_mtime_ns == mtime  # read, not written again
    # more sequences than int4_max_rows(): decode steps take the dequantize-then-GEMM
    # path too (and the tiny model's 32-wide k/v projections the int4 kernel at every size)
    prompts = [[1, 5, 9, 200, 7], [3, 3, 3], [100, 2000, 30000, 4, 4, 4, 4, 4]]
    prompts += [[17 * i + 3, 400 + i, 9] for i in range(ql.int4_max_rows())]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def run(engine):  # type: ignore[no-untyped-def]
        async with engine:
            return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    before = ql.path_calls()
    got = asyncio.run(run(quant))
    if mode == "int4" and int4_dequant.kernel() is not None:
        assert ql.path_calls()["dequant"] > before["dequant"]
        assert ql.path_calls()["int4"] > before["int4"]
    want = asyncio.run(run(ref))
    # a fresh copy: the engine's model runs only through its paged attention
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    for prompt, g, w in zip(prompts, got, want, strict=True):
        if g.token_ids == w.token_ids:
            continue
        pairs = zip(g.token_ids, w.token_ids, strict=False)
        j = next(i for i, (a, b) in enumerate(pairs) if a != b)
        with torch.inference_mode():
            logits = lm(torch.tensor([prompt + w.token_ids[:j]])).logits[0, -1].float()
        top = logits.log_softmax(-1).topk(2)
        assert float(top.values[0] - top.values[1]) < 0.05, (prompt, j)
        assert g.token_ids[j] in top.indices.tolist()


# --- the real default model -----------------------------------------------------------------


def _perplexity(lm: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        logits = lm(ids[None]).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[1:])
    return math.exp(float(nll))


@pytest.fixture(scope="module")
def default_perplexities(default_model_dir) -> dict[str, float]:
    cpu = torch.device("cpu")
    out: dict[str, float] = {}
    ids: torch.Tensor | None = None
    # "gguf bf16": the default on CPUs with bfloat16 (dtype "auto", quantization "auto")
    for key, mode, dtype in (
        ("None", None, torch.float32),
        ("gguf", "gguf", torch.float32),
        ("int8", "int8", torch.float32),
        ("gguf bf16", "gguf", torch.bfloat16),
    ):
        loaded = load_model(default_model_dir, dtype=dtype, device=cpu, quantization=mode)
        if ids is None:
            ids = torch.tensor(loaded.tokenizer.encode(TEXT.read_text()))
        out[key] = _perplexity(loaded.model, ids)
        out[f"{key} bytes"] = loaded.weight_bytes
        out[f"{key} precision"] = loaded.precision  # type: ignore[assignment]
        del loaded
    print(f"\nperplexity on {TEXT.name} ({len(ids)} tokens):", out)  # type: ignore[arg-type]
    return out


@pytest.mark.slow  # the default model's perplexities at each precision: ~90 s
def test_gguf_perplexity_within_1_percent(default_perplexities):
    f32, gguf = default_perplexities["None"], default_perplexities["gguf"]
    assert default_perplexities["gguf precision"] == DEFAULT_GGUF_PRECISION
    assert abs(gguf / f32 - 1) < 0.01, (gguf, f32)
    assert default_perplexities["gguf bytes"] < 0.4 * default_perplexities["None bytes"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gguf_blocks_found_in_a_model_of_another_dtype(default_model_dir, quant_cache, dtype):
    """A model loaded in bfloat16 or float16 holds the GGUF values rounded: its weights still
    find their Q4_1 tensors (the default, dtype "auto", is bfloat16 on CPUs that have it)."""
    loaded = load_model(default_model_dir, dtype=dtype, device=torch.device("cpu"),
                        quantization="gguf")  # fmt: skip
    assert loaded.precision == DEFAULT_GGUF_PRECISION
    assert next(loaded.model.parameters()).dtype == dtype


@pytest.mark.slow  # the default model's perplexities at each precision: ~90 s
def test_default_bf16_gguf_perplexity_within_1_percent(default_perplexities):
    """bfloat16 activations with the Q4_1 blocks (the default here) against float32 weights:
    measured +0.7% (18.90 against 18.78)."""
    f32, got = default_perplexities["None"], default_perplexities["gguf bf16"]
    assert abs(got / f32 - 1) < 0.01, (got, f32)


@pytest.mark.slow  # the default model's perplexities at each precision: ~90 s
def test_int8_perplexity_within_2_percent(default_perplexities):
    f32, int8 = default_perplexities["None"], default_perplexities["int8"]
    assert abs(int8 / f32 - 1) < 0.02, (int8, f32)


def test_auto_keeps_the_blocks_it_has_kernels_for(caplog):
    """The "auto" setting: "gguf" where a linear type has a kernel, a type without one (Q3_K)
    named as dequantized; only types without a kernel -> None; an LM head or embedding table
    of such a type (kept dense or as exact codes anyway) does not count."""
    from types import SimpleNamespace as T

    path = pathlib.Path("model.gguf")
    cpu = torch.device("cpu")
    names = ["blk.0.attn_q.weight", "output.weight", "token_embd.weight", "blk.0.ffn_up.weight"]
    ok = [T(name=n, kind=k) for n, k in zip(names, ["Q4_K", "Q6_K", "Q6_K", "Q8_0"], strict=True)]
    mixed = [*ok, T(name="blk.1.ffn_down.weight", kind="Q3_K")]
    none = [T(name="blk.0.attn_q.weight", kind="Q3_K"), T(name="blk.0.ffn_up.weight", kind="F16")]
    with caplog.at_level("INFO", logger="asyncllm"):
        assert qz._auto_mode(ok, path, cpu, torch.float32) == "gguf"
        assert "dequantized" not in caplog.text
        assert qz._auto_mode(mixed, path, cpu, torch.float32) == "gguf"
        assert "Q3_K layers dequantized to float32" in caplog.text
        assert qz._auto_mode(none, path, cpu, torch.float32) is None
        assert "no tensor type with a kernel (Q3_K)" in caplog.text
        assert qz._auto_mode(None, None, cpu, torch.float32) is None


@pytest.fixture(scope="module")
def tiny_tied_dir(tmp_path_factory, default_model_dir) -> pathlib.Path:
    """The tiny Llama with its LM head tied to the embedding (as SmolLM2's is)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from asyncllm.bench.tiny_model import TINY_CONFIG

    torch.manual_seed(2)
    path = tmp_path_factory.mktemp("tiny-tied")
    LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, "tie_word_embeddings": True})).save_pretrained(
        path
    )
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(path)
    return path


@pytest.mark.parametrize("model", ["llama", "qwen2", "tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_start_builds_only_the_unquantized_weights(
    request, quant_cache, monkeypatch, model, dtype
):
    """With the quantized layers cached, a start builds the model around them (no
    ``from_pretrained``, so no dense copy of those layers is ever made): same modules, same
    weights, same logits as the first start, tied head and generation config included."""
    import transformers

    from asyncllm.models.loader import load_model

    path = request.getfixturevalue(f"tiny_{model}_dir")
    cpu = torch.device("cpu")
    first = load_model(path, dtype=dtype, device=cpu, quantization="int4")
    tied = first.model.lm_head.weight is first.model.get_input_embeddings().weight
    assert tied == (model == "tied")

    def refuse(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("from_pretrained called despite a cached quantization")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    again = load_model(path, dtype=dtype, device=cpu, quantization="int4")
    assert again.precision == first.precision == "int4 g32"
    assert again.weight_bytes == first.weight_bytes
    assert again.eos_token_ids == first.eos_token_ids
    assert str(again.model) == str(first.model)
    want, got = first.model.state_dict(), again.model.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k
    assert (again.model.lm_head.weight is again.model.get_input_embeddings().weight) == tied
    ids = torch.tensor([[1, 5, 9, 200, 7, 3]])
    with torch.inference_mode():
        assert torch.equal(first.model(ids).logits, again.model(ids).logits)


def _drop_a_module(path: pathlib.Path) -> None:
    data = torch.load(path, weights_only=True)
    del data["modules"][sorted(data["modules"])[0]]
    torch.save(data, path)


def _unknown_class(path: pathlib.Path) -> None:
    data = torch.load(path, weights_only=True)
    data["modules"][sorted(data["modules"])[0]]["cls"] = "Int3Linear"
    torch.save(data, path)


def _add_a_module(path: pathlib.Path) -> None:
    data = torch.load(path, weights_only=True)
    data["modules"]["model.layers.9.mlp.up_proj"] = next(iter(data["modules"].values()))
    torch.save(data, path)


def _other_weights(path: pathlib.Path) -> None:
    data = torch.load(path, weights_only=True)
    data["key"] = "0" * 64  # the key of other weights, e.g. a key prefix shared by chance
    torch.save(data, path)


def test_a_save_removes_the_setting_s_files_of_other_versions(tiny_llama_dir, quant_cache):
    """Writing a cache file removes the same model name's and setting's files of other cache
    versions, and of the names before versions were in them (this version never reads them,
    each the model's size); another setting's file and this version's other files (another
    folder of the same name) stay."""
    cpu = torch.device("cpu")
    load_model(tiny_llama_dir, dtype=torch.float32, device=cpu, quantization="int8")
    (other_setting,) = (quant_cache / "quant").glob("*.pt")
    load_model(tiny_llama_dir, dtype=torch.float32, device=cpu, quantization="int4")
    (own,) = set((quant_cache / "quant").glob("*.pt")) - {other_setting}
    prefix, version, key = own.name.rsplit("-", 2)
    assert version == f"v{qz.CACHE_VERSION}"
    stale = [own.with_name(f"{prefix}-{key}"), own.with_name(f"{prefix}-v3-{key}")]
    kept = [own.with_name(f"{prefix}-{version}-0123456789ab.pt"), other_setting]
    for path in [*stale, kept[0]]:
        path.write_bytes(b"old")
    own.unlink()  # converted and written again
    load_model(tiny_llama_dir, dtype=torch.float32, device=cpu, quantization="int4")
    assert own.exists() and all(p.exists() for p in kept)
    assert not any(p.exists() for p in stale)


@pytest.mark.parametrize(
    "tamper",
    ["other model", "other setting", "other weights", "drop a module", "add a module",
     "unknown class"],
)  # fmt: skip
def test_cache_that_does_not_fit_is_converted_again(
    tiny_llama_dir, tiny_qwen2_dir, quant_cache, tamper, caplog
):
    """A cache file under this model's name that was written for another model or setting,
    records the key of other weights, lacks or adds a layer, or names an unknown class is
    ignored: the start converts again (same weights as a fresh start, the file rewritten),
    never serves it as the model or fails on it (it served another model's layers, the int8
    layers for int4, a dense layer among int4 ones, or raised ModelLoadError)."""
    cpu = torch.device("cpu")
    fresh = load_model(tiny_llama_dir, dtype=torch.float32, device=cpu, quantization="int4")
    (own,) = (quant_cache / "quant").glob("*.pt")
    good = own.read_bytes()
    if tamper in ("other model", "other setting"):
        other = (tiny_qwen2_dir, "int4") if tamper == "other model" else (tiny_llama_dir, "int8")
        load_model(other[0], dtype=torch.float32, device=cpu, quantization=other[1])
        (foreign,) = set((quant_cache / "quant").glob("*.pt")) - {own}
        own.write_bytes(foreign.read_bytes())
    else:
        {"drop a module": _drop_a_module, "add a module": _add_a_module,
         "unknown class": _unknown_class, "other weights": _other_weights,
         }[tamper](own)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="asyncllm"):
        again = load_model(tiny_llama_dir, dtype=torch.float32, device=cpu, quantization="int4")
    ignored = [r for r in caplog.records if "ignoring quantization cache" in r.getMessage()]
    # a file named for another model or setting is skipped quietly (as another version's);
    # one that reaches the fit check gives one warning, not one per load path
    assert len(ignored) == (tamper not in ("other model", "other setting"))
    assert again.precision == "int4 g32"
    assert again.weight_bytes == fresh.weight_bytes
    want, got = fresh.model.state_dict(), again.model.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert own.read_bytes() == good  # converted again and cached again


def _retrained(src: pathlib.Path, dst: pathlib.Path, seed: int) -> pathlib.Path:
    """The tiny Llama of ``src`` (config, tokenizer) at ``dst`` with other random weights:
    the same tensors, so the same file names and sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncllm.bench.tiny_model import TINY_CONFIG

    shutil.copytree(src, dst, dirs_exist_ok=True)
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)).save_pretrained(dst)
    return dst


def _load_int4(
    path: pathlib.Path, cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> LoadedModel:
    """``path`` loaded with int4 layers, the quantized weights cached under ``cache``."""
    monkeypatch.setenv("ASYNCLLM_CACHE", str(cache))
    return load_model(path, dtype=torch.float32, device=torch.device("cpu"), quantization="int4")


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    want, got = a.state_dict(), b.state_dict()
    return want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_same_named_models_each_load_their_own_quantized_layers(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """Two models in ``run1/final`` and ``run2/final`` (one folder name, the same file
    names, sizes and modification times, other weights) each load their own quantized
    layers, on the first start and from the cache: the cache was keyed by the folder's name
    and the files' names, sizes and times, and gave the second model the first one's."""
    dirs = [_retrained(tiny_llama_dir, tmp_path / f"run{i}" / "final", 10 + i) for i in (1, 2)]
    files = [d / "model.safetensors" for d in dirs]
    assert files[0].stat().st_size == files[1].stat().st_size
    assert files[0].read_bytes() != files[1].read_bytes()
    for d in dirs:
        for f in d.iterdir():
            os.utime(f, ns=(1_700_000_000 * 10**9, 1_700_000_000 * 10**9))
    fresh = [_load_int4(d, tmp_path / f"fresh{i}", monkeypatch).model for i, d in enumerate(dirs)]
    assert not _same_weights(*fresh)
    shared = tmp_path / "shared"
    for start in ("converted", "cached"):
        for d, want in zip(dirs, fresh, strict=True):
            loaded = _load_int4(d, shared, monkeypatch)
            assert _same_weights(loaded.model, want), (start, d)
    assert len(list((shared / "quant").glob("*.pt"))) == 2


def test_weights_rewritten_in_place_are_quantized_again(tiny_llama_dir, tmp_path, monkeypatch):
    """A checkpoint rewritten in place with other weights of the same shapes (the same size)
    and its modification time restored: the next start quantizes the new weights, never
    serves the layers cached for the old ones."""
    path = _retrained(tiny_llama_dir, tmp_path / "model", 10)
    weights = path / "model.safetensors"
    cache = tmp_path / "cache"
    old = _load_int4(path, cache, monkeypatch).model
    before = weights.stat()
    _retrained(tiny_llama_dir, path, 11)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    want = _load_int4(path, tmp_path / "fresh", monkeypatch).model
    assert not _same_weights(old, want)
    got = _load_int4(path, cache, monkeypatch).model
    assert _same_weights(got, want)


def test_a_gguf_file_is_parsed_once_per_load(quant_cache, monkeypatch, default_model_dir):
    """gguf-py parses every metadata field per reader (~3 s for the default model): a first
    load on an empty cache (transformers' conversion: config, weights, tokenizer; then the
    quantization's tensor types and blocks) parses the file once, restores gguf-py as it was,
    and converts to the same weights and tokenizer as the cached conversion."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    parses: list[str] = []
    init = gguf.GGUFReader.__init__
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def counting(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        parses.append(pathlib.Path(path).name)
        init(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting)
    cpu = torch.device("cpu")
    loaded = load_model("default", dtype=torch.bfloat16, device=cpu, quantization="auto")
    assert parses == [default_gguf().name]
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map
    assert loaded.model_dir.is_relative_to(quant_cache) and "Q4_1" in loaded.precision
    want = load_file(default_model_dir / "model.safetensors")
    got = load_file(loaded.model_dir / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    text = "Hello world, résumé 123 <|im_start|>"
    ref = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    assert loaded.tokenizer(text).input_ids == ref(text).input_ids
    # A second load in the same process: the conversion and the packed weights are cached.
    load_model("default", dtype=torch.bfloat16, device=cpu, quantization="auto")
    assert len(parses) == 1


def test_gguf_tensor_kinds_are_cached(tmp_path, monkeypatch):
    """An engine start needs only the GGUF tensors' types: the first read (gguf-py parses
    every metadata field) is kept, later starts read the small file, for any file of the
    same content; a file of other content (one byte of a tensor, the modification time
    restored) is read again."""
    from asyncllm.models import gguf_quant

    src = default_gguf()
    want = [(t.name, t.kind) for t in read_tensors(src)]
    first = gguf_quant.tensor_kinds(src, tmp_path)
    assert [(t.name, t.kind) for t in first] == want
    assert len(list(tmp_path.glob("gguf-kinds-*.json"))) == 1

    def refuse(path):  # type: ignore[no-untyped-def]
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf_quant, "read_tensors", refuse)
    assert gguf_quant.tensor_kinds(src, tmp_path) == first
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(src, copy)  # another path and time, the same content: the same entry
    assert gguf_quant.tensor_kinds(copy, tmp_path) == first
    stamp = copy.stat()
    with copy.open("r+b") as f:
        f.seek(stamp.st_size - 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(copy, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    with pytest.raises(AssertionError, match="parsed again"):
        gguf_quant.tensor_kinds(copy, tmp_path)


def test_weights_whose_keys_collide_each_find_their_gguf_tensor():
    """Two GGUF tensors of one shape that differ only off the words a content key reads:
    each linear finds its own tensor (the key picks candidates, the bytes decide)."""
    from gguf import GGMLQuantizationType as Kind

    from asyncllm.models.gguf_quant import GGUFTensor
    from asyncllm.models.quantization import _from_gguf

    torch.manual_seed(0)
    a = torch.randn(8, 1024)
    b = a.clone()
    b[:, -1] += 1  # the last word of every row: not among the sampled words
    assert content_key(a) == content_key(b) and not torch.equal(a, b)
    tensors = [
        GGUFTensor(n, "F32", (8, 1024), w.numpy().view(np.uint8).reshape(-1), Kind.F32)
        for n, w in (("a", a), ("b", b))
    ]
    lm = torch.nn.Sequential(torch.nn.Linear(1024, 8, bias=False))
    for w in (a, b):
        lm[0].weight.data.copy_(w)
        assert _from_gguf(lm, tensors, torch.float32) == ({}, "gguf ()")
    lm[0].weight.data.copy_(a + 1)
    with pytest.raises(ValueError, match="no tensor of the GGUF file matches"):
        _from_gguf(lm, tensors, torch.float32)


def test_a_quantized_embedding_computes_what_the_models_own_does():
    """Gemma 3's embedding multiplies its rows by sqrt(hidden_size) in its own forward; the
    codes' lookup keeps that factor (it was dropped: Gemma 3's GGUF answered gibberish). An
    embedding whose forward does something else stays as it is."""
    from torch import nn
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (100, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(100, 2, generator=g)
    rows = q.float() * scale.repeat_interleave(32, -1)
    table = Gemma3TextScaledWordEmbedding(100, 64, 0, embed_scale=8.0)
    table.weight.data.copy_(rows)
    quant = ql.QuantEmbedding(q, scale, None, torch.float32, 0, table.embed_scale)
    ids = torch.tensor([3, 99, 0])
    assert torch.equal(quant(ids), table(ids)) and quant.same_lookups(table)

    class Shifted(nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) + 1

    shifted = Shifted(100, 64)
    shifted.weight.data.copy_(rows)
    assert not ql.QuantEmbedding(q, scale, None, torch.float32).same_lookups(shifted)
    state = ql.module_state(quant)  # the quantized-weights cache keeps the factor
    assert torch.equal(ql.module_from_state(state)(ids), table(ids))
