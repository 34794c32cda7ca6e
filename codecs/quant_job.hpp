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
  float64_range,  ///< quant of float64: a nonzero value lies outside float32's normal range or above 2^126 (it
                  ///< is quantized in float32, where it would overflow or lose its precision)
  wide,           ///< quant (plain, normalized): a group holds a magnitude >= encode_params::max_magnitude (a
                  ///< mask's fill such as finfo.min), whose step would swamp every other value of the group
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
  float const* statsf;               ///< normalized: the statistics unpacked once per call, 2 floats per
                                     ///< block: (shift, scale) to encode, (shift, 1 / scale) to decode
  boundary_params boundary;          ///< boundary
  float max_magnitude;               ///< plain, normalized encode: encode_params::max_magnitude
  bool predicate;                    ///< decode a boundary blob's predicate instead of its values
  float true_value, false_value;     ///< ... as these values
  unsigned char* meta;               ///< group metadata (read-only when decoding)
  unsigned char* codes;              ///< packed codes (read-only when decoding)
};
/// What a predicate-mask encode of bytes [b0, b1) of the code section found besides the bits.
struct mask_scan {
  bool in_range = true;   ///< every value finite and inside the predicate's closed range
  bool have_nz = false;   ///< ne: some nonzero value was seen
  float nz_min = 0.0f;    ///< ne: the smallest and largest nonzero values (equal for a two-level tensor)
  float nz_max = 0.0f;
  bool nz_finite = true;  ///< ne: every nonzero value finite
};
}  // namespace detail
}  // namespace gact::codec
