// gact/codecs/codec_cuda.cu
//
// The CUDA executor: one kernel launch per encode and one per decode, on the
// caller's stream, with no host synchronization. The kernels call the same
// GACT_HD math as the CPU executor (quant_math.hpp, mask_math.hpp, philox.hpp,
// float16.hpp, format.hpp), so an encode produces the same bytes as encode_cpu.
//
// quant encode: one warp per group. Each lane owns up to four 8-element chunks
// (chunk c of the group goes to lane c % 32), loads them with 16-byte vector
// loads when the source is aligned (scalar, bounds-checked loads for the tail
// chunk), applies the normalized variant's affine map in registers, reduces
// min/max (the boundary variant: the interior's) over the warp with
// cub::WarpReduce, and then, from registers (one pass over the input), draws one
// Philox block per chunk, quantizes, and stores the chunk's b bytes of codes.
// Block 0 writes the header, which the host built (header bytes are a kernel
// argument); the normalized variant's statistics are copied into the blob by a
// grid-stride loop over every block.
// A group holding NaN/±Inf (or, in a boundary blob, a value outside [lo, hi]) is
// written as (NaN, NaN) metadata with zero codes; every decoder turns it into NaN.
// With a device_verdict the launch also says so through mapped host memory once
// it has run (no sync: the host reads a word), and its caller keeps the tensor
// exact instead (codecs/verdict.hpp). The window encoder reports an index outside
// its window (written as code 0) the same way.
//
// decode: a grid-stride loop over 8-element chunks, with a grid sized to the
// device (a few blocks per multiprocessor), so the header is validated once per
// block (hd::check_blob against the blob length and the destination size) before
// anything else is read; statistics and group metadata are checked as they are
// read. A corrupt blob makes the kernel fill dst with 0xFF bytes (NaN for float
// dtypes, -1 for indices: zero for window blobs, so that no consumer indexes out
// of bounds) and record the hd::blob_status in the optional status word.
#include "codecs/codec.hpp"

#include "allocator/error.hpp"
#include "codecs/float16.hpp"
#include "codecs/mask_math.hpp"
#include "codecs/philox.hpp"
#include "codecs/quant_math.hpp"

#include <cub/warp/warp_reduce.cuh>
#include <cuda/functional>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstring>
#include <string>

