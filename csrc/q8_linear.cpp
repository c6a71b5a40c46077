#include "common.h"
#include "python_module.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

// A weight W [N, K] as int8 codes Q [N, K], a float32 scale per G input columns S [N, K / G]
// and, optionally, a float32 offset per group O [N, K / G]: w = S * Q (+ O). G is 32 (GGUF's
// Q8_0, Q5_0 and Q5_K, the last with offsets) or 16 (Q6_K's sub-blocks): the functions below
// take it from the scales' shape and every loop knows it at compile time (with_format). K is
// a multiple of 32 (the dequantizers write 32 columns at a time).
//
// Or, for codes in -16..15 without offsets (GGUF's Q5_0), 5-bit codes: Q uint8 [N, K / 32 *
// 20], per 32 columns of u = code + 16, 16 bytes (byte j: column j's u in bits 0-4, bits 2-4
// of column j + 16's in bits 5-7) and a little-endian 32-bit word (bits 2j, 2j + 1: bits 0-1
// of column j + 16's u); the scale float16 [N, K / 32] (Q5_0's d, as the file holds it). The
// same weights, 5.5 bits each instead of 9 (q8_linear.pack5 writes them).
constexpr int64_t BLOCK = 32;
constexpr int64_t CHUNK = 16;  // columns per vector (16 float32 lanes)
constexpr int64_t PREFETCH = 8;  // rows ahead (4.5 KiB of SmolLM2's head)

#if defined(__AVX512F__)
#include <immintrin.h>
#define Q8_FAST 1
#else
#define Q8_FAST 0
#endif

using OptTensor = std::optional<at::Tensor>;

constexpr int64_t Q5_BLOCK_BYTES = 20;  // 5-bit codes: bytes per 32 columns

// One row of a weight, as the loops read it: int8 codes q with float32 scales s (and offsets
// o, or null), or 5-bit blocks b with float16 scales h.
struct Row {
  const int8_t* q;
  const uint8_t* b;
  const float* s;
  const at::Half* h;
  const float* o;
};

// The codes of one weight.
struct Codes {
  const int8_t* q;     // int8 codes [N, K], or null
  const uint8_t* b;    // 5-bit blocks [N, K / 32 * 20], or null
  const float* s;      // with q: float32 scales [N, K / G]
  const at::Half* h;   // with b: float16 scales [N, K / 32]
  const float* o;      // null: no offsets
  int64_t K, G;
  bool q5() const { return b != nullptr; }
  int64_t row_bytes() const { return q5() ? K / BLOCK * Q5_BLOCK_BYTES : K; }
  const void* codes(int64_t n) const {
    return q5() ? static_cast<const void*>(b + n * row_bytes()) : q + n * K;
  }
  Row row(int64_t n) const {
    const int64_t NG = K / G;
    return {q5() ? nullptr : q + n * K, q5() ? b + n * row_bytes() : nullptr,
            q5() ? nullptr : s + n * NG, q5() ? h + n * NG : nullptr,
            o != nullptr ? o + n * NG : nullptr};
  }
};

// The weight's codes, its tensors (and x's width K) checked for `fn`: q int8 [N, K] with
// scales float32 [N, K / G] (G 32 or 16) and offsets none or as the scales, or q uint8 [N,
// K / 32 * 20] (5-bit codes) with scales float16 [N, K / 32] and no offsets; K % 32 == 0.
static Codes codes_of(const char* fn, const at::Tensor& q, const at::Tensor& s,
                      const OptTensor& o, int64_t K) {
  const bool q5 = q.scalar_type() == at::kByte;
  const bool common = q.dim() == 2 && q.is_contiguous() && K % BLOCK == 0 && s.dim() == 2 &&
                      s.is_contiguous() && s.size(0) == q.size(0);
  const bool int8 = common && q.scalar_type() == at::kChar && q.size(1) == K &&
                    s.scalar_type() == at::kFloat &&
                    (s.size(1) * 32 == K || s.size(1) * 16 == K) &&
                    (!o || (o->scalar_type() == at::kFloat && o->is_contiguous() &&
                            o->sizes() == s.sizes()));
  const bool five = common && q5 && q.size(1) == K / BLOCK * Q5_BLOCK_BYTES &&
                    s.scalar_type() == at::kHalf && s.size(1) * 32 == K && !o;
  TORCH_CHECK(int8 || five, fn,
              ": q int8 [N, K] with scales float32 [N, K / 32] or [N, K / 16] and offsets none "
              "or as the scales, or q uint8 [N, K / 32 * 20] (5-bit codes) with scales float16 "
              "[N, K / 32] and no offsets; x [M, K]; all contiguous, K % 32 == 0");
  if (q5) return {nullptr, q.data_ptr<uint8_t>(), nullptr, s.data_ptr<at::Half>(), nullptr, K, 32};
  return {q.data_ptr<int8_t>(), nullptr, s.data_ptr<float>(), nullptr,
          o ? o->data_ptr<float>() : nullptr, K, K / s.size(1)};
}

