#include "common.h"
#include "python_module.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// A float to the output type; at::BFloat16 rounds to nearest even, as torch's .to() does.
template <typename T>
static inline T from_f(float x) { return static_cast<T>(x); }

// Positions per tile: a tile's scores are computed (one vector of 16) before its softmax.
constexpr int64_t TILE = 16;

// An int8 KV cache (asyncllm/attention/kv_int8.py): a token's row of one KV head is D int8
// codes followed by its float16 scale (2 bytes), the value code * scale. Caches of type C =
// int8_t are read in that layout: row_extra<C>() more elements per row, each row's values
// widened with its scale (K) or its scale folded into the softmax weight (V).
template <typename C>
constexpr bool is_q8 = std::is_same<C, int8_t>::value;
template <typename C>
constexpr int64_t row_extra() { return is_q8<C> ? 2 : 0; }
static inline float to_f(int8_t x) { return static_cast<float>(x); }

// IEEE float16 bits -> float (exact). Integer arithmetic and one exact product: this file
// builds with -ffast-math, which must not change the bits of a scale.
static inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m * 2^-24, a normal float (exact)
    const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  const uint32_t bits = sign | (e == 31 ? 0x7f800000u : (e + 112) << 23) | (m << 13);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A float -> IEEE float16 bits, rounded to nearest even (as torch's .to(torch.float16));
// at least 65520 in magnitude gives infinity. Integer arithmetic only (see half_to_float).
static inline uint16_t half_bits(float f) {
  uint32_t w;
  std::memcpy(&w, &f, sizeof w);
  const uint16_t sign = static_cast<uint16_t>((w >> 16) & 0x8000u);
  w &= 0x7fffffffu;
  if (w > 0x7f800000u) return sign | 0x7e00u;                // NaN
  if (w >= 0x477ff000u) return sign | 0x7c00u;               // rounds past 65504: infinity
  if (w >= 0x38800000u)                                      // >= 2^-14: a normal half
    return sign | static_cast<uint16_t>((w + 0xfffu + ((w >> 13) & 1u) - 0x38000000u) >> 13);
  const int shift = 126 - static_cast<int>(w >> 23);         // subnormal: mant * 2^-shift
  if (shift > 24) return sign;                               // below 2^-25 (2^-25 ties to 0)
  const uint32_t mant = (w & 0x7fffffu) | 0x800000u;
  const uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
  return sign | static_cast<uint16_t>(q + (rem > half || (rem == half && (q & 1u))));
}

// The scale of the row at x (D codes): 1 for a float or bfloat16 cache.
template <typename C>
static inline float row_scale(const C* x, int64_t D) {
  if constexpr (is_q8<C>) {
    uint16_t s;
    std::memcpy(&s, x + D, sizeof s);
    return half_to_float(s);
  } else {
    (void)x;
    (void)D;
    return 1.f;
  }
}

// Which of a tile's scores each of its rows sees, and what is done to them first: row g
// sees positions lo[g] .. hi[g] - 1 of the tile (lo null: from 0; hi null: all n; the
// causal mask's diagonal sets hi, a sliding window lo), the others get weight 0; with cap > 0
// a score s becomes cap * tanh(s / cap) (attention logit soft-capping, Gemma 2) before the
// softmax.
struct Visible {
  const int64_t* lo = nullptr;
  const int64_t* hi = nullptr;
  float cap = 0.f;
};

// Soft-capping of n scores in place (scalar tanh: only soft-capped models pay for it).
static inline void soft_cap(float* __restrict s, int64_t n, float cap) {
  if (cap > 0.f)
    for (int64_t t = 0; t < n; ++t) s[t] = cap * std::tanh(s[t] / cap);
}

// The online softmax of one query row over its next n scores sg[0..n), of which lo .. nv - 1
// are visible (the rest get weight 0): sg becomes the weights exp(s - max); returns the
// factor the row's earlier accumulator is scaled by.
static inline float softmax_update(float* __restrict sg, int64_t n, int64_t lo, int64_t nv,
                                   float& m, float& l) {
  float mx = m;
  for (int64_t t = lo; t < nv; ++t) mx = std::max(mx, sg[t]);
  const float c = std::exp(m - mx);
  float sum = 0.f;
  for (int64_t t = 0; t < lo; ++t) sg[t] = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = lo; t < nv; ++t) {
    sg[t] = std::exp(sg[t] - mx);  // vectorized (libmvec) under -ffast-math
    sum += sg[t];
  }
  for (int64_t t = std::max(lo, nv); t < n; ++t) sg[t] = 0.f;
  l = l * c + sum;
  m = mx;
  return c;
}

// Prefetch n rows of D elements (row stride `stride`) at x, unless x is null: the next
// block's, whose address is data-dependent (the block table), so the hardware prefetcher
// cannot run ahead of a block boundary.
template <typename T>
static inline void prefetch_rows(const T* x, int64_t stride, int64_t n, int64_t D) {
  constexpr int64_t LINE = 64 / sizeof(T);  // elements per 64-byte cache line
  if (x != nullptr)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t e = 0; e < D; e += LINE) __builtin_prefetch(x + t * stride + e);
}

// n <= TILE rows of D elements (row stride `stride`) as float: the rows themselves for a
// float cache, else widened once into buf [n, D] (not once per query head; int8 codes times
// their row's scale); *rs: row stride.
template <typename T>
static inline const float* rows_f(const T* x, int64_t stride, int64_t n, int64_t D,
                                  float* __restrict buf, int64_t* rs) {
  if constexpr (std::is_same<T, float>::value) {
    *rs = stride;
    return x;
  } else if constexpr (is_q8<T>) {
    for (int64_t t = 0; t < n; ++t) {
      const float sc = row_scale(x + t * stride, D);
      for (int64_t d = 0; d < D; ++d) buf[t * D + d] = to_f(x[t * stride + d]) * sc;
    }
    *rs = D;
    return buf;
  } else {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < D; ++d) buf[t * D + d] = to_f(x[t * stride + d]);
    *rs = D;
    return buf;
  }
}

// One tile of one KV head for its G query rows (the query heads that share the KV head, or
// in a prefill those of several query tokens): n <= TILE positions whose K and V rows
// start at k and v (row stride `stride`), of which row g sees those `vis` says; qv [G, D]
// the scaled queries, acc [G, D], m [G], l [G] the rows' running
// state; buf [TILE, D], s [G, TILE], c [G] scratch. Portable C++
// (auto-vectorized); tile_avx512 below is the same with the G heads' accumulators in
// registers.
template <typename T, int64_t DC>
static void tile_portable(const float* __restrict qv, const T* k, const T* v, const T* kn,
                          const T* vn, int64_t stride, int64_t n, Visible vis,
                          int64_t G, int64_t D_, float* __restrict buf,
                          float* __restrict s, float* __restrict c, float* __restrict acc,
                          float* __restrict m, float* __restrict l) {
  const int64_t D = DC > 0 ? DC : D_;
  int64_t ks, vs;
  prefetch_rows(kn, stride, n, D);
  const float* kr = rows_f(k, stride, n, D, buf, &ks);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t t = 0; t < n; ++t) {
      const float* qg = qv + g * D;
      const float* kt = kr + t * ks;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * kt[d];
      s[g * TILE + t] = dot;
    }
  for (int64_t g = 0; g < G; ++g) {
    soft_cap(s + g * TILE, n, vis.cap);
    c[g] = softmax_update(s + g * TILE, n, vis.lo ? vis.lo[g] : 0, vis.hi ? vis.hi[g] : n,
                          m[g], l[g]);
    float* ag = acc + g * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) ag[d] *= c[g];
  }
  prefetch_rows(vn, stride, n, D);
  const float* vr = rows_f(v, stride, n, D, buf, &vs);  // K's rows are no longer needed
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const float e = s[g * TILE + t];
      const float* vt = vr + t * vs;
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += e * vt[d];
    }
}

#if defined(__AVX512F__)
// 16 elements as float (a bfloat16 widens exactly: zero-extend, shift left 16).
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16(const int8_t* p) {  // int8 codes, not yet scaled
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
// n rows of D = 16 * NC elements widened to float into buf [n, D] (int8 codes times their
// row's scale), the next rows at kn (or null) prefetched.
template <int NC, typename T>
static inline void widen_rows(const T* k, const T* kn, int64_t stride, int64_t n,
                              float* __restrict buf) {
  constexpr int64_t D = 16 * NC, LINE = 64 / sizeof(T);
  for (int64_t t = 0; t < n; ++t) {
    if (kn != nullptr)
      for (int64_t e = 0; e < D; e += LINE) __builtin_prefetch(kn + t * stride + e);
    const __m512 sc = _mm512_set1_ps(row_scale(k + t * stride, D));
    for (int i = 0; i < NC; ++i) {
      __m512 x = load16(k + t * stride + 16 * i);
      if constexpr (is_q8<T>) x = _mm512_mul_ps(x, sc);
      _mm512_storeu_ps(buf + t * D + 16 * i, x);
    }
  }
}
static inline __m512 unpack_add_pd(__m512 a, __m512 b) {
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
static inline __m512 lanes_add(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
// r[t] = the sum of p[t]'s 16 elements, for t < 16: a transposing reduction tree (30
// shuffles, 15 adds) instead of 16 horizontal sums.
static inline __m512 sum16(const __m512* p) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                         _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 4; ++i) y[i] = unpack_add_pd(x[2 * i], x[2 * i + 1]);  // lane sums
  return lanes_add(lanes_add(y[0], y[1]), lanes_add(y[2], y[3]));  // across the 4 lanes
}

// exp(x) of 16 floats: x = k ln2 + r, |r| <= ln2 / 2 (Cephes' two-part ln2), exp(r) by its
// degree-6 Taylor polynomial (relative error < 2e-7), times 2^k by scalef; x < -87 gives
// about 0 (exp(-87) ~ 1.6e-38).
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}