namespace gact::codec {
namespace {

#define GACT_CODEC_CUDA_TRY(call)                                                                      \
  do {                                                                                                 \
    cudaError_t const gact_e_ = (call);                                                                \
    if (gact_e_ != cudaSuccess)                                                                        \
      GACT_FAIL(std::string(#call) + ": " + cudaGetErrorName(gact_e_) + " (" + cudaGetErrorString(gact_e_) + ")", \
                ::gact::cuda_error);                                                                   \
  } while (0)

constexpr int k_warps_per_block = 8;
constexpr int k_decode_threads = 256;
constexpr int k_blocks_per_sm = 4;

/// The header bytes (fixed part, shape, parameters, padding) as a kernel argument.
struct header_bytes_arg {
  unsigned char b[64 + 8 * k_max_ndim + 160];
  std::uint32_t n;
};

__device__ __forceinline__ void write_header_block0(unsigned char* blob, header_bytes_arg const& h) {
  if (blockIdx.x == 0)
    for (std::uint32_t i = threadIdx.x; i < h.n; i += blockDim.x) blob[i] = h.b[i];
}

// ---- element access by dtype ------------------------------------------------------------------

template <int Dt>
struct dev_io;
template <>
struct dev_io<0> {
  using storage = float;
  __device__ static float load(storage v) { return v; }
  __device__ static storage store(float v) { return v; }
};
template <>
struct dev_io<1> {
  using storage = std::uint16_t;
  __device__ static float load(storage v) { return hd::half_to_float(v); }
  __device__ static storage store(float v) { return hd::float_to_half(v); }
};
template <>
struct dev_io<2> {
  using storage = std::uint16_t;
  __device__ static float load(storage v) { return hd::bf16_to_float(v); }
  __device__ static storage store(float v) { return hd::float_to_bf16(v); }
};
// float64: quantized in float32 (round to nearest, as the CPU executor's float(double)).
template <>
struct dev_io<9> {
  using storage = double;
  __device__ static float load(storage v) { return __double2float_rn(v); }
  __device__ static storage store(float v) { return double(v); }
};

constexpr int k_plain = int(quant_mode::plain);
constexpr int k_normalized = int(quant_mode::normalized);
constexpr int k_boundary = int(quant_mode::boundary);

/// Metadata value storage: the input dtype for 16-bit plain/boundary groups, float32 otherwise.
template <int Dt, int V>
struct meta_dev {
  static constexpr bool narrow = (Dt == 1 || Dt == 2) && V != k_normalized;
  using storage = std::conditional_t<narrow, std::uint16_t, float>;
  __device__ static float load(storage v) {
    if constexpr (narrow) return dev_io<Dt>::load(v);
    else return v;
  }
  __device__ static storage store(float v) {
    if constexpr (narrow) return dev_io<Dt>::store(v);
    else return v;
  }
  __device__ static storage nan() {
    if constexpr (narrow) return storage(0x7FFF);  // NaN in float16 and bfloat16
    else return __int_as_float(0x7FC00000);
  }
};

/// Load the 8 elements of chunk `e` (element index of its first element) into v; elements at or past
/// `end` are left at 0. Returns the number of valid elements.
template <int Dt, bool Vec>
__device__ __forceinline__ int load_chunk(typename dev_io<Dt>::storage const* src, std::uint64_t e,
                                          std::uint64_t end, float (&v)[8]) {
  using S = typename dev_io<Dt>::storage;
  if (Vec && e + 8 <= end) {
    if constexpr (sizeof(S) == 4) {
      float4 const a = reinterpret_cast<float4 const*>(src + e)[0];
      float4 const b = reinterpret_cast<float4 const*>(src + e)[1];
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
      v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
      return 8;
    } else if constexpr (sizeof(S) == 2) {
      uint4 const a = *reinterpret_cast<uint4 const*>(src + e);
      std::uint32_t const w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[2 * j] = dev_io<Dt>::load(S(w[j] & 0xFFFFu));
        v[2 * j + 1] = dev_io<Dt>::load(S(w[j] >> 16));
      }
      return 8;
    }
  }
  int n = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (e + std::uint64_t(j) < end) {
      v[j] = dev_io<Dt>::load(src[e + std::uint64_t(j)]);
      ++n;
    } else {
      v[j] = 0.0f;
    }
  }
  return n;
}

/// Store a chunk's b bytes of codes (element j at bits [j*b, (j+1)*b) of a little-endian word).
__device__ __forceinline__ void store_codes(unsigned char* dst, int bits, std::uint64_t word) {
  switch (bits) {
    case 1: *dst = std::uint8_t(word); break;
    case 2: *reinterpret_cast<std::uint16_t*>(dst) = std::uint16_t(word); break;
    case 4: *reinterpret_cast<std::uint32_t*>(dst) = std::uint32_t(word); break;
    default: *reinterpret_cast<std::uint64_t*>(dst) = word; break;
  }
}

__device__ __forceinline__ std::uint64_t load_codes(unsigned char const* src, int bits) {
  std::uint64_t word = 0;
  for (int b = 0; b < bits; ++b) word |= std::uint64_t(src[b]) << (8 * b);
  return word;
}

/// Statistics of block (e / inner) % count, walked element by element.
struct dev_block_cursor {
  std::uint64_t block, pos, count, inner;
  __device__ dev_block_cursor(std::uint64_t e, std::uint64_t count_, std::uint64_t inner_)
      : block((e / inner_) % count_), pos(e % inner_), count(count_), inner(inner_) {}
  __device__ void next() {
    if (++pos == inner) {
      pos = 0;
      if (++block == count) block = 0;
    }
  }
};

/// What the encode kernels need besides the tensor.
struct quant_args {
  std::uint64_t numel, n_groups, seed, key;
  int G, bits;
  std::uint64_t stats_off, meta_off, code_off, meta_pad_end;
  std::uint64_t count, inner;
  float const* shift;  // normalized: device arrays of count values
  float const* scale;
  float max_magnitude;  // plain, normalized: a group at or beyond it is marked bad (encode_params::max_magnitude)
  boundary_params boundary;
  device_verdict verdict;  // word == nullptr: not asked
};

// ---- encode kernels ---------------------------------------------------------------------------

/// Tell the host, through mapped memory, that this launch met a group it could not quantize, and (the
/// block that finishes last) that the launch has run. A flag store is made visible system-wide (its
/// writer fences, then the block meets at a barrier) before the block counts itself, and the last block
/// fences again before writing the sequence number, so a host that reads word[0] == seq then reads the
/// final word[1] (the pattern of CUDA's threadFenceReduction sample, at system scope).
__device__ __forceinline__ void report_verdict(device_verdict const& v, bool bad) {
  if (v.word == nullptr) return;  // (uniform over the grid: a kernel argument)
  if (bad) {
    *reinterpret_cast<volatile std::uint32_t*>(v.word + 1) = 1u;
    __threadfence_system();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    unsigned const before = atomicAdd(v.counter, 1u);
    if (before == gridDim.x - 1) {
      *v.counter = 0u;  // ready for the slot's next launch (ordered after this one on any stream: the host
                        // reuses a slot only after reading this launch's seq)
      __threadfence_system();
      *reinterpret_cast<volatile std::uint32_t*>(v.word) = v.seq;
    }
  }
}

/// One group of quant_encode_kernel (one warp); true when the group holds a value it cannot quantize
/// (then written as the (NaN, NaN) marker with zero codes).
template <int Dt, int CPL, bool Vec, int V>
__device__ __forceinline__ bool encode_group(typename dev_io<Dt>::storage const* __restrict__ src, quant_args const& a,
                                             unsigned char* __restrict__ blob,
                                             typename cub::WarpReduce<float>::TempStorage& temp, std::uint64_t g,
                                             int lane) {
  using M = meta_dev<Dt, V>;
  using warp_reduce = cub::WarpReduce<float>;
  std::uint64_t const e0 = g * std::uint64_t(a.G);
  std::uint64_t const end = e0 + std::uint64_t(a.G) < a.numel ? e0 + std::uint64_t(a.G) : a.numel;
  int const chunks = a.G / 8;
  bool const has_hi = a.boundary.has_hi != 0;

  float v[CPL][8];
  float lo = __int_as_float(0x7F800000), hi = __int_as_float(0xFF800000);  // +Inf / -Inf identities
  bool bad = false;
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    int const c = lane + 32 * i;
    std::uint64_t const e = e0 + 8u * std::uint64_t(c);
    int n = 0;
    if (c < chunks && e < end) n = load_chunk<Dt, Vec>(src, e, end, v[i]);
    if constexpr (V == k_normalized) {
      if (n > 0) {
        dev_block_cursor cur(e, a.count, a.inner);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (j < n) {
            float const sh = hd::round_bf16(a.shift[cur.block]), sc = hd::round_bf16(a.scale[cur.block]);
            bad |= !hd::stats_ok(sh, sc);
            v[i][j] = hd::normalize(v[i][j], sh, sc);
            cur.next();
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < n) {
        float const x = v[i][j];
        bad |= !hd::is_finite_bits(x);
        if constexpr (V == k_boundary) {
          bad |= x < a.boundary.lo || (has_hi && x > a.boundary.hi);
          if (x > a.boundary.lo && (!has_hi || x < a.boundary.hi)) {
            lo = fminf(lo, x);
            hi = fmaxf(hi, x);
          }
        } else {
          lo = fminf(lo, x);
          hi = fmaxf(hi, x);
        }
      }
    }
  }
  bad = __any_sync(0xFFFFFFFFu, bad);
  lo = warp_reduce(temp).Reduce(lo, cuda::minimum<>{});
  lo = __shfl_sync(0xFFFFFFFFu, lo, 0);
  __syncwarp();
  hi = warp_reduce(temp).Reduce(hi, cuda::maximum<>{});
  hi = __shfl_sync(0xFFFFFFFFu, hi, 0);
  if constexpr (V == k_boundary) {
    if (lo > hi) {  // no interior value: the (lo, lo) placeholder
      lo = a.boundary.lo;
      hi = a.boundary.lo;
    }
  }
  lo = hd::canonical_zero(lo);
  hi = hd::canonical_zero(hi);
  // (a group too wide to quantize, a mask's fill: marked as a non-finite one is, and the tensor kept exact through its
  // verdict; lo and hi are the warp's, so bad stays uniform)
  if constexpr (V != k_boundary) bad = bad || !hd::quant_range_ok(lo, hi, a.max_magnitude);
  if (lane == 0) {
    auto* m = reinterpret_cast<typename M::storage*>(blob + a.meta_off) + 2 * g;
    m[0] = bad ? M::nan() : M::store(lo);
    m[1] = bad ? M::nan() : M::store(hi);
  }
  // Quantize against the bounds as stored (identical to lo, hi: they are values of the storage type).
  hd::group_params p;
  if constexpr (V == k_boundary) p = hd::make_params_levels(lo, hi, hd::boundary_levels(a.bits, has_hi));
  else p = hd::make_params(lo, hi, a.bits);
  std::int32_t const top = (1 << a.bits) - 1;
  bool const quantize = !bad && (V == k_boundary || p.step > 0.0f);
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    int const c = lane + 32 * i;
    std::uint64_t const e = e0 + 8u * std::uint64_t(c);
    if (c >= chunks || e >= end) continue;
    std::uint64_t word = 0;
    if (quantize) {
      hd::philox_block const r = hd::noise_block(a.seed, a.key, e / 8);
      // (a 16-bit output's codes are chosen against the values its decode rounds to: hd::quantize_u16; a
      // normalized group's against the input itself, loaded again, and its block's decoded statistics)
      constexpr int kind = Dt == 1 ? 1 : Dt == 2 ? 2 : 0;  // (hd::quantize_as: 0 float32's rounding, 1 float16, 2 bf16)
      constexpr bool narrow = kind != 0;
      float x[8];
      if constexpr (narrow && V == k_normalized) load_chunk<Dt, Vec>(src, e, end, x);
      dev_block_cursor cur(e, V == k_normalized ? a.count : 1, V == k_normalized ? a.inner : 1);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (e + std::uint64_t(j) < end) {
          std::int32_t q;
          float const u = hd::noise_uniform(hd::noise_lane(r, j));
          if constexpr (V == k_boundary) {
            q = hd::quantize_boundary<kind>(v[i][j], a.boundary.lo, a.boundary.hi, has_hi, top, p, u);
          } else if constexpr (V == k_normalized && narrow) {
            float const sh = hd::round_bf16(a.shift[cur.block]), sc = hd::round_bf16(a.scale[cur.block]);
            q = hd::quantize_normalized16<kind == 1>(x[j], v[i][j], p, sh, hd::inverse_scale(sc), u);
            cur.next();
          } else {
            q = hd::quantize_as<kind>(v[i][j], p, u);
          }
          word |= std::uint64_t(q) << (j * a.bits);
        }
      }
    }
    store_codes(blob + a.code_off + (e / 8) * std::uint64_t(a.bits), a.bits, word);
  }
  return bad;
}

