// gact/codecs/quant_cpu.cpp
//
// The CPU executor of the quant codec: splits the groups of a tensor into one
// contiguous range per thread and runs the per-group loops of quant_groups.cpp
// on each, choosing at run time the build of those loops that the CPU can run
// (avx2 + f16c on x86-64 CPUs that have them, the baseline build otherwise; both give
// identical bytes). The threads parameter is resolved by the caller (codec.cpp).
#include "codecs/codec.hpp"

#include <atomic>
#include <thread>
#include <vector>

#if defined(GACT_CODEC_HAVE_AVX2)
#include <cpuid.h>
#endif

namespace gact::codec::detail {

namespace generic {
bool encode_range(void const* src, dtype dt, std::uint64_t numel, int bits, int G, std::uint64_t seed,
                  std::uint64_t key, unsigned char* meta, unsigned char* codes, std::uint64_t g0, std::uint64_t g1,
                  int* failed);
void decode_range(unsigned char const* meta, unsigned char const* codes, dtype dt, std::uint64_t numel, int bits,
                  int G, void* dst, std::uint64_t g0, std::uint64_t g1);
}  // namespace generic

#if defined(GACT_CODEC_HAVE_AVX2)
namespace avx2 {
bool encode_range(void const* src, dtype dt, std::uint64_t numel, int bits, int G, std::uint64_t seed,
                  std::uint64_t key, unsigned char* meta, unsigned char* codes, std::uint64_t g0, std::uint64_t g1,
                  int* failed);
void decode_range(unsigned char const* meta, unsigned char const* codes, dtype dt, std::uint64_t numel, int bits,
                  int G, void* dst, std::uint64_t g0, std::uint64_t g1);
}  // namespace avx2
#endif

namespace {

struct isa_table {
  decltype(&generic::encode_range) encode;
  decltype(&generic::decode_range) decode;
  char const* name;
};

isa_table const k_generic{&generic::encode_range, &generic::decode_range, "generic"};

isa_table const* best_isa() {
#if defined(GACT_CODEC_HAVE_AVX2)
  static isa_table const avx2_table{&avx2::encode_range, &avx2::decode_range, "avx2"};
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  bool const f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
  if (__builtin_cpu_supports("avx2") && f16c) return &avx2_table;
#endif
  return &k_generic;
}

std::atomic<isa_table const*> g_isa{nullptr};

isa_table const& isa() {
  isa_table const* t = g_isa.load(std::memory_order_acquire);
  if (t == nullptr) {
    t = best_isa();
    g_isa.store(t, std::memory_order_release);
  }
  return *t;
}

/// Run fn(begin, end) over [0, n) split into `threads` contiguous ranges (the caller runs the first).
template <typename Fn>
void parallel_ranges(std::uint64_t n, int threads, Fn const& fn) {
  if (threads <= 1 || n < 2) {
    fn(std::uint64_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(std::size_t(threads - 1));
  std::uint64_t const per = n / std::uint64_t(threads), extra = n % std::uint64_t(threads);
  std::uint64_t begin = 0;
  std::uint64_t first_end = 0;
  for (int t = 0; t < threads; ++t) {
    std::uint64_t const end = begin + per + (std::uint64_t(t) < extra ? 1 : 0);
    if (t == 0) {
      first_end = end;
    } else {
      pool.emplace_back([&fn, begin, end] { fn(begin, end); });
    }
    begin = end;
  }
  fn(std::uint64_t{0}, first_end);
  for (auto& th : pool) th.join();
}

}  // namespace

char const* quant_cpu_isa() noexcept { return isa().name; }

bool force_generic_quant_cpu(bool generic) noexcept {
  g_isa.store(generic ? &k_generic : best_isa(), std::memory_order_release);
  return best_isa() != &k_generic;
}

bool quant_encode_cpu(void const* src, dtype dt, std::uint64_t numel, int bits, int group_size,
                      std::uint64_t seed, std::uint64_t key, unsigned char* meta, unsigned char* codes,
                      int threads) {
  if (numel == 0) return true;
  std::uint64_t const n_groups = (numel + std::uint64_t(group_size) - 1) / std::uint64_t(group_size);
  int failed = 0;
  auto const enc = isa().encode;
  parallel_ranges(n_groups, threads, [&](std::uint64_t a, std::uint64_t b) {
    enc(src, dt, numel, bits, group_size, seed, key, meta, codes, a, b, &failed);
  });
  return __atomic_load_n(&failed, __ATOMIC_RELAXED) == 0;
}

void quant_decode_cpu(unsigned char const* meta, unsigned char const* codes, dtype dt, std::uint64_t numel,
                      int bits, int group_size, void* dst, int threads) {
  if (numel == 0) return;
  std::uint64_t const n_groups = (numel + std::uint64_t(group_size) - 1) / std::uint64_t(group_size);
  auto const dec = isa().decode;
  parallel_ranges(n_groups, threads, [&](std::uint64_t a, std::uint64_t b) {
    dec(meta, codes, dt, numel, bits, group_size, dst, a, b);
  });
}

}  // namespace gact::codec::detail