// softmax_update of row g's 16 scores held in a vector (the lanes `v` says it sees, the
// soft-cap applied first), in registers: the weights go to sg[0..16).
static inline float softmax16(__m512 x, int64_t n, const Visible& v, int64_t g, float* sg,
                              float& m, float& l) {
  if (v.cap > 0.f) {
    alignas(64) float t[16];
    _mm512_store_ps(t, x);
    soft_cap(t, 16, v.cap);
    x = _mm512_load_ps(t);
  }
  const int64_t lo = v.lo ? v.lo[g] : 0, hi = v.hi ? v.hi[g] : n;
  const __mmask16 vis =
      hi > lo ? static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u)) : 0;
  // Masked lanes as -1e30, not the -inf of _mm512_mask_reduce_max_ps (-ffast-math assumes
  // finite values).
  const __m512 xv = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), vis, x);
  const float mx = std::max(m, _mm512_reduce_max_ps(xv));
  const float c = std::exp(m - mx);
  const __m512 e = _mm512_maskz_mov_ps(vis, exp16(_mm512_sub_ps(x, _mm512_set1_ps(mx))));
  _mm512_storeu_ps(sg, e);
  l = l * c + _mm512_reduce_add_ps(e);
  m = mx;
  return c;
}

// acc [GN, D] = acc * c + p . V for GN query heads (p [GN, TILE] their weights), the
// accumulators in registers for the tile, each V row widened once for the GN heads.
template <int GN, int NC, typename T>
static inline void accumulate(const T* v, int64_t stride, int64_t n, const float* p,
                              const float* c, float* acc) {
  constexpr int64_t D = 16 * NC;
  __m512 a[GN][NC];
  for (int g = 0; g < GN; ++g) {
    const __m512 cg = _mm512_set1_ps(c[g]);
    for (int i = 0; i < NC; ++i) a[g][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * i), cg);
  }
  for (int64_t t = 0; t < n; ++t) {
    __m512 e[GN];
    const float vs = row_scale(v + t * stride, D);  // an int8 row's scale, in the weights
    for (int g = 0; g < GN; ++g) e[g] = _mm512_set1_ps(p[g * TILE + t] * vs);
    for (int i = 0; i < NC; ++i) {
      const __m512 x = load16(v + t * stride + 16 * i);
      for (int g = 0; g < GN; ++g) a[g][i] = _mm512_fmadd_ps(e[g], x, a[g][i]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int i = 0; i < NC; ++i) _mm512_storeu_ps(acc + g * D + 16 * i, a[g][i]);
}

// accumulate for R rows (weights s [R, TILE], factors c [R], acc [R, D]), up to GG at once:
// GG * NC accumulators <= 16 registers.
template <int NC, typename T>
static inline void accumulate_rows(const T* v, int64_t stride, int64_t n, int64_t R,
                                   const float* s, const float* c, float* acc) {
  constexpr int64_t D = 16 * NC;
  constexpr int GG = NC <= 4 ? 4 : (NC <= 8 ? 16 / NC : 1);
  for (int64_t g0 = 0; g0 < R; g0 += GG) {
    const float *p = s + g0 * TILE, *cg = c + g0;
    float* ag = acc + g0 * D;
    switch (std::min<int64_t>(GG, R - g0)) {
      case 1: accumulate<1, NC>(v, stride, n, p, cg, ag); break;
      case 2: if constexpr (GG >= 2) accumulate<2, NC>(v, stride, n, p, cg, ag); break;
      case 3: if constexpr (GG >= 3) accumulate<3, NC>(v, stride, n, p, cg, ag); break;
      default: if constexpr (GG >= 4) accumulate<4, NC>(v, stride, n, p, cg, ag); break;
    }
  }
}

// tile_portable with AVX-512 intrinsics, D = 16 * NC: the scores of the tile's 16
// positions reduced into one vector per query head (sum16), the V accumulation of several
// query heads at once in registers (accumulate_rows).
template <typename T, int NC>
static void tile_avx512(const float* __restrict qv, const T* k, const T* v, const T* kn,
                        const T* vn, int64_t stride, int64_t n, Visible vis,
                        int64_t G, float* __restrict buf, float* __restrict s,
                        float* __restrict c, float* __restrict acc, float* __restrict m,
                        float* __restrict l) {
  constexpr int64_t D = 16 * NC;
  const float* kr;
  int64_t ks;
  if constexpr (std::is_same<T, float>::value) {
    prefetch_rows(kn, stride, n, D);
    kr = k;
    ks = stride;
  } else {
    widen_rows<NC>(k, kn, stride, n, buf);
    kr = buf;
    ks = D;
  }
  for (int64_t g = 0; g < G; ++g) {
    __m512 qg[NC], P[TILE];
    for (int i = 0; i < NC; ++i) qg[i] = _mm512_loadu_ps(qv + g * D + 16 * i);
    for (int64_t t = 0; t < TILE; ++t) {
      if (t < n) {
        __m512 x = _mm512_mul_ps(qg[0], _mm512_loadu_ps(kr + t * ks));
        for (int i = 1; i < NC; ++i)
          x = _mm512_fmadd_ps(qg[i], _mm512_loadu_ps(kr + t * ks + 16 * i), x);
        P[t] = x;
      } else {
        P[t] = _mm512_setzero_ps();
      }
    }
    c[g] = softmax16(sum16(P), n, vis, g, s + g * TILE, m[g], l[g]);
  }
  prefetch_rows(vn, stride, n, D);
  accumulate_rows<NC>(v, stride, n, G, s, c, acc);
}

// tile_avx512 for many query rows R (a prefill's query tokens times G heads): the tile's K
// rows transposed once (kt [D, TILE]) so that a row's 16 scores are 16 * NC FMAs into one
// vector, four rows at a time (no per-row reduction tree), then softmax16 per row and the V
// accumulation of tile_avx512. qv holds at least R rounded up to 4 rows.
template <typename T, int NC>
static void tile_rows_avx512(const float* __restrict qv, const T* k, const T* v, const T* kn,
                             const T* vn, int64_t stride, int64_t n, Visible vis,
                             int64_t R, float* __restrict buf, float* __restrict kt,
                             float* __restrict s, float* __restrict c, float* __restrict acc,
                             float* __restrict m, float* __restrict l) {
  constexpr int64_t D = 16 * NC;
  const float* kr;
  int64_t ks;
  if constexpr (std::is_same<T, float>::value) {
    prefetch_rows(kn, stride, n, D);
    kr = k;
    ks = stride;
  } else {
    widen_rows<NC>(k, kn, stride, n, buf);
    kr = buf;
    ks = D;
  }
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
  const __m512i idx = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(ks)));
  for (int64_t d = 0; d < D; ++d)
    _mm512_storeu_ps(kt + d * TILE,
                     _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, idx, kr + d, 4));
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    __m512 a[4][2];
    for (int j = 0; j < 4; ++j) a[j][0] = a[j][1] = _mm512_setzero_ps();
    const float* q0 = qv + r0 * D;
    for (int64_t d = 0; d < D; d += 2) {  // two chains per row: FMA latency
      const __m512 k0 = _mm512_loadu_ps(kt + d * TILE), k1 = _mm512_loadu_ps(kt + (d + 1) * TILE);
      for (int j = 0; j < 4; ++j) {
        a[j][0] = _mm512_fmadd_ps(_mm512_set1_ps(q0[j * D + d]), k0, a[j][0]);
        a[j][1] = _mm512_fmadd_ps(_mm512_set1_ps(q0[j * D + d + 1]), k1, a[j][1]);
      }
    }
    for (int64_t j = 0; j < 4 && r0 + j < R; ++j) {
      const int64_t r = r0 + j;
      c[r] = softmax16(_mm512_add_ps(a[j][0], a[j][1]), n, vis, r, s + r * TILE, m[r], l[r]);
    }
  }
  prefetch_rows(vn, stride, n, D);
  accumulate_rows<NC>(v, stride, n, R, s, c, acc);
}

#endif

// One row of scores s[0..N) (unscaled) to bfloat16 weights p = exp(s * sc - m), m their
// maximum (scaled) and l the sum of the rounded weights: shared_item_gemm's softmax.
static inline void softmax_bf16_row(const float* __restrict s, int64_t N, float sc,
                                    at::BFloat16* __restrict p, float& m, float& l) {
#if defined(__AVX512BF16__)
  const __m512 vsc = _mm512_set1_ps(sc);
  __m512 vm = _mm512_set1_ps(-1e30f);
  auto mask = [N](int64_t j) {
    return j + 16 <= N ? static_cast<__mmask16>(0xFFFF)
                       : static_cast<__mmask16>((1u << (N - j)) - 1u);
  };
  for (int64_t j = 0; j < N; j += 16) {
    const __mmask16 k = mask(j);
    vm = _mm512_mask_max_ps(vm, k, vm, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), vsc));
  }
  m = _mm512_reduce_max_ps(vm);
  const __m512 vmx = _mm512_set1_ps(m);
  __m512 vl = _mm512_setzero_ps();
  for (int64_t j = 0; j < N; j += 16) {
    const __mmask16 k = mask(j);
    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), vsc);
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(exp16(_mm512_sub_ps(x, vmx)));
    _mm256_mask_storeu_epi16(p + j, k, b);
    const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
    vl = _mm512_add_ps(vl, _mm512_maskz_mov_ps(k, rounded));
  }
  l = _mm512_reduce_add_ps(vl);
