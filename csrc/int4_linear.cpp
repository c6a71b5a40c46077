#include "common.h"
#include "python_module.h"

#include <ATen/Parallel.h>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <ATen/native/CPUBlas.h>
#include <algorithm>
#include <map>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

static inline void put(float v, float* dst) { *dst = v; }
static inline void put(float v, at::BFloat16* dst) {  // round to nearest even (finite v)
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  dst->x = static_cast<uint16_t>(u >> 16);
}

// The output rows per block of torch's packed int4 layout: its CPU kernels pack
// [N / 64, K, 32] bytes where they run AVX-512 and [N / 32, K, 16] elsewhere (ATen's
// weight_to_int4pack_kernel, chosen by torch's CPU capability, ATEN_CPU_CAPABILITY included).
// Asked once from torch itself: a [64, 2] weight of known codes packed; 0 for a layout this
// file does not know (then only torch's own kernel reads it).
int64_t int4_pack_block_n() {
  static const int64_t n = [] {
    at::Tensor q = at::empty({64, 2}, at::kInt);
    int32_t* d = q.data_ptr<int32_t>();
    for (int r = 0; r < 64; ++r)
      for (int k = 0; k < 2; ++k) d[r * 2 + k] = r / 16 + 4 * k;
    const at::Tensor p = at::_convert_weight_to_int4pack_for_cpu(q, 1).contiguous();
    if (p.numel() != 64) return int64_t{0};
    const uint8_t* b = p.data_ptr<uint8_t>();
    // Byte 16: [0, 0, 16] (rows 16 and 48 at k = 0) in the 64 layout, [0, 1, 0] (rows 0 and
    // 16 at k = 1) in the 32 one.
    if (b[16] == (1 | 3 << 4) && b[0] == (0 | 2 << 4)) return int64_t{64};
    if (b[16] == (4 | 5 << 4) && b[0] == (0 | 1 << 4)) return int64_t{32};
    return int64_t{0};
  }();
  return n;
}

// H * 2 outputs from H code bytes p: o[j] from p[j]'s low nibble, o[H + j] from its high
// nibble, each (q - B) * s + z with scales s and zeros z (float, 2H each): B = 8 for torch's
// (scale, zero), 0 for a tile-major (scale, offset).
template <int H, typename T, int B = 8>
static inline void row_codes(const uint8_t* p, const float* s, const float* z, T* o) {
#pragma omp simd
  for (int j = 0; j < H; ++j) {
    const float lo = static_cast<float>(static_cast<int>(p[j] & 15) - B);
    const float hi = static_cast<float>(static_cast<int>(p[j] >> 4) - B);
    put(lo * s[j] + z[j], o + j);
    put(hi * s[H + j] + z[H + j], o + H + j);
  }
}

