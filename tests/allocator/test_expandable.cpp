// gact/tests/allocator/test_expandable.cpp — expandable segments: the caching allocator over one
// address range per stream whose pages are mapped as it grows (allocator_options::expandable_segments),
// on the host backend's virtual memory calls (mmap), and on a test backend whose events complete only
// when told. What they promise: no segment-size waste, blocks cut exactly, free pages given back on
// release, and after the out-of-memory retry a request that fits whenever the free whole pages plus the
// device's free memory hold it.
#include <doctest/doctest.h>

#include <algorithm>
#include <fstream>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/host_backend.hpp"
#include "allocator/error.hpp"
#include "manual_backend.hpp"

using gact::alloc::allocator_options;
using gact::alloc::caching_allocator;
using gact::alloc::pool_all;
using gact::device::host_backend;

namespace {

constexpr std::size_t k_mib = std::size_t{1} << 20;
constexpr std::size_t k_page = host_backend::k_vm_page;

allocator_options expandable(std::size_t range = 256 * k_mib) {
  allocator_options o;
  o.expandable_segments = true;
  o.expandable_range = range;
  return o;
}

/// expandable() with one more setting.
allocator_options expandable_with(std::size_t allocator_options::*field, std::size_t value) {
  allocator_options o = expandable();
  o.*field = value;
  return o;
}

std::uintptr_t addr(void const* p) { return reinterpret_cast<std::uintptr_t>(p); }

void fill(void* p, std::size_t n, unsigned char v) { std::memset(p, v, n); }

bool holds(void const* p, std::size_t n, unsigned char v) {
  auto const* c = static_cast<unsigned char const*>(p);
  return std::all_of(c, c + n, [v](unsigned char x) { return x == v; });
}

/// Virtual memory from a host_backend, events that complete only when the test says (as manual_backend's).
class vm_manual_backend final : public gact::device::backend {
 public:
  void complete_all() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [e, done] : events_) done = true;
  }
  int syncs() const { return syncs_; }
  /// Refuse address-space reservations above this many bytes (a limit on the process's address space).
  std::size_t max_vm_reserve = 0;
  /// What vm_reserve_hint() answers (0: no bound).
  std::size_t reserve_hint = 0;
  /// Refuse every vm_map (no memory behind the address space).
  bool refuse_maps = false;
  /// Ranges reserved and not yet freed, and the size of the last one reserved.
  int live_ranges = 0;
  std::size_t last_reserve = 0;

 private:
  void* do_reserve(std::size_t bytes) override { return host_.reserve(bytes); }
  void do_release(void* p, std::size_t bytes) noexcept override { host_.release(p, bytes); }
  gact::device::stream_t do_create_stream() override { return next_++; }
  void do_destroy_stream(gact::device::stream_t) noexcept override {}
  gact::device::event_t do_create_event() override { return next_++; }
  void do_destroy_event(gact::device::event_t) noexcept override {}
  void do_record(gact::device::event_t e, gact::device::stream_t) override {
    std::lock_guard<std::mutex> lock(mu_);
    events_[e] = false;
  }
  bool do_query(gact::device::event_t e) override {
    std::lock_guard<std::mutex> lock(mu_);
    return events_[e];
  }
  void do_wait(gact::device::stream_t, gact::device::event_t) override {}
  void do_synchronize(gact::device::event_t e) override {
    ++syncs_;
    std::lock_guard<std::mutex> lock(mu_);
    events_[e] = true;
  }
  void do_synchronize_stream(gact::device::stream_t) override { complete_all(); }
  void do_copy_async(void* d, void const* s, std::size_t n, gact::device::stream_t) override { std::memmove(d, s, n); }
  gact::device::mem_info do_memory_info() override { return host_.memory_info(); }
  gact::device::memory_kind do_kind() const noexcept override { return gact::device::memory_kind::host; }
  std::string_view do_name() const noexcept override { return "vm-manual"; }
  std::size_t do_vm_page() const noexcept override { return host_.vm_page(); }
  void* do_vm_reserve(std::size_t bytes) override {
    if (max_vm_reserve != 0 && bytes > max_vm_reserve) throw gact::out_of_memory("vm-manual: address space limit");
    void* p = host_.vm_reserve(bytes);
    ++live_ranges;
    last_reserve = bytes;
    return p;
  }
  std::size_t do_vm_reserve_hint() noexcept override { return reserve_hint; }
  void do_vm_free(void* p, std::size_t bytes) noexcept override {
    --live_ranges;
    host_.vm_free(p, bytes);
  }
  void do_vm_map(void* p, std::size_t bytes) override {
    if (refuse_maps) throw gact::out_of_memory("vm-manual: no memory");
    host_.vm_map(p, bytes);
  }
  bool do_vm_unmap(void* p, std::size_t bytes) noexcept override { return host_.vm_unmap(p, bytes); }

  host_backend host_;
  std::mutex mu_;
  std::map<gact::device::event_t, bool> events_;
  gact::device::stream_t next_ = 1;
  int syncs_ = 0;
};

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("host backend virtual memory: reserve, map, unmap, capacity") {
  host_backend be(8 * k_mib);
  REQUIRE(be.vm_page() == k_page);
  void* r = be.vm_reserve(64 * k_mib);  // address space: not counted against the 8 MiB
  CHECK(addr(r) % k_page == 0);
  CHECK(be.reserved_bytes() == 0);
  auto* c = static_cast<unsigned char*>(r);
  be.vm_map(c + k_page, 2 * k_page);
  CHECK(be.reserved_bytes() == 2 * k_page);
  CHECK(holds(c + k_page, 2 * k_page, 0));  // fresh pages are zero
  fill(c + k_page, 2 * k_page, 7);
  CHECK_THROWS_AS(be.vm_map(c + 3 * k_page, 3 * k_page), gact::out_of_memory);  // 4 + 6 MiB > 8
  CHECK(be.reserved_bytes() == 2 * k_page);
  CHECK(be.vm_unmap(c + k_page, k_page));
  CHECK(be.reserved_bytes() == k_page);
  CHECK(holds(c + 2 * k_page, k_page, 7));  // the other page kept its bytes
  be.vm_map(c + k_page, k_page);
  CHECK(holds(c + k_page, k_page, 0));  // mapped again: fresh
  CHECK_THROWS_AS(be.vm_map(c + 1, k_page), gact::invalid_argument);
  CHECK_THROWS_AS(be.vm_reserve(k_page + 512), gact::invalid_argument);
  CHECK(be.vm_unmap(c + k_page, 2 * k_page));
  CHECK(be.reserved_bytes() == 0);
  be.vm_free(r, 64 * k_mib);
}