/// One warp per group; CPL = chunks per lane (G / 256, at least 1); V = quant_mode.
template <int Dt, int CPL, bool Vec, int V>
__global__ void __launch_bounds__(32 * k_warps_per_block)
    quant_encode_kernel(typename dev_io<Dt>::storage const* __restrict__ src, quant_args a,
                        unsigned char* __restrict__ blob, header_bytes_arg hdr) {
  using M = meta_dev<Dt, V>;
  using warp_reduce = cub::WarpReduce<float>;
  __shared__ typename warp_reduce::TempStorage temp[k_warps_per_block];
  write_header_block0(blob, hdr);
  std::uint64_t const gtid = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  std::uint64_t const gstride = std::uint64_t(gridDim.x) * blockDim.x;
  if constexpr (V == k_normalized) {  // the statistics section, as the decoder will read it
    for (std::uint64_t b = gtid; b < a.count; b += gstride)
      hd::store_stat(blob + a.stats_off, b, hd::round_bf16(a.shift[b]), hd::round_bf16(a.scale[b]));
    for (std::uint64_t i = a.stats_off + std::uint64_t(hd::k_stat_bytes) * a.count + gtid; i < a.meta_off; i += gstride)
      blob[i] = 0;
  }
  {  // the metadata section's zero padding
    std::uint64_t const used = a.meta_off + a.n_groups * 2 * sizeof(typename M::storage);
    for (std::uint64_t i = used + gtid; i < a.meta_pad_end; i += gstride) blob[i] = 0;
  }
  int const warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  std::uint64_t const g = std::uint64_t(blockIdx.x) * k_warps_per_block + std::uint64_t(warp);
  // (no early return for the warps past the last group: every thread reaches report_verdict's barrier)
  bool const bad = g < a.n_groups && encode_group<Dt, CPL, Vec, V>(src, a, blob, temp[warp], g, lane);
  report_verdict(a.verdict, bad && lane == 0);
}

