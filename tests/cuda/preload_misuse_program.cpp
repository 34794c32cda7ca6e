// gact/tests/cuda/preload_misuse_program.cpp
//
// Frees the CUDA runtime rejects, made under LD_PRELOAD=libgact_preload.so on the fake
// runtime (issue 15): the shim must answer each as the runtime does
// (cudaErrorInvalidValue), touch nothing it no longer owns, and never pass a gact
// address to the runtime's free. The aliasing case is the one that corrupted memory:
// cudaFree(p) parked p, a following cudaFreeAsync(p) gave it back at once, a new
// allocation got p's address, and the flush of the parked entry later freed that live
// block, so the next allocation overlapped it.
//
// Exit status 0 when every check passed; each failure is one line on stderr.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <set>
#include <vector>

#include "fake_cudart.h"

namespace {

int g_failures = 0;

void expect(bool ok, char const* what) {
  if (!ok) {
    std::fprintf(stderr, "preload_misuse_program: FAIL: %s\n", what);
    ++g_failures;
  }
}

/// Runtime frees seen by the fake (the shim must not add any for a rejected free).
std::size_t runtime_frees() { return fake_cudart_count("cudaFree") + fake_cudart_count("cudaFreeAsync"); }

}  // namespace

int main() {
  cudaStream_t s = nullptr;
  expect(cudaStreamCreate(&s) == cudaSuccess, "cudaStreamCreate");

  // cudaFree(p); cudaFreeAsync(p) and cudaFree(p) again: both rejected, nothing touched.
  void* p = nullptr;
  expect(cudaMalloc(&p, 4096) == cudaSuccess && p != nullptr, "cudaMalloc");
  int const seg_live = fake_cudart_is_live(p);  // 1 when p starts gact's first segment
  expect(cudaFree(p) == cudaSuccess, "first cudaFree succeeds");
  std::size_t frees = runtime_frees();
  expect(cudaFreeAsync(p, s) == cudaErrorInvalidValue, "cudaFreeAsync after cudaFree: cudaErrorInvalidValue");
  expect(cudaFree(p) == cudaErrorInvalidValue, "second cudaFree: cudaErrorInvalidValue");
  expect(runtime_frees() == frees, "rejected frees of a gact pointer never reach the runtime");
  expect(fake_cudart_is_live(p) == seg_live, "the segment around p is still gact's");

  // A live block, then enough cudaMalloc/cudaFree pairs to make the shim flush its parked
  // frees (1024 blocks): no allocation may ever return an address that is still live.
  void* q = nullptr;
  expect(cudaMalloc(&q, 4096) == cudaSuccess, "cudaMalloc of the block kept live");
  expect(cudaMemsetAsync(q, 0x5A, 4096, nullptr) == cudaSuccess, "fill the live block");
  std::set<std::uintptr_t> live{reinterpret_cast<std::uintptr_t>(q)};
  bool aliased = false;
  for (int i = 0; i < 1500; ++i) {
    void* x = nullptr;
    if (cudaMalloc(&x, 4096) != cudaSuccess) {
      expect(false, "cudaMalloc in the flush loop");
      break;
    }
    auto const a = reinterpret_cast<std::uintptr_t>(x);
    if (live.count(a) != 0) aliased = true;
    expect(cudaMemsetAsync(x, 0x11, 4096, nullptr) == cudaSuccess, "write the short-lived block");
    expect(cudaFree(x) == cudaSuccess, "cudaFree in the flush loop");
  }
  expect(!aliased, "no allocation returned the address of a live block");
  unsigned char back[4096];
  expect(cudaMemcpy(back, q, sizeof back, cudaMemcpyDeviceToHost) == cudaSuccess, "read the live block");
  bool intact = true;
  for (unsigned char c : back) intact = intact && c == 0x5A;
  expect(intact, "the live block kept its bytes while other blocks were written");
  expect(cudaFree(q) == cudaSuccess, "cudaFree of the live block");

  // A double cudaFreeAsync.
  void* a = nullptr;
  expect(cudaMallocAsync(&a, 1u << 20, s) == cudaSuccess, "cudaMallocAsync");
  expect(cudaFreeAsync(a, s) == cudaSuccess, "first cudaFreeAsync succeeds");
  frees = runtime_frees();
  std::size_t const live_allocs = fake_cudart_live_allocations();
  expect(cudaFreeAsync(a, s) == cudaErrorInvalidValue, "second cudaFreeAsync: cudaErrorInvalidValue");
  expect(cudaFree(a) == cudaErrorInvalidValue, "cudaFree after cudaFreeAsync: cudaErrorInvalidValue");
  expect(runtime_frees() == frees && fake_cudart_live_allocations() == live_allocs,
         "the runtime freed nothing for the rejected frees");

  // An address inside a live gact block is not an allocation.
  void* b = nullptr;
  expect(cudaMalloc(&b, 8192) == cudaSuccess, "cudaMalloc");
  expect(cudaFree(static_cast<char*>(b) + 512) == cudaErrorInvalidValue, "cudaFree of an interior pointer");
  expect(cudaFreeAsync(static_cast<char*>(b) + 512, s) == cudaErrorInvalidValue,
         "cudaFreeAsync of an interior pointer");
  expect(cudaFree(b) == cudaSuccess, "the block itself is still freed normally");

  // A pointer the runtime allocated: the runtime's own answers.
  void* f = nullptr;
  expect(fake_cudart_malloc_direct(&f, 4096) == cudaSuccess, "a foreign allocation");
  expect(cudaFree(f) == cudaSuccess, "cudaFree of a foreign pointer reaches the runtime");
  expect(cudaFree(f) == cudaErrorInvalidValue, "the runtime rejects its own double free");
  (void)cudaGetLastError();

  expect(cudaStreamSynchronize(s) == cudaSuccess, "cudaStreamSynchronize");
  expect(cudaStreamDestroy(s) == cudaSuccess, "cudaStreamDestroy");
  expect(fake_cudart_take_async_error() == cudaSuccess, "no stream operation touched freed memory");
  if (g_failures == 0) std::printf("preload misuse: every rejected free answered cudaErrorInvalidValue\n");
  return g_failures == 0 ? 0 : 1;
}
