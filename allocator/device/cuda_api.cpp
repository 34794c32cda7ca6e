// gact/allocator/device/cuda_api.cpp
//
// The parts of the runtime call table that do not name the runtime's symbols:
// resolution through dlsym(RTLD_NEXT, ...) for the LD_PRELOAD shim, the device
// guard, and the translation of a failed call into gact's typed errors.
// dlsym(RTLD_NEXT) finds the runtime only when it is in the global scope; a runtime
// brought in by a library loaded with RTLD_LOCAL (Python loads torch that way) is found
// by its soname with dlopen(RTLD_NOLOAD), which never loads anything new. This
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

/// Fill `slot` with `name` from `handle` (RTLD_NEXT or a library handle). @returns false when missing.
template <class Fn>
bool resolve(void* handle, Fn& slot, char const* name) {
  void* sym = ::dlsym(handle, name);
  if (sym == nullptr) {
    (void)::dlerror();
    return false;
  }
  slot = reinterpret_cast<Fn>(sym);
  return true;
}

/// Every entry of the table from `handle`; nullptr-free on success.
/// @returns the name of the first symbol missing, or nullptr when all were found.
char const* resolve_table(void* handle, cuda_api& t) {
#define GACT_RESOLVE(member, name) \
  if (!resolve(handle, t.member, name)) return name;
  GACT_RESOLVE(malloc, "cudaMalloc")
  GACT_RESOLVE(free, "cudaFree")
  GACT_RESOLVE(malloc_async, "cudaMallocAsync")
  GACT_RESOLVE(free_async, "cudaFreeAsync")
  GACT_RESOLVE(mem_get_info, "cudaMemGetInfo")
  GACT_RESOLVE(get_device, "cudaGetDevice")
  GACT_RESOLVE(set_device, "cudaSetDevice")
  GACT_RESOLVE(get_device_count, "cudaGetDeviceCount")
  GACT_RESOLVE(stream_create_with_flags, "cudaStreamCreateWithFlags")
  GACT_RESOLVE(stream_destroy, "cudaStreamDestroy")
  GACT_RESOLVE(stream_synchronize, "cudaStreamSynchronize")
  GACT_RESOLVE(stream_wait_event, "cudaStreamWaitEvent")
  GACT_RESOLVE(stream_is_capturing, "cudaStreamIsCapturing")
  GACT_RESOLVE(event_create_with_flags, "cudaEventCreateWithFlags")
  GACT_RESOLVE(event_destroy, "cudaEventDestroy")
  GACT_RESOLVE(event_record, "cudaEventRecord")
  GACT_RESOLVE(event_query, "cudaEventQuery")
  GACT_RESOLVE(event_synchronize, "cudaEventSynchronize")
  GACT_RESOLVE(memcpy_async, "cudaMemcpyAsync")
  GACT_RESOLVE(host_alloc, "cudaHostAlloc")
  GACT_RESOLVE(free_host, "cudaFreeHost")
  GACT_RESOLVE(device_synchronize, "cudaDeviceSynchronize")
  GACT_RESOLVE(get_last_error, "cudaGetLastError")
  GACT_RESOLVE(get_error_name, "cudaGetErrorName")
  GACT_RESOLVE(get_error_string, "cudaGetErrorString")
#undef GACT_RESOLVE
  (void)resolve(handle, t.get_driver_entry_point, "cudaGetDriverEntryPointByVersion");  // optional
  return nullptr;
}

/// Sonames of the CUDA runtime, newest first, tried when the runtime is not in the global
/// scope (a library loaded with RTLD_LOCAL, as Python loads torch, brought it in).
constexpr char const* k_runtime_sonames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0",
                                             "libcudart.so"};

cuda_api resolve_next_table() {
  cuda_api t{};
  char const* missing = resolve_table(RTLD_NEXT, t);
  if (missing == nullptr) return t;
  for (char const* soname : k_runtime_sonames) {
    // RTLD_NOLOAD: only a runtime the process has loaded already, never a new one. The
    // reference taken here is kept: the table points into that library from now on.
    void* h = ::dlopen(soname, RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) {
      (void)::dlerror();
      continue;
    }
    cuda_api u{};
    if (resolve_table(h, u) == nullptr) return u;
    ::dlclose(h);
  }
  GACT_FAIL(std::string("CUDA runtime not found: no ") + missing +
                " after the preload shim in the global symbol scope, and none of libcudart.so.13, .12, "
                ".11.0 or libcudart.so is loaded (is libcudart loaded yet?)",
            ::gact::cuda_error);
}

}  // namespace

cuda_api const& next_cuda_api() {
  // A function-local static: a failure is not cached (the initialization is retried on the
  // next call if it threw), so a runtime loaded later is found then.
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
