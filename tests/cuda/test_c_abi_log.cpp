// gact/tests/cuda/test_c_abi_log.cpp — gact_push_tag with a 100 kB name (issue 15): the
// call fails (-1, the name is too long for a tag) and its warning names the tag cut to
// the logger's k_max_message bytes, instead of writing the 100 kB name whole.
#include <doctest/doctest.h>
#include <spdlog/sinks/ostream_sink.h>

#include <algorithm>
#include <sstream>
#include <string>

#include "allocator/log.hpp"
#include "bindings/gact.h"

TEST_CASE("c abi: gact_push_tag of a 100 kB name logs a capped warning") {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  sink->set_pattern("%v");
  auto& lg = gact::log::get();
  auto const level = lg.level();
  lg.sinks().push_back(sink);
  lg.set_level(spdlog::level::warn);
  std::string const name(100'000, 't');
  int const id = gact_push_tag(name.c_str());
  lg.set_level(level);
  lg.sinks().erase(std::remove(lg.sinks().begin(), lg.sinks().end(), sink), lg.sinks().end());
  CHECK(id == -1);
  std::string const text = out.str();
  CHECK(text.find("gact_push_tag(\"ttt") != std::string::npos);
  CHECK(text.find("more bytes cut") != std::string::npos);
  CHECK(text.size() < gact::log::k_max_message + 64);
}
