// gact/bindings/preload.cpp
//
// libgact_preload.so: gact's caching allocator LD_PRELOADed into an unmodified
// CUDA program. It defines cudaMalloc, cudaFree, cudaMallocAsync, cudaFreeAsync
// and cudaMemGetInfo, which the dynamic linker binds before libcudart's; the
// real functions are found with dlsym(RTLD_NEXT, ...), or in a runtime the program
// loaded privately (dlopen RTLD_NOLOAD of its soname; next_cuda_api()), and
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
// Frees gact cannot honour are answered as the runtime answers them: cudaFree or
// cudaFreeAsync of a pointer already freed (parked or given back), or of an address
// inside gact's segments that is not the start of a live block, returns
// cudaErrorInvalidValue and touches nothing (counted as "invalid_frees"); such a pointer
// is never handed to the runtime, which would free the gact segment around it.
//
// Settings: the GACT_* variables and GACT_STATS_PATH are checked when the shim is
// loaded; a bad one stops the program before main with a message naming it (exit
// status 2), instead of failing every cudaMalloc later. No runtime found yet (it is
// loaded later) is not cached: that call fails with cudaErrorInitializationError and
// the next call looks again.
//
// Failures never crash the program: an allocation gact cannot serve returns
// cudaErrorMemoryAllocation after a rate-limited log line. Stats: the allocators
// appear as "preload:cuda:<device>" and the shim's own counters as the
// "preload" section; with GACT_STATS_PATH set the document is dumped at exit.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "allocator/options.hpp"
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
  std::atomic<std::uint64_t> invalid_frees{0};        ///< double frees / interior pointers: cudaErrorInvalidValue
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

  /// What a free of `p` finds: a live gact block (its allocator), a pointer gact cannot
  /// free (already freed, or inside a gact segment), or a pointer that is not gact's.
  enum class free_kind { gact, invalid, foreign };
  free_kind classify(void* p, caching_allocator*& owner) noexcept {
    owner = allocators_.owner(p);
    if (owner != nullptr) return parked_ptrs_.count(p) != 0 ? free_kind::invalid : free_kind::gact;
    bool inside = false;
    allocators_.for_each([&](int, caching_allocator& a) { inside = inside || a.contains(p); });
    return inside ? free_kind::invalid : free_kind::foreign;
  }

  /// cudaFree(p) / cudaFreeAsync(p, s): classify `p` and, for a live gact block, `give_back`
  /// it, all under mu_, so that two frees of one pointer (or a free racing a flush) are seen
  /// in order. @returns cudaSuccess, cudaErrorInvalidValue, or for a foreign pointer
  /// cudaErrorNotSupported (the caller hands it to the runtime).
  template <class F>
  cudaError_t free_block(void* p, char const* call, F&& give_back) {
    std::lock_guard lk(mu_);
    caching_allocator* owner = nullptr;
    switch (classify(p, owner)) {
      case free_kind::foreign:
        return cudaErrorNotSupported;
      case free_kind::invalid:
        counters_.invalid_frees.fetch_add(1, std::memory_order_relaxed);
        GACT_WARN_CAPPED(16, "gact preload: {}({}): not a live allocation (already freed, or inside one); "
                         "cudaErrorInvalidValue", call, p);
        return cudaErrorInvalidValue;
      case free_kind::gact:
        break;
    }
    return give_back(*owner);
  }

  /// Park a block freed by cudaFree until the next device synchronization. Requires mu_.
  void park_locked(caching_allocator& owner, void* p) {
    std::size_t const bytes = owner.block_size(p);
    int device = 0;
    if (api_.get_device(&device) != cudaSuccess) {
      (void)api_.get_last_error();
    }
    parked_.push_back(parked{&owner, p, bytes, device});
    try {
      parked_ptrs_.insert(p);
    } catch (...) {
      parked_.pop_back();
      throw;
    }
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
    std::lock_guard lk(mu_);
    if (!ok) {
      for (parked const& b : batch) {  // put the batch back (still in parked_ptrs_); try again later
        parked_.push_back(b);
        parked_bytes_ += b.bytes;
      }
      return 0;
    }
    // Given back and forgotten together under mu_: a free of the same address after this is
    // judged against the allocator's state alone.
    std::size_t bytes = 0;
    for (parked const& b : batch) {
      b.owner->deallocate(b.ptr);
      parked_ptrs_.erase(b.ptr);
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
    j["invalid_frees"] = get(counters_.invalid_frees);
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
  std::mutex mu_;                ///< guards parked_, parked_ptrs_, parked_bytes_; frees classify under it
  std::vector<parked> parked_;   ///< invariant: parked_bytes_ == sum of parked_[i].bytes
  /// Every parked pointer not yet given back (those of parked_, and of a batch being flushed).
  std::unordered_set<void*> parked_ptrs_;
  std::size_t parked_bytes_ = 0;
};

void flush_at_exit() noexcept;

std::atomic<shim*> g_shim{nullptr};
std::mutex g_shim_mu;

/// The shim, created on the first intercepted call that finds a CUDA runtime; nullptr while
/// none can be found (that call fails with cudaErrorInitializationError; a later call, after
/// the program has loaded its runtime, looks again).
shim* the_shim() noexcept {
  if (shim* s = g_shim.load(std::memory_order_acquire)) [[likely]] {
    return s;
  }
  try {
    std::lock_guard lk(g_shim_mu);
    if (shim* s = g_shim.load(std::memory_order_acquire)) {
      return s;
    }
    auto* p = new shim(gact::device::next_cuda_api());  // never destroyed: exit handlers may still call us
    gact::stats::register_provider("preload", [p] { return p->stats_json(); });
    try {
      gact::stats::install_dump_triggers();
    } catch (std::exception const& e) {  // checked at load; only a path removed since lands here
      GACT_LOG_ERROR("gact preload: no stats dumps: {}", e.what());
    }
    // Registered after the dump trigger, so it runs before the exit dump.
    std::atexit(flush_at_exit);
    g_shim.store(p, std::memory_order_release);
    return p;
  } catch (...) {
    GACT_WARN_CAPPED(8, "gact preload: not active yet: {}", shim::what(std::current_exception()));
    return nullptr;
  }
}

/// Checked when the shim is loaded, before the program's main: a bad GACT_* value would
/// otherwise make every allocation fail later with a misleading out-of-memory. Writes the
/// reason to stderr directly (the logger's own level may be the bad setting) and stops.
__attribute__((constructor)) void check_settings_at_load() noexcept {
  std::string why;
  try {
    (void)gact::options::from_env();
    char const* path = std::getenv("GACT_STATS_PATH");
    if (path != nullptr) gact::stats::check_path(path, "GACT_STATS_PATH");
    return;
  } catch (std::exception const& e) {
    why = e.what();
  } catch (...) {
    why = "unknown error while reading the GACT_* settings";
  }
  std::string const msg = "gact preload (LD_PRELOAD=libgact_preload.so): " + why +
                          "\ngact preload: stopped before the program started; fix the setting, or unset it "
                          "(or LD_PRELOAD) to run without gact\n";
  [[maybe_unused]] ssize_t const n = ::write(STDERR_FILENO, msg.data(), msg.size());
  ::_exit(2);
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
  cudaError_t const err = s->free_block(devPtr, "cudaFree", [&](caching_allocator& owner) {
    try {
      s->park_locked(owner, devPtr);
    } catch (...) {
      // Could not park (no memory for the list): recycle synchronously instead.
      GACT_WARN_CAPPED(8, "gact preload: cudaFree({}) could not defer: {}", devPtr, shim::what(std::current_exception()));
      if (s->api().device_synchronize() != cudaSuccess) {
        (void)s->api().get_last_error();
        return cudaSuccess;  // leak the block rather than reuse it unsynchronized
      }
      owner.deallocate(devPtr);
    }
    return cudaSuccess;
  });
  if (err == cudaErrorNotSupported) {
    s->count().foreign_frees.fetch_add(1, std::memory_order_relaxed);
    return s->api().free(devPtr);
  }
  if (err == cudaSuccess) {
    s->count().free_calls.fetch_add(1, std::memory_order_relaxed);
  }
  return err;
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
  if (devPtr == nullptr) {
    return s->api().free_async(devPtr, hStream);
  }
  cudaStream_t const stream = hStream == cudaStreamLegacy ? nullptr : hStream;
  cudaError_t const err = s->free_block(devPtr, "cudaFreeAsync", [&](caching_allocator& owner) {
    try {
      if (hStream == cudaStreamPerThread || s->capturing(stream)) {
        // No stream handle gact can record an event on now: treat like cudaFree.
        s->park_locked(owner, devPtr);
      } else {
        owner.record_stream(devPtr, gact::device::to_handle(stream));  // no-op on the allocation stream
        owner.deallocate(devPtr);
      }
    } catch (...) {
      GACT_WARN_CAPPED(8, "gact preload: cudaFreeAsync({}) failed: {}", devPtr, shim::what(std::current_exception()));
      return cudaErrorInvalidValue;
    }
    return cudaSuccess;
  });
  if (err == cudaErrorNotSupported) {
    s->count().foreign_frees.fetch_add(1, std::memory_order_relaxed);
    return s->api().free_async(devPtr, hStream);
  }
  if (err == cudaSuccess) {
    s->count().free_async_calls.fetch_add(1, std::memory_order_relaxed);
  }
  return err;
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
