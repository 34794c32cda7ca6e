// gact/codecs/codec.hpp
//
// The public interface of gact's codecs: compress a contiguous tensor into a
// self-describing blob and back.
//
//   quant  per-group (G = 64..1024 elements) min/max quantization to 1/2/4/8 bits
//          with unbiased stochastic rounding (Philox4x32-10 noise keyed by seed
//          and tensor key); float32/float16/bfloat16 in, the same dtype out
//   mask   lossless 1 bit per element, for bool and 0/1 uint8 tensors
//   raw    lossless pass-through for any dtype
//
// Sizes: blob_size() is the one size function; the encoders write exactly that
// many bytes and the decoders accept a buffer at least that long. The format is
// in codecs/format.hpp and codecs/README.md; the math in codecs/quant_math.hpp,
// shared by the CPU executor (encode_cpu/decode_cpu) and the CUDA executor
// (encode_cuda/decode_cuda), which produce identical blobs bit for bit.
//
// Statistics: the first encode or decode registers the provider "codecs" in the
// stats registry (allocator/stats_registry.hpp); stats_json() returns the same.
#pragma once

#include "codecs/format.hpp"

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
/// Name of a codec ("raw", "quant", "mask"; "invalid" otherwise).
char const* codec_name(codec_id c) noexcept;

/// How to encode. bits and group_size matter to quant only; seed and key are the
/// Philox key and counter half of the stochastic rounding (fold a step counter into
/// the seed if rounding must differ between steps).
struct encode_params {
  codec_id codec = codec_id::quant;
  int bits = 4;            ///< 1, 2, 4 or 8
  int group_size = 256;    ///< power of two in [64, 1024]
  std::uint64_t seed = 0;
  std::uint64_t key = 0;
};

/// Exact blob size in bytes; the one function the encoders, the decoders and allocator sizing use.
/// @throws gact::invalid_argument naming the bad parameter: bits not in {1,2,4,8}, group size not
///         a power of two in [64,1024], codec/dtype mismatch (quant takes float32/float16/bfloat16,
///         mask takes bool/uint8), more than 8 dims, a negative dim, more than 2^56 elements.
std::size_t blob_size(dtype dt, std::span<std::int64_t const> shape, encode_params const& p);

/// A validated blob header.
struct blob_info {
  codec_id codec;
  dtype dt;
  int bits;                          ///< quant: 1/2/4/8; otherwise 0
  int group_size;                    ///< quant: 64..1024; otherwise 0
  std::uint64_t seed, key, numel;
  std::vector<std::int64_t> shape;
  std::size_t size;                  ///< total blob bytes (<= the len given to parse)
  std::uint64_t nonfinite_groups;    ///< quant groups marked non-finite by the CUDA encoder (decode to NaN)
};

/// Validate every header field, every section size against `len`, and (quant) every group's metadata.
/// Reads nothing outside [blob, blob + len).
/// @throws gact::corrupt_blob naming the bad field (truncated, bad magic, bad checksum, ...)
blob_info parse(void const* blob, std::size_t len);

/// Result of an encode.
struct encode_result {
  std::size_t bytes;  ///< bytes written (== blob_size); 0 when nonfinite
  codec_id codec;     ///< codec of the blob written (the requested one)
  bool nonfinite;     ///< quant refused a tensor holding NaN/±Inf: no valid blob was written
                      ///< (its magic is cleared); store the tensor with codec raw instead
};

/// Encode a contiguous host tensor on the CPU, on `threads` threads (0 = hardware concurrency).
/// @throws gact::invalid_argument for bad parameters (see blob_size), capacity < blob_size, a null
///         pointer with numel > 0, or (mask) a uint8 tensor holding a value other than 0 and 1
///         (store such a tensor raw; the message says so).
encode_result encode_cpu(void const* src, dtype dt, std::span<std::int64_t const> shape,
                         encode_params const& p, void* blob, std::size_t capacity, int threads = 0);

