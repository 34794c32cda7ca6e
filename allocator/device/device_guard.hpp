// gact/allocator/device/device_guard.hpp
//
// The current CUDA device, made explicit. The runtime keeps one current device
// per host thread, and several handles mean "this thread's current device":
// the default stream handles (0, cudaStreamLegacy, cudaStreamPerThread) name
// a different stream on each device, and objects created (streams, events,
// cudaMalloc) land on the current device. Code that acts for a given device
// (a backend, a C ABI entry point, a kernel launch for a tensor) makes that
// device current for its duration with a device_guard and restores the
// caller's device after:
//
//   device::device_guard const g(api, device);    // over a cuda_api table
//   device::device_guard const g(device);         // over the runtime this binary links
//
// The guard costs one cudaGetDevice when the device is already current (the
// usual case) and two cudaSetDevice calls otherwise. A negative device means
// "no device" (a CPU tensor): the guard does nothing.
#pragma once

#include <cuda_runtime_api.h>

namespace gact::device {

struct cuda_api;
cuda_api const& direct_cuda_api() noexcept;

/// RAII: make `device` current for the calling thread, restore the previous one after.
class device_guard {
 public:
  /// Over the calls of `api` (must outlive the guard; the tables of cuda_api.hpp are static).
  /// @throws gact::cuda_error when the current device cannot be read or `device` made current.
  device_guard(cuda_api const& api, int device);
  /// Over the runtime this binary links (direct_cuda_api(); needs gact_cuda_direct).
  /// @throws gact::cuda_error as above.
  explicit device_guard(int device) : device_guard(direct_cuda_api(), device) {}
  /// Restores the previous device; a failure is logged (capped), never thrown.
  ~device_guard();
  device_guard(device_guard const&) = delete;
  device_guard& operator=(device_guard const&) = delete;

  /// The device that was current before the guard (-1 when no switch was needed).
  int previous() const noexcept { return previous_; }

 private:
  cuda_api const& api_;
  int previous_ = -1;  ///< -1 when no switch was needed
};

/// True for the stream handles that mean "the default stream of the current device"
/// (0, cudaStreamLegacy, cudaStreamPerThread): an operation on one of them acts on
/// whichever device is current, so it needs a device_guard.
inline bool is_current_device_stream(cudaStream_t s) noexcept {
  return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread;
}

}  // namespace gact::device
