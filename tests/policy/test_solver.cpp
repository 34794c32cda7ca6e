// gact/tests/policy/test_solver.cpp
//
// The bit-allocation solvers: the storage model, greedy against the exact
// dynamic program (itself checked against brute force) on random small
// instances, the budget never exceeded (including instances where GACT's greedy,
// which ignores metadata, overshoots), the optimality certificate, monotonicity
// in C, infeasible budgets, determinism and input validation.
#include "policy/solver.hpp"

#include "codecs/format.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>

namespace {
constexpr double k_nan = std::numeric_limits<double>::quiet_NaN();  // (NAN is a float)
constexpr double k_inf = std::numeric_limits<double>::infinity();
}  // namespace

using namespace gact::policy;

namespace {

/// `rich`: items also get a narrowest width (min_bits 1, 2 or 8) and, half of them, variances of
/// their own width by width (decreasing with some noise, as a probe measures them, sometimes not
/// monotone at all).
std::vector<solver_item> random_instance(std::mt19937_64& rng, std::size_t n, bool rich = false) {
  std::uniform_int_distribution<int> kind(0, 3);
  std::uniform_real_distribution<double> logc(-3.0, 3.0);
  std::vector<solver_item> items;
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t numel = 0;
    switch (kind(rng)) {
      case 0: numel = std::uniform_int_distribution<std::uint64_t>(1, 300)(rng); break;    // tiny, 1-2 groups
      case 1: numel = 256 * std::uniform_int_distribution<std::uint64_t>(1, 16)(rng); break;
      case 2: numel = std::uniform_int_distribution<std::uint64_t>(257, 20000)(rng); break;
      default: numel = std::uniform_int_distribution<std::uint64_t>(20000, 200000)(rng); break;
    }
    double const c = std::pow(10.0, logc(rng));
    int const full = std::uniform_int_distribution<int>(0, 4)(rng) == 0 ? 16 : 32;
    items.push_back({"t" + std::to_string(i), numel, c, full});
    if (rich) {
      int const mb[] = {1, 1, 2, 8};
      items.back().min_bits = mb[std::uniform_int_distribution<int>(0, 3)(rng)];
      if (std::uniform_int_distribution<int>(0, 1)(rng) == 1) {
        std::array<double, 4> v{};
        std::uniform_real_distribution<double> wobble(0.3, 3.0);
        int const widths[] = {1, 2, 4, 8};
        for (std::size_t k = 0; k < 4; ++k) v[k] = c * variance_factor(widths[k]) * wobble(rng);
        items.back().variance = v;
      }
    }
  }
  return items;
}

std::uint64_t total_numel(std::vector<solver_item> const& items) {
  std::uint64_t t = 0;
  for (auto const& it : items) t += it.numel;
  return t;
}

/// Every assignment, for cross-checking the dynamic program.
double brute_force(std::vector<solver_item> const& items, std::uint64_t budget, solver_options const& o,
                   bool& feasible) {
  std::vector<std::vector<int>> choices;
  for (auto const& it : items) {
    std::vector<int> c = o.code_bits;
    if (o.allow_full_precision) c.push_back(it.full_bits);
    choices.push_back(c);
  }
  std::vector<std::size_t> idx(items.size(), 0);
  double best = k_inf;
  feasible = false;
  for (;;) {
    std::vector<int> bits;
    for (std::size_t i = 0; i < items.size(); ++i) bits.push_back(choices[i][idx[i]]);
    if (stored_bytes_of(items, bits, o.storage) <= budget) {
      feasible = true;
      best = std::min(best, objective_of(items, bits));
    }
    std::size_t k = 0;
    while (k < idx.size() && ++idx[k] == choices[k].size()) idx[k++] = 0;
    if (k == idx.size()) break;
  }
  return best;
}

