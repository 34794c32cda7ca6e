// gact/codecs/quant_groups.cpp
//
// The per-group loops of the quant CPU executor, compiled once per instruction
// set: GACT_CODEC_ISA names the namespace (generic: the x86-64/aarch64 baseline;
// avx2: -mavx2, chosen at run time by quant_cpu.cpp when the CPU has it). The
// arithmetic is hd:: math from quant_math.hpp either way, without FMA contraction
// (-ffp-contract=off), so both builds produce the same bytes.
//
// Inside a group every step is a plain loop over a fixed-size stack buffer,
// written for the auto-vectorizer (see codecs/README.md, "Vectorization"):
//
//   encode:  load (+ widen 16/64-bit input, + normalize) -> min/max + finiteness over 8 lanes
//            -> Philox noise for the group (one call per 8 elements)
//            -> quantize (hd::quantize_u / hd::quantize_boundary) -> pack b-bit codes into bytes
//   decode:  unpack codes -> hd::dequantize (+ denormalize) -> narrow to the dtype -> store
//            (AVX-512, float32 plain and boundary groups of 1/2/4 bits: a group has at most 16 values,
//            computed once with the per-element rule; each 16 codes select theirs, unpacking nothing)
//
// The three variants (plain, normalized, boundary; format.hpp) are template
// parameters of the same loops, so each compiles to straight-line code.
//
// This file uses no C++ library code beyond <cstdint>/<cstring>: an inline
// library function compiled here with -mavx2 could otherwise be picked by the
// linker for the generic path too.
#include "codecs/float16.hpp"
#include "codecs/format.hpp"
#include "codecs/mask_math.hpp"
#include "codecs/philox.hpp"
#include "codecs/quant_job.hpp"
#include "codecs/quant_math.hpp"

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef GACT_CODEC_ISA
#define GACT_CODEC_ISA generic
#endif

namespace gact::codec::detail::GACT_CODEC_ISA {
namespace {

using hd::group_params;

constexpr int k_buf = k_max_group;

// ---- loads and stores by dtype --------------------------------------------------------------

template <dtype Dt>
struct io;
template <>
struct io<dtype::float32> {
  using storage = float;
  static float load(storage v) { return v; }
  static storage store(float v) { return v; }
};
template <>
struct io<dtype::float16> {
  using storage = std::uint16_t;
  static float load(storage v) { return hd::half_to_float(v); }
  static storage store(float v) { return hd::float_to_half(v); }
};
template <>
struct io<dtype::bfloat16> {
  using storage = std::uint16_t;
  static float load(storage v) { return hd::bf16_to_float(v); }
  static storage store(float v) { return hd::float_to_bf16(v); }
};
// float64 is quantized in float32 (a value beyond float's range becomes Inf and the tensor is
// refused as non-finite); its metadata is float32.
template <>
struct io<dtype::float64> {
  using storage = double;
  static float load(storage v) { return float(v); }
  static storage store(float v) { return double(v); }
};

/// Storage of one metadata value: the input dtype for the 16-bit floats, float32 otherwise.
template <dtype Dt>
struct meta_io {
  using storage = float;
  static float load(storage v) { return v; }
  static storage store(float v) { return v; }
};
template <>
struct meta_io<dtype::float16> : io<dtype::float16> {};
template <>
struct meta_io<dtype::bfloat16> : io<dtype::bfloat16> {};

// ---- encode ---------------------------------------------------------------------------------

/// min/max over n >= 1 values, 8 independent lanes; returns false if any value is NaN/±Inf.
[[maybe_unused]] bool group_minmax_portable(float const* x, int n, float& lo, float& hi) {
  float mn[8], mx[8];
  std::uint32_t bad[8];
  for (int j = 0; j < 8; ++j) {
    mn[j] = x[0];
    mx[j] = x[0];
    bad[j] = 0;
  }
  int const n8 = n & ~7;
  for (int i = 0; i < n8; i += 8) {
    for (int j = 0; j < 8; ++j) {
      float const v = x[i + j];
      mn[j] = v < mn[j] ? v : mn[j];
      mx[j] = v > mx[j] ? v : mx[j];
      bad[j] |= std::uint32_t((hd::float_bits(v) & 0x7F800000u) == 0x7F800000u);
    }
  }
  for (int i = n8; i < n; ++i) {
    float const v = x[i];
    mn[0] = v < mn[0] ? v : mn[0];
    mx[0] = v > mx[0] ? v : mx[0];
    bad[0] |= std::uint32_t((hd::float_bits(v) & 0x7F800000u) == 0x7F800000u);
  }
  float l = mn[0], h = mx[0];
  std::uint32_t b = bad[0];
  for (int j = 1; j < 8; ++j) {
    l = mn[j] < l ? mn[j] : l;
    h = mx[j] > h ? mx[j] : h;
    b |= bad[j];
  }
  lo = hd::canonical_zero(l);
  hi = hd::canonical_zero(h);
  return b == 0;
}

// The per-group loops are kept out of line: compiled on their own they vectorize, while
// inlined into the group loop, jump threading on the group parameters blocks that.
#if defined(__clang__)
#define GACT_LOOP __attribute__((noinline))
#else
#define GACT_LOOP __attribute__((noipa))
#endif

/// Noise uniforms u[0, 8*nchunks) for the chunks c0 .. c0+nchunks-1 (one Philox call per chunk).
[[maybe_unused]] GACT_LOOP void group_noise_portable(std::uint64_t seed, std::uint64_t key, std::uint64_t c0, int nchunks, float* __restrict u) {
  std::uint32_t const k0 = std::uint32_t(seed), k1 = std::uint32_t(seed >> 32);
  std::uint32_t const t0 = std::uint32_t(key), t1 = std::uint32_t(key >> 32);
  for (int k = 0; k < nchunks; ++k) {
    std::uint64_t const c = c0 + std::uint64_t(k);
    hd::philox_block const b = hd::philox4x32_10(hd::philox_block{{std::uint32_t(c), std::uint32_t(c >> 32), t0, t1}}, k0, k1);
    for (int w = 0; w < 4; ++w) {
      u[8 * k + 2 * w] = hd::noise_uniform(b.v[w] & 0xFFFFu);
      u[8 * k + 2 * w + 1] = hd::noise_uniform(b.v[w] >> 16);
    }
  }
}

#if defined(__AVX2__)
// Explicit AVX2 versions of the two steps the auto-vectorizer handles poorly: a float
// min/max reduction (it will not reorder one without -ffast-math, although min/max are
// exact in any order once -0 is canonicalised) and Philox, whose 32x32->64-bit products
// it widens lane by lane. Both compute exactly what the portable loops compute (the
// tests compare the two builds byte for byte).

bool group_minmax(float const* x, int n, float& lo, float& hi) {
  if (n < 8) return group_minmax_portable(x, n, lo, hi);
  __m256 mn = _mm256_loadu_ps(x), mx = mn;
  __m256i const expmask = _mm256_set1_epi32(0x7F800000);
  __m256i bad = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(mn), expmask), expmask);
  int i = 8;
#if defined(__AVX512F__)
  if (n >= 24) {  // 16 lanes from element 8 on, folded into the 8 (min/max are exact in any order)
    __m512 mn16 = _mm512_loadu_ps(x + 8), mx16 = mn16;
    __m512i const expmask16 = _mm512_set1_epi32(0x7F800000);
    auto nonfinite = [&](__m512 v) {
      return _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), expmask16), expmask16);
    };
    __mmask16 bad16 = nonfinite(mn16);
    for (i = 24; i + 16 <= n; i += 16) {
      __m512 const v = _mm512_loadu_ps(x + i);
      mn16 = _mm512_min_ps(v, mn16);
      mx16 = _mm512_max_ps(v, mx16);
      bad16 = _kor_mask16(bad16, nonfinite(v));
    }
    auto upper = [](__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); };
    mn = _mm256_min_ps(mn, _mm256_min_ps(_mm512_castps512_ps256(mn16), upper(mn16)));
    mx = _mm256_max_ps(mx, _mm256_max_ps(_mm512_castps512_ps256(mx16), upper(mx16)));
    bad = _mm256_or_si256(bad, _mm256_set1_epi32(bad16 != 0 ? -1 : 0));
  }
#endif
  for (; i + 8 <= n; i += 8) {
    __m256 const v = _mm256_loadu_ps(x + i);
    mn = _mm256_min_ps(v, mn);
    mx = _mm256_max_ps(v, mx);
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), expmask), expmask));
  }
  alignas(32) float m0[8], m1[8];
  _mm256_store_ps(m0, mn);
  _mm256_store_ps(m1, mx);
  float l = m0[0], h = m1[0];
  for (int j = 1; j < 8; ++j) {
    l = m0[j] < l ? m0[j] : l;
    h = m1[j] > h ? m1[j] : h;
  }
  bool ok = _mm256_testz_si256(bad, bad) != 0;
  for (; i < n; ++i) {
    float const v = x[i];
    l = v < l ? v : l;
    h = v > h ? v : h;
    ok = ok && hd::is_finite_bits(v);
  }
  lo = hd::canonical_zero(l);
  hi = hd::canonical_zero(h);
  return ok;
}