/// Byte mask: one thread per output byte (8 elements, element e at bit e % 8); bool input, nonzero is 1.
__global__ void mask_encode_kernel(std::uint8_t const* __restrict__ src, std::uint64_t numel,
                                   unsigned char* __restrict__ blob, std::uint64_t code_off, header_bytes_arg hdr) {
  write_header_block0(blob, hdr);
  std::uint64_t const nbytes = (numel + 7) / 8;
  for (std::uint64_t m = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; m < nbytes;
       m += std::uint64_t(gridDim.x) * blockDim.x) {
    unsigned v = 0;
    for (int j = 0; j < 8; ++j) {
      std::uint64_t const e = 8 * m + std::uint64_t(j);
      if (e < numel) v |= unsigned(src[e] != 0) << j;
    }
    blob[code_off + m] = std::uint8_t(v);
  }
}

/// Predicate mask: one thread per output byte, the predicate evaluated on the float input.
template <int Dt>
__global__ void predicate_encode_kernel(typename dev_io<Dt>::storage const* __restrict__ src, std::uint64_t numel,
                                        predicate_params q, unsigned char* __restrict__ blob, std::uint64_t code_off,
                                        header_bytes_arg hdr) {
  write_header_block0(blob, hdr);
  std::uint64_t const nbytes = (numel + 7) / 8;
  for (std::uint64_t m = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; m < nbytes;
       m += std::uint64_t(gridDim.x) * blockDim.x) {
    unsigned v = 0;
    for (int j = 0; j < 8; ++j) {
      std::uint64_t const e = 8 * m + std::uint64_t(j);
      if (e < numel) v |= unsigned(hd::eval_predicate(q.pred, q.a, q.b, dev_io<Dt>::load(src[e]))) << j;
    }
    blob[code_off + m] = std::uint8_t(v);
  }
}

/// Window codec: one thread per 8-element chunk. An index that is not a position of its window makes
/// the kernel record hd::blob_status::bad_codes in *status (the chunk's codes are then 0).
template <typename I>
__global__ void window_encode_kernel(I const* __restrict__ src, std::uint64_t numel, int bits, window_params w,
                                     unsigned char* __restrict__ blob, std::uint64_t code_off, header_bytes_arg hdr,
                                     std::uint32_t* status, device_verdict verdict) {
  write_header_block0(blob, hdr);
  hd::window_geometry const g = hd::make_window_geometry(w);
  bool refused = false;
  std::uint64_t const nchunks = (numel + 7) / 8;
  for (std::uint64_t c = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < nchunks;
       c += std::uint64_t(gridDim.x) * blockDim.x) {
    std::uint64_t word = 0;
    bool ok = true;
    for (int j = 0; j < 8; ++j) {
      std::uint64_t const e = 8 * c + std::uint64_t(j);
      if (e >= numel) break;
      std::int64_t o[k_window_max_nd];
      hd::window_out_coords(g, e, o);
      std::int64_t const code = hd::window_encode(g, o, std::int64_t(src[e]));
      ok = ok && code >= 0;
      if (code >= 0) word |= std::uint64_t(code) << (j * bits);
    }
    if (!ok) {
      word = 0;
      atomicMax(status, std::uint32_t(hd::blob_status::bad_codes));
      refused = true;
    }
    for (int b = 0; b < bits; ++b) blob[code_off + c * std::uint64_t(bits) + std::uint64_t(b)] = std::uint8_t(word >> (8 * b));
  }
  report_verdict(verdict, refused);  // (every thread gets here: a grid-stride loop, no early return)
}

/// Byte copy with 16-byte vectors when both ends are aligned.
__device__ void copy_bytes(unsigned char* __restrict__ dst, unsigned char const* __restrict__ src, std::uint64_t n) {
  std::uint64_t const stride = std::uint64_t(gridDim.x) * blockDim.x;
  std::uint64_t const tid = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  std::uint64_t done = 0;
  if (((reinterpret_cast<std::uintptr_t>(dst) | reinterpret_cast<std::uintptr_t>(src)) & 15u) == 0) {
    std::uint64_t const nv = n / 16;
    for (std::uint64_t i = tid; i < nv; i += stride)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<uint4 const*>(src)[i];
    done = nv * 16;
  }
  for (std::uint64_t i = done + tid; i < n; i += stride) dst[i] = src[i];
}

__global__ void raw_encode_kernel(unsigned char const* __restrict__ src, std::uint64_t nbytes,
                                  unsigned char* __restrict__ blob, std::uint64_t code_off, header_bytes_arg hdr) {
  write_header_block0(blob, hdr);
  copy_bytes(blob + code_off, src, nbytes);
}

