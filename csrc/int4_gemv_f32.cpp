// The int4 linear layer's few-row path in float32: y [M, N] = rows [M, K] W^T for float32 rows
// and float32 scales and zeros (a GGUF file's float16 scales, exact), straight from the codes:
// what a float32 model's decode step runs (int4_linear in int4_linear.cpp calls it).
//
// w[n, k] = (q - 8) * scale + zero, so per group of columns
//   y[r, n] += scale[n] * sum_k q[n, k] x[r, k] + (zero[n] - 8 scale[n]) * sum_k x[r, k],
// all in float32 (the sums as fused multiply-adds): the function the weights define, as
// closely as float32 arithmetic computes it (torch's int4 kernel has no vectorized float32
// path: 15-70x slower than its bfloat16 one, which rounds the rows and scales to bfloat16).
//
// Layout: torch's CPU int4pack (int4_pack_block_n): 64 outputs of a column are 32 bytes of
// block [N / 64, K, 32] (low nibbles outputs 0..31, high 32..63), or two 16-byte runs of
// blocks [N / 32, K, 16] (low nibbles 0..15, high 16..31 of each). A work item is one tile of
// 64 outputs for all rows: its codes are read once, widened to 8 float vectors per column
// (AVX2: 8 lanes; AVX-512: 4 of 16 lanes), and multiplied into R rows' accumulators. Both
// vector paths compute each output with the same operations in the same order (the lanes
// are the outputs), so they agree bit for bit.
#include "common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

int64_t int4_pack_block_n();  // int4_linear.cpp

namespace {

constexpr int64_t TILE = 64;

// The tile's 64 codes of column k as floats 0..15, outputs in order: c[0..63].
#if defined(__AVX2__) && defined(__FMA__)
static inline void widen8(__m128i bytes8, __m256& out) {
  out = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8));
}

static inline void codes64(const uint8_t* P, int64_t K, int64_t t, int64_t k, int64_t block_n,
                           __m256 c[8]) {
  const __m128i nib = _mm_set1_epi8(0x0F);
  if (block_n == 64) {
    const uint8_t* p = P + (t * K + k) * 32;
    for (int h = 0; h < 2; ++h) {  // bytes 16h..16h+15: outputs 16h.. (lo), 32 + 16h.. (hi)
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h));
      const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
      widen8(lo, c[2 * h]);
      widen8(_mm_srli_si128(lo, 8), c[2 * h + 1]);
      widen8(hi, c[4 + 2 * h]);
      widen8(_mm_srli_si128(hi, 8), c[4 + 2 * h + 1]);
    }
  } else {  // block_n == 32: blocks 2t (outputs 0..31) and 2t + 1 (32..63)
    for (int h = 0; h < 2; ++h) {
      const uint8_t* p = P + ((2 * t + h) * K + k) * 16;
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
      widen8(lo, c[4 * h]);
      widen8(_mm_srli_si128(lo, 8), c[4 * h + 1]);
      widen8(hi, c[4 * h + 2]);
      widen8(_mm_srli_si128(hi, 8), c[4 * h + 3]);
    }
  }
}

