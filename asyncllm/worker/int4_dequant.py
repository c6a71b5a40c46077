"""The int4 linear layer in C++: a few-row kernel of our own (``int4_gemv.cpp``, 1-3 rows),
torch's int4 kernel up to 8 rows, dequantize-and-GEMM for more.

torch's int4 CPU kernel (``aten._weight_int4pack_mm_for_cpu``) is a matrix-vector kernel: its
cost grows linearly with the row count, so at a decode batch of 64 it is 4-5x slower than a
plain bfloat16 matmul on the same weight (docs/tuning.md). For many rows,
:class:`asyncllm.worker.quant_linear.Int4Linear` therefore multiplies with the dequantized
weight, keeping only the int4 weight in memory. The extension registers the whole layer as
one op, ``asyncllm_cpu::int4_linear`` (reshape, cast, the row-count choice, kernel, bias): a
decode step calls it 210 times with the default model, and the same steps in Python cost
about 20 us per call (4 ms of a 23 ms step at batch 1); compiled graphs call it too (its fake
implementation is registered by :func:`kernel`).

The many-row path (``int4_mm`` in the source) never writes the whole bfloat16 weight: a work
item is one 64-column block of ``W^T`` (the packing's row block) times up to 64 rows, and
items run block-major, so each thread dequantizes a block once into its own scratch
``[K, 64]`` (72 KiB at K = 576, 192 KiB at K = 1536: it stays in the core's L2), in the packed
("VNNI") layout of oneDNN's brgemm micro-kernel (``at::native::cpublas::brgemm``: AMX, or
``vdpbf16ps`` on AVX-512 BF16), and
multiplies it with the rows on the calling thread; with few blocks (N = 192) the rows are
split further so that both threads work. Dequantizing the whole weight and then calling one
``at::mm`` (the former path) wrote 2 bytes per weight to memory and read them back (about
212 MB per decode step); it remains where the CPU has no native bfloat16
(:data:`asyncllm.worker.cpu_extension.BRGEMM_BF16_SOURCE`) or the scales are float32. On a
Zen 5 EPYC without AMX the fused path is 1.5-2.7x the former at 4-64 rows
(``benchmarks/int4_many_rows.py``, docs/tuning.md).

The packed layout (``aten._convert_weight_to_int4pack_for_cpu(q_int32[N, K], 1)``, torch 2.13;
checked against the codes in tests/test_quantization.py): uint8 ``[N, K/2]`` read as
``[N/64, K, 32]``; byte ``[b, k, j]``'s low nibble is the code of row ``64b + j`` at column
``k``, its high nibble that of row ``64b + 32 + j``. Scales and zeros ``sz`` are
``[K/group, N, 2]`` (scale, zero) and ``w[n, k] = (q - 8) * scale + zero``, the int4 kernel's
own formula. Every 32-byte run of codes thus gives 64 consecutive entries of one row of
``W^T [K, N]``: the kernel streams the codes once and writes ``W^T`` contiguously.

Arithmetic: float32 (a bfloat16 scale widens exactly), the multiply and add rounded
separately (``-ffp-contract=off``: the same values as torch's float32 ``(q - 8) * s + z``),
then rounded once to the output dtype (bfloat16: to nearest even, as torch's ``.to()``): the
dequantized values are the same in both many-row paths. The GEMMs accumulate in float32 over
all of K and round once to bfloat16 (to nearest even); only their summation order differs.

The few-row kernel (``int4_gemv.cpp``, appended to this source; AVX-512 BF16 and VBMI) reads
the same packed codes: it pairs two columns' codes per output in registers and multiplies
them with bfloat16 pairs of the row (``vdpbf16ps``), half the instructions per code of
torch's kernel, which converts every code to float32 first; 1.3x at batch 1, see
:data:`asyncllm.worker.quant_linear.INT4_GEMV_MAX_ROWS`.

Built once per machine by :mod:`asyncllm.worker.cpu_extension`
(``ASYNCLLM_INT4_DEQUANT_KERNEL=0`` turns it off); where it cannot be built,
``Int4Linear`` keeps the int4 kernel for every row count (correct, slower for many rows).
"""

from __future__ import annotations

import pathlib
import threading
from typing import Any

import torch

from asyncllm.worker.cpu_extension import BRGEMM_BF16_SOURCE, CpuExtension

