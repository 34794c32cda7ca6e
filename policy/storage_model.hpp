// gact/policy/storage_model.hpp
//
// How many bytes a saved tensor occupies in the activation store at a given bit
// width. The policy's budget is stated in average bits per element, but what
// the store pays for is whole blobs: a header, per-group metadata (min and
// scale of every group) and the packed codes. GACT counted only b·numel and so
// exceeded its budget by the metadata (0.25 bit/element at 8 B per 256
// elements, 12.5 % of a 2-bit budget). This model counts everything, with the
// layout given as parameters. The defaults match gact's blob format
// (codecs/format.hpp, compute_layout) for a 4-D tensor:
//   header   align16(64 + 8·ndim) bytes = 96 for ndim 4 (also for raw pass-through blobs)
//   metadata (min, max) per group in the input dtype: 8 B (fp32) or 4 B (fp16/bf16) per group,
//            the section zero-padded to a multiple of 16 B
//   codes    ceil(numel / 8) · b bytes (8-element chunks, no padding to the group)
// `for_codec(ndim)` gives the header of another rank; a larger ndim over-counts by at
// most 16 B per dims pair and is safe (the budget then holds with margin).
//
// Invariants (checked by `validate`):
//   group_size > 0; code_chunk > 0 and code_chunk % 8 == 0 (chunks of codes are whole bytes)
//   blob_align >= 1
//   meta(f)  = meta_bytes_per_group · (meta_scales_with_dtype ? f/32 : 1);  meta_align >= 1
//   compressed_bytes(n, b, f) = align(header + align_to(groups(n)·meta(f), meta_align)
//                                     + ceil(n/code_chunk)·code_chunk·b/8)
//   full_bytes(n, f) = align(passthrough_header + n·f/8)       (f = 16 or 32)
#pragma once

#include "allocator/error.hpp"

#include <cstdint>
#include <string>

namespace gact::policy {

/// Bit widths the codecs implement; anything else is full precision or invalid.
inline constexpr int k_code_bits[] = {1, 2, 4, 8};

/// True for 1, 2, 4 and 8.
constexpr bool is_code_bits(int bits) noexcept {
  return bits == 1 || bits == 2 || bits == 4 || bits == 8;
}

/// The position of a code width in k_code_bits (1 -> 0, 2 -> 1, 4 -> 2, 8 -> 3); bits must be a code width.
constexpr std::size_t width_index(int bits) noexcept {
  return bits == 1 ? 0 : bits == 2 ? 1 : bits == 4 ? 2 : 3;
}

/// True for the full-precision widths a saved tensor can have (fp16/bf16 and fp32).
constexpr bool is_full_bits(int bits) noexcept { return bits == 16 || bits == 32; }

/// The stored size of one saved tensor as a function of its bit width.
struct storage_model {
  std::uint32_t group_size = 256;              ///< elements per quantization group
  std::uint32_t meta_bytes_per_group = 8;      ///< per-group metadata of an fp32 tensor
  bool meta_scales_with_dtype = true;          ///< metadata is stored in the input dtype (halved for 16-bit)
  std::uint32_t meta_align = 16;               ///< the metadata section is padded to a multiple of this
  std::uint32_t code_chunk = 8;                ///< codes are stored for numel rounded up to this (8: gact; 256: GACT)
  std::uint32_t header_bytes = 96;             ///< fixed bytes per compressed blob
  std::uint32_t passthrough_header_bytes = 96; ///< fixed bytes for a tensor kept at full precision
  std::uint32_t blob_align = 1;                ///< blob sizes are rounded up to a multiple of this

  /// The layout of gact's codecs (codecs/format.hpp) for tensors of up to `ndim` dims.
  /// @throws gact::invalid_argument if ndim is not in [0, 8].
  static storage_model for_codec(int ndim, std::uint32_t group_size = 256) {
    GACT_EXPECTS(ndim >= 0 && ndim <= 8, "storage_model::for_codec: ndim must be in [0, 8], got " +
                                             std::to_string(ndim));
    storage_model m;
    m.group_size = group_size;
    m.header_bytes = (64u + 8u * static_cast<std::uint32_t>(ndim) + 15u) & ~15u;
    m.passthrough_header_bytes = m.header_bytes;
    return m;
  }

