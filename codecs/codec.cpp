// gact/codecs/codec.cpp
//
// The host side of the codecs: parameter checks, blob_size, parse, the CPU
// executor's entry points (raw and mask are here; quant's loops are in
// quant_cpu.cpp), and the "codecs" statistics section. Everything that reads
// a blob goes through hd::check_blob (format.hpp) first, so a corrupt or
// truncated blob becomes gact::corrupt_blob before any section is read.
#include "codecs/codec.hpp"

#include "allocator/error.hpp"
#include "allocator/log.hpp"
#if defined(GACT_CODECS_STATS_REGISTRY)
#include "allocator/stats_registry.hpp"
#endif
#include "codecs/float16.hpp"
#include "codecs/mask_math.hpp"
#include "codecs/quant_math.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstring>
#include <type_traits>
#include <mutex>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <string>
#include <thread>

static_assert(std::endian::native == std::endian::little, "the blob format is little-endian");

namespace gact::codec {
namespace {

struct counters {
  std::atomic<std::uint64_t> encodes[k_codec_count]{};
  std::atomic<std::uint64_t> encode_bytes_in[k_codec_count]{};
  std::atomic<std::uint64_t> encode_bytes_out[k_codec_count]{};
  std::atomic<std::uint64_t> decodes[k_codec_count]{};
  std::atomic<std::uint64_t> decode_bytes_out[k_codec_count]{};
  std::atomic<std::uint64_t> nonfinite_refusals{0};
  std::atomic<std::uint64_t> refusals{0};
  std::atomic<std::uint64_t> nonfinite_groups_decoded{0};
  std::atomic<std::uint64_t> mask_rejections{0};
  std::atomic<std::uint64_t> corrupt_blobs{0};
  std::atomic<std::uint64_t> thread_fallbacks{0};  // CPU runs whose worker threads could not all start
  std::atomic<std::uint64_t> gpu_decodes{0};  // decode_cuda launches (the codec is known on the device only)
  std::atomic<std::uint64_t> gpu_decode_bytes_out{0};
};

counters& ctr() {
  static counters c;
  return c;
}

[[noreturn]] void fail_corrupt(hd::blob_status s, std::string const& where = {}) {
  ctr().corrupt_blobs.fetch_add(1, std::memory_order_relaxed);
  GACT_FAIL(std::string("corrupt blob: ") + status_name(s) + where, ::gact::corrupt_blob);
}

/// Copy in parallel (raw codec); small copies stay on the calling thread.
void parallel_copy(void* dst, void const* src, std::size_t n, int threads) {
  int const t = detail::resolve_threads(threads, n, std::uint64_t{4} << 20);
  if (t <= 1) {
    if (n != 0) std::memcpy(dst, src, n);
    return;
  }
  struct ctx_t {
    char* d;
    char const* s;
    std::size_t n;
  } ctx{static_cast<char*>(dst), static_cast<char const*>(src), n};
  // Split into 64 KiB-aligned slices, one contiguous range of slices per thread.
  std::uint64_t const slices = (n + 65535) / 65536;
  detail::parallel_for(slices, t, [](void* c, std::uint64_t a, std::uint64_t b) {
    auto* x = static_cast<ctx_t*>(c);
    std::size_t const lo = std::size_t(a) * 65536, hi = std::min(x->n, std::size_t(b) * 65536);
    if (lo < hi) std::memcpy(x->d + lo, x->s + lo, hi - lo);
  }, &ctx);
}

/// Pack bytes (0/1) into bits, element e at bit e%8 of byte e/8. Returns false if a value is > 1
/// (only when `strict`; otherwise any nonzero byte is a 1). 16 bytes at a time where SSE2 is the
/// baseline (x86-64): a compare with zero and a movemask give two bytes of bits.
bool mask_pack(std::uint8_t const* in, std::uint64_t numel, std::uint8_t* out, bool strict) {
  std::uint64_t const full = numel / 8;
  unsigned over = 0;
  std::uint64_t m = 0;
#if defined(__SSE2__)
  __m128i const zero = _mm_setzero_si128();
  __m128i any = zero;
  for (; m + 2 <= full; m += 2) {
    __m128i const x = _mm_loadu_si128(reinterpret_cast<__m128i const*>(in + 8 * m));
    any = _mm_or_si128(any, x);
    unsigned const nonzero = ~unsigned(_mm_movemask_epi8(_mm_cmpeq_epi8(x, zero)));  // bit i: byte i != 0
    out[m] = std::uint8_t(nonzero);
    out[m + 1] = std::uint8_t(nonzero >> 8);
  }
  alignas(16) std::uint8_t lanes[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), any);
  for (std::uint8_t b : lanes) over |= b;
#endif
  for (; m < full; ++m) {
    unsigned v = 0;
    for (int j = 0; j < 8; ++j) {
      unsigned const b = in[8 * m + std::uint64_t(j)];
      over |= b;
      v |= unsigned(b != 0) << j;
    }
    out[m] = std::uint8_t(v);
  }
  if (numel % 8 != 0) {
    unsigned v = 0;
    for (std::uint64_t e = full * 8; e < numel; ++e) {
      unsigned const b = in[e];
      over |= b;
      v |= unsigned(b != 0) << (e % 8);
    }
    out[full] = std::uint8_t(v);
  }
  return !strict || (over & ~1u) == 0;
}

/// The 8 bytes (0/1) of each byte of bits: a table of 2 KiB, so unpacking is a load and a store
/// per 8 elements.
constexpr auto k_unpack_table = [] {
  std::array<std::array<std::uint8_t, 8>, 256> t{};
  for (unsigned v = 0; v < 256; ++v)
    for (unsigned j = 0; j < 8; ++j) t[v][j] = std::uint8_t((v >> j) & 1u);
  return t;
}();

void mask_unpack(std::uint8_t const* in, std::uint64_t numel, std::uint8_t* out) {
  std::uint64_t const full = numel / 8;
  for (std::uint64_t m = 0; m < full; ++m) std::memcpy(out + 8 * m, k_unpack_table[in[m]].data(), 8);
  for (std::uint64_t e = full * 8; e < numel; ++e) out[e] = std::uint8_t((in[e / 8] >> (e % 8)) & 1u);
}

// ---- float element access (predicate masks) ------------------------------------------------

template <dtype Dt>
struct fio;
template <>
struct fio<dtype::float32> {
  using S = float;
  static float load(S v) { return v; }
  static S store(float v) { return v; }
};
template <>
struct fio<dtype::float16> {
  using S = std::uint16_t;
  static float load(S v) { return hd::half_to_float(v); }
  static S store(float v) { return hd::float_to_half(v); }
};
template <>
struct fio<dtype::bfloat16> {
  using S = std::uint16_t;
  static float load(S v) { return hd::bf16_to_float(v); }
  static S store(float v) { return hd::float_to_bf16(v); }
};
template <>
struct fio<dtype::float64> {
  using S = double;
  static float load(S v) { return float(v); }
  static S store(float v) { return double(v); }
};

template <typename F>
decltype(auto) with_float_dtype(dtype dt, F&& f) {
  switch (dt) {
    case dtype::float16: return f(fio<dtype::float16>{});
    case dtype::bfloat16: return f(fio<dtype::bfloat16>{});
    case dtype::float64: return f(fio<dtype::float64>{});
    default: return f(fio<dtype::float32>{});
  }
}

void predicate_decode(unsigned char const* codes, dtype dt, std::uint64_t numel, float tv, float fv, void* dst,
                      int threads) {
  int const t = detail::resolve_threads(threads, numel, 1u << 18);
  struct ctx_t {
    unsigned char const* codes;
    dtype dt;
    std::uint64_t numel;
    float tv, fv;
    void* dst;
  } ctx{codes, dt, numel, tv, fv, dst};
  std::uint64_t const chunks = (numel + 4095) / 4096;
  detail::parallel_for(chunks, t, [](void* c, std::uint64_t a, std::uint64_t b) {
    auto* x = static_cast<ctx_t*>(c);
    with_float_dtype(x->dt, [&](auto io) {
      using IO = decltype(io);
      using S = typename IO::S;
      // The values as bit patterns, selected with masks (no branch, no float arithmetic): a byte of
      // codes at a time, 8 fixed lanes, which the compiler vectorizes.
      using U = std::conditional_t<sizeof(S) == 2, std::uint16_t, std::conditional_t<sizeof(S) == 4, std::uint32_t,
                                                                                     std::uint64_t>>;
      S const t1 = IO::store(x->tv), f1 = IO::store(x->fv);
      U tb, fb;
      std::memcpy(&tb, &t1, sizeof tb);
      std::memcpy(&fb, &f1, sizeof fb);
      auto* out = static_cast<U*>(x->dst);  // S and U share size and alignment
      std::uint64_t const e0 = a * 4096, e1 = std::min(x->numel, b * 4096);
      std::uint64_t const full_end = e0 + ((e1 - e0) & ~std::uint64_t(7));
      for (std::uint64_t e = e0; e < full_end; e += 8) {
        unsigned const v = x->codes[e / 8];
        for (int j = 0; j < 8; ++j) {
          U const m = U(U(0) - U((v >> j) & 1u));
          out[e + std::uint64_t(j)] = U((tb & m) | (fb & U(~m)));
        }
      }
      for (std::uint64_t e = full_end; e < e1; ++e) out[e] = ((x->codes[e / 8] >> (e % 8)) & 1u) ? tb : fb;
    });
  }, &ctx);
}

// ---- window codec --------------------------------------------------------------------------

template <typename I>
bool window_encode_all(I const* in, window_params const& w, std::uint64_t numel, int bits, std::uint8_t* codes) {
  hd::window_geometry const g = hd::make_window_geometry(w);
  std::uint64_t const nchunks = (numel + 7) / 8;
  for (std::uint64_t c = 0; c < nchunks; ++c) {
    std::uint64_t word = 0;
    for (int j = 0; j < 8; ++j) {
      std::uint64_t const e = 8 * c + std::uint64_t(j);
      if (e >= numel) break;
      std::int64_t o[k_window_max_nd];
      hd::window_out_coords(g, e, o);
      std::int64_t const code = hd::window_encode(g, o, std::int64_t(in[e]));
      if (code < 0) return false;
      word |= std::uint64_t(code) << (j * bits);
    }
    for (int b = 0; b < bits; ++b) codes[c * std::uint64_t(bits) + std::uint64_t(b)] = std::uint8_t(word >> (8 * b));
  }
  return true;
}

template <typename I>
std::uint64_t window_decode_all(unsigned char const* codes, window_params const& w, std::uint64_t numel, int bits,
                                I* out) {
  hd::window_geometry const g = hd::make_window_geometry(w);
  std::uint64_t const mask = (std::uint64_t{1} << bits) - 1;
  std::uint64_t const nchunks = (numel + 7) / 8;
  for (std::uint64_t c = 0; c < nchunks; ++c) {
    std::uint64_t word = 0;
    for (int b = 0; b < bits; ++b) word |= std::uint64_t(codes[c * std::uint64_t(bits) + std::uint64_t(b)]) << (8 * b);
    for (int j = 0; j < 8; ++j) {
      std::uint64_t const e = 8 * c + std::uint64_t(j);
      if (e >= numel) break;
      std::int64_t o[k_window_max_nd];
      hd::window_out_coords(g, e, o);
      std::int64_t const idx = hd::window_decode(g, o, std::int64_t((word >> (j * bits)) & mask));
      if (idx < 0) return e + 1;  // 1-based position of the first impossible code
      out[e] = I(idx);
    }
  }
  return 0;
}

/// Read the metadata value v (0 = min, 1 = max) of group g.
float meta_value(unsigned char const* meta, dtype dt, std::uint8_t variant, std::uint64_t g, int v) {
  if (hd::meta_value_bytes(std::uint8_t(dt), variant) == 4) {
    float f;
    std::memcpy(&f, meta + 8 * g + 4 * std::uint64_t(v), 4);
    return f;
  }
  std::uint16_t h;
  std::memcpy(&h, meta + 4 * g + 2 * std::uint64_t(v), 2);
  return dt == dtype::float16 ? hd::half_to_float(h) : hd::bf16_to_float(h);
}

std::uint8_t variant_of(encode_params const& p) {
  return p.codec == codec_id::quant || p.codec == codec_id::mask ? p.variant : std::uint8_t{0};
}

}  // namespace

