// gact/allocator/event_trace.cpp — the ring buffer of memory events and the
// counter snapshots (see event_trace.hpp).
//
// State (one process-wide instance, leaked so that exit-time dumps can still read it):
//   ring       up to `capacity` slots, grown as events arrive (a large GACT_TRACE costs
//              memory only once that many events were recorded, 64 B each); event
//              number s (0-based since enable) lives in slot s % capacity.
//              Invariants: ring.size() == min(recorded, capacity) <= capacity;
//              the kept events are numbers recorded-|kept| .. recorded-1.
//   sources    names by register_source() id.
//   snapshots  the last k_max_snapshots snapshots, oldest first.
// All guarded by state::mu; g_enabled mirrors (capacity > 0 && on) for the fast check.
#include "allocator/event_trace.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <mutex>

#include "allocator/error.hpp"
#include "allocator/log.hpp"
#include "allocator/options.hpp"
#include "allocator/stats_registry.hpp"

namespace gact::alloc::event_trace {
namespace {

constexpr std::size_t k_max_capacity = std::size_t{1} << 26;
static_assert(sizeof(event) <= 64, "event_trace.hpp documents 64 bytes an event");
constexpr std::size_t k_max_snapshots = 4096;
constexpr std::size_t k_max_sources = 65535;

struct state {
  std::mutex mu;
  std::vector<event> ring;      // size() == min(recorded, capacity): grown lazily
  std::size_t capacity = 0;
  std::uint64_t recorded = 0;
  std::uint64_t t0_ns = 0;      // steady clock at enable()
  std::vector<std::string> sources;
  std::deque<nlohmann::json> snapshots;
  std::uint64_t snapshots_dropped = 0;
  std::uint64_t snapshot_every = 1;
  std::uint64_t steps_marked = 0;
  bool providers_registered = false;
};

state& st() {
  static state* const s = new state();  // leaked: the exit dump may run after static destructors
  return *s;
}

std::uint64_t now_ns() noexcept {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

/// True on a thread building a snapshot: the trace's own sections then stay small.
thread_local bool t_in_snapshot = false;

std::once_flag g_env_once;

}  // namespace

char const* kind_name(event_kind k) noexcept {
  switch (k) {
    case event_kind::alloc: return "alloc";
    case event_kind::free: return "free";
    case event_kind::segment_alloc: return "segment_alloc";
    case event_kind::segment_free: return "segment_free";
    case event_kind::oom: return "oom";
    case event_kind::store_put: return "store_put";
    case event_kind::store_get: return "store_get";
    case event_kind::store_release: return "store_release";
    case event_kind::swap_out: return "swap_out";
    case event_kind::swap_in: return "swap_in";
    case event_kind::step: return "step";
    case event_kind::k_count: break;
  }
  return "unknown";
}

void enable(std::size_t capacity) {
  GACT_EXPECTS(capacity <= k_max_capacity, "trace: capacity " + std::to_string(capacity) +
                                               " exceeds the maximum of " + std::to_string(k_max_capacity) +
                                               " events (" + std::to_string(k_max_capacity * sizeof(event) >> 20) +
                                               " MiB once full)");
  if (capacity == 0) {
    disable();
    return;
  }
  std::vector<event> old;  // freed outside the lock
  state& s = st();
  {
    std::lock_guard lock(s.mu);
    s.ring.swap(old);
    s.capacity = capacity;
    s.recorded = 0;
    s.t0_ns = now_ns();
    detail::g_enabled.store(true, std::memory_order_relaxed);
  }
  // Registered outside our lock: the registry calls our providers under its own lock, and
  // they take ours.
  bool need = false;
  {
    std::lock_guard lock(s.mu);
    need = !s.providers_registered;
    s.providers_registered = true;
  }
  if (need) {
    stats::register_provider("timeline", [] {
      if (t_in_snapshot) return nlohmann::json::object();
      return timeline_json();
    });
    stats::register_provider("snapshots", [] {
      if (t_in_snapshot) return nlohmann::json::array();
      return snapshots_json();
    });
  }
}

void disable() noexcept { detail::g_enabled.store(false, std::memory_order_relaxed); }

void init_from_env() {
  std::call_once(g_env_once, [] {
    char const* v = std::getenv("GACT_TRACE");
    if (v == nullptr || *v == '\0') return;
    std::uint64_t const n = option_parse::count("GACT_TRACE", v);
    if (n > 0) {
      enable(static_cast<std::size_t>(n));
      GACT_LOG_INFO("event trace on: {} events (GACT_TRACE)", n);
    }
  });
}

std::uint16_t register_source(std::string_view name) {
  state& s = st();
  std::lock_guard lock(s.mu);
  if (s.sources.size() >= k_max_sources) {
    s.sources.back() = "(many)";
    return static_cast<std::uint16_t>(s.sources.size() - 1);
  }
  s.sources.emplace_back(name);
  return static_cast<std::uint16_t>(s.sources.size() - 1);
}

void record(event e) noexcept {
  if (!enabled()) return;
  e.time_ns = now_ns();
  state& s = st();
  std::lock_guard lock(s.mu);
  if (s.capacity == 0) return;
  e.seq = s.recorded;
  if (s.ring.size() < s.capacity) {
    try {
      s.ring.push_back(e);  // still growing: ring.size() == recorded
    } catch (...) {
      // No memory to grow: keep the events so far and wrap around from here on.
      if (s.ring.empty()) return;
      s.capacity = s.ring.size();
      s.ring[s.recorded % s.capacity] = e;
    }
  } else {
    s.ring[s.recorded % s.capacity] = e;
  }
  ++s.recorded;
}

ring_copy copy() {
  state& s = st();
  ring_copy out;
  std::lock_guard lock(s.mu);
  out.capacity = s.capacity;
  out.recorded = s.recorded;
  if (out.capacity == 0) return out;
  std::uint64_t const kept = std::min<std::uint64_t>(s.recorded, s.ring.size());
  out.dropped = s.recorded - kept;
  out.events.reserve(kept);
  for (std::uint64_t n = s.recorded - kept; n < s.recorded; ++n) out.events.push_back(s.ring[n % out.capacity]);
  return out;
}

void set_snapshot_every(std::uint64_t steps) noexcept {
  state& s = st();
  std::lock_guard lock(s.mu);
  s.snapshot_every = steps;
}

void mark_step(std::uint64_t step) {
  if (!enabled()) return;
  record(event_kind::step, 0, 0, 0, 0, tag_other, step);
  bool due = false;
  {
    state& s = st();
    std::lock_guard lock(s.mu);
    ++s.steps_marked;
    due = s.snapshot_every != 0 && (s.steps_marked - 1) % s.snapshot_every == 0;
  }
  if (due) take_snapshot("step " + std::to_string(step));
}

void take_snapshot(std::string const& reason) {
  nlohmann::json doc;
  t_in_snapshot = true;
  try {
    doc = stats::document();
  } catch (...) {
    t_in_snapshot = false;
    throw;
  }
  t_in_snapshot = false;

  nlohmann::json snap = nlohmann::json::object();
  snap["t_ns"] = now_ns();
  snap["reason"] = reason;
  nlohmann::json allocs = nlohmann::json::object();
  for (auto const& [name, a] : doc["allocators"].items()) {
    if (!a.is_object()) continue;
    nlohmann::json one = {{"allocated_bytes", a.value("allocated_bytes.all.current", std::int64_t{0})},
                          {"reserved_bytes", a.value("reserved_bytes.all.current", std::int64_t{0})},
                          {"active_bytes", a.value("active_bytes.all.current", std::int64_t{0})}};
    nlohmann::json tags = nlohmann::json::object();
    if (auto it = a.find("tags"); it != a.end() && it->is_object()) {
      for (auto const& [tag, t] : it->items()) {
        if (t.is_object()) tags[tag] = t.value("current_bytes", std::int64_t{0});
      }
    }
    one["tags"] = std::move(tags);
    allocs[name] = std::move(one);
  }
  snap["allocators"] = std::move(allocs);
  if (auto it = doc.find("store"); it != doc.end() && it->is_object()) {
    nlohmann::json store = nlohmann::json::object();
    for (char const* k : {"bytes_in_current", "bytes_stored_current", "live_handles", "tensors_in", "bytes_in",
                          "bytes_stored", "step"}) {
      if (auto f = it->find(k); f != it->end()) store[k] = *f;
    }
    snap["store"] = std::move(store);
  }
  if (auto it = doc.find("swap"); it != doc.end() && it->is_object()) snap["swap"] = *it;

  state& s = st();
  std::lock_guard lock(s.mu);
  snap["step"] = s.steps_marked;
  s.snapshots.push_back(std::move(snap));
  while (s.snapshots.size() > k_max_snapshots) {
    s.snapshots.pop_front();
    ++s.snapshots_dropped;
  }
}

nlohmann::json timeline_json() {
  ring_copy const r = copy();
  std::vector<std::string> sources;
  std::uint64_t t0 = 0;
  {
    state& s = st();
    std::lock_guard lock(s.mu);
    sources = s.sources;
    t0 = s.t0_ns;
  }
  auto const tags = tag_names();
  auto const tag_of = [&](tag_id t) { return t < tags.size() ? tags[t] : std::to_string(t); };
  nlohmann::json ev = nlohmann::json::array();
  for (event const& e : r.events) {
    nlohmann::json j = {{"t_ns", e.time_ns},
                        {"seq", e.seq},
                        {"action", kind_name(e.kind)},
                        {"addr", e.addr},
                        {"size", e.size},
                        {"stream", e.stream},
                        {"tag", tag_of(e.tag)},
                        {"source", e.source < sources.size() ? sources[e.source] : std::to_string(e.source)}};
    switch (e.kind) {
      case event_kind::alloc: j["requested"] = e.aux; break;
      case event_kind::oom: j["reserved"] = e.aux; break;
      case event_kind::store_put:
      case event_kind::store_get:
      case event_kind::store_release:
        j["key"] = e.key;
        j["bits"] = e.bits;
        j["fp32_bytes"] = e.aux;
        break;
      case event_kind::swap_out:
      case event_kind::swap_in: j["key"] = e.key; break;
      case event_kind::step: j["step"] = e.key; break;
      default: break;
    }
    ev.push_back(std::move(j));
  }
  return {{"capacity", r.capacity}, {"recorded", r.recorded}, {"dropped", r.dropped},
          {"enabled", enabled()},   {"t0_ns", t0},            {"sources", sources},
          {"events", std::move(ev)}};
}

nlohmann::json snapshots_json() {
  state& s = st();
  std::lock_guard lock(s.mu);
  nlohmann::json a = nlohmann::json::array();
  for (auto const& j : s.snapshots) a.push_back(j);
  return a;
}

void clear() noexcept {
  state& s = st();
  std::lock_guard lock(s.mu);
  s.ring.clear();
  s.recorded = 0;
  s.snapshots.clear();
  s.snapshots_dropped = 0;
  s.steps_marked = 0;
}

}  // namespace gact::alloc::event_trace