/// GACT's calc_precision, for the comparison: weights = numel, bits·numel accounting (no
/// metadata), priority Δobj/(numel·Δb), stop as soon as Σ b·numel ≤ target.
std::vector<int> gact_greedy(std::vector<solver_item> const& items, double avg_bits) {
  std::map<int, int> next{{32, 8}, {16, 8}, {8, 4}, {4, 2}, {2, 1}};
  std::vector<int> bits;
  double total = 0.0, target = 0.0;
  for (auto const& it : items) {
    bits.push_back(it.full_bits);
    total += it.full_bits * static_cast<double>(it.numel);
    target += avg_bits * static_cast<double>(it.numel);
  }
  while (total > target) {
    std::size_t best = items.size();
    double best_p = k_inf;
    for (std::size_t i = 0; i < items.size(); ++i) {
      if (bits[i] == 1) continue;
      int const nb = next[bits[i]];
      double const p = items[i].sensitivity * (variance_factor(nb) - variance_factor(bits[i])) /
                       (static_cast<double>(items[i].numel) * (bits[i] - nb));
      if (p < best_p) {
        best_p = p;
        best = i;
      }
    }
    if (best == items.size()) break;
    int const nb = next[bits[best]];
    total -= static_cast<double>(items[best].numel) * (bits[best] - nb);
    bits[best] = nb;
  }
  return bits;
}

}  // namespace

TEST_CASE("storage model counts header, metadata and padding") {
  storage_model m;  // gact's blob format, 4-D: 96 B header, (min,max) per 256 padded to 16 B, 8-element chunks
  CHECK(m.groups(1) == 1);
  CHECK(m.groups(256) == 1);
  CHECK(m.groups(257) == 2);
  CHECK(m.compressed_bytes(256, 2) == 96 + 16 + 64);
  CHECK(m.compressed_bytes(300, 2) == 96 + 2 * 8 + 38 * 2);
  CHECK(m.compressed_bytes(300, 2, 16) == 96 + 16 + 38 * 2);  // fp16 metadata is half the size (8 → 16 padded)
  CHECK(m.compressed_bytes(2560, 2, 16) == 96 + 48 + 640);     // 10 groups · 4 B = 40 → 48
  CHECK(m.compressed_bytes(256, 8) == 96 + 16 + 256);
  CHECK(m.full_bytes(300, 32) == 96 + 1200);
  CHECK(m.full_bytes(300, 16) == 96 + 600);
  CHECK(m.stored_bytes(300, 32, 32) == m.full_bytes(300, 32));
  CHECK_THROWS_AS((void)m.stored_bytes(300, 16, 32), gact::invalid_argument);
  // GACT's own accounting: codes padded to the group, fp32 metadata, no header.
  storage_model g;
  g.code_chunk = 256;
  g.header_bytes = g.passthrough_header_bytes = 0;
  g.meta_scales_with_dtype = false;
  g.meta_align = 1;
  CHECK(g.compressed_bytes(300, 2) == 2 * 8 + 2 * 256 * 2 / 8);
  g.blob_align = 16;
  CHECK(g.compressed_bytes(300, 1) == 80);  // 2·8 + 2·256/8 = 80, already aligned
  CHECK(g.compressed_bytes(10, 1) == 48);   // 8 + 32 = 40 → 48
  CHECK_THROWS_AS((void)m.compressed_bytes(10, 3), gact::invalid_argument);
  CHECK_THROWS_AS((void)m.full_bytes(10, 8), gact::invalid_argument);
  CHECK(storage_model::for_codec(2).header_bytes == 80);
  CHECK(storage_model::for_codec(0).header_bytes == 64);
  CHECK_THROWS_AS((void)storage_model::for_codec(9), gact::invalid_argument);
  storage_model bad;
  bad.code_chunk = 12;
  CHECK_THROWS_AS(bad.validate(), gact::invalid_argument);
}

