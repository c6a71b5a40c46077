"""Dequantize torch's CPU int4-packed weights to a dense ``W^T`` in one streaming pass (C++).

torch's int4 CPU kernel (``aten._weight_int4pack_mm_for_cpu``) is a matrix-vector kernel: its
cost grows linearly with the row count, so at a decode batch of 64 it is 4-5x slower than a
plain bfloat16 matmul on the same weight (docs/tuning.md). For many rows,
:class:`asyncllm.worker.quant_linear.Int4Linear` therefore dequantizes the packed weight into
a reused scratch buffer with this kernel and runs one bfloat16 GEMM, keeping only the int4
weight in memory.

The packed layout (``aten._convert_weight_to_int4pack_for_cpu(q_int32[N, K], 1)``, torch 2.13;
checked against the codes in tests/test_quantization.py): uint8 ``[N, K/2]`` read as
``[N/64, K, 32]``; byte ``[b, k, j]``'s low nibble is the code of row ``64b + j`` at column
``k``, its high nibble that of row ``64b + 32 + j``. Scales and zeros ``sz`` are
``[K/group, N, 2]`` (scale, zero) and ``w[n, k] = (q - 8) * scale + zero``, the int4 kernel's
own formula. Every 32-byte run of codes thus gives 64 consecutive entries of one row of
``W^T [K, N]``: the kernel streams the codes once and writes ``W^T`` contiguously.

Arithmetic: float32 (a bfloat16 scale widens exactly), the multiply and add rounded
separately (``-ffp-contract=off``: the same values as torch's float32 ``(q - 8) * s + z``),
then rounded once to the output dtype (bfloat16: to nearest even, as torch's ``.to()``).

Built once per machine by :mod:`asyncllm.worker.cpu_extension`
(``ASYNCLLM_INT4_DEQUANT_KERNEL=0`` turns it off); where it cannot be built,
``Int4Linear`` keeps the int4 kernel for every row count (correct, slower for many rows).
"""

from __future__ import annotations

import threading

import torch

from asyncllm.worker.cpu_extension import CpuExtension

__all__ = ["EXTENSION", "KERNEL_DTYPES", "dequantize_t", "supported"]

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>

static inline float to_f(float x) { return x; }
static inline float to_f(at::BFloat16 x) {  // exact: bfloat16 is float32's top half
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
static inline void put(float v, float* dst) { *dst = v; }
static inline void put(float v, at::BFloat16* dst) {  // round to nearest even (finite v)
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  dst->x = static_cast<uint16_t>(u >> 16);
}

// One row of 64 outputs from 32 code bytes p: o[j] from p[j]'s low nibble, o[32 + j] from
// its high nibble, with scales s and zeros z (float, 64 each).
template <typename T>
static inline void row64(const uint8_t* p, const float* s, const float* z, T* o) {
#pragma omp simd
  for (int j = 0; j < 32; ++j) {
    const float lo = static_cast<float>(static_cast<int>(p[j] & 15) - 8);
    const float hi = static_cast<float>(static_cast<int>(p[j] >> 4) - 8);
    put(lo * s[j] + z[j], o + j);
    put(hi * s[32 + j] + z[32 + j], o + 32 + j);
  }
}
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
// The same with AVX-512: vcvtne2ps2bf16 rounds to nearest even, as put() does.
template <>
inline void row64<at::BFloat16>(const uint8_t* p, const float* s, const float* z,
                                at::BFloat16* o) {
  const __m512i mask = _mm512_set1_epi32(15);
  const __m512 eight = _mm512_set1_ps(8.f);
  __m512 v[4];
  for (int h = 0; h < 2; ++h) {  // bytes 16h .. 16h + 15: rows 16h.. (lo), 32 + 16h.. (hi)
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * h)));
    const __m512 lo = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, mask)), eight);
    const __m512 hi = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), eight);
    v[h] = _mm512_add_ps(_mm512_mul_ps(lo, _mm512_load_ps(s + 16 * h)),
                         _mm512_load_ps(z + 16 * h));
    v[2 + h] = _mm512_add_ps(_mm512_mul_ps(hi, _mm512_load_ps(s + 32 + 16 * h)),
                             _mm512_load_ps(z + 32 + 16 * h));
  }
  _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
  _mm512_storeu_si512(o + 32, (__m512i)_mm512_cvtne2ps_pbh(v[3], v[2]));
}
#endif

