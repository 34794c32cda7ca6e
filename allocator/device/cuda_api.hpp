// gact/allocator/device/cuda_api.hpp
//
// The CUDA runtime calls gact makes, as one table of function pointers. Every
// runtime call in gact's host code goes through a `cuda_api`, never through the
// global symbol, because the same code runs in two settings:
//
//   * the normal build (libgact.so, the Python module, tools): the table holds
//     `&cudaMalloc`, ... (`direct_cuda_api()`, defined in cuda_api_direct.cpp,
//     the only translation unit that names the runtime's symbols, so only
//     targets that link libcudart pull it in);
//   * the LD_PRELOAD shim (libgact_preload.so): the process's own `cudaMalloc`
//     is the shim's, so the table is filled with `dlsym(RTLD_NEXT, ...)`
//     (`next_cuda_api()`), i.e. the runtime loaded after the shim.
//
// GACT_CUDA_TRY(api, call) turns a failing call into a typed error carrying the
// call text, file:line and the runtime's error name and string;
// cudaErrorMemoryAllocation becomes gact::out_of_memory (after the sticky
// last-error state has been cleared), everything else gact::cuda_error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include "allocator/device/device_guard.hpp"

namespace gact::device {

/// The runtime entry points gact uses. Invariant: every member but
/// get_driver_entry_point is non-null in a table returned by direct_cuda_api() or
/// next_cuda_api().
struct cuda_api {
  cudaError_t (*malloc)(void**, std::size_t);
  cudaError_t (*free)(void*);
  cudaError_t (*malloc_async)(void**, std::size_t, cudaStream_t);
  cudaError_t (*free_async)(void*, cudaStream_t);
  cudaError_t (*mem_get_info)(std::size_t*, std::size_t*);
  cudaError_t (*get_device)(int*);
  cudaError_t (*set_device)(int);
  cudaError_t (*get_device_count)(int*);
  cudaError_t (*stream_create_with_flags)(cudaStream_t*, unsigned int);
  cudaError_t (*stream_destroy)(cudaStream_t);
  cudaError_t (*stream_synchronize)(cudaStream_t);
  cudaError_t (*stream_wait_event)(cudaStream_t, cudaEvent_t, unsigned int);
  cudaError_t (*stream_is_capturing)(cudaStream_t, cudaStreamCaptureStatus*);
  cudaError_t (*event_create_with_flags)(cudaEvent_t*, unsigned int);
  cudaError_t (*event_destroy)(cudaEvent_t);
  cudaError_t (*event_record)(cudaEvent_t, cudaStream_t);
  cudaError_t (*event_query)(cudaEvent_t);
  cudaError_t (*event_synchronize)(cudaEvent_t);
  cudaError_t (*memcpy_async)(void*, void const*, std::size_t, cudaMemcpyKind, cudaStream_t);
  cudaError_t (*host_alloc)(void**, std::size_t, unsigned int);
  cudaError_t (*free_host)(void*);
  cudaError_t (*device_synchronize)();
  cudaError_t (*get_last_error)();
  char const* (*get_error_name)(cudaError_t);
  char const* (*get_error_string)(cudaError_t);
  /// cudaGetDriverEntryPointByVersion (CUDA 12.5 and later): the driver's virtual memory calls for expandable
  /// segments. The one optional entry: null where the runtime has none (no expandable segments then).
  cudaError_t (*get_driver_entry_point)(char const*, void**, unsigned int, unsigned long long,
                                        cudaDriverEntryPointQueryResult*);
};

/// The table of the runtime this binary links (`&cudaMalloc`, ...). Defined in
/// cuda_api_direct.cpp; using it requires linking libcudart (or the test fake).
cuda_api const& direct_cuda_api() noexcept;

/// The table of the runtime found *after* the calling object in the symbol
/// search order (`dlsym(RTLD_NEXT, name)` for each entry), or else of a runtime the
/// process has loaded privately (dlopen of libcudart.so.13, .12, ... with RTLD_NOLOAD).
/// Resolved once it succeeds; a failure is not cached. Used by the LD_PRELOAD shim, whose
/// own cudaMalloc must not be called.
/// @throws gact::cuda_error naming the first symbol that could not be found
///         (no CUDA runtime loaded in the process yet).
cuda_api const& next_cuda_api();

namespace detail {
/// Raise the typed error for a failed call (see GACT_CUDA_TRY). Clears the
/// runtime's last-error state first, so that a later unrelated call does not
/// see this failure again.
/// @throws gact::out_of_memory for cudaErrorMemoryAllocation, gact::cuda_error otherwise.
[[noreturn]] void throw_cuda_error(cuda_api const& api, cudaError_t err, char const* call,
                                   char const* file, int line);
/// The message of such an error: "`call` failed at file:line: cudaErrorX (string)".
std::string cuda_error_message(cuda_api const& api, cudaError_t err, char const* call,
                               char const* file, int line);
}  // namespace detail

}  // namespace gact::device

/// Evaluate `call` (an expression of type cudaError_t that uses `api`) and throw
/// gact::out_of_memory / gact::cuda_error when it does not return cudaSuccess.
/// Usage: GACT_CUDA_TRY(api_, api_.malloc(&p, bytes));
#define GACT_CUDA_TRY(api, call)                                                        \
  do {                                                                                  \
    cudaError_t const gact_cuda_err_ = (call);                                          \
    if (gact_cuda_err_ != cudaSuccess) [[unlikely]] {                                   \
      ::gact::device::detail::throw_cuda_error((api), gact_cuda_err_, #call, __FILE__,  \
                                               __LINE__);                               \
    }                                                                                   \
  } while (0)
