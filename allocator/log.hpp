// gact/allocator/log.hpp
//
// The one logger of gact, an spdlog logger named "gact" writing to stderr. Its
// level comes from GACT_LOG_LEVEL (trace|debug|info|warn|error|off, default
// warn) when it is first used. GACT_LOG_TRACE compiles out of release builds.
// `warn_capped` limits how often one call site can warn (mimalloc style), so a
// pathological caller cannot flood the log, and no message is longer than
// k_max_message bytes (a longer one is cut, saying how much was cut).
#pragma once

#include <spdlog/spdlog.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

namespace gact::log {

/// The shared "gact" logger (created on first use, level from GACT_LOG_LEVEL).
spdlog::logger& get();

/// Set the level by name, as GACT_LOG_LEVEL accepts it (trace|debug|info|warn|error|off, any case).
/// @throws gact::invalid_argument naming GACT_LOG_LEVEL on a bad name.
void set_level(std::string const& name);

/// Longest message the logger writes; the rest is cut (see cap_message).
inline constexpr std::size_t k_max_message = 1024;

/// `text` itself when it fits in k_max_message bytes, else its first k_max_message bytes
/// followed by "... (N more bytes cut)". Every message of the logger goes through this.
std::string cap_message(std::string_view text);

/// The line that ends a capped call site's warnings: its format with the values left out,
/// `(further warnings like "activation_store: ... handles still alive ..." muted)`, at most
/// 160 bytes of it (it names what is muted, not where in gact's sources).
std::string muted_note(std::string_view format);

/// True while a call site identified by `counter` has warned fewer than `cap` times.
inline bool allow_capped(std::atomic<int>& counter, int cap = 16) noexcept {
  return counter.fetch_add(1, std::memory_order_relaxed) < cap;
}

}  // namespace gact::log

#define GACT_LOG_DEBUG(...) ::gact::log::get().debug(__VA_ARGS__)
#define GACT_LOG_INFO(...) ::gact::log::get().info(__VA_ARGS__)
#define GACT_LOG_WARN(...) ::gact::log::get().warn(__VA_ARGS__)
#define GACT_LOG_ERROR(...) ::gact::log::get().error(__VA_ARGS__)
#ifdef NDEBUG
#define GACT_LOG_TRACE(...) ((void)0)
#else
#define GACT_LOG_TRACE(...) ::gact::log::get().trace(__VA_ARGS__)
#endif

#define GACT_LOG_FIRST_(first, ...) first
/// Warn at most `cap` times from this call site, then say once that further warnings are muted.
#define GACT_WARN_CAPPED(cap, ...)                                                   \
  do {                                                                               \
    static std::atomic<int> gact_warn_count_{0};                                     \
    int const gact_n_ = gact_warn_count_.fetch_add(1, std::memory_order_relaxed);   \
    if (gact_n_ < (cap)) {                                                           \
      ::gact::log::get().warn(__VA_ARGS__);                                          \
    } else if (gact_n_ == (cap)) {                                                   \
      ::gact::log::get().warn("{}", ::gact::log::muted_note(GACT_LOG_FIRST_(__VA_ARGS__, ""))); \
    }                                                                                \
  } while (0)
