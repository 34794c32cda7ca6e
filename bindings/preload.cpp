// gact/bindings/preload.cpp
//
// libgact_preload.so: gact's caching allocator LD_PRELOADed into an unmodified
// CUDA program. It defines cudaMalloc, cudaFree, cudaMallocAsync, cudaFreeAsync
// and cudaMemGetInfo, which the dynamic linker binds before libcudart's; the
// real functions are found with dlsym(RTLD_NEXT, ...) (next_cuda_api()), and
// gact's backend calls only those, never the process's own symbols. The shim
// does not link libcudart: it uses whatever runtime the program loaded.
//
// What it does with each call:
//   cudaMalloc(p, n)          served by the device's caching allocator on the
//                             legacy stream (handle 0);
//   cudaMallocAsync(p, n, s)  served on stream s (stream-ordered reuse);
//   cudaFreeAsync(p, s)       p back to the cache; if s is not p's allocation
//                             stream, the block waits for an event on s first;
//   cudaFree(p)               the real cudaFree synchronizes the device, and
//                             PyTorch's uncached mode (PYTORCH_NO_CUDA_MEMORY_CACHING=1)
//                             relies on it: a block freed there may still be in
//                             use by a kernel on any stream. So the block is not
//                             reused at once: it is parked in a deferred list and
//                             returned to the cache only after a device-wide
//                             cudaDeviceSynchronize, done lazily for a whole batch
//                             (when the parked bytes reach k_flush_bytes or 1024
//                             blocks, when an allocation fails, or at exit). This
//                             keeps the guarantee (no reuse before all work queued
//                             before the free has finished) at the cost of one
//                             synchronization per batch instead of one per free;
//                             the call itself returns without synchronizing;
//   cudaMemGetInfo            free = the runtime's free + the pool's cached free
//                             bytes + parked bytes, capped at total.
// Passed through untouched: pointers gact did not allocate (to the real
// cudaFree/cudaFreeAsync); allocations while a capture is active on the stream
// (cudaStreamIsCapturing; for cudaMalloc, checked on the legacy stream, which
// reports any global capture), so graph memory nodes stay the runtime's;
// allocations on cudaStreamPerThread (a different stream for every thread);
// size 0 and null output pointers (the runtime gives its usual answer).
// A gact pointer freed with cudaFreeAsync on a capturing stream (or on
// cudaStreamPerThread) is parked like a cudaFree. Limitation: a graph that frees
// memory allocated outside it expects the free to happen when the graph runs;
// the shim recycles the block after the next device synchronization instead.
// PyTorch never does this (its cudaMallocAsync backend defers such frees until
// no capture is underway).
//
// Failures never crash the program: an allocation gact cannot serve returns
// cudaErrorMemoryAllocation after a rate-limited log line. Stats: the allocators
// appear as "preload:cuda:<device>" and the shim's own counters as the
// "preload" section; with GACT_STATS_PATH set the document is dumped at exit.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <utility>
#include <vector>

#include "allocator/stats_registry.hpp"
#include "bindings/device_allocators.hpp"

namespace {

using gact::alloc::caching_allocator;
using gact::device::cuda_api;

/// Parked bytes that trigger a flush of the deferred cudaFree list.
constexpr std::size_t k_flush_bytes = std::size_t{256} << 20;
/// Parked blocks that trigger a flush.
constexpr std::size_t k_flush_blocks = 1024;

struct counters {
  std::atomic<std::uint64_t> malloc_calls{0};         ///< cudaMalloc calls served by gact
  std::atomic<std::uint64_t> malloc_bytes{0};         ///< bytes requested by those
  std::atomic<std::uint64_t> malloc_async_calls{0};   ///< cudaMallocAsync calls served by gact
  std::atomic<std::uint64_t> malloc_async_bytes{0};
  std::atomic<std::uint64_t> free_calls{0};           ///< cudaFree of gact pointers (deferred)
  std::atomic<std::uint64_t> free_async_calls{0};     ///< cudaFreeAsync of gact pointers
  std::atomic<std::uint64_t> foreign_frees{0};        ///< cudaFree/cudaFreeAsync passed to the runtime
  std::atomic<std::uint64_t> capture_passthrough{0};  ///< allocations passed through during capture
  std::atomic<std::uint64_t> per_thread_passthrough{0};
  std::atomic<std::uint64_t> failed_allocs{0};        ///< returned cudaErrorMemoryAllocation
  std::atomic<std::uint64_t> flushes{0};              ///< deferred-list flushes
  std::atomic<std::uint64_t> device_syncs{0};         ///< cudaDeviceSynchronize calls of flushes
  std::atomic<std::uint64_t> mem_get_info_calls{0};
};

/// A block freed by cudaFree, waiting for a device synchronization.
struct parked {
  caching_allocator* owner;
  void* ptr;
  std::size_t bytes;
  int device;
};

class shim {
 public:
  explicit shim(cuda_api const& api) : api_(api), allocators_(api, "preload:cuda") {}

