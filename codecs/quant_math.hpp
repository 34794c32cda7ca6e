// gact/codecs/quant_math.hpp
//
// The arithmetic of the quant codec, written once: the CPU executor
// (quant_cpu.cpp) and the CUDA kernels (codec_cuda.cu) call exactly these
// functions, so a blob is the same bytes on both.
//
// Per group of G consecutive elements (row-major, the last group may be short):
//   lo, hi   = min, max of the group (signed zeros canonicalised to +0)
//   s        = 1; 1/2 when hi - lo overflows float (|range| > FLT_MAX): the
//              group is then encoded in the halved domain, so the step never
//              becomes Inf (ranges up to 2 * FLT_MAX are representable); 2^64
//              when 0 < hi - lo < 2^-100: a step among the subnormals would be
//              rounded to a multiple of 2^-149 (up to 2 % of the range wrong per
//              step at 8 bits), so such a group, whose values all lie below
//              2^-75 in magnitude, is encoded in the scaled domain, exactly, and
//              only x^ is rounded to the subnormals (half a unit, 2^-150)
//   step     = (hi*s - lo*s) / (2^b - 1), raised to the smallest denormal when
//              that underflows to 0 while hi > lo; step = 0 marks a constant group
//   v        = clamp((x*s - lo*s) / step, 0, 2^b - 1)
//   q        = floor(v) + [u < frac(v)],  u = (r + 1/2) / 2^16, r = 16 Philox bits
//   x^       = min(lo*s + q*step, hi*s) / s
// E[q] = v up to 2^-17 (16-bit noise), hence E[x^] = x up to rounding of a few
// ulps: the rounding is unbiased. q <= 2^b - 1 always (GACT's unclamped rint
// could produce 2^b and spill into the next field). Var[x^] = step^2 f(1-f) <= step^2/4.
//
// The stored metadata is (lo, hi) in the input dtype. For float16/bfloat16
// inputs these are input values, so 16-bit metadata is exact; the step is
// derived from the stored values by the encoder and the decoder alike, so
// encoding is always unbiased with respect to the stored metadata.
//
// Non-finite groups: the CPU encoder refuses the whole tensor (the caller
// stores it raw). The CUDA encoder cannot tell the host without a sync, so it
// writes (NaN, NaN) as the group's metadata and zero codes; every decoder then
// yields NaN for that whole group — never silent finite values.
#pragma once

#include "codecs/float16.hpp"
#include "codecs/hd.hpp"