std::size_t dtype_size(dtype dt) noexcept { return std::size_t(hd::dtype_bytes(std::uint8_t(dt))); }

char const* dtype_name(dtype dt) noexcept {
  switch (dt) {
    case dtype::float32: return "float32";
    case dtype::float16: return "float16";
    case dtype::bfloat16: return "bfloat16";
    case dtype::uint8: return "uint8";
    case dtype::boolean: return "bool";
    case dtype::int8: return "int8";
    case dtype::int16: return "int16";
    case dtype::int32: return "int32";
    case dtype::int64: return "int64";
    case dtype::float64: return "float64";
  }
  return "invalid";
}

char const* codec_name(codec_id c) noexcept {
  switch (c) {
    case codec_id::raw: return "raw";
    case codec_id::quant: return "quant";
    case codec_id::mask: return "mask";
    case codec_id::window: return "window";
  }
  return "invalid";
}

char const* variant_name(codec_id c, std::uint8_t variant) noexcept {
  if (c == codec_id::quant) {
    switch (quant_mode(variant)) {
      case quant_mode::plain: return "plain";
      case quant_mode::normalized: return "normalized";
      case quant_mode::boundary: return "boundary";
    }
    return "invalid";
  }
  if (c == codec_id::mask) {
    switch (mask_mode(variant)) {
      case mask_mode::bytes: return "bytes";
      case mask_mode::predicate: return "predicate";
    }
    return "invalid";
  }
  return variant == 0 ? "" : "invalid";
}