__all__ = [
    "EXTENSION",
    "fused_available",
    "gemv_available",
    "int4_linear_fake",
    "kernel",
    "op_available",
    "path_calls",
]

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <ATen/native/CPUBlas.h>
#include <algorithm>
#include <map>
#include <tuple>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

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
// AVX-512: the 16 codes bytes p's low nibbles times s_lo plus z_lo, and their high nibbles
// times s_hi plus z_hi, in float32. q - 8 is looked up by vpermps (which reads only a lane's
// low 4 bits: the low nibble needs no mask), then one fused multiply-add: (q - 8) * s is
// exact in float32 (4 by 8 significant bits), so it rounds once where mul + add would, to
// the same value.
static inline void nibbles16(const uint8_t* p, __m512 s_lo, __m512 z_lo, __m512 s_hi,
                             __m512 z_hi, __m512& lo, __m512& hi) {
  const __m512 table = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f,
                                      0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  lo = _mm512_fmadd_ps(_mm512_permutexvar_ps(c, table), s_lo, z_lo);
  hi = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), table), s_hi, z_hi);
}

// row64 with AVX-512: vcvtne2ps2bf16 rounds to nearest even, as put() does.
template <>
inline void row64<at::BFloat16>(const uint8_t* p, const float* s, const float* z,
                                at::BFloat16* o) {
  __m512 v[4];
  for (int h = 0; h < 2; ++h)  // bytes 16h .. 16h + 15: rows 16h.. (lo), 32 + 16h.. (hi)
    nibbles16(p + 16 * h, _mm512_load_ps(s + 16 * h), _mm512_load_ps(z + 16 * h),
              _mm512_load_ps(s + 32 + 16 * h), _mm512_load_ps(z + 32 + 16 * h), v[h], v[2 + h]);
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

static void check_dequant_args(const at::Tensor& packed, const at::Tensor& sz, int64_t group,
                               int64_t K, int64_t N, const char* who) {
  TORCH_CHECK(N % 64 == 0 && group > 0 && K % group == 0, who,
              ": out must be a contiguous [K, N] with N % 64 == 0, K % group == 0");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() * 2 == N * K,
              who, ": packed must be contiguous uint8 with N * K / 2 bytes");
  TORCH_CHECK((sz.scalar_type() == at::kBFloat16 || sz.scalar_type() == at::kFloat) &&
                  sz.is_contiguous() && sz.dim() == 3 && sz.size(0) == K / group &&
                  sz.size(1) == N && sz.size(2) == 2,
              who, ": sz must be a contiguous [K / group, N, 2] of bfloat16 or float32");
}

void int4_dequant_t(const at::Tensor& packed, const at::Tensor& sz, int64_t group,
                    at::Tensor& out) {
  const int64_t K = out.size(0), N = out.size(1);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(),
              "int4_dequant_t: out must be a contiguous [K, N] with N % 64 == 0, K % group == 0");
  check_dequant_args(packed, sz, group, K, N, "int4_dequant_t");
  TORCH_CHECK(sz.scalar_type() == out.scalar_type(),
              "int4_dequant_t: sz must be a contiguous [K / group, N, 2] of out's dtype");
  if (out.scalar_type() == at::kBFloat16) return dequant<at::BFloat16>(packed, sz, group, out);
  return dequant<float>(packed, sz, group, out);
}

