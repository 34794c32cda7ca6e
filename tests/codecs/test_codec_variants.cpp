// tests/codecs/test_codec_variants.cpp
//
// The codec variants that store what a backward pass reads (format.hpp): the
// normalized quant (per-block affine undone on decode), the boundary quant (exact
// boundary codes, so a ReLU's predicate survives in the values' blob), predicate
// masks evaluated on a float tensor, the window codec for max-pool indices, and
// float64 input. Each is checked for its error bound or exactness, its
// unbiasedness where it rounds, its refusals, its thread-count invariance, and
// its resistance to corrupted headers, parameters, statistics and codes.
#include "codecs/codec.hpp"
#include "codecs/float16.hpp"
#include "codecs/mask_math.hpp"
#include "codecs/quant_math.hpp"

#include "allocator/error.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <limits>
#include <vector>

using namespace gact::codec;
using bytes = std::vector<unsigned char>;

namespace {

std::vector<float> normal_values(std::size_t n, std::uint32_t seed, float mean = 0.f, float sd = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(mean, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

/// Bytes of a tensor of dtype dt holding v (rounded to dt).
bytes make_tensor(dtype dt, std::vector<float> const& v) {
  bytes t(v.size() * dtype_size(dt));
  for (std::size_t i = 0; i < v.size(); ++i) {
    switch (dt) {
      case dtype::float32: std::memcpy(t.data() + 4 * i, &v[i], 4); break;
      case dtype::float64: {
        double const d = static_cast<double>(v[i]);
        std::memcpy(t.data() + 8 * i, &d, 8);
        break;
      }
      default: {
        std::uint16_t const h = dt == dtype::float16 ? hd::float_to_half(v[i]) : hd::float_to_bf16(v[i]);
        std::memcpy(t.data() + 2 * i, &h, 2);
      }
    }
  }
  return t;
}

std::vector<double> values(dtype dt, unsigned char const* p, std::size_t n) {
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    switch (dt) {
      case dtype::float32: {
        float f;
        std::memcpy(&f, p + 4 * i, 4);
        v[i] = static_cast<double>(f);
        break;
      }
      case dtype::float64: std::memcpy(&v[i], p + 8 * i, 8); break;
      default: {
        std::uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        v[i] = static_cast<double>(dt == dtype::float16 ? hd::half_to_float(h) : hd::bf16_to_float(h));
      }
    }
  }
  return v;
}

bytes encode_ok(bytes const& t, dtype dt, std::vector<std::int64_t> const& shape, encode_params const& p,
                int threads = 1, encode_result* res = nullptr) {
  bytes b(blob_size(dt, shape, p));
  encode_result const r = encode_cpu(t.data(), dt, shape, p, b.data(), b.size(), threads);
  REQUIRE(r.refused == refusal::none);
  REQUIRE(r.bytes == b.size());
  if (res != nullptr) *res = r;
  return b;
}

std::vector<double> decode_all(bytes const& b, decode_params const& dp = {}, int threads = 1) {
  blob_info const info = parse(b.data(), b.size());
  bytes out(std::max<std::size_t>(1, info.numel * dtype_size(info.dt)));
  decode_cpu(b.data(), b.size(), out.data(), out.size(), threads, dp);
  return values(info.dt, out.data(), info.numel);
}

constexpr dtype k_float_dtypes[] = {dtype::float32, dtype::float16, dtype::bfloat16, dtype::float64};

/// A ReLU output: about half exact zeros, the rest positive with a spread of scales.
std::vector<float> relu_values(std::size_t n, std::uint32_t seed) {
  auto v = normal_values(n, seed);
  for (auto& x : v) x = x > 0.f ? x : 0.f;
  return v;
}

/// Tolerance of |mean of n decodes - x| for an unbiased stochastic rounding of x on a lattice of
/// spacing `step` that contains `lo`: the number of round-ups is Binomial(n, f), f = frac((x - lo) / step),
/// so 5 standard deviations of the mean are 5 step sqrt(f (1 - f) / n); one round-up more or less
/// (step / n) covers the discreteness when n f is small.
double rounding_tolerance(double x, double lo, double step, int n) {
  if (!(step > 0)) return 1e-6;
  double const v = (x - lo) / step;
  double const f = v - std::floor(v);
  return 5.0 * step * std::sqrt(f * (1 - f) / n) + step / n + 1e-6 * (1 + std::fabs(x));
}

/// Re-sign the header of a blob whose header bytes were edited (so the edit passes the checksum).
void resign(bytes& b) {
  int const nd = std::min<int>(b[8], 8);
  std::uint32_t const extra = 8u * std::uint32_t(nd) + hd::params_bytes(b[6], b[12]);
  if (b.size() >= std::size_t(64 + extra)) {
    std::uint32_t const c = hd::header_checksum(b.data(), extra);
    std::memcpy(b.data() + 60, &c, 4);
  }
}

}  // namespace

TEST_SUITE("codecs") {

// ---- normalized -----------------------------------------------------------------------------

/// Per-channel statistics of an NCHW (inner = H*W) or NHWC (inner = 1) tensor laid out in memory.
struct norm_case {
  std::vector<float> x, shift, scale;
  std::uint64_t count, inner;

  /// Encode parameters of the normalized variant with these statistics, `bits` wide.
  encode_params params(int bits = 4) const {
    encode_params p;
    p.bits = bits;
    p.variant = std::uint8_t(quant_mode::normalized);
    p.norm_count = count;
    p.norm_inner = inner;
    p.norm_shift = shift.data();
    p.norm_scale = scale.data();
    return p;
  }
};

norm_case batch_norm_case(int n, int c, int hw, bool channels_last, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> scale_of(0.01f, 30.f), mean_of(-50.f, 50.f);
  std::vector<float> mu(std::size_t(c), 0.f), sd(std::size_t(c), 0.f);
  for (int i = 0; i < c; ++i) {
    mu[std::size_t(i)] = mean_of(rng);
    sd[std::size_t(i)] = scale_of(rng);
  }
  std::normal_distribution<float> z(0.f, 1.f);
  norm_case k;
  k.x.resize(std::size_t(n * c * hw));
  for (int b = 0; b < n; ++b)
    for (int ch = 0; ch < c; ++ch)
      for (int s = 0; s < hw; ++s) {
        std::size_t const idx = channels_last ? std::size_t((b * hw + s) * c + ch) : std::size_t((b * c + ch) * hw + s);
        k.x[idx] = mu[std::size_t(ch)] + sd[std::size_t(ch)] * z(rng);
      }
  k.shift = mu;
  for (auto s : sd) k.scale.push_back(1.f / s);
  k.count = std::uint64_t(c);
  k.inner = channels_last ? 1 : std::uint64_t(hw);
  return k;
}

TEST_CASE("normalized quant: each element's error is within its block's step, bounds exact in float32") {
  for (bool cl : {false, true}) {
    norm_case const k = batch_norm_case(4, 24, 7 * 7, cl, 3);  // groups span channels (49 < 256)
    for (dtype dt : k_float_dtypes) {
      for (int bits : {1, 2, 4, 8}) {
        encode_params p = k.params(bits);
        auto const t = make_tensor(dt, k.x);
        auto const xin = values(dt, t.data(), k.x.size());
        auto const b = encode_ok(t, dt, {4, 24, 7, 7}, p);
        auto const y = decode_all(b);
        // Normalized values of a group lie within ~[-6, 6]: the step in z is at most 12 / (2^b - 1);
        // an element's error is its block's 1/scale times that, plus rounding to the dtype.
        double worst = 0;
        for (std::size_t e = 0; e < y.size(); ++e) {
          std::size_t const ch = cl ? e % 24 : (e / 49) % 24;
          double const zstep = 14.0 / ((1 << bits) - 1);
          double const bound = zstep / double(k.scale[ch]) + std::fabs(xin[e]) * (dt == dtype::bfloat16 ? 1e-2 : 2e-3) + 1e-6;
          worst = std::max(worst, std::fabs(y[e] - xin[e]) / bound);
        }
        CHECK_MESSAGE(worst <= 1.0, "dtype " << dtype_name(dt) << " bits " << bits << " cl " << cl << " worst " << worst);
        blob_info const info = parse(b.data(), b.size());
        CHECK(info.variant == std::uint8_t(quant_mode::normalized));
        CHECK(info.normalized.count == k.count);
        CHECK(info.normalized.inner == k.inner);
      }
    }
  }
}

TEST_CASE("normalized quant: groups spanning channels get each channel's own noise (error scales with its std)") {
  // Two channels with stds 1000 and 0.01 interleaved in one group: plain quant gives the narrow channel
  // the wide channel's step, normalized quant gives it its own.
  std::vector<float> x(256);
  std::mt19937 rng(5);
  std::normal_distribution<float> z(0.f, 1.f);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = (i % 2 == 0 ? 1000.f : 0.01f) * z(rng);
  std::vector<float> const shift{0.f, 0.f}, scale{1e-3f, 100.f};
  encode_params p;
  p.bits = 4;
  p.variant = std::uint8_t(quant_mode::normalized);
  p.norm_count = 2;
  p.norm_inner = 1;
  p.norm_shift = shift.data();
  p.norm_scale = scale.data();
  auto const yn = decode_all(encode_ok(make_tensor(dtype::float32, x), dtype::float32, {256}, p));
  encode_params plain;
  plain.bits = 4;
  auto const yp = decode_all(encode_ok(make_tensor(dtype::float32, x), dtype::float32, {256}, plain));
  double en = 0, ep = 0;
  for (std::size_t i = 1; i < x.size(); i += 2) {
    en = std::max(en, std::fabs(yn[i] - double(x[i])));
    ep = std::max(ep, std::fabs(yp[i] - double(x[i])));
  }
  CHECK(en < 0.01);   // within the narrow channel's own step (std 0.01 * ~8 / 15)
  CHECK(ep > 10.0);   // the wide channel's step
}

TEST_CASE("normalized quant: unbiased; the mean over 400 seeds is within 5 sigma / sqrt(n) of x") {
  norm_case const k = batch_norm_case(2, 8, 25, false, 9);
  encode_params p = k.params(2);
  auto const t = make_tensor(dtype::float32, k.x);
  int const n = 400;
  std::vector<double> sum(k.x.size(), 0.0);
  bytes blob;
  for (int s = 0; s < n; ++s) {
    p.seed = std::uint64_t(s) * 7919u + 1;
    blob = encode_ok(t, dtype::float32, {std::int64_t(k.x.size())}, p);
    auto const y = decode_all(blob);
    for (std::size_t i = 0; i < y.size(); ++i) sum[i] += y[i];
  }
  // The lattice of element e: z in [zmin, zmax] of its group (float32 metadata after the statistics).
  hd::blob_layout const lay = hd::compute_layout(1, 1, 0, 1, k.x.size(), 2, 256, k.count);
  int bad = 0;
  for (std::size_t i = 0; i < k.x.size(); ++i) {
    std::size_t const g = i / 256, ch = (i / 25) % 8;
    float zb[2];
    std::memcpy(zb, blob.data() + lay.header_bytes + lay.stats_bytes + 8 * g, 8);
    double const sh = double(hd::round_bf16(k.shift[ch])), sc = double(hd::round_bf16(k.scale[ch]));  // as stored
    double const inv = 1.0 / sc;
    double const z = (double(k.x[i]) - sh) * sc;
    double const tol = rounding_tolerance(z, double(zb[0]), (double(zb[1]) - double(zb[0])) / 3.0, n) * inv;
    if (std::fabs(sum[i] / n - double(k.x[i])) > tol) ++bad;
  }
  // 5 sigma: the chance that any of 400 unbiased coordinates fails is about 2e-4.
  CHECK(bad == 0);
}

TEST_CASE("normalized quant: layer-norm rows (inner = D) and any count; bad statistics are rejected") {
  auto const x = normal_values(6 * 40, 11, 3.f, 2.f);
  std::vector<float> shift(6, 3.f), scale(6, 0.5f);
  encode_params p;
  p.variant = std::uint8_t(quant_mode::normalized);
  p.norm_count = 6;
  p.norm_inner = 40;
  p.norm_shift = shift.data();
  p.norm_scale = scale.data();
  for (int threads : {1, 3}) {
    auto const a = encode_ok(make_tensor(dtype::float32, x), dtype::float32, {6, 40}, p, 1);
    auto const b = encode_ok(make_tensor(dtype::float32, x), dtype::float32, {6, 40}, p, threads);
    CHECK(a == b);
  }
  bytes blob(blob_size(dtype::float32, std::vector<std::int64_t>{240}, p));
  auto const t = make_tensor(dtype::float32, x);
  scale[2] = 0.f;
  CHECK_THROWS_WITH_AS(encode_cpu(t.data(), dtype::float32, std::vector<std::int64_t>{240}, p, blob.data(), blob.size(), 1),
                       doctest::Contains("scale"), gact::invalid_argument);
  scale[2] = 0.5f;
  p.norm_count = 0;
  CHECK_THROWS_AS(blob_size(dtype::float32, std::vector<std::int64_t>{240}, p), gact::invalid_argument);
  p.norm_count = 6;
  // A corrupted statistic in a valid blob: corrupt_blob naming the statistics, never a decode.
  auto good = encode_ok(t, dtype::float32, {240}, p);
  hd::blob_layout const lay = hd::compute_layout(1, 1, 0, 1, 240, 4, 256, 6);
  std::uint16_t const neg = hd::float_to_bf16(-1.f);
  std::memcpy(good.data() + lay.header_bytes + 4 * 3 + 2, &neg, 2);
  CHECK_THROWS_WITH_AS(parse(good.data(), good.size()), doctest::Contains("statistics"), gact::corrupt_blob);
}

// ---- boundary ---------------------------------------------------------------------------

TEST_CASE("boundary quant: zeros exact, positives never decode to 0, predicate read from codes is exact") {
  for (dtype dt : k_float_dtypes) {
    for (int bits : {2, 4, 8}) {
      auto const x = relu_values(3001, 21);
      auto const t = make_tensor(dt, x);
      auto const xin = values(dt, t.data(), x.size());
      encode_params p;
      p.bits = bits;
      p.variant = std::uint8_t(quant_mode::boundary);
      p.boundary = {0.f, 0.f, 0, 0};
      auto const b = encode_ok(t, dt, {3001}, p);
      auto const y = decode_all(b);
      decode_params dp;
      dp.predicate = true;
      dp.true_value = 1.f;
      dp.false_value = 0.f;
      auto const m = decode_all(b, dp);
      int mismatches = 0, zero_flips = 0;
      for (std::size_t i = 0; i < x.size(); ++i) {
        mismatches += (m[i] == 1.0) != (xin[i] > 0.0);
        zero_flips += (xin[i] > 0.0) != (y[i] > 0.0);
        CHECK(y[i] >= 0.0);
      }
      CHECK_MESSAGE(mismatches == 0, dtype_name(dt) << " bits " << bits);
      CHECK_MESSAGE(zero_flips == 0, dtype_name(dt) << " bits " << bits);
    }
  }
}

TEST_CASE("boundary quant: two boundaries (a clamp to [0, 6]) keep both exact; the open predicate is exact") {
  auto v = normal_values(2000, 23, 3.f, 4.f);
  for (auto& x : v) x = std::min(6.f, std::max(0.f, x));
  encode_params p;
  p.bits = 2;
  p.variant = std::uint8_t(quant_mode::boundary);
  p.boundary = {0.f, 6.f, 1, 0};
  auto const b = encode_ok(make_tensor(dtype::float32, v), dtype::float32, {2000}, p);
  auto const y = decode_all(b);
  decode_params dp;
  dp.predicate = true;
  dp.true_value = 3.f;
  dp.false_value = 0.f;
  auto const m = decode_all(b, dp);
  for (std::size_t i = 0; i < v.size(); ++i) {
    CHECK((m[i] == 3.0) == (v[i] > 0.f && v[i] < 6.f));
    if (v[i] == 0.f || v[i] == 6.f) CHECK(y[i] == double(v[i]));
    else CHECK((y[i] > 0.0 && y[i] < 6.0));
  }
}

TEST_CASE("boundary and normalized quant: every build of the CPU loops gives the baseline's bytes") {
  // The vectorized builds (avx2, avx512) encode whole blocks of a group in fused loops of their own;
  // the baseline build runs the per-element hd:: math. Groups of every size, a short last group,
  // constant groups, both boundary forms, channels-first and -last statistics, every dtype and width.
  auto const isas = detail::quant_cpu_isas();
  if (isas.size() == 1) return;  // only the baseline build exists on this CPU
  auto same_in_every_build = [&](bytes const& t, dtype dt, std::vector<std::int64_t> const& shape,
                                 encode_params const& p) {
    REQUIRE(detail::use_quant_cpu_isa("generic"));
    auto const a = encode_ok(t, dt, shape, p);
    auto const ya = decode_all(a);
    for (std::size_t k = 1; k < isas.size(); ++k) {
      CAPTURE(std::string(isas[k]));
      REQUIRE(detail::use_quant_cpu_isa(isas[k]));
      auto const b = encode_ok(t, dt, shape, p);
      CHECK(a == b);
      CHECK(decode_all(b) == ya);
    }
    detail::use_quant_cpu_isa(nullptr);
  };
  for (dtype dt : k_float_dtypes) {
    for (int G : {64, 128, 256, 1024}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(G);
      std::size_t const n = std::size_t(5 * G + 77);
      auto relu = relu_values(n, std::uint32_t(G));
      for (std::size_t i = std::size_t(G); i < std::size_t(2 * G); ++i) relu[i] = 0.f;  // a group of zeros only
      auto clamp6 = normal_values(n, std::uint32_t(G + 1), 3.f, 4.f);
      for (auto& x : clamp6) x = std::min(6.f, std::max(0.f, x));
      for (int bits : {2, 4, 8}) {
        CAPTURE(bits);
        encode_params p;
        p.bits = bits;
        p.group_size = G;
        p.seed = 0xFEEDFACECAFEBEEFull;
        p.key = 0x123456789ull << 20;
        p.variant = std::uint8_t(quant_mode::boundary);
        p.boundary = {0.f, 0.f, 0, 0};
        same_in_every_build(make_tensor(dt, relu), dt, {std::int64_t(n)}, p);
        p.boundary = {0.f, 6.f, 1, 0};
        same_in_every_build(make_tensor(dt, clamp6), dt, {std::int64_t(n)}, p);
      }
      for (bool cl : {false, true}) {
        norm_case const k = batch_norm_case(6, 24, 7 * 7, cl, std::uint32_t(G));
        for (int bits : {1, 2, 4, 8}) {
          CAPTURE(bits);
          CAPTURE(cl);
          encode_params p = k.params(bits);
          p.group_size = G;
          p.seed = 77;
          p.key = 5;
          same_in_every_build(make_tensor(dt, k.x), dt, {6, 24, 7, 7}, p);
        }
      }
    }
  }
}

TEST_CASE("boundary quant: interior values unbiased over seeds") {
  auto const x = relu_values(512, 29);
  encode_params p;
  p.bits = 2;
  p.variant = std::uint8_t(quant_mode::boundary);
  auto const t = make_tensor(dtype::float32, x);
  int const n = 400;
  std::vector<double> sum(x.size(), 0.0);
  for (int s = 0; s < n; ++s) {
    p.seed = std::uint64_t(s) + 100;
    auto const y = decode_all(encode_ok(t, dtype::float32, {512}, p));
    for (std::size_t i = 0; i < y.size(); ++i) sum[i] += y[i];
  }
  int bad = 0;
  for (std::size_t g = 0; g < 2; ++g) {
    double imin = 1e30, imax = 0;  // the interior (positive values) of the group: 2 intervals at 2 bits
    for (std::size_t i = g * 256; i < g * 256 + 256; ++i)
      if (x[i] > 0.f) {
        imin = std::min(imin, double(x[i]));
        imax = std::max(imax, double(x[i]));
      }
    for (std::size_t i = g * 256; i < g * 256 + 256; ++i) {
      double const tol = x[i] > 0.f ? rounding_tolerance(double(x[i]), imin, (imax - imin) / 2.0, n) : 0.0;
      if (std::fabs(sum[i] / n - double(x[i])) > tol) ++bad;
    }
  }
  CHECK(bad == 0);
}

/// The largest |mean - x| over n seeds' decodes of ``t`` encoded with ``p`` (groups of 256), in standard errors of an
/// unbiased rounding: an element decodes to the two values a < b around x (those seen), b with probability
/// q = (x - a) / (b - a), so its mean has the standard error (b - a) sqrt(q (1 - q) / n), taken at least
/// (b - a) sqrt(4 / n) / sqrt(n) (a count of a few, where the normal approximation says nothing: 6 of them is
/// at least 12 moves off, a chance below 1e-6 at any q). An element that decoded to one value only moved with a
/// probability below 15 / n (or that happened with a chance under e^-15), by at most its group's widest pair of
/// values seen: its measure is its error over 6 / 15 of that bound. Unbiased codes stay below 6.
double worst_bias(bytes const& t, dtype dt, std::vector<std::int64_t> const& shape, encode_params p, int n) {
  std::size_t count = 1;
  for (auto d : shape) count *= std::size_t(d);
  auto const x = values(dt, t.data(), count);
  std::vector<double> sum(count, 0.0), lo(count, 1e300), hi(count, -1e300);
  for (int s = 0; s < n; ++s) {
    p.seed = std::uint64_t(s) * 7919u + 3;
    auto const y = decode_all(encode_ok(t, dt, shape, p));
    for (std::size_t i = 0; i < count; ++i) {
      sum[i] += y[i];
      lo[i] = std::min(lo[i], y[i]);
      hi[i] = std::max(hi[i], y[i]);
    }
  }
  std::vector<double> widest((count + 255) / 256, 0.0);
  for (std::size_t i = 0; i < count; ++i) widest[i / 256] = std::max(widest[i / 256], hi[i] - lo[i]);
  double worst = 0;
  for (std::size_t i = 0; i < count; ++i) {
    double const err = std::fabs(sum[i] / n - x[i]), d = hi[i] - lo[i];
    double unit;
    if (d > 0) {
      double const q = std::min(1.0, std::max(0.0, (x[i] - lo[i]) / d));
      unit = d * std::sqrt(std::max(q * (1 - q), 4.0 / n) / n);
    } else {
      unit = 6.0 / 15.0 * 15.0 / n * widest[i / 256];
    }
    worst = std::max(worst, unit > 0 ? err / unit : (err > 1e-6 * std::fabs(x[i]) ? 1e9 : 0.0));
  }
  return worst;
}

TEST_CASE("16-bit outputs: boundary and normalized codes are unbiased against the values the decode rounds to") {
  // At 8 bits a bfloat16 unit is about the step: codes chosen against the float32 grid values, which the decode
  // then rounds to the dtype, left means up to half a unit off, 10-40 standard errors at 400 seeds.
  for (dtype dt : {dtype::bfloat16, dtype::float16}) {
    CAPTURE(dtype_name(dt));
    encode_params p;
    p.bits = 8;
    p.variant = std::uint8_t(quant_mode::boundary);
    auto const r = relu_values(1024, 31);
    CHECK(worst_bias(make_tensor(dt, r), dt, {1024}, p, 400) < 6.0);
    norm_case const k = batch_norm_case(2, 8, 25, false, 9);
    CHECK(worst_bias(make_tensor(dt, k.x), dt, {std::int64_t(k.x.size())}, k.params(8), 400) < 6.0);
    encode_params plain;
    plain.bits = 8;
    CHECK(worst_bias(make_tensor(dt, k.x), dt, {std::int64_t(k.x.size())}, plain, 400) < 6.0);
  }
  // The scaled domains: a bfloat16 group whose range exceeds FLT_MAX (halved: the two decoded values' difference
  // overflowed, and every value decoded to lo at 1 bit) and one whose range is below 2^-100 (scaled by 2^64)
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> wide(-3.3e38, 3.3e38), tiny(1e-31, 6e-31);
  std::vector<float> huge(256), small(256);
  for (std::size_t i = 0; i < 256; ++i) {
    huge[i] = float(wide(rng));
    small[i] = float(tiny(rng));
  }
  huge[0] = -3.3895314e38f;
  huge[1] = 3.3895314e38f;
  for (int bits : {1, 2, 4, 8}) {
    CAPTURE(bits);
    encode_params p;
    p.bits = bits;
    CHECK(worst_bias(make_tensor(dtype::bfloat16, huge), dtype::bfloat16, {256}, p, 400) < 6.0);
    CHECK(worst_bias(make_tensor(dtype::bfloat16, small), dtype::bfloat16, {256}, p, 400) < 6.0);
  }
}

TEST_CASE("boundary quant: refusals and bad parameters") {
  encode_params p;
  p.bits = 4;
  p.variant = std::uint8_t(quant_mode::boundary);
  std::vector<float> x(300, 1.f);
  x[7] = -0.5f;  // below lo: not the output of a clamp to [0, inf)
  bytes b(blob_size(dtype::float32, std::vector<std::int64_t>{300}, p));
  auto const t = make_tensor(dtype::float32, x);
  auto r = encode_cpu(t.data(), dtype::float32, std::vector<std::int64_t>{300}, p, b.data(), b.size(), 1);
  CHECK(r.refused == refusal::out_of_range);
  CHECK_THROWS_AS(parse(b.data(), b.size()), gact::corrupt_blob);  // no valid blob left behind
  x[7] = std::nanf("");
  auto const tn = make_tensor(dtype::float32, x);
  r = encode_cpu(tn.data(), dtype::float32, std::vector<std::int64_t>{300}, p, b.data(), b.size(), 1);
  CHECK(r.refused == refusal::nonfinite);
  CHECK(r.nonfinite);
  p.bits = 1;
  CHECK_THROWS_WITH_AS(blob_size(dtype::float32, std::vector<std::int64_t>{300}, p), doctest::Contains("at least 2"),
                       gact::invalid_argument);
  p.bits = 4;
  p.boundary = {1.f, 1.f, 1, 0};  // hi must exceed lo
  CHECK_THROWS_AS(blob_size(dtype::float32, std::vector<std::int64_t>{300}, p), gact::invalid_argument);
  // values asked as a predicate of a blob that holds none
  encode_params plain;
  auto const pb = encode_ok(make_tensor(dtype::float32, normal_values(300, 1)), dtype::float32, {300}, plain);
  decode_params dp;
  dp.predicate = true;
  std::vector<float> out(300);
  CHECK_THROWS_WITH_AS(decode_cpu(pb.data(), pb.size(), out.data(), out.size() * 4, 1, dp),
                       doctest::Contains("holds none"), gact::invalid_argument);
}

// ---- predicate masks -----------------------------------------------------------------------

TEST_CASE("predicate masks: every predicate x dtype is exact, decodes to the caller's two values") {
  // 1003: a tail of 3 elements; 8197: two whole 4096-element decode chunks and a tail in the third.
  for (std::size_t const n : {std::size_t(1003), std::size_t(8197)}) {
    CAPTURE(n);
    auto x = normal_values(n, 31, 0.f, 3.f);
    x[0] = 0.f;
    x[1] = 1.f;
    x[2] = -1.f;
    x[3] = 6.f;
    x[4] = std::nanf("");
    struct row {
      predicate pr;
      float a, b;
    } const rows[] = {{predicate::gt, 0.f, 0.f},    {predicate::ge, 1.f, 0.f},    {predicate::lt, -1.f, 0.f},
                      {predicate::le, 0.f, 0.f},    {predicate::open, 0.f, 6.f},  {predicate::closed, -1.f, 1.f},
                      {predicate::gt_or_nan, 0.f, 0.f}};
    for (dtype dt : k_float_dtypes) {
      auto const t = make_tensor(dt, x);
      auto const xin = values(dt, t.data(), x.size());
      for (auto const& r : rows) {
        encode_params p;
        p.codec = codec_id::mask;
        p.variant = std::uint8_t(mask_mode::predicate);
        p.pred = {std::uint32_t(r.pr), r.a, r.b, 0.f};
        auto const b = encode_ok(t, dt, {std::int64_t(n)}, p, 2);
        CHECK(b.size() == 64 + 8 + 16 + 8 + (n + 7) / 8);  // header + shape + params (+ pad) + 1 bit each
        decode_params dp;
        dp.true_value = 2.5f;
        dp.false_value = -7.f;
        auto const y = decode_all(b, dp);
        for (std::size_t i = 0; i < x.size(); ++i) {
          bool const want = hd::eval_predicate(std::uint32_t(r.pr), r.a, r.b, float(xin[i]));
          CHECK(y[i] == (want ? 2.5 : -7.0));
        }
        // NaN (x[4]) satisfies ne and gt_or_nan only (torch's threshold_backward zeroes the gradient only
        // where x <= a, so a NaN passes it)
        bool const nan_true = r.pr == predicate::gt_or_nan;
        CHECK(y[4] == (nan_true ? 2.5 : -7.0));
        if (r.pr == predicate::gt_or_nan) {
          CHECK(y[0] == -7.0);  // 0 <= 0
          CHECK(y[1] == 2.5);
          CHECK(y[2] == -7.0);
        }
      }
    }
  }
}

TEST_CASE("predicate masks: in_range tells a clamp's output; ne keeps a two-level tensor's level") {
  std::vector<float> relu = relu_values(900, 41), raw = normal_values(900, 42);
  encode_params p;
  p.codec = codec_id::mask;
  p.variant = std::uint8_t(mask_mode::predicate);
  p.pred = {std::uint32_t(predicate::gt), 0.f, 0.f, 0.f};
  encode_result r{};
  encode_ok(make_tensor(dtype::float32, relu), dtype::float32, {900}, p, 1, &r);
  CHECK(r.in_range);
  encode_ok(make_tensor(dtype::float32, raw), dtype::float32, {900}, p, 1, &r);
  CHECK_FALSE(r.in_range);
  // dropout on the CPU: the saved tensor holds 0 and 1/(1-p)
  std::vector<float> drop(900);
  for (std::size_t i = 0; i < drop.size(); ++i) drop[i] = (i * 7919) % 3 == 0 ? 0.f : 1.f / 0.7f;
  p.pred = {std::uint32_t(predicate::ne), 0.f, 0.f, 0.f};
  for (int threads : {1, 4}) {
    auto const b = encode_ok(make_tensor(dtype::float32, drop), dtype::float32, {900}, p, threads);
    CHECK(parse(b.data(), b.size()).pred.level == 1.f / 0.7f);
    auto const y = decode_all(b);
    for (std::size_t i = 0; i < drop.size(); ++i) CHECK(y[i] == double(drop[i]));
  }
  drop[5] = 2.f;  // a third level: refused, not silently wrong
  bytes b(blob_size(dtype::float32, std::vector<std::int64_t>{900}, p));
  auto const t = make_tensor(dtype::float32, drop);
  CHECK(encode_cpu(t.data(), dtype::float32, std::vector<std::int64_t>{900}, p, b.data(), b.size(), 1).refused ==
        refusal::not_two_level);
  p.pred = {99, 0.f, 0.f, 0.f};
  CHECK_THROWS_WITH_AS(blob_size(dtype::float32, std::vector<std::int64_t>{900}, p), doctest::Contains("predicate"),
                       gact::invalid_argument);
  p.pred = {std::uint32_t(predicate::open), 6.f, 0.f, 0.f};  // a >= b
  CHECK_THROWS_AS(blob_size(dtype::float32, std::vector<std::int64_t>{900}, p), gact::invalid_argument);
}

// ---- window ---------------------------------------------------------------------------------

/// max_pool over an (N, C, *in) tensor, returning (N, C, *out) flat indices into each input plane.
struct pool_case {
  window_params w{};
  std::vector<std::int64_t> idx;
  std::vector<std::int64_t> shape;
};

pool_case max_pool(int nd, std::vector<std::int64_t> in, std::vector<std::int64_t> k, std::vector<std::int64_t> s,
                   std::vector<std::int64_t> pad, std::vector<std::int64_t> dil, bool channels_last, std::uint32_t seed) {
  int const N = 2, C = 3;
  pool_case pc;
  pc.w.nd = std::uint32_t(nd);
  std::int64_t in_plane = 1, out_plane = 1;
  for (int d = 0; d < nd; ++d) {
    pc.w.in[d] = in[std::size_t(d)];
    pc.w.kernel[d] = k[std::size_t(d)];
    pc.w.stride[d] = s[std::size_t(d)];
    pc.w.pad[d] = pad[std::size_t(d)];
    pc.w.dilation[d] = dil[std::size_t(d)];
    pc.w.out[d] = (in[std::size_t(d)] + 2 * pad[std::size_t(d)] - dil[std::size_t(d)] * (k[std::size_t(d)] - 1) - 1) /
                      s[std::size_t(d)] + 1;
    in_plane *= pc.w.in[d];
    out_plane *= pc.w.out[d];
  }
  pc.w.inner = channels_last ? std::uint64_t(C) : 1;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> x(std::size_t(N * C * in_plane));
  for (auto& v : x) v = u(rng);
  pc.idx.resize(std::size_t(N * C * out_plane));
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c)
      for (std::int64_t os = 0; os < out_plane; ++os) {
        std::int64_t o[3] = {0, 0, 0}, rest = os;
        for (int d = nd - 1; d >= 0; --d) {
          o[d] = rest % pc.w.out[d];
          rest /= pc.w.out[d];
        }
        float best = -2.f;
        std::int64_t arg = -1;
        std::int64_t kk[3] = {0, 0, 0};
        std::int64_t const kvol = k[0] * (nd > 1 ? k[1] : 1) * (nd > 2 ? k[2] : 1);
        for (std::int64_t kc = 0; kc < kvol; ++kc) {
          std::int64_t r2 = kc;
          for (int d = nd - 1; d >= 0; --d) {
            kk[d] = r2 % k[std::size_t(d)];
            r2 /= k[std::size_t(d)];
          }
          std::int64_t flat = 0;
          bool inside = true;
          for (int d = 0; d < nd; ++d) {
            std::int64_t const i = o[d] * s[std::size_t(d)] - pad[std::size_t(d)] + kk[d] * dil[std::size_t(d)];
            inside = inside && i >= 0 && i < in[std::size_t(d)];
            flat = flat * in[std::size_t(d)] + i;
          }
          if (!inside) continue;
          float const v = x[std::size_t((n * C + c) * in_plane + flat)];
          if (v > best) {
            best = v;
            arg = flat;
          }
        }
        std::size_t const pos = channels_last ? std::size_t((n * out_plane + os) * C + c)
                                              : std::size_t((n * C + c) * out_plane + os);
        pc.idx[pos] = arg;
      }
  pc.shape = {N, C};
  for (int d = 0; d < nd; ++d) pc.shape.push_back(pc.w.out[d]);
  return pc;
}

TEST_CASE("window codec: max-pool indices round-trip exactly in 4 bits (1d, 2d, 3d, padding, dilation, layouts)") {
  struct cfg {
    int nd;
    std::vector<std::int64_t> in, k, s, pad, dil;
    int bits;
  } const cases[] = {
      {2, {9, 11}, {3, 3}, {2, 2}, {1, 1}, {1, 1}, 4},   // resnet's stem pool
      {2, {8, 8}, {2, 2}, {2, 2}, {0, 0}, {1, 1}, 2},
      {2, {10, 7}, {3, 2}, {1, 2}, {1, 0}, {2, 1}, 4},   // dilation, uneven
      {1, {17}, {5}, {3}, {2}, {1}, 4},
      {3, {5, 6, 7}, {2, 2, 2}, {2, 2, 2}, {0, 1, 0}, {1, 1, 1}, 4},
  };
  for (auto const& c : cases) {
    for (bool cl : {false, true}) {
      pool_case const pc = max_pool(c.nd, c.in, c.k, c.s, c.pad, c.dil, cl, 7);
      for (dtype dt : {dtype::int64, dtype::int32}) {
        bytes t(pc.idx.size() * dtype_size(dt));
        for (std::size_t i = 0; i < pc.idx.size(); ++i) {
          if (dt == dtype::int64) std::memcpy(t.data() + 8 * i, &pc.idx[i], 8);
          else {
            std::int32_t const v = std::int32_t(pc.idx[i]);
            std::memcpy(t.data() + 4 * i, &v, 4);
          }
        }
        encode_params p;
        p.codec = codec_id::window;
        p.bits = c.bits;
        p.window = pc.w;
        auto const b = encode_ok(t, dt, pc.shape, p);
        hd::blob_layout const lay = hd::compute_layout(3, 0, std::uint8_t(dt), int(pc.shape.size()), pc.idx.size(),
                                                       c.bits, 0, 0);
        CHECK(b.size() == lay.header_bytes + (pc.idx.size() + 7) / 8 * std::size_t(c.bits));  // bits per index
        blob_info const info = parse(b.data(), b.size());
        bytes out(t.size());
        decode_cpu(b.data(), b.size(), out.data(), out.size(), 1);
        CHECK(out == t);
        CHECK(info.window.nd == std::uint32_t(c.nd));
      }
    }
  }
}

TEST_CASE("window codec: an index outside its window is refused; a corrupt code is reported, never decoded") {
  pool_case pc = max_pool(2, {9, 9}, {3, 3}, {2, 2}, {1, 1}, {1, 1}, false, 3);
  encode_params p;
  p.codec = codec_id::window;
  p.bits = 4;
  p.window = pc.w;
  auto good = pc.idx;
  pc.idx[10] = 80;  // the far corner of the plane: not in output 10's window
  bytes t(pc.idx.size() * 8);
  std::memcpy(t.data(), pc.idx.data(), t.size());
  bytes b(blob_size(dtype::int64, pc.shape, p));
  CHECK(encode_cpu(t.data(), dtype::int64, pc.shape, p, b.data(), b.size(), 1).refused == refusal::not_window);
  std::memcpy(t.data(), good.data(), t.size());
  auto blob = encode_ok(t, dtype::int64, pc.shape, p);
  // Code 15 is beyond a 3x3 window (9 positions): a flipped code bit must not become an index.
  hd::blob_layout const lay = hd::compute_layout(3, 0, 8, 4, good.size(), 4, 0, 0);
  blob[lay.header_bytes] |= 0x0F;
  bytes out(t.size());
  CHECK_THROWS_WITH_AS(decode_cpu(blob.data(), blob.size(), out.data(), out.size(), 1), doctest::Contains("impossible code"),
                       gact::corrupt_blob);
  p.window.kernel[0] = 5;  // 5x3 = 15 positions need 4 bits: fine; 2 bits are too few
  p.bits = 2;
  CHECK_THROWS_WITH_AS(blob_size(dtype::int64, pc.shape, p), doctest::Contains("window"), gact::invalid_argument);
}

// ---- float64 ------------------------------------------------------------------------------

TEST_CASE("float64 quant: error within a step of the float32-rounded values; values float32 cannot hold refused") {
  auto const x = normal_values(1000, 51, 1.f, 1e-3f);
  encode_params p;
  p.bits = 4;
  auto const t = make_tensor(dtype::float64, x);
  auto const b = encode_ok(t, dtype::float64, {1000}, p);
  CHECK(b.size() == 80 + 32 + 1000 / 2);  // header+shape, 4 groups x (2 x float32) metadata, 4-bit codes
  auto const y = decode_all(b);
  for (std::size_t g = 0; g < 4; ++g) {
    std::size_t const e0 = g * 256, e1 = std::min<std::size_t>(1000, e0 + 256);
    auto [mn, mx] = std::minmax_element(x.begin() + long(e0), x.begin() + long(e1));
    double const step = (double(*mx) - double(*mn)) / 15.0;
    for (std::size_t i = e0; i < e1; ++i) CHECK(std::fabs(y[i] - double(x[i])) <= step * (1 + 1e-5) + 1e-12);
  }
  std::vector<double> huge(300, 1.0);
  huge[3] = 1e300;
  bytes hb(huge.size() * 8);
  std::memcpy(hb.data(), huge.data(), hb.size());
  bytes blob(blob_size(dtype::float64, std::vector<std::int64_t>{300}, p));
  auto const r = encode_cpu(hb.data(), dtype::float64, std::vector<std::int64_t>{300}, p, blob.data(), blob.size(), 1);
  CHECK(r.refused == refusal::float64_range);  // (issue 33 row 9: beyond FLT_MAX, and below FLT_MIN too)
  CHECK(r.bytes == 0);
  for (double const v : {1e-40, -1e-50, 4e-39}) {
    std::vector<double> tiny(300, 1.0);
    tiny[7] = v;
    std::memcpy(hb.data(), tiny.data(), hb.size());
    CHECK(encode_cpu(hb.data(), dtype::float64, std::vector<std::int64_t>{300}, p, blob.data(), blob.size(), 2).refused ==
          refusal::float64_range);
  }
  // zero, infinities and NaN are not range problems: zero quantizes, the others are non-finite
  std::vector<double> edge(300, 0.0);
  std::memcpy(hb.data(), edge.data(), hb.size());
  CHECK(encode_cpu(hb.data(), dtype::float64, std::vector<std::int64_t>{300}, p, blob.data(), blob.size(), 1).refused ==
        refusal::none);
  edge[5] = std::numeric_limits<double>::infinity();
  std::memcpy(hb.data(), edge.data(), hb.size());
  CHECK(encode_cpu(hb.data(), dtype::float64, std::vector<std::int64_t>{300}, p, blob.data(), blob.size(), 1).nonfinite);
}

TEST_CASE("quant: max_magnitude refuses a group holding a magnitude at or beyond it, in every dtype and build") {
  // (encode_params::max_magnitude: the store's k_store_max_magnitude keeps a mask's fill exact; 0, the default, sets no
  // limit and such a group is encoded as before)
  std::size_t const n = 300;  // (two groups of 256, the second partial: the tail loop too)
  for (char const* isa : detail::quant_cpu_isas()) {
    REQUIRE(detail::use_quant_cpu_isa(isa));
    for (dtype dt : {dtype::float32, dtype::float16, dtype::bfloat16, dtype::float64}) {
      for (std::uint8_t variant : {std::uint8_t(0), std::uint8_t(quant_mode::normalized)}) {
        for (std::size_t at : {std::size_t{0}, std::size_t{131}, n - 1}) {
          for (float v : {-65504.0f, 32768.0f, 40000.0f, 32767.0f, -32767.0f}) {
            std::vector<float> x(n);
            for (std::size_t i = 0; i < n; ++i) x[i] = float(int(i % 17) - 8) * 0.25f;
            x[at] = v;
            std::vector<unsigned char> t(n * dtype_size(dt));
            for (std::size_t i = 0; i < n; ++i) {
              if (dt == dtype::float32) std::memcpy(t.data() + 4 * i, &x[i], 4);
              else if (dt == dtype::float64) { double const d = x[i]; std::memcpy(t.data() + 8 * i, &d, 8); }
              else {
                std::uint16_t const b = dt == dtype::float16 ? hd::float_to_half(x[i]) : hd::float_to_bf16(x[i]);
                std::memcpy(t.data() + 2 * i, &b, 2);
              }
            }
            std::vector<float> shift(3, 0.0f), scale(3, 1.0f);
            for (float limit : {0.0f, 32768.0f}) {
              encode_params p;
              p.bits = 8;
              p.variant = variant;
              p.max_magnitude = limit;
              if (variant != 0) {
                p.norm_count = 3;
                p.norm_inner = 100;
                p.norm_shift = shift.data();
                p.norm_scale = scale.data();
              }
              std::vector<std::int64_t> const shape{std::int64_t(n)};
              bytes blob(blob_size(dt, shape, p));
              auto const r = encode_cpu(t.data(), dt, shape, p, blob.data(), blob.size(), 1);
              float const held = dt == dtype::float16 ? hd::half_to_float(hd::float_to_half(v))
                                 : dt == dtype::bfloat16 ? hd::bf16_to_float(hd::float_to_bf16(v))
                                                         : v;
              bool const wide = limit > 0.0f && std::fabs(held) >= limit;
              INFO(isa << " " << dtype_name(dt) << " variant " << int(variant) << " value " << v << " at " << at
                       << " limit " << limit);
              CHECK(r.refused == (wide ? refusal::wide : refusal::none));
              CHECK_FALSE(r.nonfinite);
            }
          }
        }
      }
    }
  }
  detail::use_quant_cpu_isa(nullptr);
}

TEST_CASE("float64 quant: the range test's edges, at every position of a vector, in every build of the loops") {
  encode_params p;
  p.bits = 4;
  double const fmin = double(std::numeric_limits<float>::min()), fmax = double(std::numeric_limits<float>::max());
  double const top = std::ldexp(1.0, 126);  // (above it the float32 decode can round past FLT_MAX)
  double const inf = std::numeric_limits<double>::infinity();
  struct edge_case {
    double v;
    refusal want;
  };
  std::vector<edge_case> const cases{
      {fmin, refusal::none}, {-fmin, refusal::none}, {top, refusal::none}, {-top, refusal::none},
      {std::nextafter(top, inf), refusal::float64_range}, {-std::nextafter(top, inf), refusal::float64_range},
      {fmax, refusal::float64_range}, {-fmax, refusal::float64_range},
      {-0.0, refusal::none}, {std::nextafter(fmin, 0.0), refusal::float64_range},
      {-std::nextafter(fmin, 0.0), refusal::float64_range}, {std::numeric_limits<double>::denorm_min(), refusal::float64_range},
      {std::nextafter(fmax, inf), refusal::float64_range}, {-std::nextafter(fmax, inf), refusal::float64_range},
      {std::numeric_limits<double>::max(), refusal::float64_range}};
  std::size_t const n = 37;  // not a multiple of any vector width: the tail loop is tested too
  bytes hb(n * 8), blob(blob_size(dtype::float64, std::vector<std::int64_t>{std::int64_t(n)}, p));
  for (char const* isa : detail::quant_cpu_isas()) {
    REQUIRE(detail::use_quant_cpu_isa(isa));
    for (auto const& c : cases) {
      for (std::size_t at : {std::size_t{0}, std::size_t{5}, n - 1}) {
        std::vector<double> x(n, 0.5);
        x[at] = c.v;
        std::memcpy(hb.data(), x.data(), hb.size());
        auto const r = encode_cpu(hb.data(), dtype::float64, std::vector<std::int64_t>{std::int64_t(n)}, p, blob.data(),
                                  blob.size(), 1);
        INFO(isa << " value " << c.v << " at " << at);
        CHECK(r.refused == c.want);
      }
    }
    // NaN and infinity pass the range test and are reported as non-finite
    for (double v : {inf, -inf, std::numeric_limits<double>::quiet_NaN()}) {
      std::vector<double> x(n, 0.5);
      x[n - 1] = v;
      std::memcpy(hb.data(), x.data(), hb.size());
      auto const r = encode_cpu(hb.data(), dtype::float64, std::vector<std::int64_t>{std::int64_t(n)}, p, blob.data(),
                                blob.size(), 1);
      CHECK(r.refused != refusal::float64_range);
      CHECK(r.nonfinite);
    }
  }
  detail::use_quant_cpu_isa(nullptr);
}

// ---- threads -------------------------------------------------------------------------------

TEST_CASE("a worker thread that cannot be created: the calling thread does its work, same bytes" *
          doctest::test_suite("threads")) {
  auto const x = normal_values(1 << 20, 61);  // 4096 groups: enough work for 4 threads
  auto const t = make_tensor(dtype::float32, x);
  encode_params p;
  std::vector<std::int64_t> const shape{1 << 20};
  auto const fallbacks = [] { return stats_json()["thread_fallbacks"].get<std::uint64_t>(); };
  auto const want = encode_ok(t, dtype::float32, shape, p, 4);
  std::vector<float> want_out(x.size());
  decode_cpu(want.data(), want.size(), want_out.data(), want_out.size() * 4, 4);
  for (int k : {1, 2, 3}) {
    CAPTURE(k);
    auto const before = fallbacks();
    detail::fail_thread_creation_after(k);
    bytes b(blob_size(dtype::float32, shape, p));
    auto const r = encode_cpu(t.data(), dtype::float32, shape, p, b.data(), b.size(), 4);
    std::vector<float> out(x.size(), -1.0f);
    decode_cpu(want.data(), want.size(), out.data(), out.size() * 4, 4);
    detail::fail_thread_creation_after(0);
    CHECK_FALSE(r.nonfinite);
    CHECK(b == want);          // every group encoded, by some thread, with the same noise
    CHECK(out == want_out);    // every element decoded
    CHECK(fallbacks() == before + 2);  // one fallback for the encode, one for the decode
  }
}

// ---- corruption -----------------------------------------------------------------------------

TEST_CASE("corrupted variant blobs (headers, parameters, statistics, codes) decode or are rejected, never overread") {
  std::vector<bytes> valid;
  {
    norm_case const k = batch_norm_case(2, 5, 30, false, 71);
    encode_params p = k.params();
    valid.push_back(encode_ok(make_tensor(dtype::float16, k.x), dtype::float16, {2, 5, 30}, p));
  }
  {
    encode_params p;
    p.bits = 2;
    p.variant = std::uint8_t(quant_mode::boundary);
    p.boundary = {0.f, 0.f, 0, 0};
    valid.push_back(encode_ok(make_tensor(dtype::float32, relu_values(700, 72)), dtype::float32, {700}, p));
  }
  {
    encode_params p;
    p.codec = codec_id::mask;
    p.variant = std::uint8_t(mask_mode::predicate);
    p.pred = {std::uint32_t(predicate::open), 0.f, 6.f, 0.f};
    valid.push_back(encode_ok(make_tensor(dtype::bfloat16, normal_values(500, 73)), dtype::bfloat16, {500}, p));
  }
  {
    pool_case const pc = max_pool(2, {9, 9}, {3, 3}, {2, 2}, {1, 1}, {1, 1}, true, 74);
    encode_params p;
    p.codec = codec_id::window;
    p.bits = 4;
    p.window = pc.w;
    bytes t(pc.idx.size() * 8);
    std::memcpy(t.data(), pc.idx.data(), t.size());
    valid.push_back(encode_ok(t, dtype::int64, pc.shape, p));
  }
  std::mt19937 rng(75);
  int decoded = 0, rejected = 0;
  std::vector<unsigned char> out(1 << 16);
  for (int it = 0; it < 8000; ++it) {
    bytes b = valid[std::size_t(rng()) % valid.size()];
    int const kind = int(rng() % 3);
    if (kind == 0) {
      int const flips = 1 + int(rng() % 4);
      for (int f = 0; f < flips; ++f) b[rng() % b.size()] ^= std::uint8_t(1u << (rng() % 8));
    } else if (kind == 1) {
      b.resize(rng() % b.size());
    } else {  // a header, shape or parameter byte rewritten and re-signed
      std::size_t const hb = std::min<std::size_t>(b.size(), 64 + 8 * 8 + 160);
      std::size_t pos = rng() % hb;
      if (pos >= 60 && pos < 64) pos -= 4;
      b[pos] = std::uint8_t(rng());
      resign(b);
    }
    std::unique_ptr<unsigned char[]> buf(new unsigned char[std::max<std::size_t>(1, b.size())]);
    std::memcpy(buf.get(), b.data(), b.size());
    decode_params dp;
    dp.predicate = (rng() % 2) == 0;
    try {
      decode_cpu(buf.get(), b.size(), out.data(), out.size(), 1, dp);
      ++decoded;
    } catch (gact::corrupt_blob const&) {
      ++rejected;
    } catch (gact::invalid_argument const&) {
      ++rejected;  // a valid blob too large for `out`, or a predicate it does not hold
    }
  }
  CHECK(decoded + rejected == 8000);
  CHECK(rejected > 3000);
  MESSAGE("corrupt variant blobs: " << decoded << " decoded, " << rejected << " rejected");
}

}  // TEST_SUITE