char const* predicate_name(predicate p) noexcept {
  switch (p) {
    case predicate::gt: return "gt";
    case predicate::ge: return "ge";
    case predicate::lt: return "lt";
    case predicate::le: return "le";
    case predicate::open: return "open";
    case predicate::closed: return "closed";
    case predicate::ne: return "ne";
    case predicate::gt_or_nan: return "gt_or_nan";
  }
  return "invalid";
}

char const* refusal_name(refusal r) noexcept {
  switch (r) {
    case refusal::none: return "none";
    case refusal::nonfinite: return "nonfinite";
    case refusal::out_of_range: return "out_of_range";
    case refusal::not_two_level: return "not_two_level";
    case refusal::not_window: return "not_window";
    case refusal::float64_range: return "float64_range";
    case refusal::wide: return "wide";
  }
  return "invalid";
}

char const* status_name(hd::blob_status s) noexcept {
  using S = hd::blob_status;
  switch (s) {
    case S::ok: return "ok";
    case S::truncated_header: return "truncated header (length shorter than the header)";
    case S::bad_magic: return "bad magic (not a gact blob)";
    case S::bad_version: return "unsupported format version";
    case S::bad_ndim: return "bad ndim (more than 8 dims)";
    case S::bad_header_bytes: return "bad header_bytes or nonzero header padding";
    case S::bad_checksum: return "header checksum mismatch";
    case S::bad_codec: return "unknown codec";
    case S::bad_dtype: return "unknown dtype";
    case S::bad_codec_dtype: return "codec does not accept this dtype";
    case S::bad_bits: return "bad bits (quant and window: 1, 2, 4 or 8, boundary quant at least 2; others: 0)";
    case S::bad_group_size: return "bad group_size (quant: power of two in [64, 1024]; others: 0)";
    case S::bad_flags: return "bad flags (unknown variant or nonzero reserved bits)";
    case S::bad_shape: return "bad shape (negative dim or more than 2^56 elements)";
    case S::bad_numel: return "numel differs from the product of the shape";
    case S::bad_meta_bytes: return "meta_bytes differs from the layout";
    case S::bad_code_bytes: return "code_bytes differs from the layout";
    case S::truncated: return "truncated (blob length shorter than its sections)";
    case S::bad_group_meta: return "bad group metadata (min > max, or infinite)";
    case S::dst_too_small: return "destination too small";
    case S::bad_params: return "bad variant parameters";
    case S::bad_stats: return "bad normalization statistics (non-finite shift, or scale not finite and positive)";
    case S::bad_codes: return "impossible code (a window offset outside the input plane)";
    case S::count_: break;
  }
  return "unknown status";
}

