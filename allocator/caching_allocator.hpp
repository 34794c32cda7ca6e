// gact/allocator/caching_allocator.hpp
//
// A stream-aware caching allocator over one device::backend. Requests are
// rounded up to 512 bytes and served best-fit from cached free blocks of the
// same stream, splitting large blocks and coalescing free neighbours; new
// segments come from the backend only on a miss. Small requests (<= small_size)
// are packed into small segments, larger ones into large segments, so that
// long-lived large blocks do not pin small ones (the design of PyTorch's
// CUDACachingAllocator; key names of its statistics are kept).
//
// Streams: a block freed on stream S is reused only by requests on S. A block
// used on another stream T (record_stream) is held back at free time until an
// event recorded on T has completed; events are polled on later allocations,
// never waited for on the fast path.
//
// Expandable segments (option expandable_segments, on a backend with virtual
// memory calls): each stream's blocks live in one range of address space whose
// pages are mapped as it grows, instead of in fixed segments. A request no free
// block serves maps the pages it needs at the range's free end (or in an
// unmapped hole), next to a free neighbour it then merges with, so no segment
// is ever too small and no segment size is wasted; blocks split wherever they
// are cut. Releasing the cache (empty_cache, the out-of-memory retry) unmaps
// every whole page inside a free block, so that after the retry a request fits
// whenever the free whole pages plus the device's free memory hold it. The
// design of PyTorch's expandable_segments:True: a range per stream and pool
// (small requests apart, so that they do not pin the large blocks' pages).
//
// Out of memory: on a backend failure (or the hard memory limit), cached free
// segments are released (after waiting for pending events) and the request
// retried once; then gact::out_of_memory is thrown.
//
// Bad input never corrupts state: size 0 returns nullptr; absurd sizes throw
// gact::invalid_argument; unknown pointers and double frees are counted and
// logged, and change nothing.
//
// Thread-safe: one mutex per allocator.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "allocator/device/backend.hpp"
#include "allocator/stats.hpp"
#include "allocator/tags.hpp"

namespace gact::alloc {

/// Settings of one allocator. Defaults match PyTorch's native allocator.
struct allocator_options {
  std::size_t small_size = std::size_t{1} << 20;            ///< requests <= this use the small pool
  std::size_t small_segment_size = std::size_t{2} << 20;    ///< segment size of the small pool
  std::size_t large_segment_size = std::size_t{20} << 20;   ///< segment for requests in (small_size, min_large_alloc)
  std::size_t min_large_alloc = std::size_t{10} << 20;      ///< requests >= this get their own segment
  std::size_t round_large = std::size_t{2} << 20;           ///< own segments are rounded up to this
  std::size_t memory_limit = 0;                             ///< hard cap on reserved bytes; 0 = none
  std::size_t max_request = std::size_t{1} << 46;           ///< larger requests are invalid (64 TiB)
  /// A free that leaves a whole segment of at least this size free returns it to the backend at once
  /// (as glibc unmaps a large chunk on free); 0 = cache every segment until empty_cache().
  std::size_t release_free_above = 0;
  /// A request that no free block serves (the arena must reserve more) first returns free blocks of at least this
  /// size, their whole pages, the largest first until they add up to what the request reserves: a large block cached
  /// from an earlier pattern (a blob, a decoded map) would otherwise stand in the process's peak beside the memory
  /// reserved for this request. Only on a miss, so a training step whose requests the cache serves pays nothing,
  /// and one that misses refaults at most what it reserves; 0 = off.
  std::size_t release_on_miss_above = 0;
  /// A failed segment request is retried once after releasing the cache, even when nothing can be released (a
  /// transient backend failure); false: not retried then, for a backend that retries on its own (another
  /// caching allocator).
  bool retry_when_empty = true;
  /// The backend's reserve() and release() run with the allocator's lock released (and releases after the call
  /// that freed the segment has unlocked): for a backend that calls into another allocator, which takes locks of
  /// its own and may run Python (torch's CUDA allocator: memory-history stacks, out-of-memory observers), so that
  /// no thread waits for gact's lock while the one holding it waits for theirs. Costs a relock per new segment.
  bool backend_unlocked = false;
  /// Expandable segments (see the top of this file): needs a backend with virtual memory calls (vm_page() > 0)
  /// and backend_unlocked off; requests up to small_size get a range of their own per stream (the small pool),
  /// and the segment sizes do not apply.
  bool expandable_segments = false;
  /// Address space of each expandable range (rounded up to the backend's page); 0 = the backend's total memory
  /// plus an eighth, at least the memory limit.
  std::size_t expandable_range = 0;
  std::string name = "host";                                ///< name in the stats ("cuda:0", "pinned", ...)
};

class caching_allocator {
 public:
  /// @param be the backend; must outlive the allocator.
  /// @throws gact::invalid_argument for inconsistent options (e.g. small_size > small_segment_size).
  explicit caching_allocator(device::backend& be, allocator_options opts = {});
  /// Releases every cached segment; blocks still allocated are reported as leaks in the log.
  ~caching_allocator();
  caching_allocator(caching_allocator const&) = delete;
  caching_allocator& operator=(caching_allocator const&) = delete;

