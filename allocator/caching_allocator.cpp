// gact/allocator/caching_allocator.cpp — the caching allocator (see caching_allocator.hpp).
//
// Data structures (all guarded by impl::mu):
//   block        one contiguous piece of a segment; the blocks of a segment form a
//                doubly linked list in address order (prev/next); blocks of different
//                segments never merge.
//   free sets    one std::set per pool (small, large) of free blocks ordered by
//                (stream, size, address): lower_bound({stream, size}) is a per-stream
//                best fit. Nodes come from a node_pool, records from an object_pool,
//                so the cached path allocates nothing.
//   live         flat map address -> block of every block handed out and not freed.
//   segments     ordered map base address -> size of every segment reserved and not
//                released (for contains(): is an address inside this allocator's memory?).
//   pending      (event, block) pairs of blocks freed while used on other streams.
//
//   ranges       expandable segments: vm_ranges per stream and pool (one, and more where
//                live blocks cut its address space up), each with blocks covering the whole
//                address range in order; `holes` maps the address of each unmapped block (a
//                maximal run of unmapped pages, page-aligned at both ends) to it.
//
// Invariants:
//   sum of block sizes in a segment == segment size; neighbours of a free block are
//   never free (coalescing is eager); a block is in exactly one of: a free set
//   (state free), live (state allocated), or referenced by event_count > 0 entries of
//   pending (state pending).
//   stats: allocation == |live|; active == |live| + |pending blocks|;
//   reserved_bytes == sum of segment sizes; inactive_split == free blocks with a neighbour.
//
// Fast path (a cached hit): one lower_bound, one erase, at most one insert (the split
// remainder), one flat-map insert; free: one flat-map erase, at most two erases (merged
// neighbours) and one insert. No backend call unless events are pending.
#include "allocator/caching_allocator.hpp"

#include <algorithm>
#include <array>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "allocator/block_pool.hpp"
#include "allocator/error.hpp"
#include "allocator/event_trace.hpp"
#include "allocator/log.hpp"
#include "allocator/stats_registry.hpp"

namespace gact::alloc {
namespace {

constexpr std::size_t k_min_block = 512;

std::size_t round_size(std::size_t n) noexcept {
  return n < k_min_block ? k_min_block : (n + k_min_block - 1) / k_min_block * k_min_block;
}

std::size_t round_up(std::size_t n, std::size_t to) noexcept { return (n + to - 1) / to * to; }

std::string human_bytes(std::size_t n) {
  char buf[64];
  static constexpr char const* k_units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  std::snprintf(buf, sizeof buf, "%zu bytes (%.2f %s)", n, v, k_units[u]);
  return buf;
}

enum class block_state : std::uint8_t { free, allocated, pending, unmapped };

struct block;
struct vm_range;

/// Lookup key of a best-fit search: the smallest free block of `stream` with size >= `size`.
struct fit_key {
  device::stream_t stream;
  std::size_t size;
};

/// Orders free blocks by (stream, size, address); transparent so that lower_bound takes a fit_key.
struct block_less {
  using is_transparent = void;
  bool operator()(block const* a, block const* b) const noexcept;
  bool operator()(block const* a, fit_key const& k) const noexcept;
  bool operator()(fit_key const& k, block const* b) const noexcept;
};

using free_set = std::set<block*, block_less, detail::pool_allocator<block*>>;

struct block {
  std::uintptr_t ptr = 0;
  std::size_t size = 0;        // rounded; a multiple of 512
  std::size_t requested = 0;   // the caller's size while allocated
  device::stream_t stream = 0; // the stream of the segment
  block* prev = nullptr;       // address-order neighbours in the same segment
  block* next = nullptr;
  free_set::iterator where{};  // position in its pool's free set while state == free
  std::vector<device::stream_t> stream_uses;  // other streams (record_stream); empty on the fast path
  int event_count = 0;         // pending events while state == pending
  vm_range* range = nullptr;   // the expandable range it lies in, or nullptr in a segment
  tag_id tag = tag_other;
  bool small = false;          // pool
  bool counted_split = false;  // counted in inactive_split while in a free set
  block_state state = block_state::free;

  bool whole_segment() const noexcept { return range == nullptr && prev == nullptr && next == nullptr; }
};

/// One expandable segment: address space [base, base + size) of one stream and pool. Invariant: its blocks cover it in
/// address order; mapped == size minus the sizes of the blocks in holes (all of state unmapped).
struct vm_range {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  device::stream_t stream = 0;
  bool small = false;  // the pool it serves
  std::size_t mapped = 0;
  std::map<std::uintptr_t, block*> holes;
};

inline bool block_less::operator()(block const* a, block const* b) const noexcept {
  if (a->stream != b->stream) return a->stream < b->stream;
  if (a->size != b->size) return a->size < b->size;
  return a->ptr < b->ptr;
}
inline bool block_less::operator()(block const* a, fit_key const& k) const noexcept {
  return a->stream != k.stream ? a->stream < k.stream : a->size < k.size;
}
inline bool block_less::operator()(fit_key const& k, block const* b) const noexcept {
  return k.stream != b->stream ? k.stream < b->stream : k.size < b->size;
}

struct pending_event {
  device::event_t event;
  block* blk;
};

/// Per-tag counters. Invariant: current_* == sums over live blocks with this tag.
struct tag_stat {
  std::int64_t current_bytes = 0;
  std::int64_t peak_bytes = 0;
  std::int64_t current_count = 0;
  std::int64_t peak_count = 0;
  std::int64_t total_allocs = 0;
};

}  // namespace

struct caching_allocator::impl {
  device::backend& be;
  allocator_options opts;  ///< fixed after construction, except memory_limit (set_memory_limit, under mu)
  bool release_on_miss = false;  ///< set_release_on_miss (under mu)
  mutable std::mutex mu;
  int fault_after = 0, fault_count = 0;  ///< fail_allocations (tests), under mu

  detail::node_pool nodes;  // before the sets that use it
  detail::object_pool<block> records;
  free_set small_free{block_less{}, detail::pool_allocator<block*>(nodes)};
  free_set large_free{block_less{}, detail::pool_allocator<block*>(nodes)};
  detail::ptr_map<block*> live;
  // fixed segments and expandable ranges (their address space): base -> size
  std::map<std::uintptr_t, std::size_t> segments;
  std::vector<pending_event> pending;
  std::vector<device::event_t> spare_events;
  std::vector<std::unique_ptr<vm_range>> ranges;  // expandable segments, one per stream and pool
  std::size_t page = 0;                           // the backend's vm_page() when expandable

  // backend_unlocked: segments given up under the lock, released to the backend once it is dropped (release_later
  // and the public calls' unlock_and_release), and the bytes being reserved outside it (counted against the limit)
  std::vector<std::pair<void*, std::size_t>> to_release;
  std::size_t reserving = 0;