namespace detail {

/// The parameter block of a header for encode parameters `p` (params_bytes(codec, variant) bytes).
void fill_params(encode_params const& p, std::uint8_t variant, unsigned char* out) {
  if (p.codec == codec_id::quant && variant == std::uint8_t(quant_mode::normalized)) {
    normalized_params const n{p.norm_count, p.norm_inner};
    std::memcpy(out, &n, sizeof n);
  } else if (p.codec == codec_id::quant && variant == std::uint8_t(quant_mode::boundary)) {
    boundary_params b = p.boundary;
    if (b.has_hi == 0) b.hi = 0.0f;
    b.reserved = 0;
    std::memcpy(out, &b, sizeof b);
  } else if (p.codec == codec_id::mask && variant == std::uint8_t(mask_mode::predicate)) {
    predicate_params q = p.pred;
    predicate const pr = predicate(q.pred);
    if (pr != predicate::open && pr != predicate::closed) q.b = 0.0f;
    if (pr == predicate::ne) q.a = 0.0f;
    q.level = 0.0f;  // the encoder fills in ne's level
    std::memcpy(out, &q, sizeof q);
  } else if (p.codec == codec_id::window) {
    window_params w = p.window;
    w.reserved = 0;
    for (std::uint32_t d = w.nd; d < std::uint32_t(k_window_max_nd) && w.nd <= std::uint32_t(k_window_max_nd); ++d)
      w.in[d] = w.out[d] = w.kernel[d] = w.stride[d] = w.pad[d] = w.dilation[d] = 0;
    std::memcpy(out, &w, sizeof w);
  }
}


void count_gpu_decode(std::uint64_t out_bytes) noexcept {
  auto& k = ctr();
  k.gpu_decodes.fetch_add(1, std::memory_order_relaxed);
  k.gpu_decode_bytes_out.fetch_add(out_bytes, std::memory_order_relaxed);
}

void count_thread_fallback() noexcept { ctr().thread_fallbacks.fetch_add(1, std::memory_order_relaxed); }

void count_encode(codec_id c, std::uint64_t in_bytes, std::uint64_t out_bytes) noexcept {
  auto& k = ctr();
  k.encodes[int(c)].fetch_add(1, std::memory_order_relaxed);
  k.encode_bytes_in[int(c)].fetch_add(in_bytes, std::memory_order_relaxed);
  k.encode_bytes_out[int(c)].fetch_add(out_bytes, std::memory_order_relaxed);
}

void count_decode(codec_id c, std::uint64_t out_bytes, std::uint64_t nonfinite_groups) noexcept {
  auto& k = ctr();
  k.decodes[int(c)].fetch_add(1, std::memory_order_relaxed);
  k.decode_bytes_out[int(c)].fetch_add(out_bytes, std::memory_order_relaxed);
  k.nonfinite_groups_decoded.fetch_add(nonfinite_groups, std::memory_order_relaxed);
}

void count_nonfinite_refusal() noexcept { ctr().nonfinite_refusals.fetch_add(1, std::memory_order_relaxed); }

void ensure_stats_registered() noexcept {
  static std::once_flag once;
  std::call_once(once, [] {
#if defined(GACT_CODECS_STATS_REGISTRY)
    try {
      stats::register_provider("codecs", [] { return stats_json(); });
    } catch (std::exception const& e) {
      GACT_WARN_CAPPED(1, "codecs: could not register the stats provider: {}", e.what());
    }
#endif
  });
}

int resolve_threads(int threads, std::uint64_t work_items, std::uint64_t min_items_per_thread) noexcept {
  int t = threads > 0 ? threads : int(std::max(1u, std::thread::hardware_concurrency()));
  std::uint64_t const cap = std::max<std::uint64_t>(1, work_items / std::max<std::uint64_t>(1, min_items_per_thread));
  if (std::uint64_t(t) > cap) t = int(cap);
  return std::max(1, std::min(t, 256));
}

blob_header make_header(dtype dt, std::span<std::int64_t const> shape, encode_params const& p,
                            hd::blob_layout* lay) {
  std::uint8_t const c = std::uint8_t(p.codec), d = std::uint8_t(dt);
  GACT_EXPECTS(c < k_codec_count, "codec: unknown codec id " + std::to_string(int(c)));
  GACT_EXPECTS(d < k_dtype_count, "dtype: unknown dtype id " + std::to_string(int(d)));
  bool const quant = p.codec == codec_id::quant, window = p.codec == codec_id::window;
  std::uint8_t const variant = variant_of(p);
  int const bits = quant || window ? p.bits : 0;
  int const gsize = quant ? p.group_size : 0;
  switch (hd::check_params(c, variant, d, bits, gsize)) {
    case hd::blob_status::ok: break;
    case hd::blob_status::bad_codec_dtype:
      GACT_FAIL(std::string("codec ") + codec_name(p.codec) + (p.codec == codec_id::mask ? std::string("/") +
                variant_name(p.codec, variant) : std::string()) + " does not accept dtype " + dtype_name(dt) +
                (quant ? " (quant takes float32, float16, bfloat16, float64)"
                 : window ? " (window takes int64, int32)"
                 : variant == 0 ? " (mask takes bool, uint8)" : " (a predicate mask takes float32, float16, bfloat16, float64)"));
    case hd::blob_status::bad_bits:
      GACT_FAIL("bits: " + std::to_string(p.bits) + " is not one of 1, 2, 4, 8" +
                (quant && variant == std::uint8_t(quant_mode::boundary) ? " (boundary quant needs at least 2)" : ""));
    case hd::blob_status::bad_group_size:
      GACT_FAIL("group_size: " + std::to_string(p.group_size) + " is not a power of two in [64, 1024]");
    case hd::blob_status::bad_flags:
      GACT_FAIL("variant: " + std::to_string(int(variant)) + " is not a variant of codec " + codec_name(p.codec));
    default:
      GACT_FAIL("bad codec parameters");
  }
  GACT_EXPECTS(shape.size() <= std::size_t(k_max_ndim),
               "shape: " + std::to_string(shape.size()) + " dims, at most 8 are supported");
  std::uint64_t numel = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    std::int64_t const s = shape[i];
    GACT_EXPECTS(s >= 0, "shape: dim " + std::to_string(i) + " is negative (" + std::to_string(s) + ")");
    GACT_EXPECTS(s == 0 || numel <= k_max_numel / std::uint64_t(s), "shape: more than 2^56 elements");
    numel *= std::uint64_t(s);
  }
  unsigned char params[160] = {};
  detail::fill_params(p, variant, params);
  std::uint64_t count = 0;
  switch (hd::check_variant_params(c, variant, bits, numel, params, &count)) {
    case hd::blob_status::ok: break;
    default:
      if (quant && variant == std::uint8_t(quant_mode::normalized))
        GACT_FAIL("normalized quant: count " + std::to_string(p.norm_count) + " and inner " +
                  std::to_string(p.norm_inner) + " must be in [1, max(numel, 1)] (numel " + std::to_string(numel) + ")");
      if (quant)
        GACT_FAIL("boundary quant: lo must be finite, and hi finite and > lo when has_hi (lo " +
                  std::to_string(p.boundary.lo) + ", hi " + std::to_string(p.boundary.hi) + ")");
      if (window)
        GACT_FAIL("window: bad pooling geometry (nd in [1, 3], extents in [1, 2^20], pad >= 0, kernel volume "
                  "<= 2^bits, the indices' numel a multiple of the output plane)");
      GACT_FAIL("predicate mask: unknown predicate " + std::to_string(p.pred.pred) +
                " or bounds not finite (open needs a < b, closed a <= b)");
  }
  if (quant && variant == std::uint8_t(quant_mode::normalized))
    GACT_EXPECTS(p.norm_shift != nullptr && p.norm_scale != nullptr, "normalized quant: shift and scale are null");
  blob_header h{};
  h.magic = k_magic;
  h.version = k_format_version;
  h.codec = c;
  h.dtype = d;
  h.ndim = std::uint8_t(shape.size());
  h.bits = std::uint8_t(bits);
  h.group_size = std::uint16_t(gsize);
  h.flags = variant;
  h.numel = numel;
  h.seed = p.seed;
  h.key = p.key;
  *lay = hd::compute_layout(c, variant, d, h.ndim, numel, h.bits, h.group_size, count);
  h.meta_bytes = lay->meta_bytes;
  h.code_bytes = lay->code_bytes;
  h.header_bytes = std::uint32_t(lay->header_bytes);
  return h;
}

}  // namespace detail

