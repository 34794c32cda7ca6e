// gact/swap/mover.hpp
//
// The swap mover: takes ownership of compressed activation blobs that live in a
// device arena, copies them out to a pinned host pool during forward when the
// device-resident bytes exceed a budget, and brings them back before backward
// needs them, all stream-ordered and without host synchronization.
//
// Pipeline of one blob (ids grow in the order of saving):
//
//   put(p, n, s)        ready := event on s (the encode that wrote p is queued there)
//   offload             D2H stream waits on ready; copy p -> pinned h; out := event on D2H
//   out complete        device bytes p freed (or kept, if the blob was wanted meanwhile)
//   prefetch / fetch    q := arena block on the H2D stream; copy h -> q; in := event on H2D
//   acquire(id, c)      consumer stream c waits on in; record_stream(q, c)
//   in complete         pinned bytes h freed (reusable by the next D2H)
//   release(id)         q back to the arena (its record_stream keeps it until c has used it)
//
// No device or pinned byte is ever freed before the copy that reads or writes it
// has been seen complete (event query, never a blocking wait on the fast path).
// Completed copies are retired lazily by poll(), which every call runs first.
//
// Offload order is oldest first (needed last in backward); prefetch walks the
// blobs below the one just acquired, newest first (reverse order of saving), up
// to a window of `lookahead_blobs` blobs and/or `lookahead_bytes` bytes. A blob
// whose offload is still in flight when it enters the window keeps its device
// bytes (the copy's pinned bytes are dropped instead).
//
// Faults: a pinned allocation failure leaves the blob on the device (counted);
// a device out-of-memory on a speculative prefetch leaves the blob in pinned
// memory for a later demand fetch (counted); on a demand fetch the mover waits
// for its own offloads in flight, empties the arena's cache and retries, then
// throws gact::out_of_memory. The blob is never lost: it stays in pinned memory
// and a later acquire may succeed.
//
// On a host arena (memory_kind host, e.g. CPU training), the consumer is the host:
// acquire() blocks until the blob is back (measured as stall time).
//
// Thread-safe: one mutex; the arena and pool are called with it held (lock order
// mover -> allocator; neither calls back into the mover).
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/backend.hpp"
#include "allocator/store/offloader.hpp"
#include "swap/pinned_pool.hpp"

namespace gact::swap {

/// Id of a blob owned by a mover; ids grow in the order of put(); 0 is never valid.
using blob_id = std::uint64_t;

/// Settings of a mover.
struct mover_options {
  /// Device-resident bytes of blobs not yet offloaded kept before offloading (oldest first);
  /// 0 = offload every blob (GACT_SWAP_BUDGET).
  std::size_t device_budget = 0;
  /// Prefetch window in blobs below the one being consumed (GACT_PREFETCH); 0 = no blob cap.
  std::size_t lookahead_blobs = 2;
  /// Prefetch window in bytes; 0 = no byte cap. Both 0 = no prefetch (every blob fetched on demand).
  std::size_t lookahead_bytes = 0;
  /// Blobs smaller than this are never offloaded (a copy costs more than it saves).
  std::size_t min_blob_bytes = 0;
  /// Stats section name ("swap", or "swap#2", ... when taken); empty = not registered.
  std::string stats_name = "swap";
  /// Test and debug hook, called with the mover's lock held just before device bytes
  /// (pinned = false) or pinned bytes (pinned = true) are handed back to their allocator.
  std::function<void(void const* p, std::size_t bytes, bool pinned)> before_free;
};

/// Counters of a mover (see stats_json for the JSON names).
struct mover_stats {
  std::uint64_t puts = 0;                  ///< blobs taken over
  std::uint64_t offloads = 0;              ///< D2H copies started
  std::uint64_t bytes_out = 0;             ///< bytes copied D2H
  std::uint64_t fetches = 0;               ///< H2D copies started (prefetch + demand)
  std::uint64_t bytes_in = 0;              ///< bytes copied H2D
  std::uint64_t prefetch_hits = 0;         ///< acquires of an offloaded blob whose prefetch had been issued
  std::uint64_t prefetch_late = 0;         ///< ... of which the copy was still in flight (consumer waits)
  std::uint64_t prefetch_misses = 0;       ///< acquires that had to fetch on demand
  std::uint64_t resident_gets = 0;         ///< acquires of a blob whose device bytes were never freed
  std::uint64_t offloads_kept = 0;         ///< offloads whose device bytes were kept (wanted before done)
  std::uint64_t pinned_alloc_failures = 0; ///< offloads refused by the pinned pool (blob stayed on device)
  std::uint64_t prefetch_oom_skipped = 0;  ///< speculative prefetches skipped for device OOM
  std::uint64_t fetch_oom_retries = 0;     ///< demand fetches retried after releasing cached blocks
  std::uint64_t fetch_oom_failures = 0;    ///< demand fetches that failed after the retry
  std::uint64_t stall_ns = 0;              ///< host time blocked waiting for copies
  std::uint64_t host_syncs = 0;            ///< host waits on a copy event
  std::size_t device_bytes = 0;            ///< blob bytes holding device memory now
  std::size_t device_bytes_peak = 0;
  std::size_t pending_bytes = 0;           ///< device bytes of blobs eligible for offload (<= budget after put)
  std::size_t host_bytes = 0;              ///< blob bytes holding pinned memory now
  std::size_t host_bytes_peak = 0;
  std::size_t live_blobs = 0;              ///< blobs not yet released
  std::size_t copies_in_flight = 0;        ///< D2H + H2D copies not yet retired
};

/// Moves blobs between a device arena and a pinned pool on two copy streams.
class mover final : public store::offloader {
 public:
  /// @param device_arena where blobs live (and where prefetched copies are allocated); its
  ///        backend supplies the streams, events and copies. Must outlive the mover.
  /// @param pool the pinned pool, whose backend shares stream handles with the arena's. Must outlive the mover.
  /// @throws gact::invalid_argument when the pool's allocator is the arena itself.
  /// @throws gact::cuda_error when the copy streams cannot be created.
  mover(alloc::caching_allocator& device_arena, pinned_pool& pool, mover_options opts = {});
  /// Waits for every copy in flight, then frees what is still held (live blobs are logged as leaks).
  ~mover();
  mover(mover const&) = delete;
  mover& operator=(mover const&) = delete;

