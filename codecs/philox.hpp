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

/// One Philox4x32 round: c <- (hi(M1*c2) ^ c1 ^ k0, lo(M1*c2), hi(M0*c0) ^ c3 ^ k1, lo(M0*c0)).
GACT_HD void philox_round(std::uint32_t& c0, std::uint32_t& c1, std::uint32_t& c2, std::uint32_t& c3,
                          std::uint32_t k0, std::uint32_t k1) {
  std::uint64_t const p0 = std::uint64_t{k_philox_m0} * c0;
  std::uint64_t const p1 = std::uint64_t{k_philox_m1} * c2;
  std::uint32_t const n0 = std::uint32_t(p1 >> 32) ^ c1 ^ k0;
  std::uint32_t const n2 = std::uint32_t(p0 >> 32) ^ c3 ^ k1;
  c1 = std::uint32_t(p1);
  c3 = std::uint32_t(p0);
  c0 = n0;
  c2 = n2;
}

/// Philox4x32 with 10 rounds, as in Random123's philox4x32_10 (the known-answer
/// vectors of Random123 are checked in tests/codecs). Written out round by round
/// (no loop) so that a loop calling it over many counters is straight-line code
/// the host compiler can vectorize across counters.
GACT_HD philox_block philox4x32_10(philox_block c, std::uint32_t k0, std::uint32_t k1) {
  std::uint32_t a = c.v[0], b = c.v[1], d = c.v[2], e = c.v[3];
  philox_round(a, b, d, e, k0, k1);
  philox_round(a, b, d, e, k0 + 1u * k_philox_w0, k1 + 1u * k_philox_w1);
  philox_round(a, b, d, e, k0 + 2u * k_philox_w0, k1 + 2u * k_philox_w1);
  philox_round(a, b, d, e, k0 + 3u * k_philox_w0, k1 + 3u * k_philox_w1);
  philox_round(a, b, d, e, k0 + 4u * k_philox_w0, k1 + 4u * k_philox_w1);
  philox_round(a, b, d, e, k0 + 5u * k_philox_w0, k1 + 5u * k_philox_w1);
  philox_round(a, b, d, e, k0 + 6u * k_philox_w0, k1 + 6u * k_philox_w1);
  philox_round(a, b, d, e, k0 + 7u * k_philox_w0, k1 + 7u * k_philox_w1);
  philox_round(a, b, d, e, k0 + 8u * k_philox_w0, k1 + 8u * k_philox_w1);
  philox_round(a, b, d, e, k0 + 9u * k_philox_w0, k1 + 9u * k_philox_w1);
  return philox_block{{a, b, d, e}};
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
