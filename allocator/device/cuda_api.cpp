// gact/allocator/device/cuda_api.cpp
//
// The parts of the runtime call table that do not name the runtime's symbols:
// resolution through dlsym(RTLD_NEXT, ...) for the LD_PRELOAD shim, the device
// guard, and the translation of a failed call into gact's typed errors. This
// file must never call a CUDA runtime function directly: in the shim, the
// process's `cudaMalloc` is the shim itself.
#include "allocator/device/cuda_api.hpp"

#include <dlfcn.h>

#include <mutex>
#include <string>

#include "allocator/error.hpp"
#include "allocator/log.hpp"

namespace gact::device {

namespace {

template <class Fn>
void resolve_next(Fn& slot, char const* name) {
  void* sym = ::dlsym(RTLD_NEXT, name);
  if (sym == nullptr) {
    char const* why = ::dlerror();
    GACT_FAIL(std::string("CUDA runtime symbol ") + name +
                  " not found after the preload shim (is libcudart loaded?): " +
                  (why != nullptr ? why : "no error text"),
              ::gact::cuda_error);
  }
  slot = reinterpret_cast<Fn>(sym);
}

cuda_api resolve_next_table() {
  cuda_api t{};
  resolve_next(t.malloc, "cudaMalloc");
  resolve_next(t.free, "cudaFree");
  resolve_next(t.malloc_async, "cudaMallocAsync");
  resolve_next(t.free_async, "cudaFreeAsync");
  resolve_next(t.mem_get_info, "cudaMemGetInfo");
  resolve_next(t.get_device, "cudaGetDevice");
  resolve_next(t.set_device, "cudaSetDevice");
  resolve_next(t.get_device_count, "cudaGetDeviceCount");
  resolve_next(t.stream_create_with_flags, "cudaStreamCreateWithFlags");
  resolve_next(t.stream_destroy, "cudaStreamDestroy");
  resolve_next(t.stream_synchronize, "cudaStreamSynchronize");
  resolve_next(t.stream_wait_event, "cudaStreamWaitEvent");
  resolve_next(t.stream_is_capturing, "cudaStreamIsCapturing");
  resolve_next(t.event_create_with_flags, "cudaEventCreateWithFlags");
  resolve_next(t.event_destroy, "cudaEventDestroy");
  resolve_next(t.event_record, "cudaEventRecord");
  resolve_next(t.event_query, "cudaEventQuery");
  resolve_next(t.event_synchronize, "cudaEventSynchronize");
  resolve_next(t.memcpy_async, "cudaMemcpyAsync");
  resolve_next(t.host_alloc, "cudaHostAlloc");
  resolve_next(t.free_host, "cudaFreeHost");
  resolve_next(t.device_synchronize, "cudaDeviceSynchronize");
  resolve_next(t.get_last_error, "cudaGetLastError");
  resolve_next(t.get_error_name, "cudaGetErrorName");
  resolve_next(t.get_error_string, "cudaGetErrorString");
  return t;
}

}  // namespace

cuda_api const& next_cuda_api() {
  // A function-local static: resolution is retried on the next call if it threw.
  static cuda_api const table = resolve_next_table();
  return table;
}

device_guard::device_guard(cuda_api const& api, int device) : api_(api) {
  if (device < 0) {
    return;  // no device: nothing to make current
  }
  int current = -1;
  GACT_CUDA_TRY(api_, api_.get_device(&current));
  if (current != device) {
    GACT_CUDA_TRY(api_, api_.set_device(device));
    previous_ = current;
  }
}

device_guard::~device_guard() {
  if (previous_ >= 0) {
    cudaError_t const err = api_.set_device(previous_);
    if (err != cudaSuccess) {
      (void)api_.get_last_error();
      GACT_WARN_CAPPED(8, "gact: could not restore CUDA device {}: {}", previous_,
                       api_.get_error_name(err));
    }
  }
}

namespace detail {

std::string cuda_error_message(cuda_api const& api, cudaError_t err, char const* call,
                               char const* file, int line) {
  char const* name = api.get_error_name != nullptr ? api.get_error_name(err) : nullptr;
  char const* text = api.get_error_string != nullptr ? api.get_error_string(err) : nullptr;
  std::string msg = "CUDA call `";
  msg += call;
  msg += "` failed at ";
  msg += file;
  msg += ':';
  msg += std::to_string(line);
  msg += ": ";
  msg += name != nullptr ? name : "cudaError";
  msg += " (";
  msg += std::to_string(static_cast<int>(err));
  msg += ": ";
  msg += text != nullptr ? text : "no description";
  msg += ')';
  return msg;
}

void throw_cuda_error(cuda_api const& api, cudaError_t err, char const* call, char const* file,
                      int line) {
  // Clear the runtime's last-error state so the failure is not reported again by an
  // unrelated later call (sticky errors stay; clearing them is harmless).
  if (api.get_last_error != nullptr) {
    (void)api.get_last_error();
  }
  std::string msg = cuda_error_message(api, err, call, file, line);
  if (err == cudaErrorMemoryAllocation) {
    throw ::gact::out_of_memory(std::move(msg));
  }
  throw ::gact::cuda_error(std::move(msg));
}

}  // namespace detail

}  // namespace gact::device
