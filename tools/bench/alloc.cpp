// gact/tools/bench/alloc.cpp
//
// gact-bench-alloc: the allocator benchmark (a tool, not a test). It runs the
// same workloads through gact's caching_allocator over the host backend and
// through plain malloc/free in one process, and prints each figure beside the
// malloc figure measured in the same run:
//
//   random  RMM's random_allocations (alloc_workload.hpp): N operations,
//           uniform sizes, frees of random live blocks, a live-bytes cap.
//   trace   replay of a recorded allocation trace (default: the committed
//           ResNet-50 CPU training step, tools/bench/traces/); gact's
//           fragmentation 1 - peak allocated / peak reserved is reported.
//   cached  alloc+free pairs of one fixed size, single-threaded: the
//           allocator's cached fast path.
//
// Throughput comes from untimed passes over the precomputed operation list
// (one clock read per pass), per wall-clock second and per second of the
// thread's CPU time (the figure that holds on a machine shared with other
// work; ratios to malloc use it). Latency percentiles come from separate passes in
// which every k-th operation is bracketed by two reads of the CPU's time-stamp
// counter (rdtsc, calibrated against steady_clock; the bracket's own cost,
// measured the same way, is subtracted), so timer cost does not dominate
// operations of a few tens of nanoseconds.
//
// Without the caching allocator in the build (GACT_BENCH_HAVE_GACT unset), only
// malloc is measured and --stats-out exits with status 3.
#include <time.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#define GACT_BENCH_HAVE_TSC 1
#endif

#include "allocator/error.hpp"
#include "tools/bench/alloc_workload.hpp"

#ifdef GACT_BENCH_HAVE_GACT
#include "allocator/caching_allocator.hpp"
#include "allocator/device/host_backend.hpp"
#include "allocator/stats_registry.hpp"
#endif

namespace gact::bench {
namespace {

using clock_type = std::chrono::steady_clock;

/// Seconds of CPU time this thread has used: unlike wall time, it does not count the
/// time other processes on a shared machine hold the core.
double thread_cpu_seconds() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

/// Wall and thread-CPU seconds of an interval.
struct span_timer {
  clock_type::time_point wall0 = clock_type::now();
  double cpu0 = thread_cpu_seconds();
  double wall() const { return std::chrono::duration<double>(clock_type::now() - wall0).count(); }
  double cpu() const { return thread_cpu_seconds() - cpu0; }
};

/// Keep `p` (and the memory it points to) observable so that a malloc/free pair is not elided.
inline void do_not_optimize(void* p) { asm volatile("" : : "r"(p) : "memory"); }

// ---------------------------------------------------------------------------
// Timing

/// A low-overhead tick source and its calibration against steady_clock.
class ticker {
 public:
  ticker() {
#ifdef GACT_BENCH_HAVE_TSC
    auto const t0 = clock_type::now();
    std::uint64_t const c0 = __rdtsc();
    while (clock_type::now() - t0 < std::chrono::milliseconds(50)) {
    }
    std::uint64_t const c1 = __rdtsc();
    double const ns = std::chrono::duration<double, std::nano>(clock_type::now() - t0).count();
    ns_per_tick_ = ns / static_cast<double>(c1 - c0);
#endif
    // Cost of an empty bracket (the minimum, like the measurements it is subtracted from
    // are taken one at a time).
    std::uint64_t best = UINT64_MAX;
    for (int i = 0; i < 10000; ++i) {
      std::uint64_t const a = now();
      std::uint64_t const b = now();
      best = std::min(best, b - a);
    }
    overhead_ticks_ = best;
  }

  static std::uint64_t now() noexcept {
#ifdef GACT_BENCH_HAVE_TSC
    return __rdtsc();
#else
    return static_cast<std::uint64_t>(clock_type::now().time_since_epoch().count());
#endif
  }

  /// Nanoseconds of a bracket of `ticks`, less the empty-bracket cost (never below 0).
  double ns(std::uint64_t ticks) const noexcept {
    std::uint64_t const t = ticks > overhead_ticks_ ? ticks - overhead_ticks_ : 0;
    return static_cast<double>(t) * ns_per_tick_;
  }
  double overhead_ns() const noexcept { return static_cast<double>(overhead_ticks_) * ns_per_tick_; }
  char const* source() const noexcept {
#ifdef GACT_BENCH_HAVE_TSC
    return "rdtsc";
#else
    return "steady_clock";
#endif
  }
  double ghz() const noexcept { return 1.0 / ns_per_tick_; }

