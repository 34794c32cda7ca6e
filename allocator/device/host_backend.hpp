// gact/allocator/device/host_backend.hpp
//
// The host backend: device::backend over ordinary host memory. It is a real
// feature (activation compression for CPU training, a capped host pool) and the
// backend every layer above the device is tested on where no GPU exists.
//
// Memory: segments of at least k_mmap_threshold bytes come from anonymous
// mmap (page aligned, MAP_NORESERVE), so untouched pages cost no physical
// memory; smaller ones from aligned_alloc with k_alignment. Streams run inline:
// copy_async is a memmove done before it returns, so every event is complete
// as soon as it is recorded and synchronization never waits.
//
// Virtual memory (expandable segments): vm_reserve takes address space only
// (PROT_NONE), vm_map makes part of it writable (charged against the kernel's
// overcommit limit then, and counted against the capacity as a reserve is),
// vm_unmap gives the pages' memory back to the system at once (MADV_DONTNEED:
// they read as zeros when touched again) and leaves them writable, so that
// holes never split the kernel's mapping (at most vm.max_map_count pieces per
// process). Pages are k_vm_page bytes by default, CUDA's granularity, so that
// the allocator's tests here see the layout a GPU gets.
//
// An optional capacity turns the backend into a bounded pool: a reserve that
// would take the bytes reserved past the capacity throws gact::out_of_memory,
// which is how tests drive the caching allocator's release-and-retry path.
//
// Thread-safe: the only shared state is atomic.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "allocator/device/backend.hpp"

namespace gact::device {

class host_backend final : public backend {
 public:
  /// Every pointer reserve() returns is aligned to this many bytes.
  static constexpr std::size_t k_alignment = 512;
  /// Requests of at least this size are served by mmap (page-aligned, lazily backed).
  static constexpr std::size_t k_mmap_threshold = std::size_t{256} << 10;

  /// The default page of the virtual-memory calls (vm_page()): CUDA's granularity.
  static constexpr std::size_t k_vm_page = std::size_t{2} << 20;

  /// @param capacity bytes that may be reserved at once; 0 = no cap beyond what the OS gives.
  /// @param vm_page the page of the virtual-memory calls: a power of two of at least 4 KiB (the host arena
  ///        uses a smaller one than a GPU's, so that a memory limit and a release work at a finer grain).
  /// @throws gact::invalid_argument for a bad vm_page.
  explicit host_backend(std::size_t capacity = 0, std::size_t vm_page = k_vm_page);

  /// vm_reserve_hint() under an address-space limit of `limit` bytes with `used` bytes of it taken: an eighth of
  /// the headroom, in whole pages, at least one page.
  static std::size_t reserve_hint_for(std::size_t limit, std::size_t used, std::size_t page) noexcept;
  ~host_backend() override = default;

  /// The cap given at construction (0 = none).
  std::size_t capacity() const noexcept { return capacity_; }
  /// Bytes currently reserved and not yet released.
  std::size_t reserved_bytes() const noexcept { return reserved_.load(std::memory_order_relaxed); }

  /// Fault injection for tests: after `after` more successful reserves (or vm_maps), the next `count` throw
  /// gact::out_of_memory ("injected"); count 0 turns it off.
  void fail_reserves(int after, int count) noexcept {
    fault_after_.store(after, std::memory_order_relaxed);
    fault_count_.store(count, std::memory_order_relaxed);
  }

 private:
  void* do_reserve(std::size_t bytes) override;
  void do_release(void* p, std::size_t bytes) noexcept override;
  stream_t do_create_stream() override;
  void do_destroy_stream(stream_t) noexcept override {}
  event_t do_create_event() override;
  void do_destroy_event(event_t) noexcept override {}
  void do_record(event_t, stream_t) override {}
  bool do_query(event_t) override { return true; }
  void do_wait(stream_t, event_t) override {}
  void do_synchronize(event_t) override {}
  void do_synchronize_stream(stream_t) override {}
  void do_copy_async(void* dst, void const* src, std::size_t bytes, stream_t s) override;
  mem_info do_memory_info() override;
  memory_kind do_kind() const noexcept override { return memory_kind::host; }
  std::string_view do_name() const noexcept override { return "host"; }
  std::size_t do_vm_page() const noexcept override { return vm_page_; }
  void* do_vm_reserve(std::size_t bytes) override;
  std::size_t do_vm_reserve_hint() noexcept override;
  void do_vm_free(void* p, std::size_t bytes) noexcept override;
  void do_vm_map(void* p, std::size_t bytes) override;
  bool do_vm_unmap(void* p, std::size_t bytes) noexcept override;
  /// Count `bytes` against the capacity (and the injected faults); throws out_of_memory naming `what`.
  std::size_t claim(std::size_t bytes, char const* what);

  std::size_t const capacity_;
  std::size_t const vm_page_;
  std::atomic<std::size_t> reserved_{0};      // sum of the sizes of live reservations
  std::atomic<std::uintptr_t> next_handle_{1};  // streams and events; 0 is the default stream
  std::atomic<int> fault_after_{0};             // fail_reserves
  std::atomic<int> fault_count_{0};
};

}  // namespace gact::device
