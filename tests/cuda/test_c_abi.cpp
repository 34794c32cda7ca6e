// gact/tests/cuda/test_c_abi.cpp
//
// The C ABI of libgact.so (bindings/gact.h) over the fake runtime: PyTorch's
// alloc/free signatures, record_stream, empty_cache, memory fraction, tags and
// the stats document; failures give nullptr / -1 and never throw. The
// allocators of the C ABI live for the whole process, so each test works with
// differences of the counters rather than absolute values.
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bindings/gact.h"
#include "bindings/process_allocators.hpp"
#include "cuda_fixtures.hpp"
#include "allocator/error.hpp"
#include "allocator/stats_registry.hpp"

namespace {
constexpr std::size_t k_mib = std::size_t{1} << 20;

nlohmann::json stats() {
  char* text = gact_stats_json();
  REQUIRE(text != nullptr);
  nlohmann::json j = nlohmann::json::parse(text);
  gact_free_string(text);
  return j;
}

nlohmann::json device_stats(int device) { return stats()["allocators"]["cuda:" + std::to_string(device)]; }

std::int64_t stat(int device, char const* key) { return device_stats(device)[key].get<std::int64_t>(); }
}  // namespace

TEST_CASE("c abi: alloc and free with PyTorch's signatures") {
  CHECK(gact_alloc(0, 0, nullptr) == nullptr);
  CHECK(gact_alloc(-5, 0, nullptr) == nullptr);
  gact_init(0);
  std::int64_t const allocs = stat(0, "allocation.all.allocated");
  std::int64_t const requested = stat(0, "requested_bytes.all.allocated");
  std::vector<void*> ps;
  std::size_t total = 0;
  for (ssize_t n : {1, 1000, 4096, 1 << 20, 3 << 20, 11 << 20}) {
    void* p = gact_alloc(n, 0, nullptr);
    REQUIRE(p != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % 512 == 0);
    std::memset(p, 0x5A, static_cast<std::size_t>(n));  // fake device memory is host memory
    ps.push_back(p);
    total += static_cast<std::size_t>(n);
  }
  CHECK(stat(0, "allocation.all.allocated") - allocs == 6);
  CHECK(stat(0, "requested_bytes.all.allocated") - requested == static_cast<std::int64_t>(total));
  for (void* p : ps) {
    gact_free(p, 0, 0, nullptr);
  }
  CHECK(stat(0, "allocation.all.current") == 0);
  gact_free(nullptr, 0, 0, nullptr);  // no-op
}

TEST_CASE("c abi: a wrong device argument in free still frees the block; foreign pointers are counted") {
  void* p = gact_alloc(4096, 0, nullptr);
  REQUIRE(p != nullptr);
  gact_free(p, 4096, 1, nullptr);  // device 1 has no allocator yet: the owner is found
  CHECK(stat(0, "allocation.all.current") == 0);
  int local = 0;
  auto const before = device_stats(0)["errors"]["invalid_free"].get<std::int64_t>();
  gact_free(&local, sizeof local, 0, nullptr);
  CHECK(device_stats(0)["errors"]["invalid_free"].get<std::int64_t>() == before + 1);
  gact_record_stream(&local, nullptr);  // logged, ignored
}

TEST_CASE("c abi: out of memory and bad devices give nullptr, never an exception") {
  gact_empty_cache();
  {
    gact::test::capacity_scope const cap(64 * k_mib);
    auto const ooms = stat(0, "num_ooms");
    CHECK(gact_alloc(static_cast<ssize_t>(128 * k_mib), 0, nullptr) == nullptr);
    CHECK(stat(0, "num_ooms") == ooms + 1);
    void* p = gact_alloc(static_cast<ssize_t>(32 * k_mib), 0, nullptr);  // still works after the failure
    CHECK(p != nullptr);
    gact_free(p, 0, 0, nullptr);
    gact_empty_cache();
  }
  CHECK(gact_alloc(100, 7, nullptr) == nullptr);   // no device 7
  CHECK(gact_alloc(100, -1, nullptr) == nullptr);
  CHECK(gact_alloc(100, 1 << 20, nullptr) == nullptr);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
}

TEST_CASE("c abi: empty_cache gives every cached segment back to the runtime") {
  void* p = gact_alloc(static_cast<ssize_t>(5 * k_mib), 0, nullptr);
  REQUIRE(p != nullptr);
  gact_free(p, 0, 0, nullptr);
  auto const reserved = stat(0, "reserved_bytes.all.current");
  CHECK(reserved >= static_cast<std::int64_t>(5 * k_mib));
  std::size_t const used = fake_cudart_used_bytes(0);
  gact_empty_cache();
  CHECK(stat(0, "reserved_bytes.all.current") == 0);
  CHECK(fake_cudart_used_bytes(0) == used - static_cast<std::size_t>(reserved));
}

