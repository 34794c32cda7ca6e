// gact/allocator/store/activation_store.hpp
//
// The activation store: the hub the caching allocator exists for. Autograd's
// pack hook hands it a saved tensor (a raw view: pointer, dtype, shape, strides,
// device, version counter, the storage it lives in) and what the tensor's reader
// needs (its role), and gets back an opaque handle; the unpack hook asks for the
// tensor back and receives a decoded buffer shared by every reader of the blob;
// the handle is released when autograd drops the graph.
//
// What is stored, by role:
//   values     float32/16/bf16/64 -> quant at the requested bits (1/2/4/8; the
//              normalized variant when statistics are given), raw for bits >= 16;
//              a tensor holding NaN/Inf is stored raw and counted
//              (`nonfinite_fallbacks`), and so is float64 outside float32's normal
//              range (CPU; float64 on a device is stored raw); bool -> mask; uint8 -> mask when 0/1, raw
//              otherwise; anything else raw
//   predicate  a float tensor -> a 1-bit predicate mask (codecs/format.hpp); a
//              two-level `ne` tensor whose nonzero values differ is stored as values
//   indices    int64/int32 max-pool indices -> the window codec, raw when refused
//
// Layout: a view that is non-overlapping and dense (contiguous, channels-last,
// transposed, ...) is encoded as the memory image of its span, with no gather,
// and decodes to the same strides; any other view is gathered into a workspace
// block in the order of its dense strides (the strides torch's empty_like would
// give it) and decodes to those. tensor_info::strides gives the decoded layout.
// Blobs live in a caching allocator's arena under the tag `activation`, decoded
// images under the tag `decoded`: the host arena for CPU tensors, the arena
// registered for a CUDA device for tensors on it.
//
// One blob per storage: within a step, a put whose view lies inside the span of
// a dense entry of the same storage, dtype and version counter is served by that
// entry (a view saved by another op, such as a loss's `output.view(-1, V)`), when
// the entry holds what the role needs, belongs to the same owner and, for values,
// has at least the bits the put's reader tolerates (`min_bits`: a log-space save
// raised to 4 bits gets a blob of its own beside a 2-bit one); the result gives the view's offset in the
// decoded image. A predicate entry of a clamp's output (a ReLU's: x > 0 on x >= 0)
// asked for values is upgraded in place to a boundary quant blob, which serves
// both. Handles are reference counted; each put() must be matched by a release().
// The caller calls forget() when the saved tensor object dies, so that a new
// tensor placed at the same address can never be mistaken for the stored one.
//
// Decoding: get_shared() decodes a handle at most once while the decoded image is
// alive; every reader shares it (the Python layer hands it to torch through
// DLPack, so the memory comes from gact's warm pool and returns to it).
//
// Per-step accounting: begin_step()/end_step() bracket one training iteration;
// handles still alive at end_step() are counted as leaks (they stay valid).
//
// Thread-safe: one mutex guards the handle table and the counters; each entry
// has its own mutex for its blob (decode, upgrade); encoding and decoding run
// outside the table's lock (autograd runs backward on its own threads).
#pragma once

#include <nlohmann/json.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/backend.hpp"
#include "allocator/store/offloader.hpp"
#include "codecs/codec.hpp"
#include "codecs/verdict.hpp"

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
  /// Address of the storage the view lives in (views of one storage share it); 0 = unknown (the
  /// view's own address stands for it, so only the same view dedups).
  std::uintptr_t storage = 0;
};

/// What the reader of a saved tensor needs, hence how it is stored.
enum class role : std::uint8_t { values = 0, predicate = 1, indices = 2 };
/// Stable name of a role ("values", "predicate", "indices").
char const* role_name(role r) noexcept;

/// How one tensor is to be encoded.
/// A client of the store (a Compressor): its own counters and steps. 0 = the store as a whole.
using owner_id = std::uint32_t;