  cuda_api const& api() const noexcept { return api_; }
  gact::bindings::device_allocators& allocators() noexcept { return allocators_; }
  counters& count() noexcept { return counters_; }

  /// True when stream `s` (0 = legacy) is capturing, or the runtime says the call would
  /// touch a capture (cudaErrorStreamCaptureImplicit & co.). Leaves no sticky last error.
  bool capturing(cudaStream_t s) const noexcept {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cudaError_t const err = api_.stream_is_capturing(s, &status);
    if (err != cudaSuccess) {
      (void)api_.get_last_error();
      return true;
    }
    return status != cudaStreamCaptureStatusNone;
  }

  /// Allocate through gact; on out-of-memory flush the parked frees and retry once.
  /// @returns cudaSuccess or cudaErrorMemoryAllocation (never throws).
  cudaError_t allocate(void** out, std::size_t bytes, cudaStream_t stream) noexcept {
    try {
      int device = 0;
      GACT_CUDA_TRY(api_, api_.get_device(&device));
      caching_allocator& a = allocators_.get(device);
      if (should_flush()) {
        flush();
      }
      try {
        *out = a.allocate(bytes, gact::device::to_handle(stream));
      } catch (gact::out_of_memory const&) {
        if (flush() == 0) {
          throw;
        }
        *out = a.allocate(bytes, gact::device::to_handle(stream));
      }
      return cudaSuccess;
    } catch (...) {
      counters_.failed_allocs.fetch_add(1, std::memory_order_relaxed);
      GACT_WARN_CAPPED(16, "gact preload: allocation of {} bytes failed: {}", bytes, what(std::current_exception()));
      *out = nullptr;
      return cudaErrorMemoryAllocation;
    }
  }

  /// Park a block freed by cudaFree until the next device synchronization.
  void park(caching_allocator& owner, void* p) {
    std::size_t const bytes = owner.block_size(p);
    int device = 0;
    if (api_.get_device(&device) != cudaSuccess) {
      (void)api_.get_last_error();
    }
    std::lock_guard lk(mu_);
    parked_.push_back(parked{&owner, p, bytes, device});
    parked_bytes_ += bytes;
  }

  /// Parked bytes of `device`.
  std::size_t parked_bytes(int device) noexcept {
    std::lock_guard lk(mu_);
    std::size_t n = 0;
    for (parked const& b : parked_) {
      n += b.device == device ? b.bytes : 0;
    }
    return n;
  }

  /// Synchronize every device with parked blocks and give the blocks back to their
  /// allocators. Skipped (returns 0) while a capture is active or when a
  /// synchronization fails: parked blocks are never reused unsynchronized.
  /// @returns the number of bytes given back.
  std::size_t flush() noexcept {
    std::vector<parked> batch;
    {
      std::lock_guard lk(mu_);
      batch.swap(parked_);
      parked_bytes_ = 0;
    }
    if (batch.empty()) {
      return 0;
    }
    bool ok = !capturing(nullptr);
    std::vector<int> synced;
    for (parked const& b : batch) {
      if (!ok) {
        break;
      }
      if (std::find(synced.begin(), synced.end(), b.device) != synced.end()) {
        continue;
      }
      try {
        gact::device::device_guard const guard(api_, b.device);
        GACT_CUDA_TRY(api_, api_.device_synchronize());
        counters_.device_syncs.fetch_add(1, std::memory_order_relaxed);
        synced.push_back(b.device);
      } catch (...) {
        GACT_WARN_CAPPED(8, "gact preload: cannot synchronize device {} to recycle freed blocks: {}", b.device,
                         what(std::current_exception()));
        ok = false;
      }
    }
    if (!ok) {
      std::lock_guard lk(mu_);  // put the batch back; try again later
      for (parked const& b : batch) {
        parked_.push_back(b);
        parked_bytes_ += b.bytes;
      }
      return 0;
    }
    std::size_t bytes = 0;
    for (parked const& b : batch) {
      b.owner->deallocate(b.ptr);
      bytes += b.bytes;
    }
    counters_.flushes.fetch_add(1, std::memory_order_relaxed);
    return bytes;
  }