/// Decode a host blob into `dst` (contiguous, the blob's dtype, numel elements).
/// Groups the CUDA encoder marked non-finite decode to NaN (and are counted in the stats).
/// @throws gact::corrupt_blob for a blob that fails validation (see parse)
/// @throws gact::invalid_argument if dst_bytes < numel * dtype_size or dst is null with numel > 0
void decode_cpu(void const* blob, std::size_t len, void* dst, std::size_t dst_bytes, int threads = 0);

/// Human-readable name of a validation status (for messages and the CUDA status word).
char const* status_name(hd::blob_status s) noexcept;

/// The "codecs" statistics section (counters since process start).
nlohmann::json stats_json();

#if defined(GACT_HAVE_KERNELS) && GACT_HAVE_KERNELS
/// Encode a contiguous device tensor into a device blob: one kernel launch on `stream`, no host
/// synchronization, the same bytes as encode_cpu for finite input. A group holding NaN/±Inf cannot
/// be reported to the host without a sync: it is stored with (NaN, NaN) metadata and decodes to NaN
/// on every executor (parse() reports the count); `nonfinite` is therefore always false here.
/// Mask on the device takes bool tensors only (a uint8 tensor cannot be checked for 0/1 without a
/// sync; store it raw or check it on the host).
/// @throws gact::invalid_argument as encode_cpu (parameters, capacity, mask with uint8)
/// @throws gact::cuda_error if the launch fails
encode_result encode_cuda(void const* src, dtype dt, std::span<std::int64_t const> shape,
                          encode_params const& p, void* blob, std::size_t capacity, cudaStream_t stream);

/// Decode a device blob into device memory: one kernel launch on `stream`, no host sync. The kernel
/// validates the header and each group's metadata itself (same checks as parse). On a corrupt blob it
/// writes no decoded value: `dst_bytes` bytes of dst are set to 0xFF (NaN for float dtypes) and, if
/// `status` is not null, the failed hd::blob_status is written to *status (device memory; it is
/// set to 0 == ok by a valid decode). Read *status after synchronizing to learn the outcome.
/// @throws gact::cuda_error if the launch fails
void decode_cuda(void const* blob, std::size_t len, void* dst, std::size_t dst_bytes, cudaStream_t stream,
                 std::uint32_t* status = nullptr);
#endif

namespace detail {
// Counters shared by the executors (codec.cpp owns them).
void count_encode(codec_id c, std::uint64_t in_bytes, std::uint64_t out_bytes) noexcept;
void count_decode(codec_id c, std::uint64_t out_bytes, std::uint64_t nonfinite_groups) noexcept;
void count_nonfinite_refusal() noexcept;
void ensure_stats_registered() noexcept;
// Shared host-side checks and header construction.
blob_header make_header(dtype dt, std::span<std::int64_t const> shape, encode_params const& p,
                            hd::blob_layout* lay);
int resolve_threads(int threads, std::uint64_t work_items, std::uint64_t min_items_per_thread) noexcept;
// The quant CPU executor (quant_cpu.cpp). Returns false (nonfinite) if the input holds NaN/±Inf.
bool quant_encode_cpu(void const* src, dtype dt, std::uint64_t numel, int bits, int group_size,
                      std::uint64_t seed, std::uint64_t key, unsigned char* meta, unsigned char* codes,
                      int threads);
void quant_decode_cpu(unsigned char const* meta, unsigned char const* codes, dtype dt, std::uint64_t numel,
                      int bits, int group_size, void* dst, int threads);
/// Name of the build of the per-group loops in use ("avx2" or "generic").
char const* quant_cpu_isa() noexcept;
/// Tests and benchmarks: use the baseline build of the loops (true) or the best one (false).
/// Returns whether a faster build than the baseline exists on this CPU.
bool force_generic_quant_cpu(bool generic) noexcept;
}  // namespace detail

}  // namespace gact::codec
