// The int4 linear layer's few-row path in float32: y [M, N] = rows [M, K] W^T for float32 rows
// and float32 scales and zeros (a GGUF file's float16 scales, exact), straight from the codes:
// what a float32 model's decode step runs (int4_linear in int4_linear.cpp calls it).
//
// w[n, k] = q * scale + offset, so per group of columns
//   y[r, n] += scale[n] * sum_k q[n, k] x[r, k] + offset[n] * sum_k x[r, k],
// all in float32 (the sums as fused multiply-adds): the function the weights define, as
// closely as float32 arithmetic computes it (torch's int4 kernel has no vectorized float32
// path: 15-70x slower than its bfloat16 one, which rounds the rows and scales to bfloat16).
//
// Layout: codes in torch's CPU int4pack (int4_pack_block_n): 64 outputs of a column are 32
// bytes of block [N / 64, K, 32] (low nibbles outputs 0..31, high 32..63), or two 16-byte runs
// of blocks [N / 32, K, 16] (low nibbles 0..15, high 16..31 of each). Scales and offsets are
// tile-major, [N / 64, K / group, 2, 64] (a group's 64 scales, then its 64 offsets): a tile's
// are one run beside its codes, where torch's [K / group, N, 2] layout has them in 512-byte
// pieces a row of N apart (docs/tuning.md, "Native forward"). A work item is one tile of 64
// outputs for all rows: its codes are read once, widened to 8 float vectors per column
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

#if defined(__AVX2__) && defined(__FMA__)
// The codes this many bytes ahead of a tile's column k are prefetched, every 64 bytes (a core
// alone keeps too few misses in flight to stream them at the memory's speed).
constexpr int64_t PREFETCH_BYTES = 2048;

static inline void prefetch_codes(const uint8_t* P, int64_t K, int64_t t, int64_t k,
                                  int64_t block_n) {
  const auto at = [](const uint8_t* p) {
    _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_BYTES), _MM_HINT_T0);
  };
  if (block_n == 64 && k % 2 == 0) {
    at(P + (t * K + k) * 32);
  } else if (block_n != 64 && k % 4 == 0) {
    at(P + (2 * t * K + k) * 16);
    at(P + ((2 * t + 1) * K + k) * 16);
  }
}

// A tile loop's vector width: 8 float32 lanes (AVX2) or 16 (AVX-512), and the tile's 64 codes
// of column k as floats 0..15 in TILE / LANES vectors, outputs in order. Layouts: block_n
// 64: bytes 16h.. of the column hold outputs 16h.. (low nibbles) and 32 + 16h.. (high);
// block_n 32: block 2t + h's 16 bytes hold outputs 32h.. (low) and 32h + 16.. (high).
struct Lanes8 {
  using V = __m256;
  static constexpr int LANES = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V load(const float* p) { return _mm256_load_ps(p); }
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_store_ps(p, v); }
  static void storeu(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void codes(const uint8_t* P, int64_t K, int64_t t, int64_t k, int64_t block_n,
                    V c[8]) {
    const __m128i nib = _mm_set1_epi8(0x0F);
    const auto widen8 = [](__m128i bytes8) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8));
    };
    // 16 bytes: low nibbles to lo0 (bytes 0..7) and lo1, high nibbles to hi0 and hi1
    const auto split = [&](const uint8_t* p, V& lo0, V& lo1, V& hi0, V& hi1) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
      lo0 = widen8(lo), lo1 = widen8(_mm_srli_si128(lo, 8));
      hi0 = widen8(hi), hi1 = widen8(_mm_srli_si128(hi, 8));
    };
    if (block_n == 64) {  // constant indices: the code vectors stay in registers
      const uint8_t* p = P + (t * K + k) * 32;
      split(p, c[0], c[1], c[4], c[5]);
      split(p + 16, c[2], c[3], c[6], c[7]);
    } else {
      split(P + (2 * t * K + k) * 16, c[0], c[1], c[2], c[3]);
      split(P + ((2 * t + 1) * K + k) * 16, c[4], c[5], c[6], c[7]);
    }
  }
};

#if defined(__AVX512F__)
// GCC 12 takes the _mm512_undefined_* operand inside these intrinsics for a variable that
// "may be used uninitialized" once they are inlined here: a false warning.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
struct Lanes16 {
  using V = __m512;
  static constexpr int LANES = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V load(const float* p) { return _mm512_load_ps(p); }
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_store_ps(p, v); }
  static void storeu(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void codes(const uint8_t* P, int64_t K, int64_t t, int64_t k, int64_t block_n,
                    V c[4]) {
    const __m512i nib = _mm512_set1_epi32(0x0F);
    // 16 bytes widened once to 32-bit lanes, the nibbles split there
    const auto split = [&](const uint8_t* p, V& lo, V& hi) {
      const __m512i b =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, nib));
      hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    };
    if (block_n == 64) {  // constant indices: the code vectors stay in registers
      const uint8_t* p = P + (t * K + k) * 32;
      split(p, c[0], c[2]);
      split(p + 16, c[1], c[3]);
    } else {
      split(P + (2 * t * K + k) * 16, c[0], c[1]);
      split(P + ((2 * t + 1) * K + k) * 16, c[2], c[3]);
    }
  }
};
#pragma GCC diagnostic pop
// 4R accumulators and 4 code vectors fit AVX-512's 32 registers up to 6 rows.
using Vec = Lanes16;
constexpr int MAX_ROWS = 6;
#else
// At four rows the accumulators outgrow AVX2's 16 registers: 4 rows took 2x the time of 2
// (benchmarks/int4_f32.py).
using Vec = Lanes8;
constexpr int MAX_ROWS = 2;
#endif

