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
// CUDA (builds with kernels, a device present): the same configurations through
// encode_cuda / decode_cuda on one stream, timed with CUDA events (median of R
// repetitions of 10 calls), beside cudaMemcpyAsync device-to-device bandwidth
// measured in the same run on a buffer of the fp32 input's size. All GB/s count
// the uncompressed tensor's bytes once (a copy of B bytes in t seconds: B/t), so
// "encode_vs_d2d_copy" is the fraction of copy speed (target >= 0.80). Each
// configuration is also encoded and decoded on the CPU once: blob_matches_cpu and
// decode_matches_cpu say whether the device produced the same bytes.
//
// A tool, not a test: no figure here is asserted on.
//
//   gact-bench-codec [--numel N] [--reps R] [--threads T] [--device cpu|cuda|all]
//                    [--cuda-numel N] [--isa NAME] [--json]
//
// --isa picks the build of the CPU loops (generic, avx2, avx512: those this CPU runs;
// the fastest is the default). The memcpy reference of each row's ratios is measured
// again right before that row: on a shared machine memory bandwidth drifts between
// rows, and a ratio against a figure from another moment would carry the drift.
#include "codecs/codec.hpp"
#include "codecs/float16.hpp"
#include "codecs/verdict.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <random>
#include <stdexcept>
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

/// One configuration of the codec matrix.
struct config {
  dtype dt;
  codec_id codec;
  int bits;  ///< quant: 1/2/4/8; 0 for mask and raw
};

std::vector<config> codec_configs() {
  std::vector<config> configs;
  for (dtype dt : {dtype::float32, dtype::float16, dtype::bfloat16})
    for (int b : {1, 2, 4, 8}) configs.push_back({dt, codec_id::quant, b});
  configs.push_back({dtype::boolean, codec_id::mask, 0});
  configs.push_back({dtype::float32, codec_id::raw, 0});
  return configs;
}

/// The input tensor of configuration `c`: `values` in its dtype (bool: value > 0).
void fill_input(config const& c, std::vector<float> const& values, unsigned char* dst) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (c.dt == dtype::float32) {
      std::memcpy(dst + 4 * i, &values[i], 4);
    } else if (c.dt == dtype::boolean) {
      dst[i] = values[i] > 0.f ? 1 : 0;
    } else {
      std::uint16_t const h = c.dt == dtype::float16 ? hd::float_to_half(values[i]) : hd::float_to_bf16(values[i]);
      std::memcpy(dst + 2 * i, &h, 2);
    }
  }
}

encode_params params_of(config const& c) {
  encode_params p;
  p.codec = c.codec;
  p.bits = c.bits == 0 ? 4 : c.bits;
  p.seed = 3;
  return p;
}

