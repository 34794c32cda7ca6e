// gact/bindings/python/torch_cpu.cpp
//
// `_gact_torch`: gact's host arena as torch's CPU allocator, so that torch's CPU tensors,
// gact's blobs and its decoded images share one pool. On the CPU, torch allocates with
// glibc malloc and gact's blobs live in gact's own arena: memory one side frees cannot
// serve the other (blob bytes released in backward stay idle while the gradients grow),
// and glibc's heap fragments under a compressed forward's pattern (a large activation
// freed right after its blob is written, between small long-lived allocations): measured
// on a 6-layer transformer encoder, 420 MiB free inside a 497 MiB heap at the end of
// forward. One pool fixes both, and its segments stay warm (no fresh page per step).
//
// This module depends on torch's c10 (headers and libc10) and nothing of gact's: the
// allocation functions come from `_gact` as a capsule (`_gact._host_allocator()`), so
// `_gact` itself never links torch. gact/allocator.py (use_cpu_allocator) installs and removes it.
//
// c10::Allocator changed in torch 2.3 (allocate() non-const, copy_data pure virtual);
// both forms are handled below.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#if __has_include(<torch/version.h>)
#include <torch/version.h>
#endif
#include <pybind11/pybind11.h>

#include "host_allocator_fns.h"
#include "../../allocator/device/external_blocks.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

#if defined(TORCH_VERSION_MAJOR) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3))
#define GACT_C10_ALLOCATE_CONST
#define GACT_C10_HAS_COPY_DATA 1
#else
#define GACT_C10_ALLOCATE_CONST const
#define GACT_C10_HAS_COPY_DATA 0
#endif

namespace {

using gact::bindings::host_allocator_fns;  // what _gact._host_allocator()'s capsule holds

std::atomic<host_allocator_fns const*> g_fns{nullptr};

void gact_delete(void* p) {
  if (p != nullptr) g_fns.load(std::memory_order_acquire)->free(p);
}

class gact_cpu_allocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t n) GACT_C10_ALLOCATE_CONST override {
    c10::Device const dev(c10::DeviceType::CPU);
    if (n == 0) return {nullptr, nullptr, &gact_delete, dev};
    char why[512] = {0};
    void* p = g_fns.load(std::memory_order_acquire)->alloc(n, why, sizeof why);
    TORCH_CHECK(p != nullptr, "gact: CPU allocator (gact's host arena): cannot allocate ", n, " bytes: ", why,
                " (gact.configure(memory_limit=...) caps it; gact.use_cpu_allocator(False) returns torch to "
                "its own allocator)");
    return {p, p, &gact_delete, dev};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &gact_delete; }
#if GACT_C10_HAS_COPY_DATA
  void copy_data(void* dest, void const* src, std::size_t count) const override {
    if (count != 0) std::memcpy(dest, src, count);
  }
#endif
};

gact_cpu_allocator g_allocator;
c10::Allocator* g_previous = nullptr;
constexpr std::uint8_t k_priority = 100;  // above torch's default (0); restoring uses it too

bool installed() { return c10::GetAllocator(c10::DeviceType::CPU) == &g_allocator; }

void install(py::capsule fns) {
  if (std::strcmp(fns.name(), "gact.host_allocator") != 0)
    throw py::value_error("_gact_torch.install: expected the capsule of _gact._host_allocator()");
  auto const* f = static_cast<host_allocator_fns const*>(fns.get_pointer());
  if (f == nullptr || f->version != 1 || f->alloc == nullptr || f->free == nullptr)
    throw py::value_error("_gact_torch.install: the capsule's entry points are of another version of _gact");
  // Memory handed out keeps its deleter, which uses these functions: set once, never replaced.
  host_allocator_fns const* expected = nullptr;
  if (!g_fns.compare_exchange_strong(expected, f) && expected != f)
    throw py::value_error("_gact_torch.install: already bound to another _gact");
  if (installed()) return;
  g_previous = c10::GetAllocator(c10::DeviceType::CPU);
  c10::SetAllocator(c10::DeviceType::CPU, &g_allocator, k_priority);
}

