// gact/allocator/device/cuda_api_direct.cpp
//
// The runtime call table of a binary that links libcudart: the one translation
// unit of gact that names the runtime's symbols. It lives in its own static
// library (gact_cuda_direct) so that the LD_PRELOAD shim, whose `cudaMalloc` is
// its own, never pulls it in.
#include "allocator/device/cuda_api.hpp"

namespace gact::device {

cuda_api const& direct_cuda_api() noexcept {
  static cuda_api const table{
      .malloc = &::cudaMalloc,
      .free = &::cudaFree,
      .malloc_async = &::cudaMallocAsync,
      .free_async = &::cudaFreeAsync,
      .mem_get_info = &::cudaMemGetInfo,
      .get_device = &::cudaGetDevice,
      .set_device = &::cudaSetDevice,
      .get_device_count = &::cudaGetDeviceCount,
      .stream_create_with_flags = &::cudaStreamCreateWithFlags,
      .stream_destroy = &::cudaStreamDestroy,
      .stream_synchronize = &::cudaStreamSynchronize,
      .stream_wait_event = &::cudaStreamWaitEvent,
      .stream_is_capturing = &::cudaStreamIsCapturing,
      .event_create_with_flags = &::cudaEventCreateWithFlags,
      .event_destroy = &::cudaEventDestroy,
      .event_record = &::cudaEventRecord,
      .event_query = &::cudaEventQuery,
      .event_synchronize = &::cudaEventSynchronize,
      .memcpy_async = &::cudaMemcpyAsync,
      .host_alloc = &::cudaHostAlloc,
      .free_host = &::cudaFreeHost,
      .device_synchronize = &::cudaDeviceSynchronize,
      .get_last_error = &::cudaGetLastError,
      .get_error_name = &::cudaGetErrorName,
      .get_error_string = &::cudaGetErrorString,
      .get_driver_entry_point = &::cudaGetDriverEntryPointByVersion,
  };
  return table;
}

}  // namespace gact::device
