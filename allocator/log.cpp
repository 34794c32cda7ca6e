// gact/allocator/log.cpp — the "gact" spdlog logger, its level from GACT_LOG_LEVEL, and
// the cap on the length of one message.
//
// A message longer than k_max_message bytes is cut before any sink sees it (mimalloc
// caps its error messages the same way): a caller's 100 kB tag name or path must not
// become a 100 kB log line, once per call.
#include "log.hpp"

#include <spdlog/sinks/stdout_sinks.h>

#include <cstdlib>
#include <string>

#include "error.hpp"
#include "options.hpp"

namespace gact::log {
namespace {

spdlog::level::level_enum to_spdlog(option_level l) noexcept {
  switch (l) {
    case option_level::trace: return spdlog::level::trace;
    case option_level::debug: return spdlog::level::debug;
    case option_level::info: return spdlog::level::info;
    case option_level::warn: return spdlog::level::warn;
    case option_level::error: return spdlog::level::err;
    case option_level::off: return spdlog::level::off;
  }
  return spdlog::level::warn;
}

/// The options table's parser, so that the logger accepts exactly what GACT_LOG_LEVEL's
/// row accepts (any case, "warning").
spdlog::level::level_enum parse_level(std::string const& name) {
  return to_spdlog(option_parse::level("GACT_LOG_LEVEL", name));
}

/// A logger whose messages are capped at k_max_message bytes.
class capped_logger final : public spdlog::logger {
 public:
  using spdlog::logger::logger;

 protected:
  void sink_it_(spdlog::details::log_msg const& msg) override {
    if (msg.payload.size() <= k_max_message) {
      spdlog::logger::sink_it_(msg);
      return;
    }
    std::string const text = cap_message(std::string_view(msg.payload.data(), msg.payload.size()));
    spdlog::details::log_msg cut(msg);
    cut.payload = spdlog::string_view_t(text.data(), text.size());
    spdlog::logger::sink_it_(cut);
  }
};

std::shared_ptr<spdlog::logger> make_logger() {
  // A private logger (not registered globally) so that a host application's
  // spdlog registry and ours never clash.
  auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  auto lg = std::make_shared<capped_logger>("gact", sink);
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

std::string muted_note(std::string_view format) {
  std::string body;
  for (std::size_t i = 0; i < format.size() && body.size() < 160; ++i) {
    char const c = format[i];
    if (c == '{' && i + 1 < format.size() && format[i + 1] == '{') {
      body += '{';
      ++i;
    } else if (c == '}' && i + 1 < format.size() && format[i + 1] == '}') {
      body += '}';
      ++i;
    } else if (c == '{') {  // a replacement field: its value is left out
      std::size_t const end = format.find('}', i);
      body += "...";
      if (end == std::string_view::npos) break;
      i = end;
    } else {
      body += c;
    }
  }
  if (body.size() >= 160) {
    body.resize(157);
    body += "...";
  }
  return "(further warnings like \"" + body + "\" muted)";
}

std::string cap_message(std::string_view text) {
  if (text.size() <= k_max_message) return std::string(text);
  std::string out(text.substr(0, k_max_message));
  out += "... (";
  out += std::to_string(text.size() - k_max_message);
  out += " more bytes cut)";
  return out;
}

spdlog::logger& get() {
  // Leaked on purpose: the logger must outlive every static destructor that may log.
  static auto* const instance = new std::shared_ptr<spdlog::logger>(make_logger());
  return **instance;
}

void set_level(std::string const& name) { get().set_level(parse_level(name)); }

}  // namespace gact::log
