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

/// float16 bits -> float (exact).
GACT_HD float half_to_float(std::uint16_t h) {
  std::uint32_t const sign = std::uint32_t(h & 0x8000u) << 16;
  std::uint32_t const em = h & 0x7FFFu;
  std::uint32_t bits;
  if (em >= 0x7C00u) {
    bits = 0x7F800000u | ((em & 0x3FFu) << 13);                     // Inf / NaN (payload kept)
  } else if (em >= 0x0400u) {
    bits = (em << 13) + 0x38000000u;                                 // normal: rebias 15 -> 127
  } else {
    bits = float_bits(mul_rn(float(em), 5.9604644775390625e-8f));    // denormal: em * 2^-24, exact
  }
  return bits_float(sign | bits);
}

/// float -> float16 bits, round to nearest even.
GACT_HD std::uint16_t float_to_half(float f) {
  std::uint32_t const x = float_bits(f);
  std::uint32_t const sign = (x >> 16) & 0x8000u;
  std::uint32_t const ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return std::uint16_t(sign | (ax > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (ax >= 0x477FF000u) return std::uint16_t(sign | 0x7C00u);       // >= 65520 rounds to Inf
  if (ax < 0x38800000u) {
    // Below 2^-14: a float16 denormal or zero. Adding 0.5 (ulp 2^-24, the float16
    // denormal unit) rounds the value to that unit in one IEEE addition.
    float const t = add_rn(bits_float(ax), 0.5f);
    return std::uint16_t(sign | (float_bits(t) - 0x3F000000u));
  }
  std::uint32_t const odd = (ax >> 13) & 1u;
  return std::uint16_t(sign | ((ax + 0xC8000FFFu + odd) >> 13));     // rebias 127 -> 15, RNE
}

/// bfloat16 bits -> float (exact).
GACT_HD float bf16_to_float(std::uint16_t h) { return bits_float(std::uint32_t(h) << 16); }

/// float -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN).
GACT_HD std::uint16_t float_to_bf16(float f) {
  std::uint32_t const x = float_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return std::uint16_t((x >> 16) | 0x0040u);
  return std::uint16_t((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace gact::codec::hd
