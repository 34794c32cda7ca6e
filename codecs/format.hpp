// gact/codecs/format.hpp
//
// The blob format, declared once for the host and the device: the on-disk
// header, the per-variant parameter blocks, the size of every section, the
// header checksum, and the validation that every decoder (CPU parse/decode_cpu,
// the CUDA decode kernel) runs before it reads a byte past the header. The byte
// layout is documented in codecs/README.md; any change here is a format change
// and bumps k_format_version.
//
// A blob is four sections, in this order, with no gaps:
//
//   [ header (64 B) | shape (8 B x ndim) | variant parameters (0, 16 or 160 B) |
//     zero padding to a multiple of 16                                     ]   header_bytes
//   [ normalized quant only: per-block statistics (shift, scale) as bfloat16
//     pairs; zero padding to a multiple of 16                              ]   stats_bytes  \ meta_bytes
//   [ quant: per-group metadata (min, max); zero padding to a multiple of 16 ]   group_bytes  /
//   [ packed codes                                                          ]   code_bytes
//
// invariant: total = header_bytes + meta_bytes + code_bytes, meta_bytes =
// stats_bytes + group_bytes, and every size is a pure function of (codec,
// variant, dtype, ndim, numel, bits, group_size, statistics count) computed by
// compute_layout(), the one size function of the format.
//
// Codecs and their variants (the variant is the low byte of the header's flags):
//   raw     any dtype, lossless bytes
//   quant   float32/float16/bfloat16/float64, b in {1,2,4,8} bits per element:
//             plain       per-group (min, max) with stochastic rounding
//             normalized  the same on z = (x - shift_i) * scale_i, i = (e / inner) % count,
//                         decoded as x = z * (1 / scale_i) + shift_i (batch/layer/group norm inputs)
//             boundary    code 0 is exactly `lo`, code 2^b-1 exactly `hi` (when has_hi); the values
//                         strictly between are quantized on the remaining codes, so a predicate
//                         reader (ReLU: x > 0) reads its predicate exactly from the codes
//   mask    1 bit per element:
//             bytes       bool or 0/1 uint8 input, decoded as 0/1 bytes
//             predicate   a float tensor and a predicate (x > a, a < x < b, x != 0, ...), decoded
//                         to a caller-chosen value for true and for false
//   window  lossless max-pool indices stored as the offset inside their pooling window
//           (a 3x3 window: 4 bits instead of 64)
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
enum class codec_id : std::uint8_t { raw = 0, quant = 1, mask = 2, window = 3 };
inline constexpr int k_codec_count = 4;

/// Variants of the quant codec (low byte of blob_header::flags).
enum class quant_mode : std::uint8_t { plain = 0, normalized = 1, boundary = 2 };
/// Variants of the mask codec (low byte of blob_header::flags).
enum class mask_mode : std::uint8_t { bytes = 0, predicate = 1 };

/// The predicate of a predicate mask, on the element value x (NaN satisfies none but `ne` and
/// `gt_or_nan`, the one read by backwards that pass the gradient at NaN).
enum class predicate : std::uint32_t {
  gt = 1,      ///< x > a             (relu, threshold, leaky_relu: sign)
  ge = 2,      ///< x >= a            (clamp(min=a))
  lt = 3,      ///< x < a
  le = 4,      ///< x <= a            (clamp(max=a))
  open = 5,    ///< a < x < b         (hardtanh, relu6)
  closed = 6,  ///< a <= x <= b       (clamp(a, b))
  ne = 7,      ///< x != 0            (a two-level tensor such as a dropout mask scaled by 1/(1-p))
  gt_or_nan = 8,  ///< !(x <= a)    (relu, threshold: torch zeroes the gradient where x <= a only)
};
inline constexpr std::uint32_t k_predicate_max = 8;