// ---- decode kernel ----------------------------------------------------------------------------

struct decode_view {
  blob_header h;
  hd::blob_layout lay;
  std::uint64_t count;
  unsigned char const* params;
};

template <int Dt, int V>
__device__ void quant_decode(unsigned char const* blob, decode_view const& d, decode_params const& dp, void* dst,
                             std::uint32_t* status) {
  using S = typename dev_io<Dt>::storage;
  using M = meta_dev<Dt, V>;
  S* out = static_cast<S*>(dst);
  unsigned char const* stats = blob + d.lay.header_bytes;
  auto const* meta = reinterpret_cast<typename M::storage const*>(stats + d.lay.stats_bytes);
  unsigned char const* codes = blob + d.lay.header_bytes + d.lay.meta_bytes;
  int const bits = d.h.bits, G = d.h.group_size;
  std::uint32_t const mask = (1u << bits) - 1u;
  std::int32_t const top = std::int32_t(mask);
  std::uint64_t const numel = d.h.numel;
  std::uint64_t const nchunks = (numel + 7) / 8;
  boundary_params bp{};
  normalized_params np{1, 1};
  if constexpr (V == k_boundary) memcpy(&bp, d.params, sizeof bp);
  if constexpr (V == k_normalized) memcpy(&np, d.params, sizeof np);
  bool const has_hi = bp.has_hi != 0;
  bool const vec_out = sizeof(S) <= 4 && (reinterpret_cast<std::uintptr_t>(dst) & 15u) == 0;
  for (std::uint64_t c = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < nchunks;
       c += std::uint64_t(gridDim.x) * blockDim.x) {
    std::uint64_t const e = 8 * c;
    std::uint64_t const g = e / std::uint64_t(G);
    float const lo = M::load(meta[2 * g]), hi = M::load(meta[2 * g + 1]);
    float r[8];
    bool ok = hd::meta_ok(lo, hi);
    if constexpr (V == k_boundary) ok = ok && (lo != lo || (lo >= bp.lo && (!has_hi || hi <= bp.hi)));
    if (!ok) {
      atomicMax(status, std::uint32_t(hd::blob_status::bad_group_meta));
#pragma unroll
      for (int j = 0; j < 8; ++j) r[j] = __int_as_float(0x7FFFFFFF);
    } else {
      std::uint64_t const word = load_codes(codes + c * std::uint64_t(bits), bits);
      if constexpr (V == k_boundary) {
        hd::group_params const p = hd::make_params_levels(lo, hi, hd::boundary_levels(bits, has_hi));
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          std::int32_t const q = std::int32_t((word >> (j * bits)) & mask);
          r[j] = dp.predicate ? ((q != 0 && !(has_hi && q == top)) ? dp.true_value : dp.false_value)
                              : hd::dequantize_boundary(q, bp.lo, bp.hi, has_hi, top, p);
          if (lo != lo && !dp.predicate) r[j] = lo;  // a group marked non-finite decodes to NaN
        }
      } else {
        hd::group_params const p = hd::make_params(lo, hi, bits);
#pragma unroll
        for (int j = 0; j < 8; ++j) r[j] = hd::dequantize(std::int32_t((word >> (j * bits)) & mask), p);
        if constexpr (V == k_normalized) {
          dev_block_cursor cur(e, np.count, np.inner);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (e + std::uint64_t(j) < numel) {
              float st[2];
              hd::load_stat(stats, cur.block, st[0], st[1]);
              if (!hd::stats_ok(st[0], st[1])) {
                atomicMax(status, std::uint32_t(hd::blob_status::bad_stats));
                r[j] = __int_as_float(0x7FFFFFFF);
              } else {
                r[j] = hd::denormalize(r[j], st[0], hd::inverse_scale(st[1]));
              }
              cur.next();
            }
          }
        }
      }
    }
    if (vec_out && e + 8 <= numel) {
      if constexpr (sizeof(S) == 4) {
        reinterpret_cast<float4*>(out + e)[0] = make_float4(r[0], r[1], r[2], r[3]);
        reinterpret_cast<float4*>(out + e)[1] = make_float4(r[4], r[5], r[6], r[7]);
      } else if constexpr (sizeof(S) == 2) {
        std::uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          w[j] = std::uint32_t(dev_io<Dt>::store(r[2 * j])) | (std::uint32_t(dev_io<Dt>::store(r[2 * j + 1])) << 16);
        *reinterpret_cast<uint4*>(out + e) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    } else {
      for (int j = 0; j < 8 && e + std::uint64_t(j) < numel; ++j) out[e + std::uint64_t(j)] = dev_io<Dt>::store(r[j]);
    }
  }
}

template <int Dt>
__device__ void predicate_decode(unsigned char const* codes, std::uint64_t numel, float tv, float fv, void* dst) {
  using S = typename dev_io<Dt>::storage;
  S* out = static_cast<S*>(dst);
  S const t1 = dev_io<Dt>::store(tv), f1 = dev_io<Dt>::store(fv);
  for (std::uint64_t e = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < numel;
       e += std::uint64_t(gridDim.x) * blockDim.x)
    out[e] = ((codes[e / 8] >> (e % 8)) & 1u) ? t1 : f1;
}