// W^T's 64-column block b [K, 64] as brgemm's packed B (oneDNN's "pack32" (VNNI) layout
// for bfloat16: [K / 2][64][2], rows 2i and 2i + 1 interleaved), from the same values as row64.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
// AVX-512: rows k and k + 1 are rounded together and interleaved in registers, straight into
// the layout; the thread's next block (`next`, or -1) is prefetched into L2 meanwhile (one
// core alone keeps too few misses in flight to stream the codes at the memory's speed).
static void dequant_block_vnni(const uint8_t* P, const at::BFloat16* S, int64_t K, int64_t N,
                               int64_t group, int64_t b, int64_t next, at::BFloat16* out) {
  alignas(64) static const uint16_t interleave[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pair = _mm512_load_si512(interleave);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t g = 0; g < K / group; ++g) {
    // 64 (scale, zero) bfloat16 pairs: lane j of vector i holds column 16i + j's pair.
    const at::BFloat16* src = S + (g * N + b * 64) * 2;
    __m512 s[4], z[4];
    for (int i = 0; i < 4; ++i) {
      const __m512i v = _mm512_loadu_si512(src + 32 * i);
      s[i] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      z[i] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
    if (next >= 0)
      for (int i = 0; i < 4; ++i)
        _mm_prefetch((const char*)(S + (g * N + next * 64) * 2 + 32 * i), _MM_HINT_T1);
    for (int64_t k = g * group; k < (g + 1) * group; k += 2) {  // group is even
      const uint8_t* p = P + (b * K + k) * 32;  // rows k and k + 1: 32 code bytes each
      if (next >= 0) _mm_prefetch((const char*)(P + (next * K + k) * 32), _MM_HINT_T1);
      at::BFloat16* o = out + k * 64;
      for (int h = 0; h < 2; ++h) {  // bytes 16h..: columns 16h.. (low), 32 + 16h.. (high)
        __m512 l0, h0, l1, h1;
        nibbles16(p + 16 * h, s[h], z[h], s[2 + h], z[2 + h], l0, h0);
        nibbles16(p + 32 + 16 * h, s[h], z[h], s[2 + h], z[2 + h], l1, h1);
        _mm512_storeu_si512(o + 32 * h, _mm512_permutexvar_epi16(
                                            pair, (__m512i)_mm512_cvtne2ps_pbh(l1, l0)));
        _mm512_storeu_si512(o + 64 + 32 * h, _mm512_permutexvar_epi16(
                                                 pair, (__m512i)_mm512_cvtne2ps_pbh(h1, h0)));
      }
    }
  }
}
#else
static void dequant_block_vnni(const uint8_t* P, const at::BFloat16* S, int64_t K, int64_t N,
                               int64_t group, int64_t b, int64_t /*next*/, at::BFloat16* out) {
  alignas(64) float s[64], z[64];
  alignas(64) at::BFloat16 r[2][64];
  for (int64_t g = 0; g < K / group; ++g) {
    const at::BFloat16* src = S + (g * N + b * 64) * 2;
    for (int j = 0; j < 64; ++j) {
      s[j] = to_f(src[2 * j]);
      z[j] = to_f(src[2 * j + 1]);
    }
    for (int64_t k = g * group; k < (g + 1) * group; k += 2) {  // group is even
      row64<at::BFloat16>(P + (b * K + k) * 32, s, z, r[0]);
      row64<at::BFloat16>(P + (b * K + k + 1) * 32, s, z, r[1]);
      at::BFloat16* o = out + k * 64;
      for (int j = 0; j < 64; ++j) {
        o[2 * j] = r[0][j];
        o[2 * j + 1] = r[1][j];
      }
    }
  }
}
#endif

// 64 float32 accumulators to bfloat16, rounded to nearest even (as oneDNN's GEMM output).
static inline void store64(const float* c, at::BFloat16* o) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  for (int h = 0; h < 2; ++h)
    _mm512_storeu_si512(o + 32 * h, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(c + 32 * h + 16),
                                                                 _mm512_loadu_ps(c + 32 * h)));
#else
  for (int j = 0; j < 64; ++j) o[j] = at::BFloat16(c[j]);
#endif
}

// The fused many-row path is there: oneDNN's bfloat16 brgemm runs (AMX or AVX-512 BF16).
static bool fused_available() { return brgemm_bf16_runs(); }

