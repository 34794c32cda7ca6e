// gact/tests/swap/test_mover.cpp
//
// Deterministic tests of the swap mover's state machine. The "device" is a
// manual_backend seen through a checking_backend that reports it as device
// memory: copies happen at once, but an event completes only when the test says
// so, so each test can look at the mover between "copy queued" and "copy done"
// and check that nothing was freed early, that the consumer was told to wait,
// which blobs were prefetched, and what the counters say. The faults (pinned
// allocation failure, device OOM on prefetch and on demand) are injected through
// the checking_backend. A host-arena test covers the CPU path and slab reuse.
#include <doctest/doctest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/host_backend.hpp"
#include "allocator/error.hpp"
#include "swap/mover.hpp"
#include "swap/pinned_pool.hpp"
#include "tests/allocator/manual_backend.hpp"
#include "tests/swap/checking_backend.hpp"

namespace {

using gact::swap::blob_id;
using gact::swap::mover;
using gact::swap::mover_options;
using gact::swap::pinned_pool;

// Device and pinned memory on manual backends; the device arena's backend is checked.
struct manual_rig {
  gact::test::manual_backend dev_raw;
  gact::test::checking_backend dev{dev_raw, gact::device::memory_kind::device};
  gact::test::manual_backend pin_raw;
  gact::test::checking_backend pin{pin_raw, gact::device::memory_kind::pinned_host};
  gact::alloc::caching_allocator arena{dev, arena_opts()};
  pinned_pool pool{pin};
  gact::device::stream_t compute = dev.create_stream();
  int early_frees = 0;   // hook calls while a copy still touched the bytes
  int device_frees = 0;
  int pinned_frees = 0;
  std::unique_ptr<mover> m;

  static gact::alloc::allocator_options arena_opts() {
    gact::alloc::allocator_options o;
    o.name = "test-device";
    return o;
  }
  explicit manual_rig(mover_options o) {
    o.stats_name = "";
    o.before_free = [this](void const* p, std::size_t n, bool pinned) {
      // manual copies are immediate, but their tracking events complete on command
      if (dev.busy(p, n)) ++early_frees;
      ++(pinned ? pinned_frees : device_frees);
    };
    m = std::make_unique<mover>(arena, pool, std::move(o));
  }
  ~manual_rig() { m.reset(); }

