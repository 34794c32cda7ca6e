// tools/bench/codec.cpp — gact-bench-codec: throughput of the CPU codec executor.
//
// For each dtype (float32, float16, bfloat16) and bit width (1, 2, 4, 8), and for
// the mask and raw codecs, measures encode and decode throughput in GB/s of the
// uncompressed tensor, on 1 thread and on all threads, beside memcpy bandwidth
// measured in the same run on the same buffer sizes. Ratios are per thread
// against single-thread memcpy (the targets: encode >= 0.30, decode >= 0.50).
//
// "warm" figures reuse buffers whose pages are already mapped (the steady state
// of a caching allocator); "fresh" figures write into newly allocated memory,
// so they include first-touch page faults, and are reported separately with
// memcpy into fresh memory as their reference.
//
// A tool, not a test: no figure here is asserted on.
//
//   gact-bench-codec [--numel N] [--reps R] [--threads T] [--json]
#include "codecs/codec.hpp"
#include "codecs/float16.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace gact::codec;
using clock_type = std::chrono::steady_clock;

struct buffer {
  std::unique_ptr<unsigned char[]> p;
  std::size_t n = 0;
  explicit buffer(std::size_t bytes) : p(new unsigned char[std::max<std::size_t>(bytes, 1)]), n(bytes) {
    std::memset(p.get(), 0, n);  // map the pages now: a warm buffer
  }
  unsigned char* data() { return p.get(); }
};

double process_cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}

/// Median wall seconds and median process CPU seconds of `reps` runs of fn (after one warm-up run).
/// CPU seconds summed over all threads measure work per thread independently of how the
/// (shared) machine time-slices the run.
struct timing {
  double wall, cpu;
};
template <typename Fn>
timing measure(int reps, Fn&& fn) {
  fn();
  std::vector<double> w, c;
  for (int i = 0; i < reps; ++i) {
    double const c0 = process_cpu_seconds();
    auto const a = clock_type::now();
    fn();
    w.push_back(std::chrono::duration<double>(clock_type::now() - a).count());
    c.push_back(process_cpu_seconds() - c0);
  }
  std::sort(w.begin(), w.end());
  std::sort(c.begin(), c.end());
  return {w[w.size() / 2], c[c.size() / 2]};
}

double gbps(std::size_t bytes, double s) { return double(bytes) / s / 1e9; }

}  // namespace

