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
#include "codecs/quant_math.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <mutex>
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
  std::atomic<std::uint64_t> nonfinite_groups_decoded{0};
  std::atomic<std::uint64_t> mask_rejections{0};
  std::atomic<std::uint64_t> corrupt_blobs{0};
};

counters& ctr() {
  static counters c;
  return c;
}

[[noreturn]] void fail_corrupt(hd::blob_status s) {
  ctr().corrupt_blobs.fetch_add(1, std::memory_order_relaxed);
  GACT_FAIL(std::string("corrupt blob: ") + status_name(s), ::gact::corrupt_blob);
}

/// Copy in parallel (raw codec); small copies stay on the calling thread.
void parallel_copy(void* dst, void const* src, std::size_t n, int threads) {
  int const t = detail::resolve_threads(threads, n, std::uint64_t{4} << 20);
  if (t <= 1) {
    if (n != 0) std::memcpy(dst, src, n);
    return;
  }
  std::vector<std::thread> pool;
  std::size_t const per = (n + std::size_t(t) - 1) / std::size_t(t);
  for (int i = 1; i < t; ++i) {
    std::size_t const b = std::size_t(i) * per, e = std::min(n, b + per);
    if (b < e)
      pool.emplace_back([=] { std::memcpy(static_cast<char*>(dst) + b, static_cast<char const*>(src) + b, e - b); });
  }
  std::memcpy(dst, src, std::min(n, per));
  for (auto& th : pool) th.join();
}