  /// Allocate `bytes` on `stream`, tagged with the calling thread's current tag.
  /// @returns nullptr for bytes == 0 (counted), else a pointer aligned to 512 bytes.
  /// @throws gact::out_of_memory after release-and-retry failed or the memory limit would be exceeded.
  /// @throws gact::invalid_argument for bytes > max_request.
  void* allocate(std::size_t bytes, device::stream_t stream = 0);
  /// As allocate, with an explicit tag.
  void* allocate(std::size_t bytes, device::stream_t stream, tag_id tag);

  /// Free a pointer returned by allocate. nullptr is a no-op. Unknown pointers and double
  /// frees are counted (stats "errors") and logged; the allocator state is unchanged.
  void deallocate(void* p) noexcept;
  /// Free `p` when this allocator handed it out (one lookup, as deallocate); false, with nothing counted or
  /// logged, for a pointer it does not own (the C ABI's free path asks each device's allocator in turn).
  bool try_deallocate(void* p) noexcept;

  /// Mark `p` as used on `stream` (a stream other than its allocation stream): its memory is
  /// not reused until the work queued on `stream` at free time has completed.
  /// @throws gact::invalid_argument for an unknown pointer.
  void record_stream(void* p, device::stream_t stream);
  /// As record_stream; false for a pointer this allocator did not allocate (nothing recorded).
  bool try_record_stream(void* p, device::stream_t stream);

  /// Release every cached free segment to the backend (waits for pending events first).
  void empty_cache();

  /// While on, a request that no cached block can serve first returns every whole free
  /// segment to the backend, then reserves its own: what is reserved stays close to what is
  /// in use while the sizes requested keep changing (gact's policy turns it on for its
  /// estimates, on the host arena). Off by default: a repeating pattern of requests (a
  /// training step) never misses, and a segment kept warm spares the first touch of fresh
  /// pages. Returns the previous setting.
  bool set_release_on_miss(bool on) noexcept;

  /// fork() safety (pthread_atfork): lock the allocator before a fork and unlock it after, in the
  /// parent and in the child, so that a fork while another thread is inside the allocator cannot
  /// leave the child's copy locked forever. Call the three in that order around one fork.
  void fork_prepare() noexcept;
  void fork_parent() noexcept;
  void fork_child() noexcept;

  /// Tests: after `after` more non-empty allocate() calls, fail the next `count` with out_of_memory
  /// (the usual message and counters), whatever the cache holds; (0, 0) turns it off.
  void fail_allocations(int after, int count) noexcept;

  /// The rounded size of a live block (0 for an unknown pointer).
  std::size_t block_size(void const* p) const noexcept;
  /// True when `p` is the start of a live block of this allocator.
  bool owns(void const* p) const noexcept;
  /// True when `p` lies inside a segment this allocator has reserved and not released
  /// (a live block, a free or pending one, or inside one): memory only this allocator may
  /// give back to the backend.
  bool contains(void const* p) const noexcept;

  /// Counters in the key names of torch.cuda.memory_stats(), flattened
  /// ("allocated_bytes.all.current", "num_alloc_retries", ...), plus gact's sections
  /// "tags", "fragmentation", "errors", "options".
  nlohmann::json stats_json() const;
  /// A consistent copy of the counters (cheap: no JSON, one lock).
  allocator_stats stats() const;
  /// The name this allocator is registered under in the stats document ("allocators/<name>");
  /// options().name, or options().name + "#2", ... when another allocator already had it.
  std::string const& stats_name() const noexcept;

  /// Peaks := current values.
  void reset_peak_stats();
  /// allocated/freed counters and num_* := 0.
  void reset_accumulated_stats();

  /// Current bytes reserved from the backend.
  std::size_t reserved_bytes() const noexcept;
  /// Current bytes handed out (rounded sizes).
  std::size_t allocated_bytes() const noexcept;

  device::backend& backend() const noexcept;
  /// The options; memory_limit may change later (set_memory_limit), so read it while no
  /// other thread may call that.
  allocator_options const& options() const noexcept;

  /// Change the hard cap on reserved bytes (0 = none) for later reservations. When more is
  /// reserved than the new cap, the cached free segments are released first; blocks in use
  /// are never taken back (later allocations fail until enough is freed).
  void set_memory_limit(std::size_t bytes);

 private:
  /// deallocate's body: false when `p` is not live here (counted as a bad free when `count_bad`).
  bool free_if_owned(void* p, bool count_bad) noexcept;

  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace gact::alloc