TEST_CASE("storage model equals the codecs' blob layout") {
  namespace cf = gact::codec;
  std::mt19937_64 rng(3);
  int checked = 0;
  for (int ndim = 0; ndim <= 8; ++ndim) {
    for (int gs : {64, 128, 256, 512, 1024}) {
      storage_model const m = storage_model::for_codec(ndim, static_cast<std::uint32_t>(gs));
      for (int rep = 0; rep < 20; ++rep) {
        std::uint64_t const numel = std::uniform_int_distribution<std::uint64_t>(1, 1u << 20)(rng);
        for (auto [dt, full] : {std::pair{cf::dtype::float32, 32}, std::pair{cf::dtype::float16, 16},
                                std::pair{cf::dtype::bfloat16, 16}}) {
          for (int b : {1, 2, 4, 8}) {
            auto const l = cf::hd::compute_layout(static_cast<std::uint8_t>(cf::codec_id::quant), 0,
                                                  static_cast<std::uint8_t>(dt), ndim, numel, b, gs, 0);
            CHECK(m.compressed_bytes(numel, b, full) == l.total);
            ++checked;
          }
          auto const raw = cf::hd::compute_layout(static_cast<std::uint8_t>(cf::codec_id::raw), 0,
                                                  static_cast<std::uint8_t>(dt), ndim, numel, 0, 0, 0);
          CHECK(m.full_bytes(numel, full) == raw.total);
        }
      }
    }
  }
  CHECK(checked == 9 * 5 * 20 * 3 * 4);
}

TEST_CASE("variance factor and budget") {
  CHECK(variance_factor(1) == 1.0);
  CHECK(variance_factor(2) == doctest::Approx(1.0 / 9.0));
  CHECK(variance_factor(8) == doctest::Approx(1.0 / 65025.0));
  CHECK(variance_factor(32) == 0.0);
  CHECK(variance_factor(16) == 0.0);
  CHECK_THROWS_AS((void)variance_factor(3), gact::invalid_argument);
  CHECK(budget_bytes_for(2.0, 1000) == 250);
  CHECK(budget_bytes_for(2.25, 1001) == 281);  // floor(281.53)
  CHECK_THROWS_AS((void)budget_bytes_for(0.0, 10), gact::invalid_argument);
  CHECK_THROWS_AS((void)budget_bytes_for(k_nan, 10), gact::invalid_argument);
}

TEST_CASE("exact solver agrees with brute force") {
  std::mt19937_64 rng(20260101);
  solver_options o;
  for (int trial = 0; trial < 300; ++trial) {
    std::size_t const n = std::uniform_int_distribution<std::size_t>(1, 5)(rng);
    auto items = random_instance(rng, n);
    double const avg = std::uniform_real_distribution<double>(0.8, 12.0)(rng);
    std::uint64_t const budget = budget_bytes_for(avg, total_numel(items));
    bool feasible = false;
    double const bf = brute_force(items, budget, o, feasible);
    solution const ex = solve_exact(items, budget, o);
    CAPTURE(trial);
    REQUIRE((ex.status == solve_status::ok) == feasible);
    if (feasible) {
      CHECK(ex.stored_bytes <= budget);
      CHECK(ex.objective == doctest::Approx(bf).epsilon(1e-12));
    }
  }
}