std::size_t blob_size(dtype dt, std::span<std::int64_t const> shape, encode_params const& p) {
  hd::blob_layout lay;
  (void)detail::make_header(dt, shape, p, &lay);
  return std::size_t(lay.total);
}

blob_info parse(void const* blob, std::size_t len) {
  if (blob == nullptr) fail_corrupt(hd::blob_status::truncated_header);
  auto const* p = static_cast<unsigned char const*>(blob);
  blob_header h;
  std::int64_t shape[k_max_ndim];
  hd::blob_layout lay;
  std::uint64_t count = 0;
  hd::blob_status const s = hd::check_blob(p, len, &h, shape, &lay, &count);
  if (s != hd::blob_status::ok) fail_corrupt(s);
  blob_info info{codec_id(h.codec), dtype(h.dtype), h.bits, h.group_size, h.seed, h.key, h.numel,
                 std::vector<std::int64_t>(shape, shape + h.ndim), std::size_t(lay.total), 0};
  info.variant = std::uint8_t(h.flags & 0xFFu);
  unsigned char const* params = p + 64 + 8 * h.ndim;
  if (info.codec == codec_id::quant && info.variant == std::uint8_t(quant_mode::normalized))
    std::memcpy(&info.normalized, params, sizeof info.normalized);
  if (info.codec == codec_id::quant && info.variant == std::uint8_t(quant_mode::boundary))
    std::memcpy(&info.boundary, params, sizeof info.boundary);
  if (info.codec == codec_id::mask && info.variant == std::uint8_t(mask_mode::predicate))
    std::memcpy(&info.pred, params, sizeof info.pred);
  if (info.codec == codec_id::window) std::memcpy(&info.window, params, sizeof info.window);
  if (info.codec == codec_id::quant) {
    unsigned char const* stats = p + lay.header_bytes;
    for (std::uint64_t b = 0; b < count; ++b) {
      float shift, scale;
      hd::load_stat(stats, b, shift, scale);
      if (!hd::stats_ok(shift, scale)) fail_corrupt(hd::blob_status::bad_stats, " in block " + std::to_string(b));
    }
    unsigned char const* meta = stats + lay.stats_bytes;
    bool const boundary = info.variant == std::uint8_t(quant_mode::boundary);
    for (std::uint64_t g = 0; g < lay.n_groups; ++g) {
      float const lo = meta_value(meta, info.dt, info.variant, g, 0), hi = meta_value(meta, info.dt, info.variant, g, 1);
      // A boundary group's interior lies inside [lo, hi] of the blob (or is the (lo, lo) placeholder).
      bool ok = hd::meta_ok(lo, hi);
      if (ok && boundary && lo == lo)
        ok = lo >= info.boundary.lo && (info.boundary.has_hi == 0 || hi <= info.boundary.hi);
      if (!ok) fail_corrupt(hd::blob_status::bad_group_meta, " in group " + std::to_string(g));
      if (lo != lo) ++info.nonfinite_groups;
    }
  }
  return info;
}

