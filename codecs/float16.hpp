// gact/codecs/float16.hpp
//
// IEEE binary16 (float16) and bfloat16 conversions, written with integer and
// single-precision operations only, so that the same definition compiles for
// the host (g++/clang, no cuda_fp16.h) and the device, and both sides convert
// identically. float -> 16 bit rounds to nearest even; NaN stays NaN (quiet),
// ±Inf stays ±Inf, overflow goes to ±Inf, float16 denormals are produced and
// read exactly (no flush to zero).
#pragma once

#include "codecs/hd.hpp"

namespace gact::codec::hd {

/// float16 bits -> float (exact). Branch-free (selects only), so loops over it vectorize.
GACT_HD float half_to_float(std::uint16_t h) {
  std::uint32_t const sign = std::uint32_t(h & 0x8000u) << 16;
  std::uint32_t const em = h & 0x7FFFu;
  std::uint32_t const normal = (em << 13) + 0x38000000u;                 // rebias 15 -> 127
  std::uint32_t const infnan = (em << 13) + 0x70000000u;                 // exponent all ones, payload kept
  std::uint32_t const denorm = float_bits(mul_rn(float(std::int32_t(em)), 5.9604644775390625e-8f));  // em * 2^-24
  std::uint32_t const bits = em >= 0x7C00u ? infnan : (em >= 0x0400u ? normal : denorm);
  return bits_float(sign | bits);
}

/// float -> float16 bits, round to nearest even. Branch-free (selects only).
GACT_HD std::uint16_t float_to_half(float f) {
  std::uint32_t const x = float_bits(f);
  std::uint32_t const sign = (x >> 16) & 0x8000u;
  std::uint32_t const ax = x & 0x7FFFFFFFu;
  std::uint32_t const special = ax > 0x7F800000u ? 0x7E00u : 0x7C00u;  // NaN (quiet) or Inf/overflow
  // Below 2^-14: a float16 denormal or zero. Adding 0.5 (ulp 2^-24, the float16
  // denormal unit) rounds the value to that unit in one IEEE addition.
  std::uint32_t const denorm = float_bits(add_rn(bits_float(ax < 0x38800000u ? ax : 0u), 0.5f)) - 0x3F000000u;
  std::uint32_t const normal = (ax + 0xC8000FFFu + ((ax >> 13) & 1u)) >> 13;  // rebias 127 -> 15, RNE
  std::uint32_t const r = ax >= 0x477FF000u ? special : (ax < 0x38800000u ? denorm : normal);  // >= 65520: Inf
  return std::uint16_t(sign | r);
}

/// bfloat16 bits -> float (exact).
GACT_HD float bf16_to_float(std::uint16_t h) { return bits_float(std::uint32_t(h) << 16); }

/// float -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN).
GACT_HD std::uint16_t float_to_bf16(float f) {
  std::uint32_t const x = float_bits(f);
  std::uint32_t const rounded = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
  return std::uint16_t((x & 0x7FFFFFFFu) > 0x7F800000u ? ((x >> 16) | 0x0040u) : rounded);
}

}  // namespace gact::codec::hd