TEST_CASE("a backend without virtual memory calls is refused, naming it") {
  gact::test::manual_backend be;
  CHECK(be.vm_page() == 0);
  try {
    caching_allocator a(be, expandable());
    FAIL("expected invalid_argument");
  } catch (gact::invalid_argument const& e) {
    CHECK(std::string(e.what()).find("'manual' has none") != std::string::npos);
  }
  host_backend hb;
  allocator_options o = expandable();
  o.backend_unlocked = true;
  CHECK_THROWS_AS(caching_allocator(hb, o), gact::invalid_argument);
}

TEST_CASE("expandable: blocks are cut exactly and side by side, pages mapped as the range grows") {
  host_backend be;
  caching_allocator a(be, expandable());
  void* p = a.allocate(3 * k_mib);
  CHECK(a.reserved_bytes() == 2 * k_page);  // 3 MiB on 2 MiB pages
  CHECK(a.block_size(p) == 3 * k_mib);      // no unsplit remainder
  void* q = a.allocate(5 * k_mib);          // the free 1 MiB after p is extended by two pages
  CHECK(addr(q) == addr(p) + 3 * k_mib);
  CHECK(a.reserved_bytes() == 8 * k_mib);
  CHECK(a.allocated_bytes() == 8 * k_mib);
  void* s = a.allocate(1000);  // a small request: the small pool's own range, one page
  CHECK(a.block_size(s) == 1024);
  CHECK(a.reserved_bytes() == 10 * k_mib);
  void* s2 = a.allocate(1000);  // beside it
  CHECK(addr(s2) == addr(s) + 1024);
  CHECK(be.reserved_bytes() == a.reserved_bytes());
  fill(p, 3 * k_mib, 1);
  fill(q, 5 * k_mib, 2);
  CHECK(a.contains(p));
  auto const st = a.stats();
  CHECK(st.segment[pool_all].current == 2);  // one range per pool
  CHECK(st.segment[gact::alloc::pool_small].current == 1);
  CHECK(st.reserved_bytes[pool_all].current == static_cast<std::int64_t>(10 * k_mib));
  CHECK(st.reserved_bytes[gact::alloc::pool_small].current == static_cast<std::int64_t>(2 * k_mib));
  auto const j = a.stats_json();
  CHECK(j["options"]["expandable_segments"] == true);

  a.deallocate(p);
  void* p2 = a.allocate(2 * k_mib);  // best fit in the freed 3 MiB: no new page
  CHECK(p2 == p);
  CHECK(a.reserved_bytes() == 10 * k_mib);
  CHECK(holds(q, 5 * k_mib, 2));
  for (void* x : {p2, q, s, s2}) a.deallocate(x);
  CHECK(a.reserved_bytes() == 10 * k_mib);  // cached until released
  a.empty_cache();
  CHECK(a.reserved_bytes() == 0);
  CHECK(be.reserved_bytes() == 0);
  CHECK(a.stats().segment[pool_all].current == 0);  // the whole range given back
  CHECK_FALSE(a.contains(q));
}

