// gact/tests/fake_cudart/fake_cudart.cpp
//
// A fake CUDA runtime for tests on machines without a GPU: the runtime calls
// gact makes, implemented against the real declarations of cuda_runtime_api.h
// and built as libcudart.so.13, so a program linked against it (instead of the
// real runtime) runs unmodified.
//
// Model:
//   * "device memory" is host memory (512-byte aligned, the first 64 KiB of a
//     fresh allocation poisoned with 0xA5), limited per device by a capacity;
//     cudaMalloc beyond it fails with cudaErrorMemoryAllocation;
//   * each stream is a worker thread that runs its queued operations in order
//     (copies, memsets, frees of cudaFreeAsync, event records, waits), after an
//     optional random delay (FAKE_CUDART_DELAY_US) so that ordering bugs show;
//     the default stream (0, cudaStreamLegacy, cudaStreamPerThread) is one such
//     stream per device, with no implicit synchronization with other streams;
//   * an event completes when its stream reaches the record; an event never
//     recorded is complete; cudaStreamWaitEvent makes the stream's worker wait;
//   * synchronizing calls (cudaFree, cudaMemcpy, cudaDeviceSynchronize) drain
//     every stream; cudaFree/cudaFreeHost of an unknown pointer, a double free,
//     or a free through the wrong call returns cudaErrorInvalidValue;
//   * a stream put in capture (fake_cudart_begin_capture) makes the calls that
//     global-mode capture forbids fail with cudaErrorStreamCaptureUnsupported,
//     and cudaStreamIsCapturing on the legacy stream fail with
//     cudaErrorStreamCaptureImplicit, as the real runtime does; the work queued
//     on a capturing stream still runs (no graph is built);
//   * a stream operation that touches a device range outside a live allocation
//     sets an asynchronous error (cudaErrorIllegalAddress) that later
//     synchronizing calls return until a test takes it;
//   * every failing call sets the calling thread's last error (cudaGetLastError
//     returns and clears it); every call is counted by name;
//   * the driver's virtual memory calls (cuMemAddressReserve, cuMemCreate,
//     cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease, cuMemAddressFree,
//     cuMemGetAllocationGranularity: 2 MiB), reached as on a real runtime through
//     cudaGetDriverEntryPointByVersion: address space is host address space
//     with no access, a mapped page is host memory (poisoned like cudaMalloc's)
//     counted against the device's capacity when created, and stream operations
//     may touch any run of mapped pages that cuMemSetAccess made readable and
//     writable (others are an illegal address, as on a device);
//   * kernels compiled by nvcc register and launch through it, but no device code
//     runs: a launch is an empty operation on its stream (counted as
//     "__cudaLaunchKernel"), a __device__ variable's address (cudaGetSymbolAddress)
//     is a device allocation of its registered size, and the device has 4
//     multiprocessors. Host code that launches kernels (the store's device path)
//     is thereby testable for the calls it makes, not for the bytes it computes.
//
// The global state is created on first use and never destroyed, so calls made
// from other libraries' exit handlers still work.
#include "fake_cudart.h"

#include <cuda.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

constexpr std::size_t k_alignment = 512;
constexpr std::size_t k_poison_bytes = 64 * 1024;

/// One allocation. Invariant: [base, base + size) of distinct live entries are disjoint.
struct alloc_info {
  std::size_t size = 0;
  int device = 0;
  bool host = false;          ///< cudaHostAlloc memory (not device memory)
  bool free_pending = false;  ///< cudaFreeAsync queued, not yet reached by its stream
};

/// An event. Invariant: done <= recorded; the event is complete iff done == recorded.
struct fake_event {
  int device = 0;              ///< the device current at creation
  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t recorded = 0;  ///< generation of the latest cudaEventRecord
  std::uint64_t done = 0;      ///< latest generation its stream has reached
};

/// A stream: a worker thread over a queue. Invariant: completed <= enqueued.
struct fake_stream {
  int device = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  std::uint64_t enqueued = 0;
  std::uint64_t completed = 0;
  bool stop = false;
  std::uint64_t holds = 0;     ///< fake_cudart_hold calls
  std::uint64_t releases = 0;  ///< fake_cudart_release calls; invariant: releases <= holds
  std::atomic<bool> capturing{false};
  std::thread worker;
};

struct state {
  std::mutex mu;  ///< guards everything below except the atomics
  std::map<std::uintptr_t, alloc_info> allocs;
  std::vector<std::size_t> used;  ///< device bytes in use, per device
  std::size_t capacity = std::size_t{8} << 30;
  int devices = 2;
  unsigned delay_us = 0;
  std::unordered_map<fake_stream*, std::shared_ptr<fake_stream>> streams;  ///< shared: drain_all may hold one
  std::vector<fake_stream*> default_streams;  ///< per device, created lazily
  std::unordered_map<fake_event*, std::shared_ptr<fake_event>> events;
  std::map<std::uintptr_t, std::size_t> vranges;  ///< cuMemAddressReserve: base -> size
  struct vmap {
    std::size_t size;
    unsigned long long handle;
    bool access;  ///< cuMemSetAccess granted the device read/write access (before, a stream operation faults)
  };
  std::map<std::uintptr_t, vmap> vmapped;  ///< cuMemMap: address -> mapping
  struct vhandle {
    std::size_t size;
    int device;
    int maps;  ///< live mappings of it
  };
  std::map<unsigned long long, vhandle> vhandles;  ///< cuMemCreate's physical allocations
  unsigned long long next_vhandle = 1;
  bool vmm = true;  ///< fake_cudart_set_vmm
  std::atomic<int> capturing{0};  ///< number of streams in capture
  std::atomic<int> async_error{cudaSuccess};