TEST_CASE("c abi: record_stream keeps a block from reuse until the other stream is done") {
  cudaStream_t s1 = nullptr;
  cudaStream_t s2 = nullptr;
  REQUIRE(cudaStreamCreate(&s1) == cudaSuccess);
  REQUIRE(cudaStreamCreate(&s2) == cudaSuccess);
  void* p = gact_alloc(static_cast<ssize_t>(2 * k_mib), 0, s1);
  REQUIRE(p != nullptr);
  gact_record_stream(p, s2);
  REQUIRE(fake_cudart_hold(s2) == cudaSuccess);
  gact_free(p, static_cast<ssize_t>(2 * k_mib), 0, s1);
  void* q = gact_alloc(static_cast<ssize_t>(2 * k_mib), 0, s1);
  CHECK(q != p);
  REQUIRE(fake_cudart_release(s2) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s2) == cudaSuccess);
  void* r = gact_alloc(static_cast<ssize_t>(2 * k_mib), 0, s1);
  CHECK(r == p);
  gact_free(q, 0, 0, s1);
  gact_free(r, 0, 0, s1);
  gact_empty_cache();
  CHECK(cudaStreamDestroy(s1) == cudaSuccess);
  CHECK(cudaStreamDestroy(s2) == cudaSuccess);
}

TEST_CASE("c abi: tags are recorded per allocation") {
  int const id = gact_push_tag("activation");
  CHECK(id == 1);
  void* p = gact_alloc(4096, 0, nullptr);
  REQUIRE(p != nullptr);
  auto const tags = device_stats(0)["tags"];
  CHECK(tags["activation"]["current_bytes"] == 4096);
  CHECK(tags["activation"]["current_count"] == 1);
  gact_pop_tag();
  int const user = gact_push_tag("my_buffers");
  CHECK(user >= 6);
  CHECK(gact_push_tag("my_buffers") == user);  // same name, same id
  gact_pop_tag();
  gact_pop_tag();
  CHECK(gact_push_tag("") == -1);
  CHECK(gact_push_tag(nullptr) == -1);
  CHECK(gact_push_tag(std::string(100, 'x').c_str()) == -1);
  gact_free(p, 4096, 0, nullptr);
  CHECK(device_stats(0)["tags"]["activation"]["current_bytes"] == 0);
}

TEST_CASE("c abi: memory fraction caps a device before and after its first allocation (issue 14)") {
  gact_set_memory_fraction(1.5, 1);  // rejected, logged
  gact_set_memory_fraction(0.25, 1);  // 2 GiB of the fake's 8 GiB
  CHECK(gact_alloc(static_cast<ssize_t>(3) << 30, 1, nullptr) == nullptr);
  void* p = gact_alloc(static_cast<ssize_t>(64 * k_mib), 1, nullptr);
  CHECK(p != nullptr);
  CHECK(device_stats(1)["options"]["memory_limit"] == std::size_t{2} << 30);
  // torch.cuda.set_per_process_memory_fraction at any time: the cap follows from now on.
  gact_set_memory_fraction(0.5, 1);
  CHECK(device_stats(1)["options"]["memory_limit"] == std::size_t{4} << 30);
  void* q = gact_alloc(static_cast<ssize_t>(3) << 30, 1, nullptr);
  CHECK(q != nullptr);
  gact_set_memory_fraction(0.0625, 1);  // 512 MiB, below what is in use: new segments are refused
  CHECK(gact_alloc(static_cast<ssize_t>(32 * k_mib), 1, nullptr) == nullptr);
  gact_free(q, 0, 1, nullptr);
  void* r = gact_alloc(static_cast<ssize_t>(32 * k_mib), 1, nullptr);  // q's cached segment released, retried
  CHECK(r != nullptr);
  gact_free(p, 0, 1, nullptr);
  gact_free(r, 0, 1, nullptr);
  gact_set_memory_fraction(1.0, 1);
  gact_empty_cache();
  CHECK(fake_cudart_used_bytes(1) == 0);
}