// f(std::integral_constant<int64_t, G>{}, std::bool_constant<Q5>{}) for the weight's group G
// (16 or 32) and format (5-bit codes or int8): one instantiation of each loop per kind, both
// constants inside it.
template <typename F>
static decltype(auto) with_format(const Codes& W, F&& f) {
  if (W.q5()) return f(std::integral_constant<int64_t, 32>{}, std::true_type{});
  if (W.G == 16) return f(std::integral_constant<int64_t, 16>{}, std::false_type{});
  return f(std::integral_constant<int64_t, 32>{}, std::false_type{});
}

// Column j's code (0 <= j < 32) of a block of 5-bit codes: u - 16.
static inline int q5_code(const uint8_t* blk, int64_t j) {
  if (j < 16) return (blk[j] & 31) - 16;
  uint32_t word;
  std::memcpy(&word, blk + 16, sizeof word);
  return static_cast<int>(((blk[j - 16] >> 5) << 2) | ((word >> (2 * (j - 16))) & 3)) - 16;
}

// Weight k of a row (codes q, its scales s and offsets o or null), float32: the code times
// its group's scale, rounded once, then plus the offset, rounded once. GGUF's own values bit
// for bit: Q6_K's (d * sc) * (q - 32) is that product; Q5_K's (d * sc) * q is exact (22
// significant bits), so adding -(dmin * m) is gguf's one rounding.
// A 5-bit code times its float16 scale: exact in float32 (5 by 11 significant bits), as
// gguf computes Q5_0's d * (q - 16).
template <int64_t G, bool Q5>
static inline float weight_at(const Row& r, int64_t k) {
  if constexpr (Q5) {
    const uint8_t* blk = r.b + k / BLOCK * Q5_BLOCK_BYTES;
    return static_cast<float>(q5_code(blk, k % BLOCK)) * static_cast<float>(r.h[k / BLOCK]);
  } else {
    const float w = static_cast<float>(r.q[k]) * r.s[k / G];
    return r.o != nullptr ? w + r.o[k / G] : w;
  }
}

#if Q8_FAST
static inline __m512 codes16(const int8_t* c) {  // 16 codes as float32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)c)));
}

// Weights k .. k + 15 of a row of int8 codes (k % 16 == 0: one group), as weight_at computes
// them (the product exact where there is an offset, so the fused add rounds as the separate
// one).
template <int64_t G>
static inline __m512 weights16(const Row& r, int64_t k) {
  const __m512 sc = _mm512_set1_ps(r.s[k / G]);
  return r.o != nullptr ? _mm512_fmadd_ps(codes16(r.q + k), sc, _mm512_set1_ps(r.o[k / G]))
                        : _mm512_mul_ps(codes16(r.q + k), sc);
}