// y [M, N] = rows [M, K] W^T (bfloat16), block by block without the whole W^T: a work item is
// one 64-column block of W^T times m_tile rows; items run block-major, so a thread's
// consecutive items share a block, dequantized once into the thread's scratch [K, 64] (72 or
// 192 KiB: stays in its L2) in brgemm's packed layout, then multiplied on the calling thread
// by oneDNN's brgemm micro-kernel (float32 accumulation over all of K, one bfloat16 rounding).
static void fused(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& sz,
                  int64_t group, int64_t m_tile, at::Tensor& y) {
  const int64_t M = rows.size(0), K = rows.size(1), N = y.size(1), NB = N / 64;
  int64_t MT = (M + m_tile - 1) / m_tile;
  // Few blocks (N = 192: 3) for the threads: split the rows further so that each thread
  // gets about the same work (a block then is dequantized by up to two threads).
  const int64_t threads = at::get_num_threads(), want = 2 * threads;
  if (NB * MT < want) MT = std::min((want + NB - 1) / NB, (M + 15) / 16);
  // An item count the threads do not divide leaves one thread idle at the end (N = 576: 9
  // blocks, 5 + 4 on 2 threads): split the rows further where a split of >= 16 rows evens it.
  // ``python benchmarks/int4_many_rows.py``, Zen 5, 2 threads: 32 rows 1.07x, 64 rows 1.01-1.03x.
  for (int64_t more = MT + 1; NB * MT % threads != 0 && more <= 2 * MT; ++more)
    if (NB * more % threads == 0 && M / more >= 16) MT = more;
  const int64_t mt = (M + MT - 1) / MT;
  MT = (M + mt - 1) / mt;
  const uint8_t* P = packed.data_ptr<uint8_t>();
  const at::BFloat16* S = sz.data_ptr<at::BFloat16>();
  const at::BFloat16* A = rows.data_ptr<at::BFloat16>();
  at::BFloat16* Y = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, NB * MT, 1, [&](int64_t begin, int64_t end) {
    thread_local at::Tensor wbuf, cbuf;  // grow to the largest K and row tile seen
    if (!wbuf.defined() || wbuf.numel() < K * 64) wbuf = at::empty({K * 64}, sz.options());
    if (!cbuf.defined() || cbuf.numel() < mt * 64) cbuf = at::empty({mt * 64}, at::kFloat);
    at::BFloat16* W = wbuf.data_ptr<at::BFloat16>();
    float* C = cbuf.data_ptr<float>();
    int64_t have = -1;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / MT, m0 = (i % MT) * mt, mr = std::min(mt, M - m0);
      if (b != have) {
        // The thread's next block (items are block-major) is prefetched meanwhile.
        const int64_t nb = std::min(end - 1, (b + 1) * MT) / MT;
        dequant_block_vnni(P, S, K, N, group, b, nb > b ? nb : -1, W);
        have = b;
      }
      at::native::cpublas::brgemm(mr, 64, K, K, 64, 64, false, A + m0 * K, W, C, true);
      for (int64_t r = 0; r < mr; ++r) store64(C + r * 64, Y + (m0 + r) * N + b * 64);
    }
    at::native::cpublas::brgemm_release();
  });
}

// The many-row path on its own (also for tests and benchmarks): rows [M, K] of the scales'
// dtype times the dequantized weight -> [M, N]. bfloat16 where brgemm runs: `fused` with
// m_tile rows per item; else (or with m_tile 0) the whole W^T into this thread's scratch and
// one at::mm.
at::Tensor int4_mm(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& sz,
                   int64_t group, int64_t out_features, int64_t m_tile) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == sz.scalar_type(),
              "int4_mm: rows must be [M, K] of the scales' dtype");
  TORCH_CHECK(m_tile >= 0, "int4_mm: m_tile must be >= 0");
  check_dequant_args(packed, sz, group, rows.size(1), out_features, "int4_mm");
  const at::Tensor r = rows.contiguous();
  if (m_tile > 0 && group % 2 == 0 && sz.scalar_type() == at::kBFloat16 && fused_available()) {
    at::Tensor y = at::empty({r.size(0), out_features}, r.options());
    if (r.size(0) > 0) fused(r, packed, sz, group, m_tile, y);
    return y;
  }
  thread_local std::map<std::tuple<int64_t, int64_t, int>, at::Tensor> scratch;
  at::Tensor& wt = scratch[{r.size(1), out_features, static_cast<int>(sz.scalar_type())}];
  if (!wt.defined()) wt = at::empty({r.size(1), out_features}, sz.options());
  int4_dequant_t(packed, sz, group, wt);
  return at::mm(r, wt);
}

bool int4_fused_available() { return fused_available(); }

// Rows per work item of the fused many-row path.
static constexpr int64_t M_TILE = 64;

// Calls per path of int4_linear: [0] torch's int4 kernel, [1] dequantize then GEMM, [2] the
// few-row kernel of int4_gemv.cpp.
static std::atomic<int64_t> path_calls[3];

std::vector<int64_t> int4_path_calls() {
  return {path_calls[0].load(), path_calls[1].load(), path_calls[2].load()};
}

bool int4_gemv_runs(const at::Tensor& sz, int64_t group, int64_t out_features);
at::Tensor int4_gemv(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& sz,
                     int64_t group, int64_t out_features);