TEST_CASE("c abi: gact_torch_alloc throws torch's out-of-memory text instead of returning NULL (issue 14)") {
  gact_init(0);
  gact_empty_cache();
  CHECK(gact_torch_alloc(0, 0, nullptr) == nullptr);  // an empty tensor
  {
    gact::test::capacity_scope const cap(64 * k_mib);
    auto const ooms = stat(0, "num_ooms");
    std::string msg;
    try {
      (void)gact_torch_alloc(static_cast<ssize_t>(128 * k_mib), 0, nullptr);
      FAIL("gact_torch_alloc returned instead of throwing");
    } catch (std::exception const& e) {  // what torch's translation catches
      msg = e.what();
    }
    INFO(msg);
    CHECK(msg.starts_with("CUDA out of memory. Tried to allocate 128.00 MiB on GPU 0"));
    CHECK(msg.find("cudaErrorMemoryAllocation") != std::string::npos);
    CHECK(stat(0, "num_ooms") == ooms + 1);
    void* p = gact_torch_alloc(static_cast<ssize_t>(32 * k_mib), 0, nullptr);  // usable after the failure
    CHECK(p != nullptr);
    gact_free(p, 0, 0, nullptr);
    gact_empty_cache();
  }
  CHECK_THROWS_WITH_AS((void)gact_torch_alloc(100, 7, nullptr), doctest::Contains("device 7"), std::exception);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
}

namespace {
/// A thrower as _gact_torch's, of a type of the test's own (torch's c10::OutOfMemoryError there).
struct torch_like_oom : std::runtime_error {
  std::size_t bytes;
  int device;
  torch_like_oom(char const* m, std::size_t b, int d) : std::runtime_error(m), bytes(b), device(d) {}
};
void throw_torch_like_oom(char const* message, std::size_t bytes, int device) {
  throw torch_like_oom(message, bytes, device);
}
void returning_thrower(char const*, std::size_t, int) {}
}  // namespace

TEST_CASE("c abi: gact_set_oom_thrower makes gact_torch_alloc fail with the thrower's error (issue 31)") {
  gact_init(0);
  gact_empty_cache();
  gact::test::capacity_scope const cap(64 * k_mib);
  REQUIRE(bool(gact_set_oom_thrower(&throw_torch_like_oom) == nullptr));
  auto const ooms = stat(0, "num_ooms");
  bool caught = false;
  try {
    (void)gact_torch_alloc(static_cast<ssize_t>(96 * k_mib), 0, nullptr);
  } catch (torch_like_oom const& e) {
    caught = true;
    CHECK(std::string(e.what()).starts_with("CUDA out of memory. Tried to allocate 96.00 MiB on GPU 0"));
    CHECK(e.bytes == 96 * k_mib);
    CHECK(e.device == 0);
  }
  CHECK(caught);
  CHECK(stat(0, "num_ooms") == ooms + 1);
  // the allocator is usable after it, and a request that fits never calls the thrower
  void* p = gact_torch_alloc(static_cast<ssize_t>(16 * k_mib), 0, nullptr);
  CHECK(p != nullptr);
  gact_free(p, 0, 0, nullptr);
  // a thrower that returns: gact's own error all the same (the pointer is never NULL)
  CHECK(bool(gact_set_oom_thrower(&returning_thrower) == &throw_torch_like_oom));
  CHECK_THROWS_WITH_AS((void)gact_torch_alloc(static_cast<ssize_t>(96 * k_mib), 0, nullptr),
                       doctest::Contains("CUDA out of memory. Tried to allocate"), gact::out_of_memory);
  // cleared: gact's own error again
  CHECK(bool(gact_set_oom_thrower(nullptr) == &returning_thrower));
  CHECK_THROWS_AS((void)gact_torch_alloc(static_cast<ssize_t>(96 * k_mib), 0, nullptr), gact::out_of_memory);
  gact_empty_cache();
}

TEST_CASE("c abi: reset_peak_stats brings the high-water mark down to what is in use") {
  void* big = gact_alloc(static_cast<ssize_t>(16 * k_mib), 0, nullptr);
  void* small = gact_alloc(4096, 0, nullptr);
  REQUIRE((big != nullptr && small != nullptr));
  gact_free(big, 0, 0, nullptr);
  CHECK(stat(0, "allocated_bytes.all.peak") >= static_cast<std::int64_t>(16 * k_mib));
  gact_reset_peak_stats();
  CHECK(stat(0, "allocated_bytes.all.peak") == stat(0, "allocated_bytes.all.current"));
  CHECK(stat(0, "allocated_bytes.all.current") == 4096);
  gact_free(small, 0, 0, nullptr);
  gact_empty_cache();
}

TEST_CASE("c abi: one allocator per device, the one process_device_allocators() gives other layers (issue 14)") {
  void* p = gact_alloc(4096, 0, nullptr);
  REQUIRE(p != nullptr);
  gact::alloc::caching_allocator& a = gact::bindings::process_device_allocators().get(0);
  CHECK(a.owns(p));
  CHECK(a.stats_name() == "cuda:0");
  gact_free(p, 4096, 0, nullptr);
  CHECK_FALSE(a.owns(p));
}