  allocator_stats st;
  std::array<tag_stat, k_max_tags> tags{};
  std::string last_backend_error;

  std::uint64_t stats_token = 0;
  std::string stats_name;
  std::uint16_t trace_source = 0;  // event_trace::register_source id

  /// Record an event in the trace; call only when event_trace::enabled().
  void trace(event_trace::event_kind k, std::uintptr_t addr, std::size_t size, device::stream_t s, tag_id tag,
             std::uint64_t aux = 0) const noexcept {
    event_trace::record(k, trace_source, addr, size, static_cast<std::uint64_t>(s), tag, 0, 0, aux);
  }

  impl(device::backend& b, allocator_options o) : be(b), opts(std::move(o)) {
    if (opts.expandable_segments) page = be.vm_page();
  }

  free_set& pool_of(bool small) noexcept { return small ? small_free : large_free; }

  std::size_t segment_size(std::size_t size) const noexcept {
    if (size <= opts.small_size) return opts.small_segment_size;
    if (size < opts.min_large_alloc) return opts.large_segment_size;
    return round_up(size, opts.round_large);
  }

  bool should_split(bool small, std::size_t remaining) const noexcept {
    if (opts.expandable_segments) return remaining >= k_min_block;  // (a remainder is never a segment's tail)
    return small ? remaining >= k_min_block : remaining > opts.small_size;
  }

  // ---- free sets -----------------------------------------------------------
  void insert_free(block* b) {
    b->state = block_state::free;
    b->where = pool_of(b->small).insert(b).first;
    if (!b->whole_segment()) {
      b->counted_split = true;
      stat_add(st.inactive_split, b->small, 1);
      stat_add(st.inactive_split_bytes, b->small, static_cast<std::int64_t>(b->size));
    }
  }

  void erase_free(block* b) noexcept {
    pool_of(b->small).erase(b->where);  // by position: no search
    if (b->counted_split) {
      b->counted_split = false;
      stat_sub(st.inactive_split, b->small, 1);
      stat_sub(st.inactive_split_bytes, b->small, static_cast<std::int64_t>(b->size));
    }
  }

  block* find_free(bool small, std::size_t size, device::stream_t stream) {
    free_set& pool = pool_of(small);
    auto it = pool.lower_bound(fit_key{stream, size});
    if (it == pool.end() || (*it)->stream != stream) return nullptr;
    return *it;
  }

  // ---- segments --------------------------------------------------------------
  /// A new whole-segment free block (not in a free set), or nullptr when the limit or the
  /// backend refuses. Other backend errors propagate.
  /// With backend_unlocked, `lock` (holding mu) is dropped around the backend's reserve: the segments waiting in
  /// to_release go back to the backend first, then the new one is asked for.
  block* try_new_segment(std::size_t seg_size, bool small, device::stream_t stream, std::unique_lock<std::mutex>& lock) {
    std::size_t const reserved = static_cast<std::size_t>(st.reserved_bytes[pool_all].current) + reserving;
    if (opts.memory_limit != 0 && (seg_size > opts.memory_limit || reserved > opts.memory_limit - seg_size)) {
      last_backend_error = "memory limit";
      return nullptr;
    }
    block* b = records.make();
    void* p = nullptr;
    bool const unlocked = opts.backend_unlocked;
    std::vector<std::pair<void*, std::size_t>> gone;
    if (unlocked) {
      gone.swap(to_release);
      reserving += seg_size;
      lock.unlock();
    }
    auto const relock = [&] {
      if (!unlocked) return;
      lock.lock();
      reserving -= seg_size;
    };
    try {
      for (auto const& [q, n] : gone) be.release(q, n);
      p = be.reserve(seg_size);
    } catch (out_of_memory const& e) {
      relock();
      records.destroy(b);
      last_backend_error = e.what();
      return nullptr;
    } catch (...) {
      relock();
      records.destroy(b);
      throw;
    }
    relock();
    b->ptr = reinterpret_cast<std::uintptr_t>(p);
    try {
      segments.emplace(b->ptr, seg_size);
    } catch (...) {
      release_later(p, seg_size);
      records.destroy(b);
      throw;
    }
    b->size = seg_size;
    b->stream = stream;
    b->small = small;
    stat_add(st.segment, small, 1);
    stat_add(st.reserved_bytes, small, static_cast<std::int64_t>(seg_size));
    ++st.num_device_alloc;
    if (event_trace::enabled()) [[unlikely]] trace(event_trace::event_kind::segment_alloc, b->ptr, seg_size, stream, tag_other);
    GACT_LOG_DEBUG("[segment+][{}][stream {:#x}][{}B][{}]", stats_name, stream, seg_size, p);
    return b;
  }

  /// Give `p` back to the backend: now, or with backend_unlocked once the lock is dropped.
  void release_later(void* p, std::size_t bytes) noexcept {
    if (opts.backend_unlocked) {
      try {
        to_release.emplace_back(p, bytes);
        return;
      } catch (...) {  // (no memory for the list: released under the lock, as without the option)
      }
    }
    be.release(p, bytes);
  }

  /// Drop `lock` and release the segments given up while it was held (backend_unlocked).
  void unlock_and_release(std::unique_lock<std::mutex>& lock) noexcept {
    if (to_release.empty()) return;
    std::vector<std::pair<void*, std::size_t>> gone;
    gone.swap(to_release);
    lock.unlock();
    for (auto const& [p, n] : gone) be.release(p, n);
  }

  /// Drops the lock and releases what was queued when the public call that holds it returns or throws.
  struct drain_at_exit {
    impl& m;
    std::unique_lock<std::mutex>& lock;
    drain_at_exit(impl& i, std::unique_lock<std::mutex>& l) noexcept : m(i), lock(l) {}
    drain_at_exit(drain_at_exit const&) = delete;
    drain_at_exit& operator=(drain_at_exit const&) = delete;
    ~drain_at_exit() {
      if (lock.owns_lock()) m.unlock_and_release(lock);
    }
  };

  void release_segment(block* b) noexcept {
    segments.erase(b->ptr);
    release_later(reinterpret_cast<void*>(b->ptr), b->size);
    stat_sub(st.segment, b->small, 1);
    stat_sub(st.reserved_bytes, b->small, static_cast<std::int64_t>(b->size));
    ++st.num_device_free;
    if (event_trace::enabled()) [[unlikely]] trace(event_trace::event_kind::segment_free, b->ptr, b->size, b->stream, tag_other);
    GACT_LOG_DEBUG("[segment-][{}][stream {:#x}][{}B][{:#x}]", stats_name, b->stream, b->size, b->ptr);
    records.destroy(b);
  }

