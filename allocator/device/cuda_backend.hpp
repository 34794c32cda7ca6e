// gact/allocator/device/cuda_backend.hpp
//
// The device backend over the CUDA runtime API: segments come from cudaMalloc,
// streams and events are cudaStream_t / cudaEvent_t (events created with
// cudaEventDisableTiming), copies are cudaMemcpyAsync with cudaMemcpyDefault.
// Every runtime call goes through a cuda_api table, so the same backend serves
// the normal build (direct_cuda_api()) and the LD_PRELOAD shim (next_cuda_api()).
//
// Each backend is bound to one device: calls that create or destroy device
// objects make that device current for their duration (device_guard) and
// restore the caller's device afterwards.
//
// Errors: a failing call throws gact::cuda_error (call text, file:line, CUDA
// error name and string); cudaErrorMemoryAllocation throws gact::out_of_memory,
// which the caching allocator answers by releasing cached segments and retrying.
// release() and the destroy functions never throw: failures are logged (capped).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <map>
#include <mutex>

#include "allocator/device/backend.hpp"
#include "allocator/device/cuda_api.hpp"

namespace gact::device {

class cuda_backend final : public backend {
 public:
  /// A backend for CUDA device `device` over the runtime calls in `api`.
  /// @param api must outlive the backend (the tables of cuda_api.hpp are static).
  /// @throws gact::invalid_argument when `device` is not in [0, cudaGetDeviceCount()).
  /// @throws gact::cuda_error when the device count cannot be read.
  explicit cuda_backend(int device, cuda_api const& api = direct_cuda_api());

  /// The device this backend allocates on.
  int device() const noexcept { return device_; }
  /// The runtime call table in use.
  cuda_api const& api() const noexcept { return api_; }

 private:
  void* do_reserve(std::size_t bytes) override;
  void do_release(void* p, std::size_t bytes) noexcept override;
  stream_t do_create_stream() override;
  void do_destroy_stream(stream_t s) noexcept override;
  event_t do_create_event() override;
  void do_destroy_event(event_t e) noexcept override;
  void do_record(event_t e, stream_t s) override;
  bool do_query(event_t e) override;
  void do_wait(stream_t s, event_t e) override;
  void do_synchronize(event_t e) override;
  void do_synchronize_stream(stream_t s) override;
  void do_copy_async(void* dst, void const* src, std::size_t bytes, stream_t s) override;
  mem_info do_memory_info() override;
  memory_kind do_kind() const noexcept override { return memory_kind::device; }
  std::string_view do_name() const noexcept override { return "cuda"; }
  std::size_t do_vm_page() const noexcept override { return vm_page_; }
  void* do_vm_reserve(std::size_t bytes) override;
  void do_vm_free(void* p, std::size_t bytes) noexcept override;
  void do_vm_map(void* p, std::size_t bytes) override;
  bool do_vm_unmap(void* p, std::size_t bytes) noexcept override;
  /// Resolve the driver's virtual memory calls; vm_page_ stays 0 (no expandable segments) where any is missing.
  void resolve_vm() noexcept;

  /// The driver's virtual memory calls (cudaGetDriverEntryPointByVersion), one physical allocation per page
  /// (so that any page can be unmapped and given back alone, as torch's expandable segments do).
  struct vm_calls {
    CUresult (*address_reserve)(CUdeviceptr*, std::size_t, std::size_t, CUdeviceptr, unsigned long long) = nullptr;
    CUresult (*address_free)(CUdeviceptr, std::size_t) = nullptr;
    CUresult (*create)(CUmemGenericAllocationHandle*, std::size_t, CUmemAllocationProp const*, unsigned long long) = nullptr;
    CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
    CUresult (*map)(CUdeviceptr, std::size_t, std::size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
    CUresult (*unmap)(CUdeviceptr, std::size_t) = nullptr;
    CUresult (*set_access)(CUdeviceptr, std::size_t, CUmemAccessDesc const*, std::size_t) = nullptr;
    CUresult (*granularity)(std::size_t*, CUmemAllocationProp const*, CUmemAllocationGranularity_flags) = nullptr;
  };

  cuda_api const& api_;
  int device_;
  vm_calls vm_{};
  std::size_t vm_page_ = 0;
  std::mutex vm_mu_;
  std::map<std::uintptr_t, CUmemGenericAllocationHandle> vm_pages_;  ///< mapped page -> its memory (under vm_mu_)
};

/// The stream handle of a cudaStream_t (0 for the legacy default stream).
inline stream_t to_handle(cudaStream_t s) noexcept { return reinterpret_cast<stream_t>(s); }
/// The cudaStream_t of a stream handle.
inline cudaStream_t to_cuda_stream(stream_t s) noexcept { return reinterpret_cast<cudaStream_t>(s); }
/// The cudaEvent_t of an event handle.
inline cudaEvent_t to_cuda_event(event_t e) noexcept { return reinterpret_cast<cudaEvent_t>(e); }

}  // namespace gact::device