TEST_CASE("expandable: empty_cache unmaps the free pages between live blocks and keeps the partial ones") {
  host_backend be;
  caching_allocator a(be, expandable());
  std::size_t const n = 3 * k_mib / 2;  // (large: above the small pool's 1 MiB)
  void* x = a.allocate(n);             // [0, 1.5) MiB
  void* hole = a.allocate(9 * k_mib);  // [1.5, 10.5)
  void* y = a.allocate(n);             // [10.5, 12)
  CHECK(addr(y) == addr(x) + n + 9 * k_mib);
  fill(x, n, 3);
  fill(y, n, 4);
  CHECK(a.reserved_bytes() == 12 * k_mib);
  a.deallocate(hole);
  a.empty_cache();
  // pages [2, 10) MiB lie wholly in the free block: unmapped; [0, 2) and [10, 12) hold x and y
  CHECK(a.reserved_bytes() == 4 * k_mib);
  CHECK(be.reserved_bytes() == 4 * k_mib);
  CHECK(holds(x, n, 3));
  CHECK(holds(y, n, 4));
  void* z = a.allocate(9 * k_mib);  // the hole is mapped again where it was, with the partial pages either side
  CHECK(z == hole);
  CHECK(a.reserved_bytes() == 12 * k_mib);
  fill(z, 9 * k_mib, 5);
  CHECK(holds(x, n, 3));
  CHECK(holds(y, n, 4));
  for (void* p : {x, y, z}) a.deallocate(p);
  a.empty_cache();
  CHECK(a.reserved_bytes() == 0);
}