#else
  float mx = -1e30f, sum = 0.f;
  for (int64_t j = 0; j < N; ++j) mx = std::max(mx, s[j] * sc);
  for (int64_t j = 0; j < N; ++j) {
    p[j] = static_cast<at::BFloat16>(std::exp(s[j] * sc - mx));
    sum += to_f(p[j]);
  }
  m = mx;
  l = sum;
#endif
}

// The scratch of prefix_gemm, per thread.
struct GemmScratch {
  std::vector<at::BFloat16> a, kp, p, vp;
  std::vector<float> s, o, m, l;
};

// Whether prefix_gemm runs for caches of type T and head size DC: bfloat16, DC a multiple of
// 32, and oneDNN's bfloat16 brgemm at native speed here (AVX-512 BF16 or AMX).
template <typename T, int64_t DC>
static bool gemm_runs() {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<T, at::BFloat16>::value && DC > 0 && DC % 32 == 0)
    return brgemm_bf16_runs();
#endif
  return false;
}

// R query rows (qrow(r): row r's DC elements, element stride qs2) attended over the first
// `blocks` blocks of a block table bt (caches [N, bs, Hkv, DC], tok = Hkv * DC elements a
// position, KV head h), every row seeing every position, as two GEMMs (oneDNN's brgemm
// micro-kernel, bfloat16 in, float32 sums): S = Q K^T for all rows, each row's softmax over S
// at once, then O = P V with the weights P rounded to bfloat16 (as flash attention does; l
// sums the rounded weights, so O / l stays their weighted mean). store(r, m, l, acc) gets
// row r's online-softmax state (m the maximum scaled score, acc [DC] unnormalized). K is
// repacked into brgemm's VNNI layout per panel of 64 positions, V once. Cascade attention's
// shared prefix: the float32 tiles summed the same products with FMAs at ~45 GFLOP/s a core
// on a Zen 5; brgemm runs vdpbf16ps (benchmarks/attention_kernel.py, W2's case).
template <typename T, int64_t DC, typename QRow, typename Store>
static void prefix_gemm(const T* K, const T* V, int64_t bs, int64_t tok, const int64_t* bt,
                        int64_t blocks, int64_t h, int64_t R, float sc, QRow&& qrow, int64_t qs2,
                        Store&& store, GemmScratch& w) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<T, at::BFloat16>::value && DC > 0 && DC % 32 == 0) {
    constexpr int64_t NB = 64, D = DC;
    const int64_t N = blocks * bs;
    w.a.resize(R * D);
    w.kp.resize(D * NB);
    w.s.resize(R * N);
    w.p.resize(R * N);
    w.vp.resize(N * D);
    w.o.resize(R * D);
    for (int64_t r = 0; r < R; ++r) {
      const T* src = qrow(r);
      for (int64_t d = 0; d < D; ++d) w.a[r * D + d] = src[d * qs2];
    }
    // VNNI K^T: [D / 2][nb][2], a (d, d + 1) pair of a K row is one 32-bit word: up to 16
    // positions of one block gathered per pair.
    uint32_t* __restrict kp = reinterpret_cast<uint32_t*>(w.kp.data());
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(static_cast<int>(tok / 2)));
    for (int64_t p0 = 0; p0 < N; p0 += NB) {
      const int64_t nb = std::min(NB, N - p0);
      for (int64_t t = 0, n; t < nb; t += n) {
        const int64_t pos = p0 + t, j = pos / bs, in = pos - j * bs;
        n = std::min({int64_t{16}, bs - in, nb - t});
        const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
        const int* base = reinterpret_cast<const int*>(K + (bt[j] * bs + in) * tok + h * D);
        for (int64_t i = 0; i < DC / 2; ++i)
          _mm512_mask_storeu_epi32(
              kp + i * nb + t, live,
              _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx, base + i, 4));
      }
      at::native::cpublas::brgemm(R, nb, D, D, nb, N, false, w.a.data(), w.kp.data(),
                                  w.s.data() + p0, true);
    }
    // VNNI V: [N / 2][D][2], two positions' rows interleaved (bs is even: a pair never
    // crosses a block).
    uint16_t* __restrict vp = reinterpret_cast<uint16_t*>(w.vp.data());
    for (int64_t j = 0; j < blocks; ++j) {
      const uint16_t* vb = reinterpret_cast<const uint16_t*>(V + bt[j] * bs * tok + h * D);
      for (int64_t t = 0; t < bs; t += 2) {
        const uint16_t* __restrict v0 = vb + t * tok;
        const uint16_t* __restrict v1 = v0 + tok;
        uint16_t* __restrict o = vp + (j * bs + t) * DC;
        for (int64_t d = 0; d < DC; ++d) {
          o[2 * d] = v0[d];
          o[2 * d + 1] = v1[d];
        }
      }
    }
    w.m.resize(R);
    w.l.resize(R);
    for (int64_t r = 0; r < R; ++r)
      softmax_bf16_row(w.s.data() + r * N, N, sc, w.p.data() + r * N, w.m[r], w.l[r]);
    at::native::cpublas::brgemm(R, D, N, N, D, D, false, w.p.data(), w.vp.data(), w.o.data(),
                                true);
    for (int64_t r = 0; r < R; ++r) store(r, w.m[r], w.l[r], w.o.data() + r * D);
  }
#endif
}

// One tile (see tile_portable): the AVX-512 one where it is compiled for D = DC.
template <typename T, int64_t DC>
static inline void run_tile(const float* qv, const T* k, const T* v, const T* kp, const T* vp,
                            int64_t stride, int64_t n, Visible vis, int64_t G, int64_t D,
                            float* buf, float* s, float* c, float* acc, float* m, float* l) {
#if defined(__AVX512F__)
  if constexpr (DC > 0 && DC % 16 == 0)
    return tile_avx512<T, DC / 16>(qv, k, v, kp, vp, stride, n, vis, G, buf, s, c, acc, m, l);
#endif
  tile_portable<T, DC>(qv, k, v, kp, vp, stride, n, vis, G, D, buf, s, c, acc, m, l);
}

// The state and scratch of a work item's R query rows against one KV head, and its tile: a
// prefill's query tokens x the G heads of the KV head, or a shared prefix's sequences x G.
struct RowTiles {
  std::vector<float> qv, acc, buf, kt, s, c, m, l;
  int64_t R = 0, D = 0;

  // Rows r < R from row(r), a pointer to its query's D elements (element stride qs2): qv the
  // scaled query as float, and a fresh online-softmax state; qv gets 3 zero rows more
  // (tile_rows_avx512 reads rows in fours).
  template <typename T, typename F>
  void load(int64_t rows, int64_t d, int64_t qs2, float sc, F&& row) {
    R = rows;
    D = d;
    qv.assign((R + 3) * D, 0.f);
    acc.assign(R * D, 0.f);
    buf.resize(TILE * D);
    kt.resize(TILE * D);
    s.resize(R * TILE);
    c.resize(R);
    m.assign(R, -1e30f);  // finite: exp(m - max) is 0 on the first tile
    l.assign(R, 0.f);
    for (int64_t r = 0; r < R; ++r) {
      const T* src = row(r);
      for (int64_t e = 0; e < D; ++e) qv[r * D + e] = to_f(src[e * qs2]) * sc;
    }
  }

  // One KV tile (as tile_portable) for all R rows, row r seeing what vis says.
  template <typename T, int64_t DC>
  void tile(const T* k, const T* v, const T* kp, const T* vp, int64_t stride, int64_t n,
            Visible vis) {
#if defined(__AVX512F__)
    if constexpr (DC > 0 && DC % 16 == 0)
      return tile_rows_avx512<T, DC / 16>(qv.data(), k, v, kp, vp, stride, n, vis, R, buf.data(),
                                          kt.data(), s.data(), c.data(), acc.data(), m.data(),
                                          l.data());
#endif
    run_tile<T, DC>(qv.data(), k, v, kp, vp, stride, n, vis, R, D, buf.data(), s.data(),
                    c.data(), acc.data(), m.data(), l.data());
  }
};

// The KV tiles of KV heads h0 .. h1 - 1 over positions [j0 * bs, len) of one sequence (its
// block table row bt; caches [N, bs, Hkv, hs], tok = Hkv * hs: hs = D, or D + 2 for an int8
// cache's codes and scale), block by block (a block's rows read
// whole and in order) with the next block's rows prefetched: f(h, k, v, kp, vp, n, p0) for
// a tile of n <= TILE positions from p0 whose rows of head h start at k and v (kp, vp: the
// next block's, or null).
template <typename T, typename F>
static inline void for_each_tile(const T* K, const T* V, const int64_t* bt, int64_t len,
                                 int64_t bs, int64_t tok, int64_t hs, int64_t h0, int64_t h1,
                                 int64_t j0, F&& f) {
  const int64_t blk = bs * tok;
  for (int64_t j = j0; j * bs < len; ++j) {
    const int64_t n = std::min(bs, len - j * bs);
    const T* kb = K + bt[j] * blk;
    const T* vb = V + bt[j] * blk;
    const bool more = (j + 1) * bs < len;
    const T* kn = more ? K + bt[j + 1] * blk : nullptr;
    const T* vn = more ? V + bt[j + 1] * blk : nullptr;
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        const int64_t off = t0 * tok + h * hs;
        // The next block's rows t0.. of this head (as many as this tile has, or none).
        const T* kp = kn != nullptr && t0 < len - (j + 1) * bs ? kn + off : nullptr;
        const T* vp = vn != nullptr && t0 < len - (j + 1) * bs ? vn + off : nullptr;
        f(h, kb + off, vb + off, kp, vp, std::min(TILE, n - t0), j * bs + t0);
      }
  }
}