TEST_CASE("greedy versus exact on random small instances: budget, certificate, gap") {
  std::mt19937_64 rng(42);
  double max_rel_gap = 0.0, sum_rel_gap = 0.0, plain_sum = 0.0;
  int plain_optimal = 0;
  std::string worst;
  int ok = 0, optimal = 0, infeasible = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::size_t const n = std::uniform_int_distribution<std::size_t>(1, 9)(rng);
    auto items = random_instance(rng, n);
    solver_options o;
    o.storage.meta_bytes_per_group = (trial % 2) ? 8 : 4;
    o.allow_full_precision = (trial % 5) != 0;
    double const avg = std::uniform_real_distribution<double>(0.8, 12.0)(rng);
    std::uint64_t const budget = budget_bytes_for(avg, total_numel(items));
    solution const g = solve_greedy(items, budget, o);
    solution const e = solve_exact(items, budget, o);
    solver_options plain_opts = o;
    plain_opts.improve = false;
    solution const plain = solve_greedy(items, budget, plain_opts);
    CAPTURE(trial);
    REQUIRE(g.status == e.status);
    REQUIRE(plain.status == e.status);
    if (plain.status == solve_status::ok) {
      CHECK(plain.stored_bytes <= budget);
      double const prel = (plain.objective - e.objective) / std::max(e.objective, 1e-300);
      plain_sum += prel;
      if (prel <= 1e-9) ++plain_optimal;
    }
    REQUIRE(g.bits.size() == n);
    CHECK(g.stored_bytes == stored_bytes_of(items, g.bits, o.storage));
    CHECK(g.objective == doctest::Approx(objective_of(items, g.bits)).epsilon(1e-12));
    if (g.status == solve_status::infeasible) {
      ++infeasible;
      CHECK(g.stored_bytes > budget);
      continue;
    }
    ++ok;
    CHECK(g.stored_bytes <= budget);
    double const tol = 1e-9 * (1.0 + e.objective);
    CHECK(g.objective >= e.objective - tol);           // the DP is optimal
    CHECK(g.lower_bound <= e.objective + tol);         // the certificate is a true lower bound
    double const rel = (g.objective - e.objective) / std::max(e.objective, 1e-300);
    if (g.objective - e.objective <= tol) ++optimal;
    if (rel > max_rel_gap) {
      worst.clear();
      for (std::size_t i = 0; i < n; ++i) {
        worst += items[i].key + "(numel " + std::to_string(items[i].numel) + ", C " + std::to_string(items[i].sensitivity) +
                 ") greedy " + std::to_string(g.bits[i]) + " exact " + std::to_string(e.bits[i]) + "; ";
      }
    }
    max_rel_gap = std::max(max_rel_gap, rel);
    sum_rel_gap += rel;
  }
  MESSAGE("greedy vs exact over " << ok << " feasible instances (" << infeasible << " infeasible): "
          << optimal << " optimal, mean relative gap " << sum_rel_gap / ok << ", max " << max_rel_gap
          << "; plain hull greedy without local search: " << plain_optimal << " optimal, mean relative gap "
          << plain_sum / ok << "; worst: " << worst);
  CHECK(ok > 2000);
  CHECK(infeasible > 0);
}

TEST_CASE("budget never exceeded where GACT's metadata-blind greedy overshoots") {
  // 40 equal tensors, budget 2 bits/element. GACT counts b·numel and lands exactly on 2 bits
  // everywhere; the blobs also carry 8 B per 256 elements, 2.25 bits in all: over budget.
  std::vector<solver_item> items;
  for (int i = 0; i < 40; ++i) items.push_back({"layer" + std::to_string(i), 256 * 64, 1.0 + i * 0.01, 32});
  solver_options o;
  std::uint64_t const budget = budget_bytes_for(2.0, total_numel(items));
  auto const gact_bits = gact_greedy(items, 2.0);
  std::uint64_t const gact_bytes = stored_bytes_of(items, gact_bits, o.storage);
  CHECK(gact_bytes > budget);
  solution const g = solve_greedy(items, budget, o);
  REQUIRE(g.status == solve_status::ok);
  CHECK(g.stored_bytes <= budget);
  CHECK(std::count(g.bits.begin(), g.bits.end(), 1) > 0);  // some tensors pay for the metadata

  // Random instances: ours always fits; count how often GACT's would not.
  std::mt19937_64 rng(7);
  int gact_over = 0;
  for (int trial = 0; trial < 500; ++trial) {
    auto inst = random_instance(rng, std::uniform_int_distribution<std::size_t>(2, 30)(rng));
    double const avg = std::uniform_real_distribution<double>(1.5, 9.0)(rng);
    std::uint64_t const b = budget_bytes_for(avg, total_numel(inst));
    solution const s = solve_greedy(inst, b, o);
    if (s.status == solve_status::ok) CHECK(s.stored_bytes <= b);
    if (stored_bytes_of(inst, gact_greedy(inst, avg), o.storage) > b) ++gact_over;
  }
  MESSAGE("GACT's greedy exceeds the byte budget on " << gact_over << " of 500 random instances");
  CHECK(gact_over > 0);
}