/// The uniforms of 8 chunks from their Philox output words (lane k of a, b, d, e = words 0..3 of
/// chunk k): the 16-bit halves turned into uniforms, then an 8x8 transpose to element order
/// u[8k + 2w + h].
inline void emit8(__m256i a, __m256i b, __m256i d, __m256i e, float* __restrict u) {
  __m256i const mask16 = _mm256_set1_epi32(0xFFFF);
  __m256 const scale = _mm256_set1_ps(1.52587890625e-05f), half = _mm256_set1_ps(7.62939453125e-06f);
  auto uni = [&](__m256i x) { return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(x), scale), half); };
  __m256i const words[4] = {a, b, d, e};
  __m256 rows[8];
  for (int w = 0; w < 4; ++w) {
    rows[2 * w] = uni(_mm256_and_si256(words[w], mask16));
    rows[2 * w + 1] = uni(_mm256_srli_epi32(words[w], 16));
  }
  __m256 const t0a = _mm256_unpacklo_ps(rows[0], rows[1]), t1a = _mm256_unpackhi_ps(rows[0], rows[1]);
  __m256 const t2a = _mm256_unpacklo_ps(rows[2], rows[3]), t3a = _mm256_unpackhi_ps(rows[2], rows[3]);
  __m256 const t4a = _mm256_unpacklo_ps(rows[4], rows[5]), t5a = _mm256_unpackhi_ps(rows[4], rows[5]);
  __m256 const t6a = _mm256_unpacklo_ps(rows[6], rows[7]), t7a = _mm256_unpackhi_ps(rows[6], rows[7]);
  __m256 const s0 = _mm256_shuffle_ps(t0a, t2a, 0x44), s1 = _mm256_shuffle_ps(t0a, t2a, 0xEE);
  __m256 const s2 = _mm256_shuffle_ps(t1a, t3a, 0x44), s3 = _mm256_shuffle_ps(t1a, t3a, 0xEE);
  __m256 const s4 = _mm256_shuffle_ps(t4a, t6a, 0x44), s5 = _mm256_shuffle_ps(t4a, t6a, 0xEE);
  __m256 const s6 = _mm256_shuffle_ps(t5a, t7a, 0x44), s7 = _mm256_shuffle_ps(t5a, t7a, 0xEE);
  _mm256_storeu_ps(u + 0, _mm256_permute2f128_ps(s0, s4, 0x20));
  _mm256_storeu_ps(u + 8, _mm256_permute2f128_ps(s1, s5, 0x20));
  _mm256_storeu_ps(u + 16, _mm256_permute2f128_ps(s2, s6, 0x20));
  _mm256_storeu_ps(u + 24, _mm256_permute2f128_ps(s3, s7, 0x20));
  _mm256_storeu_ps(u + 32, _mm256_permute2f128_ps(s0, s4, 0x31));
  _mm256_storeu_ps(u + 40, _mm256_permute2f128_ps(s1, s5, 0x31));
  _mm256_storeu_ps(u + 48, _mm256_permute2f128_ps(s2, s6, 0x31));
  _mm256_storeu_ps(u + 56, _mm256_permute2f128_ps(s3, s7, 0x31));
}

/// The 32-bit lane operations Philox needs, on 8 lanes (AVX2) or 16 (AVX-512).
struct lanes8 {
  using v = __m256i;
  static constexpr int n = 8;
  static v set1(std::uint32_t x) { return _mm256_set1_epi32(int(x)); }
  static v xor3(v a, v b, v c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }
  /// 64-bit lanes: counters c, c+1, ..; the full product of the low words; the high word.
  static v counters(std::uint64_t c) {
    return _mm256_add_epi64(_mm256_set1_epi64x(std::int64_t(c)), _mm256_setr_epi64x(0, 1, 2, 3));
  }
  static v mul64(v a, v m) { return _mm256_mul_epu32(a, m); }
  static v high(v p) { return _mm256_srli_epi64(p, 32); }
  /// The low words of two vectors of 64-bit lanes, in order, as one vector of 32-bit lanes.
  static v narrow(v x, v y) {
    __m256 const s = _mm256_shuffle_ps(_mm256_castsi256_ps(x), _mm256_castsi256_ps(y), 0x88);  // x0 x1 y0 y1 | x2 x3 y2 y3
    return _mm256_permute4x64_epi64(_mm256_castps_si256(s), 0xD8);
  }
  /// Uniforms of the 8 chunks whose words are lanes of a, b, d, e.
  static void emit(v a, v b, v d, v e, float* __restrict u) { emit8(a, b, d, e, u); }
};

#if defined(__AVX512F__)
struct lanes16 {
  using v = __m512i;
  static constexpr int n = 16;
  static v set1(std::uint32_t x) { return _mm512_set1_epi32(int(x)); }
  static v xor3(v a, v b, v c) { return _mm512_ternarylogic_epi32(a, b, c, 0x96); }  // a ^ b ^ c
  static v counters(std::uint64_t c) {
    return _mm512_add_epi64(_mm512_set1_epi64(std::int64_t(c)), _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static v mul64(v a, v m) { return _mm512_mul_epu32(a, m); }
  static v high(v p) { return _mm512_srli_epi64(p, 32); }
  static v narrow(v x, v y) {
    return _mm512_permutex2var_epi32(x, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), y);
  }
  /// Two halves of 8 chunks, each through the AVX2 transpose.
  static void emit(v a, v b, v d, v e, float* __restrict u) {
    emit8(_mm512_castsi512_si256(a), _mm512_castsi512_si256(b), _mm512_castsi512_si256(d),
          _mm512_castsi512_si256(e), u);
    emit8(_mm512_extracti64x4_epi64(a, 1), _mm512_extracti64x4_epi64(b, 1), _mm512_extracti64x4_epi64(d, 1),
          _mm512_extracti64x4_epi64(e, 1), u + 64);
  }
};
#endif

/// Philox4x32-10 for L::n*W consecutive chunks from c0: lane k of a[w], b[w], d[w], e[w] (32-bit
/// lanes) are words 0..3 of chunk c0 + L::n*w + k. Each counter runs in a 64-bit lane (L::n/2 per
/// vector): one 32x32->64-bit multiply is then a whole product, its high word one shift away, and
/// the high words left above the low ones are never read (the multiplies read the low 32 bits,
/// the xors keep the halves apart): 6 operations a round per vector. The 2W vectors are
/// interleaved round by round (one vector's rounds are a chain of dependent multiplies).
template <typename L, int W>
inline void philox_w(std::uint32_t k0, std::uint32_t k1, std::uint32_t t0, std::uint32_t t1, std::uint64_t c0,
                     typename L::v (&a)[W], typename L::v (&b)[W], typename L::v (&d)[W], typename L::v (&e)[W]) {
  using V = typename L::v;
  constexpr int Q = 2 * W;  // vectors of L::n/2 counters
  V x0[Q], x1[Q], x2[Q], x3[Q];
  for (int v = 0; v < Q; ++v) {
    V const c = L::counters(c0 + std::uint64_t(L::n / 2 * v));
    x0[v] = c;           // low word (the high word above it is not read)
    x1[v] = L::high(c);  // high word
    x2[v] = L::set1(t0);
    x3[v] = L::set1(t1);
  }
  V const m0 = L::set1(hd::k_philox_m0), m1 = L::set1(hd::k_philox_m1);
  for (int r = 0; r < 10; ++r) {
    V const kk0 = L::set1(k0 + std::uint32_t(r) * hd::k_philox_w0);
    V const kk1 = L::set1(k1 + std::uint32_t(r) * hd::k_philox_w1);
    for (int v = 0; v < Q; ++v) {  // hd::philox_round
      V const p0 = L::mul64(x0[v], m0), p1 = L::mul64(x2[v], m1);
      x0[v] = L::xor3(L::high(p1), x1[v], kk0);
      x2[v] = L::xor3(L::high(p0), x3[v], kk1);
      x1[v] = p1;
      x3[v] = p0;
    }
  }
  for (int w = 0; w < W; ++w) {
    a[w] = L::narrow(x0[2 * w], x0[2 * w + 1]);
    b[w] = L::narrow(x1[2 * w], x1[2 * w + 1]);
    d[w] = L::narrow(x2[2 * w], x2[2 * w + 1]);
    e[w] = L::narrow(x3[2 * w], x3[2 * w + 1]);
  }
}

/// Noise uniforms for L::n*W consecutive chunks from c0 (philox_w, then L::emit for each vector).
template <typename L, int W>
inline void noise_w(std::uint32_t k0, std::uint32_t k1, std::uint32_t t0, std::uint32_t t1, std::uint64_t c0,
                    float* __restrict u) {
  typename L::v a[W], b[W], d[W], e[W];
  philox_w<L, W>(k0, k1, t0, t1, c0, a, b, d, e);
  for (int v = 0; v < W; ++v) L::emit(a[v], b[v], d[v], e[v], u + 8 * L::n * v);
}

GACT_LOOP void group_noise(std::uint64_t seed, std::uint64_t key, std::uint64_t c0, int nchunks, float* __restrict u) {
  std::uint32_t const k0 = std::uint32_t(seed), k1 = std::uint32_t(seed >> 32);
  std::uint32_t const t0 = std::uint32_t(key), t1 = std::uint32_t(key >> 32);
  int k = 0;
#if defined(__AVX512F__)
  for (; k + 32 <= nchunks; k += 32) noise_w<lanes16, 2>(k0, k1, t0, t1, c0 + std::uint64_t(k), u + 8 * k);
#endif
  for (; k + 32 <= nchunks; k += 32) noise_w<lanes8, 4>(k0, k1, t0, t1, c0 + std::uint64_t(k), u + 8 * k);
  if (k + 16 <= nchunks) {
    noise_w<lanes8, 2>(k0, k1, t0, t1, c0 + std::uint64_t(k), u + 8 * k);
    k += 16;
  }
  if (k + 8 <= nchunks) {
    noise_w<lanes8, 1>(k0, k1, t0, t1, c0 + std::uint64_t(k), u + 8 * k);
    k += 8;
  }
  if (k < nchunks) group_noise_portable(seed, key, c0 + std::uint64_t(k), nchunks - k, u + 8 * k);
}
#else
bool group_minmax(float const* x, int n, float& lo, float& hi) { return group_minmax_portable(x, n, lo, hi); }
GACT_LOOP void group_noise(std::uint64_t seed, std::uint64_t key, std::uint64_t c0, int nchunks, float* __restrict u) {
  group_noise_portable(seed, key, c0, nchunks, u);
}
#endif

GACT_LOOP void quantize_group(float const* __restrict x, float const* __restrict u, int n, group_params const p,
                    std::int32_t* __restrict q) {
  for (int i = 0; i < n; ++i) q[i] = hd::quantize_u(x[i], p, u[i]);
}

/// Whether a dtype's decode narrows to 16 bits: its codes are chosen against the decoded values
/// (hd::quantize_u16), in the per-element loops below (the fused AVX-512 blocks are float32's).
template <dtype Dt>
inline constexpr bool k_narrow = Dt == dtype::float16 || Dt == dtype::bfloat16;
/// The fused AVX-512 blocks' narrowing of a dtype: 0 none, 1 float16, 2 bfloat16.
template <dtype Dt>
inline constexpr int k_narrow_kind = Dt == dtype::float16 ? 1 : Dt == dtype::bfloat16 ? 2 : 0;

#if defined(__AVX2__) && defined(__F16C__)
/// hd::narrow16 on 8 lanes, for finite values: F16C's conversions (hd::float_to_half's bits for every non-NaN
/// value, see widen<float16> below), and bfloat16's round to nearest even as hd::float_to_bf16 computes it.
template <bool Half>
inline __m256 narrow8(__m256 v) {
  if constexpr (Half) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    __m256i const x = _mm256_castps_si256(v);
    __m256i const lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i const r = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)), lsb);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(std::int32_t(0xFFFF0000u))));
  }
}

