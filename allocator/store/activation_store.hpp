// gact/allocator/store/activation_store.hpp
//
// The activation store: the hub the caching allocator exists for. Autograd's
// pack hook hands it a saved tensor (a raw view: pointer, dtype, shape, strides,
// device, version counter) and gets back an opaque handle; the unpack hook asks
// for the tensor back by handle and receives it decoded, contiguous, into a
// buffer it allocated; the handle is released when autograd drops the graph.
//
// What happens to a tensor on put():
//   float32/float16/bfloat16 -> quant codec at the requested bits (1/2/4/8), or raw
//                               for bits >= 16; a tensor holding NaN/Inf is stored
//                               raw and counted (`nonfinite_fallbacks`)
//   bool                     -> mask codec (1 bit per element)
//   uint8                    -> mask codec when every element is 0 or 1, raw otherwise
//   anything else            -> raw (the Python layer skips such tensors before put)
// Non-contiguous input is gathered into a contiguous workspace block (tag
// `workspace`) before encoding; get() always returns the contiguous tensor.
// Blobs live in a caching allocator's arena under the tag `activation`: the host
// arena for CPU tensors, the arena registered for a CUDA device for tensors on it.
//
// Dedup: a tensor saved more than once in a step (same data pointer, device,
// dtype, shape, strides and version counter) is stored once; its handle is
// reference counted and each put() must be matched by a release(). The caller
// calls forget() when the saved tensor object dies, so that a new tensor placed
// at the same address can never be mistaken for the stored one.
//
// Per-step accounting: begin_step()/end_step() bracket one training iteration;
// handles still alive at end_step() are counted as leaks (they stay valid).
//
// Thread-safe: one mutex guards the handle table and the counters; encoding and
// decoding run outside it (autograd runs backward on its own threads).
#pragma once

#include <nlohmann/json.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/backend.hpp"
#include "codecs/codec.hpp"

namespace gact::swap {
class mover;  // swap/mover.hpp
}

namespace gact::store {

/// Opaque handle of a stored tensor; 0 is never a valid handle.
using handle = std::uint64_t;

/// A strided tensor as the framework sees it. Strides are in elements; an empty
/// `strides` means contiguous (row-major).
struct tensor_view {
  void const* data = nullptr;           ///< address of element [0, ..., 0]
  codec::dtype dtype = codec::dtype::float32;
  std::vector<std::int64_t> shape;      ///< every extent >= 0
  std::vector<std::int64_t> strides;    ///< empty, or one stride (>= 0) per dimension
  int device = -1;                      ///< -1 = host memory, else the CUDA device index
  std::int64_t version = 0;             ///< the framework's version counter (in-place writes bump it)
};

/// How one tensor is to be encoded.
struct put_params {
  std::uint64_t key = 0;        ///< stable tensor key (saving module + order within the step)
  int bits = 4;                 ///< 1, 2, 4 or 8 for the quant codec; 16 or 32 = store raw
  int group_size = 256;         ///< elements per quantization group
  std::uint64_t seed = 0;       ///< user seed; mixed with the step and the key into the noise stream
  device::stream_t stream = 0;  ///< stream the tensor was produced on (CUDA only)
};

/// Why the framework kept a tensor out of the store (counted by note_skip()).
enum class skip_reason : std::uint8_t {
  parameter = 0,  ///< a parameter or a view of one
  small = 1,      ///< below the size threshold
  dtype = 2,      ///< a dtype gact does not compress (integers, float64, ...)
  excluded = 3,   ///< in a module or tensor the user excluded
  input = 4,      ///< a leaf that does not require grad (kept alive by the caller anyway)
  layout = 5,     ///< sparse, quantized or otherwise not a plain strided tensor
  device = 6,     ///< on a device this build cannot encode on
  stats = 7,      ///< a normalization layer's per-channel statistics (mean, 1/std): read exactly
  k_count = 8,
};

/// Stable name of a skip reason ("parameter", "small", ...).
char const* skip_reason_name(skip_reason r) noexcept;
/// Parse a skip reason name. @throws gact::invalid_argument for an unknown name (lists the accepted ones).
skip_reason parse_skip_reason(std::string const& name);

/// What the store knows about a live handle.
struct tensor_info {
  codec::dtype dtype = codec::dtype::float32;
  std::vector<std::int64_t> shape;
  int device = -1;
  codec::codec_id codec = codec::codec_id::raw;
  int bits = 0;                ///< bits per element as stored (quant: 1..8, mask: 1, raw: element bits)
  std::size_t bytes_in = 0;    ///< numel * element size
  std::size_t bytes_stored = 0;///< blob bytes
  std::uint32_t refcount = 0;
  std::uint64_t groups = 0;    ///< quant: quantization groups; 0 otherwise
  double sum_sq_ranges = 0.0;  ///< quant on the host: sum over groups of (max - min)^2, the
                               ///< encoder-side input of the policy's online sensitivity; 0 otherwise
};

/// Settings of a store.
struct store_options {
  int threads = 0;             ///< CPU encode/decode threads (0 = the codec's default)
  std::string stats_name = "store";  ///< stats provider section; empty = do not register
};

class activation_store {
 public:
  /// @param host_arena caching allocator over host memory for CPU tensors; must outlive the store.
  /// @throws gact::invalid_argument when host_arena's backend is not host memory.
  explicit activation_store(alloc::caching_allocator& host_arena, store_options opts = {});
  /// Frees every blob still stored (counted as leaks in the log) and unregisters the stats provider.
  ~activation_store();
  activation_store(activation_store const&) = delete;
  activation_store& operator=(activation_store const&) = delete;

