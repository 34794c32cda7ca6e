// gact/allocator/store/activation_store.cpp
//
// Implementation of the activation store (see the header for the contract).
// Layout of the work in put(): validate the view and find its dense layout; look
// for an entry of the same storage that can serve it (under the lock); otherwise
// take the source (the view's memory image, or a gather into a workspace block),
// choose the codec from the role and dtype, allocate the blob in the arena (tag
// activation), encode outside the lock, and publish the entry under the lock. A
// quant encode refused for NaN/Inf is redone raw into a blob of raw size; a
// refused predicate or window encode falls back to values or raw.
//
// Entries are shared_ptr-owned: get_shared() copies the pointer under the table's
// lock and decodes under the entry's own lock, so a concurrent final release()
// cannot free a blob that is being read, and an upgrade cannot swap a blob under
// a reader; the blob goes back to its arena when the last owner lets go.
#include "allocator/store/activation_store.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <span>
#include <string_view>

#include "allocator/error.hpp"
#include "allocator/event_trace.hpp"
#include "allocator/log.hpp"
#include "allocator/stats_registry.hpp"
#include "allocator/tags.hpp"
#include "codecs/float16.hpp"
#include "codecs/quant_math.hpp"

#if defined(GACT_HAVE_KERNELS)
#include <cuda_runtime_api.h>

#include "allocator/device/device_guard.hpp"
#endif