// out [K, N] = W^T with W[n, k] = (q[n, k] - 8) * sz[k / group, n, 0] + sz[k / group, n, 1];
// packed uint8 [N / 64, K, 32] (torch's CPU int4pack layout), sz [K / group, N, 2] of T.
// A work item is one group of K rows times 64 output columns: 64 scales and zeros loaded
// once, then `group` rows of 32 code bytes each, 64 contiguous outputs per row.
template <typename T>
static void dequant(const at::Tensor& packed, const at::Tensor& sz, int64_t group,
                    at::Tensor& out) {
  const int64_t K = out.size(0), N = out.size(1), NB = N / 64, G = K / group;
  const uint8_t* P = packed.data_ptr<uint8_t>();
  const T* S = sz.data_ptr<T>();
  T* O = out.data_ptr<T>();
  at::parallel_for(0, G * NB, 4, [&](int64_t begin, int64_t end) {
    alignas(64) float s[64], z[64];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / NB, b = i % NB;
      const T* src = S + (g * N + b * 64) * 2;
      for (int j = 0; j < 64; ++j) {
        s[j] = to_f(src[2 * j]);
        z[j] = to_f(src[2 * j + 1]);
      }
      for (int64_t k = g * group; k < (g + 1) * group; ++k)
        row64<T>(P + (b * K + k) * 32, s, z, O + k * N + b * 64);
    }
  });
}

void int4_dequant_t(const at::Tensor& packed, const at::Tensor& sz, int64_t group,
                    at::Tensor& out) {
  const int64_t K = out.size(0), N = out.size(1);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && N % 64 == 0 && group > 0 &&
                  K % group == 0,
              "int4_dequant_t: out must be a contiguous [K, N] with N % 64 == 0, K % group == 0");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() * 2 == N * K,
              "int4_dequant_t: packed must be contiguous uint8 with N * K / 2 bytes");
  TORCH_CHECK(sz.scalar_type() == out.scalar_type() && sz.is_contiguous() && sz.dim() == 3 &&
                  sz.size(0) == K / group && sz.size(1) == N && sz.size(2) == 2,
              "int4_dequant_t: sz must be a contiguous [K / group, N, 2] of out's dtype");
  if (out.scalar_type() == at::kBFloat16) return dequant<at::BFloat16>(packed, sz, group, out);
  return dequant<float>(packed, sz, group, out);
}
"""

#: -ffp-contract=off: no fused multiply-add, so the values equal torch's float32 arithmetic.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
ENV_SWITCH = "ASYNCLLM_INT4_DEQUANT_KERNEL"
#: Scale and output dtypes the kernel handles (float16 layers keep the int4 kernel).
KERNEL_DTYPES = (torch.bfloat16, torch.float32)

EXTENSION = CpuExtension(
    "asyncllm_int4_dequant", _SOURCE, ["int4_dequant_t"], CFLAGS, "CPU int4 dequant kernel",
    ENV_SWITCH,
)  # fmt: skip
"""The kernel's build-once extension."""

_scratch = threading.local()


def supported(packed: torch.Tensor, sz: torch.Tensor, out_features: int) -> bool:
    """The kernel can dequantize this weight: on CPU, ``out_features`` a multiple of 64 (the
    packing's row block), scales of a :data:`KERNEL_DTYPES` dtype, and the kernel builds."""
    return (
        out_features % 64 == 0
        and packed.device.type == "cpu"
        and sz.dtype in KERNEL_DTYPES
        and EXTENSION.available()
    )


def dequantize_t(
    packed: torch.Tensor, sz: torch.Tensor, group_size: int, in_features: int, out_features: int
) -> torch.Tensor:
    """The dense ``W^T`` [in_features, out_features] in ``sz``'s dtype, written into this
    thread's scratch buffer for that shape and dtype (allocated once; the next call for the
    same shape overwrites it, so use the result before that).

    Args:
        packed: uint8 [out, in / 2] from ``aten._convert_weight_to_int4pack_for_cpu(q, 1)``.
        sz: [in / group_size, out, 2] scale and zero point per group, bfloat16 or float32.
        group_size: input columns per scale and zero point.

    Raises:
        RuntimeError: the kernel is unavailable (check :func:`supported` first).
    """
    mod = EXTENSION.load()
    if mod is None:
        raise RuntimeError(f"the int4 dequant kernel is unavailable: {EXTENSION.failure()}")
    bufs: dict[tuple[int, int, torch.dtype], torch.Tensor] = _scratch.__dict__.setdefault(
        "bufs", {}
    )
    key = (in_features, out_features, sz.dtype)
    out = bufs.get(key)
    if out is None:
        out = bufs[key] = torch.empty(in_features, out_features, dtype=sz.dtype)
    mod.int4_dequant_t(packed, sz, group_size, out)
    return out
