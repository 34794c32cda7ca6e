// gact/codecs/format.hpp
//
// The blob format, declared once for the host and the device: the on-disk
// header, the size of every section, the header checksum, and the validation
// that every decoder (CPU parse/decode_cpu, the CUDA decode kernel) runs before
// it reads a byte past the header. The byte layout is documented in
// codecs/README.md; any change here is a format change and bumps
// k_format_version.
//
// A blob is three sections, in this order, with no gaps:
//
//   [ header (64 B) | shape (8 B x ndim) | zero padding to a multiple of 16 ]   header_bytes
//   [ per-group metadata: (min, max) per group, in the input dtype; zero
//     padding to a multiple of 16                                          ]   meta_bytes
//   [ packed codes                                                          ]   code_bytes
//
// invariant: total = header_bytes + meta_bytes + code_bytes, and every one of
// the three is a pure function of (codec, dtype, ndim, numel, bits, group_size)
// computed by compute_layout(), the one size function of the format.
//
// Everything is little-endian (the format is written and read by little-endian
// hosts and NVIDIA GPUs only; a static_assert in codec.cpp pins this).
#pragma once

#include "codecs/hd.hpp"

namespace gact::codec {

/// Element type of a tensor (values are on-disk codes; never renumber).
enum class dtype : std::uint8_t {
  float32 = 0, float16 = 1, bfloat16 = 2, uint8 = 3, boolean = 4,
  int8 = 5, int16 = 6, int32 = 7, int64 = 8, float64 = 9,
};
inline constexpr int k_dtype_count = 10;

/// Codec of a blob (values are on-disk codes; never renumber).
enum class codec_id : std::uint8_t { raw = 0, quant = 1, mask = 2 };
inline constexpr int k_codec_count = 3;

inline constexpr std::uint32_t k_magic = 0x42434147u;  // bytes 'G','A','C','B'
inline constexpr std::uint16_t k_format_version = 1;
inline constexpr int k_max_ndim = 8;
/// Largest element count a blob may describe (keeps every size computation far from overflow).
inline constexpr std::uint64_t k_max_numel = std::uint64_t{1} << 56;
inline constexpr int k_min_group = 64;
inline constexpr int k_max_group = 1024;

/// The fixed part of the header, exactly as stored (little-endian, 64 bytes).
/// The shape (ndim x int64) follows it, then zero padding up to header_bytes.
struct blob_header {
  std::uint32_t magic;         ///< k_magic
  std::uint16_t version;       ///< k_format_version
  std::uint8_t codec;          ///< codec_id
  std::uint8_t dtype;          ///< dtype of the encoded tensor (and of decode's output)
  std::uint8_t ndim;           ///< 0..k_max_ndim
  std::uint8_t bits;           ///< quant: 1, 2, 4 or 8; raw and mask: 0
  std::uint16_t group_size;    ///< quant: power of two in [64, 1024]; raw and mask: 0
  std::uint32_t flags;         ///< reserved, 0 in version 1
  std::uint64_t numel;         ///< product of shape (1 for ndim 0), <= k_max_numel
  std::uint64_t seed;          ///< Philox key of the stochastic rounding (quant; stored as given otherwise)
  std::uint64_t key;           ///< tensor key, part of the Philox counter (quant; stored as given otherwise)
  std::uint64_t meta_bytes;    ///< size of the per-group metadata section
  std::uint64_t code_bytes;    ///< size of the packed-code section
  std::uint32_t header_bytes;  ///< align16(64 + 8*ndim)
  std::uint32_t checksum;      ///< FNV-1a 32 over bytes [0, 60) and the shape
};
static_assert(sizeof(blob_header) == 64, "blob_header is an on-disk struct");
static_assert(alignof(blob_header) == 8);

namespace hd {

GACT_HD int dtype_bytes(std::uint8_t dt) {
  switch (dt) {
    case 0: return 4;  case 1: return 2;  case 2: return 2;  case 3: return 1;  case 4: return 1;
    case 5: return 1;  case 6: return 2;  case 7: return 4;  case 8: return 8;  case 9: return 8;
    default: return 0;
  }
}

GACT_HD bool is_float_input(std::uint8_t dt) { return dt <= 2; }

/// The sizes of a blob's sections.
struct blob_layout {
  std::uint64_t header_bytes;
  std::uint64_t n_groups;    ///< quant: ceil(numel / group_size); 0 otherwise
  std::uint64_t meta_bytes;  ///< quant: align16(n_groups * 2 * dtype_bytes) (zero padding); 0 otherwise
  std::uint64_t code_bytes;  ///< quant: ceil(numel / 8) * bits; mask: ceil(numel / 8); raw: numel * dtype_bytes
  std::uint64_t total;
};

/// Section sizes for parameters that have already been validated (numel <= k_max_numel).
/// The quant code section is a whole number of 8-element chunks (b bytes each), so
/// that a chunk is always stored whole, by the CPU and by the kernel alike.
GACT_HD blob_layout compute_layout(std::uint8_t codec, std::uint8_t dt, int ndim, std::uint64_t numel,
                                   int bits, int group_size) {
  blob_layout l{};
  l.header_bytes = (64u + 8u * std::uint64_t(ndim) + 15u) & ~std::uint64_t{15};
  if (codec == std::uint8_t(codec_id::quant)) {
    l.n_groups = (numel + std::uint64_t(group_size) - 1) / std::uint64_t(group_size);
    // Zero-padded to a multiple of 16 so that the code section is 16-byte aligned (the kernels
    // store a chunk's codes as one 1/2/4/8-byte word).
    l.meta_bytes = (l.n_groups * 2u * std::uint64_t(dtype_bytes(dt)) + 15u) & ~std::uint64_t{15};
    l.code_bytes = (numel + 7u) / 8u * std::uint64_t(bits);
  } else if (codec == std::uint8_t(codec_id::mask)) {
    l.code_bytes = (numel + 7u) / 8u;
  } else {
    l.code_bytes = numel * std::uint64_t(dtype_bytes(dt));
  }
  l.total = l.header_bytes + l.meta_bytes + l.code_bytes;
  return l;
}

/// Why a blob (or a parameter set) is not acceptable; ok == 0.
enum class blob_status : std::uint32_t {
  ok = 0, truncated_header, bad_magic, bad_version, bad_ndim, bad_header_bytes, bad_checksum,
  bad_codec, bad_dtype, bad_codec_dtype, bad_bits, bad_group_size, bad_flags, bad_shape,
  bad_numel, bad_meta_bytes, bad_code_bytes, truncated, bad_group_meta, dst_too_small,
  count_
};

/// Codec/dtype/bits/group-size consistency, shared by the encoders' parameter checks and the decoders.
GACT_HD blob_status check_params(std::uint8_t codec, std::uint8_t dt, int bits, int group_size) {
  if (codec >= k_codec_count) return blob_status::bad_codec;
  if (dt >= k_dtype_count) return blob_status::bad_dtype;
  if (codec == std::uint8_t(codec_id::quant)) {
    if (!is_float_input(dt)) return blob_status::bad_codec_dtype;
    if (bits != 1 && bits != 2 && bits != 4 && bits != 8) return blob_status::bad_bits;
    if (group_size < k_min_group || group_size > k_max_group || (group_size & (group_size - 1)) != 0)
      return blob_status::bad_group_size;
  } else {
    if (codec == std::uint8_t(codec_id::mask) && dt != std::uint8_t(dtype::boolean) &&
        dt != std::uint8_t(dtype::uint8))
      return blob_status::bad_codec_dtype;
  }
  return blob_status::ok;
}

/// FNV-1a 32 of the header's first 60 bytes and of the shape that follows it.
GACT_HD std::uint32_t header_checksum(unsigned char const* p, int ndim) {
  std::uint32_t h = 0x811C9DC5u;
  for (int i = 0; i < 60; ++i) h = (h ^ p[i]) * 0x01000193u;
  for (int i = 64; i < 64 + 8 * ndim; ++i) h = (h ^ p[i]) * 0x01000193u;
  return h;
}

/// Validate a blob of `len` readable bytes at `p`, reading nothing outside [p, p+len).
/// On ok, `*h` holds the header, `shape[0..ndim)` the shape and `*lay` the layout, and
/// lay->total <= len. Per-group metadata is checked by the decoders as they read it.
GACT_HD blob_status check_blob(unsigned char const* p, std::uint64_t len, blob_header* h,
                               std::int64_t* shape, blob_layout* lay) {
  if (len < sizeof(blob_header)) return blob_status::truncated_header;
  std::memcpy(h, p, sizeof(blob_header));
  if (h->magic != k_magic) return blob_status::bad_magic;
  if (h->version != k_format_version) return blob_status::bad_version;
  if (h->ndim > k_max_ndim) return blob_status::bad_ndim;
  std::uint32_t const hb = (64u + 8u * h->ndim + 15u) & ~15u;
  if (h->header_bytes != hb) return blob_status::bad_header_bytes;
  if (len < hb) return blob_status::truncated_header;
  if (header_checksum(p, h->ndim) != h->checksum) return blob_status::bad_checksum;
  blob_status const ps = check_params(h->codec, h->dtype, h->bits, h->group_size);
  if (ps != blob_status::ok) return ps;
  if (h->codec != std::uint8_t(codec_id::quant) && (h->bits != 0 || h->group_size != 0))
    return h->bits != 0 ? blob_status::bad_bits : blob_status::bad_group_size;
  if (h->flags != 0) return blob_status::bad_flags;
  for (std::uint32_t i = 64u + 8u * h->ndim; i < hb; ++i)
    if (p[i] != 0) return blob_status::bad_header_bytes;
  std::uint64_t prod = 1;
  for (int d = 0; d < h->ndim; ++d) {
    std::int64_t s;
    std::memcpy(&s, p + 64 + 8 * d, 8);
    if (s < 0 || std::uint64_t(s) > k_max_numel) return blob_status::bad_shape;
    if (s != 0 && prod > k_max_numel / std::uint64_t(s)) return blob_status::bad_shape;
    prod *= std::uint64_t(s);             // checked above: prod <= k_max_numel
    shape[d] = s;
  }
  if (prod != h->numel) return blob_status::bad_numel;
  *lay = compute_layout(h->codec, h->dtype, h->ndim, h->numel, h->bits, h->group_size);
  if (h->meta_bytes != lay->meta_bytes) return blob_status::bad_meta_bytes;
  if (h->code_bytes != lay->code_bytes) return blob_status::bad_code_bytes;
  if (lay->total > len) return blob_status::truncated;
  return blob_status::ok;
}

/// Fill the header and shape bytes of a blob (p must hold layout.header_bytes bytes).
GACT_HD void write_header(unsigned char* p, blob_header h, std::int64_t const* shape) {
  for (std::uint32_t i = 0; i < h.header_bytes; ++i) p[i] = 0;
  h.checksum = 0;
  std::memcpy(p, &h, sizeof h);
  for (int d = 0; d < h.ndim; ++d) std::memcpy(p + 64 + 8 * d, &shape[d], 8);
  h.checksum = header_checksum(p, h.ndim);
  std::memcpy(p + 60, &h.checksum, 4);
}

}  // namespace hd
}  // namespace gact::codec
