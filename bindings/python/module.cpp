// gact/bindings/python/module.cpp
//
// The _gact extension module: a thin pybind11 layer over the C++ core, with no
// logic of its own. It never includes libtorch: the Python package hands it raw
// data pointers, dtype names, shape/stride tuples, device indices and stream
// handles as integers (DESIGN decision 4), so one build serves every torch
// version from 1.13 on, CPU and CUDA.
//
// Process-wide state lives in one `runtime` object created at import and never
// destroyed (Python finalizers may still release handles while the interpreter
// shuts down): the options read from GACT_* variables, the host backend and its
// caching allocator ("host"), the device arenas (the process's CUDA allocators
// of bindings/process_allocators.hpp, which this module also serves to torch
// through the C ABI it links and exports), and the activation store. Encode and
// decode release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <atomic>
#include <cstring>
#include <optional>
#include <pthread.h>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/host_backend.hpp"
#include "allocator/error.hpp"
#include "allocator/event_trace.hpp"
#include "allocator/log.hpp"
#include "allocator/options.hpp"
#include "allocator/stats_registry.hpp"
#include "allocator/store/activation_store.hpp"
#include "allocator/tags.hpp"
#include "bindings/python/host_allocator_fns.h"
#include "codecs/codec.hpp"
#include "policy/controller.hpp"
#include "swap/mover.hpp"
#include "swap/pinned_pool.hpp"

#include "allocator/device/external_blocks.hpp"

#if defined(GACT_HAVE_KERNELS)
#include "allocator/device/external_backend.hpp"
#include "allocator/device/pinned_host_backend.hpp"
#include "bindings/process_allocators.hpp"
#endif

namespace py = pybind11;

namespace {

using gact::store::activation_store;

struct runtime {
  gact::options opts = gact::options::from_env();
  // (pages of 64 KiB for expandable segments: a memory limit and a release act at that grain on the host)
  gact::device::host_backend host_be{0, std::size_t{64} << 10};
  gact::alloc::caching_allocator host_arena{host_be, host_options()};
  activation_store store{host_arena, gact::store::store_options{static_cast<int>(opts.threads), "store"}};
#if defined(GACT_HAVE_KERNELS)
  std::mutex cuda_mu;
  std::vector<std::pair<int, gact::alloc::caching_allocator*>> cuda_arenas;  // (device, arena), see ensure_device
  // set_device_blocks: the store's device arenas made from now on take their memory from these blocks
  // (torch's CUDA caching allocator) through a thin layer; null: gact's own device pool (the one
  // use_allocator() hands to torch). The backends and arenas made over them are never destroyed.
  std::optional<gact::device::external_blocks> device_blocks;
  std::vector<std::unique_ptr<gact::device::cuda_backend>> blocks_delegates;
  std::vector<std::unique_ptr<gact::device::external_backend>> blocks_backends;
  std::vector<std::unique_ptr<gact::alloc::caching_allocator>> blocks_arenas;
#endif
  // Some device arena takes torch's blocks: device puts and gets keep the GIL (torch's allocator may take
  // it, under the arena's lock, to record Python stacks; a thread waiting for it there while another
  // holding it waits for the lock would deadlock).
  std::atomic<bool> blocks_in_use{false};

  // Swap (swap_enable/swap_disable): one mover per arena and setting. Movers are never destroyed,
  // since stored entries keep pointers to the mover that holds their blob. Lock order: cuda_mu, swap_mu.
  std::mutex swap_mu;
  bool swap_on = false;
  gact::swap::mover_options swap_opts;
  gact::device::host_backend swap_host_pinned;  // "pinned" memory for CPU tensors: plain host memory
  std::vector<std::unique_ptr<gact::device::backend>> swap_backends;
  std::vector<std::unique_ptr<gact::swap::pinned_pool>> swap_pools;
  std::vector<std::unique_ptr<gact::swap::mover>> swap_movers;
  std::array<gact::swap::mover*, 65> swap_current{};  // by device + 1, for swap_opts

  // The mover allocates on its own copy stream, while torch ties each block to the calling thread's current
  // stream and may hand out one whose last user's kernels are still queued there: swap needs gact's pool.
  // Checked before anything changes (requires cuda_mu).
  [[noreturn]] static void refuse_swap_over_blocks(int dev) {
    GACT_FAIL("gact: swap cannot offload compressed activations that live in torch's CUDA pool (device " +
              std::to_string(dev) + "'s first stored tensor put them there); set GACT_TORCH_POOL=0, or enable "
              "swap on the first Compressor that trains on the GPU");
  }

  // Requires swap_mu. Hand device `dev`'s blobs (arena `arena`) to a mover with swap_opts.
  void attach_swap(int dev, gact::alloc::caching_allocator& arena) {
    auto& cur = swap_current[static_cast<std::size_t>(dev + 1)];
    if (cur == nullptr) {
      gact::device::backend* pinned = &swap_host_pinned;
#if defined(GACT_HAVE_KERNELS)
      if (dev >= 0) {
        swap_backends.push_back(std::make_unique<gact::device::pinned_host_backend>(dev));
        pinned = swap_backends.back().get();
      }
#endif
      gact::swap::pinned_pool_options po;
      po.name = dev < 0 ? "pinned" : "pinned:" + std::to_string(dev);
      swap_pools.push_back(std::make_unique<gact::swap::pinned_pool>(*pinned, po));
      swap_movers.push_back(std::make_unique<gact::swap::mover>(arena, *swap_pools.back(), swap_opts));
      cur = swap_movers.back().get();
    }
    store.set_mover(dev, cur);
  }

  void swap_enable(std::size_t budget, std::size_t prefetch) {
#if defined(GACT_HAVE_KERNELS)
    std::lock_guard cuda_lock(cuda_mu);
#endif
    std::lock_guard lock(swap_mu);
#if defined(GACT_HAVE_KERNELS)
    for (auto const& [dev, arena] : cuda_arenas)
      for (auto const& b : blocks_arenas)
        if (b.get() == arena) refuse_swap_over_blocks(dev);
#endif
    if (budget != swap_opts.device_budget || prefetch != swap_opts.lookahead_blobs) swap_current.fill(nullptr);
    swap_opts.device_budget = budget;
    swap_opts.lookahead_blobs = prefetch;
    swap_opts.lookahead_bytes = 0;
    swap_on = true;
    attach_swap(-1, host_arena);
#if defined(GACT_HAVE_KERNELS)
    for (auto const& [dev, arena] : cuda_arenas) attach_swap(dev, *arena);
#endif
  }