TEST_CASE("refill spends the slack the last step leaves") {
  // The small, insensitive tensor steps 32→8 first (least variance per byte), but that is not
  // enough; the big tensor's 32→8 step then frees far more than needed, and the refill puts
  // the small tensor back at full precision.
  std::vector<solver_item> items{{"big", 1 << 20, 1000.0, 32}, {"small", 4096, 1.0, 32}};
  solver_options o;
  std::uint64_t const budget = budget_bytes_for(20.0, total_numel(items));
  solution const g = solve_greedy(items, budget, o);
  solution const e = solve_exact(items, budget, o);
  REQUIRE(g.status == solve_status::ok);
  CHECK(g.bits[0] == 8);
  CHECK(g.bits[1] == 32);
  CHECK(g.greedy_steps == 2);
  CHECK(g.refill_steps == 1);
  CHECK(g.objective == doctest::Approx(e.objective));
  CHECK(g.stored_bytes <= budget);
}

TEST_CASE("bits are monotone in C among tensors of equal size") {
  std::mt19937_64 rng(99);
  for (int trial = 0; trial < 200; ++trial) {
    std::size_t const n = 25;
    std::uint64_t const numel = 256 * std::uniform_int_distribution<std::uint64_t>(8, 40)(rng);
    std::vector<solver_item> items;
    std::uniform_real_distribution<double> logc(-4.0, 4.0);
    for (std::size_t i = 0; i < n; ++i) items.push_back({"k" + std::to_string(i), numel, std::pow(10.0, logc(rng)), 32});
    double const avg = std::uniform_real_distribution<double>(2.0, 10.0)(rng);  // 1 bit needs <= 1.625
    solver_options o;
    solution const s = solve_greedy(items, budget_bytes_for(avg, numel * n), o);
    REQUIRE(s.status == solve_status::ok);
    auto width = [](int b) { return b; };  // 1 < 2 < 4 < 8 < 32: bigger is more precise
    for (std::size_t a = 0; a < n; ++a) {
      for (std::size_t b = 0; b < n; ++b) {
        if (items[a].sensitivity > items[b].sensitivity) {
          CAPTURE(trial);
          CHECK(width(s.bits[a]) >= width(s.bits[b]));
        }
      }
    }
  }
}

TEST_CASE("infeasible budget is flagged and the smallest widths are returned") {
  std::vector<solver_item> items{{"a", 1000, 1.0, 32}, {"b", 5000, 2.0, 32}};
  solver_options o;
  // 1 bit everywhere: 96 + 4·8 + 125 = 253 and 96 + 20·8 + 625 = 881.
  std::uint64_t const min_bytes = 253 + 881;
  CHECK(min_bytes == o.storage.compressed_bytes(1000, 1) + o.storage.compressed_bytes(5000, 1));
  solution const s = solve_greedy(items, min_bytes - 1, o);
  CHECK(s.status == solve_status::infeasible);
  CHECK(s.bits == std::vector<int>{1, 1});
  CHECK(s.stored_bytes == min_bytes);
  solution const e = solve_exact(items, min_bytes - 1, o);
  CHECK(e.status == solve_status::infeasible);
  solution const fit = solve_greedy(items, min_bytes, o);
  CHECK(fit.status == solve_status::ok);
  CHECK(fit.bits == std::vector<int>{1, 1});
  // Everything fits at full precision: variance 0.
  solution const all = solve_greedy(items, 1'000'000, o);
  CHECK(all.bits == std::vector<int>{32, 32});
  CHECK(all.objective == 0.0);
  // No items: trivially ok.
  CHECK(solve_greedy({}, 0, o).status == solve_status::ok);
}

