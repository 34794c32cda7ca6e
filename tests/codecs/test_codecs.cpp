// tests/codecs/test_codecs.cpp
//
// Behaviour of the codecs on the CPU executor: the Philox generator against
// Random123's known answers, the 16-bit float conversions, the blob layout and
// parameter checks, quant's error bound, unbiasedness and exactness properties
// over every dtype x bit width x group size, the edge cases (empty, scalar,
// tails, constant groups, huge ranges, denormals, non-finite input), the mask
// and raw codecs, determinism across seeds and thread counts, and the decoder
// against thousands of corrupted and truncated blobs (run under ASan+UBSan in CI).
#include "codecs/codec.hpp"
#include "codecs/float16.hpp"
#include "codecs/philox.hpp"
#include "codecs/quant_math.hpp"

#include "allocator/error.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using namespace gact::codec;
using bytes = std::vector<unsigned char>;

namespace {

constexpr dtype k_float_dtypes[] = {dtype::float32, dtype::float16, dtype::bfloat16};
constexpr int k_bits[] = {1, 2, 4, 8};
constexpr int k_groups[] = {64, 128, 256, 512, 1024};

/// A host tensor of dt holding the given float values (rounded to the dtype).
std::vector<unsigned char> make_tensor(dtype dt, std::vector<float> const& v) {
  std::vector<unsigned char> t(v.size() * dtype_size(dt));
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (dt == dtype::float32) {
      std::memcpy(t.data() + 4 * i, &v[i], 4);
    } else {
      std::uint16_t const h = dt == dtype::float16 ? hd::float_to_half(v[i]) : hd::float_to_bf16(v[i]);
      std::memcpy(t.data() + 2 * i, &h, 2);
    }
  }
  return t;
}

std::vector<float> tensor_values(dtype dt, unsigned char const* p, std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (dt == dtype::float32) {
      std::memcpy(&v[i], p + 4 * i, 4);
    } else {
      std::uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      v[i] = dt == dtype::float16 ? hd::half_to_float(h) : hd::bf16_to_float(h);
    }
  }
  return v;
}

/// The values the tensor really holds after rounding to dt.
std::vector<float> rounded(dtype dt, std::vector<float> const& v) {
  auto t = make_tensor(dt, v);
  return tensor_values(dt, t.data(), v.size());
}

bytes encode(std::vector<unsigned char> const& t, dtype dt, std::vector<std::int64_t> const& shape,
             encode_params const& p, int threads = 1) {
  bytes b(blob_size(dt, shape, p));
  auto r = encode_cpu(t.data(), dt, shape, p, b.data(), b.size(), threads);
  REQUIRE_FALSE(r.nonfinite);
  REQUIRE(r.bytes == b.size());
  return b;
}

std::vector<float> decode_values(bytes const& b, int threads = 1) {
  auto info = parse(b.data(), b.size());
  std::vector<unsigned char> out(std::max<std::size_t>(1, info.numel * dtype_size(info.dt)));
  decode_cpu(b.data(), b.size(), out.data(), out.size(), threads);
  return tensor_values(info.dt, out.data(), info.numel);
}

/// Quantization step of a group in double precision (what the error bounds are stated in).
double group_step(std::vector<float> const& x, std::size_t begin, std::size_t end, int bits) {
  auto [mn, mx] = std::minmax_element(x.begin() + long(begin), x.begin() + long(end));
  return (double(*mx) - double(*mn)) / double((1 << bits) - 1);
}

