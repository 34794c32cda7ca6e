// gact/tests/cuda/test_cuda_backend.cpp
//
// cuda_backend and pinned_host_backend over the fake runtime: error mapping
// (capacity -> out_of_memory, bad calls -> cuda_error naming the call and the
// CUDA error), device selection, and stream/event ordering on the fake's
// asynchronous streams (run with FAKE_CUDART_DELAY_US so that a missing wait
// shows up as wrong bytes), including the caching allocator's cross-stream
// reuse through real (fake) events.
#include <doctest/doctest.h>

#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/error.hpp"
#include "cuda_fixtures.hpp"

using gact::device::cuda_backend;
using gact::device::direct_cuda_api;
using gact::device::to_cuda_stream;

namespace {
constexpr std::size_t k_mib = std::size_t{1} << 20;

bool contains(std::string const& text, char const* part) { return text.find(part) != std::string::npos; }
}  // namespace

TEST_CASE("cuda_backend: capacity exhaustion is out_of_memory, and the last error is cleared") {
  gact::test::capacity_scope const cap(16 * k_mib);
  cuda_backend be(0);
  void* ok = be.reserve(8 * k_mib);
  CHECK(ok != nullptr);
  std::string msg;
  try {
    (void)be.reserve(9 * k_mib);
  } catch (gact::out_of_memory const& e) {
    msg = e.what();
  }
  INFO(msg);
  CHECK(contains(msg, "cudaErrorMemoryAllocation"));
  CHECK(contains(msg, "out of memory"));
  CHECK(contains(msg, "malloc"));
  CHECK(contains(msg, "cuda_backend.cpp:"));
  CHECK(cudaPeekAtLastError() == cudaSuccess);  // cleared by the backend
  be.release(ok, 8 * k_mib);
  CHECK(fake_cudart_used_bytes(0) == 0);
}

TEST_CASE("GACT_CUDA_TRY: a bad free is cuda_error with the call text and the CUDA error name") {
  auto const& api = direct_cuda_api();
  int local = 0;
  std::string msg;
  try {
    GACT_CUDA_TRY(api, api.free(&local));
  } catch (gact::out_of_memory const&) {
    FAIL("a bad free is not out of memory");
  } catch (gact::cuda_error const& e) {
    msg = e.what();
  }
  INFO(msg);
  CHECK(contains(msg, "api.free(&local)"));
  CHECK(contains(msg, "cudaErrorInvalidValue"));
  CHECK(contains(msg, "invalid argument"));
  CHECK(contains(msg, "test_cuda_backend.cpp:"));
  CHECK(cudaPeekAtLastError() == cudaSuccess);
}

TEST_CASE("cuda_backend: release of a foreign pointer is logged, never thrown") {
  cuda_backend be(0);
  int local = 0;
  std::size_t const before = fake_cudart_count("cudaFree");
  be.release(&local, sizeof local);  // noexcept: must not terminate
  CHECK(fake_cudart_count("cudaFree") == before + 1);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
}

TEST_CASE("cuda_backend: devices are checked and selected per call") {
  CHECK_THROWS_AS(cuda_backend(-1), gact::invalid_argument);
  CHECK_THROWS_AS(cuda_backend(2), gact::invalid_argument);  // the fake has devices 0 and 1
  cuda_backend be1(1);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  void* p = be1.reserve(3 * k_mib);
  CHECK(fake_cudart_used_bytes(1) == 3 * k_mib);
  CHECK(fake_cudart_used_bytes(0) == 0);
  int current = -1;
  REQUIRE(cudaGetDevice(&current) == cudaSuccess);
  CHECK(current == 0);  // restored
  auto const info = be1.memory_info();
  CHECK(info.total_bytes == std::size_t{8} << 30);
  CHECK(info.free_bytes == info.total_bytes - 3 * k_mib);
  be1.release(p, 3 * k_mib);
  CHECK(fake_cudart_used_bytes(1) == 0);
  CHECK(be1.kind() == gact::device::memory_kind::device);
  CHECK(be1.name() == "cuda");
}

