// gact/codecs/quant_cpu.cpp
//
// The CPU executor of the quant codec. Work is split over threads by whole
// groups (contiguous ranges, one per thread); inside a group every step is a
// plain loop over a fixed-size stack buffer, written so that g++ vectorizes it
// (see codecs/README.md, "Vectorization"):
//
//   encode:  load (+ widen 16-bit input) -> min/max + finiteness over 8 lanes
//            -> Philox noise for the group (one call per 8 elements)
//            -> quantize (hd::quantize) -> pack b-bit codes into bytes
//   decode:  unpack codes -> hd::dequantize -> narrow to the dtype -> store
//
// All arithmetic on values is hd:: math from quant_math.hpp, shared with the
// CUDA kernels; this file only arranges loops and memory.
#include "codecs/codec.hpp"
#include "codecs/float16.hpp"
#include "codecs/philox.hpp"
#include "codecs/quant_math.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

namespace gact::codec::detail {
namespace {

using hd::group_params;

constexpr int k_buf = k_max_group;

/// Run fn(begin, end) over [0, n) split into `threads` contiguous ranges (the caller runs the first).
template <typename Fn>
void parallel_ranges(std::uint64_t n, int threads, Fn const& fn) {
  if (threads <= 1 || n < 2) {
    fn(std::uint64_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(std::size_t(threads - 1));
  std::uint64_t const per = n / std::uint64_t(threads), extra = n % std::uint64_t(threads);
  std::uint64_t begin = 0;
  std::uint64_t first_end = 0;
  for (int t = 0; t < threads; ++t) {
    std::uint64_t const end = begin + per + (std::uint64_t(t) < extra ? 1 : 0);
    if (t == 0) {
      first_end = end;
    } else {
      pool.emplace_back([&fn, begin, end] { fn(begin, end); });
    }
    begin = end;
  }
  fn(std::uint64_t{0}, first_end);
  for (auto& th : pool) th.join();
}

// ---- loads and stores by dtype --------------------------------------------------------------

template <dtype Dt>
struct io;
template <>
struct io<dtype::float32> {
  using storage = float;
  static float load(storage v) { return v; }
  static storage store(float v) { return v; }
};
template <>
struct io<dtype::float16> {
  using storage = std::uint16_t;
  static float load(storage v) { return hd::half_to_float(v); }
  static storage store(float v) { return hd::float_to_half(v); }
};
template <>
struct io<dtype::bfloat16> {
  using storage = std::uint16_t;
  static float load(storage v) { return hd::bf16_to_float(v); }
  static storage store(float v) { return hd::float_to_bf16(v); }
};

// ---- encode ---------------------------------------------------------------------------------

/// min/max over n >= 1 values, 8 independent lanes; returns false if any value is NaN/±Inf.
bool group_minmax(float const* x, int n, float& lo, float& hi) {
  float mn[8], mx[8];
  std::uint32_t bad[8];
  for (int j = 0; j < 8; ++j) {
    mn[j] = x[0];
    mx[j] = x[0];
    bad[j] = 0;
  }
  int const n8 = n & ~7;
  for (int i = 0; i < n8; i += 8) {
    for (int j = 0; j < 8; ++j) {
      float const v = x[i + j];
      mn[j] = v < mn[j] ? v : mn[j];
      mx[j] = v > mx[j] ? v : mx[j];
      bad[j] |= std::uint32_t((hd::float_bits(v) & 0x7F800000u) == 0x7F800000u);
    }
  }
  for (int i = n8; i < n; ++i) {
    float const v = x[i];
    mn[0] = v < mn[0] ? v : mn[0];
    mx[0] = v > mx[0] ? v : mx[0];
    bad[0] |= std::uint32_t((hd::float_bits(v) & 0x7F800000u) == 0x7F800000u);
  }
  float l = mn[0], h = mx[0];
  std::uint32_t b = bad[0];
  for (int j = 1; j < 8; ++j) {
    l = mn[j] < l ? mn[j] : l;
    h = mx[j] > h ? mx[j] : h;
    b |= bad[j];
  }
  lo = hd::canonical_zero(l);
  hi = hd::canonical_zero(h);
  return b == 0;
}

/// 16 noise bits for each of `nchunks` 8-element chunks starting at chunk index c0.
void group_noise(std::uint64_t seed, std::uint64_t key, std::uint64_t c0, int nchunks, std::uint16_t* r) {
  for (int k = 0; k < nchunks; ++k) {
    hd::philox_block const b = hd::noise_block(seed, key, c0 + std::uint64_t(k));
    for (int w = 0; w < 4; ++w) {
      r[8 * k + 2 * w] = std::uint16_t(b.v[w]);
      r[8 * k + 2 * w + 1] = std::uint16_t(b.v[w] >> 16);
    }
  }
}

void quantize_group(float const* x, std::uint16_t const* r, int n, group_params const& p, std::uint8_t* q) {
  for (int i = 0; i < n; ++i) q[i] = std::uint8_t(hd::quantize(x[i], p, r[i]));
}

/// Pack codes q[0, 8*nchunks) (zero past the group's end) into nchunks*Bits bytes, element e at bit e*Bits.
template <int Bits>
void pack_codes(std::uint8_t const* q, int nchunks, std::uint8_t* out) {
  constexpr int per = 8 / Bits;
  int const nbytes = nchunks * Bits;
  for (int m = 0; m < nbytes; ++m) {
    unsigned v = 0;
    for (int j = 0; j < per; ++j) v |= unsigned(q[m * per + j]) << (j * Bits);
    out[m] = std::uint8_t(v);
  }
}

template <int Bits>
void unpack_codes(std::uint8_t const* in, int nchunks, std::uint8_t* q) {
  constexpr int per = 8 / Bits;
  constexpr unsigned mask = (1u << Bits) - 1u;
  int const nbytes = nchunks * Bits;
  for (int m = 0; m < nbytes; ++m) {
    unsigned const v = in[m];
    for (int j = 0; j < per; ++j) q[m * per + j] = std::uint8_t((v >> (j * Bits)) & mask);
  }
}

template <dtype Dt>
void store_meta(unsigned char* meta, std::uint64_t g, float lo, float hi) {
  using S = typename io<Dt>::storage;
  S const v[2] = {io<Dt>::store(lo), io<Dt>::store(hi)};
  std::memcpy(meta + g * sizeof v, v, sizeof v);
}

template <dtype Dt>
void load_meta(unsigned char const* meta, std::uint64_t g, float& lo, float& hi) {
  using S = typename io<Dt>::storage;
  S v[2];
  std::memcpy(v, meta + g * sizeof v, sizeof v);
  lo = io<Dt>::load(v[0]);
  hi = io<Dt>::load(v[1]);
}

template <dtype Dt, int Bits>
bool encode_groups(void const* src, std::uint64_t numel, int G, std::uint64_t seed, std::uint64_t key,
                   unsigned char* meta, unsigned char* codes, std::uint64_t g0, std::uint64_t g1,
                   std::atomic<bool>& failed) {
  using S = typename io<Dt>::storage;
  alignas(64) float xbuf[k_buf];
  alignas(64) std::uint16_t r[k_buf];
  alignas(64) std::uint8_t q[k_buf];
  S const* in = static_cast<S const*>(src);
  for (std::uint64_t g = g0; g < g1; ++g) {
    if ((g & 63) == 0 && failed.load(std::memory_order_relaxed)) return false;
    std::uint64_t const e0 = g * std::uint64_t(G);
    int const n = int(std::min<std::uint64_t>(std::uint64_t(G), numel - e0));
    int const nchunks = (n + 7) / 8;
    float const* x;
    if constexpr (Dt == dtype::float32) {
      x = in + e0;
    } else {
      for (int i = 0; i < n; ++i) xbuf[i] = io<Dt>::load(in[e0 + std::uint64_t(i)]);
      x = xbuf;
    }
    float lo, hi;
    if (!group_minmax(x, n, lo, hi)) {
      failed.store(true, std::memory_order_relaxed);
      return false;
    }
    store_meta<Dt>(meta, g, lo, hi);
    group_params const p = hd::make_params(lo, hi, Bits);
    std::uint8_t* out = codes + (e0 / 8) * std::uint64_t(Bits);
    if (p.step > 0.0f) {
      group_noise(seed, key, e0 / 8, nchunks, r);
      quantize_group(x, r, n, p, q);
      for (int i = n; i < nchunks * 8; ++i) q[i] = 0;
      pack_codes<Bits>(q, nchunks, out);
    } else {
      std::memset(out, 0, std::size_t(nchunks) * Bits);  // constant group: every code is 0
    }
  }
  return true;
}

template <dtype Dt, int Bits>
void decode_groups(unsigned char const* meta, unsigned char const* codes, std::uint64_t numel, int G,
                   void* dst, std::uint64_t g0, std::uint64_t g1) {
  using S = typename io<Dt>::storage;
  alignas(64) std::uint8_t q[k_buf];
  S* out = static_cast<S*>(dst);
  for (std::uint64_t g = g0; g < g1; ++g) {
    std::uint64_t const e0 = g * std::uint64_t(G);
    int const n = int(std::min<std::uint64_t>(std::uint64_t(G), numel - e0));
    int const nchunks = (n + 7) / 8;
    float lo, hi;
    load_meta<Dt>(meta, g, lo, hi);
    group_params const p = hd::make_params(lo, hi, Bits);
    unpack_codes<Bits>(codes + (e0 / 8) * std::uint64_t(Bits), nchunks, q);
    S* o = out + e0;
    for (int i = 0; i < n; ++i) o[i] = io<Dt>::store(hd::dequantize(q[i], p));
  }
}

template <dtype Dt>
bool encode_dt(void const* src, std::uint64_t numel, int bits, int G, std::uint64_t seed, std::uint64_t key,
               unsigned char* meta, unsigned char* codes, int threads) {
  std::uint64_t const n_groups = (numel + std::uint64_t(G) - 1) / std::uint64_t(G);
  std::atomic<bool> failed{false};
  auto run = [&](auto bits_tag) {
    constexpr int B = decltype(bits_tag)::value;
    parallel_ranges(n_groups, threads, [&](std::uint64_t a, std::uint64_t b) {
      encode_groups<Dt, B>(src, numel, G, seed, key, meta, codes, a, b, failed);
    });
  };
  switch (bits) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    default: run(std::integral_constant<int, 8>{}); break;
  }
  return !failed.load();
}

template <dtype Dt>
void decode_dt(unsigned char const* meta, unsigned char const* codes, std::uint64_t numel, int bits, int G,
               void* dst, int threads) {
  std::uint64_t const n_groups = (numel + std::uint64_t(G) - 1) / std::uint64_t(G);
  auto run = [&](auto bits_tag) {
    constexpr int B = decltype(bits_tag)::value;
    parallel_ranges(n_groups, threads, [&](std::uint64_t a, std::uint64_t b) {
      decode_groups<Dt, B>(meta, codes, numel, G, dst, a, b);
    });
  };
  switch (bits) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    default: run(std::integral_constant<int, 8>{}); break;
  }
}

}  // namespace

bool quant_encode_cpu(void const* src, dtype dt, std::uint64_t numel, int bits, int group_size,
                      std::uint64_t seed, std::uint64_t key, unsigned char* meta, unsigned char* codes,
                      int threads) {
  if (numel == 0) return true;
  switch (dt) {
    case dtype::float32: return encode_dt<dtype::float32>(src, numel, bits, group_size, seed, key, meta, codes, threads);
    case dtype::float16: return encode_dt<dtype::float16>(src, numel, bits, group_size, seed, key, meta, codes, threads);
    default: return encode_dt<dtype::bfloat16>(src, numel, bits, group_size, seed, key, meta, codes, threads);
  }
}

void quant_decode_cpu(unsigned char const* meta, unsigned char const* codes, dtype dt, std::uint64_t numel,
                      int bits, int group_size, void* dst, int threads) {
  if (numel == 0) return;
  switch (dt) {
    case dtype::float32: decode_dt<dtype::float32>(meta, codes, numel, bits, group_size, dst, threads); break;
    case dtype::float16: decode_dt<dtype::float16>(meta, codes, numel, bits, group_size, dst, threads); break;
    default: decode_dt<dtype::bfloat16>(meta, codes, numel, bits, group_size, dst, threads); break;
  }
}

}  // namespace gact::codec::detail
