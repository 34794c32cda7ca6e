// gact/allocator/device/pinned_host_backend.cpp
//
// pinned_host_backend: cudaHostAlloc / cudaFreeHost segments; the rest is the
// bound device's cuda_backend.
#include "allocator/device/pinned_host_backend.hpp"

#include <unistd.h>

#include "allocator/error.hpp"
#include "allocator/log.hpp"

namespace gact::device {

pinned_host_backend::pinned_host_backend(int device, cuda_api const& api) : device_(device, api) {}

void* pinned_host_backend::do_reserve(std::size_t bytes) {
  GACT_EXPECTS(bytes > 0, "pinned_host_backend::reserve: size must be positive");
  cuda_api const& api = device_.api();
  device_guard const guard(api, device_.device());
  void* p = nullptr;
  // Portable: usable from every device's streams, not only the bound one.
  GACT_CUDA_TRY(api, api.host_alloc(&p, bytes, cudaHostAllocPortable));
  return p;
}

void pinned_host_backend::do_release(void* p, std::size_t bytes) noexcept {
  if (p == nullptr) {
    return;
  }
  cuda_api const& api = device_.api();
  cudaError_t const err = api.free_host(p);
  if (err != cudaSuccess) {
    (void)api.get_last_error();
    GACT_WARN_CAPPED(16, "gact: cudaFreeHost({}, {} bytes) failed: {} ({})", p, bytes,
                     api.get_error_name(err), api.get_error_string(err));
  }
}

mem_info pinned_host_backend::do_memory_info() {
  long const pages = ::sysconf(_SC_PHYS_PAGES);
  long const avail = ::sysconf(_SC_AVPHYS_PAGES);
  long const page = ::sysconf(_SC_PAGESIZE);
  mem_info info;
  if (pages > 0 && page > 0) {
    info.total_bytes = static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
    info.free_bytes = avail > 0 ? static_cast<std::size_t>(avail) * static_cast<std::size_t>(page) : 0;
  }
  return info;
}

}  // namespace gact::device