struct put_params {
  std::uint64_t key = 0;        ///< stable tensor key (saving module + order within the step)
  int bits = 4;                 ///< values: 1, 2, 4 or 8 for the quant codec; 16 or 32 = store raw
  int group_size = 256;         ///< elements per quantization group
  std::uint64_t seed = 0;       ///< user seed; mixed with the step and the key into the noise stream
  device::stream_t stream = 0;  ///< stream the tensor was produced on (CUDA only)
  role what = role::values;
  int threads = 0;              ///< CPU encode threads (0 = the store's setting)
  /// values, float input: normalize with per-block statistics (element e of the view's memory image
  /// uses block (e / norm_inner) % norm_count); host pointers for CPU tensors, device pointers for
  /// CUDA ones. norm_count == 0: plain quantization.
  std::uint64_t norm_count = 0;
  std::uint64_t norm_inner = 1;
  float const* norm_shift = nullptr;
  float const* norm_scale = nullptr;
  /// predicate: what the reader tests.
  codec::predicate_params pred{};
  /// predicate on a CUDA tensor: the tensor is known to be the output of a clamp to the predicate's
  /// range (a ReLU's result), so it may later be upgraded to a boundary blob (the CPU encoder checks
  /// this itself).
  bool clamped = false;
  /// values, float input, with `pred` an upgradable predicate (x > lo, lo < x < hi) the tensor is known to
  /// satisfy at its boundaries (a ReLU's or clamp's output, unchanged since): encode one boundary blob that
  /// also serves that predicate, so that the op's own predicate save (made after this one) is a dedup hit
  /// instead of a mask encoded first and upgraded later. A refused boundary encode (a value outside the
  /// range, on the CPU) stores plain values.
  bool boundary = false;
  /// indices: the pooling geometry (codecs/format.hpp window_params); `inner` must describe the view's
  /// memory image.
  codec::window_params window{};
  /// who stores it (new_owner(): one per Compressor); 0 = nobody in particular. Counted in that
  /// owner's statistics beside the store's, and its end_step() counts its own handles only.
  owner_id owner = 0;
  /// values: the fewest bits the reader tolerates (a log-space input's 4, an attention score's 8), as
  /// opposed to `bits`, the width chosen for this save: an earlier quantized blob of the same storage
  /// serves it only with at least these bits; 0 = any.
  int min_bits = 0;
  /// values: which blobs of the storage serve it, and which later saves it serves: 0, the storage's common
  /// ones; another value, only those put with the same group. A call whose reader multiplies a save with a
  /// gradient computed from another read of the same values (`p * log(p)` over a softmax's result, which the
  /// softmax saved too) stores its saves in a group of its own: one rounding read twice in one product is
  /// biased by its variance; the call's own saves of the memory (`p * p`) still share one blob.
  std::uint64_t group = 0;
};

/// What put() returns.
struct put_result {
  handle h = 0;
  std::int64_t offset = 0;  ///< element offset of the view's element [0, ..., 0] in the decoded image
  bool shared = false;      ///< served by an entry stored earlier (no new blob)
  bool upgraded = false;    ///< ... a predicate entry this put turned into a values blob (its bytes are this put's)
  /// Strides (elements) of the view in the decoded image: a view served by a dense entry (whose image is
  /// its storage span) keeps its own storage strides, whatever it is (strided, transposed, diagonal,
  /// overlapping, expanded); a gathered view has the dense strides it was gathered in.
  std::vector<std::int64_t> strides;
};

/// Why the framework kept a tensor out of the store (counted by note_skip()).
enum class skip_reason : std::uint8_t {
  parameter = 0,  ///< a parameter or a view of one
  small = 1,      ///< below the size threshold
  dtype = 2,      ///< a dtype gact does not compress (integers other than pooling indices, ...)
  excluded = 3,   ///< in a module or tensor the user excluded
  input = 4,      ///< a leaf that does not require grad (kept alive by the caller anyway)
  layout = 5,     ///< sparse, quantized or otherwise not a plain strided tensor
  device = 6,     ///< on a device this build cannot encode on
  stats = 7,      ///< a normalization layer's per-channel statistics (mean, 1/std): read exactly
  exact = 8,      ///< read by an op whose gradient is discontinuous in it (equality with a reduction, sign with zero)
  memory = 9,     ///< the arena could not hold its blob (out of memory): kept as it is, training goes on
  k_count = 10,
};

