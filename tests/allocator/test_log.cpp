// gact/tests/allocator/test_log.cpp — the logger (issue 15): GACT_LOG_LEVEL spellings are
// those of the options table, and no message is longer than k_max_message bytes (a
// caller's 100 kB tag name must not become a 100 kB log line).
#include <doctest/doctest.h>

#include <spdlog/sinks/ostream_sink.h>

#include <algorithm>
#include <sstream>
#include <string>

#include "allocator/error.hpp"
#include "allocator/log.hpp"

namespace {

/// Capture what the gact logger writes while alive; restores the level afterwards.
struct capture {
  std::ostringstream out;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  spdlog::level::level_enum const level = gact::log::get().level();
  capture() {
    sink->set_pattern("%v");
    gact::log::get().sinks().push_back(sink);
  }
  ~capture() {
    auto& sinks = gact::log::get().sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink), sinks.end());
    gact::log::get().set_level(level);
  }
  capture(capture const&) = delete;
  capture& operator=(capture const&) = delete;
};

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("log: a message longer than k_max_message is cut, saying how much") {
  std::string const name(100'000, 'x');
  capture c;
  gact::log::get().set_level(spdlog::level::warn);
  GACT_LOG_WARN("push_tag(\"{}\") failed", name);
  std::string const line = c.out.str();
  CHECK(line.size() < gact::log::k_max_message + 64);
  CHECK(line.find("more bytes cut") != std::string::npos);
  CHECK(line.starts_with("push_tag(\"xxxx"));

  std::string const cut = gact::log::cap_message(std::string(2000, 'y'));
  CHECK(cut == std::string(gact::log::k_max_message, 'y') + "... (976 more bytes cut)");
  CHECK(gact::log::cap_message("short") == "short");
}

TEST_CASE("log: a capped call site ends with a line naming what is muted, not a source file") {
  capture c;
  gact::log::get().set_level(spdlog::level::warn);
  for (int i = 0; i < 4; ++i) GACT_WARN_CAPPED(2, "activation_store: {} handles still alive at the end of step {}", 10, i);
  std::string const out = c.out.str();
  CHECK(out.find("10 handles still alive at the end of step 1") != std::string::npos);
  CHECK(out.find("step 2") == std::string::npos);
  CHECK(out.find("(further warnings like \"activation_store: ... handles still alive at the end of step ...\" muted)") !=
        std::string::npos);
  CHECK(out.find(".cpp") == std::string::npos);
  CHECK(out.find(".hpp") == std::string::npos);
  CHECK(gact::log::muted_note("a {{literal}} {:>8} b") == "(further warnings like \"a {literal} ... b\" muted)");
  std::string const long_note = gact::log::muted_note(std::string(500, 'z'));
  CHECK(long_note.size() < 200);
}

TEST_CASE("log: set_level takes the options table's spellings; a bad one names GACT_LOG_LEVEL") {
  capture c;
  gact::log::set_level("TRACE");  // accepted by the table, once rejected by the logger
  CHECK(gact::log::get().level() == spdlog::level::trace);
  gact::log::set_level("Warning");
  CHECK(gact::log::get().level() == spdlog::level::warn);
  gact::log::set_level("off");
  CHECK(gact::log::get().level() == spdlog::level::off);
  CHECK_THROWS_WITH_AS(gact::log::set_level("loud"), doctest::Contains("GACT_LOG_LEVEL: 'loud' is not a log level"),
                       gact::invalid_argument);
}

}  // TEST_SUITE
