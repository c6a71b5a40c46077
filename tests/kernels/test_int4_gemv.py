"""The int4 linear layer's few-row kernel (``csrc/int4_gemv.cpp``): the product
with the dequantized weight within the output's rounding, at every split over threads and
rows, and the row counts and arguments that route to it."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels import int4_dequant
from asyncllm.layers import quant_linear as ql

needs_gemv = pytest.mark.skipif(
    not int4_dequant.gemv_available(),
    reason="the few-row int4 kernel needs the avx512_bf16 variant (AVX-512 BF16 and VBMI)",
)


def _layer(n: int, k: int, gs: int) -> tuple[ql.Int4Linear, torch.Tensor]:
    """An Int4Linear of random codes [n, k] (bfloat16 scales) and its weight dequantized in
    float64 from the scales and zeros the kernel reads."""
    torch.manual_seed(n * 7 + k + gs)
    q, s, o = ql.int4_codes(torch.randn(n, k) * 0.05, gs)
    layer = ql.Int4Linear(q, s, o, gs, None, torch.bfloat16)
    sz = layer.scales_and_zeros.double()  # [k / gs, n, 2]
    scale, zero = (sz[..., i].T.repeat_interleave(gs, 1) for i in (0, 1))
    return layer, (q.double() - 8) * scale + zero


def _within_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got (bfloat16) = x w^T within half a bfloat16 ulp of the float64 product, plus the
    float32 sums' error."""
    ref = x.double() @ w.T
    assert got.dtype == torch.bfloat16
    assert ((got.double() - ref).abs() <= 2.0**-8 * ref.abs() + 1e-4).all()


@needs_gemv
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "n, k, gs, rows",
    [
        (64, 64, 32, 1),  # one block, two groups
        (192, 576, 32, 2),  # 3 blocks: split in K over 2 threads
        (960, 576, 32, 3),  # the default model's fused q/k/v
        (576, 1536, 32, 1),  # its down projection: 9 blocks, 48 groups
        (320, 256, 128, 5),  # rows beyond 3 (a second pass of 2), group 128
        (128, 192, 64, 4),  # group 64, three groups
    ],
)
def test_int4_gemv_equals_the_dequantized_product(n, k, gs, rows, threads):
    layer, w = _layer(n, k, gs)
    x = torch.randn(rows, k).bfloat16()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = int4_dequant.kernel().int4_gemv(x, layer.packed, layer.scales_and_zeros, gs, n)
    finally:
        torch.set_num_threads(old)
    assert got.shape == (rows, n)
    _within_rounding(got, x, w)
    # and torch's int4 kernel up to one rounding of either
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, gs, layer.scales_and_zeros)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2e-4)


@needs_gemv
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_int4_layer_routes_few_rows_to_the_kernel(rows, monkeypatch):
    """Up to INT4_GEMV_MAX_ROWS rows (3) the few-row kernel, then torch's int4 kernel up to
    int4_max_rows(); with the threshold at 0 torch's kernel for every few-row call."""
    layer, w = _layer(128, 64, 32)
    x = torch.randn(rows, 64)
    for gemv_rows, path in ((ql.INT4_GEMV_MAX_ROWS, "gemv" if rows <= 3 else "int4"), (0, "int4")):
        monkeypatch.setattr(ql, "INT4_GEMV_MAX_ROWS", gemv_rows)
        before = ql.path_calls()
        with torch.inference_mode():
            got = layer(x)
        assert ql.path_calls()[path] - before[path] == 1
        assert got.dtype == torch.float32 and got.shape == (rows, 128)
        _within_rounding(got.bfloat16(), x.bfloat16(), w)


@needs_gemv
def test_int4_gemv_skips_what_it_cannot_run():
    """An output width that is no multiple of 64: torch's kernel runs (the layer); float32
    scales: the float32 few-row kernel (int4_gemv_f32.cpp). A direct call of this bfloat16
    kernel says why it cannot run either."""
    torch.manual_seed(0)
    q, s, o = ql.int4_codes(torch.randn(96, 64) * 0.05, 32)
    narrow = ql.Int4Linear(q, s, o, 32, None, torch.bfloat16)
    q, s, o = ql.int4_codes(torch.randn(128, 64) * 0.05, 32)
    wide32 = ql.Int4Linear(q, s, o, 32, None, torch.float32)
    x = torch.randn(1, 64)
    for layer, path in ((narrow, "int4"), (wide32, "gemv")):
        before = ql.path_calls()
        with torch.inference_mode():
            layer(x)
        assert ql.path_calls() - before == {path: 1}
        with pytest.raises(RuntimeError, match="int4_gemv: needs"):
            int4_dequant.kernel().int4_gemv(
                x.bfloat16(), layer.packed, layer.scales_and_zeros, 32, layer.out_features
            )
    with pytest.raises(RuntimeError, match="rows must be a bfloat16"):
        layer, _ = _layer(128, 64, 32)
        int4_dequant.kernel().int4_gemv(x, layer.packed, layer.scales_and_zeros, 32, 128)
