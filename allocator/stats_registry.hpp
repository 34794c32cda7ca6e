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
// Dumps: dump(path) writes the document atomically (temp file + rename). When
// GACT_STATS_PATH is set, install_dump_triggers() arranges a dump at exit and on
// SIGUSR1; the signal handler only writes a byte to a pipe that a service
// thread reads, so no JSON is built inside the handler.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
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

/// Write document() to `path` atomically. @throws gact::error naming the path on I/O failure.
void dump(std::string const& path);

/// If GACT_STATS_PATH is set: dump there at normal exit and on SIGUSR1 (idempotent; safe to call often).
void install_dump_triggers();

}  // namespace gact::stats
