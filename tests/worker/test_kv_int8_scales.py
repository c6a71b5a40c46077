"""The int8 KV cache's float16 scales (:mod:`asyncllm.attention.kv_int8`): the formula
against an independent numpy form of it, its edge cases (an all-zero row, a scale that
underflows float16, a subnormal scale, a saturated one, float16 rounding ties, codes at
half-way points), the error bound the module proves, the C++ write bit for bit, and the
pool's capacity at the default model's shape (twice the 2,048-token sequences of a bfloat16
cache)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncllm.attention import cpu_paged, kv_int8, torch_paged
from asyncllm.kernels import paged_common
from asyncllm.worker.kv_cache import KVCacheSpec

#: float32 of 1/127: the factor the scale is computed with.
C = np.float32(1.0 / 127.0)


def reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The module's formula in numpy float32: rows ``[..., D]`` -> (codes int8, scales
    float16)."""
    x = x.astype(np.float32)
    amax = np.abs(x).max(-1, keepdims=True)
    s16 = np.minimum(amax * C, np.float32(65504.0)).astype(np.float16)  # nearest even
    s = s16.astype(np.float32)
    inv = np.where(s > 0, np.float32(1.0) / np.where(s > 0, s, np.float32(1.0)), 0)
    codes = np.clip(np.rint(x * inv.astype(np.float32)), -127, 127).astype(np.int8)
    return codes, s16[..., 0]


def _tie_amaxes() -> list[float]:
    """Row maxima ``a`` whose ``a * float32(1/127)`` is exactly half-way between two float16
    values (rounded to the even one): normal, subnormal and near float16's largest."""
    ties = [1 + 2**-11, 1 + 3 * 2**-11, 0.75 + 2**-13, 2**-25, 3 * 2**-25, 5 * 2**-25]
    ties += [7 * 2**-25, 2**-14 + 2**-25, 65488.0, 1000.25]
    found = []
    for t in map(np.float32, ties):
        a = np.float32(float(t) * 127)
        for _ in range(12):  # walk down a few ulps, then up
            a = np.nextafter(a, np.float32(0))
        for _ in range(24):
            if a * C == t:
                found.append(float(a))
                break
            a = np.nextafter(a, np.float32(np.inf))
    return found