// One row of 64 outputs in the 64 layout: 32 code bytes p.
template <typename T>
static inline void row64(const uint8_t* p, const float* s, const float* z, T* o) {
  row_codes<32>(p, s, z, o);
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

// Rows k of one group g of W^T's 64-column block b (W[n, k] = (q[n, k] - 8) * s + z, see
// dequant): `group` rows of 64 outputs each, row k at o + (k - g * group) * ld. 64 scales
// and zeros loaded once, then 32 code bytes per row in the 64 layout, 2 x 16 in the 32 one
// (blocks 2b and 2b + 1).
template <typename T>
static inline void dequant_group(const uint8_t* P, const T* S, int64_t K, int64_t N,
                                 int64_t group, int64_t block_n, int64_t g, int64_t b, T* o,
                                 int64_t ld) {
  alignas(64) float s[64], z[64];
  const T* src = S + (g * N + b * 64) * 2;
  for (int j = 0; j < 64; ++j) {
    s[j] = to_f(src[2 * j]);
    z[j] = to_f(src[2 * j + 1]);
  }
  for (int64_t k = g * group; k < (g + 1) * group; ++k, o += ld) {
    if (block_n == 64) {
      row64<T>(P + (b * K + k) * 32, s, z, o);
    } else {
      row_codes<16>(P + (2 * b * K + k) * 16, s, z, o);
      row_codes<16>(P + ((2 * b + 1) * K + k) * 16, s + 32, z + 32, o + 32);
    }
  }
}

// dequant_group for tile-major float32 scales and offsets sz [N / 64, K / group, 2, 64]
// (W[n, k] = q[n, k] * scale + offset): the group's 64 of each are one run, read in place.
static inline void dequant_group_tiled(const uint8_t* P, const float* S, int64_t K,
                                       int64_t group, int64_t block_n, int64_t g, int64_t b,
                                       float* o, int64_t ld) {
  const float* s = S + (b * (K / group) + g) * 128;
  const float* z = s + 64;
  for (int64_t k = g * group; k < (g + 1) * group; ++k, o += ld) {
    if (block_n == 64) {
      row_codes<32, float, 0>(P + (b * K + k) * 32, s, z, o);
    } else {
      row_codes<16, float, 0>(P + (2 * b * K + k) * 16, s, z, o);
      row_codes<16, float, 0>(P + ((2 * b + 1) * K + k) * 16, s + 32, z + 32, o + 32);
    }
  }
}

// One group g of block b of W^T into o (row stride ld), for either scale layout.
template <typename T>
static inline void dequant_any(const uint8_t* P, const at::Tensor& sz, int64_t K, int64_t N,
                               int64_t group, int64_t block_n, int64_t g, int64_t b, T* o,
                               int64_t ld) {
  if constexpr (std::is_same_v<T, float>) {
    if (sz.dim() == 4)
      return dequant_group_tiled(P, sz.data_ptr<float>(), K, group, block_n, g, b, o, ld);
  }
  dequant_group<T>(P, sz.data_ptr<T>(), K, N, group, block_n, g, b, o, ld);
}

// out [K, N] = W^T with W[n, k] = (q[n, k] - 8) * sz[k / group, n, 0] + sz[k / group, n, 1]
// (or, float32 tile-major, q[n, k] * sz[n / 64, k / group, 0, n % 64] + sz[..., 1, n % 64]);
// packed uint8 in torch's CPU int4pack layout (int4_pack_block_n: [N / 64, K, 32] or
// [N / 32, K, 16]), sz [K / group, N, 2] of T. A work item is one group of K rows times 64
// output columns.
template <typename T>
static void dequant(const at::Tensor& packed, const at::Tensor& sz, int64_t group,
                    at::Tensor& out) {
  const int64_t K = out.size(0), N = out.size(1), NB = N / 64, G = K / group;
  const uint8_t* P = packed.data_ptr<uint8_t>();
  T* O = out.data_ptr<T>();
  const int64_t block_n = int4_pack_block_n();
  at::parallel_for(0, G * NB, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / NB, b = i % NB;
      dequant_any<T>(P, sz, K, N, group, block_n, g, b, O + g * group * N + b * 64, N);
    }
  });
}

static void check_dequant_args(const at::Tensor& packed, const at::Tensor& sz, int64_t group,
                               int64_t K, int64_t N, const char* who) {
  TORCH_CHECK(N % 64 == 0 && group > 0 && K % group == 0, who,
              ": out must be a contiguous [K, N] with N % 64 == 0, K % group == 0");
  TORCH_CHECK(int4_pack_block_n() != 0, who, ": torch packs int4 weights in a layout unknown here");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() * 2 == N * K,
              who, ": packed must be contiguous uint8 with N * K / 2 bytes");
  const bool torch_layout = (sz.scalar_type() == at::kBFloat16 || sz.scalar_type() == at::kFloat) &&
                            sz.dim() == 3 && sz.size(0) == K / group && sz.size(1) == N &&
                            sz.size(2) == 2;
  const bool tiled = sz.scalar_type() == at::kFloat && sz.dim() == 4 && sz.size(0) == N / 64 &&
                     sz.size(1) == K / group && sz.size(2) == 2 && sz.size(3) == 64;
  TORCH_CHECK(sz.is_contiguous() && (torch_layout || tiled), who,
              ": sz must be a contiguous [K / group, N, 2] of bfloat16 or float32, or a float32 "
              "[N / 64, K / group, 2, 64]");
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
  const auto [MT, mt] = row_tiles(M, NB, m_tile);
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