 private:
  double ns_per_tick_ = 1.0;
  std::uint64_t overhead_ticks_ = 0;
};

// ---------------------------------------------------------------------------
// Allocators under test: allocate(bytes) and deallocate(p), inlined into the loops.

struct malloc_resource {
  static constexpr char const* name = "malloc";
  void* allocate(std::size_t n) {
    void* p = std::malloc(n);
    if (p == nullptr) GACT_FAIL("malloc(" + std::to_string(n) + ") failed", gact::out_of_memory);
    return p;
  }
  void deallocate(void* p) noexcept { std::free(p); }
};

#ifdef GACT_BENCH_HAVE_GACT
struct gact_resource {
  static constexpr char const* name = "gact";
  alloc::caching_allocator* a;
  void* allocate(std::size_t n) { return a->allocate(n); }
  void deallocate(void* p) noexcept { a->deallocate(p); }
};
#endif

/// Figures of one workload on one allocator.
struct result {
  std::string workload;
  std::string allocator;
  std::size_t ops = 0;          ///< operations per pass
  std::size_t passes = 0;       ///< timed passes
  double ops_per_s = 0;      ///< per wall-clock second
  double ops_per_cpu_s = 0;  ///< per second of this thread's CPU time
  double p50_ns = 0;
  double p99_ns = 0;
  std::size_t samples = 0;
};

/// Free whatever a pass left live (the trace's blocks that outlive the step). Untimed.
template <class R>
void free_leftovers(R& r, std::vector<void*>& slots) {
  for (void*& p : slots) {
    if (p != nullptr) r.deallocate(p);
    p = nullptr;
  }
}

template <class R>
void pass(workload const& w, R& r, std::vector<void*>& slots) {
  for (op const& o : w.ops) {
    if (o.is_alloc) {
      slots[o.slot] = r.allocate(o.bytes);
    } else {
      r.deallocate(slots[o.slot]);
      slots[o.slot] = nullptr;
    }
  }
}

template <class R>
void sampled_pass(workload const& w, R& r, std::vector<void*>& slots, std::size_t every, ticker const& tk,
                  std::vector<double>& out) {
  std::size_t countdown = every;
  for (op const& o : w.ops) {
    bool const timed = --countdown == 0;
    std::uint64_t t0 = 0;
    if (timed) t0 = ticker::now();
    if (o.is_alloc) {
      slots[o.slot] = r.allocate(o.bytes);
    } else {
      r.deallocate(slots[o.slot]);
      slots[o.slot] = nullptr;
    }
    if (timed) {
      out.push_back(tk.ns(ticker::now() - t0));
      countdown = every;
    }
  }
}

/// One warm-up pass, `passes` untimed passes for throughput, then sampled passes for latency.
template <class R>
result measure(workload const& w, R& r, std::size_t passes, std::size_t every, ticker const& tk) {
  std::vector<void*> slots(w.slot_count, nullptr);
  pass(w, r, slots);
  free_leftovers(r, slots);
  double seconds = 0;
  double cpu_seconds = 0;
  for (std::size_t i = 0; i < passes; ++i) {
    span_timer const t;
    pass(w, r, slots);
    seconds += t.wall();
    cpu_seconds += t.cpu();
    free_leftovers(r, slots);
  }
  std::vector<double> lat;
  lat.reserve(passes * (w.ops.size() / every + 1));
  for (std::size_t i = 0; i < passes; ++i) {
    sampled_pass(w, r, slots, every, tk, lat);
    free_leftovers(r, slots);
  }
  result res;
  res.workload = w.name;
  res.allocator = R::name;
  res.ops = w.ops.size();
  res.passes = passes;
  res.ops_per_s = static_cast<double>(w.ops.size() * passes) / seconds;
  res.ops_per_cpu_s = static_cast<double>(w.ops.size() * passes) / cpu_seconds;
  res.samples = lat.size();
  res.p50_ns = quantile(lat, 0.50);
  res.p99_ns = quantile(lat, 0.99);
  return res;
}

/// Pairs per wall-clock second and per CPU second.
struct pair_rate {
  double wall = 0;
  double cpu = 0;
};

/// alloc+free pairs of `bytes` per second (after a warm-up that fills the cache).
template <class R>
pair_rate cached_pairs_per_s(R& r, std::size_t bytes, std::size_t pairs) {
  for (int i = 0; i < 1000; ++i) {
    void* p = r.allocate(bytes);
    do_not_optimize(p);
    r.deallocate(p);
  }
  span_timer const t;
  for (std::size_t i = 0; i < pairs; ++i) {
    void* p = r.allocate(bytes);
    do_not_optimize(p);
    r.deallocate(p);
  }
  double const wall = t.wall();
  double const cpu = t.cpu();
  return {static_cast<double>(pairs) / wall, static_cast<double>(pairs) / cpu};
}

// ---------------------------------------------------------------------------
// Command line

struct options {
  random_options random;
  std::string trace_path;
  std::size_t passes = 5;
  std::size_t min_ops = 200000;
  std::size_t pairs = 5000000;
  std::size_t pair_bytes = 4096;
  std::size_t sample_every = 8;
  bool run_random = true;
  bool run_trace = true;
  bool run_cached = true;
  bool json = false;
  std::string stats_out;
  // caching_allocator settings (0 = the allocator's default)
  std::size_t small_size = 0;
  std::size_t small_segment = 0;
  std::size_t large_segment = 0;
  std::size_t min_large = 0;
  std::size_t round_large = 0;
  bool expandable = false;
};

constexpr char const* k_usage =
    "usage: gact-bench-alloc [options]\n"
    "  --only LIST        comma list of random,trace,cached (default: all)\n"
    "  --quick            small counts (a smoke run of a few seconds)\n"
    "  --ops N            operations of the random workload (default 200000)\n"
    "  --min-size B       smallest random request (default 1)\n"
    "  --max-size B       largest random request (default 4M)\n"
    "  --max-live B       cap on live bytes of the random workload (default 512M)\n"
    "  --alloc-prob P     probability that a random step allocates (default 0.73)\n"
    "  --seed S           seed of the random workload (default 42)\n"
    "  --trace PATH       allocation trace, plain or gzip (default: the committed ResNet-50 step)\n"
    "  --passes N         timed passes over each workload (default 5; more for a short workload,\n"
    "                     until a pass set has at least --min-ops operations)\n"
    "  --min-ops N        operations timed per workload at least (default 200000)\n"
    "  --pairs N          alloc+free pairs of the cached-path test (default 5000000)\n"
    "  --pair-size B      request size of the cached-path test (default 4096)\n"
    "  --sample-every K   time every K-th operation for the percentiles (default 8)\n"
    "  --json             also print the figures as one JSON line\n"
    "  --stats-out PATH   write gact's stats document (gact-stats show PATH) at the end\n"
    "gact's caching_allocator settings (default: the allocator's own defaults):\n"
    "  --small-size B  --small-segment B  --large-segment B  --min-large B  --round-large B\n"
    "  --expandable       expandable segments: one range per stream, 2 MiB pages mapped as it grows\n"
    "Sizes take K, M, G suffixes (powers of 1024).\n";

[[noreturn]] void usage_error(std::string const& msg) {
  std::cerr << "gact-bench-alloc: " << msg << "\n" << k_usage;
  std::exit(2);
}

std::size_t parse_size(std::string const& flag, std::string const& s) {
  std::size_t pos = 0;
  unsigned long long v = 0;
  try {
    v = std::stoull(s, &pos);
  } catch (std::exception const&) {
    usage_error(flag + ": '" + s + "' is not a size (e.g. 4096, 64K, 4M)");
  }
  std::size_t mult = 1;
  if (pos < s.size()) {
    std::string_view const suf(s.c_str() + pos);
    if (suf == "K" || suf == "k") mult = std::size_t{1} << 10;
    else if (suf == "M" || suf == "m") mult = std::size_t{1} << 20;
    else if (suf == "G" || suf == "g") mult = std::size_t{1} << 30;
    else usage_error(flag + ": '" + s + "' has an unknown suffix (use K, M or G)");
  }
  if (s[0] == '-' || v > SIZE_MAX / mult) usage_error(flag + ": '" + s + "' is out of range");
  return static_cast<std::size_t>(v) * mult;
}

options parse_args(int argc, char** argv) {
  options o;
#ifdef GACT_BENCH_SOURCE_ROOT
  o.trace_path = std::string(GACT_BENCH_SOURCE_ROOT) + "/tools/bench/traces/resnet50_cpu_step.trace.gz";
#endif
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    auto count = [&](std::string const& v) {
      std::size_t const n = parse_size(a, v);
      if (n == 0) usage_error(a + " must be > 0");
      return n;
    };
    if (a == "--help" || a == "-h") {
      std::cout << k_usage;
      std::exit(0);
    } else if (a == "--quick") {
      o.random.ops = 20000;
      o.passes = 2;
      o.min_ops = 10000;
      o.pairs = 200000;
    } else if (a == "--only") {
      o.run_random = o.run_trace = o.run_cached = false;
      std::stringstream ss(value());
      std::string item;
      while (std::getline(ss, item, ',')) {
        if (item == "random") o.run_random = true;
        else if (item == "trace") o.run_trace = true;
        else if (item == "cached") o.run_cached = true;
        else usage_error("--only: unknown workload '" + item + "' (random, trace, cached)");
      }
    } else if (a == "--ops") {
      o.random.ops = count(value());
    } else if (a == "--min-size") {
      o.random.min_bytes = count(value());
    } else if (a == "--max-size") {
      o.random.max_bytes = count(value());
    } else if (a == "--max-live") {
      o.random.max_live_bytes = count(value());
    } else if (a == "--alloc-prob") {
      std::string const v = value();
      char* end = nullptr;
      double const p = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || !(p > 0.0 && p <= 1.0))
        usage_error("--alloc-prob: '" + v + "' is not a probability in (0, 1]");
      o.random.alloc_probability = p;
    } else if (a == "--seed") {
      o.random.seed = parse_size(a, value());
    } else if (a == "--trace") {
      o.trace_path = value();
    } else if (a == "--passes") {
      o.passes = count(value());
    } else if (a == "--min-ops") {
      o.min_ops = count(value());
    } else if (a == "--pairs") {
      o.pairs = count(value());
    } else if (a == "--pair-size") {
      o.pair_bytes = count(value());
    } else if (a == "--sample-every") {
      o.sample_every = count(value());
    } else if (a == "--small-size") {
      o.small_size = count(value());
    } else if (a == "--small-segment") {
      o.small_segment = count(value());
    } else if (a == "--large-segment") {
      o.large_segment = count(value());
    } else if (a == "--min-large") {
      o.min_large = count(value());
    } else if (a == "--round-large") {
      o.round_large = count(value());
    } else if (a == "--expandable") {
      o.expandable = true;
    } else if (a == "--json") {
      o.json = true;
    } else if (a == "--stats-out") {
      o.stats_out = value();
    } else {
      usage_error("unknown option '" + a + "'");
    }
  }
  if (o.random.min_bytes > o.random.max_bytes) usage_error("--min-size is larger than --max-size");
  if (o.random.max_bytes > o.random.max_live_bytes) usage_error("--max-size is larger than --max-live");
  return o;
}