def _edge_rows(dim: int = 64) -> torch.Tensor:
    """Rows ``[R, dim]`` float32 with every case the formula has to get right."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.zeros(dim)]  # all zero: scale 0, codes 0
    for amax in (127 * 2**-27, 127 * 2**-24.5, 127 * 1.49 * 2**-24, 127 * 2**-20, 65520.0 * 127):
        r = torch.randn(dim, generator=g)
        rows.append(r / r.abs().max() * amax)  # underflow to 0, subnormal, saturating
    huge = torch.randn(dim, generator=g)
    huge[0] = 1e9  # saturated: the scale clamps to 65504, the large codes to +-127
    rows.append(huge)
    half = torch.zeros(dim)
    half[:6] = torch.tensor([127.0, 2.5, -3.5, 0.5, 1.5, -0.5])  # scale 1: codes at .5 ties
    rows.append(half)
    for amax in _tie_amaxes():
        r = torch.randn(dim, generator=g)
        r[0] = amax
        rows.append(r.clamp(-amax, amax))
    spread = torch.randn(256, dim, generator=g)
    spread *= torch.logspace(-9, 10, 256)[:, None] / spread.abs().amax(-1, keepdim=True)
    return torch.cat([torch.stack(rows), spread])


def test_quantize_is_the_documented_formula_bit_for_bit():
    """float32 and bfloat16 rows: the codes and float16 scale bits of the numpy form."""
    x = _edge_rows()
    assert len(_tie_amaxes()) >= 6  # the float16 rounding ties are exercised
    for src in (x, x.bfloat16()):
        packed = kv_int8.quantize(src)
        codes, s16 = reference(src.float().numpy())
        assert np.array_equal(packed[:, :-2].numpy(), codes)
        assert np.array_equal(packed[:, -2:].contiguous().view(torch.float16).numpy()[:, 0], s16)


def test_scale_edge_cases():
    x = _edge_rows()
    packed = kv_int8.quantize(x)
    scale, codes, deq = kv_int8.scales(packed), packed[:, :-2], kv_int8.dequantize(packed)
    assert packed.shape == (len(x), 66) and kv_int8.SCALE_BYTES == paged_common.SCALE_BYTES == 2
    # an all-zero row and a row whose absmax / 127 is below 2**-25: scale 0, codes 0
    for r in (0, 1):
        assert float(scale[r]) == 0.0 and not codes[r].any() and not deq[r].any()
    assert float((x[1] - deq[1]).abs().max()) < 3.8e-6
    # 127 * 2**-24.5: rounds up to the smallest subnormal, codes below 127
    assert float(scale[2]) == 2**-24 and int(codes[2].abs().max()) < 127
    # 1.49 * 2**-24 rounds down to 2**-24: the largest codes clamp, within 3.8e-6
    assert float(scale[3]) == 2**-24 and int(codes[3].abs().max()) == 127
    assert float((x[3] - deq[3]).abs().max()) < 3.8e-6
    # saturated scales: 65504 (not infinity) and the codes clamped
    assert float(scale[5]) == float(scale[6]) == 65504.0 and int(codes[6, 0]) == 127
    # scale 1: x * 1 at .5 rounds half to even
    assert float(scale[7]) == 1.0 and codes[7, :6].tolist() == [127, 2, -4, 0, 2, 0]


def test_error_bound_from_the_rounded_scale():
    """Codes from the stored float16 scale: every element within ``s * (1/2 + 2**-15)``
    where absmax / 127 is float16-normal, ``max(that, 3.8e-6)`` below (kv_int8's proof)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4000, 64, generator=g) * torch.logspace(-6, 6, 4000)[:, None]
    x = torch.cat([x, _edge_rows()[:5]])  # not the saturated ones
    for src in (x, x.bfloat16()):
        packed = kv_int8.quantize(src)
        s = kv_int8.scales(packed).double()
        err = (kv_int8.dequantize(packed).double() - src.double()).abs().amax(-1)
        normal = src.double().abs().amax(-1) / 127 >= 2**-14
        assert bool((err[normal] <= s[normal] * (0.5 + 2**-15)).all())
        below = torch.clamp_min(s * (0.5 + 2**-15), 3.8e-6)
        assert bool((err <= below).all()) and int((~normal).sum()) > 100
        # dequantization is exact: code * scale in float32 equals it in float64
        deq64 = packed[:, :-2].double() * s[:, None]
        assert torch.equal(kv_int8.dequantize(packed).double(), deq64)


@pytest.mark.skipif(not cpu_paged.available(), reason="CPU attention kernel unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_write_matches_torch_bit_for_bit(dtype):
    """The C++ decode write (``paged_write_decode``) stores the torch reference's codes and
    float16 scales for every edge row, one sequence per row pair."""
    rows = _edge_rows(64).to(dtype)
    n = len(rows) // 2
    k, v = rows[:n].view(n, 1, 64), rows[n : 2 * n].view(n, 1, 64)
    bs, heads = 4, 2
    tables = [[b] for b in range(n)]
    slots = torch.tensor([b * bs for b in range(n)])
    kc = torch.zeros(n, bs, 1, 66, dtype=torch.int8)
    vc = kc.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    torch_paged.write_kv_cache(k, v, kc_ref, vc_ref, slots)
    q = torch.randn(n, heads, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    plan = cpu_paged.CpuPagedPlan.build([1] * n, [1] * n, tables, bs)
    out = cpu_paged.write_and_decode(q, k, v, kc, vc, slots, plan, 0.1)
    assert out is not None
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_pool_holds_twice_the_2k_sequences_of_bfloat16():
    """The default model's shape (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, blocks
    of 16): 11,880 bytes a token against 23,040, so one GiB holds 44 sequences of 2,048
    tokens against 22 (and float32's 11)."""

    def seqs(kv_cache_dtype: str, dtype: torch.dtype) -> int:
        spec = KVCacheSpec(30, 3, 64, dtype, 16, kv_cache_dtype=kv_cache_dtype)
        return (2**30 // spec.bytes_per_block) // (2048 // 16)

    int8 = KVCacheSpec(30, 3, 64, torch.bfloat16, 16, kv_cache_dtype="int8")
    assert int8.bytes_per_token == 2 * 30 * 3 * 66 == 11_880
    assert seqs("auto", torch.bfloat16) == 22 and seqs("auto", torch.float32) == 11
    assert seqs("int8", torch.bfloat16) == 44 == 2 * seqs("auto", torch.bfloat16)