inline constexpr std::uint32_t k_magic = 0x42434147u;  // bytes 'G','A','C','B'
inline constexpr std::uint16_t k_format_version = 2;
inline constexpr int k_max_ndim = 8;
/// Largest element count a blob may describe (keeps every size computation far from overflow).
inline constexpr std::uint64_t k_max_numel = std::uint64_t{1} << 56;
inline constexpr int k_min_group = 64;
inline constexpr int k_max_group = 1024;
/// Largest number of spatial dims of a pooling window (max_pool1d/2d/3d).
inline constexpr int k_window_max_nd = 3;

/// The fixed part of the header, exactly as stored (little-endian, 64 bytes).
/// The shape (ndim x int64) follows it, then the variant's parameters, then zero padding
/// up to header_bytes.
struct blob_header {
  std::uint32_t magic;         ///< k_magic
  std::uint16_t version;       ///< k_format_version
  std::uint8_t codec;          ///< codec_id
  std::uint8_t dtype;          ///< dtype of the encoded tensor (and of decode's output)
  std::uint8_t ndim;           ///< 0..k_max_ndim
  std::uint8_t bits;           ///< quant and window: 1, 2, 4 or 8; raw and mask: 0
  std::uint16_t group_size;    ///< quant: power of two in [64, 1024]; others: 0
  std::uint32_t flags;         ///< low byte: the codec's variant; other bits 0
  std::uint64_t numel;         ///< product of shape (1 for ndim 0), <= k_max_numel
  std::uint64_t seed;          ///< Philox key of the stochastic rounding (quant; stored as given otherwise)
  std::uint64_t key;           ///< tensor key, part of the Philox counter (quant; stored as given otherwise)
  std::uint64_t meta_bytes;    ///< size of the statistics + per-group metadata sections
  std::uint64_t code_bytes;    ///< size of the packed-code section
  std::uint32_t header_bytes;  ///< align16(64 + 8*ndim + params_bytes(codec, variant))
  std::uint32_t checksum;      ///< FNV-1a 32 over bytes [0, 60), the shape and the parameters
};
static_assert(sizeof(blob_header) == 64, "blob_header is an on-disk struct");
static_assert(alignof(blob_header) == 8);

/// quant/normalized parameters; followed (after the header) by `count` (shift, scale) bfloat16 pairs.
struct normalized_params {
  std::uint64_t count;  ///< number of statistics blocks (>= 1)
  std::uint64_t inner;  ///< elements per block run: element e uses block (e / inner) % count (>= 1)
};
static_assert(sizeof(normalized_params) == 16, "normalized_params is an on-disk struct");

/// quant/boundary parameters.
struct boundary_params {
  float lo;              ///< the value of code 0 (finite)
  float hi;              ///< the value of code 2^b - 1 when has_hi (finite, > lo)
  std::uint32_t has_hi;  ///< 0 or 1
  std::uint32_t reserved;  ///< 0
};
static_assert(sizeof(boundary_params) == 16, "boundary_params is an on-disk struct");

/// mask/predicate parameters.
struct predicate_params {
  std::uint32_t pred;  ///< predicate (1..k_predicate_max)
  float a;             ///< first bound (finite; unused by ne)
  float b;             ///< second bound of open/closed (finite, >= a; > a for open); 0 otherwise
  float level;         ///< ne: the one nonzero value of the tensor (finite); 0 otherwise
};
static_assert(sizeof(predicate_params) == 16, "predicate_params is an on-disk struct");

/// window parameters: max-pool indices over nd spatial dims. Element e of the indices tensor (memory
/// order) belongs to output position s = (e / inner) % prod(out), row-major over out[0..nd); its value
/// is a flat row-major index into the input plane in[0..nd); the code is the row-major index of
/// (i_d - (o_d * stride_d - pad_d)) / dilation_d inside kernel[0..nd).
struct window_params {
  std::uint32_t nd;        ///< 1, 2 or 3
  std::uint32_t reserved;  ///< 0
  std::uint64_t inner;     ///< 1 for (N, C, *spatial) memory order, C for channels-last (N, *spatial, C)
  std::int64_t in[k_window_max_nd];
  std::int64_t out[k_window_max_nd];
  std::int64_t kernel[k_window_max_nd];
  std::int64_t stride[k_window_max_nd];
  std::int64_t pad[k_window_max_nd];
  std::int64_t dilation[k_window_max_nd];
};
static_assert(sizeof(window_params) == 160, "window_params is an on-disk struct");