/// A group's constants on 8 lanes (hd::group_params).
struct params8 {
  __m256 s, lo_s, hi_s, step, levels, unscale;
  explicit params8(group_params const& p)
      : s(_mm256_set1_ps(p.s)), lo_s(_mm256_set1_ps(p.lo_s)), hi_s(_mm256_set1_ps(p.hi_s)),
        step(_mm256_set1_ps(p.step)), levels(_mm256_set1_ps(p.levels)), unscale(_mm256_set1_ps(p.unscale)) {}
  /// hd::dequantize (mul, add, min, mul; no FMA)
  __m256 dequantize(__m256i q) const {
    __m256 const xs = _mm256_min_ps(_mm256_add_ps(lo_s, _mm256_mul_ps(_mm256_cvtepi32_ps(q), step)), hi_s);
    return _mm256_mul_ps(xs, unscale);
  }
};

/// hd::quantize_u16 on 8 lanes, operation by operation (the same codes as the per-element loop).
template <bool Half>
inline __m256i quantize8_narrow(__m256 x, __m256 u, params8 const& g) {
  __m256 v = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(x, g.s), g.lo_s), g.step);
  v = _mm256_max_ps(v, _mm256_setzero_ps());  // v > 0 ? v : +0 (NaN: +0)
  v = _mm256_min_ps(v, g.levels);             // v < levels ? v : levels
  __m256i const k = _mm256_cvttps_epi32(v);
  __m256i const k1 = _mm256_add_epi32(k, _mm256_set1_epi32(1));
  __m256 const d0 = narrow8<Half>(g.dequantize(k)), d1 = narrow8<Half>(g.dequantize(k1));
  __m256 const below = _mm256_cmp_ps(_mm256_cvtepi32_ps(k), g.levels, _CMP_LT_OQ);
  // (in the scaled domain, as hd::quantize_u16)
  __m256 const xs = _mm256_mul_ps(x, g.s), d0s = _mm256_mul_ps(d0, g.s), d1s = _mm256_mul_ps(d1, g.s);
  __m256 const up = _mm256_cmp_ps(_mm256_mul_ps(u, _mm256_sub_ps(d1s, d0s)), _mm256_sub_ps(xs, d0s), _CMP_LT_OQ);
  return _mm256_sub_epi32(k, _mm256_castps_si256(_mm256_and_ps(below, up)));  // (a true lane is -1)
}
#endif

template <dtype Dt>
GACT_LOOP void quantize_group16(float const* __restrict x, float const* __restrict u, int n, group_params const p,
                                std::int32_t* __restrict q) {
  constexpr bool half = Dt == dtype::float16;
  int i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  params8 const g(p);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                        quantize8_narrow<half>(_mm256_loadu_ps(x + i), _mm256_loadu_ps(u + i), g));
#endif
  for (; i < n; ++i) q[i] = hd::quantize_u16<half>(x[i], p, u[i]);
}

/// Pack codes q[0, 8*nchunks) (zero past the group's end) into nchunks*Bits bytes, element e at bit e*Bits.
template <int Bits>
void pack_codes(std::int32_t const* __restrict q, int nchunks, std::uint8_t* __restrict out) {
  constexpr int per = 8 / Bits;
  int const nbytes = nchunks * Bits;
  for (int m = 0; m < nbytes; ++m) {
    std::int32_t v = 0;
    for (int j = 0; j < per; ++j) v |= q[m * per + j] << (j * Bits);
    out[m] = std::uint8_t(v);
  }
}

template <int Bits>
void unpack_codes(std::uint8_t const* __restrict in, int nchunks, std::int32_t* __restrict q) {
  constexpr int per = 8 / Bits;
  constexpr std::int32_t mask = (1 << Bits) - 1;
  int const nbytes = nchunks * Bits;
  for (int m = 0; m < nbytes; ++m) {
    std::int32_t const v = in[m];
    for (int j = 0; j < per; ++j) q[m * per + j] = (v >> (j * Bits)) & mask;
  }
}

template <dtype Dt>
GACT_LOOP void widen(typename io<Dt>::storage const* __restrict in, int n, float* __restrict out) {
  for (int i = 0; i < n; ++i) out[i] = io<Dt>::load(in[i]);
}

template <dtype Dt>
GACT_LOOP void dequantize_group(std::int32_t const* __restrict q, int n, group_params const p,
                      typename io<Dt>::storage* __restrict out) {
  for (int i = 0; i < n; ++i) out[i] = io<Dt>::store(hd::dequantize(q[i], p));
}

#if defined(__AVX2__)
/// hd::dequantize on 8 lanes, in registers (the same operations in the same order: convert, mul,
/// add, min, mul; no FMA).
struct dequant8 {
  __m256 lo_s, step, hi_s, unscale;
  explicit dequant8(group_params const& p)
      : lo_s(_mm256_set1_ps(p.lo_s)), step(_mm256_set1_ps(p.step)), hi_s(_mm256_set1_ps(p.hi_s)),
        unscale(_mm256_set1_ps(p.unscale)) {}
  __m256 operator()(std::int32_t const* q) const {
    __m256 xs = _mm256_add_ps(lo_s, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(
                                                      reinterpret_cast<__m256i const*>(q))), step));
    xs = _mm256_min_ps(xs, hi_s);  // xs < hi_s ? xs : hi_s (NaN metadata gives hi_s = NaN in both)
    return _mm256_mul_ps(xs, unscale);
  }
};
#endif

#if defined(__F16C__)
// float16 in the AVX2 build: the F16C conversions (round to nearest even, denormals and
// overflow handled as IEEE says) give the same bits as hd::half_to_float/float_to_half for
// every non-NaN value; NaN stays NaN (its payload may differ, which no decoder relies on).
template <>
GACT_LOOP void widen<dtype::float16>(std::uint16_t const* __restrict in, int n, float* __restrict out) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(in + i))));
  for (; i < n; ++i) out[i] = hd::half_to_float(in[i]);
}

