"""GGUF Q8_0 layers: the matrix-vector kernel (its AVX-512 and AVX2 variants) and the many-row
paths (bfloat16 brgemm on the codes; a packed dense copy) against a dequantize-then-matmul
reference, and the default model's Q8_0 head
kept as codes, shared with its tied embedding table, through the quantization cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from asyncllm._kernels import native
from asyncllm.models.gguf_quant import read_tensors, unpack
from asyncllm.models.loader import load_model
from asyncllm.preflight import default_gguf
from asyncllm.worker import q8_linear

needs_kernel = pytest.mark.skipif(
    q8_linear.kernel() is None, reason=f"Q8_0 kernel unavailable: {native.failure('q8')}"
)


def _codes(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return q, torch.rand(n, k // 32, generator=g) * 0.02


def _reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None):
    y = x.double() @ q8_linear.dequantize(q, s).double().T
    return y if bias is None else y + bias.double()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_q8_linear_matches_reference(rows, dtype, packed):
    """Few rows (the kernel, float32 from the exact weights) and many (the packed dense copy,
    or the kernel where none was made), with a bias and a width not a multiple of 64; float32
    logits whatever the model's dtype."""
    n, k = 100, 96
    q, s = _codes(n, k)
    bias = torch.randn(n).to(dtype)
    layer = q8_linear.Q8Linear(q, s, bias, dtype)
    if packed:
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            pytest.skip("oneDNN's bfloat16 reorder (the packed copy) needs AVX-512 BW/VL/DQ")
        layer.pack()
    x = torch.randn(2, rows, k).to(dtype)
    with torch.inference_mode():
        y = layer(x)
    assert y.shape == (2, rows, n) and y.dtype == torch.float32
    ref = _reference(x.reshape(-1, k), q, s, bias).view(2, rows, n)
    many = 2 * rows > q8_linear.MAX_ROWS
    # float32 sums of exact weights (x is exact in either dtype); bfloat16's packed dense copy:
    # the weight's rounding (d * q rounded once) and oneDNN's output's; q8_mm: the weight's.
    mm = many and dtype == torch.bfloat16 and q8_linear.mm_available()
    tol = 2e-2 if dtype == torch.bfloat16 and many and layer.packed is not None else 1e-5
    tol = 1e-2 if mm else tol
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


needs_mm = pytest.mark.skipif(
    q8_linear.kernel() is None or not q8_linear.mm_available(), reason="no bfloat16 brgemm here"
)


@needs_mm
@pytest.mark.parametrize("n, k, rows", [(100, 96, 9), (128, 64, 64), (70, 576, 130), (64, 32, 1)])
def test_q8_mm_uses_the_exact_weights(n, k, rows):
    """The many-row kernel (per 64 outputs: dequantize, brgemm, transposed store) multiplies
    by the weight the dense copy held (``d * q`` rounded once to bfloat16) bit for bit (times
    the identity, every output is one product with 1), and any rows within bfloat16's
    rounding of the float64 reference: output blocks of fewer than 64, row tiles past 64;
    float32 output (the float32 sums, not rounded)."""
    q, s = _codes(n, k, seed=n + rows)
    mod = q8_linear.kernel()
    dense = q8_linear.dequantize(q, s).bfloat16()
    assert torch.equal(mod.q8_mm(torch.eye(k, dtype=torch.bfloat16), q, s), dense.T.float())
    x = torch.randn(rows, k).bfloat16()
    y = mod.q8_mm(x, q, s)
    ref = x.double() @ dense.double().T
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    with pytest.raises(RuntimeError, match="q8_mm"):
        mod.q8_mm(x.float(), q, s)


@needs_mm
def test_q8_linear_packs_a_dense_copy_only_for_float32():
    """bfloat16 models run many rows through ``q8_mm`` on the codes (no 57 MB dense copy of
    the default model's head); float32 ones through oneDNN on a packed float32 copy."""
    q, s = _codes(64, 64)
    bf16, f32 = (q8_linear.Q8Linear(q, s, None, dt) for dt in (torch.bfloat16, torch.float32))
    bf16.pack()
    f32.pack()
    assert bf16.packed is None and f32.packed is not None