// Sequences of a decode step whose block tables start with the same `blocks` >= 1 blocks, all
// of whose positions every member sees (prefix caching: requests after one system prompt).
struct SharedPrefix {
  std::vector<int64_t> seqs;  // two or more, ascending
  int64_t blocks;
};

// The step's shared prefixes: sequences grouped by their first block, a group's prefix the
// blocks all its members' tables agree on from the start, within each member's full blocks
// (lens[b] / bs: a partly filled block is never shared). Two sequences that share a first block
// but diverge later share that one block (one group per first block, no nesting).
static std::vector<SharedPrefix> shared_prefixes(const int64_t* BT, const int64_t* L, int64_t B,
                                                 int64_t M, int64_t bs) {
  std::vector<int64_t> order;
  for (int64_t b = 0; b < B; ++b)
    if (L[b] >= bs && M > 0) order.push_back(b);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return BT[x * M] < BT[y * M]; });
  std::vector<SharedPrefix> groups;
  for (size_t i = 0, j; i < order.size(); i = j) {
    for (j = i + 1; j < order.size() && BT[order[j] * M] == BT[order[i] * M];) ++j;
    if (j - i < 2) continue;
    SharedPrefix g{std::vector<int64_t>(order.begin() + i, order.begin() + j), M};
    std::sort(g.seqs.begin(), g.seqs.end());
    const int64_t* first = BT + g.seqs[0] * M;
    for (const int64_t b : g.seqs) {
      g.blocks = std::min(g.blocks, L[b] / bs);
      int64_t p = 1;
      while (p < g.blocks && BT[b * M + p] == first[p]) ++p;
      g.blocks = p;
    }
    groups.push_back(std::move(g));
  }
  return groups;
}

// The online-softmax state of query rows (acc [rows, D], m, l [rows]).
struct RowState {
  std::vector<float> acc, m, l;
};

// Query rows of a work item of attend_shared at most (64 rows of D = 128: 32 KiB of state).
constexpr int64_t SHARED_ROWS = 64;

// Positions per part of a decode: a sequence's blocks are attended in parts of this many
// positions, counted from position 0 whatever the batch, each part's online-softmax state
// merged into the sequence's in order (merge_state), so that a sequence's sums do not depend
// on the rest of its batch or on the threads: with few sequences the parts are the work
// items (one long sequence keeps every thread busy), with many each sequence is one.
constexpr int64_t DECODE_PART = 256;

// The online-softmax state of H query rows (acc [H, D] unnormalized, running max m [H], sum
// l [H]) merged with another over other positions: both rescaled to the larger max. One
// out-of-line copy, so every caller rounds alike (the file is built with -ffast-math).
__attribute__((noinline)) static void merge_state(float* acc, float* m, float* l,
                                                  const float* acc2, const float* m2,
                                                  const float* l2, int64_t H, int64_t D) {
  for (int64_t h = 0; h < H; ++h) {
    const float mx = std::max(m[h], m2[h]);
    const float a = std::exp(m[h] - mx), b = std::exp(m2[h] - mx);
    for (int64_t d = 0; d < D; ++d) acc[h * D + d] = acc[h * D + d] * a + acc2[h * D + d] * b;
    l[h] = l[h] * a + l2[h] * b;
    m[h] = mx;
  }
}

// Query tokens per prefill work item: a KV tile's K and V rows are read (and widened) once
// for the QT * G query rows of QT tokens and the G heads that share its KV head.
constexpr int64_t QT = 16;

// A prefill item's positions that all its rows see whole (the blocks before its first
// token's block), at least this many, go through prefix_gemm where it runs
// (benchmarks/prefill_attention.py, "1x512" and the "+512" cases).
constexpr int64_t PREFILL_GEMM_MIN = 64;

// One layer's attention over the paged cache, its tensors as sizes and pointers: q [R, H, D]
// (rows may be strided: qs0, qs1, qs2), caches [N, bs, Hkv, D] contiguous (tok = Hkv * D
// elements a position), tables [B, M] int64, lens [B] int64, out [R, H, D] contiguous; q,
// caches and out all of type T (float or bfloat16), or the caches int8 codes with scales
// (C = int8_t: rows of hs = D + 2 elements), all the arithmetic in float32. DC > 0
// fixes D at compile time (unrolled loops, and the AVX-512 tiles where DC is a multiple of 16
// and the compiler targets AVX-512); 0 reads it.
template <typename T, int64_t DC, typename C = T>
struct PagedLayer {
  const int64_t B, H, D, bs, Hkv, G, M, qs0, qs1, qs2, hs, tok;
  const T* Q;
  const C *K, *V;
  const int64_t *BT, *L;
  T* O;

  PagedLayer(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
             const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out)
      : B(lens.size(0)), H(q.size(1)), D(DC > 0 ? DC : q.size(2)), bs(key_cache.size(1)),
        Hkv(key_cache.size(2)), G(H / Hkv), M(tables.size(1)), qs0(q.stride(0)),
        qs1(q.stride(1)), qs2(q.stride(2)), hs(D + row_extra<C>()), tok(Hkv * hs),
        Q(q.data_ptr<T>()), K(key_cache.data_ptr<C>()), V(value_cache.data_ptr<C>()),
        BT(tables.data_ptr<int64_t>()), L(lens.data_ptr<int64_t>()), O(out.data_ptr<T>()) {}


  // Whether attend_shared's items go through prefix_gemm: bfloat16 queries and caches, D a
  // multiple of 32, and oneDNN's bfloat16 brgemm at native speed here (AVX-512 BF16 or AMX).
  static bool gemm_shared() { return std::is_same<T, C>::value && gemm_runs<C, DC>(); }

  // attend_shared's work item through prefix_gemm, its rows' state into st.
  void shared_item_gemm(const SharedPrefix& grp, int64_t h, int64_t s0, int64_t s1, float sc,
                        const int64_t* slot, GemmScratch& w, RowState& st) const {
    prefix_gemm<C, DC>(
        K, V, bs, tok, BT + grp.seqs[0] * M, grp.blocks, h, (s1 - s0) * G, sc,
        [&](int64_t r) { return Q + grp.seqs[s0 + r / G] * qs0 + (h * G + r % G) * qs1; }, qs2,
        [&](int64_t r, float m, float l, const float* acc) {
          const int64_t out = slot[grp.seqs[s0 + r / G]] * H + h * G + r % G;
          st.m[out] = m;
          st.l[out] = l;
          std::copy(acc, acc + D, st.acc.begin() + out * D);
        },
        w);
  }

