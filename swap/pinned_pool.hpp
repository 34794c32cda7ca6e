// gact/swap/pinned_pool.hpp
//
// The pinned host pool of the swap layer: an ordinary caching_allocator over a
// pinned-host backend (pinned_host_backend on CUDA, i.e. cudaHostAlloc slabs;
// host_backend or a test backend elsewhere), configured so that it reserves few,
// large slabs and carves every blob out of them. Slabs stay cached across steps,
// so after the first step no swap-out calls cudaHostAlloc (GACT and torchtune
// allocated pinned memory per tensor per step, which synchronizes the device and
// kills overlap: shared/reference/peers.md section 2).
//
// Blocks are allocated on the mover's D2H stream (the stream that fills them) and
// freed by the mover only after the H2D copy that drains them has been seen
// complete, so the allocator's stream-ordered reuse never hands out bytes a copy
// still reads.
//
// Thread-safe (the allocator's mutex).
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/backend.hpp"
#include "allocator/error.hpp"

namespace gact::swap {

/// Settings of a pinned pool.
struct pinned_pool_options {
  std::size_t slab_bytes = std::size_t{64} << 20;  ///< size of one pinned slab (>= 4 MiB, multiple of 2 MiB)
  std::size_t limit_bytes = 0;                     ///< cap on pinned bytes reserved; 0 = none
  std::string name = "pinned";                     ///< allocator name in the stats ("allocators/pinned")
};

/// A caching allocator over pinned host memory, carving blobs out of large slabs.
class pinned_pool {
 public:
  /// @param be the pinned-host backend (must outlive the pool); any backend whose memory the
  ///        host can read works (pinned_host_backend, host_backend, test backends).
  /// @throws gact::invalid_argument for a device-memory backend or a bad slab size.
  explicit pinned_pool(device::backend& be, pinned_pool_options opts = {})
      : opts_(check(be, std::move(opts))), alloc_(be, allocator_options(opts_)) {}

  /// A block of at least `bytes` (> 0) pinned bytes, stream-ordered on `stream`.
  /// @throws gact::out_of_memory when the limit is reached or the backend has no pinned memory left
  ///         (after the allocator released its cached slabs and retried once).
  void* allocate(std::size_t bytes, device::stream_t stream) {
    return alloc_.allocate(bytes, stream, alloc::tag_activation);
  }
  /// Return a block; the caller guarantees that no copy still touches it.
  void deallocate(void* p) noexcept { alloc_.deallocate(p); }

  /// The underlying allocator (statistics, empty_cache).
  alloc::caching_allocator& allocator() noexcept { return alloc_; }
  alloc::caching_allocator const& allocator() const noexcept { return alloc_; }
  pinned_pool_options const& options() const noexcept { return opts_; }

  /// Pool figures for the swap section: reserved/allocated bytes (current, peak), slabs, reserve calls.
  nlohmann::json stats_json() const {
    alloc::allocator_stats const s = alloc_.stats();
    return {{"reserved_bytes", s.reserved_bytes[0].current},
            {"reserved_bytes_peak", s.reserved_bytes[0].peak},
            {"allocated_bytes", s.allocated_bytes[0].current},
            {"allocated_bytes_peak", s.allocated_bytes[0].peak},
            {"slabs", s.segment[0].current},
            {"slab_reserves", s.num_device_alloc},
            {"slab_releases", s.num_device_free},
            {"ooms", s.num_ooms},
            {"slab_bytes", opts_.slab_bytes},
            {"limit_bytes", opts_.limit_bytes}};
  }

 private:
  static pinned_pool_options check(device::backend& be, pinned_pool_options o) {
    constexpr std::size_t k_two_mib = std::size_t{2} << 20;
    GACT_EXPECTS(be.kind() != device::memory_kind::device,
                 "swap::pinned_pool: the backend '" + std::string(be.name()) +
                     "' holds device memory; the pool needs host-readable (pinned) memory");
    GACT_EXPECTS(o.slab_bytes >= 2 * k_two_mib && o.slab_bytes % k_two_mib == 0,
                 "swap::pinned_pool: slab_bytes=" + std::to_string(o.slab_bytes) +
                     " must be a multiple of 2 MiB and at least 4 MiB");
    return o;
  }
  // Small blobs (<= 1 MiB) share 4 MiB slabs, the rest share slab_bytes slabs; only a blob of
  // at least half a slab gets a segment of its own (rounded to 2 MiB).
  static alloc::allocator_options allocator_options(pinned_pool_options const& o) {
    alloc::allocator_options a;
    a.small_size = std::size_t{1} << 20;
    a.small_segment_size = std::size_t{4} << 20;
    a.large_segment_size = o.slab_bytes;
    a.min_large_alloc = o.slab_bytes / 2;
    a.round_large = std::size_t{2} << 20;
    a.memory_limit = o.limit_bytes;
    a.name = o.name;
    return a;
  }

  pinned_pool_options opts_;
  alloc::caching_allocator alloc_;
};

}  // namespace gact::swap
