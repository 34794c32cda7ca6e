// gact/allocator/device/cuda_backend.cpp
//
// cuda_backend: each backend operation is one or two runtime calls through the
// cuda_api table, checked with GACT_CUDA_TRY. Only segment-level operations
// come here (the caching allocator's fast path never calls the backend), so the
// device guard's extra cudaGetDevice per call costs nothing that matters.
//
// Device: calls that create device objects (memory, streams, events) and calls
// on a default-stream handle (0, cudaStreamLegacy, cudaStreamPerThread: "the
// current device's stream") run under a device_guard for the backend's device.
// Without it, recording one of the backend's events on stream 0 while another
// device is current fails with cudaErrorInvalidResourceHandle. Calls on an
// explicit stream or event need no guard: the handle names its device.
#include "allocator/device/cuda_backend.hpp"

#include <algorithm>
#include <optional>
#include <string>
#include <type_traits>

#include "allocator/device/device_guard.hpp"
#include "allocator/error.hpp"
#include "allocator/log.hpp"

namespace gact::device {

namespace {
/// Device `device` made current when `s` is a default-stream handle (see the file comment).
struct default_stream_guard {
  std::optional<device_guard> guard;
  default_stream_guard(cuda_api const& api, int device, stream_t s) {
    if (is_current_device_stream(to_cuda_stream(s))) {
      guard.emplace(api, device);
    }
  }
};
}  // namespace

cuda_backend::cuda_backend(int device, cuda_api const& api) : api_(api), device_(device) {
  int count = 0;
  GACT_CUDA_TRY(api_, api_.get_device_count(&count));
  GACT_EXPECTS(device >= 0 && device < count,
               "cuda_backend: device " + std::to_string(device) + " does not exist (" +
                   std::to_string(count) + " CUDA devices)");
  resolve_vm();
}

// ---- virtual memory (expandable segments) ----------------------------------------

namespace {

CUmemAllocationProp page_prop(int device) noexcept {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

/// The typed error of a failed driver call: out_of_memory for CUDA_ERROR_OUT_OF_MEMORY.
[[noreturn]] void throw_driver(CUresult r, char const* call, int device) {
  std::string msg = std::string("gact: ") + call + " on device " + std::to_string(device) + " failed: CUresult " +
                    std::to_string(static_cast<int>(r));
  if (r == CUDA_ERROR_OUT_OF_MEMORY) throw out_of_memory(msg + " (CUDA_ERROR_OUT_OF_MEMORY)");
  throw cuda_error(msg);
}

}  // namespace

void cuda_backend::resolve_vm() noexcept {
  if (api_.get_driver_entry_point == nullptr) return;
  vm_calls v;
  bool ok = true;
  auto const get = [&](char const* name, auto& slot) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (api_.get_driver_entry_point(name, &fn, 12000, cudaEnableDefault, &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess || fn == nullptr) {
      (void)api_.get_last_error();
      ok = false;
      return;
    }
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(fn);
  };
  get("cuMemAddressReserve", v.address_reserve);
  get("cuMemAddressFree", v.address_free);
  get("cuMemCreate", v.create);
  get("cuMemRelease", v.release);
  get("cuMemMap", v.map);
  get("cuMemUnmap", v.unmap);
  get("cuMemSetAccess", v.set_access);
  get("cuMemGetAllocationGranularity", v.granularity);
  if (!ok) return;
  CUmemAllocationProp const prop = page_prop(device_);
  std::size_t g = 0;
  if (v.granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || g == 0 || (g & (g - 1)) != 0) return;
  vm_ = v;
  vm_page_ = std::max<std::size_t>(g, std::size_t{2} << 20);  // (torch's page too: fewer handles, same layout)
}

void* cuda_backend::do_vm_reserve(std::size_t bytes) {
  GACT_EXPECTS(vm_page_ != 0 && bytes > 0 && bytes % vm_page_ == 0,
               "cuda_backend::vm_reserve: a positive multiple of the page is required");
  device_guard const guard(api_, device_);
  CUdeviceptr p = 0;
  if (CUresult const r = vm_.address_reserve(&p, bytes, vm_page_, 0, 0); r != CUDA_SUCCESS) {
    throw_driver(r, "cuMemAddressReserve", device_);
  }
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
}

void cuda_backend::do_vm_free(void* p, std::size_t bytes) noexcept {
  if (p == nullptr) return;
  if (CUresult const r = vm_.address_free(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)), bytes);
      r != CUDA_SUCCESS) {
    GACT_WARN_CAPPED(8, "gact: cuMemAddressFree({}, {}) on device {} failed: CUresult {}", p, bytes, device_,
                     static_cast<int>(r));
  }
}