// y = x W^T + b in x's shape and dtype (see int4_linear in quant_linear.py: the same steps).
// Up to gemv_rows rows int4_gemv.cpp's kernel where it runs; above max_rows rows (and
// N % 64 == 0, scales bfloat16 or float32) the weight is dequantized block by block and
// multiplied by a GEMM (int4_mm); else torch's int4 kernel.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                       const c10::optional<at::Tensor>& bias, int64_t group, int64_t in_features,
                       int64_t out_features, int64_t max_rows, int64_t gemv_rows) {
  const at::Tensor rows = x.reshape({-1, in_features}).to(sz.scalar_type());
  at::Tensor y;
  const bool dense_ok = out_features % 64 == 0 &&
      (sz.scalar_type() == at::kBFloat16 || sz.scalar_type() == at::kFloat);
  if (rows.size(0) > max_rows && dense_ok) {
    y = int4_mm(rows, packed, sz, group, out_features, M_TILE);
    ++path_calls[1];
  } else if (rows.size(0) <= gemv_rows && int4_gemv_runs(sz, group, out_features)) {
    y = int4_gemv(rows, packed, sz, group, out_features);
    ++path_calls[2];
  } else {
    y = at::_weight_int4pack_mm_for_cpu(rows, packed, group, sz);
    ++path_calls[0];
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out_features;
  y = y.view(shape).to(x.scalar_type());
  return bias.has_value() ? y + *bias : y;
}

TORCH_LIBRARY(asyncllm_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales_and_zeros, Tensor? bias, "
        "int group_size, int in_features, int out_features, int max_rows, int gemv_rows) "
        "-> Tensor");
  m.impl("int4_linear", c10::DispatchKey::CPU, TORCH_FN(int4_linear));
}
"""

#: -ffp-contract=off: no fused multiply-add, so the values equal torch's float32 arithmetic.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
ENV_SWITCH = "ASYNCLLM_INT4_DEQUANT_KERNEL"

_FUNCTIONS = [
    "int4_dequant_t",
    "int4_mm",
    "int4_gemv",
    "int4_fused_available",
    "int4_gemv_available",
    "int4_path_calls",
]
#: The few-row kernel (``int4_gemv.cpp`` beside this file, shipped as package data).
_GEMV_SOURCE = pathlib.Path(__file__).with_name("int4_gemv.cpp").read_text()
EXTENSION = CpuExtension(
    "asyncllm_int4_dequant",
    BRGEMM_BF16_SOURCE + _SOURCE + _GEMV_SOURCE,
    _FUNCTIONS,
    CFLAGS,
    "CPU int4 kernels",
    ENV_SWITCH,
)
"""The kernel's build-once extension."""

_fake_registered = False
_lock = threading.Lock()


def kernel(wait: bool = True) -> Any:
    """The built extension, or None where it is switched off or cannot be built (with
    ``wait=False`` also while it is being built: :meth:`CpuExtension.ready`); loading it
    registers the op ``asyncllm_cpu::int4_linear`` (a whole
    :class:`~asyncllm.worker.quant_linear.Int4Linear` call in C++, the row-count choice
    inside) and here its fake implementation. Cheap after the first call."""
    global _fake_registered
    if not EXTENSION.enabled():
        return None
    mod = EXTENSION.load() if wait else EXTENSION.ready()
    if mod is not None and not _fake_registered:
        with _lock:
            if not _fake_registered:
                torch.library.register_fake("asyncllm_cpu::int4_linear")(int4_linear_fake)
                _fake_registered = True
    return mod


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def op_available() -> bool:
    """``asyncllm_cpu::int4_linear`` can be called now (:func:`kernel`, never waiting for
    its build); a constant to Dynamo, which evaluates it once while tracing instead of
    tracing the extension's loading."""
    return kernel(wait=False) is not None


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def fused_available() -> bool:
    """The fused many-row path can run here (the extension built, native bfloat16 brgemm); a
    constant to Dynamo."""
    mod = kernel(wait=False)
    return mod is not None and bool(mod.int4_fused_available())


def int4_linear_fake(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    in_features: int,
    out_features: int,
    max_rows: int,
    gemv_rows: int,
) -> torch.Tensor:
    """The int4 linear ops' shape function for Dynamo (``asyncllm_cpu::int4_linear`` and its
    Python fallback ``asyncllm::int4_linear``, which share the signature): ``x [..., in]`` ->
    an empty ``[..., out_features]`` of ``x``'s dtype."""
    return x.new_empty((*x.shape[:-1], out_features))


def path_calls() -> tuple[int, int, int]:
    """Calls of ``asyncllm_cpu::int4_linear`` so far, per path: (torch's int4 kernel,
    dequantize then GEMM, the few-row kernel); zeros where the extension is not loaded."""
    mod = EXTENSION.load() if EXTENSION.enabled() else None
    if mod is None:
        return 0, 0, 0
    int4, dense, gemv = mod.int4_path_calls()
    return int(int4), int(dense), int(gemv)


def gemv_available() -> bool:
    """The few-row kernel (``int4_gemv.cpp``) is built here: AVX-512 BF16 and VBMI."""
    mod = kernel()
    return mod is not None and bool(mod.int4_gemv_available())
