// gact/tests/allocator/test_allocator.cpp — caching allocator behaviour that needs
// a particular backend: stream events that complete only when the test says so,
// capacity-limited backends (OOM release-and-retry), injected device errors,
// tags and the fragmentation figures.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/host_backend.hpp"
#include "allocator/error.hpp"
#include "allocator/stats_registry.hpp"
#include "contract.hpp"
#include "manual_backend.hpp"
#include "waiting_backend.hpp"

using gact::alloc::allocator_options;
using gact::alloc::caching_allocator;
using gact::alloc::pool_all;
using gact::test::k_mib;

TEST_SUITE("unit") {

TEST_CASE("record_stream: reuse waits for the other stream's event, without host synchronization") {
  gact::test::manual_backend be;
  caching_allocator a(be);
  auto const s1 = be.create_stream();
  auto const s2 = be.create_stream();

  void* p = a.allocate(4096, s1);
  a.record_stream(p, s2);
  a.deallocate(p);
  auto st = a.stats();
  CHECK(st.allocation[pool_all].current == 0);
  CHECK(st.allocated_bytes[pool_all].current == 0);
  CHECK(st.active[pool_all].current == 1);  // pending free
  CHECK(st.active_bytes[pool_all].current == 4096);
  CHECK(be.records() == 1);
  CHECK(be.incomplete_events() == 1);

  void* q = a.allocate(4096, s1);  // p is still in use on s2
  CHECK(q != p);
  CHECK(be.queries() >= 1);
  CHECK(a.stats().double_free == 0);
  a.deallocate(p);  // freeing a pending block again is a double free
  CHECK(a.stats().double_free == 1);

  be.complete_stream(s2);
  void* r = a.allocate(4096, s1);  // the event is polled: p's memory is reused
  CHECK(r == p);
  st = a.stats();
  CHECK(st.active[pool_all].current == 2);
  CHECK(be.host_syncs() == 0);  // never blocked

  a.record_stream(r, s2);
  a.deallocate(r);
  CHECK(be.events_created() == 1);  // the completed event was recycled
  a.deallocate(q);
  a.empty_cache();  // waits for the pending event
  CHECK(be.host_syncs() == 1);
  st = a.stats();
  CHECK(st.num_sync_all_streams == 1);
  CHECK(st.active[pool_all].current == 0);
  CHECK(st.reserved_bytes[pool_all].current == 0);
  CHECK(be.reserved_bytes() == 0);
}

TEST_CASE("try_deallocate and try_record_stream: one lookup, false for a pointer of another allocator") {
  gact::test::manual_backend be;
  caching_allocator a(be), other(be);
  auto const s1 = be.create_stream();
  auto const s2 = be.create_stream();
  void* p = a.allocate(4096, s1);
  void* foreign = other.allocate(4096, s1);
  CHECK_FALSE(a.try_record_stream(foreign, s2));  // not ours: nothing recorded, nothing counted
  CHECK_FALSE(a.try_deallocate(foreign));
  CHECK_FALSE(a.try_deallocate(nullptr));
  CHECK(a.stats().invalid_free == 0);
  CHECK(a.stats().double_free == 0);
  CHECK(other.stats().allocation[pool_all].current == 1);  // still live in its own allocator
  CHECK(a.try_record_stream(p, s2));
  CHECK(a.try_record_stream(p, s1));  // its own stream: nothing to record
  CHECK(a.try_deallocate(p));
  CHECK(a.stats().allocation[pool_all].current == 0);
  CHECK(a.stats().active[pool_all].current == 1);  // pending on s2, as record_stream + deallocate leave it
  CHECK(be.records() == 1);
  CHECK_FALSE(a.try_deallocate(p));  // a second free: not live any more, and not counted by the try form
  CHECK(a.stats().double_free == 0);
  a.deallocate(p);  // the plain form counts it
  CHECK(a.stats().double_free == 1);
  CHECK_THROWS_AS(a.record_stream(foreign, s2), gact::invalid_argument);
  other.deallocate(foreign);
  be.complete_stream(s2);
  a.empty_cache();
  other.empty_cache();
  CHECK(be.reserved_bytes() == 0);
}

TEST_CASE("record_stream on several streams: freed after all of their events") {
  gact::test::manual_backend be;
  caching_allocator a(be);
  auto const s1 = be.create_stream();
  auto const s2 = be.create_stream();
  auto const s3 = be.create_stream();
  void* keep = a.allocate(512, s1);
  void* p = a.allocate(4096, s1);
  a.record_stream(p, s2);
  a.record_stream(p, s3);
  a.record_stream(p, s3);  // recorded once per stream
  a.deallocate(p);
  CHECK(be.records() == 2);
  be.complete_stream(s2);
  void* q = a.allocate(4096, s1);
  CHECK(q != p);  // s3 still pending
  be.complete_stream(s3);
  void* r = a.allocate(4096, s1);
  CHECK(r == p);
  CHECK(a.stats().active[pool_all].current == 3);
  for (void* x : {keep, q, r}) a.deallocate(x);
}

TEST_CASE("release_on_miss_above: a wholly free segment that large goes back before a new one is reserved") {
  for (std::size_t const above : {std::size_t{0}, 16 * k_mib}) {
    CAPTURE(above);
    gact::device::host_backend be;
    allocator_options o;
    o.release_on_miss_above = above;
    caching_allocator a(be, o);
    void* own = a.allocate(12 * k_mib);  // a 12 MiB segment of its own: below the option's size, kept
    void* mid = a.allocate(4 * k_mib);  // a 20 MiB segment of the middle sizes
    a.deallocate(own);
    a.deallocate(mid);
    CHECK(a.reserved_bytes() == 32 * k_mib);
    void* hit = a.allocate(4 * k_mib);  // served by the cache: nothing goes back
    CHECK(a.reserved_bytes() == 32 * k_mib);
    a.deallocate(hit);
    void* p = a.allocate(24 * k_mib);  // a miss: the free 20 MiB segment goes back first
    CHECK(a.reserved_bytes() == (above != 0 ? 36 * k_mib : 56 * k_mib));
    a.deallocate(p);
    CHECK(a.allocated_bytes() == 0);
  }
}

TEST_CASE("release_on_miss_above: a miss keeps a free segment larger than what it reserves anew") {
  gact::device::host_backend be;
  allocator_options o;
  o.release_on_miss_above = 16 * k_mib;
  caching_allocator a(be, o);
  auto const s2 = be.create_stream();
  void* big = a.allocate(40 * k_mib);
  a.deallocate(big);
  CHECK(a.reserved_bytes() == 40 * k_mib);
  void* small = a.allocate(k_mib, s2);  // a small segment reserved anew: the 40 MiB stay cached (before: given back)
  CHECK(a.reserved_bytes() == 42 * k_mib);
  void* again = a.allocate(40 * k_mib);  // served by the cache
  CHECK(a.reserved_bytes() == 42 * k_mib);
  void* p = a.allocate(48 * k_mib, s2);  // a miss larger than the free segment... none is free now: nothing to return
  CHECK(a.reserved_bytes() == 90 * k_mib);
  a.deallocate(again);
  void* q = a.allocate(48 * k_mib, s2);  // a miss of 48 MiB: the free 40 MiB segment fits in it and goes back
  CHECK(a.reserved_bytes() == 98 * k_mib);
  for (void* x : {small, p, q}) a.deallocate(x);
  CHECK(a.allocated_bytes() == 0);
}

TEST_CASE("OOM with a pending block: the retry synchronizes it and reuses its memory") {
  gact::test::manual_backend be(2 * k_mib);  // room for one small segment
  caching_allocator a(be);
  auto const s1 = be.create_stream();
  auto const s2 = be.create_stream();
  void* p = a.allocate(k_mib, s1);
  void* q = a.allocate(k_mib, s1);  // fills the segment
  a.record_stream(p, s2);
  a.deallocate(p);
  void* r = a.allocate(k_mib, s1);  // no room: release_cached waits for s2, then p is free
  CHECK(r == p);
  auto const st = a.stats();
  CHECK(st.num_alloc_retries == 1);
  CHECK(st.num_ooms == 0);
  CHECK(st.num_sync_all_streams == 1);
  CHECK(be.host_syncs() == 1);
  CHECK(st.segment[pool_all].current == 1);
  a.deallocate(q);
  a.deallocate(r);
}

TEST_CASE("OOM release-and-retry over a capacity-limited host backend") {
  gact::device::host_backend be(40 * k_mib);
  caching_allocator a(be);
  void* x = a.allocate(15 * k_mib);
  void* y = a.allocate(15 * k_mib);
  a.deallocate(x);
  a.deallocate(y);
  CHECK(be.reserved_bytes() == 32 * k_mib);
  void* z = a.allocate(30 * k_mib);  // the backend refuses 30 more; the cache is released, the retry fits
  auto st = a.stats();
  CHECK(st.num_alloc_retries == 1);
  CHECK(st.num_device_free == 2);
  CHECK(st.num_ooms == 0);
  CHECK(be.reserved_bytes() == 30 * k_mib);
  std::string msg;
  try {
    (void)a.allocate(20 * k_mib);
  } catch (gact::out_of_memory const& e) {
    msg = e.what();
  }
  CHECK(msg.find("requested 20971520 bytes") != std::string::npos);
  CHECK(msg.find("reserved 31457280 bytes") != std::string::npos);
  CHECK(msg.find("allocated 31457280 bytes") != std::string::npos);
  CHECK(msg.find("limit none") != std::string::npos);
  CHECK(msg.find("capacity reached") != std::string::npos);
  st = a.stats();
  CHECK(st.num_ooms == 1);
  CHECK(st.num_alloc_retries == 2);
  CHECK(be.reserved_bytes() == 30 * k_mib);
  a.deallocate(z);
  a.empty_cache();
  CHECK(be.reserved_bytes() == 0);
}

TEST_CASE("a transient backend OOM is retried once") {
  gact::test::manual_backend be;
  caching_allocator a(be);
  be.fail_next_reserves(1);
  void* p = a.allocate(4096);
  CHECK(p != nullptr);
  CHECK(a.stats().num_alloc_retries == 1);
  be.fail_next_reserves(2);
  CHECK_THROWS_AS(a.allocate(3 * k_mib), gact::out_of_memory);
  CHECK(a.stats().num_ooms == 1);
  a.deallocate(p);
}

TEST_CASE("fail_allocations: injected failures even when the cache could serve, then normal service") {
  gact::device::host_backend be;
  caching_allocator a(be);
  void* warm = a.allocate(4 * k_mib);
  a.deallocate(warm);  // cached: the next 4 MiB request needs no reserve
  a.fail_allocations(1, 2);
  void* first = a.allocate(4 * k_mib);  // the one allowed before the failures
  CHECK_THROWS_WITH_AS(a.allocate(4 * k_mib), doctest::Contains("out of memory"), gact::out_of_memory);
  CHECK_THROWS_AS(a.allocate(512), gact::out_of_memory);
  void* after = a.allocate(4 * k_mib);  // the two failures are spent
  CHECK(after != nullptr);
  a.deallocate(first);
  a.deallocate(after);
  a.fail_allocations(0, 5);
  a.fail_allocations(0, 0);  // off again
  a.deallocate(a.allocate(512));
  CHECK(a.allocated_bytes() == 0);
}

TEST_CASE("a device error other than OOM propagates without retry and changes nothing") {
  gact::test::manual_backend be;
  caching_allocator a(be);
  void* p = a.allocate(4096);
  auto const before = a.stats();
  be.fail_next_reserve_with_device_error();
  CHECK_THROWS_AS(a.allocate(30 * k_mib), gact::cuda_error);
  auto const after = a.stats();
  CHECK(after.num_alloc_retries == 0);
  CHECK(after.num_ooms == 0);
  CHECK(after.reserved_bytes[pool_all].current == before.reserved_bytes[pool_all].current);
  CHECK(after.segment[pool_all].current == before.segment[pool_all].current);
  void* q = a.allocate(30 * k_mib);
  CHECK(q != nullptr);
  a.deallocate(p);
  a.deallocate(q);
}

TEST_CASE("every block records its tag: explicit, or the thread's current one") {
  gact::device::host_backend be;
  caching_allocator a(be);
  auto const mine = gact::alloc::intern_tag("test.tags.mine");
  void* w = nullptr;
  {
    gact::alloc::tag_scope scope(gact::alloc::tag_weight);
    w = a.allocate(1000);
    {
      gact::alloc::tag_scope inner("test.tags.mine");
      void* m = a.allocate(3000);
      a.deallocate(m);
    }
  }
  void* o = a.allocate(100);                                   // empty stack: "other"
  void* g = a.allocate(2000, 0, gact::alloc::tag_gradient);    // explicit
  auto const j = a.stats_json();
  CHECK(j["tags"]["weight"]["current_bytes"] == 1024);
  CHECK(j["tags"]["weight"]["current_count"] == 1);
  CHECK(j["tags"]["test.tags.mine"]["current_bytes"] == 0);
  CHECK(j["tags"]["test.tags.mine"]["peak_bytes"] == 3072);
  CHECK(j["tags"]["test.tags.mine"]["total_allocs"] == 1);
  CHECK(j["tags"]["other"]["current_bytes"] == 512);
  CHECK(j["tags"]["gradient"]["current_bytes"] == 2048);
  CHECK(gact::alloc::tag_name(mine) == "test.tags.mine");
  a.reset_peak_stats();
  CHECK(a.stats_json()["tags"]["test.tags.mine"]["peak_bytes"] == 0);
  for (void* p : {w, o, g}) a.deallocate(p);
}

TEST_CASE("fragmentation figures follow their definitions") {
  gact::device::host_backend be;
  caching_allocator a(be);
  void* x = a.allocate(1000);  // 1024 of a 2 MiB segment
  void* y = a.allocate(1000);
  a.deallocate(x);             // free: x (1024) and the tail (2 MiB - 2048)
  auto const f = a.stats_json()["fragmentation"];
  double const seg = 2.0 * double(k_mib);
  CHECK(f["peak"].get<double>() == doctest::Approx(1.0 - 2048.0 / seg));
  CHECK(f["free"].get<double>() == doctest::Approx(1.0 - (seg - 2048.0) / (seg - 1024.0)));
  CHECK(f["largest_free_block"] == 2 * k_mib - 2048);
  a.deallocate(y);
  CHECK(a.stats_json()["fragmentation"]["free"].get<double>() == 0.0);  // one free block
}

TEST_CASE("reset_peak_stats and reset_accumulated_stats") {
  gact::device::host_backend be;
  caching_allocator a(be);
  void* p = a.allocate(5 * k_mib);
  void* q = a.allocate(512);
  a.deallocate(p);
  auto st = a.stats();
  CHECK(st.allocated_bytes[pool_all].peak == static_cast<std::int64_t>(5 * k_mib + 512));
  a.reset_peak_stats();
  st = a.stats();
  CHECK(st.allocated_bytes[pool_all].peak == 512);
  CHECK(st.allocation[pool_all].allocated == 2);
  a.reset_accumulated_stats();
  st = a.stats();
  CHECK(st.allocation[pool_all].allocated == 0);
  CHECK(st.num_device_alloc == 0);
  CHECK(st.allocation[pool_all].current == 1);
  a.deallocate(q);
}

TEST_CASE("bad allocator options are rejected") {
  gact::device::host_backend be;
  allocator_options o;
  o.small_size = 4 * k_mib;  // larger than a small segment
  CHECK_THROWS_AS(caching_allocator(be, o), gact::invalid_argument);
  o = {};
  o.round_large = 1000;  // not a multiple of 512
  CHECK_THROWS_AS(caching_allocator(be, o), gact::invalid_argument);
  o = {};
  o.name.clear();
  CHECK_THROWS_AS(caching_allocator(be, o), gact::invalid_argument);
}

TEST_CASE("allocators register under unique names and unregister at destruction") {
  gact::device::host_backend be;
  allocator_options o;
  o.name = "test.dup";
  auto a = std::make_unique<caching_allocator>(be, o);
  auto b = std::make_unique<caching_allocator>(be, o);
  CHECK(a->stats_name() == "test.dup");
  CHECK(b->stats_name() == "test.dup#2");
  void* p = b->allocate(512);
  auto doc = gact::stats::document();
  CHECK(doc["allocators"].contains("test.dup"));
  CHECK(doc["allocators"]["test.dup#2"]["allocation.all.current"] == 1);
  b->deallocate(p);
  b.reset();
  a.reset();
  doc = gact::stats::document();
  CHECK_FALSE(doc["allocators"].contains("test.dup"));
  CHECK_FALSE(doc["allocators"].contains("test.dup#2"));
}

TEST_CASE("set_memory_limit: a cap set after use applies to new segments; 0 lifts it (issue 14)") {
  gact::device::host_backend be;
  allocator_options o;
  o.name = "test-runtime-limit";
  caching_allocator a(be, o);
  void* p = a.allocate(24 * k_mib);
  REQUIRE(p != nullptr);
  a.set_memory_limit(32 * k_mib);
  CHECK(a.options().memory_limit == 32 * k_mib);
  CHECK_THROWS_AS((void)a.allocate(24 * k_mib), gact::out_of_memory);  // 24 + 24 > 32
  void* q = a.allocate(512 * 1024);  // a 2 MiB small segment: 26 MiB reserved, under the cap
  CHECK(q != nullptr);
  a.set_memory_limit(0);
  void* r = a.allocate(24 * k_mib);
  CHECK(r != nullptr);
  a.deallocate(p);
  a.deallocate(q);
  a.deallocate(r);
  a.set_memory_limit(1);  // below what is reserved: the cached segments go back
  CHECK(a.reserved_bytes() == 0);
}

TEST_CASE("set_memory_limit caps later reservations and releases the cache to get under it (issue 15)") {
  // gact.configure(memory_limit=...) showed the new value in options() but changed nothing.
  gact::test::manual_backend be;
  caching_allocator a(be);
  void* p = a.allocate(4096);          // one 2 MiB small segment
  void* q = a.allocate(12 * k_mib);    // its own large segment
  a.deallocate(q);                     // cached, still reserved
  CHECK(a.reserved_bytes() > 4 * k_mib);
  a.set_memory_limit(4 * k_mib);
  CHECK(a.reserved_bytes() == 2 * k_mib);  // the cached large segment went back
  CHECK(a.options().memory_limit == 4 * k_mib);
  CHECK_THROWS_AS(a.allocate(12 * k_mib), gact::out_of_memory);
  CHECK(a.stats_json()["options"]["memory_limit"] == 4 * k_mib);
  a.set_memory_limit(0);
  void* r = a.allocate(12 * k_mib);
  CHECK(r != nullptr);
  a.deallocate(r);
  a.deallocate(p);
}

}  // TEST_SUITE