  nlohmann::json stats_json() noexcept {
    nlohmann::json j;
    auto get = [](std::atomic<std::uint64_t> const& c) { return c.load(std::memory_order_relaxed); };
    j["malloc_calls"] = get(counters_.malloc_calls);
    j["malloc_bytes"] = get(counters_.malloc_bytes);
    j["malloc_async_calls"] = get(counters_.malloc_async_calls);
    j["malloc_async_bytes"] = get(counters_.malloc_async_bytes);
    j["free_calls"] = get(counters_.free_calls);
    j["free_async_calls"] = get(counters_.free_async_calls);
    j["foreign_frees"] = get(counters_.foreign_frees);
    j["capture_passthrough"] = get(counters_.capture_passthrough);
    j["per_thread_stream_passthrough"] = get(counters_.per_thread_passthrough);
    j["failed_allocs"] = get(counters_.failed_allocs);
    j["deferred_flushes"] = get(counters_.flushes);
    j["deferred_device_syncs"] = get(counters_.device_syncs);
    j["mem_get_info_calls"] = get(counters_.mem_get_info_calls);
    std::lock_guard lk(mu_);
    j["deferred_pending_blocks"] = parked_.size();
    j["deferred_pending_bytes"] = parked_bytes_;
    return j;
  }

  static char const* what(std::exception_ptr e) noexcept {
    try {
      std::rethrow_exception(std::move(e));
    } catch (std::exception const& x) {
      return x.what();
    } catch (...) {
      return "unknown exception";
    }
  }

 private:
  bool should_flush() noexcept {
    std::lock_guard lk(mu_);
    return parked_bytes_ >= k_flush_bytes || parked_.size() >= k_flush_blocks;
  }

