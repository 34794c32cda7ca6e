// gact/codecs/quant_cpu.cpp
//
// The CPU executor's threads and the quant codec's entry into its loops: splits
// the groups of a tensor into one contiguous range per thread and runs the
// per-group loops of quant_groups.cpp on each, choosing at run time the fastest
// build of those loops that the CPU can run (avx512 (F/BW/VL/DQ) or avx2, each
// with f16c, on x86-64 CPUs that have them; the baseline build otherwise; all give
// identical bytes). The threads
// parameter is resolved by the caller (codec.cpp).
//
// A thread that cannot be created (a container's pid limit, ulimit -v) is not an
// error: the calling thread runs the ranges no thread took (the same bytes, only
// slower), says so once in the log and counts it (codecs.thread_fallbacks). Never
// a std::thread destroyed while joinable (std::terminate), never a partial blob.
#include "codecs/codec.hpp"

#include "allocator/error.hpp"
#include "allocator/log.hpp"
#include "codecs/quant_math.hpp"

#include <atomic>
#include <cmath>
#include <limits>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#if defined(GACT_CODEC_HAVE_AVX2)
#include <cpuid.h>
#endif

namespace gact::codec::detail {

// The loops of quant_groups.cpp, one namespace per build of it.
#define GACT_QUANT_LOOPS(ISA)                                                                              \
  namespace ISA {                                                                                        \
  bool encode_range(void const* src, quant_job const& job, std::uint64_t g0, std::uint64_t g1, int* failed); \
  void decode_range(quant_job const& job, void* dst, std::uint64_t g0, std::uint64_t g1);                 \
  void mask_range(void const* src, dtype dt, predicate_params const& q, std::uint64_t m0, std::uint64_t m1,  \
                  std::uint64_t numel, std::uint8_t* out, mask_scan* scan);                              \
  bool float64_in_float_range(double const* x, std::uint64_t a, std::uint64_t b);                        \
  }
GACT_QUANT_LOOPS(generic)
#if defined(GACT_CODEC_HAVE_AVX2)
GACT_QUANT_LOOPS(avx2)
#endif
#if defined(GACT_CODEC_HAVE_AVX512)
GACT_QUANT_LOOPS(avx512)
#endif
#undef GACT_QUANT_LOOPS

namespace {

struct isa_table {
  decltype(&generic::encode_range) encode;
  decltype(&generic::decode_range) decode;
  decltype(&generic::mask_range) mask;
  decltype(&generic::float64_in_float_range) float64_fits;
  char const* name;
};

isa_table const k_generic{&generic::encode_range, &generic::decode_range, &generic::mask_range, &generic::float64_in_float_range, "generic"};

/// The builds this CPU can run, the baseline first and the fastest last.
std::vector<isa_table const*> const& available_isas() {
  static std::vector<isa_table const*> const list = [] {
    std::vector<isa_table const*> v{&k_generic};
#if defined(GACT_CODEC_HAVE_AVX2)
    static isa_table const avx2_table{&avx2::encode_range, &avx2::decode_range, &avx2::mask_range, &avx2::float64_in_float_range, "avx2"};
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    bool const f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
    if (__builtin_cpu_supports("avx2") && f16c) {
      v.push_back(&avx2_table);
#if defined(GACT_CODEC_HAVE_AVX512)
      static isa_table const avx512_table{&avx512::encode_range, &avx512::decode_range, &avx512::mask_range,
                                          &avx512::float64_in_float_range, "avx512"};
      if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        v.push_back(&avx512_table);
#endif
    }
#endif
    return v;
  }();
  return list;
}

isa_table const* best_isa() { return available_isas().back(); }

std::atomic<isa_table const*> g_isa{nullptr};

isa_table const& isa() {
  isa_table const* t = g_isa.load(std::memory_order_acquire);
  if (t == nullptr) {
    t = best_isa();
    g_isa.store(t, std::memory_order_release);
  }
  return *t;
}

// Test hook: fail the creation of the N-th worker thread (0 = never).
std::atomic<int> g_fail_thread_after{0};

}  // namespace

void parallel_for(std::uint64_t n, int threads, void (*fn)(void*, std::uint64_t, std::uint64_t), void* ctx) {
  if (threads <= 1 || n < 2) {
    fn(ctx, 0, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(std::size_t(threads - 1));
  std::uint64_t const per = n / std::uint64_t(threads), extra = n % std::uint64_t(threads);
  std::uint64_t begin = 0;
  std::uint64_t first_end = 0;
  std::string failure;
  for (int t = 0; t < threads; ++t) {
    std::uint64_t const end = begin + per + (std::uint64_t(t) < extra ? 1 : 0);
    if (t == 0) {
      first_end = end;
    } else {
      try {
        int const k = g_fail_thread_after.load(std::memory_order_relaxed);
        if (k > 0 && t >= k) throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
        pool.emplace_back([fn, ctx, begin, end] { fn(ctx, begin, end); });
      } catch (std::system_error const& e) {
        failure = e.what();
        break;
      }
    }
    begin = end;
  }
  fn(ctx, 0, first_end);
  if (!failure.empty()) {
    // [begin, n) is what the thread that could not start and the ones after it would have run.
    count_thread_fallback();
    GACT_WARN_CAPPED(1,
                     "codecs: could not start worker thread {} of {} ({}); the calling thread does its work "
                     "(slower). Lower GACT_THREADS or the torch thread count, or raise the process's thread limit",
                     pool.size() + 1, threads, failure);
    fn(ctx, begin, n);
  }
  for (auto& th : pool) th.join();
}

void fail_thread_creation_after(int k) noexcept { g_fail_thread_after.store(k, std::memory_order_relaxed); }

char const* quant_cpu_isa() noexcept { return isa().name; }

mask_scan mask_encode_cpu(void const* src, dtype dt, predicate_params const& q, std::uint64_t numel,
                          std::uint8_t* out, int threads) {
  std::uint64_t const nbytes = (numel + 7) / 8;
  int const t = threads < 1 ? 1 : threads;
  std::vector<mask_scan> scans(static_cast<std::size_t>(t));
  struct ctx_t {
    void const* src;
    dtype dt;
    predicate_params q;
    std::uint64_t numel, nbytes, per;
    std::uint8_t* out;
    mask_scan* scans;
    decltype(&generic::mask_range) fn;
  } ctx{src, dt, q, numel, nbytes, (nbytes + std::uint64_t(t) - 1) / std::uint64_t(t), out, scans.data(), isa().mask};
  parallel_for(std::uint64_t(t), t, [](void* c, std::uint64_t a, std::uint64_t b) {
    auto* x = static_cast<ctx_t*>(c);
    for (std::uint64_t i = a; i < b; ++i) {
      std::uint64_t const m0 = i * x->per, m1 = m0 + x->per < x->nbytes ? m0 + x->per : x->nbytes;
      if (m0 < m1) x->fn(x->src, x->dt, x->q, m0, m1, x->numel, x->out, &x->scans[i]);
    }
  }, &ctx);
  mask_scan r;
  bool first = true;
  for (auto const& s : scans) {
    r.in_range = r.in_range && s.in_range;
    r.nz_finite = r.nz_finite && s.nz_finite;
    if (s.have_nz) {
      r.nz_min = first || s.nz_min < r.nz_min ? s.nz_min : r.nz_min;
      r.nz_max = first || s.nz_max > r.nz_max ? s.nz_max : r.nz_max;
      r.have_nz = true;
      first = false;
    }
  }
  return r;
}

std::vector<char const*> quant_cpu_isas() {
  std::vector<char const*> names;
  for (auto const* t : available_isas()) names.push_back(t->name);
  return names;
}

bool use_quant_cpu_isa(char const* name) noexcept {
  if (name == nullptr) {
    g_isa.store(best_isa(), std::memory_order_release);
    return true;
  }
  for (auto const* t : available_isas()) {
    if (std::string_view(t->name) == name) {
      g_isa.store(t, std::memory_order_release);
      return true;
    }
  }
  return false;
}

namespace {
/// A normalized job's statistics as floats, 2 per block: (shift, scale) to encode, (shift, 1/scale) to decode.
std::vector<float> unpack_stats(quant_job const& job, bool inverse) {
  std::vector<float> st;
  if (job.variant != std::uint8_t(quant_mode::normalized)) return st;
  st.resize(2 * std::size_t(job.count));
  for (std::uint64_t b = 0; b < job.count; ++b) {
    float shift, scale;
    hd::load_stat(job.stats, b, shift, scale);
    st[2 * b] = shift;
    st[2 * b + 1] = inverse ? hd::inverse_scale(scale) : scale;
  }
  return st;
}
}  // namespace

/// Whether every value of a float64 tensor survives the float32 the quant codec computes in: NaN,
/// infinities, zero and magnitudes in [FLT_MIN, FLT_MAX] do (the non-finite ones are refused later, as
/// for every dtype); a nonzero magnitude below FLT_MIN (a float32 subnormal or zero: relative precision
/// lost) or above FLT_MAX (infinite in float32) does not.
static bool float64_fits_float(double const* x, std::uint64_t n, int threads) {
  struct ctx_t {
    double const* x;
    decltype(&generic::float64_in_float_range) fits;
    int bad;
  } ctx{x, isa().float64_fits, 0};
  parallel_for(n, threads, [](void* c, std::uint64_t a, std::uint64_t b) {
    auto* k = static_cast<ctx_t*>(c);
    if (!k->fits(k->x, a, b)) __atomic_store_n(&k->bad, 1, __ATOMIC_RELAXED);
  }, &ctx);
  return __atomic_load_n(&ctx.bad, __ATOMIC_RELAXED) == 0;
}

refusal quant_encode_cpu(void const* src, quant_job const& job_in, int threads) {
  if (job_in.numel == 0) return refusal::none;
  if (job_in.dt == dtype::float64 && !float64_fits_float(static_cast<double const*>(src), job_in.numel, threads))
    return refusal::float64_range;
  std::vector<float> const st = unpack_stats(job_in, false);
  quant_job job = job_in;
  job.statsf = st.data();
  std::uint64_t const n_groups = (job.numel + std::uint64_t(job.group_size) - 1) / std::uint64_t(job.group_size);
  struct ctx_t {
    void const* src;
    quant_job const* job;
    int failed;
    decltype(&generic::encode_range) enc;
  } ctx{src, &job, 0, isa().encode};
  parallel_for(n_groups, threads, [](void* c, std::uint64_t a, std::uint64_t b) {
    auto* x = static_cast<ctx_t*>(c);
    x->enc(x->src, *x->job, a, b, &x->failed);
  }, &ctx);
  return refusal(__atomic_load_n(&ctx.failed, __ATOMIC_RELAXED));
}

void quant_decode_cpu(quant_job const& job_in, void* dst, int threads) {
  if (job_in.numel == 0) return;
  std::vector<float> const st = unpack_stats(job_in, true);
  quant_job job = job_in;
  job.statsf = st.data();
  std::uint64_t const n_groups = (job.numel + std::uint64_t(job.group_size) - 1) / std::uint64_t(job.group_size);
  struct ctx_t {
    quant_job const* job;
    void* dst;
    decltype(&generic::decode_range) dec;
  } ctx{&job, dst, isa().decode};
  parallel_for(n_groups, threads, [](void* c, std::uint64_t a, std::uint64_t b) {
    auto* x = static_cast<ctx_t*>(c);
    x->dec(*x->job, x->dst, a, b);
  }, &ctx);
}

}  // namespace gact::codec::detail