TEST_CASE("release_on_miss: a miss returns the whole free segments first; blocks in use and split segments stay") {
  gact::test::manual_backend be;
  caching_allocator a(be);
  void* keep = a.allocate(4096);        // a small segment, in use throughout
  void* p = a.allocate(12 * k_mib);     // its own large segment
  a.deallocate(p);                      // cached, whole and free
  void* q = a.allocate(14 * k_mib);     // no cached block serves it: without the setting, both stay reserved
  CHECK(a.reserved_bytes() == 2 * k_mib + 12 * k_mib + 14 * k_mib);
  a.deallocate(q);
  CHECK_FALSE(a.set_release_on_miss(true));
  void* r = a.allocate(16 * k_mib);     // a miss: the free 12 and 14 MiB segments go back first
  CHECK(a.reserved_bytes() == 2 * k_mib + 16 * k_mib);
  void* s = a.allocate(8 * k_mib);      // another miss (a 20 MiB segment): nothing whole and free to return
  CHECK(a.reserved_bytes() == 2 * k_mib + 16 * k_mib + 20 * k_mib);
  a.deallocate(r);
  void* t = a.allocate(4 * k_mib);      // served from the 20 MiB segment's free part: no miss, the free 16 MiB stays
  CHECK(a.reserved_bytes() == 2 * k_mib + 16 * k_mib + 20 * k_mib);
  CHECK(a.set_release_on_miss(false));
  a.deallocate(s);
  a.deallocate(t);
  a.deallocate(keep);
  CHECK(a.allocated_bytes() == 0);
  a.empty_cache();
  CHECK(a.reserved_bytes() == 0);
}

