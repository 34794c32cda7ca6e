// gact/allocator/event_trace.hpp
//
// The event trace: an optional, bounded ring buffer of memory events that every
// layer records into (caching allocators: alloc, free, segment alloc/free, OOM;
// the activation store: put, get, release; swap: out, in; the training loop:
// step markers), plus periodic snapshots of the per-tag and store counters. It
// is what `gact-stats plot`, `summary` and `export-torch` turn into pictures and
// into PyTorch's memory_viz snapshot format.
//
// Off by default. Turned on by GACT_TRACE=N (read when the first allocator is
// created) or enable(N) (Python: gact.trace(N)). When off, a recording site costs
// one relaxed atomic load and a predictable branch:
//
//   if (event_trace::enabled()) [[unlikely]] event_trace::record(...);
//
// When on, record() takes one short mutex (a slot copy under it); the oldest
// events are overwritten once `capacity` is reached and counted as dropped.
// Defining GACT_EVENT_TRACE_COMPILED_OUT makes enabled() a constant false (used to
// measure the cost of the check itself).
//
// The timeline and the snapshots appear in the stats document as the top-level
// sections "timeline" and "snapshots" once tracing has been enabled.
//
// Lock order: an allocator's mutex may be held while record() runs; record() never
// calls back into an allocator. take_snapshot() builds the stats document and so
// must be called with no allocator or store lock held (mark_step() is such a place).
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "allocator/tags.hpp"

namespace gact::alloc::event_trace {

/// What happened. The names (kind_name) are the "action" strings of the JSON timeline.
enum class event_kind : std::uint8_t {
  alloc = 0,          ///< a block handed out: addr, size (rounded), aux = requested bytes
  free = 1,           ///< a block given back: addr, size (rounded)
  segment_alloc = 2,  ///< memory reserved from the backend: addr, size
  segment_free = 3,   ///< memory released to the backend: addr, size
  oom = 4,            ///< a request failed: size = requested bytes, aux = reserved bytes then
  store_put = 5,      ///< a tensor stored: addr = blob, size = blob bytes, key, bits, aux = fp32-equivalent bytes
  store_get = 6,      ///< a tensor decoded: as store_put
  store_release = 7,  ///< a blob freed by its last release: as store_put
  swap_out = 8,       ///< a blob copied to host and its device bytes freed: addr = device blob, size, key
  swap_in = 9,        ///< a blob brought back to the device: addr = device blob, size, key
  step = 10,          ///< a training step begins: key = step number
  k_count = 11,
};

/// Stable name of a kind ("alloc", "segment_free", "store_put", ...).
char const* kind_name(event_kind k) noexcept;

/// One recorded event. Fields that do not apply to a kind are 0.
struct event {
  std::uint64_t time_ns = 0;  ///< steady clock, nanoseconds
  std::uint64_t seq = 0;      ///< position in the stream of events since enable(): strictly increasing
  std::uint64_t addr = 0;
  std::uint64_t size = 0;
  std::uint64_t stream = 0;
  std::uint64_t key = 0;      ///< store/swap: tensor key; step: the step number
  std::uint64_t aux = 0;      ///< see event_kind
  tag_id tag = tag_other;
  std::uint16_t source = 0;   ///< register_source() id of the recording allocator / component
  event_kind kind = event_kind::alloc;
  std::int8_t bits = 0;       ///< store events: bits per element as stored
};

namespace detail {
inline std::atomic<bool> g_enabled{false};
}  // namespace detail

/// True while tracing is on: one relaxed load (the whole cost of a recording site when off).
inline bool enabled() noexcept {
#ifdef GACT_EVENT_TRACE_COMPILED_OUT
  return false;
#else
  return detail::g_enabled.load(std::memory_order_relaxed);
#endif
}

/// Turn tracing on with room for `capacity` events (a fresh, empty buffer; snapshots are
/// kept), or off for capacity 0. The buffer grows as events arrive: it holds
/// min(recorded, capacity) events of 64 bytes, so a large capacity costs nothing until used
/// (at most 4 GiB at the maximum). Registers the "timeline" and "snapshots" stats sections.
/// @throws gact::invalid_argument for capacity > 2^26 (64 Mi events).
void enable(std::size_t capacity);
/// Turn tracing off; the recorded events stay readable (and in the stats document).
void disable() noexcept;
/// Read GACT_TRACE once per process and enable() accordingly (called by the allocators).
/// @throws gact::invalid_argument when GACT_TRACE is not a count.
void init_from_env();

/// A small id for a recording component; `name` labels its events ("host", "cuda:0", "store").
/// Ids are never reused; after 65535 registrations the last id is shared.
std::uint16_t register_source(std::string_view name);

/// Record one event (time_ns and seq are filled in). No-op when tracing is off.
void record(event e) noexcept;
/// Convenience form of record().
inline void record(event_kind kind, std::uint16_t source, std::uintptr_t addr, std::size_t size,
                   std::uint64_t stream, tag_id tag, std::uint64_t key = 0, int bits = 0,
                   std::uint64_t aux = 0) noexcept {
  event e;
  e.kind = kind;
  e.source = source;
  e.addr = addr;
  e.size = size;
  e.stream = stream;
  e.tag = tag;
  e.key = key;
  e.bits = static_cast<std::int8_t>(bits);
  e.aux = aux;
  record(e);
}

/// A consistent copy of the ring.
struct ring_copy {
  std::size_t capacity = 0;
  std::uint64_t recorded = 0;   ///< events recorded since enable()
  std::uint64_t dropped = 0;    ///< overwritten: recorded - events.size()
  std::vector<event> events;    ///< oldest first (seq strictly increasing)
};
/// Copy the ring (empty when tracing was never enabled).
ring_copy copy();

/// Every N calls of mark_step() take a snapshot (0 = never; default 1).
void set_snapshot_every(std::uint64_t steps) noexcept;
/// Record a step marker and, every set_snapshot_every() steps, take_snapshot(). No-op when off.
/// Call with no allocator or store lock held.
void mark_step(std::uint64_t step);
/// Append a snapshot of the per-tag and store counters (from the stats document) labelled
/// `reason`. At most 4096 are kept (the oldest go first, counted). Call with no allocator or
/// store lock held.
void take_snapshot(std::string const& reason);

/// The "timeline" section: {"capacity", "recorded", "dropped", "t0_ns", "sources": [...],
/// "tags": [...], "events": [{"t_ns", "seq", "action", "addr", "size", "stream", "tag", "source", ...}]}.
nlohmann::json timeline_json();
/// The "snapshots" section: [{"t_ns", "step", "reason", "allocators": {...}, "store": {...}}, ...].
nlohmann::json snapshots_json();

/// Forget everything recorded (events, snapshots); tracing stays as it is. For tests.
void clear() noexcept;

}  // namespace gact::alloc::event_trace
