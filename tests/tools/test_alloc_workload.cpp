// gact/tests/tools/test_alloc_workload.cpp
//
// Tests of gact-bench-alloc's workloads (tools/bench/alloc_workload.hpp): the
// trace parser on valid and malformed traces, the committed ResNet-50 trace
// against the figures in its own header, the random workload's invariants and
// its allocation probability, and the quantile helper. The benchmark's timings
// are not tested (a benchmark is a tool); what it replays is.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
#include <zlib.h>

#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "allocator/error.hpp"
#include "tools/bench/alloc_workload.hpp"

using gact::bench::op;
using gact::bench::workload;

namespace {

workload parse(std::string const& text) {
  std::istringstream in(text);
  return gact::bench::parse_trace(in, "t");
}

/// Replays the ops against a slot model and checks the workload invariants; returns the
/// live bytes at the end.
std::size_t check_invariants(workload const& w) {
  std::vector<std::uint64_t> live(w.slot_count, 0);
  std::size_t live_bytes = 0, peak = 0, allocs = 0, blocks = 0, peak_blocks = 0;
  for (op const& o : w.ops) {
    REQUIRE(o.slot < w.slot_count);
    if (o.is_alloc) {
      REQUIRE(live[o.slot] == 0);
      REQUIRE(o.bytes > 0);
      live[o.slot] = o.bytes;
      live_bytes += o.bytes;
      ++allocs;
      ++blocks;
    } else {
      REQUIRE(live[o.slot] != 0);
      live_bytes -= live[o.slot];
      live[o.slot] = 0;
      --blocks;
    }
    peak = std::max(peak, live_bytes);
    peak_blocks = std::max(peak_blocks, blocks);
  }
  CHECK(allocs == w.alloc_count);
  CHECK(peak == w.peak_live_bytes);
  CHECK(peak_blocks == w.peak_live_blocks);
  CHECK(blocks == w.live_at_end);
  return live_bytes;
}

std::string what_of(std::string const& text) {
  try {
    parse(text);
  } catch (gact::invalid_argument const& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("trace: ids map to dense slots that are reused after a free") {
  workload const w = parse(
      "# comment\n"
      "a 10 1000\n"
      "a 7 24\n"
      "\n"
      "f 10\n"
      "a 99 4096\r\n"  // CRLF accepted
      "f 7\n"
      "a 10 5\n");  // an id may come back after its free
  REQUIRE(w.ops.size() == 6);
  CHECK(w.alloc_count == 4);
  CHECK(w.slot_count == 2);  // never more than 2 live at once
  CHECK(w.ops[0].is_alloc);
  CHECK(w.ops[0].bytes == 1000);
  CHECK(w.ops[3].is_alloc);
  CHECK(w.ops[3].slot == w.ops[0].slot);  // the freed slot of id 10 serves id 99
  CHECK(w.peak_live_bytes == 4120);       // 24 + 4096
  CHECK(w.peak_live_blocks == 2);
  CHECK(w.live_at_end == 2);
  CHECK(check_invariants(w) == 4101);
}

TEST_CASE("trace: malformed lines are rejected with their line number") {
  struct bad_case {
    char const* text;
    char const* fragment;
  };
  bad_case const cases[] = {
      {"a 1 10\nx 2\n", "line 2: unknown event"},
      {"a 1\n", "line 1: expected 'a <id> <bytes>'"},
      {"a 1 10 7\n", "line 1: expected 'a <id> <bytes>'"},
      {"a 1 -10\n", "line 1: expected"},
      {"a  1 10\n", "line 1: expected"},
      {"a 1 10x\n", "line 1: expected"},
      {"a 1 99999999999999999999999\n", "line 1: expected"},  // overflows 64 bits
      {"a 1 0\n", "line 1: allocation of 0 bytes"},
      {"a 1 8\na 1 8\n", "line 2: id allocated again while live"},
      {"a 1 8\nf 2\n", "line 2: free of an id that is not live"},
      {"a 1 8\nf 1\nf 1\n", "line 3: free of an id that is not live"},
      {"f\n", "line 1: expected 'f <id>'"},
      {"f 1 2\n", "line 1: expected 'f <id>'"},
      {"# only comments\n", "has no allocations"},
      {"", "has no allocations"},
  };
  for (bad_case const& c : cases) {
    CAPTURE(c.text);
    std::string const msg = what_of(c.text);
    CHECK(msg.find(c.fragment) != std::string::npos);
    CHECK(msg.find("trace t") != std::string::npos);
  }
}

TEST_CASE("trace: the committed ResNet-50 step agrees with its own header") {
  std::string const path = std::string(GACT_TEST_SOURCE_ROOT) + "/tools/bench/traces/resnet50_cpu_step.trace.gz";
  gzFile f = gzopen(path.c_str(), "rb");
  REQUIRE_MESSAGE(f != nullptr, "cannot open " << path);
  std::string text;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) text.append(buf, static_cast<std::size_t>(n));
  gzclose(f);
  REQUIRE(n == 0);
  workload const w = parse(text);
  check_invariants(w);

  // "# events: <allocs> allocations, <frees> frees, peak live <bytes> bytes"
  std::size_t const at = text.find("# events: ");
  REQUIRE(at != std::string::npos);
  unsigned long long allocs = 0, frees = 0, peak = 0;
  REQUIRE(std::sscanf(text.c_str() + at, "# events: %llu allocations, %llu frees, peak live %llu bytes", &allocs,
                      &frees, &peak) == 3);
  CHECK(w.alloc_count == allocs);
  CHECK(w.ops.size() - w.alloc_count == frees);
  CHECK(w.peak_live_bytes == peak);
  // A training step: hundreds of tensors, a peak of tens of MiB at least.
  CHECK(w.alloc_count > 500);
  CHECK(w.peak_live_bytes > (std::size_t{32} << 20));
}

TEST_CASE("random workload: invariants, the live cap, determinism") {
  gact::bench::random_options o;
  o.ops = 20000;
  o.max_bytes = std::size_t{1} << 20;
  o.max_live_bytes = std::size_t{16} << 20;
  o.seed = 7;
  workload const a = gact::bench::random_workload(o);
  CHECK(a.ops.size() == o.ops);
  check_invariants(a);
  CHECK(a.peak_live_bytes <= o.max_live_bytes);
  // the cap binds: with p = 0.73 the live set would grow far past 16 MiB in 20000 steps
  CHECK(a.peak_live_bytes > o.max_live_bytes - o.max_bytes);
  for (op const& x : a.ops) {
    if (x.is_alloc) {
      CHECK(x.bytes >= o.min_bytes);
      CHECK(x.bytes <= o.max_bytes);
    }
  }
  workload const b = gact::bench::random_workload(o);
  REQUIRE(b.ops.size() == a.ops.size());
  bool same = true;
  for (std::size_t i = 0; i < a.ops.size(); ++i)
    same = same && a.ops[i].bytes == b.ops[i].bytes && a.ops[i].slot == b.ops[i].slot;
  CHECK(same);
  o.seed = 8;
  workload const c = gact::bench::random_workload(o);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < a.ops.size(); ++i) differ += a.ops[i].bytes != c.ops[i].bytes ? 1 : 0;
  CHECK(differ > a.ops.size() / 2);
}

TEST_CASE("random workload: allocation fraction matches the probability when the cap never binds") {
  gact::bench::random_options o;
  o.ops = 40000;
  o.min_bytes = 1;
  o.max_bytes = 64;
  o.max_live_bytes = std::size_t{1} << 30;  // 40000 * 64 B never reaches it
  o.alloc_probability = 0.6;
  o.seed = 11;
  workload const w = gact::bench::random_workload(o);
  check_invariants(w);
  // Each step allocates with probability p, except when nothing is live (then it must);
  // with p = 0.6 the live count drifts upward, so forced allocations are rare. The
  // fraction is a binomial mean: within 5 sigma of p, plus the forced steps.
  double const n = static_cast<double>(w.ops.size());
  double const frac = static_cast<double>(w.alloc_count) / n;
  double const sigma = std::sqrt(0.6 * 0.4 / n);
  CHECK(frac > 0.6 - 5 * sigma);
  CHECK(frac < 0.6 + 5 * sigma + 200.0 / n);
  // mean request size of uniform [1, 64] is 32.5; standard error 18.5 / sqrt(allocs)
  double sum = 0;
  for (op const& x : w.ops) sum += static_cast<double>(x.bytes);
  double const mean = sum / static_cast<double>(w.alloc_count);
  CHECK(std::abs(mean - 32.5) < 5 * 18.5 / std::sqrt(static_cast<double>(w.alloc_count)));
}

TEST_CASE("random workload: bad settings are rejected") {
  gact::bench::random_options o;
  o.min_bytes = 0;
  CHECK_THROWS_AS(gact::bench::random_workload(o), gact::invalid_argument);
  o = {};
  o.min_bytes = 10;
  o.max_bytes = 5;
  CHECK_THROWS_AS(gact::bench::random_workload(o), gact::invalid_argument);
  o = {};
  o.max_live_bytes = o.max_bytes - 1;
  CHECK_THROWS_AS(gact::bench::random_workload(o), gact::invalid_argument);
  o = {};
  o.alloc_probability = 0.0;
  CHECK_THROWS_AS(gact::bench::random_workload(o), gact::invalid_argument);
}

TEST_CASE("quantile: nearest rank") {
  std::vector<double> v{5, 1, 4, 2, 3};
  CHECK(gact::bench::quantile(v, 0.0) == 1);
  CHECK(gact::bench::quantile(v, 0.5) == 3);
  CHECK(gact::bench::quantile(v, 1.0) == 5);
  std::vector<double> big;
  for (int i = 1; i <= 1000; ++i) big.push_back(1001 - i);
  CHECK(gact::bench::quantile(big, 0.99) == doctest::Approx(990).epsilon(0.002));
  std::vector<double> empty;
  CHECK(gact::bench::quantile(empty, 0.5) == 0);
}
