// gact/allocator/store/activation_store.cpp
//
// Implementation of the activation store (see the header for the contract).
// Layout of the work in put(): validate the view; look up its identity in the
// dedup table (under the lock); choose the codec from the dtype; gather a
// non-contiguous view into a workspace block; allocate the blob in the arena
// (tag activation); encode outside the lock; publish the entry under the lock.
// A quant encode refused for NaN/Inf is redone raw into a blob of raw size.
//
// Entries are shared_ptr-owned: get() copies the pointer under the lock and
// decodes outside it, so a concurrent final release() cannot free a blob that is
// being read; the blob goes back to its arena when the last owner lets go.
#include "allocator/store/activation_store.hpp"

#include <algorithm>
#include <cstring>
#include <span>
#include <string_view>

#include "allocator/error.hpp"
#include "allocator/event_trace.hpp"
#include "allocator/log.hpp"
#include "allocator/stats_registry.hpp"
#include "allocator/tags.hpp"
#include "swap/mover.hpp"
#include "codecs/float16.hpp"

#if defined(GACT_HAVE_KERNELS)
#include <cuda_runtime_api.h>
#endif

namespace gact::store {

namespace {

constexpr std::size_t k_codec_count = 3;  // raw, quant, mask
constexpr std::size_t k_max_rank = 64;

bool is_float(codec::dtype t) noexcept {
  return t == codec::dtype::float32 || t == codec::dtype::float16 || t == codec::dtype::bfloat16;
}

// splitmix64 finalizer: a bijective mixer, so distinct (seed, step) give distinct streams.
std::uint64_t mix64(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Returns memory to its arena at scope exit.
struct arena_block {
  alloc::caching_allocator* arena = nullptr;
  void* p = nullptr;
  arena_block() = default;
  arena_block(alloc::caching_allocator& a, std::size_t bytes, device::stream_t s, alloc::tag_id tag)
      : arena(&a), p(a.allocate(bytes, s, tag)) {}
  arena_block(arena_block&& o) noexcept : arena(o.arena), p(o.p) { o.p = nullptr; }
  arena_block& operator=(arena_block&& o) noexcept {
    if (this != &o) {
      reset();
      arena = o.arena;
      p = o.p;
      o.p = nullptr;
    }
    return *this;
  }
  ~arena_block() { reset(); }
  void reset() noexcept {
    if (p != nullptr) arena->deallocate(p);
    p = nullptr;
  }
  void* release() noexcept {
    void* q = p;
    p = nullptr;
    return q;
  }
};

// Copy a strided host view into contiguous `dst` (element size `es`).
// Precondition: numel > 0, rank >= 1, strides >= 0.
void gather_strided(void const* src, std::size_t es, std::span<std::int64_t const> shape,
                    std::span<std::int64_t const> strides, void* dst) {
  std::size_t const rank = shape.size();
  auto const* s = static_cast<unsigned char const*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  std::int64_t const inner = shape[rank - 1];
  std::int64_t const inner_stride = strides[rank - 1];
  std::array<std::int64_t, k_max_rank> idx{};
  std::int64_t outer = 1;
  for (std::size_t i = 0; i + 1 < rank; ++i) outer *= shape[i];
  for (std::int64_t o = 0; o < outer; ++o) {
    std::int64_t off = 0;
    for (std::size_t i = 0; i + 1 < rank; ++i) off += idx[i] * strides[i];
    unsigned char const* row = s + off * static_cast<std::int64_t>(es);
    if (inner_stride == 1) {
      std::memcpy(d, row, static_cast<std::size_t>(inner) * es);
      d += static_cast<std::size_t>(inner) * es;
    } else {
      for (std::int64_t j = 0; j < inner; ++j) {
        std::memcpy(d, row + j * inner_stride * static_cast<std::int64_t>(es), es);
        d += es;
      }
    }
    // advance the multi-index over the outer dimensions (last outer dim fastest)
    for (std::size_t i = rank - 1; i-- > 0;) {
      if (++idx[i] < shape[i]) break;
      idx[i] = 0;
    }
  }
}

/// The store's id in the event trace (allocator/event_trace.hpp).
std::uint16_t trace_source() {
  static std::uint16_t const id = alloc::event_trace::register_source("store");
  return id;
}

// Sum over the groups of a host quant blob of (hi - lo)^2, read from its metadata section
// ((lo, hi) per group in the input dtype, right after the header).
double sum_sq_ranges(void const* blob, codec::dtype dt, std::uint64_t numel, int bits, int group_size,
                     std::uint64_t* groups) noexcept {
  auto const lay = codec::hd::compute_layout(static_cast<std::uint8_t>(codec::codec_id::quant), 0,
                                             static_cast<std::uint8_t>(dt), 1, numel, bits, group_size, 0);
  auto const* meta = static_cast<unsigned char const*>(blob) + lay.header_bytes;
  double acc = 0.0;
  for (std::uint64_t g = 0; g < lay.n_groups; ++g) {
    float lo = 0.f, hi = 0.f;
    if (dt == codec::dtype::float32) {
      std::memcpy(&lo, meta + g * 8, 4);
      std::memcpy(&hi, meta + g * 8 + 4, 4);
    } else {
      std::uint16_t l16 = 0, h16 = 0;
      std::memcpy(&l16, meta + g * 4, 2);
      std::memcpy(&h16, meta + g * 4 + 2, 2);
      lo = dt == codec::dtype::float16 ? codec::hd::half_to_float(l16) : codec::hd::bf16_to_float(l16);
      hi = dt == codec::dtype::float16 ? codec::hd::half_to_float(h16) : codec::hd::bf16_to_float(h16);
    }
    double const r = static_cast<double>(hi) - static_cast<double>(lo);
    acc += r * r;
  }
  *groups = lay.n_groups;
  return acc;
}

bool all_zero_one(void const* p, std::size_t n) noexcept {
  auto const* b = static_cast<unsigned char const*>(p);
  unsigned char acc = 0;
  for (std::size_t i = 0; i < n; ++i) acc |= static_cast<unsigned char>(b[i] & 0xFEu);
  return acc == 0;
}

}  // namespace

// ---- dtype helpers --------------------------------------------------------------------

std::size_t element_size(codec::dtype t) noexcept { return codec::dtype_size(t); }

char const* dtype_name(codec::dtype t) noexcept { return codec::dtype_name(t); }

codec::dtype parse_dtype(std::string const& name) {
  std::string_view n = name;
  if (n.starts_with("torch.")) n.remove_prefix(6);
  struct row {
    std::string_view name;
    codec::dtype t;
  };
  static constexpr row k_rows[] = {
      {"float32", codec::dtype::float32}, {"float", codec::dtype::float32},
      {"float16", codec::dtype::float16}, {"half", codec::dtype::float16},
      {"bfloat16", codec::dtype::bfloat16}, {"uint8", codec::dtype::uint8},
      {"bool", codec::dtype::boolean},     {"int8", codec::dtype::int8},
      {"int16", codec::dtype::int16},     {"short", codec::dtype::int16},
      {"int32", codec::dtype::int32},     {"int", codec::dtype::int32},
      {"int64", codec::dtype::int64},     {"long", codec::dtype::int64},
      {"float64", codec::dtype::float64}, {"double", codec::dtype::float64},
  };
  for (auto const& r : k_rows) {
    if (r.name == n) return r.t;
  }
  GACT_FAIL("dtype: '" + name +
            "' is not supported; use float32, float16, bfloat16, uint8, bool, int8, int16, int32, "
            "int64 or float64");
}

char const* skip_reason_name(skip_reason r) noexcept {
  switch (r) {
    case skip_reason::parameter: return "parameter";
    case skip_reason::small: return "small";
    case skip_reason::dtype: return "dtype";
    case skip_reason::excluded: return "excluded";
    case skip_reason::input: return "input";
    case skip_reason::layout: return "layout";
    case skip_reason::device: return "device";
    case skip_reason::stats: return "stats";
    case skip_reason::k_count: break;
  }
  return "unknown";
}

skip_reason parse_skip_reason(std::string const& name) {
  for (std::size_t i = 0; i < static_cast<std::size_t>(skip_reason::k_count); ++i) {
    auto const r = static_cast<skip_reason>(i);
    if (name == skip_reason_name(r)) return r;
  }
  GACT_FAIL("skip reason: '" + name +
            "' is unknown; use parameter, small, dtype, excluded, input, layout, device or stats");
}

// ---- internal structures ---------------------------------------------------------------

// Identity of a saved tensor for dedup. Two views with equal identities alias the same
// elements with the same contents (the version counter moves on every in-place write),
// provided the first one is still alive: forget() removes identities of dead tensors.
struct activation_store::identity {
  std::uintptr_t data = 0;
  int device = -1;
  codec::dtype dtype = codec::dtype::float32;
  std::int64_t version = 0;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;  // always rank-sized (contiguous strides filled in)
  bool operator==(identity const&) const = default;
};

std::size_t activation_store::identity_hash::operator()(identity const& id) const noexcept {
  std::uint64_t h = mix64(id.data);
  h = mix64(h ^ static_cast<std::uint64_t>(id.version));
  h = mix64(h ^ (static_cast<std::uint64_t>(id.device + 1) << 8) ^ static_cast<std::uint64_t>(id.dtype));
  for (auto x : id.shape) h = mix64(h ^ static_cast<std::uint64_t>(x));
  for (auto x : id.strides) h = mix64(h ^ static_cast<std::uint64_t>(x));
  return static_cast<std::size_t>(h);
}

// One stored tensor. Invariant: blob != nullptr iff numel > 0; bytes_stored <= capacity;
// refcount >= 1 while the entry is in entries_.
struct activation_store::entry {
  alloc::caching_allocator* arena = nullptr;
  void* blob = nullptr;
  device::stream_t stream = 0;  // allocation stream of the blob
  tensor_info info;
  std::uint64_t key = 0;        // put_params::key, for the event trace
  bool has_identity = false;
  identity id;
  swap::mover* mover = nullptr;  // owns the blob when set (blob is then no longer dereferenced)
  std::uint64_t swap_id = 0;
  entry() = default;
  entry(entry const&) = delete;
  entry& operator=(entry const&) = delete;
  ~entry() {
    if (mover != nullptr) {
      mover->release(swap_id);
    } else if (blob != nullptr) {
      arena->deallocate(blob);
    }
  }
};

struct activation_store::counters {
  struct per_codec {
    std::uint64_t tensors = 0, bytes_in = 0, bytes_stored = 0;
  };
  struct per_skip {
    std::uint64_t tensors = 0, bytes = 0;
  };
  std::uint64_t tensors_in = 0;
  std::uint64_t bytes_in = 0;
  std::uint64_t bytes_stored = 0;
  std::array<per_codec, k_codec_count> codecs{};
  std::array<std::uint64_t, 9> quant_bits{};  // index = bits (1, 2, 4, 8 used)
  std::array<per_skip, static_cast<std::size_t>(skip_reason::k_count)> skipped{};
  std::uint64_t dedup_hits = 0;
  std::uint64_t dedup_bytes = 0;
  std::uint64_t nonfinite_fallbacks = 0;
  std::uint64_t gathers = 0;
  std::uint64_t gets = 0;
  std::uint64_t releases = 0;
  std::uint64_t bad_releases = 0;
  std::uint64_t leaks = 0;
  std::uint64_t leaks_last_step = 0;
  std::uint64_t steps = 0;
  std::uint64_t current_stored = 0;
  std::uint64_t peak_stored = 0;
  std::uint64_t current_in = 0;  // numel*elem of live entries
};

// ---- construction ----------------------------------------------------------------------

activation_store::activation_store(alloc::caching_allocator& host_arena, store_options opts)
    : host_arena_(host_arena), opts_(std::move(opts)), c_(std::make_unique<counters>()) {
  GACT_EXPECTS(host_arena_.backend().kind() != device::memory_kind::device,
               "activation_store: the host arena must hold host memory, not '" +
                   std::string(host_arena_.backend().name()) + "'");
  GACT_EXPECTS(opts_.threads >= 0, "activation_store: threads must be >= 0");
  if (!opts_.stats_name.empty()) {
    stats_token_ = stats::register_provider(opts_.stats_name, [this] { return stats_json(); });
  }
}

activation_store::~activation_store() {
  if (stats_token_ != 0) stats::unregister_provider(stats_token_);
  std::lock_guard lock(mu_);
  if (!entries_.empty()) {
    GACT_LOG_WARN("activation_store: {} handles still alive at destruction; their blobs are freed",
                  entries_.size());
  }
  dedup_.clear();
  entries_.clear();
}

void activation_store::set_device_arena(int device, alloc::caching_allocator* arena) {
  GACT_EXPECTS(device >= 0 && static_cast<std::size_t>(device) < device_arenas_.size(),
               "activation_store::set_device_arena: device " + std::to_string(device) +
                   " is out of range [0, 64)");
  GACT_EXPECTS(arena == nullptr || arena->backend().kind() == device::memory_kind::device,
               "activation_store::set_device_arena: the arena must hold device memory");
  std::lock_guard lock(mu_);
  device_arenas_[static_cast<std::size_t>(device)] = arena;
}

void activation_store::set_mover(int device, swap::mover* m) {
  GACT_EXPECTS(device >= -1 && static_cast<std::size_t>(device + 1) < movers_.size(),
               "activation_store::set_mover: device " + std::to_string(device) + " is out of range [-1, 64)");
  if (m != nullptr) {
    alloc::caching_allocator const& a = arena_for(device);
    GACT_EXPECTS(&m->arena() == &a, "activation_store::set_mover: the mover works on arena '" +
                                        m->arena().stats_name() + "', not on the store's arena '" +
                                        a.stats_name() + "' for device " + std::to_string(device));
  }
  std::lock_guard lock(mu_);
  movers_[static_cast<std::size_t>(device + 1)] = m;
}

alloc::caching_allocator& activation_store::arena_for(int device) const {
  if (device < 0) return host_arena_;
  GACT_EXPECTS(static_cast<std::size_t>(device) < device_arenas_.size(),
               "activation_store: device " + std::to_string(device) + " is out of range [0, 64)");
  alloc::caching_allocator* a = nullptr;
  {
    std::lock_guard lock(mu_);
    a = device_arenas_[static_cast<std::size_t>(device)];
  }
  GACT_EXPECTS(a != nullptr, "activation_store: no arena registered for CUDA device " +
                                 std::to_string(device) + " (call set_device_arena first)");
  return *a;
}

// ---- put -------------------------------------------------------------------------------

// Record a store event (no-op when tracing is off): blob address and bytes, the tensor key,
// bits as stored and the fp32-equivalent bytes (numel * 4) that the blob stands for.
namespace {
template <class Entry>
void trace_store_event(alloc::event_trace::event_kind kind, Entry const& e) noexcept {
  if (!alloc::event_trace::enabled()) [[likely]] return;
  std::size_t numel = 1;
  for (auto x : e.info.shape) numel *= static_cast<std::size_t>(x);
  alloc::event_trace::record(kind, trace_source(), reinterpret_cast<std::uintptr_t>(e.blob), e.info.bytes_stored,
                             e.stream, alloc::tag_activation, e.key, e.info.bits, numel * 4);
}
}  // namespace


handle activation_store::put(tensor_view const& v, put_params const& p) {
  // Validate the view.
  std::size_t const rank = v.shape.size();
  GACT_EXPECTS(rank <= k_max_rank, "activation_store::put: rank " + std::to_string(rank) + " exceeds 64");
  GACT_EXPECTS(v.strides.empty() || v.strides.size() == rank,
               "activation_store::put: " + std::to_string(v.strides.size()) +
                   " strides given for a tensor of rank " + std::to_string(rank));
  std::size_t numel = 1;
  for (auto e : v.shape) {
    GACT_EXPECTS(e >= 0, "activation_store::put: negative extent " + std::to_string(e));
    numel *= static_cast<std::size_t>(e);
  }
  for (auto s : v.strides) {
    GACT_EXPECTS(s >= 0, "activation_store::put: negative stride " + std::to_string(s));
  }
  GACT_EXPECTS(numel == 0 || v.data != nullptr, "activation_store::put: null data pointer");
  GACT_EXPECTS(p.bits == 1 || p.bits == 2 || p.bits == 4 || p.bits == 8 || p.bits == 16 || p.bits == 32,
               "activation_store::put: bits=" + std::to_string(p.bits) +
                   " is not supported; use 1, 2, 4 or 8 (16 or 32 store raw)");
  GACT_EXPECTS(p.group_size > 0, "activation_store::put: group_size must be positive");
  std::size_t const es = element_size(v.dtype);
  GACT_EXPECTS(es != 0, "activation_store::put: unknown dtype");
  std::size_t const bytes_in = numel * es;

  // Contiguous strides, and whether the view is contiguous.
  std::vector<std::int64_t> strides(rank);
  {
    std::int64_t acc = 1;
    for (std::size_t i = rank; i-- > 0;) {
      strides[i] = acc;
      acc *= v.shape[i];
    }
  }
  bool contiguous = true;
  if (!v.strides.empty()) {
    for (std::size_t i = 0; i < rank; ++i) {
      if (v.shape[i] != 1 && v.strides[i] != strides[i]) contiguous = false;
    }
  }
  identity id{reinterpret_cast<std::uintptr_t>(v.data), v.device, v.dtype, v.version, v.shape,
              v.strides.empty() ? strides : v.strides};

  alloc::caching_allocator& arena = arena_for(v.device);

  // Dedup lookup.
  std::uint64_t step = 0;
  {
    std::lock_guard lock(mu_);
    step = step_;
    auto it = dedup_.find(id);
    if (it != dedup_.end()) {
      auto e = entries_.find(it->second);
      if (e != entries_.end()) {
        ++e->second->info.refcount;
        ++c_->dedup_hits;
        c_->dedup_bytes += bytes_in;
        return it->second;
      }
      dedup_.erase(it);
    }
  }

  auto ent = std::make_shared<entry>();
  ent->arena = &arena;
  ent->stream = p.stream;
  ent->info.dtype = v.dtype;
  ent->info.shape = v.shape;
  ent->info.device = v.device;
  ent->info.bytes_in = bytes_in;
  ent->info.refcount = 1;
  ent->key = p.key;

  bool nonfinite = false;
  if (numel > 0) {
    codec::encode_params ep;
    ep.group_size = p.group_size;
    ep.seed = mix64(p.seed ^ mix64(step));
    ep.key = p.key;
    ep.bits = p.bits;
    // The codecs group the row-major flattening of the tensor, so the store hands them the
    // 1-D view (any rank works; the shape is kept in the entry).
    std::int64_t const flat[1] = {static_cast<std::int64_t>(numel)};
    std::span<std::int64_t const> const shp(flat);

    if (v.device < 0) {
      // Host: gather if needed, then pick the codec.
      arena_block work;
      void const* src = v.data;
      if (!contiguous) {
        work = arena_block(host_arena_, bytes_in, 0, alloc::tag_workspace);
        gather_strided(v.data, es, std::span<std::int64_t const>(v.shape), std::span<std::int64_t const>(id.strides), work.p);
        src = work.p;
      }
      if (is_float(v.dtype) && p.bits <= 8) {
        ep.codec = codec::codec_id::quant;
      } else if (v.dtype == codec::dtype::boolean ||
                 (v.dtype == codec::dtype::uint8 && all_zero_one(src, numel))) {
        ep.codec = codec::codec_id::mask;
        ep.bits = 1;
      } else {
        ep.codec = codec::codec_id::raw;
      }
      std::size_t cap = codec::blob_size(v.dtype, shp, ep);
      arena_block blob(arena, cap, 0, alloc::tag_activation);
      codec::encode_result r = codec::encode_cpu(src, v.dtype, shp, ep, blob.p, cap, opts_.threads);
      if (r.nonfinite) {
        nonfinite = true;
        blob.reset();
        ep.codec = codec::codec_id::raw;
        cap = codec::blob_size(v.dtype, shp, ep);
        blob = arena_block(arena, cap, 0, alloc::tag_activation);
        r = codec::encode_cpu(src, v.dtype, shp, ep, blob.p, cap, opts_.threads);
      }
      GACT_ASSERT_INTERNAL(r.bytes <= cap);
      ent->info.codec = r.codec;
      ent->info.bytes_stored = r.bytes;
      if (r.codec == codec::codec_id::quant) {
        ent->info.sum_sq_ranges = sum_sq_ranges(blob.p, v.dtype, numel, ep.bits, ep.group_size, &ent->info.groups);
      }
      ent->blob = blob.release();
      if (!contiguous) {
        std::lock_guard lock(mu_);
        ++c_->gathers;
      }
    } else {
#if defined(GACT_HAVE_KERNELS)
      // CUDA: the Python layer hands over contiguous tensors (torch gathers on the device);
      // 0/1 detection of uint8 would need a device reduction, so uint8 is stored raw here.
      GACT_EXPECTS(contiguous,
                   "activation_store::put: CUDA tensors must be contiguous (call .contiguous() first)");
      if (is_float(v.dtype) && p.bits <= 8) {
        ep.codec = codec::codec_id::quant;
      } else if (v.dtype == codec::dtype::boolean) {
        ep.codec = codec::codec_id::mask;
        ep.bits = 1;
      } else {
        ep.codec = codec::codec_id::raw;
      }
      auto const stream = reinterpret_cast<cudaStream_t>(p.stream);
      std::size_t cap = codec::blob_size(v.dtype, shp, ep);
      arena_block blob(arena, cap, p.stream, alloc::tag_activation);
      codec::encode_result r = codec::encode_cuda(v.data, v.dtype, shp, ep, blob.p, cap, stream);
      if (r.nonfinite) {
        nonfinite = true;
        blob.reset();
        ep.codec = codec::codec_id::raw;
        cap = codec::blob_size(v.dtype, shp, ep);
        blob = arena_block(arena, cap, p.stream, alloc::tag_activation);
        r = codec::encode_cuda(v.data, v.dtype, shp, ep, blob.p, cap, stream);
      }
      GACT_ASSERT_INTERNAL(r.bytes <= cap);
      ent->info.codec = r.codec;
      ent->info.bytes_stored = r.bytes;
      ent->blob = blob.release();
#else
      GACT_FAIL("activation_store::put: tensor on CUDA device " + std::to_string(v.device) +
                " but this build of gact has no CUDA kernels");
#endif
    }
    ent->info.bits = ent->info.codec == codec::codec_id::quant   ? ep.bits
                     : ent->info.codec == codec::codec_id::mask ? 1
                                                                 : static_cast<int>(es * 8);
  } else {
    ent->info.codec = codec::codec_id::raw;
    ent->info.bits = static_cast<int>(es * 8);
  }

  // Swap: the mover takes the blob over (offloads it over its budget, brings it back for get).
  if (ent->blob != nullptr) {
    swap::mover* m = nullptr;
    {
      std::lock_guard lock(mu_);
      m = movers_[static_cast<std::size_t>(v.device + 1)];
    }
    if (m != nullptr) {
      ent->swap_id = m->put(ent->blob, ent->info.bytes_stored, ent->stream);
      ent->mover = m;
    }
  }

  // Publish.
  std::lock_guard lock(mu_);
  handle const h = next_handle_++;
  auto& c = *c_;
  ++c.tensors_in;
  c.bytes_in += bytes_in;
  c.bytes_stored += ent->info.bytes_stored;
  auto& pc = c.codecs[static_cast<std::size_t>(ent->info.codec) % k_codec_count];
  ++pc.tensors;
  pc.bytes_in += bytes_in;
  pc.bytes_stored += ent->info.bytes_stored;
  if (ent->info.codec == codec::codec_id::quant) ++c.quant_bits[static_cast<std::size_t>(ent->info.bits)];
  if (nonfinite) ++c.nonfinite_fallbacks;
  c.current_stored += ent->info.bytes_stored;
  c.current_in += bytes_in;
  c.peak_stored = std::max(c.peak_stored, c.current_stored);
  if (!dedup_.contains(id)) {
    ent->has_identity = true;
    ent->id = id;
    dedup_.emplace(std::move(id), h);
  }
  trace_store_event(alloc::event_trace::event_kind::store_put, *ent);
  entries_.emplace(h, std::move(ent));
  return h;
}

// ---- get / release ---------------------------------------------------------------------

std::shared_ptr<activation_store::entry> activation_store::find(handle h) const {
  std::lock_guard lock(mu_);
  auto it = entries_.find(h);
  GACT_EXPECTS(it != entries_.end(),
               "activation_store: unknown handle " + std::to_string(h) + " (released already?)");
  ++c_->gets;
  return it->second;
}

void activation_store::get(handle h, void* dst, std::size_t dst_bytes, device::stream_t stream) const {
  std::shared_ptr<entry> e = find(h);
  GACT_EXPECTS(dst_bytes == e->info.bytes_in,
               "activation_store::get: destination holds " + std::to_string(dst_bytes) +
                   " bytes, the tensor needs " + std::to_string(e->info.bytes_in));
  trace_store_event(alloc::event_trace::event_kind::store_get, *e);
  if (dst_bytes == 0) return;
  GACT_EXPECTS(dst != nullptr, "activation_store::get: null destination");
  // A swapped blob is where its mover says, ready for `stream` (the mover records the stream use).
  void const* blob = e->mover != nullptr ? e->mover->acquire(e->swap_id, stream) : e->blob;
  if (e->info.device < 0) {
    codec::decode_cpu(blob, e->info.bytes_stored, dst, dst_bytes, opts_.threads);
    return;
  }
#if defined(GACT_HAVE_KERNELS)
  codec::decode_cuda(blob, e->info.bytes_stored, dst, dst_bytes, reinterpret_cast<cudaStream_t>(stream));
  // The blob may be freed (on its allocation stream) before the decode on `stream` has run.
  if (e->mover == nullptr && stream != e->stream) e->arena->record_stream(e->blob, stream);
#else
  (void)stream;
  GACT_FAIL("activation_store::get: CUDA tensor but this build of gact has no CUDA kernels");
#endif
}

std::int64_t activation_store::release(handle h) noexcept {
  std::shared_ptr<entry> dead;  // destroyed after the lock is dropped
  {
    std::lock_guard lock(mu_);
    auto it = entries_.find(h);
    if (it == entries_.end()) {
      ++c_->bad_releases;
      GACT_WARN_CAPPED(8, "activation_store::release: unknown handle {}", h);
      return -1;
    }
    ++c_->releases;
    entry& e = *it->second;
    if (--e.info.refcount > 0) return static_cast<std::int64_t>(e.info.refcount);
    if (e.has_identity) {
      auto d = dedup_.find(e.id);
      if (d != dedup_.end() && d->second == h) dedup_.erase(d);
    }
    c_->current_stored -= e.info.bytes_stored;
    c_->current_in -= e.info.bytes_in;
    trace_store_event(alloc::event_trace::event_kind::store_release, e);
    dead = std::move(it->second);
    entries_.erase(it);
  }
  return 0;
}

void activation_store::forget(handle h) noexcept {
  std::lock_guard lock(mu_);
  auto it = entries_.find(h);
  if (it == entries_.end()) return;
  entry& e = *it->second;
  if (!e.has_identity) return;
  auto d = dedup_.find(e.id);
  if (d != dedup_.end() && d->second == h) dedup_.erase(d);
  e.has_identity = false;
}

tensor_info activation_store::info(handle h) const {
  std::lock_guard lock(mu_);
  auto it = entries_.find(h);
  GACT_EXPECTS(it != entries_.end(), "activation_store::info: unknown handle " + std::to_string(h));
  return it->second->info;
}

// ---- accounting ------------------------------------------------------------------------

void activation_store::note_skip(skip_reason r, std::size_t bytes) noexcept {
  auto const i = static_cast<std::size_t>(r);
  if (i >= c_->skipped.size()) return;
  std::lock_guard lock(mu_);
  ++c_->skipped[i].tensors;
  c_->skipped[i].bytes += bytes;
}

void activation_store::begin_step(std::uint64_t step) noexcept {
  {
    std::lock_guard lock(mu_);
    step_ = step;
    for (auto& [h, e] : entries_) e->has_identity = false;
    dedup_.clear();
  }
  if (alloc::event_trace::enabled()) {
    try {
      alloc::event_trace::mark_step(step);  // may snapshot the stats document: no lock held here
    } catch (std::exception const& ex) {
      GACT_WARN_CAPPED(4, "activation_store: event trace snapshot at step {} failed: {}", step, ex.what());
    }
  }
}

std::size_t activation_store::end_step() noexcept {
  std::lock_guard lock(mu_);
  std::size_t const n = entries_.size();
  c_->leaks += n;
  c_->leaks_last_step = n;
  ++c_->steps;
  if (n > 0) GACT_WARN_CAPPED(4, "activation_store: {} handles still alive at the end of step {}", n, step_);
  return n;
}

std::size_t activation_store::live_handles() const noexcept {
  std::lock_guard lock(mu_);
  return entries_.size();
}

std::size_t activation_store::stored_bytes() const noexcept {
  std::lock_guard lock(mu_);
  return c_->current_stored;
}

nlohmann::json activation_store::stats_json() const {
  std::lock_guard lock(mu_);
  auto const& c = *c_;
  nlohmann::json j;
  j["tensors_in"] = c.tensors_in;
  j["bytes_in"] = c.bytes_in;
  j["bytes_stored"] = c.bytes_stored;
  j["ratio"] = c.bytes_stored > 0 ? static_cast<double>(c.bytes_in) / static_cast<double>(c.bytes_stored) : 0.0;
  nlohmann::json codecs = nlohmann::json::object();
  for (std::size_t i = 0; i < k_codec_count; ++i) {
    codecs[codec::codec_name(static_cast<codec::codec_id>(i))] = {
        {"tensors", c.codecs[i].tensors},
        {"bytes_in", c.codecs[i].bytes_in},
        {"bytes_stored", c.codecs[i].bytes_stored}};
  }
  j["codecs"] = std::move(codecs);
  j["quant_bits"] = {{"1", c.quant_bits[1]}, {"2", c.quant_bits[2]}, {"4", c.quant_bits[4]}, {"8", c.quant_bits[8]}};
  nlohmann::json sk = nlohmann::json::object();
  std::uint64_t sk_t = 0, sk_b = 0;
  for (std::size_t i = 0; i < c.skipped.size(); ++i) {
    sk[skip_reason_name(static_cast<skip_reason>(i))] = {{"tensors", c.skipped[i].tensors},
                                                          {"bytes", c.skipped[i].bytes}};
    sk_t += c.skipped[i].tensors;
    sk_b += c.skipped[i].bytes;
  }
  j["skipped"] = std::move(sk);
  j["skipped_tensors"] = sk_t;
  j["skipped_bytes"] = sk_b;
  j["dedup_hits"] = c.dedup_hits;
  j["dedup_bytes"] = c.dedup_bytes;
  j["nonfinite_fallbacks"] = c.nonfinite_fallbacks;
  j["gathers"] = c.gathers;
  j["gets"] = c.gets;
  j["releases"] = c.releases;
  j["bad_releases"] = c.bad_releases;
  j["live_handles"] = entries_.size();
  j["bytes_in_current"] = c.current_in;
  j["bytes_stored_current"] = c.current_stored;
  j["bytes_stored_peak"] = c.peak_stored;
  j["leaks"] = c.leaks;
  j["leaks_last_step"] = c.leaks_last_step;
  j["steps"] = c.steps;
  j["step"] = step_;
  return j;
}

void activation_store::reset_stats() noexcept {
  std::lock_guard lock(mu_);
  counters fresh;
  fresh.current_stored = c_->current_stored;
  fresh.current_in = c_->current_in;
  fresh.peak_stored = c_->current_stored;
  *c_ = fresh;
}

}  // namespace gact::store
