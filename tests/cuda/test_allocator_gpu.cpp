// gact/tests/cuda/test_allocator_gpu.cpp
//
// The allocator over real cudaMalloc, on a real GPU (suite 'gpu'; run through
// tools/gpu-check on a lent machine, never in CI). Unlike the rest of tests/cuda
// it links the real CUDA runtime, not the fake: what it checks is what the fake
// cannot prove, that the real runtime behaves as the fake models it.
//
//   * cuda_backend: segments, memory info, errors mapped to gact's types;
//   * the caching allocator over it: data written on a stream reads back, a
//     freed block is reused on its stream without a new cudaMalloc, and a block
//     used on another stream (record_stream) is not reused while that stream is
//     still busy (held by a host function that waits for the test's signal);
//   * out of memory: a request beyond the device's memory throws
//     gact::out_of_memory and leaves the context usable;
//   * the C ABI torch uses: gact_torch_alloc / gact_free, its out-of-memory text,
//     and set_memory_fraction as a cap;
//   * with two devices or more, default-stream calls of a backend for device 1
//     while device 0 is current.
//
// Exit status 77 (meson's "skipped") when no CUDA device is visible; gpu-check
// counts a skip of this program as a failure on a GPU host.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/cuda_backend.hpp"
#include "allocator/error.hpp"
#include "bindings/gact.h"

using gact::alloc::allocator_options;
using gact::alloc::caching_allocator;
using gact::device::cuda_backend;

namespace {

constexpr std::size_t k_mib = std::size_t{1} << 20;

/// A stream held busy by a host function until release(): "a kernel still reading".
class stream_hold {
 public:
  explicit stream_hold(cudaStream_t s) {
    REQUIRE(cudaLaunchHostFunc(s, &wait_fn, &go_) == cudaSuccess);
  }
  ~stream_hold() { release(); }
  stream_hold(stream_hold const&) = delete;
  stream_hold& operator=(stream_hold const&) = delete;
  void release() { go_.store(true, std::memory_order_release); }