/// Stable name of a skip reason ("parameter", "small", ...).
char const* skip_reason_name(skip_reason r) noexcept;
/// Parse a skip reason name. @throws gact::invalid_argument for an unknown name (lists the accepted ones).
skip_reason parse_skip_reason(std::string const& name);

/// Saved tensors that needed no blob (counted by note_unstored()).
enum class unstored : std::uint8_t {
  shape = 0,  ///< the reader uses only the tensor's shape (a pooling input, a loss's log-probabilities)
  held = 1,   ///< the program still held the tensor, unchanged, when backward read it: used as it is
  k_count = 2,
};
char const* unstored_name(unstored u) noexcept;
unstored parse_unstored(std::string const& name);

/// What the store knows about a live handle.
struct tensor_info {
  codec::dtype dtype = codec::dtype::float32;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;  ///< of the decoded image (dense): the saved view's own when it was dense
  int device = -1;
  codec::codec_id codec = codec::codec_id::raw;
  std::uint8_t variant = 0;    ///< the codec's variant (codecs/format.hpp)
  int bits = 0;                ///< bits per element as stored (quant, window: 1..8; mask: 1; raw: element bits)
  std::size_t bytes_in = 0;    ///< numel * element size
  std::size_t bytes_stored = 0;///< blob bytes
  std::uint32_t refcount = 0;
  std::uint64_t groups = 0;    ///< quant: quantization groups; 0 otherwise
  double sum_sq_ranges = 0.0;  ///< quant on the host: sum over groups of (max - min)^2, the
                               ///< encoder-side input of the policy's online sensitivity; 0 otherwise
  bool values = false;         ///< decodes to the values (lossy or exact)
  bool predicate = false;      ///< decodes to a predicate mask (pred holds it)
  codec::predicate_params pred{};
};

/// How to decode (get_shared / get).
struct get_params {
  bool predicate = false;      ///< decode the entry's predicate (true_value / false_value) instead of its values
  float true_value = 1.0f;
  float false_value = 0.0f;
  device::stream_t stream = 0; ///< CUDA: the stream the reader runs on
  int threads = 0;             ///< CPU decode threads (0 = the store's setting)
};

/// A decoded image, shared by every reader of one entry; its memory returns to the arena when the last
/// reference goes (the Python layer holds one per torch tensor made from it).
class decoded_image {
 public:
  decoded_image(alloc::caching_allocator& arena, std::size_t bytes, device::stream_t stream, alloc::tag_id tag);
  ~decoded_image();
  decoded_image(decoded_image const&) = delete;
  decoded_image& operator=(decoded_image const&) = delete;
  void* data() const noexcept { return data_; }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  alloc::caching_allocator* arena_;
  void* data_;
  std::size_t bytes_;
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

  /// Hand the blobs of later puts on device `device` (-1 = host tensors) to offloader `m`, which
  /// keeps them (e.g. in pinned host memory) and brings them back for get(); nullptr stops
  /// offloading (blobs already handed over stay with theirs). The offloader must outlive every entry it holds.
  /// @throws gact::invalid_argument for a device out of range or an offloader over another arena.
  void set_mover(int device, offloader* m);

  /// Store `v` for a reader with role `p.what` (see the top of this file) and return its handle.
  /// A hit against an entry of the same storage returns that entry's handle with its reference count raised.
  /// @throws gact::invalid_argument for a malformed view (null data with numel > 0, negative
  ///         extents, strides of the wrong rank, bad bits or group size, bad role parameters, a CUDA
  ///         tensor in a build without kernels or without an arena for its device).
  /// @throws gact::out_of_memory when the arena cannot hold the blob.
  put_result put(tensor_view const& v, put_params const& p);

  /// The decoded image of handle `h` (values, or the predicate when gp.predicate), decoded now unless an
  /// image decoded the same way is still alive. Its layout is tensor_info::strides over info.shape.
  /// @throws gact::invalid_argument for an unknown handle, or a predicate asked of an entry without one.
  /// @throws gact::corrupt_blob if the stored blob fails validation.
  /// @throws gact::out_of_memory when the arena cannot hold the image.
  std::shared_ptr<decoded_image const> get_shared(handle h, get_params const& gp = {}) const;