namespace gact::codec::hd {

/// Ranges below this (2^-100) are quantized in a domain scaled by k_tiny_scale (2^64), where the step is a
/// normal float.
inline constexpr float k_tiny_range = 7.88860905221011805412e-31f;
inline constexpr float k_tiny_scale = 18446744073709551616.0f;

/// Derived per-group constants, a pure function of (lo, hi, bits).
struct group_params {
  float s;        ///< 1; 0.5 (halved domain for ranges beyond FLT_MAX); 2^64 (ranges below 2^-100)
  float unscale;  ///< 1 / s
  float lo_s;     ///< lo * s
  float hi_s;     ///< hi * s
  float step;     ///< quantization step in the scaled domain; 0 for a constant group
  float levels;   ///< 2^bits - 1
};

/// Canonical min/max: -0 becomes +0 (so every reduction order gives the same bits).
GACT_HD float canonical_zero(float x) { return add_rn(x, 0.0f); }

/// Parameters of a group quantized on `levels` intervals (2^b - 1 for plain groups; fewer for
/// boundary groups, whose extreme codes are reserved).
GACT_HD group_params make_params_levels(float lo, float hi, float levels) {
  group_params p;
  p.levels = levels;
  float const d = sub_rn(hi, lo);
  bool const huge = !(d <= k_float_max);  // overflow to +Inf (or NaN metadata)
  bool const tiny = d > 0.0f && d < k_tiny_range;  // then |lo|, |hi| < 2^-75: lo * 2^64 is exact
  p.s = huge ? 0.5f : tiny ? k_tiny_scale : 1.0f;
  p.unscale = huge ? 2.0f : tiny ? 1.0f / k_tiny_scale : 1.0f;
  p.lo_s = mul_rn(lo, p.s);
  p.hi_s = mul_rn(hi, p.s);
  float step = div_rn(sub_rn(p.hi_s, p.lo_s), p.levels);
  if (step == 0.0f && p.hi_s > p.lo_s) step = k_denorm_min;
  p.step = step;
  return p;
}

GACT_HD group_params make_params(float lo, float hi, int bits) {
  return make_params_levels(lo, hi, float((1u << bits) - 1u));
}

/// The uniform in (0, 1) used for 16 random bits r: (r + 1/2) / 2^16, exact in float.
GACT_HD float noise_uniform(std::uint32_t r16) {
  return add_rn(mul_rn(float(r16), 1.52587890625e-05f), 7.62939453125e-06f);
}

/// Code of x (finite, lo <= x <= hi) for a group with step > 0, given the uniform u = noise_uniform(r).
/// x's position on the grid, v = (x*s - lo*s) / step clamped to [0, levels].
GACT_HD float grid_position(float x, group_params const& p) {
  float v = div_rn(sub_rn(mul_rn(x, p.s), p.lo_s), p.step);
  v = v > 0.0f ? v : 0.0f;
  return v < p.levels ? v : p.levels;
}

GACT_HD std::int32_t quantize_u(float x, group_params const& p, float u) {
  float const v = grid_position(x, p);
  std::int32_t const k = std::int32_t(v);  // v >= 0, so truncation is floor
  float const frac = sub_rn(v, float(k));
  return k + (u < frac ? 1 : 0);
}

/// Code of x given 16 random bits r16 (see quantize_u).
GACT_HD std::int32_t quantize(float x, group_params const& p, std::uint32_t r16) {
  return quantize_u(x, p, noise_uniform(r16));
}

/// Value of code q (NaN metadata propagates to NaN).
GACT_HD float dequantize(std::int32_t q, group_params const& p) {
  float xs = add_rn(p.lo_s, mul_rn(float(q), p.step));
  xs = xs < p.hi_s ? xs : p.hi_s;  // NaN < NaN is false: NaN metadata gives NaN
  return mul_rn(xs, p.unscale);
}

// ---- 16-bit outputs --------------------------------------------------------------------------
// A float16 or bfloat16 tensor decodes to its dtype: the decoder rounds each code's float32 value
// to nearest even, a fixed rounding that moves the two values x's code chooses between by up to
// half a 16-bit unit each. bfloat16 keeps 8 significant bits, so at 8 bits that unit is about the
// step, and E[x^] missed x by up to half of it (1.4e-3 of a tensor's norm in bfloat16, 5e-4 in
// float16). The up decision is therefore taken against the values as decoded, d0 = R(x^(k)) and
// d1 = R(x^(k + 1)) with R the output's rounding:
//   q = k + [u * (d1 - d0) < x - d0]
// x is a value of the dtype between the two grid values, so d0 <= x <= d1 (R is monotone and
// leaves x as it is) and E[x^] = d0 + (x - d0) = x, up to the float32 rounding of the grid itself (a
// value below 2^-24 of the range can fall just outside [d0, d1], as it could before); d0 = d1 means
// x = d0, whose code is then k. The comparison is made in the group's scaled domain (x*s, d*s: exact
// scalings by a power of two), where d1 - d0 cannot overflow (a halved group's range exceeds FLT_MAX)
// and a tiny group's differences are not subnormal; a normalized group's decoded values, in the
// input's units, are compared halved.

/// The output rounding R of a float16 (Half) or bfloat16 decode, as a float.
template <bool Half>
GACT_HD float narrow16(float v) {
  if constexpr (Half) return half_to_float(float_to_half(v));
  else return bf16_to_float(float_to_bf16(v));
}

/// The floor code k of x (quantize_u's).
GACT_HD std::int32_t floor_code(float x, group_params const& p) { return std::int32_t(grid_position(x, p)); }

/// k, or k + 1 with probability (x - d0) / (d1 - d0) (u uniform in (0, 1)); never past levels.
GACT_HD std::int32_t round_between(std::int32_t k, float levels, float x, float d0, float d1, float u) {
  // (0/1 integers, no branch: the loops over it vectorize)
  return k + (std::int32_t(float(k) < levels) & std::int32_t(mul_rn(u, sub_rn(d1, d0)) < sub_rn(x, d0)));
}

/// quantize_u for a 16-bit output: unbiased against the decoded values (above).
template <bool Half>
GACT_HD std::int32_t quantize_u16(float x, group_params const& p, float u) {
  std::int32_t const k = floor_code(x, p);
  float const d0 = narrow16<Half>(dequantize(k, p)), d1 = narrow16<Half>(dequantize(k + 1, p));
  return round_between(k, p.levels, mul_rn(x, p.s), mul_rn(d0, p.s), mul_rn(d1, p.s), u);
}

/// The code of x for an output that keeps float32 (Narrow 0: quantize_u), float16 (1) or bfloat16 (2).
template <int Narrow>
GACT_HD std::int32_t quantize_as(float x, group_params const& p, float u) {
  if constexpr (Narrow == 0) return quantize_u(x, p, u);
  else return quantize_u16<Narrow == 1>(x, p, u);
}

/// Metadata of a group as the decoder accepts it: finite lo <= hi, or both NaN (non-finite group).
GACT_HD bool meta_ok(float lo, float hi) {
  bool const both_nan = lo != lo && hi != hi;
  return both_nan || (is_finite_bits(lo) && is_finite_bits(hi) && lo <= hi);
}

// ---- normalized groups ---------------------------------------------------------------------
// z = (x - shift) * scale on encode; x^ = z^ * (1 / scale) + shift on decode, with 1 / scale
// computed once per block by both executors (div_rn), so E[x^] = x up to rounding: the affine map
// is the same on both sides of the unbiased quantizer.

GACT_HD float normalize(float x, float shift, float scale) { return mul_rn(sub_rn(x, shift), scale); }
GACT_HD float denormalize(float z, float shift, float inv_scale) { return add_rn(mul_rn(z, inv_scale), shift); }
GACT_HD float inverse_scale(float scale) { return div_rn(1.0f, scale); }

/// The code of a normalized group's z = normalize(x) for a 16-bit output: against the decoded values
/// R(denormalize(x^(k))), as quantize_u16 (x: the input value, shift and inv as the decoder has them).
template <bool Half>
GACT_HD std::int32_t quantize_normalized16(float x, float z, group_params const& p, float shift, float inv, float u) {
  std::int32_t const k = floor_code(z, p);
  float const d0 = narrow16<Half>(denormalize(dequantize(k, p), shift, inv));
  float const d1 = narrow16<Half>(denormalize(dequantize(k + 1, p), shift, inv));
  return round_between(k, p.levels, mul_rn(x, 0.5f), mul_rn(d0, 0.5f), mul_rn(d1, 0.5f), u);
}
/// A block's statistics are stored as bfloat16 (shift, scale), 4 bytes: exactness does not matter to
/// unbiasedness (encoder and decoder use the same stored values), only consistency does.
inline constexpr int k_stat_bytes = 4;
GACT_HD float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }
GACT_HD void store_stat(unsigned char* stats, std::uint64_t b, float shift, float scale) {
  std::uint16_t const v[2] = {float_to_bf16(shift), float_to_bf16(scale)};
  std::memcpy(stats + std::uint64_t(k_stat_bytes) * b, v, 4);
}
GACT_HD void load_stat(unsigned char const* stats, std::uint64_t b, float& shift, float& scale) {
  std::uint16_t v[2];
  std::memcpy(v, stats + std::uint64_t(k_stat_bytes) * b, 4);
  shift = bf16_to_float(v[0]);
  scale = bf16_to_float(v[1]);
}