template <typename I>
__device__ void window_decode(unsigned char const* codes, window_params const& w, std::uint64_t numel, int bits,
                              I* out, std::uint32_t* status) {
  hd::window_geometry const g = hd::make_window_geometry(w);
  std::uint64_t const mask = (std::uint64_t{1} << bits) - 1;
  for (std::uint64_t e = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < numel;
       e += std::uint64_t(gridDim.x) * blockDim.x) {
    std::uint64_t const word = load_codes(codes + (e / 8) * std::uint64_t(bits), bits);
    std::int64_t o[k_window_max_nd];
    hd::window_out_coords(g, e, o);
    std::int64_t idx = hd::window_decode(g, o, std::int64_t((word >> ((e % 8) * std::uint64_t(bits))) & mask));
    if (idx < 0) {
      atomicMax(status, std::uint32_t(hd::blob_status::bad_codes));
      idx = 0;  // in bounds for any consumer; the status word reports the corruption
    }
    out[e] = I(idx);
  }
}

template <int V>
__device__ void quant_decode_dt(unsigned char const* blob, decode_view const& d, decode_params const& dp, void* dst,
                                std::uint32_t* status) {
  switch (d.h.dtype) {
    case 0: quant_decode<0, V>(blob, d, dp, dst, status); break;
    case 1: quant_decode<1, V>(blob, d, dp, dst, status); break;
    case 2: quant_decode<2, V>(blob, d, dp, dst, status); break;
    default: quant_decode<9, V>(blob, d, dp, dst, status); break;
  }
}

__global__ void decode_kernel(unsigned char const* __restrict__ blob, std::uint64_t len, void* __restrict__ dst,
                              std::uint64_t dst_bytes, std::uint32_t* status, decode_params dp) {
  __shared__ decode_view d;
  __shared__ std::uint32_t st;
  if (threadIdx.x == 0) {
    std::int64_t shape[k_max_ndim];
    decode_view dd{};
    hd::blob_status s = blob == nullptr ? hd::blob_status::truncated_header
                                        : hd::check_blob(blob, len, &dd.h, shape, &dd.lay, &dd.count);
    if (s == hd::blob_status::ok && dd.h.numel * std::uint64_t(hd::dtype_bytes(dd.h.dtype)) > dst_bytes)
      s = hd::blob_status::dst_too_small;
    std::uint8_t const variant = std::uint8_t(dd.h.flags & 0xFFu);
    bool const boundary = dd.h.codec == std::uint8_t(codec_id::quant) && variant == std::uint8_t(quant_mode::boundary);
    if (s == hd::blob_status::ok && dp.predicate && !boundary && dd.h.codec != std::uint8_t(codec_id::mask))
      s = hd::blob_status::bad_params;
    dd.params = blob + 64 + 8 * dd.h.ndim;
    d = dd;
    st = std::uint32_t(s);
  }
  __syncthreads();
  if (st != 0) {
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicMax(status, st);
    // Indices are zeroed (an in-bounds value for any consumer); everything else becomes 0xFF (NaN).
    std::uint8_t const fill = d.h.codec == std::uint8_t(codec_id::window) ? 0x00 : 0xFF;
    std::uint64_t const stride = std::uint64_t(gridDim.x) * blockDim.x;
    unsigned char* o = static_cast<unsigned char*>(dst);
    for (std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < dst_bytes; i += stride) o[i] = fill;
    return;
  }
  std::uint8_t const variant = std::uint8_t(d.h.flags & 0xFFu);
  unsigned char const* codes = blob + d.lay.header_bytes + d.lay.meta_bytes;
  switch (codec_id(d.h.codec)) {
    case codec_id::raw:
      copy_bytes(static_cast<unsigned char*>(dst), codes, d.lay.code_bytes);
      break;
    case codec_id::mask:
      if (variant == std::uint8_t(mask_mode::predicate)) {
        predicate_params q;
        memcpy(&q, d.params, sizeof q);
        float const tv = predicate(q.pred) == predicate::ne && !dp.predicate ? q.level : dp.true_value;
        switch (d.h.dtype) {
          case 0: predicate_decode<0>(codes, d.h.numel, tv, dp.false_value, dst); break;
          case 1: predicate_decode<1>(codes, d.h.numel, tv, dp.false_value, dst); break;
          case 2: predicate_decode<2>(codes, d.h.numel, tv, dp.false_value, dst); break;
          default: predicate_decode<9>(codes, d.h.numel, tv, dp.false_value, dst); break;
        }
      } else {
        std::uint8_t* out = static_cast<std::uint8_t*>(dst);
        for (std::uint64_t e = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < d.h.numel;
             e += std::uint64_t(gridDim.x) * blockDim.x)
          out[e] = std::uint8_t((codes[e / 8] >> (e % 8)) & 1u);
      }
      break;
    case codec_id::window: {
      window_params w;
      memcpy(&w, d.params, sizeof w);
      if (d.h.dtype == std::uint8_t(dtype::int64))
        window_decode(codes, w, d.h.numel, d.h.bits, static_cast<std::int64_t*>(dst), status);
      else
        window_decode(codes, w, d.h.numel, d.h.bits, static_cast<std::int32_t*>(dst), status);
      break;
    }
    case codec_id::quant:
      if (variant == std::uint8_t(quant_mode::normalized)) quant_decode_dt<k_normalized>(blob, d, dp, dst, status);
      else if (variant == std::uint8_t(quant_mode::boundary)) quant_decode_dt<k_boundary>(blob, d, dp, dst, status);
      else quant_decode_dt<k_plain>(blob, d, dp, dst, status);
      break;
  }
}

/// Status word used when the caller passes none (writes to it are never read).
__device__ std::uint32_t g_status_sink;

