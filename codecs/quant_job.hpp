// gact/codecs/quant_job.hpp
//
// The plain-data description of one quant encode or decode that the executor's
// per-group loops (quant_groups.cpp, compiled once per instruction set) receive,
// and the encoders' refusal reasons. It includes nothing but format.hpp, so the
// loops' translation units pull in no C++ library code (see quant_groups.cpp).
#pragma once

#include "codecs/format.hpp"

namespace gact::codec {

/// Why an encoder wrote no valid blob (the caller stores the tensor another way, e.g. raw).
enum class refusal : std::uint8_t {
  none = 0,
  nonfinite,      ///< quant: the tensor holds NaN/±Inf
  out_of_range,   ///< quant/boundary: a value lies outside [lo, hi]
  not_two_level,  ///< mask/predicate `ne`: the nonzero values are not all equal
  not_window,     ///< window: an index is not a position of its pooling window
};
namespace detail {

/// What the quant loops need besides the tensor (quant_groups.cpp). `stats` points at the blob's
/// statistics section (normalized: count (shift, scale) float32 pairs), `meta` at the group metadata.
struct quant_job {
  dtype dt;
  std::uint8_t variant;
  std::uint64_t numel;
  int bits, group_size;
  std::uint64_t seed, key;
  std::uint64_t count, inner;        ///< normalized
  unsigned char const* stats;        ///< normalized: the blob's statistics section
  boundary_params boundary;          ///< boundary
  bool predicate;                    ///< decode a boundary blob's predicate instead of its values
  float true_value, false_value;     ///< ... as these values
  unsigned char* meta;               ///< group metadata (read-only when decoding)
  unsigned char* codes;              ///< packed codes (read-only when decoding)
};
}  // namespace detail
}  // namespace gact::codec