void uninstall() {
  if (!installed() || g_previous == nullptr) return;
  c10::SetAllocator(c10::DeviceType::CPU, g_previous, k_priority);  // tensors already served keep their deleter
}

// gact_torch_alloc's out-of-memory thrower (gact_oom_thrower in bindings/gact.h): torch's own error, which
// torch raises as torch.OutOfMemoryError (torch.cuda.OutOfMemoryError) and which cuDNN's workspace fallback
// and torch's own retry paths catch; without it gact's allocator fails with a RuntimeError.
[[noreturn]] void throw_torch_oom(char const* message, std::size_t /*bytes*/, int /*device*/) {
  C10_THROW_ERROR(OutOfMemoryError, message != nullptr ? message : "CUDA out of memory");
}

// What the thrower throws, caught as c10's type: the message, or None when it throws another type (a c10
// whose OutOfMemoryError is another class than this module was compiled against). A test of the module.
py::object check_oom_thrower(std::string const& message) {
  try {
    throw_torch_oom(message.c_str(), 0, 0);
  } catch (c10::OutOfMemoryError const& e) {
    return py::str(e.msg());
  } catch (...) {
  }
  return py::none();
}

// ---- torch's CUDA caching allocator as the blocks of the store's device arena -----------------------
// When gact is not torch's CUDA allocator, the activation store takes its device blobs and decoded images
// from torch's own pool (allocator/device/external_backend.hpp), without CUDA headers here:
// - the allocator is c10::GetAllocator(CUDA) where torch registers its caching allocator there, else the
//   caching allocator itself, found by its exported symbol (torch 2.x: the atomic
//   c10::cuda::CUDACachingAllocator::allocator, a c10::Allocator; 1.x: CUDACachingAllocator::get());
// - it allocates on torch's current device and current stream: the block's device is made current through
//   c10's device guard (torch's own notion of the current device, which may differ from the runtime's
//   before a context exists), and the stream is the calling thread's current one, as a tensor made there;
// - each block's DataPtr is held until gact frees it. Its deleter gives the block back to torch, which may
//   take the GIL (torch.cuda.memory._record_memory_history gathers Python stacks on frees): a free called
//   without the GIL (an autograd device thread freeing a decoded tensor) is deferred to the interpreter's
//   main thread (Py_AddPendingCall), and to the next allocation or free made with the GIL, so that no
//   thread waits for the GIL inside a free. (gact's arena calls these entry points with its own lock
//   released: caching_allocator's backend_unlocked.)

std::mutex g_blocks_mu;
auto* const g_blocks = new std::unordered_map<void*, c10::DataPtr>();  // never destroyed: frees may come at exit
auto* const g_deferred = new std::vector<c10::DataPtr>();              // frees made without the GIL

/// A symbol of a library the process has loaded already, whether loaded globally or not (torch loads its
/// libraries RTLD_LOCAL, so dlsym(RTLD_DEFAULT) does not see them); null when neither is there.
void* loaded_symbol(char const* library, char const* symbol) {
  void* h = ::dlopen(library, RTLD_LAZY | RTLD_NOLOAD);
  if (h == nullptr) return ::dlsym(RTLD_DEFAULT, symbol);
  void* p = ::dlsym(h, symbol);
  ::dlclose(h);  // (NOLOAD took a reference of its own; the library stays loaded)
  return p;
}

c10::Allocator* cuda_allocator() {
  static std::atomic<c10::Allocator*> found{nullptr};  // (a null answer is asked again: torch may load later)
  if (c10::Allocator* a = found.load(std::memory_order_acquire)) return a;
  c10::Allocator* a = c10::GetAllocator(c10::DeviceType::CUDA);  // (null where torch never registers it)
  if (a == nullptr) {
    if (void* sym = loaded_symbol("libc10_cuda.so", "_ZN3c104cuda20CUDACachingAllocator9allocatorE")) {
      // std::atomic<CUDAAllocator*>; CUDAAllocator derives from c10::Allocator alone (the same address)
      a = static_cast<c10::Allocator*>(static_cast<std::atomic<void*>*>(sym)->load());
    } else if (void* fn = loaded_symbol("libc10_cuda.so", "_ZN3c104cuda20CUDACachingAllocator3getEv")) {
      a = reinterpret_cast<c10::Allocator* (*)()>(fn)();
    }
  }
  if (a != nullptr) found.store(a, std::memory_order_release);
  return a;
}

