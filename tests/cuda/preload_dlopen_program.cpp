// gact/tests/cuda/preload_dlopen_program.cpp
//
// The LD_PRELOAD shim when the CUDA runtime is not in the global symbol scope (issue 15,
// from issue 14 item 11). This program does not link a runtime: it calls the shim's
// cudaMalloc before any runtime is loaded (must fail with cudaErrorInitializationError,
// and that failure must not be remembered), then dlopens cuda_user_lib with RTLD_LOCAL,
// which loads the fake libcudart.so.13 privately, and uses CUDA through it: the shim must
// find the runtime with dlopen(RTLD_NOLOAD) and serve the allocations itself (one
// segment for two blocks, where the runtime alone would make two cudaMalloc calls).
//
// Usage: preload_dlopen_program PATH/TO/libcuda_user.so   (under LD_PRELOAD=libgact_preload.so)
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstddef>
#include <cstdio>

using malloc_fn = cudaError_t (*)(void**, std::size_t);
using free_fn = cudaError_t (*)(void*);
using roundtrip_fn = int (*)(std::size_t*);

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: preload_dlopen_program LIBCUDA_USER\n");
    return 2;
  }
  auto const shim_malloc = reinterpret_cast<malloc_fn>(dlsym(RTLD_DEFAULT, "cudaMalloc"));
  auto const shim_free = reinterpret_cast<free_fn>(dlsym(RTLD_DEFAULT, "cudaFree"));
  if (shim_malloc == nullptr || shim_free == nullptr) {
    std::fprintf(stderr, "preload_dlopen_program: no cudaMalloc in the process: run it under LD_PRELOAD\n");
    return 2;
  }
  int failures = 0;
  void* p = nullptr;
  cudaError_t const early = shim_malloc(&p, 4096);
  if (early != cudaErrorInitializationError) {
    std::fprintf(stderr, "FAIL: cudaMalloc before any runtime is loaded returned %d, expected "
                 "cudaErrorInitializationError\n", static_cast<int>(early));
    ++failures;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::fprintf(stderr, "preload_dlopen_program: dlopen(%s): %s\n", argv[1], dlerror());
    return 2;
  }
  if (dlsym(RTLD_DEFAULT, "fake_cudart_count") != nullptr) {
    std::fprintf(stderr, "preload_dlopen_program: the runtime is in the global scope; the test needs it local\n");
    return 2;
  }
  auto const roundtrip = reinterpret_cast<roundtrip_fn>(dlsym(lib, "cuda_user_roundtrip"));
  std::size_t runtime_mallocs = 0;
  int const rc = roundtrip != nullptr ? roundtrip(&runtime_mallocs) : -1;
  if (rc != 0) {
    std::fprintf(stderr, "FAIL: CUDA through the RTLD_LOCAL library failed at step %d\n", rc);
    ++failures;
  } else if (runtime_mallocs != 1) {
    std::fprintf(stderr, "FAIL: the runtime saw %zu cudaMalloc calls for two 4 KiB blocks; gact's one "
                 "segment expected (the shim did not serve them)\n", runtime_mallocs);
    ++failures;
  }
  // The failure of the first call was not cached: the shim works for this caller too now.
  if (shim_malloc(&p, 4096) != cudaSuccess || p == nullptr || shim_free(p) != cudaSuccess) {
    std::fprintf(stderr, "FAIL: cudaMalloc after the runtime was loaded still fails\n");
    ++failures;
  }
  if (failures == 0) std::printf("preload dlopen: the shim found the RTLD_LOCAL runtime after a first failure\n");
  return failures == 0 ? 0 : 1;
}