/// Read a trace file, gzip-compressed or plain. @throws gact::error naming the file.
workload load_trace(std::string const& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) GACT_FAIL("cannot open trace '" + path + "': " + std::strerror(errno), gact::error);
  std::string text;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) text.append(buf, static_cast<std::size_t>(n));
  int err = Z_OK;
  std::string const msg = n < 0 ? gzerror(f, &err) : "";
  gzclose(f);
  if (n < 0) GACT_FAIL("cannot read trace '" + path + "': " + msg + " (corrupt or truncated gzip?)", gact::error);
  std::istringstream in(text);
  std::string name = path.substr(path.find_last_of('/') + 1);
  for (char const* ext : {".gz", ".trace"}) {
    if (name.size() > std::strlen(ext) && name.ends_with(ext)) name.resize(name.size() - std::strlen(ext));
  }
  return parse_trace(in, "trace:" + name);
}

std::string human(double v) {
  char buf[32];
  if (v >= 1e9) std::snprintf(buf, sizeof buf, "%.2f G", v / 1e9);
  else if (v >= 1e6) std::snprintf(buf, sizeof buf, "%.2f M", v / 1e6);
  else if (v >= 1e3) std::snprintf(buf, sizeof buf, "%.2f k", v / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", v);
  return buf;
}

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / double(1 << 20));
  return buf;
}