// Weights k .. k + 31 of a row (k % 32 == 0), as weight_at computes them, in w0 (the first
// 16) and w1. 5-bit codes: a 32-entry table of the block's weights d * (u - 16) (exact:
// weight_at's values), looked up by vpermi2ps, which reads an index's low 5 bits: the 16
// bytes widened to 32 bits index columns 0-15 as they are; columns 16-31 take bits 2-4 from
// the bytes shifted right by 3 and bits 0-1 from the word shifted right by 2j (one bitwise
// select). ~10 instructions per 32 weights against ~19 to spread nibbles and add fifth bits.
template <int64_t G, bool Q5>
static inline void weights32(const Row& r, int64_t k, __m512& w0, __m512& w1) {
  if constexpr (Q5) {
    const uint8_t* blk = r.b + k / BLOCK * Q5_BLOCK_BYTES;
    const __m512i bytes =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    uint32_t word;
    std::memcpy(&word, blk + 16, sizeof word);
    const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                             28, 30);
    const __m512i low2 = _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word)), shifts);
    // bits 0-1 from low2, the rest from bytes >> 3 (0xCA: a ? b : c, a the mask 3)
    const __m512i upper = _mm512_ternarylogic_epi32(_mm512_set1_epi32(3), low2,
                                                    _mm512_srli_epi32(bytes, 3), 0xCA);
    const __m512 d = _mm512_set1_ps(r.s[k / BLOCK]);  // float_scales' copy
    const __m512 neg = _mm512_mul_ps(
        d, _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1));
    const __m512 pos =
        _mm512_mul_ps(d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    w0 = _mm512_permutex2var_ps(neg, bytes, pos);
    w1 = _mm512_permutex2var_ps(neg, upper, pos);
  } else {
    w0 = weights16<G>(r, k);
    w1 = weights16<G>(r, k + CHUNK);
  }
}

// r with its float16 scales (5-bit codes, NG of them) converted into out [NG] float32 as r.s,
// which weights32 broadcasts from memory as the int8 codes' scales: converting each block's
// scale in the loop took three shuffles per 32 weights.
static inline Row float_scales(Row r, int64_t NG, float* out) {
  for (int64_t g = 0; g < NG; g += 16) {
    const __mmask16 m = NG - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (NG - g)) - 1);
    const __m256i h = _mm256_maskz_loadu_epi16(m, r.h + g);
    _mm512_mask_storeu_ps(out + g, m, _mm512_cvtph_ps(h));
  }
  r.s = out;
  return r;
}

// Row n of W as weights32 reads it (5-bit codes: float_scales into out [K / 32]).
template <bool Q5>
static inline Row fast_row(const Codes& W, int64_t n, float* out) {
  if constexpr (Q5) return float_scales(W.row(n), W.K / BLOCK, out);
  return W.row(n);
}

// This thread's scratch of at least `floats` float32 (float_scales' copies).
static float* scale_scratch(int64_t floats) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < floats) buf.resize(floats);
  return buf.data();
}

// Asks for the cache lines of bytes [0, bytes) at p (HINT: _MM_HINT_T0 or _MM_HINT_T1).
template <int HINT>
static inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64)
    _mm_prefetch(static_cast<const char*>(p) + l, static_cast<_mm_hint>(HINT));
}
#endif

// Y[r, n] for rows r < R of X [R, K] float32 and outputs n0 <= n < n1: sum over k of
// W[n, k] X[r, k] in float32, each weight as weight_at computes it (gguf's value: x times the
// very weights of a dense float32 copy, summed in another order). Dequantizing 16 weights
// once for all R rows takes one multiply (or FMA) each, then one FMA per row: fewer than
// scaling each row's partial sum per group (Q8_0's group of 32: 3 per row and 32 weights), and
// no extra term for the offsets.
template <int R, int64_t G, bool Q5>
static void gemv_rows(const float* X, const Codes& W, int64_t n0, int64_t n1, float* Y,
                      int64_t N) {
  const int64_t K = W.K, NG = K / G;
#if Q8_FAST
  float* scales = Q5 ? scale_scratch(NG) : nullptr;
#endif
  for (int64_t n = n0; n < n1; ++n) {
#if Q8_FAST
    const Row r = fast_row<Q5>(W, n, scales);
    // One core alone cannot keep enough cache misses in flight to reach the memory
    // bandwidth with the hardware prefetcher only: ask for rows a few ahead.
    if (n + PREFETCH < n1) {
      const Row ahead = W.row(n + PREFETCH);
      prefetch_row<_MM_HINT_T0>(W.codes(n + PREFETCH), W.row_bytes());
      prefetch_row<_MM_HINT_T0>(Q5 ? static_cast<const void*>(ahead.h) : ahead.s,
                                NG * (Q5 ? 2 : 4));
      if (ahead.o != nullptr) prefetch_row<_MM_HINT_T0>(ahead.o, NG * 4);
    }
    // two sums per row (even and odd 16 columns): one FMA chain per row would wait on its
    // latency at one row
    __m512 even[R], odd[R];
    for (int i = 0; i < R; ++i) even[i] = odd[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += BLOCK) {
      __m512 w0, w1;
      weights32<G, Q5>(r, k, w0, w1);
      for (int i = 0; i < R; ++i) {
        even[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(X + i * K + k), even[i]);
        odd[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(X + i * K + k + CHUNK), odd[i]);
      }
    }
    for (int i = 0; i < R; ++i) Y[i * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(even[i], odd[i]));
#else
    (void)NG;
    const Row r = W.row(n);
    for (int i = 0; i < R; ++i) {
      const float* x = X + i * K;
      float t = 0.f;
      for (int64_t k = 0; k < K; ++k) t += weight_at<G, Q5>(r, k) * x[k];
      Y[i * N + n] = t;
    }
#endif
  }
}