// R rows of one tile: per group, each row's sum of codes times x (one FMA chain per lane)
// and sum of x, then the tile's totals (in memory: they change once per group) gain
// scale * sum q x + offset * sum x. Each output lane runs these operations in this order at
// either width, so both widths give the same bits.
template <class L, int R>
static void tile_rows(const float* X, int64_t K, int64_t group, const uint8_t* P,
                      const float* SZ, int64_t N, int64_t t, int64_t block_n, float* Y) {
  constexpr int NV = TILE / L::LANES;
  alignas(64) float tot[R][TILE];
  typename L::V acc[R][NV], c[NV];
  const int64_t G = K / group;
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) L::store(tot[r] + L::LANES * i, L::zero());
  for (int64_t g = 0; g < G; ++g) {
    const float* s = SZ + (t * G + g) * 2 * TILE;  // 64 scales, then 64 offsets
    float xs[R];
    for (int r = 0; r < R; ++r) {
      xs[r] = 0.f;
      for (int i = 0; i < NV; ++i) acc[r][i] = L::zero();
    }
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      prefetch_codes(P, K, t, k, block_n);
      L::codes(P, K, t, k, block_n, c);
      for (int r = 0; r < R; ++r) {
        const float xv = X[r * K + k];
        xs[r] += xv;
        const typename L::V xb = L::set1(xv);
        for (int i = 0; i < NV; ++i) acc[r][i] = L::fma(c[i], xb, acc[r][i]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const typename L::V xb = L::set1(xs[r]);
      for (int i = 0; i < NV; ++i) {
        float* t_ri = tot[r] + L::LANES * i;
        const typename L::V part = L::fma(L::loadu(s + TILE + L::LANES * i), xb,
                                          L::mul(L::loadu(s + L::LANES * i), acc[r][i]));
        L::store(t_ri, L::add(L::load(t_ri), part));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i)
      L::storeu(Y + r * N + t * TILE + L::LANES * i, L::load(tot[r] + L::LANES * i));
}

// The last M < MAX_ROWS rows in one pass (R counts down to M).
template <int R>
static void rest_of_tile(const float* X, int64_t M, int64_t K, int64_t group, const uint8_t* P,
                         const float* SZ, int64_t N, int64_t t, int64_t block_n, float* Y) {
  if (M == R) return tile_rows<Vec, R>(X, K, group, P, SZ, N, t, block_n, Y);
  if constexpr (R > 1) rest_of_tile<R - 1>(X, M, K, group, P, SZ, N, t, block_n, Y);
}

// Up to MAX_ROWS rows at a time share one read of the tile's codes (on AVX-512 a
// speculative step's 5 rows, k = 4, read them once).
static void rows_of_tile(const float* X, int64_t M, int64_t K, int64_t group, const uint8_t* P,
                         const float* SZ, int64_t N, int64_t t, int64_t block_n, float* Y) {
  int64_t r = 0;
  for (; r + MAX_ROWS <= M; r += MAX_ROWS)
    tile_rows<Vec, MAX_ROWS>(X + r * K, K, group, P, SZ, N, t, block_n, Y + r * N);
  if (r < M)
    rest_of_tile<MAX_ROWS - 1>(X + r * K, M - r, K, group, P, SZ, N, t, block_n, Y + r * N);
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

static void rows_of_tile(const float* X, int64_t M, int64_t K, int64_t group, const uint8_t* P,
                         const float* SZ, int64_t N, int64_t t, int64_t block_n, float* Y) {
  for (int64_t r = 0; r < M; ++r) {
    for (int j = 0; j < TILE; ++j) {
      float tot = 0.f;
      for (int64_t g = 0; g < K / group; ++g) {
        const float* sz = SZ + (t * (K / group) + g) * 2 * TILE;
        const float s = sz[j], o = sz[TILE + j];
        float acc = 0.f, xs = 0.f;
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
          const float xv = X[r * K + k];
          acc = std::fma(static_cast<float>(code_at(P, K, t, k, block_n, j)), xv, acc);
          xs += xv;
        }
        tot += std::fma(o, xs, s * acc);
      }
      Y[r * N + t * TILE + j] = tot;
    }
  }
}
#endif

}  // namespace

// Whether int4_gemv_f32 runs for these arguments: float32 scales and offsets in the
// tile-major layout, whole 64-output tiles, a packed layout this file reads.
bool int4_gemv_f32_runs(const at::Tensor& sz, int64_t out_features) {
  return sz.scalar_type() == at::kFloat && sz.dim() == 4 && out_features % TILE == 0 &&
         int4_pack_block_n() != 0;
}

// rows [M, K] float32 -> y [M, N] float32 (int4_linear calls it; tests call it directly).
at::Tensor int4_gemv_f32(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& sz,
                         int64_t group, int64_t out_features) {
  TORCH_CHECK(int4_gemv_f32_runs(sz, out_features),
              "int4_gemv_f32: needs tile-major float32 scales, out_features % 64 == 0 and a "
              "known layout");
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat,
              "int4_gemv_f32: rows must be a float32 [M, K]");
  const int64_t M = rows.size(0), K = rows.size(1), N = out_features;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() * 2 == N * K,
              "int4_gemv_f32: packed must be contiguous uint8 with N * K / 2 bytes");
  TORCH_CHECK(group > 0 && K % group == 0 && sz.is_contiguous() && sz.size(0) == N / TILE &&
                  sz.size(1) == K / group && sz.size(2) == 2 && sz.size(3) == TILE,
              "int4_gemv_f32: sz must be a contiguous [N / 64, K / group, 2, 64]");
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
