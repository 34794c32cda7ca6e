// gact/allocator/device/pinned_host_backend.hpp
//
// Page-locked host memory for the swap pool: segments come from cudaHostAlloc
// and go back with cudaFreeHost, so copies between them and the device run at
// full PCIe/NVLink speed and asynchronously. The swap pool is an ordinary
// caching_allocator over this backend (memory_kind::pinned_host).
//
// Streams, events and copies are those of the CUDA device the backend is bound
// to (a pinned buffer is filled and drained by that device's copy streams), so
// everything but reserve/release/memory_info is delegated to a cuda_backend.
// memory_info reports the host's physical memory (sysconf), since pinned memory
// is taken from it.
#pragma once

#include "allocator/device/cuda_backend.hpp"

namespace gact::device {

class pinned_host_backend final : public backend {
 public:
  /// Pinned memory used with CUDA device `device` through `api`.
  /// @throws gact::invalid_argument for a device that does not exist.
  explicit pinned_host_backend(int device = 0, cuda_api const& api = direct_cuda_api());

 private:
  void* do_reserve(std::size_t bytes) override;
  void do_release(void* p, std::size_t bytes) noexcept override;
  stream_t do_create_stream() override { return device_.create_stream(); }
  void do_destroy_stream(stream_t s) noexcept override { device_.destroy_stream(s); }
  event_t do_create_event() override { return device_.create_event(); }
  void do_destroy_event(event_t e) noexcept override { device_.destroy_event(e); }
  void do_record(event_t e, stream_t s) override { device_.record(e, s); }
  bool do_query(event_t e) override { return device_.query(e); }
  void do_wait(stream_t s, event_t e) override { device_.wait(s, e); }
  void do_synchronize(event_t e) override { device_.synchronize(e); }
  void do_synchronize_stream(stream_t s) override { device_.synchronize_stream(s); }
  void do_copy_async(void* dst, void const* src, std::size_t bytes, stream_t s) override {
    device_.copy_async(dst, src, bytes, s);
  }
  mem_info do_memory_info() override;
  memory_kind do_kind() const noexcept override { return memory_kind::pinned_host; }
  std::string_view do_name() const noexcept override { return "pinned_host"; }

  cuda_backend device_;  ///< streams, events and copies of the bound device
};

}  // namespace gact::device
