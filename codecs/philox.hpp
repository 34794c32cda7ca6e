// gact/codecs/philox.hpp
//
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011), the counter-based generator behind the stochastic rounding of the
// quant codec. A counter-based generator has no state: the random bits of an
// element are a pure function of (key, counter), so the CPU executor and the
// CUDA kernel produce the same bits for the same element in any order, on any
// number of threads.
//
// How gact uses it (part of the blob format, see codecs/README.md):
//   key     = (lo32(seed), hi32(seed))
//   counter = (lo32(c), hi32(c), lo32(tensor_key), hi32(tensor_key)),  c = element_index / 8
//   output  = 4 x 32 bits = 8 x 16 bits; element e takes the 16-bit half
//             (e % 8) / 2 of word (e % 8) / 2: low half for even e, high half for odd e.
// One call thus serves 8 consecutive elements with 16 random bits each.
#pragma once

#include "codecs/hd.hpp"

namespace gact::codec::hd {

/// Four 32-bit words: a Philox counter or output block.
struct philox_block {
  std::uint32_t v[4];
};

inline constexpr std::uint32_t k_philox_m0 = 0xD2511F53u;
inline constexpr std::uint32_t k_philox_m1 = 0xCD9E8D57u;
inline constexpr std::uint32_t k_philox_w0 = 0x9E3779B9u;
inline constexpr std::uint32_t k_philox_w1 = 0xBB67AE85u;

/// Philox4x32 with 10 rounds, as in Random123's philox4x32_10 (the known-answer
/// vectors of Random123 are checked in tests/codecs).
GACT_HD philox_block philox4x32_10(philox_block c, std::uint32_t k0, std::uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    std::uint64_t const p0 = std::uint64_t{k_philox_m0} * c.v[0];
    std::uint64_t const p1 = std::uint64_t{k_philox_m1} * c.v[2];
    std::uint32_t const hi0 = std::uint32_t(p0 >> 32), lo0 = std::uint32_t(p0);
    std::uint32_t const hi1 = std::uint32_t(p1 >> 32), lo1 = std::uint32_t(p1);
    c.v[0] = hi1 ^ c.v[1] ^ k0;
    c.v[1] = lo1;
    c.v[2] = hi0 ^ c.v[3] ^ k1;
    c.v[3] = lo0;
    k0 += k_philox_w0;
    k1 += k_philox_w1;
  }
  return c;
}

/// The 128 random bits that serve elements 8*c .. 8*c+7 of a tensor (see the file comment).
GACT_HD philox_block noise_block(std::uint64_t seed, std::uint64_t tensor_key, std::uint64_t c) {
  philox_block ctr{{std::uint32_t(c), std::uint32_t(c >> 32), std::uint32_t(tensor_key),
                    std::uint32_t(tensor_key >> 32)}};
  return philox4x32_10(ctr, std::uint32_t(seed), std::uint32_t(seed >> 32));
}

/// The 16 random bits of lane j (0..7) of a block.
GACT_HD std::uint32_t noise_lane(philox_block const& b, int j) {
  return (b.v[j >> 1] >> (16 * (j & 1))) & 0xFFFFu;
}

}  // namespace gact::codec::hd