template <int R>
static void tile_rows(const float* X, int64_t K, int64_t group, const uint8_t* P,
                      const float* SZ, int64_t N, int64_t t, int64_t block_n, float* Y) {
  alignas(32) float s[TILE], z8[TILE];
  __m256 tot[R][8], acc[R][8], c[8];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 8; ++i) tot[r][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / group; ++g) {
    const float* src = SZ + (g * N + t * TILE) * 2;
    for (int j = 0; j < TILE; ++j) {
      s[j] = src[2 * j];
      z8[j] = src[2 * j + 1] - 8.f * src[2 * j];  // exact for float16-derived scales
    }
    float xs[R];
    for (int r = 0; r < R; ++r) {
      xs[r] = 0.f;
      for (int i = 0; i < 8; ++i) acc[r][i] = _mm256_setzero_ps();
    }
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      codes64(P, K, t, k, block_n, c);
      for (int r = 0; r < R; ++r) {
        const float xv = X[r * K + k];
        xs[r] += xv;
        const __m256 xb = _mm256_set1_ps(xv);
        for (int i = 0; i < 8; ++i) acc[r][i] = _mm256_fmadd_ps(c[i], xb, acc[r][i]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_set1_ps(xs[r]);
      for (int i = 0; i < 8; ++i) {
        const __m256 part = _mm256_fmadd_ps(_mm256_load_ps(z8 + 8 * i), xb,
                                            _mm256_mul_ps(_mm256_load_ps(s + 8 * i), acc[r][i]));
        tot[r][i] = _mm256_add_ps(tot[r][i], part);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(Y + r * N + t * TILE + 8 * i, tot[r][i]);
}
#else
// Portable: the same sums, output by output.
static inline int code_at(const uint8_t* P, int64_t K, int64_t t, int64_t k, int64_t block_n,
                          int j) {
  if (block_n == 64) {
    const uint8_t b = P[(t * K + k) * 32 + (j & 31)];
    return j < 32 ? (b & 15) : (b >> 4);
  }
  const int h = j / 32, jj = j % 32;
  const uint8_t b = P[((2 * t + h) * K + k) * 16 + (jj & 15)];
  return jj < 16 ? (b & 15) : (b >> 4);
}

template <int R>
static void tile_rows(const float* X, int64_t K, int64_t group, const uint8_t* P,
                      const float* SZ, int64_t N, int64_t t, int64_t block_n, float* Y) {
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < TILE; ++j) {
      float tot = 0.f;
      for (int64_t g = 0; g < K / group; ++g) {
        const float s = SZ[(g * N + t * TILE + j) * 2], z = SZ[(g * N + t * TILE + j) * 2 + 1];
        float acc = 0.f, xs = 0.f;
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
          const float xv = X[r * K + k];
          acc = std::fma(static_cast<float>(code_at(P, K, t, k, block_n, j)), xv, acc);
          xs += xv;
        }
        tot += std::fma(z - 8.f * s, xs, s * acc);
      }
      Y[r * N + t * TILE + j] = tot;
    }
  }
}
#endif

#if defined(__AVX512F__)
// The tile's 64 codes of column k as floats 0..15 in four 16-lane vectors, outputs in order.
static inline void codes64_512(const uint8_t* P, int64_t K, int64_t t, int64_t k,
                               int64_t block_n, __m512 c[4]) {
  const __m512i nib = _mm512_set1_epi32(0x0F);
  for (int h = 0; h < 2; ++h) {
    // block_n 64: bytes 16h.. hold outputs 16h.. (low nibbles) and 32 + 16h.. (high);
    // block_n 32: block 2t + h's 16 bytes hold outputs 32h.. (low) and 32h + 16.. (high).
    const uint8_t* p = block_n == 64 ? P + (t * K + k) * 32 + 16 * h
                                     : P + ((2 * t + h) * K + k) * 16;
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, nib));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    if (block_n == 64) {
      c[h] = lo;
      c[2 + h] = hi;
    } else {
      c[2 * h] = lo;
      c[2 * h + 1] = hi;
    }
  }
}