// y [M, N] float32 = xf [M, K] float32 (contiguous) W^T, W = q [N, K] int8 * s [N, K / G]
// (+ offset [N, K / G]).
void q8_gemv(const at::Tensor& xf, const at::Tensor& q, const at::Tensor& s, at::Tensor& y,
             const OptTensor& offset) {
  TORCH_CHECK(xf.scalar_type() == at::kFloat && xf.dim() == 2 && xf.is_contiguous() &&
                  y.scalar_type() == at::kFloat && y.is_contiguous() && y.dim() == 2 &&
                  y.size(0) == xf.size(0) && y.size(1) == q.size(0),
              "q8_gemv: x float32 [M, K], y float32 [M, N], contiguous");
  const Codes W = codes_of("q8_gemv", q, s, offset, xf.size(1));
  const int64_t M = xf.size(0), K = xf.size(1), N = q.size(0);
  const float* X = xf.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  with_format(W, [&](auto group, auto five) {
    constexpr int64_t GC = decltype(group)::value;
    constexpr bool Q5 = decltype(five)::value;
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      // up to 8 rows per read of the codes (a speculative step's k + 1 <= 8 rows read them
      // once): 16 accumulators and the two weight vectors fit AVX-512's 32 registers
      for (int64_t m = 0; m < M; m += 8) {
        const float* x = X + m * K;
        float* out = Y + m * N;
        switch (std::min<int64_t>(8, M - m)) {
          case 1: gemv_rows<1, GC, Q5>(x, W, n0, n1, out, N); break;
          case 2: gemv_rows<2, GC, Q5>(x, W, n0, n1, out, N); break;
          case 3: gemv_rows<3, GC, Q5>(x, W, n0, n1, out, N); break;
          case 4: gemv_rows<4, GC, Q5>(x, W, n0, n1, out, N); break;
          case 5: gemv_rows<5, GC, Q5>(x, W, n0, n1, out, N); break;
          case 6: gemv_rows<6, GC, Q5>(x, W, n0, n1, out, N); break;
          case 7: gemv_rows<7, GC, Q5>(x, W, n0, n1, out, N); break;
          default: gemv_rows<8, GC, Q5>(x, W, n0, n1, out, N); break;
        }
      }
    });
  });
}

// Whether this build has the AVX-512 kernel (the fast path; else portable scalar code).
bool q8_fast() { return Q8_FAST; }