TEST_CASE("zero sensitivity goes to the cheapest option; tiny tensors may stay full") {
  solver_options o;
  // 16 elements: full precision is 96 + 64 B, a 1-bit blob 96 + 16 + 2 B.
  std::vector<solver_item> items{{"zero", 4096, 0.0, 32}, {"tiny", 16, 5.0, 32}, {"big", 4096, 1.0, 32}};
  solution const s = solve_greedy(items, budget_bytes_for(3.0, 4096 * 2 + 16), o);
  REQUIRE(s.status == solve_status::ok);
  CHECK(s.bits[0] == 1);
  o.storage.meta_bytes_per_group = 64;  // now every blob of "tiny" is larger than its raw bytes
  solution const t = solve_greedy(items, 1'000'000, o);
  CHECK(t.bits[1] == 32);
  solution const u = solve_greedy(items, budget_bytes_for(2.5, 4096 * 2 + 16), o);
  if (u.status == solve_status::ok) CHECK(u.bits[1] == 32);  // full is both cheapest and exact
}

TEST_CASE("deterministic: same answer for any input order and on repetition") {
  std::mt19937_64 rng(5);
  auto items = random_instance(rng, 60);
  // Force exact ties: several equal tensors with equal C.
  for (int i = 0; i < 10; ++i) items.push_back({"tie" + std::to_string(i), 8192, 3.0, 32});
  solver_options o;
  std::uint64_t const budget = budget_bytes_for(2.0, total_numel(items));
  solution const a = solve_greedy(items, budget, o);
  solution const b = solve_greedy(items, budget, o);
  CHECK(a.bits == b.bits);
  std::map<std::string, int> by_key;
  for (std::size_t i = 0; i < items.size(); ++i) by_key[items[i].key] = a.bits[i];
  for (int rep = 0; rep < 5; ++rep) {
    auto shuffled = items;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    solution const c = solve_greedy(shuffled, budget, o);
    CHECK(c.objective == doctest::Approx(a.objective).epsilon(1e-12));
    CHECK(c.stored_bytes == a.stored_bytes);
    for (std::size_t i = 0; i < shuffled.size(); ++i) CHECK(c.bits[i] == by_key[shuffled[i].key]);
  }
}

TEST_CASE("narrowest widths and variances width by width: exact = brute force, greedy within its certificate") {
  std::mt19937_64 rng(20261203);
  int ok = 0, optimal = 0;
  for (int trial = 0; trial < 1500; ++trial) {
    std::size_t const n = std::uniform_int_distribution<std::size_t>(1, trial < 300 ? 5 : 9)(rng);
    auto const items = random_instance(rng, n, true);
    solver_options o;
    o.allow_full_precision = (trial % 4) != 0;
    double const avg = std::uniform_real_distribution<double>(0.8, 12.0)(rng);
    std::uint64_t const budget = budget_bytes_for(avg, total_numel(items));
    solution const e = solve_exact(items, budget, o);
    solution const g = solve_greedy(items, budget, o);
    CAPTURE(trial);
    if (trial < 300) {
      bool feasible = false;
      double const bf = brute_force(items, budget, o, feasible);
      REQUIRE((e.status == solve_status::ok) == feasible);
      if (feasible) CHECK(e.objective == doctest::Approx(bf).epsilon(1e-12));
    }
    REQUIRE(g.status == e.status);
    for (std::size_t i = 0; i < n; ++i) {
      // never a width below the item's narrowest: its bytes would not be what the store pays
      if (is_code_bits(g.bits[i])) CHECK(g.bits[i] >= items[i].min_bits);
      if (is_code_bits(e.bits[i])) CHECK(e.bits[i] >= items[i].min_bits);
    }
    CHECK(g.stored_bytes == stored_bytes_of(items, g.bits, o.storage));
    CHECK(g.objective == doctest::Approx(objective_of(items, g.bits)).epsilon(1e-12));
    if (g.status != solve_status::ok) continue;
    ++ok;
    CHECK(g.stored_bytes <= budget);
    double const tol = 1e-9 * (1.0 + e.objective);
    CHECK(g.objective >= e.objective - tol);
    CHECK(g.lower_bound <= e.objective + tol);
    if (g.objective - e.objective <= tol) ++optimal;
  }
  MESSAGE("with narrowest widths and width-by-width variances: " << optimal << " of " << ok
                                                                 << " feasible instances solved optimally by the greedy");
  CHECK(ok > 900);
  CHECK(optimal >= ok * 9 / 10);
}