// The float32 many-row path: per work item one 64-column block of W^T dequantized exactly
// into the thread's scratch [K, 64] (256 B per row: L2-sized for these models' K), then one
// float32 GEMM of mt rows straight into y. The whole weight is never written out (the
// dequantize-then-mm path wrote and read it, 4 bytes per weight, at every step).
static void fused_f32(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& sz,
                      int64_t group, int64_t m_tile, at::Tensor& y) {
  const int64_t M = rows.size(0), K = rows.size(1), N = y.size(1), NB = N / 64;
  const auto [MT, mt] = row_tiles(M, NB, m_tile);
  const uint8_t* P = packed.data_ptr<uint8_t>();
  const float* A = rows.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  const int64_t block_n = int4_pack_block_n();
  const bool brgemm = brgemm_f32_runs();
  at::parallel_for(0, NB * MT, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> wbuf;
    if (static_cast<int64_t>(wbuf.size()) < K * 64) wbuf.resize(K * 64);
    float* W = wbuf.data();
    int64_t have = -1;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / MT, m0 = (i % MT) * mt, mr = std::min(mt, M - m0);
      if (b != have) {
        for (int64_t g = 0; g < K / group; ++g)
          dequant_any<float>(P, sz, K, N, group, block_n, g, b, W + g * group * 64, 64);
        have = b;
      }
      if (brgemm) {
        at::native::cpublas::brgemm(mr, 64, K, K, 64, N, false, A + m0 * K, W,
                                    Y + m0 * N + b * 64, false);
      } else {
        at::Tensor out = at::from_blob(Y + m0 * N + b * 64, {mr, 64}, {N, 1}, y.options());
        at::mm_out(out, rows.narrow(0, m0, mr), at::from_blob(W, {K, 64}, y.options()));
      }
    }
    if (brgemm) at::native::cpublas::brgemm_release(false);
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
#if !defined(__AVX512BF16__)
  // This variant's CPUs have no bfloat16 dot products, so a bfloat16 GEMM is emulated, a few
  // times slower than float32's: the rows and the weight (bfloat16 scales are exact in
  // float32) go through the float32 GEMM, and the output is rounded once.
  if (sz.scalar_type() == at::kBFloat16)
    return int4_mm(r.to(at::kFloat), packed, sz.to(at::kFloat), group, out_features, m_tile)
        .to(at::kBFloat16);
#endif
  if (m_tile > 0 && group % 2 == 0 && sz.scalar_type() == at::kBFloat16 && fused_available() &&
      int4_pack_block_n() == 64) {
    at::Tensor y = at::empty({r.size(0), out_features}, r.options());
    if (r.size(0) > 0) fused(r, packed, sz, group, m_tile, y);
    return y;
  }
  if (m_tile > 0 && sz.scalar_type() == at::kFloat) {
    at::Tensor y = at::empty({r.size(0), out_features}, r.options());
    if (r.size(0) > 0) fused_f32(r, packed, sz, group, m_tile, y);
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

// Calls per path of int4_linear: [0] torch's int4 kernel, [1] dequantize then GEMM, [2] a
// few-row kernel of ours (int4_gemv.cpp, int4_gemv_f32.cpp).
static std::atomic<int64_t> path_calls[3];

std::vector<int64_t> int4_path_calls() {
  return {path_calls[0].load(), path_calls[1].load(), path_calls[2].load()};
}

bool int4_gemv_runs(const at::Tensor& sz, int64_t group, int64_t out_features);
bool int4_gemv_available();
at::Tensor int4_gemv(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& sz,
                     int64_t group, int64_t out_features);
bool int4_gemv_f32_runs(const at::Tensor& sz, int64_t out_features);
at::Tensor int4_gemv_f32(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& sz,
                         int64_t group, int64_t out_features);

// y = x W^T + b in x's shape and dtype (ops.py's int4_linear_reference: the same function).
// Above max_rows rows (and N % 64 == 0, scales bfloat16 or float32) the weight is dequantized
// block by block and multiplied by a GEMM (int4_mm); up to max_rows float32 scales take
// int4_gemv_f32.cpp's kernel, bfloat16 ones up to gemv_rows int4_gemv.cpp's where it runs
// (both on the distinct rows only: on_distinct_rows); else torch's int4 kernel.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                       const c10::optional<at::Tensor>& bias, int64_t group, int64_t in_features,
                       int64_t out_features, int64_t max_rows, int64_t gemv_rows) {
  const at::Tensor rows = x.reshape({-1, in_features}).to(sz.scalar_type());
  at::Tensor y;
  const bool dense_ok = out_features % 64 == 0 && int4_pack_block_n() != 0 &&
      (sz.scalar_type() == at::kBFloat16 || sz.scalar_type() == at::kFloat);
  if (rows.size(0) > max_rows && dense_ok) {
    y = int4_mm(rows, packed, sz, group, out_features, M_TILE);
    ++path_calls[1];
  } else if (int4_gemv_f32_runs(sz, out_features)) {
    y = on_distinct_rows(rows, [&](const at::Tensor& r) {
      return int4_gemv_f32(r, packed, sz, group, out_features);
    });
    ++path_calls[2];
  } else if (rows.size(0) <= gemv_rows && int4_gemv_runs(sz, group, out_features)) {
    y = on_distinct_rows(rows, [&](const at::Tensor& r) {
      return int4_gemv(r, packed, sz, group, out_features);
    });
    ++path_calls[2];
  } else {
    // Tile-major scales never come here: they are float32 with N % 64 == 0, and the module
    // is not loaded where the packing is unknown (int4_pack_block_n() == 0; native.py).
    TORCH_CHECK(sz.dim() == 3, "int4_linear: tile-major scales need a known int4 packing");
    y = at::_weight_int4pack_mm_for_cpu(rows, packed, group, sz);
    ++path_calls[0];
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out_features;
  y = y.view(shape).to(x.scalar_type());
  return bias.has_value() ? y + *bias : y;
}

// The op's CPU kernel (its schema: asyncllm/kernels/ops.py), registered by the loader.
void register_ops() {
  static const bool once = [] {
    cpu_impls(__FILE__, __LINE__).impl("int4_linear", TORCH_FN(int4_linear));
    return true;
  }();
  (void)once;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_ops", &register_ops, "Register this module's CPU kernels of the asyncllm ops (once).");
  m.def("int4_dequant_t", torch::wrap_pybind_function(int4_dequant_t), "int4_dequant_t");
  m.def("int4_mm", torch::wrap_pybind_function(int4_mm), "int4_mm");
  m.def("int4_gemv", torch::wrap_pybind_function(int4_gemv), "int4_gemv");
  m.def("int4_fused_available", torch::wrap_pybind_function(int4_fused_available), "int4_fused_available");
  m.def("int4_gemv_f32", torch::wrap_pybind_function(int4_gemv_f32), "int4_gemv_f32");
  m.def("int4_gemv_available", torch::wrap_pybind_function(int4_gemv_available), "int4_gemv_available");
  m.def("int4_pack_block_n", torch::wrap_pybind_function(int4_pack_block_n), "int4_pack_block_n");
  m.def("int4_path_calls", torch::wrap_pybind_function(int4_path_calls), "int4_path_calls");
}