  /// Wait for every pending event, free the blocks, release every whole free segment.
  void release_cached() {
    synchronize_pending();
    ++st.num_sync_all_streams;
    release_whole_free();
  }

  /// Release every whole free segment, and unmap every whole page inside a free block of an expandable range
  /// (blocks waiting for events stay).
  void release_whole_free() {
    if (!ranges.empty()) {
      std::vector<block*> in_ranges;
      for (free_set const* pool : {&small_free, &large_free}) {
        for (block* b : *pool) {
          if (b->range != nullptr) in_ranges.push_back(b);
        }
      }
      for (block* b : in_ranges) try_unmap_free_pages(b);
      for (std::size_t i = 0; i < ranges.size();) {
        if (!release_range_if_empty(*ranges[i])) ++i;
      }
    }
    for (free_set* pool : {&small_free, &large_free}) {
      for (auto it = pool->begin(); it != pool->end();) {
        block* b = *it;
        if (b->whole_segment()) {
          it = pool->erase(it);
          release_segment(b);
        } else {
          ++it;
        }
      }
    }
  }

  /// Return the whole pages of the free blocks of at least opts.release_on_miss_above (a request missed the cache):
  /// the free runs of the expandable ranges, the wholly free fixed segments, the largest first, until they add up to
  /// `need` (the memory the request will reserve): a step whose requests miss now and then (shapes that change)
  /// refaults about what it reserves anew, not the whole cache each time. A fixed segment larger than what is left of
  /// `need` stays. The callers skip it for a request that reserves less than the option's size anew (its segment, or
  /// grow_bytes()): a small tensor's miss gave up a cached 200 MiB run, which the next large temporary mapped again,
  /// at every step of a loop that kept a small tensor a step.
  void release_large_free(std::size_t need) {
    std::size_t const above = opts.release_on_miss_above;
    std::vector<block*> big;
    for (block* b : large_free) {
      if (b->size >= above && (b->range != nullptr || b->whole_segment())) big.push_back(b);
    }
    std::sort(big.begin(), big.end(), [](block const* a, block const* b) { return a->size > b->size; });
    auto const reserved = [this] { return static_cast<std::size_t>(st.reserved_bytes[pool_all].current); };
    std::size_t const before = reserved();
    for (block* b : big) {
      // (what went back so far: nothing in the loop reserves, so the reserved bytes only fall)
      std::size_t const released = before - reserved();
      if (released >= need) break;
      if (b->range != nullptr) {
        try_unmap_free_pages(b);
      } else if (b->size <= need - released) {
        erase_free(b);
        release_segment(b);
      }
    }
  }

  /// The hole of the ranges of `stream` and pool whose mapping serves `size` with the fewest new bytes (find_hole):
  /// into best, best_bytes and r; best stays null where none serves it.
  void best_hole(std::size_t size, device::stream_t stream, bool small, block*& best, std::size_t& best_bytes,
                 vm_range*& r) {
    for (auto const& rp : ranges) {
      if (rp->stream == stream && rp->small == small) find_hole(*rp, size, best, best_bytes, r);
    }
  }

  /// The bytes grow() would map for a request of `size`: those of the hole it fills beside a free run, or of a new
  /// range.
  std::size_t grow_bytes(std::size_t size, device::stream_t stream, bool small) {
    vm_range* r = nullptr;
    block* best = nullptr;
    std::size_t best_bytes = 0;
    best_hole(size, stream, small, best, best_bytes, r);
    return best != nullptr ? best_bytes : round_up(size, page);
  }

  // ---- block life cycle --------------------------------------------------------
  /// Turn an allocated or pending block into a free one, coalescing with free neighbours.
  void free_block(block* b) {
    stat_sub(st.active, b->small, 1);
    stat_sub(st.active_bytes, b->small, static_cast<std::int64_t>(b->size));
    settle_free(b);
  }

  /// Put `b` (no longer allocated, pending or unmapped) into its free set, merged with its free neighbours;
  /// `release`: apply release_free_above (not to pages just mapped for a request).
  void settle_free(block* b, bool release = true) {
    if (block* p = b->prev; p != nullptr && p->state == block_state::free) {
      erase_free(p);
      b->ptr = p->ptr;
      b->size += p->size;
      b->prev = p->prev;
      if (b->prev != nullptr) b->prev->next = b;
      records.destroy(p);
    }
    if (block* n = b->next; n != nullptr && n->state == block_state::free) {
      erase_free(n);
      b->size += n->size;
      b->next = n->next;
      if (b->next != nullptr) b->next->prev = b;
      records.destroy(n);
    }
    if (opts.release_free_above != 0 && b->whole_segment() && b->size >= opts.release_free_above) {
      release_segment(b);  // a large segment wholly free: back to the backend now
      return;
    }
    insert_free(b);
    if (release && b->range != nullptr && opts.release_free_above != 0 &&
        round_down(b->ptr + b->size, page) >= round_up(b->ptr, page) + opts.release_free_above) {
      try_unmap_free_pages(b);  // as a whole free segment of that size would be released
    }
  }

  // ---- expandable segments ---------------------------------------------------------
  std::size_t round_down(std::size_t n, std::size_t to) const noexcept { return n / to * to; }

  /// Address space of a new range: the option, or the backend's total memory plus an eighth, bounded by the
  /// backend's hint (a limit on the process's address space).
  std::size_t range_bytes() {
    std::size_t n = opts.expandable_range;
    if (n == 0) {
      std::size_t const total = be.memory_info().total_bytes;
      n = total == 0 ? std::size_t{64} << 30 : total + total / 8;
      n = std::max(n, opts.memory_limit);
      if (std::size_t const hint = be.vm_reserve_hint(); hint != 0) n = std::min(n, hint);
    }
    return round_up(std::max(n, page), page);
  }

  /// Insert `b` after `a` in address order.
  static void link_after(block* a, block* b) noexcept {
    b->prev = a;
    b->next = a->next;
    if (b->next != nullptr) b->next->prev = b;
    a->next = b;
  }

  static void unlink(block* b) noexcept {
    if (b->prev != nullptr) b->prev->next = b->next;
    if (b->next != nullptr) b->next->prev = b->prev;
  }