  void swap_disable() {
    std::lock_guard lock(swap_mu);
    swap_on = false;
    for (int dev = -1; dev < 64; ++dev) store.set_mover(dev, nullptr);
  }

  gact::alloc::caching_allocator& arena_for(int dev) {
    if (dev < 0) return host_arena;
#if defined(GACT_HAVE_KERNELS)
    std::lock_guard lock(cuda_mu);
    for (auto const& [d, arena] : cuda_arenas)
      if (d == dev) return *arena;
#endif
    GACT_FAIL("gact: no arena for CUDA device " + std::to_string(dev));
  }

  gact::alloc::allocator_options host_options() const {
    gact::alloc::allocator_options o;
    o.name = "host";
    o.memory_limit = static_cast<std::size_t>(opts.memory_limit);
    // Host memory is counted by the pages a process touched (its RSS): segments sized close to their
    // blocks, so that the arena keeps little beyond what blobs and decoded tensors use.
    o.small_size = std::size_t{128} << 10;
    o.small_segment_size = std::size_t{512} << 10;
    o.min_large_alloc = std::size_t{512} << 10;
    o.large_segment_size = std::size_t{1} << 20;
    o.round_large = std::size_t{16} << 10;
    // A freed tensor of 256 MiB or more goes back to the system at once (torch's CPU allocator, through
    // glibc, unmaps it too): a 1-2 GiB tensor must not stay in the process's RSS after `del`.
    o.release_free_above = std::size_t{256} << 20;
    // A request the cache cannot serve first returns the free blocks of 16 MiB or more: a blob freed at its last
    // read (64 MiB beside a 512 MiB attention map) stood in the peak beside the next large tensor's new pages.
    o.release_on_miss_above = opts.host_release_on_miss_above;
    o.expandable_segments = opts.host_expandable;
    return o;
  }