  // A blob of n bytes filled with the pattern of `seed`.
  void* make(std::size_t n, unsigned seed) {
    auto* p = static_cast<unsigned char*>(arena.allocate(n, compute));
    for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<unsigned char>((seed * 131u + i * 7u) & 0xFFu);
    return p;
  }
  static bool holds(void const* p, std::size_t n, unsigned seed) {
    auto const* b = static_cast<unsigned char const*>(p);
    for (std::size_t i = 0; i < n; ++i) {
      if (b[i] != static_cast<unsigned char>((seed * 131u + i * 7u) & 0xFFu)) return false;
    }
    return true;
  }
  void finish_copies() {
    dev_raw.complete_all();
    m->poll();
  }
};

mover_options opts(std::size_t budget, std::size_t blobs, std::size_t bytes = 0) {
  mover_options o;
  o.device_budget = budget;
  o.lookahead_blobs = blobs;
  o.lookahead_bytes = bytes;
  return o;
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("offload-waits-for-encode-and-frees-device-bytes-only-after-the-copy") {
    manual_rig r(opts(0, 0));
    constexpr std::size_t n = 3000;
    void* p = r.make(n, 1);
    std::size_t const allocated = r.arena.allocated_bytes();
    blob_id const id = r.m->put(p, n, r.compute);
    CHECK(r.dev.waits_on(r.m->d2h_stream()) == 1);  // D2H waits on the encode's event
    auto s = r.m->stats();
    CHECK(s.offloads == 1);
    CHECK(s.bytes_out == n);
    CHECK(s.copies_in_flight == 1);
    r.m->poll();
    CHECK(r.arena.allocated_bytes() == allocated);  // copy not complete: device bytes held
    CHECK(r.arena.owns(p));
    CHECK(r.device_frees == 0);

    r.dev_raw.complete_stream(r.m->d2h_stream());
    r.m->poll();
    CHECK_FALSE(r.arena.owns(p));  // freed once the copy was seen complete
    CHECK(r.device_frees == 1);
    s = r.m->stats();
    CHECK(s.device_bytes == 0);
    CHECK(s.host_bytes == n);

    void* q = r.m->acquire(id, r.compute);  // not prefetched: fetched on demand
    s = r.m->stats();
    CHECK(s.prefetch_misses == 1);
    CHECK(s.fetches == 1);
    CHECK(s.bytes_in == n);
    CHECK(r.dev.waits_on(r.compute) == 1);  // the consumer waits on the H2D copy
    CHECK(r.pinned_frees == 0);             // pinned bytes still read by the copy
    CHECK(s.host_bytes == n);
    CHECK(manual_rig::holds(q, n, 1));
    r.dev_raw.complete_stream(r.m->h2d_stream());
    r.m->poll();
    CHECK(r.pinned_frees == 1);
    CHECK(r.m->stats().host_bytes == 0);
    r.m->release(id);
    s = r.m->stats();
    CHECK(s.device_bytes == 0);
    CHECK(s.live_blobs == 0);
    CHECK(r.early_frees == 0);
  }

  TEST_CASE("budget-keeps-the-newest-blobs-and-offloads-the-oldest") {
    constexpr std::size_t n = 4096;
    manual_rig r(opts(3 * n, 0));
    std::vector<void*> ptrs;
    std::vector<blob_id> ids;
    for (unsigned i = 0; i < 10; ++i) {
      ptrs.push_back(r.make(n, i));
      ids.push_back(r.m->put(ptrs.back(), n, r.compute));
      CHECK(r.m->stats().pending_bytes <= 3 * n);
    }
    r.finish_copies();
    auto const s = r.m->stats();
    CHECK(s.offloads == 7);
    CHECK(s.device_bytes == 3 * n);
    CHECK(s.host_bytes == 7 * n);
    for (std::size_t i = 0; i < 10; ++i) CHECK(r.arena.owns(ptrs[i]) == (i >= 7));
    for (std::size_t i = 10; i-- > 0;) {
      void* q = r.m->acquire(ids[i], r.compute);
      r.finish_copies();
      CHECK(manual_rig::holds(q, n, static_cast<unsigned>(i)));
      r.m->release(ids[i]);
    }
    CHECK(r.m->stats().resident_gets == 3);
    CHECK(r.m->stats().prefetch_misses == 7);
    CHECK(r.early_frees == 0);
  }

  TEST_CASE("prefetch-walks-backwards-within-the-blob-window") {
    constexpr std::size_t n = 2048;
    manual_rig r(opts(0, 2));
    std::vector<blob_id> ids;
    for (unsigned i = 0; i < 6; ++i) ids.push_back(r.m->put(r.make(n, i), n, r.compute));
    r.finish_copies();
    CHECK(r.m->stats().host_bytes == 6 * n);

    void* q = r.m->acquire(ids[5], r.compute);  // miss; prefetches 4 and 3
    auto s = r.m->stats();
    CHECK(s.prefetch_misses == 1);
    CHECK(s.fetches == 3);
    CHECK(manual_rig::holds(q, n, 5));
    r.m->release(ids[5]);

    q = r.m->acquire(ids[4], r.compute);  // prefetched, copy not complete: late hit; prefetches 2
    s = r.m->stats();
    CHECK(s.prefetch_hits == 1);
    CHECK(s.prefetch_late == 1);
    CHECK(s.fetches == 4);
    CHECK(manual_rig::holds(q, n, 4));
    r.m->release(ids[4]);

    r.finish_copies();
    q = r.m->acquire(ids[3], r.compute);  // prefetched and complete: on-time hit
    s = r.m->stats();
    CHECK(s.prefetch_hits == 2);
    CHECK(s.prefetch_late == 1);
    CHECK(s.fetches == 5);
    CHECK(manual_rig::holds(q, n, 3));
    r.m->release(ids[3]);
    for (std::size_t i = 3; i-- > 0;) {
      r.finish_copies();
      CHECK(manual_rig::holds(r.m->acquire(ids[i], r.compute), n, static_cast<unsigned>(i)));
      r.m->release(ids[i]);
    }
    s = r.m->stats();
    CHECK(s.prefetch_hits == 5);
    CHECK(s.prefetch_misses == 1);
    CHECK(s.fetches == 6);
    CHECK(s.bytes_in == 6 * n);
    CHECK(r.early_frees == 0);
  }

  TEST_CASE("prefetch-window-in-bytes") {
    constexpr std::size_t n = 2048;
    manual_rig r(opts(0, 0, 5 * n / 2));  // 2.5 blobs: two fit
    std::vector<blob_id> ids;
    for (unsigned i = 0; i < 6; ++i) ids.push_back(r.m->put(r.make(n, i), n, r.compute));
    r.finish_copies();
    r.m->begin_backward();  // prefetches 5 and 4
    CHECK(r.m->stats().fetches == 2);
    r.finish_copies();
    CHECK(manual_rig::holds(r.m->acquire(ids[5], r.compute), n, 5));
    CHECK(r.m->stats().prefetch_hits == 1);
    CHECK(r.m->stats().fetches == 3);  // the window moved by one: 3 joins
    for (auto id : ids) r.m->release(id);
    r.finish_copies();
    CHECK(r.m->stats().live_blobs == 0);
    CHECK(r.m->stats().host_bytes == 0);
    CHECK(r.m->stats().device_bytes == 0);
  }

  TEST_CASE("offload-in-flight-keeps-device-bytes-when-the-blob-is-wanted") {
    manual_rig r(opts(0, 2));
    constexpr std::size_t n = 1024;
    void* p = r.make(n, 9);
    blob_id const id = r.m->put(p, n, r.compute);
    void* q = r.m->acquire(id, r.compute);  // copy-out still running: the device copy is used
    CHECK(q == p);
    CHECK(r.m->stats().resident_gets == 1);
    r.finish_copies();
    CHECK(r.arena.owns(p));  // kept: the pinned copy is dropped instead
    auto const s = r.m->stats();
    CHECK(s.offloads_kept == 1);
    CHECK(s.host_bytes == 0);
    CHECK(s.device_bytes == n);
    CHECK(manual_rig::holds(p, n, 9));
    r.m->release(id);
    CHECK_FALSE(r.arena.owns(p));
    CHECK(r.early_frees == 0);
  }

  TEST_CASE("release-during-a-copy-frees-after-the-copy") {
    manual_rig r(opts(0, 0));
    constexpr std::size_t n = 1024;
    void* p = r.make(n, 2);
    blob_id const id = r.m->put(p, n, r.compute);
    r.m->release(id);
    CHECK(r.arena.owns(p));
    CHECK(r.m->stats().live_blobs == 0);
    CHECK(r.m->stats().host_bytes == n);
    r.finish_copies();
    CHECK_FALSE(r.arena.owns(p));
    CHECK(r.m->stats().host_bytes == 0);
    CHECK(r.m->stats().device_bytes == 0);
    CHECK(r.early_frees == 0);
    r.m->release(id);  // twice: counted, harmless
    CHECK(r.m->stats_json()["bad_releases"] == 1);
  }

  TEST_CASE("pinned-allocation-failure-keeps-the-blob-on-the-device") {
    manual_rig r(opts(0, 2));
    constexpr std::size_t n = 5000;
    r.pin.fail_next_reserves(2);  // the pool's reserve and its retry after releasing the cache
    void* p = r.make(n, 3);
    blob_id const a = r.m->put(p, n, r.compute);
    auto s = r.m->stats();
    CHECK(s.pinned_alloc_failures == 1);
    CHECK(s.offloads == 0);
    CHECK(s.device_bytes == n);
    CHECK(s.pending_bytes == 0);  // not retried on every put
    blob_id const b = r.m->put(r.make(n, 4), n, r.compute);  // the pool works again
    CHECK(r.m->stats().offloads == 1);
    r.finish_copies();
    CHECK(r.m->acquire(a, r.compute) == p);
    CHECK(manual_rig::holds(p, n, 3));
    r.finish_copies();
    CHECK(manual_rig::holds(r.m->acquire(b, r.compute), n, 4));
    r.m->release(a);
    r.m->release(b);
    CHECK(r.m->stats_json()["pinned_alloc_failures"] == 1);
  }

  TEST_CASE("device-oom-on-a-speculative-prefetch-is-skipped") {
    manual_rig r(opts(0, 2));
    constexpr std::size_t n = 1500;
    blob_id const a = r.m->put(r.make(n, 5), n, r.compute);
    r.finish_copies();
    r.dev.fail_next_reserves(2);
    r.m->begin_backward();
    auto s = r.m->stats();
    CHECK(s.prefetch_oom_skipped == 1);
    CHECK(s.fetches == 0);
    CHECK(s.host_bytes == n);  // still safe in pinned memory
    CHECK(manual_rig::holds(r.m->acquire(a, r.compute), n, 5));
    CHECK(r.m->stats().prefetch_misses == 1);
    r.m->release(a);
  }

  TEST_CASE("device-oom-on-demand-releases-retries-then-fails-clearly-and-keeps-the-blob") {
    manual_rig r(opts(0, 0));
    constexpr std::size_t n = 1500;
    blob_id const a = r.m->put(r.make(n, 6), n, r.compute);
    blob_id const b = r.m->put(r.make(n, 7), n, r.compute);
    r.finish_copies();

    r.dev.fail_next_reserves(2);  // the arena's own retry fails too; the mover's retry succeeds
    CHECK(manual_rig::holds(r.m->acquire(b, r.compute), n, 7));
    CHECK(r.m->stats().fetch_oom_retries == 1);
    CHECK(r.m->stats().fetch_oom_failures == 0);
    r.m->release(b);
    r.finish_copies();
    r.arena.empty_cache();
    INFO("reserved after empty_cache: ", r.arena.reserved_bytes(), ", live blocks ", r.arena.allocated_bytes());
    CHECK(r.m->stats().host_bytes == n);

    r.dev.fail_next_reserves(1000);
    std::string what;
    try {
      (void)r.m->acquire(a, r.compute);
    } catch (gact::out_of_memory const& e) {
      what = e.what();
    }
    CHECK(what.find("kept in pinned host memory") != std::string::npos);
    CHECK(what.find("blob " + std::to_string(a)) != std::string::npos);
    CHECK(r.m->stats().fetch_oom_failures == 1);
    CHECK(r.m->stats().host_bytes == n);
    r.dev.fail_next_reserves(0);
    CHECK(manual_rig::holds(r.m->acquire(a, r.compute), n, 6));  // not lost
    r.m->release(a);
    CHECK(r.early_frees == 0);
  }

  TEST_CASE("bad-input") {
    manual_rig r(opts(0, 0));
    void* p = r.make(512, 0);
    CHECK_THROWS_AS(r.m->put(nullptr, 8, r.compute), gact::invalid_argument);
    CHECK_THROWS_AS(r.m->put(p, 0, r.compute), gact::invalid_argument);
    CHECK_THROWS_AS(r.m->put(p, 4096, r.compute), gact::invalid_argument);
    int x = 0;
    CHECK_THROWS_AS(r.m->put(&x, 4, r.compute), gact::invalid_argument);
    CHECK_THROWS_AS((void)r.m->acquire(12345, r.compute), gact::invalid_argument);
    r.m->release(777);
    CHECK(r.m->stats_json()["bad_releases"] == 1);
    CHECK_THROWS_AS(pinned_pool(r.dev), gact::invalid_argument);  // device memory is not pinned memory
    gact::swap::pinned_pool_options po;
    po.slab_bytes = 3 << 20;
    CHECK_THROWS_AS(pinned_pool(r.pin, po), gact::invalid_argument);
    r.arena.deallocate(p);
  }

  TEST_CASE("host-arena-round-trips-and-reuses-pinned-slabs-across-steps") {
    gact::device::host_backend host_be;
    gact::device::host_backend pin_be;
    gact::alloc::allocator_options ao;
    ao.name = "test-host";
    gact::alloc::caching_allocator arena(host_be, ao);
    pinned_pool pool(pin_be);
    mover_options o = opts(0, 3);
    o.stats_name = "";
    mover m(arena, pool, o);
    std::mt19937 rng(7);
    std::size_t offloaded = 0;
    for (int step = 0; step < 40; ++step) {
      std::vector<std::pair<blob_id, std::vector<unsigned char>>> saved;
      for (int i = 0; i < 25; ++i) {
        std::size_t const n = 64 + rng() % 20000;
        std::vector<unsigned char> want(n);
        for (auto& c : want) c = static_cast<unsigned char>(rng());
        void* p = arena.allocate(n, 0);
        std::memcpy(p, want.data(), n);
        saved.emplace_back(m.put(p, n, 0), std::move(want));
        offloaded += n;
      }
      for (std::size_t i = saved.size(); i-- > 0;) {
        void const* q = m.acquire(saved[i].first, 0);
        REQUIRE(std::memcmp(q, saved[i].second.data(), saved[i].second.size()) == 0);
        m.release(saved[i].first);
      }
    }
    auto const s = m.stats();
    CHECK(s.bytes_out == offloaded);
    CHECK(s.bytes_in == offloaded);
    CHECK(s.live_blobs == 0);
    CHECK(s.device_bytes == 0);
    CHECK(s.host_bytes == 0);
    // 1000 offloads, each step's blobs (< 500 KiB) fit one small slab: slabs are reused, never per tensor.
    auto const ps = pool.allocator().stats();
    CHECK(ps.num_device_alloc <= 2);
    CHECK(s.offloads == 1000);
  }
}
