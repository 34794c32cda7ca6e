// gact/codecs/codec.hpp
//
// The public interface of gact's codecs: compress a contiguous tensor (or the
// dense memory image of a strided one) into a self-describing blob and back.
//
//   quant   per-group (G = 64..1024 elements) min/max quantization to 1/2/4/8 bits
//           with unbiased stochastic rounding (Philox4x32-10 noise keyed by seed
//           and tensor key); float32/float16/bfloat16/float64 in, the same dtype out.
//           Variants: plain; normalized (per-block shift/scale applied in the same
//           pass, for normalization-layer inputs); boundary (codes 0 and 2^b-1 reserved
//           for exact boundary values, so a ReLU's mask is read from the codes)
//   mask    lossless 1 bit per element: bool and 0/1 uint8 tensors, or a predicate
//           evaluated on a float tensor in the encode pass (no bool temporary)
//   window  lossless max-pool indices as offsets inside their pooling window
//   raw     lossless pass-through for any dtype
//
// Sizes: blob_size() is the one size function; the encoders write exactly that
// many bytes and the decoders accept a buffer at least that long. The format is
// in codecs/format.hpp and codecs/README.md; the math in codecs/quant_math.hpp
// and codecs/mask_math.hpp, shared by the CPU executor (encode_cpu/decode_cpu) and
// the CUDA executor (encode_cuda/decode_cuda), which produce identical blobs bit
// for bit.
//
// Statistics: the first encode or decode registers the provider "codecs" in the
// stats registry (allocator/stats_registry.hpp); stats_json() returns the same.
#pragma once

#include "codecs/format.hpp"
#include "codecs/quant_job.hpp"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#if defined(GACT_HAVE_KERNELS) && GACT_HAVE_KERNELS
#include <cuda_runtime_api.h>
#endif

namespace gact::codec {

/// Bytes per element of `dt` (0 for an out-of-range value).
std::size_t dtype_size(dtype dt) noexcept;
/// Lower-case name of `dt` ("float32", "bool", ...; "invalid" for an out-of-range value).
char const* dtype_name(dtype dt) noexcept;
/// Name of a codec ("raw", "quant", "mask", "window"; "invalid" otherwise).
char const* codec_name(codec_id c) noexcept;
/// Name of a codec's variant ("plain", "normalized", "boundary" for quant; "bytes", "predicate" for
/// mask; "" for raw and window).
char const* variant_name(codec_id c, std::uint8_t variant) noexcept;
/// Name of a predicate ("gt", "ge", "lt", "le", "open", "closed", "ne"; "invalid" otherwise).
char const* predicate_name(predicate p) noexcept;

/// The largest magnitude the activation store lets a plain or normalized quant group hold (2^15,
/// encode_params::max_magnitude): beyond it the group holds a mask's fill (torch.finfo(dtype).min, -1e9,
/// float16's -65504) or an outlier whose step, at least 2^15 / 255, swamps every other value of the group (at 8
/// bits a value of 1 beside finfo.min decodes to 0: the mean gradient 100 % off). Such a tensor is kept exact.
inline constexpr float k_store_max_magnitude = 32768.0f;

/// How to encode. bits and group_size matter to quant (bits also to window); seed and key are
/// the Philox key and counter half of the stochastic rounding (fold a step counter into the seed
/// if rounding must differ between steps). `variant` selects a quant_mode or mask_mode; each
/// variant reads its own parameter block below and ignores the others.
struct encode_params {
  codec_id codec = codec_id::quant;
  int bits = 4;            ///< quant: 1, 2, 4 or 8 (boundary: 2, 4 or 8); window: code bits
  int group_size = 256;    ///< quant: power of two in [64, 1024]
  std::uint64_t seed = 0;
  std::uint64_t key = 0;
  std::uint8_t variant = 0;  ///< quant_mode (quant) or mask_mode (mask); 0 otherwise