  // Cascade attention's first part: each shared prefix's blocks attended for the query rows of
  // all its sequences at once, so that a shared block's K/V rows are read (and widened) once
  // per group, not once per sequence; the rows' state goes to st, row slot[b] * H + hq (the
  // later blocks continue from it in `decode`). Through prefix_gemm (bfloat16) a work item is
  // (group, KV head, part of the group's sequences); else attend_shared_rows.
  void attend_shared(const std::vector<SharedPrefix>& groups, const int64_t* slot, float sc,
                     RowState& st) const {
    if (!gemm_shared()) return attend_shared_rows(groups, slot, sc, st);
    struct Item {
      int64_t g, h, s0, s1;
    };
    std::vector<Item> items;
    const int64_t want = 2 * at::get_num_threads();
    const int64_t per_group = static_cast<int64_t>(groups.size()) * Hkv;
    for (int64_t gi = 0; gi < static_cast<int64_t>(groups.size()); ++gi) {
      const int64_t n = static_cast<int64_t>(groups[gi].seqs.size());
      // Enough parts for the threads, and at most SHARED_ROWS query rows each (their state
      // stays in L2); each part reads the shared blocks once.
      const int64_t parts = std::min(n, std::max({int64_t{1}, (want + per_group - 1) / per_group,
                                                  (n * G + SHARED_ROWS - 1) / SHARED_ROWS}));
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t p = 0; p < parts; ++p) items.push_back({gi, h, n * p / parts, n * (p + 1) / parts});
    }
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      static thread_local GemmScratch w;  // grown once: no zero-fill per call
      for (int64_t i = begin; i < end; ++i)
        shared_item_gemm(groups[items[i].g], items[i].h, items[i].s0, items[i].s1, sc, slot, w,
                         st);
      at::native::cpublas::brgemm_release();
    });
  }

  // attend_shared by the row tiles: a work item is (group, part of its sequences: at most
  // SHARED_ROWS query rows, KV head) or, where those are fewer than twice the threads, also
  // part of its blocks (DECODE_PART positions), so a few sequences (a speculative step's rows
  // of one sequence, all sharing its context) still keep every thread busy; a (group,
  // sequence part, head)'s block parts are merged in order (merge_state) into st.
  void attend_shared_rows(const std::vector<SharedPrefix>& groups, const int64_t* slot,
                          float sc, RowState& st) const {
    struct Item {
      int64_t g, s0, s1, h, j0, j1, at;  // at: the item's state's first row in the scratch
    };
    std::vector<Item> items;
    // At most SHARED_ROWS rows an item (their state stays in L1/L2); blocks in parts only
    // where the items are otherwise fewer than twice the threads.
    auto seq_parts = [&](const SharedPrefix& g) {
      const int64_t n = static_cast<int64_t>(g.seqs.size());
      return std::min(n, (n * G + SHARED_ROWS - 1) / SHARED_ROWS);
    };
    int64_t whole = 0;
    for (const SharedPrefix& g : groups) whole += seq_parts(g) * Hkv;
    const int64_t pb = whole < 2 * at::get_num_threads() ? std::max<int64_t>(1, DECODE_PART / bs)
                                                         : M;
    int64_t rows = 0;
    for (int64_t gi = 0; gi < static_cast<int64_t>(groups.size()); ++gi) {
      const int64_t n = static_cast<int64_t>(groups[gi].seqs.size()), parts = seq_parts(groups[gi]);
      for (int64_t sp = 0; sp < parts; ++sp) {
        const int64_t s0 = n * sp / parts, s1 = n * (sp + 1) / parts;
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t j = 0, j1; j < groups[gi].blocks; j = j1) {
            j1 = std::min(groups[gi].blocks, (j / pb + 1) * pb);
            items.push_back({gi, s0, s1, h, j, j1, rows});
            rows += (s1 - s0) * G;
          }
      }
    }
    std::vector<float> acc(rows * D), m(rows), l(rows);
    const int64_t N = static_cast<int64_t>(items.size());
    std::vector<int64_t> order(N);  // longest first, from a shared counter
    for (int64_t i = 0; i < N; ++i) order[i] = i;
    auto cost = [&](int64_t i) { return (items[i].j1 - items[i].j0) * (items[i].s1 - items[i].s0); };
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t x, int64_t y) { return cost(x) > cost(y); });
    std::atomic<int64_t> next{0};
    const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N));
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      RowTiles w;
      for (int64_t i = next.fetch_add(1); i < N; i = next.fetch_add(1)) {
        const Item it = items[order[i]];
        const SharedPrefix& grp = groups[it.g];
        const int64_t R = (it.s1 - it.s0) * G;
        w.load<T>(R, D, qs2, sc, [&](int64_t r) {  // rows member-major, head-minor
          return Q + grp.seqs[it.s0 + r / G] * qs0 + (it.h * G + r % G) * qs1;
        });
        for_each_tile(K, V, BT + grp.seqs[0] * M, it.j1 * bs, bs, tok, hs, it.h, it.h + 1, it.j0,
                      [&](int64_t, const C* k, const C* v, const C* kp, const C* vp, int64_t n,
                          int64_t) { w.tile<C, DC>(k, v, kp, vp, tok, n, Visible{}); });
        std::copy(w.acc.begin(), w.acc.begin() + R * D, acc.begin() + it.at * D);
        std::copy(w.m.begin(), w.m.begin() + R, m.begin() + it.at);
        std::copy(w.l.begin(), w.l.begin() + R, l.begin() + it.at);
      }
    });
    // A (group, sequence part, head)'s block parts are consecutive items: merged into the
    // first, in order, whose rows then go to st.
    for (int64_t i = 0, first = 0; i < N; ++i) {
      const Item& it = items[i];
      const int64_t R = (it.s1 - it.s0) * G;
      if (it.j0 == 0) {
        first = it.at;
      } else {
        merge_state(acc.data() + first * D, m.data() + first, l.data() + first,
                    acc.data() + it.at * D, m.data() + it.at, l.data() + it.at, R, D);
      }
      if (i + 1 < N && items[i + 1].j0 != 0) continue;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t row = slot[groups[it.g].seqs[it.s0 + r / G]] * H + it.h * G + r % G;
        std::copy(acc.begin() + (first + r) * D, acc.begin() + (first + r + 1) * D,
                  st.acc.begin() + row * D);
        st.m[row] = m[first + r];
        st.l[row] = l[first + r];
      }
    }
  }

  // out[b, hq, :] = softmax(q[b, hq] . K^T * scale) V over positions [0, lens[b]) of
  // sequence b (q [B, H, D], out [B, H, D]), read through its block table; KV head hq / G
  // serves query head hq. With window > 0 only the last `window` positions (a sliding
  // window: from lens[b] - window), with cap > 0 soft-capped scores (Visible). Blocks that
  // sequences share from the start go through attend_shared first (cascade attention: the
  // online softmax over a sequence's positions in order, the shared ones in one pass for all
  // its sharers; not with a window or a cap), the rest per sequence.
  void decode(float sc, int64_t window, float cap) const {
    // slot[b]: sequence b's rows in st (it shares a prefix), or -1; skip[b]: its shared blocks.
    const std::vector<SharedPrefix> groups = B > 1 && window <= 0 && cap <= 0.f
                                                 ? shared_prefixes(BT, L, B, M, bs)
                                                 : std::vector<SharedPrefix>();
    std::vector<int64_t> slot(B, -1), skip(B, 0);
    RowState st;
    if (!groups.empty()) {
      int64_t n = 0;
      for (const SharedPrefix& g : groups)
        for (const int64_t b : g.seqs) {
          slot[b] = n++;
          skip[b] = g.blocks;
        }
      st.acc.resize(n * H * D);
      st.m.resize(n * H);
      st.l.resize(n * H);
      attend_shared(groups, slot.data(), sc, st);
    }
    // Sequence b's parts: blocks [j, j1) from its first visible or unshared block, cut at
    // multiples of DECODE_PART positions; parts [first[b], first[b + 1]).
    std::vector<int64_t> pj0, pj1, first(B + 1);
    const int64_t pb = std::max<int64_t>(1, DECODE_PART / bs);
    for (int64_t b = 0; b < B; ++b) {
      first[b] = static_cast<int64_t>(pj0.size());
      const int64_t nblk = (L[b] + bs - 1) / bs;
      int64_t j = std::max(skip[b], window_start(b, window) / bs);
      do {
        pj0.push_back(j);
        j = std::min(nblk, (j / pb + 1) * pb);
        pj1.push_back(j);
      } while (j < nblk);
    }
    first[B] = static_cast<int64_t>(pj0.size());
    // Work items: each sequence whole where there are enough of them, else each part (its
    // state kept, the sequence's parts merged after). Each block's rows are read whole.
    const bool whole = B >= 2 * at::get_num_threads();
    const int64_t N = whole ? B : first[B];
    std::vector<float> pacc(whole ? 0 : N * H * D), pm(whole ? 0 : N * H), pl(whole ? 0 : N * H);
    std::vector<int64_t> order(N);  // longest first, from a shared counter
    for (int64_t i = 0; i < N; ++i) order[i] = i;
    auto blocks = [&](int64_t i) {
      return whole ? pj1[first[i + 1] - 1] - pj0[first[i]] : pj1[i] - pj0[i];
    };
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t x, int64_t y) { return blocks(x) > blocks(y); });
    std::atomic<int64_t> next{0};
    auto seq_of = [&](int64_t p) {
      return std::upper_bound(first.begin(), first.end(), p) - first.begin() - 1;
    };
    const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N));
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      DecodeScratch w(H, D, G);
      for (int64_t i = next.fetch_add(1); i < N; i = next.fetch_add(1)) {
        const int64_t it = order[i], b = whole ? it : seq_of(it);
        load_query(b, sc, w.qv.data());
        const int64_t p0 = whole ? first[b] : it, p1 = whole ? first[b + 1] : it + 1;
        float* acc = whole ? w.acc.data() : pacc.data() + it * H * D;
        float* m = whole ? w.m.data() : pm.data() + it * H;
        float* l = whole ? w.l.data() : pl.data() + it * H;
        start_state(p0 == first[b] ? slot[b] : -1, st, acc, m, l);
        attend_part(b, pj0[p0], pj1[p0], window, cap, w, acc, m, l);
        for (int64_t p = p0 + 1; p < p1; ++p) {  // whole: the later parts, merged in order
          start_state(-1, st, w.acc2.data(), w.m2.data(), w.l2.data());
          attend_part(b, pj0[p], pj1[p], window, cap, w, w.acc2.data(), w.m2.data(),
                      w.l2.data());
          merge_state(acc, m, l, w.acc2.data(), w.m2.data(), w.l2.data(), H, D);
        }
        if (whole) finish(b, acc, l);
      }
    });
    if (whole) return;
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t p0 = first[b];
        for (int64_t p = p0 + 1; p < first[b + 1]; ++p)
          merge_state(pacc.data() + p0 * H * D, pm.data() + p0 * H, pl.data() + p0 * H,
                      pacc.data() + p * H * D, pm.data() + p * H, pl.data() + p * H, H, D);
        finish(b, pacc.data() + p0 * H * D, pl.data() + p0 * H);
      }
    });
  }

  // The first position sequence b sees with a window (0 without).
  int64_t window_start(int64_t b, int64_t window) const {
    return window > 0 ? std::max<int64_t>(0, L[b] - window) : 0;
  }

  // A decode worker's buffers: the query rows, two states, a tile's scratch.
  struct DecodeScratch {
    std::vector<float> qv, acc, m, l, acc2, m2, l2, buf, s, c;
    std::vector<int64_t> lo;
    DecodeScratch(int64_t H, int64_t D, int64_t G)
        : qv(H * D), acc(H * D), m(H), l(H), acc2(H * D), m2(H), l2(H), buf(TILE * D),
          s(G * TILE), c(G), lo(G) {}
  };

  // Sequence b's query rows, scaled, as float32 [H, D].
  void load_query(int64_t b, float sc, float* qv) const {
    for (int64_t hq = 0; hq < H; ++hq) {
      const T* src = Q + b * qs0 + hq * qs1;
      for (int64_t d = 0; d < D; ++d) qv[hq * D + d] = to_f(src[d * qs2]) * sc;
    }
  }

  // A state to start from: the shared prefix's rows of slot `row` (>= 0) or an empty one.
  void start_state(int64_t row, const RowState& st, float* acc, float* m, float* l) const {
    for (int64_t hq = 0; hq < H; ++hq) {
      if (row >= 0) {  // continue from the shared prefix's state
        const int64_t r = row * H + hq;
        std::copy(st.acc.begin() + r * D, st.acc.begin() + (r + 1) * D, acc + hq * D);
        m[hq] = st.m[r];
        l[hq] = st.l[r];
      } else {
        std::fill(acc + hq * D, acc + (hq + 1) * D, 0.f);
        m[hq] = -1e30f;  // finite: exp(m - max) is 0 on the first block
        l[hq] = 0.f;
      }
    }
  }

  // Blocks [j0, j1) of sequence b attended by its query rows (w.qv) into the state, all KV
  // heads; positions before its window's start masked. Out of line: the same code for whole
  // sequences and for parts.
  __attribute__((noinline)) void attend_part(int64_t b, int64_t j0, int64_t j1, int64_t window,
                                             float cap, DecodeScratch& w, float* acc, float* m,
                                             float* l) const {
    const int64_t start = window_start(b, window);
    for_each_tile(K, V, BT + b * M, std::min(L[b], j1 * bs), bs, tok, hs, 0, Hkv, j0,
                  [&](int64_t h, const C* k, const C* v, const C* kp, const C* vp, int64_t n,
                      int64_t p0) {
                    Visible vis{nullptr, nullptr, cap};
                    if (start > p0) {
                      std::fill(w.lo.begin(), w.lo.end(), std::min(n, start - p0));
                      vis.lo = w.lo.data();
                    }
                    run_tile<C, DC>(w.qv.data() + h * G * D, k, v, kp, vp, tok, n, vis, G, D,
                                    w.buf.data(), w.s.data(), w.c.data(), acc + h * G * D,
                                    m + h * G, l + h * G);
                  });
  }

  // Sequence b's output rows: acc / l.
  void finish(int64_t b, const float* acc, const float* l) const {
    for (int64_t hq = 0; hq < H; ++hq) {
      T* dst = O + (b * H + hq) * D;
      const float inv = l[hq] > 0.f ? 1.f / l[hq] : 0.f;
      for (int64_t d = 0; d < D; ++d) dst[d] = from_f<T>(acc[hq * D + d] * inv);
    }
  }

  // Chunks of any length: sequence b's query rows QS[b] .. QS[b] + QL[b] - 1 are its last
  // q_len = QL[b] positions of lens[b] (context including them); its query token i (of
  // ctx = lens[b] - q_len cached before the chunk) sees positions 0 .. ctx + i (with
  // window > 0 only the last `window` of them: from ctx + i - window + 1; with cap > 0 the
  // scores soft-capped, see Visible); out rows of no sequence are left as they are. A work item is (sequence, KV head, tile of up to QT
  // query tokens); items go to threads longest first from a shared counter (a chunk's later
  // tiles read more context).
  //
  // Sequence b with SK[b] > 0 (SK null: none) starts from a state given for its rows: its
  // first SK[b] blocks (all before its chunk) already attended, row r's normalized output in
  // IO [R, H, D] and log-sum-exp in IL [R, H] (float32; cascade attention over a prefix that
  // several chunks share, attended together outside), so its tiles start at block SK[b];
  // not with a window or a cap.
  void prefill(const int64_t* QS, const int64_t* QL, float sc, int64_t window, float cap,
               const int64_t* SK = nullptr, const float* IO = nullptr,
               const float* IL = nullptr) const {
    struct Item {
      int64_t b, t0, nt, h, cost;
    };
    std::vector<Item> items;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t ql = QL[b], ctx = L[b] - ql, done = SK != nullptr ? SK[b] * bs : 0;
      for (int64_t t0 = 0; t0 < ql; t0 += QT) {
        const int64_t nt = std::min(QT, ql - t0);
        const int64_t seen = ctx + t0 + nt - done;  // positions the tile's last token sees
        for (int64_t h = 0; h < Hkv; ++h)
          items.push_back({b, t0, nt, h, nt * (window > 0 ? std::min(seen, window + nt) : seen)});
      }
    }
    std::stable_sort(items.begin(), items.end(),
                     [](const Item& x, const Item& y) { return x.cost > y.cost; });
    const int64_t N = static_cast<int64_t>(items.size());
    std::atomic<int64_t> next{0};
    const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N));
    const bool gemm = gemm_shared() && window <= 0 && cap <= 0.f;
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      RowTiles w;
      static thread_local GemmScratch gw;  // grown once: no zero-fill per call
      std::vector<int64_t> lo(QT * G), hi(QT * G);
      for (int64_t i = next.fetch_add(1); i < N; i = next.fetch_add(1)) {
        const Item it = items[i];
        const int64_t b = it.b, h = it.h, nt = it.nt;
        const int64_t first = QS[b] + it.t0;  // the item's first query row
        const int64_t ctx = L[b] - QL[b];     // cached before the chunk
        const int64_t last = ctx + it.t0;     // the first token sees 0 .. last
        // Rows token-major, head-minor.
        w.load<T>(nt * G, D, qs2, sc,
                  [&](int64_t r) { return Q + (first + r / G) * qs0 + (h * G + r % G) * qs1; });
        const int64_t skip = SK != nullptr ? SK[b] : 0;
        for (int64_t r = 0; skip > 0 && r < w.R; ++r) {  // continue from the given state
          const int64_t row = (first + r / G) * H + h * G + r % G;
          std::copy(IO + row * D, IO + (row + 1) * D, w.acc.begin() + r * D);
          w.m[r] = IL[row];
          w.l[r] = 1.f;
        }
        // The blocks every row sees whole (before the first token's block): one GEMM,
        // merged into the rows' state (cascade attention within the sequence).
        // The first position the item's first token sees (a sliding window's start).
        const int64_t first_pos = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
        int64_t from = std::max(skip, first_pos / bs);
        const int64_t whole = (last + 1) / bs;
        if (gemm && (whole - skip) * bs >= PREFILL_GEMM_MIN) {
          prefix_gemm<C, DC>(
              K, V, bs, tok, BT + b * M + skip, whole - skip, h, w.R, sc,
              [&](int64_t r) { return Q + (first + r / G) * qs0 + (h * G + r % G) * qs1; }, qs2,
              [&](int64_t r, float m2, float l2, const float* acc2) {
                const float mx = std::max(w.m[r], m2);
                const float c1 = std::exp(w.m[r] - mx), c2 = std::exp(m2 - mx);
                float* acc = w.acc.data() + r * D;
                for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] * c1 + acc2[d] * c2;
                w.l[r] = w.l[r] * c1 + l2 * c2;
                w.m[r] = mx;
              },
              gw);
          from = whole;
        }
        const int64_t len = last + nt;  // positions the item's last token sees
        for_each_tile(K, V, BT + b * M, len, bs, tok, hs, h, h + 1, from,
                      [&](int64_t, const C* k, const C* v, const C* kp, const C* vp, int64_t n,
                          int64_t p0) {
                        // Rows that see only part of the tile: the causal mask's diagonal
                        // (hi), a sliding window's start (lo).
                        Visible vis{nullptr, nullptr, cap};
                        if (last - p0 + 1 < n) {
                          for (int64_t tt = 0; tt < nt; ++tt) {
                            const int64_t see =
                                std::max<int64_t>(0, std::min(n, last + tt - p0 + 1));
                            for (int64_t g = 0; g < G; ++g) hi[tt * G + g] = see;
                          }
                          vis.hi = hi.data();
                        }
                        if (window > 0 && last + nt - window > p0) {
                          for (int64_t tt = 0; tt < nt; ++tt) {
                            const int64_t from_t = std::max<int64_t>(
                                0, std::min(n, last + tt - window + 1 - p0));
                            for (int64_t g = 0; g < G; ++g) lo[tt * G + g] = from_t;
                          }
                          vis.lo = lo.data();
                        }
                        w.tile<C, DC>(k, v, kp, vp, tok, n, vis);
                      });
        for (int64_t r = 0; r < w.R; ++r) {
          T* dst = O + ((first + r / G) * H + h * G + r % G) * D;
          const float inv = w.l[r] > 0.f ? 1.f / w.l[r] : 0.f;
          for (int64_t d = 0; d < D; ++d) dst[d] = from_f<T>(w.acc[r * D + d] * inv);
        }
      }
      if (gemm) at::native::cpublas::brgemm_release();
    });
  }
};

