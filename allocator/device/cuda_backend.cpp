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

#include <optional>
#include <string>

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
