// gact/tools/bench/alloc_workload.hpp
//
// The workloads of gact-bench-alloc, independent of any allocator: a workload is
// a precomputed list of operations on numbered slots ("allocate N bytes into
// slot s", "free slot s"), so that replaying it costs one indexed load per
// operation and no random numbers, hashing or parsing happen inside the timed
// loop; every allocator under test runs the identical list.
//
// Two sources:
//   random_workload  RMM's random_allocations: each step allocates with
//                    probability p (uniform size in [min, max]) or frees a
//                    uniformly chosen live block; a live-bytes cap turns an
//                    allocation that would exceed it into a free.
//   parse_trace      a recorded allocation trace (tools/bench/README.md):
//                    '#' comment lines, "a <id> <bytes>" and "f <id>"; ids
//                    are mapped to dense slots, reused after a free.
//
// Invariants of a workload: an alloc op names a slot that is empty at that
// point, a free op a slot that is full; slots < slot_count; peak_live_bytes is
// the maximum over the op sequence of the sum of live requested bytes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <istream>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator/error.hpp"

namespace gact::bench {

/// One operation of a workload.
struct op {
  std::uint64_t bytes;  ///< requested bytes of an allocation; 0 for a free
  std::uint32_t slot;   ///< the slot allocated into or freed
  bool is_alloc;
};

/// A replayable sequence of operations (see the invariants in the file comment).
struct workload {
  std::string name;
  std::vector<op> ops;
  std::size_t slot_count = 0;        ///< slots needed to replay
  std::size_t alloc_count = 0;       ///< number of alloc ops
  std::size_t peak_live_bytes = 0;   ///< max over time of the live requested bytes
  std::size_t peak_live_blocks = 0;  ///< max over time of the live blocks
  std::size_t live_at_end = 0;       ///< blocks never freed by the ops (freed after a replay, untimed)
};

/// Settings of the random workload (RMM's random_allocations with a live-bytes cap).
struct random_options {
  std::size_t ops = 200000;
  std::size_t min_bytes = 1;
  std::size_t max_bytes = std::size_t{4} << 20;
  double alloc_probability = 0.73;
  std::size_t max_live_bytes = std::size_t{512} << 20;
  std::uint64_t seed = 42;
};

namespace detail {

/// Tracks slot occupancy while a workload is built, and its live-bytes figures.
class builder {
 public:
  explicit builder(workload& w) : w_(w) {}

  std::uint32_t alloc(std::uint64_t bytes) {
    std::uint32_t s;
    if (!free_slots_.empty()) {
      s = free_slots_.back();
      free_slots_.pop_back();
    } else {
      s = static_cast<std::uint32_t>(sizes_.size());
      sizes_.push_back(0);
    }
    sizes_[s] = bytes;
    live_bytes_ += bytes;
    ++live_blocks_;
    w_.ops.push_back(op{bytes, s, true});
    ++w_.alloc_count;
    w_.peak_live_bytes = std::max(w_.peak_live_bytes, live_bytes_);
    w_.peak_live_blocks = std::max(w_.peak_live_blocks, live_blocks_);
    return s;
  }

  void free(std::uint32_t s) {
    live_bytes_ -= sizes_[s];
    --live_blocks_;
    free_slots_.push_back(s);
    w_.ops.push_back(op{0, s, false});
  }

  std::size_t live_bytes() const noexcept { return live_bytes_; }

  void finish() {
    w_.slot_count = sizes_.size();
    w_.live_at_end = live_blocks_;
  }