int run(options const& o) {
  if (!o.stats_out.empty()) {
#ifndef GACT_BENCH_HAVE_GACT
    std::cerr << "gact-bench-alloc: built without gact's caching allocator; no stats to write\n";
    return 3;
#endif
  }
  ticker const tk;
  nlohmann::json js = {{"bench", "alloc"},
                       {"timer", {{"source", tk.source()}, {"ghz", tk.ghz()}, {"overhead_ns", tk.overhead_ns()}}},
                       {"sample_every", o.sample_every},
                       {"results", nlohmann::json::array()}};
  std::printf("gact-bench-alloc: single thread; gact = caching_allocator over the host backend%s\n",
#ifdef GACT_BENCH_HAVE_GACT
              ""
#else
              " (NOT BUILT: malloc only)"
#endif
  );
  std::printf("timer: %s (%.2f GHz, bracket %.1f ns subtracted), every %zu-th op timed for p50/p99\n\n",
              tk.source(), tk.ghz(), tk.overhead_ns(), o.sample_every);

  std::vector<workload> loads;
  if (o.run_random) loads.push_back(random_workload(o.random));
  if (o.run_trace) {
    if (o.trace_path.empty()) GACT_FAIL("no trace given (--trace PATH)");
    loads.push_back(load_trace(o.trace_path));
  }

#ifdef GACT_BENCH_HAVE_GACT
  device::host_backend backend;
  alloc::allocator_options aopts;
  aopts.name = "bench";
  if (o.small_size != 0) aopts.small_size = o.small_size;
  if (o.small_segment != 0) aopts.small_segment_size = o.small_segment;
  if (o.large_segment != 0) aopts.large_segment_size = o.large_segment;
  if (o.min_large != 0) aopts.min_large_alloc = o.min_large;
  if (o.round_large != 0) aopts.round_large = o.round_large;
  aopts.expandable_segments = o.expandable;
  js["gact_options"] = {{"expandable_segments", aopts.expandable_segments},
                        {"small_size", aopts.small_size},
                        {"small_segment_size", aopts.small_segment_size},
                        {"large_segment_size", aopts.large_segment_size},
                        {"min_large_alloc", aopts.min_large_alloc},
                        {"round_large", aopts.round_large}};
  std::optional<alloc::caching_allocator> cache;
  cache.emplace(backend, aopts);
#endif

  if (!loads.empty()) {
    std::printf("%-26s %-7s %8s %10s %10s %9s %8s %8s\n", "workload", "alloc", "ops", "ops/s", "ops/cpu-s",
                "x malloc", "p50 ns", "p99 ns");
  }
  for (workload const& w : loads) {
    std::size_t const passes = std::max(o.passes, (o.min_ops + w.ops.size() - 1) / w.ops.size());
    malloc_resource m;
    result const rm = measure(w, m, passes, o.sample_every, tk);
    std::vector<result> rs{rm};
    nlohmann::json wj = {{"workload", w.name},
                         {"ops", w.ops.size()},
                         {"allocs", w.alloc_count},
                         {"peak_live_requested_bytes", w.peak_live_bytes},
                         {"peak_live_blocks", w.peak_live_blocks}};
#ifdef GACT_BENCH_HAVE_GACT
    cache.emplace(backend, aopts);  // fresh allocator: peaks belong to this workload only
    gact_resource g{&*cache};
    rs.push_back(measure(w, g, passes, o.sample_every, tk));
    alloc::allocator_stats const st = cache->stats();
    double const peak_alloc = static_cast<double>(st.allocated_bytes[alloc::pool_all].peak);
    double const peak_res = static_cast<double>(st.reserved_bytes[alloc::pool_all].peak);
    double const frag = peak_res > 0 ? 1.0 - peak_alloc / peak_res : 0.0;
    double const overhead = peak_res > 0 ? 1.0 - static_cast<double>(w.peak_live_bytes) / peak_res : 0.0;
    wj["gact"] = {{"peak_allocated_bytes", st.allocated_bytes[alloc::pool_all].peak},
                  {"peak_reserved_bytes", st.reserved_bytes[alloc::pool_all].peak},
                  {"fragmentation", frag},
                  {"overhead_vs_requested", overhead},
                  {"num_device_alloc", st.num_device_alloc}};
#endif
    for (result const& r : rs) {
      double const ratio = r.ops_per_cpu_s / rm.ops_per_cpu_s;
      std::printf("%-26s %-7s %8zu %10s %10s %9.2f %8.0f %8.0f\n", r.workload.c_str(), r.allocator.c_str(), r.ops,
                  human(r.ops_per_s).c_str(), human(r.ops_per_cpu_s).c_str(), ratio, r.p50_ns, r.p99_ns);
      js["results"].push_back({{"workload", r.workload},
                               {"allocator", r.allocator},
                               {"ops", r.ops},
                               {"passes", r.passes},
                               {"ops_per_s", r.ops_per_s},
                               {"ops_per_cpu_s", r.ops_per_cpu_s},
                               {"ratio_vs_malloc", ratio},
                               {"p50_ns", r.p50_ns},
                               {"p99_ns", r.p99_ns},
                               {"samples", r.samples}});
    }
#ifdef GACT_BENCH_HAVE_GACT
    std::printf("  %s: peak live requested %s; gact peak allocated %s, peak reserved %s\n", w.name.c_str(),
                mib(static_cast<double>(w.peak_live_bytes)).c_str(), mib(peak_alloc).c_str(), mib(peak_res).c_str());
    std::printf("  gact fragmentation 1 - peak allocated / peak reserved = %.1f %%%s; 1 - requested / reserved = %.1f %%\n",
                100.0 * frag, w.name.starts_with("trace") ? (frag <= 0.10 ? "  [target <= 10 %: met]" : "  [target <= 10 %: MISSED]") : "",
                100.0 * overhead);
#endif
    js["workloads"].push_back(wj);
  }

  if (o.run_cached) {
    malloc_resource m;
    pair_rate const pm = cached_pairs_per_s(m, o.pair_bytes, o.pairs);
    nlohmann::json cj = {{"bytes", o.pair_bytes},
                         {"pairs", o.pairs},
                         {"malloc_pairs_per_s", pm.wall},
                         {"malloc_pairs_per_cpu_s", pm.cpu}};
    std::printf("\ncached path, alloc+free pairs of %zu B, single thread:\n", o.pair_bytes);
    std::printf("  malloc %s pairs/s, %s pairs/cpu-s\n", human(pm.wall).c_str(), human(pm.cpu).c_str());
#ifdef GACT_BENCH_HAVE_GACT
    gact_resource g{&*cache};
    pair_rate const pg = cached_pairs_per_s(g, o.pair_bytes, o.pairs);
    cj["gact_pairs_per_s"] = pg.wall;
    cj["gact_pairs_per_cpu_s"] = pg.cpu;
    cj["ratio_vs_malloc"] = pg.cpu / pm.cpu;
    std::printf("  gact   %s pairs/s, %s pairs/cpu-s (x %.2f malloc)  [target >= 5 M pairs/cpu-s: %s]\n",
                human(pg.wall).c_str(), human(pg.cpu).c_str(), pg.cpu / pm.cpu, pg.cpu >= 5e6 ? "met" : "MISSED");
#endif
    js["cached"] = cj;
  }

#ifdef GACT_BENCH_HAVE_GACT
  if (!o.stats_out.empty()) {
    stats::dump(o.stats_out);
    std::printf("\nstats document written to %s (gact-stats show %s)\n", o.stats_out.c_str(), o.stats_out.c_str());
  }
#endif
  if (o.json) std::printf("%s\n", js.dump().c_str());
  return 0;
}

}  // namespace
}  // namespace gact::bench

int main(int argc, char** argv) {
  try {
    return gact::bench::run(gact::bench::parse_args(argc, argv));
  } catch (gact::invalid_argument const& e) {
    std::cerr << "gact-bench-alloc: " << e.what() << "\n";
    return 2;
  } catch (std::exception const& e) {
    std::cerr << "gact-bench-alloc: " << e.what() << "\n";
    return 1;
  }
}