void cuda_backend::do_vm_map(void* p, std::size_t bytes) {
  auto const base = reinterpret_cast<std::uintptr_t>(p);
  GACT_EXPECTS(vm_page_ != 0 && p != nullptr && bytes > 0 && bytes % vm_page_ == 0 && base % vm_page_ == 0,
               "cuda_backend::vm_map: a page-aligned range of whole pages is required");
  device_guard const guard(api_, device_);
  CUmemAllocationProp const prop = page_prop(device_);
  std::lock_guard<std::mutex> lock(vm_mu_);
  std::size_t done = 0;
  auto const undo = [&] {  // (what this call mapped before a failure goes back)
    for (std::size_t off = 0; off < done; off += vm_page_) {
      auto const it = vm_pages_.find(base + off);
      (void)vm_.unmap(static_cast<CUdeviceptr>(base + off), vm_page_);
      (void)vm_.release(it->second);
      vm_pages_.erase(it);
    }
  };
  for (; done < bytes; done += vm_page_) {
    CUmemGenericAllocationHandle h{};
    if (CUresult const r = vm_.create(&h, vm_page_, &prop, 0); r != CUDA_SUCCESS) {
      undo();
      throw_driver(r, "cuMemCreate", device_);
    }
    if (CUresult const r = vm_.map(static_cast<CUdeviceptr>(base + done), vm_page_, 0, h, 0); r != CUDA_SUCCESS) {
      (void)vm_.release(h);
      undo();
      throw_driver(r, "cuMemMap", device_);
    }
    try {
      vm_pages_.emplace(base + done, h);
    } catch (...) {
      (void)vm_.unmap(static_cast<CUdeviceptr>(base + done), vm_page_);
      (void)vm_.release(h);
      undo();
      throw;
    }
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (CUresult const r = vm_.set_access(static_cast<CUdeviceptr>(base), bytes, &access, 1); r != CUDA_SUCCESS) {
    undo();
    throw_driver(r, "cuMemSetAccess", device_);
  }
}

bool cuda_backend::do_vm_unmap(void* p, std::size_t bytes) noexcept {
  auto const base = reinterpret_cast<std::uintptr_t>(p);
  {
    // Unlike cudaFree, cuMemUnmap and cuMemRelease do not wait for the kernels that may still read the pages (a
    // block freed on its own stream is reused in that stream's order, with no event): wait for the device first;
    // where it cannot be waited for (a graph capture in progress, a device error), the pages stay mapped.
    device_guard const guard(api_, device_);
    if (cudaError_t const err = api_.device_synchronize(); err != cudaSuccess) {
      (void)api_.get_last_error();
      GACT_WARN_CAPPED(8, "gact: cudaDeviceSynchronize before unmapping {} bytes at {} on device {} failed: {}; "
                       "the pages stay mapped", bytes, p, device_, api_.get_error_name(err));
      return false;
    }
  }
  std::lock_guard<std::mutex> lock(vm_mu_);
  for (std::size_t off = 0; off < bytes; off += vm_page_) {
    auto const it = vm_pages_.find(base + off);
    if (it == vm_pages_.end()) {
      GACT_WARN_CAPPED(8, "gact: vm_unmap of {:#x} on device {}: not a mapped page (ignored)", base + off, device_);
      continue;
    }
    // (a page the driver refuses to unmap is dropped all the same: the allocator counts it unmapped from here)
    CUresult const u = vm_.unmap(static_cast<CUdeviceptr>(base + off), vm_page_);
    CUresult const r = vm_.release(it->second);
    if (u != CUDA_SUCCESS || r != CUDA_SUCCESS) {
      GACT_WARN_CAPPED(8, "gact: unmapping page {:#x} on device {} failed: CUresult {} / {}", base + off, device_,
                       static_cast<int>(u), static_cast<int>(r));
    }
    vm_pages_.erase(it);
  }
  return true;
}

void* cuda_backend::do_reserve(std::size_t bytes) {
  GACT_EXPECTS(bytes > 0, "cuda_backend::reserve: size must be positive");
  device_guard const guard(api_, device_);
  void* p = nullptr;
  GACT_CUDA_TRY(api_, api_.malloc(&p, bytes));
  return p;
}

void cuda_backend::do_release(void* p, std::size_t bytes) noexcept {
  if (p == nullptr) {
    return;
  }
  // cudaFree needs no particular current device (the pointer identifies it).
  cudaError_t const err = api_.free(p);
  if (err != cudaSuccess) {
    (void)api_.get_last_error();
    GACT_WARN_CAPPED(16, "gact: cudaFree({}, {} bytes) on device {} failed: {} ({})", p, bytes,
                     device_, api_.get_error_name(err), api_.get_error_string(err));
  }
}

stream_t cuda_backend::do_create_stream() {
  device_guard const guard(api_, device_);
  cudaStream_t s = nullptr;
  GACT_CUDA_TRY(api_, api_.stream_create_with_flags(&s, cudaStreamNonBlocking));
  return to_handle(s);
}

void cuda_backend::do_destroy_stream(stream_t s) noexcept {
  if (s == 0) {
    return;  // the default stream is not ours to destroy
  }
  cudaError_t const err = api_.stream_destroy(to_cuda_stream(s));
  if (err != cudaSuccess) {
    (void)api_.get_last_error();
    GACT_WARN_CAPPED(8, "gact: cudaStreamDestroy failed: {}", api_.get_error_name(err));
  }
}

event_t cuda_backend::do_create_event() {
  device_guard const guard(api_, device_);
  cudaEvent_t e = nullptr;
  GACT_CUDA_TRY(api_, api_.event_create_with_flags(&e, cudaEventDisableTiming));
  return reinterpret_cast<event_t>(e);
}

void cuda_backend::do_destroy_event(event_t e) noexcept {
  if (e == 0) {
    return;
  }
  cudaError_t const err = api_.event_destroy(to_cuda_event(e));
  if (err != cudaSuccess) {
    (void)api_.get_last_error();
    GACT_WARN_CAPPED(8, "gact: cudaEventDestroy failed: {}", api_.get_error_name(err));
  }
}

void cuda_backend::do_record(event_t e, stream_t s) {
  default_stream_guard const guard(api_, device_, s);
  GACT_CUDA_TRY(api_, api_.event_record(to_cuda_event(e), to_cuda_stream(s)));
}

bool cuda_backend::do_query(event_t e) {
  cudaError_t const err = api_.event_query(to_cuda_event(e));
  if (err == cudaSuccess) {
    return true;
  }
  if (err == cudaErrorNotReady) {
    (void)api_.get_last_error();  // "not ready" is an answer, not a failure
    return false;
  }
  detail::throw_cuda_error(api_, err, "api_.event_query(to_cuda_event(e))", __FILE__, __LINE__);
}

void cuda_backend::do_wait(stream_t s, event_t e) {
  default_stream_guard const guard(api_, device_, s);
  GACT_CUDA_TRY(api_, api_.stream_wait_event(to_cuda_stream(s), to_cuda_event(e), 0));
}

void cuda_backend::do_synchronize(event_t e) {
  GACT_CUDA_TRY(api_, api_.event_synchronize(to_cuda_event(e)));
}

void cuda_backend::do_synchronize_stream(stream_t s) {
  default_stream_guard const guard(api_, device_, s);
  GACT_CUDA_TRY(api_, api_.stream_synchronize(to_cuda_stream(s)));
}

void cuda_backend::do_copy_async(void* dst, void const* src, std::size_t bytes, stream_t s) {
  if (bytes == 0) {
    return;
  }
  default_stream_guard const guard(api_, device_, s);
  GACT_CUDA_TRY(api_, api_.memcpy_async(dst, src, bytes, cudaMemcpyDefault, to_cuda_stream(s)));
}

mem_info cuda_backend::do_memory_info() {
  device_guard const guard(api_, device_);
  mem_info info;
  GACT_CUDA_TRY(api_, api_.mem_get_info(&info.free_bytes, &info.total_bytes));
  return info;
}

}  // namespace gact::device
