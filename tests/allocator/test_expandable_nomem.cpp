// gact/tests/allocator/test_expandable_nomem.cpp — expandable segments when the heap refuses: every
// allocation the allocator makes while it releases or grows (records, free-set nodes, the holes map, its
// lists) is made to fail in turn, and the allocator must come out consistent each time: the pages it could
// not give back stay mapped and free, later requests are served, and everything is released at the end.
// Its own executable, since it replaces the global operator new.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/host_backend.hpp"
#include "allocator/error.hpp"

namespace {
std::atomic<long> g_fail_in{0};  // > 0: the g_fail_in-th allocation from now throws bad_alloc
}

void* operator new(std::size_t n) {
  if (g_fail_in.load(std::memory_order_relaxed) > 0 && g_fail_in.fetch_sub(1, std::memory_order_relaxed) == 1) {
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t al) {
  if (g_fail_in.load(std::memory_order_relaxed) > 0 && g_fail_in.fetch_sub(1, std::memory_order_relaxed) == 1) {
    throw std::bad_alloc();
  }
  std::size_t const a = static_cast<std::size_t>(al);
  if (void* p = std::aligned_alloc(a, (n + a - 1) / a * a)) return p;
  throw std::bad_alloc();
}
// The matching deletes (free()), so that a sanitizer that tracks new against delete sees a pair. (GCC cannot
// tell that these operator news return malloc's memory.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace {
constexpr std::size_t k_mib = std::size_t{1} << 20;

gact::alloc::allocator_options expandable() {
  gact::alloc::allocator_options o;
  o.expandable_segments = true;
  o.expandable_range = 256 * k_mib;
  o.name = "nomem";
  return o;
}
}  // namespace

TEST_CASE("expandable: a failed heap allocation at any point of a release or a growth leaves a sound allocator") {
  int escaped = 0;   // the failure left empty_cache() or allocate() as bad_alloc, before anything changed
  int absorbed = 0;  // the failure hit a block's unmapping, which kept that block mapped and went on
  for (long n = 1; n <= 40; ++n) {
    CAPTURE(n);
    gact::device::host_backend be;
    gact::alloc::caching_allocator a(be, expandable());
    std::size_t const n3 = 3 * k_mib / 2;  // (large blocks: one range with y's)
    void* x = a.allocate(n3);
    void* y = a.allocate(9 * k_mib);
    void* z = a.allocate(n3);
    std::memset(x, 1, n3);
    std::memset(z, 3, n3);
    a.deallocate(y);
    std::size_t const mapped = a.reserved_bytes();
    g_fail_in = n;  // the n-th heap allocation from here fails
    bool threw = false;
    try {
      a.empty_cache();
      if (g_fail_in.load() <= 0) absorbed += a.reserved_bytes() == mapped ? 1 : 0;
      void* w = a.allocate(12 * k_mib);  // a growth past the end
      a.deallocate(w);
    } catch (std::bad_alloc const&) {
      threw = true;
    }
    escaped += threw ? 1 : 0;
    g_fail_in = 0;
    // whatever happened: the allocator serves, frees (merging with the blocks the release touched) and
    // releases as before, and the live blocks kept their bytes
    CHECK(a.reserved_bytes() == be.reserved_bytes());
    void* v = a.allocate(512 * 1024);
    void* u = a.allocate(20 * k_mib);
    std::memset(v, 5, 512 * 1024);
    std::memset(u, 4, 20 * k_mib);
    auto const* cx = static_cast<unsigned char const*>(x);
    auto const* cz = static_cast<unsigned char const*>(z);
    CHECK((cx[0] == 1 && cx[n3 - 1] == 1 && cz[0] == 3 && cz[n3 - 1] == 3));
    for (void* p : {x, v, z, u}) a.deallocate(p);
    a.empty_cache();
    CHECK(a.reserved_bytes() == 0);
    CHECK(be.reserved_bytes() == 0);
    CHECK(a.stats().segment[gact::alloc::pool_all].current == 0);
    CHECK(a.stats_json()["fragmentation"]["total_free"] == 0);
  }
  CHECK(escaped > 0);
  CHECK(absorbed > 0);
}

TEST_CASE("a failed heap allocation inside allocate() loses no block, with fixed segments or a range") {
  // allocate() takes the live map's room and a split record before a block leaves its free set: a failure there
  // must leave the block where it was (found by a review: the block was lost, its segment never released)
  for (bool exp : {false, true}) {
    int failed = 0;
    for (long n = 1; n <= 60; ++n) {
      CAPTURE(exp);
      CAPTURE(n);
      gact::device::host_backend be;
      gact::alloc::allocator_options o = exp ? expandable() : gact::alloc::allocator_options{};
      gact::alloc::caching_allocator a(be, o);
      std::vector<void*> got;
      got.reserve(80);  // (the test's own list must not fail)
      g_fail_in = n;
      try {
        for (int i = 0; i < 80; ++i) got.push_back(a.allocate(std::size_t{4096} * static_cast<std::size_t>(1 + i % 7)));
      } catch (std::bad_alloc const&) {
        ++failed;
      }
      g_fail_in = 0;
      for (void* p : got) a.deallocate(p);
      a.empty_cache();
      CHECK(a.reserved_bytes() == 0);
      CHECK(a.allocated_bytes() == 0);
      CHECK(be.reserved_bytes() == 0);
    }
    CHECK(failed > 0);
  }
}
