// gact/tests/allocator/test_event_trace.cpp — the event trace ring buffer: wrap-around
// and ordering, the allocator's events checked against its own counters (per tag,
// segments, OOM), the stats document's "timeline", "snapshots" and segment listing
// read back from a dump, and concurrent recording (suite "threads").
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/host_backend.hpp"
#include "allocator/error.hpp"
#include "allocator/event_trace.hpp"
#include "allocator/stats_registry.hpp"
#include "allocator/tags.hpp"

namespace et = gact::alloc::event_trace;
using gact::alloc::allocator_options;
using gact::alloc::caching_allocator;
using gact::alloc::pool_all;

namespace {

/// Tracing on with a fresh buffer for one test case; off and cleared afterwards, so that other
/// test cases in this executable record nothing.
struct trace_on {
  explicit trace_on(std::size_t capacity, std::uint64_t snapshot_every = 1) {
    et::clear();
    et::set_snapshot_every(snapshot_every);
    et::enable(capacity);
  }
  ~trace_on() {
    et::disable();
    et::clear();
    et::set_snapshot_every(1);
  }
  trace_on(trace_on const&) = delete;
  trace_on& operator=(trace_on const&) = delete;
};

std::string source_name(caching_allocator const& a) { return a.stats_name(); }

/// Sum of (alloc - free) bytes per tag name over the allocator's events in `events`.
std::map<std::string, std::int64_t> tag_levels(nlohmann::json const& events, std::string const& source) {
  std::map<std::string, std::int64_t> lv;
  for (auto const& e : events) {
    if (e["source"] != source) continue;
    auto const sz = e["size"].get<std::int64_t>();
    if (e["action"] == "alloc") lv[e["tag"].get<std::string>()] += sz;
    if (e["action"] == "free") lv[e["tag"].get<std::string>()] -= sz;
  }
  return lv;
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("event trace: off by default in tests, and record() is then a no-op") {
  et::disable();
  et::clear();
  CHECK_FALSE(et::enabled());
  et::record(et::event_kind::step, 0, 0, 0, 0, gact::alloc::tag_other, 7);
  CHECK(et::copy().recorded == 0);
}

TEST_CASE("event trace: the largest capacity costs memory only as events arrive (issue 15)") {
  // GACT_TRACE=67108864 used to commit the whole ring (4 GiB) at import.
  auto const resident = [] {
    std::ifstream in("/proc/self/statm");
    std::size_t pages = 0, rss = 0;
    in >> pages >> rss;
    return rss * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  };
  std::size_t const before = resident();
  {
    trace_on on(std::size_t{1} << 26);
    for (std::uint64_t i = 0; i < 1000; ++i) et::record(et::event_kind::step, 0, 0, 0, 0, gact::alloc::tag_other, i);
    std::size_t const after = resident();
    CHECK(after < before + (std::size_t{256} << 20));
    auto const r = et::copy();
    CHECK(r.capacity == (std::size_t{1} << 26));
    REQUIRE(r.events.size() == 1000);
    CHECK(r.dropped == 0);
    CHECK(r.events.front().key == 0);
    CHECK(r.events.back().key == 999);
  }
  CHECK_THROWS_WITH_AS(et::enable((std::size_t{1} << 26) + 1),
                       doctest::Contains("exceeds the maximum of 67108864 events (4096 MiB once full)"),
                       gact::invalid_argument);
}

TEST_CASE("event trace: clear() then fewer events than before, in a ring that had grown") {
  trace_on on(8);
  for (std::uint64_t i = 0; i < 5; ++i) et::record(et::event_kind::step, 0, 0, 0, 0, gact::alloc::tag_other, i);
  et::clear();
  for (std::uint64_t i = 100; i < 111; ++i) et::record(et::event_kind::step, 0, 0, 0, 0, gact::alloc::tag_other, i);
  auto const r = et::copy();
  REQUIRE(r.events.size() == 8);
  CHECK(r.dropped == 3);
  for (std::size_t i = 0; i < 8; ++i) CHECK(r.events[i].key == 103 + i);
}

TEST_CASE("event trace: wrap-around keeps the newest `capacity` events, oldest first") {
  trace_on on(8);
  for (std::uint64_t i = 0; i < 21; ++i) et::record(et::event_kind::step, 0, 0, 0, 0, gact::alloc::tag_other, i);
  auto const r = et::copy();
  CHECK(r.capacity == 8);
  CHECK(r.recorded == 21);
  CHECK(r.dropped == 13);
  REQUIRE(r.events.size() == 8);
  for (std::size_t i = 0; i < r.events.size(); ++i) {
    CHECK(r.events[i].key == 13 + i);  // the payload survives the wrap
    CHECK(r.events[i].seq == 13 + i);
    if (i > 0) CHECK(r.events[i].time_ns >= r.events[i - 1].time_ns);
  }
  // Fewer events than the capacity: nothing dropped, all kept.
  et::enable(100);
  et::record(et::event_kind::step, 0, 0, 0, 0, gact::alloc::tag_other, 5);
  auto const r2 = et::copy();
  CHECK(r2.recorded == 1);
  CHECK(r2.dropped == 0);
  CHECK(r2.events.size() == 1);
}

TEST_CASE("event trace: capacity above the maximum is rejected with a message") {
  CHECK_THROWS_AS(et::enable(std::size_t{1} << 27), gact::invalid_argument);
  CHECK_FALSE(et::enabled());
}

TEST_CASE("event trace: allocator events agree with the allocator's counters") {
  trace_on on(1 << 16);
  gact::device::host_backend be;
  allocator_options o;
  o.name = "trace-test";
  caching_allocator a(be, o);
  std::string const src = source_name(a);

  std::mt19937_64 rng(1234);  // fixed seed
  std::uniform_int_distribution<std::size_t> small(1, 300000);
  std::uniform_int_distribution<std::size_t> large(1 << 20, 12 << 20);
  std::vector<void*> live;
  auto const act = gact::alloc::intern_tag("activation");
  auto const wt = gact::alloc::intern_tag("weight");
  for (int i = 0; i < 400; ++i) {
    gact::alloc::tag_scope scope(i % 3 == 0 ? wt : act);
    live.push_back(a.allocate(i % 10 == 0 ? large(rng) : small(rng)));
    if (i % 4 == 3) {  // free one of the live blocks, chosen by the seed
      std::size_t const k = rng() % live.size();
      a.deallocate(live[k]);
      live[k] = live.back();
      live.pop_back();
    }
  }
  auto const st = a.stats();
  auto const j = a.stats_json();
  auto const r = et::copy();
  CHECK(r.dropped == 0);

  std::int64_t allocs = 0, frees = 0, seg_alloc = 0, seg_free = 0, seg_bytes = 0, bytes = 0;
  std::map<std::uint64_t, std::uint64_t> open;  // addr -> size of blocks allocated and not freed
  for (auto const& e : r.events) {
    if (e.kind == et::event_kind::alloc) {
      ++allocs;
      bytes += static_cast<std::int64_t>(e.size);
      CHECK(e.size % 512 == 0);
      CHECK(e.aux <= e.size);  // requested <= rounded
      CHECK(open.emplace(e.addr, e.size).second);
    } else if (e.kind == et::event_kind::free) {
      ++frees;
      bytes -= static_cast<std::int64_t>(e.size);
      auto it = open.find(e.addr);
      REQUIRE(it != open.end());  // every free names a block the trace saw allocated
      CHECK(it->second == e.size);
      open.erase(it);
    } else if (e.kind == et::event_kind::segment_alloc) {
      ++seg_alloc;
      seg_bytes += static_cast<std::int64_t>(e.size);
    } else if (e.kind == et::event_kind::segment_free) {
      ++seg_free;
      seg_bytes -= static_cast<std::int64_t>(e.size);
    }
  }
  CHECK(allocs == st.allocation[pool_all].allocated);
  CHECK(frees == st.allocation[pool_all].freed);
  CHECK(bytes == st.allocated_bytes[pool_all].current);
  CHECK(open.size() == live.size());
  CHECK(seg_alloc == static_cast<std::int64_t>(st.num_device_alloc));
  CHECK(seg_free == static_cast<std::int64_t>(st.num_device_free));
  CHECK(seg_bytes == st.reserved_bytes[pool_all].current);

  // Per tag, through the JSON timeline.
  auto const tl = et::timeline_json();
  auto const lv = tag_levels(tl["events"], src);
  for (auto const& [tag, t] : j["tags"].items()) CHECK(lv.at(tag) == t["current_bytes"].get<std::int64_t>());

  // The segment listing covers the reserved bytes; its allocated blocks are the live ones.
  REQUIRE(j.contains("segments"));
  std::int64_t listed = 0, listed_alloc = 0, listed_blocks = 0;
  for (auto const& s : j["segments"]) {
    std::uint64_t next = s["address"].get<std::uint64_t>(), sum = 0;
    for (auto const& b : s["blocks"]) {
      CHECK(b["address"].get<std::uint64_t>() == next);  // contiguous, address order
      next += b["size"].get<std::uint64_t>();
      sum += b["size"].get<std::uint64_t>();
      if (b["state"] == "active_allocated") {
        listed_alloc += b["size"].get<std::int64_t>();
        ++listed_blocks;
        CHECK(open.count(b["address"].get<std::uint64_t>()) == 1);
      }
    }
    CHECK(sum == s["total_size"].get<std::uint64_t>());
    listed += static_cast<std::int64_t>(sum);
  }
  CHECK(listed == st.reserved_bytes[pool_all].current);
  CHECK(listed_alloc == st.allocated_bytes[pool_all].current);
  CHECK(listed_blocks == static_cast<std::int64_t>(live.size()));

  for (void* p : live) a.deallocate(p);
  a.empty_cache();
  auto const r2 = et::copy();
  std::int64_t seg_free2 = 0;
  for (auto const& e : r2.events) seg_free2 += e.kind == et::event_kind::segment_free ? 1 : 0;
  CHECK(seg_free2 == static_cast<std::int64_t>(a.stats().num_device_free));
  CHECK(a.stats().reserved_bytes[pool_all].current == 0);
}

TEST_CASE("event trace: an OOM is recorded with the request size and the reserved bytes") {
  trace_on on(1024);
  gact::device::host_backend be;
  allocator_options o;
  o.name = "trace-oom";
  o.memory_limit = 4 << 20;
  caching_allocator a(be, o);
  void* p = a.allocate(1 << 20);
  CHECK_THROWS_AS(a.allocate(8 << 20), gact::out_of_memory);
  auto const r = et::copy();
  REQUIRE(!r.events.empty());
  auto const& e = r.events.back();
  CHECK(e.kind == et::event_kind::oom);
  CHECK(e.size == (8u << 20));
  CHECK(e.aux == static_cast<std::uint64_t>(a.stats().reserved_bytes[pool_all].current));
  CHECK(a.stats().num_ooms == 1);
  a.deallocate(p);
}

TEST_CASE("event trace: a dump carries the timeline and snapshots, and its totals agree with the counters") {
  trace_on on(4096, 2);
  gact::device::host_backend be;
  allocator_options o;
  o.name = "trace-dump";
  caching_allocator a(be, o);
  std::vector<void*> ps;
  std::vector<std::int64_t> at_snapshot;
  for (std::uint64_t step = 0; step < 5; ++step) {
    et::mark_step(step);  // steps 0, 2, 4 snapshot (every 2nd mark)
    if (step % 2 == 0) at_snapshot.push_back(static_cast<std::int64_t>(a.allocated_bytes()));
    gact::alloc::tag_scope scope("activation");
    ps.push_back(a.allocate(10000 * (step + 1)));
  }
  auto const path = std::filesystem::temp_directory_path() /
                    ("gact-test-trace-" + std::to_string(::getpid()) + ".json");
  gact::stats::dump(path.string());
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  auto const doc = nlohmann::json::parse(ss.str());
  std::filesystem::remove(path);

  CHECK(doc["schema_version"] == gact::stats::k_schema_version);
  CHECK(gact::stats::k_schema_version >= 2);
  auto const& tl = doc["timeline"];
  CHECK(tl["capacity"] == 4096);
  CHECK(tl["dropped"] == 0);
  auto const& ad = doc["allocators"][a.stats_name()];
  auto const lv = tag_levels(tl["events"], a.stats_name());
  CHECK(lv.at("activation") == ad["tags"]["activation"]["current_bytes"].get<std::int64_t>());
  std::int64_t steps = 0;
  for (auto const& e : tl["events"]) steps += e["action"] == "step" ? 1 : 0;
  CHECK(steps == 5);

  auto const& snaps = doc["snapshots"];
  REQUIRE(snaps.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(snaps[i]["allocators"][a.stats_name()]["allocated_bytes"].get<std::int64_t>() == at_snapshot[i]);
    CHECK(snaps[i]["step"] == 2 * i + 1);  // the number of marks when it was taken
  }
  for (void* p : ps) a.deallocate(p);
}

}  // TEST_SUITE("unit")

TEST_SUITE("threads") {

TEST_CASE("event trace: concurrent recorders lose nothing and keep each thread's order") {
  constexpr int k_threads = 4;
  constexpr std::uint64_t k_each = 5000;
  trace_on on(k_threads * k_each);
  std::vector<std::thread> ts;
  for (int t = 0; t < k_threads; ++t) {
    ts.emplace_back([t] {
      for (std::uint64_t i = 0; i < k_each; ++i) {
        et::record(et::event_kind::step, static_cast<std::uint16_t>(t), 0, 0, 0, gact::alloc::tag_other, i);
      }
    });
  }
  // A reader copying while they write sees a consistent prefix.
  for (int k = 0; k < 20; ++k) {
    auto const r = et::copy();
    CHECK(r.events.size() == r.recorded);
  }
  for (auto& th : ts) th.join();
  auto const r = et::copy();
  CHECK(r.recorded == k_threads * k_each);
  CHECK(r.dropped == 0);
  std::vector<std::uint64_t> next(k_threads, 0);
  for (std::size_t i = 0; i < r.events.size(); ++i) {
    auto const& e = r.events[i];
    CHECK(e.seq == i);
    REQUIRE(e.source < k_threads);
    CHECK(e.key == next[e.source]);  // per-thread order kept
    ++next[e.source];
  }
}

}  // TEST_SUITE("threads")
