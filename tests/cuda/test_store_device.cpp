// gact/tests/cuda/test_store_device.cpp — the activation store's device path over the fake runtime
// (tests/fake_cudart), which registers and launches the real kernels' host stubs without running device
// code. What it checks is the host side of a training step on a GPU: which runtime calls the store makes
// per saved tensor. A step's puts, verdict polls, decodes and releases make no call that waits for the
// device (no synchronization, no blocking copy, no cudaMalloc/cudaFree once the pools are warm): one
// kernel launch per encode and per decode, and a 4-byte memset of the decode's status word.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/cuda_backend.hpp"
#include "allocator/device/external_backend.hpp"
#include "allocator/device/host_backend.hpp"
#include "allocator/error.hpp"
#include "allocator/store/activation_store.hpp"
#include "fake_cudart.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace gact::store;
using gact::codec::dtype;

namespace {

/// Runtime calls that make the host wait for the device (or that real CUDA may synchronize in).
constexpr char const* k_waiting_calls[] = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                                           "cudaMemcpy",            "cudaMalloc",            "cudaFree",
                                           "cudaHostAlloc",         "cudaFreeHost",          "cudaEventQuery"};

std::size_t waiting_calls() {
  std::size_t n = 0;
  for (char const* c : k_waiting_calls) n += fake_cudart_count(c);
  return n;
}

std::string waiting_calls_text() {
  std::string s;
  for (char const* c : k_waiting_calls) s += std::string(c) + "=" + std::to_string(fake_cudart_count(c)) + " ";
  return s;
}

struct device_store {
  gact::device::host_backend hb;
  gact::alloc::caching_allocator host_arena{hb};
  gact::device::cuda_backend db{0};
  gact::alloc::caching_allocator dev_arena{db};
  activation_store store{host_arena, store_options{1, ""}};
  cudaStream_t stream = nullptr;
  device_store() {
    store.set_device_arena(0, &dev_arena);
    REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  }
  ~device_store() { (void)cudaStreamDestroy(stream); }
};

struct device_tensor {
  void* p = nullptr;
  std::size_t bytes = 0;
  device_tensor(void const* host, std::size_t n) : bytes(n) {
    REQUIRE(cudaMalloc(&p, n) == cudaSuccess);
    REQUIRE(cudaMemcpy(p, host, n, cudaMemcpyHostToDevice) == cudaSuccess);
  }
  ~device_tensor() { (void)cudaFree(p); }
};

tensor_view view(device_tensor const& t, dtype dt, std::vector<std::int64_t> shape, std::int64_t version = 0) {
  tensor_view v;
  v.data = t.p;
  v.dtype = dt;
  v.shape = std::move(shape);
  v.device = 0;
  v.version = version;
  return v;
}

/// The saves of one step of a small CNN-like model: a batch-norm input (normalized), a ReLU's output for its
/// mask and then for its values (one boundary blob), max-pool indices (window), a dropout mask (bool), a
/// float64 tensor (kept raw on a device) and a plain float16 activation.
struct step_saves {
  std::vector<float> x, stats;
  std::vector<std::uint16_t> h;
  std::vector<std::int64_t> idx;
  std::vector<unsigned char> mask;
  std::vector<double> d;
  explicit step_saves(std::mt19937& g) {
    std::normal_distribution<float> n(0.f, 1.f);
    x.resize(8 * 16 * 12 * 12);
    for (auto& v : x) v = n(g);
    stats.resize(32);
    for (std::size_t i = 0; i < 16; ++i) {
      stats[i] = 0.1f;        // shift
      stats[16 + i] = 1.25f;  // scale
    }
    h.resize(4096, 0x3C00);   // float16 1.0
    idx.resize(8 * 16 * 6 * 6);
    for (std::size_t e = 0; e < idx.size(); ++e) {
      std::int64_t const s = std::int64_t(e % 36), oh = s / 6, ow = s % 6;
      idx[e] = (2 * oh) * 12 + 2 * ow + std::int64_t(g() % 2);
    }
    mask.resize(8192);
    for (auto& m : mask) m = static_cast<unsigned char>(g() % 2);
    d.resize(1024, 0.5);
  }
};

}  // namespace

/// A step's tensors in (fake) device memory, made before the counted part.
struct step_tensors {
  step_saves s;
  device_tensor x, h, idx, mask, d, stats;
  explicit step_tensors(std::mt19937& g)
      : s(g), x(s.x.data(), s.x.size() * 4), h(s.h.data(), s.h.size() * 2), idx(s.idx.data(), s.idx.size() * 8),
        mask(s.mask.data(), s.mask.size()), d(s.d.data(), s.d.size() * 8), stats(s.stats.data(), s.stats.size() * 4) {}
};

