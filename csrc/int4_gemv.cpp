// The int4 linear layer's few-row path (a decode batch of 1 to 3): y [M, N] = rows [M, K] W^T
// straight from the int4 codes, on AVX-512 BF16 and VBMI; appended to int4_dequant.py's
// source (its int4_linear calls int4_gemv_rows).
//
// Layout (torch's CPU int4pack, see int4_dequant.py): uint8 [N / 64, K, 32]; byte [b, k, j]'s
// low nibble is the code of output 64b + j at column k, its high nibble that of 64b + 32 + j.
// sz [K / group, N, 2] bfloat16 (scale, zero); w[n, k] = (q - 8) * scale + zero.
//
// Per 64-output block and pair of columns (k, k + 1) one 64-byte load holds 128 codes;
// vpermb moves the code bytes of (n, k) and (n, k + 1) into the low bytes of adjacent words,
// vpermw looks up bfloat16(q - 8) from a word's low 5 bits (the low nibble needs no mask), and
// vdpbf16ps adds both products to output n's float32 lane: 6 vector instructions per 64
// codes, half of what converting every code to float32 costs (torch's int4 kernel, and the
// kernel tried in docs/tuning.md). Then per group: y += scale * sum (q - 8) x + zero * sum x.
// The products are exact in float32 (bfloat16 times a small integer), summed in float32.
#include "common.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
static constexpr bool gemv_built = true;

// bfloat16(q - 8) for a word's low 5 bits (codes 0..15, twice).
alignas(64) static const uint16_t gemv_table[32] = {
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0, 0x3F80, 0x4000,
    0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040,
    0xC000, 0xBF80, 0, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};
// vpermb indices: word 2i <- byte i (column k), word 2i + 1 <- byte 32 + i (column k + 1),
// for outputs i = 0..15 ([0]) and 16..31 ([1]); their high nibbles are outputs 32..63.
#define GEMV_PAIR(i) (uint8_t)(i), 0, (uint8_t)(32 + (i)), 0
alignas(64) static const uint8_t gemv_pairs[2][64] = {
    {GEMV_PAIR(0), GEMV_PAIR(1), GEMV_PAIR(2), GEMV_PAIR(3), GEMV_PAIR(4), GEMV_PAIR(5),
     GEMV_PAIR(6), GEMV_PAIR(7), GEMV_PAIR(8), GEMV_PAIR(9), GEMV_PAIR(10), GEMV_PAIR(11),
     GEMV_PAIR(12), GEMV_PAIR(13), GEMV_PAIR(14), GEMV_PAIR(15)},
    {GEMV_PAIR(16), GEMV_PAIR(17), GEMV_PAIR(18), GEMV_PAIR(19), GEMV_PAIR(20), GEMV_PAIR(21),
     GEMV_PAIR(22), GEMV_PAIR(23), GEMV_PAIR(24), GEMV_PAIR(25), GEMV_PAIR(26), GEMV_PAIR(27),
     GEMV_PAIR(28), GEMV_PAIR(29), GEMV_PAIR(30), GEMV_PAIR(31)}};
#undef GEMV_PAIR

// Bytes ahead of the code stream to prefetch: one core alone keeps too few misses in flight
// to stream the weights at the memory's speed (1.2x at batch 1 with it, measured here).
static constexpr int64_t GEMV_PREFETCH = 2048;

// Groups g0 .. g1 - 1 of block b for R rows X (bfloat16, row stride K; XS: their group sums)
// into Y (bfloat16 [R, N]) or, for a part of K, F (float32 partial sums [R, N]) when Y is null.
template <int R>
static void gemv_block(const at::BFloat16* X, const float* XS, int64_t K, int64_t group,
                       const uint8_t* P, const at::BFloat16* S, int64_t N, int64_t b,
                       int64_t g0, int64_t g1, at::BFloat16* Y, float* F) {
  const __m512i table = _mm512_load_si512(gemv_table);
  const __m512i pairs0 = _mm512_load_si512(gemv_pairs[0]);
  const __m512i pairs1 = _mm512_load_si512(gemv_pairs[1]);
  const __mmask64 low_bytes = 0x5555555555555555ull;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t G = K / group;
  __m512 y[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) y[r][i] = _mm512_setzero_ps();
  for (int64_t g = g0; g < g1; ++g) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
    const uint8_t* p = P + (b * K + g * group) * 32;
    for (int64_t k = g * group; k < (g + 1) * group; k += 2, p += 64) {
      _mm_prefetch((const char*)(p + GEMV_PREFETCH), _MM_HINT_T0);
      const __m512i codes = _mm512_loadu_si512(p);
      const __m512i c0 = _mm512_maskz_permutexvar_epi8(low_bytes, pairs0, codes);
      const __m512i c1 = _mm512_maskz_permutexvar_epi8(low_bytes, pairs1, codes);
      const __m512bh w[4] = {(__m512bh)_mm512_permutexvar_epi16(c0, table),
                             (__m512bh)_mm512_permutexvar_epi16(c1, table),
                             (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(c0, 4), table),
                             (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(c1, 4), table)};
      for (int r = 0; r < R; ++r) {
        int32_t x2;  // x[k], x[k + 1] as one bfloat16 pair
        std::memcpy(&x2, X + r * K + k, sizeof x2);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(x2);
        for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], w[i], xb);
      }
    }
    // 64 (scale, zero) pairs: lane j of vector i holds output 16i + j's; the next group's
    // are prefetched (they are N * 4 bytes apart).
    const at::BFloat16* src = S + (g * N + b * 64) * 2;
    if (g + 1 < g1)
      for (int i = 0; i < 4; ++i) _mm_prefetch((const char*)(src + 2 * N + 32 * i), _MM_HINT_T0);
    for (int i = 0; i < 4; ++i) {
      const __m512i v = _mm512_loadu_si512(src + 32 * i);
      const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      for (int r = 0; r < R; ++r)
        y[r][i] = _mm512_fmadd_ps(z, _mm512_set1_ps(XS[r * G + g]),
                                  _mm512_fmadd_ps(s, acc[r][i], y[r][i]));
    }
  }
  for (int r = 0; r < R; ++r) {
    if (Y != nullptr) {  // vcvtne2ps2bf16: round to nearest even
      for (int h = 0; h < 2; ++h)
        _mm512_storeu_si512(Y + r * N + b * 64 + 32 * h,
                            (__m512i)_mm512_cvtne2ps_pbh(y[r][2 * h + 1], y[r][2 * h]));
    } else {
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(F + r * N + b * 64 + 16 * i, y[r][i]);
    }
  }
}

