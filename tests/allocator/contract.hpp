// gact/tests/allocator/contract.hpp
//
// The caching allocator's contract, written once and instantiated per backend
// (doctest's version of RMM's typed suites). A fixture type F must provide:
//
//   F();                                          a fresh backend (one per test run)
//   gact::device::backend& backend();             the backend under test
//   std::unique_ptr<gact::alloc::caching_allocator>
//       make(gact::alloc::allocator_options o);   an allocator over backend() with o
//   gact::device::stream_t stream(int i);         the i-th distinct non-default stream, i in [0, 4)
//   static constexpr bool host_accessible;        true when the CPU may read/write the memory
//
// and is instantiated with
//
//   TEST_CASE_TEMPLATE_INVOKE(allocator_contract, my_fixture);
//
// Every check here holds for any backend whose events eventually complete when
// the host synchronizes (empty_cache waits for them). Sizes are chosen against
// the default segment sizes (2 MiB small, 20 MiB large, rounding to 2 MiB).
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/error.hpp"

namespace gact::test {

inline constexpr std::size_t k_kib = std::size_t{1} << 10;
inline constexpr std::size_t k_mib = std::size_t{1} << 20;

inline std::uintptr_t addr(void const* p) { return reinterpret_cast<std::uintptr_t>(p); }

/// Keys of torch.cuda.memory_stats() that every allocator's JSON must carry.
inline std::vector<std::string> torch_stat_keys() {
  std::vector<std::string> keys;
  for (char const* a : {"allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                        "active_bytes", "inactive_split_bytes", "requested_bytes"}) {
    for (char const* p : {"all", "small_pool", "large_pool"}) {
      for (char const* f : {"current", "peak", "allocated", "freed"}) {
        keys.push_back(std::string(a) + "." + p + "." + f);
      }
    }
  }
  for (char const* s : {"num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free"}) {
    keys.emplace_back(s);
  }
  return keys;
}

}  // namespace gact::test

TEST_CASE_TEMPLATE_DEFINE("allocator contract", F, allocator_contract) {
  using gact::alloc::allocator_options;
  using gact::test::addr;
  using gact::test::k_mib;
  F fx;

  SUBCASE("alignment, distinct non-overlapping blocks, owns and block_size") {
    auto a = fx.make(allocator_options{});
    std::vector<std::size_t> const sizes{1, 511, 512, 513, 4096, k_mib - 1, k_mib, k_mib + 1, 5 * k_mib, 12 * k_mib + 3};
    std::vector<void*> ptrs;
    for (std::size_t s : sizes) {
      void* p = a->allocate(s, 0);
      REQUIRE(p != nullptr);
      CHECK(addr(p) % 512 == 0);
      CHECK(a->owns(p));
      CHECK(a->block_size(p) >= (s + 511) / 512 * 512);
      if constexpr (F::host_accessible) std::memset(p, 0xAB, s);
      ptrs.push_back(p);
    }
    for (std::size_t i = 0; i < ptrs.size(); ++i) {
      for (std::size_t j = i + 1; j < ptrs.size(); ++j) {
        bool const disjoint = addr(ptrs[i]) + a->block_size(ptrs[i]) <= addr(ptrs[j]) ||
                              addr(ptrs[j]) + a->block_size(ptrs[j]) <= addr(ptrs[i]);
        CHECK(disjoint);
      }
    }
    auto const st = a->stats();
    CHECK(st.allocation[gact::alloc::pool_all].current == static_cast<std::int64_t>(sizes.size()));
    std::int64_t requested = 0;
    for (std::size_t s : sizes) requested += static_cast<std::int64_t>(s);
    CHECK(st.requested_bytes[gact::alloc::pool_all].current == requested);
    for (void* p : ptrs) a->deallocate(p);
    CHECK(a->allocated_bytes() == 0);
    CHECK_FALSE(a->owns(ptrs[0]));
    a->empty_cache();
    CHECK(a->reserved_bytes() == 0);
  }

  SUBCASE("size-zero returns nullptr and counts") {
    auto a = fx.make(allocator_options{});
    CHECK(a->allocate(0, 0) == nullptr);
    auto const st = a->stats();
    CHECK(st.zero_size == 1);
    CHECK(st.allocation[gact::alloc::pool_all].current == 0);
    CHECK(a->reserved_bytes() == 0);
    CHECK(a->stats_json()["errors"]["zero_size"] == 1);
  }

  SUBCASE("size-absurd throws invalid_argument and counts") {
    allocator_options o;
    o.max_request = 64 * k_mib;
    auto a = fx.make(o);
    CHECK_THROWS_AS(a->allocate(64 * k_mib + 1, 0), gact::invalid_argument);
    CHECK_THROWS_AS(a->allocate(~std::size_t{0}, 0), gact::invalid_argument);
    CHECK(a->stats().invalid_size == 2);
    CHECK(a->reserved_bytes() == 0);
    void* p = a->allocate(64 * k_mib, 0);  // exactly max_request is fine
    CHECK(p != nullptr);
    a->deallocate(p);
  }

  SUBCASE("free-unknown-pointer is counted and changes nothing") {
    auto a = fx.make(allocator_options{});
    void* p = a->allocate(4096, 0);
    auto const before = a->stats();
    int local = 0;
    a->deallocate(&local);
    a->deallocate(static_cast<char*>(p) + 512);  // inside a live block, not its start
    auto const after = a->stats();
    CHECK(after.invalid_free == 2);
    CHECK(after.double_free == 0);
    CHECK(after.allocation[gact::alloc::pool_all].current == before.allocation[gact::alloc::pool_all].current);
    CHECK(after.allocated_bytes[gact::alloc::pool_all].current == before.allocated_bytes[gact::alloc::pool_all].current);
    CHECK(a->owns(p));
    a->deallocate(p);
    CHECK(a->allocated_bytes() == 0);
  }

  SUBCASE("double-free is counted and changes nothing") {
    auto a = fx.make(allocator_options{});
    void* keep = a->allocate(4096, 0);
    void* p = a->allocate(8192, 0);
    a->deallocate(p);
    auto const before = a->stats();
    a->deallocate(p);
    auto const after = a->stats();
    CHECK(after.double_free == 1);
    CHECK(after.invalid_free == 0);
    CHECK(after.allocation[gact::alloc::pool_all].current == 1);
    CHECK(after.inactive_split[gact::alloc::pool_all].current == before.inactive_split[gact::alloc::pool_all].current);
    CHECK(a->owns(keep));
    a->deallocate(keep);
    a->empty_cache();
    CHECK(a->reserved_bytes() == 0);
  }

  SUBCASE("split and coalesce within a segment") {
    auto a = fx.make(allocator_options{});
    using gact::alloc::pool_all;
    using gact::alloc::pool_small;
    void* x = a->allocate(1000, 0);  // 1024 B from a new 2 MiB small segment
    void* y = a->allocate(1000, 0);  // best fit: the remainder right after x
    CHECK(a->block_size(x) == 1024);
    CHECK(addr(y) == addr(x) + 1024);
    auto st = a->stats();
    CHECK(st.segment[pool_small].current == 1);
    CHECK(st.reserved_bytes[pool_small].current == static_cast<std::int64_t>(2 * k_mib));
    CHECK(st.inactive_split[pool_small].current == 1);  // the tail after y
    CHECK(st.inactive_split_bytes[pool_small].current == static_cast<std::int64_t>(2 * k_mib - 2048));
    a->deallocate(x);  // x is free but cannot merge with y
    st = a->stats();
    CHECK(st.inactive_split[pool_small].current == 2);
    CHECK(st.inactive_split_bytes[pool_small].current == static_cast<std::int64_t>(2 * k_mib - 1024));
    a->deallocate(y);  // y merges with both neighbours: the segment is whole again
    st = a->stats();
    CHECK(st.inactive_split[pool_all].current == 0);
    CHECK(st.inactive_split_bytes[pool_all].current == 0);
    CHECK(st.segment[pool_all].current == 1);
    CHECK(st.active[pool_all].current == 0);
    void* whole = a->allocate(k_mib, 0);  // the largest small request reuses the coalesced segment
    CHECK(addr(whole) == addr(x));
    CHECK(a->stats().segment[pool_all].current == 1);
    CHECK(a->stats().num_device_alloc == 1);
    a->deallocate(whole);
    a->empty_cache();
    CHECK(a->reserved_bytes() == 0);
    CHECK(a->stats().num_device_free == 1);
  }

  SUBCASE("per-stream reuse") {
    auto a = fx.make(allocator_options{});
    auto const s1 = fx.stream(0);
    auto const s2 = fx.stream(1);
    void* p = a->allocate(4096, s1);
    a->deallocate(p);
    void* q = a->allocate(4096, s2);  // s1's cached block is not reused on s2
    CHECK(q != p);
    CHECK(a->stats().segment[gact::alloc::pool_all].current == 2);
    void* r = a->allocate(4096, s1);  // but is on s1
    CHECK(r == p);
    CHECK(a->stats().num_device_alloc == 2);
    a->deallocate(q);
    a->deallocate(r);
    a->empty_cache();
    CHECK(a->reserved_bytes() == 0);
  }

  SUBCASE("record_stream then free: memory comes back after empty_cache") {
    auto a = fx.make(allocator_options{});
    auto const s1 = fx.stream(0);
    auto const s2 = fx.stream(1);
    void* p = a->allocate(3 * k_mib, s1);
    a->record_stream(p, s2);
    a->record_stream(p, s1);  // the allocation stream: ignored
    CHECK_THROWS_AS(a->record_stream(static_cast<char*>(p) + 512, s2), gact::invalid_argument);
    a->deallocate(p);
    CHECK(a->allocated_bytes() == 0);
    a->empty_cache();  // waits for the event on s2
    auto const st = a->stats();
    CHECK(st.active[gact::alloc::pool_all].current == 0);
    CHECK(st.reserved_bytes[gact::alloc::pool_all].current == 0);
    CHECK(st.num_sync_all_streams >= 1);
  }

  SUBCASE("memory limit is exact: one byte over fails, an exact fit succeeds") {
    allocator_options o;
    o.round_large = 512;                     // segments of exactly the rounded request
    o.memory_limit = 12 * k_mib + 511;       // not a multiple of 512
    auto a = fx.make(o);
    void* p = a->allocate(12 * k_mib, 0);    // segment of 12 MiB: fits
    CHECK(a->reserved_bytes() == 12 * k_mib);
    a->deallocate(p);                        // cached
    CHECK_THROWS_AS(a->allocate(12 * k_mib + 1, 0), gact::out_of_memory);  // segment 12 MiB + 512 = limit + 1
    auto st = a->stats();
    CHECK(st.num_ooms == 1);
    CHECK(st.num_alloc_retries == 1);        // released the cached 12 MiB and tried again
    CHECK(st.num_device_free == 1);
    CHECK(a->reserved_bytes() == 0);
    p = a->allocate(12 * k_mib, 0);          // fits again
    CHECK(p != nullptr);
    CHECK(a->stats().reserved_bytes[gact::alloc::pool_all].peak <= static_cast<std::int64_t>(o.memory_limit));
    a->deallocate(p);
  }

  SUBCASE("OOM at the limit: cached segments are released and the retry succeeds") {
    allocator_options o;
    o.memory_limit = 40 * k_mib;
    auto a = fx.make(o);
    void* x = a->allocate(15 * k_mib, 0);  // own segments of 16 MiB
    void* y = a->allocate(15 * k_mib, 0);
    a->deallocate(x);
    a->deallocate(y);
    CHECK(a->reserved_bytes() == 32 * k_mib);
    void* z = a->allocate(30 * k_mib, 0);  // 32 + 30 > 40: release both, then 30 fits
    REQUIRE(z != nullptr);
    auto st = a->stats();
    CHECK(st.num_alloc_retries == 1);
    CHECK(st.num_ooms == 0);
    CHECK(st.num_device_free == 2);
    CHECK(st.num_sync_all_streams == 1);
    CHECK(a->reserved_bytes() == 30 * k_mib);
    CHECK_THROWS_AS(a->allocate(15 * k_mib, 0), gact::out_of_memory);  // 30 + 16 > 40 with nothing cached
    st = a->stats();
    CHECK(st.num_ooms == 1);
    CHECK(st.num_alloc_retries == 2);
    CHECK(a->owns(z));
    CHECK(a->reserved_bytes() == 30 * k_mib);
    a->deallocate(z);
  }

  SUBCASE("bytes written survive neighbouring allocations and frees") {
    if constexpr (F::host_accessible) {
      auto a = fx.make(allocator_options{});
      std::vector<unsigned char*> ps;
      for (int i = 0; i < 64; ++i) {
        auto* p = static_cast<unsigned char*>(a->allocate(700 + 97 * std::size_t(i), 0));
        std::memset(p, i, 700 + 97 * std::size_t(i));
        ps.push_back(p);
      }
      for (int i = 0; i < 64; i += 2) a->deallocate(ps[std::size_t(i)]);
      std::vector<void*> fillers;
      for (int i = 0; i < 32; ++i) {  // reuse the holes
        fillers.push_back(a->allocate(600, 0));
        std::memset(fillers.back(), 0xFF, 600);
      }
      for (int i = 1; i < 64; i += 2) {
        std::size_t const n = 700 + 97 * std::size_t(i);
        bool intact = true;
        for (std::size_t k = 0; k < n; ++k) intact = intact && ps[std::size_t(i)][k] == static_cast<unsigned char>(i);
        CHECK(intact);
        a->deallocate(ps[std::size_t(i)]);
      }
      for (void* f : fillers) a->deallocate(f);
      a->empty_cache();
      CHECK(a->reserved_bytes() == 0);
    }
  }

  SUBCASE("stats JSON carries the torch keys and gact's sections") {
    auto a = fx.make(allocator_options{});
    void* p = a->allocate(5000, 0, gact::alloc::tag_activation);
    auto const j = a->stats_json();
    for (auto const& k : gact::test::torch_stat_keys()) {
      INFO("key " << k);
      CHECK(j.contains(k));
    }
    CHECK(j["allocation.all.current"] == 1);
    CHECK(j["requested_bytes.all.current"] == 5000);
    CHECK(j["allocated_bytes.small_pool.current"] == 5120);
    CHECK(j["tags"]["activation"]["current_bytes"] == 5120);
    CHECK(j["tags"]["activation"]["current_count"] == 1);
    for (char const* e : {"invalid_free", "double_free", "zero_size", "invalid_size", "tag_underflow"}) {
      CHECK(j["errors"].contains(e));
    }
    CHECK(j["fragmentation"].contains("peak"));
    CHECK(j["fragmentation"].contains("free"));
    CHECK(j["backend"]["name"].is_string());
    CHECK(j["options"]["small_size"] == a->options().small_size);
    a->deallocate(p);
  }
}