/// The frees deferred by threads without the GIL, done now (the caller holds the GIL).
void drain_deferred() {
  std::vector<c10::DataPtr> done;
  {
    std::lock_guard lk(g_blocks_mu);
    if (g_deferred->empty()) return;
    done.swap(*g_deferred);
  }
  done.clear();  // torch's deleters, outside the lock
}

// A deferred free is also handed to the interpreter's main thread, which runs it between two bytecodes (holding
// the GIL and none of gact's locks): blocks do not wait for the next put or get (the last decoded images of a
// backward would otherwise stay out of torch's pool through optimizer.step()). One call in flight at a time.
std::atomic<bool> g_drain_scheduled{false};

int drain_pending_call(void*) {
  g_drain_scheduled.store(false, std::memory_order_release);
  try {
    drain_deferred();
  } catch (...) {
  }
  return 0;
}

void schedule_drain() noexcept {
  if (!g_drain_scheduled.exchange(true, std::memory_order_acq_rel) && Py_AddPendingCall(&drain_pending_call, nullptr) != 0)
    g_drain_scheduled.store(false, std::memory_order_release);  // (the queue was full: the next put or get drains)
}

void* torch_block_alloc(std::size_t bytes, int device, char* why, std::size_t why_len) noexcept {
  try {
    if (PyGILState_Check()) drain_deferred();
    c10::Allocator* a = cuda_allocator();
    if (a == nullptr) {
      std::snprintf(why, why_len, "no CUDA allocator is registered in torch's c10 (a torch without CUDA)");
      return nullptr;
    }
    c10::Device const dev(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
    std::optional<c10::DeviceGuard> guard;
    if (c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) guard.emplace(dev);
    c10::DataPtr d = a->allocate(bytes);
    void* p = d.get();
    if (p == nullptr) {
      std::snprintf(why, why_len, "torch's CUDA allocator returned no memory");
      return nullptr;
    }
    if (d.device() != dev) {
      std::snprintf(why, why_len, "torch's CUDA allocator gave memory of %s, not of %s", d.device().str().c_str(),
                    dev.str().c_str());
      return nullptr;  // (d frees it)
    }
    std::lock_guard lk(g_blocks_mu);
    g_blocks->emplace(p, std::move(d));
    return p;
  } catch (c10::Error const& e) {
    std::snprintf(why, why_len, "%s", e.what_without_backtrace());
  } catch (std::exception const& e) {
    std::snprintf(why, why_len, "%s", e.what());
  } catch (...) {
    std::snprintf(why, why_len, "unknown exception from torch's CUDA allocator");
  }
  return nullptr;
}

void torch_block_free(void* p, int /*device*/) noexcept {
  c10::DataPtr d;
  bool const gil = PyGILState_Check() != 0;
  bool deferred = false;
  {
    std::lock_guard lk(g_blocks_mu);
    auto it = g_blocks->find(p);
    if (it == g_blocks->end()) return;
    d = std::move(it->second);
    g_blocks->erase(it);
    if (!gil) {
      try {
        g_deferred->push_back(std::move(d));
        deferred = true;
      } catch (...) {  // (no memory for the list: freed now)
      }
    }
  }
  if (deferred) {
    schedule_drain();
    return;
  }
  try {
    d.clear();  // torch's deleter, outside the lock
    if (gil) drain_deferred();
  } catch (...) {
  }
}

gact::device::external_blocks const g_torch_blocks{1, &torch_block_alloc, &torch_block_free};

std::size_t torch_blocks_held() {
  drain_deferred();
  std::lock_guard lk(g_blocks_mu);
  return g_blocks->size() + g_deferred->size();
}

// Tests on a machine without CUDA: an allocator registered for CUDA in c10 that serves host memory and counts,
// standing in for torch's caching allocator (c10::SetAllocator, as libc10_cuda registers its own).
std::atomic<std::size_t> g_fake_allocs{0}, g_fake_frees{0};

void fake_cuda_delete(void* p) {
  if (p == nullptr) return;
  g_fake_frees.fetch_add(1, std::memory_order_relaxed);
  std::free(p);
}

class fake_cuda_allocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t n) GACT_C10_ALLOCATE_CONST override {
    c10::Device const dev(c10::DeviceType::CUDA, 0);
    if (n > (std::size_t{1} << 30)) C10_THROW_ERROR(OutOfMemoryError, "CUDA out of memory (the test allocator)");
    void* p = std::malloc(n == 0 ? 1 : n);
    g_fake_allocs.fetch_add(1, std::memory_order_relaxed);
    return {p, p, &fake_cuda_delete, dev};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &fake_cuda_delete; }