template <>
GACT_LOOP void dequantize_group<dtype::float16>(std::int32_t const* __restrict q, int n, group_params const p,
                                                std::uint16_t* __restrict out) {
  dequant8 const dq(p);
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(dq(q + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) out[i] = hd::float_to_half(hd::dequantize(q[i], p));
}
#endif

#if defined(__AVX2__)
// bfloat16 output in the AVX2 build: hd::float_to_bf16 on 8 lanes (round to nearest even on
// the bit pattern, NaN made quiet), then the 16-bit halves packed in order.
template <>
GACT_LOOP void dequantize_group<dtype::bfloat16>(std::int32_t const* __restrict q, int n, group_params const p,
                                                 std::uint16_t* __restrict out) {
  dequant8 const dq(p);
  __m256i const one = _mm256_set1_epi32(1), round = _mm256_set1_epi32(0x7FFF);
  __m256i const abs_mask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
  __m256i const quiet = _mm256_set1_epi32(0x0040);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i const x = _mm256_castps_si256(dq(q + i));
    __m256i const rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(x, round), _mm256_and_si256(_mm256_srli_epi32(x, 16), one)), 16);
    __m256i const nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, abs_mask), inf);
    __m256i const nanv = _mm256_or_si256(_mm256_srli_epi32(x, 16), quiet);
    __m256i const r = _mm256_blendv_epi8(rounded, nanv, nan);          // 8 x 16-bit values in 32-bit lanes
    __m256i const packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  // lanes 0..7 in order
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(packed));
  }
  for (; i < n; ++i) out[i] = hd::float_to_bf16(hd::dequantize(q[i], p));
}
#endif

#if defined(__AVX512F__)
// ---- the fused encode of whole 128-element blocks (AVX-512) -----------------------------------
// Philox gives the noise of chunk k (elements 8k .. 8k+7) as lane k of four word vectors: element
// 8k + j takes half j & 1 of word j >> 1. Rather than lay that noise out in element order (a
// transpose of the noise, then a round trip through memory for the uniforms and again for the
// codes), the block's values are transposed into the noise's order: vector j holds element 8k + j
// in lane k. The codes come out in that order too, and chunk k's Bits bytes (element 8k + j at bit
// Bits*j) are lane k's shifts and ors: nothing crosses lanes after the quantization. The arithmetic
// is hd::quantize_u's (and hd::quantize_boundary's), operation by operation: the same bytes as the
// per-element loops (the tests compare the builds byte for byte).

// Stage 1 and 2 permutations of the 16x8 -> 8x16 transpose (stage 3 selects 256-bit halves).
alignas(64) constexpr std::int32_t k_tr1[2][16] = {{0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27},
                                                   {4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31}};
alignas(64) constexpr std::int32_t k_tr2[2][16] = {{0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
                                                   {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}};

/// x[0, 128) as t[j] (lane k = x[8k + j]).
inline void transpose_block(float const* __restrict x, __m512 (&t)[8]) {
  __m512i const i10 = _mm512_load_si512(k_tr1[0]), i11 = _mm512_load_si512(k_tr1[1]);
  __m512i const i20 = _mm512_load_si512(k_tr2[0]), i21 = _mm512_load_si512(k_tr2[1]);
  __m512 u[4][2];  // u[p][s]: rows 4p .. 4p+3 (two loads), columns 4s .. 4s+3
  for (int p = 0; p < 4; ++p) {
    __m512 const r0 = _mm512_loadu_ps(x + 32 * p), r1 = _mm512_loadu_ps(x + 32 * p + 16);
    u[p][0] = _mm512_permutex2var_ps(r0, i10, r1);
    u[p][1] = _mm512_permutex2var_ps(r0, i11, r1);
  }
  for (int s = 0; s < 2; ++s) {
    __m512 v[2][2];  // v[q][t]: rows 8q .. 8q+7, columns 4s + 2t, 4s + 2t + 1
    for (int q = 0; q < 2; ++q) {
      v[q][0] = _mm512_permutex2var_ps(u[2 * q][s], i20, u[2 * q + 1][s]);
      v[q][1] = _mm512_permutex2var_ps(u[2 * q][s], i21, u[2 * q + 1][s]);
    }
    for (int tt = 0; tt < 2; ++tt) {
      t[4 * s + 2 * tt] = _mm512_shuffle_f32x4(v[0][tt], v[1][tt], 0x44);
      t[4 * s + 2 * tt + 1] = _mm512_shuffle_f32x4(v[0][tt], v[1][tt], 0xEE);
    }
  }
}

/// What a fused block needs of its group: the quantization constants (hd::group_params) and, for a
/// boundary group, its bounds and top code.
struct fused_group {
  __m512 s, lo_s, step, levels;
  __m512 hi_s, unscale;  // (a 16-bit output's decoded values: hd::dequantize)
  __m512 lo, hi;  // boundary: codes 0 (x <= lo) and top (x >= hi)
  __m512i top;
  bool live;      // step > 0
  bool halved;    // s != 1 (a range beyond FLT_MAX or below 2^-100); x * 1 is x, so the common case skips it
};

inline fused_group make_fused(group_params const& p, float lo, float hi, std::int32_t top) {
  return {_mm512_set1_ps(p.s),  _mm512_set1_ps(p.lo_s), _mm512_set1_ps(p.step), _mm512_set1_ps(p.levels),
          _mm512_set1_ps(p.hi_s), _mm512_set1_ps(p.unscale),
          _mm512_set1_ps(lo),   _mm512_set1_ps(hi),     _mm512_set1_epi32(top), p.step > 0.0f,
          p.s != 1.0f};
}

/// hd::narrow16 on 16 lanes (finite values; Narrow 1: float16, 2: bfloat16), as narrow8.
template <int Narrow>
inline __m512 narrow16x(__m512 v) {
  if constexpr (Narrow == 1) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    __m512i const x = _mm512_castps_si512(v);
    __m512i const lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i const r = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)), lsb);
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(std::int32_t(0xFFFF0000u))));
  }
}

/// hd::dequantize on 16 lanes (mul, add, min, mul; no FMA).
inline __m512 dequantize16x(__m512i q, fused_group const& g) {
  __m512 const xs = _mm512_min_ps(_mm512_add_ps(g.lo_s, _mm512_mul_ps(_mm512_cvtepi32_ps(q), g.step)), g.hi_s);
  return _mm512_mul_ps(xs, g.unscale);
}

/// hd::quantize_u on 16 lanes; with Narrow (a 16-bit output), hd::quantize_u16.
template <int Narrow = 0>
inline __m512i quantize16(__m512 x, __m512 u, fused_group const& g) {
  __m512 v = _mm512_div_ps(_mm512_sub_ps(g.halved ? _mm512_mul_ps(x, g.s) : x, g.lo_s), g.step);
  v = _mm512_max_ps(v, _mm512_setzero_ps());  // v > 0 ? v : +0
  v = _mm512_min_ps(v, g.levels);             // v < levels ? v : levels
  __m512i const k = _mm512_cvttps_epi32(v);
  __mmask16 up;
  if constexpr (Narrow != 0) {
    __m512 d0 = narrow16x<Narrow>(dequantize16x(k, g));
    __m512 d1 = narrow16x<Narrow>(dequantize16x(_mm512_add_epi32(k, _mm512_set1_epi32(1)), g));
    __m512 xs = x;
    if (g.halved) {  // (in the scaled domain, as hd::quantize_u16; x * 1 is x)
      xs = _mm512_mul_ps(x, g.s);
      d0 = _mm512_mul_ps(d0, g.s);
      d1 = _mm512_mul_ps(d1, g.s);
    }
    up = _mm512_cmp_ps_mask(_mm512_mul_ps(u, _mm512_sub_ps(d1, d0)), _mm512_sub_ps(xs, d0), _CMP_LT_OQ) &
         _mm512_cmp_ps_mask(_mm512_cvtepi32_ps(k), g.levels, _CMP_LT_OQ);
  } else {
    __m512 const frac = _mm512_sub_ps(v, _mm512_cvtepi32_ps(k));
    up = _mm512_cmp_ps_mask(u, frac, _CMP_LT_OQ);
  }
  return _mm512_mask_add_epi32(k, up, k, _mm512_set1_epi32(1));
}

/// One 128-element block's codes from its transposed values and its chunks' Philox words
/// (a, b, d, e: lane k = chunk k), written to out[0, 16*Bits).
template <int Bits, bool Boundary, int Narrow>
inline void encode_block(__m512 const (&t)[8], __m512i a, __m512i b, __m512i d, __m512i e, fused_group const& g,
                         std::uint8_t* __restrict out) {
  __m512i const words[4] = {a, b, d, e};
  __m512i const mask16 = _mm512_set1_epi32(0xFFFF);
  __m512 const scale = _mm512_set1_ps(1.52587890625e-05f), half = _mm512_set1_ps(7.62939453125e-06f);
  __m512i acc[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int j = 0; j < 8; ++j) {
    __m512i const r = (j & 1) != 0 ? _mm512_srli_epi32(words[j >> 1], 16) : _mm512_and_si512(words[j >> 1], mask16);
    __m512 const u = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(r), scale), half);  // hd::noise_uniform
    __m512i q;
    if constexpr (Boundary) {
      // hd::quantize_boundary: 0 at or below lo, top at or above hi, else 1 + the interior code
      q = g.live ? _mm512_add_epi32(quantize16<Narrow>(t[j], u, g), _mm512_set1_epi32(1)) : _mm512_set1_epi32(1);
      q = _mm512_mask_mov_epi32(q, _mm512_cmp_ps_mask(t[j], g.hi, _CMP_GE_OQ), g.top);
      q = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(t[j], g.lo, _CMP_GT_OQ), q);
    } else {
      q = quantize16<Narrow>(t[j], u, g);
    }
    constexpr int per = Bits == 8 ? 4 : 8;  // codes per 32-bit lane
    acc[j / per] = _mm512_or_si512(acc[j / per], _mm512_slli_epi32(q, unsigned(Bits * (j % per))));
  }
  if constexpr (Bits == 1) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(acc[0]));
  } else if constexpr (Bits == 2) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(acc[0]));
  } else if constexpr (Bits == 4) {
    _mm512_storeu_si512(out, acc[0]);
  } else {
    // chunk k's 8 bytes: acc[0] lane k, then acc[1] lane k
    __m512i const lo = _mm512_unpacklo_epi32(acc[0], acc[1]), hi = _mm512_unpackhi_epi32(acc[0], acc[1]);
    _mm512_storeu_si512(out, _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), hi));
    _mm512_storeu_si512(out + 64, _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), hi));
  }
}