  std::mutex count_mu;
  std::unordered_map<std::string, std::size_t> counts;
};

std::size_t parse_size(char const* text, std::size_t fallback) {
  if (text == nullptr || *text == '\0') {
    return fallback;
  }
  char* end = nullptr;
  unsigned long long v = std::strtoull(text, &end, 10);
  switch (end != nullptr ? *end : '\0') {
    case 'k': case 'K': v <<= 10; break;
    case 'm': case 'M': v <<= 20; break;
    case 'g': case 'G': v <<= 30; break;
    case 't': case 'T': v <<= 40; break;
    default: break;
  }
  return v == 0 ? fallback : static_cast<std::size_t>(v);
}

state& st() {
  static state* const s = [] {
    auto* p = new state();
    p->capacity = parse_size(std::getenv("FAKE_CUDART_CAPACITY"), p->capacity);
    if (char const* d = std::getenv("FAKE_CUDART_DEVICES"); d != nullptr && std::atoi(d) > 0) {
      p->devices = std::atoi(d);
    }
    if (char const* d = std::getenv("FAKE_CUDART_DELAY_US"); d != nullptr && std::atoi(d) > 0) {
      p->delay_us = static_cast<unsigned>(std::atoi(d));
    }
    p->used.assign(static_cast<std::size_t>(p->devices), 0);
    p->default_streams.assign(static_cast<std::size_t>(p->devices), nullptr);
    return p;
  }();
  return *s;
}

thread_local int t_device = 0;
thread_local cudaError_t t_last_error = cudaSuccess;

void count(char const* name) {
  state& s = st();
  std::lock_guard lk(s.count_mu);
  ++s.counts[name];
}

/// Record `err` as the calling thread's last error and return it.
cudaError_t fail(cudaError_t err) {
  t_last_error = err;
  return err;
}

bool capture_active() { return st().capturing.load(std::memory_order_acquire) > 0; }

void set_async_error(cudaError_t err) {
  int expected = cudaSuccess;
  st().async_error.compare_exchange_strong(expected, err);
}

// ---- streams -----------------------------------------------------------------

void worker_loop(fake_stream* s, unsigned delay_us) {
  std::minstd_rand rng(static_cast<unsigned>(reinterpret_cast<std::uintptr_t>(s) >> 4));
  for (;;) {
    std::function<void()> op;
    {
      std::unique_lock lk(s->mu);
      s->cv.wait(lk, [&] { return s->stop || !s->queue.empty(); });
      if (s->queue.empty()) {
        return;  // stop requested and nothing left to do
      }
      op = std::move(s->queue.front());
      s->queue.pop_front();
    }
    if (delay_us > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % (delay_us + 1)));
    }
    op();
    {
      std::lock_guard lk(s->mu);
      ++s->completed;
    }
    s->cv.notify_all();
  }
}

fake_stream* new_stream(int device) {
  auto owned = std::make_shared<fake_stream>();
  owned->device = device;
  owned->worker = std::thread(worker_loop, owned.get(), st().delay_us);
  fake_stream* raw = owned.get();
  st().streams.emplace(raw, std::move(owned));  // caller holds st().mu
  return raw;
}

/// The stream of a handle, or nullptr for an unknown handle.
fake_stream* resolve_stream(cudaStream_t h) {
  state& s = st();
  std::lock_guard lk(s.mu);
  if (h == nullptr || h == cudaStreamLegacy || h == cudaStreamPerThread) {
    auto const dev = static_cast<std::size_t>(t_device);
    if (s.default_streams[dev] == nullptr) {
      s.default_streams[dev] = new_stream(t_device);
    }
    return s.default_streams[dev];
  }
  auto it = s.streams.find(reinterpret_cast<fake_stream*>(h));
  return it == s.streams.end() ? nullptr : it->second.get();
}

std::uint64_t enqueue(fake_stream* s, std::function<void()> op) {
  std::uint64_t seq = 0;
  {
    std::lock_guard lk(s->mu);
    s->queue.push_back(std::move(op));
    seq = ++s->enqueued;
  }
  s->cv.notify_all();
  return seq;
}

void drain(fake_stream* s) {
  std::unique_lock lk(s->mu);
  std::uint64_t const target = s->enqueued;
  s->cv.wait(lk, [&] { return s->completed >= target; });
}

void drain_all() {
  // Shared references: a stream destroyed meanwhile by another thread stays valid
  // until its drain here returns (its destroy finished all its work anyway).
  std::vector<std::shared_ptr<fake_stream>> all;
  {
    state& s = st();
    std::lock_guard lk(s.mu);
    for (auto& [raw, owned] : s.streams) {
      all.push_back(owned);
    }
  }
  for (auto const& s : all) {
    drain(s.get());
  }
}

std::shared_ptr<fake_event> resolve_event(cudaEvent_t h) {
  state& s = st();
  std::lock_guard lk(s.mu);
  auto it = s.events.find(reinterpret_cast<fake_event*>(h));
  return it == s.events.end() ? nullptr : it->second;
}

// ---- memory ------------------------------------------------------------------

/// True when [a, a + n) is covered by mapped pages without a gap. Caller holds st().mu.
bool mapped_range_ok_locked(std::uintptr_t a, std::size_t n) {
  auto& m = st().vmapped;
  auto it = m.upper_bound(a);
  if (it == m.begin()) {
    return false;
  }
  --it;
  std::uintptr_t const end = a + n;
  std::uintptr_t covered = a;
  while (it != m.end() && it->first <= covered && it->second.access) {
    covered = std::max(covered, it->first + it->second.size);
    if (covered >= end) {
      return true;
    }
    ++it;
  }
  return false;
}