/// One step of saves (step_saves) put, polled, decoded and released, as a training step does; returns the saves.
std::size_t run_step(activation_store& store, cudaStream_t stream, step_tensors& t, std::uint64_t step) {
  std::vector<handle> hs;
  store.begin_step(step);
  put_params p;
  p.bits = 4;
  p.stream = reinterpret_cast<gact::device::stream_t>(stream);
  p.key = 1;
  // a batch-norm input: its statistics in device memory
  put_params pn = p;
  pn.norm_count = 16;
  pn.norm_inner = 144;
  pn.norm_shift = static_cast<float const*>(t.stats.p);
  pn.norm_scale = static_cast<float const*>(t.stats.p) + 16;
  hs.push_back(store.put(view(t.x, dtype::float32, {8, 16, 12, 12}), pn).h);
  // a ReLU's output (x stands in for one): its mask, then its values, as one storage and version; on a
  // device the mask is not upgraded: the values get a boundary blob of their own
  put_params pm = p;
  pm.key = 2;
  pm.what = role::predicate;
  pm.pred.pred = std::uint8_t(gact::codec::predicate::gt_or_nan);
  pm.clamped = true;
  hs.push_back(store.put(view(t.h, dtype::float16, {4096}, 3), pm).h);
  put_params pv = p;
  pv.key = 3;
  pv.boundary = true;
  pv.pred = pm.pred;
  auto const rv = store.put(view(t.h, dtype::float16, {4096}, 3), pv);
  CHECK_FALSE(rv.shared);
  hs.push_back(rv.h);
  // max-pool indices of a 2x2/2 pool over 12x12
  put_params pw = p;
  pw.key = 4;
  pw.what = role::indices;
  pw.window.nd = 2;
  pw.window.inner = 1;
  pw.window.in[0] = pw.window.in[1] = 12;
  pw.window.out[0] = pw.window.out[1] = 6;
  pw.window.kernel[0] = pw.window.kernel[1] = 2;
  pw.window.stride[0] = pw.window.stride[1] = 2;
  pw.window.dilation[0] = pw.window.dilation[1] = 1;
  hs.push_back(store.put(view(t.idx, dtype::int64, {8, 16, 6, 6}), pw).h);
  put_params pb = p;
  pb.key = 5;
  hs.push_back(store.put(view(t.mask, dtype::boolean, {8192}), pb).h);
  pb.key = 6;
  hs.push_back(store.put(view(t.d, dtype::float64, {1024}), pb).h);
  // the Compressor polls each verdict at later saves: quant and window blobs have one, not in yet (no kernel
  // runs here); mask and raw blobs have none
  std::vector<int> verdicts;
  for (handle k : hs) verdicts.push_back(store.verdict(k));
  CHECK(verdicts == std::vector<int>{-1, 0, -1, -1, 0, 0});
  CHECK(store.info(hs[1]).codec == gact::codec::codec_id::mask);
  CHECK(store.info(hs[2]).codec == gact::codec::codec_id::quant);
  CHECK(store.info(hs[5]).codec == gact::codec::codec_id::raw);
  // backward: each decoded once, then released
  for (handle k : hs) {
    get_params gp;
    gp.stream = reinterpret_cast<gact::device::stream_t>(stream);
    gp.predicate = k == hs[1];
    CHECK(store.get_shared(k, gp) != nullptr);
  }
  for (handle k : hs) CHECK(store.release(k) == 0);
  CHECK(store.end_step() == 0);
  return hs.size();
}

TEST_CASE("store on a device: a step's puts, verdicts, decodes and releases never wait for the device") {
  device_store f;
  std::mt19937 g(7);
  auto run_step = [&](step_tensors& t, std::uint64_t step) { return ::run_step(f.store, f.stream, t, step); };

  {
    step_tensors t(g);
    (void)run_step(t, 0);  // warm-up: the pools' first segments, the verdict ring (made with one synchronization)
    REQUIRE(cudaStreamSynchronize(f.stream) == cudaSuccess);
  }
  std::size_t waits = 0, launches = 0, saves = 0;
  std::string calls;
  for (std::uint64_t step = 1; step <= 3; ++step) {
    step_tensors t(g);  // (the test's own tensors are made and freed outside the counted part)
    fake_cudart_reset_counts();
    saves += run_step(t, step);
    waits += waiting_calls();
    calls += waiting_calls_text();
    launches += fake_cudart_count("__cudaLaunchKernel");
  }
  INFO(calls);
  CHECK(waits == 0);
  CHECK(f.store.stats_json()["verdict_waits"] == 0);
  CHECK(launches == 2 * saves);  // one encode and one decode per saved tensor
}