template <int Dt, int CPL, int V>
void launch_quant(void const* src, bool vec, quant_args const& a, unsigned char* blob, header_bytes_arg const& hdr,
                  cudaStream_t stream) {
  using S = typename dev_io<Dt>::storage;
  std::uint64_t const blocks = a.n_groups == 0 ? 1 : (a.n_groups + k_warps_per_block - 1) / k_warps_per_block;
  GACT_EXPECTS(blocks <= 0x7FFFFFFFull, "encode_cuda: tensor too large for one launch");
  auto const* s = static_cast<S const*>(src);
  if (vec)
    quant_encode_kernel<Dt, CPL, true, V><<<unsigned(blocks), 32 * k_warps_per_block, 0, stream>>>(s, a, blob, hdr);
  else
    quant_encode_kernel<Dt, CPL, false, V><<<unsigned(blocks), 32 * k_warps_per_block, 0, stream>>>(s, a, blob, hdr);
}

template <int Dt, int V>
void launch_quant_cpl(void const* src, bool vec, quant_args const& a, unsigned char* blob, header_bytes_arg const& hdr,
                      cudaStream_t stream) {
  if (a.G <= 256) launch_quant<Dt, 1, V>(src, vec, a, blob, hdr, stream);
  else if (a.G == 512) launch_quant<Dt, 2, V>(src, vec, a, blob, hdr, stream);
  else launch_quant<Dt, 4, V>(src, vec, a, blob, hdr, stream);
}

template <int Dt>
void launch_quant_dt(std::uint8_t variant, void const* src, bool vec, quant_args const& a, unsigned char* blob,
                     header_bytes_arg const& hdr, cudaStream_t stream) {
  if (variant == std::uint8_t(quant_mode::normalized)) launch_quant_cpl<Dt, k_normalized>(src, vec, a, blob, hdr, stream);
  else if (variant == std::uint8_t(quant_mode::boundary)) launch_quant_cpl<Dt, k_boundary>(src, vec, a, blob, hdr, stream);
  else launch_quant_cpl<Dt, k_plain>(src, vec, a, blob, hdr, stream);
}

unsigned grid_for(std::uint64_t items, unsigned threads) {
  std::uint64_t const b = (items + threads - 1) / threads;
  return unsigned(b == 0 ? 1 : (b > 65535u * 4u ? 65535u * 4u : b));
}

/// Blocks that fill the current device (a few per multiprocessor), cached per device ordinal.
unsigned device_grid_cap() {
  static std::array<std::atomic<unsigned>, 64> cap{};
  int dev = 0;
  GACT_CODEC_CUDA_TRY(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) return 1024;
  unsigned c = cap[std::size_t(dev)].load(std::memory_order_relaxed);
  if (c == 0) {
    int sms = 0;
    GACT_CODEC_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    c = unsigned(sms > 0 ? sms : 1) * k_blocks_per_sm;
    cap[std::size_t(dev)].store(c, std::memory_order_relaxed);
  }
  return c;
}

}  // namespace