  /// A new range of `stream` and pool `small` that can hold `need` bytes: range_bytes() of address space, or less
  /// where the backend refuses that much (a limit on the process's address space: halved down to `need`); nullptr
  /// when not even that is given.
  vm_range* new_range(device::stream_t stream, bool small, std::size_t need) {
    need = round_up(std::max(need, page), page);
    std::size_t bytes = std::max(range_bytes(), need);
    auto r = std::make_unique<vm_range>();
    block* hole = records.make();
    void* p = nullptr;
    for (;;) {
      try {
        p = be.vm_reserve(bytes);
        break;
      } catch (out_of_memory const& e) {
        if (bytes > need) {
          bytes = std::max(need, round_up(bytes / 2, page));
          continue;
        }
        records.destroy(hole);
        last_backend_error = e.what();
        return nullptr;
      } catch (...) {
        records.destroy(hole);
        throw;
      }
    }
    r->base = reinterpret_cast<std::uintptr_t>(p);
    r->size = bytes;
    r->stream = stream;
    r->small = small;
    hole->ptr = r->base;
    hole->size = bytes;
    hole->stream = stream;
    hole->small = small;
    hole->range = r.get();
    hole->state = block_state::unmapped;
    try {
      r->holes.emplace(r->base, hole);
      segments.emplace(r->base, bytes);
      ranges.push_back(std::move(r));
    } catch (...) {
      segments.erase(reinterpret_cast<std::uintptr_t>(p));
      records.destroy(hole);
      be.vm_free(p, bytes);
      throw;
    }
    stat_add(st.segment, small, 1);
    GACT_LOG_DEBUG("[range+][{}][stream {:#x}][{}B][{}]", stats_name, stream, bytes, p);
    return ranges.back().get();
  }

  /// Give back a range whose pages are all unmapped (one hole covering it): true when it was released.
  bool release_range_if_empty(vm_range& r) noexcept {
    if (r.mapped != 0 || r.holes.size() != 1 || r.holes.begin()->second->size != r.size) return false;
    records.destroy(r.holes.begin()->second);
    segments.erase(r.base);
    be.vm_free(reinterpret_cast<void*>(r.base), r.size);
    stat_sub(st.segment, r.small, 1);
    GACT_LOG_DEBUG("[range-][{}][stream {:#x}][{}B][{:#x}]", stats_name, r.stream, r.size, r.base);
    auto it = std::find_if(ranges.begin(), ranges.end(), [&r](auto const& q) { return q.get() == &r; });
    ranges.erase(it);
    return true;
  }

  /// Map pages of `stream`'s range so that a free block of at least `size` bytes exists there (in its free
  /// set): the hole whose mapping needs the fewest new pages (a hole after a free block extends that block);
  /// false when no hole is large enough or the limit or the backend refuses the memory. Strong guarantee: what
  /// can throw (records, set nodes, the backend) runs before anything changes.
  bool grow(std::size_t size, device::stream_t stream, bool small) {
    vm_range* r = nullptr;
    block* best = nullptr;
    std::size_t best_bytes = 0;
    best_hole(size, stream, small, best, best_bytes, r);
    bool fresh = false;
    if (best == nullptr) {
      // no range of this stream and pool has a hole the request fits in (none yet, or their address space is cut
      // up by live blocks): another range, as torch adds another expandable segment
      r = new_range(stream, small, size);
      if (r == nullptr) return false;
      fresh = true;
      find_hole(*r, size, best, best_bytes, r);
    }
    GACT_ASSERT_INTERNAL(best != nullptr);
    if (map_hole(r, best, best_bytes, stream, small)) return true;
    if (fresh) release_range_if_empty(*r);  // (no memory for it: its address space goes back at once)
    return false;
  }

  /// The hole of `r` whose mapping serves `size` with the fewest new bytes, if it needs fewer than `best_bytes`
  /// (or `best` is null): into best, best_bytes and best_range.
  void find_hole(vm_range& r, std::size_t size, block*& best, std::size_t& best_bytes, vm_range*& best_range) {
    for (auto const& [a, u] : r.holes) {
      std::size_t const before = u->prev != nullptr && u->prev->state == block_state::free ? u->prev->size : 0;
      std::size_t const after = u->next != nullptr && u->next->state == block_state::free ? u->next->size : 0;
      std::size_t bytes = 0;
      if (before >= size) {
        continue;  // (that free block would have served the request)
      } else if (before + u->size >= size) {
        bytes = std::min(u->size, round_up(size - before, page));
      } else if (before + u->size + after >= size) {
        bytes = u->size;
      } else {
        continue;
      }
      if (best == nullptr || bytes < best_bytes) {
        best = u;
        best_bytes = bytes;
        best_range = &r;
      }
    }
  }

  /// Map the first `best_bytes` of hole `best` in `r` (see grow).
  bool map_hole(vm_range* r, block* best, std::size_t best_bytes, device::stream_t stream, bool small) {
    std::size_t const reserved = static_cast<std::size_t>(st.reserved_bytes[pool_all].current);
    if (opts.memory_limit != 0 && (best_bytes > opts.memory_limit || reserved > opts.memory_limit - best_bytes)) {
      last_backend_error = "memory limit";
      return false;
    }
    nodes.reserve(1);  // (settle_free's insert)
    block* m = best_bytes == best->size ? nullptr : records.make();
    try {
      be.vm_map(reinterpret_cast<void*>(best->ptr), best_bytes);
    } catch (out_of_memory const& e) {
      if (m != nullptr) records.destroy(m);
      last_backend_error = e.what();
      return false;
    } catch (...) {
      if (m != nullptr) records.destroy(m);
      throw;
    }
    r->mapped += best_bytes;
    stat_add(st.reserved_bytes, small, static_cast<std::int64_t>(best_bytes));
    ++st.num_device_alloc;
    if (event_trace::enabled()) [[unlikely]] trace(event_trace::event_kind::segment_alloc, best->ptr, best_bytes, stream, tag_other);
    GACT_LOG_DEBUG("[map+][{}][stream {:#x}][{}B][{:#x}]", stats_name, stream, best_bytes, best->ptr);
    if (m == nullptr) {
      r->holes.erase(best->ptr);
      m = best;  // the whole hole is mapped now
    } else {
      // the mapped front becomes its own block; the rest stays a hole (its map node moved to its new address)
      auto node = r->holes.extract(best->ptr);
      m->ptr = best->ptr;
      m->size = best_bytes;
      m->stream = stream;
      m->range = r;
      m->prev = best->prev;
      m->next = best;
      if (m->prev != nullptr) m->prev->next = m;
      best->prev = m;
      best->ptr += best_bytes;
      best->size -= best_bytes;
      node.key() = best->ptr;
      r->holes.insert(std::move(node));
    }
    m->small = small;
    settle_free(m, false);
    return true;
  }

  /// unmap_free_pages, best effort: with no memory for its records the block stays mapped (and free), said once.
  void try_unmap_free_pages(block* f) noexcept {
    try {
      unmap_free_pages(f);
    } catch (std::exception const& e) {
      GACT_WARN_CAPPED(4, "allocator '{}': free pages at {:#x} kept mapped: {}", stats_name, f->ptr, e.what());
    }
  }