  /// Check the invariants above. @throws gact::invalid_argument naming the bad field.
  void validate() const {
    GACT_EXPECTS(group_size > 0, "storage_model.group_size must be positive");
    GACT_EXPECTS(code_chunk > 0 && code_chunk % 8 == 0,
                 "storage_model.code_chunk must be a positive multiple of 8, got " + std::to_string(code_chunk));
    GACT_EXPECTS(blob_align >= 1, "storage_model.blob_align must be >= 1");
    GACT_EXPECTS(meta_align >= 1, "storage_model.meta_align must be >= 1");
  }

  /// Number of groups of a tensor of `numel` elements: ceil(numel / group_size).
  std::uint64_t groups(std::uint64_t numel) const noexcept {
    return (numel + group_size - 1) / group_size;
  }

  /// Bytes of a compressed blob at `bits` ∈ {1,2,4,8} of a tensor whose own precision is
  /// `full_bits` (16 or 32), header and metadata included.
  /// @throws gact::invalid_argument if `bits` is not a code width or full_bits not 16/32.
  std::uint64_t compressed_bytes(std::uint64_t numel, int bits, int full_bits = 32) const {
    GACT_EXPECTS(is_code_bits(bits), "compressed_bytes: bits must be 1, 2, 4 or 8, got " +
                                         std::to_string(bits));
    GACT_EXPECTS(is_full_bits(full_bits), "compressed_bytes: full precision must be 16 or 32 bits, got " +
                                              std::to_string(full_bits));
    std::uint64_t const g = groups(numel);
    std::uint64_t const meta =
        meta_scales_with_dtype ? std::uint64_t{meta_bytes_per_group} * static_cast<std::uint64_t>(full_bits) / 32
                               : std::uint64_t{meta_bytes_per_group};
    std::uint64_t const chunks = (numel + code_chunk - 1) / code_chunk;
    std::uint64_t const payload = chunks * code_chunk / 8 * static_cast<std::uint64_t>(bits);
    std::uint64_t const meta_section = (g * meta + meta_align - 1) / meta_align * meta_align;
    return align(std::uint64_t{header_bytes} + meta_section + payload);
  }

  /// Bytes uniform `avg_bits` would store for this tensor: header, metadata and codes of
  /// avg_bits bits per element (chunks as compressed_bytes), exact for a code width and linear
  /// in between, so a fractional budget (3 bits) means codes of that average width. This is the
  /// policy budget's meaning: at budget b the adaptive policy may store what uniform b stores.
  /// @throws gact::invalid_argument if avg_bits is not finite and positive or full_bits not 16/32.
  double uniform_bytes(std::uint64_t numel, double avg_bits, int full_bits = 32) const {
    GACT_EXPECTS(avg_bits > 0.0 && avg_bits < 1e6, "uniform_bytes: average bits must be finite and > 0, got " +
                                                        std::to_string(avg_bits));
    std::uint64_t const fixed = compressed_bytes(numel, 1, full_bits) - code_bytes(numel, 1);
    return static_cast<double>(fixed) + static_cast<double>(code_bytes(numel, 1)) * avg_bits;
  }

  /// Bytes of the packed codes of `numel` elements at `bits` (without header and metadata).
  std::uint64_t code_bytes(std::uint64_t numel, int bits) const noexcept {
    std::uint64_t const chunks = (numel + code_chunk - 1) / code_chunk;
    return chunks * code_chunk / 8 * static_cast<std::uint64_t>(bits);
  }

  /// Bytes of a tensor kept at full precision (`full_bits` 16 or 32).
  /// @throws gact::invalid_argument if `full_bits` is not 16 or 32.
  std::uint64_t full_bytes(std::uint64_t numel, int full_bits) const {
    GACT_EXPECTS(is_full_bits(full_bits), "full_bytes: full precision must be 16 or 32 bits, got " +
                                              std::to_string(full_bits));
    return align(std::uint64_t{passthrough_header_bytes} +
                 numel * static_cast<std::uint64_t>(full_bits) / 8);
  }

  /// Bytes at `bits`, which is either a code width or the tensor's own `full_bits`.
  /// @throws gact::invalid_argument if `bits` is neither.
  std::uint64_t stored_bytes(std::uint64_t numel, int bits, int full_bits) const {
    if (is_code_bits(bits)) return compressed_bytes(numel, bits, full_bits);
    GACT_EXPECTS(bits == full_bits, "stored_bytes: bits " + std::to_string(bits) +
                                        " is neither a code width (1,2,4,8) nor the tensor's "
                                        "full precision " + std::to_string(full_bits));
    return full_bytes(numel, full_bits);
  }

 private:
  std::uint64_t align(std::uint64_t n) const noexcept {
    return (n + blob_align - 1) / blob_align * blob_align;
  }
};

}  // namespace gact::policy