encode_result encode_cpu(void const* src, dtype dt, std::span<std::int64_t const> shape, encode_params const& p,
                         void* blob, std::size_t capacity, int threads) {
  detail::ensure_stats_registered();
  hd::blob_layout lay;
  blob_header h = detail::make_header(dt, shape, p, &lay);
  GACT_EXPECTS(capacity >= lay.total, "encode: capacity " + std::to_string(capacity) + " < blob size " +
                                          std::to_string(lay.total));
  GACT_EXPECTS(blob != nullptr, "encode: blob is null");
  std::size_t const esize = dtype_size(dt);
  GACT_EXPECTS(h.numel == 0 || src != nullptr, "encode: src is null");
  GACT_EXPECTS(reinterpret_cast<std::uintptr_t>(src) % esize == 0,
               "encode: src is not aligned to its dtype's size (" + std::to_string(esize) + " bytes)");
  auto* out = static_cast<unsigned char*>(blob);
  unsigned char* stats = out + lay.header_bytes;
  unsigned char* meta = stats + lay.stats_bytes;
  unsigned char* codes = out + lay.header_bytes + lay.meta_bytes;
  std::uint64_t const in_bytes = h.numel * esize;
  std::uint8_t const variant = std::uint8_t(h.flags);
  unsigned char params[160] = {};
  detail::fill_params(p, variant, params);
  encode_result res{std::size_t(lay.total), p.codec, false, refusal::none, false};
  auto refuse = [&](refusal r) {
    std::memset(out, 0, sizeof(std::uint32_t));  // no valid magic: the bytes are not a blob
    ctr().refusals.fetch_add(1, std::memory_order_relaxed);
    if (r == refusal::nonfinite) {
      detail::count_nonfinite_refusal();
      GACT_WARN_CAPPED(4, "codecs: quant refused a tensor holding NaN/Inf (numel {}); store it raw", h.numel);
    }
    return encode_result{0, p.codec, r == refusal::nonfinite, r, false};
  };
  switch (p.codec) {
    case codec_id::raw:
      parallel_copy(codes, src, std::size_t(in_bytes), threads);
      break;
    case codec_id::mask:
      if (variant == std::uint8_t(mask_mode::predicate)) {
        predicate_params q;
        std::memcpy(&q, params, sizeof q);
        int const t = detail::resolve_threads(threads, (h.numel + 7) / 8, 1u << 16);
        detail::mask_scan const sc = detail::mask_encode_cpu(src, dt, q, h.numel, codes, t);
        if (predicate(q.pred) == predicate::ne) {
          bool const two_level = !sc.have_nz || (sc.nz_finite && hd::float_bits(sc.nz_min) == hd::float_bits(sc.nz_max));
          if (!two_level) return refuse(refusal::not_two_level);
          q.level = sc.have_nz ? sc.nz_min : 0.0f;
          std::memcpy(params, &q, sizeof q);
        }
        res.in_range = sc.in_range;
      } else if (!mask_pack(static_cast<std::uint8_t const*>(src), h.numel, codes, dt == dtype::uint8)) {
        ctr().mask_rejections.fetch_add(1, std::memory_order_relaxed);
        GACT_FAIL("mask: the uint8 tensor holds values other than 0 and 1; store it with codec raw");
      }
      break;
    case codec_id::window: {
      window_params w;
      std::memcpy(&w, params, sizeof w);
      bool const ok = dt == dtype::int64
                          ? window_encode_all(static_cast<std::int64_t const*>(src), w, h.numel, h.bits, codes)
                          : window_encode_all(static_cast<std::int32_t const*>(src), w, h.numel, h.bits, codes);
      if (!ok) return refuse(refusal::not_window);
      break;
    }
    case codec_id::quant: {
      if (lay.stats_bytes != 0) {  // the statistics as the decoder will read them
        for (std::uint64_t b = 0; b < p.norm_count; ++b) {
          float const shift = hd::round_bf16(p.norm_shift[b]), scale = hd::round_bf16(p.norm_scale[b]);
          GACT_EXPECTS(hd::stats_ok(shift, scale),
                       "normalized quant: block " + std::to_string(b) + " has shift " + std::to_string(p.norm_shift[b]) +
                           " and scale " + std::to_string(p.norm_scale[b]) +
                           " (shift must be finite, scale finite and > 0 in bfloat16)");
          hd::store_stat(stats, b, shift, scale);
        }
        std::uint64_t const used = std::uint64_t(hd::k_stat_bytes) * p.norm_count;
        std::memset(stats + used, 0, std::size_t(lay.stats_bytes - used));
      }
      std::uint64_t const used = lay.n_groups * 2 * std::uint64_t(hd::meta_value_bytes(std::uint8_t(dt), variant));
      std::memset(meta + used, 0, std::size_t(lay.group_bytes - used));  // the section's zero padding
      detail::quant_job job{};
      job.dt = dt;
      job.variant = variant;
      job.numel = h.numel;
      job.bits = p.bits;
      job.group_size = p.group_size;
      job.seed = p.seed;
      job.max_magnitude = p.max_magnitude;
      job.key = p.key;
      job.count = p.norm_count;
      job.inner = p.norm_inner;
      job.stats = stats;
      std::memcpy(&job.boundary, params, variant == std::uint8_t(quant_mode::boundary) ? sizeof job.boundary : 0);
      job.meta = meta;
      job.codes = codes;
      int const t = detail::resolve_threads(threads, lay.n_groups, 256);
      refusal const r = detail::quant_encode_cpu(src, job, t);
      if (r != refusal::none) return refuse(r);
      break;
    }
  }
  std::int64_t sh[k_max_ndim] = {};
  std::copy(shape.begin(), shape.end(), sh);
  hd::write_header(out, h, sh, params);
  detail::count_encode(p.codec, in_bytes, lay.total);
  return res;
}