  /// quant/normalized: `count` float32 shift and scale values (host memory for encode_cpu,
  /// device memory for encode_cuda); element e uses block (e / inner) % count.
  std::uint64_t norm_count = 0;
  std::uint64_t norm_inner = 1;
  float const* norm_shift = nullptr;
  float const* norm_scale = nullptr;
  /// quant plain/normalized: a group holding a magnitude >= this is refused (refusal::wide; on a device marked as a
  /// non-finite group is, for the verdict); 0: no limit. The activation store sets k_store_max_magnitude.
  float max_magnitude = 0.0f;
  /// quant/boundary: the values of codes 0 and 2^b - 1.
  boundary_params boundary{};
  /// mask/predicate: the predicate and its bounds (`level` is found by the encoder).
  predicate_params pred{};
  /// window: the pooling geometry.
  window_params window{};
};

/// Exact blob size in bytes; the one function the encoders, the decoders and allocator sizing use.
/// @throws gact::invalid_argument naming the bad parameter: bits not in {1,2,4,8}, group size not
///         a power of two in [64,1024], codec/dtype mismatch (quant and predicate masks take float32,
///         float16, bfloat16, float64; byte masks take bool, uint8; window takes int64, int32), bad
///         variant parameters, more than 8 dims, a negative dim, more than 2^56 elements.
std::size_t blob_size(dtype dt, std::span<std::int64_t const> shape, encode_params const& p);

/// A validated blob header.
struct blob_info {
  codec_id codec;
  dtype dt;
  int bits;                          ///< quant and window: 1/2/4/8; otherwise 0
  int group_size;                    ///< quant: 64..1024; otherwise 0
  std::uint64_t seed, key, numel;
  std::vector<std::int64_t> shape;
  std::size_t size;                  ///< total blob bytes (<= the len given to parse)
  std::uint64_t nonfinite_groups;    ///< quant groups marked non-finite by the CUDA encoder (decode to NaN)
  std::uint8_t variant = 0;          ///< quant_mode or mask_mode
  normalized_params normalized{};    ///< quant/normalized
  boundary_params boundary{};        ///< quant/boundary
  predicate_params pred{};           ///< mask/predicate
  window_params window{};            ///< window
};

/// Validate every header field, every section size against `len`, and (quant) every group's metadata.
/// Reads nothing outside [blob, blob + len).
/// @throws gact::corrupt_blob naming the bad field (truncated, bad magic, bad checksum, ...)
blob_info parse(void const* blob, std::size_t len);

/// Stable name of a refusal ("none", "nonfinite", ...).
char const* refusal_name(refusal r) noexcept;

/// Result of an encode.
struct encode_result {
  std::size_t bytes;  ///< bytes written (== blob_size); 0 when refused
  codec_id codec;     ///< codec of the blob written (the requested one)
  bool nonfinite;     ///< quant refused a tensor holding NaN/±Inf: no valid blob was written
                      ///< (its magic is cleared); store the tensor with codec raw instead
  refusal refused = refusal::none;  ///< why no valid blob was written (nonfinite is one reason)
  /// mask/predicate (CPU only): every value lies in the predicate's closed range ([a, +inf) for gt/ge,
  /// (-inf, a] for lt/le, [a, b] for open/closed) and is finite: the tensor is the output of a clamp
  /// to that range, so a boundary quant blob can serve both its predicate and its values.
  bool in_range = false;
};

/// Encode a contiguous host tensor on the CPU, on `threads` threads (0 = hardware concurrency).
/// @throws gact::invalid_argument for bad parameters (see blob_size), capacity < blob_size, a null
///         pointer with numel > 0, or (mask) a uint8 tensor holding a value other than 0 and 1
///         (store such a tensor raw; the message says so).
encode_result encode_cpu(void const* src, dtype dt, std::span<std::int64_t const> shape,
                         encode_params const& p, void* blob, std::size_t capacity, int threads = 0);

/// How to decode. Values are decoded by default; a predicate mask always decodes to its two values.
struct decode_params {
  /// quant/boundary: write the predicate the codes hold (code != 0, and != 2^b - 1 with has_hi) as
  /// true_value / false_value instead of the values.
  bool predicate = false;
  float true_value = 1.0f;   ///< predicate masks and boundary predicates: the value where it holds
  float false_value = 0.0f;  ///< ... and where it does not (both rounded to the blob's float dtype)
};

/// Decode a host blob into `dst` (contiguous, the blob's dtype, numel elements).
/// Groups the CUDA encoder marked non-finite decode to NaN (and are counted in the stats).
/// @throws gact::corrupt_blob for a blob that fails validation (see parse), or whose codes decode to
///         something impossible (a window index outside the input plane)
/// @throws gact::invalid_argument if dst_bytes < numel * dtype_size, dst is null with numel > 0, or
///         `dp.predicate` is asked of a blob that holds no predicate
void decode_cpu(void const* blob, std::size_t len, void* dst, std::size_t dst_bytes, int threads = 0,
                decode_params const& dp = {});

/// Human-readable name of a validation status (for messages and the CUDA status word).
char const* status_name(hd::blob_status s) noexcept;

/// The "codecs" statistics section (counters since process start).
nlohmann::json stats_json();

/// Where a device quant encode reports, without a host synchronization, whether it met a value it could
/// not quantize (NaN/±Inf, a boundary blob's value outside [lo, hi], bad normalization statistics; a
/// window encode: an index outside its window): the
/// kernel's blocks write `word[1] = 1` when one of their groups did, and the block that finishes last
/// writes `word[0] = seq`. `word` is mapped page-locked host memory (the host reads it without a CUDA
/// call; see codecs/verdict.hpp), `counter` one device word that is 0 before the launch and that the
/// last block sets back to 0. The host must set word[0] != seq and word[1] = 0 before the launch.
struct device_verdict {
  std::uint32_t* word = nullptr;     ///< [done seq, bad], host-mapped (a device-visible address)
  std::uint32_t* counter = nullptr;  ///< device memory: blocks finished
  std::uint32_t seq = 0;             ///< nonzero; what word[0] becomes when the encode has run
};

#if defined(GACT_HAVE_KERNELS) && GACT_HAVE_KERNELS
/// Encode a contiguous device tensor into a device blob: one kernel launch on `stream`, no host
/// synchronization, the same bytes as encode_cpu for finite input. A group holding NaN/±Inf cannot
/// be reported to the host without a sync: it is stored with (NaN, NaN) metadata and decodes to NaN
/// on every executor (parse() reports the count); `nonfinite` is therefore always false here. With
/// `verdict` (quant, and window for an index outside its window; ignored by mask and raw, which have
/// nothing to report), the kernel
/// tells the host through mapped memory whether such a group exists, once it has run: the caller
/// then keeps the tensor exact instead (the store and the Compressor do; codecs/verdict.hpp).
/// Mask on the device takes bool tensors only (a uint8 tensor cannot be checked for 0/1 without a
/// sync; store it raw or check it on the host).
/// @throws gact::invalid_argument as encode_cpu (parameters, capacity, mask with uint8)
/// @throws gact::cuda_error if the launch fails
encode_result encode_cuda(void const* src, dtype dt, std::span<std::int64_t const> shape,
                          encode_params const& p, void* blob, std::size_t capacity, cudaStream_t stream,
                          device_verdict const* verdict = nullptr);

/// Decode a device blob into device memory: one kernel launch on `stream`, no host sync. The kernel
/// validates the header and each group's metadata itself (same checks as parse). On a corrupt blob it
/// writes no decoded value: `dst_bytes` bytes of dst are set to 0xFF (NaN for float dtypes) and, if
/// `status` is not null, the failed hd::blob_status is written to *status (device memory; it is
/// set to 0 == ok by a valid decode). Read *status after synchronizing to learn the outcome.
/// @throws gact::cuda_error if the launch fails
void decode_cuda(void const* blob, std::size_t len, void* dst, std::size_t dst_bytes, cudaStream_t stream,
                 std::uint32_t* status = nullptr, decode_params const& dp = {});
#endif

namespace detail {
// Counters shared by the executors (codec.cpp owns them).
void count_encode(codec_id c, std::uint64_t in_bytes, std::uint64_t out_bytes) noexcept;
void count_decode(codec_id c, std::uint64_t out_bytes, std::uint64_t nonfinite_groups) noexcept;
void count_nonfinite_refusal() noexcept;
void count_gpu_decode(std::uint64_t out_bytes) noexcept;
void count_thread_fallback() noexcept;
/// The header's parameter block for encode parameters `p` (hd::params_bytes(codec, variant) bytes
/// at `out`, which holds 160): one definition for both executors.
void fill_params(encode_params const& p, std::uint8_t variant, unsigned char* out);
void ensure_stats_registered() noexcept;
// Shared host-side checks and header construction.
blob_header make_header(dtype dt, std::span<std::int64_t const> shape, encode_params const& p,
                            hd::blob_layout* lay);
int resolve_threads(int threads, std::uint64_t work_items, std::uint64_t min_items_per_thread) noexcept;
// The quant CPU executor (quant_cpu.cpp). Returns the refusal (none, nonfinite, out_of_range).
refusal quant_encode_cpu(void const* src, quant_job const& job, int threads);
void quant_decode_cpu(quant_job const& job, void* dst, int threads);
/// The predicate-mask CPU executor (quant_cpu.cpp): the code bytes of a float tensor and what they saw.
mask_scan mask_encode_cpu(void const* src, dtype dt, predicate_params const& q, std::uint64_t numel,
                          std::uint8_t* out, int threads);
/// Run fn(begin, end) over [0, n) split into `threads` contiguous ranges, the calling thread taking
/// the first. When a worker thread cannot be created, the calling thread also runs the ranges left
/// (counted by count_thread_fallback, logged once): the same result, never an exception.
void parallel_for(std::uint64_t n, int threads, void (*fn)(void*, std::uint64_t, std::uint64_t), void* ctx);
/// Name of the build of the per-group loops in use ("avx512", "avx2" or "generic").
char const* quant_cpu_isa() noexcept;
/// The builds of the loops this CPU can run, "generic" first and the fastest (the default) last.
std::vector<char const*> quant_cpu_isas();
/// Tests and benchmarks: use the build named (one of quant_cpu_isas()), or the fastest for nullptr.
/// Returns false, changing nothing, for a name this CPU cannot run.
bool use_quant_cpu_isa(char const* name) noexcept;
/// Tests: make the creation of worker thread k (1-based, k >= 1) and later ones fail; 0 = never.
void fail_thread_creation_after(int k) noexcept;
}  // namespace detail

}  // namespace gact::codec