TEST_CASE("store on a device: an encode under stream capture asks for no verdict and counts as unverified") {
  device_store f;
  std::mt19937 g(3);
  step_tensors t(g);
  put_params p;
  p.bits = 4;
  p.stream = reinterpret_cast<gact::device::stream_t>(f.stream);
  p.key = 9;
  {  // (the arena's segment first: cudaMalloc is not allowed during capture)
    handle const w = f.store.put(view(t.x, dtype::float32, {8, 16, 12, 12}, 7), p).h;
    REQUIRE(f.store.release(w) == 0);
  }
  // the kernel would be recorded, not run: its verdict would arrive at each replay, into a slot reused meanwhile
  REQUIRE(fake_cudart_begin_capture(f.stream) == cudaSuccess);
  handle const h = f.store.put(view(t.x, dtype::float32, {8, 16, 12, 12}), p).h;
  REQUIRE(fake_cudart_end_capture(f.stream) == cudaSuccess);
  CHECK(f.store.verdict(h) == 1);  // the caller keeps the tensor exact
  CHECK(f.store.stats_json()["verdict_waits"] == 0);
  CHECK(f.store.release(h) == 0);
  // outside capture, the same put asks for one (pending: no kernel runs here)
  handle const h2 = f.store.put(view(t.x, dtype::float32, {8, 16, 12, 12}, 1), p).h;
  CHECK(f.store.verdict(h2) == -1);
  CHECK(f.store.release(h2) == 0);
}

TEST_CASE("store on a device: a blob of another device than the current one gets its verdict ring there") {
  // (two fake devices; the thread's current device is 0 and the tensor lives on device 1)
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  gact::device::host_backend hb;
  gact::alloc::caching_allocator host_arena{hb};
  gact::device::cuda_backend db{1};
  gact::alloc::caching_allocator dev_arena{db};
  activation_store store{host_arena, store_options{1, ""}};
  store.set_device_arena(1, &dev_arena);
  std::vector<float> x(4096, 0.5f);
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  device_tensor const t(x.data(), x.size() * 4);
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  auto const on0 = fake_cudart_used_bytes(0), on1 = fake_cudart_used_bytes(1);
  put_params p;
  p.bits = 4;
  p.key = 1;
  p.stream = reinterpret_cast<gact::device::stream_t>(stream);
  tensor_view v = view(t, dtype::float32, {4096});
  v.device = 1;
  handle const h = store.put(v, p).h;
  CHECK(store.verdict(h) == -1);  // a ring exists: the verdict is pending (no kernel runs here)
  int cur = -1;
  REQUIRE(cudaGetDevice(&cur) == cudaSuccess);
  CHECK(cur == 0);                                 // the caller's device again
  CHECK(fake_cudart_used_bytes(0) == on0);         // nothing of the ring's (or the blob's) on device 0
  CHECK(fake_cudart_used_bytes(1) > on1);
  CHECK(store.release(h) == 0);
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  (void)cudaStreamDestroy(stream);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
}

namespace {

/// Another allocator's blocks (torch's, in a process where gact is not torch's allocator), counted: host memory
/// stands in for the device's, as the fake runtime's does.
struct counted_blocks {
  static inline std::size_t allocs = 0, frees = 0, live = 0, fail_above = 0, attempts = 0;
  static inline std::vector<std::pair<void*, std::size_t>> blocks;
  static void* alloc(std::size_t bytes, int /*device*/, char* why, std::size_t why_len) noexcept {
    ++attempts;
    if (fail_above != 0 && bytes > fail_above) {
      std::snprintf(why, why_len, "CUDA out of memory (test)");
      return nullptr;
    }
    void* p = std::aligned_alloc(512, (bytes + 511) / 512 * 512);
    ++allocs;
    live += bytes;
    blocks.emplace_back(p, bytes);
    return p;
  }
  static void free(void* p, int /*device*/) noexcept {
    for (auto it = blocks.begin(); it != blocks.end(); ++it) {
      if (it->first == p) {
        live -= it->second;
        blocks.erase(it);
        ++frees;
        std::free(p);
        return;
      }
    }
    FAIL_CHECK("a block freed twice or never handed out");
  }
};

}  // namespace