/// The codes of nblocks whole 128-element blocks x[0, 128*nblocks) whose first chunk is c0, two
/// blocks' Philox interleaved at a time.
template <int Bits, bool Boundary, int Narrow>
GACT_LOOP void encode_blocks(float const* __restrict x, int nblocks, fused_group const g, std::uint64_t seed,
                             std::uint64_t key, std::uint64_t c0, std::uint8_t* __restrict out) {
  std::uint32_t const k0 = std::uint32_t(seed), k1 = std::uint32_t(seed >> 32);
  std::uint32_t const t0 = std::uint32_t(key), t1 = std::uint32_t(key >> 32);
  int i = 0;
  for (; i + 2 <= nblocks; i += 2) {
    __m512i a[2], b[2], d[2], e[2];
    philox_w<lanes16, 2>(k0, k1, t0, t1, c0 + 16 * std::uint64_t(i), a, b, d, e);
    for (int v = 0; v < 2; ++v) {
      __m512 t[8];
      transpose_block(x + 128 * (i + v), t);
      encode_block<Bits, Boundary, Narrow>(t, a[v], b[v], d[v], e[v], g, out + 16 * Bits * (i + v));
    }
  }
  if (i < nblocks) {
    __m512i a[1], b[1], d[1], e[1];
    philox_w<lanes16, 1>(k0, k1, t0, t1, c0 + 16 * std::uint64_t(i), a, b, d, e);
    __m512 t[8];
    transpose_block(x + 128 * i, t);
    encode_block<Bits, Boundary, Narrow>(t, a[0], b[0], d[0], e[0], g, out + 16 * Bits * i);
  }
}
#endif

constexpr int k_plain = int(quant_mode::plain);
constexpr int k_normalized = int(quant_mode::normalized);
constexpr int k_boundary = int(quant_mode::boundary);

/// Metadata storage of a variant: normalized groups keep float32 bounds whatever the dtype.
template <dtype Dt, int V>
using meta_of = std::conditional_t<V == k_normalized, meta_io<dtype::float32>, meta_io<Dt>>;

template <dtype Dt, int V>
void store_meta(unsigned char* meta, std::uint64_t g, float lo, float hi) {
  using M = meta_of<Dt, V>;
  using S = typename M::storage;
  S const v[2] = {M::store(lo), M::store(hi)};
  std::memcpy(meta + g * sizeof v, v, sizeof v);
}

template <dtype Dt, int V>
void load_meta(unsigned char const* meta, std::uint64_t g, float& lo, float& hi) {
  using M = meta_of<Dt, V>;
  using S = typename M::storage;
  S v[2];
  std::memcpy(v, meta + g * sizeof v, sizeof v);
  lo = M::load(v[0]);
  hi = M::load(v[1]);
}

template <dtype Dt>
GACT_LOOP void normalize_run(typename io<Dt>::storage const* __restrict in, int n, float shift, float scale,
                             float* __restrict z) {
  for (int i = 0; i < n; ++i) z[i] = hd::normalize(io<Dt>::load(in[i]), shift, scale);
}

template <dtype Dt>
GACT_LOOP void denormalize_run(float const* __restrict z, int n, float shift, float inv,
                               typename io<Dt>::storage* __restrict out) {
  for (int i = 0; i < n; ++i) out[i] = io<Dt>::store(hd::denormalize(z[i], shift, inv));
}

/// Interior min/max of a boundary group (values strictly between lo and hi; hi = +Inf without one), over
/// 8 independent lanes and without branches; false if a value is non-finite or outside [lo, hi] (*why says
/// which). A group without interior values gets (lo, lo).
bool boundary_minmax(float const* __restrict x, int n, float lo, float hi, float& imin, float& imax, refusal* why) {
  float mn[8], mx[8];
  std::uint32_t nf[8], out[8];
  for (int j = 0; j < 8; ++j) {
    mn[j] = hd::k_float_max * 2.0f;   // +Inf
    mx[j] = -hd::k_float_max * 2.0f;  // -Inf
    nf[j] = 0;
    out[j] = 0;
  }
  int const n8 = n & ~7;
  for (int i = 0; i < n8; i += 8) {
    for (int j = 0; j < 8; ++j) {
      float const v = x[i + j];
      bool const in = v > lo && v < hi;
      float const a = in ? v : hd::k_float_max * 2.0f, b = in ? v : -hd::k_float_max * 2.0f;
      mn[j] = a < mn[j] ? a : mn[j];
      mx[j] = b > mx[j] ? b : mx[j];
      nf[j] |= std::uint32_t((hd::float_bits(v) & 0x7F800000u) == 0x7F800000u);
      out[j] |= std::uint32_t(v < lo) | std::uint32_t(v > hi);
    }
  }
  for (int i = n8; i < n; ++i) {
    float const v = x[i];
    bool const in = v > lo && v < hi;
    float const a = in ? v : hd::k_float_max * 2.0f, b = in ? v : -hd::k_float_max * 2.0f;
    mn[0] = a < mn[0] ? a : mn[0];
    mx[0] = b > mx[0] ? b : mx[0];
    nf[0] |= std::uint32_t((hd::float_bits(v) & 0x7F800000u) == 0x7F800000u);
    out[0] |= std::uint32_t(v < lo) | std::uint32_t(v > hi);
  }
  float l = mn[0], h = mx[0];
  std::uint32_t bad_nf = nf[0], bad_out = out[0];
  for (int j = 1; j < 8; ++j) {
    l = mn[j] < l ? mn[j] : l;
    h = mx[j] > h ? mx[j] : h;
    bad_nf |= nf[j];
    bad_out |= out[j];
  }
  if (l > h) {  // no interior value
    l = lo;
    h = lo;
  }
  imin = hd::canonical_zero(l);
  imax = hd::canonical_zero(h);
  if (bad_nf != 0) {
    *why = refusal::nonfinite;
    return false;
  }
  if (bad_out != 0) {
    *why = refusal::out_of_range;
    return false;
  }
  return true;
}

/// Boundary codes without branches: the interior code for every element, then the boundary codes selected
/// over it (the same results as hd::quantize_boundary, element by element).
GACT_LOOP void quantize_boundary_group(float const* __restrict x, float const* __restrict u, int n, float lo,
                                       float hi, std::int32_t top, group_params const p, std::int32_t* __restrict q) {
  // 0/1 integers instead of nested selects, so that the loop vectorizes
  if (p.step > 0.0f) {
    for (int i = 0; i < n; ++i) {
      std::int32_t const inner = 1 + hd::quantize_u(x[i], p, u[i]);
      std::int32_t const above = std::int32_t(x[i] > lo), at_hi = std::int32_t(x[i] >= hi);
      q[i] = above * (inner + at_hi * (top - inner));
    }
  } else {
    for (int i = 0; i < n; ++i) {
      std::int32_t const above = std::int32_t(x[i] > lo), at_hi = std::int32_t(x[i] >= hi);
      q[i] = above * (1 + at_hi * (top - 1));
    }
  }
}

/// quantize_boundary_group for a 16-bit output (hd::quantize_boundary<narrow> element by element).
template <dtype Dt>
GACT_LOOP void quantize_boundary_group16(float const* __restrict x, float const* __restrict u, int n, float lo,
                                         float hi, std::int32_t top, group_params const p,
                                         std::int32_t* __restrict q) {
  int i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  constexpr bool half = Dt == dtype::float16;
  // the interior code on every lane, then 0 at or below lo and top at or above hi selected over it
  params8 const g(p);
  bool const live = p.step > 0.0f;
  __m256 const vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
  __m256i const one = _mm256_set1_epi32(1), vtop = _mm256_set1_epi32(top);
  for (; i + 8 <= n; i += 8) {
    __m256 const xv = _mm256_loadu_ps(x + i);
    __m256i c = live ? _mm256_add_epi32(quantize8_narrow<half>(xv, _mm256_loadu_ps(u + i), g), one) : one;
    c = _mm256_blendv_epi8(c, vtop, _mm256_castps_si256(_mm256_cmp_ps(xv, vhi, _CMP_GE_OQ)));
    c = _mm256_and_si256(c, _mm256_castps_si256(_mm256_cmp_ps(xv, vlo, _CMP_GT_OQ)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), c);
  }
#endif
  for (; i < n; ++i) q[i] = hd::quantize_boundary<k_narrow_kind<Dt>>(x[i], lo, hi, true, top, p, u[i]);
}