  /// Unmap the whole pages inside the free block `f` of a range (in its free set), leaving the partial pages at
  /// its ends (shared with its neighbours) mapped as free blocks. Strong guarantee: the records and nodes it may
  /// need are taken first; where the backend keeps the pages mapped (it could not wait for the device), nothing
  /// changes.
  void unmap_free_pages(block* f) {
    vm_range* r = f->range;
    std::uintptr_t const a = round_up(f->ptr, page);
    std::uintptr_t const e = round_down(f->ptr + f->size, page);
    if (e <= a) return;
    std::uintptr_t const end = f->ptr + f->size;
    bool const has_head = a > f->ptr;
    bool const has_tail = end > e;
    block* hole = has_head ? records.make() : f;
    block* tail = nullptr;
    bool placed = false;  // a holes entry made for the new hole
    try {
      if (has_tail) tail = records.make();
      nodes.reserve(2);  // (the head's and the tail's inserts)
      placed = r->holes.try_emplace(a, nullptr).second;
    } catch (...) {
      if (has_head) records.destroy(hole);
      if (tail != nullptr) records.destroy(tail);
      throw;
    }
    if (!be.vm_unmap(reinterpret_cast<void*>(a), e - a)) {  // (logged by the backend)
      if (placed) r->holes.erase(a);
      if (has_head) records.destroy(hole);
      if (tail != nullptr) records.destroy(tail);
      return;
    }
    erase_free(f);
    r->mapped -= e - a;
    stat_sub(st.reserved_bytes, r->small, static_cast<std::int64_t>(e - a));
    ++st.num_device_free;
    if (event_trace::enabled()) [[unlikely]] trace(event_trace::event_kind::segment_free, a, e - a, r->stream, tag_other);
    GACT_LOG_DEBUG("[map-][{}][stream {:#x}][{}B][{:#x}]", stats_name, r->stream, e - a, a);
    block* head = nullptr;
    if (has_head) {  // the front's partial page stays mapped: f keeps it
      head = f;
      hole->stream = f->stream;
      hole->range = r;
      link_after(f, hole);
      f->size = a - f->ptr;
    }
    hole->ptr = a;
    hole->size = e - a;
    hole->state = block_state::unmapped;
    hole->small = r->small;
    if (tail != nullptr) {
      tail->ptr = e;
      tail->size = end - e;
      tail->stream = hole->stream;
      tail->small = r->small;
      tail->range = r;
      link_after(hole, tail);
    }
    if (block* p = hole->prev; p != nullptr && p->state == block_state::unmapped) {
      r->holes.erase(a);
      p->size += hole->size;  // (p keeps its key in holes)
      unlink(hole);
      records.destroy(hole);
      hole = p;
    } else {
      r->holes[a] = hole;  // (the entry made above: no allocation)
    }
    if (block* n = hole->next; n != nullptr && n->state == block_state::unmapped) {
      r->holes.erase(n->ptr);
      hole->size += n->size;
      unlink(n);
      records.destroy(n);
    }
    if (head != nullptr) insert_free(head);
    if (tail != nullptr) insert_free(tail);
  }

  device::event_t acquire_event() {
    if (!spare_events.empty()) {
      device::event_t const e = spare_events.back();
      spare_events.pop_back();
      return e;
    }
    return be.create_event();
  }

  void event_done(std::size_t i) {
    pending_event const pe = pending[i];
    pending[i] = pending.back();
    pending.pop_back();
    spare_events.push_back(pe.event);
    if (--pe.blk->event_count == 0) free_block(pe.blk);
  }

  /// Free the blocks whose events have all completed (never blocks).
  void process_events() {
    for (std::size_t i = 0; i < pending.size();) {
      if (be.query(pending[i].event)) {
        event_done(i);
      } else {
        ++i;
      }
    }
  }

  void synchronize_pending() {
    while (!pending.empty()) {
      be.synchronize(pending.back().event);
      event_done(pending.size() - 1);
    }
  }

  void count_alloc(block* b, std::size_t requested, tag_id tag) noexcept {
    auto const size = static_cast<std::int64_t>(b->size);
    stat_add(st.allocation, b->small, 1);
    stat_add(st.allocated_bytes, b->small, size);
    stat_add(st.requested_bytes, b->small, static_cast<std::int64_t>(requested));
    stat_add(st.active, b->small, 1);
    stat_add(st.active_bytes, b->small, size);
    tag_stat& t = tags[tag];
    t.current_bytes += size;
    t.peak_bytes = std::max(t.peak_bytes, t.current_bytes);
    ++t.current_count;
    t.peak_count = std::max(t.peak_count, t.current_count);
    ++t.total_allocs;
  }

  void count_free(block const* b) noexcept {
    auto const size = static_cast<std::int64_t>(b->size);
    stat_sub(st.allocation, b->small, 1);
    stat_sub(st.allocated_bytes, b->small, size);
    stat_sub(st.requested_bytes, b->small, static_cast<std::int64_t>(b->requested));
    tag_stat& t = tags[b->tag];
    t.current_bytes -= size;
    --t.current_count;
  }

  [[noreturn]] void throw_oom(std::size_t bytes, std::size_t seg_size, device::stream_t stream, tag_id tag) {
    ++st.num_ooms;
    if (event_trace::enabled()) {
      trace(event_trace::event_kind::oom, 0, bytes, stream, tag,
            static_cast<std::uint64_t>(st.reserved_bytes[pool_all].current));
    }
    std::string msg = "gact: out of memory in allocator '" + stats_name + "': requested " + human_bytes(bytes) +
                      (opts.expandable_segments ? " (no free block or mappable room of " + human_bytes(seg_size) +
                                                      " in the stream's expandable segment after releasing its free pages)"
                                                : " (needs a new segment of " + human_bytes(seg_size) + ")") +
                      "; reserved " +
                      human_bytes(static_cast<std::size_t>(st.reserved_bytes[pool_all].current)) + ", allocated " +
                      human_bytes(static_cast<std::size_t>(st.allocated_bytes[pool_all].current)) + ", limit " +
                      (opts.memory_limit == 0 ? std::string("none") : human_bytes(opts.memory_limit)) + "; " +
                      std::string(be.name()) + " backend: " + last_backend_error;
    // (said by whoever catches it: torch's error, a Compressor's one warning as it keeps the tensor, gact's
    // OutOfMemoryError; num_ooms counts it)
    GACT_LOG_INFO("{}", msg);
    throw out_of_memory(msg);
  }