TEST_CASE("a width below the narrowest is charged and valued at the narrowest") {
  solver_options o;
  o.allow_full_precision = false;
  storage_model const m;
  std::uint64_t const n = 256 * 40;
  solver_item a{"boundary", n, 9.0, 32, 2, std::nullopt};
  solver_item b{"plain", n, 1.0, 32};
  // uniform 2 bits for both: the boundary blob cannot go to 1 bit to free bytes, so nothing can rise
  solution const s = solve_greedy({a, b}, 2 * m.compressed_bytes(n, 2), o);
  REQUIRE(s.status == solve_status::ok);
  CHECK(s.bits == std::vector<int>{2, 2});
  CHECK(stored_bytes_of({a}, {1}, m) == m.compressed_bytes(n, 2));
  CHECK(objective_of({a}, {1}) == doctest::Approx(objective_of({a}, {2})));
  // with variances width by width the solver reads them, not C·v(b)
  solver_item c{"measured", n, 1.0, 32, 1, std::array<double, 4>{5.0, 4.0, 0.1, 0.0}};
  CHECK(item_variance(c, 2) == 4.0);
  CHECK(item_variance(c, 32) == 0.0);
  // 2 -> 1 costs c almost nothing (5 - 4) while 2 -> 4 saves 3.9: c goes to 4 bits, paid by plain at 1
  solution const t = solve_greedy({b, c}, 2 * m.compressed_bytes(n, 2) + m.compressed_bytes(n, 1), o);
  CHECK(t.bits == std::vector<int>{1, 4});
  // only widths below the narrowest allowed, no full precision: the widest is asked for, the narrowest paid
  solver_options narrow = o;
  narrow.code_bits = {1, 2};
  solver_item small_block{"small_block", n, 1.0, 32, 8, std::nullopt};
  solution const u = solve_greedy({small_block}, m.compressed_bytes(n, 8), narrow);
  REQUIRE(u.status == solve_status::ok);
  CHECK(u.bits == std::vector<int>{2});
  CHECK(u.stored_bytes == m.compressed_bytes(n, 8));
  CHECK(solve_greedy({small_block}, m.compressed_bytes(n, 8) - 1, narrow).status == solve_status::infeasible);
  CHECK(solve_exact({small_block}, m.compressed_bytes(n, 8), narrow).stored_bytes == m.compressed_bytes(n, 8));
}