void decode_cpu(void const* blob, std::size_t len, void* dst, std::size_t dst_bytes, int threads,
                decode_params const& dp) {
  detail::ensure_stats_registered();
  blob_info const info = parse(blob, len);
  std::size_t const esize = dtype_size(info.dt);
  std::uint64_t const out_bytes = info.numel * esize;
  GACT_EXPECTS(dst_bytes >= out_bytes, "decode: dst_bytes " + std::to_string(dst_bytes) + " < " +
                                           std::to_string(out_bytes) + " needed for " +
                                           std::to_string(info.numel) + " x " + dtype_name(info.dt));
  GACT_EXPECTS(info.numel == 0 || dst != nullptr, "decode: dst is null");
  GACT_EXPECTS(reinterpret_cast<std::uintptr_t>(dst) % esize == 0,
               "decode: dst is not aligned to its dtype's size (" + std::to_string(esize) + " bytes)");
  bool const boundary = info.codec == codec_id::quant && info.variant == std::uint8_t(quant_mode::boundary);
  GACT_EXPECTS(!dp.predicate || boundary || info.codec == codec_id::mask,
               std::string("decode: a predicate was asked of a ") + codec_name(info.codec) + " blob (variant '" +
                   variant_name(info.codec, info.variant) + "'), which holds none");
  auto const* p = static_cast<unsigned char const*>(blob);
  hd::blob_layout const lay =
      hd::compute_layout(std::uint8_t(info.codec), info.variant, std::uint8_t(info.dt), int(info.shape.size()),
                         info.numel, info.bits, info.group_size, info.normalized.count);
  unsigned char const* stats = p + lay.header_bytes;
  unsigned char const* codes = p + lay.header_bytes + lay.meta_bytes;
  switch (info.codec) {
    case codec_id::raw:
      parallel_copy(dst, codes, std::size_t(out_bytes), threads);
      break;
    case codec_id::mask:
      if (info.variant == std::uint8_t(mask_mode::predicate)) {
        // A two-level (ne) mask decodes its true value to the stored level unless the caller asks for another.
        bool const ne = predicate(info.pred.pred) == predicate::ne;
        float const tv = ne && !dp.predicate ? info.pred.level : dp.true_value;
        predicate_decode(codes, info.dt, info.numel, tv, dp.false_value, dst, threads);
      } else {
        mask_unpack(codes, info.numel, static_cast<std::uint8_t*>(dst));
      }
      break;
    case codec_id::window: {
      std::uint64_t const bad =
          info.dt == dtype::int64
              ? window_decode_all(codes, info.window, info.numel, info.bits, static_cast<std::int64_t*>(dst))
              : window_decode_all(codes, info.window, info.numel, info.bits, static_cast<std::int32_t*>(dst));
      if (bad != 0) fail_corrupt(hd::blob_status::bad_codes, " at element " + std::to_string(bad - 1));
      break;
    }
    case codec_id::quant: {
      detail::quant_job job{};
      job.dt = info.dt;
      job.variant = info.variant;
      job.numel = info.numel;
      job.bits = info.bits;
      job.group_size = info.group_size;
      job.count = info.normalized.count;
      job.inner = info.normalized.inner;
      job.stats = stats;
      job.boundary = info.boundary;
      job.predicate = dp.predicate;
      job.true_value = dp.true_value;
      job.false_value = dp.false_value;
      job.meta = const_cast<unsigned char*>(stats + lay.stats_bytes);
      job.codes = const_cast<unsigned char*>(codes);
      int const t = detail::resolve_threads(threads, lay.n_groups, 256);
      detail::quant_decode_cpu(job, dst, t);
      if (info.nonfinite_groups != 0)
        GACT_WARN_CAPPED(4, "codecs: decoded {} group(s) marked non-finite by the GPU encoder as NaN",
                         info.nonfinite_groups);
      break;
    }
  }
  detail::count_decode(info.codec, out_bytes, info.nonfinite_groups);
}