  /// Take ownership of `bytes` (> 0) of blob at `blob`, a block of the device arena, written by work
  /// queued on `stream`. Offloads the oldest eligible blobs while the budget is exceeded.
  /// @throws gact::invalid_argument for a null blob, zero bytes or a pointer the arena does not own.
  blob_id put(void* blob, std::size_t bytes, device::stream_t stream) override;

  /// The device address of blob `id`, ready for work queued on `stream` from now on (the stream waits
  /// for the copy in flight, if any; on a host arena the host waits). Brings the blob back if needed
  /// and starts prefetching the blobs saved before it. The blob stays on the device until release.
  /// @throws gact::invalid_argument for an unknown or released id.
  /// @throws gact::out_of_memory when the device has no room for it even after releasing cached
  ///         blocks (the blob stays in pinned memory; the call may be retried).
  void* acquire(blob_id id, device::stream_t stream) override;

  /// Drop blob `id`; its memory is freed once no copy touches it. Unknown ids are counted and ignored.
  void release(blob_id id) noexcept override;

  /// Start prefetching the most recently saved blobs (call when backward begins).
  void begin_backward();

  /// Retire the copies that have completed (frees what they made free). Never blocks.
  void poll();
  /// Block until every copy in flight has completed, and retire them.
  void synchronize();

  /// A consistent copy of the counters.
  mover_stats stats() const;
  /// The "swap" section: the counters, the options and the pinned pool's figures.
  nlohmann::json stats_json() const;

  mover_options const& options() const noexcept { return opts_; }
  /// The device arena the blobs live in.
  alloc::caching_allocator& arena() const noexcept override { return arena_; }
  device::stream_t d2h_stream() const noexcept { return d2h_; }
  device::stream_t h2d_stream() const noexcept { return h2d_; }

 private:
  enum class where : std::uint8_t { device, offloading, host, fetching };
  struct blob;

  bool eligible(blob const& b) const noexcept;  // may be offloaded now
  void poll_locked();
  void retire(blob_id id, blob& b);
  void enforce_budget_locked();
  void start_offload(blob& b);
  bool start_fetch(blob_id id, blob& b, bool demand);
  void prefetch_below_locked(blob_id upper);
  void free_device(blob& b) noexcept;
  void free_host(blob& b) noexcept;
  void wait_host(device::event_t e);
  device::event_t take_event();
  void give_event(device::event_t& e) noexcept;

  alloc::caching_allocator& arena_;
  pinned_pool& pool_;
  device::backend& be_;
  mover_options opts_;
  bool host_consumer_ = false;
  device::stream_t d2h_ = 0;
  device::stream_t h2d_ = 0;
  std::uint64_t stats_token_ = 0;

  mutable std::mutex mu_;
  std::map<blob_id, std::unique_ptr<blob>> blobs_;  // ordered by id = order of saving
  std::vector<device::event_t> free_events_;
  std::vector<device::event_t> all_events_;
  blob_id next_id_ = 1;
  std::vector<blob_id> inflight_;  // blobs with a copy in flight (state offloading or fetching)
  std::uint64_t bad_releases_ = 0;
  mover_stats s_;
};

}  // namespace gact::swap