TEST_CASE("expandable: out of memory with free holes: the retry gives their pages back and the request fits") {
  // 16 blocks of 4 MiB fill a 64 MiB device; every other one freed leaves 32 MiB free in 4 MiB holes. A
  // 24 MiB request fits in no hole and the device has nothing left: fixed segments fail, the range unmaps
  // the holes and maps 24 MiB at its end.
  for (bool exp : {false, true}) {
    CAPTURE(exp);
    host_backend be(64 * k_mib);
    allocator_options o = exp ? expandable() : allocator_options{};
    o.min_large_alloc = 4 * k_mib;  // fixed segments: each 4 MiB block its own segment, as large tensors get
    o.large_segment_size = 4 * k_mib;
    caching_allocator a(be, o);
    std::vector<void*> blocks;
    for (int i = 0; i < 16; ++i) {
      blocks.push_back(a.allocate(4 * k_mib));
      fill(blocks.back(), 4 * k_mib, static_cast<unsigned char>(i + 1));
    }
    for (int i = 0; i < 16; i += 2) a.deallocate(blocks[static_cast<std::size_t>(i)]);
    CHECK(a.reserved_bytes() == 64 * k_mib);
    if (!exp) {
      // whole free segments are released and the retry can reserve 24 MiB: fixed segments of their own do
      // this too; what they cannot do is the case below, where the holes are inside one segment
      void* big = a.allocate(24 * k_mib);
      CHECK(big != nullptr);
      a.deallocate(big);
    } else {
      void* big = a.allocate(24 * k_mib);
      REQUIRE(big != nullptr);
      CHECK(a.stats().num_alloc_retries == 1);
      CHECK(a.reserved_bytes() == 8 * 4 * k_mib + 24 * k_mib);  // the live blocks' pages and the new one's
      fill(big, 24 * k_mib, 0xEE);
      a.deallocate(big);
    }
    for (int i = 1; i < 16; i += 2) {
      CHECK(holds(blocks[static_cast<std::size_t>(i)], 4 * k_mib, static_cast<unsigned char>(i + 1)));
      a.deallocate(blocks[static_cast<std::size_t>(i)]);
    }
  }
}

TEST_CASE("expandable: holes inside what fixed segments would share: the retry still fits the request") {
  // The sizes of a training step: blocks of 3 MiB in 20 MiB segments (PyTorch's layout for requests under
  // 10 MiB). Every other one freed: fixed segments keep each segment (one live block pins it) and a 9 MiB
  // request fails with 30 MiB free; the range unmaps the whole pages of the holes and maps 9 MiB.
  std::size_t const cap = 60 * k_mib;
  for (bool exp : {false, true}) {
    CAPTURE(exp);
    host_backend be(cap);
    caching_allocator a(be, exp ? expandable() : allocator_options{});
    std::vector<void*> blocks;
    try {
      for (;;) blocks.push_back(a.allocate(3 * k_mib));
    } catch (gact::out_of_memory const&) {
    }
    REQUIRE(blocks.size() >= 18);
    for (std::size_t i = 0; i < blocks.size(); ++i) fill(blocks[i], 3 * k_mib, static_cast<unsigned char>(i + 1));
    for (std::size_t i = 0; i < blocks.size(); i += 2) a.deallocate(blocks[i]);
    if (!exp) {
      CHECK_THROWS_AS(a.allocate(9 * k_mib), gact::out_of_memory);
    } else {
      void* big = a.allocate(9 * k_mib);
      REQUIRE(big != nullptr);
      fill(big, 9 * k_mib, 0xAB);
      a.deallocate(big);
    }
    for (std::size_t i = 1; i < blocks.size(); i += 2) {
      CHECK(holds(blocks[i], 3 * k_mib, static_cast<unsigned char>(i + 1)));
      a.deallocate(blocks[i]);
    }
    a.empty_cache();
    CHECK(a.reserved_bytes() == 0);
  }
}

TEST_CASE("expandable: the memory limit is exact, and the error says what was tried") {
  host_backend be;
  caching_allocator a(be, expandable_with(&allocator_options::memory_limit, 8 * k_mib));
  void* p = a.allocate(6 * k_mib);
  void* q = a.allocate(2 * k_mib);  // exactly at the limit
  CHECK(a.reserved_bytes() == 8 * k_mib);
  try {
    (void)a.allocate(512);
    FAIL("expected out_of_memory");
  } catch (gact::out_of_memory const& e) {
    CHECK(std::string(e.what()).find("expandable segment") != std::string::npos);
    CHECK(std::string(e.what()).find("memory limit") != std::string::npos);
  }
  CHECK(a.stats().num_ooms == 1);
  CHECK(a.stats().reserved_bytes[pool_all].peak == static_cast<std::int64_t>(8 * k_mib));
  a.deallocate(p);
  a.deallocate(q);
}