template <typename T, typename C = T>
static void dispatch(const at::Tensor& q, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& tables,
                     const at::Tensor& lens, float sc, int64_t window, float cap,
                     at::Tensor& out) {
#define ASYNCLLM_DECODE(DC)                                                           \
  return PagedLayer<T, DC, C>(q, key_cache, value_cache, tables, lens, out).decode(sc, window, \
                                                                                   cap)
  switch (q.size(2)) {
    case 64: ASYNCLLM_DECODE(64);
    case 80: ASYNCLLM_DECODE(80);
    case 128: ASYNCLLM_DECODE(128);
    case 256: ASYNCLLM_DECODE(256);
    default: ASYNCLLM_DECODE(0);
  }
#undef ASYNCLLM_DECODE
}

// Cascade attention's shared part for prefill chunks: query rows `rows` [Tg] int64 of q
// [R, H, D] attended over the blocks `blocks` [nb] int64 of the caches [N, bs, Hkv, D] (every
// row sees every position: a prefix cached before all the chunks), by prefix_gemm per KV head
// and part of the rows; out [R, H, D] and lse [R, H] (float32, contiguous) get those rows'
// normalized outputs and log-sum-exps of the scaled scores (paged_prefill's init_out and
// init_lse), the other rows left as they are. q and caches bfloat16, D 64 or 128, and brgemm
// native here (shared_prefix_gemm_available).
template <int64_t DC>
static void shared_prefix_rows(const at::Tensor& q, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& blocks,
                               const at::Tensor& rows, float sc, at::Tensor& out,
                               at::Tensor& lse) {
  using BF = at::BFloat16;
  const int64_t H = q.size(1), Hkv = key_cache.size(2), G = H / Hkv, bs = key_cache.size(1);
  const int64_t tok = Hkv * DC, nb = blocks.size(0), Tg = rows.size(0);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const BF *Q = q.data_ptr<BF>(), *K = key_cache.data_ptr<BF>(), *V = value_cache.data_ptr<BF>();
  const int64_t *bt = blocks.data_ptr<int64_t>(), *RW = rows.data_ptr<int64_t>();
  float *O = out.data_ptr<float>(), *LS = lse.data_ptr<float>();
  const int64_t per = std::max<int64_t>(1, 64 / G);  // query tokens per item: <= 64 rows
  const int64_t parts = (Tg + per - 1) / per;
  at::parallel_for(0, Hkv * parts, 1, [&](int64_t begin, int64_t end) {
    static thread_local GemmScratch w;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / parts, t0 = (i % parts) * per, nt = std::min(per, Tg - t0);
      prefix_gemm<BF, DC>(
          K, V, bs, tok, bt, nb, h, nt * G, sc,
          [&](int64_t r) { return Q + RW[t0 + r / G] * qs0 + (h * G + r % G) * qs1; }, qs2,
          [&](int64_t r, float m, float l, const float* acc) {
            const int64_t row = RW[t0 + r / G] * H + h * G + r % G;
            const float inv = l > 0.f ? 1.f / l : 0.f;
            for (int64_t d = 0; d < DC; ++d) O[row * DC + d] = acc[d] * inv;
            LS[row] = m + std::log(l);
          },
          w);
    }
    at::native::cpublas::brgemm_release();
  });
}