TEST_CASE("fake runtime: an event recorded on a stream of another device is an invalid handle") {
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  cudaEvent_t ev = nullptr;
  REQUIRE(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess);  // device 1's
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  CHECK(cudaEventRecord(ev, nullptr) == cudaErrorInvalidResourceHandle);  // device 0's default stream
  CHECK(cudaGetLastError() == cudaErrorInvalidResourceHandle);
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  CHECK(cudaEventRecord(ev, nullptr) == cudaSuccess);
  CHECK(cudaEventSynchronize(ev) == cudaSuccess);
  CHECK(cudaEventDestroy(ev) == cudaSuccess);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
}

TEST_CASE("cuda_backend: default-stream operations act on the backend's device, whatever is current (issue 14)") {
  cuda_backend be1(1);
  auto const ev = be1.create_event();
  std::size_t const n = 64 * 1024;
  void* dev = be1.reserve(n);
  std::vector<unsigned char> src(n, 0x3C), dst(n, 0);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  be1.copy_async(dev, src.data(), n, 0);  // device 1's default stream
  be1.record(ev, 0);                      // an event of device 1 on device 1's default stream
  be1.wait(0, ev);
  be1.copy_async(dst.data(), dev, n, 0);
  be1.synchronize_stream(0);
  CHECK(std::memcmp(src.data(), dst.data(), n) == 0);
  CHECK(be1.query(ev));
  int current = -1;
  REQUIRE(cudaGetDevice(&current) == cudaSuccess);
  CHECK(current == 0);  // restored after every call
  be1.release(dev, n);
  be1.destroy_event(ev);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
}

TEST_CASE("device_guard: switches and restores; a negative device is no device") {
  auto const& api = direct_cuda_api();
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  std::size_t const sets = fake_cudart_count("cudaSetDevice");
  {
    gact::device::device_guard const g(api, 0);  // already current: no switch
    CHECK(g.previous() == -1);
  }
  {
    gact::device::device_guard const g(-1);  // a CPU tensor: nothing to do
    CHECK(g.previous() == -1);
  }
  CHECK(fake_cudart_count("cudaSetDevice") == sets);
  {
    gact::device::device_guard const g(1);
    CHECK(g.previous() == 0);
    int current = -1;
    REQUIRE(cudaGetDevice(&current) == cudaSuccess);
    CHECK(current == 1);
  }
  int current = -1;
  REQUIRE(cudaGetDevice(&current) == cudaSuccess);
  CHECK(current == 0);
  CHECK_THROWS_AS(gact::device::device_guard(api, 5), gact::cuda_error);  // no device 5
  CHECK(cudaPeekAtLastError() == cudaSuccess);
}

TEST_CASE("cuda_backend: copies ordered across streams by events") {
  cuda_backend be(0);
  auto const s1 = be.create_stream();
  auto const s2 = be.create_stream();
  auto const ev = be.create_event();
  std::size_t const n = 256 * 1024;
  std::vector<unsigned char> src(n), dst(n, 0);
  std::iota(src.begin(), src.end(), static_cast<unsigned char>(7));
  void* dev = be.reserve(n);
  for (int round = 0; round < 20; ++round) {
    src[0] = static_cast<unsigned char>(round);
    be.copy_async(dev, src.data(), n, s1);  // H2D on s1
    be.record(ev, s1);
    be.wait(s2, ev);                        // s2 waits for the copy without the host blocking
    be.copy_async(dst.data(), dev, n, s2);  // D2H on s2
    be.synchronize_stream(s2);
    CHECK(std::memcmp(src.data(), dst.data(), n) == 0);
    CHECK(be.query(ev));
  }
  be.release(dev, n);
  be.destroy_event(ev);
  be.destroy_stream(s1);
  be.destroy_stream(s2);
  CHECK(fake_cudart_take_async_error() == cudaSuccess);  // no copy touched a bad range
}

TEST_CASE("cuda_backend: query of an unfinished event is false and leaves no last error") {
  cuda_backend be(0);
  auto const s = be.create_stream();
  auto const ev = be.create_event();
  CHECK(be.query(ev));  // never recorded: complete
  REQUIRE(fake_cudart_hold(to_cuda_stream(s)) == cudaSuccess);
  be.record(ev, s);
  CHECK_FALSE(be.query(ev));
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  REQUIRE(fake_cudart_release(to_cuda_stream(s)) == cudaSuccess);
  be.synchronize(ev);
  CHECK(be.query(ev));
  be.destroy_event(ev);
  be.destroy_stream(s);
}