TEST_CASE("expandable: an injected mapping failure is retried after the release, then thrown") {
  host_backend be;
  caching_allocator a(be, expandable());
  void* p = a.allocate(4 * k_mib);
  a.deallocate(p);
  be.fail_reserves(0, 1);  // the next vm_map fails once
  void* q = a.allocate(6 * k_mib);  // first grow fails; the retry maps again
  CHECK(q != nullptr);
  CHECK(a.stats().num_alloc_retries == 1);
  be.fail_reserves(0, 2);
  CHECK_THROWS_AS(a.allocate(8 * k_mib), gact::out_of_memory);
  a.deallocate(q);
  a.empty_cache();
  CHECK(be.reserved_bytes() == 0);
}

TEST_CASE("expandable: streams get ranges of their own, a block is not reused across them") {
  host_backend be;
  caching_allocator a(be, expandable());
  auto const s1 = be.create_stream();
  auto const s2 = be.create_stream();
  void* p = a.allocate(k_mib, s1);
  a.deallocate(p);
  void* q = a.allocate(k_mib, s2);
  CHECK(q != p);
  CHECK(a.stats().segment[pool_all].current == 2);
  void* r = a.allocate(k_mib, s1);
  CHECK(r == p);
  a.deallocate(q);
  a.deallocate(r);
  a.empty_cache();
  CHECK(a.stats().segment[pool_all].current == 0);
}

TEST_CASE("expandable: a block used on another stream is reused only after its event, and release waits for it") {
  vm_manual_backend be;
  caching_allocator a(be, expandable());
  void* p = a.allocate(3 * k_mib, 1);
  a.record_stream(p, 99);
  a.deallocate(p);  // pending on stream 99
  void* q = a.allocate(3 * k_mib, 1);
  CHECK(q != p);
  be.complete_all();
  void* r = a.allocate(3 * k_mib, 1);  // the event has completed: p's memory is free again
  CHECK(r == p);
  a.record_stream(r, 99);
  a.deallocate(r);
  a.deallocate(q);
  a.empty_cache();  // waits for r's event, then unmaps everything
  CHECK(be.syncs() >= 1);
  CHECK(a.reserved_bytes() == 0);
}

TEST_CASE("expandable: release_free_above unmaps a large free run at once") {
  host_backend be;
  caching_allocator a(be, expandable_with(&allocator_options::release_free_above, 8 * k_mib));
  std::size_t const n = 3 * k_mib / 2;
  void* x = a.allocate(n);             // [0, 1.5) MiB
  void* big = a.allocate(12 * k_mib);  // [1.5, 13.5)
  void* y = a.allocate(n);             // [13.5, 15)
  CHECK(a.reserved_bytes() == 16 * k_mib);
  a.deallocate(big);  // whole pages [2, 12) inside it: 10 MiB, at least 8, unmapped now
  CHECK(a.reserved_bytes() == 6 * k_mib);
  void* w = a.allocate(n);  // the partial page before y serves it, no mapping
  CHECK(addr(w) == 12 * k_mib + addr(x));
  CHECK(a.reserved_bytes() == 6 * k_mib);
  a.deallocate(w);  // 1.5 MiB free: no whole page to give back at that threshold
  CHECK(a.reserved_bytes() == 6 * k_mib);
  for (void* p : {x, y}) a.deallocate(p);
}

