// gact/allocator/device/backend.hpp
//
// The one virtual boundary of gact: a device backend owns raw memory, streams,
// events and copies. The caching allocator calls it only when it creates or
// releases a segment (and for cross-stream events), never per allocation, so
// the virtual call costs nothing on the fast path.
//
// Backends:
//   host_backend        aligned host memory; streams run inline, events are always complete
//   cuda_backend        the CUDA runtime API (allocator/device/cuda_backend.hpp)
//   pinned_host_backend page-locked host memory for swap (cudaHostAlloc, or plain host memory)
// Tests add their own (asynchronous streams with random delays, fault injection).
//
// Handles are opaque integers: a stream handle is a cudaStream_t cast to
// std::uintptr_t on CUDA (0 is the legacy default stream); events likewise.
//
// Non-virtual public interface, virtual private implementation (NVI), as RMM's
// device_memory_resource: the public functions are where argument checks go.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace gact::device {

using stream_t = std::uintptr_t;  ///< opaque stream handle; 0 = default stream
using event_t = std::uintptr_t;   ///< opaque event handle

/// Where a backend's memory lives.
enum class memory_kind : std::uint8_t { host = 0, device = 1, pinned_host = 2 };

/// Free and total bytes as the backend sees them (cudaMemGetInfo on CUDA).
struct mem_info {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

class backend {
 public:
  virtual ~backend() = default;
  backend() = default;
  backend(backend const&) = delete;
  backend& operator=(backend const&) = delete;

  /// Obtain `bytes` (> 0) of raw memory, aligned to at least 512 bytes.
  /// @throws gact::out_of_memory when the device has no room; gact::cuda_error on other failures.
  void* reserve(std::size_t bytes) { return do_reserve(bytes); }
  /// Give back memory obtained from reserve(p, bytes). Never throws; failures are logged.
  void release(void* p, std::size_t bytes) noexcept { do_release(p, bytes); }

  /// @throws gact::cuda_error
  stream_t create_stream() { return do_create_stream(); }
  void destroy_stream(stream_t s) noexcept { do_destroy_stream(s); }
  /// @throws gact::cuda_error
  event_t create_event() { return do_create_event(); }
  void destroy_event(event_t e) noexcept { do_destroy_event(e); }

  /// Record `e` on `s`: it completes when all work queued on `s` so far has completed.
  void record(event_t e, stream_t s) { do_record(e, s); }
  /// True when `e` has completed (never blocks).
  bool query(event_t e) { return do_query(e); }
  /// Make future work on `s` wait for `e` (no host synchronization).
  void wait(stream_t s, event_t e) { do_wait(s, e); }
  /// Block the host until `e` has completed.
  void synchronize(event_t e) { do_synchronize(e); }
  /// Block the host until all work on `s` has completed.
  void synchronize_stream(stream_t s) { do_synchronize_stream(s); }
  /// Copy `bytes` from `src` to `dst` in the order of stream `s` (either side may be host or device).
  void copy_async(void* dst, void const* src, std::size_t bytes, stream_t s) {
    do_copy_async(dst, src, bytes, s);
  }

  /// Free and total memory of the device (host: physical memory).
  mem_info memory_info() { return do_memory_info(); }
  /// Where this backend's memory lives.
  memory_kind kind() const noexcept { return do_kind(); }
  /// Short name for logs and stats ("host", "cuda", "pinned_host", ...).
  std::string_view name() const noexcept { return do_name(); }

  // ---- virtual memory (expandable segments) -------------------------------------------------
  // A backend that can reserve address space apart from the memory behind it (CUDA's cuMemAddressReserve and
  // cuMemMap, the host's mmap and mprotect) lets the caching allocator grow one range per stream page by page
  // instead of reserving fixed segments. Backends without it answer vm_page() == 0 and never see the others.

  /// The mapping granularity in bytes (a power of two), or 0 when this backend has no virtual memory calls.
  std::size_t vm_page() const noexcept { return do_vm_page(); }
  /// Reserve `bytes` (a multiple of vm_page()) of address space with no memory behind it.
  /// @throws gact::out_of_memory when no such range is left; gact::cuda_error on other failures.
  void* vm_reserve(std::size_t bytes) { return do_vm_reserve(bytes); }
  /// The most address space one new range should take now, or 0 for no bound: the host's share of what a limit
  /// on the process's address space (`ulimit -v`) leaves, so that a range does not starve the rest of the
  /// process (more ranges are added as they fill). Never throws.
  std::size_t vm_reserve_hint() noexcept { return do_vm_reserve_hint(); }
  /// Give back a range from vm_reserve, whose pages must all be unmapped. Never throws; failures are logged.
  void vm_free(void* p, std::size_t bytes) noexcept { do_vm_free(p, bytes); }
  /// Put memory behind [p, p + bytes), page-aligned pages of a reserved range that are not mapped: readable
  /// and writable from the device (and from the host where the memory is the host's) once it returns.
  /// @throws gact::out_of_memory when the device has no room (nothing stays mapped); gact::cuda_error otherwise.
  void vm_map(void* p, std::size_t bytes) { do_vm_map(p, bytes); }
  /// Take the memory away from mapped pages [p, p + bytes) and give it back to the device, once the work that
  /// may still use them is done. Never throws; false (logged) when the pages stay mapped as they were (the
  /// device could not be waited for), and the caller keeps them as mapped.
  [[nodiscard]] bool vm_unmap(void* p, std::size_t bytes) noexcept { return do_vm_unmap(p, bytes); }

 private:
  virtual void* do_reserve(std::size_t bytes) = 0;
  virtual void do_release(void* p, std::size_t bytes) noexcept = 0;
  virtual stream_t do_create_stream() = 0;
  virtual void do_destroy_stream(stream_t s) noexcept = 0;
  virtual event_t do_create_event() = 0;
  virtual void do_destroy_event(event_t e) noexcept = 0;
  virtual void do_record(event_t e, stream_t s) = 0;
  virtual bool do_query(event_t e) = 0;
  virtual void do_wait(stream_t s, event_t e) = 0;
  virtual void do_synchronize(event_t e) = 0;
  virtual void do_synchronize_stream(stream_t s) = 0;
  virtual void do_copy_async(void* dst, void const* src, std::size_t bytes, stream_t s) = 0;
  virtual mem_info do_memory_info() = 0;
  virtual memory_kind do_kind() const noexcept = 0;
  virtual std::string_view do_name() const noexcept = 0;
  virtual std::size_t do_vm_page() const noexcept { return 0; }
  virtual void* do_vm_reserve(std::size_t bytes);
  virtual std::size_t do_vm_reserve_hint() noexcept { return 0; }
  virtual void do_vm_free(void* p, std::size_t bytes) noexcept;
  virtual void do_vm_map(void* p, std::size_t bytes);
  virtual bool do_vm_unmap(void* p, std::size_t bytes) noexcept;
};

}  // namespace gact::device