// tile_rows with 16-lane vectors: R rows' accumulators (4R registers) and the codes (4) fit
// AVX-512's 32 registers up to R = 6; the totals, added once per group, stay in memory.
template <int R>
static void tile_rows512(const float* X, int64_t K, int64_t group, const uint8_t* P,
                         const float* SZ, int64_t N, int64_t t, int64_t block_n, float* Y) {
  alignas(64) float s[TILE], z8[TILE], tot[R][TILE];
  __m512 acc[R][4], c[4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) _mm512_store_ps(tot[r] + 16 * i, _mm512_setzero_ps());
  for (int64_t g = 0; g < K / group; ++g) {
    const float* src = SZ + (g * N + t * TILE) * 2;
    for (int j = 0; j < TILE; ++j) {
      s[j] = src[2 * j];
      z8[j] = src[2 * j + 1] - 8.f * src[2 * j];  // exact for float16-derived scales
    }
    float xs[R];
    for (int r = 0; r < R; ++r) {
      xs[r] = 0.f;
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
    }
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      codes64_512(P, K, t, k, block_n, c);
      for (int r = 0; r < R; ++r) {
        const float xv = X[r * K + k];
        xs[r] += xv;
        const __m512 xb = _mm512_set1_ps(xv);
        for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_fmadd_ps(c[i], xb, acc[r][i]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(xs[r]);
      for (int i = 0; i < 4; ++i) {
        const __m512 part = _mm512_fmadd_ps(_mm512_load_ps(z8 + 16 * i), xb,
                                            _mm512_mul_ps(_mm512_load_ps(s + 16 * i), acc[r][i]));
        _mm512_store_ps(tot[r] + 16 * i, _mm512_add_ps(_mm512_load_ps(tot[r] + 16 * i), part));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i)
      _mm512_storeu_ps(Y + r * N + t * TILE + 16 * i, _mm512_load_ps(tot[r] + 16 * i));
}

// Up to six rows at a time share one read of the tile's codes: a speculative step's 5 rows
// (k = 4) read them once.
static void rows_of_tile(const float* X, int64_t M, int64_t K, int64_t group, const uint8_t* P,
                         const float* SZ, int64_t N, int64_t t, int64_t block_n, float* Y) {
  int64_t r = 0;
  for (; r + 6 <= M; r += 6)
    tile_rows512<6>(X + r * K, K, group, P, SZ, N, t, block_n, Y + r * N);
  switch (M - r) {
    case 5: tile_rows512<5>(X + r * K, K, group, P, SZ, N, t, block_n, Y + r * N); break;
    case 4: tile_rows512<4>(X + r * K, K, group, P, SZ, N, t, block_n, Y + r * N); break;
    case 3: tile_rows512<3>(X + r * K, K, group, P, SZ, N, t, block_n, Y + r * N); break;
    case 2: tile_rows512<2>(X + r * K, K, group, P, SZ, N, t, block_n, Y + r * N); break;
    case 1: tile_rows512<1>(X + r * K, K, group, P, SZ, N, t, block_n, Y + r * N); break;
    default: break;
  }
}
#else
// Two rows at a time share one read of the tile's codes (at four, the accumulators outgrow
// AVX2's 16 registers: 4 rows took 2x the time of 2, benchmarks/int4_f32.py).
static void rows_of_tile(const float* X, int64_t M, int64_t K, int64_t group, const uint8_t* P,
                         const float* SZ, int64_t N, int64_t t, int64_t block_n, float* Y) {
  int64_t r = 0;
  for (; r + 2 <= M; r += 2) tile_rows<2>(X + r * K, K, group, P, SZ, N, t, block_n, Y + r * N);
  if (r < M) tile_rows<1>(X + r * K, K, group, P, SZ, N, t, block_n, Y + r * N);
}
#endif

}  // namespace

// Whether int4_gemv_f32 runs for these arguments: float32 scales, whole 64-output tiles, a
// packed layout this file reads.
bool int4_gemv_f32_runs(const at::Tensor& sz, int64_t out_features) {
  return sz.scalar_type() == at::kFloat && out_features % TILE == 0 && int4_pack_block_n() != 0;
}

// rows [M, K] float32 -> y [M, N] float32 (int4_linear calls it; tests call it directly).
at::Tensor int4_gemv_f32(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& sz,
                         int64_t group, int64_t out_features) {
  TORCH_CHECK(int4_gemv_f32_runs(sz, out_features),
              "int4_gemv_f32: needs float32 scales, out_features % 64 == 0 and a known layout");
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat,
              "int4_gemv_f32: rows must be a float32 [M, K]");
  const int64_t M = rows.size(0), K = rows.size(1), N = out_features;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() * 2 == N * K,
              "int4_gemv_f32: packed must be contiguous uint8 with N * K / 2 bytes");
  TORCH_CHECK(group > 0 && K % group == 0 && sz.is_contiguous() && sz.dim() == 3 &&
                  sz.size(0) == K / group && sz.size(1) == N && sz.size(2) == 2,
              "int4_gemv_f32: sz must be a contiguous [K / group, N, 2]");
  const at::Tensor r = rows.contiguous();
  at::Tensor y = at::empty({M, N}, r.options());
  if (M == 0) return y;
  const float* X = r.data_ptr<float>();
  const float* SZ = sz.data_ptr<float>();
  const uint8_t* P = packed.data_ptr<uint8_t>();
  float* Y = y.data_ptr<float>();
  const int64_t block_n = int4_pack_block_n();
  at::parallel_for(0, N / TILE, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rows_of_tile(X, M, K, group, P, SZ, N, t, block_n, Y);
  });
  return y;
}
