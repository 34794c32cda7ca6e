// gact/tests/allocator/test_stats.cpp — the stats document: schema fields,
// providers, atomic dumps that reload as the same JSON, and the SIGUSR1 trigger.
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/host_backend.hpp"
#include "allocator/error.hpp"
#include "allocator/stats.hpp"
#include "allocator/stats_registry.hpp"
#include "test_helpers.hpp"

namespace fs = std::filesystem;

namespace {

struct temp_dir : gact::test::temp_dir {
  temp_dir() : gact::test::temp_dir("gact-test-stats-") {}
};

nlohmann::json read_json(fs::path const& p) { return nlohmann::json::parse(gact::test::read_text(p)); }

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("document: schema header, allocators and top-level sections") {
  auto const tok = gact::stats::register_provider("test_section", [] { return nlohmann::json{{"x", 1}}; });
  auto const tok2 = gact::stats::register_provider("allocators/test_fake", [] { return nlohmann::json{{"y", 2}}; });
  auto const doc = gact::stats::document();
  CHECK(doc["schema_version"] == gact::stats::k_schema_version);
  CHECK(doc["gact_version"] == GACT_VERSION);
  CHECK(doc["pid"] == static_cast<std::int64_t>(::getpid()));
  CHECK(doc["time_unix_ms"].get<std::int64_t>() > 1'600'000'000'000);
  CHECK(doc["test_section"]["x"] == 1);
  CHECK(doc["allocators"]["test_fake"]["y"] == 2);
  gact::stats::unregister_provider(tok);
  gact::stats::unregister_provider(tok2);
  gact::stats::unregister_provider(987654321);  // unknown: ignored
  auto const after = gact::stats::document();
  CHECK_FALSE(after.contains("test_section"));
  CHECK_FALSE(after["allocators"].contains("test_fake"));
}

TEST_CASE("a provider that throws yields an error entry, not a failed document") {
  auto const tok = gact::stats::register_provider("test_throws", []() -> nlohmann::json {
    throw gact::error("boom");
  });
  auto const doc = gact::stats::document();
  CHECK(doc["test_throws"]["error"] == "boom");
  gact::stats::unregister_provider(tok);
}

TEST_CASE("stats JSON has one key per field of stats_fields.def") {
  gact::device::host_backend be;
  gact::alloc::caching_allocator a(be);
  auto const j = a.stats_json();
  std::size_t arrays = 0;
  for (auto const& f : gact::alloc::stat_fields()) {
    std::string const name(f.name);
    switch (f.kind) {
      case gact::alloc::stat_kind::array:
        ++arrays;
        CHECK(j.contains(name + ".all.current"));
        CHECK(j.contains(name + ".large_pool.freed"));
        break;
      case gact::alloc::stat_kind::counter:
        CHECK(j.contains(name));
        break;
      case gact::alloc::stat_kind::error:
        CHECK(j["errors"].contains(name));
        break;
    }
  }
  CHECK(arrays == 9);
}

TEST_CASE("dump writes the document atomically and it reloads") {
  temp_dir dir;
  gact::device::host_backend be;
  gact::alloc::allocator_options o;
  o.name = "test.dump";
  gact::alloc::caching_allocator a(be, o);
  void* p = a.allocate(12345);
  fs::path const file = dir.path / "stats.json";
  gact::stats::dump(file.string());
  auto const j = read_json(file);
  CHECK(j["schema_version"] == gact::stats::k_schema_version);
  CHECK(j["allocators"]["test.dump"]["requested_bytes.all.current"] == 12345);
  CHECK(j["allocators"]["test.dump"]["allocated_bytes.all.current"] == 12800);
  // No temp file left behind.
  std::size_t files = 0;
  for ([[maybe_unused]] auto const& e : fs::directory_iterator(dir.path)) ++files;
  CHECK(files == 1);
  a.deallocate(p);
  CHECK_THROWS_AS(gact::stats::dump((dir.path / "no-such-dir" / "x.json").string()), gact::error);
  CHECK_THROWS_AS(gact::stats::dump(""), gact::invalid_argument);
}

}  // TEST_SUITE

TEST_SUITE("threads") {

TEST_CASE("SIGUSR1 dumps to GACT_STATS_PATH through the service thread") {
  temp_dir dir;
  fs::path const file = dir.path / "signal.json";
  ::setenv("GACT_STATS_PATH", file.c_str(), 1);
  gact::stats::install_dump_triggers();
  gact::stats::install_dump_triggers();  // idempotent
  gact::device::host_backend be;
  gact::alloc::allocator_options o;
  o.name = "test.signal";
  gact::alloc::caching_allocator a(be, o);
  void* p = a.allocate(777);
  std::raise(SIGUSR1);
  // Bounded poll: the service thread writes the file (atomically) soon after the signal.
  bool found = false;
  for (int i = 0; i < 500 && !found; ++i) {
    found = fs::exists(file);
    if (!found) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE(found);
  auto const j = read_json(file);
  CHECK(j["pid"] == static_cast<std::int64_t>(::getpid()));
  CHECK(j["allocators"]["test.signal"]["requested_bytes.all.current"] == 777);
  a.deallocate(p);
  ::unsetenv("GACT_STATS_PATH");  // no dump at exit into the removed directory
}

}  // TEST_SUITE
