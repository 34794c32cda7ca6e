// gact/allocator/store/offloader.hpp
//
// The interface through which the activation store hands its blobs to an
// offloader (swap/mover.hpp implements it: pinned host memory, copy streams,
// prefetch). The store only knows this interface, so allocator/ never includes
// a layer above it; swap/ builds on allocator/ and implements it.
//
// Contract: put() takes ownership of a blob of the offloader's arena; acquire()
// returns the blob's address, ready for work queued on `stream` from then on,
// until release(); release() drops the blob (its memory is freed once no copy
// touches it). put() and acquire() may throw; release() never does.
#pragma once

#include <cstddef>
#include <cstdint>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/backend.hpp"

namespace gact::store {

class offloader {
 public:
  virtual ~offloader() = default;

  /// Take ownership of `bytes` (> 0) of blob at `blob`, a block of arena(), written by work on `stream`.
  /// @returns an id for acquire/release.
  virtual std::uint64_t put(void* blob, std::size_t bytes, device::stream_t stream) = 0;
  /// The address of blob `id`, ready for work queued on `stream` (brought back if needed).
  virtual void* acquire(std::uint64_t id, device::stream_t stream) = 0;
  /// Drop blob `id`. Unknown ids are counted and ignored.
  virtual void release(std::uint64_t id) noexcept = 0;
  /// The arena the blobs live in (the store's arena for the offloader's device).
  virtual alloc::caching_allocator& arena() const noexcept = 0;
};

}  // namespace gact::store