static void gemv_rows(const at::BFloat16* A, int64_t M, int64_t K, int64_t group,
                      const uint8_t* P, const at::BFloat16* S, int64_t N, at::BFloat16* Y) {
  const int64_t G = K / group, NB = N / 64;
  // The rows' group sums, float32, in 16 lanes (a sum in order is one dependent add per
  // element): a 576 x 576 layer at 2 rows took 7.3 -> 6.7 us a call with the vector
  // rounding below.
  std::vector<float> XS(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const at::BFloat16* a = A + m * K + g * group;
      __m512 acc = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 16 <= group; k += 16) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + k));
        acc = _mm512_add_ps(acc, _mm512_cvtpbh_ps((__m256bh)h));
      }
      float sum = _mm512_reduce_add_ps(acc);
      for (; k < group; ++k) sum += static_cast<float>(a[k]);
      XS[m * G + g] = sum;
    }
  // Blocks that do not split evenly over the threads (N = 576: 9 blocks) are split in K too,
  // each part's float32 sums added at the end.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = (NB % threads != 0 && NB < 8 * threads && G >= 2) ? 2 : 1;
  std::vector<float> F(parts > 1 ? parts * M * N : 0);
  at::parallel_for(0, NB * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / parts, p = i % parts, g0 = G * p / parts, g1 = G * (p + 1) / parts;
      for (int64_t m0 = 0; m0 < M; m0 += 3) {
        const at::BFloat16* x = A + m0 * K;
        const float* xs = XS.data() + m0 * G;
        at::BFloat16* y = parts > 1 ? nullptr : Y + m0 * N;
        float* f = parts > 1 ? F.data() + (p * M + m0) * N : nullptr;
        switch (std::min<int64_t>(3, M - m0)) {
          case 1: gemv_block<1>(x, xs, K, group, P, S, N, b, g0, g1, y, f); break;
          case 2: gemv_block<2>(x, xs, K, group, P, S, N, b, g0, g1, y, f); break;
          default: gemv_block<3>(x, xs, K, group, P, S, N, b, g0, g1, y, f);
        }
      }
    }
  });
  for (int64_t i = 0; parts > 1 && i < M * N; i += 32) {  // M * N % 64 == 0; as above
    const float* f = F.data() + i;
    const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(f), _mm512_loadu_ps(f + M * N));
    const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(f + 16), _mm512_loadu_ps(f + M * N + 16));
    _mm512_storeu_si512(Y + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}
#else
static constexpr bool gemv_built = false;
static void gemv_rows(const at::BFloat16*, int64_t, int64_t, int64_t, const uint8_t*,
                      const at::BFloat16*, int64_t, at::BFloat16*) {}
#endif

int64_t int4_pack_block_n();  // int4_linear.cpp

// The few-row path runs for these arguments: built here (AVX-512 BF16 and VBMI), torch's
// 64-row packing, bfloat16 rows and scales, whole 64-output blocks, column pairs in a group.
bool int4_gemv_runs(const at::Tensor& sz, int64_t group, int64_t out_features) {
  return gemv_built && sz.scalar_type() == at::kBFloat16 && out_features % 64 == 0 &&
         group % 2 == 0 && int4_pack_block_n() == 64;
}

bool int4_gemv_available() { return gemv_built; }

// rows [M, K] bfloat16 -> y [M, N] bfloat16 (int4_linear calls it; tests call it directly).
at::Tensor int4_gemv(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& sz,
                     int64_t group, int64_t out_features) {
  TORCH_CHECK(int4_gemv_runs(sz, group, out_features),
              "int4_gemv: needs AVX-512 BF16 and VBMI, bfloat16 scales, out_features % 64 == 0 "
              "and an even group size");
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kBFloat16,
              "int4_gemv: rows must be a bfloat16 [M, K]");
  const int64_t K = rows.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() * 2 == out_features * K,
              "int4_gemv: packed must be contiguous uint8 with N * K / 2 bytes");
  TORCH_CHECK(K % group == 0 && sz.is_contiguous() && sz.dim() == 3 &&
                  sz.size(0) == K / group && sz.size(1) == out_features && sz.size(2) == 2,
              "int4_gemv: sz must be a contiguous [K / group, N, 2]");
  const at::Tensor r = rows.contiguous();
  at::Tensor y = at::empty({r.size(0), out_features}, r.options());
  if (r.size(0) > 0)
    gemv_rows(r.data_ptr<at::BFloat16>(), r.size(0), K, group, packed.data_ptr<uint8_t>(),
              sz.data_ptr<at::BFloat16>(), out_features, y.data_ptr<at::BFloat16>());
  return y;
}