#if GACT_C10_HAS_COPY_DATA
  void copy_data(void* dest, void const* src, std::size_t count) const override {
    if (count != 0) std::memcpy(dest, src, count);
  }
#endif
};

fake_cuda_allocator g_fake_cuda;

/// A saved tensor's version counter, which its views and aliases share and which torch's own check of in-place
/// changes reads: held without the tensor (and its memory), so that the Compressor sees a change made through an
/// alias after the program dropped the tensor itself, as torch does. `current()` is -1 for a tensor without a
/// counter (an inference tensor).
struct version_ref {
  c10::VariableVersion counter;
  std::int64_t current() const { return counter.enabled() ? std::int64_t(counter.current_version()) : -1; }
};

/// A tensor's storage, held weakly: `same(impl)` tells whether the tensor at `impl` still uses that very storage. A
/// weak reference keeps the StorageImpl's own memory allocated (c10's intrusive_ptr frees it with the last weak
/// reference), so no other storage can be at its address while this lives: an address compared alone would take a
/// storage freed and another made at the same place (`t.data = a` then `t.data = b`) for the one saved.
struct storage_ref {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  bool same(std::uintptr_t impl) const {
    if (impl == 0) return false;
    auto const* t = reinterpret_cast<c10::TensorImpl const*>(impl);
    if (!t->has_storage()) return false;
    return t->storage().unsafeGetStorageImpl() == storage._unsafe_get_target();
  }
};

/// Both of the above for one saved tensor, made by one call (a save pays for one object, not two): the tensor's version
/// counter (`current()`, as version_ref's) and its storage held weakly (`same(impl)`, as storage_ref's; true for any
/// tensor where the saved one had no storage, as a missing storage_ref checks nothing).
struct saved_ref {
  c10::VariableVersion counter;
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;
  std::int64_t current() const { return counter.enabled() ? std::int64_t(counter.current_version()) : -1; }
  bool same(std::uintptr_t impl) const {
    if (!storage) return true;
    if (impl == 0) return false;
    auto const* t = reinterpret_cast<c10::TensorImpl const*>(impl);
    if (!t->has_storage()) return false;
    return t->storage().unsafeGetStorageImpl() == storage->_unsafe_get_target();
  }
};

}  // namespace

#ifdef GACT_TORCH_GRAPH
namespace gact::bindings {
void register_graph(py::module_& m);  // torch_graph.cpp: graph_reaches
}
#endif