  /// Register the arena used for tensors on CUDA device `device` (nullptr unregisters).
  /// The arena must outlive the store or be unregistered first.
  /// @throws gact::invalid_argument for a negative device or a non-device arena.
  void set_device_arena(int device, alloc::caching_allocator* arena);

  /// Hand the blobs of later puts on device `device` (-1 = host tensors) to swap mover `m`, which
  /// offloads them to pinned host memory and brings them back for get(); nullptr stops swapping
  /// (blobs already handed over stay with their mover). The mover must outlive every entry it holds.
  /// @throws gact::invalid_argument for a device out of range or a mover over another arena.
  void set_mover(int device, swap::mover* m);

  /// Store `v` (encoded as described at the top of this file) and return its handle.
  /// A dedup hit returns the existing handle with its reference count raised.
  /// @throws gact::invalid_argument for a malformed view (null data with numel > 0, negative
  ///         extents, strides of the wrong rank, bad bits or group size, a CUDA tensor in a build
  ///         without kernels or without an arena for its device).
  /// @throws gact::out_of_memory when the arena cannot hold the blob.
  handle put(tensor_view const& v, put_params const& p);

  /// Decode handle `h` into `dst` (contiguous, `dst_bytes` = numel * element size), on `stream`
  /// for a CUDA tensor. The handle stays valid (retain_graph can ask twice).
  /// @throws gact::invalid_argument for an unknown handle or a wrong dst_bytes.
  /// @throws gact::corrupt_blob if the stored blob fails validation.
  void get(handle h, void* dst, std::size_t dst_bytes, device::stream_t stream = 0) const;

  /// Drop one reference to `h`; the blob is freed when the last one goes.
  /// @returns the references left (0: the blob was freed), or -1 (counted as a bad release)
  ///          for an unknown handle.
  std::int64_t release(handle h) noexcept;

  /// The saved tensor behind `h` died: later puts must not dedup against it. Unknown handles are ignored.
  void forget(handle h) noexcept;

  /// Facts about a live handle. @throws gact::invalid_argument for an unknown handle.
  tensor_info info(handle h) const;

  /// Count a tensor kept out of the store.
  void note_skip(skip_reason r, std::size_t bytes) noexcept;

  /// Start step `step` (clears the dedup identities of the previous step).
  void begin_step(std::uint64_t step) noexcept;
  /// End the current step: handles still alive are counted as leaks. @returns their number.
  std::size_t end_step() noexcept;

  /// Number of live handles.
  std::size_t live_handles() const noexcept;
  /// Blob bytes currently stored.
  std::size_t stored_bytes() const noexcept;

  /// The "store" section of the stats document (see stats_json in the .cpp for the keys).
  nlohmann::json stats_json() const;
  /// Zero the accumulated counters and set peaks to current values.
  void reset_stats() noexcept;

 private:
  struct entry;
  struct identity;
  struct identity_hash {
    std::size_t operator()(identity const& id) const noexcept;
  };
  struct counters;

  alloc::caching_allocator& arena_for(int device) const;
  std::shared_ptr<entry> find(handle h) const;

  alloc::caching_allocator& host_arena_;
  store_options opts_;
  std::array<alloc::caching_allocator*, 64> device_arenas_{};
  std::array<swap::mover*, 65> movers_{};  // index device + 1 (0 = host tensors)
  std::uint64_t stats_token_ = 0;

  mutable std::mutex mu_;
  std::unordered_map<handle, std::shared_ptr<entry>> entries_;
  std::unordered_map<identity, handle, identity_hash> dedup_;
  handle next_handle_ = 1;
  std::uint64_t step_ = 0;
  std::unique_ptr<counters> c_;
};

/// Bytes of one element of `t`.
std::size_t element_size(codec::dtype t) noexcept;
/// Stable name of a dtype, as torch spells it without the prefix ("float32", "bfloat16", "bool", ...).
char const* dtype_name(codec::dtype t) noexcept;
/// Parse a dtype name (also accepts "torch.float32" and "float"/"half"/"double"/"long"/"int").
/// @throws gact::invalid_argument naming the bad value and the accepted ones.
codec::dtype parse_dtype(std::string const& name);

}  // namespace gact::store
