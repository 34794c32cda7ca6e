// tests/codecs/test_codecs_gpu.cu
//
// The CUDA executor against the CPU executor, on a real GPU (suite 'gpu'; run
// through tools/gpu-check on a lent machine, never in CI). For every dtype x
// bit width x group size, with tail groups and unaligned sources, the device
// blob must equal the host blob byte for byte, and the device decode must equal
// the host decode bit for bit. It also checks the mask and raw codecs, the
// non-finite marker (a NaN group encodes to NaN metadata and decodes to NaN on
// both executors), and decodes corrupted and truncated blobs on the device:
// the status word must be set exactly when decode_cpu throws corrupt_blob, and
// a blob that the host accepts must decode to the same bits on the device.
// The variants (normalized with statistics in device memory, boundary values and
// predicates, predicate masks, the window codec, float64) get the same
// byte-for-byte comparison.
// Every quant encode also asks for a verdict (codecs/verdict.hpp): clean for finite
// input, bad for the non-finite marker's input, and the slot's counter back at 0.
// Exit status 0 when every check passed; each failure prints one line.
// GACT_GPU_TEST_QUICK=1 (tools/gpu-check sets it under compute-sanitizer) runs a
// reduced matrix: one group size and one tail size per dtype and bit width, and
// 100 corrupt blobs instead of 2000.
#include "codecs/codec.hpp"
#include "codecs/float16.hpp"
#include "codecs/verdict.hpp"

#include "allocator/error.hpp"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

using namespace gact::codec;