namespace hd {

GACT_HD int dtype_bytes(std::uint8_t dt) {
  switch (dt) {
    case 0: return 4;  case 1: return 2;  case 2: return 2;  case 3: return 1;  case 4: return 1;
    case 5: return 1;  case 6: return 2;  case 7: return 4;  case 8: return 8;  case 9: return 8;
    default: return 0;
  }
}

/// dtypes the quant codec and predicate masks read (float32, float16, bfloat16, float64).
GACT_HD bool is_float_input(std::uint8_t dt) { return dt <= 2 || dt == 9; }

/// Bytes of one (min, max) value of the per-group metadata: the input dtype for plain and boundary
/// groups of the 16-bit floats (their bounds are input values, exact in it); float32 for float32 and
/// float64, and for normalized groups (whose bounds are normalized values, not input values).
GACT_HD int meta_value_bytes(std::uint8_t dt, std::uint8_t variant) {
  return (dt == 1 || dt == 2) && variant != std::uint8_t(quant_mode::normalized) ? 2 : 4;
}

/// Bytes of a variant's parameter block in the header.
GACT_HD std::uint32_t params_bytes(std::uint8_t codec, std::uint8_t variant) {
  if (codec == std::uint8_t(codec_id::quant))
    return variant == std::uint8_t(quant_mode::normalized) ? 16u : variant == std::uint8_t(quant_mode::boundary) ? 16u : 0u;
  if (codec == std::uint8_t(codec_id::mask)) return variant == std::uint8_t(mask_mode::predicate) ? 16u : 0u;
  if (codec == std::uint8_t(codec_id::window)) return 160u;
  return 0u;
}

GACT_HD std::uint64_t align16(std::uint64_t n) { return (n + 15u) & ~std::uint64_t{15}; }

/// The sizes of a blob's sections.
struct blob_layout {
  std::uint64_t header_bytes;
  std::uint64_t stats_bytes;  ///< normalized quant: align16(count * 4); 0 otherwise
  std::uint64_t n_groups;     ///< quant: ceil(numel / group_size); 0 otherwise
  std::uint64_t group_bytes;  ///< quant: align16(n_groups * 2 * meta_value_bytes); 0 otherwise
  std::uint64_t meta_bytes;   ///< stats_bytes + group_bytes
  std::uint64_t code_bytes;   ///< quant, window: ceil(numel / 8) * bits; mask: ceil(numel / 8); raw: numel * dtype_bytes
  std::uint64_t total;
};

/// Section sizes for parameters that have already been validated (numel <= k_max_numel,
/// count <= max(numel, 1)). The quant and window code sections are a whole number of 8-element
/// chunks (b bytes each), so that a chunk is always stored whole, by the CPU and by the kernel alike.
GACT_HD blob_layout compute_layout(std::uint8_t codec, std::uint8_t variant, std::uint8_t dt, int ndim,
                                   std::uint64_t numel, int bits, int group_size, std::uint64_t count) {
  blob_layout l{};
  l.header_bytes = align16(64u + 8u * std::uint64_t(ndim) + params_bytes(codec, variant));
  if (codec == std::uint8_t(codec_id::quant)) {
    if (variant == std::uint8_t(quant_mode::normalized)) l.stats_bytes = align16(count * 4u);
    l.n_groups = (numel + std::uint64_t(group_size) - 1) / std::uint64_t(group_size);
    // Zero-padded to a multiple of 16 so that the code section is 16-byte aligned (the kernels
    // store a chunk's codes as one 1/2/4/8-byte word).
    l.group_bytes = align16(l.n_groups * 2u * std::uint64_t(meta_value_bytes(dt, variant)));
    l.code_bytes = (numel + 7u) / 8u * std::uint64_t(bits);
  } else if (codec == std::uint8_t(codec_id::mask)) {
    l.code_bytes = (numel + 7u) / 8u;
  } else if (codec == std::uint8_t(codec_id::window)) {
    l.code_bytes = (numel + 7u) / 8u * std::uint64_t(bits);
  } else {
    l.code_bytes = numel * std::uint64_t(dtype_bytes(dt));
  }
  l.meta_bytes = l.stats_bytes + l.group_bytes;
  l.total = l.header_bytes + l.meta_bytes + l.code_bytes;
  return l;
}

/// Why a blob (or a parameter set) is not acceptable; ok == 0.
enum class blob_status : std::uint32_t {
  ok = 0, truncated_header, bad_magic, bad_version, bad_ndim, bad_header_bytes, bad_checksum,
  bad_codec, bad_dtype, bad_codec_dtype, bad_bits, bad_group_size, bad_flags, bad_shape,
  bad_numel, bad_meta_bytes, bad_code_bytes, truncated, bad_group_meta, dst_too_small,
  bad_params, bad_stats, bad_codes,
  count_
};

/// Codec/variant/dtype/bits/group-size consistency, shared by the encoders' parameter checks and the decoders.
GACT_HD blob_status check_params(std::uint8_t codec, std::uint8_t variant, std::uint8_t dt, int bits, int group_size) {
  if (codec >= k_codec_count) return blob_status::bad_codec;
  if (dt >= k_dtype_count) return blob_status::bad_dtype;
  bool const b1248 = bits == 1 || bits == 2 || bits == 4 || bits == 8;
  switch (codec_id(codec)) {
    case codec_id::quant:
      if (variant > std::uint8_t(quant_mode::boundary)) return blob_status::bad_flags;
      if (!is_float_input(dt)) return blob_status::bad_codec_dtype;
      if (!b1248) return blob_status::bad_bits;
      if (variant == std::uint8_t(quant_mode::boundary) && bits < 2) return blob_status::bad_bits;
      if (group_size < k_min_group || group_size > k_max_group || (group_size & (group_size - 1)) != 0)
        return blob_status::bad_group_size;
      return blob_status::ok;
    case codec_id::mask:
      if (variant > std::uint8_t(mask_mode::predicate)) return blob_status::bad_flags;
      if (variant == std::uint8_t(mask_mode::bytes) && dt != std::uint8_t(dtype::boolean) &&
          dt != std::uint8_t(dtype::uint8))
        return blob_status::bad_codec_dtype;
      if (variant == std::uint8_t(mask_mode::predicate) && !is_float_input(dt)) return blob_status::bad_codec_dtype;
      break;
    case codec_id::window:
      if (variant != 0) return blob_status::bad_flags;
      if (dt != std::uint8_t(dtype::int64) && dt != std::uint8_t(dtype::int32)) return blob_status::bad_codec_dtype;
      if (!b1248) return blob_status::bad_bits;
      if (group_size != 0) return blob_status::bad_group_size;
      return blob_status::ok;
    case codec_id::raw:
      if (variant != 0) return blob_status::bad_flags;
      break;
  }
  if (bits != 0) return blob_status::bad_bits;
  if (group_size != 0) return blob_status::bad_group_size;
  return blob_status::ok;
}

/// FNV-1a 32 of the header's first 60 bytes and of the shape and parameters that follow it
/// (`extra` = 8 * ndim + params_bytes bytes from offset 64).
GACT_HD std::uint32_t header_checksum(unsigned char const* p, std::uint32_t extra) {
  std::uint32_t h = 0x811C9DC5u;
  for (int i = 0; i < 60; ++i) h = (h ^ p[i]) * 0x01000193u;
  for (std::uint32_t i = 64; i < 64 + extra; ++i) h = (h ^ p[i]) * 0x01000193u;
  return h;
}

GACT_HD bool finite_bits(float f) { return (float_bits(f) & 0x7f800000u) != 0x7f800000u; }

/// Validate the parameter block of a header whose codec, variant, dtype, bits and numel are already
/// checked. `pp` points at the block (params_bytes(codec, variant) readable bytes).
GACT_HD blob_status check_variant_params(std::uint8_t codec, std::uint8_t variant, int bits, std::uint64_t numel,
                                         unsigned char const* pp, std::uint64_t* count) {
  *count = 0;
  if (codec == std::uint8_t(codec_id::quant) && variant == std::uint8_t(quant_mode::normalized)) {
    normalized_params n;
    std::memcpy(&n, pp, sizeof n);
    std::uint64_t const most = numel > 0 ? numel : 1;
    if (n.count == 0 || n.count > most || n.inner == 0 || n.inner > most) return blob_status::bad_params;
    *count = n.count;
  } else if (codec == std::uint8_t(codec_id::quant) && variant == std::uint8_t(quant_mode::boundary)) {
    boundary_params b;
    std::memcpy(&b, pp, sizeof b);
    if (!finite_bits(b.lo) || b.has_hi > 1 || b.reserved != 0) return blob_status::bad_params;
    if (b.has_hi == 1 && !(finite_bits(b.hi) && b.hi > b.lo)) return blob_status::bad_params;
    if (b.has_hi == 0 && float_bits(b.hi) != 0) return blob_status::bad_params;
  } else if (codec == std::uint8_t(codec_id::mask) && variant == std::uint8_t(mask_mode::predicate)) {
    predicate_params q;
    std::memcpy(&q, pp, sizeof q);
    if (q.pred < 1 || q.pred > k_predicate_max) return blob_status::bad_params;
    if (!finite_bits(q.a) || !finite_bits(q.b) || !finite_bits(q.level)) return blob_status::bad_params;
    predicate const pr = predicate(q.pred);
    bool const two = pr == predicate::open || pr == predicate::closed;
    if (two && !(pr == predicate::open ? q.a < q.b : q.a <= q.b)) return blob_status::bad_params;
    if (!two && float_bits(q.b) != 0) return blob_status::bad_params;
    if (pr != predicate::ne && float_bits(q.level) != 0) return blob_status::bad_params;
    if (pr == predicate::ne && float_bits(q.a) != 0) return blob_status::bad_params;
  } else if (codec == std::uint8_t(codec_id::window)) {
    window_params w;
    std::memcpy(&w, pp, sizeof w);
    if (w.nd < 1 || w.nd > std::uint32_t(k_window_max_nd) || w.reserved != 0) return blob_status::bad_params;
    std::uint64_t const most = numel > 0 ? numel : 1;
    if (w.inner < 1 || std::uint64_t(w.inner) > most) return blob_status::bad_params;
    std::uint64_t in_plane = 1, out_plane = 1, kernel = 1;
    for (std::uint32_t d = 0; d < k_window_max_nd; ++d) {
      bool const used = d < w.nd;
      std::int64_t const lim = std::int64_t(1) << 20;  // per-dim extents far below overflow
      if (!used) {
        if (w.in[d] != 0 || w.out[d] != 0 || w.kernel[d] != 0 || w.stride[d] != 0 || w.pad[d] != 0 ||
            w.dilation[d] != 0)
          return blob_status::bad_params;
        continue;
      }
      if (w.in[d] < 1 || w.in[d] > lim || w.out[d] < 1 || w.out[d] > lim || w.kernel[d] < 1 || w.kernel[d] > 256 ||
          w.stride[d] < 1 || w.stride[d] > lim || w.pad[d] < 0 || w.pad[d] > lim || w.dilation[d] < 1 ||
          w.dilation[d] > lim)
        return blob_status::bad_params;
      in_plane *= std::uint64_t(w.in[d]);
      out_plane *= std::uint64_t(w.out[d]);
      kernel *= std::uint64_t(w.kernel[d]);
    }
    if (kernel > (std::uint64_t{1} << bits)) return blob_status::bad_params;
    if (in_plane > (std::uint64_t{1} << 62) || out_plane > most) return blob_status::bad_params;
    if (numel % out_plane != 0) return blob_status::bad_params;
  }
  return blob_status::ok;
}

/// Validate a blob of `len` readable bytes at `p`, reading nothing outside [p, p+len).
/// On ok, `*h` holds the header, `shape[0..ndim)` the shape, `*lay` the layout, `*params_off` the offset
/// of the variant's parameter block and `*count` the normalized statistics count (0 otherwise), and
/// lay->total <= len. Statistics and per-group metadata are checked by the decoders as they read them.
GACT_HD blob_status check_blob(unsigned char const* p, std::uint64_t len, blob_header* h, std::int64_t* shape,
                               blob_layout* lay, std::uint64_t* count) {
  if (len < sizeof(blob_header)) return blob_status::truncated_header;
  std::memcpy(h, p, sizeof(blob_header));
  if (h->magic != k_magic) return blob_status::bad_magic;
  if (h->version != k_format_version) return blob_status::bad_version;
  if (h->ndim > k_max_ndim) return blob_status::bad_ndim;
  if (h->codec >= k_codec_count) return blob_status::bad_codec;
  if ((h->flags & ~0xFFu) != 0) return blob_status::bad_flags;
  std::uint8_t const variant = std::uint8_t(h->flags & 0xFFu);
  if (variant > 2) return blob_status::bad_flags;
  std::uint32_t const pb = params_bytes(h->codec, variant);
  std::uint32_t const extra = 8u * h->ndim + pb;
  std::uint32_t const hb = std::uint32_t(align16(64u + extra));
  if (h->header_bytes != hb) return blob_status::bad_header_bytes;
  if (len < hb) return blob_status::truncated_header;
  if (header_checksum(p, extra) != h->checksum) return blob_status::bad_checksum;
  blob_status const ps = check_params(h->codec, variant, h->dtype, h->bits, h->group_size);
  if (ps != blob_status::ok) return ps;
  for (std::uint32_t i = 64u + extra; i < hb; ++i)
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
  blob_status const vs = check_variant_params(h->codec, variant, h->bits, h->numel, p + 64 + 8 * h->ndim, count);
  if (vs != blob_status::ok) return vs;
  *lay = compute_layout(h->codec, variant, h->dtype, h->ndim, h->numel, h->bits, h->group_size, *count);
  if (h->meta_bytes != lay->meta_bytes) return blob_status::bad_meta_bytes;
  if (h->code_bytes != lay->code_bytes) return blob_status::bad_code_bytes;
  if (lay->total > len) return blob_status::truncated;
  return blob_status::ok;
}

/// Fill the header, shape and parameter bytes of a blob (p must hold h.header_bytes bytes; `params`
/// holds params_bytes(codec, variant) bytes, or is null when there are none).
GACT_HD void write_header(unsigned char* p, blob_header h, std::int64_t const* shape, void const* params) {
  for (std::uint32_t i = 0; i < h.header_bytes; ++i) p[i] = 0;
  h.checksum = 0;
  std::memcpy(p, &h, sizeof h);
  for (int d = 0; d < h.ndim; ++d) std::memcpy(p + 64 + 8 * d, &shape[d], 8);
  std::uint32_t const pb = params_bytes(h.codec, std::uint8_t(h.flags & 0xFFu));
  if (pb != 0) std::memcpy(p + 64 + 8 * h.ndim, params, pb);
  h.checksum = header_checksum(p, 8u * h.ndim + pb);
  std::memcpy(p + 60, &h.checksum, 4);
}

}  // namespace hd
}  // namespace gact::codec