 private:
  workload& w_;
  std::vector<std::uint64_t> sizes_;
  std::vector<std::uint32_t> free_slots_;
  std::size_t live_bytes_ = 0;
  std::size_t live_blocks_ = 0;
};

}  // namespace detail

/// Build RMM's random allocation workload.
/// @throws gact::invalid_argument for min_bytes == 0, min_bytes > max_bytes, max_bytes >
///         max_live_bytes, or a probability outside (0, 1].
inline workload random_workload(random_options const& o) {
  GACT_EXPECTS(o.min_bytes > 0, "random workload: min_bytes must be > 0");
  GACT_EXPECTS(o.min_bytes <= o.max_bytes, "random workload: min_bytes must be <= max_bytes");
  GACT_EXPECTS(o.max_bytes <= o.max_live_bytes, "random workload: max_bytes must be <= max_live_bytes");
  GACT_EXPECTS(o.alloc_probability > 0.0 && o.alloc_probability <= 1.0,
               "random workload: alloc probability must be in (0, 1]");
  workload w;
  w.name = "random";
  w.ops.reserve(o.ops);
  detail::builder b(w);
  std::mt19937_64 rng(o.seed);
  std::uniform_int_distribution<std::size_t> size_dist(o.min_bytes, o.max_bytes);
  std::bernoulli_distribution coin(o.alloc_probability);
  std::vector<std::uint32_t> live;  // live slots, in any order
  while (w.ops.size() < o.ops) {
    std::size_t const bytes = size_dist(rng);
    bool const want_alloc = live.empty() || coin(rng);
    if (want_alloc && b.live_bytes() + bytes <= o.max_live_bytes) {
      live.push_back(b.alloc(bytes));
    } else {
      std::uniform_int_distribution<std::size_t> pick(0, live.size() - 1);
      std::size_t const i = pick(rng);
      b.free(live[i]);
      live[i] = live.back();
      live.pop_back();
    }
  }
  b.finish();
  return w;
}

/// Parse an allocation trace (format in the file comment).
/// @throws gact::invalid_argument naming the line for a malformed line, an id allocated
///         twice while live, a free of an id that is not live, a size of 0, or an empty trace.
inline workload parse_trace(std::istream& in, std::string name) {
  workload w;
  w.name = std::move(name);
  detail::builder b(w);
  std::unordered_map<std::uint64_t, std::uint32_t> slot_of;  // live id -> slot
  std::string line;
  std::size_t lineno = 0;
  auto fail = [&](char const* what) {
    GACT_FAIL("trace " + w.name + " line " + std::to_string(lineno) + ": " + what + " in '" +
                  line.substr(0, 80) + "'",
              gact::invalid_argument);
  };
  // Parse one unsigned decimal field starting at `pos`; advances pos past it.
  auto number = [&](std::size_t& pos, std::uint64_t& out) {
    if (pos >= line.size() || line[pos] != ' ') return false;
    ++pos;
    std::size_t const start = pos;
    std::uint64_t v = 0;
    while (pos < line.size() && line[pos] >= '0' && line[pos] <= '9') {
      std::uint64_t const d = static_cast<std::uint64_t>(line[pos] - '0');
      if (v > (UINT64_MAX - d) / 10) return false;
      v = v * 10 + d;
      ++pos;
    }
    out = v;
    return pos > start;
  };
  while (std::getline(in, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    std::size_t pos = 1;
    std::uint64_t id = 0;
    if (line[0] == 'a') {
      std::uint64_t bytes = 0;
      if (!number(pos, id) || !number(pos, bytes) || pos != line.size()) fail("expected 'a <id> <bytes>'");
      if (bytes == 0) fail("allocation of 0 bytes");
      if (slot_of.count(id) != 0) fail("id allocated again while live");
      slot_of.emplace(id, b.alloc(bytes));
    } else if (line[0] == 'f') {
      if (!number(pos, id) || pos != line.size()) fail("expected 'f <id>'");
      auto it = slot_of.find(id);
      if (it == slot_of.end()) fail("free of an id that is not live");
      b.free(it->second);
      slot_of.erase(it);
    } else {
      fail("unknown event (expected 'a', 'f' or '#')");
    }
  }
  if (in.bad()) GACT_FAIL("trace " + w.name + ": read error after line " + std::to_string(lineno));
  GACT_EXPECTS(w.alloc_count > 0, "trace " + w.name + " has no allocations");
  b.finish();
  return w;
}

/// The q-quantile (0 <= q <= 1) of `v` by nearest rank; sorts v. 0 for an empty vector.
inline double quantile(std::vector<double>& v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  double const pos = q * static_cast<double>(v.size() - 1);
  return v[static_cast<std::size_t>(pos + 0.5)];
}

}  // namespace gact::bench