/// Pack bytes (0/1) into bits, element e at bit e%8 of byte e/8. Returns false if a value is > 1
/// (only when `strict`; otherwise any nonzero byte is a 1).
bool mask_pack(std::uint8_t const* in, std::uint64_t numel, std::uint8_t* out, bool strict) {
  std::uint64_t const full = numel / 8;
  unsigned over = 0;
  for (std::uint64_t m = 0; m < full; ++m) {
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

void mask_unpack(std::uint8_t const* in, std::uint64_t numel, std::uint8_t* out) {
  for (std::uint64_t e = 0; e < numel; ++e) out[e] = std::uint8_t((in[e / 8] >> (e % 8)) & 1u);
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
    case S::bad_bits: return "bad bits (quant: 1, 2, 4 or 8; others: 0)";
    case S::bad_group_size: return "bad group_size (quant: power of two in [64, 1024]; others: 0)";
    case S::bad_flags: return "nonzero reserved flags";
    case S::bad_shape: return "bad shape (negative dim or more than 2^56 elements)";
    case S::bad_numel: return "numel differs from the product of the shape";
    case S::bad_meta_bytes: return "meta_bytes differs from the layout";
    case S::bad_code_bytes: return "code_bytes differs from the layout";
    case S::truncated: return "truncated (blob length shorter than its sections)";
    case S::bad_group_meta: return "bad group metadata (min > max, or infinite)";
    case S::dst_too_small: return "destination too small";
    case S::count_: break;
  }
  return "unknown status";
}

namespace detail {

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
  bool const quant = p.codec == codec_id::quant;
  switch (hd::check_params(c, d, quant ? p.bits : 0, quant ? p.group_size : 0)) {
    case hd::blob_status::ok: break;
    case hd::blob_status::bad_codec_dtype:
      GACT_FAIL(std::string("codec ") + codec_name(p.codec) + " does not accept dtype " + dtype_name(dt) +
                (quant ? " (quant takes float32, float16, bfloat16)" : " (mask takes bool, uint8)"));
    case hd::blob_status::bad_bits:
      GACT_FAIL("bits: " + std::to_string(p.bits) + " is not one of 1, 2, 4, 8");
    case hd::blob_status::bad_group_size:
      GACT_FAIL("group_size: " + std::to_string(p.group_size) + " is not a power of two in [64, 1024]");
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
  blob_header h{};
  h.magic = k_magic;
  h.version = k_format_version;
  h.codec = c;
  h.dtype = d;
  h.ndim = std::uint8_t(shape.size());
  h.bits = std::uint8_t(quant ? p.bits : 0);
  h.group_size = std::uint16_t(quant ? p.group_size : 0);
  h.flags = 0;
  h.numel = numel;
  h.seed = p.seed;
  h.key = p.key;
  *lay = hd::compute_layout(c, d, h.ndim, numel, h.bits, h.group_size);
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
  hd::blob_status const s = hd::check_blob(p, len, &h, shape, &lay);
  if (s != hd::blob_status::ok) fail_corrupt(s);
  blob_info info{codec_id(h.codec), dtype(h.dtype), h.bits, h.group_size, h.seed, h.key, h.numel,
                 std::vector<std::int64_t>(shape, shape + h.ndim), std::size_t(lay.total), 0};
  if (info.codec == codec_id::quant) {
    unsigned char const* meta = p + lay.header_bytes;
    bool const f32 = info.dt == dtype::float32;
    for (std::uint64_t g = 0; g < lay.n_groups; ++g) {
      float lo, hi;
      if (f32) {
        std::memcpy(&lo, meta + 8 * g, 4);
        std::memcpy(&hi, meta + 8 * g + 4, 4);
      } else {
        std::uint16_t v[2];
        std::memcpy(v, meta + 4 * g, 4);
        bool const half = info.dt == dtype::float16;
        lo = half ? hd::half_to_float(v[0]) : hd::bf16_to_float(v[0]);
        hi = half ? hd::half_to_float(v[1]) : hd::bf16_to_float(v[1]);
      }
      if (!hd::meta_ok(lo, hi)) {
        ctr().corrupt_blobs.fetch_add(1, std::memory_order_relaxed);
        GACT_FAIL("corrupt blob: " + std::string(status_name(hd::blob_status::bad_group_meta)) + " in group " +
                      std::to_string(g),
                  ::gact::corrupt_blob);
      }
      if (lo != lo) ++info.nonfinite_groups;
    }
  }
  return info;
}

encode_result encode_cpu(void const* src, dtype dt, std::span<std::int64_t const> shape, encode_params const& p,
                         void* blob, std::size_t capacity, int threads) {
  detail::ensure_stats_registered();
  hd::blob_layout lay;
  blob_header const h = detail::make_header(dt, shape, p, &lay);
  GACT_EXPECTS(capacity >= lay.total, "encode: capacity " + std::to_string(capacity) + " < blob size " +
                                          std::to_string(lay.total));
  GACT_EXPECTS(blob != nullptr, "encode: blob is null");
  std::size_t const esize = dtype_size(dt);
  GACT_EXPECTS(h.numel == 0 || src != nullptr, "encode: src is null");
  GACT_EXPECTS(reinterpret_cast<std::uintptr_t>(src) % esize == 0,
               "encode: src is not aligned to its dtype's size (" + std::to_string(esize) + " bytes)");
  auto* out = static_cast<unsigned char*>(blob);
  unsigned char* meta = out + lay.header_bytes;
  unsigned char* codes = meta + lay.meta_bytes;
  std::uint64_t const in_bytes = h.numel * esize;
  switch (p.codec) {
    case codec_id::raw:
      parallel_copy(codes, src, std::size_t(in_bytes), threads);
      break;
    case codec_id::mask:
      if (!mask_pack(static_cast<std::uint8_t const*>(src), h.numel, codes, dt == dtype::uint8)) {
        ctr().mask_rejections.fetch_add(1, std::memory_order_relaxed);
        GACT_FAIL("mask: the uint8 tensor holds values other than 0 and 1; store it with codec raw");
      }
      break;
    case codec_id::quant: {
      std::uint64_t const used = lay.n_groups * 2 * esize;
      std::memset(meta + used, 0, std::size_t(lay.meta_bytes - used));  // the section's zero padding
      int const t = detail::resolve_threads(threads, lay.n_groups, 256);
      if (!detail::quant_encode_cpu(src, dt, h.numel, p.bits, p.group_size, p.seed, p.key, meta, codes, t)) {
        std::memset(out, 0, sizeof(std::uint32_t));  // no valid magic: the bytes are not a blob
        detail::count_nonfinite_refusal();
        GACT_WARN_CAPPED(4, "codecs: quant refused a tensor holding NaN/Inf (shape numel {}); store it raw",
                         h.numel);
        return {0, codec_id::quant, true};
      }
      break;
    }
  }
  std::int64_t sh[k_max_ndim] = {};
  std::copy(shape.begin(), shape.end(), sh);
  hd::write_header(out, h, sh);
  detail::count_encode(p.codec, in_bytes, lay.total);
  return {std::size_t(lay.total), p.codec, false};
}

void decode_cpu(void const* blob, std::size_t len, void* dst, std::size_t dst_bytes, int threads) {
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
  auto const* p = static_cast<unsigned char const*>(blob);
  hd::blob_layout const lay = hd::compute_layout(std::uint8_t(info.codec), std::uint8_t(info.dt),
                                                 int(info.shape.size()), info.numel, info.bits, info.group_size);
  unsigned char const* meta = p + lay.header_bytes;
  unsigned char const* codes = meta + lay.meta_bytes;
  switch (info.codec) {
    case codec_id::raw:
      parallel_copy(dst, codes, std::size_t(out_bytes), threads);
      break;
    case codec_id::mask:
      mask_unpack(codes, info.numel, static_cast<std::uint8_t*>(dst));
      break;
    case codec_id::quant: {
      int const t = detail::resolve_threads(threads, lay.n_groups, 256);
      detail::quant_decode_cpu(meta, codes, info.dt, info.numel, info.bits, info.group_size, dst, t);
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
  j["nonfinite_groups_decoded"] = rd(k.nonfinite_groups_decoded);
  j["mask_rejections"] = rd(k.mask_rejections);
  j["corrupt_blobs"] = rd(k.corrupt_blobs);
  j["cpu_executor_isa"] = detail::quant_cpu_isa();
  return j;
}

}  // namespace gact::codec