  cuda_api const& api_;
  gact::bindings::device_allocators allocators_;
  counters counters_;
  std::mutex mu_;                ///< guards parked_ and parked_bytes_
  std::vector<parked> parked_;   ///< invariant: parked_bytes_ == sum of parked_[i].bytes
  std::size_t parked_bytes_ = 0;
};

void flush_at_exit() noexcept;

/// The shim, created on the first intercepted call; nullptr when no CUDA runtime can be
/// found after the shim (then every call fails with cudaErrorInitializationError).
shim* the_shim() noexcept {
  static shim* const s = []() -> shim* {
    try {
      auto* p = new shim(gact::device::next_cuda_api());  // never destroyed: exit handlers may still call us
      gact::stats::register_provider("preload", [p] { return p->stats_json(); });
      gact::stats::install_dump_triggers();
      // Registered after the dump trigger, so it runs before the exit dump.
      std::atexit(flush_at_exit);
      return p;
    } catch (...) {
      GACT_LOG_ERROR("gact preload: disabled: {}", shim::what(std::current_exception()));
      return nullptr;
    }
  }();
  return s;
}

void flush_at_exit() noexcept {
  if (shim* s = the_shim()) {
    (void)s->flush();
  }
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) cudaError_t CUDARTAPI cudaMalloc(void** devPtr, size_t size) {
  shim* s = the_shim();
  if (s == nullptr) {
    return cudaErrorInitializationError;
  }
  if (devPtr == nullptr || size == 0) {
    return s->api().malloc(devPtr, size);
  }
  if (s->capturing(nullptr)) {
    s->count().capture_passthrough.fetch_add(1, std::memory_order_relaxed);
    return s->api().malloc(devPtr, size);
  }
  cudaError_t const err = s->allocate(devPtr, size, nullptr);
  if (err == cudaSuccess) {
    s->count().malloc_calls.fetch_add(1, std::memory_order_relaxed);
    s->count().malloc_bytes.fetch_add(size, std::memory_order_relaxed);
  }
  return err;
}

__attribute__((visibility("default"))) cudaError_t CUDARTAPI cudaFree(void* devPtr) {
  shim* s = the_shim();
  if (s == nullptr) {
    return cudaErrorInitializationError;
  }
  if (devPtr == nullptr) {
    return s->api().free(devPtr);  // the runtime's own meaning (context set-up)
  }
  caching_allocator* owner = s->allocators().owner(devPtr);
  if (owner == nullptr) {
    s->count().foreign_frees.fetch_add(1, std::memory_order_relaxed);
    return s->api().free(devPtr);
  }
  try {
    s->park(*owner, devPtr);
  } catch (...) {
    // Could not park (no memory for the list): recycle synchronously instead.
    GACT_WARN_CAPPED(8, "gact preload: cudaFree({}) could not defer: {}", devPtr, shim::what(std::current_exception()));
    if (s->api().device_synchronize() != cudaSuccess) {
      (void)s->api().get_last_error();
      return cudaSuccess;  // leak the block rather than reuse it unsynchronized
    }
    owner->deallocate(devPtr);
  }
  s->count().free_calls.fetch_add(1, std::memory_order_relaxed);
  return cudaSuccess;
}

__attribute__((visibility("default"))) cudaError_t CUDARTAPI cudaMallocAsync(void** devPtr, size_t size,
                                                                              cudaStream_t hStream) {
  shim* s = the_shim();
  if (s == nullptr) {
    return cudaErrorInitializationError;
  }
  if (devPtr == nullptr || size == 0) {
    return s->api().malloc_async(devPtr, size, hStream);
  }
  if (hStream == cudaStreamPerThread) {
    s->count().per_thread_passthrough.fetch_add(1, std::memory_order_relaxed);
    return s->api().malloc_async(devPtr, size, hStream);
  }
  cudaStream_t const stream = hStream == cudaStreamLegacy ? nullptr : hStream;
  if (s->capturing(stream)) {
    s->count().capture_passthrough.fetch_add(1, std::memory_order_relaxed);
    return s->api().malloc_async(devPtr, size, hStream);
  }
  cudaError_t const err = s->allocate(devPtr, size, stream);
  if (err == cudaSuccess) {
    s->count().malloc_async_calls.fetch_add(1, std::memory_order_relaxed);
    s->count().malloc_async_bytes.fetch_add(size, std::memory_order_relaxed);
  }
  return err;
}

__attribute__((visibility("default"))) cudaError_t CUDARTAPI cudaFreeAsync(void* devPtr, cudaStream_t hStream) {
  shim* s = the_shim();
  if (s == nullptr) {
    return cudaErrorInitializationError;
  }
  caching_allocator* owner = devPtr != nullptr ? s->allocators().owner(devPtr) : nullptr;
  if (owner == nullptr) {
    if (devPtr != nullptr) {
      s->count().foreign_frees.fetch_add(1, std::memory_order_relaxed);
    }
    return s->api().free_async(devPtr, hStream);
  }
  cudaStream_t const stream = hStream == cudaStreamLegacy ? nullptr : hStream;
  try {
    if (hStream == cudaStreamPerThread || s->capturing(stream)) {
      // No stream handle gact can record an event on now: treat like cudaFree.
      s->park(*owner, devPtr);
    } else {
      owner->record_stream(devPtr, gact::device::to_handle(stream));  // no-op on the allocation stream
      owner->deallocate(devPtr);
    }
  } catch (...) {
    GACT_WARN_CAPPED(8, "gact preload: cudaFreeAsync({}) failed: {}", devPtr, shim::what(std::current_exception()));
    return cudaErrorInvalidValue;
  }
  s->count().free_async_calls.fetch_add(1, std::memory_order_relaxed);
  return cudaSuccess;
}

__attribute__((visibility("default"))) cudaError_t CUDARTAPI cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  shim* s = the_shim();
  if (s == nullptr) {
    return cudaErrorInitializationError;
  }
  cudaError_t const err = s->api().mem_get_info(free_bytes, total);
  if (err != cudaSuccess) {
    return err;
  }
  s->count().mem_get_info_calls.fetch_add(1, std::memory_order_relaxed);
  int device = 0;
  if (s->api().get_device(&device) != cudaSuccess) {
    (void)s->api().get_last_error();
    return cudaSuccess;
  }
  if (caching_allocator* a = s->allocators().peek(device)) {
    std::size_t const reserved = a->reserved_bytes();
    std::size_t const allocated = a->allocated_bytes();
    std::size_t const cached = reserved > allocated ? reserved - allocated : 0;
    std::size_t const extra = cached + s->parked_bytes(device);
    *free_bytes = *free_bytes + extra < *total ? *free_bytes + extra : *total;
  }
  return cudaSuccess;
}

}  // extern "C"