/// A normalized group's codes for a 16-bit output: z[i] = normalize(in[i]) quantized against the decoded
/// values (hd::quantize_normalized16), with each statistics block's shift and inverse scale as the decoder
/// computes them.
template <dtype Dt>
void quantize_normalized_group16(typename io<Dt>::storage const* __restrict in, float const* __restrict z,
                                 float const* __restrict u, int n, group_params const p, quant_job const& job,
                                 std::uint64_t e0, std::int32_t* __restrict q) {
  std::uint64_t block = (e0 / job.inner) % job.count, pos = e0 % job.inner;
  for (int i = 0; i < n;) {
    int const run = int(job.inner - pos < std::uint64_t(n - i) ? job.inner - pos : std::uint64_t(n - i));
    float const shift = job.statsf[2 * block], inv = hd::inverse_scale(job.statsf[2 * block + 1]);
    for (int j = i; j < i + run; ++j)
      q[j] = hd::quantize_normalized16<Dt == dtype::float16>(io<Dt>::load(in[j]), z[j], p, shift, inv, u[j]);
    i += run;
    pos = 0;
    block = block + 1 == job.count ? 0 : block + 1;
  }
}

/// Values of boundary codes (hd::dequantize_boundary element by element).
template <dtype Dt>
GACT_LOOP void dequantize_boundary_group(std::int32_t const* __restrict q, int n, float lo, float hi, bool has_hi,
                                         std::int32_t top, group_params const p,
                                         typename io<Dt>::storage* __restrict out) {
  std::int32_t const hi_code = has_hi ? top : -1;  // no code equals -1
  int i = 0;
#if defined(__AVX2__)
  if constexpr (Dt == dtype::float32) {
    // hd::dequantize on 8 lanes (the same operations in the same order: mul, add, min, mul; no FMA),
    // then the boundary values blended over it
    __m256 const lo_s = _mm256_set1_ps(p.lo_s), step = _mm256_set1_ps(p.step), hi_s = _mm256_set1_ps(p.hi_s);
    __m256 const unscale = _mm256_set1_ps(p.unscale), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    __m256i const one = _mm256_set1_epi32(1), zero = _mm256_setzero_si256(), hic = _mm256_set1_epi32(hi_code);
    for (; i + 8 <= n; i += 8) {
      __m256i const qi = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(q + i));
      __m256 xs = _mm256_add_ps(lo_s, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(qi, one)), step));
      xs = _mm256_min_ps(xs, hi_s);  // xs < hi_s ? xs : hi_s, as hd::dequantize (NaN gives hi_s in both)
      __m256 v = _mm256_mul_ps(xs, unscale);
      v = _mm256_blendv_ps(v, vhi, _mm256_castsi256_ps(_mm256_cmpeq_epi32(qi, hic)));
      v = _mm256_blendv_ps(v, vlo, _mm256_castsi256_ps(_mm256_cmpeq_epi32(qi, zero)));
      _mm256_storeu_ps(out + i, v);
    }
  }
#endif
  for (; i < n; ++i) {
    float const v = hd::dequantize(q[i] - 1, p);
    float const w = q[i] == hi_code ? hi : v;
    out[i] = io<Dt>::store(q[i] == 0 ? lo : w);
  }
}

template <dtype Dt, int Bits, int V>
bool encode_groups(void const* src, quant_job const& job, std::uint64_t g0, std::uint64_t g1, int* failed) {
  using S = typename io<Dt>::storage;
  alignas(64) float xbuf[k_buf];
  alignas(64) float u[k_buf];
  alignas(64) std::int32_t q[k_buf];
  S const* in = static_cast<S const*>(src);
  std::uint64_t const numel = job.numel;
  int const G = job.group_size;
  constexpr std::int32_t top = (1 << Bits) - 1;
  for (std::uint64_t g = g0; g < g1; ++g) {
    if ((g & 63) == 0 && __atomic_load_n(failed, __ATOMIC_RELAXED) != 0) return false;
    std::uint64_t const e0 = g * std::uint64_t(G);
    int const n = int(numel - e0 < std::uint64_t(G) ? numel - e0 : std::uint64_t(G));
    int const nchunks = (n + 7) / 8;
    float const* x;
    if constexpr (V == k_normalized) {
      // runs of one statistics block: a vectorizable loop each
      std::uint64_t block = (e0 / job.inner) % job.count, pos = e0 % job.inner;
      for (int i = 0; i < n;) {
        int const run = int(job.inner - pos < std::uint64_t(n - i) ? job.inner - pos : std::uint64_t(n - i));
        normalize_run<Dt>(in + e0 + std::uint64_t(i), run, job.statsf[2 * block], job.statsf[2 * block + 1], xbuf + i);
        i += run;
        pos = 0;
        block = block + 1 == job.count ? 0 : block + 1;
      }
      x = xbuf;
    } else if constexpr (Dt == dtype::float32) {
      x = in + e0;
    } else {
      widen<Dt>(in + e0, n, xbuf);
      x = xbuf;
    }
    std::uint8_t* out = job.codes + (e0 / 8) * std::uint64_t(Bits);
    if constexpr (V == k_boundary) {
      float imin, imax;
      refusal why = refusal::none;
      float const hi_or_inf = job.boundary.has_hi != 0 ? job.boundary.hi : hd::k_float_max * 2.0f;
      if (!boundary_minmax(x, n, job.boundary.lo, hi_or_inf, imin, imax, &why)) {
        __atomic_store_n(failed, int(why), __ATOMIC_RELAXED);
        return false;
      }
      store_meta<Dt, V>(job.meta, g, imin, imax);
      // The metadata as stored (a 16-bit dtype rounds nothing: imin/imax are input values).
      float lo, hi;
      load_meta<Dt, V>(job.meta, g, lo, hi);
      group_params const p = hd::make_params_levels(lo, hi, hd::boundary_levels(Bits, job.boundary.has_hi != 0));
#if defined(__AVX512F__)
      if constexpr (Bits > 1) {  // (boundary blobs have 2, 4 or 8 bits)
        if (n % 128 == 0) {
          encode_blocks<Bits, true, k_narrow_kind<Dt>>(x, n / 128, make_fused(p, job.boundary.lo, hi_or_inf, top), job.seed, job.key,
                                    e0 / 8, out);
          continue;
        }
      }
#endif
      group_noise(job.seed, job.key, e0 / 8, nchunks, u);
      if constexpr (k_narrow<Dt>)
        quantize_boundary_group16<Dt>(x, u, n, job.boundary.lo, hi_or_inf, top, p, q);
      else
        quantize_boundary_group(x, u, n, job.boundary.lo, hi_or_inf, top, p, q);
      for (int i = n; i < nchunks * 8; ++i) q[i] = 0;
      pack_codes<Bits>(q, nchunks, out);
    } else {
      float lo, hi;
      if (!group_minmax(x, n, lo, hi)) {
        __atomic_store_n(failed, int(refusal::nonfinite), __ATOMIC_RELAXED);
        return false;
      }
      if (!hd::quant_range_ok(lo, hi, job.max_magnitude)) {
        __atomic_store_n(failed, int(refusal::wide), __ATOMIC_RELAXED);
        return false;
      }
      store_meta<Dt, V>(job.meta, g, lo, hi);
      group_params const p = hd::make_params(lo, hi, Bits);
      if (p.step > 0.0f) {
#if defined(__AVX512F__)
        // (a normalized group's 16-bit codes read the input itself beside z: the per-element loop)
        if (!(k_narrow<Dt> && V == k_normalized) && n % 128 == 0) {
          encode_blocks<Bits, false, k_narrow_kind<Dt>>(x, n / 128, make_fused(p, 0.0f, 0.0f, 0), job.seed, job.key, e0 / 8, out);
          continue;
        }
#endif
        group_noise(job.seed, job.key, e0 / 8, nchunks, u);
        if constexpr (k_narrow<Dt> && V == k_normalized)
          quantize_normalized_group16<Dt>(in + e0, x, u, n, p, job, e0, q);
        else if constexpr (k_narrow<Dt>)
          quantize_group16<Dt>(x, u, n, p, q);
        else
          quantize_group(x, u, n, p, q);
        for (int i = n; i < nchunks * 8; ++i) q[i] = 0;
        pack_codes<Bits>(q, nchunks, out);
      } else {
        std::memset(out, 0, std::size_t(nchunks) * Bits);  // constant group: every code is 0
      }
    }
  }
  return true;
}

