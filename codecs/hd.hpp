// gact/codecs/hd.hpp
//
// The portability layer of the codec math. Everything that both executors run
// (the CPU executor compiled by g++/clang, the CUDA kernels compiled by nvcc)
// is written as `GACT_HD` inline functions over the helpers below, so the CPU
// tests check the very arithmetic the GPU runs.
//
// Bit-exact CPU = GPU blobs need identical floating-point rounding on both
// sides. Every arithmetic step of the shared math goes through add_rn/sub_rn/
// mul_rn/div_rn: on the device these are the `__f*_rn` intrinsics, which nvcc
// never contracts into FMAs; on the host they are plain IEEE operations, and
// codecs/ is compiled with -ffp-contract=off so the host compiler does not
// contract them either. No fused multiply-add appears in the shared math.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define GACT_HD __host__ __device__ __forceinline__
#else
#define GACT_HD inline __attribute__((always_inline))
#endif

#if !defined(__CUDA_ARCH__)
#include <bit>
#endif

namespace gact::codec::hd {

/// Largest finite float (FLT_MAX) and smallest positive denormal, as bit patterns made floats.
inline constexpr float k_float_max = 3.40282346638528859812e+38f;
inline constexpr float k_denorm_min = 1.40129846432481707092e-45f;

GACT_HD std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<std::uint32_t>(f);
#endif
}

GACT_HD float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

// Correctly rounded (round-to-nearest-even) single-precision operations, never contracted.
#if defined(__CUDA_ARCH__)
GACT_HD float add_rn(float a, float b) { return __fadd_rn(a, b); }
GACT_HD float sub_rn(float a, float b) { return __fsub_rn(a, b); }
GACT_HD float mul_rn(float a, float b) { return __fmul_rn(a, b); }
GACT_HD float div_rn(float a, float b) { return __fdiv_rn(a, b); }
#else
GACT_HD float add_rn(float a, float b) { return a + b; }
GACT_HD float sub_rn(float a, float b) { return a - b; }
GACT_HD float mul_rn(float a, float b) { return a * b; }
GACT_HD float div_rn(float a, float b) { return a / b; }
#endif

/// True for every finite float (not NaN, not ±Inf), by looking at the exponent bits only.
GACT_HD bool is_finite_bits(float f) { return (float_bits(f) & 0x7f800000u) != 0x7f800000u; }

/// Whether a group's bounds lie inside (-m, m), or m is 0 (no limit: encode_params::max_magnitude); false for NaN.
GACT_HD bool quant_range_ok(float lo, float hi, float m) { return m == 0.0f || (lo > -m && hi < m); }

}  // namespace gact::codec::hd