TEST_CASE("caching allocator over cuda_backend: record_stream holds a block until the other stream's work is done") {
  cuda_backend be(0);
  gact::alloc::allocator_options o;
  o.name = "test-cross-stream";
  gact::alloc::caching_allocator a(be, o);
  auto const s1 = be.create_stream();
  auto const s2 = be.create_stream();
  void* p = a.allocate(3 * k_mib, s1);
  a.record_stream(p, s2);
  REQUIRE(fake_cudart_hold(to_cuda_stream(s2)) == cudaSuccess);  // "a kernel on s2 still reads p"
  a.deallocate(p);
  void* q = a.allocate(3 * k_mib, s1);
  CHECK(q != p);  // p's event on s2 has not completed
  REQUIRE(fake_cudart_release(to_cuda_stream(s2)) == cudaSuccess);
  be.synchronize_stream(s2);
  void* r = a.allocate(3 * k_mib, s1);  // the event is polled now: p is free again, the best fit
  CHECK(r == p);
  CHECK(a.stats().num_device_alloc == 1);
  a.deallocate(q);
  a.deallocate(r);
  a.empty_cache();
  CHECK(a.reserved_bytes() == 0);
  be.destroy_stream(s1);
  be.destroy_stream(s2);
}

TEST_CASE("expandable segments over cuda_backend: pages mapped through the driver, copies across pages, all given back") {
  gact::test::capacity_scope const cap(64 * k_mib);
  cuda_backend be(0);
  REQUIRE(be.vm_page() == 2 * k_mib);
  gact::alloc::allocator_options o;
  o.name = "test-expandable";
  o.expandable_segments = true;
  std::size_t const maps = fake_cudart_count("cuMemMap");
  auto* a = new gact::alloc::caching_allocator(be, o);
  auto const s = be.create_stream();
  void* p = a->allocate(3 * k_mib, s);
  void* q = a->allocate(5 * k_mib, s);  // beside p: spans pages mapped by two growths
  CHECK(reinterpret_cast<std::uintptr_t>(q) == reinterpret_cast<std::uintptr_t>(p) + 3 * k_mib);
  CHECK(a->reserved_bytes() == 8 * k_mib);
  CHECK(fake_cudart_mapped_bytes() == 8 * k_mib);
  CHECK(fake_cudart_used_bytes(0) == 8 * k_mib);
  CHECK(fake_cudart_count("cuMemMap") == maps + 4);  // one physical allocation per page
  std::vector<unsigned char> src(5 * k_mib), dst(5 * k_mib, 0);
  std::iota(src.begin(), src.end(), static_cast<unsigned char>(3));
  be.copy_async(q, src.data(), src.size(), s);
  be.copy_async(dst.data(), q, dst.size(), s);
  be.synchronize_stream(s);
  CHECK(src == dst);
  CHECK(fake_cudart_take_async_error() == cudaSuccess);  // every byte copied lies in mapped pages

  // out of memory with free holes: 8 blocks of 7 MiB fill the device to 56 MiB; freeing every other one
  // leaves 28 MiB free in holes none of which holds 16 MiB; the retry unmaps their whole pages
  a->deallocate(p);
  a->deallocate(q);
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(a->allocate(7 * k_mib, s));
  for (int i = 0; i < 8; i += 2) a->deallocate(blocks[static_cast<std::size_t>(i)]);
  std::size_t const syncs = fake_cudart_count("cudaDeviceSynchronize");
  void* big = a->allocate(16 * k_mib, s);
  CHECK(big != nullptr);
  CHECK(a->stats().num_alloc_retries == 1);
  CHECK(fake_cudart_count("cudaDeviceSynchronize") > syncs);  // the pages' kernels are done before unmapping
  CHECK(fake_cudart_mapped_bytes() == a->reserved_bytes());  // the holes' whole pages went back to the device
  CHECK(a->reserved_bytes() == 4 * 8 * k_mib + 16 * k_mib);  // the four live blocks touch 4 pages each
  be.copy_async(big, src.data(), src.size(), s);
  be.synchronize_stream(s);
  CHECK(fake_cudart_take_async_error() == cudaSuccess);
  a->deallocate(big);
  for (int i = 1; i < 8; i += 2) a->deallocate(blocks[static_cast<std::size_t>(i)]);
  a->empty_cache();
  CHECK(a->reserved_bytes() == 0);
  CHECK(fake_cudart_mapped_bytes() == 0);
  CHECK(fake_cudart_used_bytes(0) == 0);
  delete a;
  be.destroy_stream(s);
}