// Rows n0 .. n0 + rows - 1 of W as bfloat16 [rows, K] (row-major): weight_at's float32
// values (gguf's), rounded once to nearest even: the values of the dense bfloat16 copy. With
// prefetch_next, the next block's codes are asked for.
template <int64_t G, bool Q5>
static void dequant_rows(const Codes& W, int64_t n0, int64_t rows, bool prefetch_next,
                         at::BFloat16* out) {
  const int64_t K = W.K;
#if Q8_FAST && defined(__AVX512BF16__)
  float* scales = Q5 ? scale_scratch(K / BLOCK) : nullptr;
#endif
  for (int64_t j = 0; j < rows; ++j) {
    at::BFloat16* row = out + j * K;
#if Q8_FAST && defined(__AVX512BF16__)
    const Row r = fast_row<Q5>(W, n0 + j, scales);
    if (prefetch_next) prefetch_row<_MM_HINT_T1>(W.codes(n0 + 64 + j), W.row_bytes());
    for (int64_t k = 0; k < K; k += BLOCK) {
      __m512 w0, w1;
      weights32<G, Q5>(r, k, w0, w1);
      _mm512_storeu_si512(row + k, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
    }
#else
    (void)prefetch_next;
    const Row r = W.row(n0 + j);
    for (int64_t k = 0; k < K; ++k) row[k] = c10::BFloat16(weight_at<G, Q5>(r, k));
#endif
  }
}

// The many-row path is there: oneDNN's bfloat16 brgemm runs (AMX or AVX-512 BF16).
bool q8_mm_available() { return brgemm_bf16_runs(); }

// y[r, j] = C[j, r] for r < mt, j < rows: a brgemm tile C [rows, mt] (outputs x rows of x)
// stored into y (row stride N) transposed.
static inline void store_transposed(const float* C, int64_t mt, int64_t rows, float* y,
                                    int64_t N) {
  for (int64_t r = 0; r < mt; ++r) {
    float* o = y + r * N;
    int64_t j = 0;
#if Q8_FAST
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(static_cast<int>(mt)));
    for (; j + 16 <= rows; j += 16)
      _mm512_storeu_ps(o + j, _mm512_i32gather_ps(idx, C + j * mt + r, 4));
#endif
    for (; j < rows; ++j) o[j] = C[j * mt + r];
  }
}

// y [M, N] float32 = x [M, K] bfloat16 W^T (W: codes, scales per G columns, offsets or none),
// without a dense copy of W: per block of 64 output features, W's rows are dequantized into
// the thread's scratch [64, K] (72 KiB at K = 576), which is brgemm's A (row-major, no
// packing); x^T, packed once per call in brgemm's VNNI layout [K / 2][M][2], is B; C = W_blk
// x^T [64, M tile] (float32 accumulation over all of K) is stored transposed into y.
at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s,
                 const OptTensor& offset) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "q8_mm: x bfloat16 [M, K], contiguous");
  const Codes W = codes_of("q8_mm", q, s, offset, x.size(1));
  TORCH_CHECK(q8_mm_available(), "q8_mm: oneDNN's bfloat16 brgemm does not run here");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), NBLK = (N + 63) / 64;
  constexpr int64_t MT = 64;  // rows per brgemm call (C is [64, MT] float32: 16 KiB)
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  // x^T as 32-bit words (column pairs): xt[k / 2][r] = (x[r, k], x[r, k + 1]).
  at::Tensor xt = at::empty({K / 2, M, 2}, x.options());
  {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
    uint32_t* dst = reinterpret_cast<uint32_t*>(xt.data_ptr<at::BFloat16>());
    for (int64_t r = 0; r < M; ++r)
      for (int64_t p = 0; p < K / 2; ++p) dst[p * M + r] = src[r * (K / 2) + p];
  }
  const at::BFloat16* B = xt.data_ptr<at::BFloat16>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, NBLK, 1, [&](int64_t begin, int64_t end) {
    thread_local at::Tensor abuf, cbuf;  // grow to the largest K seen
    if (!abuf.defined() || abuf.numel() < 64 * K) abuf = at::empty({64 * K}, at::kBFloat16);
    if (!cbuf.defined()) cbuf = at::empty({64 * MT}, at::kFloat);
    at::BFloat16* A = abuf.data_ptr<at::BFloat16>();
    float* C = cbuf.data_ptr<float>();
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * 64, rows = std::min<int64_t>(64, N - n0);
      // the next block's rows (all 64 of them: only the last block has fewer)
      const bool next = blk + 1 < end;
      with_format(W, [&](auto g, auto five) {
        dequant_rows<decltype(g)::value, decltype(five)::value>(W, n0, rows, next, A);
      });
      for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int64_t mt = std::min(MT, M - m0);
        at::native::cpublas::brgemm(rows, mt, K, K, M, mt, false, A, B + m0 * 2, C, true);
        store_transposed(C, mt, rows, Y + m0 * N + n0, N);
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return y;
}

