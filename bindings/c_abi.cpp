// gact/bindings/c_abi.cpp
//
// The C ABI of libgact.so (declared in bindings/gact.h): PyTorch's
// CUDAPluggableAllocator entry points over one caching allocator per device,
// plus tags and statistics. Thin by design: every function forwards to the
// core and converts failures, because nothing may cross a C boundary as an
// exception. Allocation failures become nullptr with a rate-limited log line;
// everything else is logged and counted by the core.
//
// PyTorch's allocator is gact_torch_alloc, the one entry point that throws:
// torch's CUDAPluggableAllocator does not check the pointer it gets (a null
// one would fault in the next kernel), and a C++ exception from the alloc
// function is how torch lets an allocator fail. The exception carries "CUDA out
// of memory", which torch turns into a RuntimeError with that text.
//
// Devices: each device's allocator makes its device current for the runtime
// calls it makes (cuda_backend's device guard), so these entry points are right
// whichever device the calling thread has current.
//
// Streams: PyTorch passes the allocation stream to both alloc and free, and
// reports other streams through the record-stream hook; the caching allocator
// keeps blocks per stream, so the `stream` argument of gact_free is not needed.
#include "bindings/gact.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include "allocator/stats_registry.hpp"
#include "allocator/tags.hpp"
#include "bindings/device_allocators.hpp"
#include "bindings/process_allocators.hpp"

gact::bindings::device_allocators& gact::bindings::process_device_allocators() {
  static device_allocators* const a = [] {
    auto* p = new device_allocators(gact::device::direct_cuda_api(), "cuda");
    gact::stats::install_dump_triggers();
    return p;
  }();
  return *a;
}