  /// Decode handle `h` into `dst` (`dst_bytes` = numel * element size): the dense image, laid out as
  /// tensor_info::strides says. The handle stays valid (retain_graph can ask twice).
  /// @throws as get_shared, and gact::invalid_argument for a wrong dst_bytes.
  void get(handle h, void* dst, std::size_t dst_bytes, get_params const& gp = {}) const;

  /// Drop one reference to `h`; the blob is freed when the last one goes.
  /// @returns the references left (0: the blob was freed), or -1 (counted as a bad release)
  ///          for an unknown handle.
  std::int64_t release(handle h) noexcept;

  /// The saved tensor behind `h` died: later puts must not dedup against it. Unknown handles are ignored.
  void forget(handle h) noexcept;

  /// The contents of `storage` may change without its version counter moving (the framework handed out
  /// an alias with a counter of its own, as torch's `.data` does): its live entries lose their identity,
  /// and until `owner`'s next begin_step() or drop_owner() (owner 0: any owner's puts, until a
  /// begin_step() of owner 0), `owner`'s puts of views of it neither are served by an entry nor serve
  /// later puts, so each of its saves gets a blob of what the storage holds then. Another owner's puts
  /// are not affected (the note may outlive the storage, whose address a new one can take).
  void forget_storage(std::uintptr_t storage, owner_id owner = 0) noexcept;

  /// Whether the device encode of `h` met a value it could not quantize (NaN/±Inf; in a boundary blob a
  /// value outside its range; bad normalization statistics): such groups are stored as the non-finite
  /// marker and decode to NaN, so the caller should keep its tensor exact instead. The device tells
  /// through mapped memory once the encode has run, with no host synchronization (codecs/verdict.hpp).
  /// @returns -1 while the encode has not run (with `wait`: only if it has not run within a few seconds
  ///          and after a synchronization of its stream, which does not happen with a working device),
  ///          1 if it met such a value, 0 otherwise (host entries, and device blobs of other codecs: 0).
  ///          Counted: `device_nonfinite` (answers 1), `verdict_waits` (a wait that found the encode not run).
  /// @throws gact::invalid_argument for an unknown handle.
  int verdict(handle h, bool wait = false);

  /// Facts about a live handle. @throws gact::invalid_argument for an unknown handle.
  tensor_info info(handle h) const;

  /// Fault injection for tests: the bytes of a live handle's blob in host memory, to corrupt them.
  /// @throws gact::invalid_argument for an unknown handle, a CUDA blob or one handed to an offloader.
  std::span<std::byte> debug_blob(handle h);

  /// Count a tensor kept out of the store (also in `owner`'s counters).
  void note_skip(skip_reason r, std::size_t bytes, owner_id owner = 0) noexcept;
  /// Count a saved tensor that needed no blob (also in `owner`'s counters).
  void note_unstored(unstored u, std::size_t bytes, owner_id owner = 0) noexcept;

  /// A new owner with counters of its own (stats_json(owner)); never 0.
  /// @throws gact::invalid_argument after 2^32 - 1 owners.
  owner_id new_owner();
  /// Drop `owner`'s counters (its live entries stay, counted by the store only). Unknown owners are ignored.
  void drop_owner(owner_id owner) noexcept;

  /// Start step `step` of `owner` (0: everyone): clears the dedup identities of its entries.
  void begin_step(std::uint64_t step, owner_id owner = 0) noexcept;
  /// End the current step of `owner` (0: everyone): its handles still alive are counted as leaks,
  /// in its counters and the store's. @returns their number. `count_step` false: a pass that is
  /// not a training step (an estimator's extra forward and backward): leaks are counted, but
  /// neither `steps` nor `leaks_last_step` moves.
  std::size_t end_step(owner_id owner = 0, bool count_step = true) noexcept;

  /// Number of live handles.
  std::size_t live_handles() const noexcept;
  /// Blob bytes currently stored.
  std::size_t stored_bytes() const noexcept;

