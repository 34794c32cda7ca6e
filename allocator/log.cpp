// gact/allocator/log.cpp — the "gact" spdlog logger and its level from GACT_LOG_LEVEL.
#include "log.hpp"

#include <spdlog/sinks/stdout_sinks.h>

#include <cstdlib>
#include <string>

#include "error.hpp"

namespace gact::log {
namespace {

spdlog::level::level_enum parse_level(std::string const& name) {
  if (name == "trace") return spdlog::level::trace;
  if (name == "debug") return spdlog::level::debug;
  if (name == "info") return spdlog::level::info;
  if (name == "warn" || name == "warning") return spdlog::level::warn;
  if (name == "error") return spdlog::level::err;
  if (name == "off") return spdlog::level::off;
  GACT_FAIL("GACT_LOG_LEVEL: '" + name + "' is not a level; use trace|debug|info|warn|error|off");
}

std::shared_ptr<spdlog::logger> make_logger() {
  // A private logger (not registered globally) so that a host application's
  // spdlog registry and ours never clash.
  auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  auto lg = std::make_shared<spdlog::logger>("gact", sink);
  lg->set_pattern("[gact %L] %v");
  lg->set_level(spdlog::level::warn);
  if (char const* env = std::getenv("GACT_LOG_LEVEL"); env != nullptr && *env != '\0') {
    try {
      lg->set_level(parse_level(env));
    } catch (gact::error const& e) {
      lg->error("{}", e.what());
    }
  }
  return lg;
}

}  // namespace

spdlog::logger& get() {
  // Leaked on purpose: the logger must outlive every static destructor that may log.
  static auto* const instance = new std::shared_ptr<spdlog::logger>(make_logger());
  return **instance;
}

void set_level(std::string const& name) { get().set_level(parse_level(name)); }

}  // namespace gact::log