  // Make sure the store has an arena for CUDA device `dev`: the process's allocator of that
  // device, the one gact_torch_alloc / gact_free serve torch from after gact.use_allocator()
  // (bindings/process_allocators.hpp), so a device caches memory once.
  void ensure_device(int dev) {
#if defined(GACT_HAVE_KERNELS)
    std::lock_guard lock(cuda_mu);
    for (auto const& [d, a] : cuda_arenas) {
      if (d == dev) return;
    }
    gact::alloc::caching_allocator* a = nullptr;
    if (device_blocks) {
      {
        std::lock_guard swap_lock(swap_mu);
        if (swap_on) refuse_swap_over_blocks(dev);
      }
      blocks_delegates.push_back(std::make_unique<gact::device::cuda_backend>(dev));
      std::string const name = "cuda:" + std::to_string(dev) + ":store";
      blocks_backends.push_back(
          std::make_unique<gact::device::external_backend>(*device_blocks, *blocks_delegates.back(), name));
      blocks_arenas.push_back(std::make_unique<gact::alloc::caching_allocator>(
          *blocks_backends.back(), gact::device::pass_through_options(name)));
      a = blocks_arenas.back().get();
      blocks_in_use.store(true, std::memory_order_release);
    } else {
      a = &gact::bindings::process_device_allocators().get(dev);
    }
    gact::alloc::caching_allocator& arena = *a;
    store.set_device_arena(dev, &arena);
    {
      std::lock_guard swap_lock(swap_mu);
      if (swap_on) attach_swap(dev, arena);
    }
    cuda_arenas.emplace_back(dev, &arena);
#else
    GACT_FAIL("gact: tensor on CUDA device " + std::to_string(dev) +
              " but this build of gact has no CUDA kernels (rebuild with the CUDA toolkit)");
#endif
  }
};

runtime* make_runtime() {
  auto* r = new runtime();
  // torch's CPU tensors may come from the host arena (gact.use_cpu_allocator): a fork (DataLoader
  // workers) while another thread is inside it must not leave the child's arena locked.
  static runtime* forked = r;
  if (::pthread_atfork([] { forked->host_arena.fork_prepare(); }, [] { forked->host_arena.fork_parent(); },
                       [] { forked->host_arena.fork_child(); }) != 0)
    GACT_LOG_WARN("gact: pthread_atfork failed: a fork while another thread allocates may hang the child");
  return r;
}

runtime& rt() {
  static runtime* r = make_runtime();  // never destroyed: see the file comment
  return *r;
}

// ---- the host arena as torch's CPU allocator (bindings/python/torch_cpu.cpp) ----------------
// Handed to torch_cpu.cpp as the capsule of _host_allocator() (host_allocator_fns.h).
using gact::bindings::host_allocator_fns;

void* host_torch_alloc(std::size_t bytes, char* why, std::size_t why_len) noexcept {
  try {
    gact::alloc::tag_id tag = gact::alloc::current_tag();
    if (tag == gact::alloc::tag_other) {
      static gact::alloc::tag_id const torch_tag = gact::alloc::intern_tag("torch");
      tag = torch_tag;
    }
    return rt().host_arena.allocate(bytes, 0, tag);
  } catch (std::exception const& e) {
    std::snprintf(why, why_len, "%s", e.what());
  } catch (...) {
    std::snprintf(why, why_len, "unknown error");
  }
  return nullptr;
}

void host_torch_free(void* p) noexcept { rt().host_arena.deallocate(p); }

host_allocator_fns const g_host_allocator_fns{1, &host_torch_alloc, &host_torch_free};

// A host tensor of fewer bytes is encoded or decoded with the GIL held (see store_put).
constexpr std::size_t kReleaseGilBytes = std::size_t(256) << 10;

std::size_t elements(std::vector<std::int64_t> const& shape) {
  std::size_t n = 1;
  for (std::int64_t d : shape) n *= static_cast<std::size_t>(d > 0 ? d : 0);
  return n;
}

std::vector<std::int64_t> to_vec(py::sequence const& s) {
  std::vector<std::int64_t> v;
  v.reserve(py::len(s));
  for (auto const& x : s) v.push_back(x.cast<std::int64_t>());
  return v;
}

gact::codec::codec_id parse_codec(std::string const& name) {
  if (name == "quant") return gact::codec::codec_id::quant;
  if (name == "raw") return gact::codec::codec_id::raw;
  if (name == "mask") return gact::codec::codec_id::mask;
  GACT_FAIL("codec: '" + name + "' is unknown; use quant, raw or mask");
}

py::object json_loads(std::string const& s) { return py::module_::import("json").attr("loads")(s); }

gact::store::role parse_role(std::string const& name) {
  if (name == "values") return gact::store::role::values;
  if (name == "predicate") return gact::store::role::predicate;
  if (name == "indices") return gact::store::role::indices;
  GACT_FAIL("role: '" + name + "' is unknown; use values, predicate or indices");
}

gact::codec::predicate parse_predicate(std::string const& name) {
  for (std::uint32_t i = 1; i <= gact::codec::k_predicate_max; ++i) {
    auto const p = static_cast<gact::codec::predicate>(i);
    if (name == gact::codec::predicate_name(p)) return p;
  }
  GACT_FAIL("predicate: '" + name + "' is unknown; use gt, ge, lt, le, open, closed or ne");
}

// ---- DLPack (the ABI, declared here: https://dmlc.github.io/dlpack; no dependency) ----------
struct dl_device {
  std::int32_t device_type;  // 1 = kDLCPU, 2 = kDLCUDA
  std::int32_t device_id;
};
struct dl_dtype {
  std::uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct dl_tensor {
  void* data;
  dl_device device;
  std::int32_t ndim;
  dl_dtype dtype;
  std::int64_t* shape;
  std::int64_t* strides;
  std::uint64_t byte_offset;
};
struct dl_managed_tensor {
  dl_tensor dl;
  void* manager_ctx;
  void (*deleter)(dl_managed_tensor*);
};

/// What a capsule owns: the decoded image (its memory returns to the pool with the last owner) and the
/// shape and strides arrays the DLPack struct points at.
struct dl_owner {
  dl_managed_tensor managed{};
  std::shared_ptr<gact::store::decoded_image const> image;
  std::vector<std::int64_t> shape, strides;
};

dl_dtype dl_dtype_of(gact::codec::dtype t) {
  using D = gact::codec::dtype;
  switch (t) {
    case D::float32: return {2, 32, 1};
    case D::float16: return {2, 16, 1};
    case D::bfloat16: return {4, 16, 1};
    case D::float64: return {2, 64, 1};
    case D::uint8: return {1, 8, 1};
    case D::boolean: return {1, 8, 1};  // torch 1.13's DLPack has no bool: uint8, viewed as bool in Python
    case D::int8: return {0, 8, 1};
    case D::int16: return {0, 16, 1};
    case D::int32: return {0, 32, 1};
    case D::int64: return {0, 64, 1};
  }
  GACT_FAIL("dlpack: unknown dtype");
}

py::capsule make_dlpack(std::shared_ptr<gact::store::decoded_image const> img, gact::store::tensor_info const& info,
                        std::vector<std::int64_t> shape, std::vector<std::int64_t> strides, std::int64_t offset) {
  GACT_EXPECTS(shape.size() == strides.size(), "dlpack: shape and strides differ in length");
  std::size_t const es = gact::store::element_size(info.dtype);
  // The view must lie inside the image.
  std::int64_t lo = offset, hi = offset;
  bool empty = false;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    GACT_EXPECTS(shape[i] >= 0 && strides[i] >= 0, "dlpack: negative extent or stride");
    if (shape[i] == 0) empty = true;
    else hi += (shape[i] - 1) * strides[i];
  }
  GACT_EXPECTS(empty || (lo >= 0 && static_cast<std::size_t>(hi + 1) * es <= std::max<std::size_t>(img->bytes(), es)),
               "dlpack: the view (offset " + std::to_string(offset) + ") lies outside the decoded image of " +
                   std::to_string(img->bytes()) + " bytes");
  auto* owner = new dl_owner();
  owner->image = std::move(img);
  owner->shape = std::move(shape);
  owner->strides = std::move(strides);
  dl_tensor& t = owner->managed.dl;
  t.data = static_cast<char*>(const_cast<void*>(owner->image->data())) + (empty ? 0 : offset * std::int64_t(es));
  t.device = info.device < 0 ? dl_device{1, 0} : dl_device{2, info.device};
  t.ndim = static_cast<std::int32_t>(owner->shape.size());
  t.dtype = dl_dtype_of(info.dtype);
  t.shape = owner->shape.data();
  t.strides = owner->strides.data();
  t.byte_offset = 0;
  owner->managed.manager_ctx = owner;
  owner->managed.deleter = [](dl_managed_tensor* self) { delete static_cast<dl_owner*>(self->manager_ctx); };
  // A capsule that no consumer renamed ("used_dltensor") still owns its tensor.
  return py::capsule(&owner->managed, "dltensor", [](PyObject* cap) {
    if (PyCapsule_IsValid(cap, "dltensor")) {
      auto* mt = static_cast<dl_managed_tensor*>(PyCapsule_GetPointer(cap, "dltensor"));
      if (mt != nullptr && mt->deleter != nullptr) mt->deleter(mt);
    } else {
      PyErr_Clear();
    }
  });
}

// ---- options that act at once (gact.configure) ----------------------------------------
// Settings the core reads live are applied here; the ones a Compressor reads at
// construction (bits, group_size, ...) act on Compressors built afterwards; threads sizes
// the store's codec executor at start and cannot change later, so a change is rejected.
void apply_option(runtime& r, std::string const& keyword, std::string const& value) {
  gact::options next = r.opts;
  next.set(keyword, value);  // validated: ValueError naming the keyword
  if (next.threads != r.opts.threads) {
    GACT_FAIL("threads: the codec executor's thread count is fixed when gact starts (it is " +
              std::to_string(r.opts.threads) + "); set GACT_THREADS before importing gact");
  }
  if (next.stats_path != r.opts.stats_path) gact::stats::set_dump_path(next.stats_path);
  if (next.trace != r.opts.trace) gact::alloc::event_trace::enable(static_cast<std::size_t>(next.trace));
  if (next.log_level != r.opts.log_level) gact::log::set_level(std::string(gact::level_name(next.log_level)));
  if (next.memory_limit != r.opts.memory_limit) {
    r.host_arena.set_memory_limit(static_cast<std::size_t>(next.memory_limit));
  }
  r.opts = next;
}

/// Sections the core writes itself; stats_set_section must not replace them.
bool core_section(std::string const& name) {
  for (char const* s : {"schema_version", "gact_version", "pid", "time_unix_ms", "allocators", "tags", "store",
                        "codecs", "swap", "policy", "timeline", "snapshots", "preload"}) {
    if (name == s) return true;
  }
  return name.starts_with("allocators/");
}

}  // namespace