nlohmann::json stats_json() {
  auto& k = ctr();
  auto rd = [](std::atomic<std::uint64_t> const& a) { return a.load(std::memory_order_relaxed); };
  nlohmann::json j;
  for (int c = 0; c < k_codec_count; ++c) {
    j[codec_name(codec_id(c))] = {
        {"encodes", rd(k.encodes[c])},
        {"encode_bytes_in", rd(k.encode_bytes_in[c])},
        {"encode_bytes_out", rd(k.encode_bytes_out[c])},
        {"decodes", rd(k.decodes[c])},
        {"decode_bytes_out", rd(k.decode_bytes_out[c])},
    };
  }
  j["nonfinite_refusals"] = rd(k.nonfinite_refusals);
  j["refusals"] = rd(k.refusals);
  j["nonfinite_groups_decoded"] = rd(k.nonfinite_groups_decoded);
  j["mask_rejections"] = rd(k.mask_rejections);
  j["corrupt_blobs"] = rd(k.corrupt_blobs);
  j["thread_fallbacks"] = rd(k.thread_fallbacks);
  j["gpu_decodes"] = rd(k.gpu_decodes);
  j["gpu_decode_bytes_out"] = rd(k.gpu_decode_bytes_out);
  j["cpu_executor_isa"] = detail::quant_cpu_isa();
  return j;
}

}  // namespace gact::codec