  /// Classify a free of a pointer that is not live: the start of a free or pending block is a
  /// double free; anything else is unknown. Slow path (walks the free sets).
  void bad_free(void* p) noexcept {
    auto const addr = reinterpret_cast<std::uintptr_t>(p);
    bool dbl = false;
    for (free_set const* pool : {&small_free, &large_free}) {
      for (block const* b : *pool) {
        if (b->ptr == addr) dbl = true;
      }
    }
    for (pending_event const& pe : pending) {
      if (pe.blk->ptr == addr) dbl = true;
    }
    if (dbl) {
      ++st.double_free;
      GACT_WARN_CAPPED(16, "allocator '{}': double free of {} (ignored)", stats_name, p);
    } else {
      ++st.invalid_free;
      GACT_WARN_CAPPED(16, "allocator '{}': free of {}, which it did not allocate (ignored)", stats_name, p);
    }
  }

  nlohmann::json stats_json_locked() const {
    nlohmann::json j = nlohmann::json::object();
    st.to_json(j);
    j["errors"]["tag_underflow"] = tag_underflows();

    auto const names = tag_names();
    nlohmann::json tj = nlohmann::json::object();
    for (std::size_t i = 0; i < tags.size(); ++i) {
      tag_stat const& t = tags[i];
      if (t.total_allocs == 0 && t.peak_bytes == 0) continue;
      std::string const name = i < names.size() ? names[i] : std::to_string(i);
      tj[name] = {{"current_bytes", t.current_bytes}, {"peak_bytes", t.peak_bytes},
                  {"current_count", t.current_count}, {"peak_count", t.peak_count},
                  {"total_allocs", t.total_allocs}};
    }
    j["tags"] = std::move(tj);

    std::size_t largest = 0;
    std::size_t total_free = 0;
    for (free_set const* pool : {&small_free, &large_free}) {
      for (block const* b : *pool) {
        largest = std::max(largest, b->size);
        total_free += b->size;
      }
    }
    double const peak_alloc = static_cast<double>(st.allocated_bytes[pool_all].peak);
    double const peak_res = static_cast<double>(st.reserved_bytes[pool_all].peak);
    j["fragmentation"] = {
        {"peak", peak_res > 0 ? 1.0 - peak_alloc / peak_res : 0.0},
        {"free", total_free > 0 ? 1.0 - static_cast<double>(largest) / static_cast<double>(total_free) : 0.0},
        {"largest_free_block", largest},
        {"total_free", total_free}};
    j["options"] = {{"small_size", opts.small_size},
                    {"small_segment_size", opts.small_segment_size},
                    {"large_segment_size", opts.large_segment_size},
                    {"min_large_alloc", opts.min_large_alloc},
                    {"round_large", opts.round_large},
                    {"memory_limit", opts.memory_limit},
                    {"max_request", opts.max_request},
                    {"release_free_above", opts.release_free_above},
                    {"release_on_miss_above", opts.release_on_miss_above},
                    {"retry_when_empty", opts.retry_when_empty},
                    {"backend_unlocked", opts.backend_unlocked},
                    {"expandable_segments", opts.expandable_segments},
                    {"expandable_range", opts.expandable_range}};
    j["name"] = stats_name;
    if (event_trace::enabled()) j["segments"] = segments_json();
    return j;
  }