namespace gact::store {

namespace {

constexpr std::size_t k_codec_count = std::size_t(codec::k_codec_count);
constexpr std::size_t k_max_rank = 64;

bool is_float(codec::dtype t) noexcept {
  return t == codec::dtype::float32 || t == codec::dtype::float16 || t == codec::dtype::bfloat16 ||
         t == codec::dtype::float64;
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

/// Copy the elements of a strided host view into `dst` in the order of the dense layout `dstrides`
/// (dst element at offset sum(i_d * dstrides_d) gets the view's element i). Precondition: numel > 0.
void gather_dense(void const* src, std::size_t es, std::span<std::int64_t const> shape,
                  std::span<std::int64_t const> strides, std::span<std::int64_t const> dstrides, void* dst) {
  std::size_t const rank = shape.size();
  auto const* s = static_cast<unsigned char const*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  if (rank == 0) {
    std::memcpy(d, s, es);
    return;
  }
  std::int64_t const inner = shape[rank - 1];
  std::int64_t const in_stride = strides[rank - 1], out_stride = dstrides[rank - 1];
  std::array<std::int64_t, k_max_rank> idx{};
  std::int64_t outer = 1;
  for (std::size_t i = 0; i + 1 < rank; ++i) outer *= shape[i];
  auto const ses = static_cast<std::int64_t>(es);
  for (std::int64_t o = 0; o < outer; ++o) {
    std::int64_t so = 0, dof = 0;
    for (std::size_t i = 0; i + 1 < rank; ++i) {
      so += idx[i] * strides[i];
      dof += idx[i] * dstrides[i];
    }
    unsigned char const* row = s + so * ses;
    unsigned char* out = d + dof * ses;
    if (in_stride == 1 && out_stride == 1) {
      std::memcpy(out, row, static_cast<std::size_t>(inner) * es);
    } else {
      for (std::int64_t j = 0; j < inner; ++j) std::memcpy(out + j * out_stride * ses, row + j * in_stride * ses, es);
    }
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

// Sum over the groups of a host quant blob of (hi - lo)^2 in the tensor's own units, read from its
// metadata section (a normalized group's range is scaled back by its first element's block statistics).
double sum_sq_ranges(void const* blob, std::size_t len, std::uint64_t* groups) {
  codec::blob_info const info = codec::parse(blob, len);
  auto const lay = codec::hd::compute_layout(std::uint8_t(codec::codec_id::quant), info.variant, std::uint8_t(info.dt),
                                             int(info.shape.size()), info.numel, info.bits, info.group_size,
                                             info.normalized.count);
  auto const* stats = static_cast<unsigned char const*>(blob) + lay.header_bytes;
  auto const* meta = stats + lay.stats_bytes;
  bool const wide = codec::hd::meta_value_bytes(std::uint8_t(info.dt), info.variant) == 4;
  bool const normalized = info.variant == std::uint8_t(codec::quant_mode::normalized);
  double acc = 0.0;
  for (std::uint64_t g = 0; g < lay.n_groups; ++g) {
    float lo = 0.f, hi = 0.f;
    if (wide) {
      std::memcpy(&lo, meta + g * 8, 4);
      std::memcpy(&hi, meta + g * 8 + 4, 4);
    } else {
      std::uint16_t l16 = 0, h16 = 0;
      std::memcpy(&l16, meta + g * 4, 2);
      std::memcpy(&h16, meta + g * 4 + 2, 2);
      bool const half = info.dt == codec::dtype::float16;
      lo = half ? codec::hd::half_to_float(l16) : codec::hd::bf16_to_float(l16);
      hi = half ? codec::hd::half_to_float(h16) : codec::hd::bf16_to_float(h16);
    }
    double r = static_cast<double>(hi) - static_cast<double>(lo);
    if (normalized) {
      std::uint64_t const e0 = g * std::uint64_t(info.group_size);
      float shift = 0.f, scale = 1.f;
      codec::hd::load_stat(stats, (e0 / info.normalized.inner) % info.normalized.count, shift, scale);
      r /= static_cast<double>(scale);
    }
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

/// A predicate whose data range makes a boundary blob possible: x > lo read from a clamp to [lo, inf),
/// lo < x < hi read from a clamp to [lo, hi].
bool upgradable(codec::predicate_params const& q) noexcept {
  auto const p = codec::predicate(q.pred);
  return p == codec::predicate::gt || p == codec::predicate::open || p == codec::predicate::gt_or_nan;
}

/// The boundary variant of quant for data read by the upgradable predicate `q` (codes 0 and 2^b - 1 exactly
/// its bounds), at `bits` but at least 2: at 1 bit the mask (1) and the values (1) would cost the same and
/// serve worse.
void set_boundary(codec::encode_params& ep, codec::predicate_params const& q, int bits) noexcept {
  ep.variant = std::uint8_t(codec::quant_mode::boundary);
  ep.bits = std::max(bits, 2);
  bool const open = codec::predicate(q.pred) == codec::predicate::open;
  ep.boundary = {q.a, open ? q.b : 0.0f, open ? 1u : 0u, 0u};
}

/// Whether a stored values blob is as precise as a put's reader tolerates (`p.min_bits`): raw bytes always are; a
/// quantized one with no fewer bits. (A policy's wider width for a later save of the same storage is the policy's
/// to model: its probe sees the first save's blob serve both.)
bool precise_enough(tensor_info const& info, put_params const& p) noexcept {
  return info.codec != codec::codec_id::quant || info.bits >= p.min_bits;
}

bool same_predicate(codec::predicate_params const& a, codec::predicate_params const& b) noexcept {
  return a.pred == b.pred && codec::hd::float_bits(a.a) == codec::hd::float_bits(b.a) &&
         codec::hd::float_bits(a.b) == codec::hd::float_bits(b.b);
}

}  // namespace

// ---- names and dtype helpers -----------------------------------------------------------

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

char const* role_name(role r) noexcept {
  switch (r) {
    case role::values: return "values";
    case role::predicate: return "predicate";
    case role::indices: return "indices";
  }
  return "unknown";
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
    case skip_reason::exact: return "exact";
    case skip_reason::memory: return "memory";
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
            "' is unknown; use parameter, small, dtype, excluded, input, layout, device, stats, exact or memory");
}

char const* unstored_name(unstored u) noexcept {
  switch (u) {
    case unstored::shape: return "shape";
    case unstored::held: return "held";
    case unstored::k_count: break;
  }
  return "unknown";
}

unstored parse_unstored(std::string const& name) {
  for (std::size_t i = 0; i < static_cast<std::size_t>(unstored::k_count); ++i) {
    auto const u = static_cast<unstored>(i);
    if (name == unstored_name(u)) return u;
  }
  GACT_FAIL("unstored kind: '" + name + "' is unknown; use shape or held");
}

// ---- layouts -------------------------------------------------------------------------------

bool is_dense(std::vector<std::int64_t> const& shape, std::vector<std::int64_t> const& strides) {
  std::size_t const rank = shape.size();
  if (strides.empty()) return true;
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < rank; ++i) {
    if (shape[i] == 0) return true;  // no elements
    if (shape[i] != 1) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return strides[a] < strides[b]; });
  std::int64_t expect = 1;
  for (std::size_t i : order) {
    if (strides[i] != expect) return false;
    expect *= shape[i];
  }
  return true;
}

std::vector<std::int64_t> dense_strides(std::vector<std::int64_t> const& shape, std::vector<std::int64_t> const& strides) {
  std::size_t const rank = shape.size();
  std::vector<std::int64_t> out(rank, 1);
  if (strides.empty()) {
    std::int64_t acc = 1;
    for (std::size_t i = rank; i-- > 0;) {
      out[i] = acc;
      acc *= std::max<std::int64_t>(shape[i], 1);
    }
    return out;
  }
  if (is_dense(shape, strides)) return strides;
  // torch's infer_dense_strides (what empty_like gives a non-dense tensor): an insertion sort of the dims,
  // innermost first, by stride; a zero stride compares as ambiguous (the dim keeps its place), equal
  // strides put the smaller size first.
  std::vector<std::size_t> perm(rank);
  for (std::size_t i = 0; i < rank; ++i) perm[i] = rank - 1 - i;
  auto should_swap = [&](std::size_t d0, std::size_t d1) {
    std::int64_t const s0 = strides[d0], s1 = strides[d1];
    if (s0 == 0 || s1 == 0) return 0;
    if (s0 < s1) return -1;
    if (s0 > s1) return 1;
    return shape[d0] > shape[d1] ? 1 : 0;
  };
  for (std::size_t i = 1; i < rank; ++i) {
    std::size_t d1 = i;
    for (std::size_t d0 = i; d0-- > 0;) {
      int const c = should_swap(perm[d0], perm[d1]);
      if (c > 0) {
        std::swap(perm[d0], perm[d1]);
        d1 = d0;
      } else if (c < 0) {
        break;
      }
    }
  }
  std::int64_t acc = 1;
  for (std::size_t i : perm) {
    out[i] = acc;
    acc *= std::max<std::int64_t>(shape[i], 1);
  }
  return out;
}

// ---- decoded images ------------------------------------------------------------------------

decoded_image::decoded_image(alloc::caching_allocator& arena, std::size_t bytes, device::stream_t stream,
                             alloc::tag_id tag)
    : arena_(&arena), data_(arena.allocate(std::max<std::size_t>(bytes, 1), stream, tag)), bytes_(bytes) {}

decoded_image::~decoded_image() { arena_->deallocate(data_); }

// ---- internal structures ---------------------------------------------------------------

// Identity of a storage's contents within a step. Views of one storage share its version counter,
// which moves on every in-place write, so equal keys mean equal contents while the first view is
// alive (forget() removes entries whose saved tensor died).
struct activation_store::storage_key {
  std::uintptr_t storage = 0;
  int device = -1;
  codec::dtype dtype = codec::dtype::float32;
  std::int64_t version = 0;
  bool operator==(storage_key const&) const = default;
};

std::size_t activation_store::storage_key_hash::operator()(storage_key const& k) const noexcept {
  std::uint64_t h = mix64(k.storage);
  h = mix64(h ^ static_cast<std::uint64_t>(k.version));
  h = mix64(h ^ (static_cast<std::uint64_t>(k.device + 1) << 8) ^ static_cast<std::uint64_t>(k.dtype));
  return static_cast<std::size_t>(h);
}

// One stored tensor. Invariant: blob != nullptr iff numel > 0; refcount >= 1 while the entry is in
// entries_; a dense entry's image is the storage's elements [span_lo, span_lo + numel).
struct activation_store::entry {
  alloc::caching_allocator* arena = nullptr;
  void* blob = nullptr;
  device::stream_t stream = 0;  // allocation stream of the blob
  tensor_info info;
  std::uint64_t key = 0;        // put_params::key, for the event trace
  handle self = 0;              // this entry's handle
  owner_id owner = 0;           // put_params::owner of the put that made it
  std::uint64_t group = 0;      // put_params::group of the put that made it
  // identity
  bool has_identity = false;
  storage_key skey;
  bool dense = false;
  std::int64_t span_lo = 0;     // element offset of the image in the storage
  std::int64_t numel = 0;
  std::vector<std::int64_t> view_strides;  // a non-dense entry matches only this exact view
  // representation
  bool in_range = false;        // a predicate entry's data is a clamp's output (upgradable)
  offloader* mover = nullptr;   // owns the blob when set (blob is then no longer dereferenced)
  std::uint64_t swap_id = 0;
  // decoded images, one per way of decoding (values; a predicate's true/false values)
  struct cache_slot {
    bool predicate = false;
    float tv = 0.f, fv = 0.f;
    std::weak_ptr<decoded_image> image;
  };
  mutable std::mutex mu;        // guards blob/mover/info.codec while decoding or upgrading, and the cache
  mutable std::vector<cache_slot> cache;
  /// The values image decoded for one reader while others still hold the handle (a ReLU's output read by
  /// the next layer's backward, then by the ReLU's): kept until the last of them takes it from the cache,
  /// so that it is decoded once. Counted in the store's held bytes (capped: activation_store::k_held_cap).
  struct held_image {
    std::shared_ptr<decoded_image const> image;
    std::atomic<std::uint64_t>* total = nullptr;
    std::uint64_t bytes = 0;
    held_image(std::shared_ptr<decoded_image const> i, std::atomic<std::uint64_t>* t, std::uint64_t b)
        : image(std::move(i)), total(t), bytes(b) {}
    held_image(held_image const&) = delete;
    held_image& operator=(held_image const&) = delete;
    ~held_image() { total->fetch_sub(bytes, std::memory_order_relaxed); }
  };
  mutable std::unique_ptr<held_image> held;  // guarded by mu

  entry() = default;
  entry(entry const&) = delete;
  entry& operator=(entry const&) = delete;
  // the device encode's verdict (codecs/verdict.hpp): asked of `ring` until read, then `bad` (also set when the
  // encode could not be verified); guarded by `mu` once published
  codec::verdict_ring* ring = nullptr;
  codec::verdict_ring::ticket ticket;
  bool bad = false;
  ~entry() {
    if (ring != nullptr) ring->release(ticket);
    free_blob();
  }
  void free_blob() noexcept {
    if (mover != nullptr) {
      mover->release(swap_id);
    } else if (blob != nullptr) {
      arena->deallocate(blob);
    }
    mover = nullptr;
    blob = nullptr;
  }
};

struct activation_store::counters {
  struct per_codec {
    std::uint64_t tensors = 0, bytes_in = 0, bytes_stored = 0;
  };
  struct per_count {
    std::uint64_t tensors = 0, bytes = 0;
  };
  std::uint64_t tensors_in = 0;
  std::uint64_t bytes_in = 0;
  std::uint64_t bytes_stored = 0;
  std::array<per_codec, k_codec_count> codecs{};
  std::array<per_count, 3> roles{};          // tensors put per role (new blobs), bytes in
  std::array<std::uint64_t, 9> quant_bits{};  // index = bits (1, 2, 4, 8 used)
  std::array<per_count, static_cast<std::size_t>(skip_reason::k_count)> skipped{};
  std::array<per_count, static_cast<std::size_t>(unstored::k_count)> unstored_{};
  std::uint64_t dedup_hits = 0;
  std::uint64_t dedup_bytes = 0;
  std::uint64_t view_hits = 0;               // of which: a different view of the same storage
  std::uint64_t upgrades = 0;                // predicate entries turned into boundary blobs
  std::uint64_t boundary_blobs = 0;          // boundary blobs stored (upgrades and boundary values puts)
  std::uint64_t nonfinite_fallbacks = 0;
  std::uint64_t device_nonfinite = 0;         // device blobs whose encode reported a non-finite group
  std::uint64_t verdict_waits = 0;            // verdict(wait) calls that found the encode not run yet
  std::uint64_t refusal_fallbacks = 0;       // predicate/window encodes refused and stored another way
  std::uint64_t gathers = 0;
  std::uint64_t gets = 0;
  std::uint64_t decodes = 0;                 // images decoded (gets served by a live image are not)
  std::uint64_t decode_bytes = 0;
  std::uint64_t releases = 0;
  std::uint64_t bad_releases = 0;
  std::uint64_t leaks = 0;
  std::uint64_t leaks_last_step = 0;
  std::uint64_t steps = 0;
  std::uint64_t noise_step = 0;              // an owner's own step (begin_step): its noise depends on nothing else
  std::uint64_t current_stored = 0;
  std::uint64_t peak_stored = 0;
  std::uint64_t current_in = 0;  // numel*elem of live entries
  std::uint64_t bytes_encoded = 0;  // input bytes of every encode pass: upgrades and refused encodes too
  // the last completed step's bytes stored (bytes_in), encoded and decoded, and the totals at its start
  std::uint64_t last_in = 0, last_encoded = 0, last_decoded = 0;
  std::uint64_t mark_in = 0, mark_encoded = 0, mark_decoded = 0;
};

/// What encode() produced.
struct activation_store::encoded {
  arena_block blob;
  std::size_t bytes = 0;
  codec::codec_id codec = codec::codec_id::raw;
  std::uint8_t variant = 0;
  int bits = 0;
  bool nonfinite = false;
  bool refused = false;      // a predicate or window encode that had to be stored another way
  bool in_range = false;
  role served = role::values;
  codec::predicate_params pred{};
  bool boundary = false;           // a boundary blob serving `pred` as well (put_params::boundary)
  std::uint64_t encoded_bytes = 0;  // input bytes of every encode pass (a refused one included)
  codec::verdict_claim verdict;  // a device quant or window encode's verdict, to ask
  bool unverified = false;       // a device encode that could ask for none (stream capture, no slot left)
  double sum_sq_ranges = 0.0;
  std::uint64_t groups = 0;
};

// ---- construction ----------------------------------------------------------------------

activation_store::activation_store(alloc::caching_allocator& host_arena, store_options opts)
    : host_arena_(host_arena), opts_(std::move(opts)), decoded_tag_(alloc::intern_tag("decoded")),
      c_(std::make_unique<counters>()) {
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
  by_storage_.clear();
  unversioned_.clear();
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

void activation_store::set_mover(int device, offloader* m) {
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

activation_store::encoded activation_store::encode(tensor_view const& v, put_params const& p, role what,
                                                   void const* src, std::uint64_t numel, std::uint64_t step,
                                                   alloc::caching_allocator& arena) const {
  encoded out;
  std::int64_t const flat[1] = {static_cast<std::int64_t>(numel)};
  std::span<std::int64_t const> const shp(flat);  // the codecs encode the 1-D image
  codec::encode_params ep;
  ep.group_size = p.group_size;
  ep.seed = mix64(p.seed ^ mix64(step));
  ep.key = p.key;
  ep.bits = p.bits;
  bool const host = v.device < 0;
  int const threads = p.threads > 0 ? p.threads : opts_.threads;
  bool const fl = is_float(v.dtype);

  // The codec for the role (and what the blob then serves).
  out.served = what;
  if (what == role::predicate && fl && !(!host && codec::predicate(p.pred.pred) == codec::predicate::ne)) {
    ep.codec = codec::codec_id::mask;
    ep.variant = std::uint8_t(codec::mask_mode::predicate);
    ep.pred = p.pred;
    out.pred = p.pred;
  } else if (what == role::indices && (v.dtype == codec::dtype::int64 || v.dtype == codec::dtype::int32)) {
    ep.codec = codec::codec_id::window;
    ep.window = p.window;
  } else {
    out.served = role::values;
    if (what != role::values) out.refused = true;
    // float64 on a device: whether its values fit float32 (the quant codec computes in it) cannot be
    // checked without a host synchronisation, so it is kept exact (the CPU checks: float64_range)
    bool const f64_on_device = !host && v.dtype == codec::dtype::float64;
    if (fl && p.bits <= 8 && !f64_on_device) {
      ep.codec = codec::codec_id::quant;
      ep.max_magnitude = codec::k_store_max_magnitude;  // (a mask's fill: kept exact, refusal::wide)
      if (what == role::values && p.boundary && p.norm_count == 0 && upgradable(p.pred)) {
        // as the upgrade of a predicate entry in put(): one blob for the values and the predicate
        set_boundary(ep, p.pred, p.bits);
        out.boundary = true;
        out.pred = p.pred;
      } else if (p.norm_count > 0) {
        ep.variant = std::uint8_t(codec::quant_mode::normalized);
        ep.norm_count = p.norm_count;
        ep.norm_inner = p.norm_inner;
        ep.norm_shift = p.norm_shift;
        ep.norm_scale = p.norm_scale;
      }
    } else if (v.dtype == codec::dtype::boolean ||
               (host && v.dtype == codec::dtype::uint8 && all_zero_one(src, numel))) {
      ep.codec = codec::codec_id::mask;
      ep.bits = 1;
    } else {
      ep.codec = codec::codec_id::raw;
    }
  }
  if (ep.codec == codec::codec_id::window) {
    // the fewest code bits that hold the window's positions
    std::int64_t vol = 1;
    for (std::uint32_t d = 0; d < p.window.nd && d < std::uint32_t(codec::k_window_max_nd); ++d) vol *= p.window.kernel[d];
    ep.bits = vol <= 2 ? 1 : vol <= 4 ? 2 : vol <= 16 ? 4 : 8;
  }

  auto run = [&](codec::encode_params const& e) {
    out.encoded_bytes += numel * element_size(v.dtype);
    std::size_t const cap = codec::blob_size(v.dtype, shp, e);
    out.blob = arena_block(arena, cap, p.stream, alloc::tag_activation);
    codec::encode_result r{};
    if (host) {
      r = codec::encode_cpu(src, v.dtype, shp, e, out.blob.p, cap, threads);
    } else {
#if defined(GACT_HAVE_KERNELS)
      codec::device_verdict dv;
      bool const reports = e.codec == codec::codec_id::quant || e.codec == codec::codec_id::window;
      auto const stream = reinterpret_cast<cudaStream_t>(p.stream);
      // Under stream capture the kernel is recorded, not run: its verdict would come at each replay, into a slot
      // reused meanwhile. Such an encode asks for none and counts as unverified (its tensor kept exact).
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      if (reports && cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
        (void)cudaGetLastError();  // (the legacy stream while another captures: treated as capturing)
        capture = cudaStreamCaptureStatusActive;
      }
      codec::verdict_ring* const ring =
          reports && capture == cudaStreamCaptureStatusNone ? verdict_ring_for(v.device) : nullptr;
      codec::verdict_claim claim;
      if (ring != nullptr) {
        codec::verdict_ring::ticket const t = ring->acquire(&dv);
        if (t.valid()) claim = codec::verdict_claim(ring, t);
      }
      out.unverified = reports && !claim.ring();
      // (a launch that throws may still have been queued: the claim releases its slot, which is reused only once
      // that launch, if any, has reported)
      r = codec::encode_cuda(src, v.dtype, shp, e, out.blob.p, cap, stream, claim.ring() ? &dv : nullptr);
      out.verdict = std::move(claim);
#else
      GACT_FAIL("activation_store::put: tensor on CUDA device " + std::to_string(v.device) +
                " but this build of gact has no CUDA kernels");
#endif
    }
    return r;
  };
  codec::encode_result r = run(ep);
  if (r.refused == codec::refusal::out_of_range && out.boundary) {
    // not a clamp's output after all: plain values (the predicate save then encodes its own mask)
    out.blob.reset();
    out.boundary = false;
    out.pred = {};
    ep.variant = 0;
    ep.bits = p.bits;
    ep.boundary = {};
    r = run(ep);
  }
  if (r.refused != codec::refusal::none) {
    out.blob.reset();
    if (out.boundary) {
      // (a boundary blob that met NaN/Inf, float64 float32 cannot hold or a group too wide: the raw values below serve
      // no predicate, which a later save of the memory would otherwise be handed and fail to decode)
      out.boundary = false;
      out.pred = {};
    }
    if (r.refused == codec::refusal::nonfinite || r.refused == codec::refusal::float64_range ||
        r.refused == codec::refusal::wide) {
      // NaN/Inf, float64 values float32 cannot hold, or a group too wide to quantize (a mask's fill): kept exact
      out.nonfinite = r.refused == codec::refusal::nonfinite;
      out.refused = !out.nonfinite;
      ep = codec::encode_params{};
      ep.codec = codec::codec_id::raw;
    } else {  // a refused predicate (not two-level) or window: keep the exact values
      out.refused = true;
      out.served = role::values;
      codec::encode_params q = ep;
      q.variant = 0;
      if (fl && p.bits <= 8) {
        q.codec = codec::codec_id::quant;
        q.bits = p.bits;
        q.max_magnitude = codec::k_store_max_magnitude;
      } else {
        q.codec = codec::codec_id::raw;
      }
      ep = q;
    }
    r = run(ep);
    if (r.refused != codec::refusal::none) {  // (the values a refused predicate fell back to: NaN/Inf, or too wide)
      if (r.refused == codec::refusal::nonfinite) out.nonfinite = true;
      out.blob.reset();
      ep = codec::encode_params{};
      ep.codec = codec::codec_id::raw;
      r = run(ep);
    }
  }
  GACT_ASSERT_INTERNAL(r.refused == codec::refusal::none);
  out.bytes = r.bytes;
  out.codec = r.codec;
  out.variant = ep.codec == codec::codec_id::quant || ep.codec == codec::codec_id::mask ? ep.variant : 0;
  out.in_range = r.in_range || (!host && p.clamped) || out.boundary;
  out.bits = out.codec == codec::codec_id::quant || out.codec == codec::codec_id::window ? ep.bits
             : out.codec == codec::codec_id::mask                                       ? 1
                                                                                        : int(element_size(v.dtype) * 8);
  if (host && out.codec == codec::codec_id::quant) out.sum_sq_ranges = sum_sq_ranges(out.blob.p, out.bytes, &out.groups);
  return out;
}

put_result activation_store::put(tensor_view const& v, put_params const& p) {
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
  GACT_EXPECTS(p.what == role::values || p.what == role::predicate || p.what == role::indices,
               "activation_store::put: unknown role " + std::to_string(int(p.what)));
  GACT_EXPECTS(p.threads >= 0, "activation_store::put: threads must be >= 0");
  std::size_t const es = element_size(v.dtype);
  GACT_EXPECTS(es != 0, "activation_store::put: unknown dtype");
  std::size_t const bytes_in = numel * es;
  GACT_EXPECTS(p.what != role::predicate || is_float(v.dtype),
               std::string("activation_store::put: a predicate is read from a float tensor, not ") + store::dtype_name(v.dtype));

  std::vector<std::int64_t> const strides_in = v.strides.empty() ? dense_strides(v.shape, {}) : v.strides;
  bool const dense = is_dense(v.shape, strides_in);
  std::vector<std::int64_t> const dstr = dense_strides(v.shape, strides_in);
  // The view's element offset in its storage, and its span there (dense: exactly numel elements).
  std::uintptr_t const storage = v.storage != 0 ? v.storage : reinterpret_cast<std::uintptr_t>(v.data);
  auto const data_addr = reinterpret_cast<std::uintptr_t>(v.data);
  GACT_EXPECTS(data_addr >= storage && (data_addr - storage) % es == 0,
               "activation_store::put: the data pointer is not an element of its storage");
  std::int64_t const view_off = static_cast<std::int64_t>((data_addr - storage) / es);
  std::int64_t view_max = view_off;  // last element reached
  for (std::size_t i = 0; i < rank; ++i)
    if (v.shape[i] > 0) view_max += (v.shape[i] - 1) * strides_in[i];
  storage_key const skey{storage, v.device, v.dtype, v.version};
  alloc::caching_allocator& arena = arena_for(v.device);

  // Look for an entry that serves the view.
  std::uint64_t step = 0;
  std::shared_ptr<entry> upgrade;
  bool unversioned = false;  // forget_storage(): neither served nor serving
  {
    std::lock_guard lock(mu_);
    // The noise of an owner's tensors follows its own steps, never another owner's (two Compressors, in
    // threads or made one after the other, are each reproducible).
    counters const* oc = owner_counters(p.owner);
    step = oc != nullptr ? oc->noise_step : step_;
    unversioned = !unversioned_.empty() &&
                  (unversioned_.contains({storage, p.owner}) || unversioned_.contains({storage, owner_id{0}}));
    auto it = unversioned ? by_storage_.end() : by_storage_.find(skey);
    if (it != by_storage_.end() && numel > 0) {
      for (handle h : it->second) {
        auto eit = entries_.find(h);
        if (eit == entries_.end()) continue;
        entry& e = *eit->second;
        bool const inside = e.dense ? (view_off >= e.span_lo && view_max < e.span_lo + e.numel)
                                    : (view_off == e.span_lo && v.shape == e.info.shape && strides_in == e.view_strides);
        if (!inside) continue;
        // Only the owner's own entries serve it (another Compressor's blob has its widths, its lifetime and its
        // abort_step()), and a values blob only when it is as precise as this save's reader tolerates: a
        // log-space input or an attention score raised to 8 bits is not served by a 2-bit blob of the same
        // memory that another op saved first.
        if (e.owner != p.owner || e.group != p.group) continue;  // (a correlated call's group: put_params::group)
        bool serves = false;
        switch (p.what) {
          case role::values:
            // (a put normalized per block, a row-divided or normalization input, is not served by plain quantized
            // groups: their range spans the blocks, which is what it is normalized against)
            serves = e.info.values && precise_enough(e.info, p) &&
                     (p.norm_count == 0 || e.info.codec != codec::codec_id::quant ||
                      e.info.variant == std::uint8_t(codec::quant_mode::normalized));
            break;
          case role::predicate: serves = e.info.predicate && same_predicate(e.info.pred, p.pred); break;
          case role::indices: serves = e.info.values && !is_float(e.info.dtype); break;
        }
        // (not on a device: there a boundary blob that met NaN/Inf is known only later, through its verdict, and
        // the mask's earlier reader keeps no tensor to fall back to; codecs/README.md, "Non-finite input")
        if (!serves && p.what == role::values && e.info.predicate && !e.info.values && e.dense && e.in_range &&
            upgradable(e.info.pred) && is_float(v.dtype) && p.bits <= 8 && p.norm_count == 0 && v.device < 0) {
          upgrade = eit->second;  // a clamp's mask, now also read for its values: one boundary blob
          break;
        }
        if (!serves) continue;
        ++e.info.refcount;
        bool const other_view = view_off != e.span_lo || v.shape != e.info.shape;
        for (counters* k : {c_.get(), owner_counters(p.owner)}) {
          if (k == nullptr) continue;
          ++k->dedup_hits;
          k->dedup_bytes += bytes_in;
          if (other_view) ++k->view_hits;
        }
        // A dense entry's image is the storage span: the view reads it through its own strides. A gathered
        // entry serves only the very view it was gathered from, in the layout it was gathered in.
        return {h, view_off - e.span_lo, true, false, e.dense ? strides_in : e.info.strides};
      }
    }
  }

  if (upgrade != nullptr) {
    entry& e = *upgrade;
    // Encode the entry's whole image (the same storage and version: the same data) as a boundary blob.
    auto const* image = reinterpret_cast<void const*>(storage + static_cast<std::uintptr_t>(e.span_lo) * es);
    codec::encode_params ep;
    ep.codec = codec::codec_id::quant;
    set_boundary(ep, e.info.pred, p.bits);
    int const ubits = ep.bits;
    ep.group_size = p.group_size;
    ep.seed = mix64(p.seed ^ mix64(step));
    ep.key = p.key;
    std::int64_t const flat[1] = {e.numel};
    std::size_t const cap = codec::blob_size(v.dtype, std::span<std::int64_t const>(flat), ep);
    arena_block blob(arena, cap, p.stream, alloc::tag_activation);
    GACT_ASSERT_INTERNAL(v.device < 0);  // (host entries only: see above)
    codec::encode_result const r = codec::encode_cpu(image, v.dtype, std::span<std::int64_t const>(flat), ep, blob.p,
                                                     cap, p.threads > 0 ? p.threads : opts_.threads);
    if (r.refused == codec::refusal::none) {
      std::uint64_t groups = 0;
      double const ssr = sum_sq_ranges(blob.p, r.bytes, &groups);
      std::size_t old_bytes = 0;
      {
        std::lock_guard elock(e.mu);
        old_bytes = e.info.bytes_stored;
        trace_store_event(alloc::event_trace::event_kind::store_release, e);  // the mask's blob goes
        e.free_blob();
        e.blob = blob.release();
        e.stream = p.stream;
        e.info.codec = codec::codec_id::quant;
        e.info.variant = ep.variant;
        e.info.bits = ubits;
        e.info.bytes_stored = r.bytes;
        e.info.values = true;
        e.info.groups = groups;
        e.info.sum_sq_ranges = ssr;
        e.cache.clear();  // images of the mask stay valid for their readers; new ones come from the new blob
        e.held.reset();
        trace_store_event(alloc::event_trace::event_kind::store_put, e);  // the boundary blob comes
      }
      offload(e);
      std::lock_guard lock(mu_);
      if (!entries_.contains(e.self)) goto fresh;  // released meanwhile: store the view on its own below
      ++e.info.refcount;
      for (counters* k : {c_.get(), owner_counters(p.owner)}) {
        if (k == nullptr) continue;
        ++k->upgrades;
        ++k->boundary_blobs;
        ++k->dedup_hits;
        k->dedup_bytes += bytes_in;
        k->bytes_encoded += static_cast<std::uint64_t>(e.numel) * es;  // the entry's image, encoded again
      }
      // The entry is now a quant blob: move it from the mask codec's counts to quant's (for the store
      // and the entry's owner, whose tensor it is).
      for (counters* k : {c_.get(), owner_counters(e.owner)}) {
        if (k == nullptr) continue;
        auto& mk = k->codecs[std::size_t(codec::codec_id::mask)];
        auto& qt = k->codecs[std::size_t(codec::codec_id::quant)];
        mk.tensors -= std::min<std::uint64_t>(mk.tensors, 1);
        mk.bytes_in -= std::min<std::uint64_t>(mk.bytes_in, e.info.bytes_in);
        mk.bytes_stored -= std::min<std::uint64_t>(mk.bytes_stored, old_bytes);
        ++qt.tensors;
        qt.bytes_in += e.info.bytes_in;
        qt.bytes_stored += r.bytes;
        k->bytes_stored -= std::min<std::uint64_t>(k->bytes_stored, old_bytes);
        k->bytes_stored += r.bytes;
        k->current_stored += r.bytes;
        k->current_stored -= std::min<std::uint64_t>(k->current_stored, old_bytes);
        k->peak_stored = std::max(k->peak_stored, k->current_stored);
        ++k->quant_bits[static_cast<std::size_t>(ubits)];
      }
      return {e.self, view_off - e.span_lo, true, true, strides_in};  // (an upgraded entry is dense)
    }
  }

fresh:
  auto ent = std::make_shared<entry>();
  ent->arena = &arena;
  ent->stream = p.stream;
  ent->info.dtype = v.dtype;
  ent->info.shape = v.shape;
  ent->info.strides = dstr;
  ent->info.device = v.device;
  ent->info.bytes_in = bytes_in;
  ent->info.refcount = 1;
  ent->key = p.key;
  ent->owner = p.owner;
  ent->group = p.group;
  ent->dense = dense;
  ent->numel = static_cast<std::int64_t>(numel);
  ent->span_lo = view_off;
  if (!dense) ent->view_strides = strides_in;
  ent->skey = skey;

  encoded enc;
  bool gathered = false;
  if (numel > 0) {
    void const* src = v.data;
    arena_block work;
    if (!dense) {
      GACT_EXPECTS(v.device < 0, "activation_store::put: a CUDA view must be non-overlapping and dense (copy it "
                                 "with empty_like + copy_ first)");
      work = arena_block(host_arena_, bytes_in, 0, alloc::tag_workspace);
      gather_dense(v.data, es, std::span<std::int64_t const>(v.shape), std::span<std::int64_t const>(strides_in),
                   std::span<std::int64_t const>(dstr), work.p);
      src = work.p;
      gathered = true;
    } else {
      // the image starts at the element with the lowest address (strides are >= 0: element [0, ..., 0])
      src = v.data;
    }
    enc = encode(v, p, p.what, src, numel, step, arena);
    ent->blob = enc.blob.release();
    ent->ticket = enc.verdict.take(&ent->ring);
    ent->bad = enc.unverified;  // (kept exact: verdict() answers 1)
    ent->info.codec = enc.codec;
    ent->info.variant = enc.variant;
    ent->info.bits = enc.bits;
    ent->info.bytes_stored = enc.bytes;
    ent->info.groups = enc.groups;
    ent->info.sum_sq_ranges = enc.sum_sq_ranges;
    ent->in_range = enc.in_range;
    // a two-level (ne) mask decodes to its exact values as well
    ent->info.values = enc.served != role::predicate || codec::predicate(enc.pred.pred) == codec::predicate::ne;
    ent->info.predicate = enc.served == role::predicate || enc.boundary;  // (a boundary blob serves both)
    ent->info.pred = enc.pred;
  } else {
    ent->info.codec = codec::codec_id::raw;
    ent->info.bits = static_cast<int>(es * 8);
    ent->info.values = true;
    ent->info.predicate = p.what == role::predicate;
    ent->info.pred = p.pred;
  }
  offload(*ent);

  // Publish.
  std::lock_guard lock(mu_);
  handle const h = next_handle_++;
  ent->self = h;
  for (counters* k : {c_.get(), owner_counters(p.owner)}) {
    if (k == nullptr) continue;
    auto& c = *k;
    ++c.tensors_in;
    c.bytes_in += bytes_in;
    c.bytes_stored += ent->info.bytes_stored;
    auto& pc = c.codecs[static_cast<std::size_t>(ent->info.codec) % k_codec_count];
    ++pc.tensors;
    pc.bytes_in += bytes_in;
    pc.bytes_stored += ent->info.bytes_stored;
    auto& pr = c.roles[static_cast<std::size_t>(p.what)];
    ++pr.tensors;
    pr.bytes += bytes_in;
    if (ent->info.codec == codec::codec_id::quant) ++c.quant_bits[static_cast<std::size_t>(ent->info.bits)];
    if (enc.nonfinite) ++c.nonfinite_fallbacks;
    if (enc.refused) ++c.refusal_fallbacks;
    if (gathered) ++c.gathers;
    c.current_stored += ent->info.bytes_stored;
    c.current_in += bytes_in;
    c.peak_stored = std::max(c.peak_stored, c.current_stored);
    c.bytes_encoded += enc.encoded_bytes;
    if (enc.boundary) ++c.boundary_blobs;
  }
  if (!unversioned) {
    ent->has_identity = true;
    by_storage_[skey].push_back(h);
  }
  trace_store_event(alloc::event_trace::event_kind::store_put, *ent);
  entries_.emplace(h, std::move(ent));
  return {h, 0, false, enc.boundary, dense ? strides_in : dstr};
}

// Hand the entry's blob to the offloader of its device, if one is set.
void activation_store::offload(entry& e) {
  if (e.blob == nullptr || e.mover != nullptr) return;
  offloader* m = nullptr;
  {
    std::lock_guard lock(mu_);
    m = movers_[static_cast<std::size_t>(e.info.device + 1)];
  }
  if (m == nullptr) return;
  std::lock_guard elock(e.mu);
  e.swap_id = m->put(e.blob, e.info.bytes_stored, e.stream);
  e.mover = m;
}

// ---- get / release ---------------------------------------------------------------------

std::shared_ptr<activation_store::entry> activation_store::lookup(handle h, char const* who) const {
  auto it = entries_.find(h);
  GACT_EXPECTS(it != entries_.end(),
               std::string(who) + ": unknown handle " + std::to_string(h) + " (released already?)");
  return it->second;
}

std::shared_ptr<activation_store::entry> activation_store::find(handle h) const {
  std::lock_guard lock(mu_);
  std::shared_ptr<entry> e = lookup(h, "activation_store");
  ++c_->gets;
  if (counters* k = owner_counters(e->owner)) ++k->gets;
  return e;
}

std::shared_ptr<decoded_image const> activation_store::get_shared(handle h, get_params const& gp) const {
  return decode_image(find(h), gp);
}

std::shared_ptr<decoded_image const> activation_store::decode_image(std::shared_ptr<entry> const& e,
                                                                    get_params const& gp) const {
  handle const h = e->self;
  GACT_EXPECTS(!gp.predicate || e->info.predicate,
               "activation_store::get: handle " + std::to_string(h) + " holds no predicate (stored as " +
                   codec::codec_name(e->info.codec) + ")");
  GACT_EXPECTS(gp.predicate || e->info.values,
               "activation_store::get: handle " + std::to_string(h) + " holds only a predicate, not the values");
  std::unique_lock elock(e->mu);
  // an image of this entry another reader decoded already (and still holds), for the same question
  auto const cached = [&]() -> std::shared_ptr<decoded_image const> {
    for (auto const& s : e->cache) {
      if (s.predicate != gp.predicate) continue;
      if (gp.predicate && (codec::hd::float_bits(s.tv) != codec::hd::float_bits(gp.true_value) ||
                           codec::hd::float_bits(s.fv) != codec::hd::float_bits(gp.false_value)))
        continue;
      if (auto img = s.image.lock()) {
        if (e->held != nullptr) {
          std::uint32_t refs = 0;
          {
            std::lock_guard lock(mu_);  // (entry, then store: the order the counters below take them in)
            refs = e->info.refcount;
          }
          if (refs <= 1) e->held.reset();  // the last reader has it
        }
        return img;
      }
    }
    return nullptr;
  };
  if (auto img = cached()) return img;
  // The image's memory is asked for outside the entry's lock: over torch's CUDA pool the allocation may run
  // Python (an out-of-memory observer) and let go of the GIL, and another reader of this entry holding the GIL
  // must not wait for the lock meanwhile. (bytes_in never changes: an upgrade to a boundary blob keeps it.)
  std::uint64_t const bytes_in = e->info.bytes_in;
  elock.unlock();
  auto img = std::make_shared<decoded_image>(*e->arena, bytes_in, gp.stream, decoded_tag_);
  elock.lock();
  if (auto other = cached()) {  // decoded by another reader meanwhile: theirs, and ours freed outside the lock
    elock.unlock();
    img.reset();
    return other;
  }
  trace_store_event(alloc::event_trace::event_kind::store_get, *e);
  if (e->info.bytes_in > 0) {
    // An offloaded blob is where its mover says, ready for `stream` (the mover records the stream use).
    void const* blob = e->mover != nullptr ? e->mover->acquire(e->swap_id, gp.stream) : e->blob;
    codec::decode_params dp;
    // A predicate entry is decoded to its two values; a boundary blob holding one too decodes it on request.
    dp.predicate = gp.predicate && !(e->info.codec == codec::codec_id::mask);
    dp.true_value = gp.true_value;
    dp.false_value = gp.false_value;
    if (gp.predicate && e->info.codec == codec::codec_id::mask) dp.predicate = true;
    if (e->info.device < 0) {
      codec::decode_cpu(blob, e->info.bytes_stored, img->data(), e->info.bytes_in,
                        gp.threads > 0 ? gp.threads : opts_.threads, dp);
    } else {
#if defined(GACT_HAVE_KERNELS)
      codec::decode_cuda(blob, e->info.bytes_stored, img->data(), e->info.bytes_in,
                         reinterpret_cast<cudaStream_t>(gp.stream), nullptr, dp);
      // The blob may be freed (on its allocation stream) before the decode on `stream` has run.
      if (e->mover == nullptr && gp.stream != e->stream) e->arena->record_stream(e->blob, gp.stream);
#else
      GACT_FAIL("activation_store::get: CUDA tensor but this build of gact has no CUDA kernels");
#endif
    }
  }
  bool hold = false;
  {
    std::lock_guard lock(mu_);
    for (counters* k : {c_.get(), owner_counters(e->owner)}) {
      if (k == nullptr) continue;
      ++k->decodes;
      k->decode_bytes += e->info.bytes_in;
    }
    hold = !gp.predicate && e->info.refcount > 1;
  }
  if (hold && e->held == nullptr) {
    std::uint64_t const b = e->info.bytes_in;
    if (held_bytes_.fetch_add(b, std::memory_order_relaxed) + b <= k_held_cap) {
      e->held = std::make_unique<entry::held_image>(img, &held_bytes_, b);
    } else {
      held_bytes_.fetch_sub(b, std::memory_order_relaxed);  // over the cap: decoded again by the next reader
    }
  }
  std::erase_if(e->cache, [](entry::cache_slot const& s) { return s.image.expired(); });
  e->cache.push_back({gp.predicate, gp.true_value, gp.false_value, img});
  return img;
}

void activation_store::get(handle h, void* dst, std::size_t dst_bytes, get_params const& gp) const {
  std::shared_ptr<entry> e = find(h);
  GACT_EXPECTS(dst_bytes == e->info.bytes_in,
               "activation_store::get: destination holds " + std::to_string(dst_bytes) +
                   " bytes, the tensor needs " + std::to_string(e->info.bytes_in));
  if (dst_bytes == 0) return;
  GACT_EXPECTS(dst != nullptr, "activation_store::get: null destination");
  auto img = decode_image(e, gp);
  if (e->info.device < 0) {
    std::memcpy(dst, img->data(), dst_bytes);
  } else {
#if defined(GACT_HAVE_KERNELS)
    cudaError_t const err = cudaMemcpyAsync(dst, img->data(), dst_bytes, cudaMemcpyDeviceToDevice,
                                            reinterpret_cast<cudaStream_t>(gp.stream));
    GACT_EXPECTS(err == cudaSuccess, std::string("activation_store::get: cudaMemcpyAsync: ") + cudaGetErrorName(err),
                 ::gact::cuda_error);
    if (gp.stream != e->stream) e->arena->record_stream(img->data(), gp.stream);
#endif
  }
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
    entry& e = *it->second;
    counters* const oc = owner_counters(e.owner);
    ++c_->releases;
    if (oc != nullptr) ++oc->releases;
    if (--e.info.refcount > 0) return static_cast<std::int64_t>(e.info.refcount);
    if (e.has_identity) {
      auto d = by_storage_.find(e.skey);
      if (d != by_storage_.end()) {
        std::erase(d->second, h);
        if (d->second.empty()) by_storage_.erase(d);
      }
    }
    for (counters* k : {c_.get(), oc}) {
      if (k == nullptr) continue;
      k->current_stored -= std::min<std::uint64_t>(k->current_stored, e.info.bytes_stored);
      k->current_in -= std::min<std::uint64_t>(k->current_in, e.info.bytes_in);
    }
    trace_store_event(alloc::event_trace::event_kind::store_release, e);
    dead = std::move(it->second);
    entries_.erase(it);
  }
  return 0;
}

codec::verdict_ring* activation_store::verdict_ring_for(int device) const {
  GACT_EXPECTS(device >= 0 && device < 64, "activation_store: device " + std::to_string(device) + " out of range");
  std::lock_guard lock(rings_mu_);
  auto& r = rings_[std::size_t(device)];
#if defined(GACT_HAVE_KERNELS)
  if (r == nullptr) {
    {
      device::device_guard const g(device);  // the ring's memory on the blob's device
      r = codec::verdict_ring::create_device();
    }
    // every slot in flight for seconds: the device is far behind or stuck; synchronizing it answers them
    r->stall = [device] {
      try {
        device::device_guard const g(device);
        (void)cudaDeviceSynchronize();
      } catch (std::exception const& e) {
        GACT_WARN_CAPPED(4, "activation_store: cannot wait for device {}: {}", device, e.what());
      }
    };
  }
#endif
  return r.get();
}

int activation_store::verdict(handle h, bool wait) {
  std::shared_ptr<entry> e;
  {
    std::lock_guard lock(mu_);
    e = lookup(h, "activation_store::verdict");
  }
  std::unique_lock elock(e->mu);
  if (e->ring == nullptr) return e->bad ? 1 : 0;
  codec::verdict_ring* const ring = e->ring;
  codec::verdict_ring::ticket const t = e->ticket;
  codec::verdict_state v = ring->poll(t);
  if (v == codec::verdict_state::pending && wait) {
    elock.unlock();
    {
      std::lock_guard lock(mu_);
      for (counters* k : {c_.get(), owner_counters(e->owner)})
        if (k != nullptr) ++k->verdict_waits;
    }
    v = ring->wait(t, std::chrono::seconds(5));
#if defined(GACT_HAVE_KERNELS)
    if (v == codec::verdict_state::pending) {
      (void)cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(e->stream));
      v = ring->wait(t, std::chrono::milliseconds(100));
    }
#endif
    elock.lock();
    if (e->ring != ring || e->ticket.seq != t.seq || v == codec::verdict_state::released)
      return e->bad ? 1 : 0;  // answered meanwhile, by another caller
    if (v == codec::verdict_state::pending) {
      GACT_WARN_CAPPED(4, "activation_store::verdict: the device encode of handle {} never reported; its tensor is "
                          "kept exact", h);
      v = codec::verdict_state::bad;
    }
  }
  if (v == codec::verdict_state::pending) return -1;
  e->bad = v == codec::verdict_state::bad;
  ring->release(t);
  e->ring = nullptr;
  e->ticket = {};
  if (e->bad) {
    elock.unlock();
    std::lock_guard lock(mu_);
    for (counters* k : {c_.get(), owner_counters(e->owner)})
      if (k != nullptr) ++k->device_nonfinite;
  }
  return e->bad ? 1 : 0;
}

void activation_store::forget(handle h) noexcept {
  std::lock_guard lock(mu_);
  auto it = entries_.find(h);
  if (it == entries_.end()) return;
  entry& e = *it->second;
  if (!e.has_identity) return;
  auto d = by_storage_.find(e.skey);
  if (d != by_storage_.end()) {
    std::erase(d->second, h);
    if (d->second.empty()) by_storage_.erase(d);
  }
  e.has_identity = false;
}

void activation_store::forget_storage(std::uintptr_t storage, owner_id owner) noexcept {
  std::lock_guard lock(mu_);
  try {
    unversioned_.emplace(storage, owner);
  } catch (...) {  // no memory for the note: the entries below still lose their identity
  }
  for (auto it = by_storage_.begin(); it != by_storage_.end();) {
    if (it->first.storage == storage) {
      for (handle h : it->second) {
        auto e = entries_.find(h);
        if (e != entries_.end()) e->second->has_identity = false;
      }
      it = by_storage_.erase(it);
    } else {
      ++it;
    }
  }
}

tensor_info activation_store::info(handle h) const {
  std::shared_ptr<entry> e;
  {
    std::lock_guard lock(mu_);
    e = lookup(h, "activation_store::info");
  }
  std::lock_guard elock(e->mu);
  std::lock_guard lock(mu_);  // refcount is guarded by the table's lock
  return e->info;
}

std::span<std::byte> activation_store::debug_blob(handle h) {
  std::shared_ptr<entry> e;
  {
    std::lock_guard lock(mu_);
    e = lookup(h, "activation_store::debug_blob");
  }
  std::lock_guard elock(e->mu);
  GACT_EXPECTS(e->info.device < 0 && e->mover == nullptr && e->blob != nullptr,
               "activation_store::debug_blob: handle " + std::to_string(h) + " has no blob in host memory");
  return {static_cast<std::byte*>(e->blob), e->info.bytes_stored};
}

// ---- accounting ------------------------------------------------------------------------

void activation_store::note_skip(skip_reason r, std::size_t bytes, owner_id owner) noexcept {
  auto const i = static_cast<std::size_t>(r);
  if (i >= c_->skipped.size()) return;
  std::lock_guard lock(mu_);
  for (counters* k : {c_.get(), owner_counters(owner)}) {
    if (k == nullptr) continue;
    ++k->skipped[i].tensors;
    k->skipped[i].bytes += bytes;
  }
}

void activation_store::note_unstored(unstored u, std::size_t bytes, owner_id owner) noexcept {
  auto const i = static_cast<std::size_t>(u);
  if (i >= c_->unstored_.size()) return;
  std::lock_guard lock(mu_);
  for (counters* k : {c_.get(), owner_counters(owner)}) {
    if (k == nullptr) continue;
    ++k->unstored_[i].tensors;
    k->unstored_[i].bytes += bytes;
  }
}

owner_id activation_store::new_owner() {
  std::lock_guard lock(mu_);
  GACT_EXPECTS(next_owner_ != 0, "activation_store::new_owner: every owner id is taken");
  owner_id const o = next_owner_++;
  owners_.emplace(o, std::make_unique<counters>());
  return o;
}

void activation_store::drop_owner(owner_id owner) noexcept {
  std::lock_guard lock(mu_);
  owners_.erase(owner);
  std::erase_if(unversioned_, [&](auto const& u) { return u.second == owner; });  // its steps are over
}

activation_store::counters* activation_store::owner_counters(owner_id o) const {
  if (o == 0) return nullptr;
  auto it = owners_.find(o);
  return it == owners_.end() ? nullptr : it->second.get();
}

void activation_store::begin_step(std::uint64_t step, owner_id owner) noexcept {
  {
    std::lock_guard lock(mu_);
    step_ = step;
    if (counters* oc = owner_counters(owner)) oc->noise_step = step;
    if (owner == 0) {
      for (auto& [h, e] : entries_) e->has_identity = false;
      by_storage_.clear();
      unversioned_.clear();
    } else {
      std::erase_if(unversioned_, [&](auto const& u) { return u.second == owner; });
      // Only this owner's entries lose their identity: another owner's step is still open.
      for (auto it = by_storage_.begin(); it != by_storage_.end();) {
        std::erase_if(it->second, [&](handle h) {
          auto e = entries_.find(h);
          if (e == entries_.end() || e->second->owner != owner) return false;
          e->second->has_identity = false;
          return true;
        });
        it = it->second.empty() ? by_storage_.erase(it) : std::next(it);
      }
    }
  }
  if (alloc::event_trace::enabled()) {
    try {
      alloc::event_trace::mark_step(step);  // may snapshot the stats document: no lock held here
    } catch (std::exception const& ex) {
      GACT_WARN_CAPPED(4, "activation_store: event trace snapshot at step {} failed: {}", step, ex.what());
    }
  }
}

std::size_t activation_store::end_step(owner_id owner, bool count_step) noexcept {
  std::lock_guard lock(mu_);
  std::size_t n = entries_.size();
  if (owner != 0) {
    n = 0;
    for (auto const& [h, e] : entries_) n += e->owner == owner ? 1 : 0;
  }
  for (counters* k : {c_.get(), owner_counters(owner)}) {
    if (k == nullptr) continue;
    k->leaks += n;
    if (!count_step) continue;
    k->leaks_last_step = n;
    ++k->steps;
    k->last_in = k->bytes_in - k->mark_in;
    k->last_encoded = k->bytes_encoded - k->mark_encoded;
    k->last_decoded = k->decode_bytes - k->mark_decoded;
    k->mark_in = k->bytes_in;
    k->mark_encoded = k->bytes_encoded;
    k->mark_decoded = k->decode_bytes;
  }
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

nlohmann::json activation_store::stats_json(owner_id owner) const {
  std::lock_guard lock(mu_);
  if (owner == 0) return counters_json(*c_, entries_.size(), 0);
  counters const* k = owner_counters(owner);
  GACT_EXPECTS(k != nullptr, "activation_store::stats_json: unknown owner " + std::to_string(owner));
  std::size_t live = 0;
  for (auto const& [h, e] : entries_) live += e->owner == owner ? 1 : 0;
  return counters_json(*k, live, owner);
}

nlohmann::json activation_store::counters_json(counters const& c, std::size_t live, owner_id owner) const {
  nlohmann::json j;
  if (owner != 0) j["owner"] = owner;
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
  nlohmann::json roles = nlohmann::json::object();
  for (std::size_t i = 0; i < c.roles.size(); ++i)
    roles[role_name(static_cast<role>(i))] = {{"tensors", c.roles[i].tensors}, {"bytes_in", c.roles[i].bytes}};
  j["roles"] = std::move(roles);
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
  nlohmann::json us = nlohmann::json::object();
  for (std::size_t i = 0; i < c.unstored_.size(); ++i)
    us[unstored_name(static_cast<unstored>(i))] = {{"tensors", c.unstored_[i].tensors}, {"bytes", c.unstored_[i].bytes}};
  j["unstored"] = std::move(us);
  j["dedup_hits"] = c.dedup_hits;
  j["dedup_bytes"] = c.dedup_bytes;
  j["view_hits"] = c.view_hits;
  j["upgrades"] = c.upgrades;
  j["boundary_blobs"] = c.boundary_blobs;  // a ReLU's (clamp's) output stored once for its mask and its values
  j["nonfinite_fallbacks"] = c.nonfinite_fallbacks;
  j["device_nonfinite"] = c.device_nonfinite;
  j["verdict_waits"] = c.verdict_waits;
  j["refusal_fallbacks"] = c.refusal_fallbacks;
  j["gathers"] = c.gathers;
  j["gets"] = c.gets;
  j["decodes"] = c.decodes;
  j["decode_bytes"] = c.decode_bytes;
  j["bytes_encoded"] = c.bytes_encoded;
  // one step's traffic beside what it saved: encoded == stored means each tensor was encoded once
  j["last_step"] = {{"bytes_in", c.last_in}, {"bytes_encoded", c.last_encoded}, {"bytes_decoded", c.last_decoded}};
  j["releases"] = c.releases;
  j["bad_releases"] = c.bad_releases;
  j["live_handles"] = live;
  j["bytes_in_current"] = c.current_in;
  j["bytes_stored_current"] = c.current_stored;
  j["bytes_stored_peak"] = c.peak_stored;
  j["leaks"] = c.leaks;
  j["leaks_last_step"] = c.leaks_last_step;
  j["steps"] = c.steps;
  j["step"] = step_;
  if (c.tensors_in == 0) {
    // Say why nothing was stored instead of a bare ratio of 0.
    std::string why = "nothing stored";
    if (sk_t > 0) {
      why += ": " + std::to_string(sk_t) + " saved tensor(s) kept as they are (";
      bool first = true;
      for (std::size_t i = 0; i < c.skipped.size(); ++i) {
        if (c.skipped[i].tensors == 0) continue;
        if (!first) why += ", ";
        first = false;
        why += std::string(skip_reason_name(static_cast<skip_reason>(i))) + " " + std::to_string(c.skipped[i].tensors);
      }
      why += ")";
    } else if (c.unstored_[0].tensors + c.unstored_[1].tensors == 0) {
      why += ": no saved tensor reached the store (is the code inside `with comp:`?)";
    }
    j["note"] = why;
  }
  return j;
}

void activation_store::reset_stats() noexcept {
  std::lock_guard lock(mu_);
  counters fresh;
  fresh.current_stored = c_->current_stored;
  fresh.current_in = c_->current_in;
  fresh.peak_stored = c_->current_stored;
  *c_ = fresh;
  for (auto& [o, k] : owners_) {
    counters f;
    f.current_stored = k->current_stored;
    f.current_in = k->current_in;
    f.peak_stored = k->current_stored;
    *k = f;
  }
}

}  // namespace gact::store