PYBIND11_MODULE(_gact, m) {
  m.doc() = "gact's C++ core (activation store, codecs, tags, stats, options); use the gact package";
  m.attr("__version__") = GACT_VERSION;
  // the largest magnitude the store quantizes (a mask's fill from there on is kept exact: codecs/codec.hpp)
  m.attr("store_max_magnitude") = gact::codec::k_store_max_magnitude;
  gact::codec::detail::ensure_stats_registered();  // the codecs section is in every document, used or not
#if defined(GACT_HAVE_KERNELS)
  m.attr("have_kernels") = true;
#else
  m.attr("have_kernels") = false;
#endif

  // Map gact's error types onto Python exceptions.
  static py::exception<gact::error> gact_error(m, "GactError", PyExc_RuntimeError);
  static py::exception<gact::corrupt_blob> corrupt(m, "CorruptBlobError", gact_error.ptr());
  static py::exception<gact::out_of_memory> oom(m, "OutOfMemoryError", PyExc_MemoryError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (gact::corrupt_blob const& e) {
      PyErr_SetString(corrupt.ptr(), e.what());
    } catch (gact::invalid_argument const& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (gact::out_of_memory const& e) {
      PyErr_SetString(oom.ptr(), e.what());
    } catch (gact::error const& e) {
      PyErr_SetString(gact_error.ptr(), e.what());
    }
  });

  // ---- activation store ----------------------------------------------------------------
  m.def(
      "store_put",
      [](std::uintptr_t ptr, std::string const& dtype, py::sequence shape, py::sequence strides, int device,
         std::int64_t version, std::uintptr_t storage, std::uint64_t key, int bits, int group_size, std::uint64_t seed,
         std::uintptr_t stream, std::string const& role, int threads, py::object norm, py::object pred, bool clamped,
         py::object window, gact::store::owner_id owner, bool boundary, int min_bits, std::uint64_t group) {
        gact::store::tensor_view v;
        v.data = reinterpret_cast<void const*>(ptr);
        v.dtype = gact::store::parse_dtype(dtype);
        v.shape = to_vec(shape);
        v.strides = to_vec(strides);
        v.device = device;
        v.version = version;
        v.storage = storage;
        gact::store::put_params p;
        p.key = key;
        p.bits = bits;
        p.group_size = group_size;
        p.seed = seed;
        p.stream = stream;
        p.what = parse_role(role);
        p.threads = threads;
        p.clamped = clamped;
        if (!norm.is_none()) {  // (count, inner, shift pointer, scale pointer)
          auto t = norm.cast<py::tuple>();
          GACT_EXPECTS(t.size() == 4, "store_put: norm must be (count, inner, shift_ptr, scale_ptr)");
          p.norm_count = t[0].cast<std::uint64_t>();
          p.norm_inner = t[1].cast<std::uint64_t>();
          p.norm_shift = reinterpret_cast<float const*>(t[2].cast<std::uintptr_t>());
          p.norm_scale = reinterpret_cast<float const*>(t[3].cast<std::uintptr_t>());
        }
        if (!pred.is_none()) {  // (name, a, b)
          auto t = pred.cast<py::tuple>();
          GACT_EXPECTS(t.size() == 3, "store_put: pred must be (predicate name, a, b)");
          p.pred.pred = static_cast<std::uint32_t>(parse_predicate(t[0].cast<std::string>()));
          p.pred.a = t[1].cast<float>();
          p.pred.b = t[2].cast<float>();
        }
        if (!window.is_none()) {  // dict: nd, inner, in, out, kernel, stride, pad, dilation
          auto d = window.cast<py::dict>();
          p.window.nd = d["nd"].cast<std::uint32_t>();
          p.window.inner = d["inner"].cast<std::uint64_t>();
          GACT_EXPECTS(p.window.nd >= 1 && p.window.nd <= 3, "store_put: window nd must be 1, 2 or 3");
          auto fill = [&](char const* k, std::int64_t* out) {
            auto seq = d[k].cast<py::sequence>();
            GACT_EXPECTS(py::len(seq) == p.window.nd, std::string("store_put: window ") + k + " needs nd values");
            for (std::uint32_t i = 0; i < p.window.nd; ++i) out[i] = seq[i].cast<std::int64_t>();
          };
          fill("in", p.window.in);
          fill("out", p.window.out);
          fill("kernel", p.window.kernel);
          fill("stride", p.window.stride);
          fill("pad", p.window.pad);
          fill("dilation", p.window.dilation);
        }
        p.owner = owner;
        p.boundary = boundary;
        p.min_bits = min_bits;
        p.group = group;
        runtime& r = rt();
        if (device >= 0) r.ensure_device(device);
        gact::store::put_result res;
        {
          // The GIL is let go for a device tensor or a host tensor worth the switch: a small one encodes in
          // less time than another thread would take to run (and releasing it costs every put a few hundred ns).
          std::optional<py::gil_scoped_release> nogil;
          if (device >= 0 ? !r.blocks_in_use.load(std::memory_order_acquire)
                          : elements(v.shape) * gact::store::element_size(v.dtype) >= kReleaseGilBytes)
            nogil.emplace();
          res = r.store.put(v, p);
        }
        // A signal that came during the put (a Ctrl-C while it encoded) would raise from its handler as soon as this
        // returns, before Python holds the handle: the blob would stay stored, owned by nothing, for good. Its handler
        // runs here instead, and the put is undone.
        if (PyErr_CheckSignals() != 0) {
          r.store.release(res.h);
          throw py::error_already_set();
        }
        // The view's strides in the decoded image (put_result::strides says which).
        return py::make_tuple(res.h, res.offset, res.shared, py::tuple(py::cast(res.strides)), res.upgraded);
      },
      py::arg("ptr"), py::arg("dtype"), py::arg("shape"), py::arg("strides"), py::arg("device"),
      py::arg("version"), py::arg("storage"), py::arg("key"), py::arg("bits"), py::arg("group_size"), py::arg("seed"),
      py::arg("stream") = 0, py::arg("role") = "values", py::arg("threads") = 0, py::arg("norm") = py::none(),
      py::arg("pred") = py::none(), py::arg("clamped") = false, py::arg("window") = py::none(),
      py::arg("owner") = 0, py::arg("boundary") = false, py::arg("min_bits") = 0, py::arg("group") = 0,
      "Store a tensor given as (data pointer, dtype name, shape, strides in elements, device index (-1 = CPU), "
      "version counter, storage address) for a reader with role 'values', 'predicate' or 'indices'; returns "
      "(handle, offset of the view in the decoded image, served by an earlier entry, the view's strides in the "
      "decoded image, a predicate entry upgraded to values by this put, or values stored as a boundary blob). "
      "owner: store_new_owner()'s id, whose counters count it too (0 = none). boundary: values of a clamp's "
      "output whose predicate `pred` a later predicate save reads (one blob serves both). min_bits: the fewest "
      "bits the reader tolerates (an earlier blob of the storage with fewer does not serve it). group: 0, or a group "
      "of saves (a correlated call's) served only by blobs of the same group, and serving only them.");
  m.def(
      "store_get",
      [](std::uint64_t h, std::uintptr_t dst, std::size_t dst_bytes, std::uintptr_t stream, bool predicate,
         float true_value, float false_value) {
        runtime& r = rt();
        gact::store::get_params gp;
        gp.stream = stream;
        gp.predicate = predicate;
        gp.true_value = true_value;
        gp.false_value = false_value;
        std::optional<py::gil_scoped_release> nogil;  // (as in store_put: a device get over torch's blocks keeps it)
        if (!r.blocks_in_use.load(std::memory_order_acquire) || r.store.info(h).device < 0) nogil.emplace();
        r.store.get(h, reinterpret_cast<void*>(dst), dst_bytes, gp);
      },
      py::arg("handle"), py::arg("dst"), py::arg("dst_bytes"), py::arg("stream") = 0, py::arg("predicate") = false,
      py::arg("true_value") = 1.0f, py::arg("false_value") = 0.0f,
      "Decode a handle's image into dst (dst_bytes bytes, laid out as store_info's strides).");
  m.def(
      "store_get_dlpack",
      [](std::uint64_t h, py::sequence shape, py::sequence strides, std::int64_t offset, std::uintptr_t stream,
         int threads, bool predicate, float true_value, float false_value) {
        runtime& r = rt();
        gact::store::get_params gp;
        gp.stream = stream;
        gp.threads = threads;
        gp.predicate = predicate;
        gp.true_value = true_value;
        gp.false_value = false_value;
        gact::store::tensor_info const info = r.store.info(h);
        std::shared_ptr<gact::store::decoded_image const> img;
        {
          std::optional<py::gil_scoped_release> nogil;  // (as in store_put)
          if (info.device >= 0 ? !r.blocks_in_use.load(std::memory_order_acquire) : info.bytes_in >= kReleaseGilBytes)
            nogil.emplace();
          img = r.store.get_shared(h, gp);
        }
        return make_dlpack(std::move(img), info, to_vec(shape), to_vec(strides), offset);
      },
      py::arg("handle"), py::arg("shape"), py::arg("strides"), py::arg("offset"), py::arg("stream") = 0,
      py::arg("threads") = 0, py::arg("predicate") = false, py::arg("true_value") = 1.0f,
      py::arg("false_value") = 0.0f,
      "The decoded image of a handle (decoded once while alive, shared by every reader) as a DLPack capsule "
      "viewing it with the given shape, strides and element offset; bool comes out as uint8.");
  m.def("store_release", [](std::uint64_t h) { return rt().store.release(h); }, py::arg("handle"),
        "Drop one reference to a handle; returns the references left (0 = freed), -1 if unknown.");
  m.def("store_forget", [](std::uint64_t h) { rt().store.forget(h); }, py::arg("handle"),
        "The tensor saved under this handle died: never dedup against it again.");
  m.def(
      "store_verdict",
      [](std::uint64_t h, bool wait) {
        if (!wait) return rt().store.verdict(h, false);
        py::gil_scoped_release nogil;  // (waits for the device)
        return rt().store.verdict(h, true);
      },
      py::arg("handle"), py::arg("wait") = false,
      "Whether the device encode of this handle met NaN/Inf (or another value it cannot quantize): -1 not run "
      "yet, 1 yes (keep the tensor exact), 0 no; host entries answer 0. wait: until it has run.");
  m.def(
      "store_forget_storage",
      [](std::uintptr_t storage, gact::store::owner_id o) { rt().store.forget_storage(storage, o); },
      py::arg("storage"), py::arg("owner") = 0,
      "The storage can change without its version counter moving (an alias such as .data was taken): until "
      "the owner's next step, every save of it gets a blob of its own.");
  m.def(
      "store_info",
      [](std::uint64_t h) {
        gact::store::tensor_info i = rt().store.info(h);
        py::dict d;
        d["dtype"] = gact::store::dtype_name(i.dtype);
        d["shape"] = py::tuple(py::cast(i.shape));
        d["strides"] = py::tuple(py::cast(i.strides));
        d["device"] = i.device;
        d["codec"] = gact::codec::codec_name(i.codec);
        d["variant"] = gact::codec::variant_name(i.codec, i.variant);
        d["bits"] = i.bits;
        d["bytes_in"] = i.bytes_in;
        d["bytes_stored"] = i.bytes_stored;
        d["refcount"] = i.refcount;
        d["groups"] = i.groups;
        d["sum_sq_ranges"] = i.sum_sq_ranges;
        d["values"] = i.values;
        d["predicate"] = i.predicate;
        return d;
      },
      py::arg("handle"));
  m.def(
      "store_note_unstored",
      [](std::string const& kind, std::size_t bytes, gact::store::owner_id owner) {
        rt().store.note_unstored(gact::store::parse_unstored(kind), bytes, owner);
      },
      py::arg("kind"), py::arg("bytes"), py::arg("owner") = 0, "Count a saved tensor that needed no blob ('shape' or 'held').");
  m.def(
      "empty_dlpack",
      [](std::string const& dtype, py::sequence shape, py::sequence strides, int device, std::uintptr_t stream) {
        // A buffer from gact's warm pool for a tensor whose values are never read (a shape-only save).
        runtime& r = rt();
        if (device >= 0) r.ensure_device(device);
        gact::store::tensor_info info;
        info.dtype = gact::store::parse_dtype(dtype);
        info.shape = to_vec(shape);
        info.strides = to_vec(strides);
        info.device = device;
        std::int64_t span = 1;
        for (std::size_t i = 0; i < info.shape.size(); ++i) {
          GACT_EXPECTS(info.shape[i] >= 0 && info.strides[i] >= 0, "empty_dlpack: negative extent or stride");
          if (info.shape[i] == 0) span = 0;
        }
        if (span != 0) {
          for (std::size_t i = 0; i < info.shape.size(); ++i) span += (info.shape[i] - 1) * info.strides[i];
        }
        std::size_t const bytes = static_cast<std::size_t>(span) * gact::store::element_size(info.dtype);
        auto img = std::make_shared<gact::store::decoded_image>(r.arena_for(device), bytes, stream,
                                                                gact::alloc::intern_tag("decoded"));
        return make_dlpack(std::move(img), info, info.shape, info.strides, 0);
      },
      py::arg("dtype"), py::arg("shape"), py::arg("strides"), py::arg("device") = -1, py::arg("stream") = 0,
      "An uninitialized tensor (DLPack capsule) of this layout from gact's pool.");
  m.def(
      "store_note_skip",
      [](std::string const& reason, std::size_t bytes, gact::store::owner_id owner) {
        rt().store.note_skip(gact::store::parse_skip_reason(reason), bytes, owner);
      },
      py::arg("reason"), py::arg("bytes"), py::arg("owner") = 0);
  // ---- swap ----------------------------------------------------------------------------
  m.def(
      "swap_enable",
      [](std::size_t budget, std::size_t prefetch) { rt().swap_enable(budget, prefetch); },
      py::arg("budget") = 0, py::arg("prefetch") = 2,
      "Offload the blobs of later puts to pinned host memory (budget: device-resident blob bytes kept "
      "before offloading, 0 = offload all; prefetch: blobs brought back ahead of backward).");
  m.def("swap_disable", []() { rt().swap_disable(); },
        "Stop offloading later puts (blobs already offloaded stay with their mover).");
  m.def("swap_stats", []() {
    runtime& r = rt();
    std::lock_guard lock(r.swap_mu);
    py::list out;
    for (auto const& mv : r.swap_movers) out.append(json_loads(mv->stats_json().dump()));
    return out;
  }, "The stats section of every swap mover created so far.");
  m.def("_host_allocator", []() {
        rt();
        return py::capsule(static_cast<void const*>(&g_host_allocator_fns), "gact.host_allocator");
      }, "The host arena's allocation entry points for torch's CPU allocator (_gact_torch.install).");
  m.def(
      "set_device_blocks",
      [](py::object blocks) {
#if defined(GACT_HAVE_KERNELS)
        runtime& r = rt();
        std::lock_guard lock(r.cuda_mu);
        if (blocks.is_none()) {
          r.device_blocks.reset();
          return;
        }
        auto cap = blocks.cast<py::capsule>();
        if (cap.name() == nullptr || std::strcmp(cap.name(), "gact.device_blocks") != 0)
          throw py::value_error("set_device_blocks: expected the capsule of _gact_torch.device_blocks()");
        auto const* f = static_cast<gact::device::external_blocks const*>(cap.get_pointer());
        if (f == nullptr || f->version != 1 || f->alloc == nullptr || f->free == nullptr)
          throw py::value_error("set_device_blocks: the capsule's entry points are of another version");
        r.device_blocks = *f;
#else
        (void)blocks;
#endif
      },
      py::arg("blocks"),
      "Device arenas made from now on (one per device, at its first stored tensor) take their memory from "
      "these blocks (_gact_torch.device_blocks(): torch's CUDA caching allocator), one block per blob or "
      "decoded image, given back when freed; None: gact's own device pool. Arenas made already stay.");
  m.def(
      "device_pool",
      [](int device) -> py::object {
#if defined(GACT_HAVE_KERNELS)
        runtime& r = rt();
        std::lock_guard lock(r.cuda_mu);
        for (auto const& [d, a] : r.cuda_arenas) {
          if (d != device) continue;
          for (auto const& b : r.blocks_arenas)
            if (b.get() == a) return py::str("torch");
          return py::str("gact");
        }
#else
        (void)device;
#endif
        return py::none();
      },
      py::arg("device"),
      "Whose memory the store's blobs on `device` live in: 'torch' (torch's CUDA caching allocator), 'gact' "
      "(gact's device pool) or None (no tensor stored on it yet).");
  m.def(
      "_device_blocks_roundtrip",
      [](py::capsule cap, std::size_t bytes, int device, bool free_without_gil) {
        if (cap.name() == nullptr || std::strcmp(cap.name(), "gact.device_blocks") != 0)
          throw py::value_error("_device_blocks_roundtrip: expected a gact.device_blocks capsule");
        auto const* f = static_cast<gact::device::external_blocks const*>(cap.get_pointer());
        char why[512] = {0};
        void* p = f->alloc(bytes, device, why, sizeof why);
        if (p == nullptr) return std::string(why[0] != '\0' ? why : "failed");
        if (free_without_gil) {
          py::gil_scoped_release nogil;  // (as an autograd device thread freeing a decoded tensor)
          f->free(p, device);
        } else {
          f->free(p, device);
        }
        return std::string();
      },
      py::arg("blocks"), py::arg("bytes"), py::arg("device") = 0, py::arg("free_without_gil") = false,
      "Allocate `bytes` on CUDA device `device` from a device-blocks capsule and free them: '' or the "
      "allocator's reason (the probe of gact.allocator's choice of pool). free_without_gil: free as a thread "
      "without the GIL does (tests).");
  m.def("store_new_owner", []() { return rt().store.new_owner(); },
        "A new owner id (one per Compressor): its puts, skips, steps and leaks are also counted apart.");
  m.def("store_drop_owner", [](gact::store::owner_id o) { rt().store.drop_owner(o); }, py::arg("owner"));
  m.def(
      "store_begin_step", [](std::uint64_t step, gact::store::owner_id o) { rt().store.begin_step(step, o); },
      py::arg("step"), py::arg("owner") = 0);
  m.def(
      "store_end_step",
      [](gact::store::owner_id o, bool count_step) { return rt().store.end_step(o, count_step); },
      py::arg("owner") = 0, py::arg("count_step") = true,
      "End the step of an owner (0: everyone); returns the number of its handles still alive (counted as leaks). "
      "count_step=False: a pass that is not a training step (an estimator's); steps and leaks_last_step stay.");
  m.def("store_live_handles", []() { return rt().store.live_handles(); });

  // ---- fault injection (tests only: tests/python/test_faults.py) ------------------------
  m.def(
      "_testing_fail_reserves",
      [](std::string const& which, int after, int count) {
        runtime& r = rt();
        if (which == "host") r.host_be.fail_reserves(after, count);
        else if (which == "pinned") r.swap_host_pinned.fail_reserves(after, count);
        else GACT_FAIL("_testing_fail_reserves: '" + which + "' is unknown; use host or pinned");
      },
      py::arg("which"), py::arg("after"), py::arg("count"),
      "Test hook: after `after` more reserves of the host arena's (or the CPU swap pool's) memory, fail `count`.");
  m.def(
      "host_release_on_miss", [](bool on) { return rt().host_arena.set_release_on_miss(on); }, py::arg("on"),
      "While on, a request the host arena's cache cannot serve first returns its whole free segments, so that "
      "what it reserves stays close to what is in use while request sizes keep changing (the policy's "
      "estimates). Returns the previous setting.");
  m.def(
      "host_empty_cache", []() { rt().host_arena.empty_cache(); },
      "Return the host arena's whole free segments to the system (what is in use stays).");
  m.def(
      "_testing_empty_caches",
      []() {
        runtime& r = rt();
        r.host_arena.empty_cache();
        std::lock_guard lock(r.swap_mu);
        for (auto& pool : r.swap_pools) pool->allocator().empty_cache();
      },
      "Test hook: return the cached segments of the host arena and the swap pools, so the next puts "
      "and offloads reserve afresh.");
  m.def(
      "_testing_fail_allocations", [](int after, int count) { rt().host_arena.fail_allocations(after, count); },
      py::arg("after"), py::arg("count"),
      "Test hook: after `after` more allocations from the host arena, fail `count` (cached memory or not).");
  m.def(
      "_testing_fail_threads_after", [](int k) { gact::codec::detail::fail_thread_creation_after(k); }, py::arg("k"),
      "Test hook: while set, every CPU encode or decode fails to create its worker thread k (1-based) and "
      "later ones; 0 turns it off.");
  m.def(
      "_testing_corrupt_blob",
      [](std::uint64_t h, std::size_t offset, std::uint8_t mask) {
        auto bytes = rt().store.debug_blob(h);
        GACT_EXPECTS(offset < bytes.size(), "_testing_corrupt_blob: offset " + std::to_string(offset) +
                                                " is past the blob's " + std::to_string(bytes.size()) + " bytes");
        bytes[offset] ^= std::byte{mask};
        return bytes.size();
      },
      py::arg("handle"), py::arg("offset"), py::arg("mask"),
      "Test hook: flip bits `mask` of byte `offset` of a live handle's host blob; returns the blob's size.");
  m.def("store_stored_bytes", []() { return rt().store.stored_bytes(); });
  m.def(
      "store_stats", [](gact::store::owner_id o) { return json_loads(rt().store.stats_json(o).dump()); },
      py::arg("owner") = 0, "The store's stats section, or one owner's (the same keys, its tensors only).");
  m.def("store_reset_stats", []() { rt().store.reset_stats(); });

  // ---- codecs --------------------------------------------------------------------------
  m.def(
      "codec_blob_size",
      [](std::string const& dtype, py::sequence shape, std::string const& codec, int bits, int group_size) {
        gact::codec::encode_params ep;
        ep.codec = parse_codec(codec);
        ep.bits = bits;
        ep.group_size = group_size;
        auto const s = to_vec(shape);
        return gact::codec::blob_size(gact::store::parse_dtype(dtype), std::span<std::int64_t const>(s), ep);
      },
      py::arg("dtype"), py::arg("shape"), py::arg("codec"), py::arg("bits"), py::arg("group_size"));
  m.def(
      "codec_encode",
      [](std::uintptr_t src, std::string const& dtype, py::sequence shape, std::string const& codec, int bits,
         int group_size, std::uint64_t seed, std::uint64_t key) {
        gact::codec::encode_params ep;
        ep.codec = parse_codec(codec);
        ep.bits = bits;
        ep.group_size = group_size;
        ep.seed = seed;
        ep.key = key;
        auto const dt = gact::store::parse_dtype(dtype);
        auto const s = to_vec(shape);
        std::span<std::int64_t const> const sp(s);
        std::size_t const cap = gact::codec::blob_size(dt, sp, ep);
        std::string buf(cap, '\0');
        gact::codec::encode_result res{};
        {
          py::gil_scoped_release nogil;
          res = gact::codec::encode_cpu(reinterpret_cast<void const*>(src), dt, sp, ep, buf.data(), cap,
                                        static_cast<int>(rt().opts.threads));
        }
        // One return type for both branches: pybind11 3.x's make_tuple is typed per argument.
        if (res.nonfinite || res.refused != gact::codec::refusal::none) {
          auto const why = res.nonfinite ? gact::codec::refusal::nonfinite : res.refused;
          return py::tuple(py::make_tuple(py::none(), std::string(gact::codec::refusal_name(why))));
        }
        buf.resize(res.bytes);
        return py::tuple(py::make_tuple(py::bytes(buf), py::none()));
      },
      py::arg("src"), py::arg("dtype"), py::arg("shape"), py::arg("codec"), py::arg("bits"),
      py::arg("group_size"), py::arg("seed"), py::arg("key"),
      "Encode a contiguous host tensor; returns (blob bytes, None), or (None, why) when the codec refused "
      "it: why is 'nonfinite' (quant: NaN/Inf), 'float64_range' (quant: a float64 value outside float32's "
      "range), 'wide' (quant: a magnitude of 2^15 or more, a mask's fill such as finfo.min) or another refusal's name.");
  m.def(
      "codec_parse",
      [](py::bytes blob) {
        std::string_view const b = blob;
        gact::codec::blob_info i = gact::codec::parse(b.data(), b.size());
        py::dict d;
        d["codec"] = gact::codec::codec_name(i.codec);
        d["dtype"] = gact::store::dtype_name(i.dt);
        d["shape"] = py::tuple(py::cast(i.shape));
        d["numel"] = i.numel;
        d["bits"] = i.bits;
        d["group_size"] = i.group_size;
        d["seed"] = i.seed;
        d["key"] = i.key;
        d["bytes"] = i.size;
        return d;
      },
      py::arg("blob"), "Validate a blob's header and return its fields; raises CorruptBlobError.");
  m.def(
      "codec_decode",
      [](py::bytes blob, std::uintptr_t dst, std::size_t dst_bytes) {
        std::string_view const b = blob;
        int const threads = static_cast<int>(rt().opts.threads);
        py::gil_scoped_release nogil;
        gact::codec::decode_cpu(b.data(), b.size(), reinterpret_cast<void*>(dst), dst_bytes, threads);
      },
      py::arg("blob"), py::arg("dst"), py::arg("dst_bytes"), "Decode a blob into contiguous host memory.");

  // ---- policy ------------------------------------------------------------------------
  // The per-tensor bit controller (policy/controller.hpp), for the Python policy driver.
  py::class_<gact::policy::controller>(m, "PolicyController",
                                        "Per-tensor bit allocation under an average-bit budget (thread-safe).")
      .def(py::init([](double budget, int default_bits, double ema_weight, std::int64_t stale_after,
                       std::uint32_t group_size, bool allow_full_precision) {
             gact::policy::controller_options o;
             o.budget_avg_bits = budget;
             o.default_bits = default_bits;
             o.ema_weight = ema_weight;
             o.stale_after = stale_after;
             o.storage.group_size = group_size;
             o.allow_full_precision = allow_full_precision;
             return std::make_unique<gact::policy::controller>(o);
           }),
           py::arg("budget") = 2.0, py::arg("default_bits") = 4, py::arg("ema_weight") = 0.5,
           py::arg("stale_after") = 2, py::arg("group_size") = 256, py::arg("allow_full_precision") = true)
      .def("set_step", &gact::policy::controller::set_step, py::arg("step"))
      .def("step", &gact::policy::controller::step)
      .def(
          "on_save",
          [](gact::policy::controller& c, std::string const& key, std::uint64_t numel, int full_bits,
             int min_bits) { return c.on_save(key, numel, full_bits, min_bits); },
          py::arg("key"), py::arg("numel"), py::arg("full_bits") = 32, py::arg("min_bits") = 1,
          "Record that key is saved now; returns the bits to encode it with (16/32 = keep raw). min_bits: the "
          "narrowest width the store uses for it (2: a boundary blob, 8: a small normalization block).")
      .def(
          "bits_for", [](gact::policy::controller const& c, std::string const& key) { return c.bits_for(key); },
          py::arg("key"))
      .def(
          "add_estimate",
          [](gact::policy::controller& c, std::string const& key, double sensitivity) {
            c.add_estimate(key, sensitivity);
          },
          py::arg("key"), py::arg("sensitivity"))
      .def(
          "add_estimate_widths",
          [](gact::policy::controller& c, std::string const& key, std::array<double, 4> const& variance) {
            c.add_estimate_widths(key, variance);
          },
          py::arg("key"), py::arg("variance"),
          "Fold an estimate of the gradient variance at 1, 2, 4 and 8 bits into key's record.")
      .def(
          "raise_variance",
          [](gact::policy::controller& c, std::string const& key, int bits, double variance) {
            c.raise_variance(key, bits, variance);
          },
          py::arg("key"), py::arg("bits"), py::arg("variance"),
          "Raise key's variance at bits to at least variance (a direct measurement found the estimate low).")
      .def(
          "add_online_sample",
          [](gact::policy::controller& c, std::string const& key, double sum_sq_ranges, std::uint64_t numel,
             std::uint32_t group_size, double grad_sq_norm, double fan_in) {
            gact::policy::online_sample smp;
            smp.sum_sq_ranges = sum_sq_ranges;
            smp.numel = numel;
            smp.group_size = group_size;
            smp.grad_sq_norm = grad_sq_norm;
            smp.fan_in = fan_in;
            c.add_online_sample(key, smp);
          },
          py::arg("key"), py::arg("sum_sq_ranges"), py::arg("numel"), py::arg("group_size"),
          py::arg("grad_sq_norm"), py::arg("fan_in") = 1.0)
      .def("apply_online_estimates", &gact::policy::controller::apply_online_estimates)
      .def("decide",
           [](gact::policy::controller& c) {
             c.decide();
             return json_loads(c.stats().dump());
           },
           "Re-solve the allocation; returns the policy stats section.")
      .def("set_budget", &gact::policy::controller::set_budget, py::arg("avg_bits"))
      .def("stats", [](gact::policy::controller const& c) { return json_loads(c.stats().dump()); })
      .def("register_stats", &gact::policy::controller::register_stats, py::arg("name") = "policy");

  // ---- tags ----------------------------------------------------------------------------
  m.def("push_tag", [](std::string const& name) { gact::alloc::push_tag(gact::alloc::intern_tag(name)); },
        py::arg("name"), "Push an allocation tag on the calling thread's stack.");
  m.def("pop_tag", []() { gact::alloc::pop_tag(); }, "Pop the calling thread's top tag.");
  m.def("current_tag", []() { return gact::alloc::tag_name(gact::alloc::current_tag()); });
  m.def("tag_depth", []() { return gact::alloc::tag_depth(); });
  m.def("tag_names", []() { return gact::alloc::tag_names(); });

  // ---- stats ---------------------------------------------------------------------------
  m.def("stats_document", []() {
    rt();  // make sure the store and the host arena are registered
    return json_loads(gact::stats::document().dump());
  });
  m.def(
      "stats_dump",
      [](std::string const& path) {
        rt();
        py::gil_scoped_release nogil;
        gact::stats::dump(path);
      },
      py::arg("path"), "Write the stats document to path atomically.");
  m.def("install_dump_triggers", []() {
    gact::stats::install_dump_triggers();  // first: a bad GACT_STATS_PATH raises before anything warns
    rt();                                  // the store and the host arena, registered (and re-armed)
  });

  // ---- event trace (allocator/event_trace.hpp) -----------------------------------------
  m.def(
      "trace_enable",
      [](std::size_t capacity, std::uint64_t snapshot_every) {
        rt();
        gact::alloc::event_trace::set_snapshot_every(snapshot_every);
        gact::alloc::event_trace::enable(capacity);
      },
      py::arg("capacity"), py::arg("snapshot_every") = 1,
      "Keep the last `capacity` memory events (0 = off); snapshot the counters every N steps.");
  m.def("trace_enabled", []() { return gact::alloc::event_trace::enabled(); });
  m.def(
      "trace_snapshot",
      [](std::string const& reason) {
        rt();
        gact::alloc::event_trace::take_snapshot(reason);
      },
      py::arg("reason") = "manual", "Append a snapshot of the per-tag and store counters now.");
  m.def("trace_timeline", []() { return json_loads(gact::alloc::event_trace::timeline_json().dump()); });

  // ---- options -------------------------------------------------------------------------
  m.def("options_table", []() {
    py::list rows;
    for (auto const& o : gact::option_table()) {
      py::dict d;
      d["name"] = std::string(o.name);
      d["type"] = std::string(o.type);
      d["env"] = std::string(o.env);
      d["keyword"] = std::string(o.keyword);
      d["default"] = o.default_text;
      d["help"] = std::string(o.help);
      rows.append(d);
    }
    return rows;
  });
  m.def("options_current", []() { return json_loads(rt().opts.to_json().dump()); });
  m.def(
      "options_set", [](std::string const& keyword, std::string const& value) { apply_option(rt(), keyword, value); },
      py::arg("keyword"), py::arg("value"),
      "Set one option from text (validated; raises ValueError naming the setting) and apply it: "
      "stats_path, trace, log_level and memory_limit act at once; threads cannot change after start.");
  m.def(
      "stats_set_section",
      [](std::string const& name, std::string const& json_text) {
        GACT_EXPECTS(!name.empty() && !core_section(name), "stats_set_section: '" + name + "' is gact's own section");
        auto j = nlohmann::json::parse(json_text, nullptr, false);
        GACT_EXPECTS(!j.is_discarded(), "stats_set_section: the text for '" + name + "' is not JSON");
        gact::stats::register_provider(name, [j = std::move(j)] { return j; });
      },
      py::arg("name"), py::arg("json_text"),
      "Add (or replace) a top-level section of the stats document holding fixed JSON (gact-run's \"run\").");
}
