// gact/codecs/codec_cuda.cu
//
// The CUDA executor: one kernel launch per encode and one per decode, on the
// caller's stream, with no host synchronization. The kernels call the same
// GACT_HD math as the CPU executor (quant_math.hpp, philox.hpp, float16.hpp,
// format.hpp), so an encode produces the same bytes as encode_cpu.
//
// quant encode: one warp per group. Each lane owns up to four 8-element chunks
// (chunk c of the group goes to lane c % 32), loads them with 16-byte vector
// loads when the source is aligned (scalar, bounds-checked loads for the tail
// chunk), reduces min/max over the warp with cub::WarpReduce, and then, from
// registers (one pass over the input), draws one Philox block per chunk,
// quantizes, and stores the chunk's b bytes of codes. Block 0 also writes the
// header, which the host built (header bytes are a kernel argument).
// A group holding NaN/±Inf is written as (NaN, NaN) metadata with zero codes;
// every decoder turns it into NaN (the host is not told: that would need a sync).
//
// decode: a grid-stride loop over 8-element chunks. Every block validates the
// header with hd::check_blob against the blob length and the destination size
// before reading anything else; group metadata is checked as it is read. A
// corrupt blob makes the kernel fill dst with 0xFF bytes (NaN for float dtypes)
// and record the hd::blob_status in the optional status word.
#include "codecs/codec.hpp"

#include "allocator/error.hpp"
#include "codecs/float16.hpp"
#include "codecs/philox.hpp"
#include "codecs/quant_math.hpp"

#include <cub/warp/warp_reduce.cuh>
#include <cuda/functional>
#include <cuda_runtime.h>

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

/// The header bytes (fixed part, shape, padding) as a kernel argument.
struct header_bytes_arg {
  unsigned char b[64 + 8 * k_max_ndim];
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

/// Load the 8 elements of chunk `e` (element index of its first element) into v; elements at or past
/// `end` are left at 0 and marked invalid.
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
    } else {
      uint4 const a = *reinterpret_cast<uint4 const*>(src + e);
      std::uint32_t const w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[2 * j] = dev_io<Dt>::load(S(w[j] & 0xFFFFu));
        v[2 * j + 1] = dev_io<Dt>::load(S(w[j] >> 16));
      }
    }
    return 8;
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

// ---- encode kernels ---------------------------------------------------------------------------

/// One warp per group; CPL = chunks per lane (G / 256, at least 1).
template <int Dt, int CPL, bool Vec>
__global__ void __launch_bounds__(32 * k_warps_per_block)
    quant_encode_kernel(typename dev_io<Dt>::storage const* __restrict__ src, std::uint64_t numel, int G, int bits,
                        std::uint64_t seed, std::uint64_t key, std::uint64_t n_groups, unsigned char* __restrict__ blob,
                        std::uint64_t meta_off, std::uint64_t code_off, header_bytes_arg hdr) {
  using S = typename dev_io<Dt>::storage;
  using warp_reduce = cub::WarpReduce<float>;
  __shared__ typename warp_reduce::TempStorage temp[k_warps_per_block];
  write_header_block0(blob, hdr);
  if (blockIdx.x == 0) {  // the metadata section's zero padding
    std::uint64_t const used = n_groups * 2 * sizeof(S);
    for (std::uint64_t i = used + threadIdx.x; i < code_off - meta_off; i += blockDim.x) blob[meta_off + i] = 0;
  }
  int const warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  std::uint64_t const g = std::uint64_t(blockIdx.x) * k_warps_per_block + std::uint64_t(warp);
  if (g >= n_groups) return;
  std::uint64_t const e0 = g * std::uint64_t(G);
  std::uint64_t const end = e0 + std::uint64_t(G) < numel ? e0 + std::uint64_t(G) : numel;
  int const chunks = G / 8;

  float v[CPL][8];
  float lo = __int_as_float(0x7F800000), hi = __int_as_float(0xFF800000);  // +Inf / -Inf identities
  bool bad = false;
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    int const c = lane + 32 * i;
    std::uint64_t const e = e0 + 8u * std::uint64_t(c);
    int n = 0;
    if (c < chunks && e < end) n = load_chunk<Dt, Vec>(src, e, end, v[i]);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < n) {
        bad |= !hd::is_finite_bits(v[i][j]);
        lo = fminf(lo, v[i][j]);
        hi = fmaxf(hi, v[i][j]);
      }
    }
  }
  bad = __any_sync(0xFFFFFFFFu, bad);
  lo = warp_reduce(temp[warp]).Reduce(lo, cuda::minimum<>{});
  lo = __shfl_sync(0xFFFFFFFFu, lo, 0);
  __syncwarp();
  hi = warp_reduce(temp[warp]).Reduce(hi, cuda::maximum<>{});
  hi = __shfl_sync(0xFFFFFFFFu, hi, 0);
  lo = hd::canonical_zero(lo);
  hi = hd::canonical_zero(hi);
  if (bad) {
    lo = __int_as_float(0x7FC00000);
    hi = lo;
  }
  if (lane == 0) {
    S* m = reinterpret_cast<S*>(blob + meta_off) + 2 * g;
    if constexpr (Dt == 0) {
      m[0] = lo;
      m[1] = hi;
    } else {
      m[0] = bad ? S(0x7FFF) : dev_io<Dt>::store(lo);  // 0x7FFF: NaN in float16 and bfloat16
      m[1] = bad ? S(0x7FFF) : dev_io<Dt>::store(hi);
    }
  }
  hd::group_params const p = hd::make_params(lo, hi, bits);
  bool const quantize = !bad && p.step > 0.0f;
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    int const c = lane + 32 * i;
    std::uint64_t const e = e0 + 8u * std::uint64_t(c);
    if (c >= chunks || e >= end) continue;
    std::uint64_t word = 0;
    if (quantize) {
      hd::philox_block const r = hd::noise_block(seed, key, e / 8);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (e + std::uint64_t(j) < end)
          word |= std::uint64_t(hd::quantize(v[i][j], p, hd::noise_lane(r, j))) << (j * bits);
      }
    }
    store_codes(blob + code_off + (e / 8) * std::uint64_t(bits), bits, word);
  }
}