std::vector<float> normal_values(std::size_t n, std::uint32_t seed, float mean = 0.f, float sd = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(mean, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

/// Half an ulp of x in dtype dt (the rounding of a decoded float to the output dtype).
double half_ulp(dtype dt, double x) {
  int const mant = dt == dtype::float32 ? 24 : dt == dtype::float16 ? 11 : 8;
  double const ax = std::max(std::fabs(x), dt == dtype::float16 ? 6.1e-5 : 1.2e-38);
  return std::ldexp(1.0, std::ilogb(ax) - mant);
}

}  // namespace

TEST_SUITE("codecs") {

TEST_CASE("philox4x32-10 matches Random123 known answers") {
  struct kat { std::uint32_t c[4], k[2], out[4]; };
  kat const cases[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (auto const& k : cases) {
    auto r = hd::philox4x32_10(hd::philox_block{{k.c[0], k.c[1], k.c[2], k.c[3]}}, k.k[0], k.k[1]);
    for (int i = 0; i < 4; ++i) CHECK(r.v[i] == k.out[i]);
  }
}

TEST_CASE("float16 and bfloat16 conversions") {
  SUBCASE("every float16 survives a trip through float") {
    for (std::uint32_t h = 0; h < 65536; ++h) {
      float const f = hd::half_to_float(std::uint16_t(h));
      if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0) {
        CHECK(std::isnan(f));
        CHECK(std::isnan(hd::half_to_float(hd::float_to_half(f))));
      } else {
        CHECK(hd::float_to_half(f) == h);
      }
    }
  }
  SUBCASE("every bfloat16 survives a trip through float") {
    for (std::uint32_t h = 0; h < 65536; ++h) {
      float const f = hd::bf16_to_float(std::uint16_t(h));
      if (std::isnan(f)) {
        CHECK(std::isnan(hd::bf16_to_float(hd::float_to_bf16(f))));
      } else {
        CHECK(hd::float_to_bf16(f) == h);
      }
    }
  }
  SUBCASE("float -> 16 bit rounds to the nearest, ties to even") {
    std::mt19937 rng(7);
    for (int i = 0; i < 200000; ++i) {
      std::uint32_t const u = rng();
      float f;
      std::memcpy(&f, &u, 4);
      if (std::isnan(f)) continue;
      // Reference: the nearest of the two neighbouring representable values, via double.
      auto check = [&](std::uint16_t h, auto to_float, double inf_boundary) {
        double const d = double(f);
        double const got = double(to_float(h));
        if (std::fabs(d) >= inf_boundary) {  // max finite + half an ulp and beyond: Inf
          CHECK(std::isinf(got));
          return;
        }
        if (std::isinf(got)) return;  // at the boundary; exact tie handling checked by round trips
        // No representable value is strictly closer than the result.
        std::uint16_t const up = std::uint16_t(h + 1), down = std::uint16_t(h - 1);
        double const e = std::fabs(got - d);
        for (std::uint16_t n : {up, down}) {
          double const o = double(to_float(n));
          if (!std::isfinite(o)) continue;
          bool const closer = std::fabs(o - d) < e;
          bool const tie_even = std::fabs(o - d) == e && (n & 1) == 0 && (h & 1) != 0;
          CHECK_FALSE(closer);
          CHECK_FALSE(tie_even);
        }
      };
      check(hd::float_to_half(f), hd::half_to_float, 65520.0);
      check(hd::float_to_bf16(f), hd::bf16_to_float, std::ldexp(2.0 - std::ldexp(1.0, -8), 127));
    }
  }
}

TEST_CASE("blob_size and parameter checks") {
  std::vector<std::int64_t> const shape{3, 100};
  encode_params p;
  p.bits = 4;
  p.group_size = 128;
  // header 64 + 16 -> 80; groups ceil(300/128) = 3 -> 3*8 meta, padded to 32 (3*4 -> 16 for
  // 16-bit dtypes); codes ceil(300/8)*4 = 152.
  CHECK(blob_size(dtype::float32, shape, p) == 80 + 32 + 152);
  CHECK(blob_size(dtype::float16, shape, p) == 80 + 16 + 152);
  p.codec = codec_id::mask;
  CHECK(blob_size(dtype::boolean, shape, p) == 80 + 38);
  p.codec = codec_id::raw;
  CHECK(blob_size(dtype::int64, shape, p) == 80 + 2400);
  CHECK(blob_size(dtype::float32, {}, p) == 64 + 4);  // a 0-dim tensor holds one element

  encode_params q;
  for (int b : {0, 3, 5, 16}) {
    q.bits = b;
    CHECK_THROWS_AS(blob_size(dtype::float32, shape, q), gact::invalid_argument);
  }
  q.bits = 4;
  for (int g : {0, 32, 96, 2048}) {
    q.group_size = g;
    CHECK_THROWS_AS(blob_size(dtype::float32, shape, q), gact::invalid_argument);
  }
  q.group_size = 256;
  CHECK_THROWS_AS(blob_size(dtype::int32, shape, q), gact::invalid_argument);
  q.codec = codec_id::mask;
  CHECK_THROWS_AS(blob_size(dtype::float32, shape, q), gact::invalid_argument);
  q.codec = codec_id::raw;
  std::vector<std::int64_t> const nine(9, 1), neg{2, -1}, huge{1 << 30, 1 << 30, 1 << 30};
  CHECK_THROWS_AS(blob_size(dtype::float32, nine, q), gact::invalid_argument);
  CHECK_THROWS_AS(blob_size(dtype::float32, neg, q), gact::invalid_argument);
  CHECK_THROWS_AS(blob_size(dtype::float32, huge, q), gact::invalid_argument);
  q.codec = codec_id(7);
  CHECK_THROWS_AS(blob_size(dtype::float32, shape, q), gact::invalid_argument);
  CHECK(std::string(dtype_name(dtype::boolean)) == "bool");
  CHECK(dtype_size(dtype::bfloat16) == 2);
  CHECK(dtype_size(dtype::float64) == 8);
}

TEST_CASE("quant: every dtype x bits x group size, with tails: error <= one step, values in [min, max]") {
  for (dtype dt : k_float_dtypes) {
    for (int bits : k_bits) {
      for (int G : k_groups) {
        CAPTURE(dtype_name(dt));
        CAPTURE(bits);
        CAPTURE(G);
        std::size_t const n = std::size_t(3 * G + 37);  // a short tail group
        auto const x = rounded(dt, normal_values(n, std::uint32_t(bits * 1000 + G), 0.5f, 2.f));
        encode_params p;
        p.bits = bits;
        p.group_size = G;
        p.seed = 42;
        auto const b = encode(make_tensor(dt, x), dt, {std::int64_t(n)}, p);
        auto const info = parse(b.data(), b.size());
        CHECK(info.numel == n);
        CHECK(info.bits == bits);
        CHECK(info.group_size == G);
        auto const y = decode_values(b);
        int bad = 0;
        for (std::size_t g0 = 0; g0 < n; g0 += std::size_t(G)) {
          std::size_t const g1 = std::min(n, g0 + std::size_t(G));
          double const step = group_step(x, g0, g1, bits);
          auto [mn, mx] = std::minmax_element(x.begin() + long(g0), x.begin() + long(g1));
          for (std::size_t i = g0; i < g1; ++i) {
            double const tol = step * (1 + 1e-5) + half_ulp(dt, double(x[i])) * 2;
            if (!(std::fabs(double(y[i]) - double(x[i])) <= tol) || y[i] < *mn || y[i] > *mx) ++bad;
          }
        }
        CHECK(bad == 0);
      }
    }
  }
}

TEST_CASE("quant: unbiased; the mean over 1000 seeds converges to x within 5 sigma / sqrt(n)") {
  int const n_seeds = 1000;
  for (dtype dt : {dtype::float32, dtype::bfloat16, dtype::float16}) {
    for (int bits : {1, 2, 4, 8}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(bits);
      int const G = 64;
      auto const x = rounded(dt, normal_values(std::size_t(G), std::uint32_t(bits), 0.f, 1.f));
      auto const t = make_tensor(dt, x);
      double const step = group_step(x, 0, x.size(), bits);
      std::vector<double> sum(x.size(), 0.0);
      for (int s = 0; s < n_seeds; ++s) {
        encode_params p;
        p.bits = bits;
        p.group_size = G;
        p.seed = std::uint64_t(s) * 0x9E3779B97F4A7C15ull + 1;
        p.key = 5;
        auto const y = decode_values(encode(t, dt, {G}, p));
        for (std::size_t i = 0; i < x.size(); ++i) sum[i] += double(y[i]);
      }
      double const lo = double(*std::min_element(x.begin(), x.end()));
      double z_sum = 0;
      for (std::size_t i = 0; i < x.size(); ++i) {
        // Per-element variance of stochastic rounding: step^2 f (1 - f), f the fractional grid position. A 16-bit
        // output chooses between the two grid values as its decode rounds them (hd::quantize_u16), at most half a
        // unit of the dtype each way: their distance is below step + 2 half units, and the rounding a Bernoulli
        // between them, sigma <= that distance / 2. No allowance for the output's rounding in the mean: at 8 bits
        // a bfloat16 unit is about the step, and the mean missed x by up to half of it (3x the bound).
        double const v = (double(x[i]) - lo) / step;
        double const f = v - std::floor(v);
        double const sigma = dt == dtype::float32 ? step * std::sqrt(f * (1 - f))
                                                  : (step + 2 * half_ulp(dt, double(x[i]))) / 2;
        double const mean = sum[i] / n_seeds;
        // 5 sigma/sqrt(n), plus the 2^-17-step bias of 16-bit noise
        double const bound = 5 * sigma / std::sqrt(double(n_seeds)) + step * std::ldexp(1.0, -16) +
                             1e-6 * std::fabs(double(x[i]));
        CAPTURE(i);
        CHECK(std::fabs(mean - double(x[i])) <= bound);
        if (sigma > 0 && dt == dtype::float32) z_sum += (mean - double(x[i])) / (sigma / std::sqrt(double(n_seeds)));
      }
      // The z-scores of 64 independent elements average to N(0, 1/64): |mean z| < 5/8.
      if (dt == dtype::float32) CHECK(std::fabs(z_sum / double(x.size())) < 5.0 / 8.0);
    }
  }
}

TEST_CASE("quant: grid values round-trip exactly") {
  for (dtype dt : k_float_dtypes) {
    for (int bits : k_bits) {
      CAPTURE(dtype_name(dt));
      CAPTURE(bits);
      int const levels = (1 << bits) - 1;
      std::vector<float> x(1000);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = 0.25f * float((i * 7) % std::size_t(levels + 1));
      for (std::size_t g = 0; g < x.size(); g += 64) {  // every group spans [0, levels/4]
        x[g] = 0.f;
        if (g + 1 < x.size()) x[g + 1] = 0.25f * float(levels);
      }
      encode_params p;
      p.bits = bits;
      p.group_size = 64;
      auto const y = decode_values(encode(make_tensor(dt, x), dt, {1000}, p));
      CHECK(y == x);
    }
  }
  SUBCASE("8-bit 0..255") {
    std::vector<float> x(256);
    for (int i = 0; i < 256; ++i) x[std::size_t(i)] = float(i);
    for (dtype dt : k_float_dtypes) {
      encode_params p;
      p.bits = 8;
      p.group_size = 256;
      p.seed = 99;
      CHECK(decode_values(encode(make_tensor(dt, x), dt, {16, 16}, p)) == x);
    }
  }
}

TEST_CASE("quant: deterministic per (seed, key); different seeds or keys give different codes") {
  auto const x = normal_values(4096, 3);
  auto const t = make_tensor(dtype::float32, x);
  encode_params p;
  p.bits = 2;
  p.seed = 11;
  p.key = 1;
  auto const a = encode(t, dtype::float32, {4096}, p);
  auto const b = encode(t, dtype::float32, {4096}, p);
  CHECK(a == b);
  p.seed = 12;
  auto const c = encode(t, dtype::float32, {4096}, p);
  p.seed = 11;
  p.key = 2;
  auto const d = encode(t, dtype::float32, {4096}, p);
  // Codes are the tail of the blob; compare them only (headers differ in seed/key anyway).
  std::size_t const codes = a.size() - 4096 / 8 * 2;
  CHECK_FALSE(std::equal(a.begin() + long(codes), a.end(), c.begin() + long(codes)));
  CHECK_FALSE(std::equal(a.begin() + long(codes), a.end(), d.begin() + long(codes)));
}

TEST_CASE("quant: thread count does not change the bytes" * doctest::test_suite("threads")) {
  auto const x = normal_values(300000 + 5, 4);
  for (dtype dt : k_float_dtypes) {
    auto const t = make_tensor(dt, x);
    encode_params p;
    p.bits = 4;
    p.seed = 8;
    auto const a = encode(t, dt, {std::int64_t(x.size())}, p, 1);
    auto const b = encode(t, dt, {std::int64_t(x.size())}, p, 4);
    CHECK(a == b);
    CHECK(decode_values(a, 1) == decode_values(a, 3));
  }
}

TEST_CASE("quant: the baseline and the vectorized (avx2, avx512) builds of the CPU loops give the same bytes") {
  auto const isas = detail::quant_cpu_isas();
  REQUIRE(std::string(isas.front()) == "generic");
  MESSAGE("CPU executor build in use: " << std::string(detail::quant_cpu_isa()) << " (of " << isas.size() << ")");
  CHECK(std::string(detail::quant_cpu_isa()) == std::string(isas.back()));  // the fastest is the default
  CHECK_FALSE(detail::use_quant_cpu_isa("no-such-isa"));
  if (isas.size() == 1) return;  // only the baseline build exists on this CPU
  for (dtype dt : k_float_dtypes) {
    for (int bits : k_bits) {
      for (int G : k_groups) {
        CAPTURE(dtype_name(dt));
        CAPTURE(bits);
        CAPTURE(G);
        std::size_t const n = std::size_t(7 * G + 61);
        auto x = normal_values(n, std::uint32_t(G + bits), 1.f, 3.f);
        x[n / 2] = -0.0f;
        for (std::size_t i = std::size_t(2 * G); i < std::size_t(3 * G); ++i) x[i] = 0.5f;  // a constant group
        if (dt != dtype::float16) {  // a group whose range overflows float: encoded in the halved domain
          x[std::size_t(3 * G + 1)] = 3e38f;
          x[std::size_t(3 * G + 2)] = -3e38f;
        }
        auto const t = make_tensor(dt, x);
        encode_params p;
        p.bits = bits;
        p.group_size = G;
        p.seed = 0xFEEDFACECAFEBEEFull;
        p.key = 0x123456789ull << 20;
        REQUIRE(detail::use_quant_cpu_isa("generic"));
        CHECK(std::string(detail::quant_cpu_isa()) == "generic");
        auto const a = encode(t, dt, {std::int64_t(n)}, p);
        auto const ya = decode_values(a);
        for (std::size_t k = 1; k < isas.size(); ++k) {
          CAPTURE(std::string(isas[k]));
          REQUIRE(detail::use_quant_cpu_isa(isas[k]));
          auto const b = encode(t, dt, {std::int64_t(n)}, p);
          CHECK(a == b);
          CHECK(decode_values(b) == ya);
        }
        detail::use_quant_cpu_isa(nullptr);
      }
    }
  }
  // Non-finite detection must agree too.
  auto x = normal_values(5000, 3);
  x[4321] = std::numeric_limits<float>::infinity();
  auto const t = make_tensor(dtype::float32, x);
  encode_params p;
  std::vector<std::int64_t> const shape{5000};
  bytes b(blob_size(dtype::float32, shape, p));
  for (char const* isa : isas) {
    CAPTURE(std::string(isa));
    REQUIRE(detail::use_quant_cpu_isa(isa));
    CHECK(encode_cpu(t.data(), dtype::float32, shape, p, b.data(), b.size(), 1).nonfinite);
  }
  detail::use_quant_cpu_isa(nullptr);
}

TEST_CASE("quant: edge cases") {
  encode_params p;
  p.bits = 4;
  SUBCASE("numel 0") {
    for (dtype dt : k_float_dtypes) {
      std::vector<std::int64_t> const shape{0, 5};
      bytes b(blob_size(dt, shape, p));
      auto r = encode_cpu(nullptr, dt, shape, p, b.data(), b.size());
      CHECK(r.bytes == b.size());
      auto info = parse(b.data(), b.size());
      CHECK(info.numel == 0);
      CHECK(info.shape == shape);
      decode_cpu(b.data(), b.size(), nullptr, 0);
    }
  }
  SUBCASE("numel 1 and 0-dim") {
    for (dtype dt : k_float_dtypes) {
      std::vector<float> const x{-3.5f};
      CHECK(decode_values(encode(make_tensor(dt, x), dt, {1}, p)) == x);
      CHECK(decode_values(encode(make_tensor(dt, x), dt, {}, p)) == x);
    }
  }
  SUBCASE("constant groups decode exactly") {
    for (dtype dt : k_float_dtypes) {
      std::vector<float> x(700, 1.5f);
      std::fill(x.begin() + 256, x.begin() + 512, -0.0f);
      auto const y = decode_values(encode(make_tensor(dt, x), dt, {700}, p));
      for (std::size_t i = 0; i < x.size(); ++i) CHECK(y[i] == x[i]);
    }
  }
  SUBCASE("huge ranges: no overflow to Inf") {
    for (int bits : k_bits) {
      p.bits = bits;
      std::vector<float> x = normal_values(512, 5, 0.f, 1e38f);
      for (auto& v : x) v = std::clamp(v, -3.0e38f, 3.0e38f);
      x[0] = -3.0e38f;
      x[1] = 3.0e38f;
      for (dtype dt : {dtype::float32, dtype::bfloat16}) {
        // The largest finite value of each dtype (FLT_MAX rounds to Inf in bfloat16).
        float const top = dt == dtype::float32 ? hd::k_float_max : hd::bf16_to_float(0x7F7F);
        x[300] = -top;
        x[301] = top;
        auto const xr = rounded(dt, x);
        auto const y = decode_values(encode(make_tensor(dt, xr), dt, {512}, p));
        for (std::size_t g = 0; g < 512; g += 256) {
          double const step = group_step(xr, g, g + 256, bits);
          for (std::size_t i = g; i < g + 256; ++i) {
            CHECK(std::isfinite(y[i]));
            CHECK(std::fabs(double(y[i]) - double(xr[i])) <= step * (1 + 1e-5) + half_ulp(dt, double(xr[i])) * 2);
          }
        }
      }
    }
  }
  SUBCASE("denormals") {
    for (int bits : k_bits) {
      p.bits = bits;
      std::vector<float> x(256);
      std::mt19937 rng(9);
      for (auto& v : x) v = float(rng() % 1000) * 1e-42f;  // float32 denormals
      auto const y = decode_values(encode(make_tensor(dtype::float32, x), dtype::float32, {256}, p));
      double const step = group_step(x, 0, 256, bits);
      for (std::size_t i = 0; i < x.size(); ++i)
        CHECK(std::fabs(double(y[i]) - double(x[i])) <= step + 1.5e-45);
      std::vector<float> h(256);  // float16 denormals (below 6.1e-5)
      for (auto& v : h) v = hd::half_to_float(std::uint16_t(rng() % 1024));
      auto const yh = decode_values(encode(make_tensor(dtype::float16, h), dtype::float16, {256}, p));
      double const hstep = group_step(h, 0, 256, bits);
      for (std::size_t i = 0; i < h.size(); ++i)
        CHECK(std::fabs(double(yh[i]) - double(h[i])) <= hstep + 3e-8);
    }
  }
  SUBCASE("ranges of a few subnormal units keep the quantizer's bound and stay unbiased") {
    // A step among the subnormals would itself be rounded to a multiple of 2^-149: at a range of 1e-41 (7100
    // units) and 8 bits that erred by 3.7 steps. The bound is the step plus half a unit (x^'s own rounding).
    double const unit = std::ldexp(1.0, -149);
    for (float range : {1e-41f, 2e-42f, 3e-43f, 3e-44f}) {
      for (int bits : k_bits) {
        CAPTURE(range);
        CAPTURE(bits);
        p.bits = bits;
        std::vector<float> x(256);
        std::mt19937 rng(11);
        for (auto& v : x) v = float(double(rng() % 4096) / 4096.0 * double(range)) - range / 3;
        double const step = group_step(x, 0, 256, bits);
        std::vector<double> mean(x.size(), 0.0);
        int const seeds = 64;
        for (int s = 0; s < seeds; ++s) {
          p.seed = std::uint64_t(1000 + s);
          auto const y = decode_values(encode(make_tensor(dtype::float32, x), dtype::float32, {256}, p));
          for (std::size_t i = 0; i < x.size(); ++i) {
            CHECK(std::fabs(double(y[i]) - double(x[i])) <= step + unit / 2);
            mean[i] += double(y[i]) / seeds;
          }
        }
        // Var[x^] <= step^2 / 4: the mean of 64 draws is within 5 standard deviations (step / 16 each)
        for (std::size_t i = 0; i < x.size(); ++i)
          CHECK(std::fabs(mean[i] - double(x[i])) <= 5 * step / 16 + unit / 2);
      }
    }
  }
  SUBCASE("NaN and +-Inf are refused, counted, and leave no valid blob") {
    float const bad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                         -std::numeric_limits<float>::infinity()};
    for (dtype dt : k_float_dtypes) {
      for (float v : bad) {
        auto x = normal_values(1000, 6);
        x[777] = v;
        auto const t = make_tensor(dt, x);
        bytes b(blob_size(dt, std::vector<std::int64_t>{1000}, p));
        auto const before = stats_json()["nonfinite_refusals"].get<std::uint64_t>();
        std::vector<std::int64_t> const shape{1000};
        auto r = encode_cpu(t.data(), dt, shape, p, b.data(), b.size(), 2);
        CHECK(r.nonfinite);
        CHECK(r.bytes == 0);
        CHECK(stats_json()["nonfinite_refusals"].get<std::uint64_t>() == before + 1);
        CHECK_THROWS_AS(parse(b.data(), b.size()), gact::corrupt_blob);
      }
    }
  }
}

TEST_CASE("quant: groups marked non-finite (the CUDA encoder's marker) decode to NaN") {
  auto const x = normal_values(600, 10);
  encode_params p;
  auto b = encode(make_tensor(dtype::float32, x), dtype::float32, {600}, p);
  auto const info = parse(b.data(), b.size());
  CHECK(info.nonfinite_groups == 0);
  float const nan = std::numeric_limits<float>::quiet_NaN();
  std::size_t const meta = 80;  // header 64 + 8 (shape) -> 80; group 1 at meta + 8
  std::memcpy(b.data() + meta + 8, &nan, 4);
  std::memcpy(b.data() + meta + 12, &nan, 4);
  CHECK(parse(b.data(), b.size()).nonfinite_groups == 1);
  auto const before = stats_json()["nonfinite_groups_decoded"].get<std::uint64_t>();
  auto const y = decode_values(b);
  CHECK(stats_json()["nonfinite_groups_decoded"].get<std::uint64_t>() == before + 1);
  for (std::size_t i = 0; i < 600; ++i) CHECK(std::isnan(y[i]) == (i >= 256 && i < 512));
  // A half-NaN or inverted (min > max) group is corruption, not a marker.
  float const two = 2.f, one = 1.f;
  std::memcpy(b.data() + meta + 8, &one, 4);
  CHECK_THROWS_AS(parse(b.data(), b.size()), gact::corrupt_blob);
  std::memcpy(b.data() + meta + 8, &two, 4);
  std::memcpy(b.data() + meta + 12, &one, 4);
  CHECK_THROWS_AS(parse(b.data(), b.size()), gact::corrupt_blob);
}

TEST_CASE("mask: lossless 1 bit per element; uint8 other than 0/1 is rejected") {
  encode_params p;
  p.codec = codec_id::mask;
  std::mt19937 rng(12);
  // sizes around the 16-byte steps of the vector loop, its odd last byte and the tail
  for (std::size_t n : {0, 1, 7, 8, 15, 16, 17, 24, 31, 33, 1001}) {
    for (dtype dt : {dtype::boolean, dtype::uint8}) {
      std::vector<std::uint8_t> x(n);
      for (auto& v : x) v = std::uint8_t(rng() & 1);
      std::vector<std::int64_t> const shape{std::int64_t(n)};
      bytes b(blob_size(dt, shape, p));
      CHECK(b.size() == 64 + 16 + (n + 7) / 8);
      auto r = encode_cpu(x.data(), dt, shape, p, b.data(), b.size());
      CHECK(r.bytes == b.size());
      std::vector<std::uint8_t> y(n + 1, 0xAA);
      decode_cpu(b.data(), b.size(), y.data(), y.size());
      CHECK(std::equal(x.begin(), x.end(), y.begin()));
      CHECK(y[n] == 0xAA);
    }
  }
  // a value other than 0/1 in the vector part (0, 15, 50), the last whole byte (92: 100 elements are
  // 12 whole bytes, an even number, so in the vector part too), the tail (97), and in an odd last
  // whole byte (a 24-element tensor: its third byte)
  for (auto const& where : {std::pair{100, 0}, {100, 15}, {100, 50}, {100, 92}, {100, 97}, {24, 20}}) {
    int const n = where.first, at = where.second;  // (clang 14 cannot capture structured bindings)
    CAPTURE(n);
    CAPTURE(at);
    std::vector<std::uint8_t> x(std::size_t(n), 1);
    x[std::size_t(at)] = 2;
    std::vector<std::int64_t> const shape{n};
    bytes b(blob_size(dtype::uint8, shape, p));
    CHECK_THROWS_WITH_AS(encode_cpu(x.data(), dtype::uint8, shape, p, b.data(), b.size()),
                         doctest::Contains("values other than 0 and 1"), gact::invalid_argument);
    // a bool tensor's byte is true when nonzero, whatever its value
    bytes bb(blob_size(dtype::boolean, shape, p));
    encode_cpu(x.data(), dtype::boolean, shape, p, bb.data(), bb.size());
    std::vector<std::uint8_t> y(static_cast<std::size_t>(n));
    decode_cpu(bb.data(), bb.size(), y.data(), y.size());
    CHECK(std::all_of(y.begin(), y.end(), [](std::uint8_t v) { return v == 1; }));
  }
}

TEST_CASE("raw: lossless for every dtype") {
  encode_params p;
  p.codec = codec_id::raw;
  std::mt19937 rng(13);
  for (int d = 0; d < k_dtype_count; ++d) {
    dtype const dt = dtype(d);
    std::vector<std::int64_t> const shape{3, 5, 7};
    std::vector<unsigned char> x(105 * dtype_size(dt));
    for (auto& v : x) v = std::uint8_t(rng());
    bytes b(blob_size(dt, shape, p));
    encode_cpu(x.data(), dt, shape, p, b.data(), b.size());
    auto info = parse(b.data(), b.size());
    CHECK(info.dt == dt);
    CHECK(info.shape == shape);
    std::vector<unsigned char> y(x.size());
    decode_cpu(b.data(), b.size(), y.data(), y.size());
    CHECK(x == y);
    CHECK_THROWS_AS(decode_cpu(b.data(), b.size(), y.data(), y.size() - 1), gact::invalid_argument);
  }
}

TEST_CASE("encode rejects a small capacity; decode rejects a small destination") {
  auto const x = normal_values(300, 14);
  auto const t = make_tensor(dtype::float32, x);
  encode_params p;
  std::vector<std::int64_t> const shape{300};
  bytes b(blob_size(dtype::float32, shape, p));
  CHECK_THROWS_AS(encode_cpu(t.data(), dtype::float32, shape, p, b.data(), b.size() - 1), gact::invalid_argument);
  encode_cpu(t.data(), dtype::float32, shape, p, b.data(), b.size());
  std::vector<float> y(299);
  CHECK_THROWS_AS(decode_cpu(b.data(), b.size(), y.data(), y.size() * 4), gact::invalid_argument);
  // A longer buffer than the blob is fine (allocator blocks are rounded up).
  b.resize(b.size() + 100, 0xEE);
  CHECK(parse(b.data(), b.size()).size == b.size() - 100);
}

TEST_CASE("corrupt and truncated blobs never read out of bounds: decode or corrupt_blob") {
  std::mt19937 rng(15);
  std::vector<bytes> valid;
  auto const x = normal_values(1500, 16);
  for (dtype dt : k_float_dtypes) {
    for (int bits : k_bits) {
      encode_params p;
      p.bits = bits;
      p.group_size = bits == 1 ? 64 : 512;
      valid.push_back(encode(make_tensor(dt, x), dt, {3, 500}, p));
    }
  }
  {
    encode_params p;
    p.codec = codec_id::mask;
    std::vector<std::uint8_t> m(333, 1);
    std::vector<std::int64_t> const shape{333};
    bytes b(blob_size(dtype::boolean, shape, p));
    encode_cpu(m.data(), dtype::boolean, shape, p, b.data(), b.size());
    valid.push_back(b);
    p.codec = codec_id::raw;
    bytes r(blob_size(dtype::int16, shape, {codec_id::raw}));
    std::vector<std::int16_t> v(333, 7);
    encode_cpu(v.data(), dtype::int16, shape, {codec_id::raw}, r.data(), r.size());
    valid.push_back(r);
  }
  int decoded = 0, rejected = 0;
  std::vector<unsigned char> out(1500 * 4);
  auto attempt = [&](bytes const& b) {
    // Copy into an exactly sized heap buffer so ASan sees any read past its end.
    std::unique_ptr<unsigned char[]> buf(new unsigned char[std::max<std::size_t>(1, b.size())]);
    std::memcpy(buf.get(), b.data(), b.size());
    try {
      decode_cpu(buf.get(), b.size(), out.data(), out.size());
      ++decoded;
    } catch (gact::corrupt_blob const&) {
      ++rejected;
    }
  };
  for (int it = 0; it < 6000; ++it) {
    bytes b = valid[std::size_t(rng()) % valid.size()];
    int const kind = int(rng() % 3);
    if (kind == 0) {  // bit flips anywhere
      int const flips = 1 + int(rng() % 4);
      for (int f = 0; f < flips; ++f) b[rng() % b.size()] ^= std::uint8_t(1u << (rng() % 8));
    } else if (kind == 1) {  // truncation
      b.resize(rng() % b.size());
    } else {  // header field overwritten with a random byte, checksum recomputed (passes the checksum)
      std::size_t const pos = rng() % 60;
      b[pos] = std::uint8_t(rng());
      int const nd = std::min<int>(b[8], 8);
      std::uint32_t const extra = 8u * std::uint32_t(nd) + hd::params_bytes(b[6], b[12]);
      if (b.size() >= std::size_t(64 + extra)) {
        std::uint32_t const c = hd::header_checksum(b.data(), extra);
        std::memcpy(b.data() + 60, &c, 4);
      }
    }
    attempt(b);
  }
  CHECK(decoded + rejected == 6000);
  CHECK(rejected > 3000);  // every truncation and nearly every header flip is caught
  MESSAGE("corrupt blobs: " << decoded << " decoded, " << rejected << " rejected");
  CHECK_THROWS_AS(parse(nullptr, 0), gact::corrupt_blob);
  CHECK_THROWS_WITH_AS(parse(valid[0].data(), valid[0].size() - 1), doctest::Contains("truncated"),
                       gact::corrupt_blob);
}

TEST_CASE("stats: the codecs section counts encodes and decodes") {
  auto const before = stats_json();
  auto const x = normal_values(1000, 17);
  encode_params p;
  auto const b = encode(make_tensor(dtype::float32, x), dtype::float32, {1000}, p);
  decode_values(b);
  auto const after = stats_json();
  CHECK(after["quant"]["encodes"].get<std::uint64_t>() == before["quant"]["encodes"].get<std::uint64_t>() + 1);
  CHECK(after["quant"]["encode_bytes_in"].get<std::uint64_t>() ==
        before["quant"]["encode_bytes_in"].get<std::uint64_t>() + 4000);
  CHECK(after["quant"]["decodes"].get<std::uint64_t>() == before["quant"]["decodes"].get<std::uint64_t>() + 1);
}

}  // TEST_SUITE