#if defined(__AVX512F__)
/// out[0, n) = table[code] for the n codes of Bits <= 4 bits at c: per 16 codes, at 1 bit their bits
/// are a mask register for one blend, at 2 and 4 bits they are shifted out of their 32 or 64 bits
/// into lanes and index the table (vpermps). q: scratch for the last codes after whole 16s.
template <int Bits>
void decode_by_table(std::uint8_t const* __restrict c, int n, float const (&table)[16], std::int32_t* __restrict q,
                     float* __restrict out) {
  int i = 0;
  if constexpr (Bits == 1) {
    __m512 const v0 = _mm512_set1_ps(table[0]), v1 = _mm512_set1_ps(table[1]);
    for (; i + 16 <= n; i += 16) {
      std::uint16_t bits16;
      std::memcpy(&bits16, c + i / 8, 2);
      _mm512_storeu_ps(out + i, _mm512_mask_blend_ps(__mmask16(bits16), v0, v1));
    }
  } else {
    __m512 const tv = _mm512_loadu_ps(table);
    __m512i const mask = _mm512_set1_epi32((1 << Bits) - 1);
    // lane k's code: bits Bits*k.. of the 16 codes' 2*Bits bytes (4 bits: lanes 8..15 in the second word)
    __m512i const shift = Bits == 2 ? _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
                                    : _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    __m512i const word = Bits == 2 ? _mm512_setzero_si512()
                                   : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (; i + 16 <= n; i += 16) {
      std::uint64_t w = 0;
      std::memcpy(&w, c + i / 8 * Bits, 2 * Bits);
      __m512i const words = _mm512_permutexvar_epi32(word, _mm512_castsi128_si512(_mm_cvtsi64_si128(std::int64_t(w))));
      _mm512_storeu_ps(out + i, _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srlv_epi32(words, shift), mask), tv));
    }
  }
  if (i < n) {
    unpack_codes<Bits>(c + i / 8 * Bits, (n - i + 7) / 8, q);
    for (int j = 0; j < n - i; ++j) out[i + j] = table[q[j]];
  }
}
#endif

template <dtype Dt, int Bits, int V>
void decode_groups(quant_job const& job, void* dst, std::uint64_t g0, std::uint64_t g1) {
  using S = typename io<Dt>::storage;
  alignas(64) std::int32_t q[k_buf];
  alignas(64) float zbuf[k_buf];
  S* out = static_cast<S*>(dst);
  std::uint64_t const numel = job.numel;
  int const G = job.group_size;
  constexpr std::int32_t top = (1 << Bits) - 1;
  for (std::uint64_t g = g0; g < g1; ++g) {
    std::uint64_t const e0 = g * std::uint64_t(G);
    int const n = int(numel - e0 < std::uint64_t(G) ? numel - e0 : std::uint64_t(G));
    int const nchunks = (n + 7) / 8;
    float lo, hi;
    load_meta<Dt, V>(job.meta, g, lo, hi);
#if defined(__AVX512F__)
    if constexpr (Dt == dtype::float32 && Bits <= 4 && V != k_normalized) {
      // A group has at most 2^Bits values: computed once with the per-element rule, then each 16
      // codes select theirs (decode_by_table), unpacking nothing.
      if (!(V == k_boundary && job.predicate)) {  // (a boundary blob's predicate decode keeps its loop)
        alignas(64) float table[16] = {};
        if constexpr (V == k_boundary) {
          bool const has_hi = job.boundary.has_hi != 0;
          group_params const p = hd::make_params_levels(lo, hi, hd::boundary_levels(Bits, has_hi));
          for (int v = 0; v <= top; ++v)
            table[v] = hd::dequantize_boundary(v, job.boundary.lo, job.boundary.hi, has_hi, top, p);
        } else {
          group_params const p = hd::make_params(lo, hi, Bits);
          for (int v = 0; v <= top; ++v) table[v] = hd::dequantize(v, p);
        }
        decode_by_table<Bits>(job.codes + (e0 / 8) * std::uint64_t(Bits), n, table, q, out + e0);
        continue;
      }
    }
#endif
    unpack_codes<Bits>(job.codes + (e0 / 8) * std::uint64_t(Bits), nchunks, q);
    if constexpr (V == k_boundary) {
      boundary_params const b = job.boundary;
      bool const has_hi = b.has_hi != 0;
      if (job.predicate) {
        S const tv = io<Dt>::store(job.true_value), fv = io<Dt>::store(job.false_value);
        for (int i = 0; i < n; ++i) out[e0 + std::uint64_t(i)] = (q[i] != 0 && !(has_hi && q[i] == top)) ? tv : fv;
      } else {
        group_params const p = hd::make_params_levels(lo, hi, hd::boundary_levels(Bits, has_hi));
        dequantize_boundary_group<Dt>(q, n, b.lo, b.hi, has_hi, top, p, out + e0);
      }
    } else if constexpr (V == k_normalized) {
      group_params const p = hd::make_params(lo, hi, Bits);
      for (int i = 0; i < n; ++i) zbuf[i] = hd::dequantize(q[i], p);
      std::uint64_t block = (e0 / job.inner) % job.count, pos = e0 % job.inner;
      for (int i = 0; i < n;) {
        int const run = int(job.inner - pos < std::uint64_t(n - i) ? job.inner - pos : std::uint64_t(n - i));
        denormalize_run<Dt>(zbuf + i, run, job.statsf[2 * block], job.statsf[2 * block + 1], out + e0 + std::uint64_t(i));
        i += run;
        pos = 0;
        block = block + 1 == job.count ? 0 : block + 1;
      }
    } else {
      group_params const p = hd::make_params(lo, hi, Bits);
      if constexpr (Dt == dtype::float64) {
        for (int i = 0; i < n; ++i) out[e0 + std::uint64_t(i)] = double(hd::dequantize(q[i], p));
      } else {
        dequantize_group<Dt>(q, n, p, out + e0);
      }
    }
  }
}

template <dtype Dt, int V>
bool encode_bits(void const* src, quant_job const& job, std::uint64_t g0, std::uint64_t g1, int* failed) {
  switch (job.bits) {
    case 1: return encode_groups<Dt, 1, V>(src, job, g0, g1, failed);
    case 2: return encode_groups<Dt, 2, V>(src, job, g0, g1, failed);
    case 4: return encode_groups<Dt, 4, V>(src, job, g0, g1, failed);
    default: return encode_groups<Dt, 8, V>(src, job, g0, g1, failed);
  }
}

template <dtype Dt, int V>
void decode_bits(quant_job const& job, void* dst, std::uint64_t g0, std::uint64_t g1) {
  switch (job.bits) {
    case 1: decode_groups<Dt, 1, V>(job, dst, g0, g1); break;
    case 2: decode_groups<Dt, 2, V>(job, dst, g0, g1); break;
    case 4: decode_groups<Dt, 4, V>(job, dst, g0, g1); break;
    default: decode_groups<Dt, 8, V>(job, dst, g0, g1); break;
  }
}

template <dtype Dt>
bool encode_variant(void const* src, quant_job const& job, std::uint64_t g0, std::uint64_t g1, int* failed) {
  switch (quant_mode(job.variant)) {
    case quant_mode::normalized: return encode_bits<Dt, k_normalized>(src, job, g0, g1, failed);
    case quant_mode::boundary: return encode_bits<Dt, k_boundary>(src, job, g0, g1, failed);
    default: return encode_bits<Dt, k_plain>(src, job, g0, g1, failed);
  }
}

template <dtype Dt>
void decode_variant(quant_job const& job, void* dst, std::uint64_t g0, std::uint64_t g1) {
  switch (quant_mode(job.variant)) {
    case quant_mode::normalized: decode_bits<Dt, k_normalized>(job, dst, g0, g1); break;
    case quant_mode::boundary: decode_bits<Dt, k_boundary>(job, dst, g0, g1); break;
    default: decode_bits<Dt, k_plain>(job, dst, g0, g1); break;
  }
}


// ---- predicate masks ------------------------------------------------------------------------

/// The closed range a predicate's clamp would give ([a, +Inf) for gt/ge, (-Inf, a] for lt/le, [a, b]).
inline void predicate_range(predicate_params const& q, float& lo, float& hi) {
  lo = -hd::k_float_max * 2.0f;
  hi = hd::k_float_max * 2.0f;
  switch (predicate(q.pred)) {
    case predicate::gt: case predicate::ge: case predicate::gt_or_nan: lo = q.a; break;
    case predicate::lt: case predicate::le: hi = q.a; break;
    case predicate::open: case predicate::closed: lo = q.a; hi = q.b; break;
    case predicate::ne: break;
  }
}

template <dtype Dt, int P>
void mask_bytes_portable(typename io<Dt>::storage const* __restrict in, float a, float b, float lo, float hi,
                         std::uint64_t m0, std::uint64_t m1, std::uint64_t numel, std::uint8_t* __restrict out,
                         mask_scan* scan) {
  bool in_range = true, nz_finite = true, have = false;
  float mn = hd::k_float_max * 2.0f, mx = -hd::k_float_max * 2.0f;
  for (std::uint64_t m = m0; m < m1; ++m) {
    unsigned v = 0;
    for (int j = 0; j < 8; ++j) {
      std::uint64_t const e = 8 * m + std::uint64_t(j);
      if (e >= numel) break;
      float const x = io<Dt>::load(in[e]);
      v |= unsigned(hd::eval_predicate(std::uint32_t(P), a, b, x)) << j;
      in_range = in_range && hd::is_finite_bits(x) && x >= lo && x <= hi;
      if constexpr (P == int(predicate::ne)) {
        if (x != 0.0f) {
          have = true;
          nz_finite = nz_finite && hd::is_finite_bits(x);
          mn = x < mn ? x : mn;
          mx = x > mx ? x : mx;
        }
      }
    }
    out[m] = std::uint8_t(v);
  }
  scan->in_range = in_range;
  scan->have_nz = have;
  scan->nz_min = mn;
  scan->nz_max = mx;
  scan->nz_finite = nz_finite;
}