namespace {

int g_checks = 0, g_failures = 0;
verdict_ring* g_ring = nullptr;  // made in main()

#define CHECK_GPU(cond, ...)                          \
  do {                                                \
    ++g_checks;                                       \
    if (!(cond)) {                                    \
      ++g_failures;                                   \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      std::printf(__VA_ARGS__);                       \
      std::printf("\n");                              \
    }                                                 \
  } while (0)

void cuda_ok(cudaError_t e, char const* what) {
  if (e != cudaSuccess) {
    std::printf("CUDA error in %s: %s\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}

struct dev_buf {
  void* p = nullptr;
  explicit dev_buf(std::size_t n) { cuda_ok(cudaMalloc(&p, n == 0 ? 1 : n), "cudaMalloc"); }
  ~dev_buf() { cudaFree(p); }
  dev_buf(dev_buf const&) = delete;
  dev_buf& operator=(dev_buf const&) = delete;
};

std::vector<unsigned char> make_input(dtype dt, std::size_t n, std::uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.3f, scale);
  std::vector<unsigned char> t(n * dtype_size(dt));
  for (std::size_t i = 0; i < n; ++i) {
    float const v = d(rng);
    if (dt == dtype::float32) std::memcpy(t.data() + 4 * i, &v, 4);
    else {
      std::uint16_t const h = dt == dtype::float16 ? hd::float_to_half(v) : hd::float_to_bf16(v);
      std::memcpy(t.data() + 2 * i, &h, 2);
    }
  }
  return t;
}

/// Encode on both executors (src copied to the device at byte offset `offset`); compare blobs and decodes
/// (decoded with `dp`). A normalized encode's statistics are copied to the device for encode_cuda.
void compare(std::vector<unsigned char> const& host, dtype dt, std::vector<std::int64_t> const& shape,
             encode_params const& p, std::size_t offset, char const* what, decode_params const& dp = {}) {
  std::size_t const bs = blob_size(dt, shape, p);
  std::vector<unsigned char> cpu_blob(bs), gpu_blob(bs);
  auto r = encode_cpu(host.data(), dt, shape, p, cpu_blob.data(), bs, 1);
  CHECK_GPU(r.refused == refusal::none, "%s: CPU refused the input (%s)", what, refusal_name(r.refused));
  dev_buf src(host.size() + offset), blob(bs), out(host.size());
  auto* s = static_cast<unsigned char*>(src.p) + offset;
  cuda_ok(cudaMemcpy(s, host.data(), host.size(), cudaMemcpyHostToDevice), "H2D");
  encode_params pd = p;
  std::size_t const stats_bytes = std::size_t(p.norm_count) * sizeof(float);
  dev_buf shift(stats_bytes), scale(stats_bytes);
  if (p.norm_shift != nullptr) {
    cuda_ok(cudaMemcpy(shift.p, p.norm_shift, stats_bytes, cudaMemcpyHostToDevice), "H2D");
    cuda_ok(cudaMemcpy(scale.p, p.norm_scale, stats_bytes, cudaMemcpyHostToDevice), "H2D");
    pd.norm_shift = static_cast<float const*>(shift.p);
    pd.norm_scale = static_cast<float const*>(scale.p);
  }
  device_verdict dv;
  // (mask and raw ignore a verdict: its slot would never report)
  bool const asks = p.codec == codec_id::quant || p.codec == codec_id::window;
  verdict_ring::ticket ticket;
  if (asks) ticket = g_ring->acquire(&dv);
  encode_cuda(s, dt, shape, pd, blob.p, bs, nullptr, asks ? &dv : nullptr);
  cuda_ok(cudaMemcpy(gpu_blob.data(), blob.p, bs, cudaMemcpyDeviceToHost), "D2H");
  if (asks) {
    verdict_state const v = g_ring->wait(ticket, std::chrono::seconds(5));
    CHECK_GPU(v == verdict_state::clean, "%s: verdict %d for finite input", what, int(v));
    std::uint32_t counter = 1;
    cuda_ok(cudaMemcpy(&counter, dv.counter, 4, cudaMemcpyDeviceToHost), "D2H");
    CHECK_GPU(counter == 0, "%s: verdict counter left at %u", what, counter);
    g_ring->release(ticket);
  }
  std::size_t diff = 0;
  while (diff < bs && cpu_blob[diff] == gpu_blob[diff]) ++diff;
  CHECK_GPU(diff == bs, "%s: blobs differ first at byte %zu of %zu", what, diff, bs);

  std::vector<unsigned char> cpu_out(host.size()), gpu_out(host.size());
  decode_cpu(cpu_blob.data(), bs, cpu_out.data(), cpu_out.size(), 1, dp);
  dev_buf status(4);
  decode_cuda(blob.p, bs, out.p, host.size(), nullptr, static_cast<std::uint32_t*>(status.p), dp);
  std::uint32_t st = 99;
  cuda_ok(cudaMemcpy(gpu_out.data(), out.p, host.size(), cudaMemcpyDeviceToHost), "D2H");
  cuda_ok(cudaMemcpy(&st, status.p, 4, cudaMemcpyDeviceToHost), "D2H");
  CHECK_GPU(st == 0, "%s: device decode status %u", what, st);
  CHECK_GPU(cpu_out == gpu_out, "%s: decodes differ", what);
}

}  // namespace

int main() {
  char const* quick_env = std::getenv("GACT_GPU_TEST_QUICK");
  bool const quick = quick_env != nullptr && *quick_env != '\0' && *quick_env != '0';
  if (quick) std::printf("quick mode (GACT_GPU_TEST_QUICK): reduced matrix\n");
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
    std::printf("no CUDA device: nothing to check\n");
    return 77;  // meson's "skipped"
  }
  auto ring = verdict_ring::create_device(64);  // (64 slots: compare() reuses them, round robin)
  g_ring = ring.get();
  char what[160];
  // 1. Every dtype x bits x group size, sizes with tails, aligned and unaligned sources.
  for (dtype dt : {dtype::float32, dtype::float16, dtype::bfloat16}) {
    for (int bits : {1, 2, 4, 8}) {
      for (int G : {64, 128, 256, 512, 1024}) {
        if (quick && G != 256) continue;
        for (std::size_t n : {std::size_t(1), std::size_t(G - 3), std::size_t(5 * G + 13), std::size_t(100003)}) {
          if (quick && n != std::size_t(5 * G + 13)) continue;
          for (std::size_t offset : {std::size_t(0), dtype_size(dt)}) {
            encode_params p;
            p.bits = bits;
            p.group_size = G;
            p.seed = 0x1234 + n;
            p.key = 77;
            std::snprintf(what, sizeof what, "%s bits=%d G=%d n=%zu offset=%zu", dtype_name(dt), bits, G, n, offset);
            compare(make_input(dt, n, std::uint32_t(n + bits), 2.f), dt, {std::int64_t(n)}, p, offset, what);
          }
        }
      }
    }
  }
  // Edge values: constant groups, huge ranges, denormals, empty tensors.
  {
    encode_params p;
    std::vector<float> x(3000, 1.25f);
    for (std::size_t i = 1000; i < 2000; ++i) x[i] = (i % 2 ? 3.0e38f : -3.0e38f);
    for (std::size_t i = 2000; i < 3000; ++i) x[i] = float(i % 97) * 1e-42f;
    std::vector<unsigned char> t(x.size() * 4);
    std::memcpy(t.data(), x.data(), t.size());
    for (int bits : {1, 2, 4, 8}) {
      p.bits = bits;
      std::snprintf(what, sizeof what, "edge values bits=%d", bits);
      compare(t, dtype::float32, {3, 1000}, p, 0, what);
    }
    compare({}, dtype::float32, {0, 7}, p, 0, "numel 0");
  }
  // 2. mask (bool) and raw.
  {
    std::vector<unsigned char> m(10007);
    std::mt19937 rng(3);
    for (auto& v : m) v = std::uint8_t(rng() & 1);
    encode_params p;
    p.codec = codec_id::mask;
    compare(m, dtype::boolean, {std::int64_t(m.size())}, p, 0, "mask");
    p.codec = codec_id::raw;
    compare(m, dtype::int8, {std::int64_t(m.size())}, p, 0, "raw int8");
    compare(m, dtype::uint8, {std::int64_t(m.size())}, p, 1, "raw uint8 unaligned");
  }
  // 3. Non-finite groups: NaN metadata, NaN decode on both executors.
  for (dtype dt : {dtype::float32, dtype::float16, dtype::bfloat16}) {
    std::size_t const n = 1000;
    auto host = make_input(dt, n, 5, 1.f);
    float const nan = std::nanf("");
    if (dt == dtype::float32) std::memcpy(host.data() + 4 * 300, &nan, 4);
    else {
      std::uint16_t const h = 0x7C00;  // +Inf in float16; a large finite value... use NaN for bf16
      std::uint16_t const b = 0x7FC0;
      std::memcpy(host.data() + 2 * 300, dt == dtype::float16 ? &h : &b, 2);
    }
    encode_params p;
    std::vector<std::int64_t> const shape{std::int64_t(n)};
    std::size_t const bs = blob_size(dt, shape, p);
    dev_buf src(host.size()), blob(bs);
    cuda_ok(cudaMemcpy(src.p, host.data(), host.size(), cudaMemcpyHostToDevice), "H2D");
    device_verdict dv;
    auto const ticket = g_ring->acquire(&dv);
    encode_cuda(src.p, dt, shape, p, blob.p, bs, nullptr, &dv);
    std::vector<unsigned char> gb(bs);
    cuda_ok(cudaMemcpy(gb.data(), blob.p, bs, cudaMemcpyDeviceToHost), "D2H");
    CHECK_GPU(g_ring->wait(ticket, std::chrono::seconds(5)) == verdict_state::bad, "%s: verdict of a NaN group not bad",
              dtype_name(dt));
    g_ring->release(ticket);
    auto info = parse(gb.data(), bs);
    CHECK_GPU(info.nonfinite_groups == 1, "%s: nonfinite_groups %llu", dtype_name(dt),
              (unsigned long long)info.nonfinite_groups);
    std::vector<unsigned char> out(host.size());
    decode_cpu(gb.data(), bs, out.data(), out.size(), 1);
    for (std::size_t i = 0; i < n; ++i) {
      float v;
      if (dt == dtype::float32) std::memcpy(&v, out.data() + 4 * i, 4);
      else {
        std::uint16_t h;
        std::memcpy(&h, out.data() + 2 * i, 2);
        v = dt == dtype::float16 ? hd::half_to_float(h) : hd::bf16_to_float(h);
      }
      CHECK_GPU(std::isnan(v) == (i >= 256 && i < 512), "%s: element %zu nan=%d", dtype_name(dt), i, int(std::isnan(v)));
    }
  }
  // 4. Corrupt and truncated blobs decoded on the device.
  {
    std::mt19937 rng(11);
    auto host = make_input(dtype::float32, 3000, 9, 1.f);
    encode_params p;
    p.bits = 2;
    std::vector<std::int64_t> const shape{3000};
    std::size_t const bs = blob_size(dtype::float32, shape, p);
    std::vector<unsigned char> good(bs);
    encode_cpu(host.data(), dtype::float32, shape, p, good.data(), bs, 1);
    dev_buf blob(bs), out(host.size()), status(4);
    int agree = 0;
    int const corrupt_blobs = quick ? 100 : 2000;
    for (int it = 0; it < corrupt_blobs; ++it) {
      std::vector<unsigned char> b = good;
      std::size_t len = bs;
      if (it % 2 == 0) len = rng() % bs;
      else for (int f = 0; f < 3; ++f) b[rng() % bs] ^= std::uint8_t(1u << (rng() % 8));
      bool cpu_ok = true;
      std::vector<unsigned char> cpu_out(host.size());
      try {
        decode_cpu(b.data(), len, cpu_out.data(), cpu_out.size(), 1);
      } catch (gact::corrupt_blob const&) {
        cpu_ok = false;
      }
      cuda_ok(cudaMemcpy(blob.p, b.data(), bs, cudaMemcpyHostToDevice), "H2D");
      decode_cuda(blob.p, len, out.p, host.size(), nullptr, static_cast<std::uint32_t*>(status.p));
      std::uint32_t st = 0;
      std::vector<unsigned char> gpu_out(host.size());
      cuda_ok(cudaMemcpy(gpu_out.data(), out.p, host.size(), cudaMemcpyDeviceToHost), "D2H");
      cuda_ok(cudaMemcpy(&st, status.p, 4, cudaMemcpyDeviceToHost), "D2H");
      bool const same = cpu_ok ? (st == 0 && gpu_out == cpu_out) : st != 0;
      CHECK_GPU(same, "corrupt blob %d: cpu_ok=%d device status=%u", it, int(cpu_ok), st);
      agree += same;
    }
    std::printf("corrupt blobs: %d/%d agree\n", agree, corrupt_blobs);
  }
  // 5. Variants.
  {
    std::mt19937 rng(21);
    std::normal_distribution<float> z(0.f, 1.f);
    for (dtype dt : {dtype::float32, dtype::float16, dtype::bfloat16, dtype::float64}) {
      std::size_t const esz = dtype_size(dt);
      auto put = [&](std::vector<unsigned char>& t, std::size_t i, float v) {
        if (dt == dtype::float32) std::memcpy(t.data() + 4 * i, &v, 4);
        else if (dt == dtype::float64) {
          double const d = v;
          std::memcpy(t.data() + 8 * i, &d, 8);
        } else {
          std::uint16_t const h = dt == dtype::float16 ? hd::float_to_half(v) : hd::float_to_bf16(v);
          std::memcpy(t.data() + 2 * i, &h, 2);
        }
      };
      // normalized: batch-norm layouts (NCHW: inner = H*W; NHWC: inner = 1), 24 channels of 7x7
      for (bool cl : {false, true}) {
        std::size_t const n = 4 * 24 * 49;
        std::vector<float> shift(24), scale(24);
        for (int c = 0; c < 24; ++c) {
          shift[std::size_t(c)] = 10.f * z(rng);
          scale[std::size_t(c)] = 1.f / (0.1f + std::fabs(5.f * z(rng)));
        }
        std::vector<unsigned char> t(n * esz);
        for (std::size_t e = 0; e < n; ++e) {
          std::size_t const c = cl ? e % 24 : (e / 49) % 24;
          put(t, e, shift[c] + z(rng) / scale[c]);
        }
        for (int bits : {1, 2, 4, 8}) {
          encode_params p;
          p.bits = bits;
          p.variant = std::uint8_t(quant_mode::normalized);
          p.norm_count = 24;
          p.norm_inner = cl ? 1 : 49;
          p.norm_shift = shift.data();
          p.norm_scale = scale.data();
          p.seed = 5;
          p.key = 9;
          std::snprintf(what, sizeof what, "normalized %s bits=%d cl=%d", dtype_name(dt), bits, int(cl));
          compare(t, dt, {4, 24, 7, 7}, p, 0, what);
        }
      }
      // boundary: a ReLU output (lo = 0) and a clamp to [0, 6]; values and the predicate
      for (bool two : {false, true}) {
        std::size_t const n = 5 * 256 + 77;
        std::vector<unsigned char> t(n * esz);
        for (std::size_t e = 0; e < n; ++e) {
          float const v = 3.f * z(rng) + (two ? 3.f : 0.f);
          put(t, e, two ? std::min(6.f, std::max(0.f, v)) : std::max(0.f, v));
        }
        for (int bits : {2, 4, 8}) {
          encode_params p;
          p.bits = bits;
          p.variant = std::uint8_t(quant_mode::boundary);
          p.boundary = {0.f, two ? 6.f : 0.f, two ? 1u : 0u, 0};
          p.seed = 3;
          std::snprintf(what, sizeof what, "boundary %s bits=%d two=%d", dtype_name(dt), bits, int(two));
          compare(t, dt, {std::int64_t(n)}, p, 0, what);
          decode_params dp;
          dp.predicate = true;
          dp.true_value = 3.f;
          dp.false_value = -1.f;
          std::snprintf(what, sizeof what, "boundary predicate %s bits=%d two=%d", dtype_name(dt), bits, int(two));
          compare(t, dt, {std::int64_t(n)}, p, 0, what, dp);
        }
      }
      // predicate masks
      {
        std::size_t const n = 10007;
        std::vector<unsigned char> t(n * esz);
        for (std::size_t e = 0; e < n; ++e) put(t, e, e % 13 == 0 ? 0.f : 4.f * z(rng));
        for (std::uint32_t pr = 1; pr <= 6; ++pr) {
          encode_params p;
          p.codec = codec_id::mask;
          p.variant = std::uint8_t(mask_mode::predicate);
          p.pred = {pr, pr >= 5 ? -1.f : 0.f, pr >= 5 ? 1.f : 0.f, 0.f};
          decode_params dp;
          dp.true_value = 0.5f;
          dp.false_value = -6.f;
          std::snprintf(what, sizeof what, "predicate %s %s", dtype_name(dt), predicate_name(predicate(pr)));
          compare(t, dt, {std::int64_t(n)}, p, 0, what, dp);
        }
      }
      {  // float64 and the 16-bit floats through the plain path with an unaligned source
        encode_params p;
        p.bits = 4;
        std::snprintf(what, sizeof what, "plain %s unaligned", dtype_name(dt));
        std::vector<unsigned char> t(3001 * esz);
        for (std::size_t e = 0; e < 3001; ++e) put(t, e, z(rng));
        compare(t, dt, {3001}, p, esz, what);
      }
    }
    // window: 3x3/2 max-pool indices of a 2x3x9x11 input, contiguous and channels-last
    for (bool cl : {false, true}) {
      window_params w{};
      w.nd = 2;
      w.inner = cl ? 3 : 1;
      w.in[0] = 9; w.in[1] = 11;
      w.kernel[0] = 3; w.kernel[1] = 3;
      w.stride[0] = 2; w.stride[1] = 2;
      w.pad[0] = 1; w.pad[1] = 1;
      w.dilation[0] = 1; w.dilation[1] = 1;
      w.out[0] = 5; w.out[1] = 6;
      std::size_t const n = 2 * 3 * 5 * 6;
      std::vector<std::int64_t> idx(n);
      for (std::size_t e = 0; e < n; ++e) {
        std::size_t const s = (e / w.inner) % 30;
        std::int64_t const oh = std::int64_t(s / 6), ow = std::int64_t(s % 6);
        std::int64_t kh = std::int64_t(rng() % 3), kw = std::int64_t(rng() % 3);
        std::int64_t ih = oh * 2 - 1 + kh, iw = ow * 2 - 1 + kw;
        if (ih < 0) ih = 0;
        if (iw < 0) iw = 0;
        if (ih > 8) ih = 8;
        if (iw > 10) iw = 10;
        idx[e] = ih * 11 + iw;
      }
      std::vector<unsigned char> t(n * 8);
      std::memcpy(t.data(), idx.data(), t.size());
      encode_params p;
      p.codec = codec_id::window;
      p.bits = 4;
      p.window = w;
      std::snprintf(what, sizeof what, "window cl=%d", int(cl));
      compare(t, dtype::int64, {2, 3, 5, 6}, p, 0, what);  // the shape is logical; `inner` gives the memory order
      // an index outside its window: refused on the host, reported bad by the device's verdict
      idx[7] = 0;
      idx[n - 1] = 0;
      std::memcpy(t.data(), idx.data(), t.size());
      std::vector<std::int64_t> const shape{2, 3, 5, 6};
      std::size_t const bs = blob_size(dtype::int64, shape, p);
      std::vector<unsigned char> host_blob(bs);
      CHECK_GPU(encode_cpu(t.data(), dtype::int64, shape, p, host_blob.data(), bs, 1).refused == refusal::not_window,
                "%s: the host took an index outside its window", what);
      dev_buf src(t.size()), blob(bs);
      cuda_ok(cudaMemcpy(src.p, t.data(), t.size(), cudaMemcpyHostToDevice), "H2D");
      device_verdict dv;
      auto const ticket = g_ring->acquire(&dv);
      encode_cuda(src.p, dtype::int64, shape, p, blob.p, bs, nullptr, &dv);
      CHECK_GPU(g_ring->wait(ticket, std::chrono::seconds(5)) == verdict_state::bad,
                "%s: verdict of an index outside its window not bad", what);
      g_ring->release(ticket);
    }
  }
  cuda_ok(cudaDeviceSynchronize(), "sync");
  std::printf("%d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