TEST_CASE("store on a device over another allocator: each blob and image is one block of it, given back when freed") {
  counted_blocks::allocs = counted_blocks::frees = counted_blocks::live = counted_blocks::fail_above = 0;
  gact::device::host_backend hb;
  gact::alloc::caching_allocator host_arena{hb};
  gact::device::cuda_backend db{0};
  gact::device::external_blocks fns;
  fns.alloc = &counted_blocks::alloc;
  fns.free = &counted_blocks::free;
  gact::device::external_backend eb{fns, db, "torch:0"};
  gact::alloc::caching_allocator arena{eb, gact::device::pass_through_options("cuda:0 (torch's pool)")};
  activation_store store{host_arena, store_options{1, ""}};
  store.set_device_arena(0, &arena);
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  std::mt19937 g(3);
  step_tensors t(g);

  put_params p;
  p.bits = 4;
  p.key = 9;
  p.stream = reinterpret_cast<gact::device::stream_t>(stream);
  CHECK(store.release(store.put(view(t.x, dtype::float32, {8, 16, 12, 12}, 7), p).h) == 0);  // (the verdict ring)
  counted_blocks::allocs = counted_blocks::frees = 0;
  fake_cudart_reset_counts();
  handle const h = store.put(view(t.x, dtype::float32, {8, 16, 12, 12}), p).h;
  auto const blob = (store.info(h).bytes_stored + 511) / 512 * 512;  // (requests are rounded to 512 bytes)
  CHECK(counted_blocks::allocs == 1);  // the blob, and nothing cached beside it
  CHECK(counted_blocks::live == blob);
  CHECK(arena.reserved_bytes() == blob);
  {
    get_params gp;
    gp.stream = p.stream;
    auto image = store.get_shared(h, gp);
    REQUIRE(image != nullptr);
    CHECK(counted_blocks::allocs == 2);  // the decoded image: a block of the same pool
    CHECK(counted_blocks::live == blob + t.x.bytes);
    CHECK(store.release(h) == 0);
    CHECK(counted_blocks::frees == 1);  // the blob went back with its handle; the image lives on with its reader
  }
  CHECK(counted_blocks::frees == 2);
  CHECK(counted_blocks::live == 0);
  CHECK(arena.reserved_bytes() == 0);  // gact's layer keeps nothing
  CHECK(fake_cudart_count("cudaMalloc") == 0);       // no memory of gact's own
  CHECK(fake_cudart_count("cudaFree") == 0);

  // the other allocator out of memory, with a blob of gact's alive in it: gact's out-of-memory error with its
  // reason, asked once (nothing of gact's own to release first), nothing more held
  handle const live = store.put(view(t.x, dtype::float32, {8, 16, 12, 12}, 5), p).h;
  counted_blocks::fail_above = 1024;
  auto const attempts = counted_blocks::attempts;
  try {
    (void)store.put(view(t.x, dtype::float32, {8, 16, 12, 12}, 1), p);
    FAIL("the put did not fail");
  } catch (gact::out_of_memory const& e) {
    CHECK(std::string(e.what()).find("CUDA out of memory (test)") != std::string::npos);
  }
  CHECK(counted_blocks::attempts == attempts + 1);  // asked once: the other allocator retried on its own
  CHECK(counted_blocks::live == blob);
  CHECK(store.live_handles() == 1);
  CHECK(store.release(live) == 0);
  CHECK(counted_blocks::live == 0);

  // a training step's saves over the other allocator's blocks wait for the device no more than over gact's pool
  counted_blocks::fail_above = 0;
  (void)run_step(store, stream, t, 1);  // (warm-up, as in the first test)
  std::size_t waits = 0;
  std::string calls;
  for (std::uint64_t step = 2; step <= 4; ++step) {
    step_tensors ts(g);
    fake_cudart_reset_counts();
    auto const before = counted_blocks::allocs;
    CHECK(run_step(store, stream, ts, step) == 6);
    waits += waiting_calls();
    calls += waiting_calls_text();
    CHECK(counted_blocks::allocs > before);  // its blobs and images are blocks of the other allocator
    CHECK(counted_blocks::live == 0);        // all given back by the end of the step
    CHECK(arena.reserved_bytes() == 0);
  }
  INFO(calls);
  CHECK(waits == 0);
  (void)cudaStreamDestroy(stream);
}