 private:
  static void CUDART_CB wait_fn(void* flag) {
    auto* go = static_cast<std::atomic<bool>*>(flag);
    while (!go->load(std::memory_order_acquire)) {
    }
  }
  std::atomic<bool> go_{false};
};

/// A caching allocator named `name` over device 0's cuda_backend.
struct device_allocator {
  cuda_backend be{0};
  caching_allocator a;
  explicit device_allocator(char const* name) : a(be, options_named(name)) {}
  static allocator_options options_named(char const* name) {
    allocator_options o;
    o.name = name;
    return o;
  }
};

std::vector<unsigned char> read_back(void const* dev, std::size_t n, cudaStream_t s) {
  std::vector<unsigned char> host(n);
  REQUIRE(cudaMemcpyAsync(host.data(), dev, n, cudaMemcpyDeviceToHost, s) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  return host;
}

}  // namespace

TEST_CASE("cuda_backend over the real runtime: segments, memory info, error types") {
  cuda_backend be(0);
  auto const info = be.memory_info();
  CHECK(info.total_bytes > 0);
  CHECK(info.free_bytes <= info.total_bytes);
  void* p = be.reserve(64 * k_mib);
  REQUIRE(p != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 512 == 0);
  be.release(p, 64 * k_mib);
  CHECK_THROWS_AS(cuda_backend(1 << 20), gact::invalid_argument);
  int local = 0;
  be.release(&local, sizeof local);  // a host pointer: logged, never thrown
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("caching allocator over cudaMalloc: data, reuse on the stream, no new segment") {
  device_allocator d("gpu-test");
  caching_allocator& a = d.a;
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  auto const hs = gact::device::to_handle(s);
  std::vector<std::pair<void*, std::size_t>> live;
  int value = 1;
  for (std::size_t n : {std::size_t{1}, std::size_t{4096}, k_mib + 7, 5 * k_mib, 33 * k_mib}) {
    void* p = a.allocate(n, hs);
    REQUIRE(p != nullptr);
    REQUIRE(cudaMemsetAsync(p, value, n, s) == cudaSuccess);
    live.emplace_back(p, n);
    ++value;
  }
  value = 1;
  for (auto [p, n] : live) {
    auto const host = read_back(p, n, s);
    CHECK(host.front() == value);
    CHECK(host.back() == value);
    ++value;
  }
  auto const segments = a.stats().num_device_alloc;
  auto const reserved = a.reserved_bytes();
  for (auto [p, n] : live) {
    a.deallocate(p);
  }
  // Freed blocks serve the same stream again: no new segment, the reservation unchanged. (Not one
  // address: coalescing the freed neighbours legitimately moves where the best fit starts.)
  void* again = a.allocate(5 * k_mib, hs);
  REQUIRE(again != nullptr);
  CHECK(a.stats().num_device_alloc == segments);
  CHECK(a.reserved_bytes() == reserved);
  REQUIRE(cudaMemsetAsync(again, 9, 5 * k_mib, s) == cudaSuccess);
  CHECK(read_back(again, 5 * k_mib, s).back() == 9);
  a.deallocate(again);
  a.empty_cache();
  CHECK(a.reserved_bytes() == 0);
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

TEST_CASE("caching allocator over cudaMalloc: record_stream holds a block while the other stream is busy") {
  device_allocator d("gpu-test-streams");
  caching_allocator& a = d.a;
  cudaStream_t s1 = nullptr;
  cudaStream_t s2 = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking) == cudaSuccess);
  auto const h1 = gact::device::to_handle(s1);
  void* p = a.allocate(3 * k_mib, h1);
  a.record_stream(p, gact::device::to_handle(s2));
  {
    stream_hold hold(s2);
    a.deallocate(p);
    void* q = a.allocate(3 * k_mib, h1);
    CHECK(q != p);  // s2 has not reached the free's event
    a.deallocate(q);
    hold.release();
    REQUIRE(cudaStreamSynchronize(s2) == cudaSuccess);
  }
  void* r = a.allocate(3 * k_mib, h1);
  CHECK(r == p);
  a.deallocate(r);
  a.empty_cache();
  REQUIRE(cudaStreamDestroy(s1) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(s2) == cudaSuccess);
}

TEST_CASE("out of memory on the device: gact::out_of_memory, and the context stays usable") {
  device_allocator d("gpu-test-oom");
  caching_allocator& a = d.a;
  std::size_t const total = d.be.memory_info().total_bytes;
  std::string msg;
  try {
    (void)a.allocate(total + (std::size_t{1} << 30));
  } catch (gact::out_of_memory const& e) {
    msg = e.what();
  }
  INFO(msg);
  CHECK(msg.find("cudaErrorMemoryAllocation") != std::string::npos);
  CHECK(a.stats().num_ooms == 1);
  CHECK(cudaGetLastError() == cudaSuccess);
  void* p = a.allocate(k_mib);  // still works
  CHECK(p != nullptr);
  a.deallocate(p);
  a.empty_cache();
}

TEST_CASE("C ABI over the real runtime: torch's alloc, free, out-of-memory text, memory fraction") {
  void* p = gact_torch_alloc(static_cast<ssize_t>(8 * k_mib), 0, nullptr);
  REQUIRE(p != nullptr);
  REQUIRE(cudaMemset(p, 7, 8 * k_mib) == cudaSuccess);
  gact_free(p, static_cast<ssize_t>(8 * k_mib), 0, nullptr);
  std::size_t free_b = 0, total = 0;
  REQUIRE(cudaMemGetInfo(&free_b, &total) == cudaSuccess);
  std::string msg;
  try {
    (void)gact_torch_alloc(static_cast<ssize_t>(total * 2), 0, nullptr);
  } catch (std::exception const& e) {
    msg = e.what();
  }
  INFO(msg);
  CHECK(msg.starts_with("CUDA out of memory. Tried to allocate"));
  gact_set_memory_fraction(0.01, 0);
  CHECK(gact_alloc(static_cast<ssize_t>(total / 50), 0, nullptr) == nullptr);  // 2 % > the 1 % cap
  gact_set_memory_fraction(1.0, 0);
  void* q = gact_alloc(static_cast<ssize_t>(total / 50), 0, nullptr);
  CHECK(q != nullptr);
  gact_free(q, 0, 0, nullptr);
  gact_empty_cache();
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("default-stream calls of device 1's backend while device 0 is current") {
  int count = 0;
  REQUIRE(cudaGetDeviceCount(&count) == cudaSuccess);
  if (count < 2) {
    MESSAGE("one device: the cross-device case needs two (not run)");
    return;
  }
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cuda_backend be1(1);
  auto const ev = be1.create_event();
  void* dev = be1.reserve(k_mib);
  std::vector<unsigned char> src(k_mib, 0x5A), dst(k_mib, 0);
  be1.copy_async(dev, src.data(), k_mib, 0);
  be1.record(ev, 0);
  be1.wait(0, ev);
  be1.copy_async(dst.data(), dev, k_mib, 0);
  be1.synchronize_stream(0);
  CHECK(std::memcmp(src.data(), dst.data(), k_mib) == 0);
  int current = -1;
  REQUIRE(cudaGetDevice(&current) == cudaSuccess);
  CHECK(current == 0);
  be1.release(dev, k_mib);
  be1.destroy_event(ev);
}

int main(int argc, char** argv) {
  int count = 0;
  cudaError_t const err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    std::printf("no CUDA device (%s): nothing to check\n", err != cudaSuccess ? cudaGetErrorName(err) : "0 devices");
    return 77;  // meson's "skipped"
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