encode_result encode_cuda(void const* src, dtype dt, std::span<std::int64_t const> shape, encode_params const& p,
                          void* blob, std::size_t capacity, cudaStream_t stream, device_verdict const* verdict) {
  detail::ensure_stats_registered();
  hd::blob_layout lay;
  blob_header const h = detail::make_header(dt, shape, p, &lay);
  std::uint8_t const variant = std::uint8_t(h.flags);
  GACT_EXPECTS(capacity >= lay.total, "encode_cuda: capacity " + std::to_string(capacity) + " < blob size " +
                                          std::to_string(lay.total));
  GACT_EXPECTS(blob != nullptr, "encode_cuda: blob is null");
  GACT_EXPECTS(h.numel == 0 || src != nullptr, "encode_cuda: src is null");
  GACT_EXPECTS(reinterpret_cast<std::uintptr_t>(blob) % 16 == 0, "encode_cuda: blob must be 16-byte aligned");
  GACT_EXPECTS(p.codec != codec_id::mask || variant != std::uint8_t(mask_mode::bytes) || dt == dtype::boolean,
               "encode_cuda: mask on the device takes bool tensors only (a uint8 tensor cannot be checked for "
               "0/1 without a sync); store it with codec raw or encode it on the host");
  GACT_EXPECTS(p.codec != codec_id::mask || variant != std::uint8_t(mask_mode::predicate) ||
                   predicate(p.pred.pred) != predicate::ne,
               "encode_cuda: a two-level (ne) mask is encoded on the host only (its level cannot be checked "
               "without a sync); quantize the values instead");
  std::size_t const esize = dtype_size(dt);
  GACT_EXPECTS(reinterpret_cast<std::uintptr_t>(src) % esize == 0, "encode_cuda: src is not aligned to its dtype");
  header_bytes_arg hdr{};
  std::int64_t sh[k_max_ndim] = {};
  for (std::size_t i = 0; i < shape.size(); ++i) sh[i] = shape[i];
  unsigned char params[160] = {};
  detail::fill_params(p, variant, params);
  hd::write_header(hdr.b, h, sh, params);
  hdr.n = h.header_bytes;
  auto* out = static_cast<unsigned char*>(blob);
  std::uint64_t const code_off = lay.header_bytes + lay.meta_bytes;
  switch (p.codec) {
    case codec_id::quant: {
      quant_args a{};
      a.numel = h.numel;
      a.n_groups = lay.n_groups;
      a.seed = p.seed;
      a.key = p.key;
      a.G = p.group_size;
      a.bits = p.bits;
      a.stats_off = lay.header_bytes;
      a.meta_off = lay.header_bytes + lay.stats_bytes;
      a.code_off = code_off;
      a.meta_pad_end = code_off;
      a.count = p.norm_count;
      a.inner = p.norm_inner;
      a.shift = p.norm_shift;
      a.scale = p.norm_scale;
      a.max_magnitude = p.max_magnitude;
      std::memcpy(&a.boundary, params, variant == std::uint8_t(quant_mode::boundary) ? sizeof a.boundary : 0);
      if (verdict != nullptr) {
        GACT_EXPECTS(verdict->word != nullptr && verdict->counter != nullptr && verdict->seq != 0,
                     "encode_cuda: a verdict needs its mapped word, its device counter and a nonzero seq");
        a.verdict = *verdict;
      }
      bool const vec = reinterpret_cast<std::uintptr_t>(src) % 16 == 0;
      if (dt == dtype::float32) launch_quant_dt<0>(variant, src, vec, a, out, hdr, stream);
      else if (dt == dtype::float16) launch_quant_dt<1>(variant, src, vec, a, out, hdr, stream);
      else if (dt == dtype::bfloat16) launch_quant_dt<2>(variant, src, vec, a, out, hdr, stream);
      else launch_quant_dt<9>(variant, src, false, a, out, hdr, stream);
      break;
    }
    case codec_id::mask:
      if (variant == std::uint8_t(mask_mode::predicate)) {
        predicate_params q;
        std::memcpy(&q, params, sizeof q);
        unsigned const grid = grid_for(lay.code_bytes, 256);
        if (dt == dtype::float32)
          predicate_encode_kernel<0><<<grid, 256, 0, stream>>>(static_cast<float const*>(src), h.numel, q, out, code_off, hdr);
        else if (dt == dtype::float16)
          predicate_encode_kernel<1><<<grid, 256, 0, stream>>>(static_cast<std::uint16_t const*>(src), h.numel, q, out, code_off, hdr);
        else if (dt == dtype::bfloat16)
          predicate_encode_kernel<2><<<grid, 256, 0, stream>>>(static_cast<std::uint16_t const*>(src), h.numel, q, out, code_off, hdr);
        else
          predicate_encode_kernel<9><<<grid, 256, 0, stream>>>(static_cast<double const*>(src), h.numel, q, out, code_off, hdr);
      } else {
        mask_encode_kernel<<<grid_for(lay.code_bytes, 256), 256, 0, stream>>>(
            static_cast<std::uint8_t const*>(src), h.numel, out, code_off, hdr);
      }
      break;
    case codec_id::window: {
      window_params w;
      std::memcpy(&w, params, sizeof w);
      std::uint32_t* st = nullptr;
      GACT_CODEC_CUDA_TRY(cudaGetSymbolAddress(reinterpret_cast<void**>(&st), g_status_sink));
      unsigned const grid = grid_for((h.numel + 7) / 8, 256);
      device_verdict const v = verdict != nullptr ? *verdict : device_verdict{};
      if (dt == dtype::int64)
        window_encode_kernel<<<grid, 256, 0, stream>>>(static_cast<std::int64_t const*>(src), h.numel, p.bits, w, out,
                                                       code_off, hdr, st, v);
      else
        window_encode_kernel<<<grid, 256, 0, stream>>>(static_cast<std::int32_t const*>(src), h.numel, p.bits, w, out,
                                                       code_off, hdr, st, v);
      break;
    }
    case codec_id::raw:
      raw_encode_kernel<<<grid_for(lay.code_bytes / 16 + 1, 256), 256, 0, stream>>>(
          static_cast<unsigned char const*>(src), lay.code_bytes, out, code_off, hdr);
      break;
  }
  GACT_CODEC_CUDA_TRY(cudaGetLastError());
  detail::count_encode(p.codec, h.numel * esize, lay.total);
  return {std::size_t(lay.total), p.codec, false, refusal::none, false};
}

void decode_cuda(void const* blob, std::size_t len, void* dst, std::size_t dst_bytes, cudaStream_t stream,
                 std::uint32_t* status, decode_params const& dp) {
  detail::ensure_stats_registered();
  GACT_EXPECTS(reinterpret_cast<std::uintptr_t>(blob) % 16 == 0,
               "decode_cuda: the blob must be 16-byte aligned (the kernels read the codes as words)");
  GACT_EXPECTS(reinterpret_cast<std::uintptr_t>(dst) % 8 == 0 || dst_bytes == 0,
               "decode_cuda: the destination must be 8-byte aligned");
  std::uint32_t* st = status;
  if (st == nullptr) {
    GACT_CODEC_CUDA_TRY(cudaGetSymbolAddress(reinterpret_cast<void**>(&st), g_status_sink));
  }
  GACT_CODEC_CUDA_TRY(cudaMemsetAsync(st, 0, sizeof(std::uint32_t), stream));
  unsigned const cap = device_grid_cap();
  unsigned grid = grid_for(dst_bytes / 8 + 1, k_decode_threads);
  if (grid > cap) grid = cap;
  decode_kernel<<<grid, k_decode_threads, 0, stream>>>(static_cast<unsigned char const*>(blob), len, dst, dst_bytes,
                                                       st, dp);
  GACT_CODEC_CUDA_TRY(cudaGetLastError());
  detail::count_gpu_decode(dst_bytes);
}

}  // namespace gact::codec
