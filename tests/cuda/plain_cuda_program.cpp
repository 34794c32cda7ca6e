// gact/tests/cuda/plain_cuda_program.cpp
//
// An ordinary CUDA program that knows nothing about gact: it allocates and frees
// device memory with cudaMalloc/cudaFree and cudaMallocAsync/cudaFreeAsync,
// writes and reads it back, and asks cudaMemGetInfo. check_preload.py runs it
// with and without LD_PRELOAD=libgact_preload.so and compares what it reports
// with gact's stats dump.
//
// When the runtime it runs on is the test fake, it also uses the fake's test
// hooks, found with dlsym (absent on a real runtime, where those steps are
// skipped): a pointer allocated behind the shim's back (must reach the
// runtime's cudaFree), and an allocation on a capturing stream (must be left to
// the runtime).
//
// Output: one JSON line on stdout with what it did; exit status 0 when every
// CUDA call succeeded and every byte read back was the byte written.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

int g_failures = 0;

void check(cudaError_t err, char const* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "plain_cuda_program: %s failed: %s\n", what, cudaGetErrorName(err));
    ++g_failures;
  }
}

void expect(bool ok, char const* what) {
  if (!ok) {
    std::fprintf(stderr, "plain_cuda_program: check failed: %s\n", what);
    ++g_failures;
  }
}

/// Fill [p, p + n) with `value` through the runtime and read both ends back.
void write_and_verify(void* p, std::size_t n, int value, cudaStream_t s) {
  check(cudaMemsetAsync(p, value, n, s), "cudaMemsetAsync");
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  unsigned char ends[2] = {0, 0};
  check(cudaMemcpy(&ends[0], p, 1, cudaMemcpyDeviceToHost), "cudaMemcpy D2H first");
  check(cudaMemcpy(&ends[1], static_cast<unsigned char*>(p) + n - 1, 1, cudaMemcpyDeviceToHost), "cudaMemcpy D2H last");
  expect(ends[0] == static_cast<unsigned char>(value) && ends[1] == static_cast<unsigned char>(value),
         "bytes read back equal the bytes written");
}

using count_fn = std::size_t (*)(char const*);
using stream_fn = cudaError_t (*)(cudaStream_t);
using malloc_fn = cudaError_t (*)(void**, std::size_t);
using live_fn = int (*)(void const*);

}  // namespace