def test_q8_linear_refuses_bad_shapes():
    q, s = _codes(8, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_linear.Q8Linear(q[:, :40], s[:, :1], None)
    with pytest.raises(ValueError, match="scales"):
        q8_linear.Q8Linear(q, s[:, :1], None)


@needs_kernel
def test_q8_gemv_checks_its_inputs():
    q, s = _codes(8, 64)
    y = torch.empty(1, 8)
    with pytest.raises(RuntimeError, match="q8_gemv"):
        q8_linear.kernel().q8_gemv(torch.randn(1, 64).bfloat16(), q, s, y)
    with pytest.raises(RuntimeError, match="q8_gemv"):
        q8_linear.kernel().q8_gemv(torch.randn(1, 32), q, s, y)


def _avx2_variant():  # type: ignore[no-untyped-def]
    try:
        return native.import_variant("q8", "avx2")
    except ImportError as e:
        pytest.skip(f"the avx2 variant is not installed: {e}")


def test_q8_gemv_avx2_variant_matches_the_reference():
    """The avx2 variant (the path of CPUs without AVX-512: no fast path) gives the
    reference's values up to float32 summation order."""
    mod = _avx2_variant()
    assert not mod.q8_fast()
    q, s = _codes(70, 128, seed=3)
    x = torch.randn(6, 128)
    y = torch.empty(6, 70)
    mod.q8_gemv(x, q, s, y)
    ref = _reference(x, q, s, None)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_q8_gemv_avx2_variant_matches_the_loaded_one():
    """The avx2 variant gives the values of the variant loaded here (AVX-512's fast path),
    up to float32 summation order."""
    mod, loaded = _avx2_variant(), q8_linear.kernel()
    if loaded is None or loaded is mod:
        pytest.skip("only the avx2 variant runs here (against the reference: the test above)")
    q, s = _codes(70, 128, seed=3)
    x = torch.randn(6, 128)
    y, fast = torch.empty(6, 70), torch.empty(6, 70)
    mod.q8_gemv(x, q, s, y)
    loaded.q8_gemv(x, q, s, fast)
    scale = _reference(x, q, s, None).abs().max().item()
    torch.testing.assert_close(fast, y, rtol=1e-5, atol=2e-5 * scale)


def test_q8_0_blocks_are_exact():
    """A Q8_0 tensor made by gguf-py: the layer's dequantized weight is gguf-py's own."""
    w = np.random.default_rng(1).standard_normal((40, 64)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType.Q8_0)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).reshape(40, 64))
    blocks = unpack("Q8_0", raw, (40, 64))
    layer = q8_linear.Q8Linear(blocks.q, blocks.scale, None, torch.float32)
    assert torch.equal(q8_linear.dequantize(layer.q, layer.scale), ref)


@needs_kernel
def test_default_model_head_is_its_q8_0_codes_shared_with_the_embedding(
    default_model_dir, quant_cache
):
    """The default model's tied head and embedding: one set of Q8_0 codes (the GGUF file's,
    exact), the same after a start from the quantization cache."""
    if not q8_linear.fast():
        pytest.skip("the Q8_0 head is kept as codes only where the AVX-512 kernel builds")
    (t,) = [t for t in read_tensors(default_gguf()) if t.name == "token_embd.weight"]
    assert t.kind == "Q8_0"
    ref = t.dequantize()
    for _ in range(2):  # converted, then from the cache
        lm = load_model(default_model_dir, dtype=torch.bfloat16, device=torch.device("cpu"),
                        quantization="gguf").model  # fmt: skip
        head, emb = lm.get_output_embeddings(), lm.get_input_embeddings()
        assert isinstance(head, q8_linear.Q8Linear)
        assert head.q.data_ptr() == emb.q.data_ptr()
        assert head.scale.data_ptr() == emb.scale.data_ptr()
        # llama.cpp stores token_embd unpermuted: rows in the model's order
        assert torch.equal(q8_linear.dequantize(head.q, head.scale), ref)
        ids = torch.tensor([[0, 17, 49151]])
        assert torch.equal(emb(ids), ref[ids].to(torch.bfloat16))
