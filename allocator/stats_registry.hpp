// gact/allocator/stats_registry.hpp
//
// The one JSON document of gact's statistics. Each component (every caching
// allocator instance, the activation store, codecs, swap, policy) registers a
// provider that returns its section; `document()` gathers them under a
// versioned schema:
//
//   { "schema_version": 2, "gact_version": "...", "pid": ..., "time_unix_ms": ...,
//     "tags": { "names": [...], "underflows": n, "overflows": n },  // the process-wide tag table
//     "allocators": { "<name>": {...} },        // one per caching_allocator; while the event
//                                               // trace is on, each has "segments": [...]
//     "<section>": {...}, ... ,                 // "store", "codecs", "swap", "policy", ...
//     "timeline": { "capacity", "recorded", "dropped", "t0_ns", "sources", "events": [...] },
//     "snapshots": [ {...}, ... ] }             // both once the event trace was enabled
//                                               // (allocator/event_trace.hpp)
//
// Versions: 1 = the sections above without "timeline", "snapshots" and "segments";
// 2 adds those three (optional: present only once tracing was enabled).
//
// A provider registered under "allocators/<name>" lands in the "allocators"
// object; any other name is a top-level section. Providers are called with no
// allocator lock held by the registry, and must be thread-safe.
//
// Dumps: dump(path) writes the document. A regular file or a new path is replaced
// atomically (temp file + rename in its directory); a symbolic link keeps being a link
// (its target is replaced); a FIFO, a terminal, /dev/stdout or /proc/self/fd/N is
// written in place, never replaced. A path holding a NUL byte is rejected.
//
// Triggers: with a configured path (GACT_STATS_PATH, or set_dump_path() from
// gact.configure(stats_path=...)), install_dump_triggers() checks the path at once
// (an error names the variable) and arranges a dump at exit, on SIGUSR1 and on SIGTERM.
// The handlers only write a byte to a pipe that a service thread reads, so no JSON is
// built inside a handler. SIGUSR1 chains to the handler it replaced; a handler
// installed later replaces gact's (calling install_dump_triggers() again re-arms gact's
// and chains to it). SIGTERM is taken only while its action is the default: the
// service thread dumps, then the process ends by SIGTERM as it would have.
// The configured path may hold {pid} (the process id) and {proc} ("rank<RANK>" in a
// process started by a torch.distributed launcher, else "pid<pid>"), expanded at each
// dump, so that every process of a job writes its own file.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>

namespace gact::stats {

inline constexpr int k_schema_version = 2;

using provider = std::function<nlohmann::json()>;

/// Register (or replace) the provider for `name`; returns a token for unregister().
std::uint64_t register_provider(std::string const& name, provider fn);
/// Register `fn` under `name`, or under "name#2", "name#3", ... when `name` is taken, so
/// that two allocators with the same name both appear in the document.
/// @returns the token for unregister() and the name actually used.
std::pair<std::uint64_t, std::string> register_unique_provider(std::string const& name, provider fn);
/// Remove a provider; unknown tokens are ignored. Waits until no document() is calling it,
/// so that the provider's owner may be destroyed as soon as this returns. A provider must
/// therefore never call register/unregister itself.
void unregister_provider(std::uint64_t token) noexcept;

/// The whole document, built now.
nlohmann::json document();

/// Write document() to `path` (see the file comment for links and special files).
/// @throws gact::invalid_argument for an empty path or one holding a NUL byte;
///         gact::error naming the path on I/O failure (a directory, a FIFO with no reader, ...).
void dump(std::string const& path);

/// `path_template` with {pid} and {proc} expanded for this process.
std::string expand_path(std::string const& path_template);

/// Check, before anything is written, that dumps to `path` (a template) can succeed:
/// no NUL byte, not a directory, its directory exists. Empty is fine (dumps off).
/// @throws gact::invalid_argument "<label>: '<path>' ..." naming what is wrong.
void check_path(std::string const& path, std::string_view label);

/// If a path is configured (GACT_STATS_PATH when set_dump_path() was never called): check
/// it, then dump there at normal exit, on SIGUSR1 and on SIGTERM. Idempotent; a later call
/// re-arms a SIGUSR1 handler that was replaced since, chaining to the new one.
/// @throws gact::invalid_argument naming GACT_STATS_PATH when that path cannot be written.
void install_dump_triggers();

/// Configure the path of the triggered dumps ("" = none) and install the triggers.
/// @throws gact::invalid_argument naming stats_path when the path cannot be written.
void set_dump_path(std::string const& path);

/// The configured path template ("" = none).
std::string dump_path();

}  // namespace gact::stats