namespace {

/// Thread A's allocate (armed 1) or deallocate (armed 2) reaches the backend; meanwhile thread B frees and
/// allocates a block of the same allocator. True when B got through while A was inside the backend.
bool other_thread_served_while_in_backend(bool unlocked, int which) {
  gact::test::waiting_backend be;
  if (!unlocked) be.patience = std::chrono::milliseconds(500);  // (B cannot get through: A's wait times out)
  allocator_options o;
  o.backend_unlocked = unlocked;
  o.release_free_above = 1;  // (as over torch's pool: a free segment goes back at once)
  caching_allocator a(be, o);
  void* cached = a.allocate(4096);   // B's block
  void* mine = a.allocate(8 * k_mib);  // A's, when A frees
  be.armed = which;
  std::thread ta([&] {
    if (which == 1) {
      a.deallocate(a.allocate(16 * k_mib));  // a new segment: reserve
    } else {
      a.deallocate(mine);  // a whole segment free: release
    }
  });
  while (!be.waiting) std::this_thread::yield();
  a.deallocate(cached);  // B: a free (its segment goes back) and an allocation (a new one)
  cached = a.allocate(4096);
  be.other_thread_done();
  ta.join();
  a.deallocate(cached);
  if (which == 1) a.deallocate(mine);
  CHECK(a.allocated_bytes() == 0);
  return be.served_meanwhile;
}

}  // namespace