bool shared_prefix_gemm_available(int64_t head_size) {
  return head_size == 64 ? gemm_runs<at::BFloat16, 64>()
                         : head_size == 128 && gemm_runs<at::BFloat16, 128>();
}

void shared_prefix_attention(const at::Tensor& q, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& blocks,
                             const at::Tensor& rows, double scale, at::Tensor& out,
                             at::Tensor& lse) {
  const int64_t D = q.size(2);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && key_cache.scalar_type() == at::kBFloat16 &&
                  value_cache.scalar_type() == at::kBFloat16 && shared_prefix_gemm_available(D),
              "shared_prefix_attention: bfloat16, head size 64 or 128 and native brgemm only");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && q.dim() == 3 &&
                  D == key_cache.size(3) && q.size(1) % key_cache.size(2) == 0 &&
                  key_cache.size(1) % 2 == 0 && out.is_contiguous() && lse.is_contiguous() &&
                  out.scalar_type() == at::kFloat && lse.scalar_type() == at::kFloat &&
                  out.sizes() == q.sizes() && lse.size(0) == q.size(0) &&
                  lse.size(1) == q.size(1) && blocks.scalar_type() == at::kLong &&
                  rows.scalar_type() == at::kLong,
              "shared_prefix_attention: shapes or dtypes do not match");
  const float sc = static_cast<float>(scale);
  if (D == 64) return shared_prefix_rows<64>(q, key_cache, value_cache, blocks, rows, sc, out, lse);
  return shared_prefix_rows<128>(q, key_cache, value_cache, blocks, rows, sc, out, lse);
}

// window > 0: a sliding window of that many positions; softcap > 0: soft-capped scores
// (PagedLayer::decode).
void paged_decode(const at::Tensor& q, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& tables,
                  const at::Tensor& lens, double scale, int64_t window, double softcap,
                  at::Tensor& out) {
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const bool bf = q.scalar_type() == at::kBFloat16;
  if (key_cache.scalar_type() == at::kChar)  // int8 codes and scales (kv_int8.py)
    return bf ? dispatch<at::BFloat16, int8_t>(q, key_cache, value_cache, tables, lens, sc,
                                               window, cap, out)
              : dispatch<float, int8_t>(q, key_cache, value_cache, tables, lens, sc, window,
                                        cap, out);
  if (bf)
    return dispatch<at::BFloat16>(q, key_cache, value_cache, tables, lens, sc, window, cap, out);
  return dispatch<float>(q, key_cache, value_cache, tables, lens, sc, window, cap, out);
}

// Attention of chunks of any length (prefills, decodes, a mix) over the paged cache: see
// PagedLayer::prefill (window, softcap as paged_decode); q, caches and out float32 or
// bfloat16 alike. With skip [B] int64, init_out [R, H, D] and init_lse [R, H] (float32, contiguous): the
// sequences' first skip[b] blocks already attended (PagedLayer::prefill's SK, IO, IL).
void paged_prefill(const at::Tensor& q, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& tables,
                   const at::Tensor& lens, const at::Tensor& qstart,
                   const at::Tensor& qlens, double scale, int64_t window, double softcap,
                   at::Tensor& out, const c10::optional<at::Tensor>& skip, const c10::optional<at::Tensor>& init_out,
                   const c10::optional<at::Tensor>& init_lse) {
  const auto T = q.scalar_type();
  const bool q8 = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type() &&
                  (q8 || key_cache.scalar_type() == T) && out.scalar_type() == T &&
                  (T == at::kFloat || T == at::kBFloat16),
              "paged_prefill: q and out float32 or bfloat16, the caches q's dtype or int8");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && out.is_contiguous() &&
                  out.sizes() == q.sizes() && q.dim() == 3 &&
                  q.size(2) + (q8 ? row_extra<int8_t>() : 0) == key_cache.size(3) &&
                  key_cache.sizes() == value_cache.sizes() && q.size(1) % key_cache.size(2) == 0,
              "paged_prefill: shapes do not match");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
                  qstart.scalar_type() == at::kLong && qlens.scalar_type() == at::kLong &&
                  tables.is_contiguous() && lens.is_contiguous() && qstart.is_contiguous() &&
                  qlens.is_contiguous() && qstart.numel() == lens.numel() &&
                  qlens.numel() == lens.numel() && tables.size(0) == lens.numel(),
              "paged_prefill: tables [B, M], lens, qstart and qlens [B] must be int64");
  const int64_t* SK = nullptr;
  const float *IO = nullptr, *IL = nullptr;
  if (skip.has_value()) {
    TORCH_CHECK(!q8, "paged_prefill: no shared-prefix state over an int8 cache");
    TORCH_CHECK(window <= 0 && softcap <= 0.0,
                "paged_prefill: no shared-prefix state with a sliding window or soft-capping");
    TORCH_CHECK(init_out.has_value() && init_lse.has_value() &&
                    skip->scalar_type() == at::kLong && skip->is_contiguous() &&
                    skip->numel() == lens.numel() && init_out->scalar_type() == at::kFloat &&
                    init_out->is_contiguous() && init_out->sizes() == q.sizes() &&
                    init_lse->scalar_type() == at::kFloat && init_lse->is_contiguous() &&
                    init_lse->numel() == q.size(0) * q.size(1),
                "paged_prefill: skip [B] int64 needs init_out [R, H, D] and init_lse [R, H] "
                "float32");
    SK = skip->data_ptr<int64_t>();
    IO = init_out->data_ptr<float>();
    IL = init_lse->data_ptr<float>();
    const int64_t* Ls = lens.data_ptr<int64_t>();
    const int64_t *QLs = qlens.data_ptr<int64_t>(), bs = key_cache.size(1);
    for (int64_t b = 0; b < lens.numel(); ++b)
      TORCH_CHECK(SK[b] >= 0 && SK[b] * bs <= Ls[b] - QLs[b] && SK[b] <= tables.size(1),
                  "paged_prefill: skip[b] must cover only blocks before sequence b's chunk");
  }
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const bool bf = T == at::kBFloat16;
  const int64_t *QS = qstart.data_ptr<int64_t>(), *QL = qlens.data_ptr<int64_t>();
#define ASYNCLLM_PREFILL_AS(QT_, CT_, DC)                                                     \
  return PagedLayer<QT_, DC, CT_>(q, key_cache, value_cache, tables, lens, out)              \
      .prefill(QS, QL, sc, window, cap, SK, IO, IL)
#define ASYNCLLM_PREFILL(DC)                                                                  \
  if (q8 && bf) ASYNCLLM_PREFILL_AS(at::BFloat16, int8_t, DC);                                \
  if (q8) ASYNCLLM_PREFILL_AS(float, int8_t, DC);                                             \
  if (bf) ASYNCLLM_PREFILL_AS(at::BFloat16, at::BFloat16, DC);                                \
  ASYNCLLM_PREFILL_AS(float, float, DC)
  switch (q.size(2)) {
    case 64: ASYNCLLM_PREFILL(64);
    case 80: ASYNCLLM_PREFILL(80);
    case 128: ASYNCLLM_PREFILL(128);
    case 256: ASYNCLLM_PREFILL(256);
    default: ASYNCLLM_PREFILL(0);
  }
#undef ASYNCLLM_PREFILL
#undef ASYNCLLM_PREFILL_AS
}

// Rows 0..n-1 of x [R, Hkv, D] (any strides) to the flat slots S of cache [N, bs, Hkv, D]
// (contiguous); a negative slot is skipped.
template <typename T>
static void write_rows(const at::Tensor& x, at::Tensor& cache, const int64_t* S, int64_t n) {
  const int64_t Hkv = x.size(1), D = x.size(2);
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2);
  const T* X = x.data_ptr<T>();
  T* C = cache.data_ptr<T>();
  for (int64_t i = 0; i < n; ++i) {
    if (S[i] < 0) continue;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t d = 0; d < D; ++d) C[(S[i] * Hkv + h) * D + d] = X[i * s0 + h * s1 + d * s2];
  }
}