/// Mask: one thread per output byte (8 elements, element e at bit e % 8); bool input, nonzero is 1.
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

template <int Dt>
__device__ void quant_decode(unsigned char const* blob, blob_header const& h, hd::blob_layout const& lay, void* dst,
                             std::uint32_t* status) {
  using S = typename dev_io<Dt>::storage;
  S* out = static_cast<S*>(dst);
  S const* meta = reinterpret_cast<S const*>(blob + lay.header_bytes);
  unsigned char const* codes = blob + lay.header_bytes + lay.meta_bytes;
  int const bits = h.bits, G = h.group_size;
  std::uint32_t const mask = (1u << bits) - 1u;
  std::uint64_t const nchunks = (h.numel + 7) / 8;
  bool const vec_out = (reinterpret_cast<std::uintptr_t>(dst) & 15u) == 0;
  for (std::uint64_t c = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < nchunks;
       c += std::uint64_t(gridDim.x) * blockDim.x) {
    std::uint64_t const e = 8 * c;
    std::uint64_t const g = e / std::uint64_t(G);
    S mv[2];
    std::memcpy(mv, meta + 2 * g, sizeof mv);
    float const lo = dev_io<Dt>::load(mv[0]), hi = dev_io<Dt>::load(mv[1]);
    float r[8];
    if (!hd::meta_ok(lo, hi)) {
      atomicMax(status, std::uint32_t(hd::blob_status::bad_group_meta));
#pragma unroll
      for (int j = 0; j < 8; ++j) r[j] = __int_as_float(0x7FFFFFFF);
    } else {
      hd::group_params const p = hd::make_params(lo, hi, bits);
      std::uint64_t word = 0;
      for (int b = 0; b < bits; ++b) word |= std::uint64_t(codes[c * std::uint64_t(bits) + std::uint64_t(b)]) << (8 * b);
#pragma unroll
      for (int j = 0; j < 8; ++j) r[j] = hd::dequantize(std::int32_t((word >> (j * bits)) & mask), p);
    }
    if (vec_out && e + 8 <= h.numel) {
      if constexpr (sizeof(S) == 4) {
        reinterpret_cast<float4*>(out + e)[0] = make_float4(r[0], r[1], r[2], r[3]);
        reinterpret_cast<float4*>(out + e)[1] = make_float4(r[4], r[5], r[6], r[7]);
      } else {
        std::uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          w[j] = std::uint32_t(dev_io<Dt>::store(r[2 * j])) | (std::uint32_t(dev_io<Dt>::store(r[2 * j + 1])) << 16);
        *reinterpret_cast<uint4*>(out + e) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    } else {
      for (int j = 0; j < 8 && e + std::uint64_t(j) < h.numel; ++j) out[e + std::uint64_t(j)] = dev_io<Dt>::store(r[j]);
    }
  }
}

__global__ void decode_kernel(unsigned char const* __restrict__ blob, std::uint64_t len, void* __restrict__ dst,
                              std::uint64_t dst_bytes, std::uint32_t* status) {
  __shared__ blob_header h;
  __shared__ hd::blob_layout lay;
  __shared__ std::uint32_t st;
  if (threadIdx.x == 0) {
    std::int64_t shape[k_max_ndim];
    blob_header hh;
    hd::blob_layout ll{};
    hd::blob_status s = blob == nullptr ? hd::blob_status::truncated_header : hd::check_blob(blob, len, &hh, shape, &ll);
    if (s == hd::blob_status::ok && hh.numel * std::uint64_t(hd::dtype_bytes(hh.dtype)) > dst_bytes)
      s = hd::blob_status::dst_too_small;
    h = hh;
    lay = ll;
    st = std::uint32_t(s);
  }
  __syncthreads();
  if (st != 0) {
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicMax(status, st);
    std::uint64_t const stride = std::uint64_t(gridDim.x) * blockDim.x;
    unsigned char* d = static_cast<unsigned char*>(dst);
    for (std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < dst_bytes; i += stride) d[i] = 0xFF;
    return;
  }
  switch (codec_id(h.codec)) {
    case codec_id::raw:
      copy_bytes(static_cast<unsigned char*>(dst), blob + lay.header_bytes, lay.code_bytes);
      break;
    case codec_id::mask: {
      std::uint8_t* out = static_cast<std::uint8_t*>(dst);
      unsigned char const* codes = blob + lay.header_bytes;
      for (std::uint64_t e = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < h.numel;
           e += std::uint64_t(gridDim.x) * blockDim.x)
        out[e] = std::uint8_t((codes[e / 8] >> (e % 8)) & 1u);
      break;
    }
    case codec_id::quant:
      if (h.dtype == 0) quant_decode<0>(blob, h, lay, dst, status);
      else if (h.dtype == 1) quant_decode<1>(blob, h, lay, dst, status);
      else quant_decode<2>(blob, h, lay, dst, status);
      break;
  }
}

/// Status word used when the caller passes none (writes to it are never read).
__device__ std::uint32_t g_status_sink;

template <int Dt, int CPL>
void launch_quant(void const* src, bool vec, std::uint64_t numel, encode_params const& p, std::uint64_t n_groups,
                  unsigned char* blob, hd::blob_layout const& lay, header_bytes_arg const& hdr, cudaStream_t stream) {
  using S = typename dev_io<Dt>::storage;
  std::uint64_t const blocks = n_groups == 0 ? 1 : (n_groups + k_warps_per_block - 1) / k_warps_per_block;
  GACT_EXPECTS(blocks <= 0x7FFFFFFFull, "encode_cuda: tensor too large for one launch");
  auto const* s = static_cast<S const*>(src);
  if (vec)
    quant_encode_kernel<Dt, CPL, true><<<unsigned(blocks), 32 * k_warps_per_block, 0, stream>>>(
        s, numel, p.group_size, p.bits, p.seed, p.key, n_groups, blob, lay.header_bytes,
        lay.header_bytes + lay.meta_bytes, hdr);
  else
    quant_encode_kernel<Dt, CPL, false><<<unsigned(blocks), 32 * k_warps_per_block, 0, stream>>>(
        s, numel, p.group_size, p.bits, p.seed, p.key, n_groups, blob, lay.header_bytes,
        lay.header_bytes + lay.meta_bytes, hdr);
}

template <int Dt>
void launch_quant_dt(void const* src, bool vec, std::uint64_t numel, encode_params const& p, std::uint64_t n_groups,
                     unsigned char* blob, hd::blob_layout const& lay, header_bytes_arg const& hdr, cudaStream_t stream) {
  if (p.group_size <= 256) launch_quant<Dt, 1>(src, vec, numel, p, n_groups, blob, lay, hdr, stream);
  else if (p.group_size == 512) launch_quant<Dt, 2>(src, vec, numel, p, n_groups, blob, lay, hdr, stream);
  else launch_quant<Dt, 4>(src, vec, numel, p, n_groups, blob, lay, hdr, stream);
}

unsigned grid_for(std::uint64_t items, unsigned threads) {
  std::uint64_t const b = (items + threads - 1) / threads;
  return unsigned(b == 0 ? 1 : (b > 65535u * 4u ? 65535u * 4u : b));
}

}  // namespace