namespace {

using gact::bindings::device_allocators;

/// The allocators of this binary (never destroyed; see device_allocators.hpp).
device_allocators& allocators() { return gact::bindings::process_device_allocators(); }

/// gact_torch_alloc's thrower of torch's out-of-memory error (gact_set_oom_thrower); null: gact's own.
std::atomic<gact_oom_thrower> g_oom_thrower{nullptr};

/// "1.50 GiB": a size the way torch's out-of-memory message writes it.
std::string human_size(double bytes) {
  char const* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

/// Log an exception escaping an entry point (capped per call site by the caller's macro).
char const* what_of(std::exception_ptr e) noexcept {
  try {
    std::rethrow_exception(e);
  } catch (std::exception const& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace

extern "C" {

void* gact_alloc(ssize_t size, int device, cudaStream_t stream) {
  if (size <= 0) {
    if (size < 0) {
      GACT_WARN_CAPPED(8, "gact_alloc: negative size {} on device {}", static_cast<long long>(size), device);
    }
    return nullptr;
  }
  try {
    return allocators().get(device).allocate(static_cast<std::size_t>(size), gact::device::to_handle(stream));
  } catch (gact::out_of_memory const& e) {
    GACT_WARN_CAPPED(16, "gact_alloc({} bytes, device {}): {}", static_cast<long long>(size), device, e.what());
  } catch (...) {
    GACT_WARN_CAPPED(16, "gact_alloc({} bytes, device {}) failed: {}", static_cast<long long>(size), device,
                     what_of(std::current_exception()));
  }
  return nullptr;
}

void* gact_torch_alloc(ssize_t size, int device, cudaStream_t stream) {
  if (size <= 0) {
    return nullptr;  // torch asks for 0 bytes for an empty tensor and never dereferences it
  }
  try {
    return allocators().get(device).allocate(static_cast<std::size_t>(size), gact::device::to_handle(stream));
  } catch (gact::out_of_memory const& e) {
    // Counted in the allocator's num_ooms; the text is the one torch users match on.
    std::string msg = "CUDA out of memory. Tried to allocate " + human_size(static_cast<double>(size)) + " on GPU " +
                      std::to_string(device) + " (gact's caching allocator: " + e.what() + ")";
    if (gact_oom_thrower const t = g_oom_thrower.load(std::memory_order_acquire)) {
      t(msg.c_str(), static_cast<std::size_t>(size), device);  // throws torch's own error
      GACT_WARN_CAPPED(4, "gact_torch_alloc: the out-of-memory thrower returned; throwing gact's own error");
    }
    throw gact::out_of_memory(std::move(msg));
  }
}

gact_oom_thrower gact_set_oom_thrower(gact_oom_thrower thrower) {
  return g_oom_thrower.exchange(thrower, std::memory_order_acq_rel);
}

void gact_free(void* ptr, ssize_t size, int device, cudaStream_t /*stream*/) {
  if (ptr == nullptr) {
    return;
  }
  try {
    // one lookup under one lock on the usual path: the device torch names owns the block
    gact::alloc::caching_allocator* a = allocators().peek(device);
    if (a != nullptr && a->try_deallocate(ptr)) [[likely]] {
      return;
    }
    // A wrong device argument must not leak the block: find its owner.
    a = allocators().owner(ptr);
    if (a == nullptr) {
      if (gact::alloc::caching_allocator* any = allocators().peek(device)) {
        any->deallocate(ptr);  // counted and logged as a bad free in that allocator's stats
      } else {
        GACT_WARN_CAPPED(16, "gact_free({}, {} bytes, device {}): not allocated by gact (ignored)", ptr,
                         static_cast<long long>(size), device);
      }
      return;
    }
    a->deallocate(ptr);
  } catch (...) {
    GACT_WARN_CAPPED(16, "gact_free({}) failed: {}", ptr, what_of(std::current_exception()));
  }
}

void gact_record_stream(void* ptr, cudaStream_t stream) {
  if (ptr == nullptr) {
    return;
  }
  try {
    // (one lookup per device allocator in existence, the owner's recording it: no owns() first)
    bool recorded = false;
    allocators().for_each([&](int, gact::alloc::caching_allocator& a) {
      if (!recorded) recorded = a.try_record_stream(ptr, gact::device::to_handle(stream));
    });
    if (!recorded) {
      GACT_WARN_CAPPED(16, "gact_record_stream({}): not allocated by gact (ignored)", ptr);
      return;
    }
  } catch (...) {
    GACT_WARN_CAPPED(16, "gact_record_stream({}) failed: {}", ptr, what_of(std::current_exception()));
  }
}

void gact_empty_cache(void) {
  try {
    allocators().for_each([](int, gact::alloc::caching_allocator& a) { a.empty_cache(); });
  } catch (...) {
    GACT_WARN_CAPPED(16, "gact_empty_cache failed: {}", what_of(std::current_exception()));
  }
}

void gact_reset_peak_stats(void) {
  try {
    allocators().for_each([](int, gact::alloc::caching_allocator& a) { a.reset_peak_stats(); });
  } catch (...) {
    GACT_WARN_CAPPED(16, "gact_reset_peak_stats failed: {}", what_of(std::current_exception()));
  }
}

void gact_init(int device) {
  try {
    (void)allocators().get(device);
    gact::stats::install_dump_triggers();  // GACT_STATS_PATH may have been set since
  } catch (...) {
    GACT_WARN_CAPPED(16, "gact_init({}) failed: {}", device, what_of(std::current_exception()));
  }
}

void gact_set_memory_fraction(double fraction, int device) {
  try {
    allocators().set_memory_fraction(fraction, device);
  } catch (...) {
    GACT_WARN_CAPPED(16, "gact_set_memory_fraction({}, {}) failed: {}", fraction, device,
                     what_of(std::current_exception()));
  }
}

int gact_push_tag(char const* name) {
  if (name == nullptr) {
    GACT_WARN_CAPPED(8, "gact_push_tag(NULL) ignored");
    return -1;
  }
  try {
    gact::alloc::tag_id const id = gact::alloc::intern_tag(name);
    gact::alloc::push_tag(id);
    return static_cast<int>(id);
  } catch (...) {
    GACT_WARN_CAPPED(16, "gact_push_tag(\"{}\") failed: {}", name, what_of(std::current_exception()));
    return -1;
  }
}

void gact_pop_tag(void) { gact::alloc::pop_tag(); }

char* gact_stats_json(void) {
  try {
    (void)allocators();  // arm the dump triggers like every other entry point
    std::string const text = gact::stats::document().dump();
    auto* out = static_cast<char*>(std::malloc(text.size() + 1));
    if (out == nullptr) {
      return nullptr;
    }
    std::memcpy(out, text.c_str(), text.size() + 1);
    return out;
  } catch (...) {
    GACT_WARN_CAPPED(16, "gact_stats_json failed: {}", what_of(std::current_exception()));
    return nullptr;
  }
}

void gact_free_string(char* s) { std::free(s); }

int gact_dump_stats(char const* path) {
  try {
    std::string target = path != nullptr ? path : "";
    if (target.empty()) {
      char const* env = std::getenv("GACT_STATS_PATH");
      target = env != nullptr ? env : "";
    }
    if (target.empty()) {
      GACT_WARN_CAPPED(8, "gact_dump_stats: no path given and GACT_STATS_PATH is not set");
      return -1;
    }
    gact::stats::dump(target);
    return 0;
  } catch (...) {
    GACT_WARN_CAPPED(16, "gact_dump_stats failed: {}", what_of(std::current_exception()));
    return -1;
  }
}

}  // extern "C"