TEST_CASE("expandable: release_on_miss_above returns the large free runs before a request the cache cannot serve") {
  for (std::size_t const above : {std::size_t{0}, 4 * k_mib}) {
    CAPTURE(above);
    host_backend be;
    caching_allocator a(be, expandable_with(&allocator_options::release_on_miss_above, above));
    void* big = a.allocate(6 * k_mib);  // [0, 6)
    void* mid = a.allocate(2 * k_mib);  // [6, 8)
    void* tail = a.allocate(2 * k_mib);  // [8, 10)
    fill(mid, 2 * k_mib, 0x5a);
    a.deallocate(big);  // cached, both ways (release_free_above is off)
    a.deallocate(tail);
    CHECK(a.reserved_bytes() == 10 * k_mib);
    void* hit = a.allocate(2 * k_mib);  // served by the cache: nothing is returned
    CHECK(a.reserved_bytes() == 10 * k_mib);
    a.deallocate(hit);
    // A miss: with the option the 6 MiB run goes back first, and the 2 MiB run at the end grows by 6 MiB into
    // the block; without it, the 6 MiB stay mapped beside the new pages.
    void* y = a.allocate(8 * k_mib);
    CHECK(a.reserved_bytes() == (above != 0 ? 10 * k_mib : 16 * k_mib));
    CHECK(holds(mid, 2 * k_mib, 0x5a));
    fill(y, 8 * k_mib, 0x33);
    void* z = a.allocate(2 * k_mib);  // with the option a miss that maps 2 MiB; without it the cached 6 MiB run serves it
    CHECK(a.reserved_bytes() == (above != 0 ? 12 * k_mib : 16 * k_mib));
    for (void* p : {mid, y, z}) a.deallocate(p);
    CHECK(a.allocated_bytes() == 0);
  }
}

TEST_CASE("expandable: a miss that maps less than release_on_miss_above returns nothing") {
  host_backend be;
  caching_allocator a(be, expandable_with(&allocator_options::release_on_miss_above, 4 * k_mib));
  auto const s2 = be.create_stream();
  void* big = a.allocate(40 * k_mib);  // [0, 40) of stream 0's range
  a.deallocate(big);
  CHECK(a.reserved_bytes() == 40 * k_mib);
  // A small miss on another stream maps one page: the cached run stays (before: all 40 MiB went back, and the next
  // 40 MiB request mapped them again).
  void* other = a.allocate(k_page, s2);
  CHECK(a.reserved_bytes() == 40 * k_mib + k_page);
  CHECK(a.stats().num_device_free == 0);
  void* hit = a.allocate(40 * k_mib);  // the cache serves it
  CHECK(a.reserved_bytes() == 40 * k_mib + k_page);
  a.deallocate(hit);
  a.deallocate(other);
  // A large temporary freed, then a small tensor kept from its run, step after step: each miss of the temporary
  // extends the run by what the kept tensors took from it, and nothing is unmapped.
  std::vector<void*> kept;
  for (int step = 0; step < 3; ++step) {
    void* t = a.allocate(40 * k_mib);
    fill(t, 40 * k_mib, 0x11);
    a.deallocate(t);
    kept.push_back(a.allocate(2 * k_mib));
    fill(kept.back(), 2 * k_mib, static_cast<unsigned char>(step));
  }
  CHECK(a.stats().num_device_free == 0);
  CHECK(a.reserved_bytes() <= (40 + 3 * 2) * k_mib + k_page);
  for (std::size_t i = 0; i < kept.size(); ++i) CHECK(holds(kept[i], 2 * k_mib, static_cast<unsigned char>(i)));
  for (void* p : kept) a.deallocate(p);
  CHECK(a.allocated_bytes() == 0);
}