int main() {
  auto const fake_count = reinterpret_cast<count_fn>(dlsym(RTLD_DEFAULT, "fake_cudart_count"));
  auto const fake_begin = reinterpret_cast<stream_fn>(dlsym(RTLD_DEFAULT, "fake_cudart_begin_capture"));
  auto const fake_end = reinterpret_cast<stream_fn>(dlsym(RTLD_DEFAULT, "fake_cudart_end_capture"));
  auto const fake_direct = reinterpret_cast<malloc_fn>(dlsym(RTLD_DEFAULT, "fake_cudart_malloc_direct"));
  auto const fake_live = reinterpret_cast<live_fn>(dlsym(RTLD_DEFAULT, "fake_cudart_is_live"));
  bool const hooks = fake_count && fake_begin && fake_end && fake_direct && fake_live;

  std::size_t free0 = 0, free1 = 0, free2 = 0, total = 0;
  check(cudaFree(nullptr), "cudaFree(nullptr)");
  check(cudaMemGetInfo(&free0, &total), "cudaMemGetInfo");

  // cudaMalloc / cudaFree
  std::size_t const sizes[] = {1000, 4096, 1u << 20, 3u << 20, (12u << 20) + 3, 50u << 20, 700, 513};
  std::vector<void*> blocks;
  std::size_t malloc_calls = 0, malloc_bytes = 0;
  for (std::size_t i = 0; i < sizeof sizes / sizeof sizes[0]; ++i) {
    void* p = nullptr;
    check(cudaMalloc(&p, sizes[i]), "cudaMalloc");
    if (p == nullptr) continue;
    ++malloc_calls;
    malloc_bytes += sizes[i];
    write_and_verify(p, sizes[i], static_cast<int>(i + 1), nullptr);
    blocks.push_back(p);
  }
  check(cudaMemGetInfo(&free1, &total), "cudaMemGetInfo");

  // cudaMallocAsync / cudaFreeAsync on one stream, then across streams
  cudaStream_t s = nullptr;
  check(cudaStreamCreate(&s), "cudaStreamCreate");
  std::size_t async_calls = 0, async_bytes = 0;
  for (std::size_t j = 0; j < 10; ++j) {
    void* q = nullptr;
    std::size_t const n = (2u << 20) + j * 512;
    check(cudaMallocAsync(&q, n, s), "cudaMallocAsync");
    if (q == nullptr) continue;
    ++async_calls;
    async_bytes += n;
    write_and_verify(q, n, static_cast<int>(0x40 + j), s);
    check(cudaFreeAsync(q, s), "cudaFreeAsync");
  }
  void* x = nullptr;
  check(cudaMallocAsync(&x, 1u << 20, s), "cudaMallocAsync");
  if (x != nullptr) {
    ++async_calls;
    async_bytes += 1u << 20;
    write_and_verify(x, 1u << 20, 0x77, s);
    check(cudaFreeAsync(x, cudaStreamLegacy), "cudaFreeAsync on another stream");
  }
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");

  // Steps that need the fake's hooks.
  std::size_t foreign_frees = 0, captured = 0;
  std::size_t fake_async_delta = 0;
  if (hooks) {
    void* f = nullptr;
    check(fake_direct(&f, 1u << 20), "fake_cudart_malloc_direct");
    expect(fake_live(f) == 1, "the foreign pointer is live");
    check(cudaFree(f), "cudaFree of a foreign pointer");
    expect(fake_live(f) == 0, "the foreign pointer reached the runtime's cudaFree");
    ++foreign_frees;

    std::size_t const before = fake_count("cudaMallocAsync");
    check(fake_begin(s), "begin capture");
    void* c = nullptr;
    check(cudaMallocAsync(&c, 4096, s), "cudaMallocAsync under capture");
    check(fake_end(s), "end capture");
    fake_async_delta = fake_count("cudaMallocAsync") - before;
    ++captured;
    check(cudaFreeAsync(c, s), "cudaFreeAsync of the captured allocation");
    ++foreign_frees;
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  }

  // cudaFree then cudaMalloc of the same size: does the second get the first's address?
  // (The shim must not hand a cudaFree'd block out before a device synchronization.)
  bool immediate_reuse = false;
  {
    void* a = nullptr;
    void* b = nullptr;
    check(cudaMalloc(&a, 8192), "cudaMalloc");
    check(cudaFree(a), "cudaFree");
    check(cudaMalloc(&b, 8192), "cudaMalloc");
    immediate_reuse = a == b;
    check(cudaFree(b), "cudaFree");
    malloc_calls += 2;
    malloc_bytes += 2 * 8192;
  }

  for (void* p : blocks) check(cudaFree(p), "cudaFree");
  check(cudaFree(nullptr), "cudaFree(nullptr)");
  check(cudaStreamDestroy(s), "cudaStreamDestroy");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check(cudaMemGetInfo(&free2, &total), "cudaMemGetInfo");

  std::printf("{\"ok\": %s, \"hooks\": %s, \"malloc_calls\": %zu, \"malloc_bytes\": %zu, "
              "\"malloc_async_calls\": %zu, \"malloc_async_bytes\": %zu, \"foreign_frees\": %zu, "
              "\"captured\": %zu, \"fake_async_delta_under_capture\": %zu, \"immediate_reuse\": %s, "
              "\"free0\": %zu, \"free1\": %zu, \"free2\": %zu, \"total\": %zu",
              g_failures == 0 ? "true" : "false", hooks ? "true" : "false", malloc_calls, malloc_bytes,
              async_calls, async_bytes, foreign_frees, captured, fake_async_delta,
              immediate_reuse ? "true" : "false", free0, free1, free2, total);
  if (hooks) {
    std::printf(", \"fake_counts\": {\"cudaMalloc\": %zu, \"cudaFree\": %zu, \"cudaMallocAsync\": %zu, "
                "\"cudaFreeAsync\": %zu, \"cudaDeviceSynchronize\": %zu}",
                fake_count("cudaMalloc"), fake_count("cudaFree"), fake_count("cudaMallocAsync"),
                fake_count("cudaFreeAsync"), fake_count("cudaDeviceSynchronize"));
  }
  std::printf("}\n");
  return g_failures == 0 ? 0 : 1;
}