/// A block's statistics as the decoder accepts them: finite shift, finite scale > 0 with a finite inverse.
GACT_HD bool stats_ok(float shift, float scale) {
  return is_finite_bits(shift) && is_finite_bits(scale) && scale > 0.0f && is_finite_bits(div_rn(1.0f, scale));
}

// ---- boundary groups ---------------------------------------------------------------------
// Code 0 stands for exactly `lo`, code L = 2^b - 1 for exactly `hi` when has_hi; the values strictly
// between (the interior) are quantized with the plain rule on codes [1, L - has_hi], i.e. on
// L - 1 - has_hi intervals between the interior's own min and max. The group metadata holds that
// interior (min, max); a group without interior values stores (lo, lo).

/// Intervals available to the interior of a boundary group (>= 1 for bits >= 2).
GACT_HD float boundary_levels(int bits, bool has_hi) {
  return float((1u << bits) - 2u - (has_hi ? 1u : 0u));
}

/// Code of x in a boundary group: 0 for x <= lo, L for x >= hi (has_hi), else 1 + the interior code (for a
/// 16-bit output, Narrow 1 or 2, against the interior's decoded values: quantize_as).
template <int Narrow = 0>
GACT_HD std::int32_t quantize_boundary(float x, float lo, float hi, bool has_hi, std::int32_t top,
                                       group_params const& interior, float u) {
  if (x <= lo) return 0;
  if (has_hi && x >= hi) return top;
  if (!(interior.step > 0.0f)) return 1;
  return 1 + quantize_as<Narrow>(x, interior, u);
}

/// Value of code q in a boundary group.
GACT_HD float dequantize_boundary(std::int32_t q, float lo, float hi, bool has_hi, std::int32_t top,
                                  group_params const& interior) {
  if (q == 0) return lo;
  if (has_hi && q == top) return hi;
  return dequantize(q - 1, interior);
}

}  // namespace gact::codec::hd