  /// The "store" section of the stats document (see stats_json in the .cpp for the keys); with an
  /// owner, the same keys counting only that owner's tensors and steps.
  /// @throws gact::invalid_argument for an unknown owner.
  nlohmann::json stats_json(owner_id owner = 0) const;
  /// Zero the accumulated counters and set peaks to current values.
  void reset_stats() noexcept;

 private:
  struct entry;
  struct storage_key;
  struct storage_key_hash {
    std::size_t operator()(storage_key const& k) const noexcept;
  };
  struct counters;
  struct encoded;

  alloc::caching_allocator& arena_for(int device) const;
  /// The live entry of `h` (a get: counted); lookup needs mu_ held and counts nothing.
  /// @throws gact::invalid_argument naming `who` for an unknown handle.
  std::shared_ptr<entry> find(handle h) const;
  std::shared_ptr<entry> lookup(handle h, char const* who) const;
  std::shared_ptr<decoded_image const> decode_image(std::shared_ptr<entry> const& e, get_params const& gp) const;
  encoded encode(tensor_view const& v, put_params const& p, role what, void const* src, std::uint64_t numel,
                 std::uint64_t step, alloc::caching_allocator& arena) const;
  void offload(entry& e);
  counters* owner_counters(owner_id o) const;  // requires mu_; nullptr for 0 or an unknown owner
  nlohmann::json counters_json(counters const& c, std::size_t live, owner_id owner) const;

  alloc::caching_allocator& host_arena_;
  store_options opts_;
  std::array<alloc::caching_allocator*, 64> device_arenas_{};
  std::array<offloader*, 65> movers_{};  // index device + 1 (0 = host tensors)
  std::uint64_t stats_token_ = 0;
  alloc::tag_id decoded_tag_;

  // (declared before entries_, whose tickets they outlive)
  mutable std::mutex rings_mu_;
  mutable std::array<std::unique_ptr<codec::verdict_ring>, 64> rings_{};
  mutable std::mutex mu_;
  /// Bytes of decoded images entries keep for their next reader (entry::held_image), and the most they keep.
  mutable std::atomic<std::uint64_t> held_bytes_{0};
  static constexpr std::uint64_t k_held_cap = std::uint64_t(256) << 20;
  std::unordered_map<handle, std::shared_ptr<entry>> entries_;
  std::unordered_map<storage_key, std::vector<handle>, storage_key_hash> by_storage_;
  std::set<std::pair<std::uintptr_t, owner_id>> unversioned_;  // forget_storage(): (storage, who said so)
  handle next_handle_ = 1;
  std::uint64_t step_ = 0;
  std::unique_ptr<counters> c_;
  std::unordered_map<owner_id, std::unique_ptr<counters>> owners_;
  /// Per device: the slots through which device encodes report (created on a device's first quant put).
  codec::verdict_ring* verdict_ring_for(int device) const;
  owner_id next_owner_ = 1;
};

/// Bytes of one element of `t`.
std::size_t element_size(codec::dtype t) noexcept;
/// Stable name of a dtype, as torch spells it without the prefix ("float32", "bfloat16", "bool", ...).
char const* dtype_name(codec::dtype t) noexcept;
/// Parse a dtype name (also accepts "torch.float32" and "float"/"half"/"double"/"long"/"int").
/// @throws gact::invalid_argument naming the bad value and the accepted ones.
codec::dtype parse_dtype(std::string const& name);

/// The strides of the dense layout a view decodes to: its own when it is non-overlapping and dense,
/// otherwise row-major in the order of its strides (largest first; ties keep the dim order), as
/// torch's empty_like gives it. Size-1 dims keep their stride when the view is dense.
std::vector<std::int64_t> dense_strides(std::vector<std::int64_t> const& shape, std::vector<std::int64_t> const& strides);
/// Whether a view with these strides is non-overlapping and dense (its elements fill a span exactly).
bool is_dense(std::vector<std::int64_t> const& shape, std::vector<std::int64_t> const& strides);

}  // namespace gact::store