encode_result encode_cuda(void const* src, dtype dt, std::span<std::int64_t const> shape, encode_params const& p,
                          void* blob, std::size_t capacity, cudaStream_t stream) {
  detail::ensure_stats_registered();
  hd::blob_layout lay;
  blob_header const h = detail::make_header(dt, shape, p, &lay);
  GACT_EXPECTS(capacity >= lay.total, "encode_cuda: capacity " + std::to_string(capacity) + " < blob size " +
                                          std::to_string(lay.total));
  GACT_EXPECTS(blob != nullptr, "encode_cuda: blob is null");
  GACT_EXPECTS(h.numel == 0 || src != nullptr, "encode_cuda: src is null");
  GACT_EXPECTS(reinterpret_cast<std::uintptr_t>(blob) % 16 == 0, "encode_cuda: blob must be 16-byte aligned");
  GACT_EXPECTS(p.codec != codec_id::mask || dt == dtype::boolean,
               "encode_cuda: mask on the device takes bool tensors only (a uint8 tensor cannot be checked for "
               "0/1 without a sync); store it with codec raw or encode it on the host");
  std::size_t const esize = dtype_size(dt);
  GACT_EXPECTS(reinterpret_cast<std::uintptr_t>(src) % esize == 0, "encode_cuda: src is not aligned to its dtype");
  header_bytes_arg hdr{};
  std::int64_t sh[k_max_ndim] = {};
  for (std::size_t i = 0; i < shape.size(); ++i) sh[i] = shape[i];
  hd::write_header(hdr.b, h, sh);
  hdr.n = h.header_bytes;
  auto* out = static_cast<unsigned char*>(blob);
  switch (p.codec) {
    case codec_id::quant: {
      bool const vec = reinterpret_cast<std::uintptr_t>(src) % 16 == 0;
      if (dt == dtype::float32) launch_quant_dt<0>(src, vec, h.numel, p, lay.n_groups, out, lay, hdr, stream);
      else if (dt == dtype::float16) launch_quant_dt<1>(src, vec, h.numel, p, lay.n_groups, out, lay, hdr, stream);
      else launch_quant_dt<2>(src, vec, h.numel, p, lay.n_groups, out, lay, hdr, stream);
      break;
    }
    case codec_id::mask:
      mask_encode_kernel<<<grid_for(lay.code_bytes, 256), 256, 0, stream>>>(
          static_cast<std::uint8_t const*>(src), h.numel, out, lay.header_bytes, hdr);
      break;
    case codec_id::raw:
      raw_encode_kernel<<<grid_for(lay.code_bytes / 16 + 1, 256), 256, 0, stream>>>(
          static_cast<unsigned char const*>(src), lay.code_bytes, out, lay.header_bytes, hdr);
      break;
  }
  GACT_CODEC_CUDA_TRY(cudaGetLastError());
  detail::count_encode(p.codec, h.numel * esize, lay.total);
  return {std::size_t(lay.total), p.codec, false};
}

void decode_cuda(void const* blob, std::size_t len, void* dst, std::size_t dst_bytes, cudaStream_t stream,
                 std::uint32_t* status) {
  detail::ensure_stats_registered();
  std::uint32_t* st = status;
  if (st == nullptr) {
    GACT_CODEC_CUDA_TRY(cudaGetSymbolAddress(reinterpret_cast<void**>(&st), g_status_sink));
  }
  GACT_CODEC_CUDA_TRY(cudaMemsetAsync(st, 0, sizeof(std::uint32_t), stream));
  decode_kernel<<<grid_for(dst_bytes / 8 + 1, k_decode_threads), k_decode_threads, 0, stream>>>(
      static_cast<unsigned char const*>(blob), len, dst, dst_bytes, st);
  GACT_CODEC_CUDA_TRY(cudaGetLastError());
}

}  // namespace gact::codec
