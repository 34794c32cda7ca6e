// gact/tests/cuda/cuda_user_lib.cpp
//
// A shared library that uses the CUDA runtime, for preload_dlopen_program: loaded with
// dlopen(RTLD_LOCAL), it brings the runtime (the fake libcudart.so.13) into the process
// outside the global symbol scope, as Python brings in torch's. Its cudaMalloc calls
// still bind to the preloaded shim, which must find that runtime by its soname.
#include <cuda_runtime_api.h>

#include <cstddef>

#include "fake_cudart.h"

extern "C" __attribute__((visibility("default"))) int cuda_user_roundtrip(std::size_t* runtime_mallocs) {
  std::size_t const before = fake_cudart_count("cudaMalloc");
  void* a = nullptr;
  void* b = nullptr;
  if (cudaMalloc(&a, 4096) != cudaSuccess || cudaMalloc(&b, 4096) != cudaSuccess) return 1;
  if (cudaMemsetAsync(a, 1, 4096, nullptr) != cudaSuccess || cudaMemsetAsync(b, 2, 4096, nullptr) != cudaSuccess) return 2;
  unsigned char x = 0;
  if (cudaMemcpy(&x, b, 1, cudaMemcpyDeviceToHost) != cudaSuccess || x != 2) return 3;
  if (cudaFree(a) != cudaSuccess || cudaFree(b) != cudaSuccess) return 4;
  *runtime_mallocs = fake_cudart_count("cudaMalloc") - before;
  return 0;
}
