// gact/tests/allocator/test_model.cpp — randomized model-based test of the caching
// allocator over the host backend. Not a benchmark.
//
// 100k random allocations and frees (sizes log-uniform in [1 B, 256 MiB], several
// streams, occasional record_stream) checked against a reference model:
//   - live blocks never overlap (one registry shared by all threads);
//   - every block is 512-byte aligned and its size is the rounded request (small
//     pool) or at most 1 MiB more (an unsplit large block);
//   - a pattern written at the start, middle and end of each block survives until
//     the block is freed;
//   - single-threaded: after every operation allocation / allocated_bytes /
//     requested_bytes current and peak equal the model's exactly;
//   - threaded (each thread with its own model): at the end the current values equal
//     the sums, and max(thread peaks) <= peak <= sum(thread peaks);
//   - after freeing everything and empty_cache, reserved bytes are 0.
// The seed is fixed (GACT_TEST_SEED overrides it) and printed with any failure.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/host_backend.hpp"

using gact::alloc::caching_allocator;
using gact::alloc::pool_all;

namespace {

constexpr std::size_t k_mib = std::size_t{1} << 20;
constexpr std::size_t k_max_size = 256 * k_mib;

std::uint64_t test_seed() {
  if (char const* s = std::getenv("GACT_TEST_SEED"); s != nullptr && *s != '\0') return std::strtoull(s, nullptr, 10);
  return 20260514;
}

/// Address ranges of every live block of every thread.
class overlap_registry {
 public:
  /// Empty string, or why [p, p + n) overlaps a live block.
  std::string insert(std::uintptr_t p, std::size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    auto next = ranges_.lower_bound(p);
    if (next != ranges_.end() && next->first < p + n) return describe(p, n, next->first, next->second);
    if (next != ranges_.begin()) {
      auto prev = std::prev(next);
      if (prev->second > p) return describe(p, n, prev->first, prev->second);
    }
    ranges_.emplace(p, p + n);
    return {};
  }
  void erase(std::uintptr_t p) {
    std::lock_guard<std::mutex> lock(mu_);
    ranges_.erase(p);
  }

 private:
  static std::string describe(std::uintptr_t p, std::size_t n, std::uintptr_t b, std::uintptr_t e) {
    std::ostringstream os;
    os << "block [" << std::hex << p << ", " << p + n << ") overlaps live [" << b << ", " << e << ")";
    return os.str();
  }
  std::mutex mu_;
  std::map<std::uintptr_t, std::uintptr_t> ranges_;  // begin -> end
};

struct live_block {
  unsigned char* p;
  std::size_t requested;
  std::size_t size;
  std::uint64_t pattern;
};

struct model_config {
  std::uint64_t seed;
  int ops;
  std::size_t max_live_bytes;   // requested bytes live at once
  std::size_t max_live_count;
  std::vector<gact::device::stream_t> streams;
  bool check_stats_each_op;     // only when this runner is the allocator's only user
  int empty_cache_every;        // 0 = never
};

/// One thread's reference model and the random workload that drives it.
class model_runner {
 public:
  model_runner(caching_allocator& a, overlap_registry& reg, model_config cfg)
      : a_(a), reg_(reg), cfg_(std::move(cfg)), rng_(cfg_.seed) {}

  /// Runs the workload; returns the first failure ("" if none).
  std::string run() {
    std::uniform_real_distribution<double> log_size(0.0, std::log(double(k_max_size)));
    std::uniform_real_distribution<double> coin(0.0, 1.0);
    for (int op = 0; op < cfg_.ops; ++op) {
      op_ = op;
      bool const want_alloc = live_.empty() || coin(rng_) < 0.55;
      if (want_alloc) {
        auto size = static_cast<std::size_t>(std::exp(log_size(rng_)));
        size = std::max<std::size_t>(1, std::min(size, k_max_size));
        if (live_bytes_ + size <= cfg_.max_live_bytes && live_.size() < cfg_.max_live_count) {
          if (!allocate(size)) return error_;
        } else if (!free_random()) {
          return error_;
        }
      } else if (!free_random()) {
        return error_;
      }
      if (cfg_.check_stats_each_op && !check_stats()) return error_;
      if (cfg_.empty_cache_every > 0 && op % cfg_.empty_cache_every == cfg_.empty_cache_every - 1) a_.empty_cache();
    }
    return {};
  }

  /// Free every live block (pattern-checked); returns the first failure.
  std::string free_all() {
    while (!live_.empty()) {
      if (!free_at(live_.size() - 1)) return error_;
    }
    if (cfg_.check_stats_each_op && !check_stats()) return error_;
    return {};
  }

  std::int64_t count() const { return count_; }
  std::int64_t allocated() const { return allocated_; }
  std::int64_t requested() const { return requested_; }
  std::int64_t peak_count() const { return peak_count_; }
  std::int64_t peak_allocated() const { return peak_allocated_; }
  std::int64_t peak_requested() const { return peak_requested_; }