#if Q8_FAST
// r[i] <- column i of the 16 x 16 block whose row j is r[j] (4 shuffle stages, 64 shuffles).
static inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + c], lane l: rows 4g .. 4g + 3 at column 4l + c
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * g + 1]), d = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int c = 0; c < 4; ++c) {  // column 4l + c: lane l of u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512 p0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44);
    const __m512 p1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 p2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 p3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(p0, p2, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(p0, p2, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(p1, p3, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(p1, p3, 0xDD);
  }
}
#endif

// W's rows n0 .. n0 + rows - 1 (rows <= 64) transposed into out [K, 64] float32 (column j:
// row n0 + j; columns from rows on are not read): weight_at's values, gguf's dequantized
// weights bit for bit. 16 rows at a time: their next 32 weights, two 16 x 16 transposes.
template <int64_t G, bool Q5>
static void dequant_cols_f32(const Codes& W, int64_t n0, int64_t rows, bool prefetch_next,
                             float* out) {
  const int64_t K = W.K;
#if Q8_FAST
  float* scales = Q5 ? scale_scratch(16 * (K / BLOCK)) : nullptr;
  for (int64_t j0 = 0; j0 < rows; j0 += 16) {
    Row r[16];
    const int64_t n = std::min<int64_t>(rows - j0, 16);
    for (int64_t j = 0; j < n; ++j) {
      r[j] = fast_row<Q5>(W, n0 + j0 + j, Q5 ? scales + j * (K / BLOCK) : nullptr);
      if (prefetch_next) prefetch_row<_MM_HINT_T1>(W.codes(n0 + 64 + j0 + j), W.row_bytes());
    }
    for (int64_t k = 0; k < K; k += BLOCK) {
      __m512 lo[16], hi[16];
      for (int64_t j = 0; j < 16; ++j) {
        if (j < n) {
          weights32<G, Q5>(r[j], k, lo[j], hi[j]);
        } else {
          lo[j] = hi[j] = _mm512_setzero_ps();
        }
      }
      transpose16(lo);
      transpose16(hi);
      for (int64_t i = 0; i < CHUNK; ++i) {
        _mm512_storeu_ps(out + (k + i) * 64 + j0, lo[i]);
        _mm512_storeu_ps(out + (k + CHUNK + i) * 64 + j0, hi[i]);
      }
    }
  }
#else
  (void)prefetch_next;
  for (int64_t j = 0; j < rows; ++j) {
    const Row r = W.row(n0 + j);
    for (int64_t k = 0; k < K; ++k) out[k * 64 + j] = weight_at<G, Q5>(r, k);
  }
#endif
}

// y [M, N] float32 = x [M, K] float32 W^T (W: codes, scales per G columns, offsets or none),
// without a dense copy of W (a float32 model's many-row path), as int4's: a work item is a
// block of 64 output features and a tile of rows (row_tiles: enough items for the threads);
// the block's W^T is dequantized exactly into the thread's scratch [K, 64] float32 (160 KiB at
// K = 640: L2) once for its tiles, and oneDNN's float32 brgemm multiplies the tile's rows of x
// by it straight into y (float32 throughout: x W^T of the exact weights up to float32
// summation order). The rows are the GEMM's M, the 64 features its vector dimension: W_blk
// x^T (features as M, rows as N) left a 41-row prefill's 41 columns in 48 lanes and stored
// C transposed by gathers: 1.5x the packed dense GEMM at 640x2048, and at::mm above 128 rows,
// where brgemm over those x^T rows ran 2.4x it. Now brgemm matches the packed dense GEMM at
// 9-512 rows (benchmarks/q8_linears.py, docs/tuning.md). Above brgemm_rows rows (tests force
// it), or where the float32 brgemm does not run, at::mm multiplies the same scratch
// (single-threaded: inside the loop).
at::Tensor q8_mm_f32_with(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s,
                          int64_t brgemm_rows, const OptTensor& offset) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "q8_mm_f32: x float32 [M, K], contiguous");
  const Codes W = codes_of("q8_mm_f32", q, s, offset, x.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), NB = (N + 63) / 64;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const bool brgemm = M <= brgemm_rows && brgemm_f32_runs();
  const auto [MT, mt] = row_tiles(M, NB, 64);
  const float* X = x.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, NB * MT, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> wbuf;  // grows to the largest K seen
    if (static_cast<int64_t>(wbuf.size()) < K * 64) wbuf.resize(K * 64);
    float* Wt = wbuf.data();
    int64_t have = -1;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / MT, m0 = (i % MT) * mt, mr = std::min(mt, M - m0);
      const int64_t n0 = b * 64, cols = std::min<int64_t>(64, N - n0);
      if (b != have) {
        const bool next = (i / MT + 1) * MT < end;  // this thread's next item is a new block
        with_format(W, [&](auto g, auto five) {
          dequant_cols_f32<decltype(g)::value, decltype(five)::value>(W, n0, cols, next, Wt);
        });
        have = b;
      }
      if (brgemm) {
        at::native::cpublas::brgemm(mr, cols, K, K, 64, N, false, X + m0 * K, Wt,
                                    Y + m0 * N + n0, false);
      } else {
        at::Tensor out = at::from_blob(Y + m0 * N + n0, {mr, cols}, {N, 1}, y.options());
        at::mm_out(out, x.narrow(0, m0, mr), at::from_blob(Wt, {K, cols}, {64, 1}, y.options()));
      }
    }
    if (brgemm) at::native::cpublas::brgemm_release(false);
  });
  return y;
}