// Rows 0..n-1 of x [R, Hkv, D] (any strides) quantized to the flat slots S of an int8 cache
// [N, bs, Hkv, D + 2] (contiguous; a negative slot is skipped): per row and head, the
// float16 scale s = half(min(absmax * (1 / 127), 65504)) after the codes round(x * (1 / s))
// (ties to even, clamped to +-127; 0 where s is 0), as kv_int8.quantize computes.
template <typename T>
static void write_rows_q8(const at::Tensor& x, at::Tensor& cache, const int64_t* S, int64_t n) {
  const int64_t Hkv = x.size(1), D = x.size(2), hs = D + 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2);
  const T* X = x.data_ptr<T>();
  int8_t* C = cache.data_ptr<int8_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (S[i] < 0) continue;
    for (int64_t h = 0; h < Hkv; ++h) {
      const T* src = X + i * s0 + h * s1;
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_f(src[d * s2])));
      const uint16_t s16 = half_bits(std::min(amax * (1.f / 127.f), 65504.f));
      const float scale = half_to_float(s16);
      const float inv = scale > 0.f ? 1.f / scale : 0.f;
      int8_t* row = C + (S[i] * Hkv + h) * hs;
      for (int64_t d = 0; d < D; ++d) {
        const float c = std::nearbyint(to_f(src[d * s2]) * inv);
        row[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, c)));
      }
      std::memcpy(row + D, &s16, sizeof s16);
    }
  }
}

// One decode step of a layer: the new K/V rows (k, v [R, Hkv, D]) of the n = lens.size(0)
// sequences written at their slots [n], then paged_decode of q rows 0..n-1 into out [R, H, D]
// (contiguous; window, softcap as paged_decode); rows n..R-1 are padding: out rows a copy of
// row n - 1 (a padded token repeats the last real one: every other op of the layer computes
// it as that token, and the linear kernels compute a repeated row once), nothing written.
void paged_write_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        at::Tensor& key_cache, at::Tensor& value_cache,
                        const at::Tensor& slots, const at::Tensor& tables,
                        const at::Tensor& lens, double scale, int64_t window, double softcap,
                        at::Tensor& out) {
  const int64_t n = lens.size(0), R = q.size(0);
  const auto T = q.scalar_type();
  const bool q8 = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k.scalar_type() == T && v.scalar_type() == T &&
                  value_cache.scalar_type() == key_cache.scalar_type() &&
                  (q8 || key_cache.scalar_type() == T) && out.scalar_type() == T &&
                  (T == at::kFloat || T == at::kBFloat16),
              "paged_write_decode: q, k, v and out float32 or bfloat16, the caches q's or int8");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && out.is_contiguous() &&
                  k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() &&
                  k.size(0) >= n && R >= n && out.sizes() == q.sizes() &&
                  key_cache.sizes() == value_cache.sizes() && k.size(1) == key_cache.size(2) &&
                  k.size(2) + (q8 ? row_extra<int8_t>() : 0) == key_cache.size(3),
              "paged_write_decode: shapes do not match");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() >= n,
              "paged_write_decode: slots must be int64 with a slot per sequence");
  const int64_t* S = slots.data_ptr<int64_t>();
  at::Tensor o = out.narrow(0, 0, n);
  if (q8 && T == at::kBFloat16) {
    write_rows_q8<at::BFloat16>(k, key_cache, S, n);
    write_rows_q8<at::BFloat16>(v, value_cache, S, n);
  } else if (q8) {
    write_rows_q8<float>(k, key_cache, S, n);
    write_rows_q8<float>(v, value_cache, S, n);
  } else if (T == at::kBFloat16) {
    write_rows<at::BFloat16>(k, key_cache, S, n);
    write_rows<at::BFloat16>(v, value_cache, S, n);
  } else {
    write_rows<float>(k, key_cache, S, n);
    write_rows<float>(v, value_cache, S, n);
  }
  paged_decode(q.narrow(0, 0, n), key_cache, value_cache, tables, lens, scale, window, softcap,
               o);
  if (R > n && n > 0)
    out.narrow(0, n, R - n).copy_(out.narrow(0, n - 1, 1).expand({R - n, q.size(1), q.size(2)}));
  else if (R > n)
    out.narrow(0, n, R - n).zero_();
}

// The op asyncllm::paged_attention (defined in backend_registry.py, called by compiled
// graphs once per layer) gets this CPU kernel: a decode-only step that Python armed on this
// thread (arm_decode: the step's caches, slots, block tables and lengths) runs
// paged_write_decode straight from here; anything else (prefill steps, a dry run, another
// thread) calls the op's Python implementation. The Python path around the kernel cost
// ~30 us per call at batch 1: dispatch back into Python, the backend's checks, the output's
// allocation, pybind's argument conversion. With layer groups (a hybrid KV cache,
// arm_decode_groups) each group has its own slots and block tables, and each layer reads
// its group's.
struct ArmedDecode {
  std::vector<at::Tensor> key_caches, value_caches;
  std::vector<at::Tensor> slots, tables;  // per layer group (one without groups)
  at::Tensor lens;
  std::vector<int64_t> layer_groups;  // per layer, its group; empty: group 0 for all
};
static thread_local std::unique_ptr<ArmedDecode> armed_decode;

void arm_decode(std::vector<at::Tensor> key_caches, std::vector<at::Tensor> value_caches,
                at::Tensor slots, at::Tensor tables, at::Tensor lens) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "arm_decode: one V cache per K cache");
  armed_decode.reset(new ArmedDecode{std::move(key_caches), std::move(value_caches),
                                     {std::move(slots)}, {std::move(tables)}, std::move(lens),
                                     {}});
}

void arm_decode_groups(std::vector<at::Tensor> key_caches, std::vector<at::Tensor> value_caches,
                       std::vector<at::Tensor> slots, std::vector<at::Tensor> tables,
                       at::Tensor lens, std::vector<int64_t> layer_groups) {
  TORCH_CHECK(key_caches.size() == value_caches.size() &&
                  layer_groups.size() == key_caches.size(),
              "arm_decode_groups: one V cache and one group per K cache");
  TORCH_CHECK(!slots.empty() && slots.size() == tables.size(),
              "arm_decode_groups: one slot mapping and one block table per group");
  for (const int64_t g : layer_groups)
    TORCH_CHECK(g >= 0 && g < static_cast<int64_t>(slots.size()),
                "arm_decode_groups: a layer's group is out of range");
  armed_decode.reset(new ArmedDecode{std::move(key_caches), std::move(value_caches),
                                     std::move(slots), std::move(tables), std::move(lens),
                                     std::move(layer_groups)});
}

void disarm_decode() { armed_decode.reset(); }

bool decode_armed() { return armed_decode != nullptr; }

static at::Tensor paged_attention_cpu_op(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, int64_t layer, double scale,
                                         int64_t window, double softcap) {
  const ArmedDecode* a = armed_decode.get();
  if (a != nullptr && layer >= 0 && layer < static_cast<int64_t>(a->key_caches.size()) &&
      q.dim() == 3 &&
      (q.scalar_type() == a->key_caches[layer].scalar_type() ||
       a->key_caches[layer].scalar_type() == at::kChar) &&
      k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type()) {
    at::Tensor out = at::empty(q.sizes(), q.options());
    const size_t g = a->layer_groups.empty() ? 0 : static_cast<size_t>(a->layer_groups[layer]);
    paged_write_decode(q, k, v, const_cast<at::Tensor&>(a->key_caches[layer]),
                       const_cast<at::Tensor&>(a->value_caches[layer]), a->slots[g],
                       a->tables[g], a->lens, scale, window, softcap, out);
    return out;
  }
  pybind11::gil_scoped_acquire gil;
  // Leaked on purpose: a py::object must not be destroyed after the interpreter finalizes.
  static pybind11::object* impl = new pybind11::object(
      pybind11::module_::import("asyncllm.attention.backend_registry").attr("paged_attention_op"));
  return (*impl)(q, k, v, layer, scale, window, softcap).cast<at::Tensor>();
}

// The op's CPU kernel, registered when the loader imports this variant (not at import time:
// a test importing another variant for its functions must not replace the engine's kernel).
void register_ops() {
  static const bool once = [] {
    cpu_impls(__FILE__, __LINE__).impl("paged_attention", TORCH_FN(paged_attention_cpu_op));
    return true;
  }();
  (void)once;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Reads and writes int8 caches (kv_int8.py); builds before it lack the attribute.
  m.attr("int8_kv") = true;
  m.def("register_ops", &register_ops, "Register this module's CPU kernels of the asyncllm ops (once).");
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode), "paged_decode");
  m.def("paged_write_decode", torch::wrap_pybind_function(paged_write_decode), "paged_write_decode");
  m.def("paged_prefill", torch::wrap_pybind_function(paged_prefill), "paged_prefill");
  m.def("arm_decode", torch::wrap_pybind_function(arm_decode), "arm_decode");
  m.def("arm_decode_groups", torch::wrap_pybind_function(arm_decode_groups), "arm_decode_groups");
  m.def("disarm_decode", torch::wrap_pybind_function(disarm_decode), "disarm_decode");
  m.def("decode_armed", torch::wrap_pybind_function(decode_armed), "decode_armed");
  m.def("shared_prefix_attention", torch::wrap_pybind_function(shared_prefix_attention), "shared_prefix_attention");
  m.def("shared_prefix_gemm_available", torch::wrap_pybind_function(shared_prefix_gemm_available), "shared_prefix_gemm_available");
}