 private:
  bool fail(std::string const& what) {
    std::ostringstream os;
    os << "seed " << cfg_.seed << ", op " << op_ << ": " << what;
    error_ = os.str();
    return false;
  }

  // Byte j of a block holds byte (j mod 8) of its pattern, so overlapping spots in tiny
  // blocks agree.
  static unsigned char pattern_byte(std::uint64_t v, std::size_t j) {
    return static_cast<unsigned char>(v >> ((j % 8) * 8));
  }
  static void write_at(unsigned char* p, std::size_t n, std::size_t off, std::uint64_t v) {
    for (std::size_t j = off; j < std::min(off + 8, n); ++j) p[j] = pattern_byte(v, j);
  }
  static bool check_at(unsigned char const* p, std::size_t n, std::size_t off, std::uint64_t v) {
    for (std::size_t j = off; j < std::min(off + 8, n); ++j) {
      if (p[j] != pattern_byte(v, j)) return false;
    }
    return true;
  }
  static std::size_t mid(std::size_t n) { return n / 2; }
  static std::size_t end8(std::size_t n) { return n >= 8 ? n - 8 : 0; }

  bool allocate(std::size_t size) {
    auto const stream = cfg_.streams[rng_() % cfg_.streams.size()];
    void* raw = nullptr;
    try {
      raw = a_.allocate(size, stream);
    } catch (std::exception const& e) {
      return fail("allocate(" + std::to_string(size) + ") threw: " + e.what());
    }
    auto* p = static_cast<unsigned char*>(raw);
    if (p == nullptr) return fail("allocate returned nullptr");
    if (reinterpret_cast<std::uintptr_t>(p) % 512 != 0) return fail("pointer not 512-byte aligned");
    std::size_t const bs = a_.block_size(p);
    std::size_t const rounded = (size + 511) / 512 * 512;
    bool const small = rounded <= a_.options().small_size;
    if (bs < rounded || (small && bs != rounded) || (!small && bs - rounded > a_.options().small_size)) {
      return fail("block size " + std::to_string(bs) + " for a request of " + std::to_string(size));
    }
    if (std::string e = reg_.insert(reinterpret_cast<std::uintptr_t>(p), bs); !e.empty()) return fail(e);
    std::uint64_t const pat = rng_() | 1;
    write_at(p, size, 0, pat);
    write_at(p, size, mid(size), pat);
    write_at(p, size, end8(size), pat);
    if (cfg_.streams.size() > 1 && rng_() % 16 == 0) {
      a_.record_stream(p, cfg_.streams[rng_() % cfg_.streams.size()]);
    }
    live_.push_back({p, size, bs, pat});
    live_bytes_ += size;
    ++count_;
    allocated_ += static_cast<std::int64_t>(bs);
    requested_ += static_cast<std::int64_t>(size);
    peak_count_ = std::max(peak_count_, count_);
    peak_allocated_ = std::max(peak_allocated_, allocated_);
    peak_requested_ = std::max(peak_requested_, requested_);
    return true;
  }

  bool free_random() { return free_at(rng_() % live_.size()); }

  bool free_at(std::size_t i) {
    live_block const b = live_[i];
    live_[i] = live_.back();
    live_.pop_back();
    if (!check_at(b.p, b.requested, 0, b.pattern) || !check_at(b.p, b.requested, mid(b.requested), b.pattern) ||
        !check_at(b.p, b.requested, end8(b.requested), b.pattern)) {
      return fail("pattern of a " + std::to_string(b.requested) + "-byte block was overwritten");
    }
    reg_.erase(reinterpret_cast<std::uintptr_t>(b.p));
    a_.deallocate(b.p);
    live_bytes_ -= b.requested;
    --count_;
    allocated_ -= static_cast<std::int64_t>(b.size);
    requested_ -= static_cast<std::int64_t>(b.requested);
    return true;
  }

  bool check_stats() {
    auto const st = a_.stats();
    auto const& al = st.allocation[pool_all];
    auto const& ab = st.allocated_bytes[pool_all];
    auto const& rb = st.requested_bytes[pool_all];
    if (al.current != count_ || al.peak != peak_count_ || ab.current != allocated_ || ab.peak != peak_allocated_ ||
        rb.current != requested_ || rb.peak != peak_requested_) {
      std::ostringstream os;
      os << "stats differ from the model: allocation " << al.current << "/" << al.peak << " vs " << count_ << "/"
         << peak_count_ << ", allocated_bytes " << ab.current << "/" << ab.peak << " vs " << allocated_ << "/"
         << peak_allocated_ << ", requested_bytes " << rb.current << "/" << rb.peak << " vs " << requested_ << "/"
         << peak_requested_;
      return fail(os.str());
    }
    if (st.reserved_bytes[pool_all].current < ab.current) return fail("reserved < allocated");
    return true;
  }