#if defined(GACT_HAVE_KERNELS) && GACT_HAVE_KERNELS
/// Throws std::runtime_error naming the call when a CUDA call fails.
void cuda_check(cudaError_t e, char const* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

struct device_buffer {
  void* p = nullptr;
  explicit device_buffer(std::size_t n) { cuda_check(cudaMalloc(&p, std::max<std::size_t>(n, 1)), "cudaMalloc"); }
  ~device_buffer() { (void)cudaFree(p); }
  device_buffer(device_buffer const&) = delete;
  device_buffer& operator=(device_buffer const&) = delete;
};

/// Median seconds per call of fn over `reps` repetitions of `inner` calls on `stream`, timed with events.
template <typename Fn>
double device_seconds(int reps, int inner, cudaStream_t stream, Fn&& fn) {
  cudaEvent_t a = nullptr, b = nullptr;
  cuda_check(cudaEventCreate(&a), "cudaEventCreate");
  cuda_check(cudaEventCreate(&b), "cudaEventCreate");
  fn();  // warm-up
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    cuda_check(cudaEventRecord(a, stream), "cudaEventRecord");
    for (int i = 0; i < inner; ++i) fn();
    cuda_check(cudaEventRecord(b, stream), "cudaEventRecord");
    cuda_check(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0.f;
    cuda_check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    t.push_back(double(ms) * 1e-3 / inner);
  }
  (void)cudaEventDestroy(a);
  (void)cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// The CUDA half of the benchmark (see the file comment): {"device", "d2d_copy_gbps", "rows", ...},
/// or {"error": ...} when there is no device or a call fails.
nlohmann::json bench_cuda(std::size_t numel, int reps, bool print) {
  nlohmann::json out;
  try {
    int count = 0;
    cuda_check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    if (count == 0) throw std::runtime_error("no CUDA device");
    cudaDeviceProp prop{};
    cuda_check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    cudaStream_t stream = nullptr;
    cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    int const inner = 10;
    std::mt19937 rng(2);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> values(numel);
    for (auto& v : values) v = nd(rng);

    std::size_t const ref_bytes = numel * 4;
    double copy_gbps = 0.0;
    {
      device_buffer src(ref_bytes), dst(ref_bytes);
      cuda_check(cudaMemcpy(src.p, values.data(), ref_bytes, cudaMemcpyHostToDevice), "H2D");
      double const t = device_seconds(reps, inner, stream, [&] {
        cuda_check(cudaMemcpyAsync(dst.p, src.p, ref_bytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
      });
      copy_gbps = gbps(ref_bytes, t);
    }
    out["device"] = prop.name;
    out["numel"] = numel;
    out["reps"] = reps;
    out["calls_per_rep"] = inner;
    out["d2d_copy_gbps"] = copy_gbps;
    out["target_vs_d2d_copy"] = 0.80;
    if (print) {
      std::printf("\nCUDA: %s, %zu elements, median of %d x %d calls; cudaMemcpyAsync D2D %.1f GB/s\n", prop.name,
                  numel, reps, inner, copy_gbps);
      std::printf("%-9s %-6s %4s | %9s %6s | %9s %6s | %s\n", "dtype", "codec", "bits", "enc GB/s", "/copy",
                  "dec GB/s", "/copy", "same as CPU (blob, decode)");
    }
    nlohmann::json rows = nlohmann::json::array();
    auto const ring = verdict_ring::create_device();
    for (config const& c : codec_configs()) {
      std::size_t const in_bytes = numel * dtype_size(c.dt);
      encode_params const p = params_of(c);
      std::vector<std::int64_t> const shape{std::int64_t(numel)};
      std::size_t const bs = blob_size(c.dt, shape, p);
      std::vector<unsigned char> host_in(in_bytes);
      fill_input(c, values, host_in.data());
      device_buffer in(in_bytes), blob(bs), dec(in_bytes), status(sizeof(std::uint32_t));
      cuda_check(cudaMemcpy(in.p, host_in.data(), in_bytes, cudaMemcpyHostToDevice), "H2D");
      // (quant as the store runs it: with a verdict, codecs/verdict.hpp)
      bool const asks = c.codec == codec_id::quant;
      double const te = device_seconds(reps, inner, stream, [&] {
        device_verdict dv;
        verdict_ring::ticket const t = asks ? ring->acquire(&dv) : verdict_ring::ticket{};
        (void)encode_cuda(in.p, c.dt, shape, p, blob.p, bs, stream, asks ? &dv : nullptr);
        if (asks) ring->release(t);
      });
      double const td = device_seconds(reps, inner, stream, [&] {
        decode_cuda(blob.p, bs, dec.p, in_bytes, stream, static_cast<std::uint32_t*>(status.p));
      });
      cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      // The device's bytes beside the CPU executor's, once per configuration.
      std::vector<unsigned char> gpu_blob(bs), cpu_blob(bs), gpu_dec(in_bytes), cpu_dec(in_bytes);
      std::uint32_t st = 0;
      cuda_check(cudaMemcpy(gpu_blob.data(), blob.p, bs, cudaMemcpyDeviceToHost), "D2H");
      cuda_check(cudaMemcpy(gpu_dec.data(), dec.p, in_bytes, cudaMemcpyDeviceToHost), "D2H");
      cuda_check(cudaMemcpy(&st, status.p, sizeof st, cudaMemcpyDeviceToHost), "D2H");
      (void)encode_cpu(host_in.data(), c.dt, shape, p, cpu_blob.data(), bs, 0);
      decode_cpu(cpu_blob.data(), bs, cpu_dec.data(), in_bytes, 0);
      bool const blob_same = gpu_blob == cpu_blob;
      bool const dec_same = st == 0 && gpu_dec == cpu_dec;
      double const enc = gbps(in_bytes, te), decs = gbps(in_bytes, td);
      rows.push_back({{"dtype", dtype_name(c.dt)}, {"codec", codec_name(c.codec)}, {"bits", c.bits},
                      {"input_bytes", in_bytes}, {"blob_bytes", bs}, {"encode_gbps", enc}, {"decode_gbps", decs},
                      {"encode_vs_d2d_copy", enc / copy_gbps}, {"decode_vs_d2d_copy", decs / copy_gbps},
                      {"blob_matches_cpu", blob_same}, {"decode_matches_cpu", dec_same}, {"decode_status", st}});
      if (print)
        std::printf("%-9s %-6s %4d | %9.1f %6.2f | %9.1f %6.2f | %s, %s\n", dtype_name(c.dt), codec_name(c.codec),
                    c.bits, enc, enc / copy_gbps, decs, decs / copy_gbps, blob_same ? "yes" : "NO",
                    dec_same ? "yes" : "NO");
    }
    out["rows"] = rows;
    (void)cudaStreamDestroy(stream);
  } catch (std::exception const& e) {
    out["error"] = e.what();
    if (print) std::printf("\nCUDA: not measured: %s\n", e.what());
  }
  return out;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  std::size_t numel = std::size_t{1} << 22;
  int reps = 5;
  int all_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  bool json = false;
  std::string device = "all";
  std::size_t cuda_numel = std::size_t{1} << 26;
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
    } else if (a == "--device") {
      device = next();
      if (device != "cpu" && device != "cuda" && device != "all") {
        std::fprintf(stderr, "gact-bench-codec: --device '%s' is not one of cpu, cuda, all\n", device.c_str());
        return 2;
      }
    } else if (a == "--cuda-numel") {
      cuda_numel = std::size_t(std::strtoull(next(), nullptr, 10));
    } else if (a == "--isa") {
      char const* name = next();
      if (!detail::use_quant_cpu_isa(name)) {
        std::string names;
        for (char const* n : detail::quant_cpu_isas()) names += std::string(names.empty() ? "" : ", ") + n;
        std::fprintf(stderr, "gact-bench-codec: --isa '%s' is not a build this CPU runs (%s)\n", name, names.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "usage: gact-bench-codec [--numel N] [--reps R] [--threads T] [--device cpu|cuda|all] "
                   "[--cuda-numel N] [--isa NAME] [--json]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  if (numel == 0) numel = 1;
  if (cuda_numel == 0) cuda_numel = 1;
  nlohmann::json out;
#if defined(GACT_HAVE_KERNELS) && GACT_HAVE_KERNELS
  if (device != "cpu") out["cuda"] = bench_cuda(cuda_numel, reps, !json);
#else
  if (device == "cuda") {
    std::fprintf(stderr, "gact-bench-codec: this build has no CUDA kernels (--device cuda)\n");
    return 2;
  }
#endif
  if (device == "cuda") {
    if (json) std::printf("%s\n", out.dump().c_str());
    return out["cuda"].contains("error") ? 1 : 0;
  }

  // Input: normal(0, 1) values, the shape of typical activations.
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> values(numel);
  for (auto& v : values) v = nd(rng);

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

  nlohmann::json rows = nlohmann::json::array();
  for (auto const& c : codec_configs()) {
    std::size_t const in_bytes = numel * dtype_size(c.dt);
    buffer in(in_bytes), dec(in_bytes);
    fill_input(c, values, in.data());
    encode_params const p = params_of(c);
    std::vector<std::int64_t> const shape{std::int64_t(numel)};
    std::size_t const bs = blob_size(c.dt, shape, p);
    buffer blob(bs);
    for (int threads : {1, all_threads}) {
      timing const mr = measure(reps, [&] { std::memcpy(mdst.data(), msrc.data(), ref_bytes); });
      double const row_memcpy_cpu = gbps(ref_bytes, mr.cpu);
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
      double const r_enc = enc_cpu / row_memcpy_cpu, r_dec = dec_cpu / row_memcpy_cpu;
      double const r_fresh = fresh_cpu / memcpy_fresh_cpu;
      rows.push_back({{"dtype", dtype_name(c.dt)}, {"codec", codec_name(c.codec)}, {"bits", c.bits},
                      {"threads", threads}, {"blob_bytes", bs}, {"input_bytes", in_bytes},
                      {"memcpy_gb_per_cpu_second", row_memcpy_cpu},
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
    std::printf("/mcpy: per-CPU-second throughput over memcpy's, warm memcpy measured again right before each row\n"
                "       ('enc fresh' against memcpy into fresh pages, measured once at the start).\n");
    std::printf("targets (float32, per thread): encode >= 0.50, decode >= 1.00\n");
  }
  return 0;
}
