// gact/tests/allocator/test_options.cpp — the settings table: every type's parser,
// every kind of bad value, the environment and keyword paths, the listing.
#include <doctest/doctest.h>

#include <map>
#include <string>

#include "allocator/error.hpp"
#include "allocator/options.hpp"
#include "test_helpers.hpp"

namespace op = gact::option_parse;
using gact::test::error_of;

TEST_SUITE("unit") {

TEST_CASE("bytes: plain numbers, suffixes, decimals") {
  CHECK(op::bytes("X", "0") == 0);
  CHECK(op::bytes("X", "4096") == 4096);
  CHECK(op::bytes("X", "1K") == 1024);
  CHECK(op::bytes("X", "1k") == 1024);
  CHECK(op::bytes("X", "2KiB") == 2048);
  CHECK(op::bytes("X", "3KB") == 3072);
  CHECK(op::bytes("X", "512M") == 512ull << 20);
  CHECK(op::bytes("X", "8G") == 8ull << 30);
  CHECK(op::bytes("X", "8 GiB") == 8ull << 30);
  CHECK(op::bytes("X", "2T") == 2ull << 40);
  CHECK(op::bytes("X", "100B") == 100);
  CHECK(op::bytes("X", " 7 ") == 7);
  CHECK(op::bytes("X", "1.5G") == 3ull << 29);
  CHECK(op::bytes("X", "0.5K") == 512);
  CHECK(op::bytes("X", ".5K") == 512);
  CHECK(op::bytes("X", "1.0001K") == 1025);  // 1024.1024 rounds up to a whole byte
  CHECK(op::bytes("X", "18446744073709551615") == 18446744073709551615ull);
}

TEST_CASE("bytes: bad values name the setting and give an example") {
  CHECK(error_of([] { op::bytes("GACT_MEMORY_LIMIT", "12Q"); }).starts_with(
      "GACT_MEMORY_LIMIT: '12Q' is not a size; use e.g. 8G"));
  for (char const* bad : {"", " ", "G", "-1", "-1G", "1..2G", "1.2.3", ".", "1e9", "0x10", "8GG", "8 G B", "abc",
                          "18446744073709551616", "16777216T", "17179869184G"}) {
    INFO("value '" << bad << "'");
    CHECK_THROWS_AS(op::bytes("GACT_MEMORY_LIMIT", bad), gact::invalid_argument);
  }
}

TEST_CASE("count and positive") {
  CHECK(op::count("X", "0") == 0);
  CHECK(op::count("X", "42") == 42);
  CHECK(op::positive("X", "1") == 1);
  for (char const* bad : {"", "-1", "1.5", "x", "1K", "99999999999999999999"}) {
    INFO(bad);
    CHECK_THROWS_AS(op::count("GACT_THREADS", bad), gact::invalid_argument);
  }
  CHECK(error_of([] { op::count("GACT_THREADS", "-1"); }) ==
        "GACT_THREADS: '-1' is not a non-negative integer; use e.g. 0, 2 or 100");
  CHECK_THROWS_AS(op::positive("GACT_ADAPT_INTERVAL", "0"), gact::invalid_argument);
  CHECK_THROWS_AS(op::positive("GACT_ADAPT_INTERVAL", "-3"), gact::invalid_argument);
}

TEST_CASE("threads: at most k_max_threads, never wrapped (issue 15)") {
  CHECK(op::threads("GACT_THREADS", "0") == 0);
  CHECK(op::threads("GACT_THREADS", "4") == 4);
  CHECK(op::threads("GACT_THREADS", "1024") == gact::k_max_threads);
  for (char const* bad : {"1025", "4294967298", "18446744073709551616", "-1", "2.5", "x", ""}) {
    INFO(bad);
    CHECK_THROWS_AS(op::threads("GACT_THREADS", bad), gact::invalid_argument);
  }
  // 4294967298 = 2^32 + 2 once became 2 threads through a cast to int.
  CHECK(error_of([] { op::threads("GACT_THREADS", "4294967298"); }) ==
        "GACT_THREADS: '4294967298' is not a thread count in [0, 1024]; use 0 (all hardware threads) or e.g. 4");
  auto const lookup = [](char const* name) -> char const* {
    return std::string_view(name) == "GACT_THREADS" ? "4294967298" : nullptr;
  };
  CHECK_THROWS_AS(gact::options::from_env(lookup), gact::invalid_argument);
}

TEST_CASE("real and fraction_bits") {
  CHECK(op::real("X", "2.5") == 2.5);
  CHECK(op::real("X", "-1") == -1.0);
  CHECK(op::fraction_bits("X", "1") == 1.0);
  CHECK(op::fraction_bits("X", "3.25") == 3.25);
  CHECK(op::fraction_bits("X", "8") == 8.0);
  for (char const* bad : {"", "abc", "2.5x", "nan", "inf", "1e999"}) {
    INFO(bad);
    CHECK_THROWS_AS(op::real("X", bad), gact::invalid_argument);
  }
  for (char const* bad : {"0.99", "8.01", "0", "-2", "x", "", "nan"}) {
    INFO(bad);
    CHECK_THROWS_AS(op::fraction_bits("GACT_BUDGET", bad), gact::invalid_argument);
  }
  CHECK(error_of([] { op::fraction_bits("GACT_BUDGET", "9"); }) ==
        "GACT_BUDGET: '9' is not an average bit width in [1, 8]; use e.g. 2 or 3.5");
}

TEST_CASE("flag") {
  for (char const* t : {"1", "true", "TRUE", "yes", "on", " On "}) CHECK(op::flag("X", t));
  for (char const* f : {"0", "false", "no", "off", "OFF"}) CHECK_FALSE(op::flag("X", f));
  for (char const* bad : {"", "2", "y", "enabled", "truee"}) {
    INFO(bad);
    CHECK_THROWS_AS(op::flag("GACT_SWAP", bad), gact::invalid_argument);
  }
  CHECK(error_of([] { op::flag("GACT_SWAP", "maybe"); }) ==
        "GACT_SWAP: 'maybe' is not a boolean; use 1|0|true|false|yes|no|on|off");
}

TEST_CASE("level") {
  CHECK(op::level("X", "trace") == gact::option_level::trace);
  CHECK(op::level("X", "DEBUG") == gact::option_level::debug);
  CHECK(op::level("X", "warning") == gact::option_level::warn);
  CHECK(op::level("X", "off") == gact::option_level::off);
  CHECK_THROWS_AS(op::level("GACT_LOG_LEVEL", "loud"), gact::invalid_argument);
  CHECK_THROWS_AS(op::level("GACT_LOG_LEVEL", ""), gact::invalid_argument);
  CHECK(gact::level_name(gact::option_level::error) == "error");
}

TEST_CASE("bits and group") {
  CHECK(op::bits("X", "1") == 1);
  CHECK(op::bits("X", "2") == 2);
  CHECK(op::bits("X", "4") == 4);
  CHECK(op::bits("X", "8") == 8);
  CHECK(op::bits("X", "auto") == gact::k_bits_auto);
  CHECK(op::bits("X", "AUTO") == gact::k_bits_auto);
  for (char const* bad : {"0", "3", "16", "", "4.0", "autox"}) {
    INFO(bad);
    CHECK_THROWS_AS(op::bits("GACT_BITS", bad), gact::invalid_argument);
  }
  CHECK(error_of([] { op::bits("GACT_BITS", "3"); }) == "GACT_BITS: '3' is not a bit width; use 1|2|4|8|auto");
  for (unsigned g : {64u, 128u, 256u, 512u, 1024u}) CHECK(op::group("X", std::to_string(g)) == g);
  for (char const* bad : {"32", "2048", "100", "0", "", "256.0", "-256"}) {
    INFO(bad);
    CHECK_THROWS_AS(op::group("GACT_GROUP_SIZE", bad), gact::invalid_argument);
  }
}

TEST_CASE("from_env: defaults, overrides, empty variables, and the first bad value") {
  gact::options const d = gact::options::from_env([](char const*) -> char const* { return nullptr; });
  CHECK(d.log_level == gact::option_level::warn);
  CHECK(d.memory_limit == 0);
  CHECK(d.stats_path.empty());
  CHECK(d.bits == 4);
  CHECK(d.budget == 2.0);
  CHECK(d.group_size == 256);
  CHECK(d.min_bytes == 4096);
  CHECK(d.threads == 0);
  CHECK(d.seed == 0);
  CHECK_FALSE(d.swap);
  CHECK(d.swap_budget == 0);
  CHECK(d.prefetch == 2);
  CHECK(d.trace == 0);
  CHECK(d.adapt_interval == 1000);

  std::map<std::string, std::string> env{{"GACT_MEMORY_LIMIT", "8G"}, {"GACT_BITS", "auto"}, {"GACT_SWAP", "1"},
                                         {"GACT_GROUP_SIZE", "128"}, {"GACT_STATS_PATH", "/tmp/s.json"},
                                         {"GACT_LOG_LEVEL", ""},  // empty: default
                                         {"GACT_BUDGET", "3.5"}, {"GACT_SEED", "7"}};
  auto lookup = [&](char const* name) -> char const* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  gact::options const o = gact::options::from_env(lookup);
  CHECK(o.memory_limit == 8ull << 30);
  CHECK(o.bits == gact::k_bits_auto);
  CHECK(o.swap);
  CHECK(o.group_size == 128);
  CHECK(o.stats_path == "/tmp/s.json");
  CHECK(o.log_level == gact::option_level::warn);
  CHECK(o.budget == 3.5);
  CHECK(o.seed == 7);

  env["GACT_MEMORY_LIMIT"] = "12Q";
  CHECK(error_of([&] { gact::options::from_env(lookup); }).starts_with(
      "GACT_MEMORY_LIMIT: '12Q' is not a size; use e.g. 8G"));
}

TEST_CASE("set by Python keyword; unknown keywords are listed") {
  gact::options o;
  o.set("memory_limit", "1.5G");
  o.set("bits", "2");
  o.set("swap", "yes");
  o.set("log_level", "error");
  CHECK(o.memory_limit == 3ull << 29);
  CHECK(o.bits == 2);
  CHECK(o.swap);
  CHECK(o.log_level == gact::option_level::error);
  CHECK(error_of([&] { o.set("group_size", "100"); }).starts_with("group_size: '100' is not a group size"));
  std::string const unknown = error_of([&] { o.set("memroy_limit", "1G"); });
  CHECK(unknown.starts_with("'memroy_limit' is not a gact setting; known: log_level, memory_limit"));
  CHECK(o.group_size == 256);  // unchanged by the failed set
}

TEST_CASE("to_json and the table") {
  gact::options o;
  o.bits = gact::k_bits_auto;
  auto const j = o.to_json();
  CHECK(j["bits"] == "auto");
  CHECK(j["log_level"] == "warn");
  CHECK(j["group_size"] == 256);
  CHECK(j["swap"] == false);
  auto const table = gact::option_table();
  CHECK(table.size() == j.size());
  bool saw_limit = false;
  for (auto const& row : table) {
    CHECK(row.env.starts_with("GACT_"));
    CHECK_FALSE(row.help.empty());
    CHECK(j.contains(std::string(row.name)));
    // The default text parses back to the default value.
    gact::options fresh;
    fresh.set(row.keyword, row.default_text);
    CHECK(fresh.to_json() == gact::options{}.to_json());
    if (row.name == "memory_limit") {
      saw_limit = true;
      CHECK(row.env == "GACT_MEMORY_LIMIT");
      CHECK(row.default_text == "0");
      CHECK(row.type == "bytes");
    }
  }
  CHECK(saw_limit);
}

}  // TEST_SUITE