  caching_allocator& a_;
  overlap_registry& reg_;
  model_config cfg_;
  std::mt19937_64 rng_;
  std::vector<live_block> live_;
  std::size_t live_bytes_ = 0;
  std::int64_t count_ = 0, allocated_ = 0, requested_ = 0;
  std::int64_t peak_count_ = 0, peak_allocated_ = 0, peak_requested_ = 0;
  int op_ = 0;
  std::string error_;
};

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("model: 70k single-threaded random operations on 3 streams") {
  std::uint64_t const seed = test_seed();
  INFO("seed " << seed << " (set GACT_TEST_SEED to replay)");
  gact::device::host_backend be;
  caching_allocator a(be);
  overlap_registry reg;
  model_config cfg{seed, 70'000, 2048 * k_mib, 512, {0, be.create_stream(), be.create_stream()}, true, 10'000};
  model_runner m(a, reg, cfg);
  CHECK(m.run() == "");
  CHECK(m.free_all() == "");
  a.empty_cache();
  CHECK(a.reserved_bytes() == 0);
  CHECK(be.reserved_bytes() == 0);
  auto const st = a.stats();
  CHECK(st.active[pool_all].current == 0);
  CHECK(st.segment[pool_all].current == 0);
  CHECK(st.inactive_split[pool_all].current == 0);
  CHECK(st.num_device_alloc == st.num_device_free);
  CHECK(st.invalid_free + st.double_free + st.zero_size + st.invalid_size == 0);
}

}  // TEST_SUITE

TEST_SUITE("threads") {

namespace {

void threaded_model(gact::alloc::allocator_options const& opts) {
  std::uint64_t const seed = test_seed();
  INFO("seed " << seed << " (set GACT_TEST_SEED to replay)");
  gact::device::host_backend be;
  caching_allocator a(be, opts);
  overlap_registry reg;
  constexpr int k_threads = 4;
  std::vector<gact::device::stream_t> const shared{0, be.create_stream(), be.create_stream()};
  std::vector<std::unique_ptr<model_runner>> models;
  for (int t = 0; t < k_threads; ++t) {
    auto streams = shared;
    streams.push_back(be.create_stream());  // one stream of its own
    models.push_back(std::make_unique<model_runner>(
        a, reg, model_config{seed + std::uint64_t(t) + 1, 7'500, 512 * k_mib, 128, streams, false, 0}));
  }
  std::vector<std::string> errors(k_threads);
  std::vector<std::thread> threads;
  for (int t = 0; t < k_threads; ++t) {
    threads.emplace_back([&, t] { errors[std::size_t(t)] = models[std::size_t(t)]->run(); });
  }
  for (auto& th : threads) th.join();
  for (auto const& e : errors) CHECK(e == "");

  auto st = a.stats();
  std::int64_t count = 0, allocated = 0, requested = 0;
  std::int64_t max_peak = 0, sum_peak = 0;
  for (auto const& m : models) {
    count += m->count();
    allocated += m->allocated();
    requested += m->requested();
    max_peak = std::max(max_peak, m->peak_count());
    sum_peak += m->peak_count();
  }
  CHECK(st.allocation[pool_all].current == count);
  CHECK(st.allocated_bytes[pool_all].current == allocated);
  CHECK(st.requested_bytes[pool_all].current == requested);
  CHECK(st.allocation[pool_all].peak >= max_peak);
  CHECK(st.allocation[pool_all].peak <= sum_peak);

  threads.clear();
  for (int t = 0; t < k_threads; ++t) {
    threads.emplace_back([&, t] { errors[std::size_t(t)] = models[std::size_t(t)]->free_all(); });
  }
  for (auto& th : threads) th.join();
  for (auto const& e : errors) CHECK(e == "");
  a.empty_cache();
  st = a.stats();
  CHECK(st.allocation[pool_all].current == 0);
  CHECK(st.active[pool_all].current == 0);
  CHECK(st.reserved_bytes[pool_all].current == 0);
  CHECK(be.reserved_bytes() == 0);
}

}  // namespace

TEST_CASE("model: 4 threads x 7.5k random operations, each with its own model") {
  threaded_model(gact::alloc::allocator_options{});
}

TEST_CASE("model: the same over a backend called outside the lock, whole free segments released at once") {
  gact::alloc::allocator_options o;  // (as over torch's CUDA pool: pass_through_options)
  o.backend_unlocked = true;
  o.release_free_above = 1;
  o.large_segment_size = o.min_large_alloc = std::size_t{2} << 20;  // (segments come and go often)
  o.round_large = 512;
  threaded_model(o);
}

}  // TEST_SUITE
