"""The int4 layer's float32 paths (``csrc/int4_gemv_f32.cpp``, and dequantize + float32 GEMM)
compute the function the weights define as closely as float32 does, in torch's packed layout
of this CPU, at every row count; a float32 model's int4 layers run them."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels import native, ops
from asyncllm.layers import quant_linear as ql

pytestmark = pytest.mark.skipif(
    native.module("int4") is None, reason=f"int4 kernel not installed: {native.failure('int4')}"
)


def _layer(n: int, k: int, group: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    # float16 scales and minimums, as a GGUF Q4_1 file stores them
    scale = (torch.rand(n, k // group, generator=g) * 0.02).half().float()
    offset = (torch.randn(n, k // group, generator=g) * 0.02).half().float()
    exact = q.double() * scale.double().repeat_interleave(group, 1)
    exact += offset.double().repeat_interleave(group, 1)
    return q, scale, offset, exact


def test_pack_layout_is_read_from_torch():
    """The kernels read torch's layout of this CPU: [N/64, K, 32] or [N/32, K, 16] bytes."""
    n, k = 64, 2
    q = torch.tensor([[r // 16 + 4 * c for c in range(k)] for r in range(n)], dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1).flatten()
    block = native.module("int4").int4_pack_block_n()
    assert block in (32, 64)
    half = block // 2  # bytes per column of a block: low nibble row j, high nibble row half + j
    for r in range(n):
        for c in range(k):
            b = int(packed[(r // block * k + c) * half + r % half])
            assert (b & 15 if r % block < half else b >> 4) == int(q[r, c])


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 20])
@pytest.mark.parametrize(("n", "k"), [(192, 576), (128, 64)])
def test_float32_int4_linear_is_the_exact_product_to_float32_rounding(rows, n, k):
    q, scale, offset, exact_w = _layer(n, k)
    layer = ql.Int4Linear(q, scale, offset, 32, None, torch.float32)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    exact = x.double() @ exact_w.T
    got = layer(x)
    assert got.dtype == torch.float32
    # float32 sums of k products: a few ulps of the largest partial sums
    tol = 8 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ exact_w.abs().T)
    assert ((got.double() - exact).abs() <= tol).all()
    # the torch reference (bfloat16-free here: float32 scales) agrees to the same bound
    ref = ops.int4_linear_reference(x, layer.packed, layer.scales_and_zeros, None, 32, k, n)
    assert ((ref.double() - exact).abs() <= tol).all()


def test_float32_layers_keep_tile_major_scales_converted_once_for_torch():
    """A float32 layer's scales are tile-major [N / 64, K / group, 2, 64] with the offsets
    as given (nothing rounded); torch's kernel gets them in its own layout, converted once
    per tensor (a decode step calls each layer again), and the conversion goes with it."""
    q, scale, offset, _ = _layer(128, 64)
    layer = ql.Int4Linear(q, scale, offset, 32, None, torch.float32)
    sz = layer.scales_and_zeros
    assert sz.shape == (2, 2, 2, 64)
    assert torch.equal(sz[:, :, 0].permute(0, 2, 1).reshape(128, 2), scale)
    assert torch.equal(sz[:, :, 1].permute(0, 2, 1).reshape(128, 2), offset)
    first = ops.torch_scales(sz)
    assert first.shape == (2, 128, 2) and ops.torch_scales(sz) is first
    want = torch.stack([scale.T.double(), offset.T.double() + 8 * scale.T.double()], -1)
    assert torch.equal(first, want.float())
    key = id(sz)
    del layer, sz
    assert key not in ops._TORCH_LAYOUT


def test_the_torch_reference_takes_strided_rows():
    """The torch reference (the path without the C++ kernel) multiplies rows that are not
    contiguous, as the C++ op does (torch's int4 kernel wants contiguous rows)."""
    q, scale, offset, _ = _layer(64, 64)
    layer = ql.Int4Linear(q, scale, offset, 32, None, torch.float32)
    x = torch.randn(3, 128)[:, ::2]
    ref = ops.int4_linear_reference(x, layer.packed, layer.scales_and_zeros, None, 32, 64, 64)
    torch.testing.assert_close(ref, layer(x.contiguous()), rtol=1e-5, atol=1e-5)


def test_bfloat16_rounding_is_what_the_float32_path_removes():
    """The bfloat16 path's error (rows and scales rounded to bfloat16) is orders of
    magnitude above the float32 path's, on the same weights and rows."""
    n, k = 192, 576
    q, scale, offset, exact_w = _layer(n, k, seed=3)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(7))
    exact = x.double() @ exact_w.T
    err = {}
    for dtype in (torch.float32, torch.bfloat16):
        layer = ql.Int4Linear(q, scale, offset, 32, None, dtype)
        err[dtype] = ((layer(x).double() - exact).abs().max() / exact.abs().max()).item()
    assert err[torch.float32] < 1e-5 < err[torch.bfloat16]
    assert err[torch.float32] * 100 < err[torch.bfloat16]


def test_a_float32_model_quantizes_to_float32_int4_layers():
    assert ql.int4_dtype(torch.float32) == torch.float32
    assert ql.int4_dtype(torch.bfloat16) == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeated_rows_are_computed_once_with_the_same_bits(dtype):
    """The compiled forward pads a one-token step with a copy of its token: the few-row
    kernels (float32 scales: ``int4_gemv_f32``; bfloat16: ``int4_gemv``) compute a row equal
    to the one before it once, and every row's output has the bits it has alone."""
    q, scale, offset, _ = _layer(192, 576, seed=4)
    layer = ql.Int4Linear(q, scale, offset, 32, None, ql.int4_dtype(dtype))
    a, b = torch.randn(2, 576, generator=torch.Generator().manual_seed(5)).to(dtype)
    before = native.module("int4").int4_path_calls()
    for x in (torch.stack([a, a]), torch.stack([a, a, b])):
        with torch.inference_mode():
            got = layer(x)
            alone = torch.cat([layer(r[None]) for r in x])
        assert torch.equal(got, alone)
    after = native.module("int4").int4_path_calls()
    if dtype == torch.float32 or native.module("int4").int4_gemv_available():
        assert after[2] - before[2] == 2 + 5  # every call took a few-row kernel
    # else (an AVX2 build: no bfloat16 few-row kernel of ours) torch's int4 kernel ran


@pytest.mark.parametrize("rows", range(1, 9))
def test_every_row_count_gives_each_row_its_bits_alone(rows):
    """The float32 few-row kernel runs 1 to 6 rows in one pass over the codes (AVX-512; 2 on
    AVX2) and more in several: each row's output has the bits it has alone (a speculative
    step's k + 1 rows compute what k + 1 single-row steps would)."""
    q, scale, offset, _ = _layer(192, 576, seed=6)
    layer = ql.Int4Linear(q, scale, offset, 32, None, torch.float32)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    before = native.module("int4").int4_path_calls()
    with torch.inference_mode():
        got = layer(x)
        alone = torch.cat([layer(r[None]) for r in x])
    assert torch.equal(got, alone)
    assert native.module("int4").int4_path_calls()[2] - before[2] == 1 + rows