at::Tensor q8_mm_f32(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s,
                     const OptTensor& offset) {
  return q8_mm_f32_with(x, q, s, INT64_MAX, offset);
}

// The op's CPU kernel (its schema and torch reference: asyncllm/kernels/ops.py and
// asyncllm/layers/q8_linear.py): x [..., K] float32 or bfloat16 -> [..., N], float32 with
// logits (the LM head), else in x's dtype. More than max_rows rows take q8_mm (bfloat16 x,
// where oneDNN's bfloat16 brgemm runs) or q8_mm_f32; up to max_rows the matrix-vector
// kernel. `packed` is not read: a layer makes a packed dense copy only where this kernel is
// not loaded (and a oneDNN tensor's calls dispatch to the torch reference anyway).
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s,
                       const OptTensor& packed, const OptTensor& bias, int64_t max_rows,
                       bool logits, const OptTensor& offset) {
  (void)packed;
  const int64_t N = q.size(0), K = q.scalar_type() == at::kByte ? s.size(1) * BLOCK : q.size(1);
  const at::Tensor rows = x.reshape({-1, K});
  const bool many = rows.size(0) > max_rows;
  const bool bf16_mm = many && x.scalar_type() == at::kBFloat16 && q8_mm_available();
  at::Tensor y;
  if (bf16_mm)
    y = q8_mm(rows.contiguous(), q, s, offset);
  else if (many)
    y = q8_mm_f32(rows.to(at::kFloat).contiguous(), q, s, offset);
  else
    y = on_distinct_rows(rows.to(at::kFloat), [&](const at::Tensor& r) {
      at::Tensor out = at::empty({r.size(0), N}, r.options());
      q8_gemv(r, q, s, out, offset);
      return out;
    });
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  y = y.view(shape);
  if (bias.has_value()) y = y + bias->to(at::kFloat);
  return logits ? y : y.to(x.scalar_type());
}

// The op's CPU kernel, registered by the loader.
void register_ops() {
  static const bool once = [] {
    cpu_impls(__FILE__, __LINE__).impl("q8_0_linear", TORCH_FN(q8_0_linear));
    return true;
  }();
  (void)once;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using py::arg;
  const auto none = py::none();
  m.def("register_ops", &register_ops, "Register this module's CPU kernels of the asyncllm ops (once).");
  m.def("q8_gemv", torch::wrap_pybind_function(q8_gemv), "q8_gemv", arg("x"), arg("q"),
        arg("scale"), arg("y"), arg("offset") = none);
  m.def("q8_fast", torch::wrap_pybind_function(q8_fast), "q8_fast");
  m.def("q8_mm", torch::wrap_pybind_function(q8_mm), "q8_mm", arg("x"), arg("q"), arg("scale"),
        arg("offset") = none);
  m.def("q8_mm_f32", torch::wrap_pybind_function(q8_mm_f32), "q8_mm_f32", arg("x"), arg("q"),
        arg("scale"), arg("offset") = none);
  m.def("q8_mm_f32_with", torch::wrap_pybind_function(q8_mm_f32_with), "q8_mm_f32_with",
        arg("x"), arg("q"), arg("scale"), arg("brgemm_rows"), arg("offset") = none);
  m.def("q8_mm_available", torch::wrap_pybind_function(q8_mm_available), "q8_mm_available");
}