TEST_CASE("c abi: a default-stream record for device 0 while device 1 is current (issue 14)") {
  // Stream 0 means the current device's default stream; the allocator of device 0 must
  // record its event on device 0's, not on that of the device the caller has current.
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  REQUIRE(fake_cudart_hold(nullptr) == cudaSuccess);  // "a kernel on device 0's default stream still reads p"
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  void* p = gact_alloc(static_cast<ssize_t>(3 * k_mib), 0, s);
  REQUIRE(p != nullptr);
  gact_record_stream(p, nullptr);
  gact_free(p, static_cast<ssize_t>(3 * k_mib), 0, s);
  void* q = gact_alloc(static_cast<ssize_t>(3 * k_mib), 0, s);
  CHECK(q != p);  // p waits for device 0's default stream
  int current = -1;
  REQUIRE(cudaGetDevice(&current) == cudaSuccess);
  CHECK(current == 1);  // the caller's device is left as it was
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  REQUIRE(fake_cudart_release(nullptr) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(nullptr) == cudaSuccess);
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  void* r = gact_alloc(static_cast<ssize_t>(3 * k_mib), 0, s);
  CHECK(r == p);
  gact_free(q, 0, 0, s);
  gact_free(r, 0, 0, s);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  gact_empty_cache();
  CHECK(cudaStreamDestroy(s) == cudaSuccess);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
}

TEST_CASE("c abi: stats dump to a file, errors as -1") {
  std::string const path = "test_c_abi_stats.json";
  std::remove(path.c_str());
  REQUIRE(gact_dump_stats(path.c_str()) == 0);
  std::ifstream in(path);
  REQUIRE(in.good());
  auto const doc = nlohmann::json::parse(in);
  CHECK(doc["schema_version"] == gact::stats::k_schema_version);
  CHECK(doc["allocators"].contains("cuda:0"));
  std::remove(path.c_str());
  CHECK(gact_dump_stats("/nonexistent-dir/gact/stats.json") == -1);
}

TEST_CASE("c abi: threads allocating, writing and freeing on their own streams") {
  constexpr int k_threads = 4;
  constexpr int k_rounds = 300;
  std::vector<std::thread> pool;
  std::vector<int> bad(k_threads, 0);
  for (int t = 0; t < k_threads; ++t) {
    pool.emplace_back([t, &bad] {
      cudaStream_t s = nullptr;
      if (cudaStreamCreate(&s) != cudaSuccess) {
        bad[static_cast<std::size_t>(t)] = -1;
        return;
      }
      std::vector<std::pair<unsigned char*, std::size_t>> live;
      unsigned seed = 12345u + static_cast<unsigned>(t);
      for (int i = 0; i < k_rounds; ++i) {
        seed = seed * 1103515245u + 12345u;
        std::size_t const n = 1 + (seed >> 8) % (3 * k_mib);
        auto* p = static_cast<unsigned char*>(gact_alloc(static_cast<ssize_t>(n), 0, s));
        if (p == nullptr) {
          ++bad[static_cast<std::size_t>(t)];
          continue;
        }
        (void)cudaMemsetAsync(p, t + 1, n, s);
        live.emplace_back(p, n);
        if (live.size() > 8 || (seed & 1) != 0) {
          auto [q, m] = live.front();
          live.erase(live.begin());
          (void)cudaStreamSynchronize(s);
          if (q[0] != t + 1 || q[m - 1] != t + 1) {
            ++bad[static_cast<std::size_t>(t)];  // another thread's block overlapped ours
          }
          gact_free(q, static_cast<ssize_t>(m), 0, s);
        }
      }
      (void)cudaStreamSynchronize(s);
      for (auto [q, m] : live) {
        if (q[0] != t + 1 || q[m - 1] != t + 1) {
          ++bad[static_cast<std::size_t>(t)];
        }
        gact_free(q, static_cast<ssize_t>(m), 0, s);
      }
      gact_empty_cache();
      (void)cudaStreamDestroy(s);
    });
  }
  for (auto& th : pool) {
    th.join();
  }
  for (int b : bad) {
    CHECK(b == 0);
  }
  CHECK(stat(0, "allocation.all.current") == 0);
  gact_empty_cache();
  CHECK(stat(0, "reserved_bytes.all.current") == 0);
  CHECK(fake_cudart_take_async_error() == cudaSuccess);
}