int main(int argc, char** argv) {
  std::size_t numel = std::size_t{1} << 22;
  int reps = 5;
  int all_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    auto next = [&]() -> char const* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "gact-bench-codec: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--numel") {
      numel = std::size_t(std::strtoull(next(), nullptr, 10));
    } else if (a == "--reps") {
      reps = std::max(1, std::atoi(next()));
    } else if (a == "--threads") {
      all_threads = std::max(1, std::atoi(next()));
    } else if (a == "--json") {
      json = true;
    } else {
      std::fprintf(stderr, "usage: gact-bench-codec [--numel N] [--reps R] [--threads T] [--json]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  if (numel == 0) numel = 1;

  // Input: normal(0, 1) values, the shape of typical activations.
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> values(numel);
  for (auto& v : values) v = nd(rng);

  nlohmann::json out;
  out["numel"] = numel;
  out["reps"] = reps;
  out["threads_all"] = all_threads;

  // memcpy references, one thread: warm (mapped destination) and fresh (new destination each time).
  std::size_t const ref_bytes = numel * 4;
  buffer msrc(ref_bytes), mdst(ref_bytes);
  std::memcpy(msrc.data(), values.data(), ref_bytes);
  timing const mw = measure(reps, [&] { std::memcpy(mdst.data(), msrc.data(), ref_bytes); });
  timing const mf = measure(reps, [&] {
    std::unique_ptr<unsigned char[]> d(new unsigned char[ref_bytes]);
    std::memcpy(d.get(), msrc.data(), ref_bytes);
    asm volatile("" : : "r"(d.get()) : "memory");
  });
  double const memcpy_warm = gbps(ref_bytes, mw.wall), memcpy_warm_cpu = gbps(ref_bytes, mw.cpu);
  double const memcpy_fresh = gbps(ref_bytes, mf.wall), memcpy_fresh_cpu = gbps(ref_bytes, mf.cpu);
  out["memcpy_gbps"] = {{"warm", memcpy_warm}, {"fresh", memcpy_fresh},
                        {"warm_per_cpu_second", memcpy_warm_cpu}, {"fresh_per_cpu_second", memcpy_fresh_cpu}};
  out["cpu_executor_isa"] = detail::quant_cpu_isa();
  if (!json) {
    std::printf("gact-bench-codec: %zu elements, median of %d, all threads = %d, CPU loops: %s\n", numel, reps,
                all_threads, detail::quant_cpu_isa());
    std::printf("memcpy 1 thread: warm %.2f GB/s (%.2f per CPU-second), fresh pages %.2f GB/s (%.2f per CPU-second)\n\n",
                memcpy_warm, memcpy_warm_cpu, memcpy_fresh, memcpy_fresh_cpu);
    std::printf("%-9s %-6s %4s %7s | %8s %8s %6s | %8s %8s %6s | %9s %6s\n", "dtype", "codec", "bits", "threads",
                "enc GB/s", "per cpu", "/mcpy", "dec GB/s", "per cpu", "/mcpy", "enc fresh", "/mcpy");
  }

  struct config {
    dtype dt;
    codec_id codec;
    int bits;
  };
  std::vector<config> configs;
  for (dtype dt : {dtype::float32, dtype::float16, dtype::bfloat16})
    for (int b : {1, 2, 4, 8}) configs.push_back({dt, codec_id::quant, b});
  configs.push_back({dtype::boolean, codec_id::mask, 0});
  configs.push_back({dtype::float32, codec_id::raw, 0});

  nlohmann::json rows = nlohmann::json::array();
  for (auto const& c : configs) {
    std::size_t const in_bytes = numel * dtype_size(c.dt);
    buffer in(in_bytes), dec(in_bytes);
    for (std::size_t i = 0; i < numel; ++i) {
      if (c.dt == dtype::float32) {
        std::memcpy(in.data() + 4 * i, &values[i], 4);
      } else if (c.dt == dtype::boolean) {
        in.data()[i] = values[i] > 0.f ? 1 : 0;
      } else {
        std::uint16_t const h = c.dt == dtype::float16 ? hd::float_to_half(values[i]) : hd::float_to_bf16(values[i]);
        std::memcpy(in.data() + 2 * i, &h, 2);
      }
    }
    encode_params p;
    p.codec = c.codec;
    p.bits = c.bits == 0 ? 4 : c.bits;
    p.seed = 3;
    std::vector<std::int64_t> const shape{std::int64_t(numel)};
    std::size_t const bs = blob_size(c.dt, shape, p);
    buffer blob(bs);
    for (int threads : {1, all_threads}) {
      timing const te = measure(reps, [&] { encode_cpu(in.data(), c.dt, shape, p, blob.data(), bs, threads); });
      timing const td = measure(reps, [&] { decode_cpu(blob.data(), bs, dec.data(), in_bytes, threads); });
      timing const tf = measure(reps, [&] {
        std::unique_ptr<unsigned char[]> b(new unsigned char[bs]);
        encode_cpu(in.data(), c.dt, shape, p, b.get(), bs, threads);
      });
      double const enc = gbps(in_bytes, te.wall), enc_cpu = gbps(in_bytes, te.cpu);
      double const decs = gbps(in_bytes, td.wall), dec_cpu = gbps(in_bytes, td.cpu);
      double const fresh = gbps(in_bytes, tf.wall), fresh_cpu = gbps(in_bytes, tf.cpu);
      // Per-thread ratios: work per CPU-second against memcpy's bytes per CPU-second.
      double const r_enc = enc_cpu / memcpy_warm_cpu, r_dec = dec_cpu / memcpy_warm_cpu;
      double const r_fresh = fresh_cpu / memcpy_fresh_cpu;
      rows.push_back({{"dtype", dtype_name(c.dt)}, {"codec", codec_name(c.codec)}, {"bits", c.bits},
                      {"threads", threads}, {"blob_bytes", bs}, {"input_bytes", in_bytes},
                      {"encode_gbps", enc}, {"decode_gbps", decs}, {"encode_fresh_gbps", fresh},
                      {"encode_gb_per_cpu_second", enc_cpu}, {"decode_gb_per_cpu_second", dec_cpu},
                      {"encode_per_thread_vs_memcpy", r_enc}, {"decode_per_thread_vs_memcpy", r_dec},
                      {"encode_fresh_per_thread_vs_memcpy_fresh", r_fresh}});
      if (!json)
        std::printf("%-9s %-6s %4d %7d | %8.2f %8.2f %6.2f | %8.2f %8.2f %6.2f | %9.2f %6.2f\n", dtype_name(c.dt),
                    codec_name(c.codec), c.bits, threads, enc, enc_cpu, r_enc, decs, dec_cpu, r_dec, fresh, r_fresh);
      if (all_threads == 1) break;
    }
  }
  out["results"] = rows;
  if (json) {
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("\nGB/s: of the uncompressed tensor, wall clock. per cpu: GB per CPU-second (all threads summed).\n");
    std::printf("/mcpy: per-CPU-second throughput over memcpy's (warm; 'enc fresh' against memcpy into fresh pages).\n");
    std::printf("targets: encode >= 0.30, decode >= 0.50\n");
  }
  return 0;
}