PYBIND11_MODULE(_gact_torch, m) {
  m.doc() = "gact's host arena as torch's CPU allocator (use gact.use_cpu_allocator)";
#ifdef GACT_TORCH_GRAPH
  gact::bindings::register_graph(m);
#endif
  m.def("install", &install, py::arg("fns"), "Serve torch's CPU tensors from gact's host arena.");
  m.def("uninstall", &uninstall, "Give torch its previous CPU allocator back (served tensors stay valid).");
  m.def("installed", &installed, "Whether torch's CPU allocator is gact's now.");
  m.def(
      "oom_thrower", [] { return reinterpret_cast<std::uintptr_t>(&throw_torch_oom); },
      "The address of a gact_oom_thrower raising c10's OutOfMemoryError (gact_set_oom_thrower).");
  m.def("check_oom_thrower", &check_oom_thrower, py::arg("message"),
        "Call the thrower and catch c10::OutOfMemoryError: its message, or None if another type came out.");
  m.def(
      "device_blocks",
      [] { return py::capsule(static_cast<void const*>(&g_torch_blocks), "gact.device_blocks"); },
      "torch's CUDA caching allocator (c10::GetAllocator(CUDA)) as the blocks of the store's device arena "
      "(the capsule _gact.set_device_blocks takes).");
  m.def("device_blocks_held", &torch_blocks_held,
        "Blocks of torch's CUDA allocator gact holds now (frees deferred by threads without the GIL are done first).");
  m.def(
      "_loaded_symbol",
      [](std::string const& library, std::string const& symbol) {
        return reinterpret_cast<std::uintptr_t>(loaded_symbol(library.c_str(), symbol.c_str()));
      },
      py::arg("library"), py::arg("symbol"),
      "Tests: the address of `symbol` in an already loaded `library` (as the CUDA allocator is found), or 0.");
  m.def(
      "_install_fake_cuda_allocator",
      [] {
        c10::SetAllocator(c10::DeviceType::CUDA, &g_fake_cuda, k_priority);
        return py::make_tuple(g_fake_allocs.load(), g_fake_frees.load());
      },
      "Tests without CUDA: register a counting host-memory allocator for CUDA in c10; returns (allocs, frees).");
  m.def(
      "_fake_cuda_counts", [] { return py::make_tuple(g_fake_allocs.load(), g_fake_frees.load()); },
      "(allocs, frees) of the test allocator.");
  py::class_<version_ref>(m, "VersionRef", "A tensor's version counter, held without the tensor (version_ref).")
      .def("current", &version_ref::current, "The counter's value now; -1 for a tensor without one.");
  m.def(
      "version_ref",
      [](std::uintptr_t impl) {
        if (impl == 0) throw py::value_error("version_ref: a null TensorImpl address");
        return version_ref{reinterpret_cast<c10::TensorImpl const*>(impl)->version_counter()};
      },
      py::arg("impl"), "The version counter of the tensor whose TensorImpl is at `impl` (torch.Tensor._cdata).");
  py::class_<storage_ref>(m, "StorageRef", "A tensor's storage, held weakly (storage_ref).")
      .def("same", &storage_ref::same, py::arg("impl"),
           "Whether the tensor whose TensorImpl is at `impl` uses this storage now.");
  m.def(
      "storage_ref",
      [](std::uintptr_t impl) -> py::object {
        if (impl == 0) throw py::value_error("storage_ref: a null TensorImpl address");
        auto const* t = reinterpret_cast<c10::TensorImpl const*>(impl);
        if (!t->has_storage()) return py::none();
        return py::cast(storage_ref{t->storage().getWeakStorageImpl()});
      },
      py::arg("impl"),
      "The storage of the tensor whose TensorImpl is at `impl` (torch.Tensor._cdata), held weakly; None without one.");
  py::class_<saved_ref>(m, "SavedRef", "A saved tensor's version counter and storage, held without it (saved_ref).")
      .def("current", &saved_ref::current, "The counter's value now; -1 for a tensor without one.")
      .def("same", &saved_ref::same, py::arg("impl"),
           "Whether the tensor whose TensorImpl is at `impl` uses the saved tensor's storage now (true where that "
           "tensor had none).");
  m.def(
      "saved_ref",
      [](std::uintptr_t impl) {
        if (impl == 0) throw py::value_error("saved_ref: a null TensorImpl address");
        auto const* t = reinterpret_cast<c10::TensorImpl const*>(impl);
        saved_ref r{t->version_counter(), std::nullopt};
        if (t->has_storage()) r.storage = t->storage().getWeakStorageImpl();
        return r;
      },
      py::arg("impl"),
      "version_ref and storage_ref of the tensor whose TensorImpl is at `impl` (torch.Tensor._cdata) in one object.");
}