TEST_CASE("expandable segments over cuda_backend: pages a kernel may still use stay mapped while the device cannot be waited for") {
  cuda_backend be(0);
  gact::alloc::allocator_options o;
  o.name = "test-expandable-capture";
  o.expandable_segments = true;
  gact::alloc::caching_allocator a(be, o);
  auto const s = be.create_stream();
  auto const s2 = be.create_stream();
  void* p = a.allocate(4 * k_mib, s);
  std::vector<unsigned char> src(4 * k_mib, 9);
  REQUIRE(fake_cudart_hold(to_cuda_stream(s)) == cudaSuccess);  // "a kernel on s still writes p"
  be.copy_async(p, src.data(), src.size(), s);
  a.deallocate(p);  // reusable in s's order: no event
  // another stream captures a graph: cudaDeviceSynchronize fails (cudaErrorStreamCaptureUnsupported), so
  // nothing may be unmapped under the queued copy
  REQUIRE(fake_cudart_begin_capture(to_cuda_stream(s2)) == cudaSuccess);
  a.empty_cache();
  CHECK(a.reserved_bytes() == 4 * k_mib);
  CHECK(fake_cudart_mapped_bytes() == 4 * k_mib);
  REQUIRE(fake_cudart_end_capture(to_cuda_stream(s2)) == cudaSuccess);
  REQUIRE(fake_cudart_release(to_cuda_stream(s)) == cudaSuccess);
  a.empty_cache();  // the copy has run (the release waits for the device): now the pages go
  CHECK(a.reserved_bytes() == 0);
  CHECK(fake_cudart_mapped_bytes() == 0);
  CHECK(fake_cudart_take_async_error() == cudaSuccess);
  be.destroy_stream(s);
  be.destroy_stream(s2);
}

TEST_CASE("expandable segments: a runtime without the driver's virtual memory calls is refused with a clear error") {
  fake_cudart_set_vmm(0);
  cuda_backend be(0);
  fake_cudart_set_vmm(1);
  CHECK(be.vm_page() == 0);
  gact::alloc::allocator_options o;
  o.expandable_segments = true;
  std::string msg;
  try {
    gact::alloc::caching_allocator a(be, o);
  } catch (gact::invalid_argument const& e) {
    msg = e.what();
  }
  CHECK(contains(msg, "expandable_segments needs a backend with virtual memory calls; 'cuda' has none"));
}

TEST_CASE("pinned_host_backend: cudaHostAlloc / cudaFreeHost, pinned_host kind") {
  gact::device::pinned_host_backend be(0);
  std::size_t const allocs = fake_cudart_count("cudaHostAlloc");
  std::size_t const frees = fake_cudart_count("cudaFreeHost");
  void* p = be.reserve(5 * k_mib);
  REQUIRE(p != nullptr);
  std::memset(p, 1, 5 * k_mib);
  CHECK(fake_cudart_count("cudaHostAlloc") == allocs + 1);
  CHECK(fake_cudart_used_bytes(0) == 0);  // host memory: no device capacity used
  be.release(p, 5 * k_mib);
  CHECK(fake_cudart_count("cudaFreeHost") == frees + 1);
  CHECK(be.kind() == gact::device::memory_kind::pinned_host);
  CHECK(be.memory_info().total_bytes > 0);
  int local = 0;
  be.release(&local, 1);  // a foreign pointer: logged, not thrown
}