/// True when [p, p + n) lies inside one live device allocation or mapped pages. Caller holds st().mu.
bool device_range_ok_locked(void const* p, std::size_t n) {
  auto const a = reinterpret_cast<std::uintptr_t>(p);
  auto& allocs = st().allocs;
  auto it = allocs.upper_bound(a);
  if (it != allocs.begin()) {
    --it;
    if (!it->second.host && a + n <= it->first + it->second.size) {
      return true;
    }
  }
  return mapped_range_ok_locked(a, std::max<std::size_t>(n, 1));
}

/// True when p points into any live device allocation or mapped page. Caller holds st().mu.
bool inside_device_locked(void const* p) {
  auto const a = reinterpret_cast<std::uintptr_t>(p);
  auto& allocs = st().allocs;
  auto it = allocs.upper_bound(a);
  if (it != allocs.begin()) {
    --it;
    if (!it->second.host && a < it->first + std::max<std::size_t>(it->second.size, 1)) {
      return true;
    }
  }
  return mapped_range_ok_locked(a, 1);
}

// ---- the driver's virtual memory calls (through cudaGetDriverEntryPointByVersion) ----------

constexpr std::size_t k_vm_page = std::size_t{2} << 20;


CUresult fake_cuMemGetAllocationGranularity(std::size_t* g, CUmemAllocationProp const* prop,
                                            CUmemAllocationGranularity_flags) {
  count("cuMemGetAllocationGranularity");
  if (g == nullptr || prop == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *g = k_vm_page;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemAddressReserve(CUdeviceptr* ptr, std::size_t size, std::size_t alignment, CUdeviceptr,
                                  unsigned long long) {
  count("cuMemAddressReserve");
  if (ptr == nullptr || size == 0 || size % k_vm_page != 0) return CUDA_ERROR_INVALID_VALUE;
  std::size_t const align = std::max(alignment, k_vm_page);
  void* raw = ::mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  auto const a = reinterpret_cast<std::uintptr_t>(raw);
  std::uintptr_t const base = (a + align - 1) / align * align;
  if (base > a) ::munmap(raw, base - a);
  if (base + size < a + size + align) ::munmap(reinterpret_cast<void*>(base + size), a + size + align - base - size);
  state& s = st();
  std::lock_guard lk(s.mu);
  s.vranges[base] = size;
  *ptr = static_cast<CUdeviceptr>(base);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemAddressFree(CUdeviceptr ptr, std::size_t size) {
  count("cuMemAddressFree");
  state& s = st();
  std::lock_guard lk(s.mu);
  auto it = s.vranges.find(static_cast<std::uintptr_t>(ptr));
  if (it == s.vranges.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  auto m = s.vmapped.lower_bound(it->first);
  if (m != s.vmapped.end() && m->first < it->first + size) return CUDA_ERROR_INVALID_VALUE;  // still mapped
  ::munmap(reinterpret_cast<void*>(it->first), size);
  s.vranges.erase(it);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemCreate(CUmemGenericAllocationHandle* handle, std::size_t size, CUmemAllocationProp const* prop,
                          unsigned long long) {
  count("cuMemCreate");
  if (handle == nullptr || prop == nullptr || size == 0 || size % k_vm_page != 0) return CUDA_ERROR_INVALID_VALUE;
  state& s = st();
  std::lock_guard lk(s.mu);
  int const dev = prop->location.id;
  if (dev < 0 || dev >= s.devices) return CUDA_ERROR_INVALID_DEVICE;
  std::size_t& used = s.used[static_cast<std::size_t>(dev)];
  if (size > s.capacity || used > s.capacity - size) return CUDA_ERROR_OUT_OF_MEMORY;
  used += size;
  unsigned long long const h = s.next_vhandle++;
  s.vhandles[h] = {size, dev, 0};
  *handle = static_cast<CUmemGenericAllocationHandle>(h);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemRelease(CUmemGenericAllocationHandle handle) {
  count("cuMemRelease");
  state& s = st();
  std::lock_guard lk(s.mu);
  auto it = s.vhandles.find(static_cast<unsigned long long>(handle));
  if (it == s.vhandles.end() || it->second.maps != 0) return CUDA_ERROR_INVALID_VALUE;  // (still mapped: refused)
  s.used[static_cast<std::size_t>(it->second.device)] -= it->second.size;
  s.vhandles.erase(it);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemMap(CUdeviceptr ptr, std::size_t size, std::size_t offset, CUmemGenericAllocationHandle handle,
                       unsigned long long) {
  count("cuMemMap");
  auto const a = static_cast<std::uintptr_t>(ptr);
  state& s = st();
  std::lock_guard lk(s.mu);
  auto h = s.vhandles.find(static_cast<unsigned long long>(handle));
  if (h == s.vhandles.end() || offset != 0 || size != h->second.size || a % k_vm_page != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  auto r = s.vranges.upper_bound(a);
  if (r == s.vranges.begin() || a + size > std::prev(r)->first + std::prev(r)->second) {
    return CUDA_ERROR_INVALID_VALUE;  // not inside a reserved range
  }
  auto m = s.vmapped.lower_bound(a);
  if ((m != s.vmapped.end() && m->first < a + size) ||
      (m != s.vmapped.begin() && std::prev(m)->first + std::prev(m)->second.size > a)) {
    return CUDA_ERROR_INVALID_VALUE;  // already mapped
  }
  if (::mmap(reinterpret_cast<void*>(a), size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1,
             0) == MAP_FAILED) {
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  std::memset(reinterpret_cast<void*>(a), 0xA5, std::min(size, k_poison_bytes));
  s.vmapped[a] = {size, static_cast<unsigned long long>(handle), false};
  ++h->second.maps;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemSetAccess(CUdeviceptr ptr, std::size_t size, CUmemAccessDesc const* desc, std::size_t n) {
  count("cuMemSetAccess");
  state& s = st();
  std::lock_guard lk(s.mu);
  auto const a = static_cast<std::uintptr_t>(ptr);
  if (desc == nullptr || n == 0 || size == 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  // every mapping in [a, a + size), which must be covered without a gap, gets the access asked for
  std::uintptr_t covered = a;
  for (auto it = s.vmapped.lower_bound(a); it != s.vmapped.end() && it->first < a + size; ++it) {
    if (it->first != covered) return CUDA_ERROR_INVALID_VALUE;
    covered = it->first + it->second.size;
  }
  if (covered < a + size) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  bool const rw = desc->flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE && desc->location.type == CU_MEM_LOCATION_TYPE_DEVICE;
  for (auto it = s.vmapped.lower_bound(a); it != s.vmapped.end() && it->first < a + size; ++it) {
    it->second.access = rw;
  }
  return CUDA_SUCCESS;
}

CUresult fake_cuMemUnmap(CUdeviceptr ptr, std::size_t size) {
  count("cuMemUnmap");
  auto const a = static_cast<std::uintptr_t>(ptr);
  state& s = st();
  std::lock_guard lk(s.mu);
  auto m = s.vmapped.find(a);
  if (m == s.vmapped.end() || m->second.size != size) return CUDA_ERROR_INVALID_VALUE;
  ::mmap(reinterpret_cast<void*>(a), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  --s.vhandles[m->second.handle].maps;
  s.vmapped.erase(m);
  return CUDA_SUCCESS;
}

/// Whether a copy of `kind` between the ranges is legal now.
bool copy_ranges_ok(void* dst, void const* src, std::size_t n, cudaMemcpyKind kind) {
  state& s = st();
  std::lock_guard lk(s.mu);
  bool const dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice ||
                       (kind == cudaMemcpyDefault && inside_device_locked(dst));
  bool const src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice ||
                       (kind == cudaMemcpyDefault && inside_device_locked(src));
  return (!dst_dev || device_range_ok_locked(dst, n)) && (!src_dev || device_range_ok_locked(src, n));
}

cudaError_t allocate(void** p, std::size_t bytes, bool host, int dev = t_device) {
  if (p == nullptr) {
    return fail(cudaErrorInvalidValue);
  }
  *p = nullptr;
  if (bytes == 0) {
    return cudaSuccess;
  }
  state& s = st();
  {
    std::lock_guard lk(s.mu);
    if (!host && (bytes > s.capacity || s.used[static_cast<std::size_t>(dev)] > s.capacity - bytes)) {
      return fail(cudaErrorMemoryAllocation);
    }
    if (!host) {
      s.used[static_cast<std::size_t>(dev)] += bytes;  // reserve before the (unlocked) malloc
    }
  }
  std::size_t const rounded = (bytes + k_alignment - 1) / k_alignment * k_alignment;
  void* mem = rounded >= bytes ? std::aligned_alloc(k_alignment, rounded) : nullptr;
  std::lock_guard lk(s.mu);
  if (mem == nullptr) {
    if (!host) {
      s.used[static_cast<std::size_t>(dev)] -= bytes;
    }
    return fail(cudaErrorMemoryAllocation);
  }
  std::memset(mem, 0xA5, std::min(bytes, k_poison_bytes));
  s.allocs[reinterpret_cast<std::uintptr_t>(mem)] = alloc_info{bytes, dev, host, false};
  *p = mem;
  return cudaSuccess;
}

/// Remove a live allocation of the given kind; cudaErrorInvalidValue if there is none.
/// With `pending_ok`, also accepts an entry whose asynchronous free is queued.
cudaError_t release(void* p, bool host, bool pending_ok) {
  state& s = st();
  void* mem = nullptr;
  {
    std::lock_guard lk(s.mu);
    auto it = s.allocs.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == s.allocs.end() || it->second.host != host || (it->second.free_pending && !pending_ok)) {
      return fail(cudaErrorInvalidValue);
    }
    if (!host) {
      s.used[static_cast<std::size_t>(it->second.device)] -= it->second.size;
    }
    mem = p;
    s.allocs.erase(it);
  }
  std::free(mem);
  return cudaSuccess;
}

cudaError_t sticky_or(cudaError_t err) {
  int const sticky = st().async_error.load();
  return sticky != cudaSuccess ? fail(static_cast<cudaError_t>(sticky)) : err;
}

}  // namespace

// ---- test controls -------------------------------------------------------------

extern "C" {

size_t fake_cudart_count(char const* name) {
  if (name == nullptr) {
    return 0;
  }
  state& s = st();
  std::lock_guard lk(s.count_mu);
  auto it = s.counts.find(name);
  return it == s.counts.end() ? 0 : it->second;
}

void fake_cudart_reset_counts(void) {
  state& s = st();
  std::lock_guard lk(s.count_mu);
  s.counts.clear();
}

cudaError_t fake_cudart_begin_capture(cudaStream_t stream) {
  fake_stream* s = resolve_stream(stream);
  if (s == nullptr || stream == nullptr || stream == cudaStreamLegacy) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  if (s->capturing.exchange(true)) {
    return fail(cudaErrorIllegalState);
  }
  st().capturing.fetch_add(1, std::memory_order_acq_rel);
  return cudaSuccess;
}

cudaError_t fake_cudart_end_capture(cudaStream_t stream) {
  fake_stream* s = resolve_stream(stream);
  if (s == nullptr) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  if (!s->capturing.exchange(false)) {
    return fail(cudaErrorIllegalState);
  }
  st().capturing.fetch_sub(1, std::memory_order_acq_rel);
  return cudaSuccess;
}

cudaError_t fake_cudart_hold(cudaStream_t stream) {
  fake_stream* s = resolve_stream(stream);
  if (s == nullptr) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  std::uint64_t gate = 0;
  {
    std::lock_guard lk(s->mu);
    gate = ++s->holds;
  }
  enqueue(s, [s, gate] {
    std::unique_lock lk(s->mu);
    s->cv.wait(lk, [&] { return s->releases >= gate; });
  });
  return cudaSuccess;
}

cudaError_t fake_cudart_release(cudaStream_t stream) {
  fake_stream* s = resolve_stream(stream);
  if (s == nullptr) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  {
    std::lock_guard lk(s->mu);
    if (s->releases >= s->holds) {
      return fail(cudaErrorIllegalState);
    }
    ++s->releases;
  }
  s->cv.notify_all();
  return cudaSuccess;
}

void fake_cudart_set_capacity(size_t bytes) {
  state& s = st();
  std::lock_guard lk(s.mu);
  s.capacity = bytes;
}

size_t fake_cudart_used_bytes(int device) {
  state& s = st();
  std::lock_guard lk(s.mu);
  return device >= 0 && device < s.devices ? s.used[static_cast<std::size_t>(device)] : 0;
}

size_t fake_cudart_live_allocations(void) {
  state& s = st();
  std::lock_guard lk(s.mu);
  return static_cast<size_t>(std::count_if(s.allocs.begin(), s.allocs.end(),
                                           [](auto const& kv) { return !kv.second.host; }));
}

int fake_cudart_is_live(void const* p) {
  state& s = st();
  std::lock_guard lk(s.mu);
  auto it = s.allocs.find(reinterpret_cast<std::uintptr_t>(p));
  return it != s.allocs.end() && !it->second.host && !it->second.free_pending ? 1 : 0;
}

cudaError_t fake_cudart_malloc_direct(void** p, size_t bytes) {
  count(__func__);
  return allocate(p, bytes, false);
}

cudaError_t fake_cudart_take_async_error(void) {
  return static_cast<cudaError_t>(st().async_error.exchange(cudaSuccess));
}

}  // extern "C"

// ---- device management -----------------------------------------------------------

cudaError_t CUDARTAPI cudaGetDeviceCount(int* count_out) {
  count(__func__);
  if (count_out == nullptr) {
    return fail(cudaErrorInvalidValue);
  }
  *count_out = st().devices;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaGetDevice(int* device) {
  count(__func__);
  if (device == nullptr) {
    return fail(cudaErrorInvalidValue);
  }
  *device = t_device;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaSetDevice(int device) {
  count(__func__);
  if (device < 0 || device >= st().devices) {
    return fail(cudaErrorInvalidDevice);
  }
  t_device = device;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaDeviceSynchronize(void) {
  count(__func__);
  if (capture_active()) {
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  drain_all();
  return sticky_or(cudaSuccess);
}

cudaError_t CUDARTAPI cudaGetLastError(void) {
  count(__func__);
  cudaError_t const err = t_last_error;
  t_last_error = cudaSuccess;
  return err;
}

cudaError_t CUDARTAPI cudaPeekAtLastError(void) {
  count(__func__);
  return t_last_error;
}

const char* CUDARTAPI cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    default: return "cudaErrorUnknown";
  }
}

const char* CUDARTAPI cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorIllegalState: return "the operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureImplicit: return "operation would make the legacy stream depend on a capturing blocking stream";
    default: return "unknown error (fake runtime)";
  }
}

// ---- memory ------------------------------------------------------------------------

cudaError_t CUDARTAPI cudaMalloc(void** devPtr, size_t size) {
  count(__func__);
  if (capture_active()) {
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  return allocate(devPtr, size, false);
}

cudaError_t CUDARTAPI cudaFree(void* devPtr) {
  count(__func__);
  if (capture_active()) {
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  drain_all();  // cudaFree synchronizes the device
  if (devPtr == nullptr) {
    return cudaSuccess;
  }
  return release(devPtr, false, false);
}

cudaError_t CUDARTAPI cudaMallocAsync(void** devPtr, size_t size, cudaStream_t hStream) {
  count(__func__);
  fake_stream const* s = resolve_stream(hStream);
  if (s == nullptr) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  return allocate(devPtr, size, false, s->device);  // the stream's device, not the current one
}

cudaError_t CUDARTAPI cudaFreeAsync(void* devPtr, cudaStream_t hStream) {
  count(__func__);
  fake_stream* s = resolve_stream(hStream);
  if (s == nullptr) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  if (devPtr == nullptr) {
    return cudaSuccess;
  }
  {
    state& g = st();
    std::lock_guard lk(g.mu);
    auto it = g.allocs.find(reinterpret_cast<std::uintptr_t>(devPtr));
    if (it == g.allocs.end() || it->second.host || it->second.free_pending) {
      return fail(cudaErrorInvalidValue);
    }
    it->second.free_pending = true;
  }
  enqueue(s, [devPtr] { (void)release(devPtr, false, true); });
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  count(__func__);
  if (free_bytes == nullptr || total == nullptr) {
    return fail(cudaErrorInvalidValue);
  }
  state& s = st();
  std::lock_guard lk(s.mu);
  std::size_t const used = s.used[static_cast<std::size_t>(t_device)];
  *total = s.capacity;
  *free_bytes = used < s.capacity ? s.capacity - used : 0;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaHostAlloc(void** pHost, size_t size, unsigned int /*flags*/) {
  count(__func__);
  return allocate(pHost, size, true);
}

cudaError_t CUDARTAPI cudaFreeHost(void* ptr) {
  count(__func__);
  if (ptr == nullptr) {
    return cudaSuccess;
  }
  return release(ptr, true, false);
}

cudaError_t CUDARTAPI cudaMemcpyAsync(void* dst, const void* src, size_t count_bytes,
                                      enum cudaMemcpyKind kind, cudaStream_t stream) {
  count(__func__);
  fake_stream* s = resolve_stream(stream);
  if (s == nullptr) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  if (count_bytes == 0) {
    return cudaSuccess;
  }
  if (dst == nullptr || src == nullptr) {
    return fail(cudaErrorInvalidValue);
  }
  enqueue(s, [dst, src, count_bytes, kind] {
    if (!copy_ranges_ok(dst, src, count_bytes, kind)) {
      set_async_error(cudaErrorIllegalAddress);
      return;
    }
    std::memmove(dst, src, count_bytes);
  });
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaMemcpy(void* dst, const void* src, size_t count_bytes, enum cudaMemcpyKind kind) {
  count(__func__);
  if (capture_active()) {
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  drain_all();
  if (count_bytes == 0) {
    return sticky_or(cudaSuccess);
  }
  if (dst == nullptr || src == nullptr || !copy_ranges_ok(dst, src, count_bytes, kind)) {
    return fail(cudaErrorInvalidValue);
  }
  std::memmove(dst, src, count_bytes);
  return sticky_or(cudaSuccess);
}

cudaError_t CUDARTAPI cudaMemsetAsync(void* devPtr, int value, size_t count_bytes, cudaStream_t stream) {
  count(__func__);
  fake_stream* s = resolve_stream(stream);
  if (s == nullptr) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  if (count_bytes == 0) {
    return cudaSuccess;
  }
  enqueue(s, [devPtr, value, count_bytes] {
    bool ok = false;
    {
      std::lock_guard lk(st().mu);
      ok = device_range_ok_locked(devPtr, count_bytes);
    }
    if (!ok) {
      set_async_error(cudaErrorIllegalAddress);
      return;
    }
    std::memset(devPtr, value, count_bytes);
  });
  return cudaSuccess;
}

// ---- streams ---------------------------------------------------------------------------

namespace {
cudaError_t stream_create(cudaStream_t* pStream) {
  if (pStream == nullptr) {
    return fail(cudaErrorInvalidValue);
  }
  state& s = st();
  std::lock_guard lk(s.mu);
  *pStream = reinterpret_cast<cudaStream_t>(new_stream(t_device));
  return cudaSuccess;
}
}  // namespace

cudaError_t CUDARTAPI cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int /*flags*/) {
  count(__func__);
  return stream_create(pStream);
}

cudaError_t CUDARTAPI cudaStreamCreate(cudaStream_t* pStream) {
  count(__func__);
  return stream_create(pStream);
}

cudaError_t CUDARTAPI cudaStreamDestroy(cudaStream_t stream) {
  count(__func__);
  std::shared_ptr<fake_stream> owned;
  {
    state& s = st();
    std::lock_guard lk(s.mu);
    auto it = s.streams.find(reinterpret_cast<fake_stream*>(stream));
    if (it == s.streams.end() ||
        std::find(s.default_streams.begin(), s.default_streams.end(), it->first) != s.default_streams.end()) {
      return fail(cudaErrorInvalidResourceHandle);
    }
    owned = std::move(it->second);
    s.streams.erase(it);
  }
  if (owned->capturing.exchange(false)) {
    st().capturing.fetch_sub(1, std::memory_order_acq_rel);
  }
  // The real runtime returns at once and frees the stream when its work is done;
  // the fake finishes the queued work first, then joins the worker.
  {
    std::lock_guard lk(owned->mu);
    owned->stop = true;
  }
  owned->cv.notify_all();
  owned->worker.join();
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaStreamSynchronize(cudaStream_t stream) {
  count(__func__);
  fake_stream* s = resolve_stream(stream);
  if (s == nullptr) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  if (capture_active()) {
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  drain(s);
  return sticky_or(cudaSuccess);
}

cudaError_t CUDARTAPI cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int /*flags*/) {
  count(__func__);
  fake_stream* s = resolve_stream(stream);
  std::shared_ptr<fake_event> e = resolve_event(event);
  if (s == nullptr || e == nullptr) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  std::uint64_t target = 0;
  {
    std::lock_guard lk(e->mu);
    target = e->recorded;
  }
  if (target == 0) {
    return cudaSuccess;  // never recorded: nothing to wait for
  }
  enqueue(s, [e, target] {
    std::unique_lock lk(e->mu);
    e->cv.wait(lk, [&] { return e->done >= target; });
  });
  return cudaSuccess;
}

namespace {
cudaError_t is_capturing(cudaStream_t stream, enum cudaStreamCaptureStatus* pCaptureStatus) {
  if (pCaptureStatus == nullptr) {
    return fail(cudaErrorInvalidValue);
  }
  if (stream == nullptr || stream == cudaStreamLegacy) {
    if (capture_active()) {
      return fail(cudaErrorStreamCaptureImplicit);
    }
    *pCaptureStatus = cudaStreamCaptureStatusNone;
    return cudaSuccess;
  }
  fake_stream* s = resolve_stream(stream);
  if (s == nullptr) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  *pCaptureStatus = s->capturing.load() ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
}  // namespace

cudaError_t CUDARTAPI cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus* pCaptureStatus) {
  count(__func__);
  return is_capturing(stream, pCaptureStatus);
}

cudaError_t CUDARTAPI cudaStreamGetCaptureInfo(cudaStream_t stream, enum cudaStreamCaptureStatus* captureStatus_out,
                                               unsigned long long* id_out, cudaGraph_t* graph_out,
                                               const cudaGraphNode_t** dependencies_out,
                                               const cudaGraphEdgeData** edgeData_out,
                                               size_t* numDependencies_out) {
  count(__func__);
  cudaError_t const err = is_capturing(stream, captureStatus_out);
  if (err != cudaSuccess) {
    return err;
  }
  if (id_out != nullptr) {
    *id_out = reinterpret_cast<std::uintptr_t>(stream);
  }
  if (graph_out != nullptr) {
    *graph_out = nullptr;
  }
  if (dependencies_out != nullptr) {
    *dependencies_out = nullptr;
  }
  if (edgeData_out != nullptr) {
    *edgeData_out = nullptr;
  }
  if (numDependencies_out != nullptr) {
    *numDependencies_out = 0;
  }
  return cudaSuccess;
}

// ---- events ------------------------------------------------------------------------------

namespace {
cudaError_t event_create(cudaEvent_t* event) {
  if (event == nullptr) {
    return fail(cudaErrorInvalidValue);
  }
  auto e = std::make_shared<fake_event>();
  e->device = t_device;
  state& s = st();
  std::lock_guard lk(s.mu);
  *event = reinterpret_cast<cudaEvent_t>(e.get());
  s.events.emplace(e.get(), std::move(e));
  return cudaSuccess;
}
}  // namespace

cudaError_t CUDARTAPI cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int /*flags*/) {
  count(__func__);
  return event_create(event);
}

cudaError_t CUDARTAPI cudaEventCreate(cudaEvent_t* event) {
  count(__func__);
  return event_create(event);
}

cudaError_t CUDARTAPI cudaEventDestroy(cudaEvent_t event) {
  count(__func__);
  state& s = st();
  std::lock_guard lk(s.mu);
  // Queued records and waits hold their own reference: destroying is safe at any time.
  if (s.events.erase(reinterpret_cast<fake_event*>(event)) == 0) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  count(__func__);
  fake_stream* s = resolve_stream(stream);
  std::shared_ptr<fake_event> e = resolve_event(event);
  if (s == nullptr || e == nullptr) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  if (s->device != e->device) {
    return fail(cudaErrorInvalidResourceHandle);  // the real runtime refuses a record across devices
  }
  std::uint64_t gen = 0;
  {
    std::lock_guard lk(e->mu);
    gen = ++e->recorded;
  }
  enqueue(s, [e, gen] {
    {
      std::lock_guard lk(e->mu);
      e->done = std::max(e->done, gen);
    }
    e->cv.notify_all();
  });
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaEventQuery(cudaEvent_t event) {
  count(__func__);
  std::shared_ptr<fake_event> e = resolve_event(event);
  if (e == nullptr) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  if (capture_active()) {
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  std::lock_guard lk(e->mu);
  // The real runtime also leaves cudaErrorNotReady in the last-error state.
  return e->done >= e->recorded ? cudaSuccess : fail(cudaErrorNotReady);
}

cudaError_t CUDARTAPI cudaEventSynchronize(cudaEvent_t event) {
  count(__func__);
  std::shared_ptr<fake_event> e = resolve_event(event);
  if (e == nullptr) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  if (capture_active()) {
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  std::unique_lock lk(e->mu);
  std::uint64_t const target = e->recorded;
  e->cv.wait(lk, [&] { return e->done >= target; });
  lk.unlock();
  return sticky_or(cudaSuccess);
}

// ---- kernels: registration and launches (no device code runs) -------------------------------

namespace {
struct launch_config {
  dim3 grid, block;
  std::size_t shared = 0;
  cudaStream_t stream = nullptr;
};
thread_local std::vector<launch_config> t_configs;

struct symbols {
  std::mutex mu;
  std::map<void const*, std::size_t> sizes;  // host shadow -> registered size
  std::map<void const*, void*> device;       // host shadow -> its device allocation
};
symbols& syms() {
  static auto* s = new symbols;  // (never destroyed, as the runtime's state)
  return *s;
}

cudaError_t launch(cudaStream_t stream) {
  count("__cudaLaunchKernel");
  fake_stream* s = resolve_stream(stream);
  if (s == nullptr) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  enqueue(s, [] {});
  return cudaSuccess;
}
}  // namespace

extern "C" {

void** CUDARTAPI __cudaRegisterFatBinary(void* /*fatCubin*/) {
  count(__func__);
  static void* handle[4] = {};
  return handle;
}
void CUDARTAPI __cudaRegisterFatBinaryEnd(void** /*handle*/) { count(__func__); }
void CUDARTAPI __cudaUnregisterFatBinary(void** /*handle*/) { count(__func__); }
void CUDARTAPI __cudaRegisterFunction(void** /*handle*/, const char* /*hostFun*/, char* /*deviceFun*/,
                                      const char* /*deviceName*/, int /*thread_limit*/, uint3* /*tid*/, uint3* /*bid*/,
                                      dim3* /*bDim*/, dim3* /*gDim*/, int* /*wSize*/) {
  count(__func__);
}
void CUDARTAPI __cudaRegisterVar(void** /*handle*/, char* hostVar, char* /*deviceAddress*/, const char* /*deviceName*/,
                                 int /*ext*/, size_t size, int /*constant*/, int /*global*/) {
  count(__func__);
  std::lock_guard lk(syms().mu);
  syms().sizes[hostVar] = size;
}
unsigned CUDARTAPI __cudaPushCallConfiguration(dim3 gridDim, dim3 blockDim, size_t sharedMem, struct CUstream_st* stream) {
  count(__func__);
  t_configs.push_back(launch_config{gridDim, blockDim, sharedMem, stream});
  return 0;
}
cudaError_t CUDARTAPI __cudaPopCallConfiguration(dim3* gridDim, dim3* blockDim, size_t* sharedMem, void* stream) {
  count(__func__);
  if (t_configs.empty()) {
    return fail(cudaErrorMissingConfiguration);
  }
  launch_config const c = t_configs.back();
  t_configs.pop_back();
  *gridDim = c.grid;
  *blockDim = c.block;
  *sharedMem = c.shared;
  *static_cast<cudaStream_t*>(stream) = c.stream;
  return cudaSuccess;
}
cudaError_t CUDARTAPI __cudaGetKernel(cudaKernel_t* kernel, const void* fun) {
  count(__func__);
  *kernel = reinterpret_cast<cudaKernel_t>(const_cast<void*>(fun));
  return cudaSuccess;
}
cudaError_t CUDARTAPI __cudaLaunchKernel(cudaKernel_t /*kernel*/, dim3 /*gridDim*/, dim3 /*blockDim*/, void** /*args*/,
                                         size_t /*sharedMem*/, cudaStream_t stream) {
  return launch(stream);
}
cudaError_t CUDARTAPI __cudaLaunchKernel_ptsz(cudaKernel_t /*kernel*/, dim3 /*gridDim*/, dim3 /*blockDim*/,
                                              void** /*args*/, size_t /*sharedMem*/, cudaStream_t stream) {
  return launch(stream);
}
cudaError_t CUDARTAPI cudaLaunchKernel(const void* /*func*/, dim3 /*gridDim*/, dim3 /*blockDim*/, void** /*args*/,
                                       size_t /*sharedMem*/, cudaStream_t stream) {
  return launch(stream);
}
cudaError_t CUDARTAPI cudaGetSymbolAddress(void** devPtr, const void* symbol) {
  count(__func__);
  if (devPtr == nullptr) {
    return fail(cudaErrorInvalidValue);
  }
  symbols& y = syms();
  std::lock_guard lk(y.mu);
  auto const known = y.sizes.find(symbol);
  if (known == y.sizes.end()) {
    return fail(cudaErrorInvalidSymbol);
  }
  void*& d = y.device[symbol];
  if (d == nullptr) {
    cudaError_t const e = allocate(&d, std::max<std::size_t>(known->second, 16), false);
    if (e != cudaSuccess) {
      return e;
    }
  }
  *devPtr = d;
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaGetDriverEntryPointByVersion(const char* symbol, void** funcPtr, unsigned int,
                                                       unsigned long long, cudaDriverEntryPointQueryResult* status) {
  count(__func__);
  if (symbol == nullptr || funcPtr == nullptr) {
    return fail(cudaErrorInvalidValue);
  }
  static std::pair<char const*, void*> const k_entries[] = {
      {"cuMemAddressReserve", reinterpret_cast<void*>(&fake_cuMemAddressReserve)},
      {"cuMemAddressFree", reinterpret_cast<void*>(&fake_cuMemAddressFree)},
      {"cuMemCreate", reinterpret_cast<void*>(&fake_cuMemCreate)},
      {"cuMemRelease", reinterpret_cast<void*>(&fake_cuMemRelease)},
      {"cuMemMap", reinterpret_cast<void*>(&fake_cuMemMap)},
      {"cuMemUnmap", reinterpret_cast<void*>(&fake_cuMemUnmap)},
      {"cuMemSetAccess", reinterpret_cast<void*>(&fake_cuMemSetAccess)},
      {"cuMemGetAllocationGranularity", reinterpret_cast<void*>(&fake_cuMemGetAllocationGranularity)},
  };
  *funcPtr = nullptr;
  bool const vmm = [] {
    std::lock_guard lk(st().mu);
    return st().vmm;
  }();
  for (auto const& [name, fn] : k_entries) {
    if (vmm && std::strcmp(name, symbol) == 0) {
      *funcPtr = fn;
      if (status != nullptr) *status = cudaDriverEntryPointSuccess;
      return cudaSuccess;
    }
  }
  if (status != nullptr) *status = cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

void fake_cudart_set_vmm(int on) {
  std::lock_guard lk(st().mu);
  st().vmm = on != 0;
}

size_t fake_cudart_mapped_bytes(void) {
  std::lock_guard lk(st().mu);
  std::size_t n = 0;
  for (auto const& [a, m] : st().vmapped) n += m.size;
  return n;
}

cudaError_t CUDARTAPI cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  count(__func__);
  if (value == nullptr || device < 0 || device >= st().devices) {
    return fail(cudaErrorInvalidValue);
  }
  *value = attr == cudaDevAttrMultiProcessorCount ? 4 : 0;
  return cudaSuccess;
}

}  // extern "C"