  /// Every segment with its blocks in address order (for gact-stats export-torch); only
  /// while tracing, as the listing grows with the number of blocks.
  nlohmann::json segments_json() const {
    std::vector<block const*> heads;
    auto const add_head = [&heads](block const* b) {
      while (b->prev != nullptr) b = b->prev;
      heads.push_back(b);
    };
    live.for_each([&](std::uintptr_t, block* b) { add_head(b); });
    for (free_set const* pool : {&small_free, &large_free}) {
      for (block const* b : *pool) add_head(b);
    }
    for (pending_event const& pe : pending) add_head(pe.blk);
    std::sort(heads.begin(), heads.end(), [](block const* a, block const* b) { return a->ptr < b->ptr; });
    heads.erase(std::unique(heads.begin(), heads.end()), heads.end());
    auto const names = tag_names();
    nlohmann::json segs = nlohmann::json::array();
    // (an expandable range is listed as its mapped runs, each a segment, as torch lists its expandable segments)
    std::vector<block const*> runs;
    for (block const* h : heads) {
      if (h->range == nullptr) {
        runs.push_back(h);
        continue;
      }
      for (block const* b = h; b != nullptr; b = b->next) {
        if (b->state != block_state::unmapped && (b->prev == nullptr || b->prev->state == block_state::unmapped)) {
          runs.push_back(b);
        }
      }
    }
    for (block const* h : runs) {
      nlohmann::json blocks = nlohmann::json::array();
      std::size_t total = 0;
      for (block const* b = h; b != nullptr && b->state != block_state::unmapped; b = b->next) {
        total += b->size;
        char const* state = b->state == block_state::allocated ? "active_allocated"
                            : b->state == block_state::pending  ? "active_pending_free"
                                                                : "inactive";
        nlohmann::json bj = {{"address", b->ptr}, {"size", b->size}, {"state", state}};
        if (b->state != block_state::free) {
          bj["requested_size"] = b->requested;
          bj["tag"] = b->tag < names.size() ? names[b->tag] : std::to_string(b->tag);
        }
        blocks.push_back(std::move(bj));
      }
      segs.push_back({{"address", h->ptr},
                      {"total_size", total},
                      {"stream", static_cast<std::uint64_t>(h->stream)},
                      {"segment_type", h->small ? "small" : "large"},
                      {"blocks", std::move(blocks)}});
    }
    return segs;
  }
};

// ---- public interface ------------------------------------------------------------

caching_allocator::caching_allocator(device::backend& be, allocator_options opts) {
  auto const multiple = [](std::size_t n) { return n > 0 && n % k_min_block == 0; };
  GACT_EXPECTS(!opts.name.empty(), "caching_allocator: options.name must not be empty");
  GACT_EXPECTS(opts.small_size > 0 && round_size(opts.small_size) <= opts.small_segment_size,
               "caching_allocator: small_size (" + std::to_string(opts.small_size) +
                   ") must be positive and fit in small_segment_size (" + std::to_string(opts.small_segment_size) + ")");
  GACT_EXPECTS(multiple(opts.small_segment_size) && multiple(opts.large_segment_size) && multiple(opts.round_large),
               "caching_allocator: small_segment_size, large_segment_size and round_large must be positive "
               "multiples of 512");
  GACT_EXPECTS(opts.min_large_alloc > opts.small_size && opts.large_segment_size >= opts.min_large_alloc,
               "caching_allocator: need small_size < min_large_alloc <= large_segment_size");
  GACT_EXPECTS(opts.max_request >= k_min_block && opts.max_request <= (std::size_t{1} << 56),
               "caching_allocator: max_request must be in [512, 2^56]");
  if (opts.expandable_segments) {
    std::size_t const page = be.vm_page();
    GACT_EXPECTS(page != 0, "caching_allocator: expandable_segments needs a backend with virtual memory calls; '" +
                                std::string(be.name()) + "' has none");
    GACT_EXPECTS((page & (page - 1)) == 0 && page % k_min_block == 0,
                 "caching_allocator: the backend's page (" + std::to_string(page) + ") must be a power of two of at least 512");
    GACT_EXPECTS(!opts.backend_unlocked, "caching_allocator: expandable_segments and backend_unlocked exclude each other");
  }
  event_trace::init_from_env();  // GACT_TRACE: a bad value is rejected here, before anything is registered
  impl_ = std::make_unique<impl>(be, std::move(opts));
  auto [token, name] = stats::register_unique_provider("allocators/" + impl_->opts.name,
                                                       [this] { return stats_json(); });
  impl_->stats_token = token;
  impl_->stats_name = name.substr(std::string_view("allocators/").size());
  try {
    impl_->trace_source = event_trace::register_source(impl_->stats_name);
  } catch (...) {
    stats::unregister_provider(token);
    throw;
  }
  try {
    stats::install_dump_triggers();  // GACT_STATS_PATH: dump at exit and on SIGUSR1
  } catch (std::exception const& e) {
    // The provider is registered; a constructor that throws now would leave it dangling.
    // Said once per process: every allocator created after the first would say it again.
    GACT_WARN_CAPPED(1, "allocator '{}': stats dump triggers not installed: {}", impl_->stats_name, e.what());
  }
}

caching_allocator::~caching_allocator() {
  stats::unregister_provider(impl_->stats_token);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl& m = *impl_;
  try {
    m.release_cached();
  } catch (std::exception const& e) {
    GACT_LOG_ERROR("allocator '{}': releasing the cache at destruction failed: {}", m.stats_name, e.what());
  }
  if (m.live.size() > 0 || !m.pending.empty()) {
    GACT_LOG_WARN("allocator '{}' destroyed with {} live blocks ({} bytes); their segments are not released",
                  m.stats_name, m.live.size(), m.st.allocated_bytes[pool_all].current);
  }
  for (auto const& [p, n] : m.to_release) m.be.release(p, n);
  m.to_release.clear();
  for (device::event_t e : m.spare_events) m.be.destroy_event(e);
  for (pending_event const& pe : m.pending) m.be.destroy_event(pe.event);
}

void* caching_allocator::allocate(std::size_t bytes, device::stream_t stream) {
  return allocate(bytes, stream, current_tag());
}

void* caching_allocator::allocate(std::size_t bytes, device::stream_t stream, tag_id tag) {
  impl& m = *impl_;
  if (bytes == 0 || bytes > m.opts.max_request) [[unlikely]] {
    std::lock_guard<std::mutex> lock(m.mu);
    if (bytes == 0) {
      ++m.st.zero_size;
      return nullptr;
    }
    ++m.st.invalid_size;
    GACT_FAIL("allocator '" + m.stats_name + "': request of " + std::to_string(bytes) +
              " bytes exceeds max_request (" + std::to_string(m.opts.max_request) + ")");
  }
  if (tag >= k_max_tags) tag = tag_other;
  std::size_t const size = round_size(bytes);
  bool const expandable = m.opts.expandable_segments;
  bool const small = size <= m.opts.small_size;

  std::unique_lock<std::mutex> lock(m.mu);
  impl::drain_at_exit const drain{m, lock};  // (also when it throws: segments released on the way stay queued)
  // What the end of this call needs and can fail for lack of heap, taken before any block leaves its free set:
  // the live map's room for one more, free-set nodes for a split remainder and a new range's pages, and a record
  // for the remainder (given back unless used).
  m.live.reserve_one();
  m.nodes.reserve(2);
  struct spare_record {
    impl& m;
    block* b;
    ~spare_record() {
      if (b != nullptr) m.records.destroy(b);
    }
  } spare{m, m.records.make()};
  if (m.fault_count > 0) [[unlikely]] {
    if (m.fault_after > 0) {
      --m.fault_after;
    } else {
      --m.fault_count;
      m.throw_oom(bytes, m.segment_size(size), stream, tag);
    }
  }
  if (!m.pending.empty()) m.process_events();
  block* b = m.find_free(small, size, stream);
  if (b != nullptr) [[likely]] {
    m.erase_free(b);
  } else if (expandable) {
    if (m.release_on_miss) {
      m.release_whole_free();
    } else if (m.opts.release_on_miss_above != 0) {
      // (a request that extends a free run maps only the rest: the release then waits for a larger miss)
      if (m.grow_bytes(size, stream, small) >= m.opts.release_on_miss_above) m.release_large_free(size);
    }
    if (!m.grow(size, stream, small)) {
      // free pages anywhere in the ranges go back to the device, which may then map them where this fits
      m.release_cached();
      ++m.st.num_alloc_retries;
      if (m.find_free(small, size, stream) == nullptr && !m.grow(size, stream, small)) {
        m.throw_oom(bytes, size, stream, tag);
      }
    }
    b = m.find_free(small, size, stream);
    GACT_ASSERT_INTERNAL(b != nullptr);
    m.erase_free(b);
  } else {
    std::size_t const seg = m.segment_size(size);
    if (m.release_on_miss) {
      m.release_whole_free();  // none of them can serve this request
    } else if (m.opts.release_on_miss_above != 0 && seg >= m.opts.release_on_miss_above) {
      m.release_large_free(seg);
    }
    b = m.try_new_segment(seg, small, stream, lock);
    if (b == nullptr) {
      // A thin layer over another allocator with nothing to release (no free segment cached, no block waiting
      // for an event; its live blocks stay): that allocator has freed its own cache and retried before failing,
      // and a second attempt would only repeat its whole out-of-memory path.
      if (!m.opts.retry_when_empty && m.pending.empty() && m.small_free.empty() && m.large_free.empty())
        m.throw_oom(bytes, seg, stream, tag);
      m.release_cached();
      ++m.st.num_alloc_retries;
      b = m.find_free(small, size, stream);  // freed pending blocks may serve it now
      if (b != nullptr) {
        m.erase_free(b);
      } else {
        b = m.try_new_segment(seg, small, stream, lock);
        if (b == nullptr) m.throw_oom(bytes, seg, stream, tag);
      }
    }
  }

  if (std::size_t const remaining = b->size - size; m.should_split(small, remaining)) {
    block* r = std::exchange(spare.b, nullptr);
    r->ptr = b->ptr + size;
    r->size = remaining;
    r->stream = b->stream;
    r->small = small;
    r->range = b->range;
    r->prev = b;
    r->next = b->next;
    if (r->next != nullptr) r->next->prev = r;
    b->next = r;
    b->size = size;
    m.insert_free(r);
  }
  b->state = block_state::allocated;
  b->requested = bytes;
  b->tag = tag;
  m.live.insert(b->ptr, b);
  m.count_alloc(b, bytes, tag);
  if (event_trace::enabled()) [[unlikely]] m.trace(event_trace::event_kind::alloc, b->ptr, b->size, stream, tag, bytes);
  return reinterpret_cast<void*>(b->ptr);  // (blocks whose events completed may have freed a segment: drained)
}

void caching_allocator::deallocate(void* p) noexcept {
  if (p != nullptr) (void)free_if_owned(p, true);
}

bool caching_allocator::try_deallocate(void* p) noexcept { return p != nullptr && free_if_owned(p, false); }

bool caching_allocator::free_if_owned(void* p, bool count_bad) noexcept {
  impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mu);
  impl::drain_at_exit const drain{m, lock};
  auto const addr = reinterpret_cast<std::uintptr_t>(p);
  block* b = m.live.find(addr);
  if (b == nullptr) [[unlikely]] {
    if (count_bad) m.bad_free(p);
    return false;
  }
  m.live.erase(addr);
  m.count_free(b);
  if (event_trace::enabled()) [[unlikely]] m.trace(event_trace::event_kind::free, b->ptr, b->size, b->stream, b->tag);
  try {
    if (b->stream_uses.empty()) [[likely]] {
      m.free_block(b);
      return true;
    }
    // Used on other streams: the memory is reusable once an event recorded now on each
    // of them has completed.
    b->state = block_state::pending;
    bool leaked = false;
    for (device::stream_t s : b->stream_uses) {
      try {
        device::event_t const e = m.acquire_event();
        try {
          m.be.record(e, s);
        } catch (...) {
          m.spare_events.push_back(e);
          throw;
        }
        m.pending.push_back({e, b});
        ++b->event_count;
      } catch (std::exception const& e) {
        // No event: wait for the stream now rather than reuse memory it may still touch.
        try {
          m.be.synchronize_stream(s);
        } catch (std::exception const& e2) {
          leaked = true;
          GACT_LOG_ERROR("allocator '{}': cannot record or wait for stream {:#x} ({}; {}); block {} is kept "
                         "out of use",
                         m.stats_name, s, e.what(), e2.what(), p);
        }
      }
    }
    b->stream_uses.clear();
    if (b->event_count == 0 && !leaked) m.free_block(b);
  } catch (std::exception const& e) {
    // Only host allocation failure (bad_alloc) can reach here; the block stays out of use.
    GACT_LOG_ERROR("allocator '{}': free of {} failed: {}", m.stats_name, p, e.what());
  }
  return true;
}