#if defined(__AVX2__)
/// float32 predicates 8 elements at a time: compare, movemask, one byte.
template <int P>
void mask_bytes_f32(float const* __restrict in, float a, float b, float lo, float hi, std::uint64_t m0,
                    std::uint64_t m1, std::uint64_t numel, std::uint8_t* __restrict out, mask_scan* scan) {
  std::uint64_t const full = numel / 8 < m1 ? numel / 8 : m1;  // bytes whose 8 elements all exist
  __m256 const va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
  __m256 const zero = _mm256_setzero_ps();
  __m256 inside = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  __m256 nzmin = _mm256_set1_ps(hd::k_float_max * 2.0f), nzmax = _mm256_set1_ps(-hd::k_float_max * 2.0f);
  __m256 anynz = zero;
  std::uint64_t m = m0;
  for (; m < full; ++m) {
    __m256 const x = _mm256_loadu_ps(in + 8 * m);
    __m256 t;
    if constexpr (P == int(predicate::gt)) t = _mm256_cmp_ps(x, va, _CMP_GT_OQ);
    else if constexpr (P == int(predicate::ge)) t = _mm256_cmp_ps(x, va, _CMP_GE_OQ);
    else if constexpr (P == int(predicate::lt)) t = _mm256_cmp_ps(x, va, _CMP_LT_OQ);
    else if constexpr (P == int(predicate::le)) t = _mm256_cmp_ps(x, va, _CMP_LE_OQ);
    else if constexpr (P == int(predicate::open))
      t = _mm256_and_ps(_mm256_cmp_ps(x, va, _CMP_GT_OQ), _mm256_cmp_ps(x, vb, _CMP_LT_OQ));
    else if constexpr (P == int(predicate::closed))
      t = _mm256_and_ps(_mm256_cmp_ps(x, va, _CMP_GE_OQ), _mm256_cmp_ps(x, vb, _CMP_LE_OQ));
    else if constexpr (P == int(predicate::gt_or_nan)) t = _mm256_cmp_ps(x, va, _CMP_NLE_UQ);  // NaN holds
    else t = _mm256_cmp_ps(x, zero, _CMP_NEQ_UQ);  // ne: NaN != 0 holds
    out[m] = std::uint8_t(_mm256_movemask_ps(t));
    // finite and inside [lo, hi] (ordered compares: NaN fails them)
    __m256 const ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    inside = _mm256_and_ps(inside, _mm256_and_ps(_mm256_cmp_ps(ax, _mm256_set1_ps(hd::k_float_max), _CMP_LE_OQ),
                                                 _mm256_and_ps(_mm256_cmp_ps(x, vlo, _CMP_GE_OQ),
                                                               _mm256_cmp_ps(x, vhi, _CMP_LE_OQ))));
    if constexpr (P == int(predicate::ne)) {
      nzmin = _mm256_min_ps(_mm256_blendv_ps(nzmin, x, t), nzmin);
      nzmax = _mm256_max_ps(_mm256_blendv_ps(nzmax, x, t), nzmax);
      anynz = _mm256_or_ps(anynz, t);
    }
  }
  mask_scan tail;
  mask_bytes_portable<dtype::float32, P>(in, a, b, lo, hi, m, m1, numel, out, &tail);
  alignas(32) float mn[8], mx[8];
  _mm256_store_ps(mn, nzmin);
  _mm256_store_ps(mx, nzmax);
  bool in_range = _mm256_movemask_ps(inside) == 0xFF && tail.in_range;
  float l = tail.nz_min, h = tail.nz_max;
  for (int j = 0; j < 8; ++j) {
    l = mn[j] < l ? mn[j] : l;
    h = mx[j] > h ? mx[j] : h;
  }
  bool const have = _mm256_movemask_ps(anynz) != 0 || tail.have_nz;
  scan->in_range = in_range;
  scan->have_nz = have;
  scan->nz_min = l;
  scan->nz_max = h;
  scan->nz_finite = tail.nz_finite && (!have || (hd::is_finite_bits(l) && hd::is_finite_bits(h)));
}
#endif

template <dtype Dt>
void mask_bytes_dt(void const* src, predicate_params const& q, std::uint64_t m0, std::uint64_t m1, std::uint64_t numel,
                   std::uint8_t* out, mask_scan* scan) {
  float lo, hi;
  predicate_range(q, lo, hi);
  auto const* in = static_cast<typename io<Dt>::storage const*>(src);
  switch (predicate(q.pred)) {
#if defined(__AVX2__)
#define GACT_MASK_CASE(P)                                                                            \
    case predicate::P:                                                                               \
      if constexpr (Dt == dtype::float32)                                                            \
        mask_bytes_f32<int(predicate::P)>(in, q.a, q.b, lo, hi, m0, m1, numel, out, scan);           \
      else                                                                                           \
        mask_bytes_portable<Dt, int(predicate::P)>(in, q.a, q.b, lo, hi, m0, m1, numel, out, scan); \
      break;
#else
#define GACT_MASK_CASE(P)                                                                            \
    case predicate::P:                                                                               \
      mask_bytes_portable<Dt, int(predicate::P)>(in, q.a, q.b, lo, hi, m0, m1, numel, out, scan);   \
      break;
#endif
    GACT_MASK_CASE(gt)
    GACT_MASK_CASE(ge)
    GACT_MASK_CASE(lt)
    GACT_MASK_CASE(le)
    GACT_MASK_CASE(open)
    GACT_MASK_CASE(closed)
    GACT_MASK_CASE(ne)
    GACT_MASK_CASE(gt_or_nan)
#undef GACT_MASK_CASE
  }
}

}  // namespace

/// Encode groups [g0, g1); false (and *failed set to the refusal) if a value is refused, or if
/// another range failed.
bool encode_range(void const* src, quant_job const& job, std::uint64_t g0, std::uint64_t g1, int* failed) {
  switch (job.dt) {
    case dtype::float32: return encode_variant<dtype::float32>(src, job, g0, g1, failed);
    case dtype::float16: return encode_variant<dtype::float16>(src, job, g0, g1, failed);
    case dtype::float64: return encode_variant<dtype::float64>(src, job, g0, g1, failed);
    default: return encode_variant<dtype::bfloat16>(src, job, g0, g1, failed);
  }
}

/// Predicate-mask bytes [m0, m1) of a float tensor (element e at bit e % 8 of byte e / 8), with their scan.
void mask_range(void const* src, dtype dt, predicate_params const& q, std::uint64_t m0, std::uint64_t m1,
                std::uint64_t numel, std::uint8_t* out, mask_scan* scan) {
  switch (dt) {
    case dtype::float32: mask_bytes_dt<dtype::float32>(src, q, m0, m1, numel, out, scan); break;
    case dtype::float16: mask_bytes_dt<dtype::float16>(src, q, m0, m1, numel, out, scan); break;
    case dtype::float64: mask_bytes_dt<dtype::float64>(src, q, m0, m1, numel, out, scan); break;
    default: mask_bytes_dt<dtype::bfloat16>(src, q, m0, m1, numel, out, scan); break;
  }
}

/// True if every value of x[a, b) is 0, infinite, NaN or of float32's normal range up to 2^126: the
/// float64 encode's precondition. The decode's affine maps (z·(1/scale) + shift, lo + q·step) round in
/// float32 and can pass FLT_MAX by a rounding near it: a float64 layer_norm input holding FLT_MAX
/// decoded its row to NaN and Inf, so the top quarter of the range is refused too. Non-negative
/// doubles order as their bit patterns, so each side is one unsigned range test, which the
/// vectorizer takes (the comparisons of doubles it did not: 13.8 against 1.9 us for 5 100 values).
bool float64_in_float_range(double const* x, std::uint64_t a, std::uint64_t b) {
  std::uint64_t const lo = 0x3810000000000000ull;   // float32's smallest normal, as a double
  std::uint64_t const hi = 0x47d0000000000000ull;   // 2^126, a quarter of float32's largest finite
  std::uint64_t const inf = 0x7ff0000000000000ull;
  std::uint64_t bad = 0;
  for (std::uint64_t i = a; i < b; ++i) {
    std::uint64_t u;
    std::memcpy(&u, x + i, sizeof u);
    u &= 0x7fffffffffffffffull;
    // 0 < u < lo, or hi < u < inf (NaNs lie above inf and pass, as infinities do).
    bad |= std::uint64_t(u - 1 < lo - 1) | std::uint64_t(u - hi - 1 < inf - hi - 1);
  }
  return bad == 0;
}

/// Decode groups [g0, g1) (metadata and statistics already validated by parse).
void decode_range(quant_job const& job, void* dst, std::uint64_t g0, std::uint64_t g1) {
  switch (job.dt) {
    case dtype::float32: decode_variant<dtype::float32>(job, dst, g0, g1); break;
    case dtype::float16: decode_variant<dtype::float16>(job, dst, g0, g1); break;
    case dtype::float64: decode_variant<dtype::float64>(job, dst, g0, g1); break;
    default: decode_variant<dtype::bfloat16>(job, dst, g0, g1); break;
  }
}

}  // namespace gact::codec::detail::GACT_CODEC_ISA