TEST_CASE("expandable: random allocations and frees keep every invariant and every byte") {
  // Sizes log-uniform in [1 B, 48 MiB] on two streams, a 192 MiB device: out of memory happens, and after
  // each one the free whole pages plus the device's room must not have held the request in one piece.
  std::mt19937_64 rng(20261206);
  host_backend be(192 * k_mib);
  caching_allocator a(be, expandable(1024 * k_mib));
  struct live {
    std::size_t n;
    unsigned char v;
    gact::device::stream_t s;
  };
  std::map<std::uintptr_t, live> blocks;
  std::uniform_real_distribution<double> logsize(0.0, std::log2(48.0 * k_mib));
  std::size_t ooms = 0;
  for (int step = 0; step < 4000; ++step) {
    bool const alloc = blocks.empty() || rng() % 100 < 55;
    if (alloc) {
      auto const n = static_cast<std::size_t>(std::exp2(logsize(rng)));
      gact::device::stream_t const s = rng() % 4 == 0 ? 7 : 0;
      void* p = nullptr;
      try {
        p = a.allocate(n, s);
      } catch (gact::out_of_memory const&) {
        ++ooms;
        // nothing was lost: every live block still holds its bytes (checked below), and the request was
        // larger than the device's room, all free memory given back by the retry
        CHECK(be.memory_info().free_bytes < (n + k_page - 1) / k_page * k_page);
        continue;
      }
      auto const v = static_cast<unsigned char>(rng());
      std::size_t const head = std::min<std::size_t>(n, 64);
      std::memset(p, v, head);
      std::memset(static_cast<unsigned char*>(p) + n - head, v, head);
      CHECK(a.block_size(p) == std::max<std::size_t>(512, (n + 511) / 512 * 512));
      auto const [it, fresh] = blocks.emplace(addr(p), live{n, v, s});
      CHECK(fresh);
      if (it != blocks.begin()) CHECK(std::prev(it)->first + std::prev(it)->second.n <= addr(p));
      if (std::next(it) != blocks.end()) CHECK(addr(p) + n <= std::next(it)->first);
    } else {
      auto it = blocks.begin();
      std::advance(it, static_cast<long>(rng() % blocks.size()));
      auto* p = reinterpret_cast<unsigned char*>(it->first);
      live const l = it->second;
      std::size_t const head = std::min<std::size_t>(l.n, 64);
      CHECK(holds(p, head, l.v));
      CHECK(holds(p + l.n - head, head, l.v));
      a.deallocate(p);
      blocks.erase(it);
    }
    if (step % 500 == 499) a.empty_cache();
    REQUIRE(a.reserved_bytes() == be.reserved_bytes());
    CHECK(a.allocated_bytes() <= a.reserved_bytes());
  }
  CHECK(ooms > 0);  // the test reached the device's limit
  for (auto const& [p, l] : blocks) a.deallocate(reinterpret_cast<void*>(p));
  a.empty_cache();
  CHECK(a.reserved_bytes() == 0);
  CHECK(be.reserved_bytes() == 0);
  CHECK(a.stats().segment[pool_all].current == 0);
}

TEST_CASE("expandable: a range whose address space is cut up by live blocks is joined by another") {
  host_backend be;
  caching_allocator a(be, expandable(32 * k_mib));
  void* p = a.allocate(10 * k_mib);
  void* q = a.allocate(10 * k_mib);
  void* r = a.allocate(10 * k_mib);
  a.deallocate(q);  // 10 MiB free in the middle, 2 MiB of address space left at the end
  void* big = a.allocate(12 * k_mib);
  REQUIRE(big != nullptr);
  CHECK((addr(big) < addr(p) || addr(big) >= addr(p) + 32 * k_mib));  // in a second range
  CHECK(a.stats().segment[pool_all].current == 2);
  fill(big, 12 * k_mib, 6);
  for (void* x : {p, r, big}) a.deallocate(x);
  a.empty_cache();
  CHECK(a.reserved_bytes() == 0);
  CHECK(a.stats().segment[pool_all].current == 0);
}