TEST_CASE("bad input is rejected with a clear error") {
  solver_options o;
  solver_item bad_min{"a", 10, 1.0, 32, 3, std::nullopt};
  CHECK_THROWS_AS(solve_greedy({bad_min}, 100, o), gact::invalid_argument);
  solver_item bad_var{"a", 10, 1.0, 32, 1, std::array<double, 4>{1.0, -1.0, 0.0, 0.0}};
  CHECK_THROWS_AS(solve_greedy({bad_var}, 100, o), gact::invalid_argument);
  bad_var.variance = std::array<double, 4>{1.0, k_nan, 0.0, 0.0};
  CHECK_THROWS_AS(solve_exact({bad_var}, 100, o), gact::invalid_argument);
  CHECK_THROWS_AS(solve_greedy({{"a", 0, 1.0, 32}}, 100, o), gact::invalid_argument);
  CHECK_THROWS_AS(solve_greedy({{"a", 10, -1.0, 32}}, 100, o), gact::invalid_argument);
  CHECK_THROWS_AS(solve_greedy({{"a", 10, k_nan, 32}}, 100, o), gact::invalid_argument);
  CHECK_THROWS_AS(solve_greedy({{"a", 10, k_inf, 32}}, 100, o), gact::invalid_argument);
  CHECK_THROWS_AS(solve_greedy({{"a", 10, 1.0, 8}}, 100, o), gact::invalid_argument);
  CHECK_THROWS_AS(solve_greedy({{"a", 10, 1.0, 32}, {"a", 20, 1.0, 32}}, 100, o), gact::invalid_argument);
  solver_options bad = o;
  bad.code_bits = {3};
  CHECK_THROWS_AS(solve_greedy({{"a", 10, 1.0, 32}}, 100, bad), gact::invalid_argument);
  bad.code_bits = {2, 2};
  CHECK_THROWS_AS(solve_greedy({{"a", 10, 1.0, 32}}, 100, bad), gact::invalid_argument);
  bad.code_bits = {};
  bad.allow_full_precision = false;
  CHECK_THROWS_AS(solve_greedy({{"a", 10, 1.0, 32}}, 100, bad), gact::invalid_argument);
  try {
    (void)solve_greedy({{"conv1#0", 10, -2.0, 32}}, 100, o);
    FAIL("expected a throw");
  } catch (gact::invalid_argument const& e) {
    CHECK(std::string(e.what()).find("conv1#0") != std::string::npos);
  }
  std::vector<solver_item> many;
  for (int i = 0; i < 40; ++i) many.push_back({"m" + std::to_string(i), 1000u + static_cast<unsigned>(i) * 37u, 1.0 + i, 32});
  CHECK_THROWS_AS(solve_exact(many, budget_bytes_for(4.0, total_numel(many)), o, 10), gact::invalid_argument);
}

TEST_CASE("greedy versus exact on network-like instances (20-32 tensors)") {
  // Saved-tensor sizes like a small CNN's (a few shapes repeated, powers of two times 256)
  // with C spread over four decades, at the budgets the policy is used with.
  std::mt19937_64 rng(2024);
  double max_rel_gap = 0.0, sum_rel_gap = 0.0;
  int runs = 0, optimal = 0;
  for (int trial = 0; trial < 15; ++trial) {
    std::size_t const n = std::uniform_int_distribution<std::size_t>(20, 32)(rng);
    std::vector<solver_item> items;
    for (std::size_t i = 0; i < n; ++i) {
      std::uint64_t const numel = 256ull << std::uniform_int_distribution<int>(4, 12)(rng);
      double const c = std::pow(10.0, std::uniform_real_distribution<double>(-2.0, 2.0)(rng));
      items.push_back({"layer" + std::to_string(i) + "#0", numel, c, 32});
    }
    solver_options o;
    for (double avg : {1.5, 2.0, 3.0, 4.0}) {
      std::uint64_t const budget = budget_bytes_for(avg, total_numel(items));
      solution const g = solve_greedy(items, budget, o);
      solution const e = solve_exact(items, budget, o);
      REQUIRE(g.status == e.status);
      if (g.status != solve_status::ok) continue;
      ++runs;
      CHECK(g.stored_bytes <= budget);
      CHECK(g.objective >= e.objective * (1 - 1e-12));
      CHECK(g.lower_bound <= e.objective * (1 + 1e-12));
      double const rel = (g.objective - e.objective) / e.objective;
      if (rel <= 1e-12) ++optimal;
      max_rel_gap = std::max(max_rel_gap, rel);
      sum_rel_gap += rel;
    }
  }
  MESSAGE("network-like instances: " << runs << " solves, " << optimal << " optimal, mean relative gap "
          << sum_rel_gap / runs << ", max " << max_rel_gap);
  CHECK(runs > 50);
}
