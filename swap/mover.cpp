// gact/swap/mover.cpp
//
// Implementation of the swap mover (see the header for the pipeline). Every
// blob is a small state machine:
//
//   device ──start_offload──▶ offloading ──retire──▶ host ──start_fetch──▶ fetching ──retire──▶ device
//                                 │ (wanted meanwhile: keep_device)                      ▲
//                                 └────────────────retire──────────────────────────────┘
//
// Copies in flight are listed in inflight_; poll() queries their completion
// events (never blocking) and retire() frees what the finished copy made free:
// the device bytes after a D2H copy, the pinned bytes after an H2D copy. A blob
// released while one of its copies is in flight is only marked, and freed at
// retirement, so no byte is ever freed under a running copy.
#include "swap/mover.hpp"

#include <algorithm>
#include <chrono>

#include "allocator/error.hpp"
#include "allocator/log.hpp"
#include "allocator/stats_registry.hpp"
#include "allocator/tags.hpp"

namespace gact::swap {

// One blob. Invariants:
//   state == device     : dev != nullptr, host == nullptr, done == 0
//   state == offloading : dev != nullptr, host != nullptr, done recorded on d2h (copy dev -> host)
//   state == host       : dev == nullptr, host != nullptr, done == 0
//   state == fetching   : dev != nullptr, host != nullptr, done recorded on h2d (copy host -> dev)
//   released            => state is offloading or fetching (otherwise the blob is gone)
struct mover::blob {
  std::size_t bytes = 0;
  where state = where::device;
  void* dev = nullptr;
  device::stream_t dev_stream = 0;  // allocation stream of dev (producer, or h2d for a fetched copy)
  device::stream_t producer = 0;    // stream whose work wrote the blob
  void* host = nullptr;
  device::event_t ready = 0;        // offloading: the producer's work up to put()
  device::event_t done = 0;         // the copy in flight
  bool keep_device = false;         // offloading: keep dev at retirement, drop host
  bool acquired = false;            // handed to a consumer; never offloaded again
  bool released = false;
  bool pinned_failed = false;       // the pool refused it: stays on the device
  bool ever_offloaded = false;
  bool prefetched = false;          // the fetch in flight (or done) was speculative
};

namespace {

std::uint64_t now_ns() noexcept {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
}

}  // namespace

mover::mover(alloc::caching_allocator& device_arena, pinned_pool& pool, mover_options opts)
    : arena_(device_arena), pool_(pool), be_(device_arena.backend()), opts_(std::move(opts)) {
  GACT_EXPECTS(&pool_.allocator() != &arena_, "swap::mover: the pinned pool cannot be the device arena");
  host_consumer_ = be_.kind() != device::memory_kind::device;
  d2h_ = be_.create_stream();
  try {
    h2d_ = be_.create_stream();
  } catch (...) {
    be_.destroy_stream(d2h_);
    throw;
  }
  if (!opts_.stats_name.empty()) {
    stats_token_ = stats::register_unique_provider(opts_.stats_name, [this] { return stats_json(); }).first;
  }
}

mover::~mover() {
  if (stats_token_ != 0) stats::unregister_provider(stats_token_);
  std::lock_guard lock(mu_);
  try {
    for (blob_id id : inflight_) be_.synchronize(blobs_.at(id)->done);
  } catch (std::exception const& e) {
    GACT_LOG_ERROR("swap::mover: waiting for copies at destruction failed: {}", e.what());
  }
  poll_locked();
  std::size_t leaked = 0;
  for (auto& [id, b] : blobs_) {
    if (!b->released) ++leaked;
    free_device(*b);
    free_host(*b);
    give_event(b->ready);
    give_event(b->done);
  }
  if (leaked > 0) GACT_LOG_WARN("swap::mover: {} blobs still owned at destruction; freed", leaked);
  blobs_.clear();
  for (device::event_t e : all_events_) be_.destroy_event(e);
  be_.destroy_stream(d2h_);
  be_.destroy_stream(h2d_);
}

// ---- events ----------------------------------------------------------------------------

device::event_t mover::take_event() {
  if (!free_events_.empty()) {
    device::event_t const e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  all_events_.reserve(all_events_.size() + 1);
  device::event_t const e = be_.create_event();
  all_events_.push_back(e);
  free_events_.reserve(all_events_.size());  // so that give_event never allocates
  return e;
}

void mover::give_event(device::event_t& e) noexcept {
  if (e == 0) return;
  free_events_.push_back(e);  // never reallocates: capacity >= all_events_.size() >= size + 1
  e = 0;
}

void mover::wait_host(device::event_t e) {
  std::uint64_t const t0 = now_ns();
  be_.synchronize(e);
  s_.stall_ns += now_ns() - t0;
  ++s_.host_syncs;
}

// ---- freeing ---------------------------------------------------------------------------

void mover::free_device(blob& b) noexcept {
  if (b.dev == nullptr) return;
  if (opts_.before_free) opts_.before_free(b.dev, b.bytes, false);
  arena_.deallocate(b.dev);
  b.dev = nullptr;
  s_.device_bytes -= b.bytes;
}

void mover::free_host(blob& b) noexcept {
  if (b.host == nullptr) return;
  if (opts_.before_free) opts_.before_free(b.host, b.bytes, true);
  pool_.deallocate(b.host);
  b.host = nullptr;
  s_.host_bytes -= b.bytes;
}

// ---- progress --------------------------------------------------------------------------

void mover::poll() {
  std::lock_guard lock(mu_);
  poll_locked();
}

void mover::poll_locked() {
  std::size_t kept = 0;
  for (std::size_t i = 0; i < inflight_.size(); ++i) {
    blob_id const id = inflight_[i];
    auto it = blobs_.find(id);
    GACT_ASSERT_INTERNAL(it != blobs_.end());
    blob& b = *it->second;
    if (!be_.query(b.done)) {
      inflight_[kept++] = id;
      continue;
    }
    retire(id, b);
    if (b.released) blobs_.erase(it);
  }
  inflight_.resize(kept);
  s_.copies_in_flight = kept;
}

// The copy of `b` has completed: free what it made free.
void mover::retire(blob_id /*id*/, blob& b) {
  if (b.state == where::offloading) {
    if (b.keep_device || b.acquired) {
      free_host(b);  // the D2H copy has finished reading dev and writing host: both are free to go
      b.state = where::device;
      ++s_.offloads_kept;
    } else {
      free_device(b);  // the D2H copy has finished reading dev
      b.state = where::host;
    }
  } else {
    GACT_ASSERT_INTERNAL(b.state == where::fetching);
    free_host(b);  // the H2D copy has finished reading host
    b.state = where::device;
  }
  give_event(b.ready);
  give_event(b.done);
  if (b.released) {
    free_device(b);
    free_host(b);
  }
}

void mover::synchronize() {
  std::lock_guard lock(mu_);
  for (blob_id id : inflight_) wait_host(blobs_.at(id)->done);
  poll_locked();
}

// ---- offload ---------------------------------------------------------------------------

bool mover::eligible(blob const& b) const noexcept {
  return b.state == where::device && !b.acquired && !b.released && !b.pinned_failed && !b.ever_offloaded &&
         b.bytes >= opts_.min_blob_bytes;
}

blob_id mover::put(void* p, std::size_t bytes, device::stream_t stream) {
  GACT_EXPECTS(p != nullptr, "swap::mover::put: null blob");
  GACT_EXPECTS(bytes > 0, "swap::mover::put: zero-byte blob");
  GACT_EXPECTS(arena_.owns(p), "swap::mover::put: the blob is not a block of the device arena '" +
                                   arena_.stats_name() + "'");
  GACT_EXPECTS(bytes <= arena_.block_size(p), "swap::mover::put: " + std::to_string(bytes) +
                                                  " bytes exceed the blob's block of " +
                                                  std::to_string(arena_.block_size(p)));
  auto b = std::make_unique<blob>();
  b->bytes = bytes;
  b->dev = p;
  b->dev_stream = stream;
  b->producer = stream;
  std::lock_guard lock(mu_);
  poll_locked();
  blob_id const id = next_id_++;
  blob& ref = *b;
  blobs_.emplace(id, std::move(b));
  ++s_.puts;
  s_.device_bytes += bytes;
  s_.device_bytes_peak = std::max(s_.device_bytes_peak, s_.device_bytes);
  if (eligible(ref)) s_.pending_bytes += bytes;
  enforce_budget_locked();
  return id;
}

void mover::enforce_budget_locked() {
  // Oldest first: the blobs saved first are needed last in backward.
  for (auto it = blobs_.begin(); it != blobs_.end() && s_.pending_bytes > opts_.device_budget; ++it) {
    blob& b = *it->second;
    if (!eligible(b)) continue;
    s_.pending_bytes -= b.bytes;
    try {
      start_offload(b);
      inflight_.push_back(it->first);
      s_.copies_in_flight = inflight_.size();
    } catch (out_of_memory const& e) {
      b.pinned_failed = true;
      ++s_.pinned_alloc_failures;
      GACT_WARN_CAPPED(4, "swap: no pinned memory for a {}-byte blob; it stays on the device ({})", b.bytes,
                       e.what());
    } catch (std::exception const& e) {
      b.pinned_failed = true;
      ++s_.pinned_alloc_failures;
      GACT_WARN_CAPPED(4, "swap: offload of a {}-byte blob failed; it stays on the device ({})", b.bytes,
                       e.what());
    }
  }
}

// Precondition: b is eligible. On any exception b is unchanged (state device, no pinned bytes).
void mover::start_offload(blob& b) {
  void* h = pool_.allocate(b.bytes, d2h_);  // throws out_of_memory
  bool copy_queued = false;
  try {
    b.ready = take_event();
    be_.record(b.ready, b.producer);  // the encode that wrote the blob is queued on the producer
    be_.wait(d2h_, b.ready);          // so the copy must not start before it has finished
    copy_queued = true;
    be_.copy_async(h, b.dev, b.bytes, d2h_);
    b.done = take_event();
    be_.record(b.done, d2h_);  // device bytes are freed, pinned bytes read, only after this
  } catch (...) {
    if (copy_queued) {
      try {
        be_.synchronize_stream(d2h_);  // the copy may be queued: it must finish before h is reused
      } catch (...) {
        give_event(b.ready);
        give_event(b.done);
        throw;  // h is leaked on purpose: freeing it under a running copy would corrupt data
      }
    }
    give_event(b.ready);
    give_event(b.done);
    pool_.deallocate(h);
    throw;
  }
  b.host = h;
  b.state = where::offloading;
  b.ever_offloaded = true;
  ++s_.offloads;
  s_.bytes_out += b.bytes;
  s_.host_bytes += b.bytes;
  s_.host_bytes_peak = std::max(s_.host_bytes_peak, s_.host_bytes);
}

// ---- fetch -----------------------------------------------------------------------------

// Precondition: b.state == host. Returns false when a speculative fetch found no device memory.
bool mover::start_fetch(blob_id id, blob& b, bool demand) {
  void* d = nullptr;
  try {
    d = arena_.allocate(b.bytes, h2d_, alloc::tag_activation);
  } catch (out_of_memory const& first) {
    if (!demand) {
      ++s_.prefetch_oom_skipped;
      return false;
    }
    // Release: let our own offloads in flight finish (their device bytes go back to the arena),
    // return every cached block to the device, and try once more.
    ++s_.fetch_oom_retries;
    for (blob_id f : inflight_) wait_host(blobs_.at(f)->done);
    poll_locked();
    arena_.empty_cache();
    try {
      d = arena_.allocate(b.bytes, h2d_, alloc::tag_activation);
    } catch (out_of_memory const& second) {
      ++s_.fetch_oom_failures;
      throw out_of_memory("swap: no device memory to bring back blob " + std::to_string(id) + " (" +
                          std::to_string(b.bytes) + " bytes) of arena '" + arena_.stats_name() +
                          "', even after releasing cached blocks (" + second.what() +
                          "); the blob is kept in pinned host memory and may be fetched later");
    }
    (void)first;
  }
  try {
    be_.copy_async(d, b.host, b.bytes, h2d_);  // pinned bytes are complete: state host means D2H retired
    b.done = take_event();
    be_.record(b.done, h2d_);  // consumers wait on it; pinned bytes are freed only after it
  } catch (...) {
    try {
      be_.synchronize_stream(h2d_);
    } catch (...) {
    }
    give_event(b.done);
    arena_.deallocate(d);
    if (demand) throw;
    return false;
  }
  b.dev = d;
  b.dev_stream = h2d_;
  b.state = where::fetching;
  b.prefetched = !demand;
  ++s_.fetches;
  s_.bytes_in += b.bytes;
  s_.device_bytes += b.bytes;
  s_.device_bytes_peak = std::max(s_.device_bytes_peak, s_.device_bytes);
  inflight_.push_back(id);
  s_.copies_in_flight = inflight_.size();
  return true;
}

void mover::prefetch_below_locked(blob_id upper) {
  if (opts_.lookahead_blobs == 0 && opts_.lookahead_bytes == 0) return;
  std::size_t count = 0;
  std::size_t bytes = 0;
  // Newest first below `upper`: the reverse order of saving is the order backward needs them.
  for (auto it = std::make_reverse_iterator(blobs_.lower_bound(upper)); it != blobs_.rend(); ++it) {
    blob& b = *it->second;
    if (b.released || b.acquired) continue;
    ++count;
    bytes += b.bytes;
    if (opts_.lookahead_blobs != 0 && count > opts_.lookahead_blobs) break;
    if (opts_.lookahead_bytes != 0 && bytes > opts_.lookahead_bytes && count > 1) break;
    if (b.state == where::host) {
      if (!start_fetch(it->first, b, false)) break;  // no device room: later blobs would not fit either
    } else if (b.state == where::offloading) {
      b.keep_device = true;  // needed soon: keep its device bytes when the copy-out finishes
    }
  }
}

void mover::begin_backward() {
  std::lock_guard lock(mu_);
  poll_locked();
  prefetch_below_locked(next_id_);
}

// ---- acquire / release -----------------------------------------------------------------

void* mover::acquire(blob_id id, device::stream_t stream) {
  std::lock_guard lock(mu_);
  poll_locked();
  auto it = blobs_.find(id);
  GACT_EXPECTS(it != blobs_.end() && !it->second->released,
               "swap::mover::acquire: unknown blob " + std::to_string(id) + " (released already?)");
  blob& b = *it->second;
  bool const first = !b.acquired;
  if (eligible(b)) s_.pending_bytes -= b.bytes;
  switch (b.state) {
    case where::device:
      if (first) {
        if (b.ever_offloaded && b.prefetched) {
          ++s_.prefetch_hits;
        } else {
          ++s_.resident_gets;
        }
      }
      break;
    case where::offloading:
      b.keep_device = true;  // dev is still valid; the copy-out only reads it
      if (first) ++s_.resident_gets;
      break;
    case where::host:
      start_fetch(id, b, true);  // throws out_of_memory; b stays in host state then
      if (first) ++s_.prefetch_misses;
      break;
    case where::fetching:
      if (first) {
        if (b.prefetched) {
          ++s_.prefetch_hits;
          ++s_.prefetch_late;
        } else {
          ++s_.prefetch_misses;
        }
      }
      break;
  }
  b.acquired = true;
  if (b.state == where::fetching) {
    if (host_consumer_) {
      wait_host(b.done);  // the host decodes: it must see the bytes
      poll_locked();
    } else {
      be_.wait(stream, b.done);  // the consumer's work starts after the copy-in
    }
  }
  void* const p = b.dev;
  if (!host_consumer_ && b.dev_stream != stream) arena_.record_stream(p, stream);
  prefetch_below_locked(id);
  return p;
}

void mover::release(blob_id id) noexcept {
  std::lock_guard lock(mu_);
  auto it = blobs_.find(id);
  if (it == blobs_.end() || it->second->released) {
    ++bad_releases_;
    GACT_WARN_CAPPED(4, "swap::mover::release: unknown blob {}", id);
    return;
  }
  blob& b = *it->second;
  if (eligible(b)) s_.pending_bytes -= b.bytes;
  b.released = true;
  if (b.state == where::device || b.state == where::host) {
    free_device(b);  // consumers were recorded on its stream (record_stream) at acquire
    free_host(b);
    blobs_.erase(it);
  }
  // offloading / fetching: freed by retire() when the copy has completed
  poll_locked();
}

// ---- stats -----------------------------------------------------------------------------

mover_stats mover::stats() const {
  std::lock_guard lock(mu_);
  mover_stats s = s_;
  s.live_blobs = 0;
  for (auto const& [id, b] : blobs_) s.live_blobs += b->released ? 0 : 1;
  return s;
}

nlohmann::json mover::stats_json() const {
  mover_stats const s = stats();
  std::uint64_t bad = 0;
  {
    std::lock_guard lock(mu_);
    bad = bad_releases_;
  }
  nlohmann::json j;
  j["puts"] = s.puts;
  j["offloads"] = s.offloads;
  j["bytes_out"] = s.bytes_out;
  j["fetches"] = s.fetches;
  j["bytes_in"] = s.bytes_in;
  j["prefetch_hits"] = s.prefetch_hits;
  j["prefetch_late"] = s.prefetch_late;
  j["prefetch_misses"] = s.prefetch_misses;
  j["resident_gets"] = s.resident_gets;
  j["offloads_kept"] = s.offloads_kept;
  j["pinned_alloc_failures"] = s.pinned_alloc_failures;
  j["prefetch_oom_skipped"] = s.prefetch_oom_skipped;
  j["fetch_oom_retries"] = s.fetch_oom_retries;
  j["fetch_oom_failures"] = s.fetch_oom_failures;
  j["stall_ns"] = s.stall_ns;
  j["host_syncs"] = s.host_syncs;
  j["device_bytes"] = s.device_bytes;
  j["device_bytes_peak"] = s.device_bytes_peak;
  j["pending_bytes"] = s.pending_bytes;
  j["host_bytes"] = s.host_bytes;
  j["host_bytes_peak"] = s.host_bytes_peak;
  j["live_blobs"] = s.live_blobs;
  j["copies_in_flight"] = s.copies_in_flight;
  j["bad_releases"] = bad;
  j["options"] = {{"device_budget", opts_.device_budget},
                  {"lookahead_blobs", opts_.lookahead_blobs},
                  {"lookahead_bytes", opts_.lookahead_bytes},
                  {"min_blob_bytes", opts_.min_blob_bytes}};
  j["device_arena"] = arena_.stats_name();
  j["pinned_pool"] = pool_.stats_json();
  return j;
}

}  // namespace gact::swap