TEST_CASE("expandable: a limit on the address space gives smaller ranges, and a clear error past it") {
  vm_manual_backend be;
  be.max_vm_reserve = 40 * k_mib;  // 256 MiB asked: 128, 64, then 32 MiB given
  caching_allocator a(be, expandable(256 * k_mib));
  void* p = a.allocate(8 * k_mib);
  REQUIRE(p != nullptr);
  void* q = a.allocate(30 * k_mib);  // not in the first 32 MiB range beside p: a second one
  REQUIRE(q != nullptr);
  CHECK(a.stats().segment[pool_all].current == 2);
  try {
    (void)a.allocate(48 * k_mib);  // more than any range the backend gives
    FAIL("expected out_of_memory");
  } catch (gact::out_of_memory const& e) {
    CHECK(std::string(e.what()).find("address space limit") != std::string::npos);
  }
  a.deallocate(p);
  a.deallocate(q);
  a.empty_cache();
  CHECK(a.reserved_bytes() == 0);
}

TEST_CASE("expandable: the backend's hint bounds a new range; a larger request gets a range of its own size") {
  vm_manual_backend be;
  be.reserve_hint = 8 * k_mib;  // (the host's share of a `ulimit -v` headroom)
  caching_allocator a(be, expandable(0));  // (no range option: the backend's memory, bounded by the hint)
  void* p = a.allocate(k_mib);
  CHECK(be.last_reserve == 8 * k_mib);
  void* q = a.allocate(20 * k_mib);  // larger than the hint: its own range
  CHECK(be.last_reserve == 20 * k_mib);
  CHECK(a.stats().segment[pool_all].current == 2);
  be.reserve_hint = 0;
  a.deallocate(p);
  a.deallocate(q);
  a.empty_cache();
  CHECK(be.live_ranges == 0);
}

TEST_CASE("expandable: a range reserved for a request whose memory is refused goes back at once") {
  vm_manual_backend be;
  be.refuse_maps = true;
  caching_allocator a(be, expandable());
  CHECK_THROWS_AS((void)a.allocate(4 * k_mib), gact::out_of_memory);
  CHECK(be.live_ranges == 0);  // (it kept an empty reservation until the next release)
  CHECK(a.stats().segment[pool_all].current == 0);
  be.refuse_maps = false;
  void* p = a.allocate(4 * k_mib);
  CHECK(p != nullptr);
  a.deallocate(p);
}

TEST_CASE("host backend: under a limit on the address space, a range takes an eighth of what is left") {
  CHECK(host_backend().vm_reserve_hint() == 0);  // (the test process has no limit)
  CHECK(host_backend::reserve_hint_for(1000 * k_mib, 200 * k_mib, k_page) == 100 * k_mib);
  CHECK(host_backend::reserve_hint_for(1000 * k_mib, 201 * k_mib, k_page) == 98 * k_mib);  // (whole pages)
  CHECK(host_backend::reserve_hint_for(1000 * k_mib, 999 * k_mib, k_page) == k_page);     // (at least one)
  CHECK(host_backend::reserve_hint_for(1000 * k_mib, 2000 * k_mib, k_page) == k_page);    // (over the limit)
}

TEST_CASE("expandable: holes do not split the process's memory map (vm.max_map_count)") {
  auto const maps = [] {
    std::ifstream f("/proc/self/maps");
    std::string line;
    std::size_t n = 0;
    while (std::getline(f, line)) ++n;
    return n;
  };
  host_backend be(0, 64 << 10);  // the host arena's pages
  caching_allocator a(be, expandable());
  std::vector<void*> blocks;
  for (int i = 0; i < 400; ++i) blocks.push_back(a.allocate(64 << 10));
  std::size_t const before = maps();
  for (std::size_t i = 0; i < blocks.size(); i += 2) a.deallocate(blocks[i]);
  a.empty_cache();  // 200 one-page holes between live blocks
  CHECK(a.reserved_bytes() == 200 * (std::size_t{64} << 10));
  CHECK(maps() <= before + 4);
  void* big = a.allocate(64 << 10);  // a hole mapped again
  CHECK(a.reserved_bytes() == 201 * (std::size_t{64} << 10));
  a.deallocate(big);
  for (std::size_t i = 1; i < blocks.size(); i += 2) a.deallocate(blocks[i]);
  a.empty_cache();
  CHECK(a.reserved_bytes() == 0);
}

}  // TEST_SUITE