void caching_allocator::record_stream(void* p, device::stream_t stream) {
  GACT_EXPECTS(try_record_stream(p, stream),
               "allocator '" + impl_->stats_name + "': record_stream on a pointer it did not allocate");
}

bool caching_allocator::try_record_stream(void* p, device::stream_t stream) {
  impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  block* b = m.live.find(reinterpret_cast<std::uintptr_t>(p));
  if (b == nullptr) return false;
  if (stream == b->stream) return true;
  if (std::find(b->stream_uses.begin(), b->stream_uses.end(), stream) == b->stream_uses.end()) {
    b->stream_uses.push_back(stream);
  }
  return true;
}

void caching_allocator::fork_prepare() noexcept { impl_->mu.lock(); }
void caching_allocator::fork_parent() noexcept { impl_->mu.unlock(); }
// The child is single-threaded and its copy of the mutex is the one the parent locked in
// fork_prepare: unlocking it is what glibc does with malloc's own locks.
void caching_allocator::fork_child() noexcept { impl_->mu.unlock(); }

void caching_allocator::fail_allocations(int after, int count) noexcept {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->fault_after = after > 0 ? after : 0;
  impl_->fault_count = count > 0 ? count : 0;
}

void caching_allocator::empty_cache() {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl::drain_at_exit const drain{*impl_, lock};
  impl_->release_cached();
}

bool caching_allocator::set_release_on_miss(bool on) noexcept {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return std::exchange(impl_->release_on_miss, on);
}

std::size_t caching_allocator::block_size(void const* p) const noexcept {
  std::lock_guard<std::mutex> lock(impl_->mu);
  block const* b = impl_->live.find(reinterpret_cast<std::uintptr_t>(p));
  return b == nullptr ? 0 : b->size;
}

bool caching_allocator::owns(void const* p) const noexcept {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->live.find(reinterpret_cast<std::uintptr_t>(p)) != nullptr;
}

bool caching_allocator::contains(void const* p) const noexcept {
  auto const a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->segments.upper_bound(a);
  if (it == impl_->segments.begin()) return false;
  --it;
  return a - it->first < it->second;
}

nlohmann::json caching_allocator::stats_json() const {
  nlohmann::json j;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    j = impl_->stats_json_locked();
  }
  // The backend may make a device call here (cudaMemGetInfo): outside the lock.
  device::mem_info const info = impl_->be.memory_info();
  j["backend"] = {{"name", std::string(impl_->be.name())},
                  {"kind", static_cast<int>(impl_->be.kind())},
                  {"free_bytes", info.free_bytes},
                  {"total_bytes", info.total_bytes}};
  return j;
}

allocator_stats caching_allocator::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->st;
}

std::string const& caching_allocator::stats_name() const noexcept { return impl_->stats_name; }

void caching_allocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->st.reset_peak();
  for (tag_stat& t : impl_->tags) {
    t.peak_bytes = t.current_bytes;
    t.peak_count = t.current_count;
  }
}

void caching_allocator::reset_accumulated_stats() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->st.reset_accumulated();
  for (tag_stat& t : impl_->tags) t.total_allocs = 0;
}

std::size_t caching_allocator::reserved_bytes() const noexcept {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<std::size_t>(impl_->st.reserved_bytes[pool_all].current);
}

std::size_t caching_allocator::allocated_bytes() const noexcept {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<std::size_t>(impl_->st.allocated_bytes[pool_all].current);
}

device::backend& caching_allocator::backend() const noexcept { return impl_->be; }

allocator_options const& caching_allocator::options() const noexcept { return impl_->opts; }

void caching_allocator::set_memory_limit(std::size_t bytes) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl::drain_at_exit const drain{*impl_, lock};
  impl_->opts.memory_limit = bytes;
  std::size_t const reserved = static_cast<std::size_t>(impl_->st.reserved_bytes[pool_all].current) + impl_->reserving;
  if (bytes != 0 && reserved > bytes) impl_->release_cached();  // get under the new cap where the cache allows
}

}  // namespace gact::alloc