TEST_SUITE("threads") {

TEST_CASE("backend_unlocked: another thread is served while one waits in the backend's reserve or release") {
  CHECK(other_thread_served_while_in_backend(true, 1));   // reserve
  CHECK(other_thread_served_while_in_backend(true, 2));   // release
}

TEST_CASE("without backend_unlocked the backend runs under the allocator's lock (what the option is for)") {
  CHECK_FALSE(other_thread_served_while_in_backend(false, 1));  // B waited for the lock
  CHECK_FALSE(other_thread_served_while_in_backend(false, 2));
}

}  // TEST_SUITE

TEST_CASE("backend_unlocked: segments given up on the way to an out-of-memory error go back to the backend") {
  for (bool const unlocked : {false, true}) {
    INFO("backend_unlocked " << unlocked);
    gact::test::manual_backend be;
    allocator_options o;
    o.backend_unlocked = unlocked;
    caching_allocator a(be, o);
    a.deallocate(a.allocate(4096));  // a cached 2 MiB small segment
    a.set_memory_limit(3 * k_mib);
    // over the limit, the cache released, over it again: out of memory, the free segment given back meanwhile
    CHECK_THROWS_AS((void)a.allocate(12 * k_mib), gact::out_of_memory);
    CHECK(a.reserved_bytes() == 0);
    CHECK(be.reserved_bytes() == 0);
  }
}
